// Every built-in policy under every eviction strategy decodes a request to its
// max_tokens, at every budget from one token to the context, and can_admit
// stays exact on the way (docs/errors.md: an admitted request is never
// refused mid-run for its geometry).
//
// The regression: evicting policies (h2o, streaming_evict) under free_block
// and slot_reuse left every freed page as a tombstone partition, and a head
// whose pages die before they fill used up its page table
// (max_context_tokens / page_tokens partitions) long before max_tokens.
#include <algorithm>
#include <cstdint>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "sparsekv/facade/manager_inspection.hpp"
#include "sparsekv/sparsekv.hpp"
#include "test_support.hpp"

using namespace sparsekv;

namespace {

constexpr EvictionStrategy kStrategies[] = {EvictionStrategy::no_op, EvictionStrategy::free_block,
                                            EvictionStrategy::sparse_copy, EvictionStrategy::slot_reuse};

struct Geometry {
  std::uint32_t page_tokens;
  std::uint32_t context;  // max_context_tokens, and every request's max_tokens
};

std::vector<std::string> all_policies() {
  std::vector<std::string> names = policy_names();
  for (const std::string& n : eviction_policy_names()) names.push_back(n);
  return names;
}

// One request decodes alone; a probe asks for admission at every step.
class Run {
 public:
  // `prompt_pages_bound`: the policy's prompt CPU pages are only bounded
  // before its Index runs (RetroInfer's clusters pad their last page), so
  // can_admit may refuse a prompt that would fit, never the reverse.
  Run(const Geometry& g, std::uint32_t prompt, std::uint32_t seed, bool prompt_pages_bound)
      : g_(g), prompt_(prompt), prompt_pages_bound_(prompt_pages_bound), rng_(seed) {}

  const ModelShape& shape() const { return shape_; }
  // Probes that can_admit admitted and refused.
  std::uint32_t admitted() const { return admitted_; }
  std::uint32_t refused() const { return refused_; }

  Config config(EvictionStrategy strategy) const {
    Config c;
    c.page_tokens = g_.page_tokens;
    c.max_requests = 2;
    c.max_context_tokens = g_.context;
    c.min_buffer_ratio = 1.0;
    c.metadata_segment_entries = 32;
    c.eviction_strategy = strategy;
    const std::size_t page = c.page_bytes(shape_);
    const std::size_t heads = std::size_t{shape_.layers} * shape_.kv_heads;
    c.host_chunk_bytes = 4 * page;
    // The request at its longest plus a probe's prompt, one page short: early
    // on a probe fits, later (for a policy that keeps every token) it does not.
    const std::size_t pages = c.max_pages_per_head() + (prompt_ + g_.page_tokens - 1) / g_.page_tokens;
    c.cpu_tier_bytes = (heads * pages - 1) * page;
    c.gpu_tier_bytes = 2 * heads * (2 * c.max_pages_per_head() + 2) * page;
    return c;
  }

  // Decodes request 1 to its max_tokens; returns the first failure's message, or "".
  std::string decode_to_max_tokens(RuntimeManager& m) {
    const std::size_t kv = std::size_t{shape_.kv_heads} * shape_.head_dim;
    const std::size_t qs = std::size_t{shape_.q_heads} * shape_.head_dim;
    REQUIRE(m.can_admit(prompt_, g_.context).admit);
    m.add_request(1, g_.context);
    const std::vector<float> k = draw(prompt_ * kv), v = draw(prompt_ * kv);
    for (std::uint32_t l = 0; l < shape_.layers; ++l) m.prefill(1, l, k.data(), v.data(), prompt_);
    const RequestId batch[] = {1};
    std::vector<float> out(qs);
    for (std::uint32_t token = prompt_; token < g_.context; ++token) {
      // Every step in short contexts; 128 times over a long one.
      if ((token - prompt_) % std::max(1u, g_.context / 128) == 0) check_admission_exact(m);
      for (std::uint32_t l = 0; l < shape_.layers; ++l) {
        const std::vector<float> q = draw(qs), kn = draw(kv), vn = draw(kv);
        try {
          m.decode(batch, l, q.data(), kn.data(), vn.data(), out.data());
        } catch (const Error& e) {
          return fmt::format("token {} of {}, layer {}: {}", token, g_.context, l, e.what());
        }
      }
    }
    inspect_buffer(m).validate();
    check_admission_exact(m);
    m.finish(1);
    return {};
  }

 private:
  // can_admit says admit exactly when a probe request is accepted and prefills.
  void check_admission_exact(RuntimeManager& m) {
    const AdmissionAdvice advice = m.can_admit(prompt_, g_.context);
    INFO("advice: " << advice.reason << "; CPU pages needed " << advice.cpu_pages_needed << ", free "
                    << advice.cpu_pages_free);
    const std::size_t kv = std::size_t{shape_.kv_heads} * shape_.head_dim;
    const std::vector<float> k = draw(prompt_ * kv), v = draw(prompt_ * kv);
    bool served = true;
    try {
      m.add_request(2, g_.context);
      for (std::uint32_t l = 0; l < shape_.layers; ++l) m.prefill(2, l, k.data(), v.data(), prompt_);
    } catch (const Error& e) {
      INFO(e.what());
      REQUIRE(e.code() == ErrorCode::resource_exhausted);
      served = false;
    }
    if (m.has_request(2)) m.finish(2);
    ++(advice.admit ? admitted_ : refused_);
    if (prompt_pages_bound_) {
      REQUIRE((!advice.admit || served));
    } else {
      REQUIRE(advice.admit == served);
    }
  }

  std::vector<float> draw(std::size_t n) {
    std::normal_distribution<float> normal;
    std::vector<float> x(n);
    for (float& e : x) e = normal(rng_);
    return x;
  }

  ModelShape shape_{2, 4, 2, 8, DType::f32};
  Geometry g_;
  std::uint32_t prompt_;
  bool prompt_pages_bound_;
  std::mt19937 rng_;
  std::uint32_t admitted_ = 0, refused_ = 0;
};

// Budgets 1 .. most_budget (the context by default).
void every_policy_and_strategy_to_max_tokens(const Geometry& g, const std::vector<std::string>& policies,
                                             std::uint32_t most_budget = 0) {
  std::uint32_t runs = 0, admitted = 0, refused = 0;
  for (const std::string& policy : policies) {
    for (const EvictionStrategy strategy : kStrategies) {
      for (std::uint32_t budget = 1; budget <= (most_budget ? most_budget : g.context); ++budget) {
        for (const std::uint32_t prompt : {1u, g.context / 3}) {
          CAPTURE(policy, to_string(strategy), budget, prompt, g.page_tokens, g.context);
          Run run(g, prompt, budget * 31 + prompt, policy.starts_with("retroinfer"));
          std::optional<AnyPolicy> made;
          try {
            made = make_policy(policy, budget);
          } catch (const Error& e) {
            // A budget below an evicting policy's protected window is refused up front.
            REQUIRE(e.code() == ErrorCode::invalid_argument);
            continue;
          }
          RuntimeManager m(run.shape(), run.config(strategy), std::move(*made));
          REQUIRE(run.decode_to_max_tokens(m) == "");
          ++runs;
          admitted += run.admitted();
          refused += run.refused();
        }
      }
    }
  }
  // The tier is tight enough that the advice goes both ways.
  CHECK(runs > 0);
  CHECK(admitted > 0);
  CHECK(refused > 0);
}

}  // namespace

TEST_CASE("eviction runs: evicting policies decode to max_tokens at every budget and strategy",
          "[facade][eviction][eviction-runs]") {
  // The geometries the bug was found at: 4-token pages over 64 tokens, 8-token pages over 128.
  every_policy_and_strategy_to_max_tokens({4, 64}, eviction_policy_names());
  every_policy_and_strategy_to_max_tokens({8, 128}, eviction_policy_names());
}

TEST_CASE("eviction runs: evicting policies decode a long context to max_tokens at budgets up to two pages",
          "[facade][eviction][eviction-runs]") {
  // No multiple of the page: h2o at budget 9 under slot_reuse stopped at 508 of 1005 tokens.
  every_policy_and_strategy_to_max_tokens({8, 1005}, eviction_policy_names(), 16);
}

TEST_CASE("eviction runs: every selection policy decodes to max_tokens at every budget and strategy",
          "[facade][eviction][eviction-runs]") {
  every_policy_and_strategy_to_max_tokens({4, 64}, policy_names());
}
