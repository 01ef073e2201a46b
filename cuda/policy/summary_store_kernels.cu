// The decode step's summary store (policy/summary_store_cuda.hpp): per layer
// one allocation carved into its arrays, the partition ids written once, and
// the prefill: the Index kernels into a caller-owned workspace, then one
// strided device-to-device copy per array into the slot's regions (neither
// for the tokens kind) and a small kernel for the pages' token counts;
// RetroInfer's rows copied from the host instead.
#include <cuda_runtime.h>

#include <cstdint>
#include <span>
#include <string>

#include "core/launch_support.cuh"
#include "sparsekv/core/device.hpp"
#include "sparsekv/core/error_code.hpp"
#include "sparsekv/policy/summary_store_cuda.hpp"
#include "sparsekv/policy/index_cuda.hpp"

namespace sparsekv::cuda {
namespace {

using namespace detail;  // core/launch_support.cuh

constexpr std::uint32_t kThreads = 256;
constexpr std::uint64_t kMaxBlocks = 4096;  // blocks stride: a capped grid covers every item

constexpr std::size_t kAlign = 256;
constexpr std::size_t aligned(std::size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

unsigned grid_for(std::uint64_t items) {
  const std::uint64_t blocks = (items + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < kMaxBlocks ? blocks : kMaxBlocks);
}

// Candidate i of every region holds partition i + first_partition.
__global__ void region_partitions_kernel(PartitionId* partitions, std::uint32_t candidates, std::uint32_t capacity,
                                         std::uint32_t first_partition) {
  for (std::uint64_t c = blockIdx.x * std::uint64_t{blockDim.x} + threadIdx.x; c < candidates;
       c += std::uint64_t{gridDim.x} * blockDim.x) {
    partitions[c] = static_cast<PartitionId>(c % capacity + first_partition);
  }
}

// Prompt page p of kv head h: tokens[region0 + h * capacity + p].
struct PrefillTokens {
  std::uint32_t* tokens;
  std::uint32_t region0, capacity, kv_heads, pages, prompt_tokens, page_tokens;
};
__global__ void prefill_tokens_kernel(PrefillTokens a) {
  const std::uint64_t items = std::uint64_t{a.kv_heads} * a.pages;
  for (std::uint64_t item = blockIdx.x * std::uint64_t{blockDim.x} + threadIdx.x; item < items;
       item += std::uint64_t{gridDim.x} * blockDim.x) {
    const auto h = static_cast<std::uint32_t>(item / a.pages);
    const auto p = static_cast<std::uint32_t>(item % a.pages);
    a.tokens[a.region0 + std::size_t{h} * a.capacity + p] = prefill_page_tokens(p, a.prompt_tokens, a.page_tokens);
  }
}

// Checked before any member that needs a device is built, so bad arguments
// read as invalid_argument on any machine.
SummaryShape checked_shape(const SummaryShape& shape) {
  constexpr const char* kFunction = "DeviceSummaries";
  check_summary_shape(kFunction, shape);
  if (cuda_device_count() == 0) {
    throw Error(ErrorCode::unavailable, std::string(kFunction) + ": no CUDA device is available for the store");
  }
  return shape;
}

// A prefill's workspace: the first array ([kv_heads][pages][head_dim]: Quest
// min, ShadowKV mean) then the second (Quest max alike, ShadowKV outlier
// scores [kv_heads][pages]).
struct PrefillWorkspace {
  std::size_t first_bytes, second_bytes;
};
PrefillWorkspace prefill_workspace(const SummaryShape& s, std::uint32_t pages) {
  if (s.kind != AppendSummary::quest && s.kind != AppendSummary::shadowkv) return {0, 0};
  const std::size_t rows = std::size_t{s.kv_heads} * pages;
  const std::size_t vectors = rows * s.head_dim * sizeof(float);
  return {aligned(vectors), aligned(s.kind == AppendSummary::quest ? vectors : rows * sizeof(float))};
}

// Head h's `width` bytes from src + h * width to dst + h * dst_pitch, every head in one call.
void copy_heads(void* dst, std::size_t dst_pitch, const void* src, std::size_t width, std::uint32_t heads,
                cudaStream_t stream) {
  const cudaError_t status =
      cudaMemcpy2DAsync(dst, dst_pitch, src, width, width, heads, cudaMemcpyDeviceToDevice, stream);
  if (status != cudaSuccess) throw_cuda("DeviceSummaries::write_prefill", "cudaMemcpy2DAsync", status);
}

void copy_to_device(void* dst, const void* src, std::size_t bytes, cudaStream_t stream) {
  const cudaError_t status = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream);
  if (status != cudaSuccess) throw_cuda("DeviceSummaries::write_rows", "cudaMemcpyAsync", status);
}

}  // namespace

DeviceSummaries::DeviceSummaries(AppendSummary kind, std::uint32_t layers, std::uint32_t slots, std::uint32_t kv_heads,
                                 std::uint32_t head_dim, std::uint32_t capacity, std::uint32_t first_partition)
    : shape_(checked_shape(SummaryShape{kind, layers, slots, kv_heads, head_dim, capacity, first_partition})) {
  const std::size_t candidates = shape_.candidates();
  const std::size_t vectors = aligned(candidates * head_dim * sizeof(float));
  const std::size_t scalars = aligned(candidates * sizeof(float));
  // The tokens kind keeps no summary: its layers hold the token counts alone.
  const bool summaries = kind != AppendSummary::tokens;
  const bool vector_second = kind == AppendSummary::quest || kind == AppendSummary::retroinfer;
  const std::size_t first = summaries ? vectors : 0;
  const std::size_t second = vector_second ? vectors : summaries ? scalars : 0;
  try {
    layers_.reserve(layers);
    for (std::uint32_t l = 0; l < layers; ++l) {
      Layer layer;
      layer.bytes = first + second + scalars;
      layer.base = memory_.allocate(layer.bytes);
      auto* p = static_cast<std::byte*>(layer.base);
      layer.first = summaries ? reinterpret_cast<float*>(p) : nullptr;
      layer.second = summaries ? reinterpret_cast<float*>(p + first) : nullptr;
      layer.tokens = reinterpret_cast<std::uint32_t*>(p + first + second);
      layers_.push_back(layer);
    }
    partitions_ = static_cast<PartitionId*>(memory_.allocate(candidates * sizeof(PartitionId)));
    region_partitions_kernel<<<grid_for(candidates), kThreads>>>(partitions_, shape_.candidates(), capacity,
                                                                 first_partition);
    check_launch("DeviceSummaries");
    // Every stream, non-blocking ones included, may read the ids once construction returns.
    const cudaError_t status = cudaDeviceSynchronize();
    if (status != cudaSuccess) throw_cuda("DeviceSummaries", "cudaDeviceSynchronize", status);
  } catch (...) {
    release();
    throw;
  }
}

DeviceSummaries::~DeviceSummaries() { release(); }

void DeviceSummaries::release() noexcept {
  for (const Layer& layer : layers_) memory_.deallocate(layer.base, layer.bytes);
  layers_.clear();
  memory_.deallocate(partitions_, std::size_t{shape_.candidates()} * sizeof(PartitionId));
  partitions_ = nullptr;
}

const DeviceSummaries::Layer& DeviceSummaries::layer_at(const char* function, std::uint32_t layer) const {
  if (layer >= layers_.size()) {
    throw_invalid(function, "layer " + std::to_string(layer) + " outside " + std::to_string(layers_.size()));
  }
  return layers_[layer];
}

float* DeviceSummaries::summary_array(const char* function, std::uint32_t layer, AppendSummary kind,
                                      float* Layer::*which) const {
  const Layer& l = layer_at(function, layer);
  return shape_.kind == kind ? l.*which : nullptr;
}
float* DeviceSummaries::min(std::uint32_t layer) const {
  return summary_array("DeviceSummaries::min", layer, AppendSummary::quest, &Layer::first);
}
float* DeviceSummaries::max(std::uint32_t layer) const {
  return summary_array("DeviceSummaries::max", layer, AppendSummary::quest, &Layer::second);
}
float* DeviceSummaries::landmarks(std::uint32_t layer) const {
  return summary_array("DeviceSummaries::landmarks", layer, AppendSummary::shadowkv, &Layer::first);
}
float* DeviceSummaries::outlier_scores(std::uint32_t layer) const {
  return summary_array("DeviceSummaries::outlier_scores", layer, AppendSummary::shadowkv, &Layer::second);
}
float* DeviceSummaries::centroids(std::uint32_t layer) const {
  return summary_array("DeviceSummaries::centroids", layer, AppendSummary::retroinfer, &Layer::first);
}
float* DeviceSummaries::value_sums(std::uint32_t layer) const {
  return summary_array("DeviceSummaries::value_sums", layer, AppendSummary::retroinfer, &Layer::second);
}
std::uint32_t* DeviceSummaries::tokens(std::uint32_t layer) const {
  return layer_at("DeviceSummaries::tokens", layer).tokens;
}

AppendSummaries DeviceSummaries::append_summaries(std::uint32_t layer, const std::uint32_t* rows) const {
  const Layer& l = layer_at("DeviceSummaries::append_summaries", layer);
  AppendSummaries s;
  s.kind = shape_.kind;
  s.rows = rows;
  if (shape_.kind == AppendSummary::quest) {
    s.min = l.first;
    s.max = l.second;
  } else if (shape_.kind == AppendSummary::shadowkv) {
    s.mean = l.first;
    s.outlier_score = l.second;
  } else if (shape_.kind == AppendSummary::retroinfer) {
    s.centroid = l.first;
    s.value_sum = l.second;
  }
  s.tokens = l.tokens;
  return s;
}

std::size_t DeviceSummaries::prefill_workspace_bytes(std::uint32_t tokens, std::uint32_t page_tokens) const {
  const PrefillWorkspace w = prefill_workspace(shape_, page_count(tokens, page_tokens));
  return w.first_bytes + w.second_bytes;
}

void DeviceSummaries::write_prefill(std::uint32_t slot, std::uint32_t layer, const KeyBlock& keys,
                                    std::uint32_t page_tokens, void* workspace, std::size_t workspace_bytes,
                                    void* stream) {
  constexpr const char* kFunction = "DeviceSummaries::write_prefill";
  if (shape_.kind == AppendSummary::retroinfer) {
    throw_invalid(kFunction, "retroinfer's prompt summaries come from its host index (write_rows)");
  }
  const std::uint32_t pages = prefill_pages(kFunction, shape_, slot, layer, keys.tokens, page_tokens);
  if (keys.kv_heads != shape_.kv_heads || keys.head_dim != shape_.head_dim) {
    throw_invalid(kFunction, "keys of " + std::to_string(keys.kv_heads) + " kv heads x " +
                                 std::to_string(keys.head_dim) + " dims, the store's are " +
                                 std::to_string(shape_.kv_heads) + " x " + std::to_string(shape_.head_dim));
  }
  if (pages == 0) return;
  const Layer& l = layers_[layer];
  const auto s = static_cast<cudaStream_t>(stream);
  if (shape_.kind != AppendSummary::tokens) {
    const PrefillWorkspace w = prefill_workspace(shape_, pages);
    if (workspace == nullptr || workspace_bytes < w.first_bytes + w.second_bytes) {
      throw_invalid(kFunction, "workspace of " + std::to_string(workspace_bytes) + " bytes, " +
                                   std::to_string(w.first_bytes + w.second_bytes) + " needed");
    }
    auto* first = static_cast<float*>(workspace);
    auto* second = reinterpret_cast<float*>(static_cast<std::byte*>(workspace) + w.first_bytes);
    // The Index kernel checks its own arguments before enqueuing: the first enqueue.
    if (shape_.kind == AppendSummary::quest) {
      page_min_max(keys, page_tokens, first, second, stream);
    } else {
      page_mean_outlier(keys, page_tokens, first, second, stream);
    }
    const std::size_t dim = shape_.head_dim;
    const std::size_t region0 = shape_.region(slot, 0);
    const std::size_t vector_width = std::size_t{pages} * dim * sizeof(float);
    const std::size_t vector_pitch = std::size_t{shape_.capacity} * dim * sizeof(float);
    copy_heads(l.first + region0 * dim, vector_pitch, first, vector_width, shape_.kv_heads, s);
    if (shape_.kind == AppendSummary::quest) {
      copy_heads(l.second + region0 * dim, vector_pitch, second, vector_width, shape_.kv_heads, s);
    } else {
      copy_heads(l.second + region0, std::size_t{shape_.capacity} * sizeof(float), second, pages * sizeof(float),
                 shape_.kv_heads, s);
    }
  }
  const PrefillTokens t{l.tokens,   shape_.region(slot, 0), shape_.capacity, shape_.kv_heads, pages, keys.tokens,
                        page_tokens};
  prefill_tokens_kernel<<<grid_for(std::uint64_t{shape_.kv_heads} * pages), kThreads, 0, s>>>(t);
  check_launch(kFunction);
}

void DeviceSummaries::write_rows(std::uint32_t slot, std::uint32_t layer, std::uint32_t head,
                                 std::span<const float> centroids, std::span<const float> value_sums,
                                 std::span<const std::uint32_t> tokens, void* stream) {
  constexpr const char* kFunction = "DeviceSummaries::write_rows";
  check_summary_rows(kFunction, shape_, slot, layer, head, tokens.size(), centroids.size(), value_sums.size());
  if (tokens.empty()) return;
  const Layer& l = layers_[layer];
  const auto s = static_cast<cudaStream_t>(stream);
  const std::size_t first = shape_.region(slot, head);
  const std::size_t dim = shape_.head_dim;
  copy_to_device(l.first + first * dim, centroids.data(), centroids.size_bytes(), s);
  copy_to_device(l.second + first * dim, value_sums.data(), value_sums.size_bytes(), s);
  copy_to_device(l.tokens + first, tokens.data(), tokens.size_bytes(), s);
  // The caller may reuse or free its (possibly pageable) rows once this returns.
  const cudaError_t status = cudaStreamSynchronize(s);
  if (status != cudaSuccess) throw_cuda(kFunction, "cudaStreamSynchronize", status);
}

}  // namespace sparsekv::cuda
