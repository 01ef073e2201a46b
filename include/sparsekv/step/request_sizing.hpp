#pragma once
// What a request of the Manager's shape, Config and policy may ask and needs
// of the tiers, asked of the policy (policy/sparse_attention.hpp) over all layers:
// its max_tokens, the mandatory pages per (layer, kv head) admission reserves, the page
// table's capacity per head, and the CPU pages a prompt can take.
#include <algorithm>
#include <cstdint>
#include <optional>

#include "sparsekv/buffer/tiered_kv_buffer.hpp"
#include "sparsekv/step/step_scope.hpp"

namespace sparsekv {

// Why a request's max_tokens is refused (add_request, can_admit, fork), or nothing.
template <class Policy>
std::optional<Refusal> max_tokens_refusal(const StepScope<Policy>& scope, std::uint32_t max_tokens) {
  if (max_tokens != 0 && max_tokens <= scope.config->max_context_tokens) return std::nullopt;
  return Refusal{ErrorCode::invalid_argument, fmt::format("max_tokens {} must be in [1, max_context_tokens = {}]",
                                                          max_tokens, scope.config->max_context_tokens)};
}

// The per-(layer, kv head) mandatory pages the policy needs for a request of
// up to `max_tokens` tokens, taken over all layers.
template <class Policy>
RequestPages request_pages(const StepScope<Policy>& scope, std::uint32_t max_tokens) {
  std::uint32_t mandatory = 1;
  for (std::uint32_t l = 0; l < scope.shape->layers; ++l) {
    mandatory = std::max(mandatory, scope.policy->mandatory_pages(scope.context(l, max_tokens)));
  }
  return RequestPages{mandatory, 0, evicts_tokens(*scope.policy)};
}

// What the page table is sized for per head: the policy's own bound for a
// request of max_context_tokens (over all layers), or Config's default: no
// admitted request outgrows it mid-run.
template <class Policy>
HeadCapacity table_head_capacity(const StepScope<Policy>& scope) {
  std::optional<HeadCapacity> most;
  for (std::uint32_t l = 0; l < scope.shape->layers; ++l) {
    if (const auto c = declared_head_capacity(*scope.policy, scope.context(l, scope.config->max_context_tokens))) {
      most = HeadCapacity{std::max(c->partitions, most ? most->partitions : 0u),
                          std::max(c->cpu_pages, most ? most->cpu_pages : 0u)};
    }
  }
  HeadCapacity capacity = most ? *most : scope.config->head_capacity();
  capacity.slot_masks = evicts_tokens(*scope.policy);
  return capacity;
}

// The most CPU pages a `tokens`-token prompt takes in one (layer, kv head):
// the policy's bound when it declares one (clusters pad their last page),
// else none (one-page partitions). An upper bound: advice errs on refusing.
template <class Policy>
std::optional<std::uint32_t> prompt_pages(const StepScope<Policy>& scope, std::uint32_t tokens) {
  std::optional<std::uint32_t> most;
  for (std::uint32_t l = 0; l < scope.shape->layers; ++l) {
    if (const auto c = declared_head_capacity(*scope.policy, scope.context(l, tokens))) {
      most = std::max(c->cpu_pages, most.value_or(0));
    }
  }
  return most;
}

}  // namespace sparsekv
