#pragma once
// A request's eviction books (BufferRequest::eviction), as TokenEvictor keeps
// them and PromptOffloader and PrefixForks reach them.
#include <cstdint>

#include "sparsekv/buffer/buffer_request.hpp"
#include "sparsekv/buffer/buffer_tiers.hpp"
#include "sparsekv/partition/partition_spec.hpp"

namespace sparsekv {

inline EvictionHead& eviction_head(const BufferTiers& tiers, BufferRequest& s, std::uint32_t layer,
                                   std::uint32_t head) {
  return s.eviction[std::size_t{layer} * tiers.shape.kv_heads + head];
}
inline const EvictionHead& eviction_head(const BufferTiers& tiers, const BufferRequest& s, std::uint32_t layer,
                                         std::uint32_t head) {
  return s.eviction[std::size_t{layer} * tiers.shape.kv_heads + head];
}
// The positions and open page of `spec`'s partitions, mapped from partition
// `first` on and holding positions from `first_position` on.
void record_offload(const BufferTiers& tiers, BufferRequest& s, std::uint32_t layer, std::uint32_t head,
                    PartitionId first, const PartitionSpec& spec, std::uint32_t first_position);

}  // namespace sparsekv
