#pragma once
// LiveTokenPolicy: the skeleton of the policies that evict tokens for good,
// H2O and StreamingLLM eviction (SpvLLM §4.2): per kv head the live positions
// (LiveTokens, token_eviction.hpp), an Index that reads no K/V (so a fork
// takes every token from its source), a saved decode page and Select as
// LiveTokens lays them out, and a placed token made live. A policy derives
// from LiveTokenPolicy<Itself>, keeps a LayerState with a LiveTokens `live`,
// gives kName, observe and evict, and what it keeps beside the positions,
// privately (the skeleton is its friend; each has a default that keeps nothing):
//
//   start(ctx, tokens, state)   its books of a fresh state of `tokens` live tokens
//   check_state(ctx, state)     its checks of a state, before Append and a placement
//   on_placed(state)            its books of the token just placed
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "sparsekv/partition/partition_spec.hpp"
#include "sparsekv/policy/sparse_attention.hpp"
#include "sparsekv/policy/token_eviction.hpp"

namespace sparsekv {

template <class Derived>
class LiveTokenPolicy {
 public:
  static constexpr RopeStage kRope = RopeStage::post_rope;
  static constexpr bool kIndexReadsValues = false;  // index() reads K alone

  template <class State>
  std::vector<PartitionSpec> index(const LayerContext& ctx, const KvView& kv, State& state) const {
    State next;
    const PartitionSpec spec = next.live.index(Derived::kName, ctx, kv);
    Derived::start(ctx, kv.tokens, next);
    state = std::move(next);
    return {spec};
  }
  // Index reads no K/V: a fork takes every token from its source.
  template <class State>
  std::uint32_t reused_tokens(const LayerContext& ctx, const State&) const {
    return ctx.tokens;
  }
  template <class State>
  std::vector<PartitionSpec> fork_index(const LayerContext& ctx, const State&, const KvView&, State& state) const {
    State next;
    const PartitionSpec spec = next.live.index_fork(ctx);
    Derived::start(ctx, ctx.tokens, next);
    state = std::move(next);
    return {spec};
  }
  template <class State>
  std::optional<Repartition> append(const LayerContext& ctx, const AppendedPage& page, State& state) const {
    Derived::check_state(ctx, state);
    state.live.append(Derived::kName, ctx, page);
    return std::nullopt;
  }
  template <class State>
  void select(const LayerContext& ctx, const DecodeQuery&, const State& state, Selection& out) const {
    state.live.select(Derived::kName, ctx, out);
  }
  std::uint32_t mandatory_pages(const LayerContext& ctx) const {
    return LiveTokens::mandatory_pages(Derived::kName, ctx);
  }
  template <class State>
  void placed(const LayerContext& ctx, std::uint32_t position, State& state) const {
    Derived::check_state(ctx, state);
    state.live.check_placed(Derived::kName, ctx, position);
    state.live.place(position);
    Derived::on_placed(state);
  }

 protected:
  template <class State>
  static void start(const LayerContext&, std::uint32_t, State&) {}
  template <class State>
  static void check_state(const LayerContext&, const State&) {}
  template <class State>
  static void on_placed(State&) {}
};

}  // namespace sparsekv
