#pragma once
// Sparse paged decode attention on the host (the reference the CUDA kernel is
// tested against): one query token per request, GQA (q head h reads kv head
// h / group), fp32 accumulation over fp32 / fp16 / bf16 pages in the
// head-wise layout (page_layout.hpp), a numerically stable softmax by online
// log-sum-exp, and a hook for a policy's extra term (an AttentionPartial per
// q head, e.g. RetroInfer's estimation zone) merged by log-sum-exp.
// Pages may carry live-slot masks (SpvLLM §2: a token evicted for good is
// a cleared bit, its slot skipped), and the softmax probability of every slot
// can be returned from the same pass (H2O's attention scores, SpvLLM §3.2).
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "sparsekv/attention/attention_partial.hpp"
#include "sparsekv/memory/page_layout.hpp"

namespace sparsekv {

// What one kv head attends over: page base addresses, valid tokens per page
// and, optionally, which of them are live. Slot t of page p attends iff
// t < tokens[p] and (live is empty or slot_live(live[p], t)); a dead slot is
// skipped, so the result is dense attention over the live rows alone.
struct HeadKv {
  std::vector<const std::byte*> pages;
  std::vector<std::uint32_t> tokens;
  std::vector<SlotMask> live;  // empty: every slot below tokens[p] is live; else parallel to pages

  void clear() {
    pages.clear();
    tokens.clear();
    live.clear();
  }
  // A page whose live slots are `live_slots` (bits at or past valid_tokens are
  // ignored). `live` stays empty while every page added is fully live, and is
  // filled in for the earlier pages at the first one that is not.
  void add(const std::byte* page, std::uint32_t valid_tokens, SlotMask live_slots = ~SlotMask{0}) {
    if (!live.empty() || live_slots != ~SlotMask{0}) {
      live.resize(pages.size(), ~SlotMask{0});
      live.push_back(live_slots);
    }
    pages.push_back(page);
    tokens.push_back(valid_tokens);
  }
};

// Folds the q heads of one GQA group (`states.size()` heads, q: [group][head_dim])
// over one kv head's live slots into `states` (scores = q.k * scale). Each K/V
// row is loaded once for the whole group.
void attend_pages(const PageLayout& layout, const float* q, float scale, const HeadKv& kv,
                  std::span<AttentionPartial> states);
// The same, also keeping every slot's score: scores is
// [kv.pages.size() * page_tokens][states.size()], slot t of page p at row
// p * page_tokens + t, -inf for a dead or unused slot. Throws
// invalid_argument when scores is neither empty nor of that size.
void attend_pages(const PageLayout& layout, const float* q, float scale, const HeadKv& kv,
                  std::span<AttentionPartial> states, std::span<float> scores);

// q: [q_heads][head_dim] fp32; kv: one HeadKv per kv head; extra: empty or one
// partial per q head; out: [q_heads][head_dim]; lse (optional): [q_heads],
// the log-sum-exp of each head's scores (-inf when it attended to nothing).
// slot_weights (optional): Σ over kv heads of pages.size() * page_tokens
// floats, kv head by kv head, slot t of the i-th page of a head's list at
// i * page_tokens + t: the softmax probability of that slot
// (softmax_weight, against the lse including the extra term) summed over the
// kv head's GQA group of q heads; 0 for a dead or unused slot. Taken from
// the scores of the attention pass itself: no K/V row is read twice.
// Throws invalid_argument on inconsistent shapes (a live mask list not
// parallel to its pages, masks with page_tokens > kMaxMaskedPageTokens,
// slot_weights of the wrong size); nothing is written then.
void decode_attention(const PageLayout& layout, std::uint32_t q_heads, float scale, const float* q,
                      std::span<const HeadKv> kv, std::span<const AttentionPartial> extra, float* out,
                      float* lse = nullptr, std::span<float> slot_weights = {});

}  // namespace sparsekv
