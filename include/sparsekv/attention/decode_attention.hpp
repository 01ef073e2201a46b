#pragma once
// Sparse paged decode attention on the host (the reference the CUDA kernel is
// tested against): one query token per request, GQA (q head h reads kv head
// h / group), fp32 accumulation over fp32 / fp16 / bf16 pages in the
// head-wise layout (page_layout.hpp), a numerically stable softmax by online
// log-sum-exp, and a hook for a policy's extra term (an AttentionPartial per
// q head, e.g. RetroInfer's estimation zone) merged by log-sum-exp.
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "sparsekv/attention/attention_partial.hpp"
#include "sparsekv/memory/page_layout.hpp"

namespace sparsekv {

// What one kv head attends over: page base addresses and valid tokens per page.
struct HeadKv {
  std::vector<const std::byte*> pages;
  std::vector<std::uint32_t> tokens;

  void clear() {
    pages.clear();
    tokens.clear();
  }
  void add(const std::byte* page, std::uint32_t valid_tokens) {
    pages.push_back(page);
    tokens.push_back(valid_tokens);
  }
};

// Folds the q heads of one GQA group (`states.size()` heads, q: [group][head_dim])
// over one kv head's pages into `states` (scores = q.k * scale). Each K/V row
// is loaded once for the whole group.
void attend_pages(const PageLayout& layout, const float* q, float scale, const HeadKv& kv,
                  std::span<AttentionPartial> states);

// q: [q_heads][head_dim] fp32; kv: one HeadKv per kv head; extra: empty or one
// partial per q head; out: [q_heads][head_dim]; lse (optional): [q_heads],
// the log-sum-exp of each head's scores (-inf when it attended to nothing).
// Throws invalid_argument on inconsistent shapes.
void decode_attention(const PageLayout& layout, std::uint32_t q_heads, float scale, const float* q,
                      std::span<const HeadKv> kv, std::span<const AttentionPartial> extra, float* out,
                      float* lse = nullptr);

}  // namespace sparsekv
