#pragma once
// What an engine owns on the device, for the examples that play the engine
// with the device-tensor API: its stream, its activation buffers (q, k, v,
// out: cudaMalloc'd by the engine, never by sparsekv) and pinned staging for
// the host-made stand-ins of the model's activations. Needs the CUDA runtime:
// include only under SPARSEKV_EXAMPLE_CUDA.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <utility>
#include <vector>

#include "sparsekv/core/error.hpp"

namespace sparsekv::tools {

inline void check_cuda(cudaError_t status, const char* what) {
  if (status != cudaSuccess) fail(ErrorCode::cuda_error, "{} failed: {}", what, cudaGetErrorString(status));
}

// The engine's stream. Non-blocking: nothing of sparsekv's may rely on the
// legacy default stream ordering it.
class EngineStream {
 public:
  EngineStream() { check_cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate"); }
  ~EngineStream() { cudaStreamDestroy(stream_); }
  EngineStream(const EngineStream&) = delete;
  EngineStream& operator=(const EngineStream&) = delete;
  cudaStream_t get() const noexcept { return stream_; }
  // What the Manager's calls take: the cudaStream_t as a void*.
  void* handle() const noexcept { return stream_; }
  void wait() const { check_cuda(cudaStreamSynchronize(stream_), "cudaStreamSynchronize"); }

 private:
  cudaStream_t stream_ = nullptr;
};

// Device memory of `n` elements of T, owned by the engine.
template <class T>
class DeviceArray {
 public:
  DeviceArray() = default;
  explicit DeviceArray(std::size_t n) : size_(n) {
    void* p = nullptr;
    check_cuda(cudaMalloc(&p, std::max<std::size_t>(n, 1) * sizeof(T)), "cudaMalloc");
    data_ = static_cast<T*>(p);
  }
  ~DeviceArray() { cudaFree(data_); }
  DeviceArray(DeviceArray&& o) noexcept : data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)) {}
  DeviceArray& operator=(DeviceArray&& o) noexcept {
    std::swap(data_, o.data_);
    std::swap(size_, o.size_);
    return *this;
  }
  T* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return size_; }

  // Enqueues a copy of `n` host elements into the front of the array.
  void upload(const T* host, std::size_t n, cudaStream_t stream) {
    if (n > size_) fail(ErrorCode::invalid_argument, "upload of {} elements into a device array of {}", n, size_);
    check_cuda(cudaMemcpyAsync(data_, host, n * sizeof(T), cudaMemcpyHostToDevice, stream), "cudaMemcpyAsync H2D");
  }
  // The first `n` elements, once everything before on `stream` is done (a sync).
  std::vector<T> download(std::size_t n, cudaStream_t stream) const {
    if (n > size_) fail(ErrorCode::invalid_argument, "download of {} elements from a device array of {}", n, size_);
    std::vector<T> out(n);
    check_cuda(cudaMemcpyAsync(out.data(), data_, n * sizeof(T), cudaMemcpyDeviceToHost, stream),
               "cudaMemcpyAsync D2H");
    check_cuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
    return out;
  }

 private:
  T* data_ = nullptr;
  std::size_t size_ = 0;
};

// Pinned host memory of `n` elements: async uploads from it do not stage
// through a pageable bounce buffer (which would wait for the stream).
template <class T>
class PinnedArray {
 public:
  PinnedArray() = default;
  explicit PinnedArray(std::size_t n) : size_(n) {
    void* p = nullptr;
    check_cuda(cudaMallocHost(&p, std::max<std::size_t>(n, 1) * sizeof(T)), "cudaMallocHost");
    data_ = static_cast<T*>(p);
  }
  ~PinnedArray() { cudaFreeHost(data_); }
  PinnedArray(PinnedArray&& o) noexcept : data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)) {}
  PinnedArray& operator=(PinnedArray&& o) noexcept {
    std::swap(data_, o.data_);
    std::swap(size_, o.size_);
    return *this;
  }
  T* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return size_; }
  T& operator[](std::size_t i) const noexcept { return data_[i]; }

 private:
  T* data_ = nullptr;
  std::size_t size_ = 0;
};

}  // namespace sparsekv::tools
