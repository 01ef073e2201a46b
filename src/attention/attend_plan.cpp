#include "sparsekv/attention/attend_plan.hpp"

#include "sparsekv/core/error.hpp"

namespace sparsekv {

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

}  // namespace sparsekv
