// Gather H2D (Spin §5.5, SparseServe §3.2.1 FlashH2D): N = 4096 scattered
// pages of 2/4/8/16/32 KB from a pinned host pool (256 MiB) into scattered
// device pages, with all SMs and with an 8-SM cap. Each run prints the
// kernel's GB/s and its ratio to three references measured in the same
// process with cudaEvents:
//   over_pcie     - the PCIe reference (pcie_GBps): one contiguous 256 MiB H2D
//                   copy, measured once per process (cuda_bench_support.hpp)
//                   and printed at startup; the fraction of the link the
//                   gather reaches, the same figure for every page size
//   over_per_page - one cudaMemcpyAsync per page, on the same pages
//   over_batch    - one cudaMemcpyBatchAsync over the same pages (CUDA 12.8+; -1 without)
// Without a CUDA device it prints "SKIPPED: no CUDA device" and exits 0.
#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <numeric>
#include <random>
#include <vector>

#include "cuda_bench_support.hpp"
#include "sparsekv/transfer/page_gather_cuda.hpp"

namespace {

using namespace sparsekv::bench;
using sparsekv::PageId;

constexpr std::uint32_t kPages = 4096;
constexpr std::size_t kPoolBytes = std::size_t{256} << 20;
constexpr std::size_t kMaxPageBytes = 32 << 10;

// Buffers shared by every run, allocated on first use.
struct Buffers {
  std::byte* pool = nullptr;  // pinned, mapped host pool (the CPU tier)
  std::byte* dst = nullptr;   // device pages (the GPU tier)
  PageId* d_src_pages = nullptr;
  PageId* d_dst_pages = nullptr;
  cudaStream_t stream = nullptr;  // non-blocking: cudaMemcpyBatchAsync rejects the legacy stream
  Events events;

  Buffers() {
    void* p = nullptr;
    check(cudaHostAlloc(&p, kPoolBytes, cudaHostAllocMapped), "cudaHostAlloc");
    pool = static_cast<std::byte*>(p);
    std::memset(pool, 0x5a, kPoolBytes);
    dst = device_alloc<std::byte>(kPages * kMaxPageBytes);
    d_src_pages = device_alloc<PageId>(kPages);
    d_dst_pages = device_alloc<PageId>(kPages);
    stream = non_blocking_stream();
  }
};

Buffers& buffers() {
  static Buffers b;
  return b;
}

// The page lists of one page size: distinct random pool pages -> a random permutation of device pages.
struct Lists {
  std::vector<PageId> src, dst;
};

const Lists& lists(std::size_t page_bytes) {
  static std::map<std::size_t, Lists> cache;
  auto it = cache.find(page_bytes);
  if (it != cache.end()) return it->second;
  std::mt19937 rng(static_cast<unsigned>(page_bytes));
  std::vector<PageId> all(kPoolBytes / page_bytes);
  std::iota(all.begin(), all.end(), PageId{0});
  std::shuffle(all.begin(), all.end(), rng);
  Lists l;
  l.src.assign(all.begin(), all.begin() + kPages);
  l.dst.resize(kPages);
  std::iota(l.dst.begin(), l.dst.end(), PageId{0});
  std::shuffle(l.dst.begin(), l.dst.end(), rng);
  return cache.emplace(page_bytes, std::move(l)).first->second;
}

// On the benchmark stream, then waited for: a cudaMemcpy from pageable memory
// may return before its DMA lands, and the non-blocking stream the kernel runs
// on would not wait for the legacy stream.
void upload(const Lists& l) {
  Buffers& b = buffers();
  check(cudaMemcpyAsync(b.d_src_pages, l.src.data(), kPages * sizeof(PageId), cudaMemcpyHostToDevice, b.stream),
        "cudaMemcpyAsync");
  check(cudaMemcpyAsync(b.d_dst_pages, l.dst.data(), kPages * sizeof(PageId), cudaMemcpyHostToDevice, b.stream),
        "cudaMemcpyAsync");
  check(cudaStreamSynchronize(b.stream), "cudaStreamSynchronize");
}

// Mean ms of `enqueue` on the benchmark stream over `reps` back-to-back runs, after one warm-up.
template <class Enqueue>
double mean_ms(int reps, Enqueue&& enqueue) {
  Buffers& b = buffers();
  enqueue();
  check(cudaStreamSynchronize(b.stream), "warm-up");
  const float ms = elapsed_ms(b.events, b.stream, [&] {
    for (int r = 0; r < reps; ++r) enqueue();
  });
  return double(ms) / reps;
}

const CopyReferences& references(std::size_t page_bytes) {
  static std::map<std::size_t, CopyReferences> cache;
  auto it = cache.find(page_bytes);
  if (it != cache.end()) return it->second;
  Buffers& b = buffers();
  const Lists& l = lists(page_bytes);
  CopyReferences r;
  r.per_page_ms = mean_ms(5, [&] {
    for (std::uint32_t i = 0; i < kPages; ++i)
      check(cudaMemcpyAsync(b.dst + l.dst[i] * page_bytes, b.pool + l.src[i] * page_bytes, page_bytes,
                            cudaMemcpyHostToDevice, b.stream),
            "memcpy");
  });
  std::vector<void*> dsts(kPages);
  std::vector<const void*> srcs(kPages);
  std::vector<std::size_t> sizes(kPages, page_bytes);
  for (std::uint32_t i = 0; i < kPages; ++i) {
    dsts[i] = b.dst + l.dst[i] * page_bytes;
    srcs[i] = b.pool + l.src[i] * page_bytes;
  }
  constexpr cudaMemcpyKind kH2D = cudaMemcpyHostToDevice;
  r.batch_ms = -1;
  if (memcpy_batch_works(dsts, srcs, sizes, kH2D, b.stream)) {
    r.batch_ms = mean_ms(20, [&] { check(memcpy_batch(dsts, srcs, sizes, kH2D, b.stream), "cudaMemcpyBatchAsync"); });
  }
  return cache.emplace(page_bytes, r).first->second;
}

// range(0): page KB; range(1): max_sms (0 = all).
void BM_GatherH2D(benchmark::State& state) {
  const std::size_t page_bytes = static_cast<std::size_t>(state.range(0)) << 10;
  sparsekv::cuda::GatherConfig config;
  config.max_sms = static_cast<std::uint32_t>(state.range(1));
  Buffers& b = buffers();
  const Lists& l = lists(page_bytes);
  const CopyReferences& ref = references(page_bytes);
  upload(l);
  auto enqueue = [&] {
    sparsekv::cuda::gather_pages(b.d_src_pages, b.d_dst_pages, kPages, b.pool, page_bytes, b.dst, page_bytes,
                                 page_bytes, config, b.stream);
  };
  enqueue();
  check(cudaStreamSynchronize(b.stream), "warm-up");
  double total_ms = 0;
  for (auto _ : state) {
    const float ms = elapsed_ms(b.events, b.stream, enqueue);
    state.SetIterationTime(ms * 1e-3);
    total_ms += ms;
  }
  const double bytes = double(kPages) * double(page_bytes);
  const double ms = total_ms / double(state.iterations());
  set_copy_counters(state, bytes, ms, ref, pcie_reference().h2d_gbps);
}

BENCHMARK(BM_GatherH2D)
    ->ArgsProduct({{2, 4, 8, 16, 32}, {0, 8}})
    ->ArgNames({"page_kb", "max_sms"})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);

}  // namespace

int main(int argc, char** argv) { return sparsekv::bench::run_benchmarks(argc, argv, report_pcie_reference); }
