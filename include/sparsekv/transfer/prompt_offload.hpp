#pragma once
// The device prefill's Offload through the staged D2H path (SparseServe
// §3.2.2 FlashD2H; §3.4 layer-segmented prefill: a layer's prompt K/V leaves
// HBM once, straight into its CPU pages, so no GPU copy of the layer is kept).
// Host-only geometry shared by the CUDA device decoder and the CI test that
// checks it against TieredKVBuffer::offload: where each source row of a
// prompt tensor goes, and the CPU tier as the saver addresses it.
#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "sparsekv/memory/page_pool.hpp"
#include "sparsekv/partition/partition_map.hpp"
#include "sparsekv/transfer/staged_save.hpp"

namespace sparsekv {

// Row i of a prompt tensor in the engine layout ([tokens][kv_heads][head_dim],
// i = t * kv_heads + h) goes to placements[i] (TieredKVBuffer::
// offload_on_device), in `block` (K or V) of that page.
inline void prompt_row_targets(std::span<const TokenPlacement> placements, KvBlock block,
                               std::vector<RowTarget>& out) {
  out.resize(placements.size());
  for (std::size_t i = 0; i < placements.size(); ++i) out[i] = RowTarget{placements[i].cpu_page, placements[i].slot, block};
}

// The CPU tier's chunks reserved so far as a StagedSaver destination. Taken
// after the prompt's pages are mapped (a mapping may reserve a chunk).
inline SaveDestination cpu_tier_destination(const PagePool& pool) {
  SaveDestination d;
  d.chunks = pool.chunks();
  d.pages_per_chunk = pool.pages_per_chunk();
  d.page_count = static_cast<std::uint32_t>(
      std::min<std::uint64_t>(pool.capacity(), std::uint64_t{pool.pages_per_chunk()} * d.chunks.size()));
  d.page_stride = pool.page_bytes();
  d.page_tokens = pool.layout().page_tokens;
  d.row_bytes = pool.layout().row_bytes();
  d.k_block_offset = pool.layout().k_offset(0);
  d.v_block_offset = pool.layout().v_offset(0);
  return d;
}

}  // namespace sparsekv
