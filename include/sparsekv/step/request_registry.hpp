#pragma once
// RequestRegistry: the step layer's books of the live requests -- each one's
// max_tokens, the mandatory pages its policy needs, and per layer its
// LayerStepState (the policy's state, the staged prompt, the recent tokens)
// -- and the checks each call makes against them before anything changes.
// The Manager holds one; every runner of a call finds its requests here.
#include <algorithm>
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "sparsekv/buffer/tiered_kv_buffer.hpp"
#include "sparsekv/core/error.hpp"
#include "sparsekv/policy/sparse_attention.hpp"
#include "sparsekv/step/layer_state.hpp"

namespace sparsekv {

template <class State>
struct RequestSteps {
  std::uint32_t max_tokens = 0;
  std::uint32_t mandatory_pages = 0;  // per (layer, kv head): the policy's for max_tokens
  std::vector<LayerStepState<State>> layers;
};

template <class Policy>
class RequestRegistry {
  using State = typename Policy::LayerState;

 public:
  using Request = RequestSteps<State>;

  explicit RequestRegistry(std::uint32_t layers) : layers_(layers) {}

  bool contains(RequestId request) const { return requests_.contains(request); }
  // Throws not_found for an unknown or finished request.
  Request& at(RequestId request) {
    const auto it = requests_.find(request);
    if (it == requests_.end()) fail(ErrorCode::not_found, "unknown or finished request {}", request);
    return it->second;
  }
  const Request& at(RequestId request) const { return const_cast<RequestRegistry*>(this)->at(request); }
  template <class F>
  void for_each_id(F&& f) const {
    for (const auto& entry : requests_) f(entry.first);
  }

  void add(RequestId request, std::uint32_t max_tokens, std::uint32_t mandatory_pages, const Policy& policy) {
    Request& r = requests_[request];
    r.max_tokens = max_tokens;
    r.mandatory_pages = mandatory_pages;
    r.layers.resize(layers_);
    for (auto& layer : r.layers) {
      layer.policy = make_layer_state(policy);
      layer.max_tokens = max_tokens;
    }
  }
  void erase(RequestId request) { requests_.erase(request); }

  // A prefill's request and layer, checked: known, the layer in range and not
  // yet prefilled, the prompt non-empty and within max_tokens.
  LayerStepState<State>& prefill_entry(RequestId request, std::uint32_t layer, std::uint32_t tokens) {
    Request& r = at(request);
    check_index("layer", layer, layers_);
    if (tokens == 0) fail(ErrorCode::invalid_argument, "prefill of request {}: tokens must be > 0", request);
    LayerStepState<State>& ls = r.layers[layer];
    if (ls.prefilled) fail(ErrorCode::failed_precondition, "request {} layer {} is already prefilled", request, layer);
    check_fits(request, "a prompt", 0, tokens, r.max_tokens);
    return ls;
  }

  // Entry b of a decode batch: a known request, once in the batch, prefilled
  // in `layer` and below its max_tokens.
  Request& batch_entry(std::span<const RequestId> batch, std::size_t b, std::uint32_t layer,
                       const TieredKVBuffer& buffer) {
    Request& r = at(batch[b]);
    if (std::find(batch.begin(), batch.begin() + b, batch[b]) != batch.begin() + b) {
      fail(ErrorCode::invalid_argument, "decode: request {} appears twice in the batch", batch[b]);
    }
    if (!r.layers[layer].prefilled) {
      fail(ErrorCode::failed_precondition, "decode of request {} layer {} before its prefill", batch[b], layer);
    }
    check_fits(batch[b], "a decode step", buffer.admission().sequence_length(batch[b], layer), 1, r.max_tokens);
    return r;
  }

  // One condition, one code: a request grown past its max_tokens, by a
  // prompt, a chunk, a decode step, an extend or a fork, is resource_exhausted.
  static void check_fits(RequestId request, std::string_view what, std::uint64_t held, std::uint64_t tokens,
                         std::uint32_t max_tokens) {
    if (held + tokens <= max_tokens) return;
    fail(ErrorCode::resource_exhausted, "request {}: {} + {} tokens ({}) exceed its max_tokens {}", request, held,
         tokens, what, max_tokens);
  }

 private:
  std::uint32_t layers_;
  std::map<RequestId, Request> requests_;
};

}  // namespace sparsekv
