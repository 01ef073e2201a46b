#include "sparsekv/metadata/metadata_footprint.hpp"

#include <cmath>

#include "sparsekv/core/error.hpp"

namespace sparsekv {

MetadataHeadCounts head_counts(const MetadataWorkingSet& ws, std::uint32_t page_tokens) {
  if (ws.partition_tokens == 0 || ws.context_tokens == 0) {
    fail(ErrorCode::invalid_argument, "MetadataWorkingSet: context_tokens and partition_tokens must be > 0");
  }
  if (!(ws.gpu_fraction >= 0.0 && ws.gpu_fraction <= 1.0)) {
    fail(ErrorCode::invalid_argument, "MetadataWorkingSet: gpu_fraction ({}) must be in [0, 1]", ws.gpu_fraction);
  }
  MetadataHeadCounts c;
  const std::uint32_t full = ws.context_tokens / ws.partition_tokens;
  const std::uint32_t rest = ws.context_tokens % ws.partition_tokens;
  c.partitions = full + (rest != 0 ? 1 : 0);
  c.cpu_pages = full * pages_for_tokens(ws.partition_tokens, page_tokens) + pages_for_tokens(rest, page_tokens);
  c.gpu_slots = static_cast<std::uint32_t>(std::ceil(ws.gpu_fraction * c.cpu_pages));
  return c;
}

MetadataFootprint estimate_metadata_footprint(const PageTableGeometry& g, std::uint32_t max_context_tokens,
                                              const MetadataWorkingSet& ws) {
  g.validate();
  const MetadataHeadCounts c = head_counts(ws, g.page_tokens);
  if (ws.requests > g.max_requests || c.partitions > g.max_partitions_per_head ||
      c.cpu_pages > g.max_cpu_pages_per_head || c.gpu_slots > g.max_gpu_pages_per_head) {
    fail(ErrorCode::invalid_argument, "MetadataWorkingSet does not fit the page-table geometry");
  }
  const std::size_t instances = g.instances();
  const std::size_t live_heads = std::size_t{ws.requests} * g.layers * g.kv_heads;
  const auto segs = [&](std::uint32_t entries) {
    return std::size_t{(entries + g.segment_entries - 1) / g.segment_entries};
  };
  // TwoLevelTable: one u32 per directory slot plus one u32 length per instance.
  const auto directory = [&](std::uint32_t max_entries) {
    return sizeof(std::uint32_t) * instances * (std::size_t{segs(max_entries)} + 1);
  };
  const std::size_t seg = g.segment_entries;
  const std::size_t meta =
      directory(g.max_partitions_per_head) + live_heads * segs(c.partitions) * seg * sizeof(MetaPartitionEntry);
  const std::size_t gpu =
      directory(g.max_gpu_pages_per_head) + live_heads * segs(c.gpu_slots) * seg * sizeof(GpuPageEntry);
  const std::size_t offsets =
      directory(g.max_partitions_per_head) + live_heads * segs(c.partitions) * seg * sizeof(PartitionOffset);
  const std::size_t cpu =
      directory(g.max_cpu_pages_per_head) + live_heads * segs(c.cpu_pages) * seg * sizeof(CpuPageEntry);
  // Indexed like the CPU page table: same directory length, same segments per head.
  const std::size_t masks =
      g.slot_masks ? directory(g.max_cpu_pages_per_head) + live_heads * segs(c.cpu_pages) * seg * sizeof(SlotMask) : 0;

  MetadataFootprint f;
  // One entry of each table per possible page (flat: one partition per page).
  const std::size_t flat_entry_bytes = sizeof(MetaPartitionEntry) + sizeof(GpuPageEntry) + sizeof(PartitionOffset) +
                                       sizeof(CpuPageEntry) + (g.slot_masks ? sizeof(SlotMask) : 0);
  f.flat_bytes = instances * pages_for_tokens(max_context_tokens, g.page_tokens) * flat_entry_bytes;
  f.flat_token_granular_bytes = instances * std::size_t{max_context_tokens} * flat_entry_bytes;
  f.slot_mask_bytes = masks;
  f.two_level_gpu_bytes = meta + gpu;
  f.two_level_cpu_bytes = offsets + cpu + masks;
  f.two_level_bytes = f.two_level_gpu_bytes + f.two_level_cpu_bytes;
  f.directory_bytes = directory(g.max_partitions_per_head) * 2 + directory(g.max_gpu_pages_per_head) +
                      directory(g.max_cpu_pages_per_head) * (g.slot_masks ? 2 : 1);
  f.segment_bytes = f.two_level_bytes - f.directory_bytes;
  return f;
}

}  // namespace sparsekv
