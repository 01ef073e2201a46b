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
