// CUDA kernels of the cache layer: the bucketed-LRU step (Spin §5.3), one
// thread block per (request, layer, kv head) buffer. The host step is one
// sequential pass with cursors; here each of its decisions is a per-element
// rule (bucketed_lru_rules.hpp) plus an exclusive scan that recovers the
// cursor: docs/buffer.md, "The CUDA step". Beside it, the glue from Select's
// output to the step's batch and the stats accumulation (lru_batch_cuda.hpp).
#include <cuda_runtime.h>

#include <cub/block/block_radix_sort.cuh>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <cub/device/device_scan.cuh>
#include <string>

#include "sparsekv/cache/bucketed_lru_cuda.hpp"
#include "sparsekv/cache/bucketed_lru_rules.hpp"
#include "sparsekv/cache/lru_batch_cuda.hpp"
#include "core/launch_support.cuh"
#include "sparsekv/core/error_code.hpp"

namespace sparsekv::cuda {
namespace {

using namespace detail;  // core/launch_support.cuh
constexpr const char* kFunction = "bucketed_lru_step";

constexpr std::uint32_t kThreads = 256;
constexpr std::uint32_t kSortItems = kLruSharedSelection / kThreads;
static_assert(kSortItems * kThreads == kLruSharedSelection);
// Independent GPU page entries each thread loads before processing them in
// the timestamp pass: the pass is a bandwidth-bound stream over the table.
constexpr std::uint32_t kUnroll = 4;
// Resident blocks per SM the register budget is sized for (on an H100 4 x 43 KB
// of shared memory fit too): independent heads hide each other's barriers.
constexpr std::uint32_t kMinBlocksPerSm = 4;

using Sort = cub::BlockRadixSort<PartitionId, kThreads, kSortItems, std::uint32_t>;
// A selection of at most kThreads partitions (the common case: slots / 8 at
// 1,024 slots) is sorted one key per thread, an eighth of Sort's work.
using SortOne = cub::BlockRadixSort<PartitionId, kThreads, 1, std::uint32_t>;
using MaxKey = cub::BlockReduce<PartitionId, kThreads>;
using Scan = cub::BlockScan<std::uint32_t, kThreads>;

struct MaxPartition {
  __device__ PartitionId operator()(PartitionId a, PartitionId b) const { return a > b ? a : b; }
};

// This thread's entries of kUnroll tiles of kThreads slots from `base`, all
// loaded before any is used (nullptr past the head's length).
__device__ __forceinline__ void load_tile(const TwoLevelView<GpuPageEntry>& slots, std::size_t inst, std::uint32_t base,
                                          std::uint32_t length, GpuPageEntry* (&at)[kUnroll],
                                          GpuPageEntry (&e)[kUnroll]) {
#pragma unroll
  for (std::uint32_t u = 0; u < kUnroll; ++u) {
    const std::uint32_t s = base + u * kThreads + threadIdx.x;
    at[u] = s < length ? slots.find(inst, s) : nullptr;
    if (at[u] != nullptr) e[u] = *at[u];
  }
}

struct SharedState {
  union {
    typename Sort::TempStorage sort;
    typename SortOne::TempStorage sort_one;
    typename MaxKey::TempStorage max_key;
    typename Scan::TempStorage scan;
  } temp;
  // The head's selection sorted by partition id, with selection indices.
  PartitionId sorted[kLruSharedSelection];
  std::uint32_t indices[kLruSharedSelection];
  // Per miss (in selection order): exclusive prefix of miss pages, selection index.
  std::uint32_t miss_starts[kLruSharedSelection];
  std::uint32_t miss_selection[kLruSharedSelection];
  std::uint32_t histogram[kMaxTimestampBuckets];
  std::uint32_t free_slots;
  std::uint32_t evicted;
  int threshold;
  int sort_bits;
};

__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm)
    bucketed_lru_step_kernel(TwoLevelView<GpuPageEntry> slots, PartitionLookup lookup, LruStepBatch batch,
                             LruStepOutput out, std::uint32_t buckets) {
  __shared__ SharedState sh;
  const std::uint32_t tid = threadIdx.x;
  const std::uint32_t head = blockIdx.x;
  const std::size_t inst = batch.instances[head];
  const std::uint32_t first = batch.selection_offsets[head];
  const std::uint32_t n = batch.selection_offsets[head + 1] - first;
  const PartitionId* selected = batch.selected + first;
  const std::uint32_t page_base = batch.page_offsets[head];
  // offsets[i]: output index of selection i's first page. Written in pass 1,
  // read back by this block after a barrier.
  std::uint32_t* offsets = out.partition_offsets + first;
  const std::uint8_t top = lru_top(buckets);
  const auto& meta = lookup.meta;

  if (head == 0 && tid == 0) {
    out.partition_offsets[batch.selection_offsets[batch.heads]] = batch.page_offsets[batch.heads];
  }
  for (std::uint32_t b = tid; b < kMaxTimestampBuckets; b += kThreads) sh.histogram[b] = 0;
  if (tid == 0) {
    sh.free_slots = 0;
    sh.evicted = 0;
  }

  // 0. Partition -> selection index: the selection sorted by partition id,
  // searched by binary search (the host indexes a per-partition array).
  const bool in_shared = n <= kLruSharedSelection;
  PartitionId* sorted = sh.sorted;
  std::uint32_t* indices = sh.indices;
  std::uint32_t* miss_starts = sh.miss_starts;
  std::uint32_t* miss_selection = sh.miss_selection;
  if (in_shared) {
    // Keys blocked over the threads (one each when n <= kThreads), padding
    // sorting last; the sort covers only the bits the largest id needs
    // (lru_sort_bits): partition ids are small, so half the radix passes or fewer.
    const std::uint32_t items = n <= kThreads ? 1 : kSortItems;
    PartitionId keys[kSortItems];
    std::uint32_t values[kSortItems];
    PartitionId local_max = 0;
#pragma unroll
    for (std::uint32_t k = 0; k < kSortItems; ++k) {
      const std::uint32_t i = tid * items + k;
      keys[k] = k < items && i < n ? selected[i] : kInvalidPartition;
      values[k] = i;
      if (k < items && i < n && keys[k] > local_max) local_max = keys[k];
    }
    const PartitionId max_key = MaxKey(sh.temp.max_key).Reduce(local_max, MaxPartition{});
    if (tid == 0) sh.sort_bits = lru_sort_bits(max_key);
    __syncthreads();  // sort_bits, and the reduction's storage free for the sort
    const int bits = sh.sort_bits;
    if (items == 1) {
      PartitionId key[1] = {keys[0]};
      std::uint32_t value[1] = {values[0]};
      SortOne(sh.temp.sort_one).Sort(key, value, 0, bits);
      keys[0] = key[0];
      values[0] = value[0];
    } else {
      Sort(sh.temp.sort).Sort(keys, values, 0, bits);
    }
#pragma unroll
    for (std::uint32_t k = 0; k < kSortItems; ++k) {
      const std::uint32_t i = tid * items + k;
      if (k < items && i < n) {
        sorted[i] = keys[k];
        indices[i] = values[k];
      }
    }
  } else {
    // Rank sort into global scratch: partitions are distinct, so each one's
    // rank is the count of smaller ones.
    std::uint32_t* scratch = batch.scratch + 4 * static_cast<std::size_t>(first);
    sorted = scratch;
    indices = scratch + n;
    miss_starts = scratch + 2 * static_cast<std::size_t>(n);
    miss_selection = scratch + 3 * static_cast<std::size_t>(n);
    for (std::uint32_t i = tid; i < n; i += kThreads) {
      const PartitionId p = selected[i];
      std::uint32_t rank = 0;
      for (std::uint32_t j = 0; j < n; ++j) rank += selected[j] < p ? 1u : 0u;
      sorted[rank] = p;
      indices[rank] = i;
    }
  }
  __syncthreads();  // also orders the sort's temp storage before the scans reuse it

  // 1. Hit/miss and the output layout, in selection order: exclusive scans of
  // the page counts (output offsets) and of the misses (admission order).
  std::uint32_t total_pages = 0;
  std::uint32_t misses = 0;
  std::uint32_t demand = 0;
  for (std::uint32_t base = 0; base < n; base += kThreads) {
    const std::uint32_t i = base + tid;
    std::uint32_t pages = 0;
    bool miss = false;
    if (i < n) {
      const MetaPartitionEntry m = *meta.find(inst, selected[i]);
      pages = pages_for_tokens(m.token_count(), lookup.page_tokens);
      miss = !m.resident();
    }
    std::uint32_t at = 0, chunk_pages = 0;
    Scan(sh.temp.scan).ExclusiveSum(pages, at, chunk_pages);
    __syncthreads();
    std::uint32_t rank = 0, chunk_misses = 0;
    Scan(sh.temp.scan).ExclusiveSum(miss ? 1u : 0u, rank, chunk_misses);
    __syncthreads();
    std::uint32_t miss_at = 0, chunk_demand = 0;
    Scan(sh.temp.scan).ExclusiveSum(miss ? pages : 0u, miss_at, chunk_demand);
    __syncthreads();
    if (i < n) {
      offsets[i] = page_base + total_pages + at;
      if (miss) {
        miss_starts[misses + rank] = demand + miss_at;
        miss_selection[misses + rank] = i;
      }
    }
    total_pages += chunk_pages;
    misses += chunk_misses;
    demand += chunk_demand;
  }
  __syncthreads();  // offsets and the miss arrays are read by other threads below

  const auto selection_of = [&](PartitionId p) { return lru_find_selection(sorted, indices, n, p); };

  // 2. Timestamps and the histogram (shared-memory atomics); hits report their pages.
  const std::uint32_t length = slots.length(inst);
  std::uint32_t free_local = 0;
  for (std::uint32_t base = 0; base < length; base += kThreads * kUnroll) {
    GpuPageEntry* at[kUnroll];
    GpuPageEntry e[kUnroll];
    load_tile(slots, inst, base, length, at, e);
#pragma unroll
    for (std::uint32_t u = 0; u < kUnroll; ++u) {
      if (at[u] == nullptr) continue;
      const std::uint32_t sel = e[u].occupied() ? selection_of(e[u].partition) : kNotSelected;
      switch (lru_touch(e[u], sel, top)) {
        case LruTouch::free:
          ++free_local;
          break;
        case LruTouch::hit:
          at[u]->timestamp = e[u].timestamp;
          out.gpu_pages[offsets[sel] + e[u].page_in_partition] = e[u].gpu_page;
          break;
        case LruTouch::aged:
          at[u]->timestamp = e[u].timestamp;
          atomicAdd(&sh.histogram[e[u].timestamp], 1u);
          break;
      }
    }
  }
  if (free_local != 0) atomicAdd(&sh.free_slots, free_local);
  __syncthreads();

  // 3. The threshold, from the block's histogram (at most T steps).
  if (tid == 0) sh.threshold = lru_threshold(sh.histogram, buckets, demand, sh.free_slots);
  __syncthreads();

  // 3+4. Eviction and admission in slot order, a tile of kThreads slots at a
  // time. A slot's admission rank k (the host's cursor) is the exclusive scan
  // of "free after eviction" over the slots before it; k < demand takes the
  // page lru_admission maps k to. Once every miss page is placed the scans
  // stop and the rest of the pass only evicts. Each thread owns its slots in
  // this pass, so it loads kUnroll tiles' entries ahead.
  std::uint32_t evicted_local = 0;
  if (demand > 0) {
    const int threshold = sh.threshold;
    std::uint32_t admitted = 0;  // free slots before the current tile (block-uniform)
    for (std::uint32_t base = 0; base < length; base += kThreads * kUnroll) {
      GpuPageEntry* at[kUnroll];
      GpuPageEntry e[kUnroll];
      load_tile(slots, inst, base, length, at, e);
#pragma unroll
      for (std::uint32_t u = 0; u < kUnroll; ++u) {
        if (at[u] != nullptr && lru_may_evict(e[u], threshold) &&
            lru_evicts(e[u], selection_of(e[u].partition), threshold)) {
          lru_evict(e[u], *meta.find(inst, e[u].partition));
          at[u]->partition = e[u].partition;
          ++evicted_local;
        }
        if (admitted >= demand) continue;
        const bool free = at[u] != nullptr && !e[u].occupied();
        std::uint32_t k = 0, tile_free = 0;
        Scan(sh.temp.scan).ExclusiveSum(free ? 1u : 0u, k, tile_free);
        __syncthreads();
        k += admitted;
        if (free && k < demand) {
          const LruAdmission a = lru_admission(k, miss_starts, misses);
          const std::uint32_t i = miss_selection[a.miss];
          const PartitionId p = selected[i];
          lru_admit(e[u], p, a.page, top);
          *at[u] = e[u];
          out.gpu_pages[offsets[i] + a.page] = e[u].gpu_page;
          out.copy_cpu_pages[page_base + k] = *lookup.cpu_pages.find(inst, *lookup.offsets.find(inst, p) + a.page);
          out.copy_gpu_pages[page_base + k] = e[u].gpu_page;
          MetaPartitionEntry& m = *meta.find(inst, p);
          if (a.page + 1 == pages_for_tokens(m.token_count(), lookup.page_tokens)) lru_set_resident(m);
        }
        admitted += tile_free;
      }
    }
  }
  if (evicted_local != 0) atomicAdd(&sh.evicted, evicted_local);
  __syncthreads();

  if (tid == 0) {
    CacheStepStats stats;
    stats.hit_partitions = n - misses;
    stats.miss_partitions = misses;
    stats.hit_pages = total_pages - demand;
    stats.miss_pages = demand;
    stats.evicted_pages = sh.evicted;
    out.stats[head] = stats;
  }
}

}  // namespace

void bucketed_lru_step(const TwoLevelView<GpuPageEntry>& gpu_pages, const PartitionLookup& lookup,
                       const LruStepBatch& batch, const LruStepOutput& out, std::uint32_t timestamp_buckets,
                       void* stream) {
  // Validation first: nothing is enqueued when an argument is wrong.
  if (timestamp_buckets < kMinTimestampBuckets || timestamp_buckets > kMaxTimestampBuckets) {
    throw_invalid(kFunction, "timestamp_buckets " + std::to_string(timestamp_buckets) + " is not in [2, 256]");
  }
  if (batch.heads > 0x7fffffffu) throw_invalid(kFunction, "heads " + std::to_string(batch.heads) + " exceeds 2^31 - 1");
  if (batch.heads == 0) return;
  if (batch.instances == nullptr || batch.selection_offsets == nullptr || batch.page_offsets == nullptr ||
      out.partition_offsets == nullptr || out.stats == nullptr) {
    throw_invalid(kFunction, "null instances, selection_offsets, page_offsets, partition_offsets or stats with " +
                                 std::to_string(batch.heads) + " heads");
  }
  if (batch.max_selection > 0 && (batch.selected == nullptr || out.gpu_pages == nullptr ||
                                  out.copy_cpu_pages == nullptr || out.copy_gpu_pages == nullptr)) {
    throw_invalid(kFunction,
                  "null selected, gpu_pages or copy arrays with max_selection " + std::to_string(batch.max_selection));
  }
  if (batch.max_selection > kLruSharedSelection && batch.scratch == nullptr) {
    throw_invalid(kFunction, "max_selection " + std::to_string(batch.max_selection) + " exceeds " +
                                 std::to_string(kLruSharedSelection) + " and no scratch was given");
  }
  bucketed_lru_step_kernel<<<batch.heads, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(gpu_pages, lookup, batch,
                                                                                            out, timestamp_buckets);
  check_launch(kFunction);
}

namespace {

using namespace detail;  // core/launch_support.cuh

constexpr std::size_t kAlign = 256;

std::size_t aligned_bytes(std::size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

// build_lru_batch's workspace: per-row selection counts and page sums (scan
// inputs), then CUB's temporary storage.
struct BatchWorkspace {
  std::uint32_t* row_counts;
  std::uint32_t* row_pages;
  void* scan;
  std::size_t scan_bytes;
};

std::size_t batch_scan_bytes(std::uint32_t rows) {
  std::size_t bytes = 0;
  const cudaError_t status =
      cub::DeviceScan::InclusiveSum(nullptr, bytes, static_cast<const std::uint32_t*>(nullptr),
                                    static_cast<std::uint32_t*>(nullptr), static_cast<int>(rows));
  if (status != cudaSuccess)
    throw_cuda("lru_batch_workspace_bytes", "cub::DeviceScan::InclusiveSum size query", status);
  return bytes;
}

BatchWorkspace carve_batch(void* base, std::uint32_t rows) {
  auto* bytes = static_cast<std::byte*>(base);
  const std::size_t row_bytes = aligned_bytes(std::size_t{rows} * sizeof(std::uint32_t));
  BatchWorkspace w;
  w.row_counts = reinterpret_cast<std::uint32_t*>(bytes);
  w.row_pages = reinterpret_cast<std::uint32_t*>(bytes + row_bytes);
  w.scan = bytes + 2 * row_bytes;
  w.scan_bytes = batch_scan_bytes(rows);
  return w;
}

// One block per row: its (cut) count and the page sum of its selections.
__global__ void __launch_bounds__(kLruBatchThreads)
    lru_batch_count_kernel(PartitionLookup lookup, LruBatchInput in, LruBatchOutput out, BatchWorkspace w) {
  using Reduce = cub::BlockReduce<std::uint32_t, kLruBatchThreads>;
  __shared__ typename Reduce::TempStorage reduce;
  const std::uint32_t row = blockIdx.x;
  if (row == 0 && threadIdx.x == 0) {
    out.selection_offsets[0] = 0;
    out.page_offsets[0] = 0;
  }
  const std::uint32_t n = lru_batch_count(in, row);
  std::uint32_t pages = 0;
  for (std::uint32_t i = threadIdx.x; i < n; i += kLruBatchThreads) {
    pages += lru_batch_selection(lookup, in, row, i).pages;
  }
  pages = Reduce(reduce).Sum(pages);
  if (threadIdx.x == 0) {
    w.row_counts[row] = n;
    w.row_pages[row] = pages;
  }
}

// One block per row: its selections and their tokens at their compact places.
__global__ void __launch_bounds__(kLruBatchThreads)
    lru_batch_fill_kernel(PartitionLookup lookup, LruBatchInput in, LruBatchOutput out) {
  const std::uint32_t row = blockIdx.x;
  const std::uint32_t n = lru_batch_count(in, row);
  const std::uint32_t first = out.selection_offsets[row];
  for (std::uint32_t i = threadIdx.x; i < n; i += kLruBatchThreads) {
    lru_batch_emit(out, lru_batch_selection(lookup, in, row, i), first + i);
  }
}

struct StepStatsSum {
  __device__ CacheStepStats operator()(const CacheStepStats& a, const CacheStepStats& b) const {
    return step_stats_sum(a, b);
  }
};

// One block: thread t sums heads t, t + kStepStatsThreads, ...; the block's
// reduction is added to the total.
__global__ void __launch_bounds__(kStepStatsThreads)
    accumulate_step_stats_kernel(const CacheStepStats* stats, std::uint32_t heads, CacheStepStats* total) {
  using Reduce = cub::BlockReduce<CacheStepStats, kStepStatsThreads>;
  __shared__ typename Reduce::TempStorage reduce;
  CacheStepStats sum;
  for (std::uint32_t h = threadIdx.x; h < heads; h += kStepStatsThreads) sum = step_stats_sum(sum, stats[h]);
  sum = Reduce(reduce).Reduce(sum, StepStatsSum{});
  if (threadIdx.x == 0) *total = step_stats_sum(*total, sum);
}

}  // namespace

std::size_t lru_batch_workspace_bytes(std::uint32_t rows) {
  return 2 * aligned_bytes(std::size_t{rows} * sizeof(std::uint32_t)) + batch_scan_bytes(rows);
}

void build_lru_batch(const PartitionLookup& lookup, const LruBatchInput& in, const LruBatchOutput& out, void* workspace,
                     std::size_t workspace_bytes, void* stream) {
  // Validation first: nothing is enqueued when an argument is wrong.
  constexpr const char* kBatchFunction = "build_lru_batch";
  if (lookup.page_tokens == 0) throw_invalid(kBatchFunction, "page_tokens is 0");
  if (in.rows > 0x7fffffffu) throw_invalid(kBatchFunction, "rows " + std::to_string(in.rows) + " exceed 2^31 - 1");
  if (std::uint64_t{in.rows} * in.max_selected > 0xffffffffu) {
    throw_invalid(kBatchFunction, "rows " + std::to_string(in.rows) + " x max_selected " +
                                      std::to_string(in.max_selected) + " exceed 2^32 - 1: the offsets are 32-bit");
  }
  if (in.rows == 0) return;
  if (in.selected_count == nullptr || in.instances == nullptr || out.selection_offsets == nullptr ||
      out.page_offsets == nullptr) {
    throw_invalid(kBatchFunction, "null selected_count, instances, selection_offsets or page_offsets");
  }
  if (in.max_selected > 0 && (in.selected == nullptr || out.selected == nullptr || out.partition_tokens == nullptr)) {
    throw_invalid(kBatchFunction,
                  "null selected or partition_tokens with max_selected " + std::to_string(in.max_selected));
  }
  const std::size_t needed = lru_batch_workspace_bytes(in.rows);
  if (workspace == nullptr || workspace_bytes < needed) {
    throw_invalid(kBatchFunction,
                  "workspace of " + std::to_string(workspace_bytes) + " bytes, " + std::to_string(needed) + " needed");
  }
  const auto s = static_cast<cudaStream_t>(stream);
  const BatchWorkspace w = carve_batch(workspace, in.rows);
  lru_batch_count_kernel<<<in.rows, kLruBatchThreads, 0, s>>>(lookup, in, out, w);
  check_launch(kBatchFunction);
  std::size_t bytes = w.scan_bytes;
  cudaError_t status = cub::DeviceScan::InclusiveSum(w.scan, bytes, w.row_counts, out.selection_offsets + 1,
                                                     static_cast<int>(in.rows), s);
  if (status != cudaSuccess) throw_cuda(kBatchFunction, "cub::DeviceScan::InclusiveSum", status);
  status =
      cub::DeviceScan::InclusiveSum(w.scan, bytes, w.row_pages, out.page_offsets + 1, static_cast<int>(in.rows), s);
  if (status != cudaSuccess) throw_cuda(kBatchFunction, "cub::DeviceScan::InclusiveSum", status);
  if (in.max_selected > 0) {
    lru_batch_fill_kernel<<<in.rows, kLruBatchThreads, 0, s>>>(lookup, in, out);
    check_launch(kBatchFunction);
  }
}

void accumulate_step_stats(const CacheStepStats* stats, std::uint32_t heads, CacheStepStats* total, void* stream) {
  constexpr const char* kStatsFunction = "accumulate_step_stats";
  if (total == nullptr) throw_invalid(kStatsFunction, "null total");
  if (heads == 0) return;
  if (stats == nullptr) throw_invalid(kStatsFunction, "null stats with " + std::to_string(heads) + " heads");
  accumulate_step_stats_kernel<<<1, kStepStatsThreads, 0, static_cast<cudaStream_t>(stream)>>>(stats, heads, total);
  check_launch(kStatsFunction);
}

}  // namespace sparsekv::cuda
