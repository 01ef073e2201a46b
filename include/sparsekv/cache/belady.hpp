#pragma once
// Belady's MIN over one head's recorded selection trace: the offline upper
// bound that Spin's bucketed LRU (Spin §5.3, "Bucketed LRU Replacement") and
// exact LRU are judged against. It sees the whole future, so no online policy
// can beat it on uniform partitions.
//
// One step (cache_step.hpp): every selected partition is resident afterwards;
// when the free pages do not hold the misses, evict the unselected resident
// partition whose next use is farthest in the future (never used again =
// infinitely far; ties: larger page count first, then higher id), repeating
// until the misses fit (never more than that).
//
// With uniform one-page partitions this is the offline optimum (fewest pages
// moved; eviction on demand loses nothing). With variable page counts optimal
// replacement is NP-hard and this is the standard farthest-next-use
// heuristic: a reference point, not a guaranteed bound.
#include <cstdint>
#include <set>
#include <tuple>
#include <vector>

#include "sparsekv/cache/cache_step.hpp"
#include "sparsekv/core/ids.hpp"

namespace sparsekv {

class Belady {
 public:
  // `steps[t]` is step t's selection, `partition_pages[p]` the page count of
  // partition p. The whole trace is checked here, so step() cannot fail on
  // bad input: throws invalid_argument (capacity 0, repeated id in a step,
  // 0-page partition), out_of_range (id beyond partition_pages) or
  // resource_exhausted (a step's pages exceed the capacity).
  Belady(std::uint32_t capacity_pages, std::vector<std::vector<PartitionId>> steps,
         std::vector<std::uint32_t> partition_pages);

  // Replays the next step. Throws failed_precondition after the last step.
  CacheStepStats step();

  bool done() const noexcept { return next_ == steps_.size(); }
  std::size_t next_step() const noexcept { return next_; }
  std::size_t step_count() const noexcept { return steps_.size(); }
  std::uint32_t capacity_pages() const noexcept { return capacity_; }
  std::uint32_t used_pages() const noexcept { return used_; }
  bool resident(PartitionId partition) const { return partition < resident_.size() && resident_[partition]; }

 private:
  static constexpr std::uint64_t kNever = ~std::uint64_t{0};
  // (next use, pages, id): the largest key is the eviction victim.
  using Key = std::tuple<std::uint64_t, std::uint32_t, PartitionId>;

  std::uint32_t capacity_;
  std::vector<std::vector<PartitionId>> steps_;
  std::vector<std::uint32_t> pages_;
  // next_use_[t][i]: the first step after t that selects steps_[t][i] (kNever if none).
  std::vector<std::vector<std::uint64_t>> next_use_;
  std::size_t next_ = 0;
  std::uint32_t used_ = 0;
  std::vector<std::uint8_t> resident_;
  // Resident partitions by next use. A partition selected in the current step
  // t has key t, below every unselected resident one (> t), so the maximum is
  // always an unselected partition.
  std::set<Key> by_next_use_;
};

}  // namespace sparsekv
