#pragma once
// Dense: every partition, every step, through the same offload / retrieve /
// attend pipeline as the sparse policies -- the baseline every policy is
// measured against. One page per partition.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <numeric>
#include <optional>
#include <vector>

#include "sparsekv/policy/sparse_attention.hpp"

namespace sparsekv {

class DensePolicy {
 public:
  struct Options {};
  struct LayerState {
    std::vector<std::uint32_t> partitions;  // per kv head
  };
  static constexpr std::string_view kName = "dense";
  static constexpr RopeStage kRope = RopeStage::post_rope;
  static constexpr bool kRegroups = false;          // append() never asks for a Repartition
  static constexpr bool kIndexReadsValues = false;  // index() reads K alone

  DensePolicy() = default;
  explicit DensePolicy(const Options&) {}

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
    select_each_head(*this, ctx, q, state, out);
  }
  void select_head(const LayerContext& ctx, const DecodeQuery&, const LayerState& state, std::uint32_t h,
                   std::vector<PartitionId>& ids) const {
    check_head(kName, ctx, h);
    ids.resize(state.partitions.at(h));
    std::iota(ids.begin(), ids.end(), PartitionId{0});
  }
  // Prefill's last page may be partial: one page more than the tokens fill
  // (in 64 bits, saturated: a context near 2^32 tokens must not wrap to a few pages).
  std::uint32_t mandatory_pages(const LayerContext& ctx) const {
    const std::uint64_t pages = (std::uint64_t{ctx.tokens} + ctx.page_tokens - 1) / ctx.page_tokens + 1;
    return static_cast<std::uint32_t>(std::min<std::uint64_t>(pages, std::numeric_limits<std::uint32_t>::max()));
  }

 private:
  static PartitionSpec pages(const LayerContext& ctx, std::uint32_t tokens, LayerState& state) {
    const PartitionSpec spec = PartitionSpec::uniform(tokens, ctx.page_tokens);
    state.partitions.assign(ctx.kv_heads, spec.partition_count());
    return spec;
  }
};

// Dense's device Select (policy/device_select.hpp): every candidate.
struct DenseDeviceSelect {
  using Policy = DensePolicy;
};
inline DenseDeviceSelect device_select_spec(const DensePolicy&, const LayerContext&) { return {}; }

}  // namespace sparsekv
