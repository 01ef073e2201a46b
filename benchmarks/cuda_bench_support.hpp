#pragma once
// Helpers shared by the CUDA benchmarks: a check that exits on a CUDA error,
// device allocation and copies, timing with cudaEvents, the device-to-device
// bandwidth reference, pad copies, and the main that prints
// "SKIPPED: no CUDA device" and exits 0 without a device.
#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "sparsekv/core/device.hpp"

namespace sparsekv::bench {

inline void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    std::fprintf(stderr, "%s failed: %s\n", what, cudaGetErrorString(status));
    std::exit(1);
  }
}

// `count` elements of device memory (one when 0), kept for the process.
template <class T>
T* device_alloc(std::size_t count) {
  void* p = nullptr;
  check(cudaMalloc(&p, std::max<std::size_t>(count, 1) * sizeof(T)), "cudaMalloc");
  return static_cast<T*>(p);
}

template <class T>
T* device_copy(const T* host, std::size_t count) {
  T* p = device_alloc<T>(count);
  if (count > 0) check(cudaMemcpy(p, host, count * sizeof(T), cudaMemcpyHostToDevice), "cudaMemcpy");
  return p;
}

template <class T>
std::vector<T> host_copy(const T* device, std::size_t count) {
  std::vector<T> values(count);
  if (count > 0) check(cudaMemcpy(values.data(), device, count * sizeof(T), cudaMemcpyDeviceToHost), "cudaMemcpy");
  return values;
}

inline cudaStream_t non_blocking_stream() {
  cudaStream_t stream = nullptr;
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  return stream;
}

// A start and a stop event, kept for the process.
struct Events {
  cudaEvent_t start = nullptr, stop = nullptr;
  Events() {
    check(cudaEventCreate(&start), "cudaEventCreate");
    check(cudaEventCreate(&stop), "cudaEventCreate");
  }
};

// Milliseconds between events recorded on `stream` before and after what `enqueue` enqueues there.
template <class Enqueue>
float elapsed_ms(const Events& events, cudaStream_t stream, Enqueue&& enqueue) {
  check(cudaEventRecord(events.start, stream), "cudaEventRecord");
  enqueue();
  check(cudaEventRecord(events.stop, stream), "cudaEventRecord");
  check(cudaEventSynchronize(events.stop), "cudaEventSynchronize");
  float ms = 0;
  check(cudaEventElapsedTime(&ms, events.start, events.stop), "cudaEventElapsedTime");
  return ms;
}

// The device-to-device reference: GB/s of `reps` back-to-back `bytes`-byte
// cudaMemcpyAsync from `src` to `dst` on `stream` after one warm-up copy,
// counting every byte read and written (2 x bytes per copy).
inline double measure_d2d_gbps(void* dst, const void* src, std::size_t bytes, int reps, cudaStream_t stream,
                               const Events& events) {
  check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream), "warm-up");
  const float ms = elapsed_ms(events, stream, [&] {
    for (int r = 0; r < reps; ++r) {
      check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream), "cudaMemcpyAsync");
    }
  });
  return 2.0 * double(bytes) * reps / (double(ms) * 1e-3) / 1e9;
}

// Keeps `stream` busy with a device-to-device copy while the host records the
// start event and launches: otherwise the start event fires at once and the
// launch latency (validation + launch, microseconds) is timed as kernel time.
inline void pad_copy(void* dst, const void* src, std::size_t bytes, cudaStream_t stream) {
  check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream), "pad");
}

// The benchmarks' main: "SKIPPED: no CUDA device" and 0 without a device.
inline int run_benchmarks(int argc, char** argv) {
  if (sparsekv::cuda_device_count() == 0) {
    std::puts("SKIPPED: no CUDA device");
    return 0;
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}

}  // namespace sparsekv::bench
