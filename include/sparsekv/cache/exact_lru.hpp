#pragma once
// Exact LRU over whole partitions: the first reference policy that Spin's
// bucketed LRU (Spin §5.3, "Bucketed LRU Replacement") is judged against.
// Bucketed LRU keeps 64 recency buckets instead of a total order; this class
// keeps the total order, so the gap between the two is the cost of the
// relaxation.
//
// One step (cache_step.hpp): every selected partition is resident afterwards.
// Hits and admitted misses become the most recent, in selection order (a
// partition earlier in the selection ends up less recent than a later one).
// When the free pages do not hold the misses, the least recent unselected
// partitions are evicted, one whole partition at a time, until they do (never
// more than that).
#include <cstdint>
#include <list>
#include <span>
#include <unordered_map>
#include <vector>

#include "sparsekv/cache/cache_step.hpp"
#include "sparsekv/core/ids.hpp"

namespace sparsekv {

class ExactLru {
 public:
  // Throws invalid_argument when capacity_pages is 0.
  explicit ExactLru(std::uint32_t capacity_pages);

  // `partition_pages[p]` is the page count of partition p; a partition must
  // keep its page count while it is resident. Throws out_of_range (id beyond
  // partition_pages), invalid_argument (repeated id, a 0-page partition, a
  // resident partition whose page count changed) or resource_exhausted (the
  // selection's pages exceed the capacity); on a throw nothing changes.
  CacheStepStats step(std::span<const PartitionId> selected, std::span<const std::uint32_t> partition_pages);

  std::uint32_t capacity_pages() const noexcept { return capacity_; }
  std::uint32_t used_pages() const noexcept { return used_; }
  bool resident(PartitionId partition) const { return index_.contains(partition); }
  // Resident partitions, least recent first.
  std::vector<PartitionId> recency_order() const;

 private:
  struct Entry {
    PartitionId partition;
    std::uint32_t pages;
  };

  std::uint32_t capacity_;
  std::uint32_t used_ = 0;
  std::list<Entry> order_;  // front = least recent
  std::unordered_map<PartitionId, std::list<Entry>::iterator> index_;
  std::vector<PartitionId> sorted_;  // scratch: the selection, sorted, to find repeats
};

}  // namespace sparsekv
