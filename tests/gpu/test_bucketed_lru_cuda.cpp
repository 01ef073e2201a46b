// The bucketed-LRU kernel (Spin §5.3) against BucketedLru::step: two tables
// built with the same calls, the host step on one (plain host memory), the
// kernel on the other (pinned host memory read and written through UVA, or
// its GPU-side tables replicated in device memory),
// many consecutive multi-head steps; every GPU page entry, meta entry, output
// page id, copy and stat must be identical after every step.
#include <catch2/catch.hpp>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <numeric>
#include <optional>
#include <random>
#include <vector>

#include "bucketed_lru_test_data.hpp"
#include "gpu_support.hpp"
#include "sparsekv/cache/bucketed_lru.hpp"
#include "sparsekv/cache/bucketed_lru_cuda.hpp"
#include "sparsekv/metadata/gpu_tables_replica.hpp"
#include "sparsekv/metadata/hierarchical_page_table.hpp"
#include "sparsekv/buffer/transfer_replica_copy.hpp"
#include "sparsekv/transfer/page_transfer_cuda.hpp"

using namespace sparsekv;
using namespace sparsekv::gpu_test;
using namespace sparsekv::test;

namespace {

constexpr std::uint32_t kPageTokens = 8;
constexpr RequestId kBigRequest = 100;  // its (layer 0, head 0) selects more than kLruSharedSelection

PageTableGeometry geometry() {
  PageTableGeometry g;
  g.max_requests = 3;
  g.layers = 2;
  g.kv_heads = 4;
  g.page_tokens = kPageTokens;
  g.max_partitions_per_head = 3072;
  g.max_cpu_pages_per_head = 3072 * 4;
  g.max_gpu_pages_per_head = 2560;
  g.segment_entries = 64;
  const auto instances = static_cast<std::uint32_t>(g.instances());
  g.meta_segments = g.offset_segments = instances * 48;
  g.cpu_page_segments = instances * 192;
  g.gpu_page_segments = instances * 40;
  return g;
}

// Requests with random partitions (1..4 pages) and empty GPU buffers of 4 to
// 700 slots (several scan tiles); the big head has 3000 one-page partitions
// and 2560 slots. The same seed builds the same table.
void build(HierarchicalPageTable& table, std::uint32_t seed) {
  std::mt19937 rng(seed);
  const PageTableGeometry& g = table.geometry();
  PageId next_cpu = 0;
  PageId next_gpu = 0;
  const RequestId requests[] = {7, kBigRequest, 3};
  for (RequestId r : requests) {
    table.add_request(r);
    for (std::uint32_t l = 0; l < g.layers; ++l) {
      for (std::uint32_t h = 0; h < g.kv_heads; ++h) {
        const bool big = r == kBigRequest && l == 0 && h == 0;
        std::vector<std::uint32_t> tokens(big ? 3000 : 30 + rng() % 600);
        std::vector<PageId> pages;
        for (auto& t : tokens) {
          t = big ? 1 + rng() % kPageTokens : 1 + rng() % (4 * kPageTokens);
          for (std::uint32_t i = 0; i < pages_for_tokens(t, kPageTokens); ++i)
            pages.push_back(next_cpu++ * 13 % 1000003);
        }
        table.append_partitions(r, l, h, tokens, pages);
        const std::uint32_t slots = big ? 2560 : 4 + rng() % 697;
        table.resize_gpu_slots(r, l, h, slots);
        for (std::uint32_t s = 0; s < slots; ++s)
          table.set_gpu_entry(r, l, h, s, {kInvalidPartition, next_gpu++, 0, 0, 0});
      }
    }
  }
}

// Distinct partitions that fit `limit` pages, about `hit_share` of them resident.
std::vector<PartitionId> random_selection(const HierarchicalPageTable& table, const Head& h, std::uint32_t limit,
                                          std::mt19937& rng, double hit_share) {
  const std::uint32_t count = table.partition_count(h.request, h.layer, h.head);
  const Candidates candidates = shuffled_candidates(table, h, rng);
  return pick_selection(table, h, candidates, limit, 2 * count, rng, hit_share);
}

}  // namespace

TEST_CASE("bucketed_lru_step matches BucketedLru::step bit for bit", "[gpu][lru]") {
  HostMemoryResource plain(false);
  HostMemoryResource pinned;  // pinned: the kernel reads and writes the tables through UVA
  REQUIRE(pinned.kind() == MemoryKind::pinned_host);
  DeviceArray<std::size_t> d_instances;
  DeviceArray<std::uint32_t> d_selection_offsets, d_page_offsets, d_scratch, d_partition_offsets;
  DeviceArray<PartitionId> d_selected;
  DeviceArray<PageId> d_gpu_pages, d_copy_cpu, d_copy_gpu;
  DeviceArray<CacheStepStats> d_stats;

  LruTotals totals;
  std::uint64_t big_steps = 0;
  const std::uint32_t bucket_choices[] = {2, 3, 8, 64, 256};
  DeviceMemoryResource device;
  cuda::DevicePageTransfer transfer;
  TransferReplicaCopy replica_copy(transfer);
  // Odd seeds: the kernel reads the tables in pinned memory through UVA; even
  // seeds: the GPU-side tables replicated in device memory (Spin §5.2's tier
  // split, GpuTablesReplica), brought back to the host table every step.
  for (std::uint32_t seed = 1; seed <= 5; ++seed) {
    const std::uint32_t buckets = bucket_choices[seed - 1];
    HierarchicalPageTable host_table(geometry(), plain, plain);
    HierarchicalPageTable gpu_table(geometry(), pinned, pinned);
    build(host_table, seed);
    build(gpu_table, seed);
    std::optional<GpuTablesReplica> replica;
    const RequestId requests[] = {7, kBigRequest, 3};
    if (seed % 2 == 0) {
      replica.emplace(gpu_table, device, replica_copy);
      for (RequestId r : requests) replica->upload(gpu_table, r, replica_copy);
      transfer.synchronize();
    }
    BucketedLru lru(buckets);
    std::mt19937 rng(seed * 104729);
    std::vector<Head> all;
    for (RequestId r : requests) {
      for (std::uint32_t l = 0; l < 2; ++l) {
        for (std::uint32_t h = 0; h < 4; ++h) all.push_back({r, l, h});
      }
    }
    for (int step = 0; step < 24; ++step) {
      std::vector<Head> heads = all;
      std::shuffle(heads.begin(), heads.end(), rng);
      heads.resize(1 + rng() % heads.size());
      const double hit_share = std::uniform_real_distribution<double>(0.3, 0.95)(rng);
      HostStepBatch host;
      for (const Head& h : heads) {
        const std::uint32_t slots = host_table.gpu_slots(h.request, h.layer, h.head);
        const bool big = h.request == kBigRequest && h.layer == 0 && h.head == 0;
        // The big head alternates between the shared-memory and the scratch path.
        const std::uint32_t limit = big && step % 2 == 0 ? 2100 + rng() % (slots - 2099) : rng() % (slots + 1);
        host.add(lru, host_table, gpu_table, h, random_selection(host_table, h, limit, rng, hit_share));
      }
      const std::uint32_t max_selection = host.max_selection;
      const std::vector<PartitionId>& selected_all = host.selected_all;
      const std::vector<std::uint32_t>& page_offsets = host.page_offsets;
      if (max_selection > cuda::kLruSharedSelection) ++big_steps;

      cuda::LruStepBatch batch;
      batch.heads = static_cast<std::uint32_t>(heads.size());
      batch.instances = d_instances.upload(host.instances);
      batch.selection_offsets = d_selection_offsets.upload(host.selection_offsets);
      batch.selected = d_selected.upload(selected_all);
      batch.page_offsets = d_page_offsets.upload(page_offsets);
      batch.max_selection = max_selection;
      batch.scratch = max_selection > cuda::kLruSharedSelection ? d_scratch.reserve(4 * selected_all.size()) : nullptr;
      cuda::LruStepOutput out;
      out.partition_offsets = d_partition_offsets.reserve(selected_all.size() + 1);
      out.gpu_pages = d_gpu_pages.reserve(page_offsets.back());
      out.copy_cpu_pages = d_copy_cpu.reserve(page_offsets.back());
      out.copy_gpu_pages = d_copy_gpu.reserve(page_offsets.back());
      out.stats = d_stats.reserve(heads.size());
      if (replica) {
        cuda::bucketed_lru_step(replica->gpu_page_view(), replica->lookup(gpu_table), batch, out, buckets, nullptr);
        check(cudaDeviceSynchronize());
        for (RequestId r : requests) replica->download(gpu_table, r, replica_copy);
      } else {
        cuda::bucketed_lru_step(gpu_table.gpu_page_view(), gpu_table.lookup(), batch, out, buckets, nullptr);
        check(cudaDeviceSynchronize());
      }

      INFO("seed " << seed << " step " << step << " buckets " << buckets << " heads " << heads.size());
      LaunchOutput got;
      got.partition_offsets = d_partition_offsets.download(selected_all.size() + 1);
      got.gpu_pages = d_gpu_pages.download(page_offsets.back());
      got.stats = d_stats.download(heads.size());
      // Head h's copies are the first stats[h].miss_pages entries of its region; the rest is never written.
      got.copy_cpu_pages.assign(page_offsets.back(), kInvalidPage);
      got.copy_gpu_pages.assign(page_offsets.back(), kInvalidPage);
      for (std::size_t h = 0; h < heads.size(); ++h) {
        REQUIRE(got.stats[h].miss_pages <= page_offsets[h + 1] - page_offsets[h]);
        d_copy_cpu.download_into(got.copy_cpu_pages, page_offsets[h], got.stats[h].miss_pages);
        d_copy_gpu.download_into(got.copy_gpu_pages, page_offsets[h], got.stats[h].miss_pages);
      }
      require_same_launch(got, host, totals);
      for (const Head& h : all) require_same_head(host_table, gpu_table, h);
      gpu_table.validate();
    }
  }
  REQUIRE(totals.evicted > 1000);
  REQUIRE(totals.hits > 1000);
  REQUIRE(totals.misses > 1000);
  REQUIRE(big_steps > 5);  // the scratch path ran
}

TEST_CASE("bucketed_lru_step refuses bad arguments before launching", "[gpu][lru]") {
  HostMemoryResource pinned;
  PageTableGeometry g = geometry();
  HierarchicalPageTable table(g, pinned, pinned);
  DeviceArray<std::size_t> d_instances;
  DeviceArray<std::uint32_t> d_offsets;
  DeviceArray<PartitionId> d_selected;
  DeviceArray<PageId> d_pages;
  DeviceArray<CacheStepStats> d_stats;
  cuda::LruStepBatch batch;
  batch.heads = 1;
  batch.instances = d_instances.reserve(1);
  batch.selection_offsets = d_offsets.reserve(4);
  batch.page_offsets = d_offsets.data + 2;
  batch.selected = d_selected.reserve(1);
  batch.max_selection = 1;
  cuda::LruStepOutput out;
  out.partition_offsets = d_offsets.data;
  out.gpu_pages = out.copy_cpu_pages = out.copy_gpu_pages = d_pages.reserve(4);
  out.stats = d_stats.reserve(1);
  const auto run = [&](cuda::LruStepBatch b, cuda::LruStepOutput o, std::uint32_t buckets) {
    return code_of([&] { cuda::bucketed_lru_step(table.gpu_page_view(), table.lookup(), b, o, buckets, nullptr); });
  };
  REQUIRE(run(batch, out, 1) == ErrorCode::invalid_argument);
  REQUIRE(run(batch, out, 257) == ErrorCode::invalid_argument);
  cuda::LruStepBatch b = batch;
  b.instances = nullptr;
  REQUIRE(run(b, out, 64) == ErrorCode::invalid_argument);
  b = batch;
  b.max_selection = cuda::kLruSharedSelection + 1;  // no scratch
  REQUIRE(run(b, out, 64) == ErrorCode::invalid_argument);
  cuda::LruStepOutput o = out;
  o.copy_gpu_pages = nullptr;
  REQUIRE(run(batch, o, 64) == ErrorCode::invalid_argument);
  b = batch;
  b.heads = 0;  // nothing to do: no launch, no error
  cuda::bucketed_lru_step(table.gpu_page_view(), table.lookup(), b, cuda::LruStepOutput{}, 64, nullptr);
  check(cudaDeviceSynchronize());
}
