#pragma once
// Two managers, a reference (HostBackend) and a backend under test, driven by
// identical calls: requests arriving and finishing at random steps, random
// bf16 K/V and queries. Every call must succeed on both or fail on both with
// the same ErrorCode (a refused call changes nothing, so both go on from the
// same state); after every decode the retrieved GPU pages and misses are
// identical and the outputs agree within `tolerance` (relative L2 per head).
//
// The tiers are sized from the policy, as decode_loop does: the GPU tier holds
// `fitting_requests` requests of the largest size, so later arrivals are
// refused on both sides and the refusal path runs too. Used by the host CI
// (tests/facade/test_backend_lockstep.cpp: a deferred-copy backend) and the GPU suite
// (tests/gpu/test_cuda_backend.cpp: CudaBackend).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "sparsekv/core/numeric.hpp"
#include "sparsekv/facade/manager_inspection.hpp"
#include "sparsekv/sparsekv.hpp"

namespace sparsekv::test {

struct LockstepShape {
  ModelShape shape{2, 8, 2, 64, DType::bf16};
  std::uint32_t page_tokens = 16;
  std::uint32_t max_prompt = 917;  // prompts are 17 .. max_prompt tokens
  std::uint32_t max_decode = 48;   // each request decodes 8 .. max_decode tokens
  std::uint32_t fitting_requests = 5;
  std::uint32_t budget_tokens = 128;
};

// Tiers for `s`: every request of the largest size needs what a manager with
// ample tiers says it needs (can_admit), times fitting_requests.
inline Config lockstep_config(const LockstepShape& s, const std::string& policy) {
  Config c;
  c.page_tokens = s.page_tokens;
  c.max_requests = 4 * s.fitting_requests;
  c.max_context_tokens = 2048;
  c.min_buffer_ratio = 1.0;
  const std::size_t page = c.page_bytes(s.shape);
  const std::size_t heads = std::size_t{c.max_requests} * s.shape.layers * s.shape.kv_heads;
  c.host_chunk_bytes = 64 * page;
  c.cpu_tier_bytes = c.gpu_tier_bytes = heads * (2 * c.max_context_tokens / c.page_tokens + 8) * page;
  const std::uint32_t largest = s.max_prompt + s.max_decode;
  const AdmissionAdvice need =
      RuntimeManager(s.shape, c, make_policy(policy, s.budget_tokens)).can_admit(s.max_prompt, largest);
  c.gpu_tier_bytes = s.fitting_requests * need.gpu_pages_needed * page;
  return c;
}

struct LockstepResult {
  double worst_error = 0;
  std::uint32_t admitted = 0, refused = 0;
  std::uint64_t decode_steps = 0;
};

namespace lockstep_detail {

inline std::vector<std::uint16_t> random_bf16(std::mt19937& rng, std::size_t n) {
  std::normal_distribution<float> normal;
  std::vector<std::uint16_t> v(n);
  for (auto& x : v) x = float_to_bf16(normal(rng));
  return v;
}

// Runs `call` on both managers; both succeed (true) or both throw the same code (false).
template <class Call>
bool on_both(RuntimeManager& reference, RuntimeManager& tested, const char* what, Call call) {
  const auto outcome = [&](RuntimeManager& m) -> std::optional<ErrorCode> {
    try {
      call(m);
      return std::nullopt;
    } catch (const Error& e) {
      UNSCOPED_INFO(m.backend().name() << " refused " << what << ": " << e.what());
      return e.code();
    }
  };
  const std::optional<ErrorCode> want = outcome(reference);
  const std::optional<ErrorCode> got = outcome(tested);
  INFO(what);
  REQUIRE(got.has_value() == want.has_value());
  if (want) REQUIRE(*got == *want);
  return !want.has_value();
}

}  // namespace lockstep_detail

inline LockstepResult lockstep(RuntimeManager& reference, RuntimeManager& tested, const LockstepShape& s,
                               std::uint32_t seed, double tolerance) {
  using lockstep_detail::on_both;
  using lockstep_detail::random_bf16;
  const ModelShape& shape = s.shape;
  const std::size_t row = std::size_t{shape.kv_heads} * shape.head_dim;
  std::mt19937 rng(seed);
  std::map<RequestId, std::uint32_t> left;
  RequestId next = 1;
  LockstepResult result;
  const auto arrive = [&] {
    const RequestId id = next++;
    const std::uint32_t prompt = 17 + rng() % (s.max_prompt - 16), decode = 8 + rng() % (s.max_decode - 7);
    if (!on_both(reference, tested, "add_request", [&](RuntimeManager& m) { m.add_request(id, prompt + decode); })) {
      ++result.refused;
      return;
    }
    ++result.admitted;
    bool prefilled = true;
    for (std::uint32_t l = 0; l < shape.layers && prefilled; ++l) {
      const auto k = random_bf16(rng, prompt * row), v = random_bf16(rng, prompt * row);
      prefilled = on_both(reference, tested, "prefill",
                          [&](RuntimeManager& m) { m.prefill(id, l, k.data(), v.data(), prompt); });
    }
    if (prefilled) {
      left[id] = decode;
    } else {
      on_both(reference, tested, "finish", [&](RuntimeManager& m) { m.finish(id); });
    }
  };
  for (std::uint32_t i = 0; i < s.fitting_requests + 3; ++i) arrive();
  for (int step = 0; !left.empty(); ++step) {
    if (step < 20 && rng() % 4 == 0) arrive();
    std::vector<RequestId> batch;
    for (const auto& [id, n] : left) batch.push_back(id);
    for (std::uint32_t l = 0; l < shape.layers; ++l) {
      const auto q = random_bf16(rng, batch.size() * shape.q_heads * shape.head_dim);
      const auto k = random_bf16(rng, batch.size() * row), v = random_bf16(rng, batch.size() * row);
      std::vector<float> want(q.size()), got(q.size());
      if (!on_both(reference, tested, "decode", [&](RuntimeManager& m) {
            m.decode(batch, l, q.data(), k.data(), v.data(), &m == &reference ? want.data() : got.data());
          })) {
        ++result.refused;
        continue;
      }
      ++result.decode_steps;
      for (std::size_t b = 0; b < batch.size(); ++b) {
        REQUIRE(tested.retrieval(b).pages.gpu_pages == reference.retrieval(b).pages.gpu_pages);
        REQUIRE(tested.retrieval(b).stats.miss_pages == reference.retrieval(b).stats.miss_pages);
      }
      for (std::size_t i = 0; i < want.size(); i += shape.head_dim) {
        double num = 0, den = 0;
        for (std::uint32_t d = 0; d < shape.head_dim; ++d) {
          num += std::pow(double(got[i + d]) - want[i + d], 2);
          den += double(want[i + d]) * want[i + d];
        }
        result.worst_error = std::max(result.worst_error, std::sqrt(num / std::max(den, 1e-30)));
      }
    }
    for (RequestId id : batch) {
      if (--left[id] == 0) {
        on_both(reference, tested, "finish", [&](RuntimeManager& m) { m.finish(id); });
        left.erase(id);
      }
    }
  }
  INFO("worst relative error per head " << result.worst_error);
  REQUIRE(result.worst_error <= tolerance);
  REQUIRE(tested.stats().cache.hit_pages == reference.stats().cache.hit_pages);
  REQUIRE(tested.stats().pages_moved == reference.stats().pages_moved);
  REQUIRE(inspect_buffer(tested).tiers().gpu_pool.used() == 0);
  REQUIRE(inspect_buffer(tested).tiers().cpu_pool.used() == 0);
  return result;
}

}  // namespace sparsekv::test
