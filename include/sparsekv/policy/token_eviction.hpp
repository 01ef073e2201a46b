#pragma once
// Permanent token eviction (SpvLLM §1, §4.2): policies that drop tokens from
// the KV cache for good, H2O (Zhang et al. 2023, SpvLLM ref. [9]) and
// StreamingLLM (Xiao et al. 2023, ref. [8]). A EvictsTokens policy is a
// SparseAttention policy (sparse_attention.hpp) that also decides, per kv
// head, which sequence positions leave the cache; the library keeps the
// position <-> (partition, slot) maps, masks dead slots and reuses them
// (docs/policies/h2o.md, docs/policies/streaming_evict.md).
//
// On top of SparseAttention, a EvictsTokens policy P has
//   P::kNeedsTokenWeights            whether observe() wants this step's attention
//                               weights (H2O) or ignores them (StreamingLLM)
//   p.placed(ctx, pos, state)   decode: token `pos` became live in every kv
//                               head; positions arrive in increasing order
//   p.observe(ctx, w, state)    after this step's Attend: the attention weight
//                               of every live token, per kv head
//   p.evict(ctx, e, state, out) after observe: the positions each kv head
//                               drops, ascending; they leave `state` at once
// The contract:
//  - Positions are sequence positions, kept per kv head in ascending order;
//    heads evict independently, so their live sets differ.
//  - index() makes the prompt's positions live; every partition is one page
//    (PartitionSpec::uniform(tokens, page_tokens)) so a freed page frees a
//    partition.
//  - A step t runs placed(t), Attend over the live tokens, observe, evict.
//    The evictions decided at step t are applied by the library at the start
//    of step t + 1, before token t + 1 is placed, so that token can take a
//    freed slot. The budget bounds the live tokens once a step's token is
//    placed: evict leaves room for the next one.
//  - EvictionContext::protected_prefix[h]: positions below it are never
//    proposed, for a caller that keeps the pages it shares with another
//    request unmasked. The Manager passes none: the buffer copies a shared
//    page before it masks it (copy-on-evict), so a fork evicts as it would
//    unshared.
//
// Optionally (RewritesSummaries) a summary policy recomputes a partition's
// summary from the live rows left after evictions or a slot rewrite, so a
// Quest box can shrink when its extreme key dies. No built-in policy both
// evicts and keeps summaries, so the library calls rewrite nowhere yet: it is
// the hook for one that does (Quest selection over an evicting cache).
#include <concepts>
#include <cstdint>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

#include "sparsekv/core/error.hpp"
#include "sparsekv/policy/sparse_attention.hpp"

namespace sparsekv {

// The step an eviction is decided at, as the buffer sees it.
struct EvictionContext {
  std::uint32_t newest = 0;                     // position of this step's token, live in every kv head
  std::vector<std::uint32_t> live_tokens;       // [kv head] live tokens, the newest included
  std::vector<std::uint32_t> protected_prefix;  // [kv head] positions below it are shared; empty: none
};

// The positions each kv head drops: one ascending list per kv head.
struct Eviction {
  std::vector<std::vector<std::uint32_t>> positions;

  void reset(std::uint32_t kv_heads) {
    positions.resize(kv_heads);
    for (auto& p : positions) p.clear();
  }
};

// One live token's attention weight at this step: its softmax probability
// summed over the q heads of the kv head's GQA group.
struct TokenWeight {
  std::uint32_t position = 0;
  float weight = 0.0f;
};

struct TokenWeights {
  std::vector<std::vector<TokenWeight>> heads;  // [kv head], any order, each position once

  void reset(std::uint32_t kv_heads) {
    heads.resize(kv_heads);
    for (auto& h : heads) h.clear();
  }
};

template <class P>
concept EvictsTokens = SparseAttention<P> &&
    requires(const P& policy, typename P::LayerState& state, const LayerContext& ctx, const EvictionContext& e,
             const TokenWeights& w, Eviction& out, std::uint32_t position) {
  { P::kNeedsTokenWeights } -> std::convertible_to<bool>;
  { policy.evict(ctx, e, state, out) } -> std::same_as<void>;
  { policy.placed(ctx, position, state) } -> std::same_as<void>;
  { policy.observe(ctx, w, state) } -> std::same_as<void>;
};

// The live rows of one partition of kv head `head` after its live set
// changed: live_rows has one kv head (kv_heads == 1), its rows in slot order.
struct RewrittenPage {
  std::uint32_t head = 0;
  PartitionId partition = 0;
  KvView live_rows;
};

template <class P>
concept RewritesSummaries = SparseAttention<P> &&
    requires(const P& policy, typename P::LayerState& state, const LayerContext& ctx, const RewrittenPage& page) {
  { policy.rewrite(ctx, page, state) } -> std::same_as<void>;
};

// Uniform calls for any SparseAttention policy: the eviction hooks of a
// EvictsTokens / RewritesSummaries policy, and for every other policy no
// weights, no eviction (an empty list per kv head) and no rewrite.
template <SparseAttention P>
constexpr bool evicts_tokens(const P&) {
  return EvictsTokens<P>;
}
template <SparseAttention P>
constexpr bool needs_token_weights(const P&) {
  if constexpr (EvictsTokens<P>) {
    return P::kNeedsTokenWeights;
  } else {
    return false;
  }
}
template <SparseAttention P>
void evict_tokens(const P& p, const LayerContext& ctx, const EvictionContext& e, typename P::LayerState& state,
                  Eviction& out) {
  if constexpr (EvictsTokens<P>) {
    p.evict(ctx, e, state, out);
  } else {
    out.reset(ctx.kv_heads);
  }
}
template <SparseAttention P>
void token_placed(const P& p, const LayerContext& ctx, std::uint32_t position, typename P::LayerState& state) {
  if constexpr (EvictsTokens<P>) p.placed(ctx, position, state);
}
template <SparseAttention P>
void observe_weights(const P& p, const LayerContext& ctx, const TokenWeights& w, typename P::LayerState& state) {
  if constexpr (EvictsTokens<P>) p.observe(ctx, w, state);
}
template <SparseAttention P>
void rewrite_summary(const P& p, const LayerContext& ctx, const RewrittenPage& page, typename P::LayerState& state) {
  if constexpr (RewritesSummaries<P>) p.rewrite(ctx, page, state);
}

// The live positions and one-page partitions each kv head holds, the part of
// the state every eviction policy keeps. Every call checks first and throws
// invalid_argument (naming `policy`), leaving the tokens as they were.
struct LiveTokens {
  std::vector<std::vector<std::uint32_t>> positions;  // [kv head] ascending
  std::vector<std::uint32_t> partitions;              // [kv head] one-page partitions made so far

  // Prefill: positions kv.first_position.. live in every kv head, one
  // partition per page.
  PartitionSpec index(std::string_view policy, const LayerContext& ctx, const KvView& kv);
  // A fork's prefill (ForksIndex): the same for its first ctx.tokens
  // positions, which need no K/V.
  PartitionSpec index_fork(const LayerContext& ctx);
  // A full decode page became one more partition in every kv head.
  void append(std::string_view policy, const LayerContext& ctx, const AppendedPage& page);
  // Every partition made so far, in every kv head.
  void select(std::string_view policy, const LayerContext& ctx, Selection& out) const;
  // Token `position` is live in every kv head: after every live one.
  void check_placed(std::string_view policy, const LayerContext& ctx, std::uint32_t position) const;
  void place(std::uint32_t position);
  // `e` matches these tokens: the newest live last in every head, the live
  // counts equal, the prefix one per head (or none).
  void check_eviction(std::string_view policy, const LayerContext& ctx, const EvictionContext& e) const;
  // Index range [first, end) in positions[h] of the tokens head h may evict:
  // at or after `sink_tokens` and the protected prefix, and older than the
  // `recent_tokens` newest once the next token is placed.
  std::pair<std::size_t, std::size_t> evictable(const EvictionContext& e, std::uint32_t h, std::uint32_t sink_tokens,
                                                std::uint32_t recent_tokens) const;
  // How many tokens head h must drop so that placing the next token keeps
  // at most `budget_tokens` live: live + 1 - budget, at least `per_step`
  // once over; never more than `evictable` tokens.
  static std::size_t eviction_count(std::size_t live, std::size_t evictable, std::uint32_t budget_tokens,
                                    std::uint32_t per_step);
  // The whole context, as Dense: the first decode step attends every live
  // token and free_block can leave one live token per page.
  static std::uint32_t mandatory_pages(std::string_view policy, const LayerContext& ctx);

 private:
  PartitionSpec lay_out(const LayerContext& ctx, std::uint32_t tokens, std::uint32_t first_position);
};

// Checks a RewrittenPage against the layer and returns the partition's index
// in state.ids[page.head] (a State with ids [kv head][partition] and tokens
// [partition], as Quest's and ShadowKV's); invalid_argument otherwise.
void check_rewritten_rows(std::string_view policy, const LayerContext& ctx, const RewrittenPage& page);
template <class State>
std::uint32_t rewritten_partition(std::string_view policy, const LayerContext& ctx, const RewrittenPage& page,
                                  const State& state) {
  check_rewritten_rows(policy, ctx, page);
  const auto& ids = state.ids[page.head];
  for (std::uint32_t i = 0; i < ids.size(); ++i) {
    if (ids[i] != page.partition) continue;
    if (page.live_rows.tokens > state.tokens[i]) {
      fail(ErrorCode::invalid_argument, "{}: {} live rows for partition {} of kv head {}, which holds {} tokens",
           policy, page.live_rows.tokens, page.partition, page.head, state.tokens[i]);
    }
    return i;
  }
  fail(ErrorCode::invalid_argument, "{}: kv head {} has no partition {} to rewrite", policy, page.head, page.partition);
}

}  // namespace sparsekv
