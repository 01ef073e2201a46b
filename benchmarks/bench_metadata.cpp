// Cost of the two-level indirection (Spin §5.4) on the Retrieve lookup path:
// resolving selected partitions to CPU page ids through PartitionLookup,
// against the same lookups in flat arrays (the reference, measured in the same
// run). Prints ns per page and the ratio to flat as counters.
#include <benchmark/benchmark.h>

#include <chrono>
#include <random>
#include <vector>

#include "sparsekv/metadata/hierarchical_page_table.hpp"

namespace {

constexpr std::uint32_t kPartitions = 16384;  // 128K tokens in 8-token pages
constexpr std::uint32_t kSelected = 256;      // a 2K-token budget

struct Setup {
  sparsekv::HostMemoryResource memory{false};
  sparsekv::HierarchicalPageTable table;
  std::vector<std::uint32_t> flat_offsets;
  std::vector<sparsekv::PageId> flat_pages;
  std::vector<sparsekv::PartitionId> selected;
  std::size_t instance;

  static sparsekv::PageTableGeometry geometry() {
    sparsekv::PageTableGeometry g;
    g.max_requests = 1;
    g.layers = 1;
    g.kv_heads = 1;
    g.page_tokens = 8;
    g.max_partitions_per_head = g.max_cpu_pages_per_head = kPartitions;
    g.max_gpu_pages_per_head = 1024;
    g.segment_entries = 256;
    g.meta_segments = g.offset_segments = g.cpu_page_segments = kPartitions / 256;
    g.gpu_page_segments = 4;
    return g;
  }

  Setup() : table(geometry(), memory, memory) {
    table.add_request(0);
    std::mt19937 rng(1);
    std::vector<std::uint32_t> tokens(kPartitions, 8);
    std::vector<sparsekv::PageId> pages(kPartitions);
    for (auto& p : pages) p = rng() % 1000000;
    table.append_partitions(0, 0, 0, tokens, pages);
    flat_pages = pages;
    for (std::uint32_t p = 0; p < kPartitions; ++p) flat_offsets.push_back(p);
    for (std::uint32_t i = 0; i < kSelected; ++i) selected.push_back(rng() % kPartitions);
    instance = table.instance(0, 0, 0);
  }
};

Setup& setup() {
  static Setup s;
  return s;
}

void lookup_flat(const Setup& s, std::vector<sparsekv::PageId>& out) {
  for (std::uint32_t i = 0; i < kSelected; ++i) out[i] = s.flat_pages[s.flat_offsets[s.selected[i]]];
  benchmark::DoNotOptimize(out.data());
}

// ns per page of the flat reference, timed here so every ratio uses this run's machine state.
double flat_ns_per_page() {
  Setup& s = setup();
  std::vector<sparsekv::PageId> out(kSelected);
  constexpr int kRounds = 200000;
  const auto start = std::chrono::steady_clock::now();
  for (int r = 0; r < kRounds; ++r) lookup_flat(s, out);
  const std::chrono::duration<double, std::nano> elapsed = std::chrono::steady_clock::now() - start;
  return elapsed.count() / (double(kRounds) * kSelected);
}

void report(benchmark::State& state, double ns_per_page) {
  state.counters["ns_per_page"] = ns_per_page;
  state.counters["ratio_to_flat"] = ns_per_page / flat_ns_per_page();
}

void BM_LookupFlat(benchmark::State& state) {
  Setup& s = setup();
  std::vector<sparsekv::PageId> out(kSelected);
  const auto start = std::chrono::steady_clock::now();
  for (auto _ : state) lookup_flat(s, out);
  const std::chrono::duration<double, std::nano> elapsed = std::chrono::steady_clock::now() - start;
  report(state, elapsed.count() / (double(state.iterations()) * kSelected));
}

void BM_LookupTwoLevel(benchmark::State& state) {
  Setup& s = setup();
  const sparsekv::PartitionLookup lookup = s.table.lookup();
  std::vector<sparsekv::PageId> out(kSelected);
  const auto start = std::chrono::steady_clock::now();
  for (auto _ : state) {
    for (std::uint32_t i = 0; i < kSelected; ++i) lookup.copy_pages(s.instance, s.selected[i], &out[i]);
    benchmark::DoNotOptimize(out.data());
  }
  const std::chrono::duration<double, std::nano> elapsed = std::chrono::steady_clock::now() - start;
  report(state, elapsed.count() / (double(state.iterations()) * kSelected));
}

BENCHMARK(BM_LookupFlat);
BENCHMARK(BM_LookupTwoLevel);

}  // namespace

BENCHMARK_MAIN();
