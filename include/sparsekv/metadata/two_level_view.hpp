#pragma once
// TwoLevelView: the plain-data form of a TwoLevelTable (Spin §5.4) that both
// backends index through: the host table and the CUDA kernels call the same
// `find`. Free of host-only headers so kernels can include it.
#include <cstddef>
#include <cstdint>
#include <limits>

#include "sparsekv/core/host_device.hpp"

namespace sparsekv {

inline constexpr std::uint32_t kNoSegment = std::numeric_limits<std::uint32_t>::max();

template <class Entry>
struct TwoLevelView {
  const std::uint32_t* directory;  // [instances][directory_length], kNoSegment = unmapped
  const std::uint32_t* lengths;    // [instances] logical length of each instance
  Entry* segments;                 // pool storage, segment s at segments + (s << segment_shift)
  std::uint32_t directory_length;
  std::uint32_t segment_shift;

  SPARSEKV_HOST_DEVICE std::uint32_t length(std::size_t instance) const { return lengths[instance]; }

  // The entry, or nullptr when `index` is past the instance's length.
  SPARSEKV_HOST_DEVICE Entry* find(std::size_t instance, std::uint32_t index) const {
    if (index >= lengths[instance]) return nullptr;
    const std::uint32_t segment = directory[instance * directory_length + (index >> segment_shift)];
    const std::uint32_t mask = (1u << segment_shift) - 1u;
    return segments + (static_cast<std::size_t>(segment) << segment_shift) + (index & mask);
  }
};

}  // namespace sparsekv
