#pragma once
// PagePositionPolicy: the skeleton of the policies that select pages by their
// position alone, Dense and StreamingWindow (StreamingLLM): one page per
// partition, an Index that reads no K/V (so a fork takes every token from
// its source), and a saved decode page as one more partition. A policy
// derives from PagePositionPolicy<Itself> and gives select_head(ctx, q,
// state, head, ids) (SelectsByHead); the device selects for both from the
// candidates' positions and token counts (policy/device_select.hpp).
#include <cstdint>
#include <optional>
#include <vector>

#include "sparsekv/partition/partition_spec.hpp"
#include "sparsekv/policy/sparse_attention.hpp"

namespace sparsekv {

template <class Derived>
class PagePositionPolicy {
 public:
  struct LayerState {
    std::vector<std::uint32_t> partitions;  // per kv head
    std::uint32_t prompt_tokens = 0;        // the prompt's last page may be short; every decode page is full
  };
  static constexpr RopeStage kRope = RopeStage::post_rope;
  static constexpr bool kRegroups = false;          // append() never asks for a Repartition
  static constexpr bool kIndexReadsValues = false;  // index() reads K alone

  std::vector<PartitionSpec> index(const LayerContext& ctx, const KvView& kv, LayerState& state) const {
    return {pages(ctx, kv.tokens, state)};
  }
  // Index reads no K/V: a fork takes every token from its source.
  std::uint32_t reused_tokens(const LayerContext& ctx, const LayerState&) const { return ctx.tokens; }
  std::vector<PartitionSpec> fork_index(const LayerContext& ctx, const LayerState&, const KvView&,
                                        LayerState& state) const {
    return {pages(ctx, ctx.tokens, state)};
  }
  std::optional<Repartition> append(const LayerContext&, const AppendedPage&, LayerState& state) const {
    for (auto& count : state.partitions) ++count;
    return std::nullopt;
  }
  void select(const LayerContext& ctx, const DecodeQuery& q, const LayerState& state, Selection& out) const {
    select_each_head(static_cast<const Derived&>(*this), ctx, q, state, out);
  }

 private:
  static PartitionSpec pages(const LayerContext& ctx, std::uint32_t tokens, LayerState& state) {
    const PartitionSpec spec = PartitionSpec::uniform(tokens, ctx.page_tokens);
    state.partitions.assign(ctx.kv_heads, spec.partition_count());
    state.prompt_tokens = tokens;
    return spec;
  }
};

}  // namespace sparsekv
