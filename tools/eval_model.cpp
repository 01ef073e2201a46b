// sparsekv-eval-model: what sparse decode attention costs a real model.
// SmolLM2-135M-Instruct reads a text (default: the GPL-3 shipped in Debian's
// common-licenses). The first --prefill tokens are prefilled densely once;
// the next --tokens tokens are teacher-forced through decode, for the model's
// own dense KV cache (Dense) and for each policy and budget through sparsekv's
// facade. The model's forward over the prompt runs once; its K/V of every
// layer are kept and replayed into each group of rows (by default one policy
// with all its budgets; --rows-per-group N), whose rows decode in lockstep
// (one row each, the weights read once per step). Groups run one after
// another, so only one group's managers hold memory at a time; Dense runs
// first and alone. A row's numbers do not depend on its group.
// Reported per policy and budget: perplexity over the teacher-forced tokens,
// its difference from Dense, top-1 agreement with Dense (the same argmax
// next-token prediction), hit ratio and pages moved.
//
// The token-evicting policies (h2o, streaming_evict; docs/eviction.md) run
// once per --strategies entry (what the buffer does with evicted slots:
// no_op, free_block, sparse_copy, slot_reuse). Their rows add the SpvLLM §3.2
// internal-fragmentation figures over the decode steps: CPU pages held and
// live slots per page slot held, every step, as mean, p99 and a timeline.
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
#include <numeric>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <stdexcept>
#include <vector>

#include <sys/resource.h>

#include <fmt/format.h>

#include "command_line.hpp"
#include "model/bpe_tokenizer.hpp"
#include "model/gguf.hpp"
#include "model/llama.hpp"
#include "model/model_files.hpp"
#include "research/qkv_trace.hpp"
#include "research/research_policies.hpp"
#include "research/selection_trace.hpp"
#include "sparsekv/facade/manager_inspection.hpp"
#include "sparsekv/sparsekv.hpp"

namespace {

using namespace sparsekv::model;
using Clock = std::chrono::steady_clock;
constexpr const char* kProgram = "sparsekv-eval-model";

void usage() {
  std::fputs(
      "usage: sparsekv-eval-model [--model PATH] [--text FILE] [--prefill 2048] [--tokens 256]\n"
      "                           [--policies LIST] [--budgets 256,512,1024] [--strategies slot_reuse]\n"
      "                           [--rows-per-group N] [--page-tokens 8] [--special] [--show-steps] [--json]\n"
      "                           [--dump DIR [--dump-policy shadowkv] [--dump-budget 512] [--dump-layers all|LIST]]\n"
      "  --model PATH       default: "
      "${SPARSEKV_MODEL_DIR:-$HOME/.cache/sparsekv/models}/SmolLM2-135M-Instruct.Q4_1.gguf\n"
      "  --text FILE        default: /usr/share/common-licenses/GPL-3 (needs prefill + tokens + 1 tokens)\n"
      "  --prefill N        tokens prefilled densely (the context the policies select from)\n"
      "  --tokens N         tokens teacher-forced through decode and scored\n"
      "  --policies LIST    default: every built-in (dense, streaming, quest, shadowkv, retroinfer,\n"
      "                     retroinfer_no_estimation, oracle); dense ignores the budget and runs once;\n"
      "                     h2o and streaming_evict evict tokens for good (budget: live tokens per kv head)\n"
      "  --budgets LIST     tokens per kv head and step\n"
      "  --strategies LIST  for h2o / streaming_evict: no_op, free_block, sparse_copy, slot_reuse (default)\n"
      "  --page-tokens N    the library's page size in tokens (default 8; llama.cpp's hook uses 16)\n"
      "  --special          parse control tokens in the text (<|im_start|>, ...: a chat-templated prompt)\n"
      "  --show-steps       print each teacher-forced step: the text's token, Dense's argmax and each run's\n"
      "                     (\"=\" where it is Dense's)\n"
      "  --rows-per-group N runs decoded in lockstep, their managers alive together (default: one\n"
      "                     policy, all its budgets, per group; 0: every run in one group)\n"
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
      : SparseSession(manager, id),
        config_(config),
        trace_layer_(std::move(trace_layer)),
        writer_(writer),
        steps_(config.layers, 0),
        ids_(std::size_t{config.layers} * config.kv_heads) {
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
      const std::size_t qn = std::size_t{config_.q_heads} * config_.head_dim,
                        kn = std::size_t{config_.kv_heads} * config_.head_dim;
      writer_.decode(static_cast<std::uint32_t>(tl), std::span(q, qn), std::span(k, kn), std::span(v, kn));
    }
    const std::size_t step = steps_[layer]++;
    if (trace_.selections.size() <= step)
      trace_.selections.resize(step + 1, std::vector<std::vector<sparsekv::PartitionId>>(trace_.heads()));
    const sparsekv::Retrieval& r = manager().retrieval(0);
    for (std::uint32_t h = 0; h < config_.kv_heads; ++h) {
      const std::size_t head = std::size_t{layer} * config_.kv_heads + h;
      auto& selected = trace_.selections[step][head];
      for (std::uint32_t i = r.head_offsets[h]; i < r.head_offsets[h + 1]; ++i) {
        const std::uint32_t pages = r.pages.partition_offsets[i + 1] - r.pages.partition_offsets[i];
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

// The prompt's post-RoPE K/V of every layer, recorded once during the
// model's prefill and replayed into each group's managers.
class PromptRecorder final : public AttentionBackend {
 public:
  explicit PromptRecorder(const LlamaConfig& config)
      : row_(std::size_t{config.kv_heads} * config.head_dim), keys_(config.layers), values_(config.layers) {}

  void prefill(std::uint32_t layer, const float* k, const float* v, std::uint32_t tokens) override {
    keys_.at(layer).assign(k, k + tokens * row_);
    values_.at(layer).assign(v, v + tokens * row_);
  }
  void decode(std::uint32_t, const float*, const float*, const float*, float*) override {
    throw std::logic_error("PromptRecorder only records the prompt");
  }
  // Hands layer `layer`'s prompt K/V to `to`, as the model's prefill did.
  void replay(std::uint32_t layer, AttentionBackend& to) const {
    to.prefill(layer, keys_[layer].data(), values_[layer].data(),
               static_cast<std::uint32_t>(keys_[layer].size() / row_));
  }

 private:
  std::size_t row_;
  std::vector<std::vector<float>> keys_, values_;  // [layer][token][kv_heads][head_dim]
};

// One policy and budget. Its manager lives only while its group runs; what
// the report needs is kept here.
struct Row {
  std::string policy;
  std::uint32_t budget = 0;                            // 0: the dense policy (everything)
  bool record = false;                                 // the --dump run
  std::optional<sparsekv::EvictionStrategy> strategy;  // a policy that evicts tokens
  double log_likelihood = 0;
  std::size_t agree = 0;
  std::vector<std::uint32_t> top;  // argmax per step
  sparsekv::StepStats stats;
  // Evicting policies, after each decode step: CPU pages held and live slots
  // in them over every (layer, kv head).
  std::vector<std::uint64_t> pages_held, live_slots;
  sparsekv::BufferStats buffer;
};

// Live slots per slot of the pages held (SpvLLM §3.2; internal
// fragmentation is one minus it), step by step.
std::vector<double> utilisation(const Row& row, std::uint32_t page_tokens) {
  std::vector<double> u;
  for (std::size_t s = 0; s < row.pages_held.size(); ++s) {
    u.push_back(row.pages_held[s] ? double(row.live_slots[s]) / double(row.pages_held[s] * page_tokens) : 1.0);
  }
  return u;
}

double mean(const std::vector<double>& x) {
  double sum = 0;
  for (double v : x) sum += v;
  return x.empty() ? 0.0 : sum / x.size();
}

// The 99th percentile of internal fragmentation (1 - utilisation), as SpvLLM's Figure 3.
double fragmentation_p99(std::vector<double> u) {
  if (u.empty()) return 0;
  for (double& v : u) v = 1 - v;
  std::sort(u.begin(), u.end());
  return u[std::min(u.size() - 1, static_cast<std::size_t>(std::ceil(0.99 * u.size())) - 1)];
}

// Rows [first, last) decoded in lockstep, their managers alive together.
struct Group {
  std::size_t first = 0, last = 0;
  double replay_s = 0, decode_s = 0;
};

double max_rss_mb() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_maxrss / 1024.0;  // Linux: kilobytes
}

}  // namespace

int main(int argc, char** argv) {
  sparsekv::register_research_policies();
  try {
    const auto args = sparsekv::tools::parse_command_line<sparsekv::model::UserError>(
        argc, argv,
        std::set<std::string>{"--model", "--text", "--prefill", "--tokens", "--policies", "--budgets", "--strategies",
                              "--dump", "--dump-policy", "--dump-budget", "--dump-layers", "--rows-per-group",
                              "--page-tokens"},
        std::set<std::string>{"--json", "--help", "--special", "--show-steps"});
    if (args.has("--help")) {
      usage();
      return 0;
    }
    const auto prefill = args.number<std::uint32_t>("--prefill", 2048);
    const auto tokens = args.number<std::uint32_t>("--tokens", 256);
    const auto dump_budget = args.number<std::uint32_t>("--dump-budget", 512);
    if (prefill == 0 || tokens == 0 || dump_budget == 0)
      throw sparsekv::model::UserError("--prefill, --tokens and --dump-budget must be > 0");
    sparsekv::Config base;
    base.page_tokens = args.number<std::uint32_t>("--page-tokens", base.page_tokens);
    if (base.page_tokens == 0 || (base.page_tokens & (base.page_tokens - 1)) != 0) {
      throw sparsekv::model::UserError(fmt::format("--page-tokens {} is not a power of two", base.page_tokens));
    }
    // Unset: one policy (all its budgets) per group; 0: every row in one group.
    const bool by_policy = !args.has("--rows-per-group");
    const auto rows_per_group = args.number<std::uint32_t>("--rows-per-group", 0);
    const std::vector<std::uint32_t> budgets = args.number_list("--budgets", "256,512,1024", 1);
    const std::vector<std::string> policies =
        args.has("--policies") ? args.list("--policies", "") : sparsekv::policy_names();
    for (const std::string& p : policies) {
      for (std::uint32_t b : budgets)
        sparsekv::make_policy(p, b);  // a bad name or budget fails here, before the model loads
    }
    std::vector<sparsekv::EvictionStrategy> strategies;
    for (const std::string& s : args.list("--strategies", "slot_reuse")) {
      strategies.push_back(sparsekv::parse_eviction_strategy(s));
    }
    const auto evicting = [](const std::string& p) {
      const auto names = sparsekv::eviction_policy_names();
      return std::find(names.begin(), names.end(), p) != names.end();
    };
    const bool json = args.has("--json");
    const std::string dump_dir = args.text("--dump", "");
    const std::string dump_policy = args.text("--dump-policy", "shadowkv");
    if (!dump_dir.empty()) {
      sparsekv::make_policy(dump_policy, dump_budget);
    }
    const std::string model_path =
        sparsekv::model::existing_model_path(args.text("--model", sparsekv::model::default_model_path().string()));
    const std::string text_path = args.text("--text", "/usr/share/common-licenses/GPL-3");
    const std::string text = sparsekv::model::read_text_file(text_path);

    const auto t_load = Clock::now();
    const GgufFile file = GgufFile::open(model_path);
    const BpeTokenizer tokenizer(file);
    const LlamaModel model(file);
    const LlamaConfig& c = model.config();
    const double load_s = since(t_load);

    std::vector<std::int32_t> ids = tokenizer.encode(text, /*parse_special=*/args.has("--special"));
    if (ids.size() < std::size_t{prefill} + tokens + 1) {
      throw sparsekv::model::UserError(fmt::format("'{}' has {} tokens; --prefill {} --tokens {} need {}", text_path,
                                                   ids.size(), prefill, tokens, std::size_t{prefill} + tokens + 1));
    }
    if (c.context != 0 && prefill + tokens > c.context) {
      throw sparsekv::model::UserError(
          fmt::format("--prefill + --tokens exceed the model's {}-token context", c.context));
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
        if (dump_layers[i] >= c.layers)
          throw sparsekv::model::UserError(fmt::format("--dump-layers: layer {} >= {}", dump_layers[i], c.layers));
        trace_layer[dump_layers[i]] = static_cast<int>(i);
      }
      sparsekv::QkvTraceHeader header;
      header.layers = static_cast<std::uint32_t>(dump_layers.size());
      header.q_heads = c.q_heads;
      header.kv_heads = c.kv_heads;
      header.head_dim = c.head_dim;
      header.prompt_tokens = prefill;
      header.decode_steps = tokens;
      header.model = fmt::format(
          "SmolLM2-135M-Instruct Q4_1 (fp32 forward), text {}, run {} budget {}, model layers {}",
          std::filesystem::path(text_path).filename().string(), dump_policy, dump_budget, fmt::join(dump_layers, ","));
      std::filesystem::create_directories(dump_dir);
      writer = std::make_unique<sparsekv::QkvTraceWriter>(std::filesystem::path(dump_dir) / "qkv", header);
    }

    // Rows: every (policy, budget); the Dense reference runs on its own, first.
    std::vector<Row> rows;
    bool recorded = false;
    const auto add = [&](const std::string& name, std::uint32_t budget) {
      Row row{name, name == "dense" ? 0 : budget};
      if (writer && !recorded && name == dump_policy && (budget == dump_budget || name == "dense")) {
        row.record = recorded = true;
      }
      if (!evicting(name)) {
        rows.push_back(std::move(row));
        return;
      }
      for (const sparsekv::EvictionStrategy s : strategies) {
        row.strategy = s;
        rows.push_back(row);
        row.record = false;
      }
    };
    for (const std::string& p : policies) {
      if (p == "dense") {
        add(p, budgets.front());
        continue;
      }
      for (std::uint32_t b : budgets) add(p, b);
    }
    if (writer && !recorded) add(dump_policy, dump_budget);

    // Groups, run one after another: only one group's managers exist at a time.
    std::vector<Group> groups;
    for (std::size_t r = 0; r < rows.size();) {
      std::size_t e = r + 1;
      if (by_policy) {
        while (e < rows.size() && rows[e].policy == rows[r].policy) ++e;
      } else {
        e = rows_per_group == 0 ? rows.size() : std::min(rows.size(), r + rows_per_group);
      }
      groups.push_back(Group{r, e});
      r = e;
    }

    const std::size_t V = c.vocab, R = rows.size();
    std::size_t widest = 1;
    for (const Group& g : groups) widest = std::max(widest, g.last - g.first);
    std::vector<float> logits(widest * V);

    if (!json) {
      fmt::print("{}: SmolLM2-135M-Instruct loaded in {:.1f} s ({} threads); {}: {} tokens\n", kProgram, load_s,
                 model.threads(), text_path, ids.size());
      fmt::print(
          "  prefill {} tokens, then {} tokens teacher-forced through decode; Dense, then {} runs in {} groups\n",
          prefill, tokens, R, groups.size());
      std::fflush(stdout);
    }
    // The model's forward over the prompt, once: Dense keeps its K/V, the
    // recorder too, for every group's managers.
    PromptRecorder prompt(c);
    auto dense = std::make_unique<DenseCache>(c);
    const auto t_prefill = Clock::now();
    {
      AttentionBackend* const sinks[] = {&prompt, dense.get()};
      model.prefill(std::span(ids.data(), prefill), sinks, logits.data());
    }
    const double prefill_s = since(t_prefill);

    // Dense first: its per-step argmax (top-1 agreement) and log-likelihood.
    const auto t_dense = Clock::now();
    std::vector<std::uint32_t> dense_top(tokens);
    double dense_log_likelihood = 0;
    for (std::uint32_t s = 0; s < tokens; ++s) {
      const std::int32_t token = ids[prefill + s];
      AttentionBackend* const one[] = {dense.get()};
      model.decode(std::span(&token, 1), prefill + s, one, logits.data());
      const std::span<const float> row(logits.data(), V);
      dense_top[s] = argmax(row);
      dense_log_likelihood += log_prob(row, static_cast<std::uint32_t>(ids[prefill + s + 1]));
    }
    dense.reset();
    const double dense_decode_s = since(t_dense);

    sparsekv::SelectionTrace recorded_trace;
    double replay_s = 0, decode_s = 0;
    for (std::size_t gi = 0; gi < groups.size(); ++gi) {
      Group& g = groups[gi];
      const std::size_t n = g.last - g.first;
      const auto t_replay = Clock::now();
      std::vector<std::unique_ptr<sparsekv::RuntimeManager>> managers;
      std::vector<std::unique_ptr<AttentionBackend>> sessions;
      RecordingSession* recorder = nullptr;
      for (std::size_t r = g.first; r < g.last; ++r) {
        const Row& row = rows[r];
        sparsekv::Config row_base = base;
        row_base.eviction_strategy = row.strategy.value_or(sparsekv::EvictionStrategy::slot_reuse);
        auto& manager = managers.emplace_back(
            make_manager(c, sparsekv::make_policy(row.policy, row.policy == "dense" ? budgets.front() : row.budget),
                         max_tokens, 1, row_base));
        manager->add_request(1, max_tokens);
        if (row.record) {
          auto session = std::make_unique<RecordingSession>(*manager, 1, c, trace_layer, *writer);
          recorder = session.get();
          sessions.push_back(std::move(session));
        } else {
          sessions.push_back(std::make_unique<SparseSession>(*manager, 1));
        }
      }
      std::vector<AttentionBackend*> backends;
      for (auto& session : sessions) backends.push_back(session.get());
      for (std::uint32_t l = 0; l < c.layers; ++l) {
        for (AttentionBackend* b : backends) prompt.replay(l, *b);
      }
      g.replay_s = since(t_replay);

      const auto t_decode = Clock::now();
      std::vector<std::int32_t> step_tokens(n);
      for (std::uint32_t s = 0; s < tokens; ++s) {
        std::fill(step_tokens.begin(), step_tokens.end(), ids[prefill + s]);
        model.decode(step_tokens, prefill + s, backends, logits.data());
        const auto target = static_cast<std::uint32_t>(ids[prefill + s + 1]);
        for (std::size_t i = 0; i < n; ++i) {
          const std::span<const float> row(logits.data() + i * V, V);
          rows[g.first + i].log_likelihood += log_prob(row, target);
          rows[g.first + i].top.push_back(argmax(row));
          if (rows[g.first + i].top.back() == dense_top[s]) ++rows[g.first + i].agree;
          if (rows[g.first + i].strategy) {
            rows[g.first + i].pages_held.push_back(sparsekv::inspect_buffer(*managers[i]).evictor().held_pages(1));
            rows[g.first + i].live_slots.push_back(sparsekv::inspect_buffer(*managers[i]).evictor().live_slots(1));
          }
        }
      }
      g.decode_s = since(t_decode);
      for (std::size_t i = 0; i < n; ++i) {
        rows[g.first + i].stats = managers[i]->stats();
        rows[g.first + i].buffer = managers[i]->tier_usage().stats;
      }
      if (recorder) recorded_trace = std::move(recorder->trace());
      replay_s += g.replay_s;
      decode_s += g.decode_s;
      if (!json) {
        fmt::print("  group {}/{} ({} runs: {}): replay {:.1f} s, decode {:.1f} s; max RSS {:.0f} MB\n", gi + 1,
                   groups.size(), n, rows[g.first].policy == rows[g.last - 1].policy ? rows[g.first].policy : "mixed",
                   g.replay_s, g.decode_s, max_rss_mb());
        std::fflush(stdout);
      }
    }  // each group's managers are destroyed here, before the next group's

    double dump_s = 0;
    if (writer) {
      const auto t = Clock::now();
      writer->finish();
      std::ofstream out(std::filesystem::path(dump_dir) / "selections.trace");
      if (!out) throw sparsekv::model::UserError(fmt::format("cannot write '{}/selections.trace'", dump_dir));
      out << "# SmolLM2-135M-Instruct, " << std::filesystem::path(text_path).filename().string() << ", policy "
          << dump_policy << " budget " << dump_budget << ", " << prefill << "-token prefill, " << tokens
          << " teacher-forced steps; page_tokens " << base.page_tokens << "\n";
      sparsekv::write_selection_trace(out, recorded_trace);
      out.close();
      if (!out) throw sparsekv::model::UserError(fmt::format("cannot write '{}/selections.trace'", dump_dir));
      dump_s = since(t);
    }

    const double total_s = since(t_load);
    const double rss_mb = max_rss_mb();
    const double dense_ppl = std::exp(-dense_log_likelihood / tokens);
    if (json) {
      fmt::print(
          "{{\"model\": \"SmolLM2-135M-Instruct.Q4_1\", \"text\": \"{}\", \"prefill_tokens\": {}, \"eval_tokens\": {}, "
          "\"dense_perplexity\": {:.6f}, \"rows_per_group\": {}, \"groups\": {}, \"max_rss_mb\": {:.0f}, "
          "\"load_s\": {:.3f}, \"prefill_s\": {:.3f}, \"dense_decode_s\": {:.3f}, \"replay_s\": {:.3f}, "
          "\"decode_s\": {:.3f}, \"total_s\": {:.3f}, \"results\": [",
          std::filesystem::path(text_path).filename().string(), prefill, tokens, dense_ppl,
          by_policy ? std::string("\"policy\"") : fmt::format("{}", rows_per_group), groups.size(), rss_mb, load_s,
          prefill_s, dense_decode_s, replay_s, decode_s, total_s);
      for (std::size_t r = 0; r < R; ++r) {
        const Row& row = rows[r];
        const double ppl = std::exp(-row.log_likelihood / tokens);
        const auto& st = row.stats;
        fmt::print(
            "{}{{\"policy\": \"{}\", \"budget_tokens\": {}, \"perplexity\": {:.6f}, \"perplexity_delta\": {:.6f}, "
            "\"top1_agreement\": {:.6f}, \"hit_ratio\": {:.6f}, \"pages_moved\": {}",
            r > 0 ? ", " : "", row.policy, row.budget, ppl, ppl - dense_ppl, double(row.agree) / tokens, st.hit_ratio(),
            st.pages_moved);
        if (row.strategy) {
          const std::vector<double> u = utilisation(row, base.page_tokens);
          fmt::print(
              ", \"strategy\": \"{}\", \"utilisation_mean\": {:.6f}, \"fragmentation_p99\": {:.6f}, "
              "\"pages_held_mean\": {:.1f}, \"pages_held_max\": {}, \"pages_freed\": {}, \"pages_copied\": {}, "
              "\"slots_copied\": {}, \"pages_held\": [{}], \"live_slots\": [{}]",
              sparsekv::to_string(*row.strategy), mean(u), fragmentation_p99(u),
              row.pages_held.empty()
                  ? 0.0
                  : std::accumulate(row.pages_held.begin(), row.pages_held.end(), 0.0) / row.pages_held.size(),
              row.pages_held.empty() ? 0 : *std::max_element(row.pages_held.begin(), row.pages_held.end()),
              row.buffer.pages_freed, row.buffer.pages_copied, row.buffer.slots_copied, fmt::join(row.pages_held, ","),
              fmt::join(row.live_slots, ","));
        }
        fmt::print("}}");
      }
      fmt::print("]");
      if (writer) fmt::print(", \"dump\": \"{}\"", dump_dir);
      fmt::print("}}\n");
    } else {
      fmt::print("\n  {:<26} {:>7} {:>11} {:>10} {:>9} {:>9} {:>10} {:>9}\n", "policy", "budget", "perplexity", "delta",
                 "delta %", "top-1", "hit ratio", "select");
      fmt::print("  {:<26} {:>7} {:>11.4f} {:>10} {:>9} {:>9} {:>10} {:>9}\n", "Dense (own KV cache)", "all", dense_ppl,
                 "-", "-", "-", "-", "-");
      for (std::size_t r = 0; r < R; ++r) {
        const Row& row = rows[r];
        const double ppl = std::exp(-row.log_likelihood / tokens);
        const auto& st = row.stats;
        const std::string name =
            row.strategy ? fmt::format("{} ({})", row.policy, sparsekv::to_string(*row.strategy)) : row.policy;
        fmt::print("  {:<26} {:>7} {:>11.4f} {:>+10.4f} {:>+8.2f}% {:>8.1f}% {:>9.1f}% {:>7.0f}us\n", name,
                   row.budget ? fmt::format("{}", row.budget) : std::string("all"), ppl, ppl - dense_ppl,
                   100 * (ppl / dense_ppl - 1), 100.0 * row.agree / tokens, 100 * st.hit_ratio(),
                   st.decode_steps ? 1e6 * st.select_s / st.decode_steps : 0.0);
      }
      bool evictions = false;
      for (std::size_t r = 0; r < R; ++r) {
        const Row& row = rows[r];
        if (!row.strategy) continue;
        if (!evictions) {
          fmt::print(
              "\n  token eviction (SpvLLM §3.2: live slots / slots of the CPU pages held, per decode step)\n"
              "  {:<16} {:>7} {:>12} {:>12} {:>14} {:>11} {:>10} {:>10}\n",
              "policy", "budget", "strategy", "utilisation", "p99 fragment.", "held mean", "freed", "copied");
          evictions = true;
        }
        const std::vector<double> u = utilisation(row, base.page_tokens);
        fmt::print("  {:<16} {:>7} {:>12} {:>11.1f}% {:>13.1f}% {:>11.0f} {:>10} {:>10}\n", row.policy, row.budget,
                   sparsekv::to_string(*row.strategy), 100 * mean(u), 100 * fragmentation_p99(u),
                   row.pages_held.empty()
                       ? 0.0
                       : std::accumulate(row.pages_held.begin(), row.pages_held.end(), 0.0) / row.pages_held.size(),
                   row.buffer.pages_freed, row.buffer.pages_copied);
      }
      if (args.has("--show-steps")) {
        // Where the runs part from Dense: each step's argmax as text.
        const auto piece = [&](std::uint32_t id) {
          const auto one = static_cast<std::int32_t>(id);
          std::string t = tokenizer.decode(std::span(&one, 1));
          for (std::size_t at = 0; (at = t.find('\n', at)) != std::string::npos;) t.replace(at, 1, "\\n");
          return fmt::format("'{}'", t);
        };
        fmt::print("\n  {:<5} {:<10} {:<10}", "step", "text", "Dense");
        for (const Row& row : rows)
          fmt::print(" {:<14.14}", row.budget ? fmt::format("{} {}", row.policy, row.budget) : row.policy);
        fmt::print("\n");
        for (std::uint32_t s = 0; s < tokens; ++s) {
          fmt::print("  {:<5} {:<10} {:<10}", s, piece(static_cast<std::uint32_t>(ids[prefill + s + 1])),
                     piece(dense_top[s]));
          for (const Row& row : rows)
            fmt::print(" {:<14}", row.top[s] == dense_top[s] ? std::string("=") : piece(row.top[s]));
          fmt::print("\n");
        }
      }
      fmt::print(
          "\n  timings: load {:.1f} s, prefill {:.1f} s ({:.0f} tokens/s), Dense decode {:.1f} s, replay {:.1f} s, "
          "decode {:.1f} s ({} runs in {} groups)",
          load_s, prefill_s, prefill / prefill_s, dense_decode_s, replay_s, decode_s, R, groups.size());
      if (writer) fmt::print(", dump {:.1f} s", dump_s);
      fmt::print("; total {:.1f} s, max RSS {:.0f} MB\n", total_s, rss_mb);
      if (writer) {
        fmt::print("  dump: {}/selections.trace ({} steps, {} layers x {} kv heads; sparsekv-cachesim --trace)\n",
                   dump_dir, recorded_trace.steps(), c.layers, c.kv_heads);
        fmt::print("        {}/qkv/ (layers {}; sparsekv-accuracy --trace)\n", dump_dir, fmt::join(dump_layers, ","));
      }
    }
    return 0;
  } catch (const std::exception& e) {  // every failure is the user's to fix: one line, exit 2
    std::fprintf(stderr, "%s: %s\n", kProgram, e.what());
    return 2;
  }
}
