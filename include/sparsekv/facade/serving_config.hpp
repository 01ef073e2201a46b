#pragma once
// serving_config: a Config whose tiers fit `requests` requests of up to
// `max_tokens` tokens each under a policy, sized from what the policy says it
// needs -- what an engine that serves a fixed number of sequences of a fixed
// context (llama.cpp's n_seq_max x n_ctx_seq) wants without working out the
// tiers itself.
#include <cstdint>

#include "sparsekv/core/config.hpp"
#include "sparsekv/core/model_shape.hpp"
#include "sparsekv/policy/any_policy.hpp"

namespace sparsekv {

// From `base` (its page_tokens, eviction_strategy, attention_scale, ...):
//  - max_context_tokens: max_tokens, or the policy's mandatory pages if more
//    (a budget beyond the context still reserves its pages), plus a page;
//  - the CPU tier: every page a head can hold (the policy's head_capacity,
//    else one per page_tokens tokens) plus a margin of 64 pages a head;
//  - the GPU tier: each request's bucketed-LRU buffer (mandatory pages x (1 +
//    min_buffer_ratio), Spin's 5x) and its tail page, but never more slots
//    than a head can hold: where the ratio asks for more (Quest's dense layers
//    and Dense make the whole context mandatory), it is lowered to fit, which
//    changes no hit, miss or move. An InPlaceBackend never takes from it.
// Throws what Config::validate throws.
Config serving_config(const ModelShape& shape, const AnyPolicy& policy, std::uint32_t max_tokens,
                      std::uint32_t requests, Config base = {});

}  // namespace sparsekv
