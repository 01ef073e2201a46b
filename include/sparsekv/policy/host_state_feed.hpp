#pragma once
// FeedsHostState: the optional capability of a policy whose device Select
// reads its host state (RetroInfer, Chen et al. 2025 §4.2: its clustering
// stays on the host). Such a policy says what each (request, kv head) row of
// the Select reads of that state, which summaries the device store takes
// from it, and when its next index update is due, so that the device step
// feeds it the saved decode pages first (docs/device-decode.md,
// "RetroInfer"). For every other policy the queries answer: nothing read, no
// summaries, never due.
#include <concepts>
#include <cstdint>
#include <vector>

#include "sparsekv/core/ids.hpp"
#include "sparsekv/policy/sparse_attention.hpp"

namespace sparsekv {

// What one (request, kv head) row reads from the host policy state besides
// the summaries (RetroInfer's sink and steady zone).
struct HostStateRow {
  PartitionId sink_partition = 0;
  std::uint32_t sink_tokens = 0;  // 0: no sink
  std::uint32_t recent = 0;       // how many of the row's last candidates are recent partitions
  std::uint32_t window = 0;       // the steady window in tokens
};

// The summaries of a head's candidates as the host state holds them, for the
// device store (written at prefill and after each index update): each
// candidate's centroid (mean key), value sum and token count.
struct HostSummaryRows {
  std::vector<float> centroids;   // [n][head_dim]
  std::vector<float> value_sums;  // [n][head_dim]
  std::vector<std::uint32_t> tokens;
};

// The policy's decode pages are one-page partitions whose summaries the
// append kernel writes; the host state learns of them only at its next index
// update, when the step feeds it the pages saved since the last (`unfed_pages`
// of them, the same count in every kv head). host_index_update_due: whether
// `pending_tokens` more decode tokens (the unfed pages and the one this step
// fills) reach that update.
template <class P>
concept FeedsHostState = SparseAttention<P> &&
    requires(const P& policy, const typename P::LayerState& state, std::uint32_t n, HostSummaryRows& rows) {
  { policy.host_state_row(state, n, n) } -> std::same_as<HostStateRow>;
  { policy.host_summary_rows(state, n, rows) } -> std::same_as<void>;
  { policy.host_index_update_due(state, n) } -> std::same_as<bool>;
};

template <SparseAttention P>
HostStateRow host_state_row(const P& policy, const typename P::LayerState& state, std::uint32_t head,
                            std::uint32_t unfed_pages) {
  if constexpr (FeedsHostState<P>) {
    return policy.host_state_row(state, head, unfed_pages);
  } else {
    return {};
  }
}
template <SparseAttention P>
void host_summary_rows(const P& policy, const typename P::LayerState& state, std::uint32_t head, HostSummaryRows& out) {
  if constexpr (FeedsHostState<P>) {
    policy.host_summary_rows(state, head, out);
  } else {
    out = {};
  }
}
template <SparseAttention P>
bool host_index_update_due(const P& policy, const typename P::LayerState& state, std::uint32_t pending_tokens) {
  if constexpr (FeedsHostState<P>) {
    return policy.host_index_update_due(state, pending_tokens);
  } else {
    return false;
  }
}

}  // namespace sparsekv
