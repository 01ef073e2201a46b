#pragma once
// ShadowKV-style selection (Sun et al., 2024; Spin §4.2, Fig. 4, Table 3):
// one 8-token page per partition. Index mean-pools each page's post-RoPE keys
// into a landmark and scores how well the landmark stands for its keys (the
// lowest cosine similarity between a key and the landmark). Select keeps the
// static pages resident -- the recent window and the outlier pages, whose
// landmark represents them worst -- and spends the rest of the budget on the
// top-k pages by softmax(q . landmark / sqrt(head_dim)), max over the q heads
// of each GQA group.
//
// Choices (docs/policies/shadowkv.md):
//  - budget_tokens counts every selected token: the recent window first (with
//    recent_tokens > 0 it always includes the newest page, even over a tiny
//    budget), then outliers, then top-k, each taking pages while they fit.
//  - The paper keeps 48 outlier pages at a 2048-token budget; we scale that to
//    round(outlier_pages * budget_tokens / 2048) so the static share of the
//    budget stays the same at every budget.
//  - Outliers are the lowest-scoring pages outside the current recent window,
//    decode pages included (each gets its landmark and score on append), so a
//    page that leaves the window competes like any other.
//  - The softmax runs over the non-static pages, per q head; taking the max over
//    the group lets each q head bring in the pages it needs, on a common scale.
//  - The landmark and outlier score follow summary_rules.hpp;
//    sparsekv::cuda::page_mean_outlier (index_cuda.hpp) computes them on the GPU.
//  - Select follows select_rules.hpp (portable exp, lane-ordered softmax sum);
//    sparsekv::cuda::shadowkv_select (select_cuda.hpp) selects the same pages.
//  - Out of scope: ShadowKV's low-rank (SVD) pre-RoPE key cache and its value
//    offload; here K and V both live in pages and the landmarks are exact means.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

#include "sparsekv/core/error.hpp"
#include "sparsekv/policy/block_summary_policy.hpp"
#include "sparsekv/policy/device_select.hpp"
#include "sparsekv/policy/summary_rules.hpp"
#include "sparsekv/policy/select_rules.hpp"
#include "sparsekv/policy/select_scoring.hpp"
#include "sparsekv/policy/sparse_attention.hpp"
#include "sparsekv/policy/token_eviction.hpp"

namespace sparsekv {

class ShadowKVPolicy : public BlockSummaryPolicy<ShadowKVPolicy> {
 public:
  struct Options {
    std::uint32_t budget_tokens = 2048;  // recent window + outliers + top-k, per kv head per step
    std::uint32_t recent_tokens = 32;    // ShadowKV's local window
    std::uint32_t outlier_pages = 48;    // at a 2048-token budget; scaled with the budget (outlier_count())
  };
  struct LayerState {
    std::uint32_t head_dim = 0;
    std::vector<std::uint32_t> tokens;              // per partition (one page), the same in every kv head
    std::vector<std::vector<PartitionId>> ids;      // [kv head][partition]
    std::vector<std::vector<float>> landmarks;      // [kv head][partition * head_dim + d]: mean key
    std::vector<std::vector<float>> outlier_score;  // [kv head][partition]: min over keys of cos(key, landmark)
  };
  static constexpr std::string_view kName = "shadowkv";

  ShadowKVPolicy() : ShadowKVPolicy(Options{}) {}  // not `= {}`: GCC rejects nested defaults there
  explicit ShadowKVPolicy(const Options& options) : options_(options) {
    if (options.budget_tokens == 0) fail(ErrorCode::invalid_argument, "shadowkv: budget_tokens must be > 0");
    outliers_ =
        static_cast<std::uint32_t>((std::uint64_t{options.outlier_pages} * options.budget_tokens + 1024) / 2048);
  }

  const Options& options() const noexcept { return options_; }
  // Outlier pages per step: round(outlier_pages * budget_tokens / 2048).
  std::uint32_t outlier_count() const noexcept { return outliers_; }

  void select_head(const LayerContext& ctx, const DecodeQuery& q, const LayerState& state, std::uint32_t h,
                   std::vector<PartitionId>& chosen) const {
    check_state(ctx, state);
    if (select_all_within_budget(kName, ctx, q, state, h, options_.budget_tokens, false, chosen)) return;
    const auto n = static_cast<std::uint32_t>(state.tokens.size());
    const std::uint32_t group = ctx.group_size();
    const float scale = logit_scale(ctx.head_dim);
    std::vector<char> taken(n, 0);
    std::vector<float> scores(n, -std::numeric_limits<float>::infinity()), shares(n), logits(std::size_t{group} * n);
    // The rules cuda::shadowkv_select shares (select_rules.hpp).
    const auto tokens = [&](std::uint32_t i) { return state.tokens[i]; };
    const auto untaken = [&](std::uint32_t i) { return taken[i] == 0; };
    const auto take = [&](std::uint32_t i) {
      taken[i] = 1;
      chosen.push_back(state.ids[h][i]);
    };
    // 1. The recent window: the newest pages covering recent_tokens tokens.
    const ShadowKVWindow window = shadowkv_window(n, tokens, options_.recent_tokens, options_.budget_tokens);
    for (std::uint32_t i = n - window.pages; i < n; ++i) take(i);
    // 2. Outliers: the lowest min-cosine among the rest.
    SkipFill outliers{window.left, outliers_};
    ranked_fill(
        n, outliers, [&](std::uint32_t i) { return -state.outlier_score[h][i]; }, untaken, tokens, take);
    // 3. Top-k: per q head, softmax over the non-static pages; max over the
    //    group (shadowkv_head_scores). Every head's logits in one pass over
    //    the landmarks, and each head's softmax, vectorized with the same
    //    bits (select_scoring.hpp).
    shadowkv_logits_simd(q.head(h * group, ctx.head_dim), group, state.landmarks[h].data(), n, ctx.head_dim, scale,
                         logits.data());
    for (std::uint32_t g = 0; g < group; ++g) {
      shadowkv_head_scores_simd(n, logits.data() + std::size_t{g} * n, taken.data(), shares.data(), scores.data());
    }
    SkipFill top_k{outliers.left};
    ranked_fill(
        n, top_k, [&](std::uint32_t i) { return scores[i]; }, untaken, tokens, take);
    std::sort(chosen.begin(), chosen.end());
  }

  // After evictions or a slot rewrite (RewritesSummaries): the partition's
  // landmark and outlier score in kv head page.head become those of its live
  // rows alone. Its token count stays the partition's (the budget goes on
  // counting its slots).
  void rewrite(const LayerContext& ctx, const RewrittenPage& page, LayerState& state) const {
    check_state(ctx, state);
    const std::uint32_t i = rewritten_partition(kName, ctx, page, state);
    float* mean = state.landmarks[page.head].data() + std::size_t{i} * ctx.head_dim;
    std::fill(mean, mean + ctx.head_dim, 0.0f);
    state.outlier_score[page.head][i] = landmark(mean, page.live_rows, 0, 0, page.live_rows.tokens);
  }

  // A selection covers at most max(budget, one page) tokens and only the last
  // prefill page can be partial, so at most ceil(tokens / page_tokens) pages;
  // never more than the context (one page more than its tokens fill, as Dense).
  std::uint32_t mandatory_pages(const LayerContext& ctx) const {
    check_layer_context(kName, ctx);
    const std::uint64_t pt = ctx.page_tokens;
    const std::uint64_t context = (std::uint64_t{ctx.tokens} + pt - 1) / pt + 1;
    const std::uint64_t most = std::max(options_.budget_tokens, ctx.page_tokens);
    return static_cast<std::uint32_t>(std::min(context, (most + pt - 1) / pt));
  }

 private:
  friend class BlockSummaryPolicy<ShadowKVPolicy>;

  // One partition per KV page.
  static std::uint32_t partition_tokens(const LayerContext& ctx) noexcept { return ctx.page_tokens; }
  static void check_context(const LayerContext& ctx) { check_layer_context(kName, ctx); }
  // A state's landmark and outlier arrays, one per kv head, reserved for `partitions`.
  static void prepare(const LayerContext& ctx, LayerState& s, std::uint32_t partitions) {
    s.landmarks.resize(ctx.kv_heads);
    s.outlier_score.resize(ctx.kv_heads);
    for (std::uint32_t h = 0; h < ctx.kv_heads; ++h) {
      s.landmarks[h].reserve(std::size_t{partitions} * ctx.head_dim);
      s.outlier_score[h].reserve(partitions);
    }
  }
  static void copy_summaries(const LayerContext& ctx, const LayerState& from, LayerState& to,
                             std::uint32_t partitions) {
    for (std::uint32_t h = 0; h < ctx.kv_heads; ++h) {
      to.landmarks[h].assign(from.landmarks[h].begin(),
                             from.landmarks[h].begin() + std::size_t{partitions} * ctx.head_dim);
      to.outlier_score[h].assign(from.outlier_score[h].begin(), from.outlier_score[h].begin() + partitions);
    }
  }
  // Appends the landmark and outlier score of tokens [first, first + count) of
  // kv head h.
  static void summarize(LayerState& state, std::uint32_t h, const KvView& kv, std::uint32_t first,
                        std::uint32_t count) {
    auto& landmarks = state.landmarks[h];
    landmarks.resize(landmarks.size() + kv.head_dim, 0.0f);
    state.outlier_score[h].push_back(landmark(landmarks.data() + landmarks.size() - kv.head_dim, kv, h, first, count));
  }
  // Writes the landmark of tokens [first, first + count) of kv head h of kv
  // to `mean` (zeroed by the caller) and returns their outlier score, by the
  // rules cuda::page_mean_outlier shares (summary_rules.hpp).
  static float landmark(float* mean, const KvView& kv, std::uint32_t h, std::uint32_t first, std::uint32_t count) {
    const std::uint32_t dim = kv.head_dim;
    for (std::uint32_t t = first; t < first + count; ++t) {
      for (std::uint32_t d = 0; d < dim; ++d) mean[d] = add_rn(mean[d], kv.key(t, h)[d]);
    }
    for (std::uint32_t d = 0; d < dim; ++d) mean[d] = page_mean(mean[d], count);
    const float mean_norm = sqrt_rn(dot_in_order(mean, mean, dim));
    float lowest = kOutlierScoreStart;
    for (std::uint32_t t = first; t < first + count; ++t) {
      const float* k = kv.key(t, h);
      lowest = fold_min(lowest, landmark_cosine(dot_in_order(k, k, dim), dot_in_order(k, mean, dim), mean_norm));
    }
    return lowest;
  }

  Options options_;
  std::uint32_t outliers_ = 0;
};

// ShadowKV's device Select (policy/device_select.hpp): cuda::shadowkv_select
// over the landmarks and outlier scores kept on the device.
struct ShadowKVDeviceSelect {
  using Policy = ShadowKVPolicy;
  static constexpr cuda::AppendSummary summary = cuda::AppendSummary::shadowkv;
  std::uint32_t budget_tokens = 0;
  std::uint32_t recent_tokens = 0;
  std::uint32_t outlier_pages = 0;  // outlier_count()

  std::uint32_t capacity(std::uint32_t max_partitions, std::uint32_t) const {
    return cuda::select_capacity(max_partitions, budget_tokens, false, 0);
  }
};
inline ShadowKVDeviceSelect device_select_spec(const ShadowKVPolicy& p, const LayerContext&) {
  return {p.options().budget_tokens, p.options().recent_tokens, p.outlier_count()};
}

}  // namespace sparsekv
