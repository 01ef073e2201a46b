// CUDA kernels of the Index stage (Spin §4.1): Quest page min / max, ShadowKV
// page mean and outlier score (Spin §4.2), RetroInfer spherical k-means
// assignment and update (RetroInfer §4.2). Every float result comes from the
// rules of summary_rules.hpp applied in the host backend's order: sums run
// sequentially inside one thread (tokens, rows or dimensions in order), only
// the independent sums are spread over threads, and no float atomics are used.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "core/launch_support.cuh"
#include "sparsekv/core/error_code.hpp"
#include "sparsekv/core/numeric.hpp"
#include "sparsekv/policy/index_cuda.hpp"
#include "sparsekv/policy/summary_rules.hpp"

namespace sparsekv::cuda {
namespace {

using namespace detail;  // core/launch_support.cuh

constexpr std::uint32_t kWarp = 32;
constexpr std::uint32_t kSummaryThreads = 128;
// kmeans_assign: a block holds kAssignRows rows in shared memory; each thread
// scores them against centroids tid, tid + blockDim, ...
constexpr std::uint32_t kAssignThreads = 256;
constexpr std::uint32_t kAssignRows = kKmeansAssignRows;
constexpr std::uint32_t kAssignWarps = kAssignThreads / kWarp;
constexpr std::uint32_t kUpdateThreads = 128;
constexpr std::uint32_t kUpdateWarps = kUpdateThreads / kWarp;

__device__ const std::byte* key_row(const KeyBlock& keys, std::uint32_t token, std::uint32_t head) {
  const std::size_t element = (static_cast<std::size_t>(token) * keys.kv_heads + head) * keys.head_dim;
  return static_cast<const std::byte*>(keys.keys) + element * dtype_size(keys.dtype);
}

// Key row t of one (page, kv head): the per-thread steps of summary_rules.hpp read through it.
struct PageKeys {
  const KeyBlock& keys;
  std::uint32_t first, head;
  __device__ const std::byte* operator()(std::uint32_t t) const { return key_row(keys, first + t, head); }
};

// Item = head * pages + page: its kv head and token range [first, end).
struct PageSpan {
  std::uint32_t head, first, end;
};
__device__ PageSpan page_span(std::uint64_t item, std::uint32_t pages, std::uint32_t page_tokens,
                              std::uint32_t tokens) {
  const auto head = static_cast<std::uint32_t>(item / pages);
  const std::uint32_t first = static_cast<std::uint32_t>(item % pages) * page_tokens;
  // first < tokens; compared as a distance so first + page_tokens never wraps.
  return {head, first, page_tokens < tokens - first ? first + page_tokens : tokens};
}

// One block per (page, kv head), blocks striding; threads over dimensions,
// each folding its dimension over the page's tokens in order.
__global__ void page_min_max_kernel(KeyBlock keys, std::uint32_t page_tokens, std::uint32_t pages, float* min,
                                    float* max) {
  const std::uint64_t total = std::uint64_t{pages} * keys.kv_heads;
  for (std::uint64_t item = blockIdx.x; item < total; item += gridDim.x) {
    const auto [head, first, end] = page_span(item, pages, page_tokens, keys.tokens);
    float* lo = min + item * keys.head_dim;
    float* hi = max + item * keys.head_dim;
    const PageKeys key{keys, first, head};
    for (std::uint32_t d = threadIdx.x; d < keys.head_dim; d += blockDim.x) {
      float l, h;
      page_min_max_channel(key, end - first, d, keys.dtype, l, h);
      lo[d] = l;
      hi[d] = h;
    }
  }
}

// One block per (page, kv head), blocks striding. Threads over dimensions sum
// the mean; thread 0 takes its norm; threads over tokens take each key's
// cosine; thread 0 folds the cosines in token order.
__global__ void page_mean_outlier_kernel(KeyBlock keys, std::uint32_t page_tokens, std::uint32_t pages, float* mean,
                                         float* outlier_score) {
  extern __shared__ float shared[];                                    // mean_outlier_shared_bytes
  float* landmark = shared;                                            // [head_dim]
  float* cosine = shared + mean_outlier_cosine_offset(keys.head_dim);  // [page_tokens]
  __shared__ float landmark_norm;
  const std::uint64_t total = std::uint64_t{pages} * keys.kv_heads;
  for (std::uint64_t item = blockIdx.x; item < total; item += gridDim.x) {
    const auto [head, first, end] = page_span(item, pages, page_tokens, keys.tokens);
    const std::uint32_t count = end - first;
    const PageKeys key{keys, first, head};
    for (std::uint32_t d = threadIdx.x; d < keys.head_dim; d += blockDim.x) {
      landmark[d] = page_mean_channel(key, count, d, keys.dtype);
      mean[item * keys.head_dim + d] = landmark[d];
    }
    __syncthreads();
    if (threadIdx.x == 0) landmark_norm = sqrt_rn(dot_in_order(landmark, landmark, keys.head_dim));
    __syncthreads();
    for (std::uint32_t i = threadIdx.x; i < count; i += blockDim.x) {
      cosine[i] = page_key_cosine(key, i, landmark, landmark_norm, keys.head_dim, keys.dtype);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      float lowest = kOutlierScoreStart;
      for (std::uint32_t i = 0; i < count; ++i) lowest = fold_min(lowest, cosine[i]);
      outlier_score[item] = lowest;
    }
    __syncthreads();  // the next item reuses landmark and cosine
  }
}

__device__ CentroidChoice shuffle_choice(CentroidChoice c, std::uint32_t lane_mask) {
  CentroidChoice other;
  other.similarity = __shfl_xor_sync(0xffffffffu, c.similarity, lane_mask);
  other.index = __shfl_xor_sync(0xffffffffu, c.index, lane_mask);
  return other;
}

// Block b scores rows [b * kAssignRows, ...) against every centroid; each
// thread keeps the best of its centroids per row (sequential rule), then the
// choices merge over the warp and over the warps (merge_choices: the same
// answer as one sequential scan).
__global__ void __launch_bounds__(kAssignThreads)
    kmeans_assign_kernel(const float* __restrict__ rows, std::uint32_t n, std::uint32_t dim,
                         const float* __restrict__ centroids, std::uint32_t k, std::uint32_t* __restrict__ labels,
                         std::uint32_t* changed) {
  extern __shared__ float tile[];  // [kAssignRows][dim], kmeans_assign_shared_bytes
  // Plain arrays, not CentroidChoice: __shared__ variables take no constructor.
  __shared__ float warp_similarity[kAssignRows][kAssignWarps];
  __shared__ std::uint32_t warp_index[kAssignRows][kAssignWarps];
  const std::uint32_t lane = threadIdx.x % kWarp;
  const std::uint32_t warp = threadIdx.x / kWarp;
  for (std::uint64_t first = std::uint64_t{blockIdx.x} * kAssignRows; first < n;
       first += std::uint64_t{gridDim.x} * kAssignRows) {
    const auto block_row = static_cast<std::uint32_t>(first);
    const std::uint32_t rows_here = n - block_row < kAssignRows ? n - block_row : kAssignRows;
    for (std::uint32_t i = threadIdx.x; i < kAssignRows * dim; i += blockDim.x) {
      tile[i] = i / dim < rows_here ? rows[static_cast<std::size_t>(block_row) * dim + i] : 0.0f;
    }
    __syncthreads();
    CentroidChoice best[kAssignRows];
    for (std::uint32_t c = threadIdx.x; c < k; c += blockDim.x) {
      const float* centroid = centroids + static_cast<std::size_t>(c) * dim;
      float acc[kAssignRows];
#pragma unroll
      for (std::uint32_t r = 0; r < kAssignRows; ++r) acc[r] = 0.0f;
      for (std::uint32_t i = 0; i < dim; ++i) {
        const float v = centroid[i];
#pragma unroll
        for (std::uint32_t r = 0; r < kAssignRows; ++r) acc[r] = dot_step(acc[r], tile[r * dim + i], v);
      }
#pragma unroll
      for (std::uint32_t r = 0; r < kAssignRows; ++r) consider_centroid(best[r], acc[r], c);
    }
#pragma unroll
    for (std::uint32_t r = 0; r < kAssignRows; ++r) {
      for (std::uint32_t mask = kWarp / 2; mask > 0; mask /= 2)
        best[r] = merge_choices(best[r], shuffle_choice(best[r], mask));
      if (lane == 0) {
        warp_similarity[r][warp] = best[r].similarity;
        warp_index[r][warp] = best[r].index;
      }
    }
    __syncthreads();
    if (threadIdx.x < rows_here) {
      CentroidChoice choice;
      for (std::uint32_t w = 0; w < kAssignWarps; ++w) {
        CentroidChoice other;
        other.similarity = warp_similarity[threadIdx.x][w];
        other.index = warp_index[threadIdx.x][w];
        choice = merge_choices(choice, other);
      }
      const std::uint32_t label = chosen_label(choice);
      std::uint32_t& slot = labels[block_row + threadIdx.x];
      if (slot != label) {
        slot = label;
        if (changed != nullptr) atomicAdd(changed, 1u);
      }
    }
    __syncthreads();  // the next rows reuse tile and the warp choices
  }
}

// One block per cluster, blocks striding. The block walks the labels in row
// order in chunks of kUpdateThreads, compacts the chunk's members (stable:
// ballot + prefix counts) and adds their rows, each thread its dimensions in
// member order; thread 0 then takes the norm in dimension order.
__global__ void __launch_bounds__(kUpdateThreads)
    kmeans_update_kernel(const float* __restrict__ rows, std::uint32_t n, std::uint32_t dim,
                         const std::uint32_t* __restrict__ labels, std::uint32_t k, float* __restrict__ centroids) {
  extern __shared__ float sums[];  // [dim], kmeans_update_shared_bytes
  __shared__ std::uint32_t members[kUpdateThreads];
  __shared__ std::uint32_t warp_counts[kUpdateWarps];
  __shared__ float inverse;
  __shared__ bool renormalise;
  const std::uint32_t lane = threadIdx.x % kWarp;
  const std::uint32_t warp = threadIdx.x / kWarp;
  for (std::uint32_t c = blockIdx.x; c < k; c += gridDim.x) {
    for (std::uint32_t d = threadIdx.x; d < dim; d += blockDim.x) sums[d] = 0.0f;
    std::uint32_t count = 0;
    for (std::uint64_t base = 0; base < n; base += kUpdateThreads) {  // 64-bit: n near 2^32 must not wrap
      const std::uint64_t row = base + threadIdx.x;
      const bool member = row < n && labels[row] == c;
      const auto t = static_cast<std::uint32_t>(row);
      const std::uint32_t ballot = __ballot_sync(0xffffffffu, member);
      if (lane == 0) warp_counts[warp] = __popc(ballot);
      __syncthreads();
      std::uint32_t offset = 0;
      std::uint32_t chunk = 0;
      for (std::uint32_t w = 0; w < kUpdateWarps; ++w) {
        if (w < warp) offset += warp_counts[w];
        chunk += warp_counts[w];
      }
      if (member) members[offset + __popc(ballot & ((1u << lane) - 1u))] = t;
      __syncthreads();
      for (std::uint32_t d = threadIdx.x; d < dim; d += blockDim.x) {
        float s = sums[d];
        for (std::uint32_t j = 0; j < chunk; ++j) s = add_rn(s, rows[static_cast<std::size_t>(members[j]) * dim + d]);
        sums[d] = s;
      }
      count += chunk;
      __syncthreads();  // members and warp_counts are refilled next chunk
    }
    if (threadIdx.x == 0) {
      double norm = 0.0;
      for (std::uint32_t d = 0; d < dim; ++d) norm = norm_sq_step(norm, sums[d]);
      float inv = 0.0f;
      renormalise = centroid_inverse_norm(norm, count, inv);
      inverse = inv;
    }
    __syncthreads();
    if (renormalise) {
      for (std::uint32_t d = threadIdx.x; d < dim; d += blockDim.x) {
        centroids[static_cast<std::size_t>(c) * dim + d] = mul_rn(sums[d], inverse);
      }
    }
    __syncthreads();  // the next cluster resets sums
  }
}

// Grids stride, so a grid capped at the hardware limit still covers every item.
unsigned grid_for(std::uint64_t items) {
  constexpr std::uint64_t kMaxGrid = 0x7fffffffu;
  return static_cast<unsigned>(items < kMaxGrid ? items : kMaxGrid);
}

// The checks page_min_max and page_mean_outlier share; returns the page count.
std::uint32_t check_key_block(const char* function, const KeyBlock& keys, std::uint32_t page_tokens, const void* out_a,
                              const void* out_b) {
  if (keys.kv_heads == 0 || keys.head_dim == 0 || page_tokens == 0) {
    throw_invalid(function, "kv_heads " + std::to_string(keys.kv_heads) + ", head_dim " +
                                std::to_string(keys.head_dim) + " and page_tokens " + std::to_string(page_tokens) +
                                " must be > 0");
  }
  if (keys.dtype != DType::f32 && keys.dtype != DType::f16 && keys.dtype != DType::bf16) {
    throw_invalid(function, "unknown dtype " + std::to_string(static_cast<int>(keys.dtype)));
  }
  if (keys.tokens > 0 && (keys.keys == nullptr || out_a == nullptr || out_b == nullptr)) {
    throw_invalid(function, "null keys or output with " + std::to_string(keys.tokens) + " tokens");
  }
  return page_count(keys.tokens, page_tokens);
}

void check_kmeans(const char* function, std::uint32_t n, std::uint32_t dim, std::uint32_t k, const void* a,
                  const void* b, const void* c) {
  if (n == 0 || dim == 0 || k == 0) {
    throw_invalid(function, std::to_string(n) + " rows x " + std::to_string(dim) + " dims and " + std::to_string(k) +
                                " centroids: all must be > 0");
  }
  if (dim > kMaxIndexDim) {
    throw_invalid(function, "dim " + std::to_string(dim) + " exceeds " + std::to_string(kMaxIndexDim));
  }
  if (a == nullptr || b == nullptr || c == nullptr) throw_invalid(function, "null rows, centroids or labels");
}

}  // namespace

void page_min_max(const KeyBlock& keys, std::uint32_t page_tokens, float* min, float* max, void* stream) {
  const std::uint32_t pages = check_key_block("page_min_max", keys, page_tokens, min, max);
  if (pages == 0) return;
  const std::uint32_t threads =
      keys.head_dim < kSummaryThreads ? (keys.head_dim + kWarp - 1) / kWarp * kWarp : kSummaryThreads;
  page_min_max_kernel<<<grid_for(std::uint64_t{pages} * keys.kv_heads), threads, 0,
                        static_cast<cudaStream_t>(stream)>>>(keys, page_tokens, pages, min, max);
  check_launch("page_min_max");
}

void page_mean_outlier(const KeyBlock& keys, std::uint32_t page_tokens, float* mean, float* outlier_score,
                       void* stream) {
  const std::uint32_t pages = check_key_block("page_mean_outlier", keys, page_tokens, mean, outlier_score);
  if (keys.head_dim > kMaxIndexDim) {
    throw_invalid("page_mean_outlier",
                  "head_dim " + std::to_string(keys.head_dim) + " exceeds " + std::to_string(kMaxIndexDim));
  }
  if (page_tokens > kMaxIndexPageTokens) {
    throw_invalid("page_mean_outlier",
                  "page_tokens " + std::to_string(page_tokens) + " exceeds " + std::to_string(kMaxIndexPageTokens));
  }
  if (pages == 0) return;
  page_mean_outlier_kernel<<<grid_for(std::uint64_t{pages} * keys.kv_heads), kSummaryThreads,
                             mean_outlier_shared_bytes(keys.head_dim, page_tokens),
                             static_cast<cudaStream_t>(stream)>>>(keys, page_tokens, pages, mean, outlier_score);
  check_launch("page_mean_outlier");
}

void kmeans_assign(const float* rows, std::uint32_t n, std::uint32_t dim, const float* centroids, std::uint32_t k,
                   std::uint32_t* labels, std::uint32_t* changed, void* stream) {
  check_kmeans("kmeans_assign", n, dim, k, rows, centroids, labels);
  const auto s = static_cast<cudaStream_t>(stream);
  if (changed != nullptr) {
    const cudaError_t status = cudaMemsetAsync(changed, 0, sizeof(std::uint32_t), s);
    if (status != cudaSuccess) throw_cuda("kmeans_assign", "cudaMemsetAsync", status);
  }
  kmeans_assign_kernel<<<grid_for((std::uint64_t{n} + kAssignRows - 1) / kAssignRows), kAssignThreads,
                         kmeans_assign_shared_bytes(dim), s>>>(rows, n, dim, centroids, k, labels, changed);
  check_launch("kmeans_assign");
}

void kmeans_update(const float* rows, std::uint32_t n, std::uint32_t dim, const std::uint32_t* labels, std::uint32_t k,
                   float* centroids, void* stream) {
  check_kmeans("kmeans_update", n, dim, k, rows, centroids, labels);
  kmeans_update_kernel<<<grid_for(k), kUpdateThreads, kmeans_update_shared_bytes(dim),
                         static_cast<cudaStream_t>(stream)>>>(rows, n, dim, labels, k, centroids);
  check_launch("kmeans_update");
}

}  // namespace sparsekv::cuda
