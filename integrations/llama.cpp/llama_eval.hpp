#pragma once
// Teacher-forced decoding of a text through llama.cpp, with or without the
// sparsekv hook: what `sparsekv-llama eval` reports and the integration test
// checks. Every variant gets a fresh llama_context of the same parameters;
// the prompt (the text's first `prefill` tokens of each sequence) is
// prefilled in that context (llama.cpp's attention with the hook off, the
// library's prompt attention through it) or prefilled once per kind and
// loaded (SavedPrompts: the same bytes, one prefill for a run of many
// variants); the `tokens` decode steps after it
// are one llama_decode each (one row per sequence), and each step's
// next-token distribution is compared with the hook-off run's.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "llama.h"
#include "sparsekv/core/dtype.hpp"
#include "sparsekv_llama.hpp"

namespace sparsekv::llama_cpp {

struct EvalSetup {
  llama_model* model = nullptr;
  std::vector<llama_token> text;
  std::uint32_t prefill = 1024;  // prompt tokens per sequence
  std::uint32_t tokens = 64;     // teacher-forced decode steps
  std::uint32_t parallel = 1;    // sequences decoded at once; sequence j starts j * tokens into the text
  std::int32_t threads = 2;
  bool flash_attn = true;
  // The K/V cache type: f16 (llama.cpp's default), f32 or q8_0, for
  // llama.cpp's cache (-ctk / -ctv) and the library's storage alike.
  DType kv = DType::f16;
  std::uint32_t page_tokens = 16;
};

struct EvalVariant {
  std::string policy = "llama";  // "llama": the hook off; else a sparsekv policy through the hook
  std::uint32_t budget_tokens = 0;
};

// Per decode step and sequence, the log-softmax of the next-token logits.
struct Distributions {
  std::uint32_t vocab = 0;
  std::vector<float> log_probs;  // [step][sequence][vocab]
};

struct EvalResult {
  std::string policy;
  std::uint32_t budget_tokens = 0;
  double perplexity = 0;        // exp(mean -log p(next text token)) over the decode steps
  double kld_mean = 0;          // mean KL(llama's own || this) per step and sequence; 0 for the reference
  double top1_agreement = 1;    // share of steps whose argmax is llama's own
  double tokens_per_s = 0;      // decode rows / llama_decode time, steps 2..tokens (the first indexes the prompt)
  std::uint64_t hook_rows = 0;  // decode rows the library attended in a sparse decode step (over the hooked layers)
  std::uint64_t hook_prompt_rows = 0;  // prompt rows the library attended (over the hooked layers)
};

// ggml's CPU thread pool attached to a context for the pool's life, as
// llama.cpp's own tools do (llama-bench, llama-cli): without one, ggml starts
// and joins its worker threads at every graph.
class AttachedThreadpool {
 public:
  AttachedThreadpool(llama_context* ctx, std::int32_t threads);
  ~AttachedThreadpool();
  AttachedThreadpool(const AttachedThreadpool&) = delete;
  AttachedThreadpool& operator=(const AttachedThreadpool&) = delete;

 private:
  llama_context* ctx_;
  ggml_threadpool* pool_;
};

// Every sequence's prompt, prefilled once with the hook off and once through
// it: llama.cpp's state of each sequence (llama_state_seq_get_data: every
// layer with the hook off; through it, the layers it does not serve and the
// library's K/V of those it does), to be loaded into each variant's context.
struct SavedPrompts {
  std::vector<std::vector<std::uint8_t>> llama_state;   // [sequence], the hook off
  std::vector<std::vector<std::uint8_t>> hooked_state;  // [sequence], through the hook
};
SavedPrompts prefill_prompts(const EvalSetup& setup);

// Tokens the text needs: parallel * tokens + prefill + tokens + 1.
std::size_t eval_text_tokens(const EvalSetup& setup);
// Runs one variant, its prompts loaded from `prompts` or, when null,
// prefilled in its own context. `reference` (the hook-off run) gives kld and top-1;
// `keep`, when given, receives this run's distributions. Throws
// sparsekv::Error: invalid_argument (a short text), or what llama_decode or
// the hook reported (its message).
EvalResult eval_variant(const EvalSetup& setup, const SavedPrompts* prompts, const EvalVariant& variant,
                        const Distributions* reference, Distributions* keep);

// Mean KL(reference || run) per step and sequence, and the share of them
// whose argmax agrees: two runs of the same text, steps and sequences.
struct Agreement {
  double kld_mean = 0;
  double top1 = 1;
};
Agreement agreement(const Distributions& reference, const Distributions& run);

// The text tokenized with the model's vocabulary (a BOS first where the model adds one).
std::vector<llama_token> tokenize(const llama_model* model, const std::string& text);

}  // namespace sparsekv::llama_cpp
