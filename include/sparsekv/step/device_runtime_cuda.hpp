#pragma once
// The CUDA DeviceRuntime's entry point (library sparsekv::cuda,
// cuda/step/device_runtime.cpp): what CudaBackend::make_device_runtime hands
// the device step.
#include <memory>

#include "sparsekv/memory/memory_resource.hpp"
#include "sparsekv/step/device_runtime.hpp"

namespace sparsekv::cuda {

// A runtime for `buffer` (made on a CudaBackend's memory), its device arrays
// sized by `setup` and allocated in device memory. Throws cuda_error when an
// allocation fails.
std::unique_ptr<DeviceRuntime> make_cuda_device_runtime(const DeviceRuntimeSetup& setup, TieredKVBuffer& buffer,
                                                        DeviceMemoryResource& device_memory);

}  // namespace sparsekv::cuda
