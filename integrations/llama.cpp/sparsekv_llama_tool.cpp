// sparsekv-llama: llama.cpp with its decode attention through sparsekv
// (docs/llama-cpp.md). Written against llama.h and the hook alone.
//
//   sparsekv-llama generate --model F (--prompt TEXT | --prompt-file F) [--tokens N] [--policy P]
//                           [--budget B] [--threads T] [--hook on|off] [--ctx N] [--flash-attn on|off]
//                           [--kv f16|f32|q8_0] [--json FILE]
//       greedy decoding: prints the text; on stderr the prompt rate, the first decode step (which indexes
//       the prompt through the hook), the decode rate over the steps after it, and the process's peak RSS.
//       --kv is llama.cpp's -ctk and -ctv at once: its cache type, and how the library stores K/V.
//   sparsekv-llama eval --model F --text F [--prefill N] [--tokens N] [--policies a,b] [--budgets 256,512]
//                       [--threads T] [--parallel P] [--page N] [--flash-attn on|off] [--kv f16,q8_0,...]
//                       [--json FILE]
//                       [--shared-prefill on|off] [--yardstick on|off]
//       teacher-forced decoding of the text: llama.cpp alone, Dense through the hook, then each policy x
//       budget: perplexity, KL divergence from llama.cpp's own distribution, top-1 agreement, tokens/s.
//       The prompt is prefilled once and loaded into every variant's context (llama.cpp's state, which
//       carries the library's K/V), unless --shared-prefill off. --yardstick on adds llama.cpp
//       alone with flash attention flipped: how far llama.cpp's own two attentions are apart. Several --kv
//       types run every variant each; a later type's runs are also compared with the first type's run of the
//       same variant (kld_vs_first: what storing K/V that way costs, llama.cpp's own cache included).
#include <sys/resource.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "command_line.hpp"
#include "llama.h"
#include "llama_eval.hpp"
#include "sparsekv/core/error.hpp"
#include "sparsekv_llama.hpp"

namespace {

using namespace sparsekv;
using namespace sparsekv::llama_cpp;

constexpr const char* kUsage =
    "usage: sparsekv-llama generate --model F (--prompt TEXT | --prompt-file F) [--tokens N] [--policy P]\n"
    "                               [--budget B] [--threads T] [--hook on|off] [--ctx N] [--flash-attn on|off]\n"
    "                               [--kv f16|f32|q8_0] [--json FILE]\n"
    "       sparsekv-llama eval --model F --text F [--prefill N] [--tokens N] [--policies a,b] [--budgets 256,512]\n"
    "                           [--threads T] [--parallel P] [--page N] [--flash-attn on|off] [--kv f16,q8_0]\n"
    "                           [--json FILE] [--shared-prefill on|off] [--yardstick on|off]\n";

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(ErrorCode::not_found, "cannot read {}", path);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

bool on_off(const tools::CommandLine& cli, const std::string& name, bool fallback) {
  const std::string v = cli.text(name, fallback ? "on" : "off");
  if (v != "on" && v != "off") fail(ErrorCode::invalid_argument, "{} takes on or off, got '{}'", name, v);
  return v == "on";
}

struct ModelDeleter {
  void operator()(llama_model* m) const { llama_model_free(m); }
};
struct ContextDeleter {
  void operator()(llama_context* c) const { llama_free(c); }
};

std::unique_ptr<llama_model, ModelDeleter> load_model(const std::string& path) {
  llama_model_params params = llama_model_default_params();
  std::unique_ptr<llama_model, ModelDeleter> model(llama_model_load_from_file(path.c_str(), params));
  if (!model) fail(ErrorCode::not_found, "cannot load the model {}", path);
  return model;
}

// A cache type of --kv: f16, f32 or q8_0.
DType kv_type(const std::string& name) {
  const DType kv = parse_dtype(name);
  if (kv == DType::bf16) fail(ErrorCode::invalid_argument, "--kv takes f16, f32 or q8_0, got '{}'", name);
  return kv;
}

int generate(const tools::CommandLine& cli) {
  const auto model = load_model(cli.text("--model", ""));
  const std::string prompt = cli.has("--prompt") ? cli.text("--prompt", "") : read_file(cli.text("--prompt-file", ""));
  const auto new_tokens = cli.number<std::uint32_t>("--tokens", 64);
  const bool hooked = on_off(cli, "--hook", true);
  std::vector<llama_token> tokens = tokenize(model.get(), prompt);
  llama_context_params params = llama_context_default_params();
  params.n_ctx = cli.number<std::uint32_t>("--ctx", std::uint32_t((tokens.size() + new_tokens + 255) / 256 * 256));
  params.n_batch = 512;
  params.n_ubatch = 512;
  params.n_threads = params.n_threads_batch = cli.number<std::int32_t>("--threads", 2);
  const bool flash_attn = on_off(cli, "--flash-attn", true);
  params.flash_attn_type = flash_attn ? LLAMA_FLASH_ATTN_TYPE_ENABLED : LLAMA_FLASH_ATTN_TYPE_DISABLED;
  params.no_perf = true;
  // llama.cpp's -ctk / -ctv for both: the hook stores K/V the same way (q8_0 included).
  const DType kv = kv_type(cli.text("--kv", "f16"));
  if (kv == DType::f32) params.type_k = params.type_v = GGML_TYPE_F32;
  if (kv == DType::q8_0) params.type_k = params.type_v = GGML_TYPE_Q8_0;
  HookOptions options;
  options.policy = cli.text("--policy", "quest");
  options.budget_tokens = cli.number<std::uint32_t>("--budget", 1024);
  options.dtype = kv == DType::f32 ? DType::f32 : DType::f16;
  std::unique_ptr<llama_context, ContextDeleter> own;
  std::optional<Hook> hook;
  if (hooked) {
    hook.emplace(model.get(), params, options);
  } else {
    own.reset(llama_init_from_model(model.get(), params));
    if (!own) fail(ErrorCode::internal, "llama_init_from_model failed");
  }
  llama_context* const ctx = hook ? hook->context() : own.get();
  const AttachedThreadpool pool(ctx, params.n_threads);
  const auto check = [&](std::int32_t rc) {
    if (rc == 0) return;
    if (hook && hook->failure()) fail(hook->failure()->code, "llama_decode: {}", hook->failure()->message);
    fail(ErrorCode::internal, "llama_decode returned {}", rc);
  };
  fmt::print(stderr, "sparsekv-llama: {} prompt tokens, decode attention: {}\n", tokens.size(),
             hooked ? fmt::format("sparsekv {} at {} tokens", options.policy, options.budget_tokens)
                    : std::string("llama.cpp"));
  const auto t0 = std::chrono::steady_clock::now();
  for (std::size_t at = 0; at < tokens.size(); at += params.n_batch) {
    const auto n = std::int32_t(std::min<std::size_t>(params.n_batch, tokens.size() - at));
    check(llama_decode(ctx, llama_batch_get_one(tokens.data() + at, n)));
  }
  const auto t1 = std::chrono::steady_clock::now();
  const llama_vocab* vocab = llama_model_get_vocab(model.get());
  const std::int32_t n_vocab = llama_vocab_n_tokens(vocab);
  std::uint32_t produced = 0;
  auto first_step_end = t1;
  for (; produced < new_tokens; ++produced) {
    if (produced == 1) first_step_end = std::chrono::steady_clock::now();
    const float* logits = llama_get_logits_ith(ctx, -1);
    llama_token next = 0;
    for (llama_token i = 1; i < n_vocab; ++i) next = logits[i] > logits[next] ? i : next;
    if (llama_vocab_is_eog(vocab, next)) break;
    char piece[256];
    const std::int32_t len = llama_token_to_piece(vocab, next, piece, sizeof piece, 0, false);
    if (len > 0) std::fwrite(piece, 1, std::size_t(len), stdout);
    std::fflush(stdout);
    check(llama_decode(ctx, llama_batch_get_one(&next, 1)));
  }
  const auto t2 = std::chrono::steady_clock::now();
  // The first step (the llama_decode after the prompt's last logits) also
  // indexes the prompt through the hook: timed apart from the steps after it.
  const double prefill_s = std::chrono::duration<double>(t1 - t0).count();
  const double first_s = std::chrono::duration<double>(first_step_end - t1).count();
  const double decode_s = std::chrono::duration<double>(t2 - first_step_end).count();
  const double decode_rate = produced > 1 ? (produced - 1) / decode_s : 0.0;
  fmt::print("\n");
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  const double peak_mib = double(usage.ru_maxrss) / 1024.0;
  fmt::print(stderr,
             "sparsekv-llama: prompt {:.1f} tokens/s, first decode step {:.1f} ms, then {} tokens at {:.1f} "
             "tokens/s, peak RSS {:.0f} MiB\n",
             double(tokens.size()) / prefill_s, first_s * 1e3, produced > 0 ? produced - 1 : 0, decode_rate, peak_mib);
  if (cli.has("--json")) {
    std::ofstream out(cli.text("--json", ""));
    out << fmt::format(
        "{{\"prompt_tokens\": {}, \"hook\": {}, \"policy\": \"{}\", \"budget_tokens\": {}, \"kv\": \"{}\", "
        "\"flash_attn\": {}, "
        "\"threads\": {}, \"n_ctx\": {}, \"prompt_s\": {:.4f}, \"first_step_s\": {:.4f}, \"decode_tokens\": {}, "
        "\"decode_tokens_per_s\": {:.3f}, \"peak_rss_mib\": {:.1f}}}\n",
        tokens.size(), hooked, hooked ? options.policy : std::string("llama"), hooked ? options.budget_tokens : 0,
        to_string(kv), flash_attn, params.n_threads, params.n_ctx, prefill_s, first_s, produced > 0 ? produced - 1 : 0,
        decode_rate, peak_mib);
  }
  return 0;
}

std::vector<std::uint32_t> numbers(const std::vector<std::string>& items) {
  std::vector<std::uint32_t> out;
  for (const std::string& s : items) {
    std::size_t end = 0;
    const unsigned long v = std::stoul(s, &end);
    if (end != s.size() || v == 0) fail(ErrorCode::invalid_argument, "'{}' is not a positive number", s);
    out.push_back(std::uint32_t(v));
  }
  return out;
}

int eval(const tools::CommandLine& cli) {
  const auto model = load_model(cli.text("--model", ""));
  EvalSetup setup;
  setup.model = model.get();
  setup.prefill = cli.number<std::uint32_t>("--prefill", 1024);
  setup.tokens = cli.number<std::uint32_t>("--tokens", 64);
  setup.parallel = cli.number<std::uint32_t>("--parallel", 1);
  setup.threads = cli.number<std::int32_t>("--threads", 2);
  setup.page_tokens = cli.number<std::uint32_t>("--page", 16);
  setup.flash_attn = on_off(cli, "--flash-attn", true);
  // Each cache type runs every variant; the first type's llama.cpp run is the
  // reference, and a later type's run is compared with the first type's run
  // of the same variant too (kld_vs_first: what storing K/V that way costs).
  std::vector<DType> kvs;
  for (const std::string& kv : cli.list("--kv", "f16")) kvs.push_back(kv_type(kv));
  setup.text = tokenize(model.get(), read_file(cli.text("--text", "")));
  // A short text is read again from its start: a long context from any text.
  const std::size_t own = setup.text.size();
  while (setup.text.size() < eval_text_tokens(setup)) {
    setup.text.insert(setup.text.end(), setup.text.begin() + 1, setup.text.begin() + std::ptrdiff_t(own));
  }
  std::vector<EvalVariant> variants{{"llama", 0}, {"dense", setup.prefill + setup.tokens}};
  for (const std::string& p : cli.list("--policies", "quest,shadowkv")) {
    for (const std::uint32_t b : numbers(cli.list("--budgets", "256,1024"))) variants.push_back({p, b});
  }
  fmt::print("sparsekv-llama eval: {} prompt tokens x {} sequences, {} teacher-forced steps, {} threads\n",
             setup.prefill, setup.parallel, setup.tokens, setup.threads);
  fmt::print("{:<16} {:>5} {:>7} {:>11} {:>10} {:>7} {:>9} {:>12} {:>10}\n", "policy", "kv", "budget", "perplexity",
             "kld_mean", "top1", "tokens/s", "kld_vs_first", "top1_first");
  struct Row {
    EvalResult result;
    DType kv;
    std::optional<Agreement> vs_first;
  };
  Distributions reference;
  std::vector<Distributions> first_kv(variants.size());
  std::vector<Row> rows;
  std::vector<double> prefill_s;
  // --yardstick on: llama.cpp alone without flash attention too (its own
  // exact attention, rounded differently): how far llama.cpp is from itself.
  const bool yardstick = on_off(cli, "--yardstick", false);
  const auto show = [](const Row& row) {
    const EvalResult& r = row.result;
    fmt::print("{:<16} {:>5} {:>7} {:>11.4f} {:>10.2e} {:>7.3f} {:>9.1f} {:>12} {:>10}\n", r.policy, to_string(row.kv),
               r.budget_tokens == 0 ? std::string("-") : fmt::format("{}", r.budget_tokens), r.perplexity, r.kld_mean,
               r.top1_agreement, r.tokens_per_s,
               row.vs_first ? fmt::format("{:.2e}", row.vs_first->kld_mean) : std::string("-"),
               row.vs_first ? fmt::format("{:.3f}", row.vs_first->top1) : std::string("-"));
    std::fflush(stdout);
  };
  for (std::size_t k = 0; k < kvs.size(); ++k) {
    setup.kv = kvs[k];
    // One prefill for every variant of this cache type (--shared-prefill off: one each).
    std::optional<SavedPrompts> prompts;
    if (on_off(cli, "--shared-prefill", true)) {
      const auto t0 = std::chrono::steady_clock::now();
      prompts = prefill_prompts(setup);
      prefill_s.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      fmt::print("sparsekv-llama eval: {} prefilled once in {:.1f} s; every variant loads it\n", to_string(setup.kv),
                 prefill_s.back());
    }
    for (std::size_t i = 0; i < variants.size(); ++i) {
      const bool first = rows.empty();
      Distributions run;
      Row row{eval_variant(setup, prompts ? &*prompts : nullptr, variants[i], first ? nullptr : &reference, &run),
              setup.kv, std::nullopt};
      if (first) reference = run;
      if (k == 0) {
        first_kv[i] = std::move(run);
      } else {
        row.vs_first = agreement(first_kv[i], run);
      }
      rows.push_back(row);
      show(rows.back());
      if (first && yardstick) {
        EvalSetup flipped = setup;
        flipped.flash_attn = !setup.flash_attn;
        rows.push_back({eval_variant(flipped, nullptr, variants[i], &reference, nullptr), setup.kv, std::nullopt});
        rows.back().result.policy = setup.flash_attn ? "llama_no_fa" : "llama_fa";
        show(rows.back());
      }
    }
  }
  if (cli.has("--json")) {
    std::ofstream out(cli.text("--json", ""));
    out << fmt::format(
        "{{\"prefill\": {}, \"tokens\": {}, \"parallel\": {}, \"threads\": {}, "
        "\"shared_prefill_s\": [{}], \"results\": [",
        setup.prefill, setup.tokens, setup.parallel, setup.threads, fmt::join(prefill_s, ", "));
    for (std::size_t i = 0; i < rows.size(); ++i) {
      const EvalResult& r = rows[i].result;
      const auto& vs = rows[i].vs_first;
      out << fmt::format(
          "{}\n  {{\"policy\": \"{}\", \"kv\": \"{}\", \"budget_tokens\": {}, \"perplexity\": {:.6f}, "
          "\"kld_mean\": {:.6e}, \"top1_agreement\": {:.6f}, \"tokens_per_s\": {:.3f}, \"hook_rows\": {}, "
          "\"kld_vs_first_kv\": {}, \"top1_vs_first_kv\": {}}}",
          i == 0 ? "" : ",", r.policy, to_string(rows[i].kv), r.budget_tokens, r.perplexity, r.kld_mean,
          r.top1_agreement, r.tokens_per_s, r.hook_rows, vs ? fmt::format("{:.6e}", vs->kld_mean) : "null",
          vs ? fmt::format("{:.6f}", vs->top1) : "null");
    }
    out << "\n]}\n";
  }
  return 0;
}

void quiet_log(ggml_log_level level, const char* text, void*) {
  if (level >= GGML_LOG_LEVEL_ERROR) std::fputs(text, stderr);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fputs(kUsage, stderr);
    return 2;
  }
  const std::string command = argv[1];
  try {
    llama_log_set(quiet_log, nullptr);
    llama_backend_init();
    const tools::CommandLine cli(
        argc - 1, argv + 1,
        {"--model", "--prompt",     "--prompt-file", "--tokens",  "--policy",         "--budget",   "--threads",
         "--hook",  "--ctx",        "--text",        "--prefill", "--policies",       "--budgets",  "--parallel",
         "--page",  "--flash-attn", "--kv",          "--json",    "--shared-prefill", "--yardstick"},
        {});
    if (command == "generate") return generate(cli);
    if (command == "eval") return eval(cli);
    std::fputs(kUsage, stderr);
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "sparsekv-llama: %s\n", e.what());
    return 1;
  }
}
