#pragma once
// Policies by name: make_policy() builds one for a token budget. The
// built-ins, at their papers' defaults: dense, streaming, quest, shadowkv,
// retroinfer, retroinfer_no_estimation (RetroInfer without its estimation
// zone), and the token-evicting h2o and streaming_evict, whose budget is the
// live tokens per kv head (H2O's recent window is half of it). A program adds
// its own with register_policy() (the tools register the oracle,
// tools/research/research_policies.hpp); the registry is process-wide and
// thread-safe.
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "sparsekv/policy/any_policy.hpp"

namespace sparsekv {

// Throws invalid_argument for an unknown name, a budget of 0 (dense ignores
// the budget) or what the policy's constructor refuses (a budget below an
// eviction policy's protected window).
AnyPolicy make_policy(std::string_view name, std::uint32_t budget_tokens);
// The selection policies make_policy accepts, built-ins first, then the
// registered ones in registration order (the tools' default lists).
std::vector<std::string> policy_names();
// The token-evicting policies make_policy accepts, kept apart from
// policy_names() so the tools' default lists stay selection-only.
std::vector<std::string> eviction_policy_names();

// Makes a selection policy for a budget > 0 (make_policy checks it first).
using PolicyFactory = std::function<AnyPolicy(std::uint32_t budget_tokens)>;
// Adds a selection policy to make_policy's names. Throws invalid_argument
// for an empty name or factory and already_exists for a name taken,
// registering nothing.
void register_policy(std::string name, PolicyFactory make);

}  // namespace sparsekv
