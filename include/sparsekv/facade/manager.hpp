#pragma once
// sparsekv::Manager: the engine-facing facade (ARCHITECTURE.md, "Engine-facing
// contract"). An engine with its own scheduler calls, per request:
//
//   can_admit(prompt, max_tokens)   advice only: the library never queues
//   add_request(id, max_tokens)
//   prefill(id, layer, k, v, tokens)          per layer: Index + Offload
//   decode(batch, layer, q, k_new, v_new, out) per step and layer: append,
//        Select, Retrieve, Attend -- or plan(...) instead, which stops after
//        Retrieve and returns an AttendPlan for the engine's own kernel
//   finish(id)
//
// Tensors are row-major in the model's dtype (ModelShape::dtype):
//   prefill k, v: [tokens][kv_heads][head_dim]
//   decode  q: [batch][q_heads][head_dim], k_new / v_new: [batch][kv_heads][head_dim]
//   out: [batch][q_heads][head_dim] fp32
// The caller keeps ownership of every pointer; nothing is retained after a call.
//
// Backends (facade/backend.hpp): HostBackend by default; a CudaBackend
// (facade/cuda_backend.hpp, sparsekv::cuda) keeps the GPU tier in device
// memory. Tensors passed to the Manager are host memory with either backend.
//
// Threads and streams: one Manager is driven by one thread at a time (calls
// must not overlap). Every call has finished with the engine's buffers when it
// returns, so the engine may reuse them at once. decode() returns with `out`
// complete. plan() may leave Retrieve's copies in flight on backend().stream()
// (CUDA backend): the engine orders its attention kernel after that stream.
// An AttendPlan stays valid until the next call on the same Manager.
//
// Errors: every call validates its arguments and the requests' state first
// (unknown or finished request, decode before prefill, shape or dtype
// mismatch, a batch naming a request twice) and throws sparsekv::Error,
// changing nothing. Manager<P> is templated on the policy; RuntimeManager
// (Manager<AnyPolicy>) picks it by name at run time.
#include <algorithm>
#include <any>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <type_traits>
#include <span>
#include <utility>
#include <string>
#include <string_view>
#include <vector>

#include "sparsekv/attention/decode_attention.hpp"
#include "sparsekv/buffer/tiered_kv_buffer.hpp"
#include "sparsekv/core/error.hpp"
#include "sparsekv/core/numeric.hpp"
#include "sparsekv/facade/attend_plan.hpp"
#include "sparsekv/facade/backend.hpp"
#include "sparsekv/facade/device_decoder.hpp"
#include "sparsekv/policy/any_policy.hpp"

namespace sparsekv {

struct ManagerStats {
  CacheStepStats cache;            // hits + misses = selected pages
  std::uint64_t pages_moved = 0;   // CPU -> GPU by Retrieve
  std::uint64_t bytes_moved = 0;
  std::uint64_t pages_saved = 0;   // GPU tail -> CPU by decode appends, one per kv head (as BufferStats)
  std::uint64_t decode_steps = 0;  // (request, layer) decode steps
  // Wall time per operation, seconds.
  double index_s = 0, offload_s = 0, append_s = 0, select_s = 0, retrieve_s = 0, attend_s = 0;

  double hit_ratio() const { return cache.hit_ratio(); }
};

namespace detail {

// Uniform access to a static policy P and to AnyPolicy, so Manager<P> keeps
// P's calls static and RuntimeManager dispatches at this one edge.
template <class P>
struct PolicyOps {
  using State = typename P::LayerState;
  static State make_state(const P&) { return State{}; }
  static constexpr bool has_attend(const P&) { return CustomAttend<P>; }
  static void attend(const P& p, const LayerContext& c, const DecodeQuery& q, const State& s, const Selection& sel,
                     std::span<AttentionPartial> extra) {
    if constexpr (CustomAttend<P>) p.attend(c, q, s, sel, extra);
  }
  static std::optional<HeadCapacity> head_capacity(const P& p, const LayerContext& c) {
    if constexpr (DeclaresHeadCapacity<P>) {
      return p.head_capacity(c);
    } else {
      return std::nullopt;
    }
  }
  static DeviceSelectRow device_select_row(const P& p, const State& s, std::uint32_t head, std::uint32_t unfed) {
    return sparsekv::device_select_row(p, s, head, unfed);
  }
  static bool device_index_update_due(const P& p, const State& s, std::uint32_t pending_tokens) {
    return sparsekv::device_index_update_due(p, s, pending_tokens);
  }
  static void device_summary_rows(const P& p, const State& s, std::uint32_t head, DeviceSummaryRows& out) {
    sparsekv::device_summary_rows(p, s, head, out);
  }
  static constexpr bool evicts(const P&) { return TokenEviction<P>; }
  static bool needs_weights(const P& p) { return needs_token_weights(p); }
  static void placed(const P& p, const LayerContext& c, std::uint32_t position, State& s) {
    token_placed(p, c, position, s);
  }
  static void observe(const P& p, const LayerContext& c, const TokenWeights& w, State& s) {
    observe_weights(p, c, w, s);
  }
  static void evict(const P& p, const LayerContext& c, const EvictionContext& e, State& s, Eviction& out) {
    evict_tokens(p, c, e, s, out);
  }
};
template <>
struct PolicyOps<AnyPolicy> {
  using State = std::any;
  static State make_state(const AnyPolicy& p) { return p.make_state(); }
  static bool has_attend(const AnyPolicy& p) { return p.has_attend(); }
  static void attend(const AnyPolicy& p, const LayerContext& c, const DecodeQuery& q, const State& s,
                     const Selection& sel, std::span<AttentionPartial> extra) {
    p.attend(c, q, s, sel, extra);
  }
  static std::optional<HeadCapacity> head_capacity(const AnyPolicy& p, const LayerContext& c) {
    return p.head_capacity(c);
  }
  static DeviceSelectRow device_select_row(const AnyPolicy& p, const State& s, std::uint32_t head,
                                           std::uint32_t unfed) {
    return p.device_select_row(s, head, unfed);
  }
  static bool device_index_update_due(const AnyPolicy& p, const State& s, std::uint32_t pending_tokens) {
    return p.device_index_update_due(s, pending_tokens);
  }
  static void device_summary_rows(const AnyPolicy& p, const State& s, std::uint32_t head, DeviceSummaryRows& out) {
    p.device_summary_rows(s, head, out);
  }
  static bool evicts(const AnyPolicy& p) { return p.evicts(); }
  static bool needs_weights(const AnyPolicy& p) { return p.needs_weights(); }
  static void placed(const AnyPolicy& p, const LayerContext& c, std::uint32_t position, State& s) {
    p.placed(c, position, s);
  }
  static void observe(const AnyPolicy& p, const LayerContext& c, const TokenWeights& w, State& s) {
    p.observe(c, w, s);
  }
  static void evict(const AnyPolicy& p, const LayerContext& c, const EvictionContext& e, State& s, Eviction& out) {
    p.evict(c, e, s, out);
  }
};

// Splits one (request, kv head)'s pages into runs whose pages are all full
// but the last, appending them to the plan; returns the runs added.
std::int64_t append_runs(AttendPlan& plan, std::span<const PageId> pages, std::span<const std::uint32_t> tokens,
                         std::uint32_t page_tokens);

// Appends the runs of kv head `head` of a retrieval (its pages as
// Retrieval::for_each_page lists them; `pages` and `tokens` are scratch) and
// returns how many: the host Plan step, the reference of the device one
// (attend_plan_cuda.hpp).
inline std::int64_t append_head_runs(AttendPlan& plan, const Retrieval& r, std::uint32_t head,
                                     std::uint32_t page_tokens, std::vector<PageId>& pages,
                                     std::vector<std::uint32_t>& tokens) {
  pages.clear();
  tokens.clear();
  r.for_each_page(head, page_tokens, [&](PageId page, std::uint32_t n) {
    pages.push_back(page);
    tokens.push_back(n);
  });
  return append_runs(plan, pages, tokens, page_tokens);
}

}  // namespace detail

template <class Policy>
class Manager {
  using Ops = detail::PolicyOps<Policy>;

 public:
  // `config` sizes the tiers (cpu_tier_bytes, gpu_tier_bytes) and everything
  // else (Config's defaults follow the papers).
  Manager(const ModelShape& shape, const Config& config, Policy policy,
          std::unique_ptr<Backend> backend = std::make_unique<HostBackend>())
      : shape_(shape), config_(config), policy_(std::move(policy)), backend_(std::move(backend)) {
    if (!backend_) fail(ErrorCode::invalid_argument, "Manager: backend must not be null");
    config_.validate(shape_);  // before the policy sizes anything from it
    if (Ops::evicts(policy_) && config_.page_tokens > kMaxMaskedPageTokens) {
      fail(ErrorCode::invalid_argument,
           "Manager: the policy evicts tokens, which needs page_tokens <= {} (one 64-bit slot mask per page); got {}",
           kMaxMaskedPageTokens, config_.page_tokens);
    }
    budget(config_.max_context_tokens);  // a policy that cannot serve this shape or page size refuses here, not later
    buffer_ = std::make_unique<TieredKVBuffer>(shape, config, backend_->cpu_tier(), backend_->gpu_pages(),
                                               backend_->gpu_tables(), backend_->transfer(), head_capacity());
  }

  // The per-(layer, kv head) mandatory pages the policy needs for a request of
  // up to `max_tokens` tokens, taken over all layers.
  RequestBudget budget(std::uint32_t max_tokens) const {
    std::uint32_t mandatory = 1;
    for (std::uint32_t l = 0; l < shape_.layers; ++l) {
      mandatory = std::max(mandatory, policy_.mandatory_pages(context(l, max_tokens)));
    }
    return RequestBudget{mandatory, 0, Ops::evicts(policy_)};
  }

  // Advice: admit is true exactly when add_request(id, max_tokens) would
  // succeed now (for a new id) and a `prompt_tokens`-token prompt fits both
  // max_tokens and the CPU tier; otherwise `reason` says why.
  AdmissionAdvice can_admit(std::uint32_t prompt_tokens, std::uint32_t max_tokens) const {
    if (std::string bad = max_tokens_refusal(max_tokens); !bad.empty()) {
      AdmissionAdvice advice;
      advice.reason = std::move(bad);
      return advice;
    }
    AdmissionAdvice advice = buffer_->can_admit(prompt_tokens, budget(max_tokens), prompt_pages(prompt_tokens));
    if (advice.admit && prompt_tokens > max_tokens) {
      advice.admit = false;
      advice.reason = fmt::format("a {}-token prompt exceeds max_tokens {}", prompt_tokens, max_tokens);
    }
    return advice;
  }

  void add_request(RequestId request, std::uint32_t max_tokens) {
    if (std::string bad = max_tokens_refusal(max_tokens); !bad.empty()) {
      fail(ErrorCode::invalid_argument, "request {}: {}", request, bad);
    }
    if (device_) {
      // add_request may reclaim buffering pages of other requests, whose
      // current GPU page tables the device holds: bring them back first.
      for (const auto& [id, unused] : requests_) device_->download_tables(id);
      buffer_->add_request(request, budget(max_tokens));
      for (const auto& [id, unused] : requests_) device_->upload_tables(id);
      device_->upload_tables(request);
    } else {
      buffer_->add_request(request, budget(max_tokens));
    }
    RequestState& s = requests_[request];
    s.max_tokens = max_tokens;
    s.layers.resize(shape_.layers);
    for (auto& layer : s.layers) layer.policy = Ops::make_state(policy_);
  }

  void prefill(RequestId request, std::uint32_t layer, const void* k, const void* v, std::uint32_t tokens) {
    use_api(Api::host);
    host_prefill(request, layer, k, v, tokens);
  }

  // ---- Device tensors (docs/integration.md, "Device tensors") ---------------
  // The same calls with device pointers in the model dtype and the engine's
  // cudaStream_t: everything is enqueued on `stream`. A Manager serves one
  // kind of tensor: its first prefill picks (the other kind is then refused).
  // Needs a backend with device memory and a decoder (CudaBackend; others
  // throw unavailable before anything changes). A policy with a device
  // Select (policy/device_select.hpp: Quest with one-page partitions,
  // ShadowKV, StreamingWindow, Dense, RetroInfer) runs the whole step there;
  // prefill() waits for its copies, decode() and plan() return without
  // waiting. Any other policy (a custom one with only a host Select) takes
  // the slower host-Select path: every call copies its tensors down, runs the
  // host-tensor call, copies `out` up and waits; plan() is refused there.
  //
  // prefill(): Index on the device (the policy's summaries, written where the
  // device Select reads them) and Offload through the staged D2H path
  // (DeviceDecoder::offload_prompt; SparseServe §3.2.2 FlashD2H, §3.4
  // layer-segmented prefill): the layer's K/V leave HBM once, into pinned
  // staging, and host workers scatter them into the CPU pages; no copy of the
  // layer stays on the GPU and none is made in pageable host memory. The
  // partitions are the policy's uniform ones, known from the token count;
  // the host policy state is not indexed, since with device tensors no call
  // reads it (Select runs on the device). A policy that clusters on the host
  // (RetroInfer: DeviceSelectSpec::host_state) instead has the prompt copied
  // down once, indexed and offloaded as on the host path, and its summaries
  // uploaded. Non-finite K/V is refused first.
  void prefill(RequestId request, std::uint32_t layer, const void* k, const void* v, std::uint32_t tokens,
               void* stream) {
    if (!device_selects()) {
      host_select_prefill(request, layer, k, v, tokens, stream);
      return;
    }
    DeviceDecoder& device = device_decoder();
    RequestState& s = state(request);
    check_index("layer", layer, shape_.layers);
    check_device_pointer("prefill k", k);
    check_device_pointer("prefill v", v);
    if (tokens == 0) fail(ErrorCode::invalid_argument, "prefill of request {}: tokens must be > 0", request);
    LayerState& ls = s.layers[layer];
    if (ls.prefilled) fail(ErrorCode::failed_precondition, "request {} layer {} is already prefilled", request, layer);
    if (tokens > s.max_tokens) {
      fail(ErrorCode::invalid_argument, "request {}: a {}-token prompt exceeds its max_tokens {}", request, tokens,
           s.max_tokens);
    }
    const std::uint64_t row = std::uint64_t{shape_.kv_heads} * shape_.head_dim;
    for (const auto& [what, data] : {std::pair{"prefill k", k}, std::pair{"prefill v", v}}) {
      const std::uint64_t bad = device.first_non_finite(data, tokens * row, stream);
      if (bad != DeviceDecoder::kNoNonFinite) {
        fail(ErrorCode::invalid_argument, "{} of request {}: token {} kv head {} (dim {}) is not finite", what,
             request, bad / row, bad % row / shape_.head_dim, bad % shape_.head_dim);
      }
    }
    use_api(Api::device);
    const DeviceSelectSpec select = device_select(policy_, context(layer, tokens));
    if (select.host_state) {
      // A policy that clusters on the host (RetroInfer): the prompt comes down
      // once, is indexed and offloaded as on the host path, and the state's
      // summaries go up into the device store.
      const std::size_t bytes = tokens * row * dtype_size(shape_.dtype);
      prompt_k_.resize(bytes);
      prompt_v_.resize(bytes);
      backend_->copy_to_host(prompt_k_.data(), k, bytes, stream);
      backend_->copy_to_host(prompt_v_.data(), v, bytes, stream);
      to_float(prompt_k_.data(), tokens * row, keys_);
      to_float(prompt_v_.data(), tokens * row, values_);
      index_and_offload(request, layer, prompt_k_.data(), prompt_v_.data(), tokens);
      upload_summary_rows(device, request, layer, stream);
      device.upload_tables(request);
      return;
    }
    const PartitionSpec spec = PartitionSpec::uniform(tokens, select.partition_tokens);
    const auto t0 = Clock::now();
    buffer_->offload_on_device(request, layer, tokens, std::span(&spec, 1), device_placements_);
    device.offload_prompt(k, v, device_placements_, stream);
    const auto t1 = Clock::now();
    device.index_prompt(table_slot(request), layer, k, tokens, select, stream);
    device.upload_tables(request);
    stats_.offload_s += seconds(t1 - t0);
    stats_.index_s += seconds(Clock::now() - t1);
    ls.prefilled = true;
  }

  // decode() on device tensors: q [batch][q_heads][head_dim] and k_new / v_new
  // [batch][kv_heads][head_dim] in the model dtype, out [batch][q_heads][head_dim]
  // fp32, all device memory. Returns once the step is enqueued on `stream`.
  void decode(std::span<const RequestId> batch, std::uint32_t layer, const void* q, const void* k_new,
              const void* v_new, float* out, void* stream) {
    if (!device_selects()) {
      host_select_decode(batch, layer, q, k_new, v_new, out, stream);
      return;
    }
    DeviceDecoder& device = device_decoder();
    check_device_pointer("decode out", out);
    // The attention kernel's shapes, refused before the step changes the buffer.
    backend_->check_attend(PageLayout{config_.page_tokens, shape_.head_dim, shape_.dtype}, shape_.q_heads,
                           shape_.kv_heads);
    device_step(device, batch, layer, q, k_new, v_new, out, stream);
  }

  // plan() on device tensors: the step up to the plan, which stays in device
  // memory (DeviceAttendPlan) for the engine's kernel on `stream`; valid
  // until the next call on this Manager.
  DeviceAttendPlan plan(std::span<const RequestId> batch, std::uint32_t layer, const void* q, const void* k_new,
                        const void* v_new, void* stream) {
    if (!device_selects()) {
      require_device_tensors();
      fail(ErrorCode::invalid_argument,
           "policy {} selects on the host: plan() on device tensors needs a device Select "
           "(policy/device_select.hpp); use decode(), or plan() on host tensors",
           policy_name());
    }
    DeviceDecoder& device = device_decoder();
    device_step(device, batch, layer, q, k_new, v_new, nullptr, stream);
    return device.plan();
  }

 private:
  void host_prefill(RequestId request, std::uint32_t layer, const void* k, const void* v, std::uint32_t tokens) {
    RequestState& s = state(request);
    check_index("layer", layer, shape_.layers);
    if (k == nullptr || v == nullptr || tokens == 0) {
      fail(ErrorCode::invalid_argument, "prefill of request {}: K/V must be non-null with tokens > 0", request);
    }
    LayerState& ls = s.layers[layer];
    if (ls.prefilled) fail(ErrorCode::failed_precondition, "request {} layer {} is already prefilled", request, layer);
    if (tokens > s.max_tokens) {
      fail(ErrorCode::invalid_argument, "request {}: a {}-token prompt exceeds its max_tokens {}", request, tokens,
           s.max_tokens);
    }
    const std::size_t n = std::size_t{tokens} * shape_.kv_heads * shape_.head_dim;
    to_float(k, n, keys_);
    to_float(v, n, values_);
    check_finite("prefill k", request, keys_, 0);
    check_finite("prefill v", request, values_, 0);
    index_and_offload(request, layer, k, v, tokens);
  }

  // Index of the prompt in keys_ / values_ (fp32) and Offload of k / v (host,
  // model dtype) into the CPU tier; the layer is then prefilled.
  void index_and_offload(RequestId request, std::uint32_t layer, const void* k, const void* v, std::uint32_t tokens) {
    LayerState& ls = state(request).layers[layer];
    const auto t0 = Clock::now();
    const KvView view{keys_, values_, tokens, shape_.kv_heads, shape_.head_dim, 0};
    // Indexed into a copy: a policy's state changes only if the offload succeeds.
    typename Ops::State indexed = ls.policy;
    std::vector<PartitionSpec> specs = policy_.index(context(layer, tokens), view, indexed);
    // A policy that evicts without attention weights (StreamingLLM) cuts a
    // prompt over its budget here; the buffer applies the cut at the first
    // decode step, as every decision, before that step's token is placed.
    std::optional<Eviction> cut;
    if (Ops::evicts(policy_) && !Ops::needs_weights(policy_)) {
      EvictionContext e;
      e.newest = tokens - 1;
      e.live_tokens.assign(shape_.kv_heads, tokens);
      Eviction out;
      Ops::evict(policy_, context(layer, tokens), e, indexed, out);
      if (drops_any(out)) cut = std::move(out);
    }
    const auto t1 = Clock::now();
    buffer_->offload(request, layer, KvChunk{k, v, tokens, shape_.dtype}, specs);
    ls.policy = std::move(indexed);
    ls.eviction = std::move(cut);
    stats_.index_s += seconds(t1 - t0);
    stats_.offload_s += seconds(Clock::now() - t1);
    ls.prefilled = true;
  }

 public:

  // Built-in Attend: out[b] = attention of q[b] over request b's selected pages and tail.
  void decode(std::span<const RequestId> batch, std::uint32_t layer, const void* q, const void* k_new,
              const void* v_new, float* out) {
    use_api(Api::host);
    host_decode(batch, layer, q, k_new, v_new, out);
  }

 private:
  void host_decode(std::span<const RequestId> batch, std::uint32_t layer, const void* q, const void* k_new,
                   const void* v_new, float* out) {
    if (out == nullptr) fail(ErrorCode::invalid_argument, "decode: out must not be null");
    backend_->check_attend(PageLayout{config_.page_tokens, shape_.head_dim, shape_.dtype}, shape_.q_heads,
                           shape_.kv_heads);
    step(batch, layer, q, k_new, v_new);
    const auto t0 = Clock::now();
    build_plan(batch.size());
    AttendCall call;
    call.plan = &plan_;
    call.layout = PageLayout{config_.page_tokens, shape_.head_dim, shape_.dtype};
    call.batch = static_cast<std::uint32_t>(batch.size());
    call.q_heads = shape_.q_heads;
    call.kv_heads = shape_.kv_heads;
    call.scale = scale();
    call.q = queries_.data();
    call.out = out;
    const bool weighed = Ops::evicts(policy_) && Ops::needs_weights(policy_);
    if (weighed) {
      slot_weights_.resize(plan_.indices.size() * config_.page_tokens);
      call.slot_weights = slot_weights_.data();
    }
    backend_->attend(call);
    if (Ops::evicts(policy_)) decide_evictions(batch, layer, weighed);
    stats_.attend_s += seconds(Clock::now() - t0);
  }

  // The host-Select path of the device-tensor API: the tensors come down,
  // the host-tensor call runs, `out` goes up; each call waits. Checked as
  // the host calls check them, after the copies (which change nothing).
  void host_select_prefill(RequestId request, std::uint32_t layer, const void* k, const void* v,
                           std::uint32_t tokens, void* stream) {
    require_device_tensors();
    state(request);
    check_index("layer", layer, shape_.layers);
    check_device_pointer("prefill k", k);
    check_device_pointer("prefill v", v);
    if (tokens == 0) fail(ErrorCode::invalid_argument, "prefill of request {}: tokens must be > 0", request);
    const std::size_t bytes = std::size_t{tokens} * shape_.kv_heads * shape_.head_dim * dtype_size(shape_.dtype);
    prompt_k_.resize(bytes);
    prompt_v_.resize(bytes);
    backend_->copy_to_host(prompt_k_.data(), k, bytes, stream);
    backend_->copy_to_host(prompt_v_.data(), v, bytes, stream);
    host_prefill(request, layer, prompt_k_.data(), prompt_v_.data(), tokens);
    use_api(Api::device);
  }
  void host_select_decode(std::span<const RequestId> batch, std::uint32_t layer, const void* q, const void* k_new,
                          const void* v_new, float* out, void* stream) {
    require_device_tensors();
    for (const auto& [what, p] : {std::pair{"decode q", q}, std::pair{"decode k_new", k_new},
                                  std::pair{"decode v_new", v_new}, std::pair{"decode out", static_cast<const void*>(out)}}) {
      check_device_pointer(what, p);
    }
    const std::size_t elem = dtype_size(shape_.dtype);
    const std::size_t q_values = batch.size() * shape_.q_heads * shape_.head_dim;
    const std::size_t kv_bytes = batch.size() * shape_.kv_heads * shape_.head_dim * elem;
    step_q_.resize(q_values * elem);
    prompt_k_.resize(kv_bytes);
    prompt_v_.resize(kv_bytes);
    backend_->copy_to_host(step_q_.data(), q, step_q_.size(), stream);
    backend_->copy_to_host(prompt_k_.data(), k_new, kv_bytes, stream);
    backend_->copy_to_host(prompt_v_.data(), v_new, kv_bytes, stream);
    step_out_.resize(q_values);
    host_decode(batch, layer, step_q_.data(), prompt_k_.data(), prompt_v_.data(), step_out_.data());
    backend_->copy_to_device(out, step_out_.data(), q_values * sizeof(float), stream);
    use_api(Api::device);
  }

 public:

  // Retrieve without Attend: the engine runs its own paged kernel over the plan.
  const AttendPlan& plan(std::span<const RequestId> batch, std::uint32_t layer, const void* q, const void* k_new,
                         const void* v_new) {
    use_api(Api::host);
    if (Ops::evicts(policy_) && Ops::needs_weights(policy_)) {
      fail(ErrorCode::invalid_argument,
           "plan: this policy evicts by the attention weights of the built-in Attend, which an engine's kernel does "
           "not return; use decode()");
    }
    step(batch, layer, q, k_new, v_new);
    build_plan(batch.size());
    if (Ops::evicts(policy_)) decide_evictions(batch, layer, false);
    return plan_;
  }


  void finish(RequestId request) {
    state(request);
    if (device_) device_->download_tables(request);  // waits for the request's steps
    buffer_->finish(request);
    requests_.erase(request);
  }

  std::uint64_t working_set(RequestId request) const {
    state(request);
    return buffer_->working_set_pages(request);
  }
  bool has_request(RequestId request) const { return requests_.contains(request); }
  // What the last decode()/plan() retrieved for batch entry b (selected
  // partitions, their GPU pages and token counts, the tails as attended,
  // hit/miss stats). A tail the step's token filled counts page_tokens tokens.
  const Retrieval& retrieval(std::size_t b) const {
    check_index("batch entry", b, retrievals_.size());
    return retrievals_[b];
  }
  const ManagerStats& stats() const noexcept { return stats_; }
  // Device-tensor API: waits for every step enqueued so far and brings the
  // device's hit / miss totals into stats().cache; reports a non-finite value
  // a step found (check_values). Nothing to do with host tensors.
  void synchronize() {
    if (!device_) return;
    device_->synchronize();
    stats_.cache = device_->cache_stats();
    // Every miss the device gathered is one page moved CPU -> GPU, as Retrieve counts them.
    stats_.pages_moved = stats_.cache.miss_pages;
    stats_.bytes_moved = stats_.cache.miss_pages * buffer_->cpu_pool().page_bytes();
    device_->check_values(nullptr);
  }
  // Device-tensor API: opt-in per-stage timing of later decode steps
  // (DeviceDecoder::time_stages, docs/device-decode.md; off by default, no
  // host sync added to a step) and its totals (waits for the steps).
  // Makes the device decoder: the first call precedes the first add_request.
  void time_device_stages(bool on) { device_decoder().time_stages(on); }
  DeviceStageTimes device_stage_times() { return device_decoder().stage_times(); }
  const TieredKVBuffer& buffer() const noexcept { return *buffer_; }
  const Policy& policy() const noexcept { return policy_; }
  const Backend& backend() const noexcept { return *backend_; }
  // Bytes of host memory the CPU tier has reserved (pinned when a GPU is present).
  std::size_t cpu_tier_reserved_bytes() const noexcept { return buffer_->cpu_pool().reserved_bytes(); }

 private:
  using Clock = std::chrono::steady_clock;
  struct LayerState {
    typename Ops::State policy;
    bool prefilled = false;
    std::vector<float> recent_k, recent_v;  // decode tokens since the last saved page, fp32
    // Device path, a host-state policy: decode pages saved since the state
    // was last fed (device_select_row, device_index_update_due).
    std::uint32_t unfed_pages = 0;
    // A policy that evicts: what the last step decided to drop, applied at the next.
    std::optional<Eviction> eviction;
  };
  struct RequestState {
    std::uint32_t max_tokens = 0;
    std::vector<LayerState> layers;
  };

  // What the page table is sized for per head: the policy's own bound for a
  // request of max_context_tokens (over all layers), or the default: no
  // admitted request outgrows it mid-run.
  HeadCapacity head_capacity() const {
    std::optional<HeadCapacity> most;
    for (std::uint32_t l = 0; l < shape_.layers; ++l) {
      if (const auto c = Ops::head_capacity(policy_, context(l, config_.max_context_tokens))) {
        most = HeadCapacity{std::max(c->partitions, most ? most->partitions : 0u),
                            std::max(c->cpu_pages, most ? most->cpu_pages : 0u)};
      }
    }
    HeadCapacity capacity = most ? *most : config_.head_capacity();
    capacity.slot_masks = Ops::evicts(policy_);
    return capacity;
  }

  // The AttendPlan of the last step's retrievals (batch entries 0 .. batch).
  void build_plan(std::size_t batch) {
    plan_.clear();
    plan_.gpu_tier_base = buffer_->gpu_pool().base();
    plan_.page_bytes = buffer_->gpu_pool().page_bytes();
    std::vector<PageId>& pages = plan_pages_;
    std::vector<std::uint32_t>& tokens = plan_tokens_;
    for (std::size_t b = 0; b < batch; ++b) {
      const Retrieval& r = retrievals_[b];
      for (std::uint32_t h = 0; h < shape_.kv_heads; ++h) {
        plan_.head_entries.push_back(plan_.head_entries.back() +
                                     detail::append_head_runs(plan_, r, h, config_.page_tokens, pages, tokens));
        if (!r.page_masks.empty()) {
          r.for_each_page_masked(h, config_.page_tokens,
                                 [&](PageId, std::uint32_t, SlotMask mask) { plan_.live_masks.push_back(mask); });
        }
      }
    }
    plan_.extra = extra_;
  }

  static double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }
  float scale() const { return 1.0f / std::sqrt(static_cast<float>(shape_.head_dim)); }

  // The most CPU pages a `tokens`-token prompt takes in one (layer, kv head):
  // the policy's bound when it declares one (clusters pad their last page),
  // else none (one-page partitions). An upper bound: advice errs on refusing.
  std::optional<std::uint32_t> prompt_pages(std::uint32_t tokens) const {
    std::optional<std::uint32_t> most;
    for (std::uint32_t l = 0; l < shape_.layers; ++l) {
      if (const auto c = Ops::head_capacity(policy_, context(l, tokens))) most = std::max(c->cpu_pages, most.value_or(0));
    }
    return most;
  }

  std::string max_tokens_refusal(std::uint32_t max_tokens) const {
    if (max_tokens != 0 && max_tokens <= config_.max_context_tokens) return {};
    return fmt::format("max_tokens {} must be in [1, max_context_tokens = {}]", max_tokens,
                       config_.max_context_tokens);
  }

  LayerContext context(std::uint32_t layer, std::uint32_t tokens) const {
    return {layer, shape_.layers, shape_.q_heads, shape_.kv_heads, shape_.head_dim, config_.page_tokens, tokens};
  }
  RequestState& state(RequestId request) {
    const auto it = requests_.find(request);
    if (it == requests_.end()) fail(ErrorCode::not_found, "unknown or finished request {}", request);
    return it->second;
  }
  const RequestState& state(RequestId request) const { return const_cast<Manager*>(this)->state(request); }

  void to_float(const void* data, std::size_t n, std::vector<float>& out) const {
    out.resize(n);
    for (std::size_t i = 0; i < n; ++i) out[i] = load_element(data, static_cast<std::uint32_t>(i), shape_.dtype);
  }
  // Non-finite K/V must never reach the CPU tier, the source of truth: every
  // later output attending it would be NaN. `kv` holds [token][kv_head][dim]
  // rows, the first at sequence position `first`.
  void check_finite(std::string_view what, RequestId request, std::span<const float> kv, std::uint32_t first) const {
    const auto bad = std::find_if(kv.begin(), kv.end(), [](float x) { return !std::isfinite(x); });
    if (bad == kv.end()) return;
    const auto i = static_cast<std::size_t>(bad - kv.begin());
    const std::size_t row = std::size_t{shape_.kv_heads} * shape_.head_dim;
    fail(ErrorCode::invalid_argument, "{} of request {}: token {} kv head {} (dim {}) is not finite", what, request,
         first + i / row, i % row / shape_.head_dim, i % shape_.head_dim);
  }

  // Append + Select + Retrieve for every request of the batch. Plans first:
  // a request whose tail this token fills shows the full page to the policy on
  // a copy of its state, the page save plus any regroup the policy asks for
  // are sized against the pools, and every request's selection is made and
  // checked, all before any request changes. Then commits.
  void step(std::span<const RequestId> batch, std::uint32_t layer, const void* q, const void* k_new,
            const void* v_new) {
    check_index("layer", layer, shape_.layers);
    if (batch.empty()) fail(ErrorCode::invalid_argument, "decode: empty batch");
    if (q == nullptr || k_new == nullptr || v_new == nullptr) {
      fail(ErrorCode::invalid_argument, "decode: q, k_new and v_new must not be null");
    }
    for (std::size_t b = 0; b < batch.size(); ++b) {
      check_batch_entry(batch, b, layer);
    }
    const std::size_t row = std::size_t{shape_.kv_heads} * shape_.head_dim;
    const std::size_t qd = std::size_t{shape_.q_heads} * shape_.head_dim;
    const std::size_t elem = dtype_size(shape_.dtype);
    const auto k_row = [&](std::size_t b) { return static_cast<const std::byte*>(k_new) + b * row * elem; };
    const auto v_row = [&](std::size_t b) { return static_cast<const std::byte*>(v_new) + b * row * elem; };
    const auto new_k = [&](std::size_t b) { return std::span<const float>(keys_).subspan(b * row, row); };
    const auto new_v = [&](std::size_t b) { return std::span<const float>(values_).subspan(b * row, row); };
    to_float(q, batch.size() * qd, queries_);
    for (std::size_t i = 0; i < queries_.size(); ++i) {
      if (!std::isfinite(queries_[i])) {
        fail(ErrorCode::invalid_argument, "decode: q value {} of request {} is not finite", i % qd, batch[i / qd]);
      }
    }
    to_float(k_new, batch.size() * row, keys_);
    to_float(v_new, batch.size() * row, values_);
    for (std::size_t b = 0; b < batch.size(); ++b) {
      const std::uint32_t position = buffer_->sequence_length(batch[b], layer);
      check_finite("decode k_new", batch[b], new_k(b), position);
      check_finite("decode v_new", batch[b], new_v(b), position);
    }

    if (Ops::evicts(policy_)) {
      evicting_step(batch, layer, k_new, v_new);
      return;
    }
    const auto t0 = Clock::now();
    pending_.resize(batch.size());
    // The commits below run in batch order: a save takes its pages, then a
    // regroup frees its run's pages before it takes its own. Replaying that on
    // a count of free CPU pages makes the check exact: it neither refuses a
    // step that fits nor lets a regroup fail half-way. Segments are summed
    // without what earlier regroups free: a slight overestimate.
    std::uint64_t cpu_free = buffer_->cpu_pool().available();
    SegmentDemand segments;
    for (std::size_t b = 0; b < batch.size(); ++b) {
      const RequestId id = batch[b];
      LayerState& ls = state(id).layers[layer];
      Pending& next = pending_[b];
      next.saves = buffer_->tail_tokens(id, layer) + 1 == config_.page_tokens;
      next.regroup.reset();
      if (!next.saves) continue;
      next.page_k = ls.recent_k;
      next.page_v = ls.recent_v;
      next.page_k.insert(next.page_k.end(), new_k(b).begin(), new_k(b).end());
      next.page_v.insert(next.page_v.end(), new_v(b).begin(), new_v(b).end());
      const std::uint32_t tokens = buffer_->sequence_length(id, layer) + 1;
      AppendedPage page;
      page.page = KvView{next.page_k, next.page_v, config_.page_tokens, shape_.kv_heads, shape_.head_dim,
                         tokens - config_.page_tokens};
      for (std::uint32_t h = 0; h < shape_.kv_heads; ++h) {
        page.partitions.push_back(buffer_->table().partition_count(id, layer, h));
      }
      next.state = ls.policy;  // the policy commits to the page only if the step does
      next.regroup = policy_.append(context(layer, tokens), page, next.state);
      SaveDemand demand;
      if (next.regroup) {
        for (std::uint32_t h = 0; h < shape_.kv_heads; ++h) {
          check_regroup(id, layer, h, *next.regroup, page.partitions[h]);
        }
        demand = buffer_->save_demand(id, layer, next.regroup->first_partitions, next.regroup->specs);
      } else {
        demand = buffer_->save_demand(id, layer);
      }
      if (demand.saved_pages > cpu_free) {
        fail(ErrorCode::resource_exhausted, "decode: saving the full tail of request {} needs {} CPU pages, {} free",
             id, demand.saved_pages, cpu_free);
      }
      cpu_free -= demand.saved_pages;
      if (demand.regroup_pages > cpu_free + demand.freed_pages) {
        fail(ErrorCode::resource_exhausted,
             "decode: the regroup of request {} needs {} CPU pages; {} free plus {} freed by its run", id,
             demand.regroup_pages, cpu_free, demand.freed_pages);
      }
      cpu_free = cpu_free + demand.freed_pages - demand.regroup_pages;
      segments += demand.segments;
    }
    buffer_->table().check_segments(segments);

    // Select (and a custom Attend) on each request's state as it stands, before
    // this token's page joins it: the token is in the tail, which is always
    // attended, so whatever the policy and its budget select, the token takes
    // part. Selections are checked here too, so a bad one changes nothing.
    const auto t1 = Clock::now();
    selections_.resize(batch.size());
    extra_.clear();
    const bool custom = Ops::has_attend(policy_);
    if (custom) extra_.assign(batch.size() * shape_.q_heads, AttentionPartial(shape_.head_dim));
    for (std::size_t b = 0; b < batch.size(); ++b) {
      const RequestId id = batch[b];
      const LayerState& ls = state(id).layers[layer];
      const std::uint32_t position = buffer_->sequence_length(id, layer);
      const LayerContext ctx = context(layer, position - buffer_->tail_tokens(id, layer));
      const DecodeQuery query{std::span(queries_).subspan(b * qd, qd), position};
      policy_.select(ctx, query, ls.policy, selections_[b]);
      if (custom) {
        Ops::attend(policy_, ctx, query, ls.policy, selections_[b],
                    std::span(extra_).subspan(b * shape_.q_heads, shape_.q_heads));
      }
      buffer_->check_selection(id, layer, selections_[b].partitions);
    }
    const auto t2 = Clock::now();
    // Nothing below refuses: the planning time is counted only for a step that commits.
    stats_.append_s += seconds(t1 - t0);
    stats_.select_s += seconds(t2 - t1);

    // Commit: append, Retrieve, then (a full tail) the policy's page and regroup.
    retrievals_.resize(batch.size());
    for (std::size_t b = 0; b < batch.size(); ++b) {
      const RequestId id = batch[b];
      LayerState& ls = state(id).layers[layer];
      Pending& next = pending_[b];
      const auto a0 = Clock::now();
      buffer_->append(id, layer, KvChunk{k_row(b), v_row(b), 1, shape_.dtype});
      const auto r0 = Clock::now();
      buffer_->retrieve(id, layer, selections_[b].partitions, retrievals_[b]);
      const auto r1 = Clock::now();
      if (next.saves) {
        // The filled page is saved but still whole in the GPU tail page: it is
        // this step's tail, attended on top of the selection (which predates
        // it), at no GPU slot or copy. The next append starts the tail afresh.
        retrievals_[b].tail_tokens.assign(shape_.kv_heads, config_.page_tokens);
        if (next.regroup) buffer_->repartition(id, layer, next.regroup->first_partitions, next.regroup->specs);
        ls.policy = std::move(next.state);
        ls.recent_k.clear();
        ls.recent_v.clear();
        stats_.pages_saved += shape_.kv_heads;  // one page per kv head, as BufferStats counts
      } else {
        ls.recent_k.insert(ls.recent_k.end(), new_k(b).begin(), new_k(b).end());
        ls.recent_v.insert(ls.recent_v.end(), new_v(b).begin(), new_v(b).end());
      }
      stats_.append_s += seconds(r0 - a0) + seconds(Clock::now() - r1);
      stats_.retrieve_s += seconds(r1 - r0);
      stats_.cache += retrievals_[b].stats;
      stats_.pages_moved += retrievals_[b].plan.copies.size();
      stats_.bytes_moved += retrievals_[b].plan.copies.size() * buffer_->cpu_pool().page_bytes();
      ++stats_.decode_steps;
    }
  }

  // step() for a policy that evicts tokens for good (policy/token_eviction.hpp,
  // SpvLLM §2): per request, the evictions decided at the last step leave the
  // cache, then this token takes a slot (the buffer's strategy picks it, a
  // freed one first under slot_reuse), and the selection is every page with a
  // live slot: dense attention over the live tokens, as H2O and StreamingLLM
  // attend. Planned first against the pools, as step() plans saves, then
  // committed.
  void evicting_step(std::span<const RequestId> batch, std::uint32_t layer, const void* k_new, const void* v_new) {
    const auto t0 = Clock::now();
    const std::size_t row_bytes = std::size_t{shape_.kv_heads} * shape_.head_dim * dtype_size(shape_.dtype);
    pending_.resize(batch.size());
    std::uint64_t cpu_free = buffer_->cpu_pool().available();
    SegmentDemand segments;
    for (std::size_t b = 0; b < batch.size(); ++b) {
      const RequestId id = batch[b];
      const RequestState& s = state(id);
      const LayerState& ls = s.layers[layer];
      const EvictionDemand demand = buffer_->append_demand_evicting(id, layer, pending_evictions(ls));
      cpu_free += demand.freed_pages;
      if (demand.placed_pages > cpu_free) {
        fail(ErrorCode::resource_exhausted, "decode: placing the token of request {} needs {} CPU pages, {} free", id,
             demand.placed_pages, cpu_free);
      }
      cpu_free -= demand.placed_pages;
      segments += demand.segments;
      const std::uint32_t mandatory = budget(s.max_tokens).mandatory_pages;
      for (std::uint32_t h = 0; h < shape_.kv_heads; ++h) {
        if (demand.live_partitions[h] > mandatory) {
          fail(ErrorCode::resource_exhausted,
               "decode: request {} layer {} kv head {} would attend {} live pages, over its {} mandatory pages", id,
               layer, h, demand.live_partitions[h], mandatory);
        }
      }
      Pending& next = pending_[b];
      next.state = ls.policy;
      const std::uint32_t position = buffer_->sequence_length(id, layer);
      Ops::placed(policy_, context(layer, position + 1), position, next.state);
    }
    buffer_->table().check_segments(segments);
    const auto t1 = Clock::now();
    stats_.append_s += seconds(t1 - t0);

    retrievals_.resize(batch.size());
    selections_.resize(batch.size());
    extra_.clear();
    for (std::size_t b = 0; b < batch.size(); ++b) {
      const RequestId id = batch[b];
      LayerState& ls = state(id).layers[layer];
      const auto a0 = Clock::now();
      if (ls.eviction) buffer_->evict(id, layer, ls.eviction->positions);
      ls.eviction.reset();
      buffer_->place_token(id, layer,
                           KvChunk{static_cast<const std::byte*>(k_new) + b * row_bytes,
                                   static_cast<const std::byte*>(v_new) + b * row_bytes, 1, shape_.dtype});
      ls.policy = std::move(pending_[b].state);
      auto& selection = selections_[b].partitions;
      selection.resize(shape_.kv_heads);
      for (std::uint32_t h = 0; h < shape_.kv_heads; ++h) buffer_->live_partitions(id, layer, h, selection[h]);
      const auto r0 = Clock::now();
      buffer_->retrieve(id, layer, selection, retrievals_[b]);
      const auto r1 = Clock::now();
      stats_.append_s += seconds(r0 - a0);
      stats_.retrieve_s += seconds(r1 - r0);
      stats_.cache += retrievals_[b].stats;
      stats_.pages_moved += retrievals_[b].plan.copies.size();
      stats_.bytes_moved += retrievals_[b].plan.copies.size() * buffer_->cpu_pool().page_bytes();
      ++stats_.decode_steps;
    }
  }

  static bool drops_any(const Eviction& e) {
    return std::any_of(e.positions.begin(), e.positions.end(), [](const auto& p) { return !p.empty(); });
  }
  // The positions a layer's pending eviction drops per kv head (none: empty lists).
  std::span<const std::vector<std::uint32_t>> pending_evictions(const LayerState& ls) {
    if (ls.eviction) return ls.eviction->positions;
    no_eviction_.resize(shape_.kv_heads);
    return no_eviction_;
  }

  // After a step of a policy that evicts: its Attend weights (slot_weights_,
  // [plan_.indices][page_tokens], when the policy reads them) go to the
  // policy by sequence position, and the policy decides what each kv head
  // drops; the buffer applies it at the start of the layer's next step, so
  // this step's plan stays valid until the next call.
  void decide_evictions(std::span<const RequestId> batch, std::uint32_t layer, bool weighed) {
    const std::uint32_t pt = config_.page_tokens;
    std::size_t index = 0;  // plan_.indices walks the batch, its heads and their pages in this order
    for (std::size_t b = 0; b < batch.size(); ++b) {
      const RequestId id = batch[b];
      LayerState& ls = state(id).layers[layer];
      const Retrieval& r = retrievals_[b];
      const std::uint32_t position = buffer_->sequence_length(id, layer) - 1;
      const LayerContext ctx = context(layer, position + 1);
      EvictionContext e;
      e.newest = position;
      for (std::uint32_t h = 0; h < shape_.kv_heads; ++h) e.live_tokens.push_back(buffer_->live_tokens(id, layer, h));
      if (weighed) {
        token_weights_.reset(shape_.kv_heads);
        for (std::uint32_t h = 0; h < shape_.kv_heads; ++h) {
          for (std::uint32_t i = r.head_offsets[h]; i < r.head_offsets[h + 1]; ++i) {
            for (std::uint32_t p = r.plan.partition_offsets[i]; p < r.plan.partition_offsets[i + 1]; ++p, ++index) {
              for (std::uint32_t t = 0; t < pt; ++t) {
                const std::uint32_t pos = r.slot_positions[std::size_t{p} * pt + t];
                if (pos != kNoPosition) token_weights_.heads[h].push_back({pos, slot_weights_[index * pt + t]});
              }
            }
          }
        }
        Ops::observe(policy_, ctx, token_weights_, ls.policy);
      }
      Eviction out;
      Ops::evict(policy_, ctx, e, ls.policy, out);
      if (drops_any(out)) ls.eviction = std::move(out);
    }
  }

  enum class Api : std::uint8_t { unset, host, device };
  void use_api(Api api) {
    if (api_ == Api::unset) api_ = api;
    if (api_ != api) {
      fail(ErrorCode::failed_precondition, "this Manager serves {} tensors (its first prefill chose); got {} tensors",
           api_ == Api::host ? "host" : "device", api == Api::host ? "host" : "device");
    }
  }

  // The device decoder, made at the first device-tensor call.
  DeviceDecoder& device_decoder() {
    if (api_ == Api::host) use_api(Api::device);  // throws: this Manager serves host tensors
    if (device_) return *device_;
    DeviceDecoderSetup setup;
    setup.shape = shape_;
    setup.page_tokens = config_.page_tokens;
    setup.max_batch = config_.max_requests;  // a batch names distinct requests
    setup.max_requests = config_.max_requests;
    setup.max_partitions_per_head = head_capacity().partitions;
    setup.max_pages_per_head = budget(config_.max_context_tokens).mandatory_pages;
    setup.timestamp_buckets = config_.timestamp_buckets;
    setup.scale = scale();
    for (std::uint32_t l = 0; l < shape_.layers; ++l) {
      const DeviceSelectSpec spec = device_select(policy_, context(l, config_.max_context_tokens));
      if (spec.kind == DeviceSelectSpec::Kind::none) {
        fail(ErrorCode::invalid_argument,
             "policy {} has no device Select in layer {} (policy/device_select.hpp); use the host-tensor API", policy_name(), l);
      }
      setup.select = spec.kind;
      setup.first_partition = spec.first_partition;
      setup.max_selected_per_head =
          std::max(setup.max_selected_per_head, device_select_capacity(spec, setup.max_partitions_per_head));
    }
    device_ = backend_->make_device_decoder(setup, *buffer_);
    if (!device_) {
      fail(ErrorCode::unavailable, "backend {} serves host tensors only; device tensors need the CUDA backend",
           backend_->name());
    }
    // Requests added before the first device call (none prefilled: that
    // would have chosen host tensors) get their tables on the device too.
    for (const auto& [id, unused] : requests_) device_->upload_tables(id);
    return *device_;
  }

  void check_device_pointer(std::string_view what, const void* p) const {
    if (p == nullptr) fail(ErrorCode::invalid_argument, "{} must not be null", what);
    if (!backend_->is_device_pointer(p)) fail(ErrorCode::invalid_argument, "{} is not device memory", what);
  }
  // Whether every layer's policy selects on the device (policy/device_select.hpp):
  // fixed by the policy and Config, asked once.
  bool device_selects() {
    if (!device_selects_) {
      device_selects_ = true;
      for (std::uint32_t l = 0; l < shape_.layers; ++l) {
        if (device_select(policy_, context(l, config_.max_context_tokens)).kind == DeviceSelectSpec::Kind::none) {
          device_selects_ = false;
        }
      }
    }
    return *device_selects_;
  }
  // The device-tensor API's precondition on the host-Select path (the
  // decoder's path refuses the same in device_decoder()).
  void require_device_tensors() const {
    if (api_ == Api::host) const_cast<Manager*>(this)->use_api(Api::device);  // throws
    if (!backend_->has_device_memory()) {
      fail(ErrorCode::unavailable, "backend {} serves host tensors only; device tensors need the CUDA backend",
           backend_->name());
    }
  }

  std::uint32_t table_slot(RequestId request) const {
    const std::size_t per_request = std::size_t{shape_.layers} * shape_.kv_heads;
    return static_cast<std::uint32_t>(buffer_->table().instance(request, 0, 0) / per_request);
  }

  // Entry b of a decode batch, for either tensor kind: a known request, once
  // in the batch, prefilled in `layer` and below its max_tokens.
  void check_batch_entry(std::span<const RequestId> batch, std::size_t b, std::uint32_t layer) const {
    const RequestState& s = state(batch[b]);
    if (std::find(batch.begin(), batch.begin() + b, batch[b]) != batch.begin() + b) {
      fail(ErrorCode::invalid_argument, "decode: request {} appears twice in the batch", batch[b]);
    }
    if (!s.layers[layer].prefilled) {
      fail(ErrorCode::failed_precondition, "decode of request {} layer {} before its prefill", batch[b], layer);
    }
    if (buffer_->sequence_length(batch[b], layer) >= s.max_tokens) {
      fail(ErrorCode::resource_exhausted, "request {} reached its max_tokens {}", batch[b], s.max_tokens);
    }
  }

  // The host's part of a device step (DeviceStep), then the decoder's launch.
  // Everything is checked before anything changes, as in step(). A policy
  // whose rows read its host state (RetroInfer) learns of its decode pages
  // only at its index updates: a step whose page reaches one first waits for
  // the device, feeds the state the pages saved since the last update and
  // this one, and sizes the regroup against the pools; after the step is
  // enqueued it applies the regroup to the tables and the summary store
  // (docs/device-decode.md, "RetroInfer").
  void device_step(DeviceDecoder& device, std::span<const RequestId> batch, std::uint32_t layer, const void* q,
                   const void* k_new, const void* v_new, float* out, void* stream) {
    check_index("layer", layer, shape_.layers);
    if (batch.empty()) fail(ErrorCode::invalid_argument, "decode: empty batch");
    check_device_pointer("decode q", q);
    check_device_pointer("decode k_new", k_new);
    check_device_pointer("decode v_new", v_new);
    device.check_values(stream);
    const DeviceSelectSpec select = device_select(policy_, context(layer, config_.max_context_tokens));
    std::uint64_t cpu_free = buffer_->cpu_pool().available();
    SegmentDemand segments;
    pending_.resize(batch.size());
    bool synced = false;
    for (std::size_t b = 0; b < batch.size(); ++b) {
      check_batch_entry(batch, b, layer);
      Pending& next = pending_[b];
      next.saves = buffer_->tail_tokens(batch[b], layer) + 1 == config_.page_tokens;
      next.regroup.reset();
      next.feeds = false;
      if (!next.saves) continue;
      const LayerState& ls = state(batch[b]).layers[layer];
      SaveDemand demand;
      if (select.host_state &&
          Ops::device_index_update_due(policy_, ls.policy, (ls.unfed_pages + 1) * config_.page_tokens)) {
        if (device.capturing(stream)) {
          fail(ErrorCode::failed_precondition,
               "decode: request {} layer {} reaches its policy's index update, which waits for the device: "
               "this step cannot be captured into a CUDA graph",
               batch[b], layer);
        }
        if (!std::exchange(synced, true)) device.synchronize();  // the unfed pages' saves and the tail
        feed_pages(device, batch, b, layer, k_new, v_new, stream);
        demand = next.regroup ? buffer_->save_demand(batch[b], layer, next.regroup->first_partitions,
                                                     next.regroup->specs)
                              : buffer_->save_demand(batch[b], layer);
      } else {
        demand = buffer_->save_demand(batch[b], layer);
      }
      if (demand.saved_pages > cpu_free) {
        fail(ErrorCode::resource_exhausted, "decode: saving the full tail of request {} needs {} CPU pages, {} free",
             batch[b], demand.saved_pages, cpu_free);
      }
      cpu_free -= demand.saved_pages;
      next.regroup_pages = demand.regroup_pages;
      next.freed_pages = demand.freed_pages;
      segments += demand.segments;
    }
    // Here every save precedes the regroups (applied once the step is
    // enqueued, in batch order): replayed on the free count in that order.
    for (std::size_t b = 0; b < batch.size(); ++b) {
      const Pending& next = pending_[b];
      if (!next.regroup) continue;
      if (next.regroup_pages > cpu_free + next.freed_pages) {
        fail(ErrorCode::resource_exhausted,
             "decode: the regroup of request {} needs {} CPU pages; {} free plus {} freed by its run", batch[b],
             next.regroup_pages, cpu_free, next.freed_pages);
      }
      cpu_free = cpu_free + next.freed_pages - next.regroup_pages;
    }
    buffer_->table().check_segments(segments);

    const auto t0 = Clock::now();
    const std::size_t rows = batch.size() * shape_.kv_heads;
    DeviceStepScratch& d = device_scratch_;
    d.request_slots.resize(batch.size());
    d.tail_slots.resize(batch.size());
    for (auto* v : {&d.tail_tokens, &d.candidates}) v->resize(rows);
    d.tail_pages.resize(rows);
    d.save_pages.assign(rows, kInvalidPage);
    d.instances.resize(rows);
    d.select_rows.assign(select.host_state ? rows : 0, DeviceSelectRow{});
    for (std::size_t b = 0; b < batch.size(); ++b) {
      const RequestId id = batch[b];
      LayerState& ls = state(id).layers[layer];
      d.request_slots[b] = table_slot(id);
      for (std::uint32_t h = 0; h < shape_.kv_heads; ++h) {
        const std::size_t r = b * shape_.kv_heads + h;
        d.candidates[r] = buffer_->table().partition_count(id, layer, h);  // Select sees the state before the save
        d.instances[r] = buffer_->table().instance(id, layer, h);
        d.tail_pages[r] = buffer_->tail_page(id, layer, h);
        if (select.host_state) d.select_rows[r] = Ops::device_select_row(policy_, ls.policy, h, ls.unfed_pages);
      }
      const auto slot = buffer_->append_on_device(
          id, layer, std::span<PageId>(d.save_pages).subspan(b * shape_.kv_heads, shape_.kv_heads));
      d.tail_slots[b] = slot.tail_slot;
      // A filled page is saved but still whole in the tail page: this step's tail.
      std::fill_n(d.tail_tokens.begin() + b * shape_.kv_heads, shape_.kv_heads, slot.tail_slot + 1);
      if (slot.fills_tail) stats_.pages_saved += shape_.kv_heads;
    }
    DeviceStep step;
    step.layer = layer;
    step.batch = static_cast<std::uint32_t>(batch.size());
    step.q = q;
    step.k_new = k_new;
    step.v_new = v_new;
    step.out = out;
    step.stream = stream;
    step.select = select;
    step.request_slots = d.request_slots;
    step.tail_slots = d.tail_slots;
    step.tail_pages = d.tail_pages;
    step.tail_tokens = d.tail_tokens;
    step.candidates = d.candidates;
    step.save_pages = d.save_pages;
    step.instances = d.instances;
    step.select_rows = d.select_rows;
    device.step(step);
    // The host state after the step: fed (and regrouped), or one page behind.
    for (std::size_t b = 0; b < batch.size() && select.host_state; ++b) {
      Pending& next = pending_[b];
      LayerState& ls = state(batch[b]).layers[layer];
      if (!next.saves) continue;
      if (!next.feeds) {
        ++ls.unfed_pages;
        continue;
      }
      ls.policy = std::move(next.state);
      ls.unfed_pages = 0;
      if (next.regroup) {
        device.download_tables(batch[b]);  // waits for the step
        buffer_->repartition(batch[b], layer, next.regroup->first_partitions, next.regroup->specs);
        device.upload_tables(batch[b]);
        upload_summary_rows(device, batch[b], layer, stream);
      }
    }
    stats_.decode_steps += batch.size();
    stats_.append_s += seconds(Clock::now() - t0);  // host time to plan and enqueue the whole step
  }

  // Feeds batch entry b's state copy (pending_[b].state) the decode pages
  // saved since its last index update, read from the CPU tier, then the page
  // this step fills: the device tail page's tokens and k_new / v_new of the
  // entry. The device must be idle (the saves and the tail complete). The
  // last page's append returns the policy's regroup, checked as step()
  // checks it; an earlier page asking for one is a policy bug.
  void feed_pages(DeviceDecoder& device, std::span<const RequestId> batch, std::size_t b, std::uint32_t layer,
                  const void* k_new, const void* v_new, void* stream) {
    const RequestId id = batch[b];
    const LayerState& ls = state(id).layers[layer];
    Pending& next = pending_[b];
    next.feeds = true;
    next.state = ls.policy;
    const PageLayout layout{config_.page_tokens, shape_.head_dim, shape_.dtype};
    const std::uint32_t page = config_.page_tokens;
    const std::size_t row = std::size_t{shape_.kv_heads} * shape_.head_dim;
    const std::size_t elem = dtype_size(shape_.dtype);
    std::vector<std::byte>& bytes = page_bytes_;
    next.page_k.resize(page * row);
    next.page_v.resize(page * row);
    // Head h's rows of one page (its bytes in `bytes`), tokens [0, n), into the page's floats.
    const auto unpack = [&](std::uint32_t h, std::uint32_t n) {
      for (std::uint32_t t = 0; t < n; ++t) {
        for (std::uint32_t i = 0; i < shape_.head_dim; ++i) {
          const std::size_t at = t * row + std::size_t{h} * shape_.head_dim + i;
          next.page_k[at] = load_element(bytes.data() + layout.k_offset(t), i, shape_.dtype);
          next.page_v[at] = load_element(bytes.data() + layout.v_offset(t), i, shape_.dtype);
        }
      }
    };
    const std::uint32_t saved = buffer_->sequence_length(id, layer) - buffer_->tail_tokens(id, layer);
    AppendedPage appended;
    appended.partitions.resize(shape_.kv_heads);
    for (std::uint32_t u = 0; u <= ls.unfed_pages; ++u) {
      const bool last = u == ls.unfed_pages;
      for (std::uint32_t h = 0; h < shape_.kv_heads; ++h) {
        const PartitionId p = buffer_->table().partition_count(id, layer, h) - ls.unfed_pages + u;
        appended.partitions[h] = p;
        bytes.resize(layout.page_bytes());
        if (!last) {
          cpu_pages_.clear();
          buffer_->table().cpu_pages(id, layer, h, p, cpu_pages_);  // a decode page: one-page partition
          std::memcpy(bytes.data(), buffer_->cpu_pool().data(cpu_pages_.at(0)), layout.page_bytes());
          unpack(h, page);
        } else {
          const std::byte* tail = buffer_->gpu_pool().base() + std::size_t{buffer_->tail_page(id, layer, h)} *
                                                                   buffer_->gpu_pool().page_bytes();
          backend_->copy_to_host(bytes.data(), tail, layout.page_bytes(), stream);
          unpack(h, page - 1);
        }
      }
      if (last) {  // the token this step appends: row b of k_new / v_new
        bytes.resize(2 * row * elem);
        backend_->copy_to_host(bytes.data(), static_cast<const std::byte*>(k_new) + b * row * elem, row * elem,
                               stream);
        backend_->copy_to_host(bytes.data() + row * elem, static_cast<const std::byte*>(v_new) + b * row * elem,
                               row * elem, stream);
        for (std::size_t i = 0; i < row; ++i) {
          next.page_k[(page - 1) * row + i] = load_element(bytes.data(), static_cast<std::uint32_t>(i), shape_.dtype);
          next.page_v[(page - 1) * row + i] =
              load_element(bytes.data() + row * elem, static_cast<std::uint32_t>(i), shape_.dtype);
        }
        check_finite("decode k_new", id, std::span(next.page_k).subspan((page - 1) * row, row), saved + page - 1);
        check_finite("decode v_new", id, std::span(next.page_v).subspan((page - 1) * row, row), saved + page - 1);
      }
      const std::uint32_t tokens = saved - (ls.unfed_pages - u) * page + page;
      appended.page = KvView{next.page_k, next.page_v, page, shape_.kv_heads, shape_.head_dim, tokens - page};
      next.regroup = policy_.append(context(layer, tokens), appended, next.state);
      if (next.regroup && !last) {
        fail(ErrorCode::failed_precondition, "policy {}: request {} layer {} regroups before its update was due",
             policy_name(), id, layer);
      }
    }
    if (next.regroup) {
      for (std::uint32_t h = 0; h < shape_.kv_heads; ++h) {
        check_regroup(id, layer, h, *next.regroup, appended.partitions[h]);
      }
    }
  }

  // The host state's summaries of every kv head of (request, layer) into the device store.
  void upload_summary_rows(DeviceDecoder& device, RequestId request, std::uint32_t layer, void* stream) {
    const LayerState& ls = state(request).layers[layer];
    for (std::uint32_t h = 0; h < shape_.kv_heads; ++h) {
      Ops::device_summary_rows(policy_, ls.policy, h, summary_rows_);
      device.write_summary_rows(table_slot(request), layer, h, summary_rows_, stream);
    }
  }

  // A regroup the policy asks for must describe the head as it will be once
  // the page is saved (checked before anything changes: a policy bug must not
  // leave a request half-stepped).
  void check_regroup(RequestId id, std::uint32_t layer, std::uint32_t head, const Repartition& r,
                     std::uint32_t saved_partition) const {
    if (r.first_partitions.size() != shape_.kv_heads || r.specs.size() != shape_.kv_heads ||
        r.first_partitions[head] > saved_partition) {
      fail(ErrorCode::failed_precondition, "policy {}: malformed regroup of request {} layer {}", policy_name(), id,
           layer);
    }
    std::uint64_t tokens = config_.page_tokens;  // the page being saved
    for (PartitionId p = r.first_partitions[head]; p < saved_partition; ++p) {
      tokens += buffer_->table().meta(id, layer, head, p).token_count();
    }
    if (tokens != r.specs[head].token_count()) {
      fail(ErrorCode::failed_precondition, "policy {}: regroup of kv head {} covers {} tokens, the run holds {}",
           policy_name(), head, r.specs[head].token_count(), tokens);
    }
  }
  std::string_view policy_name() const {
    if constexpr (std::is_same_v<Policy, AnyPolicy>) {
      return policy_.name();
    } else {
      return Policy::kName;
    }
  }

  ModelShape shape_;
  Config config_;
  Policy policy_;
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<TieredKVBuffer> buffer_;
  std::map<RequestId, RequestState> requests_;
  ManagerStats stats_;
  // Scratch reused across calls.
  std::vector<float> keys_, values_, queries_;
  std::vector<Selection> selections_;
  std::vector<Retrieval> retrievals_;
  std::vector<AttentionPartial> extra_;
  AttendPlan plan_;
  std::vector<PageId> plan_pages_;           // one (request, kv head)'s pages while building plan_
  std::vector<std::uint32_t> plan_tokens_;
  struct Pending {
    bool saves = false;
    std::vector<float> page_k, page_v;
    typename Ops::State state;
    std::optional<Repartition> regroup;
    bool feeds = false;  // device path: the state was fed the pages since its last update
    std::uint64_t regroup_pages = 0, freed_pages = 0;  // device path: the regroup's SaveDemand
  };
  std::vector<Pending> pending_;
  std::vector<float> slot_weights_;                    // a step's Attend weights, for a policy that reads them
  TokenWeights token_weights_;
  std::vector<std::vector<std::uint32_t>> no_eviction_;  // empty lists: a step with nothing to drop
  // The device-tensor API (docs/device-decode.md).
  Api api_ = Api::unset;
  std::optional<bool> device_selects_;  // device_selects(), once asked
  std::unique_ptr<DeviceDecoder> device_;
  struct DeviceStepScratch {
    std::vector<std::uint32_t> request_slots, tail_slots, tail_tokens, candidates;
    std::vector<PageId> tail_pages, save_pages;
    std::vector<std::size_t> instances;
    std::vector<DeviceSelectRow> select_rows;
  };
  DeviceStepScratch device_scratch_;
  std::vector<TokenPlacement> device_placements_;  // a device prompt's rows in the CPU tier
  std::vector<std::byte> prompt_k_, prompt_v_;      // a prompt or step's K / V, come down
  std::vector<std::byte> step_q_;                   // the host-Select path: a step's q, come down ...
  std::vector<float> step_out_;                     // ... and its output, going up
  std::vector<std::byte> page_bytes_;               // ... and one page of its index update
  std::vector<PageId> cpu_pages_;
  DeviceSummaryRows summary_rows_;
};

using RuntimeManager = Manager<AnyPolicy>;

}  // namespace sparsekv
