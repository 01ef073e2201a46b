#pragma once
// The host Select's scoring, vectorized (Google Highway, runtime dispatch):
// the shared rules of select_rules.hpp computed several lanes at a time, with
// the same values bit for bit. A rule that sums in eight interleaved lanes
// (lane_order_sum: Quest) maps each of its lanes onto a vector lane, a rule
// that sums in dimension order (ShadowKV) gives each candidate a lane, and
// every step keeps the rule's single roundings (src/policy/select_scoring.cpp is built
// with -ffp-contract=off), so the CUDA kernels, the scalar rules and these
// agree on every partition a Select ranks.
#include <cstdint>

#include "sparsekv/core/dtype.hpp"

namespace sparsekv {

// quest_logit (select_rules.hpp) of boxes min / max [n][head_dim], stored in
// `dtype` (policy/box_rows.hpp) and widened exactly, for every q head g of
// the group: out[g * n + i]. Each box is read once for up to four heads.
void quest_logits_simd(const float* q, std::uint32_t group, const void* min, const void* max, DType dtype,
                       std::uint32_t n, std::uint32_t head_dim, float spread, float scale, float* out);

// shadowkv_logit (select_rules.hpp) of landmarks [n][head_dim] for every q
// head g of the group: out[g * n + i]. Each landmark is read once for up to
// four heads.
void shadowkv_logits_simd(const float* q, std::uint32_t group, const float* landmarks, std::uint32_t n,
                          std::uint32_t head_dim, float scale, float* out);

// out[i] = portable_exp(add_rn(x[i], bias)) (select_rules.hpp), bit for bit;
// out may be x.
void portable_exps(const float* x, float bias, std::uint32_t n, float* out);

// shadowkv_head_scores (select_rules.hpp), vectorized: the same shares and
// scores bit for bit.
void shadowkv_head_scores_simd(std::uint32_t n, const float* logits, const char* taken, float* shares, float* scores);

// softmax_rank_add (select_rules.hpp) with portable_exps: the same ranks.
void softmax_rank_add_simd(std::uint32_t m, const float* logits, float* rank);

}  // namespace sparsekv
