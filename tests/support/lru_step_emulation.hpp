#pragma once
// The bucketed-LRU kernel's decomposition (cache_kernels.cu) in plain C++,
// shared by the host emulations that chain into it: the LRU rules' own
// (test_bucketed_lru_rules.cpp) and the Select -> LRU glue's
// (test_lru_batch_rules.cpp).
#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <utility>
#include <vector>

#include "bucketed_lru_test_data.hpp"
#include "sparsekv/cache/bucketed_lru_rules.hpp"
#include "sparsekv/metadata/partition_lookup.hpp"

namespace sparsekv::test {

// A selection sorted by partition id, beside each entry's index in the
// selection: what lru_find_selection searches.
struct SortedSelection {
  std::vector<PartitionId> sorted;
  std::vector<std::uint32_t> indices;
};

inline SortedSelection sort_selection(const PartitionId* selected, std::uint32_t n) {
  std::vector<std::pair<PartitionId, std::uint32_t>> pairs;
  for (std::uint32_t i = 0; i < n; ++i) pairs.push_back({selected[i], i});
  std::sort(pairs.begin(), pairs.end());
  SortedSelection s;
  for (auto [p, i] : pairs) {
    s.sorted.push_back(p);
    s.indices.push_back(i);
  }
  return s;
}

// The kernel's decomposition in plain C++: every head independently
// (blocks), each phase's per-element work in a random order (threads run in
// any order), cross-element order only through exclusive scans, eviction and
// admission in tiles of `tile` slots.
inline void emulate_lru_step(const TwoLevelView<GpuPageEntry>& slots, const PartitionLookup& lookup,
                             std::uint32_t buckets, const std::vector<std::size_t>& instances,
                             const std::vector<std::uint32_t>& selection_offsets,
                             const std::vector<PartitionId>& selected_all,
                             const std::vector<std::uint32_t>& page_offsets, std::uint32_t tile, std::mt19937& rng,
                             LaunchOutput& out) {
  const auto& meta = lookup.meta;
  const std::uint8_t top = lru_top(buckets);
  const std::size_t heads = instances.size();
  out.partition_offsets.assign(selection_offsets.back() + 1, 0xdeadbeefu);
  out.gpu_pages.assign(page_offsets.back(), kInvalidPage - 1);
  out.copy_cpu_pages.assign(page_offsets.back(), kInvalidPage - 1);
  out.copy_gpu_pages.assign(page_offsets.back(), kInvalidPage - 1);
  out.stats.assign(heads, {});
  out.partition_offsets[selection_offsets.back()] = page_offsets.back();
  const auto shuffled = [&](std::uint32_t n) {
    std::vector<std::uint32_t> order(n);
    std::iota(order.begin(), order.end(), 0u);
    std::shuffle(order.begin(), order.end(), rng);
    return order;
  };
  for (std::size_t head = 0; head < heads; ++head) {
    const std::size_t inst = instances[head];
    const std::uint32_t first = selection_offsets[head];
    const std::uint32_t n = selection_offsets[head + 1] - first;
    const PartitionId* selected = selected_all.data() + first;
    std::uint32_t* offsets = out.partition_offsets.data() + first;
    const std::uint32_t page_base = page_offsets[head];

    // 0. Sorted selection.
    const SortedSelection by_id = sort_selection(selected, n);
    const auto selection_of = [&](PartitionId p) {
      return lru_find_selection(by_id.sorted.data(), by_id.indices.data(), n, p);
    };

    // 1. Hit/miss, scans over page counts and misses.
    std::vector<std::uint32_t> pages(n), is_miss(n), miss_pages(n);
    for (std::uint32_t i : shuffled(n)) {
      const MetaPartitionEntry m = *meta.find(inst, selected[i]);
      pages[i] = pages_for_tokens(m.token_count(), lookup.page_tokens);
      is_miss[i] = m.resident() ? 0 : 1;
      miss_pages[i] = is_miss[i] ? pages[i] : 0;
    }
    std::vector<std::uint32_t> at(n), rank(n), miss_at(n);
    std::exclusive_scan(pages.begin(), pages.end(), at.begin(), 0u);
    std::exclusive_scan(is_miss.begin(), is_miss.end(), rank.begin(), 0u);
    std::exclusive_scan(miss_pages.begin(), miss_pages.end(), miss_at.begin(), 0u);
    const std::uint32_t total_pages = std::accumulate(pages.begin(), pages.end(), 0u);
    const std::uint32_t misses = std::accumulate(is_miss.begin(), is_miss.end(), 0u);
    const std::uint32_t demand = std::accumulate(miss_pages.begin(), miss_pages.end(), 0u);
    std::vector<std::uint32_t> miss_starts(misses), miss_selection(misses);
    for (std::uint32_t i : shuffled(n)) {
      offsets[i] = page_base + at[i];
      if (is_miss[i]) {
        miss_starts[rank[i]] = miss_at[i];
        miss_selection[rank[i]] = i;
      }
    }

    // 2. Timestamps and histogram, slots in any order.
    const std::uint32_t length = slots.length(inst);
    std::vector<std::uint32_t> histogram(buckets, 0);
    std::uint32_t free_slots = 0;
    for (std::uint32_t s : shuffled(length)) {
      GpuPageEntry* e = slots.find(inst, s);
      const std::uint32_t sel = e->occupied() ? selection_of(e->partition) : kNotSelected;
      switch (lru_touch(*e, sel, top)) {
        case LruTouch::free:
          ++free_slots;
          break;
        case LruTouch::hit:
          out.gpu_pages[offsets[sel] + e->page_in_partition] = e->gpu_page;
          break;
        case LruTouch::aged:
          ++histogram[e->timestamp];
          break;
      }
    }

    // 3. Threshold; 3+4. eviction and tiled admission.
    const int threshold = lru_threshold(histogram.data(), buckets, demand, free_slots);
    std::uint32_t evicted = 0;
    if (demand > 0) {
      std::uint32_t admitted = 0;
      for (std::uint32_t base = 0; base < length; base += tile) {
        const std::uint32_t width = std::min(tile, length - base);
        for (std::uint32_t t : shuffled(width)) {
          GpuPageEntry* e = slots.find(inst, base + t);
          if (lru_may_evict(*e, threshold) && lru_evicts(*e, selection_of(e->partition), threshold)) {
            lru_evict(*e, *meta.find(inst, e->partition));
            ++evicted;
          }
        }
        if (admitted >= demand) continue;
        std::vector<std::uint32_t> free_flag(width), k(width);
        for (std::uint32_t t = 0; t < width; ++t) free_flag[t] = slots.find(inst, base + t)->occupied() ? 0 : 1;
        std::exclusive_scan(free_flag.begin(), free_flag.end(), k.begin(), admitted);
        for (std::uint32_t t : shuffled(width)) {
          if (!free_flag[t] || k[t] >= demand) continue;
          GpuPageEntry* e = slots.find(inst, base + t);
          const LruAdmission a = lru_admission(k[t], miss_starts.data(), misses);
          const std::uint32_t i = miss_selection[a.miss];
          const PartitionId p = selected[i];
          lru_admit(*e, p, a.page, top);
          out.gpu_pages[offsets[i] + a.page] = e->gpu_page;
          out.copy_cpu_pages[page_base + k[t]] = *lookup.cpu_pages.find(inst, *lookup.offsets.find(inst, p) + a.page);
          out.copy_gpu_pages[page_base + k[t]] = e->gpu_page;
          MetaPartitionEntry& m = *meta.find(inst, p);
          if (a.page + 1 == pages_for_tokens(m.token_count(), lookup.page_tokens)) lru_set_resident(m);
        }
        admitted += std::accumulate(free_flag.begin(), free_flag.end(), 0u);
      }
    }
    CacheStepStats& stats = out.stats[head];
    stats.hit_partitions = n - misses;
    stats.miss_partitions = misses;
    stats.hit_pages = total_pages - demand;
    stats.miss_pages = demand;
    stats.evicted_pages = evicted;
  }
}

}  // namespace sparsekv::test
