#pragma once
// StepScope: what every runner of a step works in -- the model's shape, the
// Manager's Config, its policy, buffer, backend and stats -- and the helpers
// they share (the policy's LayerContext, the engine's tensors in fp32 and
// their finiteness check). The Manager owns each referenced object and
// outlives the runners it makes with it.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include "sparsekv/buffer/tiered_kv_buffer.hpp"
#include "sparsekv/core/config.hpp"
#include "sparsekv/core/convert.hpp"
#include "sparsekv/core/error.hpp"
#include "sparsekv/core/model_shape.hpp"
#include "sparsekv/core/numeric.hpp"
#include "sparsekv/policy/sparse_attention.hpp"
#include "sparsekv/step/backend.hpp"
#include "sparsekv/step/step_stats.hpp"

namespace sparsekv {

template <class Policy>
struct StepScope {
  const ModelShape* shape = nullptr;
  const Config* config = nullptr;
  const Policy* policy = nullptr;
  TieredKVBuffer* buffer = nullptr;
  Backend* backend = nullptr;
  StepStats* stats = nullptr;

  LayerContext context(std::uint32_t layer, std::uint32_t tokens) const {
    LayerContext ctx{layer,           shape->layers,       shape->q_heads, shape->kv_heads,
                     shape->head_dim, config->page_tokens, tokens};
    ctx.kv_dtype = shape->dtype;
    return ctx;
  }
  PageLayout layout() const { return {config->page_tokens, shape->head_dim, config->storage_dtype(*shape)}; }
  // The scale Attend and the policies apply to q.k: 1/sqrt(head_dim). A
  // Config::attention_scale s is folded into q instead (rescale_queries:
  // q * s * sqrt(head_dim)), so that Select ranks, and Attend weighs, by the
  // model's own logits through rules that are shared with the device.
  float scale() const { return 1.0f / std::sqrt(static_cast<float>(shape->head_dim)); }
  void rescale_queries(std::vector<float>& q) const {
    if (config->attention_scale == 0.0f) return;
    const float factor = config->attention_scale * std::sqrt(static_cast<float>(shape->head_dim));
    for (float& x : q) x *= factor;
  }
  // K/V rows an engine hands over or reads back: the model dtype or the storage dtype.
  void check_rows_dtype(std::string_view call, std::optional<DType> rows) const {
    const DType stored = config->storage_dtype(*shape);
    if (rows && *rows != shape->dtype && *rows != stored) {
      fail(ErrorCode::invalid_argument, "{}: rows in {}; expected the model's {} or the stored {}", call,
           to_string(*rows), to_string(shape->dtype), to_string(stored));
    }
  }
  std::size_t kv_row() const { return std::size_t{shape->kv_heads} * shape->head_dim; }  // one token's K or V
  std::size_t q_row() const { return std::size_t{shape->q_heads} * shape->head_dim; }    // one token's q

  // `n` values at `data` (in `dtype`: the model's unless said) as fp32 in
  // `out`; whether all are finite (found in the same pass).
  bool to_float(const void* data, std::size_t n, std::vector<float>& out) const {
    return to_float(data, shape->dtype, n, out);
  }
  bool to_float(const void* data, DType dtype, std::size_t n, std::vector<float>& out) const {
    out.resize(n);
    return widen_to_float(data, dtype, n, out.data());
  }
  // fp32 K/V rows of what a policy indexes, made the values the pages hold:
  // with q8_0 storage each row quantized and read back (the model dtype
  // stored as it is: nothing to do). So that Index and Select (Quest's
  // bounds) see what Attend reads.
  void as_stored(std::vector<float>& rows) const {
    const DType stored = config->storage_dtype(*shape);
    if (stored == shape->dtype || rows.empty()) return;
    const std::size_t count = rows.size() / shape->head_dim;
    thread_local std::vector<std::byte> blocks;
    blocks.resize(count * dtype_row_bytes(stored, shape->head_dim));
    convert_rows(rows.data(), DType::f32, blocks.data(), stored, count, shape->head_dim);
    convert_rows(blocks.data(), stored, rows.data(), DType::f32, count, shape->head_dim);
  }
  // Non-finite K/V must never reach the CPU tier, the source of truth: every
  // later output attending it would be NaN. `kv` holds [token][kv_head][dim]
  // rows, the first at sequence position `first`. Throws invalid_argument.
  // A search: bulk rows take to_finite_float, whose conversion checks them.
  void check_finite(std::string_view what, RequestId request, std::span<const float> kv, std::uint32_t first) const {
    const auto bad = std::find_if(kv.begin(), kv.end(), [](float x) { return !is_finite(x); });
    if (bad == kv.end()) return;
    const auto i = static_cast<std::size_t>(bad - kv.begin());
    fail(ErrorCode::invalid_argument, "{} of request {}: token {} kv head {} (dim {}) is not finite", what, request,
         first + i / kv_row(), i % kv_row() / shape->head_dim, i % shape->head_dim);
  }
  // to_float of K/V rows, then check_finite of them: no second pass over
  // the rows unless a value is not finite.
  void to_finite_float(std::string_view what, RequestId request, const void* data, std::size_t n,
                       std::vector<float>& out, std::uint32_t first, std::optional<DType> dtype = {}) const {
    if (!to_float(data, dtype.value_or(shape->dtype), n, out)) check_finite(what, request, out, first);
  }
};

}  // namespace sparsekv
