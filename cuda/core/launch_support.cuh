#pragma once
// Host-side helpers of the kernel translation units (fmt-free): errors named
// after the entry point that raised them, and per-device launch figures (SM
// count, resident blocks of a kernel) asked of the runtime once, since entry
// points size persistent and split-K grids from them on every call.
#include <cuda_runtime.h>

#include <cstddef>
#include <map>
#include <mutex>
#include <string>
#include <tuple>

#include "sparsekv/core/error_code.hpp"

namespace sparsekv::cuda::detail {

[[noreturn]] inline void throw_cuda(const char* function, const char* what, cudaError_t status) {
  throw Error(ErrorCode::cuda_error, std::string(function) + ": " + what + " failed: " + cudaGetErrorString(status));
}

[[noreturn]] inline void throw_invalid(const char* function, const std::string& message) {
  throw Error(ErrorCode::invalid_argument, std::string(function) + ": " + message);
}

inline void check_launch(const char* function) {
  const cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess) throw_cuda(function, "launch", status);
}

inline int current_device(const char* function) {
  int device = 0;
  const cudaError_t status = cudaGetDevice(&device);
  if (status != cudaSuccess) throw_cuda(function, "cudaGetDevice", status);
  return device;
}

// Memo of positive per-device figures; `query` runs once per key.
template <class Key, class Query>
int memoised(const Key& key, Query&& query) {
  static std::mutex mutex;
  static std::map<Key, int> values;
  {
    const std::lock_guard lock(mutex);
    if (const auto it = values.find(key); it != values.end()) return it->second;
  }
  const int value = query();
  const std::lock_guard lock(mutex);
  values.emplace(key, value);
  return value;
}

inline int multiprocessor_count(int device, const char* function) {
  return memoised(device, [&] {
    int sms = 0;
    const cudaError_t status = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    if (status != cudaSuccess) throw_cuda(function, "cudaDeviceGetAttribute(MultiProcessorCount)", status);
    return sms;
  });
}

// Blocks of `kernel` resident on one SM at `threads` threads per block (at least 1).
template <class Kernel>
int resident_blocks_per_sm(Kernel kernel, int device, int threads, std::size_t dynamic_shared_bytes,
                           const char* function) {
  const auto key = std::make_tuple(device, reinterpret_cast<const void*>(kernel), threads, dynamic_shared_bytes);
  return memoised(key, [&] {
    int blocks = 0;
    const cudaError_t status =
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, threads, dynamic_shared_bytes);
    if (status != cudaSuccess) throw_cuda(function, "cudaOccupancyMaxActiveBlocksPerMultiprocessor", status);
    return blocks < 1 ? 1 : blocks;
  });
}

}  // namespace sparsekv::cuda::detail
