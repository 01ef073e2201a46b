#include "sparsekv/cache/bucketed_lru.hpp"

#include <algorithm>
#include <numeric>

#include "sparsekv/cache/bucketed_lru_rules.hpp"
#include "sparsekv/core/error.hpp"

namespace sparsekv {

BucketedLru::BucketedLru(std::uint32_t timestamp_buckets) : buckets_(timestamp_buckets), histogram_(timestamp_buckets) {
  if (timestamp_buckets < kMinTimestampBuckets || timestamp_buckets > kMaxTimestampBuckets) {
    fail(ErrorCode::invalid_argument, "BucketedLru: timestamp_buckets ({}) must be in [{}, {}]", timestamp_buckets,
         kMinTimestampBuckets, kMaxTimestampBuckets);
  }
}

std::uint32_t BucketedLru::mark(std::span<const PartitionId> selected, std::uint32_t partitions) {
  if (selection_slot_.size() < partitions) selection_slot_.resize(partitions, 0);
  for (std::uint32_t i = 0; i < selected.size(); ++i) {
    const PartitionId p = selected[i];
    if (p >= partitions || selection_slot_[p] != 0) {
      // Undo the marks made so far: the scratch must stay clean for the next call.
      for (std::uint32_t j = 0; j < i; ++j) selection_slot_[selected[j]] = 0;
      if (p >= partitions) fail(ErrorCode::out_of_range, "selected partition {} out of range [0, {})", p, partitions);
      fail(ErrorCode::invalid_argument, "partition {} is selected twice", p);
    }
    selection_slot_[p] = i + 1;
  }
  return static_cast<std::uint32_t>(selected.size());
}

std::uint32_t BucketedLru::check(const HierarchicalPageTable& table, RequestId request, std::uint32_t layer,
                                 std::uint32_t head, std::span<const PartitionId> selected, std::uint32_t max_pages,
                                 bool cached) {
  const std::size_t inst = table.instance(request, layer, head);  // checks request, layer, head
  const auto meta = table.meta_view();
  const std::uint32_t page_tokens = table.geometry().page_tokens;
  mark(selected, meta.length(inst));
  std::uint64_t pages = 0;
  for (PartitionId p : selected) {
    pages += pages_for_tokens(meta.find(inst, p)->token_count(), page_tokens);
    selection_slot_[p] = 0;
  }
  if (pages > max_pages) {
    fail(ErrorCode::resource_exhausted, "head ({}, {}) of request {}: selection needs {} pages, the budget is {}",
         layer, head, request, pages, max_pages);
  }
  const std::uint32_t slots = table.gpu_slots(request, layer, head);
  if (cached && pages > slots) {
    fail(ErrorCode::resource_exhausted, "head ({}, {}) of request {}: selection needs {} pages, the buffer has {}",
         layer, head, request, pages, slots);
  }
  return static_cast<std::uint32_t>(pages);
}

CacheStepStats BucketedLru::step(HierarchicalPageTable& table, RequestId request, std::uint32_t layer,
                                 std::uint32_t head, std::span<const PartitionId> selected, RetrievedPages& result) {
  const std::size_t inst = table.instance(request, layer, head);
  const auto meta = table.meta_view();
  const auto slots = table.gpu_page_view();
  const PartitionLookup lookup = table.lookup();
  const std::uint8_t top = lru_top(buckets_);
  mark(selected, meta.length(inst));

  // 1. Hit/miss classification and the output layout.
  CacheStepStats stats;
  const std::size_t base = result.gpu_pages.size();
  const std::size_t first_offset = result.partition_offsets.size() - 1;
  std::uint32_t demand = 0;
  for (PartitionId p : selected) {
    const MetaPartitionEntry m = *meta.find(inst, p);
    const std::uint32_t pages = pages_for_tokens(m.token_count(), lookup.page_tokens);
    if (m.resident()) {
      ++stats.hit_partitions;
      stats.hit_pages += pages;
    } else {
      ++stats.miss_partitions;
      stats.miss_pages += pages;
      demand += pages;
    }
    result.partition_offsets.push_back(result.partition_offsets.back() + pages);
  }
  result.gpu_pages.resize(base + (result.partition_offsets.back() - result.partition_offsets[first_offset]));
  const auto out = [&](std::uint32_t selection_index, std::uint32_t page) -> PageId& {
    return result.gpu_pages[result.partition_offsets[first_offset + selection_index] + page];
  };

  // The selection index of an occupied slot's partition (selection_slot_ is 1-based, 0 = unselected).
  const auto selection_of = [&](const GpuPageEntry& e) {
    return e.occupied() && selection_slot_[e.partition] != 0 ? selection_slot_[e.partition] - 1 : kNotSelected;
  };

  // 2. Timestamp update and histogram in one pass; hits report their pages.
  std::fill(histogram_.begin(), histogram_.end(), 0u);
  std::uint32_t free_slots = 0;
  slots.for_each(inst, [&](GpuPageEntry& e, std::uint32_t) {
    const std::uint32_t sel = selection_of(e);
    switch (lru_touch(e, sel, top)) {
      case LruTouch::free:
        ++free_slots;
        break;
      case LruTouch::hit:
        out(sel, e.page_in_partition) = e.gpu_page;
        break;
      case LruTouch::aged:
        ++histogram_[e.timestamp];
        break;
    }
  });

  if (demand > 0) {
    // 3. The smallest threshold whose cumulative count covers the shortfall.
    const int threshold = lru_threshold(histogram_.data(), buckets_, demand, free_slots);
    // 3+4. Evict at or below the threshold and admit the misses into free
    // slots, both in ascending slot order, in one pass.
    std::uint32_t miss = 0;  // selection index of the partition being admitted
    std::uint32_t page = 0;
    const auto next_miss = [&] {
      while (miss < selected.size() && meta.find(inst, selected[miss])->resident()) ++miss;
    };
    next_miss();
    slots.for_each(inst, [&](GpuPageEntry& e, std::uint32_t) {
      if (lru_evicts(e, selection_of(e), threshold)) {
        lru_evict(e, *meta.find(inst, e.partition));
        ++stats.evicted_pages;
      }
      if (e.occupied() || miss >= selected.size()) return;
      const PartitionId p = selected[miss];
      MetaPartitionEntry& m = *meta.find(inst, p);
      lru_admit(e, p, page, top);
      out(miss, page) = e.gpu_page;
      result.copies.push_back({*lookup.cpu_pages.find(inst, *lookup.offsets.find(inst, p) + page), e.gpu_page});
      if (++page == pages_for_tokens(m.token_count(), lookup.page_tokens)) {
        // Marked resident only after its last page: the scan above still sees it as a miss.
        lru_set_resident(m);
        page = 0;
        ++miss;
        next_miss();
      }
    });
  }
  for (PartitionId p : selected) selection_slot_[p] = 0;
  return stats;
}

namespace {

PageTableGeometry single_head_geometry(std::uint32_t capacity, std::span<const std::uint32_t> partition_pages) {
  const std::uint64_t pages = std::accumulate(partition_pages.begin(), partition_pages.end(), std::uint64_t{0});
  if (partition_pages.empty() || capacity == 0 || pages >= 0xffffffffull) {
    fail(ErrorCode::invalid_argument, "BucketedLruCache: needs partitions and a capacity > 0");
  }
  PageTableGeometry g;
  g.max_requests = g.layers = g.kv_heads = 1;
  g.page_tokens = 1;  // one token per page: a partition's token count is its page count
  g.segment_entries = 256;
  g.max_partitions_per_head = static_cast<std::uint32_t>(partition_pages.size());
  g.max_cpu_pages_per_head = static_cast<std::uint32_t>(pages);
  g.max_gpu_pages_per_head = capacity;
  const auto segments = [](std::uint64_t n) { return static_cast<std::uint32_t>((n + 255) / 256); };
  g.meta_segments = g.offset_segments = segments(partition_pages.size());
  g.cpu_page_segments = segments(pages);
  g.gpu_page_segments = segments(capacity);
  return g;
}

}  // namespace

BucketedLruCache::BucketedLruCache(std::uint32_t capacity_pages, std::span<const std::uint32_t> partition_pages,
                                   std::uint32_t timestamp_buckets)
    : table_(single_head_geometry(capacity_pages, partition_pages), memory_, memory_),
      lru_(timestamp_buckets),
      capacity_(capacity_pages) {
  table_.add_request(0);
  std::vector<PageId> cpu_pages(table_.geometry().max_cpu_pages_per_head);
  std::iota(cpu_pages.begin(), cpu_pages.end(), PageId{0});
  table_.append_partitions(0, 0, 0, partition_pages, cpu_pages);
  table_.resize_gpu_slots(0, 0, 0, capacity_pages);
  for (std::uint32_t s = 0; s < capacity_pages; ++s) table_.set_gpu_entry(0, 0, 0, s, {kInvalidPartition, s, 0, 0, 0});
}

CacheStepStats BucketedLruCache::step(std::span<const PartitionId> selected) {
  lru_.check(table_, 0, 0, 0, selected, capacity_);
  pages_.clear();
  return lru_.step(table_, 0, 0, 0, selected, pages_);
}

}  // namespace sparsekv
