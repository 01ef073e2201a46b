#pragma once
// EvictingStep: the parts of a host decode step that differ for a policy that
// evicts tokens for good (policy/token_eviction.hpp, SpvLLM §2; H2O,
// StreamingLLM). Per request, the evictions decided at the last step leave the
// cache, then this token takes a slot (the buffer's strategy picks it, a freed
// one first under slot_reuse), and the selection is every page with a live
// slot: dense attention over the live tokens, as H2O and StreamingLLM attend.
// There is no Select. After Attend, the policy reads the step's attention
// weights (when it needs them) and decides what each kv head drops; the
// buffer applies that at the layer's next step, so the step's plan stays
// valid until the next call. The host step (host_step.hpp) runs these in its
// phases: prepare in begin, commit in commit, decide in finish.
#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "sparsekv/attention/attend_plan.hpp"
#include "sparsekv/buffer/tiered_kv_buffer.hpp"
#include "sparsekv/core/error.hpp"
#include "sparsekv/policy/token_eviction.hpp"
#include "sparsekv/step/layer_state.hpp"
#include "sparsekv/step/step_plan.hpp"
#include "sparsekv/step/step_scope.hpp"

namespace sparsekv {

// One batch entry of a host step: the request, its step state in the layer,
// and the mandatory pages per kv head it was admitted with.
template <class State>
struct HostStepEntry {
  RequestId request = 0;
  LayerStepState<State>* state = nullptr;
  std::uint32_t mandatory_pages = 0;
};

// Whether an eviction drops anything in any kv head.
inline bool drops_any(const Eviction& e) {
  return std::any_of(e.positions.begin(), e.positions.end(), [](const auto& p) { return !p.empty(); });
}

template <class Policy>
class EvictingStep {
 public:
  using State = typename Policy::LayerState;
  using Entry = HostStepEntry<State>;

  explicit EvictingStep(const StepScope<Policy>& scope) : scope_(scope) {}

  // Planned against the pools, as a selecting step plans its saves: each
  // entry's evictions then its placement, and no kv head attending more live
  // pages than its mandatory pages. The policy sees its token placed on a
  // copy of its state. Throws; changes nothing.
  void prepare(std::span<const Entry> batch, std::uint32_t layer, StepPlan<State>& plan) {
    TieredKVBuffer& buffer = *scope_.buffer;
    for (std::size_t b = 0; b < batch.size(); ++b) {
      const Entry& e = batch[b];
      const EvictionDemand demand = buffer.evictor().append_demand_evicting(e.request, layer, pending(*e.state));
      plan.add_placement(e.request, demand);
      for (std::uint32_t h = 0; h < scope_.shape->kv_heads; ++h) {
        if (demand.live_partitions[h] > e.mandatory_pages) {
          fail(ErrorCode::resource_exhausted,
               "decode: request {} layer {} kv head {} would attend {} live pages, over its {} mandatory pages",
               e.request, layer, h, demand.live_partitions[h], e.mandatory_pages);
        }
      }
      PlannedEntry<State>& next = plan.entry(b);
      next.state = e.state->policy;
      const std::uint32_t position = buffer.admission().sequence_length(e.request, layer);
      token_placed(*scope_.policy, scope_.context(layer, position + 1), position, next.state);
    }
    plan.check(buffer, CommitOrder::entry_by_entry);
  }

  // Evicts, places the token (row b of k_new / v_new, model dtype) and
  // retrieves every page with a live slot. Nothing here refuses.
  void commit(std::span<const Entry> batch, std::uint32_t layer, const void* k_new, const void* v_new,
              StepPlan<State>& plan, std::span<Selection> selections, std::span<Retrieval> retrievals) {
    TieredKVBuffer& buffer = *scope_.buffer;
    StepStats& stats = *scope_.stats;
    const std::size_t row_bytes = scope_.kv_row() * dtype_size(scope_.shape->dtype);
    for (std::size_t b = 0; b < batch.size(); ++b) {
      const Entry& e = batch[b];
      LayerStepState<State>& ls = *e.state;
      const auto a0 = Clock::now();
      if (ls.eviction) buffer.evictor().evict(e.request, layer, ls.eviction->positions);
      ls.eviction.reset();
      buffer.evictor().place_token(
          e.request, layer,
          KvChunk{static_cast<const std::byte*>(k_new) + b * row_bytes,
                  static_cast<const std::byte*>(v_new) + b * row_bytes, 1, scope_.shape->dtype});
      ls.policy = std::move(plan.entry(b).state);
      auto& selection = selections[b].partitions;
      selection.resize(scope_.shape->kv_heads);
      for (std::uint32_t h = 0; h < scope_.shape->kv_heads; ++h) {
        buffer.evictor().live_partitions(e.request, layer, h, selection[h]);
      }
      const auto r0 = Clock::now();
      buffer.retriever().retrieve(e.request, layer, selection, retrievals[b]);
      const auto r1 = Clock::now();
      stats.append_s += seconds(r0 - a0);
      stats.retrieve_s += seconds(r1 - r0);
    }
  }

  // After Attend: the step's slot weights ([attend plan pages][page_tokens],
  // when the policy reads them; empty otherwise) go to the policy by sequence
  // position, and the policy decides what each kv head drops next step.
  void decide(std::span<const Entry> batch, std::uint32_t layer, std::span<const Retrieval> retrievals,
              std::span<const float> slot_weights) {
    const Policy& policy = *scope_.policy;
    const TieredKVBuffer& buffer = *scope_.buffer;
    const std::uint32_t pt = scope_.config->page_tokens;
    std::size_t index = 0;  // the plan's pages walk the batch, its heads and their pages in this order
    for (std::size_t b = 0; b < batch.size(); ++b) {
      const Entry& e = batch[b];
      LayerStepState<State>& ls = *e.state;
      const Retrieval& r = retrievals[b];
      const std::uint32_t position = buffer.admission().sequence_length(e.request, layer) - 1;
      const LayerContext ctx = scope_.context(layer, position + 1);
      EvictionContext ec;
      ec.newest = position;
      for (std::uint32_t h = 0; h < scope_.shape->kv_heads; ++h) {
        ec.live_tokens.push_back(buffer.evictor().live_tokens(e.request, layer, h));
      }
      if (!slot_weights.empty()) {
        weights_.reset(scope_.shape->kv_heads);
        for (std::uint32_t h = 0; h < scope_.shape->kv_heads; ++h) {
          for (std::uint32_t i = r.head_offsets[h]; i < r.head_offsets[h + 1]; ++i) {
            for (std::uint32_t p = r.pages.partition_offsets[i]; p < r.pages.partition_offsets[i + 1]; ++p, ++index) {
              for (std::uint32_t t = 0; t < pt; ++t) {
                const std::uint32_t pos = r.slot_positions[std::size_t{p} * pt + t];
                if (pos != kNoPosition) weights_.heads[h].push_back({pos, slot_weights[index * pt + t]});
              }
            }
          }
        }
        observe_weights(policy, ctx, weights_, ls.policy);
      }
      Eviction out;
      evict_tokens(policy, ctx, ec, ls.policy, out);
      if (drops_any(out)) ls.eviction = std::move(out);
    }
  }

 private:
  using Clock = std::chrono::steady_clock;
  static double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }
  // The positions a layer's pending eviction drops per kv head (none: empty lists).
  std::span<const std::vector<std::uint32_t>> pending(const LayerStepState<State>& ls) {
    if (ls.eviction) return ls.eviction->positions;
    no_eviction_.resize(scope_.shape->kv_heads);
    return no_eviction_;
  }

  StepScope<Policy> scope_;
  TokenWeights weights_;
  std::vector<std::vector<std::uint32_t>> no_eviction_;  // empty lists: a step with nothing to drop
};

}  // namespace sparsekv
