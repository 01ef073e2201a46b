#pragma once
// Helpers shared by the GPU tests: a Catch2 check of CUDA calls, RAII owners
// of pinned-mapped host memory, device memory and streams, the code of a
// sparsekv::Error a call throws, random bytes.
#include <catch2/catch.hpp>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <functional>
#include <random>
#include <vector>

#include "sparsekv/core/error.hpp"
#include "sparsekv/core/error_code.hpp"

namespace sparsekv::gpu_test {

inline void check(cudaError_t status) {
  INFO(cudaGetErrorString(status));
  REQUIRE(status == cudaSuccess);
}

// Pinned, mapped host memory: kernels read and write it through UVA.
struct PinnedBytes {
  explicit PinnedBytes(std::size_t bytes, unsigned int flags = cudaHostAllocMapped) {
    void* p = nullptr;
    check(cudaHostAlloc(&p, bytes, flags));
    data = static_cast<std::byte*>(p);
  }
  ~PinnedBytes() { cudaFreeHost(data); }
  PinnedBytes(const PinnedBytes&) = delete;
  PinnedBytes& operator=(const PinnedBytes&) = delete;
  template <class T>
  T* as() const {
    return reinterpret_cast<T*>(data);
  }
  std::byte* data = nullptr;
};

// Device memory of `bytes` bytes (16 when 0, so that the pointer is never null).
struct DeviceBytes {
  explicit DeviceBytes(std::size_t bytes) {
    void* p = nullptr;
    check(cudaMalloc(&p, bytes == 0 ? 16 : bytes));
    data = static_cast<std::byte*>(p);
  }
  ~DeviceBytes() { cudaFree(data); }
  DeviceBytes(const DeviceBytes&) = delete;
  DeviceBytes& operator=(const DeviceBytes&) = delete;
  template <class T>
  T* as() const {
    return reinterpret_cast<T*>(data);
  }
  std::byte* data = nullptr;
};

// A typed device array of `size` elements (at least one allocated). reserve
// and upload grow it on demand; growing does not keep the contents.
template <class T>
struct DeviceArray {
  DeviceArray() = default;
  explicit DeviceArray(std::size_t n) { reserve(n); }
  explicit DeviceArray(const std::vector<T>& values) { upload(values); }
  ~DeviceArray() { cudaFree(data); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;

  T* reserve(std::size_t n) {
    size = n;
    n = std::max<std::size_t>(n, 1);
    if (n > capacity) {
      check(cudaFree(data));
      data = nullptr;
      void* p = nullptr;
      check(cudaMalloc(&p, n * sizeof(T)));
      data = static_cast<T*>(p);
      capacity = n;
    }
    return data;
  }
  // Returns with the bytes on the device: a cudaMemcpy from pageable memory
  // may return before its DMA lands, and kernels on the tests' non-blocking
  // streams do not wait for the legacy stream it ran on.
  T* upload(const std::vector<T>& values) {
    reserve(values.size());
    if (!values.empty()) check(cudaMemcpy(data, values.data(), values.size() * sizeof(T), cudaMemcpyHostToDevice));
    check(cudaDeviceSynchronize());
    return data;
  }
  std::vector<T> download(std::size_t n) const {
    std::vector<T> values(n);
    download_into(values, 0, n);
    return values;
  }
  // Elements [first, first + n) into values[first ..]: for outputs a kernel
  // writes only in part, so initcheck still flags a write that went missing.
  void download_into(std::vector<T>& values, std::size_t first, std::size_t n) const {
    if (n > 0) check(cudaMemcpy(values.data() + first, data + first, n * sizeof(T), cudaMemcpyDeviceToHost));
  }
  std::vector<T> download() const { return download(size); }

  T* data = nullptr;
  std::size_t size = 0;      // elements last reserved or uploaded
  std::size_t capacity = 0;  // elements allocated
};

// A non-blocking stream: it does not wait for the legacy default stream.
struct Stream {
  Stream() { check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking)); }
  ~Stream() { cudaStreamDestroy(stream); }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  cudaStream_t stream = nullptr;
};

// The code of the sparsekv::Error `call` throws; fails the test if it throws none.
inline ErrorCode code_of(const std::function<void()>& call) {
  try {
    call();
  } catch (const Error& e) {
    return e.code();
  }
  FAIL("no sparsekv::Error thrown");
  return ErrorCode::invalid_argument;
}

inline void fill_random(std::byte* data, std::size_t n, std::mt19937& rng) {
  for (std::size_t i = 0; i < n; ++i) data[i] = static_cast<std::byte>(rng());
}

inline std::vector<std::byte> random_bytes(std::size_t n, std::mt19937& rng) {
  std::vector<std::byte> bytes(n);
  fill_random(bytes.data(), n, rng);
  return bytes;
}

}  // namespace sparsekv::gpu_test
