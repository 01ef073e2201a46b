#pragma once
// `--backend host|in-place|cuda` for the examples: the one runtime choice at
// the facade edge, which also picks the Manager's tensor API.
//
//   host      HostBackend, host tensors (the host-tensor API).
//   in-place  InPlaceBackend, host tensors: no GPU tier, the CPU pages
//             attended where they are (what a CPU engine uses).
//   cuda  CudaBackend, device tensors on the engine's stream (the
//         device-tensor API, docs/integration.md). The examples show its
//         device path, so they ask for a policy with a device Select
//         (policy/device_select.hpp) at this shape and page size; for any
//         other policy -- which the library serves through its slower
//         host-Select path, no faster than host tensors -- it is an error
//         naming --backend host.
//   none  cuda when sparsekv::cuda is linked (SPARSEKV_EXAMPLE_CUDA), a
//         device can be used and the policy has a device Select; else host,
//         with a note saying why when a device was there to use.
//
// Asking for cuda where it cannot run is an error, never a silent fallback.
#include <memory>
#include <string>
#include <string_view>

#include "sparsekv/core/config.hpp"
#include "sparsekv/core/device.hpp"
#include "sparsekv/core/error.hpp"
#include "sparsekv/core/model_shape.hpp"
#include "sparsekv/facade/host_backend.hpp"
#include "sparsekv/facade/in_place_backend.hpp"
#include "sparsekv/policy/any_policy.hpp"
#if SPARSEKV_EXAMPLE_CUDA
#include "sparsekv/facade/cuda_backend.hpp"
#endif

namespace sparsekv::tools {

struct BackendChoice {
  std::unique_ptr<Backend> backend;
  bool device_tensors = false;  // drive the Manager with device tensors on a stream
  std::string note;             // why the default fell back to host; empty otherwise
};

// Why `policy` cannot serve device tensors at `shape` / `config` (the check
// Manager makes at its first device-tensor call, made here before anything is
// built); empty when every layer has a device Select.
inline std::string device_select_refusal(const AnyPolicy& policy, const ModelShape& shape, const Config& config) {
  for (std::uint32_t l = 0; l < shape.layers; ++l) {
    const LayerContext ctx{
        l, shape.layers, shape.q_heads, shape.kv_heads, shape.head_dim, config.page_tokens, config.max_context_tokens};
    if (!device_select(policy, ctx).on_device()) {
      return fmt::format(
          "policy {} has no device Select at {}-token pages (layer {}; policy/device_select.hpp: "
          "Quest with one-page partitions, ShadowKV, StreamingWindow, Dense, RetroInfer; not the oracle)",
          policy.name(), config.page_tokens, l);
    }
  }
  return {};
}

inline BackendChoice choose_backend(std::string_view name, const AnyPolicy& policy, const ModelShape& shape,
                                    const Config& config) {
  if (!name.empty() && name != "host" && name != "in-place" && name != "cuda") {
    fail(ErrorCode::invalid_argument, "--backend must be host, in-place or cuda, not '{}'", name);
  }
  BackendChoice choice;
  if (name == "host") {
    choice.backend = std::make_unique<HostBackend>();
    return choice;
  }
  if (name == "in-place") {
    choice.backend = std::make_unique<InPlaceBackend>();
    return choice;
  }
  const std::string refusal = device_select_refusal(policy, shape, config);
  if (name == "cuda") {
    // A configuration error: reported the same with or without a device.
    if (!refusal.empty()) fail(ErrorCode::invalid_argument, "--backend cuda: {}; run it with --backend host", refusal);
#if SPARSEKV_EXAMPLE_CUDA
    if (cuda_device_count() == 0) fail(ErrorCode::unavailable, "--backend cuda: no usable CUDA device");
    choice.backend = std::make_unique<cuda::CudaBackend>();
    choice.device_tensors = true;
    return choice;
#else
    fail(ErrorCode::unavailable,
         "--backend cuda: this build has no CUDA backend (nvcc was not found at configure time)");
#endif
  }
#if SPARSEKV_EXAMPLE_CUDA
  if (cuda_device_count() > 0) {
    if (refusal.empty()) {
      choice.backend = std::make_unique<cuda::CudaBackend>();
      choice.device_tensors = true;
      return choice;
    }
    choice.note = refusal + ": using the host backend";
  }
#endif
  choice.backend = std::make_unique<HostBackend>();
  return choice;
}

}  // namespace sparsekv::tools
