#pragma once
// Per-candidate rules of the Select stage (Spin §4.1) that the host policies
// and the CUDA kernels (cuda/policy/select_kernels.cu) both call, so both
// backends choose the same partitions bit for bit:
//  - Quest (Tang et al. 2024): a partition's logit from its key box, ranked
//    by the group-summed softmax (RetroInfer's GQA rank);
//  - ShadowKV (Sun et al. 2024; Spin §4.2): the landmark logit, its softmax
//    over the non-static pages, the recent window;
//  - StreamingWindow (StreamingLLM) and Dense: the sink pages and the recent
//    window, positional (no summaries);
//  - RetroInfer (Chen et al. 2025, §4.2): the centroid logit, the group-summed
//    softmax rank (softmax_rank_add), the steady zone, the retrieval and
//    estimation zones' fills, and the estimation zone's fold (eqs. 2-4) that
//    attend() and the estimate kernel share;
//  - the ranking key (descending score, ties to the lower index: top_k's
//    order) and the greedy fills over the ranked list.
//
// What bit identity needs beyond summary_rules.hpp's single roundings:
//  - exp: std::exp and CUDA's expf differ in the last bit, so both sides call
//    portable_exp (Cody-Waite reduction and a degree-7 polynomial, every step
//    one rounding);
//  - sums over candidates: element i goes to lane i % kSumLanes, each lane
//    adds its elements in index order, then the lanes combine by
//    tree_combine: what one warp does with a strided loop and __shfl_down;
//  - max over candidates: the std::max fold from -inf; partials of a parallel
//    max never hold NaN, so any merge order gives the same value up to the
//    sign of a zero, which exp(x - max) does not see.
//
// fmt-free and free of CUDA headers: kernel translation units include it.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "sparsekv/attention/attention_partial.hpp"
#include "sparsekv/core/host_device.hpp"
#include "sparsekv/core/numeric.hpp"
#include "sparsekv/policy/summary_rules.hpp"

namespace sparsekv {

// ---- exp ---------------------------------------------------------------------

// exp(x) within 2 ulp of the true value on [-103.9, 88.7] (tests/policy/test_select_rules.cpp),
// the same bits on host and device. 0 below, inf above, NaN for NaN.
SPARSEKV_HOST_DEVICE inline float portable_exp(float x) {
  if (x != x) return x;
  if (x > 88.72283f) return std::numeric_limits<float>::infinity();
  if (x < -103.972084f) return 0.0f;
  // k = round(x / ln 2) by the 1.5 * 2^23 trick (|x / ln 2| < 2^22), r = x - k ln 2
  // with ln 2 split so that k * kLn2Hi is exact.
  constexpr float kMagic = 12582912.0f;
  constexpr float kLn2Hi = 0.693145751953125f;
  constexpr float kLn2Lo = 1.42860677e-06f;
  const float k = add_rn(add_rn(mul_rn(x, 1.44269502f), kMagic), -kMagic);
  const float r = add_rn(add_rn(x, -mul_rn(k, kLn2Hi)), -mul_rn(k, kLn2Lo));
  // Taylor to degree 7 on |r| <= 0.35: truncation below 1e-8 relative.
  float p = 1.98412698e-4f;
  p = add_rn(mul_rn(p, r), 1.38888889e-3f);
  p = add_rn(mul_rn(p, r), 8.33333333e-3f);
  p = add_rn(mul_rn(p, r), 4.16666667e-2f);
  p = add_rn(mul_rn(p, r), 1.66666667e-1f);
  p = add_rn(mul_rn(p, r), 0.5f);
  p = add_rn(mul_rn(p, r), 1.0f);
  p = add_rn(mul_rn(p, r), 1.0f);
  const int n = static_cast<int>(k);
  if (n > 127) return mul_rn(mul_rn(p, 0x1p127f), 2.0f);
  if (n >= -126) return mul_rn(p, bits_float(static_cast<std::uint32_t>(n + 127) << 23));
  // Subnormal results: scale in two steps, each exact but the last.
  return mul_rn(mul_rn(p, bits_float(static_cast<std::uint32_t>(n + 64 + 127) << 23)), 0x1p-64f);
}

// ---- sums and maxima over candidates ------------------------------------------

inline constexpr std::uint32_t kSumLanes = 32;

// Combines the lane partials in place; the sum ends in lanes[0]. Lane l adds
// lane l + offset for offset 16, 8, 4, 2, 1: a warp's __shfl_down tree.
template <class T>
SPARSEKV_HOST_DEVICE inline T tree_combine(T* lanes) {
  for (std::uint32_t offset = kSumLanes / 2; offset > 0; offset /= 2) {
    for (std::uint32_t l = 0; l < offset; ++l) lanes[l] = lanes[l] + lanes[l + offset];
  }
  return lanes[0];
}

// The ordered sum of value(i) over the i in [0, n) with include(i): the
// reference form of the lane rule (a kernel runs the lanes in parallel).
template <class T, class Value, class Include>
T lane_sum(std::uint32_t n, Value&& value, Include&& include) {
  T lanes[kSumLanes] = {};
  for (std::uint32_t i = 0; i < n; ++i) {
    if (include(i)) lanes[i % kSumLanes] = lanes[i % kSumLanes] + value(i);
  }
  return tree_combine(lanes);
}

// std::max(current, x): a NaN x is ignored.
SPARSEKV_HOST_DEVICE inline float fold_max_score(float current, float x) { return current < x ? x : current; }

// ---- ranking -----------------------------------------------------------------

// An unsigned image of a score, larger for a larger score; -0 and +0 tie (as
// top_k's == does) and NaN ranks below -inf.
SPARSEKV_HOST_DEVICE inline std::uint32_t score_order_bits(float s) {
  // Without branches (random signs would mispredict half the time): a
  // negative score's bits flipped, a positive's sign bit set.
  const std::uint32_t u = float_bits(s) & (s == 0.0f ? 0u : ~0u);
  const std::uint32_t flip = (0u - (u >> 31)) | 0x80000000u;
  return s != s ? 0u : u ^ flip;
}

// Ascending keys rank candidates best first: descending score in the high
// half, ties to the lower candidate index in the low half. Keys are distinct.
SPARSEKV_HOST_DEVICE inline std::uint64_t rank_key(float score, std::uint32_t index) {
  return (std::uint64_t{~score_order_bits(score)} << 32) | index;
}
SPARSEKV_HOST_DEVICE inline std::uint32_t rank_key_index(std::uint64_t key) { return static_cast<std::uint32_t>(key); }

// Radix select of a kernel tile (most significant digit first): given the
// histogram of the next digit over the keys that share the prefix chosen so
// far, picks the digit holding the `needed`-th smallest of them (1-based) and
// leaves in `needed` its rank inside that digit's bucket.
inline constexpr std::uint32_t kRadixBits = 8;
inline constexpr std::uint32_t kRadixBins = 1u << kRadixBits;

SPARSEKV_HOST_DEVICE inline std::uint32_t pick_digit(const std::uint32_t* histogram, std::uint32_t& needed) {
  std::uint32_t digit = 0;
  while (histogram[digit] < needed) needed -= histogram[digit++];
  return digit;
}

// The tile threshold of a kernel's ranking round: the key of rank `needed`
// among the keys left (all distinct), found one 8-bit digit per pass, most
// significant first. A pass histograms the digit() of the keys that
// matches(); step() picks the digit. When the whole picked bucket is needed
// the search ends early: threshold() then covers every key with the prefix.
struct TileThreshold {
  std::uint64_t prefix = 0;
  std::uint32_t needed = 0;
  std::uint32_t shift = 64;  // bits below the digits chosen so far
  bool done = false;

  SPARSEKV_HOST_DEVICE bool matches(std::uint64_t key) const {
    return shift == 64 || (key >> shift) == (prefix >> shift);
  }
  SPARSEKV_HOST_DEVICE std::uint32_t digit(std::uint64_t key) const {
    return static_cast<std::uint32_t>(key >> (shift - kRadixBits)) & (kRadixBins - 1);
  }
  SPARSEKV_HOST_DEVICE void step(const std::uint32_t* histogram) {
    shift -= kRadixBits;
    const std::uint32_t d = pick_digit(histogram, needed);
    prefix |= std::uint64_t{d} << shift;
    done = histogram[d] == needed || shift == 0;
  }
  SPARSEKV_HOST_DEVICE std::uint64_t threshold() const {
    return shift == 0 ? prefix : prefix | ((std::uint64_t{1} << shift) - 1);
  }
};

// Where element j of `count` ids, sorted in runs of `tile` (ids distinct),
// lands in the merged order: its place in its run plus the smaller ids of
// every other run (binary search).
SPARSEKV_HOST_DEVICE inline std::uint32_t merged_position(const std::uint32_t* runs, std::uint32_t count,
                                                          std::uint32_t tile, std::uint32_t j) {
  const std::uint32_t own = j / tile;
  const std::uint32_t id = runs[j];
  std::uint32_t position = j - own * tile;
  for (std::uint32_t first = 0; first < count; first += tile) {
    if (first == own * tile) continue;
    std::uint32_t lo = 0;
    std::uint32_t hi = count - first < tile ? count - first : tile;
    while (lo < hi) {
      const std::uint32_t mid = (lo + hi) / 2;
      if (runs[first + mid] < id) {
        lo = mid + 1;
      } else {
        hi = mid;
      }
    }
    position += lo;
  }
  return position;
}

// ---- greedy fills over the ranked list -------------------------------------------

enum class Fill : std::uint8_t { take, skip, stop };

// Quest and ShadowKV: stop once `limit` are taken or no budget is left, skip
// what does not fit.
struct SkipFill {
  std::int64_t left = 0;
  std::uint32_t limit = std::numeric_limits<std::uint32_t>::max();

  SPARSEKV_HOST_DEVICE Fill offer(std::uint32_t tokens) {
    if (limit == 0 || left <= 0) return Fill::stop;
    if (tokens > left) return Fill::skip;
    left -= tokens;
    --limit;
    return Fill::take;
  }
  // Whether no offer from now on takes, when no candidate left is smaller
  // than `smallest` tokens (a budget left smaller than every page would skip
  // them all).
  SPARSEKV_HOST_DEVICE bool full(std::uint32_t smallest) const {
    return limit == 0 || left <= 0 || left < std::int64_t{smallest};
  }
  // At most this many offers take, when no candidate is smaller than
  // `smallest` (> 0) tokens.
  SPARSEKV_HOST_DEVICE std::uint64_t most_takes(std::uint32_t smallest) const {
    const std::uint64_t fit = left <= 0 ? 0 : static_cast<std::uint64_t>(left) / smallest;
    return fit < limit ? fit : limit;
  }
};

// RetroInfer: the first `limit` ranked, in order, stopping at the first that
// does not fit (so what it takes is always a prefix of the rank).
struct BreakFill {
  std::uint64_t used = 0;
  std::uint32_t budget = 0;
  std::uint32_t limit = 0;

  SPARSEKV_HOST_DEVICE Fill offer(std::uint32_t tokens) {
    if (limit == 0 || used + tokens > budget) return Fill::stop;
    used += tokens;
    --limit;
    return Fill::take;
  }
  SPARSEKV_HOST_DEVICE bool full(std::uint32_t smallest) const { return limit == 0 || used + smallest > budget; }
  SPARSEKV_HOST_DEVICE std::uint64_t most_takes(std::uint32_t smallest) const {
    const std::uint64_t fit = used >= budget ? 0 : (budget - used) / smallest;
    return fit < limit ? fit : limit;
  }
};

// Candidates ranked in ranked_fill's first round, at least.
inline constexpr std::size_t kFirstRankRound = 64;

// The host form of a ranked fill: offers the candidates [0, n) with
// eligible(i), best first by rank_key(score(i), i), until the fill stops;
// take(i) for each taken.
template <class Filler, class Score, class Eligible, class Tokens, class Take>
void ranked_fill(std::uint32_t n, Filler& fill, Score&& score, Eligible&& eligible, Tokens&& tokens, Take&& take) {
  thread_local std::vector<std::uint64_t> keys;  // Select runs on the engine's threads, a head each
  keys.resize(n);
  std::size_t eligible_keys = 0;
  std::uint32_t smallest = std::numeric_limits<std::uint32_t>::max();  // tokens of the smallest candidate
  for (std::uint32_t i = 0; i < n; ++i) {                              // no branch: an ineligible key is overwritten
    keys[eligible_keys] = rank_key(score(i), i);
    const bool counts = eligible(i);
    const std::uint32_t t = tokens(i);
    smallest = counts && t < smallest ? t : smallest;
    eligible_keys += counts ? 1 : 0;
  }
  keys.resize(eligible_keys);
  // Rounds: the best `round` keys left, found as the kernels find a tile's
  // (TileThreshold: a histogram pass per 8-bit digit, no comparisons to
  // mispredict), moved to the front, sorted and offered; the next round
  // (doubling) starts only if the fill can still take something (skips left
  // it short), and the offers end once nothing left would fit (a budget left
  // below the smallest candidate: the rest would all be skipped). Keys are
  // distinct, so the order offered is exactly the full sort's.
  auto first = keys.begin();
  // The first round holds every key the fill could take, unless skips
  // intervene: one threshold search, not one per doubling.
  std::size_t round = kFirstRankRound;
  if (smallest != 0 && smallest != std::numeric_limits<std::uint32_t>::max()) {
    while (round < fill.most_takes(smallest) && round < keys.size()) round *= 2;
  }
  while (first != keys.end() && !fill.full(smallest)) {
    auto end = keys.end();
    if (keys.end() - first > static_cast<std::ptrdiff_t>(round)) {
      TileThreshold t{0, static_cast<std::uint32_t>(round)};
      std::uint32_t histogram[kRadixBins];
      while (!t.done) {
        std::fill_n(histogram, kRadixBins, 0u);
        for (auto k = first; k != keys.end(); ++k) histogram[t.digit(*k)] += t.matches(*k) ? 1 : 0;
        t.step(histogram);
      }
      const std::uint64_t threshold = t.threshold();  // exactly `round` keys are <= it
      end = std::partition(first, keys.end(), [&](std::uint64_t k) { return k <= threshold; });
    }
    std::sort(first, end);
    for (; first != end && !fill.full(smallest); ++first) {
      const std::uint32_t i = rank_key_index(*first);
      const Fill f = fill.offer(tokens(i));
      if (f == Fill::stop) return;
      if (f == Fill::take) take(i);
    }
    round *= 2;
  }
}

// ---- Quest -------------------------------------------------------------------

// A sum over the dimensions d < head_dim of term(d) in eight interleaved
// lanes (lane j takes dimensions j, j + 8, ... of the whole blocks of eight),
// lanes j and j + 4 added, then (0 + 2) + (1 + 3), then the tail in order:
// the host's SIMD order, kept because it vectorises.
template <class Term>
SPARSEKV_HOST_DEVICE inline float lane_order_sum(std::uint32_t head_dim, Term&& term) {
  float lanes[8] = {};
  std::uint32_t d = 0;
  for (; d + 8 <= head_dim; d += 8) {
    for (std::uint32_t j = 0; j < 8; ++j) lanes[j] = add_rn(lanes[j], term(d + j));
  }
  float half[4];
  for (std::uint32_t j = 0; j < 4; ++j) half[j] = add_rn(lanes[j], lanes[j + 4]);
  float sum = add_rn(add_rn(half[0], half[2]), add_rn(half[1], half[3]));
  for (; d < head_dim; ++d) sum = add_rn(sum, term(d));
  return sum;
}

// Quest's page logit for one q head, scaled like an attention logit: per
// dimension q_d times the centre of [min_d, max_d] plus `spread` times |q_d|
// times its half-width, summed in lane order, times `scale`. spread = 1 is
// the paper's bound on q.k over the keys inside the box (sum_d max(q_d min_d,
// q_d max_d), up to rounding); spread = 0 scores the box's centre.
// The halves are taken from q, not from the box: (q / 2)(min + max) +
// (spread |q| / 2)(max - min), so that a kernel computes q's factors once
// for all the boxes (two multiplies a dimension and head, not five). For a
// power-of-two spread (the default 0.5, the paper's 1) this is the
// centre / half-width form bit for bit but below 2^-125, where halving
// rounds.
struct QuestHalves {
  float half;        // q / 2
  float reach_half;  // spread |q| / 2
};
SPARSEKV_HOST_DEVICE inline QuestHalves quest_halves(float q, float spread) {
  return {mul_rn(q, 0.5f), mul_rn(mul_rn(spread, q < 0.0f ? -q : q), 0.5f)};
}
SPARSEKV_HOST_DEVICE inline float quest_term(QuestHalves f, float lo, float hi) {
  return add_rn(mul_rn(f.half, add_rn(lo, hi)), mul_rn(f.reach_half, add_rn(hi, -lo)));
}
SPARSEKV_HOST_DEVICE inline float quest_logit(const float* q, const float* min, const float* max,
                                              std::uint32_t head_dim, float spread, float scale) {
  const float sum =
      lane_order_sum(head_dim, [&](std::uint32_t d) { return quest_term(quest_halves(q[d], spread), min[d], max[d]); });
  return mul_rn(sum, scale);
}

// ---- one candidate's logits for a GQA group, in one pass ---------------------
// What the GPU's logits kernel runs (a thread a candidate): each head's
// arithmetic is quest_logit's / shadowkv_logit's step for step, but
// kLogitHeads heads share each pass over the candidate's summary row, so the
// row is read once for up to kLogitHeads heads instead of once a head. The
// kernel holds a piece of kLogitPiece dimensions of its candidates' rows at a
// time (QuestGroupLogits / ShadowKVGroupLogits take the row piece by piece);
// the sums carry from piece to piece, so any cut gives the same bits.
// q: [count][head_dim]; emit(h, logit) for h < count.
inline constexpr std::uint32_t kLogitHeads = 4;
inline constexpr std::uint32_t kLogitPiece = 32;  // a multiple of lane_order_sum's 8 lanes

// lane_order_sum of term(h, d) for the heads h < kLogitHeads at once, in
// pieces: add() the whole blocks of eight in [d0, d1) (d0 a multiple of 8),
// in order, then finish() reduces the lanes and adds the dimensions past
// the last whole block.
struct LaneOrderSums {
  float lanes[kLogitHeads][8] = {};
  template <class Term>
  SPARSEKV_HOST_DEVICE void add(std::uint32_t d0, std::uint32_t d1, Term&& term) {
    for (std::uint32_t d = d0; d + 8 <= d1; d += 8) {
      for (std::uint32_t j = 0; j < 8; ++j) {
        for (std::uint32_t h = 0; h < kLogitHeads; ++h) lanes[h][j] = add_rn(lanes[h][j], term(h, d + j));
      }
    }
  }
  template <class Term>
  SPARSEKV_HOST_DEVICE void finish(std::uint32_t head_dim, Term&& term, float* sums) const {
    for (std::uint32_t h = 0; h < kLogitHeads; ++h) {
      float half[4];
      for (std::uint32_t j = 0; j < 4; ++j) half[j] = add_rn(lanes[h][j], lanes[h][j + 4]);
      sums[h] = add_rn(add_rn(half[0], half[2]), add_rn(half[1], half[3]));
    }
    for (std::uint32_t d = head_dim / 8 * 8; d < head_dim; ++d) {
      for (std::uint32_t h = 0; h < kLogitHeads; ++h) sums[h] = add_rn(sums[h], term(h, d));
    }
  }
};

// The q rows of heads [h0, h0 + kLogitHeads), the heads past `count` reading head h0's.
struct LogitHeads {
  const float* q[kLogitHeads];
  SPARSEKV_HOST_DEVICE LogitHeads(const float* queries, std::uint32_t count, std::uint32_t h0, std::uint32_t head_dim) {
    for (std::uint32_t h = 0; h < kLogitHeads; ++h) {
      q[h] = queries + std::size_t{h0 + (h0 + h < count ? h : 0)} * head_dim;
    }
  }
};

// quest_logit of heads [h0, h0 + kLogitHeads) of `count`, the row taken in
// pieces [d0, d1) cut at multiples of 8, in order: min / max point at the
// piece's first dimension (min[d - d0]). finish() takes the last piece.
struct QuestGroupLogits {
  LogitHeads heads;
  float spread, scale;
  LaneOrderSums sums;
  SPARSEKV_HOST_DEVICE QuestGroupLogits(const float* q, std::uint32_t count, std::uint32_t h0, std::uint32_t head_dim,
                                        float spread_, float scale_)
      : heads(q, count, h0, head_dim), spread(spread_), scale(scale_) {}
  SPARSEKV_HOST_DEVICE void add(const float* min, const float* max, std::uint32_t d0, std::uint32_t d1) {
    sums.add(d0, d1, [&](std::uint32_t h, std::uint32_t d) {
      return quest_term(quest_halves(heads.q[h][d], spread), min[d - d0], max[d - d0]);
    });
  }
  template <class Emit>
  SPARSEKV_HOST_DEVICE void finish(const float* min, const float* max, std::uint32_t d0, std::uint32_t head_dim,
                                   std::uint32_t count, std::uint32_t h0, Emit&& emit) const {
    float total[kLogitHeads];
    sums.finish(
        head_dim,
        [&](std::uint32_t h, std::uint32_t d) {
          return quest_term(quest_halves(heads.q[h][d], spread), min[d - d0], max[d - d0]);
        },
        total);
    for (std::uint32_t h = 0; h < kLogitHeads && h0 + h < count; ++h) emit(h0 + h, mul_rn(total[h], scale));
  }
};

template <class Emit>
SPARSEKV_HOST_DEVICE inline void quest_group_logits(const float* q, std::uint32_t count, const float* min,
                                                    const float* max, std::uint32_t head_dim, float spread, float scale,
                                                    Emit&& emit) {
  for (std::uint32_t h0 = 0; h0 < count; h0 += kLogitHeads) {
    QuestGroupLogits group(q, count, h0, head_dim, spread, scale);
    group.add(min, max, 0, head_dim);
    group.finish(min, max, 0, head_dim, count, h0, emit);
  }
}

// Quest's steady zone, taken before the ranked fill, each partition only if it
// fits: the newest partition (always), then the partitions holding the first
// `sink_tokens` tokens (the attention sink), then the partitions before the
// newest, newest first, until `window_tokens` more are covered. What is taken
// is [0, sinks) and [window_first, n); the fill ranks [sinks, window_first)
// with `left` tokens. tokens(i): partition i's tokens; n >= 1.
struct QuestSteady {
  std::uint32_t sinks = 0;
  std::uint32_t window_first = 0;
  std::int64_t left = 0;
};
template <class Tokens>
SPARSEKV_HOST_DEVICE QuestSteady quest_steady(std::uint32_t n, Tokens&& tokens, std::uint32_t budget_tokens,
                                              std::uint32_t sink_tokens, std::uint32_t window_tokens) {
  QuestSteady z;
  const std::uint32_t newest = n - 1;
  z.left = std::int64_t{budget_tokens} - tokens(newest);
  std::uint64_t sunk = 0;
  while (z.sinks < newest && sunk < sink_tokens && tokens(z.sinks) <= z.left) {
    sunk += tokens(z.sinks);
    z.left -= tokens(z.sinks);
    ++z.sinks;
  }
  z.window_first = newest;
  std::int64_t window = window_tokens;
  while (z.window_first > z.sinks && window > 0 && tokens(z.window_first - 1) <= z.left) {
    --z.window_first;
    window -= tokens(z.window_first);
    z.left -= tokens(z.window_first);
  }
  return z;
}

// ---- ShadowKV and RetroInfer: logits -------------------------------------------

// 1 / sqrt(head_dim), as both policies scale their logits.
SPARSEKV_HOST_DEVICE inline float logit_scale(std::uint32_t head_dim) {
  return div_rn(1.0f, sqrt_rn(static_cast<float>(head_dim)));
}

// ShadowKV: scale * (q . landmark), the dot product in dimension order.
SPARSEKV_HOST_DEVICE inline float shadowkv_logit(const float* q, const float* landmark, std::uint32_t head_dim,
                                                 float scale) {
  return mul_rn(scale, dot_in_order(q, landmark, head_dim));
}

// shadowkv_logit of heads [h0, h0 + kLogitHeads) of `count`, the landmark
// taken in pieces [d0, d1) in order (landmark[d - d0]).
struct ShadowKVGroupLogits {
  LogitHeads heads;
  float scale;
  float acc[kLogitHeads] = {};
  SPARSEKV_HOST_DEVICE ShadowKVGroupLogits(const float* q, std::uint32_t count, std::uint32_t h0,
                                           std::uint32_t head_dim, float scale_)
      : heads(q, count, h0, head_dim), scale(scale_) {}
  SPARSEKV_HOST_DEVICE void add(const float* landmark, std::uint32_t d0, std::uint32_t d1) {
    for (std::uint32_t d = d0; d < d1; ++d) {
      for (std::uint32_t h = 0; h < kLogitHeads; ++h) acc[h] = dot_step(acc[h], heads.q[h][d], landmark[d - d0]);
    }
  }
  template <class Emit>
  SPARSEKV_HOST_DEVICE void finish(std::uint32_t count, std::uint32_t h0, Emit&& emit) const {
    for (std::uint32_t h = 0; h < kLogitHeads && h0 + h < count; ++h) emit(h0 + h, mul_rn(scale, acc[h]));
  }
};

// shadowkv_logit of `count` heads (q: [count][head_dim]) in one pass over the
// landmark, kLogitHeads at a time; emit(h, logit).
template <class Emit>
SPARSEKV_HOST_DEVICE inline void shadowkv_group_logits(const float* q, std::uint32_t count, const float* landmark,
                                                       std::uint32_t head_dim, float scale, Emit&& emit) {
  for (std::uint32_t h0 = 0; h0 < count; h0 += kLogitHeads) {
    ShadowKVGroupLogits group(q, count, h0, head_dim, scale);
    group.add(landmark, 0, head_dim);
    group.finish(count, h0, emit);
  }
}

// RetroInfer: (q . centroid) * scale, the dot product in lane_order_sum's order.
SPARSEKV_HOST_DEVICE inline float retroinfer_logit(const float* q, const float* centroid, std::uint32_t head_dim,
                                                   float scale) {
  return mul_rn(lane_order_sum(head_dim, [&](std::uint32_t d) { return mul_rn(q[d], centroid[d]); }), scale);
}

// ---- ShadowKV: the recent window ------------------------------------------------

struct ShadowKVWindow {
  std::uint32_t pages = 0;  // the newest `pages` candidates
  std::int64_t left = 0;    // budget left after them
};

// The newest pages while fewer than recent_tokens tokens are covered; the
// newest is always taken, an older one only while it fits.
template <class Tokens>
SPARSEKV_HOST_DEVICE ShadowKVWindow shadowkv_window(std::uint32_t n, Tokens tokens, std::uint32_t recent_tokens,
                                                    std::uint32_t budget) {
  ShadowKVWindow w{0, budget};
  std::uint64_t covered = 0;
  for (std::uint32_t i = n; i-- > 0 && covered < recent_tokens;) {
    if (i != n - 1 && tokens(i) > w.left) break;
    w.left -= tokens(i);
    covered += tokens(i);
    ++w.pages;
  }
  return w;
}

// ShadowKV's top-k score of one q head, folded into the group's: the softmax
// of the head's logits over the candidates not taken (the max by
// fold_max_score, portable_exp(logit - max), summed in float by lane_sum),
// each untaken candidate's share div_rn(e, sum) kept in scores[i] when larger
// (fold_max_score: the max over the group). `shares` is [n] scratch; a taken
// candidate's score is not read or written. The scalar reference of
// shadowkv_head_scores_simd (select_scoring.hpp: the same bits, vectorized).
inline void shadowkv_head_scores(std::uint32_t n, const float* logits, const char* taken, float* shares,
                                 float* scores) {
  float top = kNegativeInfinity;
  for (std::uint32_t i = 0; i < n; ++i) {
    if (taken[i] == 0) top = fold_max_score(top, logits[i]);
  }
  for (std::uint32_t i = 0; i < n; ++i) shares[i] = portable_exp(add_rn(logits[i], -top));
  const auto untaken = [&](std::uint32_t i) { return taken[i] == 0; };
  const float sum = lane_sum<float>(
      n, [&](std::uint32_t i) { return shares[i]; }, untaken);
  for (std::uint32_t i = 0; i < n; ++i) {
    if (taken[i] == 0) scores[i] = fold_max_score(scores[i], div_rn(shares[i], sum));
  }
}

// ---- StreamingWindow and Dense: positional zones --------------------------------

// StreamingWindowPolicy::select's selection of one head (StreamingLLM's
// attention sinks and recent window; RetroInfer §4.2's steady zone): the sink
// candidates [0, sinks) -- the first sink_pages, oldest first, each while it
// fits the budget -- then the window [window, n): the newest candidates,
// newest first, each while it fits what is left. Dense selects everything:
// the zone {0, 0}. Either way the selection is [0, sinks) then [window, n),
// ascending, with tokens(i) the candidate's token count.
struct PositionalZone {
  std::uint32_t sinks = 0;
  std::uint32_t window = 0;  // the window is [window, n)
};

template <class Tokens>
SPARSEKV_HOST_DEVICE PositionalZone streaming_zone(std::uint32_t n, Tokens tokens, std::uint32_t sink_pages,
                                                   std::uint32_t budget) {
  PositionalZone z;
  std::uint64_t left = budget;
  const std::uint32_t sinks = sink_pages < n ? sink_pages : n;
  for (; z.sinks < sinks && tokens(z.sinks) <= left; ++z.sinks) left -= tokens(z.sinks);
  z.window = n;
  for (; z.window > z.sinks && tokens(z.window - 1) <= left; --z.window) left -= tokens(z.window - 1);
  return z;
}

// The zone's selection size and its j-th candidate (j < positional_count).
SPARSEKV_HOST_DEVICE inline std::uint32_t positional_count(PositionalZone z, std::uint32_t n) {
  return z.sinks + (n - z.window);
}
SPARSEKV_HOST_DEVICE inline std::uint32_t positional_candidate(PositionalZone z, std::uint32_t j) {
  return j < z.sinks ? j : z.window + (j - z.sinks);
}

// ---- RetroInfer: steady zone and retrieval zone ----------------------------------

// RetroInfer's budget_tokens: 0 means the caller gave none (the paper's
// fraction rule, no token cap); a budget covering a head's `tokens` selects
// every partition (Dense).
SPARSEKV_HOST_DEVICE inline bool retroinfer_covers(std::uint32_t budget, std::uint64_t tokens) {
  return budget > 0 && budget >= tokens;
}
// The tokens the steady and retrieval zones may cover: the budget, or no cap.
SPARSEKV_HOST_DEVICE inline std::uint32_t retroinfer_token_cap(std::uint32_t budget) {
  return budget > 0 ? budget : std::numeric_limits<std::uint32_t>::max();
}

// The steady zone of one head: the newest recent partitions (newest first
// while fewer than `window` tokens are covered), then the sink, all within
// the budget: a tiny budget keeps the newest tokens and drops the sinks first.
struct SteadyZone {
  bool sink = false;
  std::uint32_t window_parts = 0;
  std::uint32_t tokens = 0;
};

template <class RecentTokens>
SPARSEKV_HOST_DEVICE SteadyZone steady_zone(std::uint32_t recent, RecentTokens recent_tokens, std::uint32_t sink_tokens,
                                            std::uint32_t window, std::uint32_t budget) {
  SteadyZone s;
  std::uint32_t covered = 0;
  for (std::uint32_t i = recent; i-- > 0 && covered < window;) {
    const std::uint32_t size = recent_tokens(i);
    if (s.tokens + size > budget) break;
    covered += size;
    s.tokens += size;
    ++s.window_parts;
  }
  if (sink_tokens > 0 && s.tokens + sink_tokens <= budget) {
    s.sink = true;
    s.tokens += sink_tokens;
  }
  return s;
}

// ceil(fraction * m), clamped to [0, m]; the epsilon absorbs fp32 fractions
// (0.018f is a hair off 0.018).
SPARSEKV_HOST_DEVICE inline std::uint32_t fraction_count(double fraction, std::uint64_t m) {
#if defined(__CUDA_ARCH__)
  const double x = ceil(__dadd_rn(__dmul_rn(fraction, static_cast<double>(m)), -1e-6));
#else
  const double x = std::ceil(fraction * static_cast<double>(m) - 1e-6);
#endif
  if (x <= 0.0) return 0;
  return static_cast<std::uint32_t>(x < static_cast<double>(m) ? x : static_cast<double>(m));
}

// The GQA rank Quest and RetroInfer share: a candidate's rank is the sum
// over the group's q heads of its softmax over the candidates' logits, the
// heads added in order with add_rn. One head's share: exp(logit - max) / sum,
// with the max by fold_max_score, the sum of portable_exp(logit - max) in
// double by lane_sum (a kernel: block max, warp-0 lane sum).
SPARSEKV_HOST_DEVICE inline float softmax_share(float logit, float max, float inverse_sum) {
  return mul_rn(portable_exp(add_rn(logit, -max)), inverse_sum);
}

SPARSEKV_HOST_DEVICE inline float softmax_inverse_sum(double sum) {
#if defined(__CUDA_ARCH__)
  return __double2float_rn(__ddiv_rn(1.0, sum));
#else
  return static_cast<float>(1.0 / sum);
#endif
}

// The host form: adds one q head's shares of logits[0, m) to rank[0, m).
// exps(bias, out) writes out[i] = portable_exp(add_rn(logits[i], bias)) for
// i < m (vectorized: select_scoring.hpp's softmax_rank_add_simd); each
// exponential serves the sum and the share (softmax_share's value).
template <class Exps>
void softmax_rank_add(std::uint32_t m, const float* logits, float* rank, Exps&& exps) {
  float max = -std::numeric_limits<float>::infinity();
  for (std::uint32_t i = 0; i < m; ++i) max = fold_max_score(max, logits[i]);
  thread_local std::vector<float> shares;
  shares.resize(m);
  exps(-max, shares.data());
  const double sum = lane_sum<double>(
      m, [&](std::uint32_t i) { return static_cast<double>(shares[i]); }, [](std::uint32_t) { return true; });
  const float inverse = softmax_inverse_sum(sum);
  for (std::uint32_t i = 0; i < m; ++i) rank[i] = add_rn(rank[i], mul_rn(shares[i], inverse));
}
inline void softmax_rank_add(std::uint32_t m, const float* logits, float* rank) {
  softmax_rank_add(m, logits, rank, [&](float bias, float* out) {
    for (std::uint32_t i = 0; i < m; ++i) out[i] = portable_exp(add_rn(logits[i], bias));
  });
}

// The retrieval zone's fill over the m ranked candidates after a steady zone
// of `steady_tokens`: with a budget, the best-ranked while they fit in what
// the steady zone leaves (a caller's budget is spent, whatever the context);
// without one (0), the top retrieval_fraction of them (the paper's 1.8%).
SPARSEKV_HOST_DEVICE inline BreakFill retroinfer_retrieval_fill(std::uint32_t steady_tokens, std::uint32_t budget,
                                                                float retrieval_fraction, std::uint32_t m) {
  if (budget == 0) return {steady_tokens, retroinfer_token_cap(budget), fraction_count(retrieval_fraction, m)};
  return {steady_tokens, budget, m};
}

// ---- RetroInfer: the estimation zone ---------------------------------------------

// The estimation zone's fill over the ranked candidates the selection does not
// hold: the best-ranked fraction_count(estimation_fraction, m) of them. The
// retrieval zone is a prefix of the rank (BreakFill), so with r retrieved
// these are the ranks [r, min(m, r + that)).
SPARSEKV_HOST_DEVICE inline BreakFill retroinfer_estimation_fill(float estimation_fraction, std::uint32_t m) {
  return {0, std::numeric_limits<std::uint32_t>::max(), fraction_count(estimation_fraction, m)};
}

// Eqs. 2-4: `weight` keys that share the centroid's score, folded into a q
// head's softmax state: softmax_fold's rule, but with portable_exp and one
// rounding per step (softmax_exp is std::exp on the host and expf on the
// device, and nvcc would contract the sum into an fma), so that attend() and
// the estimate kernel produce the same bits.
SPARSEKV_HOST_DEVICE inline RescaleStep estimation_fold(SoftmaxState& s, float score, float weight) {
  if (!(weight > 0.0f) || score == kNegativeInfinity) return {1.0f, 0.0f};
  const bool new_max = score > s.max;
  const float acc_scale = new_max ? portable_exp(add_rn(s.max, -score)) : 1.0f;
  const float m = new_max ? score : s.max;
  const float e = portable_exp(add_rn(score, -m));
  s.sum = add_rn(mul_rn(s.sum, acc_scale), mul_rn(weight, e));
  s.max = m;
  return {acc_scale, e};
}

// One accumulator element after an estimation_fold step (softmax_rescale_add
// with single roundings; a side weighted 0 is skipped, not multiplied).
SPARSEKV_HOST_DEVICE inline float estimation_rescale_add(float acc, RescaleStep step, float value_sum) {
  if (step.value_weight == 0.0f) return mul_rn(acc, step.acc_scale);
  if (step.acc_scale == 0.0f) return mul_rn(value_sum, step.value_weight);
  return add_rn(mul_rn(acc, step.acc_scale), mul_rn(value_sum, step.value_weight));
}

}  // namespace sparsekv
