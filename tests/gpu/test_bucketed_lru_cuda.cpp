// The bucketed-LRU kernel (Spin §5.3) against BucketedLru::step: two tables
// built with the same calls, the host step on one (plain host memory), the
// kernel on the other (pinned host memory read and written through UVA),
// many consecutive multi-head steps; every GPU page entry, meta entry, output
// page id, copy and stat must be identical after every step.
#include <catch2/catch.hpp>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <functional>
#include <numeric>
#include <random>
#include <vector>

#include "sparsekv/cache/bucketed_lru.hpp"
#include "sparsekv/cache/bucketed_lru_cuda.hpp"
#include "sparsekv/metadata/hierarchical_page_table.hpp"

using namespace sparsekv;

namespace {

void check(cudaError_t status) {
  INFO(cudaGetErrorString(status));
  REQUIRE(status == cudaSuccess);
}

// A device array that grows on demand (contents are not kept).
template <class T>
struct DeviceArray {
  T* data = nullptr;
  std::size_t capacity = 0;
  DeviceArray() = default;
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  ~DeviceArray() { cudaFree(data); }
  T* reserve(std::size_t n) {
    n = std::max<std::size_t>(n, 1);
    if (n > capacity) {
      check(cudaFree(data));
      data = nullptr;
      void* p = nullptr;
      check(cudaMalloc(&p, n * sizeof(T)));
      data = static_cast<T*>(p);
      capacity = n;
    }
    return data;
  }
  T* upload(const std::vector<T>& values) {
    reserve(values.size());
    if (!values.empty()) check(cudaMemcpy(data, values.data(), values.size() * sizeof(T), cudaMemcpyHostToDevice));
    return data;
  }
  std::vector<T> download(std::size_t n) const {
    std::vector<T> values(n);
    if (n > 0) check(cudaMemcpy(values.data(), data, n * sizeof(T), cudaMemcpyDeviceToHost));
    return values;
  }
};

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
          for (std::uint32_t i = 0; i < pages_for_tokens(t, kPageTokens); ++i) pages.push_back(next_cpu++ * 13 % 1000003);
        }
        table.append_partitions(r, l, h, tokens, pages);
        const std::uint32_t slots = big ? 2560 : 4 + rng() % 697;
        table.resize_gpu_slots(r, l, h, slots);
        for (std::uint32_t s = 0; s < slots; ++s) table.set_gpu_entry(r, l, h, s, {kInvalidPartition, next_gpu++, 0, 0, 0});
      }
    }
  }
}

struct Head {
  RequestId request;
  std::uint32_t layer;
  std::uint32_t head;
};

// Distinct partitions that fit `limit` pages, about `hit_share` of them resident.
std::vector<PartitionId> random_selection(const HierarchicalPageTable& table, const Head& h, std::uint32_t limit,
                                          std::mt19937& rng, double hit_share) {
  const std::uint32_t count = table.partition_count(h.request, h.layer, h.head);
  std::vector<PartitionId> resident, other;
  for (PartitionId p = 0; p < count; ++p) {
    (table.meta(h.request, h.layer, h.head, p).resident() ? resident : other).push_back(p);
  }
  std::shuffle(resident.begin(), resident.end(), rng);
  std::shuffle(other.begin(), other.end(), rng);
  std::vector<PartitionId> selected;
  std::uint32_t pages = 0;
  std::size_t ri = 0, oi = 0;
  std::bernoulli_distribution pick_resident(hit_share);
  for (std::uint32_t tries = 0; tries < 2 * count && (ri < resident.size() || oi < other.size()); ++tries) {
    const bool from_resident = oi == other.size() || (ri < resident.size() && pick_resident(rng));
    const PartitionId p = from_resident ? resident[ri++] : other[oi++];
    const std::uint32_t n = table.page_count(h.request, h.layer, h.head, p);
    if (pages + n > limit) continue;
    pages += n;
    selected.push_back(p);
  }
  return selected;
}

ErrorCode code_of(const std::function<void()>& call) {
  try {
    call();
  } catch (const Error& e) {
    return e.code();
  }
  FAIL("no sparsekv::Error thrown");
  return ErrorCode::invalid_argument;
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

  std::uint64_t evicted = 0, hits = 0, misses = 0, big_steps = 0;
  const std::uint32_t bucket_choices[] = {2, 3, 8, 64, 256};
  for (std::uint32_t seed = 1; seed <= 5; ++seed) {
    const std::uint32_t buckets = bucket_choices[seed - 1];
    HierarchicalPageTable host_table(geometry(), plain, plain);
    HierarchicalPageTable gpu_table(geometry(), pinned, pinned);
    build(host_table, seed);
    build(gpu_table, seed);
    BucketedLru lru(buckets);
    std::mt19937 rng(seed * 104729);
    std::vector<Head> all;
    for (RequestId r : {RequestId{7}, kBigRequest, RequestId{3}}) {
      for (std::uint32_t l = 0; l < 2; ++l) {
        for (std::uint32_t h = 0; h < 4; ++h) all.push_back({r, l, h});
      }
    }
    for (int step = 0; step < 24; ++step) {
      std::vector<Head> heads = all;
      std::shuffle(heads.begin(), heads.end(), rng);
      heads.resize(1 + rng() % heads.size());
      const double hit_share = std::uniform_real_distribution<double>(0.3, 0.95)(rng);
      std::vector<std::size_t> instances;
      std::vector<std::uint32_t> selection_offsets{0}, page_offsets{0};
      std::vector<PartitionId> selected_all;
      std::uint32_t max_selection = 0;
      RetrievePlan plan;
      std::vector<CacheStepStats> host_stats;
      for (const Head& h : heads) {
        const std::uint32_t slots = host_table.gpu_slots(h.request, h.layer, h.head);
        const bool big = h.request == kBigRequest && h.layer == 0 && h.head == 0;
        // The big head alternates between the shared-memory and the scratch path.
        const std::uint32_t limit = big && step % 2 == 0 ? 2100 + rng() % (slots - 2099) : rng() % (slots + 1);
        const std::vector<PartitionId> selected = random_selection(host_table, h, limit, rng, hit_share);
        const std::uint32_t pages = lru.check(host_table, h.request, h.layer, h.head, selected, slots);
        host_stats.push_back(lru.step(host_table, h.request, h.layer, h.head, selected, plan));
        instances.push_back(gpu_table.instance(h.request, h.layer, h.head));
        selected_all.insert(selected_all.end(), selected.begin(), selected.end());
        selection_offsets.push_back(static_cast<std::uint32_t>(selected_all.size()));
        page_offsets.push_back(page_offsets.back() + pages);
        max_selection = std::max(max_selection, static_cast<std::uint32_t>(selected.size()));
      }
      if (max_selection > cuda::kLruSharedSelection) ++big_steps;

      cuda::LruStepBatch batch;
      batch.heads = static_cast<std::uint32_t>(heads.size());
      batch.instances = d_instances.upload(instances);
      batch.selection_offsets = d_selection_offsets.upload(selection_offsets);
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
      cuda::bucketed_lru_step(gpu_table.gpu_page_view(), gpu_table.lookup(), batch, out, buckets, nullptr);
      check(cudaDeviceSynchronize());

      INFO("seed " << seed << " step " << step << " buckets " << buckets << " heads " << heads.size());
      REQUIRE(d_partition_offsets.download(selected_all.size() + 1) == plan.partition_offsets);
      REQUIRE(d_gpu_pages.download(page_offsets.back()) == plan.gpu_pages);
      const auto stats = d_stats.download(heads.size());
      const auto copy_cpu = d_copy_cpu.download(page_offsets.back());
      const auto copy_gpu = d_copy_gpu.download(page_offsets.back());
      std::size_t copy = 0;
      for (std::size_t h = 0; h < heads.size(); ++h) {
        INFO("head " << h);
        REQUIRE(stats[h].hit_partitions == host_stats[h].hit_partitions);
        REQUIRE(stats[h].miss_partitions == host_stats[h].miss_partitions);
        REQUIRE(stats[h].hit_pages == host_stats[h].hit_pages);
        REQUIRE(stats[h].miss_pages == host_stats[h].miss_pages);
        REQUIRE(stats[h].evicted_pages == host_stats[h].evicted_pages);
        for (std::uint64_t c = 0; c < stats[h].miss_pages; ++c, ++copy) {
          REQUIRE(copy < plan.copies.size());
          REQUIRE(copy_cpu[page_offsets[h] + c] == plan.copies[copy].cpu_page);
          REQUIRE(copy_gpu[page_offsets[h] + c] == plan.copies[copy].gpu_page);
        }
        evicted += host_stats[h].evicted_pages;
        hits += host_stats[h].hit_partitions;
        misses += host_stats[h].miss_partitions;
      }
      REQUIRE(copy == plan.copies.size());
      for (const Head& h : all) {
        const std::uint32_t slots = host_table.gpu_slots(h.request, h.layer, h.head);
        for (std::uint32_t s = 0; s < slots; ++s) {
          const GpuPageEntry x = host_table.gpu_entry(h.request, h.layer, h.head, s);
          const GpuPageEntry y = gpu_table.gpu_entry(h.request, h.layer, h.head, s);
          INFO("request " << h.request << " layer " << h.layer << " head " << h.head << " slot " << s);
          REQUIRE(x.partition == y.partition);
          REQUIRE(x.gpu_page == y.gpu_page);
          REQUIRE(x.page_in_partition == y.page_in_partition);
          REQUIRE(x.timestamp == y.timestamp);
          REQUIRE(x.reserved == y.reserved);
        }
        const std::uint32_t partitions = host_table.partition_count(h.request, h.layer, h.head);
        for (PartitionId p = 0; p < partitions; ++p) {
          REQUIRE(host_table.meta(h.request, h.layer, h.head, p).bits ==
                  gpu_table.meta(h.request, h.layer, h.head, p).bits);
        }
      }
      gpu_table.validate();
    }
  }
  REQUIRE(evicted > 1000);
  REQUIRE(hits > 1000);
  REQUIRE(misses > 1000);
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
