#include "sparsekv/cache/exact_lru.hpp"

#include <algorithm>
#include <iterator>

#include "sparsekv/core/error.hpp"

namespace sparsekv {

ExactLru::ExactLru(std::uint32_t capacity_pages) : capacity_(capacity_pages) {
  if (capacity_pages == 0) fail(ErrorCode::invalid_argument, "ExactLru: capacity_pages must be > 0");
}

CacheStepStats ExactLru::step(std::span<const PartitionId> selected, std::span<const std::uint32_t> partition_pages) {
  // Validate everything first: a throw must leave the cache as it was.
  std::uint64_t selected_pages = 0;
  CacheStepStats stats;
  for (PartitionId p : selected) {
    check_index("ExactLru: partition", p, partition_pages.size());
    const std::uint32_t pages = partition_pages[p];
    if (pages == 0) fail(ErrorCode::invalid_argument, "ExactLru: partition {} has 0 pages", p);
    selected_pages += pages;
    if (const auto it = index_.find(p); it == index_.end()) {
      ++stats.miss_partitions;
      stats.miss_pages += pages;
    } else {
      if (it->second->pages != pages) {
        fail(ErrorCode::invalid_argument, "ExactLru: resident partition {} has {} pages, the step says {}", p,
             it->second->pages, pages);
      }
      ++stats.hit_partitions;
      stats.hit_pages += pages;
    }
  }
  sorted_.assign(selected.begin(), selected.end());
  std::sort(sorted_.begin(), sorted_.end());
  if (const auto dup = std::adjacent_find(sorted_.begin(), sorted_.end()); dup != sorted_.end()) {
    fail(ErrorCode::invalid_argument, "ExactLru: partition {} is selected twice", *dup);
  }
  if (selected_pages > capacity_) {
    fail(ErrorCode::resource_exhausted, "ExactLru: the selection needs {} pages, the buffer holds {}", selected_pages,
         capacity_);
  }

  // Hits go to the back first, so the front holds only unselected partitions:
  // the unselected pages always suffice (selection <= capacity), so eviction
  // from the front never reaches a hit.
  for (PartitionId p : selected) {
    if (const auto it = index_.find(p); it != index_.end()) order_.splice(order_.end(), order_, it->second);
  }
  while (capacity_ - used_ < stats.miss_pages) {
    const Entry victim = order_.front();
    order_.pop_front();
    index_.erase(victim.partition);
    used_ -= victim.pages;
    stats.evicted_pages += victim.pages;
  }
  // Final recency follows the selection order across hits and misses.
  for (PartitionId p : selected) {
    if (const auto it = index_.find(p); it != index_.end()) {
      order_.splice(order_.end(), order_, it->second);
    } else {
      order_.push_back({p, partition_pages[p]});
      index_.emplace(p, std::prev(order_.end()));
      used_ += partition_pages[p];
    }
  }
  return stats;
}

std::vector<PartitionId> ExactLru::recency_order() const {
  std::vector<PartitionId> out;
  out.reserve(order_.size());
  for (const Entry& e : order_) out.push_back(e.partition);
  return out;
}

}  // namespace sparsekv
