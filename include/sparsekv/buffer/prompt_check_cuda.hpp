#pragma once
// The device prefill's finiteness check (step/device_runtime.hpp,
// check_prompt): the index of the first non-finite element of a device
// tensor, so that non-finite prompt K/V is refused before it reaches the CPU
// tier, the source of truth, as the host prefill refuses it.
//
// Result word: one uint64 in device memory; the launch sets it to
// kAllFinite first, then every non-finite element lowers it with atomicMin to
// its index, so afterwards it holds the smallest such index however blocks
// were scheduled. The caller copies it back (prefill waits anyway).
//
// Conventions of the kernels' C API: caller-owned memory, work enqueued on
// `stream` (a cudaStream_t; nullptr = the default stream), no allocation and
// no synchronisation; invalid_argument before anything is enqueued,
// cuda_error for a failed launch. fmt-free and free of CUDA headers: the
// kernel and the host emulation in the tests share element_is_finite.
#include <cstddef>
#include <cstdint>

#include "sparsekv/core/dtype.hpp"
#include "sparsekv/core/host_device.hpp"
#include "sparsekv/core/numeric.hpp"

namespace sparsekv::cuda {

inline constexpr std::uint64_t kAllFinite = ~std::uint64_t{0};

// The per-element rule: element `i` of `data` in `dtype`, finite as the host
// prefill's check_finite tests it (is_finite of its fp32 value).
SPARSEKV_HOST_DEVICE inline bool element_is_finite(const void* data, std::uint64_t i, DType dtype) {
  return is_finite(load_element(static_cast<const unsigned char*>(data) + i * dtype_size(dtype), 0, dtype));
}

// Enqueues the search over `count` elements; *result (device memory) ends as
// the smallest non-finite index or kAllFinite. count 0 writes kAllFinite.
void first_non_finite(const void* data, std::uint64_t count, DType dtype, std::uint64_t* result, void* stream);

}  // namespace sparsekv::cuda
