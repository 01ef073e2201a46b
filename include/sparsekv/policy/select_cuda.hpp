#pragma once
// CUDA backend of the Select stage (Spin §4.1; the device decode step,
// docs/device-decode.md): the partitions each (request, kv head) needs for a
// decode query, chosen on the device from the summaries the Index kernels
// keep there, for Quest (Tang et al. 2024), ShadowKV (Sun et al. 2024; Spin
// §4.2) and RetroInfer (Chen et al. 2025, §4.2), and from the candidates'
// token counts alone for StreamingWindow (StreamingLLM) and Dense. Each
// kernel applies the rules of select_rules.hpp in the host policies' order,
// so its selections equal QuestPolicy / ShadowKVPolicy / RetroInferPolicy /
// StreamingWindowPolicy / DensePolicy::select bit for bit
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

#include "sparsekv/core/host_device.hpp"
#include "sparsekv/core/ids.hpp"

namespace sparsekv::cuda {

// One row per (request, kv head): row r = b * kv_heads + h reads the q heads
// [h * group, (h + 1) * group) of request b, i.e. q + r * group * head_dim.
// Its candidates are [first[r], first[r] + count[r]) of the per-candidate
// arrays, in the order the host policy's LayerState keeps them (Quest and
// ShadowKV: the kv head's partitions, the newest last; RetroInfer: clusters,
// then recent partitions oldest first). Rows are addressed by first / count,
// not by CSR offsets, because on the decode step the summaries stay on the
// device in fixed-capacity regions, one per (request slot, layer, kv head)
// (summary_store_cuda.hpp): a batch's rows are then scattered over the arena,
// in any order and with other slots' regions between them, and a per-step
// compact copy would move the whole arena.
//
// max_row_candidates bounds every count: the workspace keeps one slice of
// that many candidates per row, so it grows with the batch and the region
// capacity, not with the arena. It may exceed the real counts (a captured
// graph passes the host-known capacity); the counts are device data the host
// cannot check, so the kernels clamp a count to max_row_candidates and a row
// to the arrays' extent (select_row_span) rather than read past either.
struct SelectRows {
  std::uint32_t rows = 0;
  std::uint32_t kv_heads = 0;
  std::uint32_t group = 0;  // q heads per kv head
  std::uint32_t head_dim = 0;
  std::uint32_t candidates = 0;             // the per-candidate arrays' extent: first[r] + count[r] <= candidates
  std::uint32_t max_row_candidates = 0;     // >= every count[r]
  const std::uint32_t* first = nullptr;     // [rows]: row r's first candidate
  const std::uint32_t* count = nullptr;     // [rows]: row r's candidates
  const std::uint32_t* tokens = nullptr;    // [candidates], each >= 1 inside a row
  const PartitionId* partitions = nullptr;  // [candidates]
  const float* q = nullptr;                 // [rows / kv_heads][kv_heads * group][head_dim]
};

// Row r's candidates as the kernels read them: count clamped to the
// workspace's slice (max_row_candidates) and the row to the arrays' extent.
// Shared with the CI emulation (tests/policy/test_select_rules.cpp).
struct SelectRowSpan {
  std::uint32_t first = 0;
  std::uint32_t n = 0;
};
SPARSEKV_HOST_DEVICE inline SelectRowSpan select_row_span(std::uint32_t first, std::uint32_t count,
                                                          std::uint32_t max_row_candidates, std::uint32_t candidates) {
  const std::uint32_t start = first < candidates ? first : candidates;
  const std::uint32_t room = candidates - start;
  std::uint32_t n = count < max_row_candidates ? count : max_row_candidates;
  if (n > room) n = room;
  return {start, n};
}

// selected[r * max_selected, + selected_count[r]): row r's partitions, sorted
// ascending, or in candidate order where the policy selects everything (as
// the host policies return them). max_selected must hold the largest
// selection: see each entry point.
struct SelectOutput {
  std::uint32_t max_selected = 0;
  PartitionId* selected = nullptr;          // [rows][max_selected]
  std::uint32_t* selected_count = nullptr;  // [rows]
};

// QuestPolicy with budget_tokens, sink_tokens and window_tokens() (its
// steady zone, quest_steady; zeros: the paper's Quest) and spread
// (quest_logit; 1: the paper's bound); `dense_layer` (ctx.layer <
// dense_layers) selects everything. min / max:
// [candidates][head_dim]; candidate c's row at c * head_dim, so row r's
// candidate i at (first[r] + i) * head_dim (as every per-candidate array
// below).
struct QuestSelect {
  const float* min = nullptr;
  const float* max = nullptr;
  std::uint32_t budget_tokens = 0;
  bool dense_layer = false;
  std::uint32_t sink_tokens = 0;
  std::uint32_t window_tokens = 0;
  float spread = 1.0f;
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

// RetroInferPolicy with budget_tokens and retrieval_fraction (read only when
// budget_tokens is 0, no budget: retroinfer_retrieval_fill); a row's steady
// window is its LayerState's window (retroinfer_row_window). centroids:
// [candidates][head_dim]; per row the sink's partition and tokens (0: none)
// and how many of its last candidates are recent partitions (the steady
// window is taken from them).
struct RetroInferSelect {
  const float* centroids = nullptr;
  const PartitionId* sink_partitions = nullptr;  // [rows]
  const std::uint32_t* sink_tokens = nullptr;    // [rows]
  const std::uint32_t* recent = nullptr;         // [rows]
  std::uint32_t budget_tokens = 0;
  std::uint32_t window_tokens = 0;
  float retrieval_fraction = 0.0f;
  // [rows]: row r's steady window in tokens (LayerState::window, which
  // differs per request: a short prompt's whole tail until the first index
  // update); null: window_tokens for every row.
  const std::uint32_t* windows = nullptr;
};

// Row r's steady window in tokens, as the kernels and the CI emulation read it.
SPARSEKV_HOST_DEVICE inline std::uint32_t retroinfer_row_window(const RetroInferSelect& retroinfer, std::uint32_t row) {
  return retroinfer.windows != nullptr ? retroinfer.windows[row] : retroinfer.window_tokens;
}

// RetroInferPolicy::attend's estimation zone (RetroInfer §4.2 eqs. 2-4) for
// rows ranked with a RetroInferSelect: the best-ranked
// fraction_count(estimation_fraction, m) of the row's m ranked candidates
// that its selection does not hold (retroinfer_estimation_fill).
// value_sums: [candidates][head_dim], each candidate's summed values.
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

// StreamingWindowPolicy with budget_tokens (StreamingLLM's sinks and recent
// window) over the candidates' token counts only: sink_pages =
// streaming_sink_pages(sink_tokens, page_tokens). page_tokens is a full
// candidate's tokens: every candidate of a row holds page_tokens tokens but
// at most one (the prompt's last page, as the summary store keeps them), so a
// selection holds at most ceil(budget / page_tokens) candidates. Dense
// (dense_select) takes no parameters: every candidate, in candidate order.
struct StreamingSelect {
  std::uint32_t budget_tokens = 0;
  std::uint32_t sink_pages = 0;
  std::uint32_t page_tokens = 0;
};

// Candidates ranked per round: rows up to this many are sorted in one pass;
// longer rows take a radix-select pass per round of this many.
inline constexpr std::uint32_t kSelectTile = 2048;

// Bytes of the caller-owned workspace the select entry points take for
// `rows`: per row a slice of max_row_candidates slots (a score, the group's
// logits, a taken flag and a chosen id each) and one more id (RetroInfer's
// sink), independent of `candidates`. Every Select and retroinfer_estimate
// take this size.
std::size_t select_workspace_bytes(const SelectRows& rows);

// The smallest max_selected the entry points accept: a selection covers at
// most max(budget, one candidate) tokens, so it holds at most budget_tokens
// candidates (tokens >= 1), or the whole row (max_row_candidates, plus
// RetroInfer's sink) when the row fits the budget, the layer is dense or
// RetroInfer has no budget (0: its fraction counts candidates, not tokens).
// select_capacity is that rule, inline so the facade sizes its arrays by it
// (each spec's capacity, policy/device_select.hpp) without the CUDA library.
inline std::uint32_t select_capacity(std::uint32_t max_row_candidates, std::uint32_t budget_candidates, bool whole_row,
                                     std::uint32_t extra) {
  const std::uint64_t whole = std::uint64_t{max_row_candidates} + extra;
  const std::uint64_t most = whole_row || budget_candidates >= whole ? whole : budget_candidates;
  return static_cast<std::uint32_t>(most);
}
std::uint32_t quest_select_capacity(const SelectRows& rows, const QuestSelect& quest);
std::uint32_t shadowkv_select_capacity(const SelectRows& rows, const ShadowKVSelect& shadowkv);
std::uint32_t retroinfer_select_capacity(const SelectRows& rows, const RetroInferSelect& retroinfer);
// min(max_row_candidates, ceil(budget / page_tokens)); Dense: max_row_candidates.
std::uint32_t streaming_select_capacity(const SelectRows& rows, const StreamingSelect& streaming);
std::uint32_t dense_select_capacity(const SelectRows& rows);

// Throw invalid_argument, enqueuing nothing, for kv_heads, group or head_dim
// of 0, rows not a multiple of kv_heads, max_row_candidates > candidates, a
// budget of 0, a retrieval fraction outside [0, 1], max_selected below the
// capacity above, a workspace smaller than select_workspace_bytes, or a null
// pointer the call reads or writes (first and count whenever rows > 0).
// rows == 0 enqueues nothing.
void quest_select(const SelectRows& rows, const QuestSelect& quest, const SelectOutput& out, void* workspace,
                  std::size_t workspace_bytes, void* stream);
void shadowkv_select(const SelectRows& rows, const ShadowKVSelect& shadowkv, const SelectOutput& out, void* workspace,
                     std::size_t workspace_bytes, void* stream);
void retroinfer_select(const SelectRows& rows, const RetroInferSelect& retroinfer, const SelectOutput& out,
                       void* workspace, std::size_t workspace_bytes, void* stream);

// The positional selections (select_rules.hpp's streaming_zone): no
// summaries, no query (q, group and head_dim are not read), no workspace;
// one block per row writes [0, sinks) then [window, n) of its candidates'
// partition ids, equal to StreamingWindowPolicy / DensePolicy::select. Throw
// invalid_argument, enqueuing nothing, for kv_heads of 0, rows not a
// multiple of kv_heads, max_row_candidates > candidates, a budget or
// page_tokens of 0 (streaming), max_selected below the capacity above, or a
// null pointer the call reads or writes (dense reads no tokens). rows == 0
// enqueues nothing.
void streaming_select(const SelectRows& rows, const StreamingSelect& streaming, const SelectOutput& out, void* stream);
void dense_select(const SelectRows& rows, const SelectOutput& out, void* stream);

// Writes each q head's estimation term: the values RetroInferPolicy::attend
// gives, bit for bit (docs/policies/select-gpu.md). Rows whose budget covers
// the row and the sink, or with estimation false, get empty terms. Throws
// invalid_argument, enqueuing nothing, for what retroinfer_select refuses
// (max_selected is the selection's), an estimation fraction below 0 or
// summing with the retrieval fraction to more than 1, a workspace smaller
// than select_workspace_bytes, or a null value_sums, selection or output
// pointer. rows == 0 enqueues nothing.
void retroinfer_estimate(const SelectRows& rows, const RetroInferSelect& retroinfer, const RetroInferEstimate& estimate,
                         const EstimateOutput& out, void* workspace, std::size_t workspace_bytes, void* stream);

}  // namespace sparsekv::cuda
