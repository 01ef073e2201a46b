#pragma once
// Quest (Tang et al., ICML 2024; a block-summary policy in Spin §2.2 / §4.1):
// Index keeps, per partition and kv head, the element-wise min and max of the
// partition's post-RoPE keys. Select scores each partition from that key box
// and keeps the partitions with the highest scores, the newest one always.
// The paper's score is the bound on the largest logit q.k any key of the box
// can reach, sum_d max(q_d min_d, q_d max_d); here it is one end of
// quest_logit's `spread` (select_rules.hpp). The min / max fold is the rule
// in summary_rules.hpp; sparsekv::cuda::page_min_max (index_cuda.hpp)
// computes the same boxes on the GPU. The score, ranking and fill are
// select_rules.hpp's; sparsekv::cuda::quest_select (select_cuda.hpp) selects
// the same partitions on the GPU.
//
// Choices (docs/policies/quest.md):
//  - A partition is one Quest page: by default one KV page (the paper's page
//    is its KV cache's page, 16 tokens there), or `page_tokens_per_partition`
//    tokens, a whole number of KV pages; the last prefill partition may be
//    short. The library appends each full decode page as its own one-page
//    partition, so decode pages get their own min/max instead of widening the
//    bounds of a 16-token Quest page.
//  - The score: per q head, q . centre of the box plus `spread` times
//    sum_d |q_d| half-width_d, scaled by 1/sqrt(d). spread = 1 is the paper's
//    bound; the default 0.5, measured on SmolLM2 at 6K tokens, halves the
//    reach the bound grants a box for its width: the bound ranks wide boxes
//    (pages of diverse keys) above pages whose keys are close to q, and in
//    perplexity that costs more than the needles it catches.
//  - GQA (the paper is silent: its models have one q head per kv head): one
//    selection serves a kv head's whole group, so a partition's rank is the
//    sum over the group's q heads of its softmax over the partitions' scores
//    (RetroInfer's GQA rank): each head votes with the same weight, where a
//    sum of raw bounds lets the heads with the largest |q| decide.
//  - A steady zone before the ranking (quest_steady in select_rules.hpp): the
//    newest partition, the attention sink (the partition holding the first
//    `sink_tokens` tokens) and a recent window of `recent_fraction` of the
//    budget. The paper has neither sink nor window; on SmolLM2 at 6K tokens
//    the bound ranks the sink page low in the layers where it holds half the
//    softmax mass, and the output error of those layers triples
//    (docs/policies/quest.md, "Sink and window"). sink_tokens = 0,
//    recent_fraction = 0 and spread = 1 give the paper's Quest.
//  - budget_tokens counts every selected token, the steady zone included;
//    then partitions in descending rank are taken while they fit (a budget
//    below one partition still gets the newest); the smaller decode
//    partitions let more fit.
//  - Layers below `dense_layers` (paper: 2) select everything, so their
//    mandatory_pages is the whole context: those layers need the whole
//    context in the GPU buffer.
//  - The boxes are stored in the K/V's dtype (LayerContext::kv_dtype;
//    policy/box_rows.hpp): exact for keys of that dtype, as the facade's
//    are, and half the bytes of fp32 for f16 / bf16 models.
#include <algorithm>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "sparsekv/core/error.hpp"
#include "sparsekv/policy/block_summary_policy.hpp"
#include "sparsekv/policy/box_rows.hpp"
#include "sparsekv/policy/device_select.hpp"
#include "sparsekv/policy/summary_rules.hpp"
#include "sparsekv/policy/select_rules.hpp"
#include "sparsekv/policy/select_scoring.hpp"
#include "sparsekv/policy/sparse_attention.hpp"
#include "sparsekv/policy/token_eviction.hpp"

namespace sparsekv {

class QuestPolicy : public BlockSummaryPolicy<QuestPolicy> {
 public:
  struct Options {
    std::uint32_t budget_tokens = 2048;           // per kv head per step, newest partition included
    std::uint32_t page_tokens_per_partition = 0;  // Quest's page; 0: one KV page, else a multiple of it
    std::uint32_t dense_layers = 2;               // Quest keeps the first two layers dense
    std::uint32_t sink_tokens = 4;                // StreamingLLM's 4 attention sinks (0: none, as the paper)
    float recent_fraction = 0.25f;                // of the budget, the recent window (0: the newest partition only)
    float spread = 0.5f;                          // weight of the box's half-width in the score (1: the paper's bound)
  };
  struct LayerState {
    std::uint32_t head_dim = 0;
    std::vector<std::uint32_t> tokens;          // per partition, the same in every kv head
    std::vector<std::vector<PartitionId>> ids;  // [kv head][partition]
    std::vector<BoxRows> min, max;              // [kv head], a row per partition
  };
  static constexpr std::string_view kName = "quest";

  QuestPolicy() : QuestPolicy(Options{}) {}  // not `= {}`: GCC rejects nested defaults there
  explicit QuestPolicy(const Options& options) : options_(options) {
    if (options.budget_tokens == 0) fail(ErrorCode::invalid_argument, "quest: budget_tokens must be > 0");
    if (!(options.recent_fraction >= 0.0f && options.recent_fraction <= 1.0f)) {
      fail(ErrorCode::invalid_argument, "quest: recent_fraction {} is not in [0, 1]", options.recent_fraction);
    }
    if (!(options.spread >= 0.0f && options.spread <= 1.0f)) {
      fail(ErrorCode::invalid_argument, "quest: spread {} is not in [0, 1]", options.spread);
    }
  }

  const Options& options() const noexcept { return options_; }
  // Tokens per Quest page with `ctx`'s KV pages.
  std::uint32_t partition_tokens(const LayerContext& ctx) const noexcept {
    return options_.page_tokens_per_partition != 0 ? options_.page_tokens_per_partition : ctx.page_tokens;
  }
  // The recent window beyond the newest partition, in tokens.
  std::uint32_t window_tokens() const noexcept {
    return static_cast<std::uint32_t>(static_cast<double>(options_.budget_tokens) * options_.recent_fraction);
  }

  void select_head(const LayerContext& ctx, const DecodeQuery& q, const LayerState& state, std::uint32_t h,
                   std::vector<PartitionId>& chosen) const {
    check_state(ctx, state);
    const bool dense_layer = ctx.layer < options_.dense_layers;
    if (select_all_within_budget(kName, ctx, q, state, h, options_.budget_tokens, dense_layer, chosen)) return;
    const auto n = static_cast<std::uint32_t>(state.tokens.size());
    const std::uint32_t group = ctx.group_size();
    const std::uint32_t newest = n - 1;
    const float scale = logit_scale(ctx.head_dim);
    std::vector<float> logits(std::size_t{group} * newest), rank(n, 0.0f);
    // The rules cuda::quest_select shares (select_rules.hpp): every head's
    // logits in one pass over the boxes (vectorized, the same bits:
    // select_scoring.hpp), then each head's softmax rank.
    quest_logits_simd(q.head(h * group, ctx.head_dim), group, state.min[h].data(), state.max[h].data(),
                      state.min[h].dtype(), newest, ctx.head_dim, options_.spread, scale, logits.data());
    for (std::uint32_t g = 0; g < group; ++g) {
      softmax_rank_add_simd(newest, logits.data() + std::size_t{g} * newest, rank.data());
    }
    const QuestSteady steady = quest_steady(
        n, [&](std::uint32_t i) { return state.tokens[i]; }, options_.budget_tokens, options_.sink_tokens,
        window_tokens());
    for (std::uint32_t i = 0; i < steady.sinks; ++i) chosen.push_back(state.ids[h][i]);
    for (std::uint32_t i = steady.window_first; i < n; ++i) chosen.push_back(state.ids[h][i]);
    SkipFill fill{steady.left};
    ranked_fill(
        newest, fill, [&](std::uint32_t i) { return rank[i]; },
        [&](std::uint32_t i) { return i >= steady.sinks && i < steady.window_first; },
        [&](std::uint32_t i) { return state.tokens[i]; }, [&](std::uint32_t i) { chosen.push_back(state.ids[h][i]); });
    std::sort(chosen.begin(), chosen.end());
  }

  // After evictions or a slot rewrite (RewritesSummaries): the partition's box
  // in kv head page.head becomes the box of its live rows alone, so it
  // shrinks when an extreme key died. Its token count stays the partition's
  // (the budget goes on counting its slots).
  void rewrite(const LayerContext& ctx, const RewrittenPage& page, LayerState& state) const {
    check_state(ctx, state);
    const std::uint32_t i = rewritten_partition(kName, ctx, page, state);
    std::vector<float> box(2 * std::size_t{ctx.head_dim});
    bound(box.data(), box.data() + ctx.head_dim, page.live_rows, 0, 0, page.live_rows.tokens);
    state.min[page.head].set(i, box.data(), BoxSide::lower);
    state.max[page.head].set(i, box.data() + ctx.head_dim, BoxSide::upper);
  }

  // A selection covers at most max(budget, one partition) tokens, and since
  // only one partition (the last prefill one) can end in a partial page, that
  // is at most ceil(tokens / page_tokens) pages; never more than the context
  // (one page more than its tokens fill, as Dense). Dense layers: the context.
  std::uint32_t mandatory_pages(const LayerContext& ctx) const {
    check_context(ctx);
    const std::uint64_t pt = ctx.page_tokens;
    const std::uint64_t context = (std::uint64_t{ctx.tokens} + pt - 1) / pt + 1;
    if (ctx.layer < options_.dense_layers) return static_cast<std::uint32_t>(context);
    const std::uint64_t most = std::max(options_.budget_tokens, partition_tokens(ctx));
    return static_cast<std::uint32_t>(std::min(context, (most + pt - 1) / pt));
  }

 private:
  friend class BlockSummaryPolicy<QuestPolicy>;

  // A state's boxes, one per kv head in the K/V dtype, reserved for `partitions`.
  static void prepare(const LayerContext& ctx, LayerState& s, std::uint32_t partitions) {
    s.min.assign(ctx.kv_heads, BoxRows(ctx.kv_dtype, ctx.head_dim));
    s.max.assign(ctx.kv_heads, BoxRows(ctx.kv_dtype, ctx.head_dim));
    for (std::uint32_t h = 0; h < ctx.kv_heads; ++h) {
      s.min[h].reserve(partitions);
      s.max[h].reserve(partitions);
    }
  }
  static void copy_summaries(const LayerContext& ctx, const LayerState& from, LayerState& to,
                             std::uint32_t partitions) {
    for (std::uint32_t h = 0; h < ctx.kv_heads; ++h) {
      to.min[h].assign_prefix(from.min[h], partitions);
      to.max[h].assign_prefix(from.max[h], partitions);
    }
  }
  void check_context(const LayerContext& ctx) const {
    check_layer_context(kName, ctx);
    if (partition_tokens(ctx) % ctx.page_tokens != 0) {
      fail(ErrorCode::invalid_argument, "quest: page_tokens_per_partition {} is not a multiple of the {}-token page",
           options_.page_tokens_per_partition, ctx.page_tokens);
    }
  }
  static void summarize(LayerState& state, std::uint32_t h, const KvView& kv, std::uint32_t first,
                        std::uint32_t count) {
    const std::uint32_t dim = kv.head_dim;
    std::vector<float> box(2 * std::size_t{dim});
    bound(box.data(), box.data() + dim, kv, h, first, count);
    state.min[h].push_back(box.data(), BoxSide::lower);
    state.max[h].push_back(box.data() + dim, BoxSide::upper);
  }
  // The box of tokens [first, first + count) of kv head h of kv, written to
  // lo / hi: the first key folded with the rest, the rule cuda::page_min_max
  // shares (summary_rules.hpp).
  static void bound(float* lo, float* hi, const KvView& kv, std::uint32_t h, std::uint32_t first, std::uint32_t count) {
    const std::uint32_t dim = kv.head_dim;
    const float* k = kv.key(first, h);
    std::copy(k, k + dim, lo);
    std::copy(k, k + dim, hi);
    for (std::uint32_t t = first + 1; t < first + count; ++t) fold_min_max(lo, hi, kv.key(t, h), dim);
  }

  Options options_;
};

// Quest's device Select (policy/device_select.hpp): cuda::quest_select over
// the min / max summaries kept on the device, equal to select() bit for bit.
// Its decode partitions are single pages (its append), so its prompt
// partitions must be too for one summary per partition on the device; a
// coarser page_tokens_per_partition keeps it on the host-tensor API.
struct QuestDeviceSelect {
  using Policy = QuestPolicy;
  static constexpr cuda::AppendSummary summary = cuda::AppendSummary::quest;
  std::uint32_t budget_tokens = 0;
  bool dense_layer = false;         // a layer below dense_layers selects everything
  std::uint32_t sink_tokens = 0;    // the steady zone's sink ...
  std::uint32_t window_tokens = 0;  // ... and recent window (QuestPolicy::window_tokens())
  float spread = 1.0f;              // the score's spread (Options::spread)

  std::uint32_t capacity(std::uint32_t max_partitions, std::uint32_t) const {
    return cuda::select_capacity(max_partitions, budget_tokens, dense_layer, 0);
  }
};
inline std::optional<QuestDeviceSelect> device_select_spec(const QuestPolicy& p, const LayerContext& ctx) {
  if (p.partition_tokens(ctx) != ctx.page_tokens) return std::nullopt;
  return QuestDeviceSelect{p.options().budget_tokens, ctx.layer < p.options().dense_layers, p.options().sink_tokens,
                           p.window_tokens(), p.options().spread};
}

}  // namespace sparsekv
