#pragma once
// The device decode step's summary store (docs/device-decode.md): the Index
// summaries (Spin §4.1) of every (request slot, layer, kv head) kept in
// device memory for the request's life, each in a fixed-capacity region, so
// that Select reads them in place -- a row's SelectRows first / count point into its region
// (policy/select_cuda.hpp) -- and no step copies them. Quest (Tang et al.
// 2024): per partition the key min / max; ShadowKV (Sun et al. 2024; Spin
// §4.2): the landmark (mean key) and outlier score; RetroInfer (Chen et al.
// 2025, §4.2): per cluster or recent page the centroid (mean key) and value
// sum; the positional policies (StreamingWindow, Dense:
// AppendSummary::tokens) none. Per candidate also its token count and
// partition id, the other arrays SelectRows reads.
//
// Who writes what: write_prefill, a slot's prompt pages (the Index kernels of
// index_cuda.hpp, then device-to-device copies into the slot's regions);
// write_rows, RetroInfer's rows from its host index (at prefill and at each
// index update); the append kernel, each decode page that fills
// (append_summaries: the AppendSummaries of a layer, rows[b][h] =
// region(slot of b, h) + the page's index in the region, which the host
// knows without device data).
//
// Layout of a layer, one array per field: candidate c = region(slot, h) + i
// holds partition i + first_partition of (slot, h); min / max / landmarks /
// centroids / value_sums [c][head_dim], outlier_scores / tokens [c]. Quest
// with one page per partition and ShadowKV number a kv head's pages 0, 1,
// ... (first_partition 0); RetroInfer numbers its sink 0, kept out of the
// candidates, and its clusters then recent pages 1, 2, ... (first_partition
// 1). So the partition ids are the same in every region and every layer: one
// array, written at construction, serves them all.
//
// Same conventions as the kernels' C API: work enqueued on `stream` (a
// cudaStream_t; nullptr = the default stream), no allocation and no
// synchronisation after construction, host-side checks before anything is
// enqueued (ErrorCode::invalid_argument), a failed runtime call throws
// ErrorCode::cuda_error. fmt-free: the geometry below is inline host code
// that CI checks without a device (tests/policy/test_select_rules.cpp).
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "sparsekv/core/error_code.hpp"
#include "sparsekv/core/host_device.hpp"
#include "sparsekv/core/ids.hpp"
#include "sparsekv/memory/memory_resource.hpp"
#include "sparsekv/memory/page_layout.hpp"
#include "sparsekv/policy/index_cuda.hpp"

namespace sparsekv::cuda {

// What a decode page that fills gets on the device (step/append_summaries_cuda.hpp
// fuses it into the append):
// tokens: no key summary, only the full page's token count (the positional
// policies, StreamingWindow and Dense, select from token counts alone).
enum class AppendSummary : std::uint8_t { none, quest, shadowkv, tokens, retroinfer };

struct AppendSummaries {
  AppendSummary kind = AppendSummary::none;
  // [batch][kv_heads]: the summary row (b, h)'s full page takes; read only
  // for entries whose tail fills.
  const std::uint32_t* rows = nullptr;
  float* min = nullptr;            // quest: [row][head_dim]
  float* max = nullptr;            // quest: [row][head_dim]
  float* mean = nullptr;           // shadowkv: [row][head_dim], the landmark
  float* outlier_score = nullptr;  // shadowkv: [row]
  // quest, shadowkv and retroinfer, optional: [row], set to page_tokens (the
  // full page's token count, what the policies' append records), so that
  // Select reads a decode partition's size from the same store as its
  // summaries (summary_store_cuda.hpp); nullptr: not written. tokens: required.
  std::uint32_t* tokens = nullptr;
  // Last, so that the kinds above keep their positional initialisers.
  float* centroid = nullptr;   // retroinfer: [row][head_dim], the page's mean key
  float* value_sum = nullptr;  // retroinfer: [row][head_dim], the page's summed values
};

// Key / value row t of a page: what the per-thread summary steps of summary_rules.hpp read.
struct PageKeyRows {
  const std::byte* page;
  PageLayout layout;
  SPARSEKV_HOST_DEVICE const std::byte* operator()(std::uint32_t t) const { return page + layout.k_offset(t); }
};
struct PageValueRows {
  const std::byte* page;
  PageLayout layout;
  SPARSEKV_HOST_DEVICE const std::byte* operator()(std::uint32_t t) const { return page + layout.v_offset(t); }
};

// The store's shape and geometry.
struct SummaryShape {
  AppendSummary kind = AppendSummary::none;  // quest, shadowkv, retroinfer or tokens (token counts only)
  std::uint32_t layers = 0;
  std::uint32_t slots = 0;  // concurrent requests
  std::uint32_t kv_heads = 0;
  std::uint32_t head_dim = 0;
  std::uint32_t capacity = 0;  // partitions (pages) per (slot, layer, kv head)
  // The partition id of a region's candidate 0: RetroInfer numbers its sink 0
  // and keeps it out of the candidates, so its candidate i is partition i + 1.
  std::uint32_t first_partition = 0;

  // One layer's candidates: what SelectRows::candidates is over the store.
  std::uint32_t candidates() const noexcept { return slots * kv_heads * capacity; }
  // The first candidate of (slot, head) in a layer's arrays: SelectRows::first of its row.
  std::uint32_t region(std::uint32_t slot, std::uint32_t head) const noexcept {
    return (slot * kv_heads + head) * capacity;
  }
};

// Throws invalid_argument for a kind other than quest / shadowkv / retroinfer
// / tokens, a count of 0, more candidates per layer than SelectRows' 32-bit
// indices address, or partition ids past 32 bits.
inline void check_summary_shape(const char* function, const SummaryShape& s) {
  const auto fail = [function](const std::string& what) {
    throw Error(ErrorCode::invalid_argument, std::string(function) + ": " + what);
  };
  if (s.kind != AppendSummary::quest && s.kind != AppendSummary::shadowkv && s.kind != AppendSummary::retroinfer &&
      s.kind != AppendSummary::tokens) {
    fail("summary kind " + std::to_string(static_cast<int>(s.kind)) + " is not quest, shadowkv, retroinfer or tokens");
  }
  if (s.layers == 0 || s.slots == 0 || s.kv_heads == 0 || s.head_dim == 0 || s.capacity == 0) {
    fail("layers " + std::to_string(s.layers) + ", slots " + std::to_string(s.slots) + ", kv_heads " +
         std::to_string(s.kv_heads) + ", head_dim " + std::to_string(s.head_dim) + " and capacity " +
         std::to_string(s.capacity) + " must be > 0");
  }
  const std::uint64_t candidates = std::uint64_t{s.slots} * s.kv_heads * s.capacity;
  if (candidates > 0xffffffffu) {
    fail(std::to_string(candidates) + " candidates per layer exceed SelectRows' 32-bit indices");
  }
  if (std::uint64_t{s.first_partition} + s.capacity > 0xffffffffu) {
    fail("partition ids from " + std::to_string(s.first_partition) + " over a capacity of " +
         std::to_string(s.capacity) + " exceed 32 bits");
  }
}

// The pages of a prompt of `tokens` tokens (page_count: the last may be
// short), checked against the store: throws invalid_argument for a slot or
// layer out of range, page_tokens of 0, or more pages than a region holds.
inline std::uint32_t prefill_pages(const char* function, const SummaryShape& s, std::uint32_t slot, std::uint32_t layer,
                                   std::uint32_t tokens, std::uint32_t page_tokens) {
  const auto fail = [function](const std::string& what) {
    throw Error(ErrorCode::invalid_argument, std::string(function) + ": " + what);
  };
  if (slot >= s.slots || layer >= s.layers) {
    fail("slot " + std::to_string(slot) + " / layer " + std::to_string(layer) + " outside " + std::to_string(s.slots) +
         " slots x " + std::to_string(s.layers) + " layers");
  }
  if (page_tokens == 0) fail("page_tokens must be > 0");
  const std::uint32_t pages = page_count(tokens, page_tokens);
  if (pages > s.capacity) {
    fail(std::to_string(tokens) + " tokens make " + std::to_string(pages) + " pages, above the capacity of " +
         std::to_string(s.capacity));
  }
  return pages;
}

// write_rows' checks: the retroinfer kind, slot / layer / head in range, at
// most `capacity` rows, and centroids / value_sums of rows * head_dim floats
// each; throws invalid_argument otherwise.
inline void check_summary_rows(const char* function, const SummaryShape& s, std::uint32_t slot, std::uint32_t layer,
                               std::uint32_t head, std::size_t rows, std::size_t centroid_floats,
                               std::size_t value_sum_floats) {
  const auto fail = [function](const std::string& what) {
    throw Error(ErrorCode::invalid_argument, std::string(function) + ": " + what);
  };
  if (s.kind != AppendSummary::retroinfer) {
    fail("summary kind " + std::to_string(static_cast<int>(s.kind)) + " takes no rows from the host");
  }
  if (slot >= s.slots || layer >= s.layers || head >= s.kv_heads) {
    fail("slot " + std::to_string(slot) + " / layer " + std::to_string(layer) + " / kv head " + std::to_string(head) +
         " outside " + std::to_string(s.slots) + " slots x " + std::to_string(s.layers) + " layers x " +
         std::to_string(s.kv_heads) + " kv heads");
  }
  if (rows > s.capacity) {
    fail(std::to_string(rows) + " rows, above the capacity of " + std::to_string(s.capacity));
  }
  const std::size_t floats = rows * s.head_dim;
  if (centroid_floats != floats || value_sum_floats != floats) {
    fail(std::to_string(centroid_floats) + " centroid and " + std::to_string(value_sum_floats) +
         " value-sum floats for " + std::to_string(rows) + " rows of " + std::to_string(s.head_dim) + " dims");
  }
}

// Prompt page p's token count: page_tokens, the last page the remainder (as
// the policies' index records it). p < page_count(tokens, page_tokens).
SPARSEKV_HOST_DEVICE inline std::uint32_t prefill_page_tokens(std::uint32_t p, std::uint32_t tokens,
                                                              std::uint32_t page_tokens) {
  const std::uint32_t left = tokens - p * page_tokens;
  return left < page_tokens ? left : page_tokens;
}

class DeviceSummaries {
 public:
  // Allocates every layer's arrays (zero-filled) and writes the partition
  // ids (partitions[region(slot, h) + i] = i + first_partition);
  // synchronises the device once (construction is off the step's path).
  // Throws what check_summary_shape throws, then ErrorCode::unavailable
  // without a usable CUDA device, cuda_error when an allocation fails.
  DeviceSummaries(AppendSummary kind, std::uint32_t layers, std::uint32_t slots, std::uint32_t kv_heads,
                  std::uint32_t head_dim, std::uint32_t capacity, std::uint32_t first_partition = 0);
  ~DeviceSummaries();
  DeviceSummaries(const DeviceSummaries&) = delete;
  DeviceSummaries& operator=(const DeviceSummaries&) = delete;

  const SummaryShape& shape() const noexcept { return shape_; }
  std::uint32_t candidates() const noexcept { return shape_.candidates(); }
  std::uint32_t region(std::uint32_t slot, std::uint32_t head) const noexcept { return shape_.region(slot, head); }

  // A layer's device arrays, [candidates()] rows each; the other kinds' are
  // null (tokens: all but tokens()). Throw invalid_argument for a layer out of range.
  float* min(std::uint32_t layer) const;                                  // quest: [c][head_dim]
  float* max(std::uint32_t layer) const;                                  // quest: [c][head_dim]
  float* landmarks(std::uint32_t layer) const;                            // shadowkv: [c][head_dim]
  float* outlier_scores(std::uint32_t layer) const;                       // shadowkv: [c]
  float* centroids(std::uint32_t layer) const;                            // retroinfer: [c][head_dim]
  float* value_sums(std::uint32_t layer) const;                           // retroinfer: [c][head_dim]
  std::uint32_t* tokens(std::uint32_t layer) const;                       // [c]
  const PartitionId* partitions() const noexcept { return partitions_; }  // [c], every layer

  // The append kernel's AppendSummaries for `layer`: this store's arrays
  // (tokens included) and the caller's device rows [batch][kv_heads].
  AppendSummaries append_summaries(std::uint32_t layer, const std::uint32_t* rows) const;

  // Workspace write_prefill takes for a prompt of `tokens` tokens: the Index
  // kernels' outputs, [kv_heads][pages][head_dim] (and [kv_heads][pages]);
  // 0 for the tokens and retroinfer kinds, which run no Index kernel.
  std::size_t prefill_workspace_bytes(std::uint32_t tokens, std::uint32_t page_tokens) const;

  // Writes the prompt's pages into partitions [0, pages) of (slot, h) for
  // every kv head h of `layer`: page_min_max or page_mean_outlier (one
  // partition per page: Quest with page_tokens_per_partition == page_tokens,
  // ShadowKV with ctx.page_tokens == page_tokens) into the workspace, one
  // strided device-to-device copy per array into the slot's regions, and the
  // pages' token counts (prefill_page_tokens; the tokens kind writes only
  // these, and takes a null workspace). `keys` is the whole prompt on
  // the device (kv_heads and head_dim the store's). Partitions past the
  // prompt keep what they held. tokens == 0 enqueues nothing. Throws
  // invalid_argument, enqueuing nothing, for the retroinfer kind (its prompt
  // summaries come from the host index: write_rows), what prefill_pages
  // refuses, keys of another shape, a workspace below
  // prefill_workspace_bytes, and what the Index kernel refuses.
  void write_prefill(std::uint32_t slot, std::uint32_t layer, const KeyBlock& keys, std::uint32_t page_tokens,
                     void* workspace, std::size_t workspace_bytes, void* stream);

  // RetroInfer: host rows into candidates [0, n) of region(slot, head) of
  // `layer`, n = tokens.size() (a head's clusters then recent partitions, as
  // its HeadState keeps them; centroids and value_sums [n][head_dim]), then
  // waits for them: the host memory may be pageable and reused once this
  // returns. At prefill and at RetroInfer's index update, off the step's
  // path. Candidates past n keep what they held; n == 0 enqueues nothing.
  // Throws invalid_argument, enqueuing nothing, for what check_summary_rows
  // refuses.
  void write_rows(std::uint32_t slot, std::uint32_t layer, std::uint32_t head, std::span<const float> centroids,
                  std::span<const float> value_sums, std::span<const std::uint32_t> tokens, void* stream);

 private:
  // One layer's arrays, carved from one allocation.
  struct Layer {
    void* base = nullptr;
    std::size_t bytes = 0;
    float* first = nullptr;   // quest min, shadowkv landmarks, retroinfer centroids
    float* second = nullptr;  // quest max, shadowkv outlier scores, retroinfer value sums
    std::uint32_t* tokens = nullptr;
  };
  const Layer& layer_at(const char* function, std::uint32_t layer) const;
  // Layer `layer`'s array `which` when the store keeps `kind`, else null.
  float* summary_array(const char* function, std::uint32_t layer, AppendSummary kind, float* Layer::*which) const;
  void release() noexcept;

  SummaryShape shape_;
  DeviceMemoryResource memory_;
  std::vector<Layer> layers_;
  PartitionId* partitions_ = nullptr;
};

}  // namespace sparsekv::cuda
