#pragma once
// A prompt's Index and Offload on the host (Spin §4.1): the policy partitions
// and summarises the prompt, the buffer maps the partitions to CPU pages and
// writes the K/V there. Used by host-tensor prefill, and by the device step
// for a policy that clusters on the host (RetroInfer), whose prompt comes down
// once.
#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "sparsekv/step/evicting_step.hpp"
#include "sparsekv/step/layer_state.hpp"
#include "sparsekv/step/step_scope.hpp"

namespace sparsekv {

// Where a fork's prompt comes from (Manager::fork): the request it starts
// from, that request's policy state of the layer, and the tokens the
// policy's fork_index takes from that state (they need no conversion nor Index).
template <class Policy>
struct ForkSource {
  RequestId request = 0;
  const typename Policy::LayerState* state = nullptr;
  std::uint32_t reused_tokens = 0;
};

// Index of the prompt in `keys` / `values` (fp32 [tokens][kv_heads][head_dim])
// and Offload of k / v (host, model dtype) into the CPU tier; the layer is
// then prefilled. A policy that evicts without attention weights
// (StreamingLLM) cuts a prompt over its budget here; the buffer applies the
// cut at the first decode step, as every decision, before that step's token
// is placed. With `fork`, the prompt is the first tokens of fork->request:
// keys / values hold only those past fork->reused_tokens, the policy's
// fork_index takes the rest from fork->state, and the pages are shared where
// they coincide (PrefixForks::offload_shared). Throws what Index or
// Offload throw, changing nothing.
template <class Policy>
void index_and_offload(const StepScope<Policy>& scope, RequestId request, std::uint32_t layer,
                       LayerStepState<typename Policy::LayerState>& ls, const void* k, const void* v,
                       std::span<const float> keys, std::span<const float> values, std::uint32_t tokens,
                       const ForkSource<Policy>* fork = nullptr, std::optional<DType> rows = {}) {
  using Clock = std::chrono::steady_clock;
  const Policy& policy = *scope.policy;
  const ModelShape& shape = *scope.shape;
  const auto t0 = Clock::now();
  const std::uint32_t first = fork ? fork->reused_tokens : 0;
  const KvView view{keys, values, tokens - first, shape.kv_heads, shape.head_dim, first};
  // Indexed into a copy: a policy's state changes only if the offload succeeds.
  typename Policy::LayerState indexed = ls.policy;
  LayerContext ctx = scope.context(layer, tokens);
  ctx.reserve_tokens = ls.max_tokens;
  std::vector<PartitionSpec> specs =
      fork ? sparsekv::fork_index(policy, ctx, *fork->state, view, indexed) : policy.index(ctx, view, indexed);
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
  if (fork) {
    scope.buffer->forks().offload_shared(request, fork->request, layer, tokens, specs);
  } else {
    scope.buffer->offloader().offload(request, layer, KvChunk{k, v, tokens, rows.value_or(shape.dtype)}, specs);
  }
  ls.policy = std::move(indexed);
  ls.eviction = std::move(cut);
  scope.stats->index_s += std::chrono::duration<double>(t1 - t0).count();
  scope.stats->offload_s += std::chrono::duration<double>(Clock::now() - t1).count();
  ls.prefilled = true;
}

// Host-tensor prefill of a checked request and layer: the prompt k / v
// ([tokens][kv_heads][head_dim] in `rows`: the model dtype unless said, or
// the storage dtype, host memory) converted into `keys` / `values`
// (scratch), checked finite, indexed and offloaded. V is checked a block of
// rows at a time, and kept in fp32 only for a policy whose Index reads it.
template <class Policy>
void host_prefill(const StepScope<Policy>& scope, RequestId request, std::uint32_t layer,
                  LayerStepState<typename Policy::LayerState>& ls, const void* k, const void* v, std::uint32_t tokens,
                  std::vector<float>& keys, std::vector<float>& values, std::optional<DType> rows = {}) {
  const DType dtype = rows.value_or(scope.shape->dtype);
  const std::size_t n = std::size_t{tokens} * scope.kv_row();
  // Index sees the values the pages will hold (rows in the storage dtype already are).
  const bool quantizes = dtype != scope.config->storage_dtype(*scope.shape);
  scope.to_finite_float("prefill k", request, k, n, keys, 0, dtype);
  if (quantizes) scope.as_stored(keys);
  if (index_reads_values(*scope.policy)) {
    scope.to_finite_float("prefill v", request, v, n, values, 0, dtype);
    if (quantizes) scope.as_stored(values);
    index_and_offload<Policy>(scope, request, layer, ls, k, v, keys, values, tokens, nullptr, dtype);
    return;
  }
  constexpr std::uint32_t kBlockTokens = 256;
  const std::size_t token_bytes = std::size_t{scope.shape->kv_heads} * dtype_row_bytes(dtype, scope.shape->head_dim);
  for (std::uint32_t t = 0; t < tokens; t += kBlockTokens) {
    const std::size_t block = std::min(kBlockTokens, tokens - t);
    scope.to_finite_float("prefill v", request, static_cast<const std::byte*>(v) + t * token_bytes,
                          block * scope.kv_row(), values, t, dtype);
  }
  index_and_offload<Policy>(scope, request, layer, ls, k, v, keys, {}, tokens, nullptr, dtype);
}

// A fork's prefill (Manager::fork) of the source's first `tokens` tokens:
// k / v hold the rows past fork.reused_tokens, read back from the CPU tier
// (finite: the tier holds no other) for the policy to index; the buffer
// takes the bytes from the source's pages itself.
template <class Policy>
void host_fork_prefill(const StepScope<Policy>& scope, RequestId request, std::uint32_t layer,
                       LayerStepState<typename Policy::LayerState>& ls, const void* k, const void* v,
                       std::uint32_t tokens, std::vector<float>& keys, std::vector<float>& values,
                       const ForkSource<Policy>& fork) {
  const std::size_t n = std::size_t{tokens - fork.reused_tokens} * scope.kv_row();
  scope.to_float(k, n, keys);
  scope.to_float(v, n, values);
  index_and_offload(scope, request, layer, ls, nullptr, nullptr, keys, values, tokens, &fork);
}

}  // namespace sparsekv
