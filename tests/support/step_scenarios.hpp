#pragma once
// Random decode scenarios over every built-in policy, evicting ones included:
// shapes, dtypes, page sizes, request counts and step counts, and a budget per
// policy. The tests that drive two ways of running a step with identical
// calls and compare them (tests/step/test_step_threads.cpp,
// tests/facade/test_in_place_backend.cpp) share them.
#include <catch2/catch.hpp>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "sparsekv/core/numeric.hpp"
#include "sparsekv/sparsekv.hpp"

namespace sparsekv::test {

struct StepScenario {
  ModelShape shape;
  Config config;
  std::uint32_t requests = 0;
  std::uint32_t steps = 0;
};

inline StepScenario random_step_scenario(std::mt19937& rng) {
  const DType dtypes[] = {DType::f32, DType::f16, DType::bf16};
  const std::uint32_t groups[] = {1, 2, 4};
  StepScenario s;
  const auto kv_heads = static_cast<std::uint32_t>(1 + rng() % 3);
  s.shape = ModelShape{1 + static_cast<std::uint32_t>(rng() % 2), kv_heads * groups[rng() % 3], kv_heads,
                       16u << (rng() % 2), dtypes[rng() % 3]};
  s.config.page_tokens = 4u << (rng() % 3);  // 4 .. 16
  s.config.max_context_tokens = 1024;
  s.config.max_requests = 8;
  s.config.min_buffer_ratio = 1.0;
  const std::size_t heads = std::size_t{s.config.max_requests} * s.shape.layers * s.shape.kv_heads;
  const std::size_t page = s.config.page_bytes(s.shape);
  s.config.cpu_tier_bytes = s.config.gpu_tier_bytes = heads * 2 * s.config.max_pages_per_head() * page;
  s.config.host_chunk_bytes = 64 * page;
  s.requests = 1 + rng() % 4;
  s.steps = 2 * s.config.page_tokens + rng() % 24;  // tails fill and save
  return s;
}

inline std::vector<std::byte> random_rows(std::mt19937& rng, std::size_t values, DType dtype) {
  std::normal_distribution<float> normal;
  std::vector<std::byte> bytes(values * dtype_size(dtype));
  for (std::size_t i = 0; i < values; ++i)
    store_element(bytes.data(), static_cast<std::uint32_t>(i), dtype, normal(rng));
  return bytes;
}

// run(scenario, policy name, budget, seed) for every built-in policy on
// `seeds` random scenarios, skipping a budget or shape the policy refuses at
// construction; returns the sum of what run returns (the decodes compared).
template <class Run>
std::uint64_t for_each_policy_scenario(std::uint32_t seeds, Run&& run) {
  std::uint64_t decodes = 0;
  std::vector<std::string> names = policy_names();
  for (const std::string& e : eviction_policy_names()) names.push_back(e);
  for (std::uint32_t seed = 1; seed <= seeds; ++seed) {
    std::mt19937 rng(seed);
    const StepScenario s = random_step_scenario(rng);
    for (const std::string& name : names) {
      const std::uint32_t budget = s.config.page_tokens * (2 + rng() % 4) + rng() % s.config.page_tokens;
      CAPTURE(seed, name, budget, s.config.page_tokens, to_string(s.shape.dtype), s.shape.layers, s.shape.q_heads,
              s.shape.kv_heads, s.shape.head_dim);
      try {
        RuntimeManager probe(s.shape, s.config, make_policy(name, budget));
      } catch (const Error& e) {  // a budget or shape the policy cannot serve is refused at construction
        REQUIRE(e.code() == ErrorCode::invalid_argument);
        continue;
      }
      decodes += run(s, name, budget, seed * 100 + budget);
    }
  }
  return decodes;
}

}  // namespace sparsekv::test
