// sparsekv-eval-model: what sparse decode attention costs a real model.
// SmolLM2-135M-Instruct reads a text (default: the GPL-3 shipped in Debian's
// common-licenses). The first --prefill tokens are prefilled densely once;
// the next --tokens tokens are teacher-forced through decode, for the model's
// own dense KV cache (Dense) and for each policy and budget through sparsekv's
// facade, all in lockstep (one row each, the weights read once per step).
// Reported per policy and budget: perplexity over the teacher-forced tokens,
// its difference from Dense, top-1 agreement with Dense (the same argmax
// next-token prediction), hit ratio and pages moved.
//
// --dump DIR also records, for one policy and budget (--dump-policy,
// --dump-budget), the run's real selections as DIR/selections.trace
// (sparsekv-cachesim --trace) and the Q/K/V of the chosen layers as DIR/qkv/
// (sparsekv-accuracy --trace): the prompt's K/V and, per teacher-forced step,
// that run's query and the token's K/V.
#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "command_line.hpp"
#include "model/bpe_tokenizer.hpp"
#include "model/gguf.hpp"
#include "model/llama.hpp"
#include "model/model_files.hpp"
#include "sparsekv/cache/selection_trace.hpp"
#include "sparsekv/policy/qkv_trace.hpp"
#include "sparsekv/sparsekv.hpp"

namespace {

using namespace sparsekv::model;
using Clock = std::chrono::steady_clock;
constexpr const char* kProgram = "sparsekv-eval-model";

void usage() {
  std::fputs(
      "usage: sparsekv-eval-model [--model PATH] [--text FILE] [--prefill 2048] [--tokens 256]\n"
      "                           [--policies LIST] [--budgets 256,512,1024] [--json]\n"
      "                           [--dump DIR [--dump-policy shadowkv] [--dump-budget 512] [--dump-layers all|LIST]]\n"
      "  --model PATH       default: ${SPARSEKV_MODEL_DIR:-$HOME/.cache/sparsekv/models}/SmolLM2-135M-Instruct.Q4_1.gguf\n"
      "  --text FILE        default: /usr/share/common-licenses/GPL-3 (needs prefill + tokens + 1 tokens)\n"
      "  --prefill N        tokens prefilled densely (the context the policies select from)\n"
      "  --tokens N         tokens teacher-forced through decode and scored\n"
      "  --policies LIST    default: every built-in (dense, streaming, quest, shadowkv, retroinfer,\n"
      "                     retroinfer_no_estimation); dense ignores the budget and runs once\n"
      "  --budgets LIST     tokens per kv head and step\n"
      "  --json             one JSON object on stdout\n"
      "  --dump DIR         write DIR/selections.trace and DIR/qkv/ for one policy and budget\n"
      "  --dump-layers      layers whose Q/K/V are written, as trace layers 0.. in this order (default all)\n",
      stderr);
}

double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// A SparseSession that also records its run: the selections of every layer
// (as a selection trace) and the Q/K/V of the chosen layers.
class RecordingSession final : public SparseSession {
 public:
  RecordingSession(sparsekv::RuntimeManager& manager, sparsekv::RequestId id, const LlamaConfig& config,
                   std::vector<int> trace_layer, sparsekv::QkvTraceWriter& writer)
      : SparseSession(manager, id), config_(config), trace_layer_(std::move(trace_layer)), writer_(writer),
        steps_(config.layers, 0), ids_(std::size_t{config.layers} * config.kv_heads) {
    trace_.layers = config.layers;
    trace_.kv_heads = config.kv_heads;
    trace_.partition_pages.resize(trace_.heads());
  }

  void prefill(std::uint32_t layer, const float* k, const float* v, std::uint32_t tokens) override {
    SparseSession::prefill(layer, k, v, tokens);
    if (const int tl = trace_layer_[layer]; tl >= 0) {
      const std::size_t n = std::size_t{tokens} * config_.kv_heads * config_.head_dim;
      writer_.prompt(static_cast<std::uint32_t>(tl), std::span(k, n), std::span(v, n));
    }
  }

  void decode(std::uint32_t layer, const float* q, const float* k, const float* v, float* out) override {
    SparseSession::decode(layer, q, k, v, out);
    if (const int tl = trace_layer_[layer]; tl >= 0) {
      const std::size_t qn = std::size_t{config_.q_heads} * config_.head_dim, kn = std::size_t{config_.kv_heads} * config_.head_dim;
      writer_.decode(static_cast<std::uint32_t>(tl), std::span(q, qn), std::span(k, kn), std::span(v, kn));
    }
    const std::size_t step = steps_[layer]++;
    if (trace_.selections.size() <= step) trace_.selections.resize(step + 1, std::vector<std::vector<sparsekv::PartitionId>>(trace_.heads()));
    const sparsekv::Retrieval& r = manager().retrieval(0);
    for (std::uint32_t h = 0; h < config_.kv_heads; ++h) {
      const std::size_t head = std::size_t{layer} * config_.kv_heads + h;
      auto& selected = trace_.selections[step][head];
      for (std::uint32_t i = r.head_offsets[h]; i < r.head_offsets[h + 1]; ++i) {
        const std::uint32_t pages = r.plan.partition_offsets[i + 1] - r.plan.partition_offsets[i];
        if (pages == 0) continue;
        selected.push_back(trace_id(head, r.partitions[i], pages));
      }
    }
  }

  sparsekv::SelectionTrace& trace() { return trace_; }

 private:
  // A trace partition keeps one page count: a sparsekv partition whose page
  // count changes (a policy regrouped it) becomes a new trace partition.
  sparsekv::PartitionId trace_id(std::size_t head, sparsekv::PartitionId pid, std::uint32_t pages) {
    auto& map = ids_[head];
    auto it = map.find(pid);
    if (it != map.end() && trace_.partition_pages[head][it->second] == pages) return it->second;
    const auto id = static_cast<sparsekv::PartitionId>(trace_.partition_pages[head].size());
    trace_.partition_pages[head].push_back(pages);
    map[pid] = id;
    return id;
  }

  LlamaConfig config_;
  std::vector<int> trace_layer_;
  sparsekv::QkvTraceWriter& writer_;
  std::vector<std::size_t> steps_;
  std::vector<std::map<sparsekv::PartitionId, sparsekv::PartitionId>> ids_;
  sparsekv::SelectionTrace trace_;
};

struct Row {
  std::string policy;
  std::uint32_t budget = 0;  // 0: Dense / dense policy (everything)
  std::unique_ptr<sparsekv::RuntimeManager> manager;
  std::unique_ptr<AttentionBackend> backend;
  double log_likelihood = 0;
  std::size_t agree = 0;
};

}  // namespace

int main(int argc, char** argv) {
  try {
    std::unique_ptr<sparsekv::tools::CommandLine> parsed;
    try {
      parsed = std::make_unique<sparsekv::tools::CommandLine>(
          argc, argv,
          std::set<std::string>{"--model", "--text", "--prefill", "--tokens", "--policies", "--budgets", "--dump",
                                "--dump-policy", "--dump-budget", "--dump-layers"},
          std::set<std::string>{"--json", "--help"});
    } catch (const std::exception& e) {
      throw sparsekv::model::UserError(fmt::format("{} (--help for usage)", e.what()));
    }
    const auto& args = *parsed;
    if (args.has("--help")) {
      usage();
      return 0;
    }
    const auto prefill = args.number<std::uint32_t>("--prefill", 2048);
    const auto tokens = args.number<std::uint32_t>("--tokens", 256);
    const auto dump_budget = args.number<std::uint32_t>("--dump-budget", 512);
    if (prefill == 0 || tokens == 0 || dump_budget == 0) throw sparsekv::model::UserError("--prefill, --tokens and --dump-budget must be > 0");
    const std::vector<std::uint32_t> budgets = args.number_list("--budgets", "256,512,1024", 1);
    const std::vector<std::string> policies =
        args.has("--policies") ? args.list("--policies", "") : sparsekv::policy_names();
    for (const std::string& p : policies) {
      sparsekv::make_policy(p, 1);  // an unknown name fails here, before the model loads
    }
    const bool json = args.has("--json");
    const std::string dump_dir = args.text("--dump", "");
    const std::string dump_policy = args.text("--dump-policy", "shadowkv");
    if (!dump_dir.empty()) {
      sparsekv::make_policy(dump_policy, dump_budget);
    }
    const std::string model_path = args.text("--model", sparsekv::model::default_model_path().string());
    const std::string text_path = args.text("--text", "/usr/share/common-licenses/GPL-3");
    {
      std::error_code ec;
      if (!std::filesystem::is_regular_file(model_path, ec)) {
        throw sparsekv::model::UserError(fmt::format("model file '{}' not found (run scripts/setup, set SPARSEKV_MODEL_DIR, or pass --model)",
                                    model_path));
      }
    }
    const std::string text = sparsekv::model::read_text_file(text_path);

    const auto t_load = Clock::now();
    const GgufFile file = GgufFile::open(model_path);
    const BpeTokenizer tokenizer(file);
    const LlamaModel model(file);
    const LlamaConfig& c = model.config();
    const double load_s = since(t_load);

    std::vector<std::int32_t> ids = tokenizer.encode(text, /*parse_special=*/false);
    if (ids.size() < std::size_t{prefill} + tokens + 1) {
      throw sparsekv::model::UserError(fmt::format("'{}' has {} tokens; --prefill {} --tokens {} need {}", text_path, ids.size(), prefill,
                                  tokens, std::size_t{prefill} + tokens + 1));
    }
    if (c.context != 0 && prefill + tokens > c.context) {
      throw sparsekv::model::UserError(fmt::format("--prefill + --tokens exceed the model's {}-token context", c.context));
    }
    const std::uint32_t max_tokens = prefill + tokens + 1;

    // Dump: which real layer is which trace layer.
    std::vector<int> trace_layer(c.layers, -1);
    std::vector<std::uint32_t> dump_layers;
    std::unique_ptr<sparsekv::QkvTraceWriter> writer;
    if (!dump_dir.empty()) {
      const std::string spec = args.text("--dump-layers", "all");
      if (spec == "all") {
        for (std::uint32_t l = 0; l < c.layers; ++l) dump_layers.push_back(l);
      } else {
        dump_layers = args.number_list("--dump-layers", spec);
      }
      for (std::size_t i = 0; i < dump_layers.size(); ++i) {
        if (dump_layers[i] >= c.layers) throw sparsekv::model::UserError(fmt::format("--dump-layers: layer {} >= {}", dump_layers[i], c.layers));
        trace_layer[dump_layers[i]] = static_cast<int>(i);
      }
      sparsekv::QkvTraceHeader header;
      header.layers = static_cast<std::uint32_t>(dump_layers.size());
      header.q_heads = c.q_heads;
      header.kv_heads = c.kv_heads;
      header.head_dim = c.head_dim;
      header.prompt_tokens = prefill;
      header.decode_steps = tokens;
      header.model = fmt::format("SmolLM2-135M-Instruct Q4_1 (fp32 forward), text {}, run {} budget {}, model layers {}",
                                 std::filesystem::path(text_path).filename().string(), dump_policy, dump_budget,
                                 fmt::join(dump_layers, ","));
      std::filesystem::create_directories(dump_dir);
      writer = std::make_unique<sparsekv::QkvTraceWriter>(std::filesystem::path(dump_dir) / "qkv", header);
    }

    // Rows: Dense first, then every (policy, budget).
    std::vector<Row> rows;
    rows.push_back(Row{"Dense", 0, nullptr, std::make_unique<DenseCache>(c)});
    RecordingSession* recorder = nullptr;
    const auto add = [&](const std::string& name, std::uint32_t budget) {
      Row row{name, name == "dense" ? 0 : budget};
      row.manager = make_manager(c, sparsekv::make_policy(name, budget), max_tokens);
      row.manager->add_request(1, max_tokens);
      if (writer && !recorder && name == dump_policy && (budget == dump_budget || name == "dense")) {
        auto session = std::make_unique<RecordingSession>(*row.manager, 1, c, trace_layer, *writer);
        recorder = session.get();
        row.backend = std::move(session);
      } else {
        row.backend = std::make_unique<SparseSession>(*row.manager, 1);
      }
      rows.push_back(std::move(row));
    };
    for (const std::string& p : policies) {
      if (p == "dense") {
        add(p, budgets.front());
        continue;
      }
      for (std::uint32_t b : budgets) add(p, b);
    }
    if (writer && !recorder) add(dump_policy, dump_budget);

    std::vector<AttentionBackend*> backends;
    for (Row& r : rows) backends.push_back(r.backend.get());
    const std::size_t V = c.vocab, R = rows.size();
    std::vector<float> logits(R * V);

    if (!json) {
      fmt::print("{}: SmolLM2-135M-Instruct loaded in {:.1f} s ({} threads); {}: {} tokens\n", kProgram, load_s,
                 model.threads(), text_path, ids.size());
      fmt::print("  prefill {} tokens, then {} tokens teacher-forced through decode; {} runs in lockstep\n", prefill,
                 tokens, R);
      std::fflush(stdout);
    }
    const auto t_prefill = Clock::now();
    model.prefill(std::span(ids.data(), prefill), backends, logits.data());
    const double prefill_s = since(t_prefill);

    const auto t_decode = Clock::now();
    std::vector<std::int32_t> step_tokens(R);
    for (std::uint32_t s = 0; s < tokens; ++s) {
      std::fill(step_tokens.begin(), step_tokens.end(), ids[prefill + s]);
      model.decode(step_tokens, prefill + s, backends, logits.data());
      const auto target = static_cast<std::uint32_t>(ids[prefill + s + 1]);
      const std::uint32_t dense_top = argmax(std::span(logits.data(), V));
      for (std::size_t r = 0; r < R; ++r) {
        const std::span<const float> row(logits.data() + r * V, V);
        rows[r].log_likelihood += log_prob(row, target);
        if (argmax(row) == dense_top) ++rows[r].agree;
      }
      if (!json && (s + 1) % 64 == 0) {
        fmt::print("  step {}/{} ({:.1f} s)\n", s + 1, tokens, since(t_decode));
        std::fflush(stdout);
      }
    }
    const double decode_s = since(t_decode);

    double dump_s = 0;
    if (writer) {
      const auto t = Clock::now();
      writer->finish();
      std::ofstream out(std::filesystem::path(dump_dir) / "selections.trace");
      if (!out) throw sparsekv::model::UserError(fmt::format("cannot write '{}/selections.trace'", dump_dir));
      out << "# SmolLM2-135M-Instruct, " << std::filesystem::path(text_path).filename().string() << ", policy "
          << dump_policy << " budget " << dump_budget << ", " << prefill << "-token prefill, " << tokens
          << " teacher-forced steps; page_tokens 8\n";
      sparsekv::write_selection_trace(out, recorder->trace());
      out.close();
      if (!out) throw sparsekv::model::UserError(fmt::format("cannot write '{}/selections.trace'", dump_dir));
      dump_s = since(t);
    }

    const double dense_ppl = std::exp(-rows[0].log_likelihood / tokens);
    if (json) {
      fmt::print("{{\"model\": \"SmolLM2-135M-Instruct.Q4_1\", \"text\": \"{}\", \"prefill_tokens\": {}, \"eval_tokens\": {}, "
                 "\"dense_perplexity\": {:.6f}, \"prefill_s\": {:.3f}, \"decode_s\": {:.3f}, \"results\": [",
                 std::filesystem::path(text_path).filename().string(), prefill, tokens, dense_ppl, prefill_s, decode_s);
      for (std::size_t r = 1; r < R; ++r) {
        const Row& row = rows[r];
        const double ppl = std::exp(-row.log_likelihood / tokens);
        const auto& st = row.manager->stats();
        fmt::print("{}{{\"policy\": \"{}\", \"budget_tokens\": {}, \"perplexity\": {:.6f}, \"perplexity_delta\": {:.6f}, "
                   "\"top1_agreement\": {:.6f}, \"hit_ratio\": {:.6f}, \"pages_moved\": {}}}",
                   r > 1 ? ", " : "", row.policy, row.budget, ppl, ppl - dense_ppl, double(row.agree) / tokens,
                   st.hit_ratio(), st.pages_moved);
      }
      fmt::print("]");
      if (writer) fmt::print(", \"dump\": \"{}\"", dump_dir);
      fmt::print("}}\n");
    } else {
      fmt::print("\n  {:<26} {:>7} {:>11} {:>10} {:>9} {:>9} {:>10} {:>9}\n", "policy", "budget", "perplexity", "delta",
                 "delta %", "top-1", "hit ratio", "select");
      fmt::print("  {:<26} {:>7} {:>11.4f} {:>10} {:>9} {:>9} {:>10} {:>9}\n", "Dense (own KV cache)", "all", dense_ppl,
                 "-", "-", "-", "-", "-");
      for (std::size_t r = 1; r < R; ++r) {
        const Row& row = rows[r];
        const double ppl = std::exp(-row.log_likelihood / tokens);
        const auto& st = row.manager->stats();
        fmt::print("  {:<26} {:>7} {:>11.4f} {:>+10.4f} {:>+8.2f}% {:>8.1f}% {:>9.1f}% {:>7.0f}us\n", row.policy,
                   row.budget ? fmt::format("{}", row.budget) : std::string("all"), ppl, ppl - dense_ppl,
                   100 * (ppl / dense_ppl - 1), 100.0 * row.agree / tokens, 100 * st.hit_ratio(),
                   st.decode_steps ? 1e6 * st.select_s / st.decode_steps : 0.0);
      }
      fmt::print("\n  timings: load {:.1f} s, prefill {:.1f} s ({:.0f} tokens/s), decode {:.1f} s ({:.2f} s per step for {} runs)",
                 load_s, prefill_s, prefill / prefill_s, decode_s, decode_s / tokens, R);
      if (writer) fmt::print(", dump {:.1f} s", dump_s);
      fmt::print("\n");
      if (writer) {
        fmt::print("  dump: {}/selections.trace ({} steps, {} layers x {} kv heads; sparsekv-cachesim --trace)\n", dump_dir,
                   recorder->trace().steps(), c.layers, c.kv_heads);
        fmt::print("        {}/qkv/ (layers {}; sparsekv-accuracy --trace)\n", dump_dir, fmt::join(dump_layers, ","));
      }
    }
    return 0;
  } catch (const std::exception& e) {  // every failure is the user's to fix: one line, exit 2
    std::fprintf(stderr, "%s: %s\n", kProgram, e.what());
    return 2;
  }
}
