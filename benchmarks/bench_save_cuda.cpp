// Save D2H (SparseServe §3.2.2 FlashD2H): FlashD2HSaver -- one contiguous D2H
// copy into pinned staging, then host workers scatter the rows -- saving KV
// pages from device memory into random distinct pages of a pinned CPU pool
// (256 MiB). Pages of 2/4/8/16/32 KB (K block then V block of 256-byte rows:
// head_dim 128, fp16), 1, 2 and 4 scatter workers, two shapes:
//   BM_SaveDecodePages  - one full page per (request, kv head) of a decode
//                         step: 32 requests x 8 kv heads = 256 pages
//   BM_SavePrefillLayer - one layer of an 8192-token prefill, 8 kv heads:
//                         32 MiB, 16384 pages of 2 KB to 1024 of 32 KB
// The device source holds the pages in save order, each laid out as its CPU
// page, so every contender moves the same bytes from the same device
// addresses into the same CPU pages; the saver's rows are those pages' rows
// in order. (An engine's prefill tensor is token-major; that changes only
// the order in which the workers read staging, not what crosses PCIe.)
//
// Timed by the wall clock (steady_clock), from the first call that enqueues
// until the bytes are in the CPU pages: what an engine waits for. For the
// saver that is save() to wait() returning, since the host workers finish
// the save and cudaEvents cannot see them; for the references, the first
// cudaMemcpyAsync to cudaStreamSynchronize. GB/s counts every saved page
// byte once (bytes / time; the staging write is not counted again).
// Each row prints the saver's GBps and its ratio to references:
//   over_pcie     - pcie_GBps: the PCIe reference, one contiguous 256 MiB
//                   D2H copy measured once per process with cudaEvents
//                   (cuda_bench_support.hpp) and printed at startup: the
//                   fraction of the link the save reaches
//   over_per_page - per_page_GBps: one cudaMemcpyAsync D2H per page
//   over_batch    - batch_GBps: one cudaMemcpyBatchAsync over the same pages
//                   (CUDA 12.8+; -1 without)
// the two copies measured in the same process on the same pages, as the mean
// over repetitions filling at least 50 ms. SparseServe (Fig. 4b, PCIe Gen4)
// reports over 23 GB/s for FlashD2H against under 6 GB/s for per-block copies.
//
// Every contender is checked once per configuration outside the timed loop:
// the destination pages are first filled with the complement of their
// expected bytes, so a byte the save does not write differs; any byte unequal
// to the source exits 1 naming the contender, page and byte.
// Without a CUDA device it prints "SKIPPED: no CUDA device" and exits 0.
#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <numeric>
#include <random>
#include <span>
#include <utility>
#include <vector>

#include "cuda_bench_support.hpp"
#include "sparsekv/transfer/flash_d2h_save.hpp"

namespace {

using namespace sparsekv::bench;
using sparsekv::KvBlock;
using sparsekv::PageId;
using sparsekv::RowTarget;

constexpr std::size_t kPoolBytes = std::size_t{256} << 20;
constexpr std::size_t kRowBytes = 128 * 2;      // one (token, kv head) row: head_dim 128, fp16
constexpr std::uint32_t kDecodePages = 32 * 8;  // requests x kv heads
constexpr std::size_t kPrefillBytes = std::size_t{8192} * 8 * 2 * kRowBytes;  // tokens x kv heads x (K, V)
constexpr std::size_t kMaxSourceBytes = std::max(kPrefillBytes, kDecodePages*(std::size_t{32} << 10));

// Buffers shared by every run, allocated on first use.
struct Buffers {
  std::byte* pool = nullptr;    // pinned host pool (the CPU tier)
  std::byte* source = nullptr;  // device: the pages to save, in save order
  // The compute stream the saver's copy waits on, and the references' copy
  // stream; non-blocking: cudaMemcpyBatchAsync rejects the legacy stream.
  cudaStream_t stream = nullptr;

  Buffers() {
    void* p = nullptr;
    check(cudaHostAlloc(&p, kPoolBytes, cudaHostAllocDefault), "cudaHostAlloc");
    pool = static_cast<std::byte*>(p);
    source = device_alloc<std::byte>(kMaxSourceBytes);
    stream = non_blocking_stream();
  }
};

Buffers& buffers() {
  static Buffers b;
  return b;
}

// One configuration: source page i (source + i * page_bytes) goes to pool page dst[i].
struct Case {
  std::size_t page_bytes = 0;
  std::vector<PageId> dst;         // distinct random pool pages
  std::vector<std::byte> bytes;    // the source's contents
  std::vector<RowTarget> targets;  // the saver's rows: page i's K rows, then its V rows, by slot
};

// The same pages and bytes for every run of a (pages, page size), whatever its worker count.
Case make_case(std::uint32_t pages, std::size_t page_bytes) {
  std::mt19937_64 rng(pages * std::uint64_t{131} + page_bytes);
  Case c;
  c.page_bytes = page_bytes;
  std::vector<PageId> all(kPoolBytes / page_bytes);
  std::iota(all.begin(), all.end(), PageId{0});
  std::shuffle(all.begin(), all.end(), rng);
  c.dst.assign(all.begin(), all.begin() + pages);
  c.bytes.resize(pages * page_bytes);
  for (std::size_t i = 0; i < c.bytes.size(); i += sizeof(std::uint64_t)) {
    const std::uint64_t word = rng();
    std::memcpy(c.bytes.data() + i, &word, sizeof word);
  }
  const auto page_tokens = static_cast<std::uint32_t>(page_bytes / (2 * kRowBytes));
  c.targets.reserve(c.bytes.size() / kRowBytes);
  for (const PageId page : c.dst) {
    for (const KvBlock block : {KvBlock::k, KvBlock::v}) {
      for (std::uint32_t slot = 0; slot < page_tokens; ++slot) c.targets.push_back({page, slot, block});
    }
  }
  return c;
}

// The pool as the saver addresses it: one chunk of page_bytes pages, K block then V block.
sparsekv::SaveDestination destination(std::size_t page_bytes) {
  Buffers& b = buffers();
  const auto pool_pages = static_cast<std::uint32_t>(kPoolBytes / page_bytes);
  sparsekv::SaveDestination d;
  d.chunks = std::span<std::byte* const>(&b.pool, 1);
  d.pages_per_chunk = pool_pages;
  d.page_count = pool_pages;
  d.page_stride = page_bytes;
  d.page_tokens = static_cast<std::uint32_t>(page_bytes / (2 * kRowBytes));
  d.row_bytes = kRowBytes;
  d.k_block_offset = 0;
  d.v_block_offset = page_bytes / 2;
  return d;
}

// Fills c's destination pages with the complement of their expected bytes,
// runs `save` (which returns once its bytes are in the pages) and exits 1
// unless every byte of every page equals the source.
template <class Save>
void verify(const char* contender, const Case& c, Save&& save) {
  Buffers& b = buffers();
  const std::size_t page_bytes = c.page_bytes;
  for (std::size_t i = 0; i < c.dst.size(); ++i) {
    std::byte* page = b.pool + std::size_t{c.dst[i]} * page_bytes;
    const std::byte* expected = c.bytes.data() + i * page_bytes;
    for (std::size_t k = 0; k < page_bytes; ++k) page[k] = ~expected[k];
  }
  save();
  for (std::size_t i = 0; i < c.dst.size(); ++i) {
    const std::byte* page = b.pool + std::size_t{c.dst[i]} * page_bytes;
    const std::byte* expected = c.bytes.data() + i * page_bytes;
    const std::byte* wrong = std::mismatch(page, page + page_bytes, expected).first;
    if (wrong != page + page_bytes) {
      std::fprintf(stderr, "%s saved wrong bytes: page %zu of %zu (pool page %u, %zu KB pages), byte %zu\n", contender,
                   i, c.dst.size(), c.dst[i], page_bytes >> 10, static_cast<std::size_t>(wrong - page));
      std::exit(1);
    }
  }
}

using Clock = std::chrono::steady_clock;

// Wall-clock ms of `run`, which returns once its bytes are in the CPU pages.
template <class Run>
double wall_ms(Run&& run) {
  const Clock::time_point start = Clock::now();
  run();
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

// Mean wall_ms of `run` over repetitions filling at least 50 ms (at least 3), after one warm-up.
template <class Run>
double mean_wall_ms(Run&& run) {
  run();
  double total_ms = 0;
  int reps = 0;
  while (reps < 3 || total_ms < 50) {
    total_ms += wall_ms(run);
    ++reps;
  }
  return total_ms / reps;
}

// Checked and measured once per configuration; the device source must hold c's bytes.
const CopyReferences& references(const Case& c) {
  static std::map<std::pair<std::size_t, std::size_t>, CopyReferences> cache;  // (pages, page_bytes)
  const std::pair key(c.dst.size(), c.page_bytes);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  Buffers& b = buffers();
  const std::size_t page_bytes = c.page_bytes;
  const std::size_t pages = c.dst.size();
  CopyReferences r;
  auto per_page = [&] {
    for (std::size_t i = 0; i < pages; ++i)
      check(cudaMemcpyAsync(b.pool + std::size_t{c.dst[i]} * page_bytes, b.source + i * page_bytes, page_bytes,
                            cudaMemcpyDeviceToHost, b.stream),
            "cudaMemcpyAsync");
    check(cudaStreamSynchronize(b.stream), "cudaStreamSynchronize");
  };
  verify("per-page cudaMemcpyAsync", c, per_page);
  r.per_page_ms = mean_wall_ms(per_page);
  std::vector<void*> dsts(pages);
  std::vector<const void*> srcs(pages);
  std::vector<std::size_t> sizes(pages, page_bytes);
  for (std::size_t i = 0; i < pages; ++i) {
    dsts[i] = b.pool + std::size_t{c.dst[i]} * page_bytes;
    srcs[i] = b.source + i * page_bytes;
  }
  constexpr cudaMemcpyKind kD2H = cudaMemcpyDeviceToHost;
  r.batch_ms = -1;
  if (memcpy_batch_works(dsts, srcs, sizes, kD2H, b.stream)) {
    auto batch = [&] {
      check(memcpy_batch(dsts, srcs, sizes, kD2H, b.stream), "cudaMemcpyBatchAsync");
      check(cudaStreamSynchronize(b.stream), "cudaStreamSynchronize");
    };
    verify("cudaMemcpyBatchAsync", c, batch);
    r.batch_ms = mean_wall_ms(batch);
  }
  return cache.emplace(key, r).first->second;
}

std::size_t page_bytes_of(const benchmark::State& state) { return static_cast<std::size_t>(state.range(0)) << 10; }

// range(0): page KB; range(1): scatter workers.
void run_save(benchmark::State& state, std::uint32_t pages) {
  const std::size_t page_bytes = page_bytes_of(state);
  const auto workers = static_cast<std::uint32_t>(state.range(1));
  Buffers& b = buffers();
  const Case c = make_case(pages, page_bytes);
  const std::size_t bytes = c.bytes.size();
  check(cudaMemcpyAsync(b.source, c.bytes.data(), bytes, cudaMemcpyHostToDevice, b.stream), "cudaMemcpyAsync");
  check(cudaStreamSynchronize(b.stream), "cudaStreamSynchronize");
  const CopyReferences& ref = references(c);

  // Both staging slots sized for the save up front: nothing is allocated in the timed loop.
  sparsekv::FlashD2HSaver saver(sparsekv::FlashD2HSaverConfig{workers, 2, bytes});
  saver.set_destination(destination(page_bytes));
  auto save = [&] { saver.wait(saver.save(b.source, bytes, c.targets, b.stream)); };
  verify("FlashD2HSaver", c, save);
  save();  // the second staging slot's first save
  double total_ms = 0;
  for (auto _ : state) {
    const double ms = wall_ms(save);
    state.SetIterationTime(ms * 1e-3);
    total_ms += ms;
  }
  const double ms = total_ms / double(state.iterations());
  state.counters["pages"] = pages;
  set_copy_counters(state, double(bytes), ms, ref, pcie_reference().d2h_gbps);
}

void BM_SaveDecodePages(benchmark::State& state) { run_save(state, kDecodePages); }

void BM_SavePrefillLayer(benchmark::State& state) {
  run_save(state, static_cast<std::uint32_t>(kPrefillBytes / page_bytes_of(state)));
}

BENCHMARK(BM_SaveDecodePages)
    ->ArgsProduct({{2, 4, 8, 16, 32}, {1, 2, 4}})
    ->ArgNames({"page_kb", "workers"})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);

BENCHMARK(BM_SavePrefillLayer)
    ->ArgsProduct({{2, 4, 8, 16, 32}, {1, 2, 4}})
    ->ArgNames({"page_kb", "workers"})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);

}  // namespace

int main(int argc, char** argv) { return sparsekv::bench::run_benchmarks(argc, argv, report_pcie_reference); }
