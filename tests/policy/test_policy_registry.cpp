// make_policy's names: the built-ins, then what a program registered (the
// test runner registers the oracle, as the tools do: research_main.cpp).
#include <algorithm>
#include <string>
#include <vector>

#include "research/oracle.hpp"
#include "sparsekv/policy/policy_registry.hpp"
#include "test_support.hpp"

using namespace sparsekv;

TEST_CASE("Policy registry: the built-ins first, a registered policy after, every refusal registering nothing",
          "[policy]") {
  const std::vector<std::string> names = policy_names();
  const std::vector<std::string> builtins{"dense",    "streaming",  "quest",
                                          "shadowkv", "retroinfer", "retroinfer_no_estimation"};
  REQUIRE(names.size() == builtins.size() + 1);
  REQUIRE(std::equal(builtins.begin(), builtins.end(), names.begin()));
  REQUIRE(names.back() == "oracle");  // registered by the runner
  REQUIRE(eviction_policy_names() == std::vector<std::string>{"h2o", "streaming_evict"});

  const AnyPolicy oracle = make_policy("oracle", 64);
  REQUIRE(oracle.name() == OraclePolicy::kName);
  REQUIRE_SPARSEKV_ERROR(make_policy("oracle", 0), ErrorCode::invalid_argument);

  const PolicyFactory quest = [](std::uint32_t budget) { return make_policy("quest", budget); };
  REQUIRE_SPARSEKV_ERROR(register_policy("oracle", quest), ErrorCode::already_exists);
  REQUIRE_SPARSEKV_ERROR(register_policy("h2o", quest), ErrorCode::already_exists);
  REQUIRE_SPARSEKV_ERROR(register_policy("", quest), ErrorCode::invalid_argument);
  REQUIRE_SPARSEKV_ERROR(register_policy("unnamed_factory", PolicyFactory{}), ErrorCode::invalid_argument);
  REQUIRE(policy_names() == names);
  REQUIRE_SPARSEKV_ERROR(make_policy("unnamed_factory", 64), ErrorCode::invalid_argument);
}
