#pragma once
// Oracle: the best page selection of a given size, for measuring the others.
// It keeps every post-RoPE key and, per step and kv head, ranks
// the KV pages by the dense softmax mass the GQA group's queries put on them
// (each q head's softmax over the whole selectable context, summed over the
// group), then takes pages in descending mass while the token budget lasts.
// No real policy can beat it at page granularity with a per-kv-head
// selection, so its row in docs/results.md is the bound a selection policy
// can reach at that budget. Host only, and as costly as dense attention: an
// evaluation tool, not a serving policy. See docs/policies/oracle.md.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <optional>
#include <vector>

#include "sparsekv/core/error.hpp"
#include "sparsekv/policy/block_summary_policy.hpp"
#include "sparsekv/policy/select_rules.hpp"
#include "sparsekv/policy/sparse_attention.hpp"

namespace sparsekv {

class OraclePolicy : public BlockSummaryPolicy<OraclePolicy> {
 public:
  struct Options {
    std::uint32_t budget_tokens = 2048;  // per kv head per step
  };
  struct LayerState {
    std::uint32_t head_dim = 0;
    std::vector<std::uint32_t> tokens;          // per partition (one KV page), the same in every kv head
    std::vector<std::vector<PartitionId>> ids;  // [kv head][partition]
    std::vector<std::vector<float>> keys;       // [kv head][token * head_dim + d], in partition order
  };
  static constexpr std::string_view kName = "oracle";

  OraclePolicy() : OraclePolicy(Options{}) {}
  explicit OraclePolicy(const Options& options) : options_(options) {
    if (options.budget_tokens == 0) fail(ErrorCode::invalid_argument, "oracle: budget_tokens must be > 0");
  }

  const Options& options() const noexcept { return options_; }

  void select_head(const LayerContext& ctx, const DecodeQuery& q, const LayerState& state, std::uint32_t h,
                   std::vector<PartitionId>& chosen) const {
    check_state(ctx, state);
    if (select_all_within_budget(kName, ctx, q, state, h, options_.budget_tokens, false, chosen)) return;
    const auto n = static_cast<std::uint32_t>(state.tokens.size());
    const std::uint64_t total = std::accumulate(state.tokens.begin(), state.tokens.end(), std::uint64_t{0});
    const std::uint32_t group = ctx.group_size(), d = ctx.head_dim;
    const double scale = 1.0 / std::sqrt(double(d));
    std::vector<double> logits(total);
    std::vector<float> mass(n);
    std::vector<double> page_mass(n, 0.0);
    const float* keys = state.keys[h].data();
    for (std::uint32_t g = 0; g < group; ++g) {
      const float* qh = q.head(h * group + g, d);
      double top = -INFINITY;
      for (std::uint64_t t = 0; t < total; ++t) {
        double dot = 0;
        for (std::uint32_t i = 0; i < d; ++i) dot += double(qh[i]) * keys[t * d + i];
        logits[t] = dot * scale;
        top = std::max(top, logits[t]);
      }
      double sum = 0;
      for (std::uint64_t t = 0; t < total; ++t) sum += (logits[t] = std::exp(logits[t] - top));
      std::uint64_t t = 0;
      for (std::uint32_t p = 0; p < n; ++p) {
        for (std::uint32_t end = static_cast<std::uint32_t>(t) + state.tokens[p]; t < end; ++t) {
          page_mass[p] += logits[t] / sum;
        }
      }
    }
    for (std::uint32_t p = 0; p < n; ++p) mass[p] = static_cast<float>(page_mass[p]);
    SkipFill fill{std::int64_t{options_.budget_tokens}};
    ranked_fill(
        n, fill, [&](std::uint32_t p) { return mass[p]; }, [](std::uint32_t) { return true; },
        [&](std::uint32_t p) { return state.tokens[p]; }, [&](std::uint32_t p) { chosen.push_back(state.ids[h][p]); });
    std::sort(chosen.begin(), chosen.end());
  }

  // At most the budget's tokens in pages all full but the prompt's last:
  // ceil(budget / page_tokens), never more than the context can fill.
  std::uint32_t mandatory_pages(const LayerContext& ctx) const {
    check_layer_context(kName, ctx);
    const std::uint64_t pt = ctx.page_tokens;
    const std::uint64_t context = (std::uint64_t{ctx.tokens} + pt - 1) / pt + 1;
    return static_cast<std::uint32_t>(std::min((std::uint64_t{options_.budget_tokens} + pt - 1) / pt, context));
  }

 private:
  friend class BlockSummaryPolicy<OraclePolicy>;

  // One partition per KV page.
  static std::uint32_t partition_tokens(const LayerContext& ctx) noexcept { return ctx.page_tokens; }
  static void check_context(const LayerContext& ctx) { check_layer_context(kName, ctx); }
  // A state's key arrays, one per kv head, reserved for `partitions` pages.
  static void prepare(const LayerContext& ctx, LayerState& s, std::uint32_t partitions) {
    s.keys.resize(ctx.kv_heads);
    for (auto& keys : s.keys) keys.reserve(std::size_t{partitions} * ctx.page_tokens * ctx.head_dim);
  }
  static void copy_summaries(const LayerContext& ctx, const LayerState& from, LayerState& to,
                             std::uint32_t partitions) {
    const std::size_t values = std::size_t{partitions} * ctx.page_tokens * ctx.head_dim;
    for (std::uint32_t h = 0; h < ctx.kv_heads; ++h)
      to.keys[h].assign(from.keys[h].begin(), from.keys[h].begin() + values);
  }
  static void summarize(LayerState& state, std::uint32_t h, const KvView& kv, std::uint32_t first,
                        std::uint32_t count) {
    for (std::uint32_t t = first; t < first + count; ++t) {
      const float* k = kv.key(t, h);
      state.keys[h].insert(state.keys[h].end(), k, k + kv.head_dim);
    }
  }

  Options options_;
};

}  // namespace sparsekv
