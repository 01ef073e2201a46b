#pragma once
// Owners of the device runtime's fixed allocations (device memory, pinned
// host memory) and the one check its runtime calls go through; private to
// cuda/step/.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <utility>

#include "sparsekv/core/error.hpp"

namespace sparsekv::cuda {

inline void check_runtime(cudaError_t status, const char* what) {
  if (status != cudaSuccess)
    fail(ErrorCode::cuda_error, "DeviceRuntime: {} failed: {}", what, cudaGetErrorString(status));
}

// Whether `stream` is being captured into a CUDA graph.
inline bool stream_capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  check_runtime(cudaStreamIsCapturing(stream, &capture), "cudaStreamIsCapturing");
  return capture != cudaStreamCaptureStatusNone;
}

// Device memory of a fixed size, freed with its owner.
class DeviceBytes {
 public:
  DeviceBytes() = default;
  explicit DeviceBytes(std::size_t bytes) : bytes_(std::max<std::size_t>(bytes, 16)) {
    check_runtime(cudaMalloc(&data_, bytes_), "cudaMalloc");
  }
  // A moved-from owner frees nothing: cudaFree(nullptr) inside a stream
  // capture is a prohibited call that invalidates the capture.
  ~DeviceBytes() {
    if (data_ != nullptr) cudaFree(data_);
  }
  DeviceBytes(DeviceBytes&& o) noexcept : data_(std::exchange(o.data_, nullptr)), bytes_(o.bytes_) {}
  DeviceBytes& operator=(DeviceBytes&& o) noexcept {
    std::swap(data_, o.data_);
    std::swap(bytes_, o.bytes_);
    return *this;
  }
  template <class T>
  T* as() const noexcept {
    return static_cast<T*>(data_);
  }
  std::size_t bytes() const noexcept { return bytes_; }

 private:
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
};

// Pinned host memory (device-accessible through UVA).
class PinnedBytes {
 public:
  PinnedBytes() = default;
  explicit PinnedBytes(std::size_t bytes) {
    check_runtime(cudaHostAlloc(&data_, std::max<std::size_t>(bytes, 16), cudaHostAllocMapped | cudaHostAllocPortable),
                  "cudaHostAlloc");
  }
  // As ~DeviceBytes: a moved-from block (the ring moves them during a
  // capture) must make no call.
  ~PinnedBytes() {
    if (data_ != nullptr) cudaFreeHost(data_);
  }
  PinnedBytes(PinnedBytes&& o) noexcept : data_(std::exchange(o.data_, nullptr)) {}
  PinnedBytes& operator=(PinnedBytes&& o) noexcept {
    std::swap(data_, o.data_);
    return *this;
  }
  template <class T>
  T* as() const noexcept {
    return static_cast<T*>(data_);
  }

 private:
  void* data_ = nullptr;
};

}  // namespace sparsekv::cuda
