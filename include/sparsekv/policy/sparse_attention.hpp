#pragma once
// The SparseAttention policy interface (Spin §4.1, §4.2): the algorithm-
// specific operations Index, Select and (optionally) Attend. The library owns
// Offload and Retrieve (TieredKVBuffer); a policy only decides how tokens are
// grouped into partitions, what it remembers about them (summaries), which
// partitions each kv head needs for a query, and any extra attention term.
//
// A policy is a type P with
//   P::Options                  its knobs, defaulted to its paper's settings
//   P::LayerState               what it keeps per (request, layer): summaries
//   P::kName, P::kRope          a name, and whether it reads pre- or post-RoPE q/k
//   p.index(ctx, kv, state)     prefill: one PartitionSpec per kv head (state
//                               may be reserved for ctx.reserve_tokens)
//   p.append(ctx, page, state)  decode: a full page of new tokens became a
//                               one-page partition in every kv head; update
//                               summaries, optionally ask for a repartition
//   p.select(ctx, q, state, s)  the partitions each kv head needs for query q;
//                               the decode tail, which holds the token being
//                               decoded, is attended on top. On the step whose
//                               token fills the tail page, select (and attend)
//                               see the state from before append(): that page
//                               is attended whole as the tail, and selectable
//                               from the next step on
//   p.mandatory_pages(ctx)      the most pages one select may return per kv head
//                               while the request holds at most ctx.tokens tokens
// and optionally (CustomAttend)
//   p.attend(ctx, q, state, s, extra)  one AttentionPartial per q head, merged
//                               by log-sum-exp with the exact attention over
//                               the selected pages (RetroInfer's estimation zone)
// and optionally (DeclaresHeadCapacity)
//   p.head_capacity(ctx)        the most partitions and CPU pages one kv head
//                               holds while the request holds at most
//                               ctx.tokens tokens; the page table is sized for
//                               it at max_context_tokens. Without it:
//                               Config::head_capacity() (one partition per
//                               page, twice the pages), too small for
//                               partitions smaller than a page (RetroInfer's)
// and optionally
//   P::kIndexReadsValues = false  index() reads the prompt's K alone: a
//                               prefill then converts no V to fp32 for it
//                               (half the prompt's fp32 copy, resident while
//                               the prompt moves into the CPU tier)
// and optionally
//   P::kRegroups = false        append() never returns a Repartition: the step
//                               then shows it a filled page at commit, on its
//                               own state, instead of on a copy of the state
//                               made while it plans (a copy of every summary,
//                               per page); its append must not throw for a
//                               page and state the step checked
// and optionally (SelectsByHead, AttendsByHead), so that a step can run each
// kv head's Select on another of the engine's threads (step/host_step.hpp):
//   p.select_head(ctx, q, state, h, ids)  what select() returns for kv head h
//   p.attend_head(ctx, q, state, h, selected, extra)  attend()'s partials of
//                               kv head h's q heads (extra: group_size of them)
//                               given h's selection
// Each must equal its slice of the whole-request call bit for bit; a policy
// with only select() / attend() is run one request per thread.
// and optionally (ForksIndex), so that a fork (Manager::fork: a request
// started from the first tokens of another) reuses what the source's Index
// built instead of indexing those tokens again:
//   p.reused_tokens(ctx, source)  how many of the fork's first ctx.tokens
//                               tokens fork_index takes from `source`, the
//                               layer state of the request it starts from
//   p.fork_index(ctx, source, kv, state)  index() of the fork's first
//                               ctx.tokens tokens, bit for bit, given only
//                               those from kv.first_position =
//                               reused_tokens(ctx, source) on
//
// Threads: select, select_head, attend and attend_head may be called
// concurrently on one const policy, for different requests and kv heads, when
// an engine lends a step its threads; like a const member of a standard type,
// they must not write shared state (no unguarded mutable scratch). index,
// append and the eviction hooks are never called concurrently.
//
// Policies see fp32 copies of q/k/v; the facade converts the engine's dtype.
// Adding an algorithm is one header: examples/custom_policy.cpp.
#include <algorithm>
#include <concepts>
#include <numeric>
#include <cstdint>
#include <optional>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

#include "sparsekv/attention/attention_partial.hpp"
#include "sparsekv/core/config.hpp"
#include "sparsekv/core/error.hpp"
#include "sparsekv/core/ids.hpp"
#include "sparsekv/partition/partition_spec.hpp"

namespace sparsekv {

// Where in the layer a policy's inputs are taken (Spin §4.2: ShadowKV and
// RetroInfer register after RoPE, SeerAttention-R before).
enum class RopeStage { pre_rope, post_rope };

// One (request, layer) as a policy sees it.
struct LayerContext {
  std::uint32_t layer = 0;
  std::uint32_t layers = 1;
  std::uint32_t q_heads = 0;
  std::uint32_t kv_heads = 0;
  std::uint32_t head_dim = 0;
  std::uint32_t page_tokens = 8;
  std::uint32_t tokens = 0;  // tokens in partitions (the decode tail excluded)
  // Index and fork_index only: the tokens the request may reach (its
  // max_tokens; 0: not known). A policy whose state grows by a partition a
  // saved page reserves it for them, so that no decode step reallocates it:
  // that copies every summary of the (request, layer), a stall that grows
  // with the context (docs/performance.md, "Summaries reserved at Index").
  std::uint32_t reserve_tokens = 0;
  // The dtype of the engine's K/V: the fp32 keys and values a policy sees are
  // exact widenings of it, so summaries that only pick among them (Quest's
  // boxes) can be stored in it without loss.
  DType kv_dtype = DType::f32;

  std::uint32_t group_size() const noexcept { return q_heads / kv_heads; }
  // Partitions a state of `partitions` now holds when the request reaches
  // reserve_tokens, each decode page one more (the tail's page included).
  std::uint32_t reserved_partitions(std::uint32_t partitions) const noexcept {
    const std::uint64_t growth =
        reserve_tokens > tokens ? (std::uint64_t{reserve_tokens} - tokens + page_tokens - 1) / page_tokens : 0;
    return static_cast<std::uint32_t>(std::min<std::uint64_t>(partitions + growth, UINT32_MAX));
  }
};

// K and V of `tokens` consecutive tokens of one layer, fp32, [token][kv_head][dim].
struct KvView {
  std::span<const float> keys;
  std::span<const float> values;
  std::uint32_t tokens = 0;
  std::uint32_t kv_heads = 0;
  std::uint32_t head_dim = 0;
  std::uint32_t first_position = 0;  // sequence position of token 0

  const float* key(std::uint32_t token, std::uint32_t head) const {
    return keys.data() + (std::size_t{token} * kv_heads + head) * head_dim;
  }
  const float* value(std::uint32_t token, std::uint32_t head) const {
    return values.data() + (std::size_t{token} * kv_heads + head) * head_dim;
  }
};

// A full decode page (`page.tokens == page_tokens`) that became a one-page
// partition in every kv head: partitions[h] is its id in kv head h.
struct AppendedPage {
  KvView page;
  std::vector<PartitionId> partitions;
};

// Ask the library to regroup, in every kv head h, the tokens of partitions
// [first_partitions[h], end) (in their page order: token i of that run is
// spec token i) into specs[h]'s partitions, which take ids first_partitions[h]
// onwards; e.g. RetroInfer clustering each new 1024-token decode segment (§4.2).
struct Repartition {
  std::vector<PartitionId> first_partitions;  // one per kv head
  std::vector<PartitionSpec> specs;           // one per kv head
};

// The query of one decode step: [q_heads][head_dim] fp32 at sequence `position`.
struct DecodeQuery {
  std::span<const float> q;
  std::uint32_t position = 0;

  const float* head(std::uint32_t h, std::uint32_t head_dim) const { return q.data() + std::size_t{h} * head_dim; }
};

struct Selection {
  std::vector<std::vector<PartitionId>> partitions;  // [kv_head] distinct ids

  void reset(std::uint32_t kv_heads) {
    partitions.resize(kv_heads);
    for (auto& p : partitions) p.clear();
  }
};

template <class P>
concept SparseAttention = requires(const P& policy, typename P::LayerState& state, const typename P::LayerState& cstate,
                                   const LayerContext& ctx, const KvView& kv, const AppendedPage& page,
                                   const DecodeQuery& q, Selection& selection) {
  typename P::Options;
  typename P::LayerState;
  { P::kName } -> std::convertible_to<std::string_view>;
  { P::kRope } -> std::convertible_to<RopeStage>;
  { policy.index(ctx, kv, state) } -> std::same_as<std::vector<PartitionSpec>>;
  { policy.append(ctx, page, state) } -> std::same_as<std::optional<Repartition>>;
  { policy.select(ctx, q, cstate, selection) } -> std::same_as<void>;
  { policy.mandatory_pages(ctx) } -> std::same_as<std::uint32_t>;
};

template <class P>
concept CustomAttend = SparseAttention<P> &&
    requires(const P& policy, const typename P::LayerState& state, const LayerContext& ctx, const DecodeQuery& q,
             const Selection& selection, std::span<AttentionPartial> extra) {
  { policy.attend(ctx, q, state, selection, extra) } -> std::same_as<void>;
};

template <class P>
concept SelectsByHead = SparseAttention<P> &&
    requires(const P& policy, const typename P::LayerState& state, const LayerContext& ctx, const DecodeQuery& q,
             std::uint32_t head, std::vector<PartitionId>& ids) {
  { policy.select_head(ctx, q, state, head, ids) } -> std::same_as<void>;
};

template <class P>
concept AttendsByHead = CustomAttend<P> &&
    requires(const P& policy, const typename P::LayerState& state, const LayerContext& ctx, const DecodeQuery& q,
             std::uint32_t head, std::span<const PartitionId> selected, std::span<AttentionPartial> extra) {
  { policy.attend_head(ctx, q, state, head, selected, extra) } -> std::same_as<void>;
};

// select() of a policy that selects by head: every kv head in turn.
template <class P>
void select_each_head(const P& policy, const LayerContext& ctx, const DecodeQuery& q,
                      const typename P::LayerState& state, Selection& out) {
  out.reset(ctx.kv_heads);
  for (std::uint32_t h = 0; h < ctx.kv_heads; ++h) policy.select_head(ctx, q, state, h, out.partitions[h]);
}

template <class P>
concept DeclaresHeadCapacity = SparseAttention<P> && requires(const P& policy, const LayerContext& ctx) {
  { policy.head_capacity(ctx) } -> std::same_as<HeadCapacity>;
};

template <class P>
concept ForksIndex = SparseAttention<P> &&
    requires(const P& policy, const typename P::LayerState& source, typename P::LayerState& state,
             const LayerContext& ctx, const KvView& kv) {
  { policy.reused_tokens(ctx, source) } -> std::same_as<std::uint32_t>;
  { policy.fork_index(ctx, source, kv, state) } -> std::same_as<std::vector<PartitionSpec>>;
};

// The calls a decode step makes on any policy, its optional parts answered
// here once; AnyPolicy overloads each (any_policy.hpp), so a step templated on
// the policy serves a static policy and one chosen at run time alike.
template <SparseAttention P>
typename P::LayerState make_layer_state(const P&) {
  return {};
}
template <SparseAttention P>
constexpr std::string_view policy_name(const P&) {
  return P::kName;
}
template <SparseAttention P>
constexpr bool has_custom_attend(const P&) {
  return CustomAttend<P>;
}
// Leaves `extra` untouched for a policy without CustomAttend.
template <SparseAttention P>
void custom_attend(const P& p, const LayerContext& ctx, const DecodeQuery& q, const typename P::LayerState& state,
                   const Selection& selection, std::span<AttentionPartial> extra) {
  if constexpr (CustomAttend<P>) p.attend(ctx, q, state, selection, extra);
}
template <SparseAttention P>
constexpr bool selects_by_head(const P&) {
  return SelectsByHead<P>;
}
// Only for a policy that selects_by_head (else nothing is written).
template <SparseAttention P>
void select_one_head(const P& p, const LayerContext& ctx, const DecodeQuery& q, const typename P::LayerState& state,
                     std::uint32_t head, std::vector<PartitionId>& ids) {
  if constexpr (SelectsByHead<P>) p.select_head(ctx, q, state, head, ids);
}
template <SparseAttention P>
constexpr bool attends_by_head(const P&) {
  return AttendsByHead<P>;
}
// Only for a policy that attends_by_head (else nothing is written).
template <SparseAttention P>
void attend_one_head(const P& p, const LayerContext& ctx, const DecodeQuery& q, const typename P::LayerState& state,
                     std::uint32_t head, std::span<const PartitionId> selected, std::span<AttentionPartial> extra) {
  if constexpr (AttendsByHead<P>) p.attend_head(ctx, q, state, head, selected, extra);
}
// Whether append() may return a Repartition (P::kRegroups, true unless declared).
template <SparseAttention P>
constexpr bool may_regroup(const P&) {
  if constexpr (requires { P::kRegroups; }) {
    return P::kRegroups;
  } else {
    return true;
  }
}
// Whether index() reads the prompt's V (P::kIndexReadsValues, true unless declared).
template <SparseAttention P>
constexpr bool index_reads_values(const P&) {
  if constexpr (requires { P::kIndexReadsValues; }) {
    return P::kIndexReadsValues;
  } else {
    return true;
  }
}
// A fork's Index (ForksIndex): whether the policy has the hook; what it takes
// from the source's state, 0 without the hook; and the Index itself, index()
// of kv (all ctx.tokens tokens, first_position 0) without it.
template <SparseAttention P>
constexpr bool forks_index(const P&) {
  return ForksIndex<P>;
}
template <SparseAttention P>
std::uint32_t reused_tokens(const P& p, const LayerContext& ctx, const typename P::LayerState& source) {
  if constexpr (ForksIndex<P>) {
    return p.reused_tokens(ctx, source);
  } else {
    return 0;
  }
}
template <SparseAttention P>
std::vector<PartitionSpec> fork_index(const P& p, const LayerContext& ctx, const typename P::LayerState& source,
                                      const KvView& kv, typename P::LayerState& state) {
  if constexpr (ForksIndex<P>) {
    return p.fork_index(ctx, source, kv, state);
  } else {
    return p.index(ctx, kv, state);
  }
}
// The policy's HeadCapacity, nullopt when it declares none.
template <SparseAttention P>
std::optional<HeadCapacity> declared_head_capacity(const P& p, const LayerContext& ctx) {
  if constexpr (DeclaresHeadCapacity<P>) {
    return p.head_capacity(ctx);
  } else {
    return std::nullopt;
  }
}

// Entry checks the policies share; `policy` names the policy in the message.
// All throw invalid_argument. check_kv_view checks the context too; values
// may be empty unless `needs_values`.
void check_layer_context(std::string_view policy, const LayerContext& ctx);
void check_kv_view(std::string_view policy, const LayerContext& ctx, const KvView& kv, bool needs_values);
void check_decode_query(std::string_view policy, const LayerContext& ctx, const DecodeQuery& q);
void check_head(std::string_view policy, const LayerContext& ctx, std::uint32_t head);
// A full page (page_tokens tokens, K and V) with one partition id per kv head.
void check_appended_page(std::string_view policy, const LayerContext& ctx, const AppendedPage& page, bool needs_values);

// Top-k helper the policies share: indices of the k largest scores, ties to
// the lower index, returned in descending score order.
std::vector<std::uint32_t> top_k(std::span<const float> scores, std::uint32_t k);

}  // namespace sparsekv
