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
// The Manager keeps the requests (their registry, admission, validation),
// the choice between host and device tensors, and the stats; the decode step
// itself is the step layer's (step/): HostStep on host tensors, split into
// phases an engine's threads can share; DeviceStep on device tensors.
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
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "sparsekv/attention/attend_plan.hpp"
#include "sparsekv/attention/prompt_attention.hpp"
#include "sparsekv/buffer/tiered_kv_buffer.hpp"
#include "sparsekv/core/error.hpp"
#include "sparsekv/facade/device_stream.hpp"
#include "sparsekv/facade/host_backend.hpp"
#include "sparsekv/policy/any_policy.hpp"
#include "sparsekv/step/backend.hpp"
#include "sparsekv/step/device_step.hpp"
#include "sparsekv/step/host_step.hpp"
#include "sparsekv/step/prefill.hpp"
#include "sparsekv/step/staged_tensors.hpp"
#include "sparsekv/step/step_executor.hpp"
#include "sparsekv/step/step_stats.hpp"

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
    budget(config_.max_context_tokens);  // a policy that cannot serve this shape or page size refuses here, not later
    buffer_ = std::make_unique<TieredKVBuffer>(shape, config, backend_->cpu_tier(), backend_->gpu_pages(),
                                               backend_->gpu_tables(), backend_->transfer(), head_capacity(),
                                               backend_->attend_site());
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
        requests_(std::move(o.requests_)),
        stats_(o.stats_),
        api_(o.api_),
        device_selects_(o.device_selects_),
        runtime_(std::move(o.runtime_)) {
    bind_steps();
  }
  Manager(const Manager&) = delete;
  Manager& operator=(const Manager&) = delete;
  Manager& operator=(Manager&&) = delete;

  // The per-(layer, kv head) mandatory pages the policy needs for a request of
  // up to `max_tokens` tokens, taken over all layers.
  RequestBudget budget(std::uint32_t max_tokens) const {
    std::uint32_t mandatory = 1;
    for (std::uint32_t l = 0; l < shape_.layers; ++l) {
      mandatory = std::max(mandatory, policy_.mandatory_pages(context(l, max_tokens)));
    }
    return RequestBudget{mandatory, 0, evicts_tokens(policy_)};
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

  // Advice for fork(request, source, tokens, max_tokens), as can_admit is for
  // add_request + prefill: admit is true exactly when the fork would succeed
  // now, the pages it shares with `source` counted once (the source's). For
  // a policy with ForksIndex the fork's layout is worked out as the fork
  // would (its Index on a copy, from the few rows past what it reuses); for
  // any other (RetroInfer) the prompt's pages are the policy's bound, as in
  // can_admit: the advice then errs on refusing.
  AdmissionAdvice can_fork(RequestId source, std::uint32_t tokens, std::uint32_t max_tokens) const {
    if (std::optional<Refusal> r = fork_refusal(source, tokens, max_tokens)) {
      AdmissionAdvice advice;
      advice.reason = std::move(r->message);
      return advice;
    }
    const RequestBudget b = budget(max_tokens);
    if (!forks_index(policy_)) return buffer_->can_admit(tokens, b, prompt_pages(tokens));
    std::uint64_t pages = 0;
    std::vector<std::byte> k, v;
    std::vector<float> keys, values;
    for (std::uint32_t l = 0; l < shape_.layers; ++l) {
      const State& from = state(source).layers[l].policy;
      const std::uint32_t reused = read_fork_rows(source, l, tokens, k, v);
      scope_.to_float(k.data(), std::size_t{tokens - reused} * scope_.kv_row(), keys);
      scope_.to_float(v.data(), std::size_t{tokens - reused} * scope_.kv_row(), values);
      State indexed = make_layer_state(policy_);
      const KvView view{keys, values, tokens - reused, shape_.kv_heads, shape_.head_dim, reused};
      pages += buffer_->fork_pages(source, l, tokens, fork_index(policy_, context(l, tokens), from, view, indexed));
    }
    return buffer_->can_admit_pages(tokens, b, pages);
  }

  void add_request(RequestId request, std::uint32_t max_tokens) {
    if (std::string bad = max_tokens_refusal(max_tokens); !bad.empty()) {
      fail(ErrorCode::invalid_argument, "request {}: {}", request, bad);
    }
    const RequestBudget b = budget(max_tokens);
    if (runtime_) {
      // add_request may reclaim buffering pages of other requests, whose
      // current GPU page tables the device holds: bring them back first.
      for (const auto& [id, unused] : requests_) runtime_->download_tables(id);
      buffer_->add_request(request, b);
      for (const auto& [id, unused] : requests_) runtime_->upload_tables(id);
      runtime_->upload_tables(request);
    } else {
      buffer_->add_request(request, b);
    }
    RequestState& s = requests_[request];
    s.max_tokens = max_tokens;
    s.mandatory_pages = b.mandatory_pages;
    s.layers.resize(shape_.layers);
    for (auto& layer : s.layers) {
      layer.policy = make_layer_state(policy_);
      layer.max_tokens = max_tokens;
    }
  }

  // ---- Host tensors ---------------------------------------------------------

  // `rows`: the dtype of k / v, the model's unless said; the storage dtype
  // (Config::kv_storage) takes rows read back by read_kv in it, stored as
  // they are.
  void prefill(RequestId request, std::uint32_t layer, const void* k, const void* v, std::uint32_t tokens,
               std::optional<DType> rows = {}) {
    use_api(Api::host);
    state(request);
    check_index("layer", layer, shape_.layers);
    if (k == nullptr || v == nullptr || tokens == 0) {
      fail(ErrorCode::invalid_argument, "prefill of request {}: K/V must be non-null with tokens > 0", request);
    }
    check_rows_dtype("prefill", rows);
    if (const std::uint32_t staged = state(request).layers[layer].staged_tokens; staged != 0) {
      fail(ErrorCode::failed_precondition,
           "prefill of request {} layer {}: {} tokens of its prompt are staged; send the rest with prefill_chunk",
           request, layer, staged);
    }
    LayerStepState<State>& ls = prefill_entry(request, layer, tokens);
    host_prefill(scope_, request, layer, ls, k, v, tokens, keys_, values_, rows);
  }

  // A prompt in chunks, as an engine's ubatches bring it (docs/integration.md,
  // "Prompts in chunks"): each chunk's K/V are kept in the storage dtype
  // (Config::kv_storage: the model's, or q8_0, then quantized here; `rows`
  // says what k / v hold, the model dtype unless said) until
  // the layer's first decode step (or end_prompt), which prefills the whole
  // prompt at once, so the result is exactly prefill() of the concatenated
  // chunks for every policy (ShadowKV's SVD, RetroInfer's clusters and
  // StreamingLLM's cut need the whole prompt). Host tensors. Throws, changing
  // nothing: invalid_argument (null or non-finite K/V, no tokens, past
  // max_tokens), failed_precondition once the layer is prefilled (a live
  // request grows by extend()).
  void prefill_chunk(RequestId request, std::uint32_t layer, const void* k, const void* v, std::uint32_t tokens,
                     std::optional<DType> rows = {}) {
    use_api(Api::host);
    RequestState& s = state(request);
    check_index("layer", layer, shape_.layers);
    if (k == nullptr || v == nullptr || tokens == 0) {
      fail(ErrorCode::invalid_argument, "prefill_chunk of request {}: K/V must be non-null with tokens > 0", request);
    }
    check_rows_dtype("prefill_chunk", rows);
    const DType from = rows.value_or(shape_.dtype), stored = config_.storage_dtype(shape_);
    LayerStepState<State>& ls = s.layers[layer];
    if (ls.prefilled) {
      fail(ErrorCode::failed_precondition,
           "prefill_chunk of request {} layer {}: the layer is prefilled; append to a live request with extend()",
           request, layer);
    }
    if (std::uint64_t{ls.staged_tokens} + tokens > s.max_tokens) {
      fail(ErrorCode::invalid_argument, "request {}: a prompt of {} + {} tokens exceeds its max_tokens {}", request,
           ls.staged_tokens, tokens, s.max_tokens);
    }
    const std::size_t n = std::size_t{tokens} * scope_.kv_row();
    scope_.to_finite_float("prefill_chunk k", request, k, n, keys_, ls.staged_tokens, from);
    scope_.to_finite_float("prefill_chunk v", request, v, n, values_, ls.staged_tokens, from);
    const std::size_t token_bytes = shape_.kv_heads * dtype_row_bytes(stored, shape_.head_dim);
    const std::size_t bytes = std::size_t{tokens} * token_bytes;
    ls.staged_k.reserve(std::size_t{s.max_tokens} * token_bytes);
    ls.staged_v.reserve(std::size_t{s.max_tokens} * token_bytes);
    if (from == stored) {
      ls.staged_k.append(k, bytes);
      ls.staged_v.append(v, bytes);
    } else {
      const std::size_t heads = std::size_t{tokens} * shape_.kv_heads;
      chunk_rows_.resize(bytes);
      convert_rows(k, from, chunk_rows_.data(), stored, heads, shape_.head_dim);
      ls.staged_k.append(chunk_rows_.data(), bytes);
      convert_rows(v, from, chunk_rows_.data(), stored, heads, shape_.head_dim);
      ls.staged_v.append(chunk_rows_.data(), bytes);
    }
    ls.staged_tokens += tokens;
  }
  // Prefills every layer of `request` that holds a staged prompt, now (each
  // layer's first decode step does it otherwise). Throws what prefill()
  // throws; the layers before the failing one stay prefilled, which is what
  // their decode would have done.
  void end_prompt(RequestId request) {
    RequestState& s = state(request);
    for (std::uint32_t l = 0; l < shape_.layers; ++l) {
      if (s.layers[l].staged_tokens != 0) prefill_staged(request, l);
    }
  }
  // Tokens of `layer`'s prompt staged by prefill_chunk and not yet prefilled;
  // and whether the layer is prefilled (decode and extend need it).
  std::uint32_t staged_tokens(RequestId request, std::uint32_t layer) const {
    check_index("layer", layer, shape_.layers);
    return state(request).layers[layer].staged_tokens;
  }
  bool prefilled(RequestId request, std::uint32_t layer) const {
    check_index("layer", layer, shape_.layers);
    return state(request).layers[layer].prefilled;
  }
  // Reads back positions [first, end) of the layer's K/V into k and v
  // ([end - first][kv_heads][head_dim], in `as`: the model dtype unless said,
  // q8_0 storage then dequantized; or the storage dtype, the stored bytes,
  // which prefill(..., rows) takes back exactly): what an engine saves
  // beside its own state, or checks against its own cache. Readable are a
  // staged prompt's tokens and, once the layer is prefilled, the CPU tier's
  // tokens in order (TieredKVBuffer::readable_tokens: not a policy's
  // regrouped or evicted tokens, nor the unsaved decode page on a GPU tier;
  // in place that page is read too). Throws, writing nothing: not_found
  // (unknown request), out_of_range (`end` past what is readable, or first > end).
  void read_kv(RequestId request, std::uint32_t layer, std::uint32_t first, std::uint32_t end, void* k, void* v,
               std::optional<DType> as = {}) const {
    check_index("layer", layer, shape_.layers);
    check_rows_dtype("read_kv", as);
    const DType dtype = as.value_or(shape_.dtype);
    const LayerStepState<State>& ls = state(request).layers[layer];
    const std::uint32_t readable = readable_tokens(request, layer);
    if (first > end || end > readable) {
      fail(ErrorCode::out_of_range, "read_kv of request {} layer {}: positions [{}, {}) but {} are readable", request,
           layer, first, end, readable);
    }
    if (ls.prefilled) {
      buffer_->read_prefix(request, layer, first, end, k, v, dtype);
      return;
    }
    const DType stored = config_.storage_dtype(shape_);
    const std::size_t row = shape_.kv_heads * dtype_row_bytes(stored, shape_.head_dim);
    const std::size_t rows = std::size_t{end - first} * shape_.kv_heads;
    convert_rows(ls.staged_k.data() + first * row, stored, k, dtype, rows, shape_.head_dim);
    convert_rows(ls.staged_v.data() + first * row, stored, v, dtype, rows, shape_.head_dim);
  }
  // The shape of the library's prompt attention (attention/prompt_attention.hpp): the model's heads, the
  // staged prompt's dtype (the storage dtype), and the scale Attend applies (Config::attention_scale, or
  // 1/sqrt(head_dim)).
  PromptAttentionShape prompt_attention_shape() const {
    const float scale = config_.attention_scale != 0.0f ? config_.attention_scale : scope_.scale();
    return PromptAttentionShape{config_.storage_dtype(shape_), shape_.q_heads, shape_.kv_heads, shape_.head_dim,
                                scale};
  }
  // The causal attention of the last `rows` tokens of `layer`'s staged prompt (prefill_chunk), for an engine
  // that has the library attend its prompt: their queries q ([rows][q_heads][head_dim] fp32, rows q_stride
  // floats apart, 0 for packed) over the staged tokens up to each one, into out (the same, out_stride). Run
  // it with PromptAttention on any threads; it reads the staged K/V, valid until the next call that changes
  // this request. Throws, changing nothing: not_found, failed_precondition (the layer is prefilled: a live
  // request attends by extend), out_of_range (rows 0 or more than staged), invalid_argument (null q or out).
  PromptChunk prompt_chunk(RequestId request, std::uint32_t layer, const float* q, std::uint32_t rows, float* out,
                           std::size_t q_stride = 0, std::size_t out_stride = 0) const {
    check_index("layer", layer, shape_.layers);
    const LayerStepState<State>& ls = state(request).layers[layer];
    if (ls.prefilled) {
      fail(ErrorCode::failed_precondition, "prompt_chunk of request {} layer {}: the layer is prefilled", request,
           layer);
    }
    if (rows == 0 || rows > ls.staged_tokens) {
      fail(ErrorCode::out_of_range, "prompt_chunk of request {} layer {}: {} rows, {} staged", request, layer, rows,
           ls.staged_tokens);
    }
    if (q == nullptr || out == nullptr) fail(ErrorCode::invalid_argument, "prompt_chunk: q and out must not be null");
    return PromptChunk{q, q_stride, ls.staged_k.data(), ls.staged_v.data(), ls.staged_tokens - rows, rows, out,
                       out_stride};
  }
  // The layer's first tokens read_kv can read.
  std::uint32_t readable_tokens(RequestId request, std::uint32_t layer) const {
    check_index("layer", layer, shape_.layers);
    const LayerStepState<State>& ls = state(request).layers[layer];
    return ls.prefilled ? buffer_->readable_tokens(request, layer) : ls.staged_tokens;
  }

  // Appends `tokens` tokens to the live request in `layer` -- a new chat turn,
  // a speculative draft being verified -- as that many decode steps of batch
  // 1: the request ends up exactly as if it had decoded them, its policy
  // included (H2O weighs them by their attention). q [tokens][q_heads]
  // [head_dim], k / v [tokens][kv_heads][head_dim], host tensors in the model
  // dtype; `out` ([tokens][q_heads][head_dim] fp32) receives each step's
  // attention, or null when the engine computes it itself. Checks every
  // token first and throws, changing nothing, what decode() throws (a layer
  // not prefilled, non-finite values, past max_tokens); only then is a
  // staged prompt (prefill_chunk) prefilled, as the layer's first decode
  // step would. A pool that runs out mid-way throws resource_exhausted
  // naming how many tokens went in (those stay: each was a whole step).
  void extend(RequestId request, std::uint32_t layer, const void* q, const void* k, const void* v,
              std::uint32_t tokens, float* out = nullptr) {
    use_api(Api::host);
    RequestState& s = state(request);
    check_index("layer", layer, shape_.layers);
    if (q == nullptr || k == nullptr || v == nullptr || tokens == 0) {
      fail(ErrorCode::invalid_argument, "extend of request {}: q, K and V must be non-null with tokens > 0",
           request);
    }
    // A staged layer is checked as the prompt it will be, and prefilled after the checks.
    const std::uint32_t staged = s.layers[layer].staged_tokens;
    const RequestId batch[] = {request};
    if (staged == 0) check_batch_entry(batch, 0, layer);
    const std::uint32_t length = staged != 0 ? staged : buffer_->sequence_length(request, layer);
    if (std::uint64_t{length} + tokens > s.max_tokens) {
      fail(ErrorCode::resource_exhausted, "extend of request {} by {} tokens: {} + {} exceeds its max_tokens {}",
           request, tokens, length, tokens, s.max_tokens);
    }
    const std::size_t qd = scope_.q_row(), kvd = scope_.kv_row(), size = dtype_size(shape_.dtype);
    if (!scope_.to_float(q, tokens * qd, keys_)) {
      fail(ErrorCode::invalid_argument, "extend of request {}: a q value is not finite", request);
    }
    scope_.to_finite_float("extend k", request, k, tokens * kvd, keys_, length);
    scope_.to_finite_float("extend v", request, v, tokens * kvd, values_, length);
    if (staged != 0) prefill_staged(request, layer);
    extend_out_.resize(qd);
    const auto* qb = static_cast<const std::byte*>(q);
    const auto* kb = static_cast<const std::byte*>(k);
    const auto* vb = static_cast<const std::byte*>(v);
    for (std::uint32_t t = 0; t < tokens; ++t) {
      try {
        decode(batch, layer, qb + t * qd * size, kb + t * kvd * size, vb + t * kvd * size,
               out != nullptr ? out + t * qd : extend_out_.data());
      } catch (const Error& e) {
        if (t == 0) throw;
        fail(e.code(), "extend of request {}: {} of {} tokens appended, then: {}", request, t, tokens, e.what());
      }
    }
  }

  // Built-in Attend: out[b] = attention of q[b] over request b's selected
  // pages and tail, on this thread -- or, given the engine's parallel_for
  // (step/step_executor.hpp), with Select and Attend on the engine's threads;
  // the output is bit-identical either way.
  void decode(std::span<const RequestId> batch, std::uint32_t layer, const void* q, const void* k_new,
              const void* v_new, float* out) {
    begin_decode(batch, layer, q, k_new, v_new, out).run(nullptr);
  }
  void decode(std::span<const RequestId> batch, std::uint32_t layer, const void* q, const void* k_new,
              const void* v_new, float* out, const StepExecutor& executor) {
    begin_decode(batch, layer, q, k_new, v_new, out).run(&executor);
  }

  // decode()'s first phase, for an engine that runs the rest on its own
  // threads with (ith, nth) (step/host_step.hpp; docs/integration.md,
  // "Threads"): step.select(ith, nth) on every thread, then step.commit() on
  // one, step.attend(ith, nth) on every thread, step.finish() on one, with a
  // barrier between. Checks everything and plans the step; changes nothing
  // until commit(). The step is the Manager's, valid until the next call.
  HostStep<Policy>& begin_decode(std::span<const RequestId> batch, std::uint32_t layer, const void* q,
                                 const void* k_new, const void* v_new, float* out) {
    use_api(Api::host);
    if (out == nullptr) fail(ErrorCode::invalid_argument, "decode: out must not be null");
    backend_->check_attend(scope_.layout(), shape_.q_heads, shape_.kv_heads);
    begin_host_step(batch, layer, q, k_new, v_new, out);
    return *host_step_;
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
  // (an engine's prefix cache, llama.cpp's seq_cp; docs/integration.md,
  // "Shared prefixes"): add_request(request, max_tokens), then in every layer
  // the prefill of those tokens' K/V, which the library takes from
  // `source`'s CPU pages. The policy indexes them as a prefill would, reusing
  // the source's summaries of the pages the two share where it can
  // (ForksIndex); the full pages its partitions share with `source`
  // (page-sized uniform ones) are mapped by reference, the partial last page
  // is copied. The two requests then decode independently, each exactly as
  // if prefilled unshared; either may finish first. `tokens` may reach only
  // what the source holds in order in the CPU tier in every layer
  // (TieredKVBuffer::readable_tokens: in place its unsaved decode page too;
  // not that page on a GPU tier, nor tokens a policy regrouped or evicted).
  // Host tensors only; throws (changing nothing) what add_request and prefill
  // throw, and out_of_range past the readable tokens.
  void fork(RequestId request, RequestId source, std::uint32_t tokens, std::uint32_t max_tokens) {
    use_api(Api::host);
    if (request == source) fail(ErrorCode::invalid_argument, "request {} cannot fork itself", request);
    if (std::optional<Refusal> r = fork_refusal(source, tokens, max_tokens)) fail(r->code, "fork: {}", r->message);
    add_request(request, max_tokens);
    try {
      for (std::uint32_t l = 0; l < shape_.layers; ++l) {
        const ForkSource<Policy> fork{source, &state(source).layers[l].policy,
                                      read_fork_rows(source, l, tokens, fork_k_, fork_v_)};
        LayerStepState<State>& ls = prefill_entry(request, l, tokens);
        host_fork_prefill(scope_, request, l, ls, fork_k_.data(), fork_v_.data(), tokens, keys_, values_, fork);
      }
    } catch (...) {
      finish(request);
      throw;
    }
  }

  // ---- Device tensors (docs/integration.md, "Device tensors") ---------------
  // The same calls with device pointers in the model dtype and the engine's
  // cudaStream_t (a DeviceStream: a bare nullptr or {} picks the host call,
  // never these): everything is enqueued on `stream`. Needs a backend with
  // device memory and a device runtime (CudaBackend; others throw
  // unavailable before anything changes). A policy with a device Select
  // (policy/device_select.hpp: Quest with one-page partitions, ShadowKV,
  // StreamingWindow, Dense, RetroInfer) runs the whole step there
  // (step/device_step.hpp); prefill() waits for its copies, decode() and
  // plan() return without waiting. Any other policy (a custom one with only a
  // host Select) takes the slower host-Select path: every call copies its
  // tensors down, runs the host-tensor call, copies `out` up and waits;
  // plan() is refused there.

  void prefill(RequestId request, std::uint32_t layer, const void* k, const void* v, std::uint32_t tokens,
               DeviceStream stream) {
    if (!device_selects()) {
      staged_prefill(request, layer, k, v, tokens, stream.handle);
      return;
    }
    DeviceStep<Policy>& step = device_step();
    state(request);
    check_index("layer", layer, shape_.layers);
    check_device_pointer("prefill k", k);
    check_device_pointer("prefill v", v);
    LayerStepState<State>& ls = prefill_entry(request, layer, tokens);
    step.prefill({request, &ls, table_slot(request)}, layer, k, v, tokens, stream.handle);
    use_api(Api::device);
  }

  // decode() on device tensors: returns once the step is enqueued on `stream`.
  void decode(std::span<const RequestId> batch, std::uint32_t layer, const void* q, const void* k_new,
              const void* v_new, float* out, DeviceStream stream) {
    if (!device_selects()) {
      staged_decode(batch, layer, q, k_new, v_new, out, stream.handle);
      return;
    }
    DeviceStep<Policy>& step = device_step();
    check_device_pointer("decode out", out);
    // The attention kernel's shapes, refused before the step changes the buffer.
    backend_->check_attend(scope_.layout(), shape_.q_heads, shape_.kv_heads);
    step.decode(device_entries(batch, layer, q, k_new, v_new), layer, q, k_new, v_new, out, stream.handle);
  }

  // plan() on device tensors: the step up to the plan, which stays in device
  // memory (DeviceAttendPlan) for the engine's kernel on `stream`; valid
  // until the next call on this Manager.
  DeviceAttendPlan plan(std::span<const RequestId> batch, std::uint32_t layer, const void* q, const void* k_new,
                        const void* v_new, DeviceStream stream) {
    if (!device_selects()) {
      require_device_tensors();
      fail(ErrorCode::invalid_argument,
           "policy {} selects on the host: plan() on device tensors needs a device Select "
           "(policy/device_select.hpp); use decode(), or plan() on host tensors",
           policy_name(policy_));
    }
    DeviceStep<Policy>& step = device_step();
    step.decode(device_entries(batch, layer, q, k_new, v_new), layer, q, k_new, v_new, nullptr, stream.handle);
    return runtime_->plan();
  }

  // ---- Either kind ----------------------------------------------------------

  void finish(RequestId request) {
    state(request);
    if (runtime_) runtime_->download_tables(request);  // waits for the request's steps
    buffer_->finish(request);
    requests_.erase(request);
  }

  std::uint64_t working_set(RequestId request) const {
    state(request);
    return buffer_->working_set_pages(request);
  }
  bool has_request(RequestId request) const { return requests_.contains(request); }
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
  void synchronize() {
    if (!runtime_) return;
    runtime_->synchronize();
    stats_.cache = runtime_->cache_stats();
    // Every miss the device gathered is one page moved CPU -> GPU, as Retrieve counts them.
    stats_.pages_moved = stats_.cache.miss_pages;
    stats_.bytes_moved = stats_.cache.miss_pages * buffer_->cpu_pool().page_bytes();
    runtime_->check_values(nullptr);
  }
  // Device-tensor API: opt-in per-stage timing of later decode steps
  // (DeviceRuntime::time_stages, docs/device-decode.md; off by default, no
  // host sync added to a step) and its totals (waits for the steps). Makes
  // the device runtime: the first call precedes the first add_request.
  void time_device_stages(bool on) { device_runtime().time_stages(on); }
  DeviceStageTimes device_stage_times() { return device_runtime().stage_times(); }
  const TieredKVBuffer& buffer() const noexcept { return *buffer_; }
  const Policy& policy() const noexcept { return policy_; }
  const Backend& backend() const noexcept { return *backend_; }
  // Bytes of host memory the CPU tier has reserved (pinned when a GPU is present).
  std::size_t cpu_tier_reserved_bytes() const noexcept { return buffer_->cpu_pool().reserved_bytes(); }

 private:
  struct RequestState {
    std::uint32_t max_tokens = 0;
    std::uint32_t mandatory_pages = 0;  // per (layer, kv head): budget(max_tokens)
    std::vector<LayerStepState<State>> layers;
  };
  enum class Api : std::uint8_t { unset, host, device };

  // What the page table is sized for per head: the policy's own bound for a
  // request of max_context_tokens (over all layers), or the default: no
  // admitted request outgrows it mid-run.
  HeadCapacity head_capacity() const {
    std::optional<HeadCapacity> most;
    for (std::uint32_t l = 0; l < shape_.layers; ++l) {
      if (const auto c = declared_head_capacity(policy_, context(l, config_.max_context_tokens))) {
        most = HeadCapacity{std::max(c->partitions, most ? most->partitions : 0u),
                            std::max(c->cpu_pages, most ? most->cpu_pages : 0u)};
      }
    }
    HeadCapacity capacity = most ? *most : config_.head_capacity();
    capacity.slot_masks = evicts_tokens(policy_);
    return capacity;
  }

  // The most CPU pages a `tokens`-token prompt takes in one (layer, kv head):
  // the policy's bound when it declares one (clusters pad their last page),
  // else none (one-page partitions). An upper bound: advice errs on refusing.
  std::optional<std::uint32_t> prompt_pages(std::uint32_t tokens) const {
    std::optional<std::uint32_t> most;
    for (std::uint32_t l = 0; l < shape_.layers; ++l) {
      if (const auto c = declared_head_capacity(policy_, context(l, tokens))) {
        most = std::max(c->cpu_pages, most.value_or(0));
      }
    }
    return most;
  }

  // The rows of `source`'s layer a fork of `tokens` tokens indexes: those
  // past what its policy reuses, read back into k / v (model dtype). Returns
  // the reused tokens.
  std::uint32_t read_fork_rows(RequestId source, std::uint32_t layer, std::uint32_t tokens, std::vector<std::byte>& k,
                               std::vector<std::byte>& v) const {
    const std::uint32_t reused = reused_tokens(policy_, context(layer, tokens), state(source).layers[layer].policy);
    k.resize(std::size_t{tokens - reused} * scope_.kv_row() * dtype_size(shape_.dtype));
    v.resize(k.size());
    buffer_->read_prefix(source, layer, reused, tokens, k.data(), v.data(), shape_.dtype);
    return reused;
  }
  // Why fork(·, source, tokens, max_tokens) would be refused for its
  // arguments or the source's state: the code it throws and the message, or
  // nothing. can_fork and fork share it so that they agree.
  struct Refusal {
    ErrorCode code;
    std::string message;
  };
  std::optional<Refusal> fork_refusal(RequestId source, std::uint32_t tokens, std::uint32_t max_tokens) const {
    if (std::string bad = max_tokens_refusal(max_tokens); !bad.empty()) return Refusal{ErrorCode::invalid_argument, bad};
    if (!requests_.contains(source)) {
      return Refusal{ErrorCode::not_found, fmt::format("unknown or finished request {}", source)};
    }
    if (api_ == Api::device) {
      return Refusal{ErrorCode::failed_precondition, "forks take host tensors; this Manager serves device tensors"};
    }
    if (tokens == 0 || tokens > max_tokens) {
      return Refusal{ErrorCode::invalid_argument,
                     fmt::format("a fork of {} tokens must be in [1, max_tokens = {}]", tokens, max_tokens)};
    }
    for (std::uint32_t l = 0; l < shape_.layers; ++l) {
      if (!state(source).layers[l].prefilled) {
        return Refusal{ErrorCode::failed_precondition, fmt::format("request {} layer {} is not prefilled", source, l)};
      }
      if (const std::uint32_t readable = buffer_->readable_tokens(source, l); tokens > readable) {
        return Refusal{ErrorCode::out_of_range,
                       fmt::format("request {} layer {} holds its first {} tokens in order in the CPU tier (the rest "
                                   "are in the unsaved decode page on the GPU tier, regrouped or evicted); cannot fork {}",
                                   source, l, readable, tokens)};
      }
    }
    return std::nullopt;
  }

  // K/V rows an engine hands over or reads back: the model dtype or the storage dtype.
  void check_rows_dtype(std::string_view call, std::optional<DType> rows) const {
    const DType stored = config_.storage_dtype(shape_);
    if (rows && *rows != shape_.dtype && *rows != stored) {
      fail(ErrorCode::invalid_argument, "{}: rows in {}; expected the model's {} or the stored {}", call,
           to_string(*rows), to_string(shape_.dtype), to_string(stored));
    }
  }

  std::string max_tokens_refusal(std::uint32_t max_tokens) const {
    if (max_tokens != 0 && max_tokens <= config_.max_context_tokens) return {};
    return fmt::format("max_tokens {} must be in [1, max_context_tokens = {}]", max_tokens,
                       config_.max_context_tokens);
  }

  LayerContext context(std::uint32_t layer, std::uint32_t tokens) const {
    LayerContext ctx{layer, shape_.layers, shape_.q_heads, shape_.kv_heads, shape_.head_dim, config_.page_tokens, tokens};
    ctx.kv_dtype = shape_.dtype;
    return ctx;
  }
  RequestState& state(RequestId request) {
    const auto it = requests_.find(request);
    if (it == requests_.end()) fail(ErrorCode::not_found, "unknown or finished request {}", request);
    return it->second;
  }
  const RequestState& state(RequestId request) const { return const_cast<Manager*>(this)->state(request); }

  // A prefill's request and layer, checked: known, the layer in range and not
  // yet prefilled, the prompt non-empty and within max_tokens.
  LayerStepState<State>& prefill_entry(RequestId request, std::uint32_t layer, std::uint32_t tokens) {
    RequestState& s = state(request);
    check_index("layer", layer, shape_.layers);
    if (tokens == 0) fail(ErrorCode::invalid_argument, "prefill of request {}: tokens must be > 0", request);
    LayerStepState<State>& ls = s.layers[layer];
    if (ls.prefilled) fail(ErrorCode::failed_precondition, "request {} layer {} is already prefilled", request, layer);
    if (tokens > s.max_tokens) {
      fail(ErrorCode::invalid_argument, "request {}: a {}-token prompt exceeds its max_tokens {}", request, tokens,
           s.max_tokens);
    }
    return ls;
  }

  // Prefills `layer` of `request` with its staged prompt (prefill_chunk) and
  // releases the staged bytes, and the prompt's fp32 copy when it is long:
  // kept, it would stay resident beside the CPU tier for the Manager's life.
  void prefill_staged(RequestId request, std::uint32_t layer) {
    LayerStepState<State>& ls = prefill_entry(request, layer, state(request).layers[layer].staged_tokens);
    host_prefill(scope_, request, layer, ls, ls.staged_k.data(), ls.staged_v.data(), ls.staged_tokens, keys_,
                 values_, config_.storage_dtype(shape_));
    ls.staged_k.release();
    ls.staged_v.release();
    ls.staged_tokens = 0;
    if (keys_.capacity() * sizeof(float) > kKeptPromptScratchBytes) {
      keys_ = {};
      values_ = {};
    }
  }
  static constexpr std::size_t kKeptPromptScratchBytes = std::size_t{1} << 20;

  // Entry b of a decode batch, for either tensor kind: a known request, once
  // in the batch, prefilled in `layer` and below its max_tokens.
  RequestState& check_batch_entry(std::span<const RequestId> batch, std::size_t b, std::uint32_t layer) {
    RequestState& s = state(batch[b]);
    if (std::find(batch.begin(), batch.begin() + b, batch[b]) != batch.begin() + b) {
      fail(ErrorCode::invalid_argument, "decode: request {} appears twice in the batch", batch[b]);
    }
    if (!s.layers[layer].prefilled) {
      fail(ErrorCode::failed_precondition, "decode of request {} layer {} before its prefill", batch[b], layer);
    }
    if (buffer_->sequence_length(batch[b], layer) >= s.max_tokens) {
      fail(ErrorCode::resource_exhausted, "request {} reached its max_tokens {}", batch[b], s.max_tokens);
    }
    return s;
  }
  void check_step_call(std::span<const RequestId> batch, std::uint32_t layer) const {
    check_index("layer", layer, shape_.layers);
    if (batch.empty()) fail(ErrorCode::invalid_argument, "decode: empty batch");
  }

  void begin_host_step(std::span<const RequestId> batch, std::uint32_t layer, const void* q, const void* k_new,
                       const void* v_new, float* out) {
    check_step_call(batch, layer);
    if (q == nullptr || k_new == nullptr || v_new == nullptr) {
      fail(ErrorCode::invalid_argument, "decode: q, k_new and v_new must not be null");
    }
    host_entries_.clear();
    for (std::size_t b = 0; b < batch.size(); ++b) {
      if (state(batch[b]).layers[layer].staged_tokens != 0) prefill_staged(batch[b], layer);
      RequestState& s = check_batch_entry(batch, b, layer);
      host_entries_.push_back({batch[b], &s.layers[layer], s.mandatory_pages});
    }
    host_step_->begin(host_entries_, layer, q, k_new, v_new, out);
  }

  std::span<const typename DeviceStep<Policy>::Entry> device_entries(std::span<const RequestId> batch,
                                                                     std::uint32_t layer, const void* q,
                                                                     const void* k_new, const void* v_new) {
    check_step_call(batch, layer);
    check_device_pointer("decode q", q);
    check_device_pointer("decode k_new", k_new);
    check_device_pointer("decode v_new", v_new);
    device_entries_.clear();
    for (std::size_t b = 0; b < batch.size(); ++b) {
      RequestState& s = check_batch_entry(batch, b, layer);
      device_entries_.push_back({batch[b], &s.layers[layer], table_slot(batch[b])});
    }
    return device_entries_;
  }

  // The host-Select path of the device-tensor API (step/staged_tensors.hpp):
  // the device tensors are staged in host memory, the host-tensor call runs,
  // `out` goes up; each call waits. Checked as the host calls check them,
  // after the copies (which change nothing).
  void staged_prefill(RequestId request, std::uint32_t layer, const void* k, const void* v,
                           std::uint32_t tokens, void* stream) {
    require_device_tensors();
    state(request);
    check_index("layer", layer, shape_.layers);
    check_device_pointer("prefill k", k);
    check_device_pointer("prefill v", v);
    LayerStepState<State>& ls = prefill_entry(request, layer, tokens);
    const std::size_t bytes = std::size_t{tokens} * scope_.kv_row() * dtype_size(shape_.dtype);
    host_prefill(scope_, request, layer, ls, staged_.stage(*backend_, 1, k, bytes, stream),
                 staged_.stage(*backend_, 2, v, bytes, stream), tokens, keys_, values_);
    use_api(Api::device);
  }
  void staged_decode(std::span<const RequestId> batch, std::uint32_t layer, const void* q, const void* k_new,
                          const void* v_new, float* out, void* stream) {
    require_device_tensors();
    for (const auto& [what, p] : {std::pair{"decode q", q}, std::pair{"decode k_new", k_new},
                                  std::pair{"decode v_new", v_new}, std::pair{"decode out", static_cast<const void*>(out)}}) {
      check_device_pointer(what, p);
    }
    const std::size_t elem = dtype_size(shape_.dtype);
    const std::size_t kv_bytes = batch.size() * scope_.kv_row() * elem;
    const std::byte* host_q = staged_.stage(*backend_, 0, q, batch.size() * scope_.q_row() * elem, stream);
    const std::byte* host_k = staged_.stage(*backend_, 1, k_new, kv_bytes, stream);
    const std::byte* host_v = staged_.stage(*backend_, 2, v_new, kv_bytes, stream);
    backend_->check_attend(scope_.layout(), shape_.q_heads, shape_.kv_heads);
    begin_host_step(batch, layer, host_q, host_k, host_v, staged_.output(batch.size() * scope_.q_row()));
    host_step_->run(nullptr);
    staged_.write_output(*backend_, out, stream);
    use_api(Api::device);
  }

  // The host/device latch: the first prefill picks the tensor kind.
  void use_api(Api api) {
    if (api_ == Api::unset) api_ = api;
    if (api_ != api) {
      fail(ErrorCode::failed_precondition, "this Manager serves {} tensors (its first prefill chose); got {} tensors",
           api_ == Api::host ? "host" : "device", api == Api::host ? "host" : "device");
    }
  }
  // Whether every layer's policy selects on the device: fixed by the policy
  // and Config, asked once.
  bool device_selects() {
    if (!device_selects_) device_selects_ = selects_on_device_in_every_layer(scope_);
    return *device_selects_;
  }
  // The device-tensor API's precondition on the host-Select path (the device
  // step's path refuses the same in device_runtime()).
  void require_device_tensors() {
    if (api_ == Api::host) use_api(Api::device);  // throws
    check_device_scale();
    if (!backend_->has_device_memory()) {
      fail(ErrorCode::unavailable, "backend {} serves host tensors only; device tensors need the CUDA backend",
           backend_->name());
    }
  }
  void check_device_scale() const {
    if (config_.attention_scale != 0.0f) {
      fail(ErrorCode::unavailable,
           "Config.attention_scale is served on host tensors only; device tensors attend with 1/sqrt(head_dim)");
    }
  }
  void check_device_pointer(std::string_view what, const void* p) const {
    if (p == nullptr) fail(ErrorCode::invalid_argument, "{} must not be null", what);
    if (!backend_->is_device_pointer(p)) fail(ErrorCode::invalid_argument, "{} is not device memory", what);
  }

  // The device runtime, made at the first device-tensor call.
  DeviceRuntime& device_runtime() {
    if (api_ == Api::host) use_api(Api::device);  // throws: this Manager serves host tensors
    check_device_scale();
    if (runtime_) return *runtime_;
    runtime_ = backend_->make_device_runtime(
        device_runtime_setup(scope_, head_capacity().partitions, budget(config_.max_context_tokens).mandatory_pages),
        *buffer_);
    if (!runtime_) {
      fail(ErrorCode::unavailable, "backend {} serves host tensors only; device tensors need the CUDA backend",
           backend_->name());
    }
    // Requests added before the first device call (none prefilled: that
    // would have chosen host tensors) get their tables on the device too.
    for (const auto& [id, unused] : requests_) runtime_->upload_tables(id);
    return *runtime_;
  }
  // The steps work on this Manager's members.
  void bind_steps() {
    scope_ = StepScope<Policy>{&shape_, &config_, &policy_, buffer_.get(), backend_.get(), &stats_};
    host_step_.emplace(scope_);
    if (runtime_) device_step_.emplace(scope_, *runtime_);
  }
  DeviceStep<Policy>& device_step() {
    DeviceRuntime& runtime = device_runtime();
    if (!device_step_) device_step_.emplace(scope_, runtime);
    return *device_step_;
  }
  std::uint32_t table_slot(RequestId request) const {
    const std::size_t per_request = std::size_t{shape_.layers} * shape_.kv_heads;
    return static_cast<std::uint32_t>(buffer_->table().instance(request, 0, 0) / per_request);
  }

  ModelShape shape_;
  Config config_;
  Policy policy_;
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<TieredKVBuffer> buffer_;
  std::map<RequestId, RequestState> requests_;
  StepStats stats_;
  StepScope<Policy> scope_;
  std::optional<HostStep<Policy>> host_step_;
  std::vector<typename HostStep<Policy>::Entry> host_entries_;
  Api api_ = Api::unset;
  std::optional<bool> device_selects_;  // device_selects(), once asked
  std::unique_ptr<DeviceRuntime> runtime_;
  std::optional<DeviceStep<Policy>> device_step_;
  std::vector<typename DeviceStep<Policy>::Entry> device_entries_;
  std::vector<float> keys_, values_;  // a host prompt in fp32
  std::vector<float> extend_out_;     // extend()'s dropped outputs
  std::vector<std::byte> fork_k_, fork_v_;  // a fork's prompt read back, in the model dtype
  std::vector<std::byte> chunk_rows_;       // a prompt chunk's rows converted to the storage dtype
  StagedTensors staged_;              // the host-Select path's tensors
};

using RuntimeManager = Manager<AnyPolicy>;

}  // namespace sparsekv
