#pragma once
// CUDA backend of the Retrieve copy step: Gather H2D (Spin §5.5, SparseServe
// §3.2.1 FlashH2D). One kernel launch copies a list of scattered pages; each
// warp copies whole pages with 16-byte vector accesses, a persistent grid
// spreads the pages over all warps regardless of owning head or request.
//
// fmt-free: kernel translation units and their callers can include it. The
// host side of a retrieve produces PageCopy{cpu_page, gpu_page} lists
// (cache/bucketed_lru.hpp); pass them here as two plain arrays of page ids.
#include <cstddef>
#include <cstdint>

#include "sparsekv/core/ids.hpp"
#include "sparsekv/transfer/miss_list.hpp"

namespace sparsekv::cuda {

struct GatherConfig {
  // Cap on the SMs taken from compute: the grid is at most max_sms x (resident
  // blocks per SM) blocks, i.e. the footprint of max_sms SMs. The hardware
  // block scheduler may still place those blocks on more SMs than max_sms; the
  // cap bounds the warps taken, not their placement. 0 = all SMs.
  std::uint32_t max_sms = 0;
  // Threads per block / 32; one warp copies one page at a time. 1..32.
  std::uint32_t warps_per_block = 8;
};

// Copies page src_pages[i] of the source pool to page dst_pages[i] of the
// destination pool, for i < count:
//   dst_base + dst_pages[i] * dst_stride  <-  src_base + src_pages[i] * src_stride,
// page_bytes bytes each. dst_pages == nullptr gathers into a contiguous buffer
// (destination page i), e.g. a device-to-device gather into an execution buffer.
//
// `src_pages` and `dst_pages` are device-accessible (device memory or mapped
// pinned host memory). `src_base` is device memory or pinned host memory read
// through UVA (the CPU tier of a PagePool when a device exists); `dst_base` is
// device memory. Page ids are not bounds-checked: they must lie inside their
// pools. Source and destination pages must not overlap.
//
// Checked on the host before launching (ErrorCode::invalid_argument):
// page_bytes is a non-zero multiple of 16; src_base, dst_base, src_stride and
// dst_stride are multiples of 16 with strides >= page_bytes; the page-id
// arrays and bases are non-null when count > 0; 1 <= warps_per_block <= 32.
// Enqueued on `stream` (a cudaStream_t; nullptr = default stream);
// throws ErrorCode::cuda_error if a device query or the launch fails.
void gather_pages(const PageId* src_pages, const PageId* dst_pages, std::uint32_t count, const std::byte* src_base,
                  std::size_t src_stride, std::byte* dst_base, std::size_t dst_stride, std::size_t page_bytes,
                  const GatherConfig& config, void* stream);

// The same copy with one address per page: page i moves src[i] -> dst[i]
// (page_bytes each), for pools reserved in chunks (a CPU-tier PagePool) that
// have no single base. Both address arrays are device-accessible; every
// address is 16-byte aligned (pages of a PagePool are). Checks and errors as
// gather_pages.
void gather_page_addresses(const std::byte* const* src, std::byte* const* dst, std::uint32_t count,
                           std::size_t page_bytes, const GatherConfig& config, void* stream);

// The Retrieve copy step straight from the device miss list (miss_list.hpp):
// for every head h < misses.heads, entries page_offsets[h] .. page_offsets[h]
// + counts[h * count_stride] (cut at max_entries) move
//   gpu_base + gpu_pages[e] * gpu_stride  <-  cpu_tier.address(cpu_pages[e]),
// page_bytes each. Nothing about the counts is read on the host: the grid is
// sized from the capacities, so the launch can be captured in a CUDA graph
// and replayed while the counts change.
//
// Decomposition: the persistent grid's warps own the flattened (head, entry)
// space round-robin (miss_list_first), as gather_pages owns its list. Each
// warp walks the heads 32 at a time, one head per lane, prefix-summing the
// counts with a warp scan to find where each head starts in the flattened
// space, and copies its own entries of those heads with the same 16-byte
// unrolled page copy: every warp gets an even share of the pages however the
// misses fall on heads, with no host prefix sum and no extra launch. The price
// is O(heads) count reads per warp, which stay in L2.
//
// Checked on the host before launching (ErrorCode::invalid_argument):
// page_bytes a non-zero multiple of 16; gpu_base, gpu_stride and
// cpu_tier.page_stride multiples of 16 with strides >= page_bytes;
// cpu_tier.pages_per_chunk > 0; count_stride > 0; non-null page_offsets,
// counts, copy arrays, chunk_bases and gpu_base when heads > 0 and
// max_entries > 0 (otherwise nothing is enqueued); 1 <= warps_per_block <= 32.
// Chunk bases must be 16-byte aligned (PagePool chunks are; not checkable on
// the host). Enqueued on `stream`; throws ErrorCode::cuda_error if a device
// query or the launch fails.
void gather_miss_list(const DeviceMissList& misses, const ChunkedPages& cpu_tier, std::byte* gpu_base,
                      std::size_t gpu_stride, std::size_t page_bytes, const GatherConfig& config, void* stream);

}  // namespace sparsekv::cuda
