#!/usr/bin/env python3
"""llama.cpp's own programs with --sparse-attn (docs/llama-cpp.md, "llama.cpp's programs").

  server:     the patched llama-server on 127.0.0.1 (a free port), 4 slots, 12 concurrent greedy
              completions of different prompt lengths, some sharing a prefix, sent with the standard
              library. Stock (flash attention on, the reference; off, the noise), Dense through the
              library (matches the reference within the noise rule below), Quest at 256 tokens (every
              request completes; /metrics has the library's counters; a shared prefix is kept through
              the library's fork; slot save and restore), H2O at 256 tokens (a slot save the library
              refuses is an HTTP error while the other slots go on), and --context-shift refused at
              start-up.
  perplexity: llama-perplexity --kl-divergence with --sparse-attn against a base file written by the
              stock program: Dense within llama.cpp's own noise (flash attention off against on), in
              ubatches of 512 rows (the library's prompt attention) and of one row (-ub 1: decode steps);
              Quest at 128 of 512 tokens (-ub 1) farther than Dense, reporting KLD and "Same top p".

The noise rule: the greedy outputs of two attentions part at some token. For each of six requests,
sent one at a time, the share of its tokens before the first difference from the reference is taken;
Dense's mean share must be at least llama.cpp's own (flash attention off against on, over the same
requests) minus 0.1.

Exit 77 (ctest's skip) when the model or the programs are not there.
"""
import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

SKIP = 77
SLOTS = 4
N_PREDICT = 24
CTX = 8192


class Failure(Exception):
    pass


def check(condition, message):
    if not condition:
        raise Failure(message)


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, binary, model, name, extra, workdir, threads):
        self.name = name
        self.port = free_port()
        self.log_path = os.path.join(workdir, f"server-{name}.log")
        self.args = [binary, "-m", model, "--host", "127.0.0.1", "--port", str(self.port), "-c", str(CTX),
                     "-np", str(SLOTS), "-t", str(threads), "--metrics", "--slot-save-path", workdir, "--no-webui",
                     *extra]
        self.proc = None

    def start(self, timeout=180):
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.args, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise Failure(f"{self.name}: llama-server exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                status, _ = self.get("/health")
                if status == 200:
                    return self
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(0.5)
        raise Failure(f"{self.name}: no /health within {timeout} s:\n{self.tail()}")

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc:
            self.log.close()

    def tail(self, lines=30):
        with open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])

    def request(self, method, path, body=None, timeout=600):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def get(self, path):
        return self.request("GET", path)

    def post(self, path, body):
        status, text = self.request("POST", path, body)
        try:
            return status, json.loads(text)
        except json.JSONDecodeError:
            return status, {"raw": text}

    def complete(self, prompt, **extra):
        body = {"prompt": prompt, "n_predict": N_PREDICT, "temperature": 0, "top_k": 1, "seed": 1,
                "cache_prompt": True, "return_tokens": True, **extra}
        return self.post("/completion", body)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def prompts(text):
    """12 prompts of 40 to 900 words; the first five share a 500-word prefix."""
    words = text.split()
    shared = " ".join(words[:500])
    out = [shared + " " + " ".join(words[500 + 37 * i: 520 + 37 * i + 40 * i]) for i in range(5)]
    for i, n in enumerate([40, 120, 260, 380, 640, 760, 900]):
        start = 700 + 61 * i
        out.append(" ".join(words[start:start + n]))
    return out


def run_all(server, texts):
    with ThreadPoolExecutor(max_workers=len(texts)) as pool:
        return list(pool.map(lambda t: server.complete(t), texts))


def run_each(server, texts):
    return [server.complete(t, id_slot=0) for t in texts]


def tokens_of(results, name):
    out = []
    for i, (status, body) in enumerate(results):
        check(status == 200, f"{name}: request {i} got HTTP {status}: {body}")
        check(body.get("tokens_predicted", 0) >= 1, f"{name}: request {i} predicted nothing: {body}")
        out.append(body["tokens"])
    return out


def agreement(reference, other):
    """Mean share of each request's tokens before its first difference from the reference."""
    shares = []
    for a, b in zip(reference, other):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        shares.append(n / max(len(a), 1))
    return sum(shares) / len(shares)


def metric(text, name):
    m = re.search(r"^sparsekv:" + name + r"\{[^}]*\} (\S+)$", text, re.M)
    check(m is not None, f"/metrics has no sparsekv:{name}:\n{text[-2000:]}")
    return float(m.group(1))


def server_tests(a, text, workdir):
    texts = prompts(text)
    threads = a.threads
    # The outputs are compared one request at a time (concurrent batches differ from run to run, and with them
    # the last bits of every server's logits); the 12 concurrent requests must all complete.
    compared = texts[:3] + texts[6:9]
    with Server(a.server, a.model, "stock", ["-fa", "on"], workdir, threads) as s:
        reference = tokens_of(run_each(s, compared), "stock")
        tokens_of(run_all(s, texts), "stock, concurrent")
    with Server(a.server, a.model, "stock-fa-off", ["-fa", "off"], workdir, threads) as s:
        noise = agreement(reference, tokens_of(run_each(s, compared), "stock, flash attention off"))
    with Server(a.server, a.model, "dense", ["--sparse-attn", "dense"], workdir, threads) as s:
        dense = agreement(reference, tokens_of(run_each(s, compared), "dense"))
        tokens_of(run_all(s, texts), "dense, concurrent")
    print(f"greedy agreement with stock: llama.cpp without flash attention {noise:.3f}, Dense {dense:.3f}")
    check(dense >= noise - 0.1, f"Dense agrees on {dense:.3f} of the tokens, llama.cpp with itself {noise:.3f}")

    with Server(a.server, a.model, "quest", ["--sparse-attn", "quest", "--sparse-budget", "256"], workdir,
                threads) as s:
        tokens_of(run_all(s, texts), "quest")
        status, metrics = s.get("/metrics")
        check(status == 200, f"quest: /metrics HTTP {status}")
        rows, pages = metric(metrics, "decode_rows_total"), metric(metrics, "pages_selected_total")
        check(rows > 0 and pages > 0, f"quest: the library decoded {rows} rows, selected {pages} pages")
        print(f"quest /metrics: decode rows {rows:.0f}, pages selected {pages:.0f}, "
              f"bytes attended {metric(metrics, 'bytes_attended_total'):.3g}")
        # A kept prefix: the second request on the slot reuses the first one's prompt (the library's fork).
        first = texts[0]
        status, one = s.complete(first, id_slot=0)
        check(status == 200, f"quest: HTTP {status} {one}")
        status, two = s.complete(first + " " + " ".join(text.split()[2000:2100]), id_slot=0)
        check(status == 200, f"quest: HTTP {status} {two}")
        check(two["tokens_cached"] > 0 and two["timings"]["prompt_n"] < two["tokens_evaluated"],
              f"quest: the shared prefix was not kept: {two['timings']}, {two['tokens_evaluated']} evaluated")
        print(f"quest prompt cache: {two['tokens_evaluated'] - two['timings']['prompt_n']} of "
              f"{two['tokens_evaluated']} prompt tokens kept")
        # Slot save and restore (the library's K/V go with llama.cpp's state), restored into another slot.
        status, saved = s.post("/slots/0?action=save", {"filename": "quest-slot0.bin"})
        check(status == 200 and saved.get("n_saved", 0) > 0, f"quest: slot save HTTP {status}: {saved}")
        status, restored = s.post("/slots/1?action=restore", {"filename": "quest-slot0.bin"})
        check(status == 200 and restored.get("n_restored") == saved["n_saved"],
              f"quest: slot restore HTTP {status}: {restored}")
        # The restored K/V serve the same prompt: only its last token is evaluated again. (That the bytes load
        # back exactly, and decode bit for bit, is the C++ test's [state] case.)
        status, after = s.complete(first + " " + " ".join(text.split()[2000:2100]), id_slot=1)
        check(status == 200 and after["timings"]["prompt_n"] <= 1 and after["tokens_predicted"] >= 1,
              f"quest: the restored slot did not serve the prompt from its cache: HTTP {status} {after}")
        print(f"quest slot save/restore: {saved['n_saved']} tokens saved and restored into another slot, "
              f"{after['tokens_evaluated'] - after['timings']['prompt_n']} of them reused")
        # A chat's next turn keeps the conversation so far, its answer included (in place, the library forks
        # the answer's decode pages, the unsaved one too).
        words = text.split()
        chat = [{"role": "user", "content": " ".join(words[3000:3400]) + "\nWhat is this text about?"}]
        status, turn = s.post("/v1/chat/completions", {"messages": chat, "max_tokens": 40, "temperature": 0,
                                                       "id_slot": 2, "cache_prompt": True})
        check(status == 200, f"quest chat, first turn: HTTP {status} {turn}")
        first_prompt = turn["usage"]["prompt_tokens"]
        chat += [{"role": "assistant", "content": turn["choices"][0]["message"]["content"]},
                 {"role": "user", "content": "Say more."}]
        status, turn = s.post("/v1/chat/completions", {"messages": chat, "max_tokens": 8, "temperature": 0,
                                                       "id_slot": 2, "cache_prompt": True})
        check(status == 200, f"quest chat, second turn: HTTP {status} {turn}")
        kept = turn["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
        check(kept > first_prompt, f"quest chat: the second turn kept {kept} tokens, not the first turn's "
                                   f"{first_prompt} prompt tokens and some of its answer: {turn['usage']}")
        print(f"quest chat: the second turn kept {kept} of {turn['usage']['prompt_tokens']} prompt tokens "
              f"(the first turn's prompt: {first_prompt})")

    with Server(a.server, a.model, "h2o", ["--sparse-attn", "h2o", "--sparse-budget", "256"], workdir,
                threads) as s:
        status, body = s.complete(texts[0], id_slot=0)
        check(status == 200, f"h2o: HTTP {status} {body}")
        with ThreadPoolExecutor(max_workers=4) as pool:
            others = [pool.submit(s.complete, t, id_slot=1 + i) for i, t in enumerate(texts[5:8])]
            status, refused = s.post("/slots/0?action=save", {"filename": "h2o-slot0.bin"})
            results = [f.result() for f in others]
        check(status >= 400, f"h2o: saving a slot whose tokens H2O evicted gave HTTP {status}: {refused}")
        tokens_of(results, "h2o, beside the refused save")
        check("evicted" in json.dumps(refused), f"h2o: the HTTP error does not say why the save was refused: {refused}")
        print(f"h2o: slot save refused with HTTP {status}; {len(results)} other requests completed")

    shift = Server(a.server, a.model, "context-shift", ["--sparse-attn", "quest", "--context-shift"], workdir,
                   threads)
    try:
        shift.start(timeout=60)
        raise Failure("--sparse-attn with --context-shift started")
    except Failure as e:
        check("exited" in str(e) and "context-shift" in shift.tail(), f"--context-shift: {e}")
    finally:
        shift.stop()
    print("--context-shift refused at start-up")


def perplexity(a, args, log):
    run = subprocess.run([a.perplexity, "-m", a.model, "-f", a.text, "-c", "512", "-b", "512", "--chunks", "4",
                          "-t", str(a.threads), *args], capture_output=True, text=True)
    with open(log, "w") as f:
        f.write(run.stdout + run.stderr)
    check(run.returncode == 0, f"llama-perplexity {' '.join(args)} exited {run.returncode}:\n{run.stderr[-3000:]}")
    return run.stdout + run.stderr


def perplexity_tests(a, workdir):
    """KLD against the stock base file. In ubatches of 512 rows every row is a prompt row, attended by the
    library's (dense) prompt attention whatever the policy; in ubatches of one row (-ub 1) every row after the
    first is a decode step of the policy, teacher-forced."""
    base = os.path.join(workdir, "base.kld")
    perplexity(a, ["--kl-divergence-base", base], os.path.join(workdir, "ppl-base.log"))
    out = {}
    for name, args in [("llama, flash attention off", ["-fa", "off"]),
                       ("dense", ["--sparse-attn", "dense"]),
                       ("dense, -ub 1", ["--sparse-attn", "dense", "-ub", "1"]),
                       ("quest 128, -ub 1", ["--sparse-attn", "quest", "--sparse-budget", "128", "-ub", "1"])]:
        text = perplexity(a, ["--kl-divergence-base", base, "--kl-divergence", *args],
                          os.path.join(workdir, "ppl-" + re.sub(r"\W+", "-", name) + ".log"))
        kld = re.search(r"Mean\s+KLD:\s+(\S+)", text)
        top = re.search(r"Same top p:\s+(\S+)", text)
        check(kld and top, f"{name}: no Mean KLD / Same top p in llama-perplexity's output:\n{text[-3000:]}")
        out[name] = (float(kld.group(1)), float(top.group(1)))
        print(f"llama-perplexity --kl-divergence, {name}: mean KLD {out[name][0]:.5f}, same top p {out[name][1]:.2f}%")
    noise_kld, noise_top = out["llama, flash attention off"]
    for name in ("dense", "dense, -ub 1"):
        kld, top = out[name]
        check(kld <= 2 * noise_kld + 1e-3, f"{name}: KLD {kld} against llama.cpp's own {noise_kld}")
        check(top >= noise_top - 5, f"{name}: same top p {top}% against llama.cpp's own {noise_top}%")
    quest_kld, quest_top = out["quest 128, -ub 1"]
    check(quest_kld > out["dense, -ub 1"][0], "Quest at 128 of 512 tokens is not farther than Dense: not sparse?")
    check(quest_kld < 1.0 and quest_top > 50, f"Quest 128: KLD {quest_kld}, same top p {quest_top}%")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["server", "perplexity"])
    p.add_argument("--bin", required=True, help="folder holding llama-server and llama-perplexity")
    models = os.environ.get("SPARSEKV_MODEL_DIR", os.path.expanduser("~/.cache/sparsekv/models"))
    p.add_argument("--model", default=os.path.join(models, "SmolLM2-135M-Instruct.Q4_1.gguf"))
    p.add_argument("--text", default="/usr/share/common-licenses/GPL-3")
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    a.server = os.path.join(a.bin, "llama-server")
    a.perplexity = os.path.join(a.bin, "llama-perplexity")
    for path in (a.model, a.text, a.server if a.what == "server" else a.perplexity):
        if not os.path.exists(path):
            print(f"skipped: {path} is not there")
            return SKIP
    workdir = tempfile.mkdtemp(prefix=f"sparsekv-{a.what}-")
    try:
        with open(a.text) as f:
            text = f.read()
        if a.what == "server":
            server_tests(a, text, workdir)
        else:
            perplexity_tests(a, workdir)
    except Failure as e:
        print(f"FAILED: {e}\n(logs in {workdir})")
        return 1
    print(f"passed (logs in {workdir})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
