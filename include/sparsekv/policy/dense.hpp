#pragma once
// Dense: every partition, every step, through the same offload / retrieve /
// attend pipeline as the sparse policies -- the baseline every policy is
// measured against. One page per partition.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <numeric>
#include <optional>
#include <vector>

#include "sparsekv/policy/device_select.hpp"
#include "sparsekv/policy/page_position_policy.hpp"
#include "sparsekv/policy/sparse_attention.hpp"

namespace sparsekv {

class DensePolicy : public PagePositionPolicy<DensePolicy> {
 public:
  struct Options {};
  static constexpr std::string_view kName = "dense";

  DensePolicy() = default;
  explicit DensePolicy(const Options&) {}

  void select_head(const LayerContext& ctx, const DecodeQuery&, const LayerState& state, std::uint32_t h,
                   std::vector<PartitionId>& ids) const {
    check_head(kName, ctx, h);
    ids.resize(state.partitions.at(h));
    std::iota(ids.begin(), ids.end(), PartitionId{0});
  }
  // Prefill's last page may be partial: one page more than the tokens fill
  // (in 64 bits, saturated: a context near 2^32 tokens must not wrap to a few pages).
  std::uint32_t mandatory_pages(const LayerContext& ctx) const {
    const std::uint64_t pages = (std::uint64_t{ctx.tokens} + ctx.page_tokens - 1) / ctx.page_tokens + 1;
    return static_cast<std::uint32_t>(std::min<std::uint64_t>(pages, std::numeric_limits<std::uint32_t>::max()));
  }
};

// Dense's device Select (policy/device_select.hpp): every candidate.
struct DenseDeviceSelect {
  using Policy = DensePolicy;
  static constexpr cuda::AppendSummary summary = cuda::AppendSummary::tokens;

  std::uint32_t capacity(std::uint32_t max_partitions, std::uint32_t) const {
    return cuda::select_capacity(max_partitions, 0, true, 0);
  }
};
inline DenseDeviceSelect device_select_spec(const DensePolicy&, const LayerContext&) { return {}; }

}  // namespace sparsekv
