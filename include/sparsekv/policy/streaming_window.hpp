#pragma once
// StreamingWindow (StreamingLLM, "attention sinks"; RetroInfer §4.2's steady
// zone): the first `sink_tokens` tokens and the most recent tokens, static
// and query-independent. One page per partition. The budget counts tokens,
// not pages: the sink pages first, then the newest pages, each while it fits,
// so a short prompt page costs its tokens and a budget covering the context
// selects all of it (Dense).
#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#include "sparsekv/core/error.hpp"
#include "sparsekv/policy/device_select.hpp"
#include "sparsekv/policy/page_position_policy.hpp"
#include "sparsekv/policy/sparse_attention.hpp"

namespace sparsekv {

class StreamingWindowPolicy : public PagePositionPolicy<StreamingWindowPolicy> {
 public:
  struct Options {
    std::uint32_t budget_tokens = 2048;  // sinks + window, per kv head
    std::uint32_t sink_tokens = 4;       // StreamingLLM's 4 attention sinks
  };
  static constexpr std::string_view kName = "streaming";

  StreamingWindowPolicy();
  explicit StreamingWindowPolicy(const Options& options) : options_(options) {
    if (options.budget_tokens == 0) fail(ErrorCode::invalid_argument, "streaming: budget_tokens must be > 0");
  }

  const Options& options() const noexcept { return options_; }

  void select_head(const LayerContext& ctx, const DecodeQuery&, const LayerState& state, std::uint32_t h,
                   std::vector<PartitionId>& ids) const {
    check_head(kName, ctx, h);
    ids.clear();
    const std::uint32_t pt = ctx.page_tokens;
    const std::uint32_t prompt_pages = (state.prompt_tokens + pt - 1) / pt;
    const auto size = [&](PartitionId p) { return p + 1 == prompt_pages ? state.prompt_tokens - p * pt : pt; };
    const std::uint32_t sink_pages = static_cast<std::uint32_t>((std::uint64_t{options_.sink_tokens} + pt - 1) / pt);
    const std::uint32_t n = state.partitions.at(h);
    std::uint64_t left = options_.budget_tokens;
    PartitionId sinks = 0;
    for (; sinks < std::min(sink_pages, n) && size(sinks) <= left; ++sinks) {
      ids.push_back(sinks);
      left -= size(sinks);
    }
    PartitionId window = n;  // the window is [window, n)
    for (; window > sinks && size(window - 1) <= left; --window) left -= size(window - 1);
    for (PartitionId p = window; p < n; ++p) ids.push_back(p);
  }
  // At most the budget's tokens, in pages all full but the prompt's last:
  // ceil(budget / page_tokens), never more than the context can fill.
  std::uint32_t mandatory_pages(const LayerContext& ctx) const {
    const std::uint64_t pt = ctx.page_tokens;
    const std::uint64_t context = (std::uint64_t{ctx.tokens} + pt - 1) / pt + 1;
    return static_cast<std::uint32_t>(std::min((std::uint64_t{options_.budget_tokens} + pt - 1) / pt, context));
  }

 private:
  Options options_;
};

// StreamingWindow's device Select (policy/device_select.hpp): from the
// candidates' positions and token counts alone, one page per partition; the
// budget counts tokens.
struct StreamingDeviceSelect {
  using Policy = StreamingWindowPolicy;
  static constexpr cuda::AppendSummary summary = cuda::AppendSummary::tokens;  // one page a partition
  std::uint32_t budget_tokens = 0;
  std::uint32_t sink_pages = 0;  // the pages its sink tokens span

  std::uint32_t capacity(std::uint32_t max_partitions, std::uint32_t page_tokens) const {
    const std::uint64_t pages = (std::uint64_t{budget_tokens} + page_tokens - 1) / page_tokens;
    return cuda::select_capacity(max_partitions,
                                 static_cast<std::uint32_t>(std::min<std::uint64_t>(pages, 0xffffffffu)), false, 0);
  }
};
inline StreamingDeviceSelect device_select_spec(const StreamingWindowPolicy& p, const LayerContext& ctx) {
  // select_head's sink_pages: ceil(sink_tokens / page_tokens) in 64 bits.
  const auto sink_pages =
      static_cast<std::uint32_t>((std::uint64_t{p.options().sink_tokens} + ctx.page_tokens - 1) / ctx.page_tokens);
  return {p.options().budget_tokens, sink_pages};
}

// Out of the class: Options' member initialisers are not usable inside it (GCC).
inline StreamingWindowPolicy::StreamingWindowPolicy() : StreamingWindowPolicy(Options{}) {}

}  // namespace sparsekv
