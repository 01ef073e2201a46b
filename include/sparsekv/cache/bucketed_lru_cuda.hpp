#pragma once
// CUDA backend of the bucketed-LRU step (Spin §5.3): one launch runs
// BucketedLru::step for a batch of (request, layer, kv head) buffers, one
// thread block per head: hit/miss, timestamp update, shared-memory histogram,
// threshold, eviction and admission, with tables, page ids, copies and stats
// identical to the host backend's (the per-slot rules are shared:
// bucketed_lru_rules.hpp; how the data-parallel passes reproduce the host's
// sequential tie-breaking: docs/buffer.md).
//
// fmt-free: kernel translation units and their callers can include it.
#include <cstddef>
#include <cstdint>

#include "sparsekv/cache/cache_step.hpp"
#include "sparsekv/core/ids.hpp"
#include "sparsekv/metadata/page_table_entries.hpp"
#include "sparsekv/metadata/partition_lookup.hpp"
#include "sparsekv/metadata/two_level_view.hpp"

namespace sparsekv::cuda {

// Largest per-head selection a block sorts in shared memory (256 threads x 8
// keys, CUB BlockRadixSort). A larger one is sorted into `scratch` in global
// memory (rank sort, quadratic in the selection: correct, but meant for the rare case).
inline constexpr std::uint32_t kLruSharedSelection = 2048;

// The heads of one launch. Every array is device-accessible (device memory or
// mapped pinned host memory).
struct LruStepBatch {
  std::uint32_t heads = 0;
  // [heads] HierarchicalPageTable::instance() of each head; distinct.
  const std::size_t* instances = nullptr;
  // [heads + 1] CSR: head h selected selected[selection_offsets[h] .. selection_offsets[h + 1]).
  const std::uint32_t* selection_offsets = nullptr;
  const PartitionId* selected = nullptr;
  // [heads + 1] exclusive prefix of the heads' selection page counts (the
  // values BucketedLru::check returns); head h's output pages and copies
  // start at page_offsets[h].
  const std::uint32_t* page_offsets = nullptr;
  // Host-side: the largest per-head selection in the batch.
  std::uint32_t max_selection = 0;
  // [4 * selection_offsets[heads]] words, needed only when max_selection > kLruSharedSelection.
  std::uint32_t* scratch = nullptr;
};

// Where the step's results go (device-accessible). The layout is the
// RetrievedPages's, heads after each other, except that copies stay in
// per-head regions.
struct LruStepOutput {
  // [selection_offsets[heads] + 1]: selection i's pages are
  // gpu_pages[partition_offsets[i] .. partition_offsets[i + 1]), in page order.
  std::uint32_t* partition_offsets = nullptr;
  PageId* gpu_pages = nullptr;  // [page_offsets[heads]]
  // [page_offsets[heads]] each: head h's CPU -> GPU copies of its misses, in
  // the host's admission order, are entries page_offsets[h] ..
  // page_offsets[h] + stats[h].miss_pages; the rest of its region is not written.
  PageId* copy_cpu_pages = nullptr;
  PageId* copy_gpu_pages = nullptr;
  CacheStepStats* stats = nullptr;  // [heads]
};

// One bucketed-LRU step for every head of `batch` over the tables behind
// `gpu_pages` (GPU page table) and `lookup` (meta-partition, partition offset
// and CPU page tables), updating them exactly as BucketedLru::step does:
// timestamps, admitted and evicted slots, meta residency bits. The tables are
// device memory or pinned host memory read through UVA.
//
// Preconditions (not re-checked on the device): BucketedLru::check passed
// for each head's selection, the instances are distinct, every GPU page
// timestamp is below timestamp_buckets, and no other work touches these
// heads' tables or the outputs while the step runs.
//
// Checked on the host before launching (ErrorCode::invalid_argument):
// timestamp_buckets in [2, 256]; heads <= 2^31 - 1; non-null instances,
// selection_offsets, page_offsets, partition_offsets and stats when
// heads > 0; non-null selected, gpu_pages and copy arrays when
// max_selection > 0; scratch non-null when max_selection > kLruSharedSelection.
// heads == 0 enqueues nothing. Enqueued on `stream` (a cudaStream_t; nullptr
// = default stream); throws ErrorCode::cuda_error if the launch fails.
void bucketed_lru_step(const TwoLevelView<GpuPageEntry>& gpu_pages, const PartitionLookup& lookup,
                       const LruStepBatch& batch, const LruStepOutput& out, std::uint32_t timestamp_buckets,
                       void* stream);

}  // namespace sparsekv::cuda
