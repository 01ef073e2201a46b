#pragma once
// StreamingWindow (StreamingLLM, "attention sinks"; RetroInfer §4.2's steady
// zone): the first `sink_tokens` tokens and the most recent tokens, static
// and query-independent. One page per partition; the window fills whatever
// of the budget the sink pages leave, newest pages first.
#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#include "sparsekv/core/error.hpp"
#include "sparsekv/policy/sparse_attention.hpp"

namespace sparsekv {

class StreamingWindowPolicy {
 public:
  struct Options {
    std::uint32_t budget_tokens = 2048;  // sinks + window, per kv head
    std::uint32_t sink_tokens = 4;       // StreamingLLM's 4 attention sinks
  };
  struct LayerState {
    std::vector<std::uint32_t> partitions;  // per kv head
  };
  static constexpr std::string_view kName = "streaming";
  static constexpr RopeStage kRope = RopeStage::post_rope;

  StreamingWindowPolicy();
  explicit StreamingWindowPolicy(const Options& options) : options_(options) {
    if (options.budget_tokens == 0) fail(ErrorCode::invalid_argument, "streaming: budget_tokens must be > 0");
  }

  std::vector<PartitionSpec> index(const LayerContext& ctx, const KvView& kv, LayerState& state) const {
    const PartitionSpec spec = PartitionSpec::uniform(kv.tokens, ctx.page_tokens);
    state.partitions.assign(ctx.kv_heads, spec.partition_count());
    return {spec};
  }
  std::optional<Repartition> append(const LayerContext&, const AppendedPage&, LayerState& state) const {
    for (auto& count : state.partitions) ++count;
    return std::nullopt;
  }
  void select(const LayerContext& ctx, const DecodeQuery&, const LayerState& state, Selection& out) const {
    out.reset(ctx.kv_heads);
    const std::uint32_t budget_pages = std::max(1u, options_.budget_tokens / ctx.page_tokens);
    const std::uint32_t sink_pages =
        std::min(budget_pages, (options_.sink_tokens + ctx.page_tokens - 1) / ctx.page_tokens);
    for (std::uint32_t h = 0; h < ctx.kv_heads; ++h) {
      const std::uint32_t n = state.partitions[h];
      const std::uint32_t sinks = std::min(sink_pages, n);
      const std::uint32_t window = std::min(budget_pages - sink_pages, n - sinks);
      for (PartitionId p = 0; p < sinks; ++p) out.partitions[h].push_back(p);
      for (PartitionId p = n - window; p < n; ++p) out.partitions[h].push_back(p);
    }
  }
  // The budget, but never more pages than the context can fill (prefill's
  // last page may be partial).
  std::uint32_t mandatory_pages(const LayerContext& ctx) const {
    const std::uint64_t context = (std::uint64_t{ctx.tokens} + ctx.page_tokens - 1) / ctx.page_tokens + 1;
    return static_cast<std::uint32_t>(
        std::min<std::uint64_t>(std::max(1u, options_.budget_tokens / ctx.page_tokens), context));
  }

 private:
  Options options_;
};

// Out of the class: Options' member initialisers are not usable inside it (GCC).
inline StreamingWindowPolicy::StreamingWindowPolicy() : StreamingWindowPolicy(Options{}) {}

}  // namespace sparsekv
