#pragma once
// AttendPlan: what a decode step hands an engine that runs its own paged
// attention kernel instead of sparsekv's built-in Attend. It is shaped like
// FlashInfer's paged_kv_t with the kv head folded into the batch dimension:
// every *entry* is one (request, kv head) run of GPU-tier pages, all full
// except possibly the last, and attends with num_kv_heads = 1:
//
//   k_data = gpu_tier_base                 v_data = gpu_tier_base + page_tokens * head_dim elements
//   stride_page = 2 * page_tokens * head_dim   stride_n = head_dim   (one head per page)
//   indptr[e] .. indptr[e+1]  -> indices (page ids), last_page_len[e] in [1, page_tokens]
//
// A (request, kv head) whose pages are not all full except the last (a
// partial prefill page, clusters padding their last page, the decode tail)
// gets one entry per run; head_entries[b * kv_heads + h] .. [+1] lists its
// entries, whose outputs the engine merges by log-sum-exp (FlashInfer:
// return_lse + merge_states). Queries: q head j of request b belongs to kv
// head j / group_size; each entry is one "sequence" with group_size q heads.
// extra (empty, or batch * q_heads entries) holds a policy's own attention
// term (RetroInfer's estimation zone) to merge the same way.
//
// live_masks (empty, or one SlotMask per entry of indices) marks the slots
// that still hold a token when a request of the batch evicts tokens for good
// (SpvLLM §2, H2O, StreamingLLM): slot t of page indices[i] attends iff it
// is below the page's token count (page_tokens, or last_page_len[e] for the
// last page of its entry e) AND slot_live(live_masks[i], t); any other slot's
// score is -inf, as in vLLM / SpvLLM block masks. Runs and head_entries are
// the same with or without masks; empty means every slot below the token
// count is live. An engine whose kernel takes no masks can run a plan only
// while live_masks is empty.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "sparsekv/attention/attention_partial.hpp"
#include "sparsekv/memory/page_layout.hpp"

namespace sparsekv {

struct AttendPlan {
  std::vector<std::int64_t> indptr{0};          // [entries + 1] into indices
  std::vector<std::int64_t> indices;            // GPU-tier page ids
  std::vector<std::int32_t> last_page_len;      // [entries]
  std::vector<std::int64_t> head_entries{0};    // [batch * kv_heads + 1] into the entries
  std::vector<AttentionPartial> extra;          // empty or [batch * q_heads]
  std::vector<SlotMask> live_masks;             // empty or [indices.size()]: bit t = slot t of indices[i] live
  const std::byte* gpu_tier_base = nullptr;     // page p at gpu_tier_base + p * page_bytes
  std::size_t page_bytes = 0;

  std::size_t entries() const { return last_page_len.size(); }
  void clear() {
    indptr.assign(1, 0);
    indices.clear();
    last_page_len.clear();
    head_entries.assign(1, 0);
    extra.clear();
    live_masks.clear();
  }
};

}  // namespace sparsekv
