#pragma once
// CUDA backend of the Select stage (Spin §4.1, "The decode step on the GPU"
// in ARCHITECTURE.md): the partitions each (request, kv head) needs for a
// decode query, chosen on the device from the summaries the Index kernels
// keep there, for Quest (Tang et al. 2024), ShadowKV (Sun et al. 2024; Spin
// §4.2) and RetroInfer (Chen et al. 2025, §4.2). Each kernel applies the
// rules of select_rules.hpp in the host policies' order, so its selections
// equal QuestPolicy / ShadowKVPolicy / RetroInferPolicy::select bit for bit
// (docs/policies/select-gpu.md). retroinfer_estimate then writes RetroInfer's
// estimation terms (RetroInferPolicy::attend's, bit for bit) in the layout
// the attention kernel merges (DecodeAttentionExtra).
//
// C API in the TensorRT-LLM style: plain structs, a workspace size query, a
// caller-owned workspace, enqueued on `stream` (a cudaStream_t; nullptr = the
// default stream), no allocation and no synchronisation. All pointers are
// device-accessible. Argument checks run on the host before anything is
// enqueued and throw ErrorCode::invalid_argument; a failed launch throws
// ErrorCode::cuda_error. fmt-free.
#include <cstddef>
#include <cstdint>

#include "sparsekv/core/ids.hpp"

namespace sparsekv::cuda {

// One row per (request, kv head): row r = b * kv_heads + h reads the q heads
// [h * group, (h + 1) * group) of request b, i.e. q + r * group * head_dim.
// Its candidates are [offsets[r], offsets[r + 1]) of the flat per-candidate
// arrays, in the order the host policy's LayerState keeps them (Quest and
// ShadowKV: the kv head's partitions, the newest last; RetroInfer: clusters,
// then recent partitions oldest first).
struct SelectRows {
  std::uint32_t rows = 0;
  std::uint32_t kv_heads = 0;
  std::uint32_t group = 0;               // q heads per kv head
  std::uint32_t head_dim = 0;
  std::uint32_t candidates = 0;          // offsets[rows]
  std::uint32_t max_row_candidates = 0;  // the largest row's count
  const std::uint32_t* offsets = nullptr;   // [rows + 1], offsets[0] = 0
  const std::uint32_t* tokens = nullptr;    // [candidates], each >= 1
  const PartitionId* partitions = nullptr;  // [candidates]
  const float* q = nullptr;                 // [rows / kv_heads][kv_heads * group][head_dim]
};

// selected[r * max_selected, + selected_count[r]): row r's partitions, sorted
// ascending, or in candidate order where the policy selects everything (as
// the host policies return them). max_selected must hold the largest
// selection: see each entry point.
struct SelectOutput {
  std::uint32_t max_selected = 0;
  PartitionId* selected = nullptr;          // [rows][max_selected]
  std::uint32_t* selected_count = nullptr;  // [rows]
};

// QuestPolicy with budget_tokens; `dense_layer` (ctx.layer < dense_layers)
// selects everything. min / max: [candidates][head_dim].
struct QuestSelect {
  const float* min = nullptr;
  const float* max = nullptr;
  std::uint32_t budget_tokens = 0;
  bool dense_layer = false;
};

// ShadowKVPolicy with budget_tokens, recent_tokens and outlier_count()
// pages. landmarks: [candidates][head_dim]; outlier_scores: [candidates].
struct ShadowKVSelect {
  const float* landmarks = nullptr;
  const float* outlier_scores = nullptr;
  std::uint32_t budget_tokens = 0;
  std::uint32_t recent_tokens = 0;
  std::uint32_t outlier_pages = 0;
};

// RetroInferPolicy with budget_tokens and retrieval_fraction; window_tokens
// is the LayerState's window. centroids: [candidates][head_dim]; per row the
// sink's partition and tokens (0: none) and how many of its last candidates
// are recent partitions (the steady window is taken from them).
struct RetroInferSelect {
  const float* centroids = nullptr;
  const PartitionId* sink_partitions = nullptr;  // [rows]
  const std::uint32_t* sink_tokens = nullptr;    // [rows]
  const std::uint32_t* recent = nullptr;         // [rows]
  std::uint32_t budget_tokens = 0;
  std::uint32_t window_tokens = 0;
  float retrieval_fraction = 0.0f;
};

// RetroInferPolicy::attend's estimation zone (RetroInfer §4.2 eqs. 2-4) for
// rows ranked with a RetroInferSelect: the clusters ranked within
// retrieval_fraction + estimation_fraction that the row's selection does not
// hold. value_sums: [candidates][head_dim], each candidate's summed values.
// The selection is what retroinfer_select wrote for the same rows, query and
// RetroInferSelect (sorted ascending; read only).
struct RetroInferEstimate {
  const float* value_sums = nullptr;
  const PartitionId* selected = nullptr;          // [rows][max_selected]
  const std::uint32_t* selected_count = nullptr;  // [rows]
  std::uint32_t max_selected = 0;
  float estimation_fraction = 0.0f;
  bool estimation = true;  // false: every term empty (retroinfer_no_estimation)
};

// One term per q head in DecodeAttentionExtra's layout (q head j of row r is
// r * group + j = b * q_heads + the head): max and sum [rows * group], acc
// [rows * group][head_dim], unnormalised; pass them to the attention as
// DecodeAttentionExtra{max, sum, acc}. An empty term is max -inf, sum 0, acc 0.
struct EstimateOutput {
  float* max = nullptr;
  float* sum = nullptr;
  float* acc = nullptr;
};

// Candidates ranked per round: rows up to this many are sorted in one pass;
// longer rows take a radix-select pass per round of this many.
inline constexpr std::uint32_t kSelectTile = 2048;

// Bytes of the caller-owned workspace the select entry points take for
// `rows`; retroinfer_estimate keeps every q head's logits and takes more.
std::size_t select_workspace_bytes(const SelectRows& rows);
std::size_t estimate_workspace_bytes(const SelectRows& rows);

// The smallest max_selected the entry points accept: a selection covers at
// most max(budget, one candidate) tokens, so it holds at most budget_tokens
// candidates (tokens >= 1), or the whole row (plus RetroInfer's sink) when
// the row fits the budget or the layer is dense.
std::uint32_t quest_select_capacity(const SelectRows& rows, const QuestSelect& quest);
std::uint32_t shadowkv_select_capacity(const SelectRows& rows, const ShadowKVSelect& shadowkv);
std::uint32_t retroinfer_select_capacity(const SelectRows& rows, const RetroInferSelect& retroinfer);

// Throw invalid_argument, enqueuing nothing, for kv_heads, group or head_dim
// of 0, rows not a multiple of kv_heads, max_row_candidates > candidates, a
// budget of 0, a retrieval fraction outside [0, 1], max_selected below the
// capacity above, a workspace smaller than select_workspace_bytes, or a null
// pointer the call reads or writes. rows == 0 enqueues nothing.
void quest_select(const SelectRows& rows, const QuestSelect& quest, const SelectOutput& out, void* workspace,
                  std::size_t workspace_bytes, void* stream);
void shadowkv_select(const SelectRows& rows, const ShadowKVSelect& shadowkv, const SelectOutput& out,
                     void* workspace, std::size_t workspace_bytes, void* stream);
void retroinfer_select(const SelectRows& rows, const RetroInferSelect& retroinfer, const SelectOutput& out,
                       void* workspace, std::size_t workspace_bytes, void* stream);

// Writes each q head's estimation term: the values RetroInferPolicy::attend
// gives, bit for bit (docs/policies/select-gpu.md). Rows whose budget covers
// the row and the sink, or with estimation false, get empty terms. Throws
// invalid_argument, enqueuing nothing, for what retroinfer_select refuses
// (max_selected is the selection's), an estimation fraction below 0 or
// summing with the retrieval fraction to more than 1, a workspace smaller
// than estimate_workspace_bytes, or a null value_sums, selection or output
// pointer. rows == 0 enqueues nothing.
void retroinfer_estimate(const SelectRows& rows, const RetroInferSelect& retroinfer,
                         const RetroInferEstimate& estimate, const EstimateOutput& out, void* workspace,
                         std::size_t workspace_bytes, void* stream);

}  // namespace sparsekv::cuda
