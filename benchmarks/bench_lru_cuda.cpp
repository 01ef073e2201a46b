// Bucketed-LRU step kernel (Spin §5.3): one launch over 64K, 256K, 1M and 4M
// GPU page entries in total (64 x 1024, 256 x 1024, 512 x 2048 and
// 1024 x 4096 heads x slots). Every buffer is full (one-page partitions,
// timestamps uniform in [0, 64)) and each head selects slots / 8 partitions,
// 80% of them resident, so every head evicts and admits. The tables live in
// device memory: built on the host, then their directories, lengths and
// segment pools copied to device buffers that TwoLevelView copies point at.
//
// Each launch (timed alone with cudaEvents, on tables restored from a
// pristine device copy beforehand, behind a pad copy so that the launch
// latency is not timed) is reported as bytes touched / time:
// every GPU page entry read and written once (12 + 12 B: every occupied
// entry's timestamp changes and DRAM writes whole sectors), the selected
// partitions' meta entries read, the misses' and evicted partitions' meta
// entries written, partition offsets and CPU page ids of the miss pages read,
// the selection and per-head arrays read, and the outputs (partition offsets,
// page ids, copies, stats) written. `over_d2d` is its ratio to a 256 MiB
// device-to-device cudaMemcpyAsync measured in the same run (read + write
// bytes / time); the target is >= 0.5. The first launch of each size is
// checked against the host BucketedLru (stats and output page ids).
//
// Without a CUDA device it prints "SKIPPED: no CUDA device" and exits 0.
#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <vector>

#include "cuda_bench_support.hpp"
#include "sparsekv/cache/bucketed_lru.hpp"
#include "sparsekv/cache/bucketed_lru_cuda.hpp"
#include "sparsekv/metadata/hierarchical_page_table.hpp"

namespace {

using namespace sparsekv;
using namespace sparsekv::bench;

constexpr std::uint32_t kBuckets = 64;
constexpr std::uint32_t kPageTokens = 16;
constexpr std::uint32_t kKvHeads = 8;

// A table's view with directory, lengths and segment pool copied to device memory.
template <class Entry>
TwoLevelView<Entry> mirror(const TwoLevelView<Entry>& v, std::size_t instances, std::uint32_t pool_segments,
                           std::size_t& segment_bytes) {
  segment_bytes = (std::size_t{pool_segments} << v.segment_shift) * sizeof(Entry);
  TwoLevelView<Entry> d = v;
  d.directory = device_copy(v.directory, instances * v.directory_length);
  d.lengths = device_copy(v.lengths, instances);
  d.segments = device_copy(v.segments, segment_bytes / sizeof(Entry));
  return d;
}

// One size: the device tables, a pristine copy of the two tables the step
// writes, the batch and its outputs.
struct Setup {
  std::uint32_t heads = 0, slots = 0;
  TwoLevelView<GpuPageEntry> gpu_pages{};
  PartitionLookup lookup{};
  std::size_t gpu_bytes = 0, meta_bytes = 0;
  GpuPageEntry* gpu_pristine = nullptr;
  MetaPartitionEntry* meta_pristine = nullptr;
  cuda::LruStepBatch batch;
  cuda::LruStepOutput out;
  std::uint32_t selected = 0, pages = 0;
  double bytes_touched = 0;
  double hit_ratio = 0;
  std::uint64_t evicted = 0;
};

std::unique_ptr<Setup> make_setup(std::uint32_t heads, std::uint32_t slots) {
  auto s = std::make_unique<Setup>();
  s->heads = heads;
  s->slots = slots;
  const std::uint32_t partitions = 2 * slots;
  PageTableGeometry g;
  g.max_requests = 1;
  g.layers = heads / kKvHeads;
  g.kv_heads = kKvHeads;
  g.page_tokens = kPageTokens;
  g.max_partitions_per_head = partitions;
  g.max_cpu_pages_per_head = partitions;
  g.max_gpu_pages_per_head = slots;
  g.segment_entries = 256;
  g.meta_segments = g.offset_segments = g.cpu_page_segments = heads * (partitions / 256);
  g.gpu_page_segments = heads * (slots / 256);
  HostMemoryResource memory(false);
  HierarchicalPageTable table(g, memory, memory);
  table.add_request(0);
  std::mt19937 rng(heads * 31 + slots);
  std::vector<std::uint32_t> tokens(partitions, kPageTokens);
  std::vector<PageId> cpu(partitions);
  std::vector<std::vector<PartitionId>> selections(heads);
  for (std::uint32_t i = 0; i < heads; ++i) {
    const std::uint32_t layer = i / kKvHeads, head = i % kKvHeads;
    std::iota(cpu.begin(), cpu.end(), PageId{i * partitions});
    table.append_partitions(0, layer, head, tokens, cpu);
    table.resize_gpu_slots(0, layer, head, slots);
    std::vector<PartitionId> order(partitions);
    std::iota(order.begin(), order.end(), PartitionId{0});
    std::shuffle(order.begin(), order.end(), rng);
    for (std::uint32_t slot = 0; slot < slots; ++slot) {
      table.set_gpu_entry(0, layer, head, slot,
                          {order[slot], i * slots + slot, 0, static_cast<std::uint8_t>(rng() % kBuckets), 0});
      table.set_resident(0, layer, head, order[slot], true);
    }
    // slots / 8 partitions: 80% resident (order[0, slots)), 20% not (order[slots, 2 slots)).
    const std::uint32_t n = slots / 8, hits = n * 4 / 5;
    std::vector<PartitionId>& sel = selections[i];
    std::shuffle(order.begin(), order.begin() + slots, rng);
    std::shuffle(order.begin() + slots, order.end(), rng);
    sel.assign(order.begin(), order.begin() + hits);
    sel.insert(sel.end(), order.begin() + slots, order.begin() + slots + (n - hits));
    std::shuffle(sel.begin(), sel.end(), rng);
  }

  const std::size_t instances = g.instances();
  std::size_t offset_bytes = 0, cpu_bytes = 0;
  s->gpu_pages = mirror(table.gpu_page_view(), instances, g.gpu_page_segments, s->gpu_bytes);
  s->lookup.meta = mirror(table.meta_view(), instances, g.meta_segments, s->meta_bytes);
  s->lookup.offsets = mirror(table.offset_view(), instances, g.offset_segments, offset_bytes);
  s->lookup.cpu_pages = mirror(table.cpu_page_view(), instances, g.cpu_page_segments, cpu_bytes);
  s->lookup.page_tokens = kPageTokens;
  s->gpu_pristine = device_alloc<GpuPageEntry>(s->gpu_bytes / sizeof(GpuPageEntry));
  check(cudaMemcpy(s->gpu_pristine, s->gpu_pages.segments, s->gpu_bytes, cudaMemcpyDeviceToDevice), "cudaMemcpy");
  s->meta_pristine = device_alloc<MetaPartitionEntry>(s->meta_bytes / sizeof(MetaPartitionEntry));
  check(cudaMemcpy(s->meta_pristine, s->lookup.meta.segments, s->meta_bytes, cudaMemcpyDeviceToDevice), "cudaMemcpy");

  // The host step on the host table: the reference for the first launch.
  BucketedLru lru(kBuckets);
  RetrievedPages retrieved;
  CacheStepStats host_total;
  std::vector<std::size_t> inst(heads);
  std::vector<std::uint32_t> selection_offsets{0}, page_offsets{0};
  std::vector<PartitionId> selected;
  for (std::uint32_t i = 0; i < heads; ++i) {
    const std::uint32_t layer = i / kKvHeads, head = i % kKvHeads;
    inst[i] = table.instance(0, layer, head);
    const std::uint32_t pages = lru.check(table, 0, layer, head, selections[i], slots);
    host_total += lru.step(table, 0, layer, head, selections[i], retrieved);
    selected.insert(selected.end(), selections[i].begin(), selections[i].end());
    selection_offsets.push_back(static_cast<std::uint32_t>(selected.size()));
    page_offsets.push_back(page_offsets.back() + pages);
  }
  s->selected = static_cast<std::uint32_t>(selected.size());
  s->pages = page_offsets.back();
  s->batch.heads = heads;
  s->batch.instances = device_copy(inst.data(), inst.size());
  s->batch.selection_offsets = device_copy(selection_offsets.data(), selection_offsets.size());
  s->batch.selected = device_copy(selected.data(), selected.size());
  s->batch.page_offsets = device_copy(page_offsets.data(), page_offsets.size());
  s->batch.max_selection = slots / 8;  // <= kLruSharedSelection for every size here
  s->out.partition_offsets = device_alloc<std::uint32_t>(s->selected + 1);
  s->out.gpu_pages = device_alloc<PageId>(s->pages);
  s->out.copy_cpu_pages = device_alloc<PageId>(s->pages);
  s->out.copy_gpu_pages = device_alloc<PageId>(s->pages);
  s->out.stats = device_alloc<CacheStepStats>(heads);

  // One launch, checked against the host.
  cuda::bucketed_lru_step(s->gpu_pages, s->lookup, s->batch, s->out, kBuckets, nullptr);
  check(cudaDeviceSynchronize(), "bucketed_lru_step");
  CacheStepStats total;
  for (const CacheStepStats& st : host_copy(s->out.stats, heads)) total += st;
  if (total.hit_pages != host_total.hit_pages || total.miss_pages != host_total.miss_pages ||
      total.evicted_pages != host_total.evicted_pages || host_copy(s->out.gpu_pages, s->pages) != retrieved.gpu_pages) {
    std::fprintf(stderr, "bucketed_lru_step disagrees with the host step (%u heads x %u slots)\n", heads, slots);
    std::exit(1);
  }
  s->hit_ratio = total.hit_ratio();
  s->evicted = total.evicted_pages;
  // Evicted pages are one-page partitions here: one meta write each.
  const double entries = double(heads) * slots;
  s->bytes_touched = entries * 2 * sizeof(GpuPageEntry) + double(s->selected) * 4 /* meta read */ +
                     double(total.miss_partitions + total.evicted_pages) * 4 /* meta written */ +
                     double(total.miss_pages) * 8 /* offset + CPU page id */ + double(s->selected) * 4 /* ids */ +
                     double(heads) * (sizeof(std::size_t) + 8) /* instances, CSR, page offsets */ +
                     double(s->selected + 1) * 4 + double(s->pages) * 4 + double(total.miss_pages) * 8 +
                     double(heads) * sizeof(CacheStepStats);
  return s;
}

Setup& setup(std::uint32_t heads, std::uint32_t slots) {
  static std::map<std::pair<std::uint32_t, std::uint32_t>, std::unique_ptr<Setup>> cache;
  auto& s = cache[{heads, slots}];
  if (!s) s = make_setup(heads, slots);
  return *s;
}

// range(0): heads; range(1): slots per head.
void BM_LruStep(benchmark::State& state) {
  DeviceCopyTiming& t = device_copy_timing();
  Setup& s = setup(static_cast<std::uint32_t>(state.range(0)), static_cast<std::uint32_t>(state.range(1)));
  double total_ms = 0;
  for (auto _ : state) {
    check(cudaMemcpyAsync(s.gpu_pages.segments, s.gpu_pristine, s.gpu_bytes, cudaMemcpyDeviceToDevice, nullptr),
          "restore");
    check(cudaMemcpyAsync(s.lookup.meta.segments, s.meta_pristine, s.meta_bytes, cudaMemcpyDeviceToDevice, nullptr),
          "restore");
    t.pad();
    const float ms = elapsed_ms(
        t.events, nullptr, [&] { cuda::bucketed_lru_step(s.gpu_pages, s.lookup, s.batch, s.out, kBuckets, nullptr); });
    state.SetIterationTime(ms * 1e-3);
    total_ms += ms;
  }
  const double ms = total_ms / double(state.iterations());
  const double gbps = s.bytes_touched / (ms * 1e-3) / 1e9;
  state.counters["entries"] = double(s.heads) * s.slots;
  state.counters["MB_touched"] = s.bytes_touched / 1e6;
  state.counters["GBps"] = gbps;
  state.counters["d2d_GBps"] = t.d2d_gbps;
  state.counters["over_d2d"] = gbps / t.d2d_gbps;
  state.counters["hit_ratio"] = s.hit_ratio;
  state.counters["evicted"] = double(s.evicted);
}

BENCHMARK(BM_LruStep)
    ->Args({64, 1024})
    ->Args({256, 1024})
    ->Args({512, 2048})
    ->Args({1024, 4096})
    ->ArgNames({"heads", "slots"})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);

}  // namespace

int main(int argc, char** argv) { return sparsekv::bench::run_benchmarks(argc, argv); }
