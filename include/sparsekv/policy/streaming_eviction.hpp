#pragma once
// StreamingLLM eviction (Xiao et al. 2023; SpvLLM §4.2 and its ref. [8]): the
// cache keeps the first `sink_tokens` tokens (attention sinks) and a rolling
// window of the newest tokens; each decode step evicts the token that leaves
// the window. A EvictsTokens policy (token_eviction.hpp) on the
// LiveTokenPolicy skeleton (live_token_policy.hpp) that needs no attention
// weights; docs/policies/streaming_evict.md. The static-selection
// form over a full cache is StreamingWindowPolicy (streaming_window.hpp).
//
// Choices:
//  - The budget bounds the live tokens of a kv head once a step's token is
//    placed: the sinks plus a window of budget - sink_tokens, the placed
//    token included.
//  - A prompt larger than the budget is cut down at prefill: the Manager
//    calls evict right after index (no attention is needed to choose).
//  - The shared prefix (EvictionContext::protected_prefix) is never
//    evicted; the oldest tokens after it go first.
#include <cstdint>
#include <utility>
#include <vector>

#include "sparsekv/core/error.hpp"
#include "sparsekv/policy/live_token_policy.hpp"
#include "sparsekv/policy/sparse_attention.hpp"
#include "sparsekv/policy/token_eviction.hpp"

namespace sparsekv {

class StreamingEvictionPolicy : public LiveTokenPolicy<StreamingEvictionPolicy> {
 public:
  struct Options {
    std::uint32_t budget_tokens = 2048;  // sinks + window, per kv head, once a step's token is placed
    std::uint32_t sink_tokens = 4;       // StreamingLLM's 4 attention sinks
  };
  struct LayerState {
    LiveTokens live;
  };
  static constexpr std::string_view kName = "streaming_evict";
  static constexpr bool kNeedsTokenWeights = false;

  StreamingEvictionPolicy();
  explicit StreamingEvictionPolicy(const Options& options) : options_(options) {
    // The sinks and the placed token are never evicted: the budget must hold them.
    if (options.budget_tokens <= options.sink_tokens) {
      fail(ErrorCode::invalid_argument,
           "streaming_evict: budget below protected window ({} budget tokens, {} sink tokens and the newest "
           "token)",
           options.budget_tokens, options.sink_tokens);
    }
  }

  const Options& options() const noexcept { return options_; }

  // Scores play no part: the weights are not read.
  void observe(const LayerContext&, const TokenWeights&, LayerState&) const {}

  // Per kv head: the live + 1 - budget oldest evictable tokens, once placing
  // the next token would exceed the budget.
  void evict(const LayerContext& ctx, const EvictionContext& e, LayerState& state, Eviction& out) const {
    state.live.check_eviction(kName, ctx, e);
    Eviction next;
    next.reset(ctx.kv_heads);
    std::vector<std::pair<std::size_t, std::size_t>> drop(ctx.kv_heads);  // [first, end) in positions[h]
    for (std::uint32_t h = 0; h < ctx.kv_heads; ++h) {
      const auto& live = state.live.positions[h];
      const auto [first, end] = state.live.evictable(e, h, options_.sink_tokens, 0);
      const std::size_t count = LiveTokens::eviction_count(live.size(), end - first, options_.budget_tokens, 1);
      next.positions[h].assign(live.begin() + static_cast<std::ptrdiff_t>(first),
                               live.begin() + static_cast<std::ptrdiff_t>(first + count));
      drop[h] = {first, first + count};
    }
    for (std::uint32_t h = 0; h < ctx.kv_heads; ++h) {
      auto& live = state.live.positions[h];
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(drop[h].first),
                 live.begin() + static_cast<std::ptrdiff_t>(drop[h].second));
    }
    out = std::move(next);
  }

 private:
  Options options_;
};

// Out of the class: Options' member initialisers are not usable inside it (GCC).
inline StreamingEvictionPolicy::StreamingEvictionPolicy() : StreamingEvictionPolicy(Options{}) {}

}  // namespace sparsekv
