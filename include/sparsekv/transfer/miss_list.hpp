#pragma once
// The device miss list of a Retrieve step and how the gather kernel walks it
// (page_gather_cuda.hpp: gather_miss_list). Plain C++ shared by the kernel and
// the host emulation that CI runs (tests/attention/test_plan_rules.cpp).
//
// The list is the bucketed-LRU step's output left where the step wrote it:
// head h's CPU -> GPU copies are entries page_offsets[h] .. page_offsets[h] +
// count(h) of two page-id arrays, the rest of each head's region unwritten.
// Only capacities are known on the host, so one captured launch serves every
// step whatever the counts.
//
// fmt-free: kernel translation units and their callers can include it.
#include <cstddef>
#include <cstdint>

#include "sparsekv/core/host_device.hpp"
#include "sparsekv/core/ids.hpp"

namespace sparsekv {

// Page-id -> address map of a pool reserved in chunks (a CPU-tier PagePool:
// PagePool::chunks()): page p lives in chunk p / pages_per_chunk at offset
// (p % pages_per_chunk) * page_stride. A one-chunk pool is the plain
// base + id * stride case. `chunk_bases` is device-accessible for the kernel.
struct ChunkedPages {
  const std::byte* const* chunk_bases = nullptr;
  std::uint32_t pages_per_chunk = 0;
  std::size_t page_stride = 0;

  SPARSEKV_HOST_DEVICE const std::byte* address(PageId page) const {
    return chunk_bases[page / pages_per_chunk] + std::size_t{page % pages_per_chunk} * page_stride;
  }
};

// Every array is device-accessible (device memory or mapped pinned memory);
// `heads` and `max_entries` are the only host-known figures.
struct DeviceMissList {
  std::uint32_t heads = 0;                      // capacity: heads of the LRU launch
  std::uint32_t max_entries = 0;                // capacity of the copy arrays (the LRU launch's page_offsets[heads])
  const std::uint32_t* page_offsets = nullptr;  // [heads]: head h's region starts here
  // Head h copies counts[h * count_stride] entries. A 64-bit strided view so
  // the LRU step's CacheStepStats::miss_pages is read in place
  // (&stats->miss_pages, stride sizeof(CacheStepStats) / 8) with no
  // compaction launch in between; a plain uint64 array is stride 1.
  const std::uint64_t* counts = nullptr;
  std::uint32_t count_stride = 1;
  const PageId* cpu_pages = nullptr;  // [max_entries] copy sources (CPU-tier page ids)
  const PageId* gpu_pages = nullptr;  // [max_entries] copy destinations (GPU-tier page ids)
};

// Entries head h copies: its count, cut at the copy arrays' capacity so that a
// corrupt count can never read past them.
SPARSEKV_HOST_DEVICE inline std::uint64_t miss_list_entries(std::uint32_t page_offset, std::uint64_t count,
                                                            std::uint32_t max_entries) {
  const std::uint64_t room = page_offset < max_entries ? max_entries - page_offset : 0;
  return count < room ? count : room;
}

// Warp w of `warps` owns the flattened entries j == w (mod warps) of the
// concatenation of all heads' entries (the order of the host's copy list). A
// head whose entries start at flattened index `start` gives warp w its first
// entry here (>= start; the head has one for w iff it is < start + entries).
SPARSEKV_HOST_DEVICE inline std::uint64_t miss_list_first(std::uint64_t start, std::uint32_t warp,
                                                          std::uint32_t warps) {
  const std::uint64_t phase = start % warps;
  return start + (warp >= phase ? warp - phase : warps - phase + warp);
}

}  // namespace sparsekv
