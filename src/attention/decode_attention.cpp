#include "sparsekv/attention/decode_attention.hpp"

#include "sparsekv/core/error.hpp"
#include "sparsekv/core/numeric.hpp"

namespace sparsekv {

void attend_pages(const PageLayout& layout, const float* q, float scale, const HeadKv& kv,
                  std::span<AttentionPartial> states) {
  const std::uint32_t d = layout.head_dim;
  std::vector<float> k(d), v(d);
  for (std::size_t p = 0; p < kv.pages.size(); ++p) {
    const std::byte* page = kv.pages[p];
    for (std::uint32_t t = 0; t < kv.tokens[p]; ++t) {
      const void* k_row = page + layout.k_offset(t);
      const void* v_row = page + layout.v_offset(t);
      for (std::uint32_t i = 0; i < d; ++i) k[i] = load_element(k_row, i, layout.dtype);
      for (std::uint32_t i = 0; i < d; ++i) v[i] = load_element(v_row, i, layout.dtype);
      for (std::size_t g = 0; g < states.size(); ++g) {
        const float* qg = q + g * d;
        float score = 0.0f;
        for (std::uint32_t i = 0; i < d; ++i) score += qg[i] * k[i];
        states[g].add(score * scale, 1.0f, v.data());
      }
    }
  }
}

void decode_attention(const PageLayout& layout, std::uint32_t q_heads, float scale, const float* q,
                      std::span<const HeadKv> kv, std::span<const AttentionPartial> extra, float* out, float* lse) {
  const std::size_t kv_heads = kv.size();
  if (kv_heads == 0 || q_heads % kv_heads != 0) {
    fail(ErrorCode::invalid_argument, "decode_attention: {} q heads cannot be grouped onto {} kv heads", q_heads,
         kv_heads);
  }
  if (!extra.empty() && extra.size() != q_heads) {
    fail(ErrorCode::invalid_argument, "decode_attention: {} extra terms for {} q heads", extra.size(), q_heads);
  }
  for (const HeadKv& head : kv) {
    if (head.pages.size() != head.tokens.size()) {
      fail(ErrorCode::invalid_argument, "decode_attention: {} pages but {} token counts", head.pages.size(),
           head.tokens.size());
    }
    for (std::uint32_t t : head.tokens) {
      if (t > layout.page_tokens) {
        fail(ErrorCode::invalid_argument, "decode_attention: a page holds {} tokens, at most {}", t,
             layout.page_tokens);
      }
    }
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
  for (std::size_t g = 0; g < kv_heads; ++g) {
    states.assign(group, AttentionPartial(d));
    attend_pages(layout, q + g * group * d, scale, kv[g], states);
    for (std::size_t j = 0; j < group; ++j) {
      const std::size_t h = g * group + j;
      if (!extra.empty()) states[j].merge(extra[h]);
      states[j].write_output(out + h * d);
      if (lse != nullptr) lse[h] = softmax_lse(states[j].state());
    }
  }
}

}  // namespace sparsekv
