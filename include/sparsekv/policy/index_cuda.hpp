#pragma once
// CUDA backend of the Index stage (Spin §4.1): the per-page summaries of
// Quest (channel-wise key min / max) and ShadowKV (mean key and its lowest
// cosine, Spin §4.2), and the assignment and update steps of RetroInfer's
// spherical k-means (RetroInfer §4.2). Each kernel applies the rules of
// summary_rules.hpp in the same order as the host backend (QuestPolicy,
// ShadowKVPolicy, sparsekv::kmeans_assign / kmeans_update), so results are
// bit-identical to it; no float atomics anywhere.
//
// fmt-free: kernel translation units and their callers can include it. All
// pointers are device-accessible (device memory or mapped pinned host memory);
// calls are enqueued on `stream` (a cudaStream_t; nullptr = default stream).
// Argument checks run on the host before anything is enqueued and throw
// ErrorCode::invalid_argument; a failed launch or runtime call throws
// ErrorCode::cuda_error.
#include <cstddef>
#include <cstdint>

#include "sparsekv/core/dtype.hpp"
#include "sparsekv/core/host_device.hpp"

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
// Largest page the mean kernels take (their cosine buffer).
inline constexpr std::uint32_t kMaxIndexPageTokens = 4096;

// Dynamic shared memory of the kernels, shared by the launches and the kernels
// so CI can check its bounds (tests/policy/test_index_rules.cpp). nvcc reads a float
// array that starts on a 16-byte boundary with 128-bit loads, remainder loops
// included: summing sums[0 .. 2) reads sums[0 .. 4). So every array starts
// on a granule and is allocated in whole granules; sizing to the floats used
// made memcheck report reads past the block's allocation (dim = 2 k-means).
inline constexpr std::size_t kSharedGranuleFloats = 16 / sizeof(float);
SPARSEKV_HOST_DEVICE constexpr std::size_t shared_granule_floats(std::size_t floats) {
  return (floats + kSharedGranuleFloats - 1) / kSharedGranuleFloats * kSharedGranuleFloats;
}
// page_mean_outlier: landmark [head_dim] at 0, cosine [page_tokens] after it.
SPARSEKV_HOST_DEVICE constexpr std::size_t mean_outlier_cosine_offset(std::uint32_t head_dim) {
  return shared_granule_floats(head_dim);
}
constexpr std::size_t mean_outlier_shared_bytes(std::uint32_t head_dim, std::uint32_t page_tokens) {
  return (mean_outlier_cosine_offset(head_dim) + shared_granule_floats(page_tokens)) * sizeof(float);
}
// kmeans_assign: a tile of kKmeansAssignRows rows [rows][dim]; kmeans_update: the sums [dim].
inline constexpr std::uint32_t kKmeansAssignRows = 16;
constexpr std::size_t kmeans_assign_shared_bytes(std::uint32_t dim) {
  return shared_granule_floats(std::size_t{kKmeansAssignRows} * dim) * sizeof(float);
}
constexpr std::size_t kmeans_update_shared_bytes(std::uint32_t dim) {
  return shared_granule_floats(dim) * sizeof(float);
}

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
void kmeans_update(const float* rows, std::uint32_t n, std::uint32_t dim, const std::uint32_t* labels, std::uint32_t k,
                   float* centroids, void* stream);

}  // namespace sparsekv::cuda
