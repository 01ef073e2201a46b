#pragma once
// BlockSummaryPolicy: the skeleton of the policies that summarise uniform
// partitions of keys, the same in every kv head, and rank each head's
// partitions by their summaries: Quest (Tang et al. 2024, min / max boxes),
// ShadowKV (Sun et al. 2024; Spin §4.2, landmarks and outliers) and the
// oracle. The skeleton does Index, a fork's Index (ForksIndex), Append (a
// saved decode page is one more partition) and Select head by head; a policy
// derives from BlockSummaryPolicy<Itself> and gives what differs, privately
// (the skeleton is its friend):
//
//   kName                                     its name, in messages
//   partition_tokens(ctx)                     tokens per partition
//   check_context(ctx)                        its checks of the layer context
//   prepare(ctx, state, partitions)           its summary arrays, sized and reserved
//   copy_summaries(ctx, from, to, partitions) a fork's reused partitions' summaries
//   static summarize(state, head, kv, first, count)
//                                             one partition's summary of head `head`, appended
//   select_head(ctx, q, state, head, chosen)  its ranking, public (SelectsByHead),
//                                             starting with check_state and
//                                             select_all_within_budget
//
// Its LayerState has head_dim, tokens ([partition], the same in every kv
// head) and ids ([kv head][partition]). Every call that throws leaves the
// state as it was. The pieces are also free functions, below, for a policy
// that needs one alone.
#include <cstdint>
#include <numeric>
#include <optional>
#include <string_view>
#include <utility>
#include <vector>

#include "sparsekv/core/error.hpp"
#include "sparsekv/partition/partition_spec.hpp"
#include "sparsekv/policy/sparse_attention.hpp"

namespace sparsekv {

// Index: uniform partitions of `partition_tokens` tokens, the same in every kv head,
// each summarised by summarize(state, head, first_token, tokens). Built into a fresh State, so a
// failure leaves the caller's as it was; State has head_dim, tokens
// ([partition]) and ids ([kv head][partition]), its summary arrays sized by
// the caller's `prepare(state, partitions)` and reserved there for
// `partitions` (ctx.reserved_partitions), as tokens and ids are here.
template <class State, class Prepare, class Summarize>
PartitionSpec index_uniform_partitions(const LayerContext& ctx, const KvView& kv, std::uint32_t partition_tokens,
                                       State& state, Prepare&& prepare, Summarize&& summarize) {
  const PartitionSpec spec = PartitionSpec::uniform(kv.tokens, partition_tokens);
  const std::uint32_t reserved = ctx.reserved_partitions(spec.partition_count());
  State next;
  next.head_dim = ctx.head_dim;
  next.tokens.reserve(reserved);
  next.ids.resize(ctx.kv_heads);
  for (auto& ids : next.ids) ids.reserve(reserved);
  prepare(next, reserved);
  for (std::uint32_t p = 0; p < spec.partition_count(); ++p) {
    next.tokens.push_back(spec.size(p));
    for (std::uint32_t h = 0; h < ctx.kv_heads; ++h) {
      next.ids[h].push_back(p);
      summarize(next, h, spec.token(p, 0), spec.size(p));
    }
  }
  state = std::move(next);
  return spec;
}

// Append: the saved page becomes one
// more partition in every kv head, summarised by summarize(state, head, page,
// first_token, tokens). The caller checks the page and the state first.
template <class State, class Summarize>
void append_page_partition(const LayerContext& ctx, const AppendedPage& page, State& state, Summarize&& summarize) {
  state.tokens.push_back(page.page.tokens);
  for (std::uint32_t h = 0; h < ctx.kv_heads; ++h) {
    state.ids[h].push_back(page.partitions[h]);
    summarize(state, h, page.page, 0, page.page.tokens);
  }
}

// Select's start, after the state check: the query
// and head checked, and every partition of head h chosen when the context
// fits `budget_tokens` (or `all_pages` asks for it: Quest's dense layers).
// Returns whether Select is done; otherwise `chosen` is empty.
template <class State>
bool select_all_within_budget(std::string_view policy, const LayerContext& ctx, const DecodeQuery& q,
                              const State& state, std::uint32_t h, std::uint64_t budget_tokens, bool all_pages,
                              std::vector<PartitionId>& chosen) {
  check_decode_query(policy, ctx, q);
  check_head(policy, ctx, h);
  chosen.clear();
  const std::uint64_t total = std::accumulate(state.tokens.begin(), state.tokens.end(), std::uint64_t{0});
  if (!all_pages && total > budget_tokens) return false;
  chosen = state.ids[h];
  return true;
}

// A fork's Index (ForksIndex): the leading whole
// partitions of `source` numbered 0, 1, ... in every kv head are the fork's
// too, summarised alike; reusable_uniform_tokens says how many tokens they
// hold (at most ctx.tokens).
template <class State>
std::uint32_t reusable_uniform_tokens(const LayerContext& ctx, const State& source, std::uint32_t partition_tokens) {
  const std::uint32_t most = ctx.tokens / partition_tokens;
  std::uint32_t n = 0;
  const auto numbered = [&](std::uint32_t p) {
    if (source.ids.size() != ctx.kv_heads) return false;
    for (const auto& ids : source.ids) {
      if (ids.size() <= p || ids[p] != p) return false;
    }
    return true;
  };
  while (n < most && n < source.tokens.size() && source.tokens[n] == partition_tokens && numbered(n)) ++n;
  return n * partition_tokens;
}
// fork_index: the reused partitions' ids and token counts,
// the summary arrays sized and reserved by prepare(state, partitions) as
// index_uniform_partitions does, copy_prefix(source, state, partitions)
// copying the reused summaries into them, then the rest summarised from kv
// (tokens kv.first_position .. ctx.tokens - 1). Built into a fresh State.
template <class State, class Prepare, class CopyPrefix, class Summarize>
PartitionSpec fork_uniform_partitions(const LayerContext& ctx, const State& source, const KvView& kv,
                                      std::uint32_t partition_tokens, State& state, Prepare&& prepare,
                                      CopyPrefix&& copy_prefix, Summarize&& summarize) {
  if (kv.first_position != reusable_uniform_tokens(ctx, source, partition_tokens) ||
      kv.first_position + kv.tokens != ctx.tokens) {
    fail(ErrorCode::invalid_argument,
         "fork_index: K/V of tokens {} .. {} given; the fork takes {} of its {} tokens from its source",
         kv.first_position, kv.first_position + kv.tokens, reusable_uniform_tokens(ctx, source, partition_tokens),
         ctx.tokens);
  }
  const PartitionSpec spec = PartitionSpec::uniform(ctx.tokens, partition_tokens);
  const std::uint32_t reused = kv.first_position / partition_tokens;
  const std::uint32_t reserved = ctx.reserved_partitions(spec.partition_count());
  State next;
  next.head_dim = ctx.head_dim;
  next.tokens.reserve(reserved);
  next.tokens.assign(source.tokens.begin(), source.tokens.begin() + reused);
  next.ids.resize(ctx.kv_heads);
  for (std::uint32_t h = 0; h < ctx.kv_heads; ++h) {
    next.ids[h].reserve(reserved);
    next.ids[h].assign(source.ids[h].begin(), source.ids[h].begin() + reused);
  }
  prepare(next, reserved);
  copy_prefix(source, next, reused);
  for (std::uint32_t p = reused; p < spec.partition_count(); ++p) {
    next.tokens.push_back(spec.size(p));
    for (std::uint32_t h = 0; h < ctx.kv_heads; ++h) {
      next.ids[h].push_back(p);
      summarize(next, h, spec.token(p, 0) - kv.first_position, spec.size(p));
    }
  }
  state = std::move(next);
  return spec;
}

template <class Derived>
class BlockSummaryPolicy {
 public:
  static constexpr RopeStage kRope = RopeStage::post_rope;  // summaries of the keys attention reads
  static constexpr bool kRegroups = false;                  // append() never asks for a Repartition
  static constexpr bool kIndexReadsValues = false;          // index() reads K alone

  template <class State>
  std::vector<PartitionSpec> index(const LayerContext& ctx, const KvView& kv, State& state) const {
    const Derived& p = derived();
    p.check_context(ctx);
    check_kv_view(Derived::kName, ctx, kv, false);
    return {index_uniform_partitions(
        ctx, kv, p.partition_tokens(ctx), state, [&](State& s, std::uint32_t reserved) { p.prepare(ctx, s, reserved); },
        [&](State& s, std::uint32_t h, std::uint32_t first, std::uint32_t count) {
          Derived::summarize(s, h, kv, first, count);
        })};
  }

  // A fork reuses the source's summaries of its whole leading partitions.
  template <class State>
  std::uint32_t reused_tokens(const LayerContext& ctx, const State& source) const {
    return reusable_uniform_tokens(ctx, source, derived().partition_tokens(ctx));
  }
  template <class State>
  std::vector<PartitionSpec> fork_index(const LayerContext& ctx, const State& source, const KvView& kv,
                                        State& state) const {
    const Derived& p = derived();
    p.check_context(ctx);
    check_kv_view(Derived::kName, ctx, kv, false);
    return {fork_uniform_partitions(
        ctx, source, kv, p.partition_tokens(ctx), state,
        [&](State& s, std::uint32_t reserved) { p.prepare(ctx, s, reserved); },
        [&](const State& from, State& to, std::uint32_t partitions) { p.copy_summaries(ctx, from, to, partitions); },
        [&](State& s, std::uint32_t h, std::uint32_t first, std::uint32_t count) {
          Derived::summarize(s, h, kv, first, count);
        })};
  }

  template <class State>
  std::optional<Repartition> append(const LayerContext& ctx, const AppendedPage& page, State& state) const {
    derived().check_context(ctx);
    check_appended_page(Derived::kName, ctx, page, false);
    check_state(ctx, state);
    append_page_partition(ctx, page, state,
                          [](State& s, std::uint32_t h, const KvView& kv, std::uint32_t first, std::uint32_t count) {
                            Derived::summarize(s, h, kv, first, count);
                          });
    return std::nullopt;
  }

  template <class State>
  void select(const LayerContext& ctx, const DecodeQuery& q, const State& state, Selection& out) const {
    select_each_head(derived(), ctx, q, state, out);
  }

 protected:
  // The context passes the policy's checks and the state was indexed for its kv heads and head_dim.
  template <class State>
  void check_state(const LayerContext& ctx, const State& state) const {
    derived().check_context(ctx);
    if (state.tokens.empty() || state.ids.size() != ctx.kv_heads || state.head_dim != ctx.head_dim) {
      fail(ErrorCode::invalid_argument, "{}: layer state was not indexed for {} kv heads x {} dims", Derived::kName,
           ctx.kv_heads, ctx.head_dim);
    }
  }

 private:
  const Derived& derived() const noexcept { return static_cast<const Derived&>(*this); }
};

}  // namespace sparsekv
