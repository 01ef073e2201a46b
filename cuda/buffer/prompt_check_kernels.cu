// first_non_finite (buffer/prompt_check_cuda.hpp).
#include <cuda_runtime.h>

#include "core/launch_support.cuh"
#include "sparsekv/buffer/prompt_check_cuda.hpp"

namespace sparsekv::cuda {
namespace {

constexpr int kThreads = 256;

// Threads stride over the elements keeping their smallest bad index; a warp
// reduces to one atomicMin, so a clean tensor costs one read of it.
__global__ void __launch_bounds__(kThreads)
    first_non_finite_kernel(const void* data, std::uint64_t count, DType dtype, unsigned long long* result) {
  unsigned long long bad = kAllFinite;
  const std::uint64_t stride = std::uint64_t{gridDim.x} * blockDim.x;
  for (std::uint64_t i = std::uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < count && bad == kAllFinite;
       i += stride) {
    if (!element_is_finite(data, i, dtype)) bad = i;
  }
  for (int mask = 16; mask > 0; mask /= 2) {
    const unsigned long long other = __shfl_xor_sync(0xffffffffu, bad, mask);
    bad = other < bad ? other : bad;
  }
  if (threadIdx.x % 32 == 0 && bad != kAllFinite) atomicMin(result, bad);
}

}  // namespace

void first_non_finite(const void* data, std::uint64_t count, DType dtype, std::uint64_t* result, void* stream) {
  constexpr const char* kFunction = "first_non_finite";
  if (result == nullptr) detail::throw_invalid(kFunction, "result must not be null");
  if (count > 0 && data == nullptr) detail::throw_invalid(kFunction, "data must not be null");
  if (dtype != DType::f32 && dtype != DType::f16 && dtype != DType::bf16) {
    detail::throw_invalid(kFunction, "unknown dtype");
  }
  const auto s = static_cast<cudaStream_t>(stream);
  if (const cudaError_t status = cudaMemsetAsync(result, 0xff, sizeof(std::uint64_t), s); status != cudaSuccess) {
    detail::throw_cuda(kFunction, "cudaMemsetAsync", status);
  }
  if (count == 0) return;
  const int device = detail::current_device(kFunction);
  const std::uint64_t wanted = (count + kThreads - 1) / kThreads;
  const std::uint64_t most = std::uint64_t{8} * detail::multiprocessor_count(device, kFunction);
  const auto blocks = static_cast<unsigned>(wanted < most ? wanted : most);
  first_non_finite_kernel<<<blocks, kThreads, 0, s>>>(data, count, dtype,
                                                      reinterpret_cast<unsigned long long*>(result));
  detail::check_launch(kFunction);
}

}  // namespace sparsekv::cuda
