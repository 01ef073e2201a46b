// Split-K sparse paged decode attention (Spin §4.1 Attend) over the grid
// batch {1, 8, 32, 64} requests x head_dim {128, 64} x page_tokens {16, 8}:
// 8 kv heads x 2048 selected tokens per (request, kv head) -- 128 pages of 16
// tokens or 256 of 8 -- scattered over a 512 MiB page pool, bf16 pages, GQA 4
// (32 q heads), fp32 q / o / lse. The head_dim 128, 16-token rows come first:
// the shape of docs/performance.md's table.
// Targets: at batch >= 32, >= 0.8 of the HBM bound and within
// 1.15x of PyTorch SDPA over the same KV made contiguous; at batch 8 within
// 1.3x; at batch 1 <= 20 us. benchmarks/peer_attention.py times the PyTorch
// side over the same grid and shapes.
//
// Each run times back-to-back launches with cudaEvents and reports
//   GBps      - bytes the attention must move (K/V pages read + q read + o and
//               lse written) / time per launch
//   hbm_GBps  - the HBM bound measured in the same process: a 256 MiB
//               device-to-device cudaMemcpyAsync, counted as 2 x 256 MiB
//               (every byte is read and written once)
//   over_hbm  - GBps / hbm_GBps (the target is >= 0.8 at batch >= 32)
//   chunks    - split-K chunks per (request, kv head) chosen for this case
//   pages     - pages per (request, kv head): 2048 / page_tokens
// Launches rotate over disjoint page sets (>= 128 MiB together, or one set
// when a launch alone reads more) so the 50 MiB L2 cannot serve a launch from
// the previous one's reads.
// Without a CUDA device it prints "SKIPPED: no CUDA device" and exits 0.
#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <vector>

#include "cuda_bench_support.hpp"
#include "scattered_attention.hpp"
#include "sparsekv/attention/sparse_decode_attention_cuda.hpp"

namespace {

using namespace sparsekv::bench;

constexpr std::uint32_t kKvHeads = 8;
constexpr std::uint32_t kQHeads = 32;
constexpr std::uint32_t kSelectedTokens = 2048;
constexpr std::array<std::uint32_t, 4> kBatches{1, 8, 32, 64};
constexpr std::array<std::uint32_t, 2> kHeadDims{128, 64};
constexpr std::array<std::uint32_t, 2> kPageTokens{16, 8};
constexpr std::uint32_t kMaxBatch = *std::max_element(kBatches.begin(), kBatches.end());
constexpr std::uint32_t kMaxHeadDim = *std::max_element(kHeadDims.begin(), kHeadDims.end());
constexpr std::size_t kPoolBytes = std::size_t{512} << 20;
constexpr std::size_t kCopyBytes = std::size_t{256} << 20;
constexpr std::size_t kRotationBytes = std::size_t{128} << 20;
constexpr int kLaunchesPerIteration = 16;

constexpr sparsekv::PageLayout layout_of(std::uint32_t head_dim, std::uint32_t page_tokens) {
  return {page_tokens, head_dim, sparsekv::DType::bf16};
}

constexpr std::uint32_t row_pages(const sparsekv::PageLayout& layout) { return kSelectedTokens / layout.page_tokens; }

// Pages one launch reads (every row of the batch) and pages the pool holds in
// this layout: page ids below pool_pages stay inside the pool.
constexpr std::size_t launch_pages(std::uint32_t batch, const sparsekv::PageLayout& layout) {
  return std::size_t{batch} * kKvHeads * row_pages(layout);
}
constexpr std::size_t pool_pages(const sparsekv::PageLayout& layout) { return kPoolBytes / layout.page_bytes(); }

// Every case's last page is full, and every case has at least one rotation
// set in the pool (head_dim 128 at batch 64 reads exactly the whole pool in
// either page size).
constexpr bool grid_fits_pool() {
  for (const std::uint32_t batch : kBatches) {
    for (const std::uint32_t head_dim : kHeadDims) {
      for (const std::uint32_t page_tokens : kPageTokens) {
        const sparsekv::PageLayout layout = layout_of(head_dim, page_tokens);
        if (kSelectedTokens % page_tokens != 0 || launch_pages(batch, layout) > pool_pages(layout)) return false;
      }
    }
  }
  return true;
}
static_assert(grid_fits_pool());

// Buffers shared by every run, allocated on first use.
struct Buffers {
  std::byte* pool = nullptr;
  std::byte* copy_dst = nullptr;  // destination of the HBM reference copy
  float* q = nullptr;             // [kMaxBatch][kQHeads][kMaxHeadDim]; a case uses its leading part
  float* out = nullptr;
  float* lse = nullptr;
  cudaStream_t stream = nullptr;
  Events events;
  double hbm_gbps = 0;

  Buffers() {
    pool = device_alloc<std::byte>(kPoolBytes);
    check(cudaMemset(pool, 0x3c, kPoolBytes), "cudaMemset");  // bf16 0x3c3c: small finite values
    copy_dst = device_alloc<std::byte>(kCopyBytes);
    const std::size_t q_elems = std::size_t{kMaxBatch} * kQHeads * kMaxHeadDim;
    std::vector<float> host_q(q_elems);
    std::mt19937 rng(1);
    std::normal_distribution<float> normal;
    for (float& x : host_q) x = normal(rng);
    q = device_copy(host_q.data(), q_elems);
    out = device_alloc<float>(q_elems);
    lse = device_alloc<float>(std::size_t{kMaxBatch} * kQHeads);
    stream = non_blocking_stream();
    // The fills and uploads above ran on the legacy default stream, which the
    // non-blocking `stream` does not wait for.
    check(cudaDeviceSynchronize(), "setup");
    hbm_gbps = measure_d2d_gbps(copy_dst, pool, kCopyBytes, 10, stream, events);
  }
};

Buffers& buffers() {
  static Buffers b;
  return b;
}

void BM_SparseDecodeAttention(benchmark::State& state) {
  const auto batch = static_cast<std::uint32_t>(state.range(0));
  const sparsekv::PageLayout layout =
      layout_of(static_cast<std::uint32_t>(state.range(1)), static_cast<std::uint32_t>(state.range(2)));
  Buffers& b = buffers();
  // Every case has at least one rotation set in the pool (grid_fits_pool).
  ScatteredAttention p = make_scattered_attention(batch, kQHeads, kKvHeads, layout, row_pages(layout), b.pool,
                                                  kPoolBytes, kRotationBytes, batch);
  p.args.q = b.q;
  p.args.out = b.out;
  p.args.lse = b.lse;
  auto launch = [&] {
    sparsekv::cuda::sparse_decode_attention(p.shape, p.args, b.stream);
    p.rotate();
  };
  for (std::size_t s = 0; s < p.set_count; ++s) launch();  // warm-up: every set once
  check(cudaStreamSynchronize(b.stream), "warm-up");
  double total_ms = 0;
  for (auto _ : state) {
    // Keep the stream busy (a 256 MiB copy, ~0.2 ms) while the host enqueues
    // the start event and the launches: the GPU then runs them back to back
    // and the events time the kernels, not the host's launch rate (one launch
    // at batch 1 moves 4 or 8 MiB, a few microseconds, about the host's cost of
    // validating and launching two kernels). The copy also flushes the L2.
    pad_copy(b.copy_dst, b.pool, kCopyBytes, b.stream);
    const float ms = elapsed_ms(b.events, b.stream, [&] {
      for (int r = 0; r < kLaunchesPerIteration; ++r) launch();
    });
    const double per_launch_ms = double(ms) / kLaunchesPerIteration;
    state.SetIterationTime(per_launch_ms * 1e-3);
    total_ms += per_launch_ms;
  }
  const double heads = double(batch) * kQHeads;
  const double bytes = double(launch_pages(batch, layout)) * double(layout.page_bytes())  // K/V pages
                       + heads * layout.head_dim * sizeof(float)                          // q
                       + heads * (layout.head_dim + 1) * sizeof(float);                   // o + lse
  const double ms = total_ms / double(state.iterations());
  const double gbps = bytes / (ms * 1e-3) / 1e9;
  state.counters["GBps"] = gbps;
  state.counters["hbm_GBps"] = b.hbm_gbps;
  state.counters["over_hbm"] = gbps / b.hbm_gbps;
  state.counters["chunks"] = p.split.chunks;
  state.counters["pages"] = row_pages(layout);
  p.release();
}

// Layout by layout, the head_dim 128 / 16-token one first, each over every batch.
void grid(benchmark::internal::Benchmark* b) {
  for (const std::uint32_t head_dim : kHeadDims) {
    for (const std::uint32_t page_tokens : kPageTokens) {
      for (const std::uint32_t batch : kBatches) b->Args({batch, head_dim, page_tokens});
    }
  }
  b->ArgNames({"batch", "head_dim", "page_tokens"});
}

BENCHMARK(BM_SparseDecodeAttention)->Apply(grid)->UseManualTime()->Unit(benchmark::kMicrosecond);

}  // namespace

int main(int argc, char** argv) { return sparsekv::bench::run_benchmarks(argc, argv); }
