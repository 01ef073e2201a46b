#pragma once
#include <cstdint>
#include <limits>

namespace sparsekv {

// The engine's own request handle; sparsekv never invents one.
using RequestId = std::uint64_t;
// Index of a physical page inside one PagePool (CPU tier or GPU tier).
using PageId = std::uint32_t;
// Index of a partition inside one (request, layer, kv head).
using PartitionId = std::uint32_t;

inline constexpr PageId kInvalidPage = std::numeric_limits<PageId>::max();
inline constexpr PartitionId kInvalidPartition = std::numeric_limits<PartitionId>::max();

}  // namespace sparsekv
