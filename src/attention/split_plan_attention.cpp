#include "sparsekv/attention/split_plan_attention.hpp"

#include <algorithm>

#include "sparsekv/attention/page_fold.hpp"
#include "sparsekv/core/error.hpp"

namespace sparsekv {

void SplitPlanAttention::prepare(const AttendCall& call) {
  check_attend_masks(call);
  const AttendPlan& plan = *call.plan;
  const std::uint32_t pt = call.layout.page_tokens;
  const std::uint32_t d = call.layout.head_dim;
  if (call.kv_heads == 0 || call.q_heads % call.kv_heads != 0) {
    fail(ErrorCode::invalid_argument, "attend: {} q heads cannot be grouped onto {} kv heads", call.q_heads,
         call.kv_heads);
  }
  const std::size_t rows = std::size_t{call.batch} * call.kv_heads;
  if (plan.head_entries.size() != rows + 1) {
    fail(ErrorCode::invalid_argument, "attend: the plan has {} head entries for {} rows", plan.head_entries.size() - 1,
         rows);
  }
  if (!plan.extra.empty() && plan.extra.size() != std::size_t{call.batch} * call.q_heads) {
    fail(ErrorCode::invalid_argument, "attend: {} extra terms for {} q heads", plan.extra.size(),
         std::size_t{call.batch} * call.q_heads);
  }
  for (std::size_t h = 0; h < plan.extra.size(); ++h) {
    if (!plan.extra[h].empty() && plan.extra[h].acc.size() != d) {
      fail(ErrorCode::invalid_argument, "attend: extra term of q head {} has {} dims, expected {}", h,
           plan.extra[h].acc.size(), d);
    }
  }
  const std::size_t pages = plan.indices.size();
  if (!plan.page_data.empty() && plan.page_data.size() != pages) {
    fail(ErrorCode::invalid_argument, "attend: the plan has {} page addresses for {} pages", plan.page_data.size(),
         pages);
  }
  page_tokens_.resize(pages);
  for (std::size_t e = 0; e < plan.entries(); ++e) {
    const auto tokens = plan.last_page_len[e];
    if (tokens < 1 || static_cast<std::uint32_t>(tokens) > pt) {
      fail(ErrorCode::invalid_argument, "attend: a page holds {} tokens, at most {}", tokens, pt);
    }
    for (auto i = plan.indptr[e]; i < plan.indptr[e + 1]; ++i) {
      page_tokens_[static_cast<std::size_t>(i)] = i + 1 == plan.indptr[e + 1] ? static_cast<std::uint32_t>(tokens) : pt;
    }
  }
  call_ = call;
  group_ = call.q_heads / call.kv_heads;
  // A row's pages are the plan's pages [indptr[head_entries[r]], indptr[head_entries[r + 1]]).
  const std::size_t base_pages = std::max<std::size_t>(1, kChunkTokens / pt);
  chunks_.clear();
  row_chunks_.assign(1, 0);
  for (std::size_t r = 0; r < rows; ++r) {
    const auto first = static_cast<std::size_t>(plan.indptr[static_cast<std::size_t>(plan.head_entries[r])]);
    const auto end = static_cast<std::size_t>(plan.indptr[static_cast<std::size_t>(plan.head_entries[r + 1])]);
    const std::size_t chunk_pages = std::max(base_pages, (end - first + kMaxRowChunks - 1) / kMaxRowChunks);
    for (std::size_t p = first; p < end; p += chunk_pages) {
      chunks_.push_back({static_cast<std::uint32_t>(r), p, std::min(end, p + chunk_pages)});
    }
    row_chunks_.push_back(chunks_.size());
  }
  // Scratch only grows: a model's layers alternate sizes (Quest's dense
  // layers, then sparse ones), and regrowing would zero megabytes a step.
  // Every element used is written before it is read.
  const auto at_least = [](auto& v, std::size_t n) {
    if (v.size() < n) v.resize(n);
  };
  at_least(states_, chunks_.size() * group_);
  at_least(acc_, chunks_.size() * group_ * d);
  at_least(weights_, chunks_.size() * page_fold_scratch_floats(pt));
  if (call.slot_weights != nullptr) at_least(scores_, pages * pt * group_);
  at_least(merged_, rows * group_ * d);
  at_least(lse_, rows * group_);
  ran_.assign(chunks_.size(), 0);
  if (chunks_left_capacity_ < rows) {
    chunks_left_ = std::make_unique<std::atomic<std::uint32_t>[]>(rows);
    chunks_left_capacity_ = rows;
  }
  for (std::size_t r = 0; r < rows; ++r) {
    chunks_left_[r].store(static_cast<std::uint32_t>(row_chunks_[r + 1] - row_chunks_[r]), std::memory_order_relaxed);
  }
  // Pages no row reaches get no weight; merge_row writes the others'.
  if (call.slot_weights != nullptr) std::fill_n(call.slot_weights, pages * pt, 0.0f);
}

void SplitPlanAttention::run(std::size_t first, std::size_t end) noexcept {
  for (std::size_t c = first; c < end; ++c) {
    run_chunk(c);
    ran_[c] = 1;
    // acq_rel: the thread that runs a row's last chunk sees every other
    // chunk's states (a release sequence of the row's counter).
    const std::uint32_t row = chunks_[c].row;
    if (chunks_left_[row].fetch_sub(1, std::memory_order_acq_rel) == 1) merge_row(row);
  }
}

bool SplitPlanAttention::all_ran() const noexcept { return std::find(ran_.begin(), ran_.end(), 0) == ran_.end(); }

void SplitPlanAttention::run_chunk(std::size_t c) noexcept {
  const AttendPlan& plan = *call_.plan;
  const PageLayout& layout = call_.layout;
  const std::uint32_t d = layout.head_dim, pt = layout.page_tokens;
  const Chunk& chunk = chunks_[c];
  const std::uint32_t b = chunk.row / call_.kv_heads, h = chunk.row % call_.kv_heads;
  PageFold fold;
  fold.layout = layout;
  fold.group = group_;
  fold.scale = call_.scale;
  fold.q = call_.q + (std::size_t{b} * call_.q_heads + std::size_t{h} * group_) * d;
  fold.states = states_.data() + c * group_;
  fold.acc = acc_.data() + c * group_ * d;
  fold.weights = weights_.data() + c * page_fold_scratch_floats(pt);
  std::fill_n(fold.states, group_, SoftmaxState{});
  std::fill_n(fold.acc, std::size_t{group_} * d, 0.0f);
  // Tiles of whole pages up to fold_tile_tokens slots (a longer page alone):
  // cut by the plan alone, so the result does not depend on the threads.
  const std::uint32_t tile_tokens = fold_tile_tokens(layout);
  FoldPageRef tile[kFoldTileTokens];
  std::size_t i = chunk.first_page;
  while (i < chunk.end_page) {
    const std::size_t first = i;
    std::uint32_t count = 0, tokens = 0;
    do {
      tile[count++] = {plan.page(i), page_tokens_[i], plan.live_masks.empty() ? ~SlotMask{0} : plan.live_masks[i]};
      tokens += page_tokens_[i];
      ++i;
    } while (i < chunk.end_page && tokens + page_tokens_[i] <= tile_tokens);
    fold.scores = call_.slot_weights == nullptr ? nullptr : scores_.data() + first * pt * group_;
    fold_pages(fold, std::span<const FoldPageRef>(tile, count), i < chunk.end_page ? plan.page(i) : nullptr);
  }
}

// The row's chunks merged in chunk order, then the extra term, into the row's
// outputs in merged_ (finish() hands them out); then the slot weights of the
// row's pages.
void SplitPlanAttention::merge_row(std::size_t r) noexcept {
  const AttendPlan& plan = *call_.plan;
  const std::uint32_t d = call_.layout.head_dim, pt = call_.layout.page_tokens;
  float* lse = lse_.data() + r * group_;
  const std::size_t b = r / call_.kv_heads, h = r % call_.kv_heads;
  for (std::uint32_t g = 0; g < group_; ++g) {
    const std::size_t head = b * call_.q_heads + h * group_ + g;
    float* out = merged_.data() + (r * group_ + g) * d;
    SoftmaxState state;
    std::fill_n(out, d, 0.0f);
    const auto merge = [&](SoftmaxState other, const float* other_acc) {
      const RescaleStep step = softmax_merge(state, other);
      for (std::uint32_t j = 0; j < d; ++j) out[j] = softmax_rescale_add(out[j], step, other_acc[j]);
    };
    for (std::size_t c = row_chunks_[r]; c < row_chunks_[r + 1]; ++c) {
      merge(states_[c * group_ + g], acc_.data() + (c * group_ + g) * d);
    }
    if (!plan.extra.empty() && !plan.extra[head].empty()) merge(plan.extra[head].state(), plan.extra[head].acc.data());
    for (std::uint32_t j = 0; j < d; ++j) out[j] = softmax_output(out[j], state);
    lse[g] = softmax_lse(state);
  }
  if (call_.slot_weights == nullptr) return;
  const auto first = static_cast<std::size_t>(plan.indptr[static_cast<std::size_t>(plan.head_entries[r])]);
  const auto end = static_cast<std::size_t>(plan.indptr[static_cast<std::size_t>(plan.head_entries[r + 1])]);
  for (std::size_t s = first * pt; s < end * pt; ++s) {
    call_.slot_weights[s] = softmax_group_weight(scores_.data() + s * group_, lse, group_);
  }
}

void SplitPlanAttention::finish() {
  const std::size_t rows = row_chunks_.size() - 1;
  for (std::size_t r = 0; r < rows; ++r) {
    if (row_chunks_[r] == row_chunks_[r + 1]) merge_row(r);
  }
  // Rows are (request, kv head) and a kv head's group is its q heads in order:
  // merged_ is laid out as out.
  std::copy_n(merged_.data(), rows * group_ * call_.layout.head_dim, call_.out);
}

void SplitPlanAttention::attend(const AttendCall& call) {
  prepare(call);
  run(0, chunks());
  finish();
}

}  // namespace sparsekv
