#pragma once
// Helpers shared by the CUDA benchmarks: a check that exits on a CUDA error,
// device allocation and copies, timing with cudaEvents, the device-to-device
// and PCIe bandwidth references, cudaMemcpyBatchAsync across toolkits, pad
// copies, and the main that prints "SKIPPED: no CUDA device" and exits 0
// without a device.
#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
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

// The PCIe reference, GB/s per direction: one contiguous 256 MiB
// cudaMemcpyAsync between pinned host memory and device memory, best of 5
// after a warm-up, each copy timed alone with cudaEvents. Measured once per
// process on first use, so that every row is compared with the same figure
// for the link: a contiguous copy of each row's own bytes is one more noisy
// measurement per row, and a ratio to it says as much about that copy as
// about the gather or save beside it.
struct PcieReference {
  double h2d_gbps = 0, d2h_gbps = 0;
};

inline const PcieReference& pcie_reference() {
  static const PcieReference reference = [] {
    constexpr std::size_t kBytes = std::size_t{256} << 20;
    constexpr int kReps = 5;
    void* host = nullptr;
    check(cudaHostAlloc(&host, kBytes, cudaHostAllocDefault), "cudaHostAlloc");
    std::memset(host, 0x5a, kBytes);
    void* device = device_alloc<std::byte>(kBytes);
    const cudaStream_t stream = non_blocking_stream();
    const Events events;
    auto best_gbps = [&](void* dst, const void* src, cudaMemcpyKind kind) {
      check(cudaMemcpyAsync(dst, src, kBytes, kind, stream), "warm-up");
      float best_ms = 0;
      for (int r = 0; r < kReps; ++r) {
        const float ms = elapsed_ms(events, stream,
                                    [&] { check(cudaMemcpyAsync(dst, src, kBytes, kind, stream), "cudaMemcpyAsync"); });
        if (r == 0 || ms < best_ms) best_ms = ms;
      }
      return double(kBytes) / (double(best_ms) * 1e-3) / 1e9;
    };
    PcieReference r;
    r.h2d_gbps = best_gbps(device, host, cudaMemcpyHostToDevice);
    r.d2h_gbps = best_gbps(host, device, cudaMemcpyDeviceToHost);
    check(cudaEventDestroy(events.start), "cudaEventDestroy");
    check(cudaEventDestroy(events.stop), "cudaEventDestroy");
    check(cudaStreamDestroy(stream), "cudaStreamDestroy");
    check(cudaFree(device), "cudaFree");
    check(cudaFreeHost(host), "cudaFreeHost");
    return r;
  }();
  return reference;
}

// Measures the PCIe reference and prints it on stderr, beside Google
// Benchmark's context lines, so that stdout stays one table (or JSON document).
inline void report_pcie_reference() {
  const PcieReference& r = pcie_reference();
  std::fprintf(stderr, "PCIe reference (contiguous 256 MiB pinned copy, best of 5): H2D %.2f GB/s, D2H %.2f GB/s\n",
               r.h2d_gbps, r.d2h_gbps);
}

// cudaMemcpyBatchAsync of dsts[i] <- srcs[i] (sizes[i] bytes) in direction
// `kind` (cudaMemcpyHostToDevice or cudaMemcpyDeviceToHost). CUDA 12.8 and
// 12.9 take non-const sources and a failure index, CUDA 13 neither; older
// toolkits lack it (cudaErrorNotSupported).
inline cudaError_t memcpy_batch(std::vector<void*>& dsts, std::vector<const void*>& srcs,
                                std::vector<std::size_t>& sizes, cudaMemcpyKind kind, cudaStream_t stream) {
#if CUDART_VERSION >= 12080
  int device = 0;
  if (const cudaError_t status = cudaGetDevice(&device); status != cudaSuccess) return status;
  cudaMemcpyAttributes attrs{};
  attrs.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  cudaMemLocation& device_side = kind == cudaMemcpyHostToDevice ? attrs.dstLocHint : attrs.srcLocHint;
  cudaMemLocation& host_side = kind == cudaMemcpyHostToDevice ? attrs.srcLocHint : attrs.dstLocHint;
  device_side.type = cudaMemLocationTypeDevice;
  device_side.id = device;
  host_side.type = cudaMemLocationTypeHost;
  std::size_t attrs_idx = 0;
#if CUDART_VERSION >= 13000
  return cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(), dsts.size(), &attrs, &attrs_idx, 1, stream);
#else
  std::size_t fail_idx = 0;
  return cudaMemcpyBatchAsync(dsts.data(), const_cast<void**>(srcs.data()), sizes.data(), dsts.size(), &attrs,
                              &attrs_idx, 1, &fail_idx, stream);
#endif
#else
  (void)dsts;
  (void)srcs;
  (void)sizes;
  (void)kind;
  (void)stream;
  return cudaErrorNotSupported;
#endif
}

// One memcpy_batch on `stream`, waited for: false where the toolkit or driver
// lacks it (the reason printed, the error cleared), so that a benchmark
// reports the batch reference as unavailable instead of exiting.
inline bool memcpy_batch_works(std::vector<void*>& dsts, std::vector<const void*>& srcs,
                               std::vector<std::size_t>& sizes, cudaMemcpyKind kind, cudaStream_t stream) {
  const cudaError_t status = memcpy_batch(dsts, srcs, sizes, kind, stream);
  if (status != cudaSuccess) {
    std::fprintf(stderr, "cudaMemcpyBatchAsync unavailable: %s\n", cudaGetErrorString(status));
    cudaGetLastError();
    return false;
  }
  check(cudaStreamSynchronize(stream), "cudaMemcpyBatchAsync");
  return true;
}

// Keeps `stream` busy with a device-to-device copy while the host records the
// start event and launches: otherwise the start event fires at once and the
// launch latency (validation + launch, microseconds) is timed as kernel time.
inline void pad_copy(void* dst, const void* src, std::size_t bytes, cudaStream_t stream) {
  check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream), "pad");
}

// What the LRU and Select benchmarks time against, made once per process: a
// device-to-device copy of 256 MiB (its GB/s, read + write, is the HBM
// reference) and a 64 MiB pad copy before each timed launch, so that launch
// latency is not timed as kernel time (pad_copy).
struct DeviceCopyTiming {
  static constexpr std::size_t kCopyBytes = std::size_t{256} << 20;
  Events events;
  double d2d_gbps = 0;
  void* a = nullptr;  // the reference copy's buffers, kept for pad()
  void* b = nullptr;
  DeviceCopyTiming() {
    a = device_alloc<std::byte>(kCopyBytes);
    b = device_alloc<std::byte>(kCopyBytes);
    check(cudaMemset(a, 1, kCopyBytes), "cudaMemset");
    d2d_gbps = measure_d2d_gbps(b, a, kCopyBytes, 20, nullptr, events);
  }
  void pad() const { pad_copy(b, a, kCopyBytes / 4, nullptr); }
};

inline DeviceCopyTiming& device_copy_timing() {
  static DeviceCopyTiming t;
  return t;
}

// The same page copies done by the two copy-engine references, timed in the
// same process: one cudaMemcpyAsync per page, and one cudaMemcpyBatchAsync
// (batch_ms < 0: unavailable).
struct CopyReferences {
  double per_page_ms = 0, batch_ms = 0;
};

// The counters the gather and save benchmarks share: GB/s of the kernel
// (`ms` for `bytes`) and of each reference, and their ratios, the PCIe
// reference of the copy's direction included.
inline void set_copy_counters(benchmark::State& state, double bytes, double ms, const CopyReferences& ref,
                              double pcie_gbps) {
  const auto gbps = [&](double t_ms) { return bytes / (t_ms * 1e-3) / 1e9; };
  state.counters["GBps"] = gbps(ms);
  state.counters["pcie_GBps"] = pcie_gbps;
  state.counters["per_page_GBps"] = gbps(ref.per_page_ms);
  state.counters["batch_GBps"] = ref.batch_ms > 0 ? gbps(ref.batch_ms) : -1;
  state.counters["over_pcie"] = gbps(ms) / pcie_gbps;
  state.counters["over_per_page"] = ref.per_page_ms / ms;
  state.counters["over_batch"] = ref.batch_ms > 0 ? ref.batch_ms / ms : -1;
}

// The benchmarks' main: "SKIPPED: no CUDA device" and 0 without a device;
// otherwise `before` (when given) runs once, after the arguments are parsed
// and before the first benchmark, e.g. report_pcie_reference.
inline int run_benchmarks(int argc, char** argv, void (*before)() = nullptr) {
  if (sparsekv::cuda_device_count() == 0) {
    std::puts("SKIPPED: no CUDA device");
    return 0;
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  if (before != nullptr) before();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}

}  // namespace sparsekv::bench
