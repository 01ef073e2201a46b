#pragma once
// What the device-tensor decode tests share, in CI
// (test_device_decode_rules.cpp, against the emulated runtime) and on a GPU
// (gpu/test_device_decode_cuda.cpp): the model shape, bf16 data, and a
// RetroInfer that updates its index often.
#include <cstddef>
#include <cstdint>
#include <random>
#include <vector>

#include "sparsekv/core/model_shape.hpp"
#include "sparsekv/core/numeric.hpp"
#include "sparsekv/policy/retroinfer.hpp"

namespace sparsekv::test {

inline ModelShape device_shape() {
  ModelShape s;
  s.layers = 3;
  s.q_heads = 8;
  s.kv_heads = 2;
  s.head_dim = 64;
  s.dtype = DType::bf16;
  return s;
}

inline std::vector<std::uint16_t> random_bf16(std::size_t n, std::mt19937& rng) {
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<std::uint16_t> out(n);
  for (auto& x : out) x = float_to_bf16(d(rng));
  return out;
}

// RetroInfer with short index updates (every 3 pages of 16 tokens) and a
// two-page window, so a run regroups often; prompts under 4 + 32 + 16 tokens
// keep their whole tail as the window until the first update.
inline RetroInferPolicy::Options frequent_update_retroinfer(std::uint32_t budget_tokens, bool estimation) {
  RetroInferPolicy::Options o;
  o.budget_tokens = budget_tokens;
  o.segment_tokens = 128;
  o.tokens_per_cluster = 16;
  o.kmeans_iterations = 3;
  o.window_tokens = 32;
  o.update_tokens = 48;
  o.retrieval_fraction = 0.1f;
  o.estimation_fraction = 0.3f;
  o.estimation = estimation;
  return o;
}

}  // namespace sparsekv::test
