// The test runner of the suites that cover "every policy" (policy_names()):
// the evaluation policies (the oracle) are registered first, as the tools do.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include "research/research_policies.hpp"

int main(int argc, char* argv[]) {
  sparsekv::register_research_policies();
  return Catch::Session().run(argc, argv);
}
