#pragma once
// ExtendRunner: `tokens` tokens appended to a live request in one layer (a
// new chat turn, a speculative draft being verified; Manager::extend) as that
// many decode steps of batch 1, so that the request, its policy included,
// ends up exactly as if it had decoded them. Every token is checked before
// the first step; a layer whose prompt is still staged is checked as the
// prompt it will be.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "sparsekv/core/error.hpp"
#include "sparsekv/step/request_registry.hpp"
#include "sparsekv/step/step_scope.hpp"

namespace sparsekv {

template <class Policy>
class ExtendRunner {
 public:
  // Throws, changing nothing, what a decode step would: not_found,
  // failed_precondition (the layer neither prefilled nor staged),
  // resource_exhausted (past max_tokens), invalid_argument (null or
  // non-finite q, K or V, no tokens).
  void check(const StepScope<Policy>& scope, RequestRegistry<Policy>& registry, RequestId request, std::uint32_t layer,
             const void* q, const void* k, const void* v, std::uint32_t tokens) {
    RequestSteps<typename Policy::LayerState>& r = registry.at(request);
    check_index("layer", layer, scope.shape->layers);
    if (q == nullptr || k == nullptr || v == nullptr || tokens == 0) {
      fail(ErrorCode::invalid_argument, "extend of request {}: q, K and V must be non-null with tokens > 0", request);
    }
    const std::uint32_t staged = r.layers[layer].staged_tokens;
    const RequestId batch[] = {request};
    if (staged == 0) registry.batch_entry(batch, 0, layer, *scope.buffer);
    const std::uint32_t length = staged != 0 ? staged : scope.buffer->admission().sequence_length(request, layer);
    RequestRegistry<Policy>::check_fits(request, "an extend", length, tokens, r.max_tokens);
    const std::size_t kvd = scope.kv_row();
    if (!scope.to_float(q, tokens * scope.q_row(), scratch_)) {
      fail(ErrorCode::invalid_argument, "extend of request {}: a q value is not finite", request);
    }
    scope.to_finite_float("extend k", request, k, tokens * kvd, scratch_, length);
    scope.to_finite_float("extend v", request, v, tokens * kvd, scratch_, length);
  }

  // The steps, after check(): decode_step(q, k, v, out) per token, `out`
  // rows into `out` or dropped. A step that fails after the first throws
  // its code, naming how many tokens went in (those stay: each was a whole step).
  template <class DecodeStep>
  void run(const StepScope<Policy>& scope, RequestId request, const void* q, const void* k, const void* v,
           std::uint32_t tokens, float* out, DecodeStep&& decode_step) {
    const std::size_t qd = scope.q_row(), kvd = scope.kv_row(), size = dtype_size(scope.shape->dtype);
    dropped_.resize(qd);
    const auto* qb = static_cast<const std::byte*>(q);
    const auto* kb = static_cast<const std::byte*>(k);
    const auto* vb = static_cast<const std::byte*>(v);
    for (std::uint32_t t = 0; t < tokens; ++t) {
      try {
        decode_step(qb + t * qd * size, kb + t * kvd * size, vb + t * kvd * size,
                    out != nullptr ? out + t * qd : dropped_.data());
      } catch (const Error& e) {
        if (t == 0) throw;
        fail(e.code(), "extend of request {}: {} of {} tokens appended, then: {}", request, t, tokens, e.what());
      }
    }
  }

 private:
  std::vector<float> scratch_;  // the tokens in fp32, for their finiteness check
  std::vector<float> dropped_;  // a step's output the engine did not ask for
};

}  // namespace sparsekv
