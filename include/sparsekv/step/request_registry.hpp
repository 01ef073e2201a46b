#pragma once
// RequestRegistry: the step layer's books of the live requests -- each one's
// max_tokens, the mandatory pages its policy needs, and per layer its
// LayerStepState (the policy's state, the staged prompt, the recent tokens)
// -- and the checks each call makes against them before anything changes.
// The books ride in the buffer's own entry of the request (a
// RequestAttachment, buffer/buffer_request.hpp), so a request is booked in one
// place: add() is the buffer's add_request, erase() its finish, and the two
// cannot disagree. The Manager holds one; every runner of a call finds its
// requests here.
#include <algorithm>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "sparsekv/buffer/tiered_kv_buffer.hpp"
#include "sparsekv/core/error.hpp"
#include "sparsekv/policy/sparse_attention.hpp"
#include "sparsekv/step/layer_state.hpp"

namespace sparsekv {

template <class State>
struct RequestSteps : RequestAttachment {
  std::uint32_t max_tokens = 0;
  std::uint32_t mandatory_pages = 0;  // per (layer, kv head): the policy's for max_tokens
  std::vector<LayerStepState<State>> layers;
};

template <class Policy>
class RequestRegistry {
  using State = typename Policy::LayerState;

 public:
  using Request = RequestSteps<State>;

  // The books live in `buffer`'s requests; the buffer must outlive the
  // registry, which serves no call before bind().
  void bind(TieredKVBuffer& buffer, std::uint32_t layers) {
    admission_ = &buffer.admission();
    layers_ = layers;
  }

  bool contains(RequestId request) const {
    return admission_->has_request(request) && admission_->attachment(request) != nullptr;
  }
  // Throws not_found for an unknown or finished request.
  Request& at(RequestId request) {
    RequestAttachment* books = admission_->has_request(request) ? admission_->attachment(request) : nullptr;
    if (books == nullptr) fail(ErrorCode::not_found, "unknown or finished request {}", request);
    return static_cast<Request&>(*books);  // every attachment in this buffer is add()'s
  }
  const Request& at(RequestId request) const { return const_cast<RequestRegistry*>(this)->at(request); }
  template <class F>
  void for_each_id(F&& f) const {
    for (RequestId id : admission_->request_ids()) {
      if (admission_->attachment(id) != nullptr) f(id);
    }
  }

  // The buffer's add_request(request, pages), with the request's books;
  // throws what it throws, changing nothing.
  void add(RequestId request, std::uint32_t max_tokens, const RequestPages& pages, const Policy& policy) {
    auto r = std::make_unique<Request>();
    r->max_tokens = max_tokens;
    r->mandatory_pages = pages.mandatory_pages;
    r->layers.resize(layers_);
    for (auto& layer : r->layers) {
      layer.policy = make_layer_state(policy);
      layer.max_tokens = max_tokens;
    }
    admission_->add_request(request, pages, std::move(r));
  }
  // The buffer's finish(request): its pages and its books go together.
  void erase(RequestId request) {
    at(request);
    admission_->finish(request);
  }

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
  BufferAdmission* admission_ = nullptr;
  std::uint32_t layers_ = 0;
};

}  // namespace sparsekv
