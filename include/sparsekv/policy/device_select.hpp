#pragma once
// Which policies select on the device, and with what (the device decode step,
// docs/device-decode.md). Each policy that has a device Select declares its
// own spec beside it (QuestDeviceSelect in quest.hpp, ShadowKVDeviceSelect,
// StreamingDeviceSelect, DenseDeviceSelect, RetroInferDeviceSelect) and a
// device_select_spec(policy, ctx) that makes it; DeviceSelect is the one of
// them a layer uses, and the device step dispatches on it once, at its entry
// (step/device_runtime.hpp). Quest (Tang et al. 2024, min / max bound) and
// ShadowKV (Sun et al. 2024; Spin §4.2, landmarks + outliers) run the kernels
// of policy/select_cuda.hpp over summaries kept on the device, equal to their
// host select() bit for bit. StreamingWindow (StreamingLLM) and Dense select
// from the candidates' positions and token counts alone (no summaries: the
// store keeps only token counts). RetroInfer (Chen et al. 2025, §4.2) ranks
// centroids kept on the device; its clustering stays on the host, whose state
// its rows read (policy/host_state_feed.hpp). Every other policy has none
// (std::monostate) and is served by the host-tensor API.
#include <cstdint>
#include <optional>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "sparsekv/policy/dense.hpp"
#include "sparsekv/policy/host_state_feed.hpp"
#include "sparsekv/policy/quest.hpp"
#include "sparsekv/policy/retroinfer.hpp"
#include "sparsekv/policy/select_cuda.hpp"
#include "sparsekv/policy/shadowkv.hpp"
#include "sparsekv/policy/sparse_attention.hpp"
#include "sparsekv/policy/streaming_window.hpp"
#include "sparsekv/policy/summary_store_cuda.hpp"

namespace sparsekv {

using DeviceSelect = std::variant<std::monostate, QuestDeviceSelect, ShadowKVDeviceSelect, StreamingDeviceSelect,
                                  DenseDeviceSelect, RetroInferDeviceSelect>;

namespace detail {
template <class Spec>
struct UnwrapSpec {
  using type = Spec;
};
template <class Spec>
struct UnwrapSpec<std::optional<Spec>> {
  using type = Spec;
};
}  // namespace detail

// The device Select of policy `p` in the layer of `ctx`, or std::monostate. A
// spec serves exactly the policy type it names (Spec::Policy): a policy
// derived from a built-in one may select differently, so it has none.
template <class P>
DeviceSelect device_select(const P& p, const LayerContext& ctx) {
  if constexpr (requires { device_select_spec(p, ctx); }) {
    using Made = decltype(device_select_spec(p, ctx));
    if constexpr (!std::is_same_v<typename detail::UnwrapSpec<Made>::type::Policy, P>) {
      return {};
    } else {
      Made spec = device_select_spec(p, ctx);
      if constexpr (std::is_same_v<Made, typename detail::UnwrapSpec<Made>::type>) {
        return DeviceSelect{spec};
      } else {
        if (!spec) return {};
        return DeviceSelect{*spec};
      }
    }
  } else {
    return {};
  }
}

inline bool selects_on_device(const DeviceSelect& s) { return !std::holds_alternative<std::monostate>(s); }

// Whether a row of the Select reads the host policy state (RetroInfer's sink
// and steady zone, host_state_row), which the step then keeps in step.
inline bool reads_host_state(const DeviceSelect& s) { return std::holds_alternative<RetroInferDeviceSelect>(s); }

// The partition id of a row's first candidate (RetroInfer's sink is none).
inline std::uint32_t first_candidate_partition(const DeviceSelect& s) {
  const auto* retro = std::get_if<RetroInferDeviceSelect>(&s);
  return retro != nullptr ? retro->first_partition : 0;
}

// The summaries a Select reads on the device (the positional kinds only token
// counts); AppendSummary::none for a policy without a device Select.
inline cuda::AppendSummary summary_kind(const DeviceSelect& s) {
  using Summary = cuda::AppendSummary;
  constexpr Summary kinds[] = {Summary::none,   Summary::quest,  Summary::shadowkv,
                               Summary::tokens, Summary::tokens, Summary::retroinfer};
  static_assert(std::size(kinds) == std::variant_size_v<DeviceSelect>);
  return kinds[s.index()];
}

// The partitions one device Select of `s` may return per row of at most
// `max_partitions` candidates: the bound the Select kernels hold their output
// array to (cuda::select_capacity; they cannot assume page-sized partitions,
// so Quest and ShadowKV need up to budget_tokens slots, not budget / page
// tokens). The step sizes its selection arrays by the largest over layers.
inline std::uint32_t select_capacity(const DeviceSelect& s, std::uint32_t max_partitions, std::uint32_t page_tokens) {
  struct Capacity {
    std::uint32_t max_partitions, page_tokens;
    std::uint32_t operator()(std::monostate) const { return 0; }
    std::uint32_t operator()(const QuestDeviceSelect& q) const {
      return cuda::select_capacity(max_partitions, q.budget_tokens, q.dense_layer, 0);
    }
    std::uint32_t operator()(const ShadowKVDeviceSelect& k) const {
      return cuda::select_capacity(max_partitions, k.budget_tokens, false, 0);
    }
    std::uint32_t operator()(const StreamingDeviceSelect& w) const {
      const std::uint64_t pages = (std::uint64_t{w.budget_tokens} + page_tokens - 1) / page_tokens;
      return cuda::select_capacity(max_partitions,
                                   static_cast<std::uint32_t>(std::min<std::uint64_t>(pages, 0xffffffffu)), false, 0);
    }
    std::uint32_t operator()(const DenseDeviceSelect&) const {
      return cuda::select_capacity(max_partitions, 0, true, 0);
    }
    std::uint32_t operator()(const RetroInferDeviceSelect& r) const {
      // The sink besides the candidates; no budget (0): the whole row.
      return cuda::select_capacity(max_partitions, r.budget_tokens, r.budget_tokens == 0, 1);
    }
  };
  return std::visit(Capacity{max_partitions, page_tokens}, s);
}

}  // namespace sparsekv
