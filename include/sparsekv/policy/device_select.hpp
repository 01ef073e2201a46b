#pragma once
// Which policies select on the device, and with what (the device decode step,
// docs/device-decode.md): Quest (Tang et al. 2024, min / max bound) and
// ShadowKV (Sun et al. 2024; Spin §4.2, landmarks + outliers) run the kernels
// of policy/select_cuda.hpp over summaries kept on the device, equal to their
// host select() bit for bit. StreamingWindow (StreamingLLM) and Dense select
// from the candidates' positions and token counts alone (no summaries: the
// store keeps only token counts). RetroInfer (Chen et al. 2025, §4.2) ranks
// centroids kept on the device and hands its estimation zone to the
// attention kernel; its clustering stays on the host (device_select_row,
// device_index_update_due below; docs/device-decode.md, "RetroInfer"). Every
// other policy answers Kind::none and is served by the host-tensor API.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "sparsekv/policy/dense.hpp"
#include "sparsekv/policy/quest.hpp"
#include "sparsekv/policy/retroinfer.hpp"
#include "sparsekv/policy/select_cuda.hpp"
#include "sparsekv/policy/shadowkv.hpp"
#include "sparsekv/policy/sparse_attention.hpp"
#include "sparsekv/policy/streaming_window.hpp"

namespace sparsekv {

struct DeviceSelectSpec {
  enum class Kind : std::uint8_t { none, quest, shadowkv, streaming, dense, retroinfer };
  Kind kind = Kind::none;
  std::uint32_t budget_tokens = 0;
  std::uint32_t partition_tokens = 0;  // tokens of each prompt partition (the last may be short)
  bool dense_layer = false;            // quest: a layer below dense_layers selects everything
  std::uint32_t recent_tokens = 0;     // shadowkv
  std::uint32_t outlier_pages = 0;     // shadowkv: outlier_count()
  std::uint32_t sink_pages = 0;        // streaming: the pages its sink tokens span
  std::uint32_t sink_tokens = 0;       // quest: its steady zone's sink ...
  std::uint32_t window_tokens = 0;     // ... and recent window (QuestPolicy::window_tokens())
  float spread = 1.0f;                 // quest: its score's spread (QuestPolicy::Options::spread)
  // retroinfer: the zones' fractions (retrieval_fraction applies with
  // budget_tokens 0, no budget), and whether the estimation zone is
  // attended. Its rows also read the host policy state (device_select_row),
  // which the Manager keeps: indexed at prefill, fed the saved decode pages at
  // each index update (device_index_update_due).
  float retrieval_fraction = 0.0f;
  float estimation_fraction = 0.0f;
  bool estimation = false;
  // The partition id of a head's first candidate: RetroInfer's sink is
  // partition 0 and no candidate (it joins a selection by the steady zone).
  std::uint32_t first_partition = 0;
  bool host_state = false;  // rows read device_select_row of the host state
};

// What one (request, kv head) row of a device Select reads from the host
// policy state besides the summaries (RetroInfer's sink and steady zone);
// zero for the policies whose state the device Select does not read.
struct DeviceSelectRow {
  PartitionId sink_partition = 0;
  std::uint32_t sink_tokens = 0;  // 0: no sink
  std::uint32_t recent = 0;       // how many of the row's last candidates are recent partitions
  std::uint32_t window = 0;       // the steady window in tokens
};

template <class P>
DeviceSelectSpec device_select(const P&, const LayerContext&) {
  return {};
}

// Quest's decode partitions are single pages (its append), so its prompt
// partitions must be too for one summary per partition on the device; a
// coarser page_tokens_per_partition keeps it on the host-tensor API.
inline DeviceSelectSpec device_select(const QuestPolicy& p, const LayerContext& ctx) {
  DeviceSelectSpec s;
  if (p.partition_tokens(ctx) != ctx.page_tokens) return s;
  s.kind = DeviceSelectSpec::Kind::quest;
  s.budget_tokens = p.options().budget_tokens;
  s.partition_tokens = ctx.page_tokens;
  s.dense_layer = ctx.layer < p.options().dense_layers;
  s.sink_tokens = p.options().sink_tokens;
  s.window_tokens = p.window_tokens();
  s.spread = p.options().spread;
  return s;
}

inline DeviceSelectSpec device_select(const ShadowKVPolicy& p, const LayerContext& ctx) {
  DeviceSelectSpec s;
  s.kind = DeviceSelectSpec::Kind::shadowkv;
  s.budget_tokens = p.options().budget_tokens;
  s.partition_tokens = ctx.page_tokens;
  s.recent_tokens = p.options().recent_tokens;
  s.outlier_pages = p.outlier_count();
  return s;
}

// One page per partition, as both policies index; the budget counts tokens.
inline DeviceSelectSpec device_select(const StreamingWindowPolicy& p, const LayerContext& ctx) {
  DeviceSelectSpec s;
  s.kind = DeviceSelectSpec::Kind::streaming;
  s.budget_tokens = p.options().budget_tokens;
  s.partition_tokens = ctx.page_tokens;
  // StreamingWindowPolicy::select's sink_pages: ceil(sink_tokens / page_tokens) in 64 bits.
  s.sink_pages = static_cast<std::uint32_t>((std::uint64_t{p.options().sink_tokens} + ctx.page_tokens - 1) /
                                            ctx.page_tokens);
  return s;
}

inline DeviceSelectSpec device_select(const DensePolicy&, const LayerContext& ctx) {
  DeviceSelectSpec s;
  s.kind = DeviceSelectSpec::Kind::dense;
  s.partition_tokens = ctx.page_tokens;
  return s;
}

// RetroInfer's decode pages are one-page partitions whose summaries (mean
// key, value sum) the append kernel writes; the host state learns of them
// only at its next index update, when the Manager feeds it the pages saved
// since the last (`unfed_pages` of them, the same count in every kv head).
inline DeviceSelectSpec device_select(const RetroInferPolicy& p, const LayerContext& ctx) {
  const RetroInferPolicy::Options& o = p.options();
  DeviceSelectSpec s;
  s.kind = DeviceSelectSpec::Kind::retroinfer;
  s.budget_tokens = o.budget_tokens;
  s.partition_tokens = ctx.page_tokens;
  s.retrieval_fraction = o.retrieval_fraction;
  s.estimation_fraction = o.estimation_fraction;
  s.estimation = o.estimation;
  s.first_partition = o.sink_tokens > 0 ? 1 : 0;
  s.host_state = true;
  return s;
}

template <class P, class State>
DeviceSelectRow device_select_row(const P&, const State&, std::uint32_t, std::uint32_t) {
  return {};
}
inline DeviceSelectRow device_select_row(const RetroInferPolicy&, const RetroInferPolicy::LayerState& state,
                                         std::uint32_t head, std::uint32_t unfed_pages) {
  const RetroInferPolicy::HeadState& h = state.heads.at(head);
  return {h.sink.id, h.sink.tokens, static_cast<std::uint32_t>(h.recent.size()) + unfed_pages, state.window};
}

// The summaries of a head's candidates as the host state holds them, for the
// device store (written at prefill and after each index update): RetroInfer's
// clusters then recent partitions, each its centroid (mean key), value sum
// and token count. Policies whose state the device Select does not read: none.
struct DeviceSummaryRows {
  std::vector<float> centroids;   // [n][head_dim]
  std::vector<float> value_sums;  // [n][head_dim]
  std::vector<std::uint32_t> tokens;
};
template <class P, class State>
void device_summary_rows(const P&, const State&, std::uint32_t, DeviceSummaryRows& out) {
  out = {};
}
inline void device_summary_rows(const RetroInferPolicy&, const RetroInferPolicy::LayerState& state,
                                std::uint32_t head, DeviceSummaryRows& out) {
  const RetroInferPolicy::HeadState& h = state.heads.at(head);
  out.centroids = h.centroids;
  out.centroids.insert(out.centroids.end(), h.recent_centroids.begin(), h.recent_centroids.end());
  out.value_sums = h.value_sums;
  out.value_sums.insert(out.value_sums.end(), h.recent_value_sums.begin(), h.recent_value_sums.end());
  out.tokens.clear();
  for (const auto& g : h.clusters) out.tokens.push_back(g.tokens);
  for (const auto& g : h.recent) out.tokens.push_back(g.tokens);
}

// Whether feeding the state `pending_tokens` more decode tokens (the unfed
// pages and the one this step fills) reaches the policy's next index update:
// RetroInferPolicy::append then regroups, so the Manager feeds it before the
// step. Policies whose state the device Select does not read: never.
template <class P, class State>
bool device_index_update_due(const P&, const State&, std::uint32_t) {
  return false;
}
inline bool device_index_update_due(const RetroInferPolicy& p, const RetroInferPolicy::LayerState& state,
                                    std::uint32_t pending_tokens) {
  return std::uint64_t{state.generated} + pending_tokens >= p.options().update_tokens;
}

// The partitions one device Select of `s` may return per row of at most
// `max_partitions` candidates: the bound the Select kernels hold their output
// array to (cuda::select_capacity; they cannot assume page-sized partitions,
// so Quest and ShadowKV need up to budget_tokens slots, not budget / page
// tokens). The decoder sizes its selection arrays by the largest over layers.
inline std::uint32_t device_select_capacity(const DeviceSelectSpec& s, std::uint32_t max_partitions) {
  using Kind = DeviceSelectSpec::Kind;
  switch (s.kind) {
    case Kind::quest:
      return cuda::select_capacity(max_partitions, s.budget_tokens, s.dense_layer, 0);
    case Kind::shadowkv:
      return cuda::select_capacity(max_partitions, s.budget_tokens, false, 0);
    case Kind::streaming: {
      if (s.partition_tokens == 0) return max_partitions;
      const std::uint64_t pages = (std::uint64_t{s.budget_tokens} + s.partition_tokens - 1) / s.partition_tokens;
      return cuda::select_capacity(max_partitions, static_cast<std::uint32_t>(std::min<std::uint64_t>(pages, 0xffffffffu)),
                                   false, 0);
    }
    case Kind::dense:
      return cuda::select_capacity(max_partitions, 0, true, 0);
    case Kind::retroinfer:  // the sink besides the candidates; no budget (0): the whole row
      return cuda::select_capacity(max_partitions, s.budget_tokens, s.budget_tokens == 0, 1);
    case Kind::none:
      break;
  }
  return 0;
}

}  // namespace sparsekv
