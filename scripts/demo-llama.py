#!/usr/bin/env python3
"""The main demo's run (scripts/demo builds llama-completion first): llama.cpp's own llama-completion answers a
question about a long document three times, stock (llama.cpp's attention, flash attention on and off) and with sparsekv
(--sparse-attn), greedy, and prints each answer with its prompt and decode tokens/s (llama.cpp's own timings) and
the process's peak memory. Each run is its own process; nothing but the flag differs."""
import argparse
import os
import re
import subprocess
import sys
import tempfile


def run(cmd):
    """Runs cmd, returning (stdout, stderr, peak RSS in MiB) of that process alone."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(errors="replace"), err.read().decode(errors="replace")
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} exited {proc.returncode}:\n{stderr[-3000:]}")
    return stdout, stderr, usage.ru_maxrss / 1024


def rate(stderr, what):
    m = re.search(what + r" time =\s*[\d.]+ ms /\s*(\d+) (?:tokens|runs).*?([\d.]+) tokens per second", stderr)
    return (int(m.group(1)), float(m.group(2))) if m else (0, 0.0)


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--bin", default="build/bin")
    p.add_argument("--model", default=os.path.join(os.environ.get("SPARSEKV_MODEL_DIR", os.path.expanduser(
        "~/.cache/sparsekv/models")), "SmolLM2-135M-Instruct.Q4_1.gguf"))
    p.add_argument("--document", default="/usr/share/common-licenses/GPL-3")
    p.add_argument("--chars", type=int, default=16000, help="characters of the document kept (its start)")
    p.add_argument("--question", default="What is the name of the document above, and who published it?")
    p.add_argument("--policy", default="quest")
    p.add_argument("--budget", type=int, default=1024)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    a = p.parse_args()
    with open(a.document) as f:
        document = f.read()[:a.chars]
    prompt = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
              f"<|im_start|>user\n{document}\n\n{a.question}<|im_end|>\n<|im_start|>assistant\n")
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(prompt)
        prompt_file = f.name
    base = [os.path.join(a.bin, "llama-completion"), "-m", a.model, "-f", prompt_file, "-n", str(a.tokens),
            "--temp", "0", "-no-cnv", "--no-display-prompt", "-c", "8192", "-t", str(a.threads),
            "--no-warmup", "-r", "<|im_end|>"]
    runs = [("llama.cpp (stock attention, flash attention on)", base + ["-fa", "on"]),
            ("llama.cpp (stock attention, flash attention off)", base + ["-fa", "off"]),
            (f"llama.cpp + sparsekv (--sparse-attn {a.policy} --sparse-budget {a.budget})",
             base + ["-fa", "on", "--sparse-attn", a.policy, "--sparse-budget", str(a.budget)])]
    print(f"{os.path.basename(a.model)} reads {os.path.basename(a.document)} ({a.chars} characters) and answers:\n"
          f"  {a.question}\n", flush=True)
    results = []
    for name, cmd in runs:
        print(f"== {name}", flush=True)
        out, err, peak = run(cmd)
        (n_prompt, prompt_tps), (n_decode, decode_tps) = rate(err, "prompt eval"), rate(err, r"(?<!prompt )eval")
        print(out.replace("<|im_end|>", "").replace("[end of text]", "").strip() + "\n")
        print(f"   prompt {n_prompt} tokens at {prompt_tps:.1f} tokens/s; decode {n_decode} tokens at "
              f"{decode_tps:.1f} tokens/s; peak memory {peak:.0f} MiB\n", flush=True)
        results.append((decode_tps, peak))
    *stock, (sparse_tps, sparse_peak) = results
    stock_tps, stock_peak = max(stock)  # the faster stock run
    if stock_tps > 0:
        print(f"sparsekv against the faster stock run: decode {sparse_tps / stock_tps:.2f}x, peak memory "
              f"{sparse_peak / stock_peak:.2f}x")
    os.unlink(prompt_file)


if __name__ == "__main__":
    main()
