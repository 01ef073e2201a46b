#include "sparsekv/core/device.hpp"

#if SPARSEKV_WITH_CUDA_RUNTIME
#include <cuda_runtime_api.h>
#endif

namespace sparsekv {

bool built_with_cuda() noexcept { return SPARSEKV_WITH_CUDA_RUNTIME != 0; }

int cuda_device_count() noexcept {
#if SPARSEKV_WITH_CUDA_RUNTIME
  // Asked once: without a driver the first runtime call fails, and the answer
  // cannot change during the process.
  static const int count = [] {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
      cudaGetLastError();  // clear the sticky error so later checks stay clean
      return 0;
    }
    return n;
  }();
  return count;
#else
  return 0;
#endif
}

}  // namespace sparsekv
