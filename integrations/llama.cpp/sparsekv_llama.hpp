#pragma once
// sparsekv inside llama.cpp: the attention and the K/V of a llama_context's
// global layers served by a sparsekv Manager, on ggml's own threads
// (docs/llama-cpp.md). Needs the patched llama.cpp (attn-hook.patch:
// llama_init_from_model_with_attn_hook in llama-ext.h).
//
// The Hook makes the context: llama.cpp's KV cache leaves every layer the hook
// serves (every layer that is not sliding-window) out, so the library's CPU
// tier is the only copy of their K/V. Each ubatch's rows of a served layer:
//  - a sequence's prompt rows (any number of them, one chunk at a time) are
//    staged (Manager::prefill_chunk) and attended by the library's causal
//    prompt attention (PromptAttention) over the staged prompt; the prompt is
//    indexed whole at the sequence's first decode;
//  - a sequence's one next token after its prompt is a row of one library
//    decode step, whose rows are every such row of the ubatch (Select and
//    Attend split over ggml's threads with the op's (ith, nth));
//  - several tokens of a sequence that has decoded (a new chat turn, a draft)
//    are as many decode steps of that sequence (Manager::extend).
// A ubatch mixing them (one sequence's prompt beside others' decode tokens, as
// continuous batching makes) is served row by row in one node.
//
// llama.cpp's memory and state calls reach the library themselves (the
// patch: llama_attn_hook::memory / state_write / state_read), whoever makes
// them: llama_memory_seq_rm / seq_cp / seq_keep / clear are followed, and
// llama_state_* save and load the library's K/V with llama.cpp's cells.
//
// What the library cannot follow is refused, never silently wrong: a memory
// call it cannot follow fails as llama.cpp's would (seq_rm false, the other
// calls do nothing; both caches unchanged, the reason logged), a state save
// or load it cannot follow fails (0 bytes; a failed load leaves the sequence
// empty on both sides), and inside llama_decode a row whose position is not
// its sequence's next token (a state load of llama.cpp's cells alone), a
// token in several sequences, rows of one sequence not adjacent in a ubatch,
// a layer with attention sinks or a bias, a layer shaped differently from the
// first hooked one, a cache type other than f16, f32 or q8_0 for both K and V
// (HookOptions::kv_storage). A refusal inside llama_decode stops that
// ubatch's graph (the hook's abort is asked before the context's abort
// callback): llama_decode returns 2 and failure() says why. The sequences of
// a failed ubatch are then refused until they restart at position 0 (after a
// whole removal); the other sequences go on.
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "llama.h"
#include "llama-ext.h"
#include "sparsekv/core/dtype.hpp"
#include "sparsekv/core/error_slot.hpp"
#include "sparsekv/policy/any_policy.hpp"
#include "sparsekv/policy/policy_registry.hpp"
#include "sparsekv/step/step_stats.hpp"

namespace sparsekv::llama_cpp {

// A sequence's K/V as the library holds them, in its hooked layers: what goes
// beside llama_state_seq_get_data's bytes so that a saved sequence can be
// loaded again (a prompt cache; one prefill shared by several hooks).
struct SequenceSnapshot {
  std::vector<std::int32_t> layers;  // the hooked llama layers; k[l] / v[l] are layers[l]'s
  std::uint32_t q_heads = 0, kv_heads = 0, head_dim = 0;
  float kq_scale = 0;  // llama.cpp's, as the hook received it
  DType dtype = DType::f16;
  std::uint32_t tokens = 0;                  // positions 0 .. tokens-1
  std::vector<std::vector<std::byte>> k, v;  // [layer][tokens][kv_heads][head_dim], dtype (q8_0: blocks)
};

struct HookOptions {
  std::string policy = "quest";  // make_policy's names (sparsekv::policy_names, eviction_policy_names)
  std::uint32_t budget_tokens = 1024;
  // An engine's own policy (any SparseAttention type, examples/custom_policy.cpp)
  // served instead of `policy`, which then only names it (/metrics' label);
  // budget_tokens is then the policy's own business.
  std::optional<AnyPolicy> custom_policy;
  std::uint32_t page_tokens = 16;
  DType dtype = DType::f16;  // the rows the hook hands the library (llama.cpp's default cache type)
  // How the library stores them: the dtype above, or q8_0. Unset: from the
  // context's cache types, q8_0 for `-ctk q8_0 -ctv q8_0`, else `dtype`;
  // other quantized cache types are refused.
  std::optional<DType> kv_storage;
};

// The hook llama.cpp installs itself for llama_context_params::sparse_attn
// (llama_sparse_attn_make_hook): the context owns its State and frees it.
// Throws sparsekv::Error for options the library refuses.
llama_attn_hook make_params_hook(const llama_context_params& params, const HookOptions& options);

class Hook {
 public:
  // Makes the llama_context of `model` with `params`, its global layers served
  // by the library, and owns it. Throws sparsekv::Error: invalid_argument (an
  // unknown policy, a bad budget or page size), unavailable (llama.cpp made no
  // context: a model whose memory is not a plain or sliding-window KV cache,
  // or what its log says).
  Hook(llama_model* model, const llama_context_params& params, const HookOptions& options);
  // Frees the context.
  ~Hook();
  llama_context* context() const noexcept;
  Hook(const Hook&) = delete;
  Hook& operator=(const Hook&) = delete;

  // llama.cpp's memory operations: the llama_memory_* call, which the
  // library follows first (any program's call does the same); each returns
  // false, with failure() set, when the library refused it, and then nothing
  // changed in either cache.
  //  - seq_rm of a whole sequence (p0 <= 0, p1 < 0) finishes its request;
  //    keeping its first p0 tokens (p1 < 0) forks them into a new request when
  //    every layer holds them in order in the CPU tier (Manager::fork), else
  //    is refused; other ranges are refused.
  //  - seq_cp of a whole sequence into an empty one forks it (shared pages).
  //  - seq_keep finishes every other sequence; clear finishes all.
  //  - seq_add and seq_div (context shift, self-extend) of a sequence the
  //    library holds are refused; llama_memory_can_shift is false.
  bool seq_rm(llama_seq_id seq, llama_pos p0, llama_pos p1);
  bool seq_cp(llama_seq_id source, llama_seq_id dest, llama_pos p0, llama_pos p1);
  bool seq_keep(llama_seq_id seq);
  bool seq_add(llama_seq_id seq, llama_pos p0, llama_pos p1, llama_pos delta);
  bool seq_div(llama_seq_id seq, llama_pos p0, llama_pos p1, int d);
  void clear();

  // State save and load. llama_state_seq_* and llama_state_* carry the
  // library's K/V after llama.cpp's part (a SequenceSnapshot per sequence;
  // LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY leaves them out, as it leaves out
  // llama.cpp's full-attention layers). A save of a sequence the library
  // cannot read whole (readable_tokens) fails. A load replaces the sequence
  // and stages its K/V as a prompt, as if llama.cpp had just prefilled it: a
  // snapshot in q8_0 (what a q8_0 hook saves: the stored blocks) byte for
  // byte, one in the rows' dtype quantized as a prefill would.
  // The same, by hand, beside llama.cpp's state without the library's part:
  //  - save_sequence(seq): the first `tokens` positions (all of them by
  //    default) in every hooked layer. Readable are a prompt not yet decoded,
  //    and the tokens the CPU tier holds in order (readable_tokens;
  //    Manager::read_kv). Throws sparsekv::Error: not_found (a sequence the
  //    hook does not hold), out_of_range (more than readable).
  //  - load_sequence(seq, snapshot) after a partial llama_state_seq_set_data
  //    into an empty sequence: llama.cpp's cache must hold exactly positions
  //    0 .. tokens-1 of seq, and the snapshot's layers, shape and scale must
  //    be this context's. Returns false with failure() set and changes
  //    nothing when it cannot.
  // A load of llama.cpp's part alone is refused by llama_decode (the row's
  // position is not what the hook holds).
  std::uint32_t readable_tokens(llama_seq_id seq) const;
  SequenceSnapshot save_sequence(llama_seq_id seq, std::optional<std::uint32_t> tokens = std::nullopt) const;
  bool load_sequence(llama_seq_id seq, const SequenceSnapshot& snapshot);

  // Why a llama_decode returned 2, or else why a memory call or a load was
  // refused; empty otherwise, and again after clear_failure().
  std::optional<ErrorRecord> failure() const;
  void clear_failure();

  // The library's figures since the first decode: hits, pages moved, time per
  // operation (StepStats), and the rows and hooked layers served: rows summed
  // over the hooked layers, by the way they were attended.
  StepStats stats() const;
  std::uint64_t decode_rows() const;  // a sparse decode step's rows
  std::uint64_t prompt_rows() const;  // prompt attention
  std::uint64_t extend_rows() const;  // decode steps of several tokens of a sequence (Manager::extend)
  std::vector<std::int32_t> hooked_layers() const;
  // Tokens the library holds for `seq` in its first hooked layer (staged
  // prompt included); 0 for an unknown sequence.
  std::uint32_t tokens(llama_seq_id seq) const;

  struct State;  // the hook's callbacks reach it through llama_attn_hook::user

 private:
  State* state_ = nullptr;  // owned by the context (llama_attn_hook::free)
};

}  // namespace sparsekv::llama_cpp
