#pragma once
// sparsekv::Manager: the engine-facing facade (docs/integration.md). An engine
// with its own scheduler calls, per request:
//
//   can_admit(prompt, max_tokens)   advice only: the library never queues
//   add_request(id, max_tokens)
//   prefill(id, layer, k, v, tokens)          per layer: Index + Offload
//   decode(batch, layer, q, k_new, v_new, out) per step and layer: append,
//        Select, Retrieve, Attend -- or plan(...) instead, which stops after
//        Retrieve and returns an AttendPlan for the engine's own kernel
//   finish(id)
//
// and, for an engine with a prefix cache, fork(id, source, tokens, max_tokens)
// in place of add_request + prefill: the new request starts as the first
// `tokens` tokens of a live one, sharing its full CPU pages.
//
// Tensors are row-major in the model's dtype (ModelShape::dtype):
//   prefill k, v: [tokens][kv_heads][head_dim]
//   decode  q: [batch][q_heads][head_dim], k_new / v_new: [batch][kv_heads][head_dim]
//   out: [batch][q_heads][head_dim] fp32
// Each call comes in two kinds: host tensors (host memory), and device
// tensors (device memory and the engine's cudaStream_t; docs/integration.md,
// "Device tensors"). A Manager serves one kind: its first prefill picks, and
// the other kind is then refused. The caller keeps ownership of every
// pointer; nothing is retained after a call.
//
// The Manager orchestrates: it keeps the choice between host and device
// tensors and checks each call; the work is the step layer's (step/): the
// requests' books (RequestRegistry), HostStep (phases an engine's threads
// can share), PromptStaging, ExtendRunner, ForkRunner, DeviceTensorCalls.
//
// Threads and streams: one Manager is driven by one thread at a time (calls
// must not overlap), except for the phases of a host step, which the
// engine's threads share (begin_decode; docs/integration.md, "Threads").
// Every call has finished with the engine's buffers when it returns, so the
// engine may reuse them at once. decode() on host tensors returns with `out`
// complete. plan() may leave Retrieve's copies in flight on backend().stream()
// (CUDA backend): the engine orders its attention kernel after that stream.
// An AttendPlan stays valid until the next call on the same Manager.
//
// Errors: every call validates its arguments and the requests' state first
// (unknown or finished request, decode before prefill, shape or dtype
// mismatch, a batch naming a request twice) and throws sparsekv::Error,
// changing nothing. Manager<P> is templated on the policy; RuntimeManager
// (Manager<AnyPolicy>) picks it by name at run time.
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "sparsekv/attention/attend_plan.hpp"
#include "sparsekv/attention/prompt_attention.hpp"
#include "sparsekv/buffer/tiered_kv_buffer.hpp"
#include "sparsekv/core/error.hpp"
#include "sparsekv/facade/decode_phases.hpp"
#include "sparsekv/facade/device_stream.hpp"
#include "sparsekv/facade/host_backend.hpp"
#include "sparsekv/facade/tier_usage.hpp"
#include "sparsekv/policy/any_policy.hpp"
#include "sparsekv/step/device_tensor_calls.hpp"
#include "sparsekv/step/extend_runner.hpp"
#include "sparsekv/step/fork_runner.hpp"
#include "sparsekv/step/host_step.hpp"
#include "sparsekv/step/prompt_staging.hpp"
#include "sparsekv/step/request_registry.hpp"
#include "sparsekv/step/request_sizing.hpp"
#include "sparsekv/step/step_executor.hpp"

namespace sparsekv {

template <class Policy>
class Manager {
  using State = typename Policy::LayerState;

 public:
  // `config` sizes the tiers (cpu_tier_bytes, gpu_tier_bytes) and everything
  // else (Config's defaults follow the papers).
  Manager(const ModelShape& shape, const Config& config, Policy policy,
          std::unique_ptr<Backend> backend = std::make_unique<HostBackend>())
      : shape_(shape), config_(config), policy_(std::move(policy)), backend_(std::move(backend)) {
    if (!backend_) fail(ErrorCode::invalid_argument, "Manager: backend must not be null");
    config_.validate(shape_);  // before the policy sizes anything from it
    if (evicts_tokens(policy_) && config_.page_tokens > kMaxMaskedPageTokens) {
      fail(ErrorCode::invalid_argument,
           "Manager: the policy evicts tokens, which needs page_tokens <= {} (one 64-bit slot mask per page); got {}",
           kMaxMaskedPageTokens, config_.page_tokens);
    }
    scope_ = StepScope<Policy>{&shape_, &config_, &policy_, nullptr, backend_.get(), &stats_};  // for the sizing
    // A policy that cannot serve this shape or page size refuses here, not later.
    request_pages(config_.max_context_tokens);
    buffer_ = std::make_unique<TieredKVBuffer>(shape, config, backend_->cpu_tier(), backend_->gpu_pages(),
                                               backend_->gpu_tables(), backend_->transfer(),
                                               table_head_capacity(scope_), backend_->attend_site());
    bind_steps();
  }
  // A moved Manager keeps its requests, tiers and device runtime; the last
  // step's plan and retrievals stay behind. Not during a step's phases; the
  // moved-from Manager may only be destroyed.
  Manager(Manager&& o)
      : shape_(o.shape_),
        config_(o.config_),
        policy_(std::move(o.policy_)),
        backend_(std::move(o.backend_)),
        buffer_(std::move(o.buffer_)),
        registry_(std::move(o.registry_)),
        stats_(o.stats_),
        api_(o.api_),
        device_(std::move(o.device_)) {
    bind_steps();
  }
  Manager(const Manager&) = delete;
  Manager& operator=(const Manager&) = delete;
  Manager& operator=(Manager&&) = delete;

  // The GPU pages per (layer, kv head) a request of up to `max_tokens` tokens reserves (step/request_sizing.hpp).
  RequestPages request_pages(std::uint32_t max_tokens) const { return sparsekv::request_pages(scope_, max_tokens); }

  // Advice: admit is true exactly when add_request(id, max_tokens) would
  // succeed now (for a new id) and a `prompt_tokens`-token prompt fits both
  // max_tokens and the CPU tier; otherwise `reason` says why.
  AdmissionAdvice can_admit(std::uint32_t prompt_tokens, std::uint32_t max_tokens) const {
    if (std::optional<Refusal> r = max_tokens_refusal(scope_, max_tokens))
      return AdmissionAdvice{.reason = std::move(r->message)};
    AdmissionAdvice advice =
        buffer_->admission().can_admit(prompt_tokens, request_pages(max_tokens), prompt_pages(scope_, prompt_tokens));
    if (advice.admit && prompt_tokens > max_tokens) {
      advice.admit = false;
      advice.reason = fmt::format("a {}-token prompt exceeds max_tokens {}", prompt_tokens, max_tokens);
    }
    return advice;
  }

  // Advice for fork(request, source, tokens, max_tokens), as can_admit is for add_request + prefill: admit is true
  // exactly when the fork would succeed now, the pages it shares with `source` counted once (the source's). For a
  // policy with ForksIndex the fork's layout is worked out as the fork would (its Index on a copy, from the few rows
  // past what it reuses); for any other (RetroInfer) the prompt's pages are the policy's bound, as in can_admit: the
  // advice then errs on refusing.
  AdmissionAdvice can_fork(RequestId source, std::uint32_t tokens, std::uint32_t max_tokens) const {
    if (std::optional<Refusal> r = fork_refusal(source, tokens, max_tokens))
      return AdmissionAdvice{.reason = std::move(r->message)};
    const RequestPages b = request_pages(max_tokens);
    const BufferAdmission& admission = buffer_->admission();
    if (!forks_index(policy_)) return admission.can_admit(tokens, b, prompt_pages(scope_, tokens));
    return admission.can_admit_pages(tokens, b, ForkRunner<Policy>{}.new_pages(scope_, registry_, source, tokens));
  }

  void add_request(RequestId request, std::uint32_t max_tokens) {
    if (std::optional<Refusal> r = max_tokens_refusal(scope_, max_tokens))
      fail(r->code, "request {}: {}", request, r->message);
    const RequestPages b = request_pages(max_tokens);
    device_.admit([&] { registry_.add(request, max_tokens, b, policy_); });
  }

  // ---- Host tensors ---------------------------------------------------------
  // `rows`: the dtype of k / v, the model's unless said; the storage dtype
  // (Config::kv_storage) takes rows read back by read_kv in it, stored as
  // they are.
  void prefill(RequestId request, std::uint32_t layer, const void* k, const void* v, std::uint32_t tokens,
               std::optional<DType> rows = {}) {
    use_api(Api::host);
    registry_.at(request);
    check_index("layer", layer, shape_.layers);
    if (k == nullptr || v == nullptr || tokens == 0)
      fail(ErrorCode::invalid_argument, "prefill of request {}: K/V must be non-null with tokens > 0", request);
    scope_.check_rows_dtype("prefill", rows);
    if (const std::uint32_t staged = registry_.at(request).layers[layer].staged_tokens; staged != 0) {
      fail(ErrorCode::failed_precondition,
           "prefill of request {} layer {}: {} tokens of its prompt are staged; send the rest with prefill_chunk",
           request, layer, staged);
    }
    LayerStepState<State>& ls = registry_.prefill_entry(request, layer, tokens);
    host_prefill(scope_, request, layer, ls, k, v, tokens, keys_, values_, rows);
  }

  // A prompt in chunks, as an engine's ubatches bring it (step/prompt_staging.hpp;
  // docs/integration.md, "Prompts in chunks"): each chunk is kept in the
  // storage dtype until the layer's first decode step (or extend, or
  // end_prompt) prefills the whole prompt at once, exactly as prefill() of
  // the concatenated chunks. `rows`: what k / v hold, the model dtype unless
  // said. Host tensors. Throws, changing nothing: invalid_argument (null or
  // non-finite K/V, no tokens), resource_exhausted (past max_tokens),
  // failed_precondition once the layer is prefilled (a live request grows by
  // extend()).
  void prefill_chunk(RequestId request, std::uint32_t layer, const void* k, const void* v, std::uint32_t tokens,
                     std::optional<DType> rows = {}) {
    use_api(Api::host);
    RequestSteps<State>& r = registry_.at(request);
    check_index("layer", layer, shape_.layers);
    if (k == nullptr || v == nullptr || tokens == 0)
      fail(ErrorCode::invalid_argument, "prefill_chunk of request {}: K/V must be non-null with tokens > 0", request);
    scope_.check_rows_dtype("prefill_chunk", rows);
    staging_.stage(scope_, request, layer, r, k, v, tokens, rows.value_or(shape_.dtype));
  }
  // Prefills every layer of `request` that holds a staged prompt, now (each
  // layer's first decode step does it otherwise). Throws what prefill()
  // throws; the layers before the failing one stay prefilled, which is what
  // their decode would have done.
  void end_prompt(RequestId request) {
    RequestSteps<State>& r = registry_.at(request);
    for (std::uint32_t l = 0; l < shape_.layers; ++l)
      if (r.layers[l].staged_tokens != 0) prefill_staged(request, l);
  }
  // Tokens of `layer`'s prompt staged by prefill_chunk and not yet prefilled;
  // and whether the layer is prefilled (decode and extend need it).
  std::uint32_t staged_tokens(RequestId request, std::uint32_t layer) const {
    return layer_state(request, layer).staged_tokens;
  }
  bool prefilled(RequestId request, std::uint32_t layer) const { return layer_state(request, layer).prefilled; }
  // Reads back positions [first, end) of the layer's K/V into k and v
  // ([end - first][kv_heads][head_dim], in `as`: the model dtype unless said,
  // q8_0 storage then dequantized; or the storage dtype, the stored bytes,
  // which prefill(..., rows) takes back exactly): what an engine saves
  // beside its own state, or checks against its own cache. Readable are a
  // staged prompt's tokens and, once the layer is prefilled, the CPU tier's
  // tokens in order (PrefixForks::readable_tokens: not a policy's
  // regrouped or evicted tokens, nor the unsaved decode page on a GPU tier;
  // in place that page is read too). Throws, writing nothing: not_found
  // (unknown request), out_of_range (`end` past what is readable, or first > end).
  void read_kv(RequestId request, std::uint32_t layer, std::uint32_t first, std::uint32_t end, void* k, void* v,
               std::optional<DType> as = {}) const {
    scope_.check_rows_dtype("read_kv", as);
    const LayerStepState<State>& ls = layer_state(request, layer);
    if (const std::uint32_t readable = readable_tokens(request, layer); first > end || end > readable) {
      fail(ErrorCode::out_of_range, "read_kv of request {} layer {}: positions [{}, {}) but {} are readable", request,
           layer, first, end, readable);
    }
    if (ls.prefilled) {
      buffer_->forks().read_prefix(request, layer, first, end, k, v, as.value_or(shape_.dtype));
    } else {
      PromptStaging<Policy>::read(scope_, ls, first, end, k, v, as.value_or(shape_.dtype));
    }
  }
  // The shape of the library's prompt attention (attention/prompt_attention.hpp): the model's heads, the
  // staged prompt's dtype (the storage dtype), and the scale Attend applies (Config::attention_scale, or
  // 1/sqrt(head_dim)).
  PromptAttentionShape prompt_attention_shape() const { return PromptStaging<Policy>::attention_shape(scope_); }
  // The causal attention of the last `rows` tokens of `layer`'s staged prompt (prefill_chunk), for an engine
  // that has the library attend its prompt: their queries q ([rows][q_heads][head_dim] fp32, rows q_stride
  // floats apart, 0 for packed) over the staged tokens up to each one, into out (the same, out_stride). Run
  // it with PromptAttention on any threads; it reads the staged K/V, valid until the next call that changes
  // this request. Throws, changing nothing: not_found, failed_precondition (the layer is prefilled: a live
  // request attends by extend), out_of_range (rows 0 or more than staged), invalid_argument (null q or out).
  PromptChunk prompt_chunk(RequestId request, std::uint32_t layer, const float* q, std::uint32_t rows, float* out,
                           std::size_t q_stride = 0, std::size_t out_stride = 0) const {
    return PromptStaging<Policy>::chunk(request, layer, layer_state(request, layer), q, rows, out, q_stride,
                                        out_stride);
  }
  // The layer's first tokens read_kv can read.
  std::uint32_t readable_tokens(RequestId request, std::uint32_t layer) const {
    const LayerStepState<State>& ls = layer_state(request, layer);
    return ls.prefilled ? buffer_->forks().readable_tokens(request, layer) : ls.staged_tokens;
  }

  // Appends `tokens` tokens to the live request in `layer` (step/extend_runner.hpp):
  // a new chat turn, a speculative draft being verified, as that many decode
  // steps of batch 1. q [tokens][q_heads][head_dim], k / v [tokens][kv_heads]
  // [head_dim], host tensors in the model dtype; `out` ([tokens][q_heads]
  // [head_dim] fp32) receives each step's attention, or null when the engine
  // computes it itself. Checks every token first and throws, changing
  // nothing, what decode() throws; only then is a staged prompt prefilled,
  // as the layer's first decode step would. A pool that runs out mid-way
  // throws resource_exhausted naming how many tokens went in (those stay).
  void extend(RequestId request, std::uint32_t layer, const void* q, const void* k, const void* v, std::uint32_t tokens,
              float* out = nullptr) {
    use_api(Api::host);
    extend_.check(scope_, registry_, request, layer, q, k, v, tokens);
    if (registry_.at(request).layers[layer].staged_tokens != 0) prefill_staged(request, layer);
    const RequestId batch[] = {request};
    extend_.run(scope_, request, q, k, v, tokens, out, [&](const void* qt, const void* kt, const void* vt, float* ot) {
      decode(batch, layer, qt, kt, vt, ot);
    });
  }

  // Built-in Attend: out[b] = attention of q[b] over request b's selected
  // pages and tail, on this thread -- or, given the engine's parallel_for
  // (step/step_executor.hpp), with Select and Attend on the engine's threads;
  // the output is bit-identical either way.
  void decode(std::span<const RequestId> batch, std::uint32_t layer, const void* q, const void* k_new,
              const void* v_new, float* out) {
    begin_decode(batch, layer, q, k_new, v_new, out);
    host_step_->run(nullptr);
  }
  void decode(std::span<const RequestId> batch, std::uint32_t layer, const void* q, const void* k_new,
              const void* v_new, float* out, const StepExecutor& executor) {
    begin_decode(batch, layer, q, k_new, v_new, out);
    host_step_->run(&executor);
  }

  // decode()'s first phase, for an engine that runs the rest on its own
  // threads with (ith, nth) (facade/decode_phases.hpp; docs/integration.md,
  // "Threads"). Checks everything and plans the step; changes nothing until
  // its commit(). The phases are the Manager's step, valid until the next call.
  DecodePhases<Policy> begin_decode(std::span<const RequestId> batch, std::uint32_t layer, const void* q,
                                    const void* k_new, const void* v_new, float* out) {
    use_api(Api::host);
    if (out == nullptr) fail(ErrorCode::invalid_argument, "decode: out must not be null");
    backend_->check_attend(scope_.layout(), shape_.q_heads, shape_.kv_heads);
    begin_host_step(batch, layer, q, k_new, v_new, out);
    return DecodePhases<Policy>(*host_step_);
  }

  // Retrieve without Attend: the engine runs its own paged kernel over the plan.
  const AttendPlan& plan(std::span<const RequestId> batch, std::uint32_t layer, const void* q, const void* k_new,
                         const void* v_new) {
    use_api(Api::host);
    if (evicts_tokens(policy_) && needs_token_weights(policy_)) {
      fail(ErrorCode::invalid_argument,
           "plan: this policy evicts by the attention weights of the built-in Attend, which an engine's kernel does "
           "not return; use decode()");
    }
    begin_host_step(batch, layer, q, k_new, v_new, nullptr);
    host_step_->run(nullptr);
    return host_step_->plan();
  }

  // Starts `request` as the first `tokens` tokens of live request `source`
  // (step/fork_runner.hpp; an engine's prefix cache, llama.cpp's seq_cp;
  // docs/integration.md, "Shared prefixes"): add_request(request,
  // max_tokens), then in every layer the prefill of those tokens' K/V, which
  // the library takes from `source`'s CPU pages, sharing its full pages. The
  // two requests then decode independently, each exactly as if prefilled
  // unshared; either may finish first. `tokens` may reach only what the
  // source holds in order in the CPU tier in every layer
  // (PrefixForks::readable_tokens: in place its unsaved decode page too;
  // not that page on a GPU tier, nor tokens a policy regrouped or evicted).
  // Host tensors only; throws (changing nothing) what add_request and prefill
  // throw, and out_of_range past the readable tokens.
  void fork(RequestId request, RequestId source, std::uint32_t tokens, std::uint32_t max_tokens) {
    use_api(Api::host);
    if (request == source) fail(ErrorCode::invalid_argument, "request {} cannot fork itself", request);
    if (std::optional<Refusal> r = fork_refusal(source, tokens, max_tokens)) fail(r->code, "fork: {}", r->message);
    add_request(request, max_tokens);
    try {
      fork_.run(scope_, registry_, request, source, tokens);
    } catch (...) {
      finish(request);
      throw;
    }
  }

  // ---- Device tensors (docs/integration.md, "Device tensors") ---------------
  // The same calls with device pointers in the model dtype and the engine's
  // cudaStream_t (a DeviceStream: a bare nullptr or {} picks the host call,
  // never these), enqueued on `stream`. Needs a backend with device memory
  // (CudaBackend; others throw unavailable, changing nothing). A policy with
  // a device Select (policy/device_select.hpp) runs the whole step there:
  // prefill() waits for its copies, decode() and plan() do not. Any other
  // takes the host-Select path, each call waiting, and plan() is refused
  // there (step/device_tensor_calls.hpp).

  void prefill(RequestId request, std::uint32_t layer, const void* k, const void* v, std::uint32_t tokens,
               DeviceStream stream) {
    refuse_if_host_latched();
    device_.prefill(request, layer, k, v, tokens, stream.handle);
    use_api(Api::device);
  }

  // decode() on device tensors: returns once the step is enqueued on `stream`.
  void decode(std::span<const RequestId> batch, std::uint32_t layer, const void* q, const void* k_new,
              const void* v_new, float* out, DeviceStream stream) {
    refuse_if_host_latched();
    device_.decode(batch, layer, q, k_new, v_new, out, stream.handle,
                   [&](const void* host_q, const void* host_k, const void* host_v, float* host_out) {
                     begin_host_step(batch, layer, host_q, host_k, host_v, host_out);
                     host_step_->run(nullptr);
                   });
    use_api(Api::device);
  }

  // plan() on device tensors: the step up to the plan, which stays in device
  // memory (DeviceAttendPlan) for the engine's kernel on `stream`; valid
  // until the next call on this Manager.
  DeviceAttendPlan plan(std::span<const RequestId> batch, std::uint32_t layer, const void* q, const void* k_new,
                        const void* v_new, DeviceStream stream) {
    refuse_if_host_latched();
    return device_.plan(batch, layer, q, k_new, v_new, stream.handle);
  }

  // ---- Either kind ----------------------------------------------------------
  void finish(RequestId request) {
    registry_.at(request);
    if (DeviceRuntime* runtime = device_.made_runtime()) runtime->download_tables(request);  // waits for its steps
    registry_.erase(request);
  }

  std::uint64_t working_set(RequestId request) const {
    registry_.at(request);
    return buffer_->admission().working_set_pages(request);
  }
  bool has_request(RequestId request) const { return registry_.contains(request); }
  // What the last host-tensor decode()/plan() retrieved for batch entry b
  // (selected partitions, their GPU pages and token counts, the tails as
  // attended, hit/miss stats). A tail the step's token filled counts
  // page_tokens tokens.
  const Retrieval& retrieval(std::size_t b) const {
    const std::span<const Retrieval> retrievals = host_step_->retrievals();
    check_index("batch entry", b, retrievals.size());
    return retrievals[b];
  }
  const StepStats& stats() const noexcept { return stats_; }
  // Device-tensor API: waits for every step enqueued so far and brings the
  // device's hit / miss totals into stats().cache; reports a non-finite value
  // a step found (check_values). Nothing to do with host tensors.
  void synchronize() { device_.synchronize(stats_); }
  // Device-tensor API: opt-in per-stage timing of later decode steps
  // (DeviceRuntime::time_stages, docs/device-decode.md; off by default, no
  // host sync added to a step) and its totals (waits for the steps). Makes
  // the device runtime: the first call precedes the first add_request.
  void time_device_stages(bool on) { device_runtime().time_stages(on); }
  DeviceStageTimes device_stage_times() { return device_runtime().stage_times(); }
  // Tokens `layer` of the request holds: its staged prompt, or once prefilled its sequence length.
  std::uint32_t held_tokens(RequestId request, std::uint32_t layer) const {
    const LayerStepState<State>& ls = layer_state(request, layer);
    return ls.prefilled ? buffer_->admission().sequence_length(request, layer) : ls.staged_tokens;
  }
  TierUsage tier_usage() const { return sparsekv::tier_usage(*buffer_); }
  const ModelShape& shape() const noexcept { return shape_; }
  const Policy& policy() const noexcept { return policy_; }
  const Backend& backend() const noexcept { return *backend_; }

 private:
  friend struct ManagerInspection;  // the library's tests and tools read the tiers (manager_inspection.hpp)
  enum class Api : std::uint8_t { unset, host, device };

  // Why fork(·, source, tokens, max_tokens) would be refused; can_fork and fork share it.
  std::optional<Refusal> fork_refusal(RequestId source, std::uint32_t tokens, std::uint32_t max_tokens) const {
    if (std::optional<Refusal> r = max_tokens_refusal(scope_, max_tokens)) return r;
    return ForkRunner<Policy>::refusal(scope_, registry_, source, tokens, max_tokens, api_ == Api::device);
  }

  const LayerStepState<State>& layer_state(RequestId request, std::uint32_t layer) const {
    check_index("layer", layer, shape_.layers);
    return registry_.at(request).layers[layer];
  }
  void prefill_staged(RequestId request, std::uint32_t layer) {
    PromptStaging<Policy>::prefill(scope_, registry_, request, layer, keys_, values_);
  }

  void begin_host_step(std::span<const RequestId> batch, std::uint32_t layer, const void* q, const void* k_new,
                       const void* v_new, float* out) {
    check_index("layer", layer, shape_.layers);
    if (batch.empty()) fail(ErrorCode::invalid_argument, "decode: empty batch");
    if (q == nullptr || k_new == nullptr || v_new == nullptr) {
      fail(ErrorCode::invalid_argument, "decode: q, k_new and v_new must not be null");
    }
    host_entries_.clear();
    for (std::size_t b = 0; b < batch.size(); ++b) {
      if (registry_.at(batch[b]).layers[layer].staged_tokens != 0) prefill_staged(batch[b], layer);
      RequestSteps<State>& r = registry_.batch_entry(batch, b, layer, *buffer_);
      host_entries_.push_back({batch[b], &r.layers[layer], r.mandatory_pages});
    }
    host_step_->begin(host_entries_, layer, q, k_new, v_new, out);
  }

  // The host/device latch: the first prefill picks the tensor kind.
  void use_api(Api api) {
    if (api_ == Api::unset) api_ = api;
    if (api_ != api)
      fail(ErrorCode::failed_precondition, "this Manager serves {} tensors (its first prefill chose); got {} tensors",
           api_ == Api::host ? "host" : "device", api == Api::host ? "host" : "device");
  }
  void refuse_if_host_latched() {
    if (api_ == Api::host) use_api(Api::device);  // throws
  }
  DeviceRuntime& device_runtime() {
    refuse_if_host_latched();
    return device_.runtime();
  }
  // The steps and runners work on this Manager's members.
  void bind_steps() {
    scope_ = StepScope<Policy>{&shape_, &config_, &policy_, buffer_.get(), backend_.get(), &stats_};
    registry_.bind(*buffer_, shape_.layers);
    host_step_.emplace(scope_);
    device_.bind(scope_, registry_);
  }

  ModelShape shape_;
  Config config_;
  Policy policy_;
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<TieredKVBuffer> buffer_;
  RequestRegistry<Policy> registry_;
  StepStats stats_;
  StepScope<Policy> scope_;
  Api api_ = Api::unset;
  std::optional<HostStep<Policy>> host_step_;
  std::vector<typename HostStep<Policy>::Entry> host_entries_;
  PromptStaging<Policy> staging_;
  ExtendRunner<Policy> extend_;
  ForkRunner<Policy> fork_;
  DeviceTensorCalls<Policy> device_;
  std::vector<float> keys_, values_;  // a host prompt in fp32
};

using RuntimeManager = Manager<AnyPolicy>;

}  // namespace sparsekv
