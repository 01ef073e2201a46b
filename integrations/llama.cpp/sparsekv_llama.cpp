#include "sparsekv_llama.hpp"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <utility>

#include "ggml-cpu.h"
#include "llama-ext.h"
#include "fmt/format.h"
#include "research/research_policies.hpp"
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

class StateWriter;

}  // namespace

struct Hook::State {
  llama_context* ctx = nullptr;
  HookOptions options;
  std::vector<std::int32_t> layers;         // hooked llama layers; the library's layer l is layers[l]
  std::unique_ptr<RuntimeManager> manager;  // made at the first op, when the shape is known
  std::map<llama_seq_id, Sequence> sequences;
  RequestId next_request = 1;
  ModelShape shape;             // the library's: one layer per hooked layer
  float llama_kq_scale = 0.0f;  // every hooked layer's; Config::attention_scale follows from it
  std::uint32_t max_tokens = 0;
  ErrorSlot failure;  // an op's: stops the graph (hook_abort) until cleared
  ErrorSlot refusal;  // a memory call's or a load's: reported, stops nothing
  SpinBarrier barrier;
  std::atomic<bool> stepping{false};  // this op's decode rows go through a library step
  std::optional<DecodePhases<AnyPolicy>> step;
  PromptAttention prompts;  // this op's prompt rows
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
    if (it == layers.end())
      fail(ErrorCode::failed_precondition, "layer {} was not hooked when the library was made", il);
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
    AnyPolicy policy =
        options.custom_policy ? *options.custom_policy : make_policy(options.policy, options.budget_tokens);
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
  std::uint32_t tokens_held(RequestId id, std::uint32_t layer) const { return manager->held_tokens(id, layer); }

  // n rows of `width` floats from `from` into `to` in the model dtype.
  void narrow(const float* from, std::size_t n, std::vector<std::byte>& to) const {
    to.resize(n * dtype_size(options.dtype));
    switch (options.dtype) {
      case DType::f32:
        std::memcpy(to.data(), from, n * sizeof(float));
        return;
      case DType::f16:
        ggml_cpu_fp32_to_fp16(from, reinterpret_cast<ggml_fp16_t*>(to.data()), std::int64_t(n));
        return;
      case DType::bf16:
        ggml_cpu_fp32_to_bf16(from, reinterpret_cast<ggml_bf16_t*>(to.data()), std::int64_t(n));
        return;
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

  // Thread 0, inside a catch block: the op's failure stops the graph
  // (hook_abort) and refuses the ubatch's sequences until they restart.
  void fail_op(const llama_attn_hook_call& c) noexcept {
    failure.capture();
    mark_broken(c);
    try {
      why = failure.error()->message;
    } catch (...) {
      why.clear();
    }
  }
  void new_ubatch() noexcept {
    if (failure.failed()) {
      last_failure = failure.error();
      failure.clear();
    }
    why.clear();
  }

  void mark_broken(const llama_attn_hook_call& c) {
    for (std::int32_t i = 0; i < c.n_tokens; ++i) {
      if (const auto it = sequences.find(c.seq[i]); it != sequences.end()) it->second.broken = true;
    }
  }

  // ---- Memory calls (llama_attn_hook::memory), followed before llama.cpp's memory acts ----
  // Each throws, changing nothing, what the library cannot follow.
  std::uint64_t refusals = 0;  // memory calls and loads refused: the wrappers' results
  std::string why;             // the refusal or failure of the latest call or ubatch (llama_attn_hook::last_error)
  std::optional<ErrorRecord> last_failure;  // an earlier ubatch's, until clear_failure()

  const char* refuse_current() noexcept {
    refusal.clear();
    refusal.capture();
    ++refusals;
    try {
      why = refusal.error()->message;
    } catch (...) {
      return "sparsekv: refused (no memory for the reason)";
    }
    return why.c_str();
  }

  void follow(const llama_attn_hook_memory_call& c) {
    switch (c.op) {
      case LLAMA_ATTN_HOOK_MEMORY_CLEAR:
        finish_all();
        return;
      case LLAMA_ATTN_HOOK_MEMORY_SEQ_RM:
        follow_seq_rm(c.seq, c.p0, c.p1);
        return;
      case LLAMA_ATTN_HOOK_MEMORY_SEQ_CP:
        follow_seq_cp(c.seq, c.dest, c.p0, c.p1);
        return;
      case LLAMA_ATTN_HOOK_MEMORY_SEQ_KEEP:
        follow_seq_keep(c.seq);
        return;
      case LLAMA_ATTN_HOOK_MEMORY_SEQ_ADD:
        if (c.delta != 0 && holds_any(c.seq)) {
          fail(ErrorCode::failed_precondition,
               "seq_add: sparsekv does not follow a position shift (context shift); its pages hold the tokens' "
               "RoPE'd keys");
        }
        return;
      case LLAMA_ATTN_HOOK_MEMORY_SEQ_DIV:
        if (c.d != 1 && holds_any(c.seq)) {
          fail(ErrorCode::failed_precondition, "seq_div: sparsekv does not follow a position division (self-extend)");
        }
        return;
    }
    fail(ErrorCode::invalid_argument, "memory call {} is not one sparsekv knows", int(c.op));
  }
  bool holds_any(llama_seq_id seq) const { return seq < 0 ? !sequences.empty() : sequences.contains(seq); }
  void finish_all() {
    for (const auto& [seq, sequence] : sequences) manager->finish(sequence.request);
    sequences.clear();
  }
  void follow_seq_rm(llama_seq_id seq, llama_pos p0, llama_pos p1) {
    if (seq < 0) {  // llama.cpp: every sequence
      if (p0 > 0 || p1 >= 0)
        fail(ErrorCode::invalid_argument, "seq_rm: sparsekv follows removing every sequence whole only");
      finish_all();
      return;
    }
    const auto it = sequences.find(seq);
    if (it == sequences.end()) return;
    const RequestId id = it->second.request;
    if (p0 <= 0 && p1 < 0) {
      manager->finish(id);
      sequences.erase(it);
      return;
    }
    if (p1 >= 0 || it->second.broken) {
      fail(ErrorCode::invalid_argument,
           "seq_rm: sparsekv follows the removal of a whole sequence or of its tail, not of a middle range");
    }
    // Keep the first p0 tokens: they become a new request forked from the old one.
    const std::uint32_t keep = std::uint32_t(p0);
    if (keep >= tokens_held(id, 0)) return;
    manager->end_prompt(id);  // a staged prompt is indexed, then forked like any other
    for (std::uint32_t l = 0; l < layers.size(); ++l) {
      if (manager->readable_tokens(id, l) < keep) {
        fail(ErrorCode::failed_precondition,
             "seq_rm: sparsekv keeps the first tokens of a sequence only where every layer holds them in order in "
             "the CPU tier (not tokens a policy regrouped or evicted)");
      }
    }
    const RequestId fresh = next_request;
    manager->fork(fresh, id, keep, max_tokens);
    ++next_request;
    manager->finish(id);
    it->second.request = fresh;
  }
  void follow_seq_cp(llama_seq_id source, llama_seq_id dest, llama_pos p0, llama_pos p1) {
    if (source == dest) return;
    const auto it = sequences.find(source);
    if (it == sequences.end()) {
      if (llama_memory_seq_pos_max(llama_get_memory(ctx), source) < 0) return;  // nothing to copy
      fail(ErrorCode::not_found, "seq_cp: sparsekv holds nothing of source sequence {}", source);
    }
    if (p0 > 0 || p1 >= 0 || sequences.contains(dest) || it->second.broken) {
      fail(ErrorCode::invalid_argument, "seq_cp: sparsekv copies a whole sequence into an empty one only");
    }
    const RequestId id = it->second.request;
    const std::uint32_t held = tokens_held(id, 0);
    const RequestId fresh = next_request;
    manager->end_prompt(id);
    manager->fork(fresh, id, held, max_tokens);
    ++next_request;
    sequences.emplace(dest, Sequence{fresh, false});
  }
  void follow_seq_keep(llama_seq_id seq) {
    for (auto it = sequences.begin(); it != sequences.end();) {
      if (it->first == seq) {
        ++it;
        continue;
      }
      manager->finish(it->second.request);
      it = sequences.erase(it);
    }
  }

  // ---- A sequence's K/V as a snapshot (save_sequence, load_sequence, llama_state_*) ----
  std::uint32_t readable(llama_seq_id seq) const {
    const auto it = sequences.find(seq);
    if (it == sequences.end()) return 0;
    std::uint32_t n = tokens_held(it->second.request, 0);
    for (std::uint32_t l = 0; l < shape.layers; ++l) n = std::min(n, manager->readable_tokens(it->second.request, l));
    return n;
  }
  // The first `tokens` positions of every hooked layer, as stored (q8_0
  // included): a load gives back the same bytes.
  SequenceSnapshot snapshot(llama_seq_id seq, std::uint32_t tokens) const {
    const RequestId id = sequences.at(seq).request;
    const DType stored = *options.kv_storage;
    SequenceSnapshot out{layers, shape.q_heads, shape.kv_heads, shape.head_dim, llama_kq_scale, stored, tokens, {}, {}};
    const std::size_t bytes = std::size_t{tokens} * shape.kv_heads * dtype_row_bytes(stored, shape.head_dim);
    for (std::uint32_t l = 0; l < shape.layers; ++l) {
      out.k.emplace_back(bytes);
      out.v.emplace_back(bytes);
      manager->read_kv(id, l, 0, tokens, out.k.back().data(), out.v.back().data(), stored);
    }
    return out;
  }
  // snapshot(seq, tokens) into a state stream, one layer's K/V at a time
  // through a reused buffer; a size-only save reads none of them.
  void write_sequence(StateWriter& w, llama_seq_id seq, std::uint32_t tokens);
  std::vector<std::byte> state_k, state_v;  // write_sequence's layer

  // Stages the snapshot as sequence seq's prompt (the hook must not hold
  // seq). Throws, changing nothing, when it does not fit.
  void load(llama_seq_id seq, const SequenceSnapshot& snapshot) {
    if (seq < 0) fail(ErrorCode::invalid_argument, "load_sequence: sequence {} is not a sequence id", seq);
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
    const DType stored = *options.kv_storage;
    if (snapshot.dtype != options.dtype && snapshot.dtype != stored) {
      fail(ErrorCode::invalid_argument, "load_sequence: the snapshot holds {} K/V, the hook takes {} and stores {}",
           to_string(snapshot.dtype), to_string(options.dtype), to_string(stored));
    }
    if (snapshot.tokens > llama_n_ctx_seq(ctx)) {
      fail(ErrorCode::invalid_argument, "load_sequence: {} tokens exceed the context's {} per sequence",
           snapshot.tokens, llama_n_ctx_seq(ctx));
    }
    const llama_pos last = llama_memory_seq_pos_max(llama_get_memory(ctx), seq);
    if (last != llama_pos(snapshot.tokens) - 1) {
      fail(ErrorCode::failed_precondition,
           "load_sequence: llama.cpp's cache holds sequence {} up to position {}, the snapshot {} tokens (load "
           "llama.cpp's state of the same sequence first)",
           seq, last, snapshot.tokens);
    }
    std::vector<std::int32_t> sorted = snapshot.layers;
    std::sort(sorted.begin(), sorted.end());
    if (sorted != snapshot.layers || (!layers.empty() && layers != sorted)) {
      fail(ErrorCode::invalid_argument, "load_sequence: the snapshot's hooked layers are not this context's");
    }
    // Made from the snapshot when no op has run yet (its layers then become
    // the hooked ones), else checked against it; a refusal restores the layers.
    const std::vector<std::int32_t> before = std::exchange(layers, sorted);
    RuntimeManager* made = nullptr;
    try {
      made = &ensure_manager(sorted.front(), snapshot.q_heads, snapshot.kv_heads, snapshot.head_dim, snapshot.kq_scale);
    } catch (...) {
      layers = before;
      throw;
    }
    RuntimeManager& m = *made;
    const RequestId id = next_request;
    m.add_request(id, max_tokens);
    try {
      for (std::uint32_t l = 0; l < shape.layers; ++l) {
        m.prefill_chunk(id, l, snapshot.k[l].data(), snapshot.v[l].data(), snapshot.tokens, snapshot.dtype);
      }
    } catch (...) {
      m.finish(id);
      throw;
    }
    ++next_request;
    sequences.emplace(seq, Sequence{id, false});
  }
  const char* state_write(const llama_attn_hook_io& io, llama_seq_id seq) noexcept;
  const char* state_read(const llama_attn_hook_io& io, llama_seq_id seq) noexcept;

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
             "layer {} row {}: the rows of sequence {} are not adjacent at consecutive positions in the ubatch", c.il,
             i, c.seq[i]);
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
    step = m.begin_decode(batch, layer, q.data(), k.data(), v.data(), out.data());
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
  // A ubatch's first hooked layer: the previous ubatch's failure stopped that
  // ubatch alone (its sequences stay refused); it is kept for failure().
  if (ith == 0 && call->il == s.layers.front()) s.new_ubatch();
  const auto serial = [&](auto&& work) {
    if (ith == 0 && !s.failure.failed()) {
      try {
        work();
      } catch (...) {
        s.fail_op(*call);
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
      s.fail_op(*call);
    }
  }
}

bool hook_abort(void* user) { return state_of(user).failure.failed(); }

void hook_attach(void* user, llama_context* ctx) { state_of(user).ctx = ctx; }

void hook_free(void* user) { delete &state_of(user); }

const char* hook_last_error(void* user) {
  const Hook::State& s = state_of(user);
  return s.why.empty() ? nullptr : s.why.c_str();
}

const char* hook_memory(void* user, const llama_attn_hook_memory_call* call) {
  Hook::State& s = state_of(user);
  s.why.clear();
  try {
    s.follow(*call);
    return nullptr;
  } catch (...) {
    return s.refuse_current();
  }
}

// ---- A sequence's K/V in llama.cpp's state stream ---------------------------
// A snapshot: magic, layers, heads, head size, scale, dtype, tokens, then each
// layer's K and V bytes; a whole-context state holds a count, then each
// sequence's id and snapshot.
constexpr std::uint32_t kSnapshotMagic = 0x736b7631;  // "skv1"

class StateWriter {
 public:
  explicit StateWriter(const llama_attn_hook_io& io) : io_(io) {}
  template <class T>
  void put(const T& value) {
    bytes(&value, sizeof(T));
  }
  void bytes(const void* src, std::size_t n) { io_.write(io_.io, src, n); }
  // A save that only counts its bytes (llama_state_*_get_size): no K/V need be read for it.
  bool size_only() const { return io_.size_only; }

 private:
  const llama_attn_hook_io& io_;
};

class StateReader {
 public:
  explicit StateReader(const llama_attn_hook_io& io) : io_(io) {}
  template <class T>
  T get() {
    T value{};
    bytes(&value, sizeof(T));
    return value;
  }
  void bytes(void* dst, std::size_t n) { io_.read(io_.io, dst, n); }

 private:
  const llama_attn_hook_io& io_;
};

// A SequenceSnapshot's bytes up to its K/V (which follow, k then v per layer).
void write_snapshot_header(StateWriter& w, const SequenceSnapshot& snapshot) {
  w.put(kSnapshotMagic);
  w.put(std::uint32_t(snapshot.layers.size()));
  for (const std::int32_t il : snapshot.layers) w.put(il);
  w.put(snapshot.q_heads);
  w.put(snapshot.kv_heads);
  w.put(snapshot.head_dim);
  w.put(snapshot.kq_scale);
  w.put(std::uint32_t(snapshot.dtype));
  w.put(snapshot.tokens);
}

SequenceSnapshot read_snapshot(StateReader& r) {
  if (r.get<std::uint32_t>() != kSnapshotMagic) {
    fail(ErrorCode::invalid_argument,
         "state load: no sparsekv K/V where the state should hold them (a state saved "
         "without --sparse-attn?)");
  }
  SequenceSnapshot snapshot;
  const auto layers = r.get<std::uint32_t>();
  if (layers == 0 || layers > 4096) fail(ErrorCode::invalid_argument, "state load: {} hooked layers", layers);
  for (std::uint32_t l = 0; l < layers; ++l) snapshot.layers.push_back(r.get<std::int32_t>());
  snapshot.q_heads = r.get<std::uint32_t>();
  snapshot.kv_heads = r.get<std::uint32_t>();
  snapshot.head_dim = r.get<std::uint32_t>();
  snapshot.kq_scale = r.get<float>();
  const auto dtype = r.get<std::uint32_t>();
  if (dtype != std::uint32_t(DType::f16) && dtype != std::uint32_t(DType::f32) && dtype != std::uint32_t(DType::bf16) &&
      dtype != std::uint32_t(DType::q8_0)) {
    fail(ErrorCode::invalid_argument, "state load: unknown K/V dtype {}", dtype);
  }
  snapshot.dtype = DType(dtype);
  snapshot.tokens = r.get<std::uint32_t>();
  if (snapshot.head_dim == 0 || snapshot.kv_heads == 0 || snapshot.head_dim > 4096 || snapshot.kv_heads > 4096 ||
      snapshot.tokens > (1u << 24) || (snapshot.dtype == DType::q8_0 && snapshot.head_dim % kQ8BlockValues != 0)) {
    fail(ErrorCode::invalid_argument, "state load: a snapshot of {} tokens, {} kv heads of {}", snapshot.tokens,
         snapshot.kv_heads, snapshot.head_dim);
  }
  const std::size_t bytes =
      std::size_t{snapshot.tokens} * snapshot.kv_heads * dtype_row_bytes(snapshot.dtype, snapshot.head_dim);
  for (std::uint32_t l = 0; l < layers; ++l) {
    snapshot.k.emplace_back(bytes);
    snapshot.v.emplace_back(bytes);
    r.bytes(snapshot.k.back().data(), bytes);
    r.bytes(snapshot.v.back().data(), bytes);
  }
  return snapshot;
}

}  // namespace

void Hook::State::write_sequence(StateWriter& w, llama_seq_id seq, std::uint32_t tokens) {
  const DType stored = *options.kv_storage;
  write_snapshot_header(
      w,
      SequenceSnapshot{layers, shape.q_heads, shape.kv_heads, shape.head_dim, llama_kq_scale, stored, tokens, {}, {}});
  const std::size_t bytes = std::size_t{tokens} * shape.kv_heads * dtype_row_bytes(stored, shape.head_dim);
  if (!w.size_only()) {
    state_k.resize(bytes);
    state_v.resize(bytes);
  }
  for (std::uint32_t l = 0; l < shape.layers; ++l) {
    if (!w.size_only())
      manager->read_kv(sequences.at(seq).request, l, 0, tokens, state_k.data(), state_v.data(), stored);
    w.bytes(w.size_only() ? nullptr : state_k.data(), bytes);
    w.bytes(w.size_only() ? nullptr : state_v.data(), bytes);
  }
}

// The hook's part of a state save: a sequence's snapshot (every token
// llama.cpp holds of it: a save the library cannot make whole is refused), or
// every sequence's.
const char* Hook::State::state_write(const llama_attn_hook_io& io, llama_seq_id seq) noexcept {
  why.clear();
  try {
    StateWriter w(io);
    const auto save = [&](llama_seq_id id) {
      const llama_pos last = llama_memory_seq_pos_max(llama_get_memory(ctx), id);
      const std::uint32_t held = sequences.contains(id) ? tokens_held(sequences.at(id).request, 0) : 0;
      if (held != std::uint32_t(last + 1)) {
        fail(ErrorCode::failed_precondition, "state save of sequence {}: llama.cpp holds {} tokens, sparsekv {}", id,
             last + 1, held);
      }
      if (held == 0) {
        w.put(std::uint32_t{0});
        return;
      }
      if (readable(id) < held) {
        fail(ErrorCode::failed_precondition,
             "state save of sequence {}: sparsekv can read {} of its {} tokens in order (the policy regrouped or "
             "evicted tokens)",
             id, readable(id), held);
      }
      w.put(std::uint32_t{1});
      write_sequence(w, id, held);
    };
    if (seq >= 0) {
      save(seq);
      return nullptr;
    }
    w.put(std::uint32_t(sequences.size()));
    for (const auto& [id, sequence] : sequences) {
      w.put(std::int32_t(id));
      save(id);
    }
    return nullptr;
  } catch (...) {
    return refuse_current();
  }
}

// The hook's part of a state load, after llama.cpp's memory loaded its own:
// the sequence (or every one) the memory replaced is finished here too, then
// each snapshot is loaded as load_sequence does.
const char* Hook::State::state_read(const llama_attn_hook_io& io, llama_seq_id seq) noexcept {
  why.clear();
  try {
    StateReader r(io);
    const auto load_one = [&](llama_seq_id id) {
      if (r.get<std::uint32_t>() == 0) return;
      load(id, read_snapshot(r));
    };
    if (seq >= 0) {
      if (const auto it = sequences.find(seq); it != sequences.end()) {
        manager->finish(it->second.request);
        sequences.erase(it);
      }
      load_one(seq);
      return nullptr;
    }
    if (manager) finish_all();
    const auto count = r.get<std::uint32_t>();
    for (std::uint32_t i = 0; i < count; ++i) load_one(llama_seq_id(r.get<std::int32_t>()));
    return nullptr;
  } catch (...) {
    return refuse_current();
  }
}

namespace {

const char* hook_state_write(void* user, const llama_attn_hook_io* io, llama_seq_id seq) {
  return state_of(user).state_write(*io, seq);
}
const char* hook_state_read(void* user, const llama_attn_hook_io* io, llama_seq_id seq) {
  return state_of(user).state_read(*io, seq);
}

// Prometheus text: the library's counters since the context was made.
std::int32_t hook_metrics(void* user, char* buf, std::size_t size) {
  const Hook::State& s = state_of(user);
  const StepStats st = s.manager ? s.manager->stats() : StepStats{};
  const std::uint64_t row_bytes = s.manager ? dtype_row_bytes(*s.options.kv_storage, s.shape.head_dim) : 0;
  std::string text;
  const auto metric = [&](const char* name, const char* type, const char* help, double value) {
    text += fmt::format("# HELP sparsekv:{} {}\n# TYPE sparsekv:{} {}\nsparsekv:{}{{policy=\"{}\"}} {}\n", name, help,
                        name, type, name, s.options.policy, value);
  };
  metric("decode_rows_total", "counter", "Rows attended by a sparse decode step, summed over the hooked layers.",
         double(s.decode_count));
  metric("prompt_rows_total", "counter", "Prompt rows attended by the library's prompt attention.",
         double(s.prompt_count));
  metric("extend_rows_total", "counter", "Rows of multi-token continuations (one decode step each).",
         double(s.extend_count));
  metric("decode_steps_total", "counter", "(request, layer) decode steps.", double(st.decode_steps));
  metric("pages_selected_total", "counter", "Pages (one kv head each) the policy selected.", double(st.pages_selected));
  metric("bytes_attended_total", "counter", "K and V bytes of the selected tokens, as stored.",
         double(2 * st.tokens_selected * row_bytes));
  metric("sequences", "gauge", "Sequences the library holds.", double(s.sequences.size()));
  metric("refusals_total", "counter", "Memory calls and state loads the library refused.", double(s.refusals));
  if (buf != nullptr && size > 0) {
    const std::size_t n = std::min(text.size(), size - 1);
    std::memcpy(buf, text.data(), n);
    buf[n] = 0;
  }
  return std::int32_t(text.size());
}

// The library's storage for llama.cpp's cache types: q8_0 for q8_0 K and V,
// the hook's rows for f16 or f32; anything else is not served.
DType storage_of(const llama_context_params& params, DType rows) {
  if (params.type_k == GGML_TYPE_Q8_0 && params.type_v == GGML_TYPE_Q8_0) return DType::q8_0;
  const auto plain = [](ggml_type t) { return t == GGML_TYPE_F16 || t == GGML_TYPE_F32; };
  if (plain(params.type_k) && plain(params.type_v)) return rows;
  fail(ErrorCode::invalid_argument,
       "the library stores the hooked layers' K/V as f16, f32 or q8_0 (both -ctk and -ctv q8_0); cache types "
       "K {} and V {} are not served",
       ggml_type_name(params.type_k), ggml_type_name(params.type_v));
}

// A hook whose State the context owns (llama_attn_hook::free). Throws
// sparsekv::Error for options the library refuses.
llama_attn_hook make_hook(const llama_context_params& params, const HookOptions& options) {
  register_research_policies();  // --sparse-attn oracle, for evaluation
  if (!options.custom_policy) {
    make_policy(options.policy, options.budget_tokens);  // throws on an unknown policy before anything is made
  }
  if (options.page_tokens == 0 || (options.page_tokens & (options.page_tokens - 1)) != 0) {
    fail(ErrorCode::invalid_argument, "page_tokens ({}) must be a power of two", options.page_tokens);
  }
  auto state = std::make_unique<Hook::State>();
  state->options = options;
  if (!options.kv_storage) state->options.kv_storage = storage_of(params, options.dtype);
  llama_attn_hook hook{};
  hook.user = state.release();
  hook.layer = hook_layer;
  hook.attend = hook_attend;
  hook.attach = hook_attach;
  hook.free = hook_free;
  hook.abort = hook_abort;
  hook.memory = hook_memory;
  hook.state_write = hook_state_write;
  hook.state_read = hook_state_read;
  hook.metrics = hook_metrics;
  hook.last_error = hook_last_error;
  return hook;
}

}  // namespace

llama_attn_hook make_params_hook(const llama_context_params& params, const HookOptions& options) {
  return make_hook(params, options);
}

Hook::Hook(llama_model* model, const llama_context_params& params, const HookOptions& options) {
  if (model == nullptr) fail(ErrorCode::invalid_argument, "Hook: llama_model must not be null");
  const llama_attn_hook hook = make_hook(params, options);
  state_ = &state_of(hook.user);
  llama_context* ctx = llama_init_from_model_with_attn_hook(model, params, &hook);  // frees the State when it fails
  if (ctx == nullptr) {
    fail(ErrorCode::unavailable,
         "Hook: llama.cpp made no context with the attention hook (a model whose memory is not a plain or "
         "sliding-window KV cache? its log says why)");
  }
}

Hook::~Hook() { llama_free(state_->ctx); }

llama_context* Hook::context() const noexcept { return state_->ctx; }

// The memory calls go through llama.cpp, which asks the hook first
// (hook_memory); a refusal shows as a new entry in the State's count.
bool Hook::seq_rm(llama_seq_id seq, llama_pos p0, llama_pos p1) {
  const std::uint64_t before = state_->refusals;
  return llama_memory_seq_rm(llama_get_memory(state_->ctx), seq, p0, p1) && state_->refusals == before;
}
bool Hook::seq_cp(llama_seq_id source, llama_seq_id dest, llama_pos p0, llama_pos p1) {
  const std::uint64_t before = state_->refusals;
  llama_memory_seq_cp(llama_get_memory(state_->ctx), source, dest, p0, p1);
  return state_->refusals == before;
}
bool Hook::seq_keep(llama_seq_id seq) {
  const std::uint64_t before = state_->refusals;
  llama_memory_seq_keep(llama_get_memory(state_->ctx), seq);
  return state_->refusals == before;
}
bool Hook::seq_add(llama_seq_id seq, llama_pos p0, llama_pos p1, llama_pos delta) {
  const std::uint64_t before = state_->refusals;
  llama_memory_seq_add(llama_get_memory(state_->ctx), seq, p0, p1, delta);
  return state_->refusals == before;
}
bool Hook::seq_div(llama_seq_id seq, llama_pos p0, llama_pos p1, int d) {
  const std::uint64_t before = state_->refusals;
  llama_memory_seq_div(llama_get_memory(state_->ctx), seq, p0, p1, d);
  return state_->refusals == before;
}
void Hook::clear() { llama_memory_clear(llama_get_memory(state_->ctx), true); }

std::uint32_t Hook::readable_tokens(llama_seq_id seq) const { return state_->readable(seq); }

SequenceSnapshot Hook::save_sequence(llama_seq_id seq, std::optional<std::uint32_t> tokens) const {
  const State& s = *state_;
  const auto it = s.sequences.find(seq);
  if (it == s.sequences.end()) fail(ErrorCode::not_found, "save_sequence: the hook holds no sequence {}", seq);
  return s.snapshot(seq, tokens.value_or(s.tokens_held(it->second.request, 0)));
}

bool Hook::load_sequence(llama_seq_id seq, const SequenceSnapshot& snapshot) {
  State& s = *state_;
  try {
    if (s.sequences.contains(seq)) {
      fail(ErrorCode::failed_precondition, "load_sequence: the hook holds sequence {}; remove it (seq_rm) first", seq);
    }
    s.load(seq, snapshot);
    return true;
  } catch (...) {
    s.refuse_current();
    return false;
  }
}

std::optional<ErrorRecord> Hook::failure() const {
  if (std::optional<ErrorRecord> op = state_->failure.error()) return op;
  if (state_->last_failure) return state_->last_failure;
  return state_->refusal.error();
}
void Hook::clear_failure() {
  state_->failure.clear();
  state_->last_failure.reset();
  state_->refusal.clear();
  state_->why.clear();
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

// llama_init_from_model's hook for llama_context_params::sparse_attn (llama-ext.h).
bool llama_sparse_attn_make_hook(const llama_model* /*model*/, const llama_context_params* params,
                                 llama_attn_hook* hook, char* error, size_t error_size) {
  try {
    sparsekv::llama_cpp::HookOptions options;
    options.policy = params->sparse_attn;
    if (params->sparse_budget < 0 || params->sparse_page < 0) {
      sparsekv::fail(sparsekv::ErrorCode::invalid_argument, "budget ({}) and page ({}) must be >= 0",
                     params->sparse_budget, params->sparse_page);
    }
    if (params->sparse_budget > 0) options.budget_tokens = std::uint32_t(params->sparse_budget);
    if (params->sparse_page > 0) options.page_tokens = std::uint32_t(params->sparse_page);
    *hook = sparsekv::llama_cpp::make_params_hook(*params, options);
    return true;
  } catch (const std::exception& e) {
    if (error != nullptr && error_size > 0) std::snprintf(error, error_size, "%s", e.what());
    return false;
  }
}
