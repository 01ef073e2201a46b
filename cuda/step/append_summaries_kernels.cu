// Appends on the device with the full pages' Quest, ShadowKV or RetroInfer
// summaries, or their token counts alone (step/append_summaries_cuda.hpp):
// the buffer layer's append kernel instantiated with the per-thread summary
// steps of summary_rules.hpp, split over the block as the index kernels
// split them (index_kernels.cu).
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "buffer/append_kernel.cuh"
#include "sparsekv/step/append_summaries_cuda.hpp"
#include "sparsekv/policy/index_cuda.hpp"
#include "sparsekv/policy/summary_rules.hpp"

namespace sparsekv::cuda {
namespace {

// The full page's token count, when the caller keeps them (thread 0).
__device__ void write_page_tokens(std::uint32_t* tokens, std::size_t row, const DeviceAppend& a) {
  if (tokens != nullptr && threadIdx.x == 0) tokens[row] = a.layout.page_tokens;
}

// Threads over dimensions, each folding its channel over the page's tokens.
struct QuestPageSummary {
  const std::uint32_t* rows;
  float* min;
  float* max;
  std::uint32_t* tokens;
  std::size_t shared_bytes(const PageLayout&) const { return 0; }
  __device__ void operator()(const DeviceAppend& a, std::uint32_t b, std::uint32_t h, float*) const {
    const PageKeyRows key{append_tail_page(a, b, h), a.layout};
    const std::size_t row = rows[std::size_t{b} * a.kv_heads + h];
    write_page_tokens(tokens, row, a);
    const std::size_t first = row * a.layout.head_dim;
    for (std::uint32_t d = threadIdx.x; d < a.layout.head_dim; d += blockDim.x) {
      float lo, hi;
      page_min_max_channel(key, a.layout.page_tokens, d, a.layout.dtype, lo, hi);
      min[first + d] = lo;
      max[first + d] = hi;
    }
  }
};

// Threads over dimensions take the landmark, thread 0 its norm, threads over
// tokens the cosines, thread 0 folds them in token order.
struct ShadowKVPageSummary {
  const std::uint32_t* rows;
  float* mean;
  float* outlier_score;
  std::uint32_t* tokens;
  std::size_t shared_bytes(const PageLayout& l) const { return mean_outlier_shared_bytes(l.head_dim, l.page_tokens); }
  __device__ void operator()(const DeviceAppend& a, std::uint32_t b, std::uint32_t h, float* shared) const {
    __shared__ float landmark_norm;
    const std::uint32_t dim = a.layout.head_dim;
    const std::uint32_t count = a.layout.page_tokens;
    float* landmark = shared;                                  // [head_dim]
    float* cosine = shared + mean_outlier_cosine_offset(dim);  // [page_tokens]
    const PageKeyRows key{append_tail_page(a, b, h), a.layout};
    const std::size_t row = rows[std::size_t{b} * a.kv_heads + h];
    write_page_tokens(tokens, row, a);
    for (std::uint32_t d = threadIdx.x; d < dim; d += blockDim.x) {
      landmark[d] = page_mean_channel(key, count, d, a.layout.dtype);
      mean[row * dim + d] = landmark[d];
    }
    __syncthreads();
    if (threadIdx.x == 0) landmark_norm = sqrt_rn(dot_in_order(landmark, landmark, dim));
    __syncthreads();
    for (std::uint32_t i = threadIdx.x; i < count; i += blockDim.x) {
      cosine[i] = page_key_cosine(key, i, landmark, landmark_norm, dim, a.layout.dtype);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      float lowest = kOutlierScoreStart;
      for (std::uint32_t i = 0; i < count; ++i) lowest = fold_min(lowest, cosine[i]);
      outlier_score[row] = lowest;
    }
  }
};

// Threads over dimensions, each folding its channel of keys and values over the page's tokens.
struct RetroInferPageSummary {
  const std::uint32_t* rows;
  float* centroid;
  float* value_sum;
  std::uint32_t* tokens;
  std::size_t shared_bytes(const PageLayout&) const { return 0; }
  __device__ void operator()(const DeviceAppend& a, std::uint32_t b, std::uint32_t h, float*) const {
    const std::byte* page = append_tail_page(a, b, h);
    const PageKeyRows key{page, a.layout};
    const PageValueRows value{page, a.layout};
    const std::size_t row = rows[std::size_t{b} * a.kv_heads + h];
    write_page_tokens(tokens, row, a);
    const std::size_t first = row * a.layout.head_dim;
    for (std::uint32_t d = threadIdx.x; d < a.layout.head_dim; d += blockDim.x) {
      page_key_mean_value_sum_channel(key, value, a.layout.page_tokens, d, a.layout.dtype, centroid[first + d],
                                      value_sum[first + d]);
    }
  }
};

// No key summary: the full page's token count alone.
struct TokensPageSummary {
  const std::uint32_t* rows;
  std::uint32_t* tokens;
  std::size_t shared_bytes(const PageLayout&) const { return 0; }
  __device__ void operator()(const DeviceAppend& a, std::uint32_t b, std::uint32_t h, float*) const {
    write_page_tokens(tokens, rows[std::size_t{b} * a.kv_heads + h], a);
  }
};

}  // namespace

void append_tokens(const DeviceAppend& args, const AppendSummaries& summaries, void* stream) {
  constexpr const char* kFunction = "append_tokens";
  detail::check_device_append(kFunction, args);
  const bool rows = args.batch == 0 || summaries.rows != nullptr;
  switch (summaries.kind) {
    case AppendSummary::none:
      detail::launch_append(kFunction, args, detail::NoPageSummary{}, stream);
      return;
    case AppendSummary::quest:
      if (!rows || (args.batch > 0 && (summaries.min == nullptr || summaries.max == nullptr))) {
        detail::throw_invalid(kFunction, "quest summaries need rows, min and max");
      }
      detail::launch_append(kFunction, args,
                            QuestPageSummary{summaries.rows, summaries.min, summaries.max, summaries.tokens}, stream);
      return;
    case AppendSummary::shadowkv:
      if (!rows || (args.batch > 0 && (summaries.mean == nullptr || summaries.outlier_score == nullptr))) {
        detail::throw_invalid(kFunction, "shadowkv summaries need rows, mean and outlier_score");
      }
      if (args.layout.head_dim > kMaxIndexDim || args.layout.page_tokens > kMaxIndexPageTokens) {
        detail::throw_invalid(kFunction, "shadowkv summaries take head_dim <= " + std::to_string(kMaxIndexDim) +
                                             " and page_tokens <= " + std::to_string(kMaxIndexPageTokens));
      }
      detail::launch_append(
          kFunction, args,
          ShadowKVPageSummary{summaries.rows, summaries.mean, summaries.outlier_score, summaries.tokens}, stream);
      return;
    case AppendSummary::tokens:
      if (!rows || (args.batch > 0 && summaries.tokens == nullptr)) {
        detail::throw_invalid(kFunction, "token-count summaries need rows and tokens");
      }
      detail::launch_append(kFunction, args, TokensPageSummary{summaries.rows, summaries.tokens}, stream);
      return;
    case AppendSummary::retroinfer:
      if (!rows || (args.batch > 0 && (summaries.centroid == nullptr || summaries.value_sum == nullptr))) {
        detail::throw_invalid(kFunction, "retroinfer summaries need rows, centroid and value_sum");
      }
      detail::launch_append(
          kFunction, args,
          RetroInferPageSummary{summaries.rows, summaries.centroid, summaries.value_sum, summaries.tokens}, stream);
      return;
  }
  detail::throw_invalid(kFunction, "unknown summary kind " + std::to_string(static_cast<int>(summaries.kind)));
}

}  // namespace sparsekv::cuda
