#pragma once
// What the step keeps per (request, layer) besides the buffer's tables: the
// policy's state and the decode tokens it has not seen as a page yet. The
// RequestRegistry (request_registry.hpp) holds one per layer of each request; a step reads and
// commits the ones of its batch.
#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include "sparsekv/memory/reserved_bytes.hpp"
#include "sparsekv/policy/token_eviction.hpp"

namespace sparsekv {

template <class State>
struct LayerStepState {
  State policy;
  bool prefilled = false;
  // The request's max_tokens, for which Index reserves the policy's state
  // (LayerContext::reserve_tokens).
  std::uint32_t max_tokens = 0;
  // A prompt arriving in chunks (Manager::prefill_chunk), host tensors in the
  // storage dtype, [token][kv_head][dim], until the layer is prefilled with it:
  // reserved for max_tokens, resident as written, returned when prefilled.
  ReservedBytes staged_k, staged_v;
  std::uint32_t staged_tokens = 0;
  // Host tensors: the decode tokens since the last saved page, fp32
  // [token][kv_head][dim], shown to the policy with the token that fills it.
  std::vector<float> recent_k, recent_v;
  // Device tensors, a policy whose device Select reads its host state
  // (RetroInfer): decode pages saved since the state was last fed
  // (host_state_row, host_index_update_due).
  std::uint32_t unfed_pages = 0;
  // A policy that evicts: what the last step decided to drop, applied at the next.
  std::optional<Eviction> eviction;
};

}  // namespace sparsekv
