#pragma once
// Random inputs and bit-exact comparison shared by the Index rules tests
// (test_index_rules.cpp) and the index kernels' GPU tests
// (gpu/test_index_cuda.cpp).
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "sparsekv/policy/sparse_attention.hpp"

namespace sparsekv::test {

inline bool same_bits(float a, float b) { return std::memcmp(&a, &b, sizeof a) == 0; }
inline bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

inline std::vector<float> random_values(std::size_t n, std::mt19937& rng, float scale = 1.0f) {
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = normal(rng);
  return v;
}

// Unit rows, as spherical_kmeans prepares them (zero rows stay zero).
inline std::vector<float> unit_rows(std::uint32_t n, std::uint32_t dim, std::mt19937& rng) {
  std::vector<float> rows = random_values(std::size_t{n} * dim, rng);
  for (std::uint32_t t = 0; t < n; ++t) {
    float* row = rows.data() + std::size_t{t} * dim;
    const float norm = std::sqrt(std::inner_product(row, row + dim, row, 0.0f));
    for (std::uint32_t d = 0; d < dim; ++d) row[d] /= norm;
  }
  return rows;
}

// `group` q heads per kv head.
inline LayerContext layer_context(std::uint32_t kv_heads, std::uint32_t head_dim, std::uint32_t page_tokens,
                                  std::uint32_t group) {
  LayerContext ctx;
  ctx.q_heads = kv_heads * group;
  ctx.kv_heads = kv_heads;
  ctx.head_dim = head_dim;
  ctx.page_tokens = page_tokens;
  return ctx;
}

inline KvView key_view(const std::vector<float>& keys, std::uint32_t tokens, const LayerContext& ctx) {
  KvView kv;
  kv.keys = keys;
  kv.tokens = tokens;
  kv.kv_heads = ctx.kv_heads;
  kv.head_dim = ctx.head_dim;
  return kv;
}

}  // namespace sparsekv::test
