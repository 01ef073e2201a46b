#pragma once
// PromptStaging: a prompt arriving in chunks (Manager::prefill_chunk), as an
// engine's ubatches bring it. Each chunk's K/V are kept per layer in the
// storage dtype (LayerStepState::staged_k / staged_v) until the layer's first
// decode step, extend or end_prompt prefills the whole prompt at once, so the
// result is exactly the prefill of the concatenated chunks for every policy
// (ShadowKV's SVD, RetroInfer's clusters and StreamingLLM's cut need the
// whole prompt). Until then the staged rows can be read back and attended
// (attention/prompt_attention.hpp).
#include <cstddef>
#include <cstdint>
#include <vector>

#include "sparsekv/attention/prompt_attention.hpp"
#include "sparsekv/core/convert.hpp"
#include "sparsekv/core/error.hpp"
#include "sparsekv/step/layer_state.hpp"
#include "sparsekv/step/prefill.hpp"
#include "sparsekv/step/request_registry.hpp"
#include "sparsekv/step/step_scope.hpp"

namespace sparsekv {

template <class Policy>
class PromptStaging {
  using State = typename Policy::LayerState;

 public:
  // Appends `tokens` rows of k / v (host, in `from`) to the layer's staged
  // prompt. Throws, changing nothing: failed_precondition (the layer is
  // prefilled), resource_exhausted (past max_tokens), invalid_argument (a
  // non-finite value).
  void stage(const StepScope<Policy>& scope, RequestId request, std::uint32_t layer, RequestSteps<State>& r,
             const void* k, const void* v, std::uint32_t tokens, DType from) {
    const ModelShape& shape = *scope.shape;
    LayerStepState<State>& ls = r.layers[layer];
    if (ls.prefilled) {
      fail(ErrorCode::failed_precondition,
           "prefill_chunk of request {} layer {}: the layer is prefilled; append to a live request with extend()",
           request, layer);
    }
    RequestRegistry<Policy>::check_fits(request, "a prompt chunk", ls.staged_tokens, tokens, r.max_tokens);
    const std::size_t n = std::size_t{tokens} * scope.kv_row();
    scope.to_finite_float("prefill_chunk k", request, k, n, keys_, ls.staged_tokens, from);
    scope.to_finite_float("prefill_chunk v", request, v, n, values_, ls.staged_tokens, from);
    const DType stored = scope.config->storage_dtype(shape);
    const std::size_t token_bytes = shape.kv_heads * dtype_row_bytes(stored, shape.head_dim);
    const std::size_t bytes = std::size_t{tokens} * token_bytes;
    ls.staged_k.reserve(std::size_t{r.max_tokens} * token_bytes);
    ls.staged_v.reserve(std::size_t{r.max_tokens} * token_bytes);
    if (from == stored) {
      ls.staged_k.append(k, bytes);
      ls.staged_v.append(v, bytes);
    } else {
      const std::size_t heads = std::size_t{tokens} * shape.kv_heads;
      rows_.resize(bytes);
      convert_rows(k, from, rows_.data(), stored, heads, shape.head_dim);
      ls.staged_k.append(rows_.data(), bytes);
      convert_rows(v, from, rows_.data(), stored, heads, shape.head_dim);
      ls.staged_v.append(rows_.data(), bytes);
    }
    ls.staged_tokens += tokens;
  }

  // What PromptAttention attends the staged prompt with: the model's heads,
  // the storage dtype, and the scale Attend applies.
  static PromptAttentionShape attention_shape(const StepScope<Policy>& scope) {
    const Config& config = *scope.config;
    const float scale = config.attention_scale != 0.0f ? config.attention_scale : scope.scale();
    return PromptAttentionShape{config.storage_dtype(*scope.shape), scope.shape->q_heads, scope.shape->kv_heads,
                                scope.shape->head_dim, scale};
  }

  // Staged positions [first, end) into k / v in `as` (checked by the caller).
  static void read(const StepScope<Policy>& scope, const LayerStepState<State>& ls, std::uint32_t first,
                   std::uint32_t end, void* k, void* v, DType as) {
    const ModelShape& shape = *scope.shape;
    const DType stored = scope.config->storage_dtype(shape);
    const std::size_t row = shape.kv_heads * dtype_row_bytes(stored, shape.head_dim);
    const std::size_t rows = std::size_t{end - first} * shape.kv_heads;
    convert_rows(ls.staged_k.data() + first * row, stored, k, as, rows, shape.head_dim);
    convert_rows(ls.staged_v.data() + first * row, stored, v, as, rows, shape.head_dim);
  }

  // The causal attention of the last `rows` staged tokens (Manager::prompt_chunk).
  static PromptChunk chunk(RequestId request, std::uint32_t layer, const LayerStepState<State>& ls, const float* q,
                           std::uint32_t rows, float* out, std::size_t q_stride, std::size_t out_stride) {
    if (ls.prefilled) {
      fail(ErrorCode::failed_precondition, "prompt_chunk of request {} layer {}: the layer is prefilled", request,
           layer);
    }
    if (rows == 0 || rows > ls.staged_tokens) {
      fail(ErrorCode::out_of_range, "prompt_chunk of request {} layer {}: {} rows, {} staged", request, layer, rows,
           ls.staged_tokens);
    }
    if (q == nullptr || out == nullptr) fail(ErrorCode::invalid_argument, "prompt_chunk: q and out must not be null");
    return PromptChunk{q,    q_stride, ls.staged_k.data(), ls.staged_v.data(), ls.staged_tokens - rows,
                       rows, out,      out_stride};
  }

  // Prefills the layer with its staged prompt and releases the staged bytes,
  // and the prompt's fp32 copy (keys / values, the caller's scratch) when it
  // is long: kept, it would stay resident beside the CPU tier.
  static void prefill(const StepScope<Policy>& scope, RequestRegistry<Policy>& registry, RequestId request,
                      std::uint32_t layer, std::vector<float>& keys, std::vector<float>& values) {
    LayerStepState<State>& ls =
        registry.prefill_entry(request, layer, registry.at(request).layers[layer].staged_tokens);
    host_prefill(scope, request, layer, ls, ls.staged_k.data(), ls.staged_v.data(), ls.staged_tokens, keys, values,
                 scope.config->storage_dtype(*scope.shape));
    ls.staged_k.release();
    ls.staged_v.release();
    ls.staged_tokens = 0;
    if (keys.capacity() * sizeof(float) > kKeptScratchBytes) {
      keys = {};
      values = {};
    }
  }

 private:
  static constexpr std::size_t kKeptScratchBytes = std::size_t{1} << 20;
  std::vector<float> keys_, values_;  // a chunk in fp32, for its finiteness check
  std::vector<std::byte> rows_;       // a chunk's rows converted to the storage dtype
};

}  // namespace sparsekv
