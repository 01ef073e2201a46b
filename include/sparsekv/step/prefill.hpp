#pragma once
// A prompt's Index and Offload on the host (Spin §4.1): the policy partitions
// and summarises the prompt, the buffer maps the partitions to CPU pages and
// writes the K/V there. Used by host-tensor prefill, and by the device step
// for a policy that clusters on the host (RetroInfer), whose prompt comes down
// once.
#include <chrono>
#include <cstdint>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "sparsekv/step/evicting_step.hpp"
#include "sparsekv/step/layer_state.hpp"
#include "sparsekv/step/step_scope.hpp"

namespace sparsekv {

// Index of the prompt in `keys` / `values` (fp32 [tokens][kv_heads][head_dim])
// and Offload of k / v (host, model dtype) into the CPU tier; the layer is
// then prefilled. A policy that evicts without attention weights
// (StreamingLLM) cuts a prompt over its budget here; the buffer applies the
// cut at the first decode step, as every decision, before that step's token
// is placed. With `fork_of`, the prompt is that request's first tokens and
// its pages are shared where they coincide (TieredKVBuffer::offload_shared).
// Throws what Index or Offload throw, changing nothing.
template <class Policy>
void index_and_offload(const StepScope<Policy>& scope, RequestId request, std::uint32_t layer,
                       LayerStepState<typename Policy::LayerState>& ls, const void* k, const void* v,
                       std::span<const float> keys, std::span<const float> values, std::uint32_t tokens,
                       std::optional<RequestId> fork_of = std::nullopt) {
  using Clock = std::chrono::steady_clock;
  const Policy& policy = *scope.policy;
  const ModelShape& shape = *scope.shape;
  const auto t0 = Clock::now();
  const KvView view{keys, values, tokens, shape.kv_heads, shape.head_dim, 0};
  // Indexed into a copy: a policy's state changes only if the offload succeeds.
  typename Policy::LayerState indexed = ls.policy;
  std::vector<PartitionSpec> specs = policy.index(scope.context(layer, tokens), view, indexed);
  std::optional<Eviction> cut;
  if (evicts_tokens(policy) && !needs_token_weights(policy)) {
    EvictionContext e;
    e.newest = tokens - 1;
    e.live_tokens.assign(shape.kv_heads, tokens);
    Eviction out;
    evict_tokens(policy, scope.context(layer, tokens), e, indexed, out);
    if (drops_any(out)) cut = std::move(out);
  }
  const auto t1 = Clock::now();
  if (fork_of) {
    scope.buffer->offload_shared(request, *fork_of, layer, KvChunk{k, v, tokens, shape.dtype}, specs);
  } else {
    scope.buffer->offload(request, layer, KvChunk{k, v, tokens, shape.dtype}, specs);
  }
  ls.policy = std::move(indexed);
  ls.eviction = std::move(cut);
  scope.stats->index_s += std::chrono::duration<double>(t1 - t0).count();
  scope.stats->offload_s += std::chrono::duration<double>(Clock::now() - t1).count();
  ls.prefilled = true;
}

// Host-tensor prefill of a checked request and layer: the prompt k / v
// ([tokens][kv_heads][head_dim], model dtype, host memory) converted into
// `keys` / `values` (scratch), checked finite, indexed and offloaded.
template <class Policy>
void host_prefill(const StepScope<Policy>& scope, RequestId request, std::uint32_t layer,
                  LayerStepState<typename Policy::LayerState>& ls, const void* k, const void* v, std::uint32_t tokens,
                  std::vector<float>& keys, std::vector<float>& values,
                  std::optional<RequestId> fork_of = std::nullopt) {
  const std::size_t n = std::size_t{tokens} * scope.kv_row();
  scope.to_float(k, n, keys);
  scope.to_float(v, n, values);
  scope.check_finite("prefill k", request, keys, 0);
  scope.check_finite("prefill v", request, values, 0);
  index_and_offload(scope, request, layer, ls, k, v, keys, values, tokens, fork_of);
}

}  // namespace sparsekv
