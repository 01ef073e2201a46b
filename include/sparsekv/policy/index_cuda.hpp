#pragma once
// CUDA backend of the Index stage (Spin §4.1): the per-page summaries of
// Quest (channel-wise key min / max) and ShadowKV (mean key and its lowest
// cosine, Spin §4.2), and the assignment and update steps of RetroInfer's
// spherical k-means (RetroInfer §4.2). Each kernel applies the rules of
// page_summaries.hpp in the same order as the host backend (QuestPolicy,
// ShadowKVPolicy, sparsekv::kmeans_assign / kmeans_update), so results are
// bit-identical to it; no float atomics anywhere.
//
// fmt-free: kernel translation units and their callers can include it. All
// pointers are device-accessible (device memory or mapped pinned host memory);
// calls are enqueued on `stream` (a cudaStream_t; nullptr = default stream).
// Argument checks run on the host before anything is enqueued and throw
// ErrorCode::invalid_argument; a failed launch or runtime call throws
// ErrorCode::cuda_error.
#include <cstdint>

#include "sparsekv/core/dtype.hpp"

namespace sparsekv::cuda {

// The keys of `tokens` consecutive tokens of one layer in the engine's dtype,
// laid out as KvView: [token][kv_head][head_dim]. The host policies see the
// same keys converted to fp32 by load_element (core/numeric.hpp); the kernels
// convert each element the same way.
struct KeyBlock {
  const void* keys = nullptr;
  DType dtype = DType::f32;
  std::uint32_t tokens = 0;
  std::uint32_t kv_heads = 0;
  std::uint32_t head_dim = 0;
};

// Pages are runs of `page_tokens` tokens from token 0; the last may be short:
// pages = ceil(tokens / page_tokens). Outputs are kv-head major, [kv_head][page]
// (times head_dim for vectors): the per-head vectors of QuestPolicy /
// ShadowKVPolicy LayerState laid end to end.
inline std::uint32_t page_count(std::uint32_t tokens, std::uint32_t page_tokens) {
  return page_tokens == 0 ? 0 : static_cast<std::uint32_t>((std::uint64_t{tokens} + page_tokens - 1) / page_tokens);
}

// Largest head_dim the mean and k-means kernels take (their shared-memory tiles).
inline constexpr std::uint32_t kMaxIndexDim = 512;

// Quest: min / max, each [kv_heads][pages][head_dim] fp32, of every (page,
// kv head) in one launch; equals QuestPolicy's LayerState min / max with
// page_tokens_per_partition = page_tokens. tokens == 0 enqueues nothing.
// Throws invalid_argument for kv_heads, head_dim or page_tokens of 0, an
// unknown dtype, or a null pointer while tokens > 0.
void page_min_max(const KeyBlock& keys, std::uint32_t page_tokens, float* min, float* max, void* stream);

// ShadowKV: mean [kv_heads][pages][head_dim] (the landmarks) and
// outlier_score [kv_heads][pages] (the lowest cos(key, landmark) of the page,
// starting from 1), as ShadowKVPolicy computes them with ctx.page_tokens =
// page_tokens. tokens == 0 enqueues nothing. Throws invalid_argument as
// page_min_max, and when head_dim > kMaxIndexDim or page_tokens > 4096.
void page_mean_outlier(const KeyBlock& keys, std::uint32_t page_tokens, float* mean, float* outlier_score,
                       void* stream);

// One k-means assignment pass: rows [n][dim] and centroids [k][dim] fp32 (the
// mean-centred, unit rows spherical_kmeans prepares and its unit centroids);
// labels[n] holds the previous assignment (any values) and receives each
// row's most similar centroid (sparsekv::kmeans_assign's rule). When
// `changed` is not null it is set to the number of labels that changed (it is
// zeroed on the stream first). Throws invalid_argument when n, dim or k is 0,
// dim > kMaxIndexDim, or rows, centroids or labels is null.
void kmeans_assign(const float* rows, std::uint32_t n, std::uint32_t dim, const float* centroids, std::uint32_t k,
                   std::uint32_t* labels, std::uint32_t* changed, void* stream);

// One k-means update pass: every centroid with members becomes the
// renormalised sum of its rows, summed in row order; empty or zero-sum
// clusters keep theirs (sparsekv::kmeans_update's rule). Labels must be < k
// (not checked on the device: a row labelled >= k belongs to no cluster).
// Each cluster scans all n labels, so the cost grows with n * k. Throws
// invalid_argument when n, dim or k is 0, dim > kMaxIndexDim, or a pointer
// is null.
void kmeans_update(const float* rows, std::uint32_t n, std::uint32_t dim, const std::uint32_t* labels,
                   std::uint32_t k, float* centroids, void* stream);

}  // namespace sparsekv::cuda
