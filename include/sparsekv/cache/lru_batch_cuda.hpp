#pragma once
// The glue of the device decode step between Select and the bucketed-LRU
// step (docs/device-decode.md, steps 2 -> 3): the Select kernels' fixed-stride
// output (SelectOutput: row r's partitions at selected[r * max_selected ..
// + selected_count[r])) becomes the LruStepBatch CSR the LRU launch reads,
// with the page offsets BucketedLru::check would return on the host and each
// selection's token count, which the device Plan reads (DevicePlanInput::
// partition_tokens). Nothing is read back on the host: only capacities (rows,
// max_selected) are host-known, so the launches can be captured in a graph.
//
// Four launches on the caller's stream:
//   1. counts: one block per row sums its selections' page counts (a CUB
//      BlockReduce over the meta-partition table's token counts);
//   2. two CUB DeviceScan::InclusiveSum over the rows: selection counts ->
//      selection_offsets, page sums -> page_offsets;
//   3. fill: one block per row writes its selections and their token counts
//      at their compact places.
// accumulate_step_stats folds the LRU launch's per-head stats into a device
// running total, so that the stats need no per-step copy back either.
//
// The per-element rules below are plain C++ shared with the host emulation
// CI runs (tests/cache/test_lru_batch_rules.cpp).
//
// fmt-free: kernel translation units and their callers can include it.
#include <cstddef>
#include <cstdint>

#include "sparsekv/cache/bucketed_lru_cuda.hpp"
#include "sparsekv/cache/cache_step.hpp"
#include "sparsekv/core/host_device.hpp"
#include "sparsekv/core/ids.hpp"
#include "sparsekv/metadata/page_table_entries.hpp"
#include "sparsekv/metadata/partition_lookup.hpp"

namespace sparsekv::cuda {

// Threads of a count or fill block: a row's selections are walked this many at a time.
inline constexpr std::uint32_t kLruBatchThreads = 128;

// Select's output (policy/select_cuda.hpp: SelectOutput) and the rows'
// tables. Every array is device-accessible.
struct LruBatchInput {
  std::uint32_t rows = 0;                         // rows r = b * kv_heads + h of the launch
  std::uint32_t max_selected = 0;                 // SelectOutput::max_selected: the row stride
  const PartitionId* selected = nullptr;          // [rows * max_selected]
  const std::uint32_t* selected_count = nullptr;  // [rows]
  const std::size_t* instances = nullptr;         // [rows]: HierarchicalPageTable::instance() of each row
};

// The LRU launch's batch (LruStepBatch) and the Plan's token counts
// (device-accessible). The first selection_offsets[rows] entries of the
// compact arrays are written; the rest of their capacity is left alone.
struct LruBatchOutput {
  std::uint32_t* selection_offsets = nullptr;  // [rows + 1]: exclusive scan of the rows' counts
  PartitionId* selected = nullptr;             // [rows * max_selected] capacity
  std::uint32_t* page_offsets = nullptr;       // [rows + 1]: exclusive scan of the rows' selection pages
  std::uint32_t* partition_tokens = nullptr;   // [rows * max_selected] capacity: tokens of each selection
};

// One selection as the LRU step and the Plan see it.
struct LruBatchSelection {
  PartitionId partition = kInvalidPartition;
  std::uint32_t tokens = 0;
  std::uint32_t pages = 0;  // PartitionLookup::page_count
};

// Selections row r passes on: its count, cut at the row's capacity so that a
// corrupt count never reads past the row.
SPARSEKV_HOST_DEVICE inline std::uint32_t lru_batch_count(const LruBatchInput& in, std::uint32_t row) {
  const std::uint32_t n = in.selected_count[row];
  return n < in.max_selected ? n : in.max_selected;
}

// Selection i of row r (i < its count), its tokens read from the meta-partition
// table once and its pages derived from them as PartitionLookup::page_count does.
SPARSEKV_HOST_DEVICE inline LruBatchSelection lru_batch_selection(const PartitionLookup& lookup,
                                                                  const LruBatchInput& in, std::uint32_t row,
                                                                  std::uint32_t i) {
  LruBatchSelection s;
  s.partition = in.selected[std::size_t{row} * in.max_selected + i];
  const MetaPartitionEntry* m = lookup.meta.find(in.instances[row], s.partition);
  s.tokens = m == nullptr ? 0 : m->token_count();
  s.pages = pages_for_tokens(s.tokens, lookup.page_tokens);
  return s;
}

// Writes a selection at its compact place `at` (selection_offsets[r] + i).
SPARSEKV_HOST_DEVICE inline void lru_batch_emit(const LruBatchOutput& out, const LruBatchSelection& s,
                                                std::uint32_t at) {
  out.selected[at] = s.partition;
  out.partition_tokens[at] = s.tokens;
}

// The LRU launch's batch over the glue's output. max_selection is the
// capacity, since the largest count stays on the device: the LRU kernel
// sorts each head by its own count, so scratch
// ([4 * rows * max_selected] words) is needed only when max_selected > kLruSharedSelection.
inline LruStepBatch lru_step_batch(const LruBatchInput& in, const LruBatchOutput& out, std::uint32_t* scratch) {
  LruStepBatch b;
  b.heads = in.rows;
  b.instances = in.instances;
  b.selection_offsets = out.selection_offsets;
  b.selected = out.selected;
  b.page_offsets = out.page_offsets;
  b.max_selection = in.max_selected;
  b.scratch = scratch;
  return b;
}

// Bytes of the caller-owned workspace build_lru_batch needs for `rows` rows
// (two uint32 row arrays and CUB's scan storage). Throws
// ErrorCode::cuda_error if CUB's size query fails.
std::size_t lru_batch_workspace_bytes(std::uint32_t rows);

// Builds the LRU batch of `in` into `out` on `stream` (a cudaStream_t;
// nullptr = default stream), reading token counts from `lookup.meta` only.
//
// Preconditions (not re-checked on the device): each row's selection is
// distinct partitions of its instance that fit the head's budget and GPU
// slots (what Select produces and BucketedLru::check verifies on the host),
// so that every offset fits 32 bits.
//
// Checked on the host before launching (ErrorCode::invalid_argument):
// lookup.page_tokens > 0; rows <= 2^31 - 1; rows * max_selected < 2^32;
// non-null selected_count, instances, selection_offsets and page_offsets when
// rows > 0; non-null in.selected, out.selected and partition_tokens when
// max_selected > 0 as well; workspace non-null and workspace_bytes >=
// lru_batch_workspace_bytes(rows). rows == 0 enqueues nothing. Throws
// ErrorCode::cuda_error if a launch fails.
void build_lru_batch(const PartitionLookup& lookup, const LruBatchInput& in, const LruBatchOutput& out, void* workspace,
                     std::size_t workspace_bytes, void* stream);

// a + b, field by field: CacheStepStats::operator+= for the device too.
SPARSEKV_HOST_DEVICE inline CacheStepStats step_stats_sum(const CacheStepStats& a, const CacheStepStats& b) {
  CacheStepStats s;
  s.hit_partitions = a.hit_partitions + b.hit_partitions;
  s.miss_partitions = a.miss_partitions + b.miss_partitions;
  s.hit_pages = a.hit_pages + b.hit_pages;
  s.miss_pages = a.miss_pages + b.miss_pages;
  s.evicted_pages = a.evicted_pages + b.evicted_pages;
  return s;
}

// Threads of the one block accumulate_step_stats launches.
inline constexpr std::uint32_t kStepStatsThreads = 256;

// Adds the `heads` stats of one LRU launch (LruStepOutput::stats) to `*total`
// on `stream`: the sums the host's `total += stats[h]` over the heads gives.
// One block (a CUB BlockReduce); `*total` is read and written without
// atomics, so launches into one total must be ordered (one stream).
// Checked on the host (ErrorCode::invalid_argument): total non-null, stats
// non-null when heads > 0. heads == 0 enqueues nothing. Throws
// ErrorCode::cuda_error if the launch fails.
void accumulate_step_stats(const CacheStepStats* stats, std::uint32_t heads, CacheStepStats* total, void* stream);

}  // namespace sparsekv::cuda
