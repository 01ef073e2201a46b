#include <algorithm>
#include <cmath>
#include <numeric>

#include "sparsekv/core/error.hpp"
#include "sparsekv/core/numeric.hpp"
#include "sparsekv/policy/sparse_attention.hpp"

namespace sparsekv {

void check_layer_context(std::string_view policy, const LayerContext& ctx) {
  if (ctx.kv_heads == 0 || ctx.q_heads == 0 || ctx.q_heads % ctx.kv_heads != 0 || ctx.head_dim == 0 ||
      ctx.page_tokens == 0) {
    fail(ErrorCode::invalid_argument, "{}: bad layer context ({} q heads, {} kv heads, head dim {}, page tokens {})",
         policy, ctx.q_heads, ctx.kv_heads, ctx.head_dim, ctx.page_tokens);
  }
}

void check_kv_view(std::string_view policy, const LayerContext& ctx, const KvView& kv, bool needs_values) {
  check_layer_context(policy, ctx);
  const std::size_t expected = std::size_t{kv.tokens} * ctx.kv_heads * ctx.head_dim;
  const bool values_ok = kv.values.size() == expected || (!needs_values && kv.values.empty());
  if (kv.kv_heads != ctx.kv_heads || kv.head_dim != ctx.head_dim || kv.keys.size() != expected || !values_ok) {
    fail(ErrorCode::invalid_argument,
         "{}: K/V of {} tokens x {} kv heads x {} dims ({} / {} values) does not match the layer's {} kv heads x {} "
         "dims",
         policy, kv.tokens, kv.kv_heads, kv.head_dim, kv.keys.size(), kv.values.size(), ctx.kv_heads, ctx.head_dim);
  }
}

void check_decode_query(std::string_view policy, const LayerContext& ctx, const DecodeQuery& q) {
  if (q.q.size() != std::size_t{ctx.q_heads} * ctx.head_dim) {
    fail(ErrorCode::invalid_argument, "{}: query has {} values, expected {} q heads x {} dims", policy, q.q.size(),
         ctx.q_heads, ctx.head_dim);
  }
  // Scores of a non-finite query have no order: top-k would be undefined.
  // One pass without an early exit, which vectorizes: every select_head of
  // a step checks the whole query (32 x 128 values for Llama-8B).
  std::uint32_t non_finite = 0;
  for (const float x : q.q) non_finite |= is_finite(x) ? 0u : 1u;
  if (non_finite != 0) {
    const auto bad = std::find_if(q.q.begin(), q.q.end(), [](float x) { return !is_finite(x); });
    fail(ErrorCode::invalid_argument, "{}: query value {} is not finite", policy, bad - q.q.begin());
  }
}

void check_head(std::string_view policy, const LayerContext& ctx, std::uint32_t head) {
  if (head >= ctx.kv_heads) {
    fail(ErrorCode::invalid_argument, "{}: kv head {} of {}", policy, head, ctx.kv_heads);
  }
}

void check_appended_page(std::string_view policy, const LayerContext& ctx, const AppendedPage& page,
                         bool needs_values) {
  check_kv_view(policy, ctx, page.page, needs_values);
  if (page.page.tokens != ctx.page_tokens || page.partitions.size() != ctx.kv_heads) {
    fail(ErrorCode::invalid_argument, "{}: an appended page needs {} tokens and {} partition ids, got {} and {}",
         policy, ctx.page_tokens, ctx.kv_heads, page.page.tokens, page.partitions.size());
  }
}

std::vector<std::uint32_t> top_k(std::span<const float> scores, std::uint32_t k) {
  std::vector<std::uint32_t> order(scores.size());
  std::iota(order.begin(), order.end(), 0u);
  k = std::min<std::uint32_t>(k, static_cast<std::uint32_t>(order.size()));
  const auto better = [&](std::uint32_t a, std::uint32_t b) {
    return scores[a] > scores[b] || (scores[a] == scores[b] && a < b);
  };
  std::partial_sort(order.begin(), order.begin() + k, order.end(), better);
  order.resize(k);
  return order;
}

}  // namespace sparsekv
