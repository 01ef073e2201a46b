#pragma once
// The running state of a numerically stable softmax-weighted sum (online
// softmax / log-sum-exp): max score m, sum of exp(score - m) s, and the
// exp-weighted value accumulator o (not yet divided by s). Partial results
// over disjoint key sets -- split-K chunks, the resident tail, or a policy's
// estimated term (RetroInfer §4.2 estimation zone) -- merge exactly.
//
// The per-element rules (fold one score, merge two states, rescale an
// accumulator element, finish) are SPARSEKV_HOST_DEVICE functions on plain
// floats: the host backend (AttentionPartial, decode_attention) and the CUDA
// split-K kernel (sparse_decode_attention_cuda.hpp) run the same code, so CI
// tests what the GPU computes. fmt-free and container-free up to
// AttentionPartial, which is host-only.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

#include "sparsekv/core/host_device.hpp"

namespace sparsekv {

inline constexpr float kNegativeInfinity = -std::numeric_limits<float>::infinity();

// (m, s) of one head; the caller keeps the head_dim accumulator elements.
// Empty (no key folded, or only zero weights) is s == 0, m == -inf.
struct SoftmaxState {
  float max = kNegativeInfinity;
  float sum = 0.0f;
};

// How one accumulator element changes in a fold or merge:
// acc' = acc * acc_scale + value * value_weight (see softmax_rescale_add).
struct RescaleStep {
  float acc_scale = 1.0f;
  float value_weight = 0.0f;
};

SPARSEKV_HOST_DEVICE inline float softmax_exp(float x) {
#if defined(__CUDA_ARCH__)
  return ::expf(x);
#else
  return std::exp(x);
#endif
}

SPARSEKV_HOST_DEVICE inline float softmax_log(float x) {
#if defined(__CUDA_ARCH__)
  return ::logf(x);
#else
  return std::log(x);
#endif
}

SPARSEKV_HOST_DEVICE inline bool softmax_empty(SoftmaxState s) { return s.sum == 0.0f; }

// Adds `weight` keys sharing one score (weight 1 for a single key): s +=
// weight * e^(score - m), and the returned step adds e^(score - m) * value to
// each accumulator element (RetroInfer eqs. 2-4: a cluster of size w
// estimated by its centroid score carries w times the mass and its summed
// values). A non-positive weight or a -inf score adds nothing.
SPARSEKV_HOST_DEVICE inline RescaleStep softmax_fold(SoftmaxState& s, float score, float weight) {
  if (!(weight > 0.0f) || score == kNegativeInfinity) return {1.0f, 0.0f};
  const bool new_max = score > s.max;
  // The old mass is rescaled only when the max moves; e^(-inf) = 0 when s was empty.
  const float acc_scale = new_max ? softmax_exp(s.max - score) : 1.0f;
  const float m = new_max ? score : s.max;
  const float e = softmax_exp(score - m);
  s.sum = s.sum * acc_scale + weight * e;
  s.max = m;
  return {acc_scale, e};
}

// Folds a tile of n scores at once (the CUDA split kernel's rule: one
// rescale per tile instead of one per score): m' = max(m, the tile's max),
// the earlier mass scaled by e^(m - m') once, and each score adds
// weights[j] = e^(score_j - m') (exactly 0 for a -inf score: an unused or
// dead slot). Returns that scale: the caller scales each accumulator element
// by it once (softmax_rescale_tile) and adds weights[j] * value_j for each
// nonzero weight, in j order. A tile of only -inf scores
// changes nothing (scale 1, weights 0); a NaN score makes the state NaN, as
// softmax_fold does. weights may alias scores.
SPARSEKV_HOST_DEVICE inline float softmax_fold_tile(SoftmaxState& s, const float* scores, std::uint32_t n,
                                                    float* weights) {
  float tile_max = kNegativeInfinity;
  for (std::uint32_t j = 0; j < n; ++j) tile_max = !(scores[j] <= tile_max) ? scores[j] : tile_max;
  if (tile_max == kNegativeInfinity) {
    for (std::uint32_t j = 0; j < n; ++j) weights[j] = 0.0f;
    return 1.0f;
  }
  const float m = s.max > tile_max ? s.max : tile_max;
  const float scale = softmax_exp(s.max - m);  // 0 for an empty state (m finite)
  float sum = s.sum * scale;
  for (std::uint32_t j = 0; j < n; ++j) {
    weights[j] = softmax_exp(scores[j] - m);
    sum += weights[j];
  }
  s.sum = sum;
  s.max = m;
  return scale;
}

// An accumulator element scaled by a tile's fold: a scale of 0 (the state
// was empty) clears it whatever it held, as softmax_rescale_add does.
SPARSEKV_HOST_DEVICE inline float softmax_rescale_tile(float acc, float scale) {
  return scale == 0.0f ? 0.0f : acc * scale;
}

// Merges `other` (a disjoint key set) into `s`; the returned step combines
// the accumulators: acc * acc_scale + other_acc * value_weight. An empty side
// gets weight exactly 0 and the other side exactly 1, so merging with an
// empty state changes nothing.
SPARSEKV_HOST_DEVICE inline RescaleStep softmax_merge(SoftmaxState& s, SoftmaxState other) {
  if (softmax_empty(other)) return {1.0f, 0.0f};
  if (softmax_empty(s)) {
    s = other;
    return {0.0f, 1.0f};
  }
  const float m = s.max > other.max ? s.max : other.max;
  const float a = softmax_exp(s.max - m);
  const float b = softmax_exp(other.max - m);
  s.sum = s.sum * a + other.sum * b;
  s.max = m;
  return {a, b};
}

// One accumulator element after a fold or merge step. A side weighted 0 is
// skipped, not multiplied: an empty side's accumulator may be unwritten or
// infinite, and 0 * inf would turn the result into NaN.
SPARSEKV_HOST_DEVICE inline float softmax_rescale_add(float acc, RescaleStep step, float value) {
  if (step.value_weight == 0.0f) return acc * step.acc_scale;
  if (step.acc_scale == 0.0f) return value * step.value_weight;
  return acc * step.acc_scale + value * step.value_weight;
}

// log of the total softmax mass in score units (the logsumexp of the
// scores); -inf for an empty state.
SPARSEKV_HOST_DEVICE inline float softmax_lse(SoftmaxState s) {
  return softmax_empty(s) ? kNegativeInfinity : s.max + softmax_log(s.sum);
}

// One output element: acc / s, 0 for an empty state (attended to nothing).
SPARSEKV_HOST_DEVICE inline float softmax_output(float acc, SoftmaxState s) {
  return softmax_empty(s) ? 0.0f : acc / s.sum;
}

// The softmax probability of one key: e^(score - lse), where lse is the
// head's softmax_lse over all it attended to. 0 when the head attended to
// nothing (lse -inf) and for an absent key (score -inf).
SPARSEKV_HOST_DEVICE inline float softmax_weight(float score, float lse) {
  return lse == kNegativeInfinity ? 0.0f : softmax_exp(score - lse);
}

// What one key weighs for a GQA group (H2O's accumulated attention, summed
// over the q heads sharing a kv head): the sum of softmax_weight over the
// group's `group` q heads, scores[j] and lse[j] being q head j's, in head order.
SPARSEKV_HOST_DEVICE inline float softmax_group_weight(const float* scores, const float* lse, std::uint32_t group) {
  float w = 0.0f;
  for (std::uint32_t j = 0; j < group; ++j) w += softmax_weight(scores[j], lse[j]);
  return w;
}

// Host container over the rules above: one head's state with its accumulator.
struct AttentionPartial {
  float max = kNegativeInfinity;
  float sum = 0.0f;        // sum of exp(score - max)
  std::vector<float> acc;  // sum of exp(score - max) * value, head_dim entries

  AttentionPartial() = default;
  explicit AttentionPartial(std::uint32_t head_dim) : acc(head_dim, 0.0f) {}

  bool empty() const { return sum == 0.0f; }
  SoftmaxState state() const { return {max, sum}; }

  // Adds `weight` keys that share one score and the sum of their values
  // (softmax_fold); value_sum holds acc.size() entries.
  void add(float score, float weight, const float* value_sum) {
    SoftmaxState s = state();
    const RescaleStep step = softmax_fold(s, score, weight);
    max = s.max;
    sum = s.sum;
    if (step.value_weight == 0.0f && step.acc_scale == 1.0f) return;
    for (std::size_t d = 0; d < acc.size(); ++d) acc[d] = softmax_rescale_add(acc[d], step, value_sum[d]);
  }

  // Merges a partial over a disjoint key set (softmax_merge). An empty
  // partial takes the other's accumulator size, so a default-constructed one
  // can collect any head.
  void merge(const AttentionPartial& other) {
    if (other.empty()) return;
    if (empty() && acc.size() != other.acc.size()) acc.assign(other.acc.size(), 0.0f);
    SoftmaxState s = state();
    const RescaleStep step = softmax_merge(s, other.state());
    max = s.max;
    sum = s.sum;
    for (std::size_t d = 0; d < acc.size(); ++d) acc[d] = softmax_rescale_add(acc[d], step, other.acc[d]);
  }

  // log of the total softmax mass (in score units): logsumexp of the scores, -inf when empty.
  float log_sum_exp() const { return softmax_lse(state()); }

  void write_output(float* out) const {
    for (std::size_t d = 0; d < acc.size(); ++d) out[d] = softmax_output(acc[d], state());
  }
};

}  // namespace sparsekv
