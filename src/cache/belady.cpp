#include "sparsekv/cache/belady.hpp"

#include <algorithm>
#include <iterator>

#include "sparsekv/core/error.hpp"

namespace sparsekv {

Belady::Belady(std::uint32_t capacity_pages, std::vector<std::vector<PartitionId>> steps,
               std::vector<std::uint32_t> partition_pages)
    : capacity_(capacity_pages), steps_(std::move(steps)), pages_(std::move(partition_pages)) {
  if (capacity_ == 0) fail(ErrorCode::invalid_argument, "Belady: capacity_pages must be > 0");
  std::vector<std::uint64_t> last_seen(pages_.size(), kNever);  // step of the last check, to find repeats
  for (std::size_t t = 0; t < steps_.size(); ++t) {
    std::uint64_t step_pages = 0;
    for (PartitionId p : steps_[t]) {
      check_index("Belady: partition", p, pages_.size());
      if (pages_[p] == 0) fail(ErrorCode::invalid_argument, "Belady: partition {} has 0 pages", p);
      if (last_seen[p] == t) fail(ErrorCode::invalid_argument, "Belady: step {} selects partition {} twice", t, p);
      last_seen[p] = t;
      step_pages += pages_[p];
    }
    if (step_pages > capacity_) {
      fail(ErrorCode::resource_exhausted, "Belady: step {} selects {} pages, the buffer holds {}", t, step_pages,
           capacity_);
    }
  }
  // One backward pass: O(total selections), not O(steps) per eviction.
  std::fill(last_seen.begin(), last_seen.end(), kNever);
  next_use_.resize(steps_.size());
  for (std::size_t t = steps_.size(); t-- > 0;) {
    next_use_[t].resize(steps_[t].size());
    for (std::size_t i = 0; i < steps_[t].size(); ++i) {
      next_use_[t][i] = last_seen[steps_[t][i]];
      last_seen[steps_[t][i]] = t;
    }
  }
  resident_.assign(pages_.size(), 0);
}

CacheStepStats Belady::step() {
  if (done()) fail(ErrorCode::failed_precondition, "Belady: all {} steps replayed", steps_.size());
  const std::vector<PartitionId>& selected = steps_[next_];
  CacheStepStats stats;
  for (PartitionId p : selected) {
    if (resident_[p]) {
      ++stats.hit_partitions;
      stats.hit_pages += pages_[p];
    } else {
      ++stats.miss_partitions;
      stats.miss_pages += pages_[p];
    }
  }
  while (capacity_ - used_ < stats.miss_pages) {
    const auto victim = std::prev(by_next_use_.end());
    const auto [use, pages, id] = *victim;
    by_next_use_.erase(victim);
    resident_[id] = 0;
    used_ -= pages;
    stats.evicted_pages += pages;
  }
  for (std::size_t i = 0; i < selected.size(); ++i) {
    const PartitionId p = selected[i];
    if (resident_[p]) {
      by_next_use_.erase(Key{next_, pages_[p], p});
    } else {
      resident_[p] = 1;
      used_ += pages_[p];
    }
    by_next_use_.emplace(next_use_[next_][i], pages_[p], p);
  }
  ++next_;
  return stats;
}

}  // namespace sparsekv
