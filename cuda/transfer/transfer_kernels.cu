// CUDA kernels of the transfer layer: Gather H2D (Spin §5.5 warp-based copy
// kernel, SparseServe §3.2.1 FlashH2D GPU-direct loading through UVA).
#include <cuda_runtime.h>

#include <cstdint>
#include <cub/warp/warp_scan.cuh>
#include <string>

#include "core/launch_support.cuh"
#include "sparsekv/core/error_code.hpp"
#include "sparsekv/transfer/page_gather_cuda.hpp"

namespace sparsekv::cuda {
namespace {

using namespace detail;  // core/launch_support.cuh

constexpr std::uint32_t kWarp = 32;
// Independent 16-byte loads per thread issued before the first store: PCIe
// reads are latency-bound, throughput follows the bytes outstanding.
constexpr std::uint32_t kUnroll = 4;
constexpr std::size_t kVec = sizeof(uint4);  // 16 bytes

// Where page p comes from and goes to: page ids into two pools, or explicit
// addresses (pools reserved in chunks have no single base).
struct PoolAddressing {
  const PageId* __restrict__ src_pages;
  const PageId* __restrict__ dst_pages;  // nullptr: destination page p of a contiguous buffer
  const uint4* __restrict__ src;
  std::size_t src_stride_vec;
  uint4* __restrict__ dst;
  std::size_t dst_stride_vec;
  __device__ const uint4* source(std::uint32_t p) const {
    return src + static_cast<std::size_t>(src_pages[p]) * src_stride_vec;
  }
  __device__ uint4* destination(std::uint32_t p) const {
    return dst + static_cast<std::size_t>(dst_pages != nullptr ? dst_pages[p] : p) * dst_stride_vec;
  }
};

struct PointerAddressing {
  const std::byte* const* __restrict__ src;
  std::byte* const* __restrict__ dst;
  __device__ const uint4* source(std::uint32_t p) const { return reinterpret_cast<const uint4*>(src[p]); }
  __device__ uint4* destination(std::uint32_t p) const { return reinterpret_cast<uint4*>(dst[p]); }
};

// Lane l of a warp moves vectors l, l + 32, ... of one page, kUnroll of them in flight.
__device__ __forceinline__ void copy_page(const uint4* __restrict__ s, uint4* __restrict__ d, std::uint32_t lane,
                                          std::uint32_t page_vec) {
  std::uint32_t v = lane;
  for (; v + (kUnroll - 1) * kWarp < page_vec; v += kUnroll * kWarp) {
    uint4 r[kUnroll];
#pragma unroll
    for (std::uint32_t u = 0; u < kUnroll; ++u) r[u] = __ldcs(s + v + u * kWarp);
#pragma unroll
    for (std::uint32_t u = 0; u < kUnroll; ++u) d[v + u * kWarp] = r[u];
  }
  // Tail: fewer than kUnroll vectors left for this lane.
  uint4 r[kUnroll - 1];
#pragma unroll
  for (std::uint32_t u = 0; u < kUnroll - 1; ++u)
    if (v + u * kWarp < page_vec) r[u] = __ldcs(s + v + u * kWarp);
#pragma unroll
  for (std::uint32_t u = 0; u < kUnroll - 1; ++u)
    if (v + u * kWarp < page_vec) d[v + u * kWarp] = r[u];
}

// One warp per page, persistent: warp w copies pages w, w + total_warps, ...
template <class Addressing>
__global__ void __launch_bounds__(1024)
    gather_pages_kernel(Addressing where, std::uint32_t count, std::uint32_t page_vec) {
  const std::uint32_t lane = threadIdx.x % kWarp;
  const std::uint32_t warps_per_block = blockDim.x / kWarp;
  const std::uint32_t total_warps = gridDim.x * warps_per_block;
  for (std::uint32_t p = blockIdx.x * warps_per_block + threadIdx.x / kWarp; p < count; p += total_warps)
    copy_page(where.source(p), where.destination(p), lane, page_vec);
}

// The miss-list gather (page_gather_cuda.hpp: gather_miss_list). Warp w owns
// flattened entries w, w + total_warps, ...; it finds them by walking the
// heads 32 at a time (one per lane), a warp scan of their counts giving each
// head's start in the flattened space.
__global__ void __launch_bounds__(1024)
    gather_miss_list_kernel(DeviceMissList misses, ChunkedPages cpu_tier, uint4* __restrict__ gpu_base,
                            std::size_t gpu_stride_vec, std::uint32_t page_vec) {
  using WarpScan = cub::WarpScan<unsigned long long>;
  __shared__ typename WarpScan::TempStorage scan[kWarp];
  const std::uint32_t lane = threadIdx.x % kWarp;
  const std::uint32_t warp_in_block = threadIdx.x / kWarp;
  const std::uint32_t warps_per_block = blockDim.x / kWarp;
  const std::uint32_t warp = blockIdx.x * warps_per_block + warp_in_block;
  const std::uint32_t total_warps = gridDim.x * warps_per_block;
  unsigned long long before = 0;  // entries of the heads already walked
  for (std::uint32_t group = 0; group < misses.heads; group += kWarp) {
    const std::uint32_t h = group + lane;
    std::uint32_t offset = 0;
    unsigned long long entries = 0;
    if (h < misses.heads) {
      offset = misses.page_offsets[h];
      entries = miss_list_entries(offset, misses.counts[std::size_t{h} * misses.count_stride], misses.max_entries);
    }
    unsigned long long start = 0, group_entries = 0;
    WarpScan(scan[warp_in_block]).ExclusiveSum(entries, start, group_entries);
    start += before;
    before += group_entries;
    const unsigned long long first = miss_list_first(start, warp, total_warps);
    // Heads of this group that hold an entry of this warp, one at a time.
    for (unsigned mine = __ballot_sync(0xffffffffu, first < start + entries); mine != 0; mine &= mine - 1) {
      const int src = __ffs(mine) - 1;
      const unsigned long long head_first = __shfl_sync(0xffffffffu, first, src);
      const unsigned long long head_start = __shfl_sync(0xffffffffu, start, src);
      const unsigned long long head_end = head_start + __shfl_sync(0xffffffffu, entries, src);
      const std::uint32_t head_offset = __shfl_sync(0xffffffffu, offset, src);
      for (unsigned long long j = head_first; j < head_end; j += total_warps) {
        const std::size_t e = head_offset + static_cast<std::size_t>(j - head_start);
        const auto* s = reinterpret_cast<const uint4*>(cpu_tier.address(misses.cpu_pages[e]));
        copy_page(s, gpu_base + std::size_t{misses.gpu_pages[e]} * gpu_stride_vec, lane, page_vec);
      }
    }
  }
}

bool aligned(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % kVec == 0; }

void check_config(const char* function, std::size_t page_bytes, const GatherConfig& config) {
  if (page_bytes == 0 || page_bytes % kVec != 0)
    throw_invalid(function, "page_bytes " + std::to_string(page_bytes) + " is not a non-zero multiple of 16");
  if (page_bytes / kVec > UINT32_MAX)
    throw_invalid(function, "page_bytes " + std::to_string(page_bytes) + " is too large");
  if (config.warps_per_block == 0 || config.warps_per_block > kWarp)
    throw_invalid(function, "warps_per_block " + std::to_string(config.warps_per_block) + " is not in 1..32");
}

// A persistent grid no larger than the SM cap's resident blocks, nor than
// `pages` pages need (one warp each).
template <class Kernel, class... Args>
void launch(const char* function, Kernel kernel, std::uint32_t pages, const GatherConfig& config, void* stream,
            Args... args) {
  const int device = current_device(function);
  const auto sms_total = static_cast<std::uint32_t>(multiprocessor_count(device, function));
  const std::uint32_t sms = config.max_sms == 0 || config.max_sms > sms_total ? sms_total : config.max_sms;
  const int threads = static_cast<int>(config.warps_per_block * kWarp);
  const std::uint32_t resident =
      sms * static_cast<std::uint32_t>(resident_blocks_per_sm(kernel, device, threads, 0, function));
  const std::uint32_t needed = (pages + config.warps_per_block - 1) / config.warps_per_block;
  const std::uint32_t blocks = needed < resident ? needed : resident;
  kernel<<<blocks, threads, 0, static_cast<cudaStream_t>(stream)>>>(args...);
  check_launch(function);
}

}  // namespace

void gather_pages(const PageId* src_pages, const PageId* dst_pages, std::uint32_t count, const std::byte* src_base,
                  std::size_t src_stride, std::byte* dst_base, std::size_t dst_stride, std::size_t page_bytes,
                  const GatherConfig& config, void* stream) {
  // Validation first: nothing is enqueued when an argument is wrong.
  constexpr const char* kFunction = "gather_pages";
  check_config(kFunction, page_bytes, config);
  if (src_stride % kVec != 0 || src_stride < page_bytes)
    throw_invalid(kFunction, "src_stride " + std::to_string(src_stride) + " is not a multiple of 16 >= page_bytes " +
                                 std::to_string(page_bytes));
  if (dst_stride % kVec != 0 || dst_stride < page_bytes)
    throw_invalid(kFunction, "dst_stride " + std::to_string(dst_stride) + " is not a multiple of 16 >= page_bytes " +
                                 std::to_string(page_bytes));
  if (!aligned(src_base) || !aligned(dst_base)) throw_invalid(kFunction, "src_base or dst_base is not 16-byte aligned");
  if (count == 0) return;
  if (src_pages == nullptr || src_base == nullptr || dst_base == nullptr)
    throw_invalid(kFunction, "null src_pages, src_base or dst_base with count " + std::to_string(count));
  const PoolAddressing where{src_pages,
                             dst_pages,
                             reinterpret_cast<const uint4*>(src_base),
                             src_stride / kVec,
                             reinterpret_cast<uint4*>(dst_base),
                             dst_stride / kVec};
  launch(kFunction, gather_pages_kernel<PoolAddressing>, count, config, stream, where, count,
         static_cast<std::uint32_t>(page_bytes / kVec));
}

void gather_page_addresses(const std::byte* const* src, std::byte* const* dst, std::uint32_t count,
                           std::size_t page_bytes, const GatherConfig& config, void* stream) {
  constexpr const char* kFunction = "gather_page_addresses";
  check_config(kFunction, page_bytes, config);
  if (count == 0) return;
  if (src == nullptr || dst == nullptr)
    throw_invalid(kFunction, "null address arrays with count " + std::to_string(count));
  launch(kFunction, gather_pages_kernel<PointerAddressing>, count, config, stream, PointerAddressing{src, dst}, count,
         static_cast<std::uint32_t>(page_bytes / kVec));
}

void gather_miss_list(const DeviceMissList& misses, const ChunkedPages& cpu_tier, std::byte* gpu_base,
                      std::size_t gpu_stride, std::size_t page_bytes, const GatherConfig& config, void* stream) {
  constexpr const char* kFunction = "gather_miss_list";
  check_config(kFunction, page_bytes, config);
  if (gpu_stride % kVec != 0 || gpu_stride < page_bytes)
    throw_invalid(kFunction, "gpu_stride " + std::to_string(gpu_stride) + " is not a multiple of 16 >= page_bytes " +
                                 std::to_string(page_bytes));
  if (cpu_tier.page_stride % kVec != 0 || cpu_tier.page_stride < page_bytes)
    throw_invalid(kFunction, "cpu_tier.page_stride " + std::to_string(cpu_tier.page_stride) +
                                 " is not a multiple of 16 >= page_bytes " + std::to_string(page_bytes));
  if (!aligned(gpu_base)) throw_invalid(kFunction, "gpu_base is not 16-byte aligned");
  if (cpu_tier.pages_per_chunk == 0) throw_invalid(kFunction, "cpu_tier.pages_per_chunk is 0");
  if (misses.count_stride == 0) throw_invalid(kFunction, "count_stride is 0");
  if (misses.heads == 0 || misses.max_entries == 0) return;
  if (misses.page_offsets == nullptr || misses.counts == nullptr || misses.cpu_pages == nullptr ||
      misses.gpu_pages == nullptr || cpu_tier.chunk_bases == nullptr || gpu_base == nullptr)
    throw_invalid(kFunction, "null miss-list array, chunk_bases or gpu_base with " + std::to_string(misses.heads) +
                                 " heads and " + std::to_string(misses.max_entries) + " entries");
  launch(kFunction, gather_miss_list_kernel, misses.max_entries, config, stream, misses, cpu_tier,
         reinterpret_cast<uint4*>(gpu_base), gpu_stride / kVec, static_cast<std::uint32_t>(page_bytes / kVec));
}

}  // namespace sparsekv::cuda
