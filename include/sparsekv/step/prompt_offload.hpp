#pragma once
// The device prefill's Offload through the staged D2H path (SparseServe
// §3.2.2 FlashD2H; §3.4 layer-segmented prefill: a layer's prompt K/V leaves
// HBM once, straight into its CPU pages, so no GPU copy of the layer is kept).
// Host-only geometry shared by the CUDA device runtime and the CI test that
// checks it against PromptOffloader::offload: where each source row of a
// prompt tensor goes, and the CPU tier as the saver addresses it.
#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "sparsekv/memory/page_pool.hpp"
#include "sparsekv/partition/partition_map.hpp"
#include "sparsekv/transfer/flash_d2h_save.hpp"

namespace sparsekv {

// Row i of a prompt tensor in the engine layout ([tokens][kv_heads][head_dim],
// i = t * kv_heads + h) goes to placements[i] (TieredKVBuffer::
// offload_on_device), in `block` (K or V) of that page.
inline void prompt_row_targets(std::span<const TokenPlacement> placements, KvBlock block, std::vector<RowTarget>& out) {
  out.resize(placements.size());
  for (std::size_t i = 0; i < placements.size(); ++i)
    out[i] = RowTarget{placements[i].cpu_page, placements[i].slot, block};
}

// The CPU tier's chunks reserved so far as a FlashD2HSaver destination. Taken
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

// Offloads a prompt's K and V (engine layout, one row per placement) into the
// CPU tier through `saver`: the pool as its destination, each tensor in
// pieces of at most `piece_bytes` (staging stays bounded while the workers
// scatter the previous piece), then waits until every row is written.
// `k_targets` / `v_targets` are the caller's reusable scratch. The CUDA
// runtime passes device K / V; the CI emulation the same call on host ones.
inline void save_prompt(FlashD2HSaver& saver, const PagePool& pool, const void* k, const void* v,
                        std::span<const TokenPlacement> placements, std::size_t piece_bytes, void* stream,
                        std::vector<RowTarget>& k_targets, std::vector<RowTarget>& v_targets) {
  saver.set_destination(cpu_tier_destination(pool));
  const std::size_t row = pool.layout().row_bytes();
  const std::size_t piece_rows = std::max<std::size_t>(1, piece_bytes / row);
  prompt_row_targets(placements, KvBlock::k, k_targets);
  prompt_row_targets(placements, KvBlock::v, v_targets);
  for (const auto& [source, targets] : {std::pair{k, &k_targets}, std::pair{v, &v_targets}}) {
    for (std::size_t first = 0; first < targets->size(); first += piece_rows) {
      const std::size_t rows = std::min(piece_rows, targets->size() - first);
      saver.save(static_cast<const std::byte*>(source) + first * row, rows * row,
                 std::span<const RowTarget>(*targets).subspan(first, rows), stream);
    }
  }
  saver.wait();
}

}  // namespace sparsekv
