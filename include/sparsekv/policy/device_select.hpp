#pragma once
// Which policies select on the device, and with what (the device decode step,
// docs/device-decode.md): Quest (Tang et al. 2024, min / max bound) and
// ShadowKV (Sun et al. 2024; Spin §4.2, landmarks + outliers) run the kernels
// of policy/select_cuda.hpp over summaries kept on the device, equal to their
// host select() bit for bit. StreamingWindow (StreamingLLM) and Dense select
// from the candidates' positions and token counts alone (no summaries: the
// store keeps only token counts). Every other policy -- RetroInfer, whose
// centroids, value sums and regroups are not kept on the device yet --
// answers Kind::none and is served by the host-tensor API.
#include <algorithm>
#include <cstdint>

#include "sparsekv/policy/dense.hpp"
#include "sparsekv/policy/quest.hpp"
#include "sparsekv/policy/select_cuda.hpp"
#include "sparsekv/policy/shadowkv.hpp"
#include "sparsekv/policy/sparse_attention.hpp"
#include "sparsekv/policy/streaming_window.hpp"

namespace sparsekv {

struct DeviceSelectSpec {
  enum class Kind : std::uint8_t { none, quest, shadowkv, streaming, dense };
  Kind kind = Kind::none;
  std::uint32_t budget_tokens = 0;
  std::uint32_t partition_tokens = 0;  // tokens of each prompt partition (the last may be short)
  bool dense_layer = false;            // quest: a layer below dense_layers selects everything
  std::uint32_t recent_tokens = 0;     // shadowkv
  std::uint32_t outlier_pages = 0;     // shadowkv: outlier_count()
  std::uint32_t sink_pages = 0;        // streaming: the pages its sink tokens span
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
  if (p.options().page_tokens_per_partition != ctx.page_tokens) return s;
  s.kind = DeviceSelectSpec::Kind::quest;
  s.budget_tokens = p.options().budget_tokens;
  s.partition_tokens = ctx.page_tokens;
  s.dense_layer = ctx.layer < p.options().dense_layers;
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
    case Kind::none:
      break;
  }
  return 0;
}

}  // namespace sparsekv
