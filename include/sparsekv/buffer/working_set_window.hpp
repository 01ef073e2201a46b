#pragma once
// Working-set estimate of SparseServe §3.3: the union of the partitions a head
// selected over its last `window` decode steps (w = 12 in the paper). Steps
// close together select heavily overlapping sets, so this union predicts how
// many pages a request keeps touching, which is what its GPU buffer must hold
// to hit; the engine's scheduler uses it for admission.
#include <cstdint>
#include <deque>
#include <span>
#include <vector>

#include "sparsekv/core/ids.hpp"

namespace sparsekv {

class WorkingSetWindow {
 public:
  explicit WorkingSetWindow(std::uint32_t window = 12) : window_(window) {}

  void record(std::span<const PartitionId> selected) {
    steps_.emplace_back(selected.begin(), selected.end());
    if (steps_.size() > window_) steps_.pop_front();
  }
  // Drops ids >= first: those partitions were regrouped and the ids reused.
  void forget_from(PartitionId first) {
    for (auto& step : steps_) std::erase_if(step, [first](PartitionId p) { return p >= first; });
  }
  // Distinct partitions selected over the window, ascending.
  std::vector<PartitionId> partitions() const;
  std::uint32_t steps() const noexcept { return static_cast<std::uint32_t>(steps_.size()); }

 private:
  std::uint32_t window_;
  std::deque<std::vector<PartitionId>> steps_;
};

}  // namespace sparsekv
