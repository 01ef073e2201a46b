#pragma once
// Per-element rules of one bucketed-LRU step (Spin §5.3), written once for
// both backends: BucketedLru::step (host, one sequential pass) and
// sparsekv::cuda::bucketed_lru_step (one block per head, data-parallel) call
// these, so CI exercises the kernel's logic on the host. The step they make
// up is documented in bucketed_lru.hpp and docs/buffer.md. fmt-free.
#include <cstdint>

#include "sparsekv/core/host_device.hpp"
#include "sparsekv/core/ids.hpp"
#include "sparsekv/metadata/page_table_entries.hpp"

namespace sparsekv {

inline constexpr std::uint32_t kMinTimestampBuckets = 2;
inline constexpr std::uint32_t kMaxTimestampBuckets = 256;  // timestamps are 8-bit
// Selection index of a partition the step did not select.
inline constexpr std::uint32_t kNotSelected = 0xffffffffu;

// Timestamp of pages used in this step (hits and admissions): the top bucket T-1.
SPARSEKV_HOST_DEVICE constexpr std::uint8_t lru_top(std::uint32_t buckets) {
  return static_cast<std::uint8_t>(buckets - 1);
}

// Ageing of a page the step did not use: one bucket down, saturating at 0.
SPARSEKV_HOST_DEVICE constexpr std::uint8_t lru_demote(std::uint8_t timestamp) {
  return timestamp == 0 ? std::uint8_t{0} : static_cast<std::uint8_t>(timestamp - 1);
}

enum class LruTouch : std::uint8_t {
  free,  // empty slot: counts as free
  hit,   // page of a selected (hence resident) partition: promoted to the top
  aged,  // any other page: demoted and counted in the histogram bucket of its new timestamp
};

// Step 2 for one slot. `selection` is the selection index of the slot's
// partition (kNotSelected if unselected); ignored for an empty slot.
SPARSEKV_HOST_DEVICE inline LruTouch lru_touch(GpuPageEntry& e, std::uint32_t selection, std::uint8_t top) {
  if (!e.occupied()) return LruTouch::free;
  if (selection != kNotSelected) {
    e.timestamp = top;
    return LruTouch::hit;
  }
  e.timestamp = lru_demote(e.timestamp);
  return LruTouch::aged;
}

// Step 3: the eviction threshold, -1 = evict nothing. With `free_slots` free
// and `demand` pages to admit, the smallest t whose cumulative count over
// buckets [0, t] reaches the shortfall. It never passes T-2: unselected pages
// were demoted below the top, and the selection check guarantees they cover
// the shortfall.
SPARSEKV_HOST_DEVICE inline int lru_threshold(const std::uint32_t* histogram, std::uint32_t buckets,
                                              std::uint32_t demand, std::uint32_t free_slots) {
  int threshold = -1;
  if (demand > free_slots) {
    std::uint32_t covered = 0;
    while (covered < demand - free_slots && threshold + 2 < static_cast<int>(buckets)) {
      covered += histogram[++threshold];
    }
  }
  return threshold;
}

// The part of the eviction predicate that needs no selection lookup: an
// occupied page at or below the threshold. The kernel looks the partition up
// only when this holds.
SPARSEKV_HOST_DEVICE inline bool lru_may_evict(const GpuPageEntry& e, int threshold) {
  return e.occupied() && static_cast<int>(e.timestamp) <= threshold;
}

// Step 3 for one slot (after step 2): unselected, occupied, at or below the threshold.
SPARSEKV_HOST_DEVICE inline bool lru_evicts(const GpuPageEntry& e, std::uint32_t selection, int threshold) {
  return lru_may_evict(e, threshold) && selection == kNotSelected;
}

// Evicts the page of `e`; `m` is its partition's meta entry, marked
// non-resident (every page of it goes in the same step: they share a timestamp).
SPARSEKV_HOST_DEVICE inline void lru_evict(GpuPageEntry& e, MetaPartitionEntry& m) {
  m = MetaPartitionEntry::make(m.token_count(), false);
  e.partition = kInvalidPartition;
}

// Step 4 for one free slot: it now caches page `page` of `partition`.
SPARSEKV_HOST_DEVICE inline void lru_admit(GpuPageEntry& e, PartitionId partition, std::uint32_t page,
                                           std::uint8_t top) {
  e.partition = partition;
  e.page_in_partition = static_cast<std::uint16_t>(page);
  e.timestamp = top;
}

// A miss partition becomes resident once its last page is admitted.
SPARSEKV_HOST_DEVICE inline void lru_set_resident(MetaPartitionEntry& m) {
  m = MetaPartitionEntry::make(m.token_count(), true);
}

// Which page the k-th free slot (in ascending slot order, k < demand)
// receives: `miss_starts[j]` is the exclusive prefix of the page counts of
// misses 0..j-1 (misses in selection order), so the k-th slot takes page
// k - miss_starts[j] of the last miss j with miss_starts[j] <= k. This is the
// host's sequential admission cursor turned into a lookup.
struct LruAdmission {
  std::uint32_t miss;  // index among the misses
  std::uint32_t page;  // page of that partition
};

SPARSEKV_HOST_DEVICE inline LruAdmission lru_admission(std::uint32_t k, const std::uint32_t* miss_starts,
                                                       std::uint32_t misses) {
  std::uint32_t lo = 0;  // invariant: miss_starts[lo] <= k (miss_starts[0] == 0)
  std::uint32_t hi = misses;
  while (hi - lo > 1) {
    const std::uint32_t mid = lo + (hi - lo) / 2;
    if (miss_starts[mid] <= k) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return {lo, k - miss_starts[lo]};
}

// Step 0: the low key bits the kernel's radix sort of a selection needs
// when its largest partition id is max_partition: every id up to it is below
// the padding (kInvalidPartition) in these bits, so a stable sort over them
// alone still puts the selection in id order and the padding after it.
SPARSEKV_HOST_DEVICE constexpr int lru_sort_bits(PartitionId max_partition) {
  int bits = 1;
  while (bits < 32 && (std::uint64_t{max_partition} + 1) >> bits != 0) ++bits;
  return bits;
}

// Selection index of `partition` in a selection sorted by partition id
// (`indices[i]` is the selection index of `sorted[i]`), or kNotSelected.
SPARSEKV_HOST_DEVICE inline std::uint32_t lru_find_selection(const PartitionId* sorted, const std::uint32_t* indices,
                                                             std::uint32_t count, PartitionId partition) {
  std::uint32_t lo = 0;
  std::uint32_t hi = count;
  while (lo < hi) {
    const std::uint32_t mid = lo + (hi - lo) / 2;
    if (sorted[mid] < partition) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo < count && sorted[lo] == partition ? indices[lo] : kNotSelected;
}

}  // namespace sparsekv
