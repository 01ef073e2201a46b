#pragma once
// A request's prefix order (BufferRequest::ordered_tokens, saved_tail,
// scattered): which of a layer's first tokens lie where PrefixForks can read
// them back. The parts that lay tokens out keep it as they go.
#include <cstdint>
#include <span>

#include "sparsekv/buffer/buffer_request.hpp"
#include "sparsekv/buffer/buffer_tiers.hpp"
#include "sparsekv/partition/partition_spec.hpp"

namespace sparsekv {

// Extends ordered_tokens over an offload of `tokens` tokens about to start at
// s.tokens[layer]: while the layer is in page order so far, page-sized
// uniform specs keep it so; returns whether it did.
bool record_prompt_order(const BufferTiers& tiers, BufferRequest& s, std::uint32_t layer,
                         std::span<const PartitionSpec> specs, std::uint32_t tokens);
// Extends it over the page a full tail just became (saved[h]: its partition
// in head h), when the order reached the page's first position on a page
// boundary; else extends or starts the layer's saved-tail run.
void record_save_order(const BufferTiers& tiers, BufferRequest& s, std::uint32_t layer,
                       std::span<const PartitionId> saved);
// Cuts head `head`'s order where a regroup replaces partitions `first` onwards.
void cut_prefix_order(const BufferTiers& tiers, BufferRequest& s, std::uint32_t layer, std::uint32_t head,
                      PartitionId first);
// The layer's first tokens readable from the prompt's layout alone (page
// order or scattered placements), without eviction.
std::uint32_t prompt_readable(const BufferTiers& tiers, const BufferRequest& s, std::uint32_t layer);

}  // namespace sparsekv
