#pragma once
// The evaluation policies the tools, tests and benchmarks measure the others
// with, added to make_policy's names (policy/policy_registry.hpp): "oracle"
// (oracle.hpp), the best page selection of the budget's size. Not serving
// policies, so not built into the library; a program that wants them by name
// calls register_research_policies() once (more calls change nothing).
namespace sparsekv {

void register_research_policies();

}  // namespace sparsekv
