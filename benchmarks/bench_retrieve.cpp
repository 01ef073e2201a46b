// Retrieve bookkeeping per (layer, kv head) step (Spin §5.3): bucketed LRU
// (hit/miss, timestamps, histogram, threshold, eviction, admission, output
// page ids and copy list) against exact LRU (std::list + hash map), on a GPU
// buffer of 1K, 8K and 64K pages filled to Spin's default shape: mandatory
// pages = buffer / 6 (minimum buffering 5x mandatory), selections from the
// synthetic locality generator. Each run prints ns per step, ns per buffer
// page and the exact-LRU / bucketed ratio measured in the same process.
#include <benchmark/benchmark.h>

#include <chrono>
#include <map>

#include "research/selection_trace.hpp"
#include "sparsekv/cache/bucketed_lru.hpp"
#include "sparsekv/cache/exact_lru.hpp"

namespace {

using sparsekv::PartitionId;

struct Workload {
  std::uint32_t buffer_pages;
  std::vector<std::uint32_t> partition_pages;
  std::vector<std::vector<PartitionId>> steps;
};

const Workload& workload(std::uint32_t buffer_pages) {
  static std::map<std::uint32_t, Workload> cache;
  auto it = cache.find(buffer_pages);
  if (it != cache.end()) return it->second;
  sparsekv::SyntheticTraceOptions o;
  o.layers = o.kv_heads = 1;
  o.steps = 256;
  o.selected = buffer_pages / 6;
  o.partitions = buffer_pages * 8;  // the context is 8x the buffer
  const sparsekv::SelectionTrace trace = sparsekv::synthetic_selection_trace(o);
  return cache.emplace(buffer_pages, Workload{buffer_pages, trace.partition_pages[0], trace.head_selections(0)})
      .first->second;
}

// Mean ns per step of `policy` replaying the workload `rounds` times.
template <class Step>
double ns_per_step(const Workload& w, int rounds, Step&& step) {
  const auto start = std::chrono::steady_clock::now();
  for (int r = 0; r < rounds; ++r)
    for (const auto& sel : w.steps) step(sel);
  const std::chrono::duration<double, std::nano> elapsed = std::chrono::steady_clock::now() - start;
  return elapsed.count() / (double(rounds) * w.steps.size());
}

double exact_lru_ns(const Workload& w) {
  static std::map<std::uint32_t, double> measured;
  if (!measured.contains(w.buffer_pages)) {
    sparsekv::ExactLru lru(w.buffer_pages);
    measured[w.buffer_pages] = ns_per_step(w, 4, [&](const auto& sel) { lru.step(sel, w.partition_pages); });
  }
  return measured[w.buffer_pages];
}

void report(benchmark::State& state, const Workload& w, double ns) {
  state.counters["ns_per_step"] = ns;
  state.counters["ns_per_buffer_page"] = ns / w.buffer_pages;
  state.counters["ns_per_selected_page"] = ns / (w.buffer_pages / 6);
  state.counters["exact_lru_over_this"] = exact_lru_ns(w) / ns;
}

void BM_BucketedLruStep(benchmark::State& state) {
  const Workload& w = workload(static_cast<std::uint32_t>(state.range(0)));
  sparsekv::BucketedLruCache cache(w.buffer_pages, w.partition_pages);
  std::size_t i = 0;
  const auto start = std::chrono::steady_clock::now();
  for (auto _ : state) benchmark::DoNotOptimize(cache.step(w.steps[i++ % w.steps.size()]));
  const std::chrono::duration<double, std::nano> elapsed = std::chrono::steady_clock::now() - start;
  report(state, w, elapsed.count() / double(state.iterations()));
}

void BM_ExactLruStep(benchmark::State& state) {
  const Workload& w = workload(static_cast<std::uint32_t>(state.range(0)));
  sparsekv::ExactLru lru(w.buffer_pages);
  std::size_t i = 0;
  const auto start = std::chrono::steady_clock::now();
  for (auto _ : state) benchmark::DoNotOptimize(lru.step(w.steps[i++ % w.steps.size()], w.partition_pages));
  const std::chrono::duration<double, std::nano> elapsed = std::chrono::steady_clock::now() - start;
  report(state, w, elapsed.count() / double(state.iterations()));
}

BENCHMARK(BM_BucketedLruStep)->Arg(1024)->Arg(8192)->Arg(65536);
BENCHMARK(BM_ExactLruStep)->Arg(1024)->Arg(8192)->Arg(65536);

}  // namespace

BENCHMARK_MAIN();
