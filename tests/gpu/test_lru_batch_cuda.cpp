// The Select -> LRU glue (build_lru_batch) chained into bucketed_lru_step and
// accumulate_step_stats on one stream, nothing read on the host in between,
// against the host path: BucketedLru::check's page counts, the token counts,
// BucketedLru::step's plan, stats and tables, the stats summed with +=. The
// tables are pinned host memory read through UVA or replicated in device
// memory (GpuTablesReplica); the chained step is also captured once in a CUDA
// graph and replayed; bad arguments are refused before anything is enqueued.
#include <catch2/catch.hpp>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <random>
#include <vector>

#include "bucketed_lru_test_data.hpp"
#include "lru_batch_test_data.hpp"
#include "gpu_support.hpp"
#include "sparsekv/cache/bucketed_lru.hpp"
#include "sparsekv/cache/bucketed_lru_cuda.hpp"
#include "sparsekv/cache/lru_batch_cuda.hpp"
#include "sparsekv/metadata/gpu_tables_replica.hpp"
#include "sparsekv/metadata/hierarchical_page_table.hpp"
#include "sparsekv/buffer/transfer_replica_copy.hpp"
#include "sparsekv/transfer/page_transfer_cuda.hpp"

using namespace sparsekv;
using namespace sparsekv::gpu_test;
using namespace sparsekv::test;

namespace {

// Device buffers of one chained step for `rows` rows of `max_selected`
// selections and at most `max_pages` pages each, allocated once: a captured
// graph keeps the pointers.
struct DeviceStepInput {
  DeviceStepInput(std::uint32_t rows, std::uint32_t max_selected, std::uint32_t max_pages)
      : rows(rows),
        max_selected(max_selected),
        select_selected(std::size_t{rows} * max_selected),
        select_counts(rows),
        instances(rows),
        selection_offsets(std::size_t{rows} + 1),
        page_offsets(std::size_t{rows} + 1),
        partition_tokens(std::size_t{rows} * max_selected),
        selected(std::size_t{rows} * max_selected),
        workspace(cuda::lru_batch_workspace_bytes(rows)),
        partition_offsets(std::size_t{rows} * max_selected + 1),
        gpu_pages(std::size_t{rows} * max_pages),
        copy_cpu(std::size_t{rows} * max_pages),
        copy_gpu(std::size_t{rows} * max_pages),
        stats(rows) {}

  // Uploads Select's output and sentinel-filled glue outputs.
  void load(const FixedStride& f) {
    REQUIRE(f.counts.size() == rows);
    REQUIRE(f.max_selected == max_selected);
    copy(select_selected, f.selected);
    copy(select_counts, f.counts);
    copy(instances, f.instances);
    const LruBatchArrays sentinels(rows, max_selected);
    copy(selection_offsets, sentinels.selection_offsets);
    copy(page_offsets, sentinels.page_offsets);
    copy(partition_tokens, sentinels.partition_tokens);
    copy(selected, sentinels.selected);
    check(cudaDeviceSynchronize());  // pageable copies may still be landing; the launches run on another stream
  }
  template <class T>
  static void copy(DeviceArray<T>& to, const std::vector<T>& from) {
    REQUIRE(from.size() <= to.capacity);
    if (!from.empty()) check(cudaMemcpy(to.data, from.data(), from.size() * sizeof(T), cudaMemcpyHostToDevice));
  }

  cuda::LruBatchInput input() const {
    return {rows, max_selected, select_selected.data, select_counts.data, instances.data};
  }
  cuda::LruBatchOutput output() const {
    return {selection_offsets.data, selected.data, page_offsets.data, partition_tokens.data};
  }
  // Glue, LRU step, stats into `total`: what one layer's step enqueues.
  void enqueue(const TwoLevelView<GpuPageEntry>& slots, const PartitionLookup& lookup, std::uint32_t buckets,
               CacheStepStats* total, cudaStream_t stream) const {
    cuda::build_lru_batch(lookup, input(), output(), workspace.data, workspace.size, stream);
    const cuda::LruStepOutput out{partition_offsets.data, gpu_pages.data, copy_cpu.data, copy_gpu.data, stats.data};
    cuda::bucketed_lru_step(slots, lookup, cuda::lru_step_batch(input(), output(), nullptr), out, buckets, stream);
    cuda::accumulate_step_stats(stats.data, rows, total, stream);
  }

  LruBatchArrays download_glue() const {
    LruBatchArrays a(rows, max_selected);
    a.selection_offsets = selection_offsets.download(std::size_t{rows} + 1);
    a.page_offsets = page_offsets.download(std::size_t{rows} + 1);
    a.selected = selected.download(std::size_t{rows} * max_selected);
    a.partition_tokens = partition_tokens.download(std::size_t{rows} * max_selected);
    return a;
  }
  // The LRU step's outputs, sized by the host reference; each head's copies
  // only up to its miss count (the rest of its region is never written).
  LaunchOutput download_lru(const HostStepBatch& host) const {
    LaunchOutput got;
    got.partition_offsets = partition_offsets.download(host.selected_all.size() + 1);
    got.gpu_pages = gpu_pages.download(host.page_offsets.back());
    got.stats = stats.download(rows);
    got.copy_cpu_pages.assign(host.page_offsets.back(), kInvalidPage);
    got.copy_gpu_pages.assign(host.page_offsets.back(), kInvalidPage);
    for (std::size_t h = 0; h < rows; ++h) {
      REQUIRE(got.stats[h].miss_pages <= host.page_offsets[h + 1] - host.page_offsets[h]);
      copy_cpu.download_into(got.copy_cpu_pages, host.page_offsets[h], got.stats[h].miss_pages);
      copy_gpu.download_into(got.copy_gpu_pages, host.page_offsets[h], got.stats[h].miss_pages);
    }
    return got;
  }

  std::uint32_t rows, max_selected;
  DeviceArray<PartitionId> select_selected;
  DeviceArray<std::uint32_t> select_counts;
  DeviceArray<std::size_t> instances;
  DeviceArray<std::uint32_t> selection_offsets, page_offsets, partition_tokens;
  DeviceArray<PartitionId> selected;
  DeviceArray<std::byte> workspace;
  DeviceArray<std::uint32_t> partition_offsets;
  DeviceArray<PageId> gpu_pages, copy_cpu, copy_gpu;
  DeviceArray<CacheStepStats> stats;
};

// Both tables built alike: the host's (the reference) and the kernels' in
// pinned memory, optionally replicated in device memory.
struct Tables {
  Tables(std::uint32_t seed, bool replicate)
      : host(emulation_geometry(), plain, plain), gpu(emulation_geometry(), pinned, pinned) {
    build_emulation_table(host, seed);
    build_emulation_table(gpu, seed);
    const PageTableGeometry& g = host.geometry();
    for (RequestId r = 0; r < g.max_requests; ++r) {
      for (std::uint32_t l = 0; l < g.layers; ++l)
        for (std::uint32_t h = 0; h < g.kv_heads; ++h) all.push_back({r * 10 + 3, l, h});
    }
    if (!replicate) return;
    replica.emplace(gpu, device, replica_copy);
    for (RequestId r = 0; r < g.max_requests; ++r) replica->upload(gpu, r * 10 + 3, replica_copy);
    transfer.synchronize();
  }
  TwoLevelView<GpuPageEntry> slots() const { return replica ? replica->gpu_page_view() : gpu.gpu_page_view(); }
  PartitionLookup lookup() const { return replica ? replica->lookup(gpu) : gpu.lookup(); }
  // The kernels' tables equal the host's (after bringing a replica's back).
  void require_same() {
    if (replica) {
      for (RequestId r = 0; r < host.geometry().max_requests; ++r) replica->download(gpu, r * 10 + 3, replica_copy);
    }
    for (const Head& h : all) require_same_head(host, gpu, h);
    gpu.validate();
  }

  HostMemoryResource plain{false};
  HostMemoryResource pinned;  // the kernels read and write it through UVA
  DeviceMemoryResource device;
  cuda::DevicePageTransfer transfer;
  TransferReplicaCopy replica_copy{transfer};
  HierarchicalPageTable host, gpu;
  std::optional<GpuTablesReplica> replica;
  std::vector<Head> all;
};

// The host path of one step over `heads`: check and step per head, the tokens of each selection.
struct HostStep {
  HostStepBatch batch;
  std::vector<std::vector<PartitionId>> rows;
  std::vector<std::uint32_t> tokens;
};

HostStep host_step(Tables& t, BucketedLru& lru, const std::vector<Head>& heads, std::mt19937& rng) {
  HostStep s;
  const double hit_share = std::uniform_real_distribution<double>(0.2, 0.95)(rng);
  for (const Head& h : heads) {
    s.rows.push_back(random_selection(t.host, h, rng, hit_share));
    for (PartitionId p : s.rows.back()) s.tokens.push_back(t.host.meta(h.request, h.layer, h.head, p).token_count());
    s.batch.add(lru, t.host, t.gpu, h, s.rows.back());
  }
  return s;
}

void require_same_step(const DeviceStepInput& d, const HostStep& s, const CacheStepStats& host_total,
                       const DeviceArray<CacheStepStats>& total, LruTotals& totals) {
  require_same_csr(d.download_glue(), s.batch.selection_offsets, s.batch.selected_all, s.batch.page_offsets, s.tokens);
  require_same_launch(d.download_lru(s.batch), s.batch, totals);
  require_same_stats(total.download(1)[0], host_total);
}

}  // namespace

TEST_CASE("build_lru_batch chained into bucketed_lru_step and accumulate_step_stats matches the host path",
          "[gpu][lru]") {
  const std::uint32_t bucket_choices[] = {2, 8, 64, 256};
  LruTotals totals;
  Stream stream;
  for (std::uint32_t seed = 1; seed <= 4; ++seed) {
    // Odd seeds: tables in pinned memory through UVA; even seeds: replicated in device memory.
    Tables t(seed, seed % 2 == 0);
    const std::uint32_t buckets = bucket_choices[seed - 1];
    BucketedLru lru(buckets);
    std::mt19937 rng(seed * 7717);
    DeviceArray<CacheStepStats> total(std::vector<CacheStepStats>(1));
    CacheStepStats host_total;
    for (int step = 0; step < 30; ++step) {
      std::vector<Head> heads = t.all;
      std::shuffle(heads.begin(), heads.end(), rng);
      heads.resize(1 + rng() % heads.size());
      const HostStep s = host_step(t, lru, heads, rng);
      for (const CacheStepStats& h : s.batch.host_stats) host_total += h;
      const std::uint32_t max_selected = longest_row(s.rows) + static_cast<std::uint32_t>(rng() % 4);
      DeviceStepInput d(static_cast<std::uint32_t>(heads.size()), max_selected,
                        t.host.geometry().max_gpu_pages_per_head);
      d.load(fixed_stride(s.rows, s.batch.instances, max_selected, rng));
      d.enqueue(t.slots(), t.lookup(), buckets, total.data, stream.stream);
      check(cudaStreamSynchronize(stream.stream));

      INFO("seed " << seed << " step " << step << " rows " << heads.size() << " max_selected " << max_selected);
      require_same_step(d, s, host_total, total, totals);
      t.require_same();
    }
  }
  REQUIRE(totals.hits > 500);
  REQUIRE(totals.misses > 500);
  REQUIRE(totals.evicted > 100);
}

TEST_CASE("build_lru_batch chained into the LRU step, captured once, replays new selections", "[gpu][lru]") {
  constexpr std::uint32_t kBuckets = 64;
  Tables t(5, true);
  BucketedLru lru(kBuckets);
  std::mt19937 rng(5 * 7717);
  const PageTableGeometry& g = t.host.geometry();
  const auto rows = static_cast<std::uint32_t>(t.all.size());
  // Capacities: any selection of a head fits.
  DeviceStepInput d(rows, g.max_partitions_per_head, g.max_gpu_pages_per_head);
  DeviceArray<CacheStepStats> total(std::vector<CacheStepStats>(1));
  CacheStepStats host_total;
  LruTotals totals;
  Stream stream;
  const auto next_step = [&] {
    std::vector<Head> heads = t.all;
    std::shuffle(heads.begin(), heads.end(), rng);  // each replay's rows in a new order: the instances are device data
    HostStep s = host_step(t, lru, heads, rng);
    for (const CacheStepStats& h : s.batch.host_stats) host_total += h;
    d.load(fixed_stride(s.rows, s.batch.instances, d.max_selected, rng));
    return s;
  };
  // A first step outside the capture: the warm-up reads and writes what a real step does.
  {
    const HostStep s = next_step();
    d.enqueue(t.slots(), t.lookup(), kBuckets, total.data, stream.stream);
    check(cudaStreamSynchronize(stream.stream));
    require_same_step(d, s, host_total, total, totals);
    t.require_same();
  }
  cudaGraph_t graph = nullptr;
  check(cudaStreamBeginCapture(stream.stream, cudaStreamCaptureModeThreadLocal));
  d.enqueue(t.slots(), t.lookup(), kBuckets, total.data, stream.stream);
  check(cudaStreamEndCapture(stream.stream, &graph));
  cudaGraphExec_t exec = nullptr;
  check(cudaGraphInstantiate(&exec, graph, 0));
  for (int replay = 0; replay < 30; ++replay) {
    INFO("replay " << replay);
    const HostStep s = next_step();
    check(cudaGraphLaunch(exec, stream.stream));
    check(cudaStreamSynchronize(stream.stream));
    require_same_step(d, s, host_total, total, totals);
    t.require_same();
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  REQUIRE(totals.hits > 100);
  REQUIRE(totals.misses > 100);
}

TEST_CASE("build_lru_batch and accumulate_step_stats refuse bad arguments before launching", "[gpu][lru]") {
  HostMemoryResource pinned;
  HierarchicalPageTable table(emulation_geometry(), pinned, pinned);
  const PartitionLookup lookup = table.lookup();
  DeviceStepInput d(4, 8, 8);
  const auto run = [&](const PartitionLookup& l, const cuda::LruBatchInput& in, const cuda::LruBatchOutput& out,
                       std::size_t workspace_bytes) {
    return code_of([&] { cuda::build_lru_batch(l, in, out, d.workspace.data, workspace_bytes, nullptr); });
  };
  const std::size_t bytes = d.workspace.size;
  PartitionLookup no_tokens = lookup;
  no_tokens.page_tokens = 0;
  REQUIRE(run(no_tokens, d.input(), d.output(), bytes) == ErrorCode::invalid_argument);
  cuda::LruBatchInput in = d.input();
  in.rows = 0x80000000u;
  in.max_selected = 1;
  REQUIRE(run(lookup, in, d.output(), bytes) == ErrorCode::invalid_argument);
  in = d.input();
  in.rows = 1u << 16;
  in.max_selected = 1u << 16;  // offsets past 32 bits
  REQUIRE(run(lookup, in, d.output(), bytes) == ErrorCode::invalid_argument);
  in = d.input();
  in.selected_count = nullptr;
  REQUIRE(run(lookup, in, d.output(), bytes) == ErrorCode::invalid_argument);
  cuda::LruBatchOutput out = d.output();
  out.partition_tokens = nullptr;
  REQUIRE(run(lookup, d.input(), out, bytes) == ErrorCode::invalid_argument);
  REQUIRE(run(lookup, d.input(), d.output(), bytes - 1) == ErrorCode::invalid_argument);
  // Nothing to do: no launch, no error, whatever the pointers.
  cuda::build_lru_batch(lookup, cuda::LruBatchInput{}, cuda::LruBatchOutput{}, nullptr, 0, nullptr);

  DeviceArray<CacheStepStats> total(1);
  REQUIRE(code_of([&] { cuda::accumulate_step_stats(d.stats.data, 4, nullptr, nullptr); }) ==
          ErrorCode::invalid_argument);
  REQUIRE(code_of([&] { cuda::accumulate_step_stats(nullptr, 4, total.data, nullptr); }) ==
          ErrorCode::invalid_argument);
  cuda::accumulate_step_stats(nullptr, 0, total.data, nullptr);
  check(cudaDeviceSynchronize());
}
