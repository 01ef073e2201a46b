#pragma once
// Whether a CUDA device can be used from this process. The library is built
// with the CUDA runtime when the toolkit is found, but a machine without a
// driver fails at the first runtime call: everything that might touch a GPU
// asks here first and falls back (host memory) or reports `unavailable`.
namespace sparsekv {

// True when sparsekv was built against the CUDA runtime.
bool built_with_cuda() noexcept;
// Number of usable CUDA devices; 0 without a driver, a device, or CUDA support.
int cuda_device_count() noexcept;

}  // namespace sparsekv
