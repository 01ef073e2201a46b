#pragma once
// DeviceTensorCalls: the Manager's calls on device tensors (docs/integration.md,
// "Device tensors"). A policy with a device Select in every layer runs the
// whole step on the device (DeviceStep, through the backend's DeviceRuntime,
// made at the first call); any other takes the host-Select path: the call's
// tensors are copied into host memory (HostSelectTensors), the host call runs, and
// `out` goes back up, each call waiting. Every call checks its arguments and
// the registry's requests before it changes anything.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

#include "sparsekv/core/error.hpp"
#include "sparsekv/step/backend.hpp"
#include "sparsekv/step/device_step.hpp"
#include "sparsekv/step/prefill.hpp"
#include "sparsekv/step/request_registry.hpp"
#include "sparsekv/step/request_sizing.hpp"
#include "sparsekv/step/host_select_tensors.hpp"
#include "sparsekv/step/step_scope.hpp"

namespace sparsekv {

template <class Policy>
class DeviceTensorCalls {
  using State = typename Policy::LayerState;

 public:
  // The objects the calls work on; again after the owner moves.
  void bind(const StepScope<Policy>& scope, RequestRegistry<Policy>& registry) {
    scope_ = scope;
    registry_ = &registry;
    if (runtime_) step_.emplace(scope_, *runtime_);
  }

  void prefill(RequestId request, std::uint32_t layer, const void* k, const void* v, std::uint32_t tokens,
               void* stream) {
    const bool on_device = selects_on_device();
    if (on_device) {
      runtime();
    } else {
      require_device_memory();
    }
    registry_->at(request);
    check_index("layer", layer, scope_.shape->layers);
    check_pointer("prefill k", k);
    check_pointer("prefill v", v);
    LayerStepState<State>& ls = registry_->prefill_entry(request, layer, tokens);
    if (on_device) {
      step_->prefill({request, &ls, table_slot(request)}, layer, k, v, tokens, stream);
      return;
    }
    const std::size_t bytes = std::size_t{tokens} * scope_.kv_row() * dtype_size(scope_.shape->dtype);
    host_prefill(scope_, request, layer, ls, copies_.copy_in(*scope_.backend, 1, k, bytes, stream),
                 copies_.copy_in(*scope_.backend, 2, v, bytes, stream), tokens, keys_, values_);
  }

  // `host_decode(q, k_new, v_new, out)` runs the host-tensor decode on host
  // copies: the host-Select path.
  template <class HostDecode>
  void decode(std::span<const RequestId> batch, std::uint32_t layer, const void* q, const void* k_new,
              const void* v_new, float* out, void* stream, HostDecode&& host_decode) {
    if (selects_on_device()) {
      runtime();
      check_pointer("decode out", out);
      // The attention kernel's shapes, refused before the step changes the buffer.
      scope_.backend->check_attend(scope_.layout(), scope_.shape->q_heads, scope_.shape->kv_heads);
      step_->decode(entries(batch, layer, q, k_new, v_new), layer, q, k_new, v_new, out, stream);
      return;
    }
    require_device_memory();
    for (const auto& [what, p] :
         {std::pair{"decode q", q}, std::pair{"decode k_new", k_new}, std::pair{"decode v_new", v_new},
          std::pair{"decode out", static_cast<const void*>(out)}}) {
      check_pointer(what, p);
    }
    const std::size_t elem = dtype_size(scope_.shape->dtype);
    const std::size_t kv_bytes = batch.size() * scope_.kv_row() * elem;
    const std::byte* host_q = copies_.copy_in(*scope_.backend, 0, q, batch.size() * scope_.q_row() * elem, stream);
    const std::byte* host_k = copies_.copy_in(*scope_.backend, 1, k_new, kv_bytes, stream);
    const std::byte* host_v = copies_.copy_in(*scope_.backend, 2, v_new, kv_bytes, stream);
    scope_.backend->check_attend(scope_.layout(), scope_.shape->q_heads, scope_.shape->kv_heads);
    host_decode(host_q, host_k, host_v, copies_.output(batch.size() * scope_.q_row()));
    copies_.write_output(*scope_.backend, out, stream);
  }

  DeviceAttendPlan plan(std::span<const RequestId> batch, std::uint32_t layer, const void* q, const void* k_new,
                        const void* v_new, void* stream) {
    if (!selects_on_device()) {
      require_device_memory();
      fail(ErrorCode::invalid_argument,
           "policy {} selects on the host: plan() on device tensors needs a device Select "
           "(policy/device_select.hpp); use decode(), or plan() on host tensors",
           policy_name(*scope_.policy));
    }
    runtime();
    step_->decode(entries(batch, layer, q, k_new, v_new), layer, q, k_new, v_new, nullptr, stream);
    return runtime_->plan();
  }

  // The device runtime, made at the first call that needs it; then every
  // registered request's tables go up too (none is prefilled: that would
  // have chosen host tensors).
  DeviceRuntime& runtime() {
    check_scale();
    if (runtime_) return *runtime_;
    runtime_ = scope_.backend->make_device_runtime(
        device_runtime_setup(scope_, table_head_capacity(scope_).partitions,
                             request_pages(scope_, scope_.config->max_context_tokens).mandatory_pages),
        *scope_.buffer);
    if (!runtime_) unavailable();
    registry_->for_each_id([&](RequestId id) { runtime_->upload_tables(id); });
    step_.emplace(scope_, *runtime_);
    return *runtime_;
  }
  // The runtime if a call made it, else null.
  DeviceRuntime* made_runtime() const noexcept { return runtime_.get(); }

  // `add()` adds a request to the buffer, which may reclaim buffering pages
  // of other requests, whose current GPU page tables the device holds: they
  // come back first, and go up again with the new request's.
  template <class Add>
  void admit(Add&& add) {
    if (!runtime_) {
      add();
      return;
    }
    registry_->for_each_id([&](RequestId id) { runtime_->download_tables(id); });
    add();
    registry_->for_each_id([&](RequestId id) { runtime_->upload_tables(id); });  // the new request's too
  }

  // Waits for every step enqueued so far and brings the device's hit / miss
  // totals into `stats`; reports a non-finite value a step found. Nothing
  // to do before the runtime is made.
  void synchronize(StepStats& stats) {
    if (!runtime_) return;
    runtime_->synchronize();
    stats.cache = runtime_->cache_stats();
    // Every miss the device gathered is one page moved CPU -> GPU, as Retrieve counts them.
    stats.pages_moved = stats.cache.miss_pages;
    stats.bytes_moved = stats.cache.miss_pages * scope_.buffer->tiers().cpu_pool.page_bytes();
    runtime_->check_values(nullptr);
  }

 private:
  // Whether every layer's policy selects on the device: fixed by the policy and Config, asked once.
  bool selects_on_device() {
    if (!selects_on_device_) selects_on_device_ = selects_on_device_in_every_layer(scope_);
    return *selects_on_device_;
  }
  void check_scale() const {
    if (scope_.config->attention_scale != 0.0f) {
      fail(ErrorCode::unavailable,
           "Config.attention_scale is served on host tensors only; device tensors attend with 1/sqrt(head_dim)");
    }
  }
  // The host-Select path's precondition (the device path's runtime() refuses the same).
  void require_device_memory() const {
    check_scale();
    if (!scope_.backend->has_device_memory()) unavailable();
  }
  [[noreturn]] void unavailable() const {
    fail(ErrorCode::unavailable, "backend {} serves host tensors only; device tensors need the CUDA backend",
         scope_.backend->name());
  }
  void check_pointer(std::string_view what, const void* p) const {
    if (p == nullptr) fail(ErrorCode::invalid_argument, "{} must not be null", what);
    if (!scope_.backend->is_device_pointer(p)) fail(ErrorCode::invalid_argument, "{} is not device memory", what);
  }
  std::uint32_t table_slot(RequestId request) const {
    const std::size_t per_request = std::size_t{scope_.shape->layers} * scope_.shape->kv_heads;
    return static_cast<std::uint32_t>(scope_.buffer->tiers().table.instance(request, 0, 0) / per_request);
  }
  std::span<const typename DeviceStep<Policy>::Entry> entries(std::span<const RequestId> batch, std::uint32_t layer,
                                                              const void* q, const void* k_new, const void* v_new) {
    check_index("layer", layer, scope_.shape->layers);
    if (batch.empty()) fail(ErrorCode::invalid_argument, "decode: empty batch");
    check_pointer("decode q", q);
    check_pointer("decode k_new", k_new);
    check_pointer("decode v_new", v_new);
    entries_.clear();
    for (std::size_t b = 0; b < batch.size(); ++b) {
      RequestSteps<State>& r = registry_->batch_entry(batch, b, layer, *scope_.buffer);
      entries_.push_back({batch[b], &r.layers[layer], table_slot(batch[b])});
    }
    return entries_;
  }

  StepScope<Policy> scope_;
  RequestRegistry<Policy>* registry_ = nullptr;
  std::optional<bool> selects_on_device_;
  std::unique_ptr<DeviceRuntime> runtime_;
  std::optional<DeviceStep<Policy>> step_;
  std::vector<typename DeviceStep<Policy>::Entry> entries_;
  std::vector<float> keys_, values_;  // a host-Select prompt in fp32
  HostSelectTensors copies_;
};

}  // namespace sparsekv
