#pragma once
// Random selections, a launch's batch built beside the host BucketedLru::step
// reference, and the comparisons, shared by the host emulation of the
// bucketed-LRU kernel (test_bucketed_lru_rules.cpp) and the kernel's GPU test
// (gpu/test_bucketed_lru_cuda.cpp).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <random>
#include <vector>

#include "sparsekv/cache/bucketed_lru.hpp"
#include "sparsekv/metadata/hierarchical_page_table.hpp"

namespace sparsekv::test {

struct Head {
  RequestId request;
  std::uint32_t layer;
  std::uint32_t head;
};

// A head's resident and non-resident partitions, each in random order.
struct Candidates {
  std::vector<PartitionId> resident, other;
};

inline Candidates shuffled_candidates(const HierarchicalPageTable& table, const Head& h, std::mt19937& rng) {
  const std::uint32_t count = table.partition_count(h.request, h.layer, h.head);
  Candidates c;
  for (PartitionId p = 0; p < count; ++p) {
    (table.meta(h.request, h.layer, h.head, p).resident() ? c.resident : c.other).push_back(p);
  }
  std::shuffle(c.resident.begin(), c.resident.end(), rng);
  std::shuffle(c.other.begin(), c.other.end(), rng);
  return c;
}

// Distinct candidates whose pages fit `limit`, each drawn from the resident
// ones with probability `hit_share` (hit ratio around that share), in at most
// `max_tries` draws.
inline std::vector<PartitionId> pick_selection(const HierarchicalPageTable& table, const Head& h, const Candidates& c,
                                               std::uint32_t limit, std::uint32_t max_tries, std::mt19937& rng,
                                               double hit_share) {
  std::vector<PartitionId> selected;
  std::uint32_t pages = 0;
  std::size_t ri = 0, oi = 0;
  std::bernoulli_distribution pick_resident(hit_share);
  for (std::uint32_t tries = 0; tries < max_tries && (ri < c.resident.size() || oi < c.other.size()); ++tries) {
    const bool from_resident = oi == c.other.size() || (ri < c.resident.size() && pick_resident(rng));
    const PartitionId p = from_resident ? c.resident[ri++] : c.other[oi++];
    const std::uint32_t n = table.page_count(h.request, h.layer, h.head, p);
    if (pages + n > limit) continue;
    pages += n;
    selected.push_back(p);
  }
  return selected;
}

// One launch's batch, laid out as bucketed_lru_cuda.hpp documents, built
// head by head while the host step runs on the host table: the reference.
struct HostStepBatch {
  std::vector<std::size_t> instances;
  std::vector<std::uint32_t> selection_offsets{0}, page_offsets{0};
  std::vector<PartitionId> selected_all;
  std::uint32_t max_selection = 0;
  RetrievedPages retrieved;
  std::vector<CacheStepStats> host_stats;

  // Steps `h` on `host_table`; the launch addresses `launch_table`'s instance.
  void add(BucketedLru& lru, HierarchicalPageTable& host_table, const HierarchicalPageTable& launch_table,
           const Head& h, const std::vector<PartitionId>& selected) {
    const std::uint32_t slots = host_table.gpu_slots(h.request, h.layer, h.head);
    const std::uint32_t pages = lru.check(host_table, h.request, h.layer, h.head, selected, slots);
    host_stats.push_back(lru.step(host_table, h.request, h.layer, h.head, selected, retrieved));
    instances.push_back(launch_table.instance(h.request, h.layer, h.head));
    selected_all.insert(selected_all.end(), selected.begin(), selected.end());
    selection_offsets.push_back(static_cast<std::uint32_t>(selected_all.size()));
    page_offsets.push_back(page_offsets.back() + pages);
    max_selection = std::max(max_selection, static_cast<std::uint32_t>(selected.size()));
  }
};

// Outputs of one launch, laid out as bucketed_lru_cuda.hpp documents.
struct LaunchOutput {
  std::vector<std::uint32_t> partition_offsets;
  std::vector<PageId> gpu_pages, copy_cpu_pages, copy_gpu_pages;
  std::vector<CacheStepStats> stats;
};

struct LruTotals {
  std::uint64_t evicted = 0, hits = 0, misses = 0;
};

// The launch's outputs equal the host steps' pages and stats; adds the host stats to `totals`.
inline void require_same_launch(const LaunchOutput& out, const HostStepBatch& batch, LruTotals& totals) {
  const RetrievedPages& pages = batch.retrieved;
  REQUIRE(out.partition_offsets == pages.partition_offsets);
  REQUIRE(out.gpu_pages == pages.gpu_pages);
  std::size_t copy = 0;
  for (std::size_t h = 0; h < batch.host_stats.size(); ++h) {
    INFO("head " << h);
    const CacheStepStats& want = batch.host_stats[h];
    REQUIRE(out.stats[h].hit_partitions == want.hit_partitions);
    REQUIRE(out.stats[h].miss_partitions == want.miss_partitions);
    REQUIRE(out.stats[h].hit_pages == want.hit_pages);
    REQUIRE(out.stats[h].miss_pages == want.miss_pages);
    REQUIRE(out.stats[h].evicted_pages == want.evicted_pages);
    for (std::uint64_t c = 0; c < out.stats[h].miss_pages; ++c, ++copy) {
      REQUIRE(copy < pages.copies.size());
      REQUIRE(out.copy_cpu_pages[batch.page_offsets[h] + c] == pages.copies[copy].cpu_page);
      REQUIRE(out.copy_gpu_pages[batch.page_offsets[h] + c] == pages.copies[copy].gpu_page);
    }
    totals.evicted += want.evicted_pages;
    totals.hits += want.hit_partitions;
    totals.misses += want.miss_partitions;
  }
  REQUIRE(copy == pages.copies.size());
}

// The head's GPU page entries (the first `a`'s slot count) and meta entries equal in both tables.
inline void require_same_head(const HierarchicalPageTable& a, const HierarchicalPageTable& b, const Head& h) {
  const std::uint32_t slots = a.gpu_slots(h.request, h.layer, h.head);
  for (std::uint32_t s = 0; s < slots; ++s) {
    const GpuPageEntry x = a.gpu_entry(h.request, h.layer, h.head, s);
    const GpuPageEntry y = b.gpu_entry(h.request, h.layer, h.head, s);
    INFO("request " << h.request << " layer " << h.layer << " head " << h.head << " slot " << s);
    REQUIRE(x.partition == y.partition);
    REQUIRE(x.gpu_page == y.gpu_page);
    REQUIRE(x.page_in_partition == y.page_in_partition);
    REQUIRE(x.timestamp == y.timestamp);
    REQUIRE(x.reserved == y.reserved);
  }
  const std::uint32_t partitions = a.partition_count(h.request, h.layer, h.head);
  for (PartitionId p = 0; p < partitions; ++p) {
    REQUIRE(a.meta(h.request, h.layer, h.head, p).bits == b.meta(h.request, h.layer, h.head, p).bits);
  }
}

// The small page table the host emulations of the LRU kernel step over:
// several segments per head, so that the views' segment walk matters.
inline constexpr std::uint32_t kEmulationPageTokens = 4;

inline PageTableGeometry emulation_geometry() {
  PageTableGeometry g;
  g.max_requests = 2;
  g.layers = 2;
  g.kv_heads = 3;
  g.page_tokens = kEmulationPageTokens;
  g.max_partitions_per_head = 160;
  g.max_cpu_pages_per_head = 160 * 3;
  g.max_gpu_pages_per_head = 96;
  g.segment_entries = 32;  // several segments per head: the views' segment walk matters
  const auto instances = static_cast<std::uint32_t>(g.instances());
  g.meta_segments = g.offset_segments = instances * 5;
  g.cpu_page_segments = instances * 15;
  g.gpu_page_segments = instances * 3;
  return g;
}

// Random requests, partitions of 1..3 pages, empty buffers of varied sizes;
// the same seed builds the same table.
inline void build_emulation_table(HierarchicalPageTable& table, std::uint32_t seed) {
  std::mt19937 rng(seed);
  const PageTableGeometry& g = table.geometry();
  PageId next_cpu = 0;
  PageId next_gpu = 0;
  for (RequestId r = 0; r < g.max_requests; ++r) {
    table.add_request(r * 10 + 3);
    for (std::uint32_t l = 0; l < g.layers; ++l) {
      for (std::uint32_t h = 0; h < g.kv_heads; ++h) {
        std::vector<std::uint32_t> tokens(20 + rng() % 140);
        std::vector<PageId> pages;
        for (auto& t : tokens) {
          t = 1 + rng() % (3 * kEmulationPageTokens);
          for (std::uint32_t i = 0; i < pages_for_tokens(t, kEmulationPageTokens); ++i)
            pages.push_back(next_cpu++ * 31 % 100003);
        }
        table.append_partitions(r * 10 + 3, l, h, tokens, pages);
        const std::uint32_t slots = 4 + rng() % 93;
        table.resize_gpu_slots(r * 10 + 3, l, h, slots);
        for (std::uint32_t s = 0; s < slots; ++s) {
          table.set_gpu_entry(r * 10 + 3, l, h, s, {kInvalidPartition, next_gpu++ * 7 % 65521, 0, 0, 0});
        }
      }
    }
  }
}

// A selection of distinct partitions whose pages fit the head's slots, biased
// towards resident partitions (hit ratio around the given share).
inline std::vector<PartitionId> random_selection(const HierarchicalPageTable& table, const Head& h, std::mt19937& rng,
                                                 double hit_share) {
  const std::uint32_t slots = table.gpu_slots(h.request, h.layer, h.head);
  const Candidates candidates = shuffled_candidates(table, h, rng);
  const std::uint32_t limit = rng() % (slots + 1);
  return pick_selection(table, h, candidates, limit, 400, rng, hit_share);
}

}  // namespace sparsekv::test
