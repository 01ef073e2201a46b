#pragma once
// Metadata bytes of the four tables of Spin §5.2 under two layouts (Spin §5.4,
// §6.4), computed from the same entry widths and directory/segment geometry
// HierarchicalPageTable allocates (tests compare the two).
//
//  - flat: every table pre-allocated for the worst case, all in GPU memory, as
//    a vLLM-style serving system would: max_requests x layers x kv_heads x
//    ceil(max_context / page_tokens) entries per table, one partition per page
//    (the coarsest partitioning a page-based layout must still allow).
//  - flat, token-granular: the same when partitions may be single tokens
//    (Spin §4.1), each on its own page: every table sized per token.
//  - two-level: static directories plus segments for the working set only,
//    segment pools sized to it exactly.
//  - two-level + tier split: the GPU share of the above (meta-partition and
//    GPU page tables with their directories); the rest lives in pinned host memory.
//
// A geometry with slot masks (SpvLLM §2, block masks: requests that evict
// tokens) adds a fifth table, a SlotMask (8 B) per CPU page, to every layout;
// two-level, it sits in the CPU tier next to the CPU page table it parallels.
#include <cstddef>
#include <cstdint>

#include "sparsekv/metadata/hierarchical_page_table.hpp"

namespace sparsekv {

// What is mapped: `requests` live requests of `context_tokens` each, every
// (layer, kv head) with partitions of `partition_tokens` tokens and a GPU buffer
// of `gpu_fraction` of its pages.
struct MetadataWorkingSet {
  std::uint32_t requests = 0;
  std::uint32_t context_tokens = 0;
  std::uint32_t partition_tokens = 0;
  double gpu_fraction = 0.1;
};

struct MetadataFootprint {
  std::size_t flat_bytes = 0;
  std::size_t flat_token_granular_bytes = 0;
  std::size_t two_level_bytes = 0;
  std::size_t two_level_gpu_bytes = 0;
  std::size_t two_level_cpu_bytes = 0;
  // Two-level breakdown: static directories vs mapped segments.
  std::size_t directory_bytes = 0;
  std::size_t segment_bytes = 0;
  // Two-level slot mask table, directory and segments (0 without slot masks);
  // part of two_level_cpu_bytes.
  std::size_t slot_mask_bytes = 0;

  double two_level_reduction() const { return double(flat_bytes) / double(two_level_bytes); }
  double gpu_reduction() const { return double(flat_bytes) / double(two_level_gpu_bytes); }
};

// Per-head counts the working set maps; shared with the tests that build it for real.
struct MetadataHeadCounts {
  std::uint32_t partitions = 0;
  std::uint32_t cpu_pages = 0;
  std::uint32_t gpu_slots = 0;
};
MetadataHeadCounts head_counts(const MetadataWorkingSet& working_set, std::uint32_t page_tokens);

// `geometry` gives the directories, the segment size and whether there are
// slot masks; `max_context_tokens` the flat layout's per-head capacity. Throws
// invalid_argument if the working set does not fit the geometry.
MetadataFootprint estimate_metadata_footprint(const PageTableGeometry& geometry, std::uint32_t max_context_tokens,
                                              const MetadataWorkingSet& working_set);

}  // namespace sparsekv
