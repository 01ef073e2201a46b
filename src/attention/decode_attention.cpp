#include "sparsekv/attention/decode_attention.hpp"

#include <algorithm>

#include "sparsekv/core/error.hpp"
#include "sparsekv/core/numeric.hpp"

namespace sparsekv {

void attend_pages(const PageLayout& layout, const float* q, float scale, const HeadKv& kv,
                  std::span<AttentionPartial> states) {
  attend_pages(layout, q, scale, kv, states, {});
}

void attend_pages(const PageLayout& layout, const float* q, float scale, const HeadKv& kv,
                  std::span<AttentionPartial> states, std::span<float> scores) {
  const std::uint32_t d = layout.head_dim;
  const std::size_t group = states.size();
  if (!scores.empty() && scores.size() != kv.pages.size() * layout.page_tokens * group) {
    fail(ErrorCode::invalid_argument, "attend_pages: {} scores for {} pages of {} slots and {} q heads", scores.size(),
         kv.pages.size(), layout.page_tokens, group);
  }
  // Dead and unused slots keep -inf: their weight is then 0 by softmax_weight.
  std::fill(scores.begin(), scores.end(), kNegativeInfinity);
  std::vector<float> k(d), v(d);
  for (std::size_t p = 0; p < kv.pages.size(); ++p) {
    const std::byte* page = kv.pages[p];
    for (std::uint32_t t = 0; t < kv.tokens[p]; ++t) {
      if (!kv.live.empty() && !slot_live(kv.live[p], t)) continue;
      const void* k_row = page + layout.k_offset(t);
      const void* v_row = page + layout.v_offset(t);
      for (std::uint32_t i = 0; i < d; ++i) k[i] = load_element(k_row, i, layout.dtype);
      for (std::uint32_t i = 0; i < d; ++i) v[i] = load_element(v_row, i, layout.dtype);
      for (std::size_t g = 0; g < group; ++g) {
        const float* qg = q + g * d;
        float score = 0.0f;
        for (std::uint32_t i = 0; i < d; ++i) score += qg[i] * k[i];
        states[g].add(score * scale, 1.0f, v.data());
        if (!scores.empty()) scores[(p * layout.page_tokens + t) * group + g] = score * scale;
      }
    }
  }
}

void decode_attention(const PageLayout& layout, std::uint32_t q_heads, float scale, const float* q,
                      std::span<const HeadKv> kv, std::span<const AttentionPartial> extra, float* out, float* lse,
                      std::span<float> slot_weights) {
  const std::size_t kv_heads = kv.size();
  if (kv_heads == 0 || q_heads % kv_heads != 0) {
    fail(ErrorCode::invalid_argument, "decode_attention: {} q heads cannot be grouped onto {} kv heads", q_heads,
         kv_heads);
  }
  if (!extra.empty() && extra.size() != q_heads) {
    fail(ErrorCode::invalid_argument, "decode_attention: {} extra terms for {} q heads", extra.size(), q_heads);
  }
  std::size_t total_pages = 0;
  for (const HeadKv& head : kv) {
    if (head.pages.size() != head.tokens.size()) {
      fail(ErrorCode::invalid_argument, "decode_attention: {} pages but {} token counts", head.pages.size(),
           head.tokens.size());
    }
    if (!head.live.empty() && head.live.size() != head.pages.size()) {
      fail(ErrorCode::invalid_argument, "decode_attention: {} pages but {} live masks", head.pages.size(),
           head.live.size());
    }
    if (!head.live.empty() && layout.page_tokens > kMaxMaskedPageTokens) {
      fail(ErrorCode::invalid_argument, "decode_attention: live masks cover {} slots, pages hold {}",
           kMaxMaskedPageTokens, layout.page_tokens);
    }
    for (std::uint32_t t : head.tokens) {
      if (t > layout.page_tokens) {
        fail(ErrorCode::invalid_argument, "decode_attention: a page holds {} tokens, at most {}", t,
             layout.page_tokens);
      }
    }
    total_pages += head.pages.size();
  }
  if (!slot_weights.empty() && slot_weights.size() != total_pages * layout.page_tokens) {
    fail(ErrorCode::invalid_argument, "decode_attention: {} slot weights for {} pages of {} tokens",
         slot_weights.size(), total_pages, layout.page_tokens);
  }
  const std::size_t group = q_heads / kv_heads;
  const std::uint32_t d = layout.head_dim;
  for (std::size_t h = 0; h < extra.size(); ++h) {
    if (!extra[h].empty() && extra[h].acc.size() != d) {
      fail(ErrorCode::invalid_argument, "decode_attention: extra term of head {} has {} dims, expected {}", h,
           extra[h].acc.size(), d);
    }
  }
  std::vector<AttentionPartial> states;
  std::vector<float> scores, group_lse(group);
  std::size_t first_slot = 0;  // of the kv head's pages in slot_weights
  for (std::size_t g = 0; g < kv_heads; ++g) {
    const std::size_t slots = slot_weights.empty() ? 0 : kv[g].pages.size() * layout.page_tokens;
    states.assign(group, AttentionPartial(d));
    scores.resize(slots * group);
    attend_pages(layout, q + g * group * d, scale, kv[g], states, scores);
    for (std::size_t j = 0; j < group; ++j) {
      const std::size_t h = g * group + j;
      if (!extra.empty()) states[j].merge(extra[h]);
      states[j].write_output(out + h * d);
      group_lse[j] = softmax_lse(states[j].state());
      if (lse != nullptr) lse[h] = group_lse[j];
    }
    for (std::size_t s = 0; s < slots; ++s) {
      slot_weights[first_slot + s] =
          softmax_group_weight(scores.data() + s * group, group_lse.data(), static_cast<std::uint32_t>(group));
    }
    first_slot += slots;
  }
}

}  // namespace sparsekv
