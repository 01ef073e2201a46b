#include "llama_eval.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <memory>
#include <optional>

#include "ggml-cpu.h"
#include "sparsekv/core/error.hpp"
#include "sparsekv_llama.hpp"

namespace sparsekv::llama_cpp {

namespace {

struct ContextDeleter {
  void operator()(llama_context* c) const { llama_free(c); }
};
struct BatchOwner {
  llama_batch batch;
  explicit BatchOwner(std::int32_t n) : batch(llama_batch_init(n, 0, 1)) {}
  ~BatchOwner() { llama_batch_free(batch); }
  void add(llama_token token, llama_pos pos, llama_seq_id seq, bool logits) {
    const std::int32_t i = batch.n_tokens++;
    batch.token[i] = token;
    batch.pos[i] = pos;
    batch.n_seq_id[i] = 1;
    batch.seq_id[i][0] = seq;
    batch.logits[i] = logits;
  }
};

void decode_or_throw(llama_context* ctx, const llama_batch& batch, const Hook* hook) {
  const std::int32_t rc = llama_decode(ctx, batch);
  if (rc == 0) return;
  if (hook != nullptr) {
    if (const auto f = hook->failure()) fail(f->code, "llama_decode returned {}: {}", rc, f->message);
  }
  fail(ErrorCode::internal, "llama_decode returned {}", rc);
}

void log_softmax(const float* logits, std::uint32_t n, float* out) {
  const float m = *std::max_element(logits, logits + n);
  double sum = 0;
  for (std::uint32_t i = 0; i < n; ++i) sum += std::exp(double(logits[i]) - m);
  const auto log_sum = static_cast<float>(std::log(sum));
  for (std::uint32_t i = 0; i < n; ++i) out[i] = logits[i] - m - log_sum;
}

}  // namespace

AttachedThreadpool::AttachedThreadpool(llama_context* ctx, std::int32_t threads) : ctx_(ctx) {
  ggml_threadpool_params params = ggml_threadpool_params_default(threads);
  pool_ = ggml_threadpool_new(&params);
  if (pool_ == nullptr) fail(ErrorCode::resource_exhausted, "ggml_threadpool_new failed for {} threads", threads);
  llama_attach_threadpool(ctx_, pool_, nullptr);
}

AttachedThreadpool::~AttachedThreadpool() {
  llama_detach_threadpool(ctx_);
  ggml_threadpool_free(pool_);
}

std::size_t eval_text_tokens(const EvalSetup& s) {
  return std::size_t{s.parallel} * s.tokens + s.prefill + s.tokens + 1;
}

std::vector<llama_token> tokenize(const llama_model* model, const std::string& text) {
  const llama_vocab* vocab = llama_model_get_vocab(model);
  std::vector<llama_token> tokens(text.size() + 8);
  std::int32_t n = llama_tokenize(vocab, text.data(), std::int32_t(text.size()), tokens.data(),
                                  std::int32_t(tokens.size()), true, false);
  if (n < 0) {
    tokens.resize(std::size_t(-n));
    n = llama_tokenize(vocab, text.data(), std::int32_t(text.size()), tokens.data(), std::int32_t(tokens.size()), true,
                       false);
  }
  if (n < 0) fail(ErrorCode::invalid_argument, "llama_tokenize failed ({})", n);
  tokens.resize(std::size_t(n));
  return tokens;
}

namespace {

void check_setup(const EvalSetup& s) {
  if (s.model == nullptr || s.prefill == 0 || s.tokens == 0 || s.parallel == 0) {
    fail(ErrorCode::invalid_argument, "eval: a model, prefill > 0, tokens > 0 and parallel > 0 are needed");
  }
  if (s.text.size() < eval_text_tokens(s)) {
    fail(ErrorCode::invalid_argument,
         "eval: the text has {} tokens; {} are needed ({} sequences x {} steps + {} + {} + 1)", s.text.size(),
         eval_text_tokens(s), s.parallel, s.tokens, s.prefill, s.tokens);
  }
}

using Context = std::unique_ptr<llama_context, ContextDeleter>;
constexpr std::uint32_t kBatch = 512;

llama_context_params context_params(const EvalSetup& s) {
  const std::uint32_t per_sequence = (s.prefill + s.tokens + 1 + 255) / 256 * 256;
  llama_context_params params = llama_context_default_params();
  params.n_ctx = per_sequence * s.parallel;
  params.n_batch = kBatch;
  params.n_ubatch = kBatch;
  params.n_seq_max = s.parallel;
  params.n_threads = s.threads;
  params.n_threads_batch = s.threads;
  params.flash_attn_type = s.flash_attn ? LLAMA_FLASH_ATTN_TYPE_ENABLED : LLAMA_FLASH_ATTN_TYPE_DISABLED;
  params.no_perf = true;
  if (s.kv == DType::f32) params.type_k = params.type_v = GGML_TYPE_F32;
  if (s.kv == DType::q8_0) params.type_k = params.type_v = GGML_TYPE_Q8_0;
  return params;
}

HookOptions hook_options(const EvalSetup& s, const std::string& policy, std::uint32_t budget) {
  HookOptions options;
  options.policy = policy;
  options.budget_tokens = budget;
  options.page_tokens = s.page_tokens;
  options.dtype = s.kv == DType::f32 ? DType::f32 : DType::f16;
  return options;
}

// A variant's context: llama.cpp's own, or one the hook makes and serves.
struct VariantContext {
  Context own;
  std::optional<Hook> hook;
  // `keep_rows`: the library stores the rows as handed over whatever the
  // cache type, so that a saved prompt holds them before any quantization.
  VariantContext(const EvalSetup& s, const std::string& policy, std::uint32_t budget, bool keep_rows = false) {
    if (policy == "llama") {
      own.reset(llama_init_from_model(s.model, context_params(s)));
      if (!own) fail(ErrorCode::internal, "llama_init_from_model failed");
    } else {
      HookOptions options = hook_options(s, policy, budget);
      if (keep_rows) options.kv_storage = options.dtype;
      hook.emplace(s.model, context_params(s), options);
    }
  }
  llama_context* get() const { return hook ? hook->context() : own.get(); }
};

// The prompts, one sequence at a time, in llama.cpp's batches.
void prefill(const EvalSetup& s, llama_context* ctx, const Hook* hook) {
  for (std::uint32_t j = 0; j < s.parallel; ++j) {
    const std::size_t start = std::size_t{j} * s.tokens;
    for (std::uint32_t at = 0; at < s.prefill; at += kBatch) {
      const std::uint32_t n = std::min(kBatch, s.prefill - at);
      BatchOwner b{std::int32_t(n)};
      for (std::uint32_t i = 0; i < n; ++i) {
        b.add(s.text[start + at + i], llama_pos(at + i), llama_seq_id(j), at + i + 1 == s.prefill);
      }
      decode_or_throw(ctx, b.batch, hook);
    }
  }
}

}  // namespace

SavedPrompts prefill_prompts(const EvalSetup& s) {
  check_setup(s);
  SavedPrompts saved;
  // Any policy's prompt is the same: staged and attended by the prompt
  // attention; its rows are saved unquantized, and a q8_0 variant that loads
  // them quantizes them as its own prefill would.
  for (const char* policy : {"llama", "dense"}) {
    const VariantContext variant_ctx(s, policy, 0, true);
    llama_context* const ctx = variant_ctx.get();
    const AttachedThreadpool pool(ctx, s.threads);
    const Hook* hook = variant_ctx.hook ? &*variant_ctx.hook : nullptr;
    prefill(s, ctx, hook);
    for (std::uint32_t j = 0; j < s.parallel; ++j) {
      std::vector<std::uint8_t>& bytes =
          (hook ? saved.hooked_state : saved.llama_state).emplace_back(llama_state_seq_get_size(ctx, j));
      if (llama_state_seq_get_data(ctx, bytes.data(), bytes.size(), j) != bytes.size()) {
        fail(ErrorCode::internal, "llama_state_seq_get_data of sequence {} failed", j);
      }
    }
  }
  return saved;
}

EvalResult eval_variant(const EvalSetup& s, const SavedPrompts* prompts, const EvalVariant& variant,
                        const Distributions* reference, Distributions* keep) {
  check_setup(s);
  if (prompts != nullptr && (prompts->llama_state.size() != s.parallel || prompts->hooked_state.size() != s.parallel)) {
    fail(ErrorCode::invalid_argument, "eval: the saved prompts hold {} sequences, the setup {}",
         prompts->llama_state.size(), s.parallel);
  }
  VariantContext variant_ctx(s, variant.policy, variant.budget_tokens);
  llama_context* const ctx = variant_ctx.get();
  const AttachedThreadpool pool(ctx, s.threads);
  std::optional<Hook>& hook = variant_ctx.hook;
  const Hook* h = hook ? &*hook : nullptr;
  if (prompts == nullptr) {
    prefill(s, ctx, h);
  } else {
    for (std::uint32_t j = 0; j < s.parallel; ++j) {
      const std::vector<std::uint8_t>& bytes = hook ? prompts->hooked_state[j] : prompts->llama_state[j];
      if (llama_state_seq_set_data(ctx, bytes.data(), bytes.size(), j) != bytes.size()) {
        if (hook && hook->failure()) fail(hook->failure()->code, "{}", hook->failure()->message);
        fail(ErrorCode::internal, "llama_state_seq_set_data of sequence {} failed", j);
      }
    }
  }

  const llama_vocab* vocab = llama_model_get_vocab(s.model);
  const auto n_vocab = static_cast<std::uint32_t>(llama_vocab_n_tokens(vocab));
  if (reference != nullptr && reference->vocab != n_vocab) {
    fail(ErrorCode::invalid_argument, "eval: the reference has {} tokens of vocabulary, the model {}", reference->vocab,
         n_vocab);
  }
  if (keep != nullptr) {
    keep->vocab = n_vocab;
    keep->log_probs.assign(std::size_t{s.tokens} * s.parallel * n_vocab, 0.0f);
  }
  std::vector<float> lp(n_vocab);
  double nll = 0, kld = 0, decode_s = 0;
  std::uint64_t agree = 0, timed_rows = 0;
  for (std::uint32_t t = 0; t < s.tokens; ++t) {
    BatchOwner b{std::int32_t(s.parallel)};
    for (std::uint32_t j = 0; j < s.parallel; ++j) {
      b.add(s.text[std::size_t{j} * s.tokens + s.prefill + t], llama_pos(s.prefill + t), llama_seq_id(j), true);
    }
    const auto t0 = std::chrono::steady_clock::now();
    decode_or_throw(ctx, b.batch, h);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (t > 0) {
      decode_s += seconds;
      timed_rows += s.parallel;
    }
    for (std::uint32_t j = 0; j < s.parallel; ++j) {
      log_softmax(llama_get_logits_ith(ctx, std::int32_t(j)), n_vocab, lp.data());
      const llama_token next = s.text[std::size_t{j} * s.tokens + s.prefill + t + 1];
      nll -= lp[std::size_t(next)];
      const std::size_t at = (std::size_t{t} * s.parallel + j) * n_vocab;
      if (keep != nullptr) std::copy(lp.begin(), lp.end(), keep->log_probs.begin() + std::ptrdiff_t(at));
      if (reference != nullptr) {
        const float* ref = reference->log_probs.data() + at;
        double k = 0;
        for (std::uint32_t i = 0; i < n_vocab; ++i) k += std::exp(double(ref[i])) * (double(ref[i]) - lp[i]);
        kld += k;
        agree += std::max_element(ref, ref + n_vocab) - ref == std::max_element(lp.begin(), lp.end()) - lp.begin();
      }
    }
  }
  const double n = double(s.tokens) * s.parallel;
  EvalResult r;
  r.policy = variant.policy;
  r.budget_tokens = variant.policy == "llama" ? 0 : variant.budget_tokens;
  r.perplexity = std::exp(nll / n);
  r.kld_mean = reference != nullptr ? kld / n : 0.0;
  r.top1_agreement = reference != nullptr ? double(agree) / n : 1.0;
  r.tokens_per_s = decode_s > 0 ? double(timed_rows) / decode_s : 0.0;
  r.hook_rows = hook ? hook->decode_rows() : 0;
  r.hook_prompt_rows = hook ? hook->prompt_rows() : 0;
  return r;
}

Agreement agreement(const Distributions& reference, const Distributions& run) {
  if (reference.vocab != run.vocab || reference.log_probs.size() != run.log_probs.size() || run.vocab == 0) {
    fail(ErrorCode::invalid_argument, "agreement: runs of {} and {} values over {} and {} tokens of vocabulary",
         reference.log_probs.size(), run.log_probs.size(), reference.vocab, run.vocab);
  }
  const std::size_t rows = run.log_probs.size() / run.vocab;
  double kld = 0;
  std::uint64_t agree = 0;
  for (std::size_t r = 0; r < rows; ++r) {
    const float* ref = reference.log_probs.data() + r * run.vocab;
    const float* lp = run.log_probs.data() + r * run.vocab;
    double k = 0;
    for (std::uint32_t i = 0; i < run.vocab; ++i) k += std::exp(double(ref[i])) * (double(ref[i]) - lp[i]);
    kld += k;
    agree += std::max_element(ref, ref + run.vocab) - ref == std::max_element(lp, lp + run.vocab) - lp;
  }
  return {rows == 0 ? 0.0 : kld / double(rows), rows == 0 ? 1.0 : double(agree) / double(rows)};
}

}  // namespace sparsekv::llama_cpp
