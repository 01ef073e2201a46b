// make_policy(): the built-in policies by name, at their papers' defaults.
#include <string>
#include <vector>

#include "sparsekv/core/error.hpp"
#include "sparsekv/policy/any_policy.hpp"
#include "sparsekv/policy/dense.hpp"
#include "sparsekv/policy/h2o.hpp"
#include "sparsekv/policy/oracle.hpp"
#include "sparsekv/policy/quest.hpp"
#include "sparsekv/policy/retroinfer.hpp"
#include "sparsekv/policy/shadowkv.hpp"
#include "sparsekv/policy/streaming_eviction.hpp"
#include "sparsekv/policy/streaming_window.hpp"

namespace sparsekv {

std::vector<std::string> policy_names() {
  return {"dense", "streaming", "quest", "shadowkv", "retroinfer", "retroinfer_no_estimation", "oracle"};
}

std::vector<std::string> eviction_policy_names() { return {"h2o", "streaming_evict"}; }

AnyPolicy make_policy(std::string_view name, std::uint32_t budget_tokens) {
  if (name == "dense") return AnyPolicy(DensePolicy{});
  if (budget_tokens == 0) fail(ErrorCode::invalid_argument, "policy '{}': budget_tokens must be > 0", name);
  if (name == "streaming") {
    StreamingWindowPolicy::Options o;
    o.budget_tokens = budget_tokens;
    return AnyPolicy(StreamingWindowPolicy(o));
  }
  if (name == "quest") {
    QuestPolicy::Options o;
    o.budget_tokens = budget_tokens;
    return AnyPolicy(QuestPolicy(o));
  }
  if (name == "shadowkv") {
    ShadowKVPolicy::Options o;
    o.budget_tokens = budget_tokens;
    return AnyPolicy(ShadowKVPolicy(o));
  }
  if (name == "retroinfer" || name == "retroinfer_no_estimation") {
    RetroInferPolicy::Options o;
    o.budget_tokens = budget_tokens;
    o.estimation = name == "retroinfer";
    return AnyPolicy(RetroInferPolicy(o));
  }
  if (name == "oracle") {
    OraclePolicy::Options o;
    o.budget_tokens = budget_tokens;
    return AnyPolicy(OraclePolicy(o));
  }
  if (name == "h2o") {
    H2OPolicy::Options o;
    o.budget_tokens = budget_tokens;
    return AnyPolicy(H2OPolicy(o));
  }
  if (name == "streaming_evict") {
    StreamingEvictionPolicy::Options o;
    o.budget_tokens = budget_tokens;
    return AnyPolicy(StreamingEvictionPolicy(o));
  }
  std::string known;
  for (const auto& n : policy_names()) known += (known.empty() ? "" : ", ") + n;
  for (const auto& n : eviction_policy_names()) known += ", " + n;
  fail(ErrorCode::invalid_argument, "unknown policy '{}' (known: {})", name, known);
}

}  // namespace sparsekv
