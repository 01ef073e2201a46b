#pragma once
// inspect_buffer(manager): the Manager's TieredKVBuffer, read-only, for the
// library's own tests, benchmarks and tools, which check the tiers' books
// (page tables, pools, eviction, forks) after the calls they make. Not the
// engine API: an engine reads what it needs from the Manager itself
// (tier_usage, held_tokens, working_set, stats), which keeps the buffer
// to itself.
#include "sparsekv/facade/manager.hpp"

namespace sparsekv {

struct ManagerInspection {
  template <class Policy>
  static const TieredKVBuffer& buffer(const Manager<Policy>& manager) noexcept {
    return *manager.buffer_;
  }
};

template <class Policy>
const TieredKVBuffer& inspect_buffer(const Manager<Policy>& manager) noexcept {
  return ManagerInspection::buffer(manager);
}

}  // namespace sparsekv
