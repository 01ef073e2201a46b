#pragma once
// The running state of a numerically stable softmax-weighted sum (online
// softmax / log-sum-exp): max score m, sum of exp(score - m) s, and the
// exp-weighted value accumulator o (not yet divided by s). Partial results
// over disjoint key sets -- split-K chunks, the resident tail, or a policy's
// estimated term (RetroInfer §4.2 estimation zone) -- merge exactly.
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace sparsekv {

struct AttentionPartial {
  float max = -std::numeric_limits<float>::infinity();
  float sum = 0.0f;         // sum of exp(score - max)
  std::vector<float> acc;   // sum of exp(score - max) * value, head_dim entries

  AttentionPartial() = default;
  explicit AttentionPartial(std::uint32_t head_dim) : acc(head_dim, 0.0f) {}

  bool empty() const { return sum == 0.0f; }

  // Adds `weight` keys that share one score (weight 1 for a single key) and
  // the sum of their values: sum += weight * e^(score - max), acc += e^(score
  // - max) * value_sum (RetroInfer eqs. 2-4: a cluster of size s estimated by
  // its centroid score carries s times the mass and its summed values).
  void add(float score, float weight, const float* value_sum) {
    if (weight <= 0.0f) return;
    if (score > max) {
      const float scale = std::exp(max - score);  // 0 when max is -inf
      sum *= scale;
      for (float& a : acc) a *= scale;
      max = score;
    }
    const float e = std::exp(score - max);
    sum += weight * e;
    for (std::size_t d = 0; d < acc.size(); ++d) acc[d] += e * value_sum[d];
  }

  void merge(const AttentionPartial& other) {
    if (other.empty()) return;
    if (empty()) {
      *this = other;
      return;
    }
    const float m = std::max(max, other.max);
    const float a = std::exp(max - m);
    const float b = std::exp(other.max - m);
    sum = sum * a + other.sum * b;
    for (std::size_t d = 0; d < acc.size(); ++d) acc[d] = acc[d] * a + other.acc[d] * b;
    max = m;
  }

  // log of the total softmax mass (in score units): logsumexp of the scores.
  float log_sum_exp() const { return max + std::log(sum); }

  void write_output(float* out) const {
    for (std::size_t d = 0; d < acc.size(); ++d) out[d] = empty() ? 0.0f : acc[d] / sum;
  }
};

}  // namespace sparsekv
