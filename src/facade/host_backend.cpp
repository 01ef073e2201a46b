#include <algorithm>

#include "sparsekv/facade/manager.hpp"

namespace sparsekv::detail {

std::int64_t append_runs(AttendPlan& plan, std::span<const PageId> pages, std::span<const std::uint32_t> tokens,
                         std::uint32_t page_tokens) {
  std::int64_t runs = 0;
  std::size_t i = 0;
  while (i < pages.size()) {
    // A run ends at its first page that is not full (or at the last page).
    std::size_t end = i;
    while (end + 1 < pages.size() && tokens[end] == page_tokens) ++end;
    for (std::size_t p = i; p <= end; ++p) plan.indices.push_back(pages[p]);
    plan.indptr.push_back(static_cast<std::int64_t>(plan.indices.size()));
    plan.last_page_len.push_back(static_cast<std::int32_t>(tokens[end]));
    ++runs;
    i = end + 1;
  }
  return runs;
}

}  // namespace sparsekv::detail

namespace sparsekv {

void check_attend_masks(const AttendCall& call) {
  const AttendPlan& plan = *call.plan;
  if (plan.live_masks.empty()) return;
  if (plan.live_masks.size() != plan.indices.size()) {
    fail(ErrorCode::invalid_argument, "attend: {} live masks for {} plan pages", plan.live_masks.size(),
         plan.indices.size());
  }
  if (call.layout.page_tokens > kMaxMaskedPageTokens) {
    fail(ErrorCode::invalid_argument, "attend: live masks cover {} slots, pages hold {}", kMaxMaskedPageTokens,
         call.layout.page_tokens);
  }
}

void HostBackend::attend(const AttendCall& call) {
  check_attend_masks(call);
  const AttendPlan& plan = *call.plan;
  const std::uint32_t page_tokens = call.layout.page_tokens;
  const std::size_t qd = std::size_t{call.q_heads} * call.layout.head_dim;
  // Pages no row reaches get no weight.
  if (call.slot_weights != nullptr) std::fill_n(call.slot_weights, plan.indices.size() * page_tokens, 0.0f);
  std::vector<HeadKv> kv(call.kv_heads);
  for (std::uint32_t b = 0; b < call.batch; ++b) {
    const std::size_t first_row = std::size_t{b} * call.kv_heads;
    for (std::uint32_t h = 0; h < call.kv_heads; ++h) {
      kv[h].clear();
      const std::size_t head = first_row + h;
      for (auto e = plan.head_entries[head]; e < plan.head_entries[head + 1]; ++e) {
        for (auto i = plan.indptr[e]; i < plan.indptr[e + 1]; ++i) {
          const std::uint32_t tokens =
              i + 1 == plan.indptr[e + 1] ? static_cast<std::uint32_t>(plan.last_page_len[e]) : page_tokens;
          kv[h].add(plan.gpu_tier_base + static_cast<std::size_t>(plan.indices[i]) * plan.page_bytes, tokens,
                    plan.live_masks.empty() ? ~SlotMask{0} : plan.live_masks[static_cast<std::size_t>(i)]);
        }
      }
    }
    const std::span<const AttentionPartial> extra =
        plan.extra.empty() ? std::span<const AttentionPartial>{}
                           : std::span(plan.extra).subspan(std::size_t{b} * call.q_heads, call.q_heads);
    // The request's rows hold the plan's pages [first, end) in order: its slot weights are that slice.
    std::span<float> weights;
    if (call.slot_weights != nullptr) {
      const auto first = static_cast<std::size_t>(plan.indptr[plan.head_entries[first_row]]);
      const auto end = static_cast<std::size_t>(plan.indptr[plan.head_entries[first_row + call.kv_heads]]);
      weights = std::span(call.slot_weights + first * page_tokens, (end - first) * page_tokens);
    }
    decode_attention(call.layout, call.q_heads, call.scale, call.q + b * qd, kv, extra, call.out + b * qd, nullptr,
                     weights);
  }
}

}  // namespace sparsekv
