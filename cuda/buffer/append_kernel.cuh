#pragma once
// The append kernel of buffer/append_cuda.hpp, templated on what it
// computes for a full tail page before saving it. The buffer layer
// instantiates it with NoPageSummary (cuda/buffer/append_kernels.cu); the
// step layer, which sees both this kernel and the policies' summary rules,
// with Quest's, ShadowKV's and RetroInfer's
// (cuda/step/append_summaries_kernels.cu). So one launch
// still does the whole step, and no buffer-layer file includes a policy
// header.
//
// A Summary has `std::size_t shared_bytes(const PageLayout&) const` (dynamic
// shared memory) and `__device__ void operator()(const DeviceAppend&, b, h,
// float* shared) const`, run by every thread of the block once (b, h)'s full
// page is in its tail, bracketed by barriers.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "core/launch_support.cuh"
#include "sparsekv/buffer/append_cuda.hpp"

namespace sparsekv::cuda::detail {

struct NoPageSummary {
  std::size_t shared_bytes(const PageLayout&) const { return 0; }
  __device__ void operator()(const DeviceAppend&, std::uint32_t, std::uint32_t, float*) const {}
};

inline constexpr std::uint32_t kAppendWarps = kAppendThreads / 32;

// One block per (b, h) item, blocks striding. Threads scan dimensions (q
// converted, every value tested), the block agrees on whether the K/V row is
// clean (__syncthreads_or), thread 0 lowers the error word once with the
// block's smallest key, and a clean row is written; a full page is then
// summarised and saved, threads striding over its 16-byte vectors.
template <class Summary>
__global__ void __launch_bounds__(kAppendThreads) append_kernel(DeviceAppend a, Summary summary) {
  extern __shared__ float summary_shared[];
  __shared__ unsigned long long warp_bad[kAppendWarps];
  const std::uint64_t items = std::uint64_t{a.batch} * a.kv_heads;
  const std::size_t vectors = append_page_vectors(a.layout);
  for (std::uint64_t item = blockIdx.x; item < items; item += gridDim.x) {
    const auto b = static_cast<std::uint32_t>(item / a.kv_heads);
    const auto h = static_cast<std::uint32_t>(item % a.kv_heads);
    std::uint64_t first_bad = kNoAppendError;
    bool kv_bad = false;
    for (std::uint32_t d = threadIdx.x; d < a.layout.head_dim; d += blockDim.x) {
      kv_bad = append_scan_dim(a, b, h, d, first_bad) || kv_bad;
    }
    unsigned long long bad = first_bad;
    for (std::uint32_t mask = 16; mask > 0; mask /= 2) {
      const unsigned long long other = __shfl_xor_sync(0xffffffffu, bad, mask);
      bad = other < bad ? other : bad;
    }
    if (threadIdx.x % 32 == 0) warp_bad[threadIdx.x / 32] = bad;
    const bool row_bad = __syncthreads_or(kv_bad);  // also publishes warp_bad
    if (threadIdx.x == 0) {
      unsigned long long block_bad = kNoAppendError;
      for (std::uint32_t w = 0; w < kAppendWarps; ++w) block_bad = warp_bad[w] < block_bad ? warp_bad[w] : block_bad;
      if (block_bad != kNoAppendError) atomicMin(reinterpret_cast<unsigned long long*>(a.error), block_bad);
    }
    if (!row_bad) {
      for (std::uint32_t d = threadIdx.x; d < a.layout.head_dim; d += blockDim.x) append_write_dim(a, b, h, d);
      if (append_fills_tail(a, b)) {
        __syncthreads();  // the new row is in the page for every thread
        summary(a, b, h, summary_shared);
        for (std::size_t v = threadIdx.x; v < vectors; v += blockDim.x) append_save_vector(a, b, h, v);
      }
    }
    __syncthreads();  // the next item reuses warp_bad and the summary's shared memory
  }
}

// The checks of buffer/append_cuda.hpp's append_tokens.
inline void check_device_append(const char* function, const DeviceAppend& a) {
  const PageLayout& l = a.layout;
  if (a.q_heads == 0 || a.kv_heads == 0 || l.head_dim == 0 || l.page_tokens == 0) {
    throw_invalid(function, "q_heads " + std::to_string(a.q_heads) + ", kv_heads " + std::to_string(a.kv_heads) +
                                ", head_dim " + std::to_string(l.head_dim) + " and page_tokens " +
                                std::to_string(l.page_tokens) + " must be > 0");
  }
  if (a.q_heads % a.kv_heads != 0) {
    throw_invalid(function, "q_heads " + std::to_string(a.q_heads) + " is not a multiple of kv_heads " +
                                std::to_string(a.kv_heads));
  }
  if (a.batch > kMaxAppendBatch || a.q_heads > kMaxAppendHeads || l.head_dim > kMaxAppendDim) {
    throw_invalid(function, "batch " + std::to_string(a.batch) + ", q_heads " + std::to_string(a.q_heads) +
                                " or head_dim " + std::to_string(l.head_dim) + " exceeds the error word's fields");
  }
  if (l.dtype != DType::f32 && l.dtype != DType::f16 && l.dtype != DType::bf16) {
    throw_invalid(function, "unknown dtype " + std::to_string(static_cast<int>(l.dtype)));
  }
  if (l.page_bytes() % sizeof(AppendVector) != 0 || a.page_stride % sizeof(AppendVector) != 0 ||
      a.page_stride < l.page_bytes()) {
    throw_invalid(function, "page_bytes " + std::to_string(l.page_bytes()) + " and page_stride " +
                                std::to_string(a.page_stride) + " must be multiples of 16, the stride >= the page");
  }
  if (reinterpret_cast<std::uintptr_t>(a.gpu_tier) % sizeof(AppendVector) != 0) {
    throw_invalid(function, "gpu_tier is not 16-byte aligned");
  }
  if (a.batch > 0 &&
      (a.q == nullptr || a.k_new == nullptr || a.v_new == nullptr || a.q_out == nullptr || a.gpu_tier == nullptr ||
       a.tail_pages == nullptr || a.tail_slots == nullptr || a.cpu_pages == nullptr || a.error == nullptr)) {
    throw_invalid(function, "null pointer with batch " + std::to_string(a.batch));
  }
}

template <class Summary>
void launch_append(const char* function, const DeviceAppend& a, const Summary& summary, void* stream) {
  if (a.batch == 0) return;
  constexpr std::uint64_t kMaxGrid = 0x7fffffffu;  // blocks stride: a capped grid covers every item
  const std::uint64_t items = std::uint64_t{a.batch} * a.kv_heads;
  append_kernel<Summary><<<static_cast<unsigned>(items < kMaxGrid ? items : kMaxGrid), kAppendThreads,
                           summary.shared_bytes(a.layout), static_cast<cudaStream_t>(stream)>>>(a, summary);
  check_launch(function);
}

}  // namespace sparsekv::cuda::detail
