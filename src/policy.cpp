#include <algorithm>
#include <numeric>

#include "sparsekv/policy/sparse_attention.hpp"

namespace sparsekv {

std::vector<std::uint32_t> top_k(std::span<const float> scores, std::uint32_t k) {
  std::vector<std::uint32_t> order(scores.size());
  std::iota(order.begin(), order.end(), 0u);
  k = std::min<std::uint32_t>(k, static_cast<std::uint32_t>(order.size()));
  const auto better = [&](std::uint32_t a, std::uint32_t b) {
    return scores[a] > scores[b] || (scores[a] == scores[b] && a < b);
  };
  std::partial_sort(order.begin(), order.begin() + k, order.end(), better);
  order.resize(k);
  return order;
}

}  // namespace sparsekv
