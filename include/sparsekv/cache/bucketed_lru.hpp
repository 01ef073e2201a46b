#pragma once
// Bucketed LRU replacement for one (request, layer, kv head) GPU buffer
// (Spin §5.3). Each GPU page carries a timestamp in [0, T) (T = 64 by
// default); one step, for a selection of partitions that must all be resident
// afterwards, runs the paper's four steps with this exact, kernel-reproducible
// tie-breaking:
//
//  1. Hit/miss: a selected partition is a hit iff the meta-partition table
//     marks it resident; page demand = pages of the misses.
//  2. Timestamps, one pass over the GPU page table in slot order: pages of
//     hit partitions -> T-1; every other occupied page -> max(t - 1, 0) and
//     counted in a histogram of T buckets; empty slots are counted as free.
//  3. Eviction: need = demand - free. If need > 0, the threshold is the
//     smallest t whose cumulative count over buckets [0, t] reaches need;
//     every unselected page with timestamp <= t is evicted (pages of one
//     partition always share a timestamp, so whole partitions go) and its
//     partition marked non-resident.
//  4. Admission: misses in selection order, each partition's pages in page
//     order, take the free slots in ascending slot order; timestamp T-1.
//
// The result lists, per selected partition in selection order, its GPU pages
// in page order, and the CPU -> GPU copies of the misses (the copies are the
// caller's to run). The GPU page of a slot belongs to the slot: admission
// only rewrites metadata, as in the paper.
//
// The per-slot rules live in bucketed_lru_rules.hpp, shared with the CUDA
// backend (bucketed_lru_cuda.hpp), which runs the same step for a batch of
// heads in one launch with identical results.
#include <cstdint>
#include <span>
#include <vector>

#include "sparsekv/cache/cache_step.hpp"
#include "sparsekv/core/ids.hpp"
#include "sparsekv/metadata/hierarchical_page_table.hpp"

namespace sparsekv {

struct PageCopy {
  PageId cpu_page = kInvalidPage;
  PageId gpu_page = kInvalidPage;
};

// Output of retrieval steps, appended to head after head.
struct RetrievedPages {
  std::vector<std::uint32_t> partition_offsets{0};  // [selected + 1] into gpu_pages
  std::vector<PageId> gpu_pages;                    // pages of every selected partition
  std::vector<PageCopy> copies;                     // misses: CPU page -> GPU page

  void clear() {
    partition_offsets.assign(1, 0);
    gpu_pages.clear();
    copies.clear();
  }
};

class BucketedLru {
 public:
  explicit BucketedLru(std::uint32_t timestamp_buckets = 64);

  // Checks a selection for one head without changing anything: partitions in
  // range and distinct, and their pages within `max_pages` and the head's
  // GPU slots (unless `cached` is false: a buffer that attends the CPU tier
  // in place caches nothing). Throws out_of_range / invalid_argument /
  // resource_exhausted. Returns the selection's page count.
  std::uint32_t check(const HierarchicalPageTable& table, RequestId request, std::uint32_t layer, std::uint32_t head,
                      std::span<const PartitionId> selected, std::uint32_t max_pages, bool cached = true);

  // One replacement step (check() must have passed for this selection).
  CacheStepStats step(HierarchicalPageTable& table, RequestId request, std::uint32_t layer, std::uint32_t head,
                      std::span<const PartitionId> selected, RetrievedPages& result);

  std::uint32_t timestamp_buckets() const noexcept { return buckets_; }

 private:
  std::uint32_t mark(std::span<const PartitionId> selected, std::uint32_t partitions);

  std::uint32_t buckets_;
  // selection index + 1 of each partition in the current step, 0 = unselected;
  // reset after each step by walking the selection, so it stays O(selection).
  std::vector<std::uint32_t> selection_slot_;
  std::vector<std::uint32_t> histogram_;
};

// A standalone single-head cache on its own page table, running the same
// BucketedLru code as TieredKVBuffer; used by sparsekv-cachesim and the
// benchmarks to compare against the reference policies.
class BucketedLruCache {
 public:
  BucketedLruCache(std::uint32_t capacity_pages, std::span<const std::uint32_t> partition_pages,
                   std::uint32_t timestamp_buckets = 64);
  CacheStepStats step(std::span<const PartitionId> selected);

 private:
  HostMemoryResource memory_{false};
  HierarchicalPageTable table_;
  BucketedLru lru_;
  RetrievedPages pages_;
  std::uint32_t capacity_;
};

}  // namespace sparsekv
