// sparsekv-passkey: a task measure on the real model, passkey retrieval.
// A random 5-digit number is hidden at a chosen depth of a long filler text
// (tools/passkey_prompt.hpp: the prompt of Mohtashami & Jaggi 2023) and
// SmolLM2-135M-Instruct is asked for it at the end. Per (depth, trial): one
// dense prefill of the prompt, then greedy decoding of --answer-tokens tokens
// for every row in lockstep (each row feeds its own argmax token): row 0 is
// Dense (the model's own exact KV cache), then one sparsekv facade session
// (make_manager + RuntimeManager) per policy and budget ("dense" once). A row
// succeeds when its answer holds the 5 digits.
//
// --rows-at-once N bounds memory: the prefill's K/V is computed once, and
// when there are more than N rows it is also kept and replayed into the later
// groups of N rows (the same K/V: the same results as one group).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "command_line.hpp"
#include "model/bpe_tokenizer.hpp"
#include "model/gguf.hpp"
#include "model/llama.hpp"
#include "model/model_files.hpp"
#include "passkey_prompt.hpp"
#include "research/research_policies.hpp"
#include "sparsekv/sparsekv.hpp"

namespace {

using namespace sparsekv::model;
namespace pk = sparsekv::tools::passkey;
using Clock = std::chrono::steady_clock;
constexpr const char* kProgram = "sparsekv-passkey";

void usage() {
  std::fputs(
      "usage: sparsekv-passkey [--model PATH] [--context 6144] [--depths 10,30,50,70,90] [--trials 1] [--seed 1]\n"
      "                        [--policies LIST] [--budgets 128,256,512,1024] [--answer-tokens 8]\n"
      "                        [--format raw|chat] [--rows-at-once N] [--show] [--json]\n"
      "  --model PATH        default: "
      "${SPARSEKV_MODEL_DIR:-$HOME/.cache/sparsekv/models}/SmolLM2-135M-Instruct.Q4_1.gguf\n"
      "  --context N         prompt tokens (the longest prompt of at most N tokens; the real length is reported)\n"
      "  --depths LIST       where the needle sits, % of the filler (0..100)\n"
      "  --trials N          prompts per depth, each with its own number (from --seed)\n"
      "  --policies LIST     default: every built-in (dense, streaming, quest, shadowkv, retroinfer,\n"
      "                      retroinfer_no_estimation, oracle); dense ignores the budget and runs once.\n"
      "                      Dense (the model's own KV cache) always runs, as row 0\n"
      "  --budgets LIST      tokens per kv head and step\n"
      "  --answer-tokens N   tokens decoded greedily per row\n"
      "  --format F          raw: plain completion of '... The pass key is' (default);\n"
      "                      chat: SmolLM2's chat template\n"
      "  --rows-at-once N    decode at most N rows together (memory); default: all\n"
      "  --show              print every row's answer\n"
      "  --json              one JSON object on stdout\n",
      stderr);
}

double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// The prompt's K/V of every layer, kept to be replayed into later rows.
class KvRecorder final : public AttentionBackend {
 public:
  explicit KvRecorder(std::uint32_t layers) : k_(layers), v_(layers), tokens_(layers, 0) {}
  void prefill(std::uint32_t layer, const float* k, const float* v, std::uint32_t tokens) override {
    const std::size_t n = std::size_t{tokens} * row_;
    k_[layer].assign(k, k + n);
    v_[layer].assign(v, v + n);
    tokens_[layer] = tokens;
  }
  void decode(std::uint32_t, const float*, const float*, const float*, float*) override {
    throw std::logic_error("KvRecorder does not decode");
  }
  void set_row(std::size_t floats_per_token) { row_ = floats_per_token; }
  void replay(AttentionBackend& to) const {
    for (std::uint32_t l = 0; l < k_.size(); ++l) to.prefill(l, k_[l].data(), v_[l].data(), tokens_[l]);
  }

 private:
  std::vector<std::vector<float>> k_, v_;
  std::vector<std::uint32_t> tokens_;
  std::size_t row_ = 0;
};

struct RowSpec {
  std::string policy;                    // "Dense" for the model's own cache
  std::uint32_t budget = 0;              // 0: everything
  std::vector<std::uint32_t> successes;  // per depth
  std::vector<std::string> answers;      // per (depth, trial), for --show
  std::string label() const {
    if (policy == "Dense") return "Dense (own KV cache)";
    return budget ? fmt::format("{} {}", policy, budget) : policy + " all";
  }
};

struct Live {
  std::unique_ptr<sparsekv::RuntimeManager> manager;
  std::unique_ptr<AttentionBackend> backend;
};

struct TrialInfo {
  std::uint32_t depth = 0, trial = 0;
  std::string passkey;
  std::size_t prompt_tokens = 0;
  std::uint32_t needle_token = 0;
  double prefill_s = 0, decode_s = 0, wall_s = 0;
};

std::string json_escape(const std::string& s) {
  std::string out;
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c < 0x20) {
      out += fmt::format("\\u{:04x}", c);
    } else {
      out += static_cast<char>(c);
    }
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  sparsekv::register_research_policies();
  try {
    const auto args = sparsekv::tools::parse_command_line<UserError>(
        argc, argv,
        std::set<std::string>{"--model", "--context", "--depths", "--trials", "--seed", "--policies", "--budgets",
                              "--answer-tokens", "--format", "--rows-at-once"},
        std::set<std::string>{"--json", "--show", "--help"});
    if (args.has("--help")) {
      usage();
      return 0;
    }
    std::uint32_t context = 0, trials = 0, answer_tokens = 0, rows_at_once = 0;
    std::uint64_t seed = 0;
    std::vector<std::uint32_t> depths, budgets;
    std::vector<std::string> policies;
    try {
      context = args.number<std::uint32_t>("--context", 6144);
      trials = args.number<std::uint32_t>("--trials", 1);
      seed = args.number<std::uint64_t>("--seed", 1);
      answer_tokens = args.number<std::uint32_t>("--answer-tokens", 8);
      rows_at_once = args.number<std::uint32_t>("--rows-at-once", 0);
      depths = args.number_list("--depths", "10,30,50,70,90");
      budgets = args.number_list("--budgets", "128,256,512,1024", 1);
      policies = args.has("--policies") ? args.list("--policies", "") : sparsekv::policy_names();
    } catch (const std::invalid_argument& e) {
      throw UserError(e.what());
    }
    if (context == 0 || trials == 0 || answer_tokens == 0) {
      throw UserError("--context, --trials and --answer-tokens must be > 0");
    }
    for (std::uint32_t d : depths) {
      if (d > 100) throw UserError(fmt::format("--depths: {} is not a percentage (0..100)", d));
    }
    const std::string format_name = args.text("--format", "raw");
    if (format_name != "raw" && format_name != "chat") {
      throw UserError(fmt::format("--format: '{}' is neither raw nor chat", format_name));
    }
    const pk::Format format = format_name == "chat" ? pk::Format::chat : pk::Format::raw;
    for (const std::string& p : policies) {
      try {
        sparsekv::make_policy(p, 1);  // an unknown name fails here, before the model loads
      } catch (const std::exception& e) {
        throw UserError(fmt::format("--policies: {}", e.what()));
      }
    }
    const bool json = args.has("--json"), show = args.has("--show");
    const std::string model_path = existing_model_path(args.text("--model", default_model_path().string()));

    std::vector<RowSpec> specs;
    specs.push_back(RowSpec{"Dense", 0});
    for (const std::string& p : policies) {
      if (p == "dense") {
        specs.push_back(RowSpec{p, 0});
        continue;
      }
      for (std::uint32_t b : budgets) specs.push_back(RowSpec{p, b});
    }
    for (RowSpec& s : specs) s.successes.assign(depths.size(), 0);
    const std::size_t R = specs.size();
    const std::size_t group = rows_at_once == 0 ? R : std::min<std::size_t>(rows_at_once, R);

    const auto t_load = Clock::now();
    const GgufFile file = GgufFile::open(model_path);
    const BpeTokenizer tokenizer(file);
    const LlamaModel model(file);
    const LlamaConfig& c = model.config();
    const double load_s = since(t_load);
    if (c.context != 0 && context + answer_tokens > c.context) {
      throw UserError(fmt::format("--context {} + --answer-tokens {} exceed the model's {}-token context", context,
                                  answer_tokens, c.context));
    }
    const std::size_t V = c.vocab;
    const std::int32_t eos = tokenizer.eos();

    if (!json) {
      fmt::print("{}: SmolLM2-135M-Instruct loaded in {:.1f} s ({} threads; training context {})\n", kProgram, load_s,
                 model.threads(), c.context);
      fmt::print(
          "  context {} tokens, {} format, depths {}%, {} trial(s) each, {} answer tokens; {} rows ({} at once)\n",
          context, format_name, fmt::join(depths, ","), trials, answer_tokens, R, group);
      std::fflush(stdout);
    }

    std::vector<TrialInfo> infos;
    std::vector<float> prefill_logits(V);
    for (std::size_t di = 0; di < depths.size(); ++di) {
      for (std::uint32_t t = 0; t < trials; ++t) {
        const auto t_trial = Clock::now();
        TrialInfo info{depths[di], t, pk::make_passkey(seed, depths[di], t)};
        pk::Prompt prompt;
        try {
          prompt = pk::build_prompt(tokenizer, context, depths[di] / 100.0, info.passkey, format);
        } catch (const std::invalid_argument& e) {
          throw UserError(e.what());
        }
        const auto T = static_cast<std::uint32_t>(prompt.tokens.size());
        info.prompt_tokens = T;
        info.needle_token = prompt.needle_begin;
        const std::uint32_t max_tokens = T + answer_tokens;

        const auto make_row = [&](const RowSpec& s) {
          Live live;
          if (s.policy == "Dense") {
            live.backend = std::make_unique<DenseCache>(c);
          } else {
            live.manager =
                make_manager(c, sparsekv::make_policy(s.policy, s.budget ? s.budget : budgets.front()), max_tokens);
            live.manager->add_request(1, max_tokens);
            live.backend = std::make_unique<SparseSession>(*live.manager, 1);
          }
          return live;
        };

        std::unique_ptr<KvRecorder> recorder;
        for (std::size_t g0 = 0; g0 < R; g0 += group) {
          const std::size_t g1 = std::min(R, g0 + group), n = g1 - g0;
          std::vector<Live> live;
          std::vector<AttentionBackend*> backends;
          for (std::size_t r = g0; r < g1; ++r) {
            live.push_back(make_row(specs[r]));
            backends.push_back(live.back().backend.get());
          }
          if (g0 == 0) {  // the one prefill: this group's rows (and the recorder for later groups) as sinks
            std::vector<AttentionBackend*> sinks = backends;
            if (g1 < R) {
              recorder = std::make_unique<KvRecorder>(c.layers);
              recorder->set_row(std::size_t{c.kv_heads} * c.head_dim);
              sinks.push_back(recorder.get());
            }
            const auto t_prefill = Clock::now();
            model.prefill(prompt.tokens, sinks, prefill_logits.data());
            info.prefill_s = since(t_prefill);
          } else {
            const auto t_replay = Clock::now();
            for (AttentionBackend* b : backends) recorder->replay(*b);
            info.prefill_s += since(t_replay);
          }
          if (g1 == R) recorder.reset();

          // Greedy decode in lockstep: every row starts from the prefill's argmax.
          const auto t_decode = Clock::now();
          std::vector<std::vector<std::int32_t>> out(n);
          std::vector<std::int32_t> step(n, static_cast<std::int32_t>(argmax(prefill_logits)));
          std::vector<float> logits(n * V);
          for (std::uint32_t s = 0;; ++s) {
            for (std::size_t r = 0; r < n; ++r) out[r].push_back(step[r]);
            if (s + 1 == answer_tokens) break;
            model.decode(step, T + s, backends, logits.data());
            for (std::size_t r = 0; r < n; ++r) {
              step[r] = static_cast<std::int32_t>(argmax(std::span<const float>(logits.data() + r * V, V)));
            }
          }
          info.decode_s += since(t_decode);
          for (std::size_t r = 0; r < n; ++r) {
            std::vector<std::int32_t>& ids = out[r];
            if (const auto it = std::find(ids.begin(), ids.end(), eos); it != ids.end()) ids.erase(it, ids.end());
            const std::string answer = tokenizer.decode(ids);
            RowSpec& spec = specs[g0 + r];
            if (pk::answer_matches(answer, info.passkey)) ++spec.successes[di];
            spec.answers.push_back(answer);
          }
        }  // the group's rows are destroyed here
        info.wall_s = since(t_trial);
        infos.push_back(info);
        if (!json) {
          fmt::print(
              "  depth {:>3}% trial {}: pass key {}, {} prompt tokens, needle at token {} ({:.1f}%); "
              "Dense {}; prefill {:.1f} s, decode {:.1f} s, trial {:.1f} s\n",
              info.depth, t, info.passkey, T, info.needle_token, 100.0 * info.needle_token / T,
              pk::answer_matches(specs[0].answers.back(), info.passkey) ? "found it" : "missed", info.prefill_s,
              info.decode_s, info.wall_s);
          if (show) {
            for (const RowSpec& s : specs) fmt::print("    {:<34} \"{}\"\n", s.label(), json_escape(s.answers.back()));
          }
          std::fflush(stdout);
        }
      }
    }

    const auto total = [&](const RowSpec& s) {
      std::uint32_t sum = 0;
      for (std::uint32_t x : s.successes) sum += x;
      return sum;
    };
    const std::size_t all_trials = depths.size() * std::size_t{trials};
    if (json) {
      fmt::print(
          "{{\"model\": \"SmolLM2-135M-Instruct.Q4_1\", \"task\": \"passkey\", \"format\": \"{}\", "
          "\"context\": {}, \"depths\": [{}], \"trials\": {}, \"seed\": {}, \"answer_tokens\": {}, "
          "\"load_s\": {:.3f}, \"trial_runs\": [",
          format_name, context, fmt::join(depths, ", "), trials, seed, answer_tokens, load_s);
      for (std::size_t i = 0; i < infos.size(); ++i) {
        const TrialInfo& x = infos[i];
        fmt::print(
            "{}{{\"depth\": {}, \"trial\": {}, \"passkey\": \"{}\", \"prompt_tokens\": {}, \"needle_token\": {}, "
            "\"prefill_s\": {:.3f}, \"decode_s\": {:.3f}, \"wall_s\": {:.3f}}}",
            i ? ", " : "", x.depth, x.trial, x.passkey, x.prompt_tokens, x.needle_token, x.prefill_s, x.decode_s,
            x.wall_s);
      }
      fmt::print("], \"results\": [");
      for (std::size_t r = 0; r < R; ++r) {
        const RowSpec& s = specs[r];
        std::vector<std::string> answers;
        for (const std::string& a : s.answers) answers.push_back("\"" + json_escape(a) + "\"");
        fmt::print(
            "{}{{\"policy\": \"{}\", \"budget_tokens\": {}, \"successes\": [{}], \"success_rate\": {:.4f}, "
            "\"answers\": [{}]}}",
            r ? ", " : "", s.policy, s.budget, fmt::join(s.successes, ", "), double(total(s)) / all_trials,
            fmt::join(answers, ", "));
      }
      fmt::print("]}}\n");
    } else {
      fmt::print("\n  successes / {} trial(s) per depth\n  {:<34}", trials, "row");
      for (std::uint32_t d : depths) fmt::print(" {:>6}", fmt::format("{}%", d));
      fmt::print(" {:>9}\n", "overall");
      for (const RowSpec& s : specs) {
        fmt::print("  {:<34}", s.label());
        for (std::uint32_t x : s.successes) fmt::print(" {:>6}", fmt::format("{}/{}", x, trials));
        fmt::print(" {:>8.0f}%\n", 100.0 * total(s) / all_trials);
      }
      double wall = 0;
      for (const TrialInfo& x : infos) wall += x.wall_s;
      fmt::print("\n  timings: load {:.1f} s, {} trial(s) {:.1f} s ({:.1f} s per trial)\n", load_s, infos.size(), wall,
                 wall / std::max<std::size_t>(1, infos.size()));
    }
    return 0;
  } catch (const std::exception& e) {  // every failure is the user's to fix: one line, exit 2
    std::fprintf(stderr, "%s: %s\n", kProgram, e.what());
    return 2;
  }
}
