#include "sparsekv/memory/memory_resource.hpp"

#include <cstdint>
#include <cstdlib>
#include <cstring>

#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
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

#if defined(__linux__)
// Large blocks are anonymous mappings: the kernel zero-fills each page when
// it is first written, so reserving a chunk costs no pass over its bytes. A
// memset here made the decode step that reserved the CPU tier's next 64 MiB
// chunk stall ~100 ms (docs/performance.md, "Chunks zeroed by the kernel").
void* map_huge_aligned(std::size_t bytes, Residency residency) {
  const std::size_t mapped = bytes + kHugePage;
  void* raw = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) fail(ErrorCode::resource_exhausted, "host allocation of {} bytes failed", bytes);
  const auto start = reinterpret_cast<std::uintptr_t>(raw);
  const std::uintptr_t aligned = (start + kHugePage - 1) / kHugePage * kHugePage;
  const std::uintptr_t end = aligned + bytes, mapped_end = start + mapped;
  const auto small_page = static_cast<std::uintptr_t>(sysconf(_SC_PAGESIZE));
  const std::uintptr_t kept_end = (end + small_page - 1) / small_page * small_page;
  if (aligned > start) munmap(raw, aligned - start);
  if (mapped_end > kept_end) munmap(reinterpret_cast<void*>(kept_end), mapped_end - kept_end);
#if defined(MADV_HUGEPAGE)
  // Advice on the whole huge pages of the block; where THP is off the pages stay small.
  madvise(reinterpret_cast<void*>(aligned), bytes / kHugePage * kHugePage, MADV_HUGEPAGE);
#endif
  // After the advice: the first touch gets the huge pages.
  if (residency == Residency::at_allocation) std::memset(reinterpret_cast<void*>(aligned), 0, bytes);
  return reinterpret_cast<void*>(aligned);
}
#endif

void* allocate_plain(std::size_t bytes, Residency residency) {
#if defined(__linux__)
  if (bytes >= kHugePage) return map_huge_aligned(bytes, residency);
#endif
  void* pointer = nullptr;
  if (posix_memalign(&pointer, bytes >= kHugePage ? kHugePage : kAlignment, bytes) != 0) {
    fail(ErrorCode::resource_exhausted, "host allocation of {} bytes failed", bytes);
  }
  std::memset(pointer, 0, bytes);
  return pointer;
}

void free_plain(void* pointer, std::size_t bytes) noexcept {
#if defined(__linux__)
  if (bytes >= kHugePage) {
    munmap(pointer, bytes);
    return;
  }
#endif
  std::free(pointer);
}

}  // namespace

HostMemoryResource::HostMemoryResource(bool prefer_pinned, Residency residency)
    : pinned_(prefer_pinned && cuda_device_count() > 0), residency_(residency) {}

void* HostMemoryResource::allocate(std::size_t bytes) {
  if (bytes == 0) return nullptr;
#if SPARSEKV_WITH_CUDA_RUNTIME
  if (pinned_) {
    void* pointer = nullptr;
    // Mapped + portable: kernels on any device read it through UVA (Spin §5.2
    // keeps the CPU-side tables and the CPU tier where GPU kernels reach them).
    const cudaError_t status = cudaHostAlloc(&pointer, bytes, cudaHostAllocMapped | cudaHostAllocPortable);
    if (status != cudaSuccess) {
      cudaGetLastError();
      fail(ErrorCode::resource_exhausted, "cudaHostAlloc of {} bytes failed: {}", bytes, cudaGetErrorString(status));
    }
    std::memset(pointer, 0, bytes);
    return pointer;
  }
#endif
  return allocate_plain(bytes, residency_);
}

void HostMemoryResource::deallocate(void* pointer, std::size_t bytes) noexcept {
  if (pointer == nullptr) return;
#if SPARSEKV_WITH_CUDA_RUNTIME
  if (pinned_) {
    cudaFreeHost(pointer);
    return;
  }
#endif
  free_plain(pointer, bytes);
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
