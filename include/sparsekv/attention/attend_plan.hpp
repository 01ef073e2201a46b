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
#include <span>
#include <vector>

#include "sparsekv/attention/attention_partial.hpp"
#include "sparsekv/core/ids.hpp"
#include "sparsekv/memory/page_layout.hpp"

namespace sparsekv {

struct AttendPlan {
  std::vector<std::int64_t> indptr{0};        // [entries + 1] into indices
  std::vector<std::int64_t> indices;          // GPU-tier page ids
  std::vector<std::int32_t> last_page_len;    // [entries]
  std::vector<std::int64_t> head_entries{0};  // [batch * kv_heads + 1] into the entries
  std::vector<AttentionPartial> extra;        // empty or [batch * q_heads]
  std::vector<SlotMask> live_masks;           // empty or [indices.size()]: bit t = slot t of indices[i] live
  const std::byte* gpu_tier_base = nullptr;   // page p at gpu_tier_base + p * page_bytes
  std::size_t page_bytes = 0;
  // Empty, or [indices.size()]: where page indices[i] is, for a plan over the
  // CPU tier in place (a chunked pool, gpu_tier_base null; indices are then
  // CPU-tier page ids).
  std::vector<const std::byte*> page_data;

  const std::byte* page(std::size_t i) const {
    return page_data.empty() ? gpu_tier_base + static_cast<std::size_t>(indices[i]) * page_bytes : page_data[i];
  }

  std::size_t entries() const { return last_page_len.size(); }
  void clear() {
    indptr.assign(1, 0);
    indices.clear();
    last_page_len.clear();
    head_entries.assign(1, 0);
    extra.clear();
    live_masks.clear();
    page_data.clear();
  }
};

// Splits one (request, kv head)'s pages into runs whose pages are all full
// but the last, appending them to the plan; returns the runs added: the host
// plan rule, the reference of the device one (attend_plan_cuda.hpp).
std::int64_t append_runs(AttendPlan& plan, std::span<const PageId> pages, std::span<const std::uint32_t> tokens,
                         std::uint32_t page_tokens);

// What the built-in Attend computes for one decode step of one layer.
struct AttendCall {
  const AttendPlan* plan = nullptr;
  PageLayout layout;
  std::uint32_t batch = 0;
  std::uint32_t q_heads = 0;
  std::uint32_t kv_heads = 0;
  float scale = 1.0f;
  const float* q = nullptr;  // [batch][q_heads][head_dim], host memory
  float* out = nullptr;      // [batch][q_heads][head_dim], host memory
  // Null, or [plan->indices.size()][layout.page_tokens] in host memory: slot
  // t of page indices[i] gets its softmax probability summed over the q heads
  // of its kv head's GQA group (decode_attention's slot_weights), 0 for a
  // dead or unused slot; taken from the attention pass itself.
  float* slot_weights = nullptr;
};

// Throws invalid_argument unless call.plan->live_masks is empty, or parallel
// to its indices with page_tokens <= kMaxMaskedPageTokens. Every Attend of a
// plan asks it before it writes anything.
void check_attend_masks(const AttendCall& call);

// The same plan in device memory, built by the device step (attend_plan_cuda.hpp)
// for the built-in kernel or the engine's: the arrays mean what AttendPlan's do.
struct DeviceAttendPlan {
  const std::int64_t* head_entries = nullptr;  // [rows + 1]
  const std::int64_t* indptr = nullptr;
  const std::int64_t* indices = nullptr;
  const std::int32_t* last_page_len = nullptr;
  const std::byte* gpu_tier_base = nullptr;
  std::size_t page_bytes = 0;
  std::uint32_t rows = 0;
  // RetroInfer's estimation zone (its Attend term, RetroInfer §4.2 eqs. 2-4),
  // for the engine's kernel to merge by log-sum-exp as
  // DecodeAttentionExtra: max, sum [rows * group] and acc [rows * group][head_dim];
  // null for the other policies and without estimation.
  const float* extra_max = nullptr;
  const float* extra_sum = nullptr;
  const float* extra_acc = nullptr;
};

}  // namespace sparsekv
