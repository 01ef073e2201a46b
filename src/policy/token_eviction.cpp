#include "sparsekv/policy/token_eviction.hpp"

#include <algorithm>
#include <limits>

namespace sparsekv {

namespace {

void check_live_tokens(std::string_view policy, const LayerContext& ctx, const LiveTokens& live) {
  check_layer_context(policy, ctx);
  if (live.positions.size() != ctx.kv_heads || live.partitions.size() != ctx.kv_heads) {
    fail(ErrorCode::invalid_argument, "{}: layer state was not indexed for {} kv heads", policy, ctx.kv_heads);
  }
}

}  // namespace

PartitionSpec LiveTokens::index(std::string_view policy, const LayerContext& ctx, const KvView& kv) {
  check_kv_view(policy, ctx, kv, false);
  return lay_out(ctx, kv.tokens, kv.first_position);
}

PartitionSpec LiveTokens::index_fork(const LayerContext& ctx) { return lay_out(ctx, ctx.tokens, 0); }

PartitionSpec LiveTokens::lay_out(const LayerContext& ctx, std::uint32_t tokens, std::uint32_t first_position) {
  const PartitionSpec spec = PartitionSpec::uniform(tokens, ctx.page_tokens);
  std::vector<std::uint32_t> prompt(tokens);
  for (std::uint32_t t = 0; t < tokens; ++t) prompt[t] = first_position + t;
  std::vector<std::vector<std::uint32_t>> next(ctx.kv_heads, prompt);
  positions = std::move(next);
  partitions.assign(ctx.kv_heads, spec.partition_count());
  return spec;
}

void LiveTokens::append(std::string_view policy, const LayerContext& ctx, const AppendedPage& page) {
  check_appended_page(policy, ctx, page, false);
  check_live_tokens(policy, ctx, *this);
  for (auto& count : partitions) ++count;
}

void LiveTokens::select(std::string_view policy, const LayerContext& ctx, Selection& out) const {
  check_live_tokens(policy, ctx, *this);
  out.reset(ctx.kv_heads);
  for (std::uint32_t h = 0; h < ctx.kv_heads; ++h) {
    for (PartitionId p = 0; p < partitions[h]; ++p) out.partitions[h].push_back(p);
  }
}

void LiveTokens::check_placed(std::string_view policy, const LayerContext& ctx, std::uint32_t position) const {
  check_live_tokens(policy, ctx, *this);
  for (std::uint32_t h = 0; h < ctx.kv_heads; ++h) {
    if (!positions[h].empty() && positions[h].back() >= position) {
      fail(ErrorCode::invalid_argument, "{}: placed position {} is not after kv head {}'s newest live position {}",
           policy, position, h, positions[h].back());
    }
  }
}

void LiveTokens::place(std::uint32_t position) {
  for (auto& head : positions) head.push_back(position);
}

void LiveTokens::check_eviction(std::string_view policy, const LayerContext& ctx, const EvictionContext& e) const {
  check_live_tokens(policy, ctx, *this);
  if (e.live_tokens.size() != ctx.kv_heads ||
      (!e.protected_prefix.empty() && e.protected_prefix.size() != ctx.kv_heads)) {
    fail(ErrorCode::invalid_argument,
         "{}: eviction context has {} live counts and {} protected prefixes for {} kv heads", policy,
         e.live_tokens.size(), e.protected_prefix.size(), ctx.kv_heads);
  }
  for (std::uint32_t h = 0; h < ctx.kv_heads; ++h) {
    if (positions[h].empty() || positions[h].back() != e.newest) {
      fail(ErrorCode::invalid_argument, "{}: position {} was not the newest placed in kv head {}", policy, e.newest, h);
    }
    if (e.live_tokens[h] != positions[h].size()) {
      fail(ErrorCode::invalid_argument, "{}: the buffer holds {} live tokens in kv head {}, the policy state {}",
           policy, e.live_tokens[h], h, positions[h].size());
    }
  }
}

std::pair<std::size_t, std::size_t> LiveTokens::evictable(const EvictionContext& e, std::uint32_t h,
                                                          std::uint32_t sink_tokens,
                                                          std::uint32_t recent_tokens) const {
  const auto& live = positions[h];
  const std::uint32_t prefix = e.protected_prefix.empty() ? 0 : e.protected_prefix[h];
  const std::uint64_t lowest = std::max(sink_tokens, prefix);
  // The recent window is the `recent_tokens` newest positions once token
  // newest + 1 is placed: a position p stays out of it iff p + recent <= newest + 1.
  const std::uint64_t window_end = std::uint64_t{e.newest} + 1;
  const auto first = std::partition_point(live.begin(), live.end(), [&](std::uint32_t p) { return p < lowest; });
  const auto end = std::partition_point(
      first, live.end(), [&](std::uint32_t p) { return std::uint64_t{p} + recent_tokens <= window_end; });
  return {static_cast<std::size_t>(first - live.begin()), static_cast<std::size_t>(end - live.begin())};
}

std::size_t LiveTokens::eviction_count(std::size_t live, std::size_t evictable, std::uint32_t budget_tokens,
                                       std::uint32_t per_step) {
  if (live + 1 <= budget_tokens) return 0;
  const std::size_t over = live + 1 - budget_tokens;
  return std::min(std::max<std::size_t>(per_step, over), evictable);
}

std::uint32_t LiveTokens::mandatory_pages(std::string_view policy, const LayerContext& ctx) {
  check_layer_context(policy, ctx);
  const std::uint64_t pages = (std::uint64_t{ctx.tokens} + ctx.page_tokens - 1) / ctx.page_tokens + 1;
  return static_cast<std::uint32_t>(std::min<std::uint64_t>(pages, std::numeric_limits<std::uint32_t>::max()));
}

void check_rewritten_rows(std::string_view policy, const LayerContext& ctx, const RewrittenPage& page) {
  check_layer_context(policy, ctx);
  check_index("kv head", page.head, ctx.kv_heads);
  const KvView& rows = page.live_rows;
  const std::size_t expected = std::size_t{rows.tokens} * ctx.head_dim;
  if (rows.tokens == 0 || rows.kv_heads != 1 || rows.head_dim != ctx.head_dim || rows.keys.size() != expected ||
      !(rows.values.empty() || rows.values.size() == expected)) {
    fail(ErrorCode::invalid_argument,
         "{}: rewritten rows must be 1 or more rows of one kv head x {} dims, got {} rows x {} kv heads x {} dims "
         "({} keys, {} values)",
         policy, ctx.head_dim, rows.tokens, rows.kv_heads, rows.head_dim, rows.keys.size(), rows.values.size());
  }
}

}  // namespace sparsekv
