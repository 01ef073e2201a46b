#include "sparsekv/memory/memory_resource.hpp"

#include <cstdlib>
#include <cstring>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "sparsekv/core/device.hpp"
#include "sparsekv/core/error.hpp"

#if SPARSEKV_WITH_CUDA_RUNTIME
#include <cuda_runtime_api.h>
#endif

namespace sparsekv {
namespace {

constexpr std::size_t kAlignment = 256;
// A block this large starts on a 2 MiB boundary and asks Linux for
// transparent huge pages: the host Attend reads scattered pages, and each one
// would otherwise cost a page walk (a nested one in a VM). Measured on a
// 2 vCPU VM, a read of random 8 KiB pages of a 1 GiB pool: 7.8 GB/s on 4 KiB
// pages, 10.2 on huge ones (docs/performance.md, "Scattered pages").
constexpr std::size_t kHugePage = std::size_t{2} << 20;

void* allocate_plain(std::size_t bytes) {
  const std::size_t alignment = bytes >= kHugePage ? kHugePage : kAlignment;
  void* pointer = nullptr;
  if (posix_memalign(&pointer, alignment, bytes) != 0) {
    fail(ErrorCode::resource_exhausted, "host allocation of {} bytes failed", bytes);
  }
#if defined(MADV_HUGEPAGE)
  // Advice on the whole huge pages of the block (no rounding up, so no more
  // memory than asked for); where THP is off the pages stay small.
  if (alignment == kHugePage) madvise(pointer, bytes / kHugePage * kHugePage, MADV_HUGEPAGE);
#endif
  std::memset(pointer, 0, bytes);  // after the advice: the first touch gets the huge pages
  return pointer;
}

}  // namespace

HostMemoryResource::HostMemoryResource(bool prefer_pinned)
    : pinned_(prefer_pinned && cuda_device_count() > 0) {}

void* HostMemoryResource::allocate(std::size_t bytes) {
  if (bytes == 0) return nullptr;
#if SPARSEKV_WITH_CUDA_RUNTIME
  if (pinned_) {
    void* pointer = nullptr;
    // Mapped + portable: kernels on any device read it through UVA (Spin §5.2
    // keeps the CPU-side tables and the CPU tier where GPU kernels reach them).
    const cudaError_t status =
        cudaHostAlloc(&pointer, bytes, cudaHostAllocMapped | cudaHostAllocPortable);
    if (status != cudaSuccess) {
      cudaGetLastError();
      fail(ErrorCode::resource_exhausted, "cudaHostAlloc of {} bytes failed: {}", bytes,
           cudaGetErrorString(status));
    }
    std::memset(pointer, 0, bytes);
    return pointer;
  }
#endif
  return allocate_plain(bytes);
}

void HostMemoryResource::deallocate(void* pointer, std::size_t) noexcept {
  if (pointer == nullptr) return;
#if SPARSEKV_WITH_CUDA_RUNTIME
  if (pinned_) {
    cudaFreeHost(pointer);
    return;
  }
#endif
  std::free(pointer);
}

DeviceMemoryResource::DeviceMemoryResource() {
  if (cuda_device_count() == 0) {
    fail(ErrorCode::unavailable, "{}",
         built_with_cuda() ? "no CUDA device is available for device memory"
                           : "sparsekv was built without CUDA; device memory is unavailable");
  }
}

void* DeviceMemoryResource::allocate(std::size_t bytes) {
  if (bytes == 0) return nullptr;
#if SPARSEKV_WITH_CUDA_RUNTIME
  void* pointer = nullptr;
  cudaError_t status = cudaMalloc(&pointer, bytes);
  // Synchronous, so no stream can see the memory before it is zero.
  if (status == cudaSuccess) status = cudaMemset(pointer, 0, bytes);
  if (status == cudaSuccess) status = cudaDeviceSynchronize();
  if (status != cudaSuccess) {
    cudaGetLastError();
    if (pointer != nullptr) cudaFree(pointer);
    fail(ErrorCode::cuda_error, "cudaMalloc of {} bytes failed: {}", bytes, cudaGetErrorString(status));
  }
  return pointer;
#else
  fail(ErrorCode::unavailable, "sparsekv was built without CUDA; cannot allocate {} device bytes", bytes);
#endif
}

void DeviceMemoryResource::deallocate(void* pointer, std::size_t) noexcept {
#if SPARSEKV_WITH_CUDA_RUNTIME
  if (pointer != nullptr) cudaFree(pointer);
#else
  (void)pointer;
#endif
}

}  // namespace sparsekv
