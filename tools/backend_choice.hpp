#pragma once
// `--backend host|cuda` for the examples: the one runtime choice at the
// facade edge. No choice = the CUDA backend when sparsekv::cuda is linked
// (SPARSEKV_EXAMPLE_CUDA) and a device can be used, else the host backend.
// Asking for cuda where it cannot run is an error, never a silent fallback.
#include <memory>
#include <string_view>

#include "sparsekv/core/device.hpp"
#include "sparsekv/core/error.hpp"
#include "sparsekv/facade/backend.hpp"
#if SPARSEKV_EXAMPLE_CUDA
#include "sparsekv/facade/cuda_backend.hpp"
#endif

namespace sparsekv::tools {

inline std::unique_ptr<Backend> make_backend(std::string_view name) {
  if (!name.empty() && name != "host" && name != "cuda") {
    fail(ErrorCode::invalid_argument, "--backend must be host or cuda, not '{}'", name);
  }
  if (name == "host") return std::make_unique<HostBackend>();
#if SPARSEKV_EXAMPLE_CUDA
  if (name.empty()) return cuda::make_best_backend();
  if (cuda_device_count() == 0) fail(ErrorCode::unavailable, "--backend cuda: no usable CUDA device");
  return std::make_unique<cuda::CudaBackend>();
#else
  if (name == "cuda") {
    fail(ErrorCode::unavailable, "--backend cuda: this build has no CUDA backend (nvcc was not found at configure time)");
  }
  return std::make_unique<HostBackend>();
#endif
}

}  // namespace sparsekv::tools
