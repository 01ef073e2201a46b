#pragma once
// A policy's device Select (the device decode step, docs/device-decode.md),
// open to registration. A policy with one declares beside it a spec, a plain
// trivially copyable struct that names the policy it serves and states its
// rules, and a device_select_spec(policy, ctx) that makes it:
//
//   struct MyDeviceSelect {
//     using Policy = MyPolicy;
//     static constexpr cuda::AppendSummary summary = cuda::AppendSummary::quest;  // what the store keeps
//     std::uint32_t capacity(std::uint32_t max_partitions, std::uint32_t page_tokens) const;
//     ...  // the Select's parameters
//   };
//
// and optionally `static constexpr bool reads_host_state = true` (its rows
// read the host policy state, which the step then keeps in step),
// `static constexpr bool estimates = true` (it may hand an estimation zone's
// terms to the attention) and a `first_partition` member (the partition id
// of a row's first candidate). DeviceSelect holds any spec by value, without
// allocating; the CUDA runtime finds its launch by the spec's type
// (policy/device_select_launch.hpp). Built in: Quest (Tang et al. 2024,
// min / max bound) and ShadowKV (Sun et al. 2024; Spin §4.2, landmarks +
// outliers) over summaries kept on the device, equal to their host select()
// bit for bit; StreamingWindow (StreamingLLM) and Dense from the candidates'
// positions and token counts alone; RetroInfer (Chen et al. 2025, §4.2)
// ranking centroids kept on the device, its clustering on the host
// (policy/host_state_feed.hpp). Every other policy has none and is served by
// the host-tensor API.
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <new>
#include <optional>
#include <type_traits>
#include <typeinfo>

#include "sparsekv/core/error.hpp"
#include "sparsekv/policy/select_cuda.hpp"
#include "sparsekv/policy/sparse_attention.hpp"
#include "sparsekv/policy/summary_store_cuda.hpp"

namespace sparsekv {

inline constexpr std::size_t kMaxDeviceSelectSpecBytes = 64;

template <class S>
concept DeviceSelectSpec = std::is_trivially_copyable_v<S> && sizeof(S) <= kMaxDeviceSelectSpecBytes &&
                           alignof(S) <= alignof(std::max_align_t) && requires(const S& s, std::uint32_t n) {
  typename S::Policy;
  { S::summary } -> std::convertible_to<cuda::AppendSummary>;
  { s.capacity(n, n) } -> std::convertible_to<std::uint32_t>;
};

// One layer's device Select: a spec of any registered type, or none.
class DeviceSelect {
 public:
  DeviceSelect() = default;  // none: the policy selects on the host
  template <DeviceSelectSpec S>
  DeviceSelect(const S& spec) : rules_(&rules_of<S>()) {  // NOLINT: a spec converts
    std::memcpy(bytes_, &spec, sizeof(S));
  }

  bool on_device() const noexcept { return rules_ != nullptr; }
  // The spec's type; typeid(void) for none.
  const std::type_info& type() const noexcept { return rules_ != nullptr ? *rules_->type : typeid(void); }
  template <class S>
  bool holds() const noexcept {
    return rules_ != nullptr && *rules_->type == typeid(S);
  }
  template <class S>
  const S* get_if() const noexcept {
    return holds<S>() ? std::launder(reinterpret_cast<const S*>(bytes_)) : nullptr;
  }
  // The spec; invalid_argument when it is of another type.
  template <class S>
  const S& get() const {
    const S* spec = get_if<S>();
    if (spec == nullptr) fail(ErrorCode::invalid_argument, "DeviceSelect: holds another spec type");
    return *spec;
  }

  // The spec's rules (AppendSummary::none, false and 0 for none):
  // - summary: the summaries the device store keeps for it (the positional
  //   kinds only token counts);
  // - reads_host_state: a row reads the host policy state (RetroInfer's sink
  //   and steady zone, host_state_row), which the step then keeps in step;
  // - estimates: it may hand an estimation zone's terms to the attention;
  // - first_partition: the partition id of a row's first candidate
  //   (RetroInfer's sink is none);
  // - capacity: the partitions one Select may return per row of at most
  //   `max_partitions` candidates, the bound the Select kernels hold their
  //   output array to (cuda::select_capacity; they cannot assume page-sized
  //   partitions, so Quest and ShadowKV need up to budget_tokens slots, not
  //   budget / page tokens). The step sizes its selection arrays by the
  //   largest over layers.
  cuda::AppendSummary summary() const noexcept {
    return rules_ != nullptr ? rules_->summary : cuda::AppendSummary::none;
  }
  bool reads_host_state() const noexcept { return rules_ != nullptr && rules_->reads_host_state; }
  bool estimates() const noexcept { return rules_ != nullptr && rules_->estimates; }
  std::uint32_t first_partition() const noexcept { return rules_ != nullptr ? rules_->first_partition(bytes_) : 0; }
  std::uint32_t capacity(std::uint32_t max_partitions, std::uint32_t page_tokens) const {
    return rules_ != nullptr ? rules_->capacity(bytes_, max_partitions, page_tokens) : 0;
  }

 private:
  struct Rules {
    const std::type_info* type;
    cuda::AppendSummary summary;
    bool reads_host_state;
    bool estimates;
    std::uint32_t (*capacity)(const std::byte*, std::uint32_t, std::uint32_t);
    std::uint32_t (*first_partition)(const std::byte*);
  };
  template <class S>
  static const S& spec_at(const std::byte* bytes) {
    return *std::launder(reinterpret_cast<const S*>(bytes));
  }
  template <class S>
  static const Rules& rules_of() {
    static const Rules rules{
        &typeid(S),
        S::summary,
        [] {
          if constexpr (requires { S::reads_host_state; }) return bool{S::reads_host_state};
          return false;
        }(),
        [] {
          if constexpr (requires { S::estimates; }) return bool{S::estimates};
          return false;
        }(),
        [](const std::byte* b, std::uint32_t max_partitions, std::uint32_t page_tokens) -> std::uint32_t {
          return spec_at<S>(b).capacity(max_partitions, page_tokens);
        },
        [](const std::byte* b) -> std::uint32_t {
          if constexpr (requires(const S& s) { s.first_partition; }) return spec_at<S>(b).first_partition;
          return 0;
        }};
    return rules;
  }

  const Rules* rules_ = nullptr;
  alignas(std::max_align_t) std::byte bytes_[kMaxDeviceSelectSpecBytes]{};
};

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

// The device Select of policy `p` in the layer of `ctx`, or none. A spec
// serves exactly the policy type it names (Spec::Policy): a policy derived
// from a built-in one may select differently, so it has none.
template <class P>
DeviceSelect device_select(const P& p, const LayerContext& ctx) {
  if constexpr (requires { device_select_spec(p, ctx); }) {
    using Made = decltype(device_select_spec(p, ctx));
    using Spec = typename detail::UnwrapSpec<Made>::type;
    static_assert(DeviceSelectSpec<Spec>, "a device Select spec states its rules (policy/device_select.hpp)");
    if constexpr (!std::is_same_v<typename Spec::Policy, P>) {
      return {};
    } else {
      Made spec = device_select_spec(p, ctx);
      if constexpr (std::is_same_v<Made, Spec>) {
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

}  // namespace sparsekv
