#include "research/research_policies.hpp"

#include <mutex>

#include "research/oracle.hpp"
#include "sparsekv/policy/policy_registry.hpp"

namespace sparsekv {

void register_research_policies() {
  static std::once_flag once;
  std::call_once(once, [] {
    register_policy(std::string(OraclePolicy::kName), [](std::uint32_t budget_tokens) {
      OraclePolicy::Options o;
      o.budget_tokens = budget_tokens;
      return AnyPolicy(OraclePolicy(o));
    });
  });
}

}  // namespace sparsekv
