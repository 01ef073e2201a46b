// Regressions of issue 12 (facade correctness), one or more per bug; each
// failed on the tree before its fix.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "sparsekv/core/numeric.hpp"
#include "sparsekv/policy/quest.hpp"
#include "sparsekv/policy/retroinfer.hpp"
#include "sparsekv/sparsekv.hpp"
#include "test_support.hpp"

using namespace sparsekv;

namespace {

// Tiers for two requests of up to `request_tokens` tokens, with room for
// RetroInfer's mandatory pages (up to one page per token); max_context_tokens
// sizes the per-head GPU slot maximum to match.
Config small_config(const ModelShape& shape, std::uint32_t page_tokens, std::uint32_t request_tokens) {
  Config c;
  c.page_tokens = page_tokens;
  c.max_requests = 2;
  c.max_context_tokens = std::max(request_tokens, 2048u);
  c.min_buffer_ratio = 1.0;
  const std::size_t page = c.page_bytes(shape);
  const std::size_t heads = std::size_t{2} * shape.layers * shape.kv_heads;
  c.cpu_tier_bytes = heads * (2 * std::size_t{request_tokens} + 8) * page;
  c.gpu_tier_bytes = heads * (3 * std::size_t{request_tokens} + 8) * page;
  c.host_chunk_bytes = 64 * page;
  return c;
}

std::vector<float> normal_values(std::mt19937& rng, std::size_t n, float mean = 0.0f) {
  std::normal_distribution<float> normal(mean, 1.0f);
  std::vector<float> out(n);
  for (float& x : out) x = normal(rng);
  return out;
}

}  // namespace

TEST_CASE("Facade: ManagerStats::pages_saved counts pages, one per kv head, like BufferStats", "[facade]") {
  constexpr ModelShape shape{2, 8, 4, 16, DType::f32};
  RuntimeManager manager(shape, small_config(shape, 8, 64), make_policy("dense", 64));
  std::mt19937 rng(7);
  const std::vector<float> k = normal_values(rng, 8 * 64), v = normal_values(rng, 8 * 64);
  const std::vector<float> q = normal_values(rng, 8 * 16);
  std::vector<float> out(8 * 16);
  manager.add_request(1, 64);
  for (std::uint32_t l = 0; l < 2; ++l) manager.prefill(1, l, k.data(), v.data(), 1);
  for (std::uint32_t t = 1; t <= 8; ++t) {  // the 8th decode fills the tail page of each layer
    for (std::uint32_t l = 0; l < 2; ++l) {
      manager.decode(std::vector<RequestId>{1}, l, q.data(), k.data() + (t % 8) * 64, v.data() + (t % 8) * 64,
                     out.data());
    }
  }
  REQUIRE(manager.buffer().stats().pages_saved == 8);  // 2 layers x 4 kv heads
  REQUIRE(manager.stats().pages_saved == manager.buffer().stats().pages_saved);
}

