#pragma once
// H2O, the Heavy-Hitter Oracle (Zhang et al. 2023; SpvLLM §4.2 and its
// ref. [9]): every token keeps the cumulative attention it has received;
// once the cache holds its budget, each decode step greedily evicts the live
// token with the lowest cumulative score among those older than the recent
// window, one token per step by default. A EvictsTokens policy
// (token_eviction.hpp) on the LiveTokenPolicy skeleton (live_token_policy.hpp),
// keeping the scores beside the live positions; docs/policies/h2o.md.
//
// Choices:
//  - Per (request, layer) and kv head, as the paper: scores and evictions are
//    per head, from the softmax probability each token gets at each step,
//    summed over the kv head's GQA group (the paper's models have one q
//    head per kv head). Scores add up in double, in the order steps arrive.
//  - The budget bounds the live tokens of a kv head once a step's token is
//    placed; the recent window is the `recent_tokens` newest positions at
//    that point (the placed token included), so budget == sink + recent
//    holds the bound. recent defaults to budget / 2: the paper splits its
//    cache evenly between heavy hitters and recent tokens.
//  - Optional attention sinks (`sink_tokens`, 0 = the paper) and the shared
//    prefix (EvictionContext::protected_prefix) are never evicted.
//  - Ties: the lower score goes first, then the older position.
//  - Prefill carries no query, so prompt tokens start at score 0 and a
//    prompt larger than the budget is cut down at the first decode step,
//    from that step's attention alone (catch-up eviction); the paper scores
//    the prompt with its own attention.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <optional>
#include <vector>

#include "sparsekv/core/error.hpp"
#include "sparsekv/policy/live_token_policy.hpp"
#include "sparsekv/policy/sparse_attention.hpp"
#include "sparsekv/policy/token_eviction.hpp"

namespace sparsekv {

class H2OPolicy : public LiveTokenPolicy<H2OPolicy> {
 public:
  struct Options {
    std::uint32_t budget_tokens = 2048;          // live tokens per kv head once a step's token is placed
    std::optional<std::uint32_t> recent_tokens;  // the recent window; unset: budget_tokens / 2
    std::uint32_t sink_tokens = 0;               // first positions never evicted (0: none, as the paper)
    std::uint32_t evict_per_step = 1;            // tokens evicted per step once over the budget (paper: 1)
  };
  struct LayerState {
    LiveTokens live;
    std::vector<std::vector<double>> scores;  // [kv head], parallel to live.positions
  };
  static constexpr std::string_view kName = "h2o";
  static constexpr bool kNeedsTokenWeights = true;

  H2OPolicy();
  explicit H2OPolicy(const Options& options)
      : options_(options), recent_(options.recent_tokens.value_or(options.budget_tokens / 2)) {
    // The sinks, the window and the placed token (in the window, or on its own
    // when the window is empty) are never evicted: the budget must hold them.
    const std::uint64_t kept = std::uint64_t{options.sink_tokens} + std::max<std::uint32_t>(recent_, 1);
    if (options.budget_tokens == 0 || options.budget_tokens < kept) {
      fail(ErrorCode::invalid_argument,
           "h2o: budget below protected window ({} budget tokens, {} sink + {} recent tokens, the newest "
           "included)",
           options.budget_tokens, options.sink_tokens, recent_);
    }
    if (options.evict_per_step == 0) fail(ErrorCode::invalid_argument, "h2o: evict_per_step must be > 0");
  }

  const Options& options() const noexcept { return options_; }
  std::uint32_t recent_tokens() const noexcept { return recent_; }

  // Adds each token's weight to its cumulative score. Every position must be
  // live in its kv head and listed once; weights finite and >= 0.
  void observe(const LayerContext& ctx, const TokenWeights& w, LayerState& state) const {
    check_state(ctx, state);
    if (w.heads.size() != ctx.kv_heads) {
      fail(ErrorCode::invalid_argument, "h2o: weights for {} kv heads, the layer has {}", w.heads.size(), ctx.kv_heads);
    }
    std::vector<std::vector<std::uint32_t>> at(ctx.kv_heads);
    for (std::uint32_t h = 0; h < ctx.kv_heads; ++h) {
      const auto& live = state.live.positions[h];
      std::vector<char> seen(live.size(), 0);
      for (const TokenWeight& tw : w.heads[h]) {
        const auto it = std::lower_bound(live.begin(), live.end(), tw.position);
        if (it == live.end() || *it != tw.position) {
          fail(ErrorCode::invalid_argument, "h2o: weight for position {}, which is not live in kv head {}", tw.position,
               h);
        }
        const auto i = static_cast<std::uint32_t>(it - live.begin());
        if (seen[i]) fail(ErrorCode::invalid_argument, "h2o: position {} weighed twice in kv head {}", tw.position, h);
        if (!(std::isfinite(tw.weight) && tw.weight >= 0.0f)) {
          fail(ErrorCode::invalid_argument, "h2o: weight {} of position {} in kv head {} is not a probability",
               tw.weight, tw.position, h);
        }
        seen[i] = 1;
        at[h].push_back(i);
      }
    }
    for (std::uint32_t h = 0; h < ctx.kv_heads; ++h) {
      for (std::size_t j = 0; j < at[h].size(); ++j) state.scores[h][at[h][j]] += w.heads[h][j].weight;
    }
  }

  // Per kv head: once placing the next token would exceed the budget, the
  // max(evict_per_step, live + 1 - budget) lowest-scoring evictable tokens.
  void evict(const LayerContext& ctx, const EvictionContext& e, LayerState& state, Eviction& out) const {
    check_state(ctx, state);
    state.live.check_eviction(kName, ctx, e);
    Eviction next;
    next.reset(ctx.kv_heads);
    std::vector<std::vector<std::uint32_t>> drop(ctx.kv_heads);  // indices into positions[h], ascending
    for (std::uint32_t h = 0; h < ctx.kv_heads; ++h) {
      const auto& live = state.live.positions[h];
      const auto& score = state.scores[h];
      const auto [first, end] = state.live.evictable(e, h, options_.sink_tokens, recent_);
      const std::size_t count =
          LiveTokens::eviction_count(live.size(), end - first, options_.budget_tokens, options_.evict_per_step);
      std::vector<std::uint32_t> order(end - first);
      std::iota(order.begin(), order.end(), static_cast<std::uint32_t>(first));
      // Positions ascend with the index, so the lower index is the older token.
      const auto evicted_first = [&](std::uint32_t a, std::uint32_t b) {
        return score[a] < score[b] || (score[a] == score[b] && a < b);
      };
      std::partial_sort(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(count), order.end(), evicted_first);
      order.resize(count);
      std::sort(order.begin(), order.end());
      for (const std::uint32_t i : order) next.positions[h].push_back(live[i]);
      drop[h] = std::move(order);
    }
    for (std::uint32_t h = 0; h < ctx.kv_heads; ++h) {
      erase_indices(state.live.positions[h], drop[h]);
      erase_indices(state.scores[h], drop[h]);
    }
    out = std::move(next);
  }

 private:
  friend class LiveTokenPolicy<H2OPolicy>;
  // Every live token starts at score 0: a prompt's and a fork's (prefill carries no query) and a placed one.
  static void start(const LayerContext& ctx, std::uint32_t tokens, LayerState& state) {
    state.scores.assign(ctx.kv_heads, std::vector<double>(tokens, 0.0));
  }
  static void on_placed(LayerState& state) {
    for (auto& s : state.scores) s.push_back(0.0);
  }
  static void check_state(const LayerContext& ctx, const LayerState& state) {
    check_layer_context(kName, ctx);
    bool ok = state.scores.size() == ctx.kv_heads && state.live.positions.size() == ctx.kv_heads;
    for (std::uint32_t h = 0; ok && h < ctx.kv_heads; ++h) {
      ok = state.scores[h].size() == state.live.positions[h].size();
    }
    if (!ok) fail(ErrorCode::invalid_argument, "h2o: layer state was not indexed for {} kv heads", ctx.kv_heads);
  }
  // Removes the elements at `indices` (ascending) from v, keeping the order.
  template <class T>
  static void erase_indices(std::vector<T>& v, const std::vector<std::uint32_t>& indices) {
    std::size_t kept = 0;
    std::size_t next = 0;
    for (std::size_t i = 0; i < v.size(); ++i) {
      if (next < indices.size() && indices[next] == i) {
        ++next;
        continue;
      }
      v[kept++] = v[i];
    }
    v.resize(kept);
  }

  Options options_;
  std::uint32_t recent_ = 0;
};

// Out of the class: Options' member initialisers are not usable inside it (GCC).
inline H2OPolicy::H2OPolicy() : H2OPolicy(Options{}) {}

}  // namespace sparsekv
