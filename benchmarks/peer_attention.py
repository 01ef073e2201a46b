#!/usr/bin/env python3
"""PyTorch peer of benchmarks/bench_attention_cuda.cpp: the same grid
and shapes timed with PyTorch's kernels, so that the two tables can be read
side by side.

    python3 benchmarks/peer_attention.py [--json PATH]

Grid, in the benchmark's row order: head_dim {128, 64} x page_tokens {16, 8},
each over batch {1, 8, 32, 64}. Every case is 8 kv heads x 2048 selected tokens
per (request, kv head) -- 128 pages of 16 tokens or 256 of 8 -- scattered over
a 512 MiB pool of bf16 pages laid out as sparsekv's PageLayout (a page is its K
block [page_tokens][head_dim], then its V block), 32 q heads (GQA 4), one query
token per request. Row r = request * 8 + kv head holds its case's pages
r * pages .. (r + 1) * pages - 1 of the launch's page list, as the benchmark's
indptr says.

Per row:
  sdpa_contig_us   F.scaled_dot_product_attention(enable_gqa=True) over the
                   case's K and V already contiguous, [batch][8][2048][head_dim]:
                   the dense decode kernel an engine has, reading the same
                   bytes without paging (the reference time)
  gather_sdpa_us   index_select of the pages' K blocks and of their V blocks
                   straight into that contiguous form, then the same SDPA: the
                   naive sparse path ("-", null in JSON, when the host could not
                   enqueue an iteration within the longest pad)
  bytes_MB         what the contiguous SDPA must move: K/V read, q read and o
                   written (q and o bf16, as SDPA takes q in K/V's dtype; the
                   benchmark's are fp32, with lse: 0.2% more bytes)
  contig_GBps      bytes / sdpa_contig_us
  contig_over_hbm  contig_GBps / hbm_GBps
  hbm_GBps         the HBM bound, measured once in this run as the benchmark
                   measures it: a 256 MiB device-to-device copy, counted as
                   2 x 256 MiB (every byte read and written once)

Timing follows the benchmark. Launches rotate over disjoint page sets (>= 128
MiB together, or one set when a launch alone reads more), so the 50 MiB L2
cannot serve a launch from the previous one's reads. Each iteration enqueues a
pad of 256 MiB device copies (it also flushes the L2), records the start event,
enqueues 16 launches and records the stop event: the time per launch is the
interval / 16, and a row's figure the median over 30 iterations. The pad keeps
the GPU busy while Python enqueues (tens of microseconds a launch, more than a
batch-1 launch runs), so the events time the kernels and not the host: an
iteration whose start event has already completed when its last launch is
enqueued (the GPU may have waited for the host) is discarded and the pad
doubled. The first H100 table timed one call at a time, host dispatch included, so
its small batches read higher than this.

--json PATH writes {"device", "torch", "hbm_GBps", "rows": [...]}, each row with
the keys batch, head_dim, page_tokens, pages, bytes and the columns above.
Without PyTorch (>= 2.5, for enable_gqa) or a CUDA device it prints
"SKIPPED: ..." and exits 0, as the benchmark does.
"""

import argparse
import json
import statistics
import sys

KV_HEADS = 8
Q_HEADS = 32
SELECTED_TOKENS = 2048
BATCHES = (1, 8, 32, 64)
HEAD_DIMS = (128, 64)
PAGE_TOKENS = (16, 8)
BF16_BYTES = 2
POOL_BYTES = 512 << 20
COPY_BYTES = 256 << 20
ROTATION_BYTES = 128 << 20
LAUNCHES_PER_ITERATION = 16
ITERATIONS = 30
HBM_COPIES = 10
MAX_PAD_COPIES = 64


class PadTooShort(RuntimeError):
    """The host took longer to enqueue an iteration than the longest pad runs."""


def page_bytes(head_dim, page_tokens):
    return 2 * page_tokens * head_dim * BF16_BYTES  # K block + V block


def pool_pages(head_dim, page_tokens):
    return POOL_BYTES // page_bytes(head_dim, page_tokens)


def row_pages(page_tokens):
    return SELECTED_TOKENS // page_tokens


def launch_pages(batch, page_tokens):
    return batch * KV_HEADS * row_pages(page_tokens)


def rotation_sets(batch, head_dim, page_tokens):
    """Disjoint page sets a case rotates over: enough for ROTATION_BYTES, as
    many as the pool holds. Set s is pages [s * launch_pages, (s + 1) *
    launch_pages) of a permutation of the pool, so every id is below
    pool_pages."""
    pages = launch_pages(batch, page_tokens)
    launch_bytes = pages * page_bytes(head_dim, page_tokens)
    wanted = -(-ROTATION_BYTES // launch_bytes)
    sets = min(wanted, pool_pages(head_dim, page_tokens) // pages)
    if sets < 1:
        raise ValueError(f"batch {batch}, head_dim {head_dim}, page_tokens {page_tokens}: one launch's "
                         f"{pages} pages exceed the {pool_pages(head_dim, page_tokens)}-page pool")
    return sets


def case_bytes(batch, head_dim, page_tokens):
    kv = launch_pages(batch, page_tokens) * page_bytes(head_dim, page_tokens)
    q_and_o = 2 * batch * Q_HEADS * head_dim * BF16_BYTES
    return kv + q_and_o


def torch_or_skip():
    """torch, or None after printing why the peer cannot run here."""
    try:
        import torch
    except ImportError:
        print("SKIPPED: PyTorch is not installed")
        return None
    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    if (major, minor) < (2, 5):
        print(f"SKIPPED: PyTorch {torch.__version__} lacks scaled_dot_product_attention(enable_gqa=True) (2.5+)")
        return None
    if not torch.cuda.is_available():
        print("SKIPPED: no CUDA device")
        return None
    return torch


class Timer:
    """The benchmark's timing: pad copies, then launches back to back between
    two events. The pad grows (doubling) whenever the host fell behind.
    hbm_gbps is the HBM bound, measured once when the timer is made."""

    def __init__(self, torch):
        self.torch = torch
        self.src = torch.full((COPY_BYTES,), 0x3C, dtype=torch.uint8, device="cuda")
        self.dst = torch.empty_like(self.src)
        self.start = torch.cuda.Event(enable_timing=True)
        self.stop = torch.cuda.Event(enable_timing=True)
        self.pad_copies = 1
        self.hbm_gbps = self._copy_gbps()

    def _copy_gbps(self):
        self.dst.copy_(self.src)
        self.start.record()
        for _ in range(HBM_COPIES):
            self.dst.copy_(self.src)
        self.stop.record()
        self.stop.synchronize()
        seconds = self.start.elapsed_time(self.stop) * 1e-3
        return 2 * COPY_BYTES * HBM_COPIES / seconds / 1e9

    def median_us(self, launch, warmup):
        """Median microseconds per launch() over ITERATIONS iterations, after
        `warmup` launches."""
        for _ in range(warmup):
            launch()
        self.torch.cuda.synchronize()
        per_launch_us = []
        while len(per_launch_us) < ITERATIONS:
            for _ in range(self.pad_copies):
                self.dst.copy_(self.src)
            self.start.record()
            for _ in range(LAUNCHES_PER_ITERATION):
                launch()
            host_fell_behind = self.start.query()
            self.stop.record()
            self.stop.synchronize()
            if host_fell_behind:
                if self.pad_copies >= MAX_PAD_COPIES:
                    raise PadTooShort(f"{MAX_PAD_COPIES} pad copies still end before the host enqueues "
                                       f"{LAUNCHES_PER_ITERATION} launches")
                self.pad_copies *= 2
                continue
            per_launch_us.append(self.start.elapsed_time(self.stop) * 1e3 / LAUNCHES_PER_ITERATION)
        return statistics.median(per_launch_us)


def measure_layout(torch, timer, head_dim, page_tokens):
    """Rows of one page layout: the pool is filled once and shared by its batches."""
    import torch.nn.functional as F

    pool = torch.randn(pool_pages(head_dim, page_tokens), 2, page_tokens, head_dim, dtype=torch.bfloat16,
                       device="cuda")
    k_blocks, v_blocks = pool[:, 0], pool[:, 1]  # [pool pages][page_tokens][head_dim], strided views
    rows = []
    for batch in BATCHES:
        sets = rotation_sets(batch, head_dim, page_tokens)
        pages = launch_pages(batch, page_tokens)
        permutation = torch.randperm(pool.shape[0], device="cuda")
        indices = [permutation[s * pages:(s + 1) * pages] for s in range(sets)]
        shape = (batch, KV_HEADS, SELECTED_TOKENS, head_dim)

        def gather(blocks, s):
            return blocks.index_select(0, indices[s]).view(shape)

        contiguous = [(gather(k_blocks, s), gather(v_blocks, s)) for s in range(sets)]
        q = torch.randn(batch, Q_HEADS, 1, head_dim, dtype=torch.bfloat16, device="cuda")
        next_set = [0]

        def take_set():
            s = next_set[0]
            next_set[0] = (s + 1) % sets
            return s

        def sdpa_contig():
            k, v = contiguous[take_set()]
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

        def gather_sdpa():
            s = take_set()
            return F.scaled_dot_product_attention(q, gather(k_blocks, s), gather(v_blocks, s), enable_gqa=True)

        # Both paths attend to the same keys: set 0 gives the same output.
        next_set[0] = 0
        reference = sdpa_contig()
        next_set[0] = 0
        torch.testing.assert_close(gather_sdpa(), reference)

        contig_us = timer.median_us(sdpa_contig, sets)
        try:
            gather_us = timer.median_us(gather_sdpa, sets)
        except PadTooShort as e:
            # Seen on an H100 at batch 64 (2026-11-26): the naive path is
            # only a side column, so its row keeps the SDPA figure.
            print(f"batch {batch} head_dim {head_dim} page_tokens {page_tokens}: gather_sdpa not timed: {e}",
                  file=sys.stderr, flush=True)
            gather_us = None
        nbytes = case_bytes(batch, head_dim, page_tokens)
        contig_gbps = nbytes / (contig_us * 1e-6) / 1e9
        rows.append({"batch": batch, "head_dim": head_dim, "page_tokens": page_tokens,
                     "pages": row_pages(page_tokens), "bytes": nbytes, "sdpa_contig_us": contig_us,
                     "gather_sdpa_us": gather_us, "contig_GBps": contig_gbps,
                     "contig_over_hbm": contig_gbps / timer.hbm_gbps, "hbm_GBps": timer.hbm_gbps})
        print(format_row(rows[-1]), flush=True)
    return rows


HEADER = (f"{'batch':>5} {'head_dim':>8} {'page_tokens':>11} {'pages':>5} {'bytes_MB':>9} {'sdpa_contig_us':>14} "
          f"{'gather_sdpa_us':>14} {'contig_GBps':>11} {'contig_over_hbm':>15} {'hbm_GBps':>8}")


def format_row(r):
    gather = "-" if r["gather_sdpa_us"] is None else f"{r['gather_sdpa_us']:.1f}"
    return (f"{r['batch']:>5} {r['head_dim']:>8} {r['page_tokens']:>11} {r['pages']:>5} {r['bytes'] / 1e6:>9.1f} "
            f"{r['sdpa_contig_us']:>14.1f} {gather:>14} {r['contig_GBps']:>11.0f} "
            f"{r['contig_over_hbm']:>15.3f} {r['hbm_GBps']:>8.0f}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", metavar="PATH", help="also write the rows to PATH as JSON")
    args = parser.parse_args(argv)
    torch = torch_or_skip()
    if torch is None:
        return 0
    torch.manual_seed(1)
    timer = Timer(torch)
    device = torch.cuda.get_device_name()
    print(f"device {device}, torch {torch.__version__}, hbm_GBps {timer.hbm_gbps:.0f}")
    print(HEADER, flush=True)
    rows = []
    for head_dim in HEAD_DIMS:
        for page_tokens in PAGE_TOKENS:
            rows += measure_layout(torch, timer, head_dim, page_tokens)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "torch": torch.__version__, "hbm_GBps": timer.hbm_gbps, "rows": rows}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
