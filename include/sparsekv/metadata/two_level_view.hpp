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

  SPARSEKV_HOST_DEVICE std::uint32_t segment_entries() const { return 1u << segment_shift; }

  // First entry of the instance's `slot`-th segment (entries slot * segment_entries() onwards).
  SPARSEKV_HOST_DEVICE Entry* segment(std::size_t instance, std::uint32_t slot) const {
    return segments + (static_cast<std::size_t>(directory[instance * directory_length + slot]) << segment_shift);
  }

  // Calls fn(entry, index) for every entry of an instance, a segment at a time.
  template <class Fn>
  SPARSEKV_HOST_DEVICE void for_each(std::size_t instance, Fn&& fn) const {
    const std::uint32_t n = lengths[instance];
    for (std::uint32_t first = 0, slot = 0; first < n; first += segment_entries(), ++slot) {
      Entry* base = segment(instance, slot);
      const std::uint32_t count = n - first < segment_entries() ? n - first : segment_entries();
      for (std::uint32_t i = 0; i < count; ++i) fn(base[i], first + i);
    }
  }

  // The entry, or nullptr when `index` is past the instance's length.
  SPARSEKV_HOST_DEVICE Entry* find(std::size_t instance, std::uint32_t index) const {
    if (index >= lengths[instance]) return nullptr;
    const std::uint32_t segment = directory[instance * directory_length + (index >> segment_shift)];
    const std::uint32_t mask = (1u << segment_shift) - 1u;
    return segments + (static_cast<std::size_t>(segment) << segment_shift) + (index & mask);
  }
};

}  // namespace sparsekv
