#pragma once
// ForkRunner: a request started as the first `tokens` tokens of a live one
// (Manager::fork, an engine's prefix cache; docs/integration.md, "Shared
// prefixes"). In every layer the policy indexes those tokens as a prefill
// would, reusing the source's summaries of the pages the two share where it
// can (ForksIndex), and the buffer maps the shared full pages by reference
// (PrefixForks::offload_shared). Its advice (can_fork) and the fork share
// the refusal and the layout, so that they agree.
#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include "sparsekv/core/error.hpp"
#include "sparsekv/step/prefill.hpp"
#include "sparsekv/step/request_registry.hpp"
#include "sparsekv/step/step_scope.hpp"

namespace sparsekv {

template <class Policy>
class ForkRunner {
  using State = typename Policy::LayerState;

 public:
  // Why a fork of `source`'s first `tokens` tokens would be refused for its
  // arguments or the source's state (max_tokens checked by the caller). A
  // Manager that serves device tensors forks none.
  static std::optional<Refusal> refusal(const StepScope<Policy>& scope, const RequestRegistry<Policy>& registry,
                                        RequestId source, std::uint32_t tokens, std::uint32_t max_tokens,
                                        bool serves_device_tensors) {
    if (!registry.contains(source)) {
      return Refusal{ErrorCode::not_found, fmt::format("unknown or finished request {}", source)};
    }
    if (serves_device_tensors) {
      return Refusal{ErrorCode::failed_precondition, "forks take host tensors; this Manager serves device tensors"};
    }
    if (tokens == 0) return Refusal{ErrorCode::invalid_argument, "a fork needs tokens > 0"};
    if (tokens > max_tokens) {
      return Refusal{ErrorCode::resource_exhausted,
                     fmt::format("a fork of {} tokens exceeds its max_tokens {}", tokens, max_tokens)};
    }
    for (std::uint32_t l = 0; l < scope.shape->layers; ++l) {
      if (!registry.at(source).layers[l].prefilled) {
        return Refusal{ErrorCode::failed_precondition, fmt::format("request {} layer {} is not prefilled", source, l)};
      }
      if (const std::uint32_t readable = scope.buffer->forks().readable_tokens(source, l); tokens > readable) {
        return Refusal{
            ErrorCode::out_of_range,
            fmt::format("request {} layer {} holds its first {} tokens in order in the CPU tier (the rest "
                        "are in the unsaved decode page on the GPU tier, regrouped or evicted); cannot fork {}",
                        source, l, readable, tokens)};
      }
    }
    return std::nullopt;
  }

  // The CPU pages the fork would take beyond those it shares, over all
  // layers: each layer's Index run on a copy, as the fork would. ForksIndex only.
  std::uint64_t new_pages(const StepScope<Policy>& scope, const RequestRegistry<Policy>& registry, RequestId source,
                          std::uint32_t tokens) {
    std::uint64_t pages = 0;
    for (std::uint32_t l = 0; l < scope.shape->layers; ++l) {
      const std::uint32_t reused = read_rows(scope, registry, source, l, tokens);
      const std::size_t n = std::size_t{tokens - reused} * scope.kv_row();
      scope.to_float(k_.data(), n, keys_);
      scope.to_float(v_.data(), n, values_);
      State indexed = make_layer_state(*scope.policy);
      const KvView view{keys_, values_, tokens - reused, scope.shape->kv_heads, scope.shape->head_dim, reused};
      pages += scope.buffer->forks().fork_pages(
          source, l, tokens,
          fork_index(*scope.policy, scope.context(l, tokens), registry.at(source).layers[l].policy, view, indexed));
    }
    return pages;
  }

  // Prefills every layer of the added `request` from `source`'s pages.
  // Throws what a prefill throws; the caller finishes `request` then.
  void run(const StepScope<Policy>& scope, RequestRegistry<Policy>& registry, RequestId request, RequestId source,
           std::uint32_t tokens) {
    for (std::uint32_t l = 0; l < scope.shape->layers; ++l) {
      const ForkSource<Policy> fork{source, &registry.at(source).layers[l].policy,
                                    read_rows(scope, registry, source, l, tokens)};
      LayerStepState<State>& ls = registry.prefill_entry(request, l, tokens);
      host_fork_prefill(scope, request, l, ls, k_.data(), v_.data(), tokens, keys_, values_, fork);
    }
  }

 private:
  // The rows of `source`'s layer the fork indexes -- those past what its
  // policy reuses -- read back into k_ / v_ (model dtype). Returns the reused tokens.
  std::uint32_t read_rows(const StepScope<Policy>& scope, const RequestRegistry<Policy>& registry, RequestId source,
                          std::uint32_t layer, std::uint32_t tokens) {
    const std::uint32_t reused =
        reused_tokens(*scope.policy, scope.context(layer, tokens), registry.at(source).layers[layer].policy);
    k_.resize(std::size_t{tokens - reused} * scope.kv_row() * dtype_size(scope.shape->dtype));
    v_.resize(k_.size());
    scope.buffer->forks().read_prefix(source, layer, reused, tokens, k_.data(), v_.data(), scope.shape->dtype);
    return reused;
  }

  std::vector<std::byte> k_, v_;      // the source's rows, in the model dtype
  std::vector<float> keys_, values_;  // the same in fp32
};

}  // namespace sparsekv
