#include "sparsekv_llama.hpp"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <map>
#include <thread>
#include <utility>

#include "ggml-cpu.h"
#include "llama-ext.h"
#include "sparsekv/sparsekv.hpp"

namespace sparsekv::llama_cpp {

namespace {

// ggml's threads meet here between a decode step's phases. ggml runs every
// thread of its pool through a custom op with n_tasks = all, at once, so all
// nth arrive; they spin, as ggml's own barrier between nodes does.
class SpinBarrier {
 public:
  void wait(int nth) {
    if (nth <= 1) return;
    const unsigned generation = generation_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == nth) {
      arrived_.store(0, std::memory_order_relaxed);
      generation_.fetch_add(1, std::memory_order_release);
      return;
    }
    while (generation_.load(std::memory_order_acquire) == generation) {
#if defined(__x86_64__) || defined(__i386__)
      __builtin_ia32_pause();
#else
      std::this_thread::yield();
#endif
    }
  }

 private:
  std::atomic<int> arrived_{0};
  std::atomic<unsigned> generation_{0};
};

struct Sequence {
  RequestId request = 0;
  bool broken = false;  // a ubatch of it failed: refused until it restarts at position 0
};

}  // namespace

struct Hook::State {
  llama_context* ctx = nullptr;
  HookOptions options;
  std::vector<std::int32_t> layers;         // hooked llama layers; the library's layer l is layers[l]
  std::unique_ptr<RuntimeManager> manager;  // made at the first op, when the shape is known
  std::map<llama_seq_id, Sequence> sequences;
  RequestId next_request = 1;
  ModelShape shape;              // the library's: one layer per hooked layer
  float llama_kq_scale = 0.0f;  // every hooked layer's; Config::attention_scale follows from it
  std::uint32_t max_tokens = 0;
  ErrorSlot failure;  // an op's: stops the graph (hook_abort) until cleared
  ErrorSlot refusal;  // a memory call's or a load's: reported, stops nothing
  SpinBarrier barrier;
  std::atomic<bool> stepping{false};  // this op's decode rows go through a library step
  HostStep<AnyPolicy>* step = nullptr;
  PromptAttention prompts;            // this op's prompt rows
  std::vector<PromptChunk> chunks;
  std::uint64_t decode_count = 0, prompt_count = 0, extend_count = 0;
  // The op's tensors in the model dtype, its batch, and where each batch row came from.
  std::vector<std::byte> q, k, v;
  std::vector<float> out;
  std::vector<RequestId> batch;
  std::vector<std::int32_t> batch_rows;
  std::vector<float> gathered;  // rows gathered before narrow_rows
  // A sequence's prompt rows of this op: staged first, attended once every run is staged.
  struct PromptRows {
    RequestId request;
    std::int32_t row;
    std::uint32_t rows;
  };
  std::vector<PromptRows> prompt_runs;
  std::vector<llama_seq_id> seen;  // the sequences of this op, each in one run of adjacent rows

  std::uint32_t layer_of(std::int32_t il) const {
    const auto it = std::find(layers.begin(), layers.end(), il);
    if (it == layers.end()) fail(ErrorCode::failed_precondition, "layer {} was not hooked when the library was made", il);
    return static_cast<std::uint32_t>(it - layers.begin());
  }

  // The Manager, made at the first op (or a loaded sequence): heads and head
  // size come from the call, the requests and their context from the
  // llama_context.
  RuntimeManager& ensure_manager(const llama_attn_hook_call& c) {
    return ensure_manager(c.il, std::uint32_t(c.n_head), std::uint32_t(c.n_head_kv), std::uint32_t(c.n_embd_head),
                          c.kq_scale);
  }
  RuntimeManager& ensure_manager(std::int32_t il, std::uint32_t q_heads, std::uint32_t kv_heads, std::uint32_t head_dim,
                                 float kq_scale) {
    if (manager) {
      if (shape.q_heads != q_heads || shape.kv_heads != kv_heads || shape.head_dim != head_dim) {
        fail(ErrorCode::invalid_argument, "layer {}: {} q / {} kv heads of {} differ from the first hooked layer's", il,
             q_heads, kv_heads, head_dim);
      }
      if (kq_scale != llama_kq_scale) {
        fail(ErrorCode::invalid_argument, "layer {}: kq_scale {} differs from the first hooked layer's ({})", il,
             kq_scale, llama_kq_scale);
      }
      return *manager;
    }
    std::sort(layers.begin(), layers.end());
    shape = ModelShape{static_cast<std::uint32_t>(layers.size()), q_heads, kv_heads, head_dim, options.dtype};
    llama_kq_scale = kq_scale;
    AnyPolicy policy = make_policy(options.policy, options.budget_tokens);
    Config base;
    base.page_tokens = options.page_tokens;
    base.kv_storage = options.kv_storage;
    // 0 (the library's default) where llama.cpp's scale is 1/sqrt(head_dim).
    const float standard = 1.0f / std::sqrt(static_cast<float>(head_dim));
    base.attention_scale = std::abs(kq_scale - standard) <= 1e-6f * standard ? 0.0f : kq_scale;
    max_tokens = llama_n_ctx_seq(ctx);
    // One request more than llama.cpp's sequences: seq_rm keeps a sequence's
    // first tokens by forking them before the old request finishes.
    const Config config = serving_config(shape, policy, max_tokens, llama_n_seq_max(ctx) + 1, base);
    manager = std::make_unique<RuntimeManager>(shape, config, std::move(policy), std::make_unique<InPlaceBackend>());
    return *manager;
  }

  // The request of row i's sequence, checked: one sequence, not broken, and
  // the row at the position the library expects next in `layer` (a row at
  // position 0 restarts the sequence: llama.cpp holds nothing of it).
  RequestId request_of(const llama_attn_hook_call& c, std::int32_t i, std::uint32_t layer) {
    const llama_seq_id seq = c.seq[i];
    const llama_pos pos = c.pos[i];
    if (seq < 0) {
      fail(ErrorCode::invalid_argument, "layer {} row {}: a token in several sequences cannot be followed", c.il, i);
    }
    auto it = sequences.find(seq);
    if (pos == 0 && layer == 0) {
      if (it != sequences.end()) {
        manager->finish(it->second.request);
        sequences.erase(it);
      }
      const RequestId id = next_request++;
      manager->add_request(id, max_tokens);
      it = sequences.emplace(seq, Sequence{id, false}).first;
    }
    if (it == sequences.end()) {
      fail(ErrorCode::failed_precondition,
           "sequence {}: a row at position {}, but the library never saw the sequence start (was the hook set after "
           "its prompt?)",
           seq, pos);
    }
    if (it->second.broken) {
      fail(ErrorCode::failed_precondition,
           "sequence {} failed in an earlier ubatch; remove it (seq_rm) and start again from position 0", seq);
    }
    const std::uint32_t held = tokens_held(it->second.request, layer);
    if (std::uint32_t(pos) != held) {
      fail(ErrorCode::failed_precondition,
           "sequence {} layer {}: a row at position {}, but the library holds {} tokens (a context shift, "
           "seq_add/seq_div, a state load or a partial removal outside the hook is not followed)",
           seq, c.il, pos, held);
    }
    return it->second.request;
  }
  std::uint32_t tokens_held(RequestId id, std::uint32_t layer) const {
    return manager->prefilled(id, layer) ? manager->buffer().sequence_length(id, layer)
                                         : manager->staged_tokens(id, layer);
  }

  // n rows of `width` floats from `from` into `to` in the model dtype.
  void narrow(const float* from, std::size_t n, std::vector<std::byte>& to) const {
    to.resize(n * dtype_size(options.dtype));
    switch (options.dtype) {
      case DType::f32: std::memcpy(to.data(), from, n * sizeof(float)); return;
      case DType::f16: ggml_cpu_fp32_to_fp16(from, reinterpret_cast<ggml_fp16_t*>(to.data()), std::int64_t(n)); return;
      case DType::bf16: ggml_cpu_fp32_to_bf16(from, reinterpret_cast<ggml_bf16_t*>(to.data()), std::int64_t(n)); return;
    }
  }

  // The batch's rows of a [n_tokens][width] tensor in the model dtype; the
  // rows are gathered first only when some row left the batch.
  void narrow_rows(const float* from, std::size_t width, std::vector<std::byte>& to) {
    if (batch_rows.back() + 1 == std::int32_t(batch_rows.size())) {  // rows 0..n-1, in order
      narrow(from, batch_rows.size() * width, to);
      return;
    }
    gathered.resize(batch_rows.size() * width);
    for (std::size_t b = 0; b < batch_rows.size(); ++b) {
      std::copy_n(from + batch_rows[b] * width, width, gathered.data() + b * width);
    }
    narrow(gathered.data(), gathered.size(), to);
  }

  void mark_broken(const llama_attn_hook_call& c) {
    for (std::int32_t i = 0; i < c.n_tokens; ++i) {
      if (const auto it = sequences.find(c.seq[i]); it != sequences.end()) it->second.broken = true;
    }
  }

  // ---- One op: every row of a hooked layer's ubatch ------------------------
  // Thread 0: checks the rows, stages the prompt rows, runs the multi-token
  // continuations and begins the decode step; the threads then share Select,
  // Attend and the prompt attention. Rows of one sequence come as one run of
  // adjacent rows at consecutive positions:
  //  - a run of a sequence whose layer is not prefilled, except one row past
  //    position 0 after it: prompt rows, staged and attended causally;
  //  - one row otherwise: a row of the decode step (the first one indexes the
  //    staged prompt);
  //  - several rows of a prefilled sequence: decode steps of it (extend).
  void begin(const llama_attn_hook_call& c, std::int32_t nth) {
    if (!c.causal) {
      fail(ErrorCode::failed_precondition, "layer {}: non-causal attention (llama_set_causal_attn) is not served",
           c.il);
    }
    RuntimeManager& m = ensure_manager(c);
    const std::uint32_t layer = layer_of(c.il);
    const std::size_t qd = std::size_t(c.n_head) * c.n_embd_head, kvd = std::size_t(c.n_head_kv) * c.n_embd_head;
    batch.clear();
    batch_rows.clear();
    prompt_runs.clear();
    chunks.clear();
    seen.clear();
    for (std::int32_t i = 0; i < c.n_tokens;) {
      std::int32_t end = i + 1;
      while (end < c.n_tokens && c.seq[end] == c.seq[i] && c.pos[end] == c.pos[end - 1] + 1) ++end;
      if (std::find(seen.begin(), seen.end(), c.seq[i]) != seen.end()) {
        fail(ErrorCode::invalid_argument,
             "layer {} row {}: the rows of sequence {} are not adjacent at consecutive positions in the ubatch",
             c.il, i, c.seq[i]);
      }
      seen.push_back(c.seq[i]);
      const RequestId id = request_of(c, i, layer);
      const auto n = static_cast<std::uint32_t>(end - i);
      if (!m.prefilled(id, layer) && (n > 1 || c.pos[i] == 0)) {
        narrow(c.k + i * kvd, n * kvd, k);
        narrow(c.v + i * kvd, n * kvd, v);
        m.prefill_chunk(id, layer, k.data(), v.data(), n);
        prompt_runs.push_back({id, i, n});
      } else if (n == 1) {
        batch.push_back(id);
        batch_rows.push_back(i);
      } else {
        narrow(c.q + i * qd, n * qd, q);
        narrow(c.k + i * kvd, n * kvd, k);
        narrow(c.v + i * kvd, n * kvd, v);
        m.extend(id, layer, q.data(), k.data(), v.data(), n, c.out + i * qd);
        extend_count += n;
      }
      i = end;
    }
    // The staged prompts are in place: each run's chunk reads them.
    for (const PromptRows& r : prompt_runs) {
      chunks.push_back(m.prompt_chunk(r.request, layer, c.q + r.row * qd, r.rows, c.out + r.row * qd));
      prompt_count += r.rows;
    }
    if (!chunks.empty()) prompts.plan(m.prompt_attention_shape(), chunks, std::size_t(nth));
    if (batch.empty()) return;
    narrow_rows(c.q, qd, q);
    narrow_rows(c.k, kvd, k);
    narrow_rows(c.v, kvd, v);
    out.resize(batch.size() * qd);
    step = &m.begin_decode(batch, layer, q.data(), k.data(), v.data(), out.data());
    stepping.store(true, std::memory_order_relaxed);
  }
  void finish(const llama_attn_hook_call& c) {
    step->finish();
    const std::size_t qd = std::size_t(c.n_head) * c.n_embd_head;
    for (std::size_t b = 0; b < batch.size(); ++b) std::copy_n(out.data() + b * qd, qd, c.out + batch_rows[b] * qd);
    decode_count += batch.size();
  }
};

namespace {

Hook::State& state_of(void* user) { return *static_cast<Hook::State*>(user); }

// Asked for every layer that is not sliding-window while the context is made,
// and again at each graph build: the hook serves them all.
bool hook_layer(void* user, std::int32_t il) {
  Hook::State& s = state_of(user);
  if (std::find(s.layers.begin(), s.layers.end(), il) != s.layers.end()) return true;
  if (s.manager) return false;  // the library's layers are fixed once it is made
  s.layers.insert(std::upper_bound(s.layers.begin(), s.layers.end(), il), il);
  return true;
}

// Every thread runs it: begin (thread 0) | select (all) | commit (0) | attend
// and prompt attention (all) | finish (0). A failure stops the phases after
// it; the abort callback then stops the graph.
void hook_attend(void* user, const llama_attn_hook_call* call, std::int32_t ith, std::int32_t nth) {
  Hook::State& s = state_of(user);
  const auto serial = [&](auto&& work) {
    if (ith == 0 && !s.failure.failed()) {
      try {
        work();
      } catch (...) {
        s.failure.capture();
        s.mark_broken(*call);
      }
    }
    s.barrier.wait(nth);
  };
  serial([&] {
    s.stepping.store(false, std::memory_order_relaxed);
    s.begin(*call, nth);
  });
  if (s.failure.failed()) return;
  const bool stepping = s.stepping.load(std::memory_order_relaxed);
  if (stepping) {
    s.step->select(std::size_t(ith), std::size_t(nth));
    s.barrier.wait(nth);
    serial([&] { s.step->commit(); });
    if (s.failure.failed()) return;
    s.step->attend(std::size_t(ith), std::size_t(nth));
  }
  if (!s.chunks.empty()) s.prompts.run(std::size_t(ith), std::size_t(nth));
  if (!stepping) return;
  s.barrier.wait(nth);
  if (ith == 0) {
    try {
      s.finish(*call);
    } catch (...) {
      s.failure.capture();
      s.mark_broken(*call);
    }
  }
}

bool hook_abort(void* user) { return state_of(user).failure.failed(); }

// The library's storage for llama.cpp's cache types: q8_0 for q8_0 K and V,
// the hook's rows for f16 or f32; anything else is not served.
DType storage_of(const llama_context_params& params, DType rows) {
  if (params.type_k == GGML_TYPE_Q8_0 && params.type_v == GGML_TYPE_Q8_0) return DType::q8_0;
  const auto plain = [](ggml_type t) { return t == GGML_TYPE_F16 || t == GGML_TYPE_F32; };
  if (plain(params.type_k) && plain(params.type_v)) return rows;
  fail(ErrorCode::invalid_argument,
       "Hook: the library stores the hooked layers' K/V as f16, f32 or q8_0 (both -ctk and -ctv q8_0); cache types "
       "K {} and V {} are not served",
       ggml_type_name(params.type_k), ggml_type_name(params.type_v));
}

}  // namespace

Hook::Hook(llama_model* model, const llama_context_params& params, const HookOptions& options)
    : state_(std::make_unique<State>()) {
  if (model == nullptr) fail(ErrorCode::invalid_argument, "Hook: llama_model must not be null");
  make_policy(options.policy, options.budget_tokens);  // throws on an unknown policy before anything is made
  if (options.page_tokens == 0 || (options.page_tokens & (options.page_tokens - 1)) != 0) {
    fail(ErrorCode::invalid_argument, "Hook: page_tokens ({}) must be a power of two", options.page_tokens);
  }
  state_->options = options;
  if (!options.kv_storage) state_->options.kv_storage = storage_of(params, options.dtype);
  const llama_attn_hook hook{state_.get(), hook_layer, hook_attend};
  llama_context* ctx = llama_init_from_model_with_attn_hook(model, params, &hook);
  if (ctx == nullptr) {
    fail(ErrorCode::unavailable,
         "Hook: llama.cpp made no context with the attention hook (a model whose memory is not a plain or "
         "sliding-window KV cache? its log says why)");
  }
  state_->ctx = ctx;
  llama_set_abort_callback(ctx, hook_abort, state_.get());
}

Hook::~Hook() { llama_free(state_->ctx); }

llama_context* Hook::context() const noexcept { return state_->ctx; }

bool Hook::seq_rm(llama_seq_id seq, llama_pos p0, llama_pos p1) {
  State& s = *state_;
  llama_memory_t memory = llama_get_memory(s.ctx);
  if (seq < 0) {  // llama.cpp: every sequence
    if (p0 > 0 || p1 >= 0) {
      s.refusal.set(ErrorCode::invalid_argument, "seq_rm: sparsekv follows removing every sequence whole only");
      return false;
    }
    if (!llama_memory_seq_rm(memory, seq, p0, p1)) return false;
    for (const auto& [id, sequence] : s.sequences) s.manager->finish(sequence.request);
    s.sequences.clear();
    return true;
  }
  const auto it = s.sequences.find(seq);
  if (it == s.sequences.end() || !s.manager) return llama_memory_seq_rm(memory, seq, p0, p1);
  const RequestId id = it->second.request;
  if (p0 <= 0 && p1 < 0) {
    if (!llama_memory_seq_rm(memory, seq, p0, p1)) return false;
    s.manager->finish(id);
    s.sequences.erase(it);
    return true;
  }
  if (p1 >= 0 || it->second.broken) {
    s.refusal.set(ErrorCode::invalid_argument,
                  "seq_rm: sparsekv follows the removal of a whole sequence or of its tail, not of a middle range");
    return false;
  }
  // Keep the first p0 tokens: they become a new request forked from the old one.
  const std::uint32_t keep = std::uint32_t(p0);
  if (keep >= s.tokens_held(id, 0)) return llama_memory_seq_rm(memory, seq, p0, p1);
  try {
    s.manager->end_prompt(id);  // a staged prompt is indexed, then forked like any other
  } catch (...) {
    s.refusal.capture();
    return false;
  }
  for (std::uint32_t l = 0; l < s.layers.size(); ++l) {
    if (s.manager->buffer().forkable_tokens(id, l) < keep) {
      s.refusal.set(ErrorCode::failed_precondition,
                    "seq_rm: sparsekv keeps the first tokens of a sequence only where every layer holds them in "
                    "order in the CPU tier (not its last decode page while unsaved, nor tokens a policy regrouped "
                    "or evicted)");
      return false;
    }
  }
  const RequestId fresh = s.next_request;
  try {
    s.manager->fork(fresh, id, keep, s.max_tokens);
  } catch (...) {
    s.refusal.capture();
    return false;
  }
  if (!llama_memory_seq_rm(memory, seq, p0, p1)) {
    s.manager->finish(fresh);
    return false;
  }
  ++s.next_request;
  s.manager->finish(id);
  it->second.request = fresh;
  return true;
}

bool Hook::seq_cp(llama_seq_id source, llama_seq_id dest, llama_pos p0, llama_pos p1) {
  State& s = *state_;
  const auto it = s.sequences.find(source);
  if (it == s.sequences.end() || !s.manager) {
    s.refusal.set(ErrorCode::not_found, "seq_cp: sparsekv holds nothing of the source sequence");
    return false;
  }
  if (p0 > 0 || p1 >= 0 || s.sequences.contains(dest) || it->second.broken) {
    s.refusal.set(ErrorCode::invalid_argument, "seq_cp: sparsekv copies a whole sequence into an empty one only");
    return false;
  }
  const RequestId id = it->second.request;
  const std::uint32_t tokens = s.tokens_held(id, 0);
  const RequestId fresh = s.next_request;
  try {
    s.manager->end_prompt(id);
    s.manager->fork(fresh, id, tokens, s.max_tokens);
  } catch (...) {
    s.refusal.capture();
    return false;
  }
  ++s.next_request;
  s.sequences.emplace(dest, Sequence{fresh, false});
  llama_memory_seq_cp(llama_get_memory(s.ctx), source, dest, p0, p1);
  return true;
}

bool Hook::seq_keep(llama_seq_id seq) {
  State& s = *state_;
  for (auto it = s.sequences.begin(); it != s.sequences.end();) {
    if (it->first == seq) {
      ++it;
      continue;
    }
    s.manager->finish(it->second.request);
    it = s.sequences.erase(it);
  }
  llama_memory_seq_keep(llama_get_memory(s.ctx), seq);
  return true;
}

bool Hook::seq_add(llama_seq_id, llama_pos, llama_pos, llama_pos) {
  state_->refusal.set(ErrorCode::failed_precondition,
                      "seq_add: sparsekv does not follow a position shift (context shift); its pages hold the "
                      "tokens' RoPE'd keys");
  return false;
}

bool Hook::seq_div(llama_seq_id, llama_pos, llama_pos, int) {
  state_->refusal.set(ErrorCode::failed_precondition,
                      "seq_div: sparsekv does not follow a position division (self-extend)");
  return false;
}

void Hook::clear() {
  State& s = *state_;
  for (const auto& [seq, sequence] : s.sequences) s.manager->finish(sequence.request);
  s.sequences.clear();
  llama_memory_clear(llama_get_memory(s.ctx), true);
}

std::uint32_t Hook::readable_tokens(llama_seq_id seq) const {
  const State& s = *state_;
  const auto it = s.sequences.find(seq);
  if (it == s.sequences.end()) return 0;
  std::uint32_t readable = s.tokens_held(it->second.request, 0);
  for (std::uint32_t l = 0; l < s.shape.layers; ++l) {
    readable = std::min(readable, s.manager->readable_tokens(it->second.request, l));
  }
  return readable;
}

SequenceSnapshot Hook::save_sequence(llama_seq_id seq, std::optional<std::uint32_t> tokens) const {
  const State& s = *state_;
  const auto it = s.sequences.find(seq);
  if (it == s.sequences.end()) fail(ErrorCode::not_found, "save_sequence: the hook holds no sequence {}", seq);
  const RequestId id = it->second.request;
  // As stored (q8_0 included): a load gives back the same bytes.
  const DType stored = *s.options.kv_storage;
  SequenceSnapshot snapshot{s.layers, s.shape.q_heads, s.shape.kv_heads, s.shape.head_dim, s.llama_kq_scale,
                            stored, tokens.value_or(s.tokens_held(id, 0)), {}, {}};
  const std::size_t bytes =
      std::size_t{snapshot.tokens} * s.shape.kv_heads * dtype_row_bytes(stored, s.shape.head_dim);
  for (std::uint32_t l = 0; l < s.shape.layers; ++l) {
    snapshot.k.emplace_back(bytes);
    snapshot.v.emplace_back(bytes);
    s.manager->read_kv(id, l, 0, snapshot.tokens, snapshot.k.back().data(), snapshot.v.back().data(), stored);
  }
  return snapshot;
}

bool Hook::load_sequence(llama_seq_id seq, const SequenceSnapshot& snapshot) {
  State& s = *state_;
  try {
    if (seq < 0) fail(ErrorCode::invalid_argument, "load_sequence: sequence {} is not a sequence id", seq);
    if (s.sequences.contains(seq)) {
      fail(ErrorCode::failed_precondition, "load_sequence: the hook holds sequence {}; remove it (seq_rm) first", seq);
    }
    const std::size_t bytes =
        std::size_t{snapshot.tokens} * snapshot.kv_heads * dtype_row_bytes(snapshot.dtype, snapshot.head_dim);
    const auto holds = [&](const std::vector<std::vector<std::byte>>& rows) {
      return rows.size() == snapshot.layers.size() &&
             std::all_of(rows.begin(), rows.end(), [&](const auto& r) { return r.size() == bytes; });
    };
    const bool sized = holds(snapshot.k) && holds(snapshot.v);
    if (snapshot.tokens == 0 || snapshot.layers.empty() || !sized) {
      fail(ErrorCode::invalid_argument, "load_sequence: the snapshot's K/V do not hold {} tokens of {} layers",
           snapshot.tokens, snapshot.layers.size());
    }
    const DType stored = *s.options.kv_storage;
    if (snapshot.dtype != s.options.dtype && snapshot.dtype != stored) {
      fail(ErrorCode::invalid_argument, "load_sequence: the snapshot holds {} K/V, the hook takes {} and stores {}",
           to_string(snapshot.dtype), to_string(s.options.dtype), to_string(stored));
    }
    if (snapshot.tokens > llama_n_ctx_seq(s.ctx)) {
      fail(ErrorCode::invalid_argument, "load_sequence: {} tokens exceed the context's {} per sequence",
           snapshot.tokens, llama_n_ctx_seq(s.ctx));
    }
    const llama_pos last = llama_memory_seq_pos_max(llama_get_memory(s.ctx), seq);
    if (last != llama_pos(snapshot.tokens) - 1) {
      fail(ErrorCode::failed_precondition,
           "load_sequence: llama.cpp's cache holds sequence {} up to position {}, the snapshot {} tokens (load "
           "llama.cpp's state of the same sequence first)",
           seq, last, snapshot.tokens);
    }
    std::vector<std::int32_t> layers = snapshot.layers;
    std::sort(layers.begin(), layers.end());
    if (layers != snapshot.layers || (!s.layers.empty() && s.layers != layers)) {
      fail(ErrorCode::invalid_argument, "load_sequence: the snapshot's hooked layers are not this context's");
    }
    // Made from the snapshot when no op has run yet (its layers then become
    // the hooked ones), else checked against it; a refusal restores the layers.
    const std::vector<std::int32_t> before = std::exchange(s.layers, layers);
    RuntimeManager* made = nullptr;
    try {
      made = &s.ensure_manager(layers.front(), snapshot.q_heads, snapshot.kv_heads, snapshot.head_dim,
                               snapshot.kq_scale);
    } catch (...) {
      s.layers = before;
      throw;
    }
    RuntimeManager& m = *made;
    const RequestId id = s.next_request;
    m.add_request(id, s.max_tokens);
    try {
      for (std::uint32_t l = 0; l < s.shape.layers; ++l) {
        m.prefill_chunk(id, l, snapshot.k[l].data(), snapshot.v[l].data(), snapshot.tokens, snapshot.dtype);
      }
    } catch (...) {
      m.finish(id);
      throw;
    }
    ++s.next_request;
    s.sequences.emplace(seq, Sequence{id, false});
    return true;
  } catch (...) {
    s.refusal.capture();
    return false;
  }
}

std::optional<ErrorRecord> Hook::failure() const {
  const std::optional<ErrorRecord> op = state_->failure.error();
  return op ? op : state_->refusal.error();
}
void Hook::clear_failure() {
  state_->failure.clear();
  state_->refusal.clear();
}

StepStats Hook::stats() const { return state_->manager ? state_->manager->stats() : StepStats{}; }
std::uint64_t Hook::decode_rows() const { return state_->decode_count; }
std::uint64_t Hook::prompt_rows() const { return state_->prompt_count; }
std::uint64_t Hook::extend_rows() const { return state_->extend_count; }
std::vector<std::int32_t> Hook::hooked_layers() const { return state_->layers; }
std::uint32_t Hook::tokens(llama_seq_id seq) const {
  const auto it = state_->sequences.find(seq);
  return it == state_->sequences.end() ? 0 : state_->tokens_held(it->second.request, 0);
}

}  // namespace sparsekv::llama_cpp
