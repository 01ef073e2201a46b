// sparsekv-accuracy: runs a Q/K/V trace (qkv_trace.hpp; recorded from a model
// or synthetic) through every built-in policy at several token budgets, with
// the library's own pipeline (tools/sparse_pipeline.hpp: Index, Offload,
// Select, Retrieve, Attend), and compares each decode step's attention output
// with exact dense attention over the whole context. docs/accuracy.md
// describes the trace format, the generator's knobs and the metrics.
#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstring>
#include <cstdio>
#include <exception>
#include <mutex>
#include <numeric>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "command_line.hpp"
#include "research/qkv_trace.hpp"
#include "research/research_policies.hpp"
#include "sparse_pipeline.hpp"
#include "sparsekv/core/error.hpp"
#include "sparsekv/policy/any_policy.hpp"
#include "sparsekv/policy/policy_registry.hpp"

namespace {

using sparsekv::QkvTrace;

void usage() {
  std::fputs(
      "usage: sparsekv-accuracy --trace DIR [options]\n"
      "       sparsekv-accuracy --synthetic [knobs] [--write-trace DIR] [options]\n"
      "  --trace DIR          a Q/K/V dump (format: docs/accuracy.md)\n"
      "  --synthetic          generate one; knobs (defaults):\n"
      "    geometry: --seed 1 --layers 4 --q-heads 8 --kv-heads 2 --head-dim 64 --prompt 4096 --steps 32\n"
      "    topics:   --topics 16 --segment-tokens 512 --segment-topics 3 --run-tokens 16 --key-noise 0.5\n"
      "              --topic-logit 6 --topic-dwell 8 --blend-steps 4 --query-noise 0.3 --head-noise 0.3\n"
      "    planted:  --heavy-hitters 8 --heavy-logit 8 --sink-tokens 4 --sink-logit 5\n"
      "              --recency-logit 2 --recency-tokens 64 --value-topic 0.5\n"
      "  --write-trace DIR    also save the trace that was evaluated\n"
      "  --budgets LIST       token budgets per kv head and step (default 256,512,1024,2048)\n"
      "  --policies LIST      default: all built-in (dense, streaming, quest, shadowkv, retroinfer,\n"
      "                       retroinfer_no_estimation, oracle)\n"
      "  --page-tokens N      KV page size in tokens (default 8)\n"
      "  --first-steps N      evaluate the first N decode steps only (default: all)\n"
      "  --from-step N        measure decode steps N.. only; the steps before still run (default 0)\n"
      "  --needle FIRST:END   prompt tokens [FIRST, END) to follow (a needle): the dense softmax mass on them\n"
      "                       and the share of it each policy attends, overall, per step and per layer\n"
      "  --threads N          runs in parallel (default: the hardware threads)\n"
      "  --per-layer          also print each policy's mass recall per layer (mean over kv heads)\n"
      "  --json               print [{policy, budget_tokens, rel_error, mass_recall, pages_selected,\n"
      "                       mass_recall_by_layer_head: [layer][kv head]}, ...]; with --needle also\n"
      "                       needle_mass, needle_recall, needle_recall_by_step, needle_mass_by_layer_head,\n"
      "                       needle_recall_by_layer_head\n",
      stderr);
}

// Dense attention of every (step, layer), computed once.
struct Reference {
  std::vector<float> out;   // [step][layer][q_heads][head_dim]
  std::vector<double> lse;  // [step][layer][q_heads]
};

Reference reference(const QkvTrace& trace, unsigned threads) {
  const auto& h = trace.header;
  Reference ref;
  ref.out.resize(std::size_t{h.decode_steps} * h.layers * h.q_heads * h.head_dim);
  ref.lse.resize(std::size_t{h.decode_steps} * h.layers * h.q_heads);
  const std::uint32_t jobs = h.decode_steps * h.layers;
  std::vector<std::thread> pool;
  for (unsigned t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      for (std::uint32_t j = t; j < jobs; j += threads) {
        sparsekv::reference_attention(trace, j % h.layers, j / h.layers,
                                      ref.out.data() + std::size_t{j} * h.q_heads * h.head_dim,
                                      ref.lse.data() + std::size_t{j} * h.q_heads);
      }
    });
  }
  for (auto& t : pool) t.join();
  return ref;
}

// part / whole; 1 where there was nothing to keep.
double share(double part, double whole) { return whole > 0 ? part / whole : 1.0; }

struct Result {
  std::string policy;
  std::uint32_t budget = 0;
  double rel_error = 0;             // mean over (step, layer, q head)
  double mass_recall = 0;           // mean over (step, layer, q head)
  double pages_selected = 0;        // mean over (step, layer, kv head), the decode tail excluded
  double tokens_attended = 0;       // mean over (step, layer, kv head), the decode tail included
  std::vector<double> head_recall;  // [layer][kv head]: mass recall, mean over (step, the group's q heads)
  // --needle: dense softmax mass on the needle's tokens, and the part of it
  // on the tokens the policy attended; sums over q heads.
  double needle_mass = 0, needle_attended = 0;
  std::vector<double> step_needle_mass, step_needle_attended;  // [step]
  std::vector<double> head_needle_mass, head_needle_attended;  // [layer][kv head]

  double needle_recall() const { return share(needle_attended, needle_mass); }
};

// What a [layer][kv head] needle sum is divided by for the mean per q head
// and measured step.
double needle_norm(const sparsekv::QkvTraceHeader& h, std::uint32_t from_step) {
  return double(h.decode_steps - from_step) * (h.q_heads / h.kv_heads);
}

// The dense needle mass per q head, layer and measured step.
double mean_needle_mass(const Result& r, const sparsekv::QkvTraceHeader& h, std::uint32_t from_step) {
  return r.needle_mass / (needle_norm(h, from_step) * h.layers * h.kv_heads);
}

// Prompt tokens [first, end) whose attention is followed (--needle).
struct Needle {
  std::uint32_t first = 0, end = 0;
  bool empty() const { return first == end; }
};

// Whether `key` (head_dim floats) is the key of one of the needle's tokens
// in kv head `kv` of layer `l`: the attended pages are found by content, so
// any partitioning (pages, clusters, regroups) is followed.
bool is_needle_key(const QkvTrace& trace, const Needle& needle, std::uint32_t l, std::uint32_t kv, const float* key) {
  const std::uint32_t d = trace.header.head_dim;
  for (std::uint32_t t = needle.first; t < needle.end; ++t) {
    if (std::memcmp(trace.key(l, t) + std::size_t{kv} * d, key, d * sizeof(float)) == 0) return true;
  }
  return false;
}

// One policy at one budget through the pipeline, every decode step and layer.
// Steps before `from_step` run but are not measured.
Result evaluate(const QkvTrace& trace, const Reference& ref, const std::string& policy, std::uint32_t budget,
                std::uint32_t page_tokens, std::uint32_t from_step, const Needle& needle) {
  const auto& h = trace.header;
  const std::uint32_t d = h.head_dim, group = h.q_heads / h.kv_heads;
  const double scale = 1.0 / std::sqrt(double(d));
  sparsekv::tools::SparsePipeline pipeline(h.shape(), sparsekv::make_policy(policy, budget), h.tokens(), page_tokens);
  for (std::uint32_t l = 0; l < h.layers; ++l) pipeline.prefill(l, trace.prompt(l));

  Result r{policy, budget};
  r.head_recall.assign(std::size_t{h.layers} * h.kv_heads, 0.0);
  r.step_needle_mass.assign(h.decode_steps, 0.0);
  r.step_needle_attended.assign(h.decode_steps, 0.0);
  r.head_needle_mass.assign(std::size_t{h.layers} * h.kv_heads, 0.0);
  r.head_needle_attended.assign(std::size_t{h.layers} * h.kv_heads, 0.0);
  std::vector<float> out(std::size_t{h.q_heads} * d);
  std::vector<double> mass(h.q_heads), needle_mass(h.q_heads), needle_attended(h.q_heads);
  const auto weight = [&](const float* qv, const float* key, double lse) {
    double dot = 0;
    for (std::uint32_t i = 0; i < d; ++i) dot += double(qv[i]) * key[i];
    return std::exp(dot * scale - lse);
  };
  const sparsekv::PageLayout& layout = pipeline.buffer().tiers().gpu_pool.layout();
  for (std::uint32_t s = 0; s < h.decode_steps; ++s) {
    for (std::uint32_t l = 0; l < h.layers; ++l) {
      const std::uint32_t token = h.prompt_tokens + s;
      pipeline.append(l, trace.key(l, token), trace.value(l, token));
      const sparsekv::DecodeQuery q = trace.query(l, s);
      pipeline.attend(l, q, out.data());
      if (s < from_step) continue;
      const std::size_t j = std::size_t{s} * h.layers + l;
      const float* want = ref.out.data() + j * h.q_heads * d;
      const double* lse = ref.lse.data() + j * h.q_heads;
      for (std::uint32_t qh = 0; qh < h.q_heads; ++qh) {
        double num = 0, den = 0;
        for (std::uint32_t i = 0; i < d; ++i) {
          const double e = double(out[qh * d + i]) - want[qh * d + i];
          num += e * e;
          den += double(want[qh * d + i]) * want[qh * d + i];
        }
        r.rel_error += den > 0 ? std::sqrt(num / den) : std::sqrt(num);
      }
      // Dense softmax mass on the tokens the policy attended: the keys of the
      // retrieved pages (selected partitions) and of the resident tail.
      std::fill(mass.begin(), mass.end(), 0.0);
      std::fill(needle_mass.begin(), needle_mass.end(), 0.0);
      std::fill(needle_attended.begin(), needle_attended.end(), 0.0);
      for (std::uint32_t t = needle.first; t < needle.end; ++t) {
        for (std::uint32_t qh = 0; qh < h.q_heads; ++qh) {
          needle_mass[qh] += weight(q.head(qh, d), trace.key(l, t) + std::size_t{qh / group} * d, lse[qh]);
        }
      }
      const sparsekv::Retrieval& got = pipeline.retrieval();
      const sparsekv::PagePool& gpu = pipeline.buffer().tiers().gpu_pool;
      const auto add_page = [&](std::uint32_t kv, sparsekv::PageId page, std::uint32_t tokens) {
        const std::byte* base = gpu.data(page);
        for (std::uint32_t slot = 0; slot < tokens; ++slot) {
          const auto* key = reinterpret_cast<const float*>(base + layout.k_offset(slot));
          const bool in_needle = !needle.empty() && is_needle_key(trace, needle, l, kv, key);
          for (std::uint32_t qh = kv * group; qh < (kv + 1) * group; ++qh) {
            const double w = weight(q.head(qh, d), key, lse[qh]);
            mass[qh] += w;
            if (in_needle) needle_attended[qh] += w;
          }
        }
        r.tokens_attended += tokens;
      };
      for (std::uint32_t kv = 0; kv < h.kv_heads; ++kv) {
        got.for_each_page(kv, page_tokens,
                          [&](sparsekv::PageId page, std::uint32_t tokens) { add_page(kv, page, tokens); });
        r.pages_selected +=
            got.pages.partition_offsets[got.head_offsets[kv + 1]] - got.pages.partition_offsets[got.head_offsets[kv]];
      }
      for (std::uint32_t qh = 0; qh < h.q_heads; ++qh) {
        const double m = std::min(mass[qh], 1.0);  // rounding can pass 1 by an ulp
        r.mass_recall += m;
        const std::size_t head = std::size_t{l} * h.kv_heads + qh / group;
        r.head_recall[head] += m;
        r.needle_mass += needle_mass[qh];
        r.needle_attended += needle_attended[qh];
        r.step_needle_mass[s] += needle_mass[qh];
        r.step_needle_attended[s] += needle_attended[qh];
        r.head_needle_mass[head] += needle_mass[qh];
        r.head_needle_attended[head] += needle_attended[qh];
      }
    }
  }
  const std::uint32_t steps = h.decode_steps - from_step;
  const double qn = double(steps) * h.layers * h.q_heads, kn = double(steps) * h.layers * h.kv_heads;
  r.rel_error /= qn;
  r.mass_recall /= qn;
  r.pages_selected /= kn;
  r.tokens_attended /= kn;
  for (double& m : r.head_recall) m /= double(steps) * group;
  return r;
}

sparsekv::SyntheticQkvOptions synthetic_options(const sparsekv::tools::CommandLine& args) {
  sparsekv::SyntheticQkvOptions o;
  o.seed = args.number<std::uint64_t>("--seed", o.seed);
  o.layers = args.number<std::uint32_t>("--layers", o.layers);
  o.q_heads = args.number<std::uint32_t>("--q-heads", o.q_heads);
  o.kv_heads = args.number<std::uint32_t>("--kv-heads", o.kv_heads);
  o.head_dim = args.number<std::uint32_t>("--head-dim", o.head_dim);
  o.prompt_tokens = args.number<std::uint32_t>("--prompt", o.prompt_tokens);
  o.decode_steps = args.number<std::uint32_t>("--steps", o.decode_steps);
  o.topics = args.number<std::uint32_t>("--topics", o.topics);
  o.segment_tokens = args.number<std::uint32_t>("--segment-tokens", o.segment_tokens);
  o.segment_topics = args.number<std::uint32_t>("--segment-topics", o.segment_topics);
  o.run_tokens = args.number<double>("--run-tokens", o.run_tokens);
  o.key_noise = args.number<double>("--key-noise", o.key_noise);
  o.topic_logit = args.number<double>("--topic-logit", o.topic_logit);
  o.topic_dwell = args.number<double>("--topic-dwell", o.topic_dwell);
  o.blend_steps = args.number<std::uint32_t>("--blend-steps", o.blend_steps);
  o.query_noise = args.number<double>("--query-noise", o.query_noise);
  o.head_noise = args.number<double>("--head-noise", o.head_noise);
  o.heavy_hitters = args.number<std::uint32_t>("--heavy-hitters", o.heavy_hitters);
  o.heavy_logit = args.number<double>("--heavy-logit", o.heavy_logit);
  o.sink_tokens = args.number<std::uint32_t>("--sink-tokens", o.sink_tokens);
  o.sink_logit = args.number<double>("--sink-logit", o.sink_logit);
  o.recency_logit = args.number<double>("--recency-logit", o.recency_logit);
  o.recency_tokens = args.number<double>("--recency-tokens", o.recency_tokens);
  o.value_topic = args.number<double>("--value-topic", o.value_topic);
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  sparsekv::register_research_policies();
  try {
    const std::set<std::string> knobs = {
        "--seed",        "--layers",      "--q-heads",        "--kv-heads",       "--head-dim",       "--prompt",
        "--steps",       "--topics",      "--segment-tokens", "--segment-topics", "--run-tokens",     "--key-noise",
        "--topic-logit", "--topic-dwell", "--blend-steps",    "--query-noise",    "--head-noise",     "--heavy-hitters",
        "--heavy-logit", "--sink-tokens", "--sink-logit",     "--recency-logit",  "--recency-tokens", "--value-topic"};
    std::set<std::string> flags = knobs;
    flags.insert({"--trace", "--write-trace", "--budgets", "--policies", "--page-tokens", "--threads", "--first-steps",
                  "--from-step", "--needle"});
    const sparsekv::tools::CommandLine args(argc, argv, flags, {"--synthetic", "--json", "--per-layer", "--help"});
    if (args.has("--help")) {
      usage();
      return 0;
    }
    if (args.has("--trace") == args.has("--synthetic")) {
      throw std::invalid_argument("give exactly one of --trace DIR and --synthetic");
    }
    for (const auto& knob : knobs) {
      if (args.has(knob) && !args.has("--synthetic")) throw std::invalid_argument(knob + " needs --synthetic");
    }
    const std::vector<std::uint32_t> budgets = args.number_list("--budgets", "256,512,1024,2048", 1);
    const std::vector<std::string> known = sparsekv::policy_names();
    std::vector<std::string> policies = known;
    if (args.has("--policies")) {
      policies.clear();
      for (const std::string& p : args.list("--policies", "")) {
        if (std::find(known.begin(), known.end(), p) == known.end()) {
          throw std::invalid_argument(fmt::format("--policies: unknown policy '{}'", p));
        }
        if (std::find(policies.begin(), policies.end(), p) == policies.end()) policies.push_back(p);
      }
    }
    const auto page_tokens = args.number<std::uint32_t>("--page-tokens", 8);
    const unsigned threads =
        std::max(1u, args.number<unsigned>("--threads", std::max(1u, std::thread::hardware_concurrency())));

    QkvTrace trace;
    if (args.has("--trace")) {
      trace = sparsekv::read_qkv_trace(args.text("--trace", ""));
    } else {
      trace = sparsekv::synthetic_qkv_trace(synthetic_options(args));
    }
    trace.validate();
    if (args.has("--first-steps")) {
      // The first N decode steps only: the prompt and every layer's arrays as
      // if the trace had stopped there.
      const auto steps = args.number<std::uint32_t>("--first-steps", 0);
      if (steps == 0 || steps > trace.header.decode_steps) {
        throw std::invalid_argument(
            fmt::format("--first-steps {}: the trace has {} decode steps", steps, trace.header.decode_steps));
      }
      trace.header.decode_steps = steps;
      for (sparsekv::QkvLayer& layer : trace.layers) {
        layer.keys.resize(trace.header.kv_floats());
        layer.values.resize(trace.header.kv_floats());
        layer.queries.resize(trace.header.q_floats());
      }
      trace.validate();
    }
    const auto from_step = args.number<std::uint32_t>("--from-step", 0);
    if (from_step >= trace.header.decode_steps) {
      throw std::invalid_argument(
          fmt::format("--from-step {}: the trace has {} decode steps", from_step, trace.header.decode_steps));
    }
    Needle needle;
    if (args.has("--needle")) {
      const std::string spec = args.text("--needle", "");
      std::uint32_t ends[2] = {0, 0};
      const char* const last = spec.data() + spec.size();
      const auto [colon, ec1] = std::from_chars(spec.data(), last, ends[0]);
      const bool parsed = ec1 == std::errc{} && colon != last && *colon == ':' &&
                          std::from_chars(colon + 1, last, ends[1]).ptr == last && colon + 1 != last;
      if (!parsed || ends[0] >= ends[1] || ends[1] > trace.header.prompt_tokens) {
        throw std::invalid_argument(
            fmt::format("--needle {}: want FIRST:END with FIRST < END <= {} (the prompt's tokens)", spec,
                        trace.header.prompt_tokens));
      }
      needle = {ends[0], ends[1]};
    }
    if (args.has("--write-trace")) sparsekv::write_qkv_trace(args.text("--write-trace", ""), trace);

    // Jobs: dense ignores the budget, so it runs once and fills every budget's row.
    struct Job {
      std::string policy;
      std::uint32_t budget;
    };
    std::vector<Job> jobs;
    for (const auto& p : policies) {
      if (p == "dense")
        jobs.push_back({p, 0});
      else
        for (std::uint32_t b : budgets) jobs.push_back({p, b});
    }
    const Reference ref = reference(trace, threads);
    std::vector<Result> done(jobs.size());
    std::vector<std::exception_ptr> errors(jobs.size());
    {
      std::mutex mutex;
      std::size_t next = 0;
      std::vector<std::thread> pool;
      for (unsigned t = 0; t < std::min<std::size_t>(threads, jobs.size()); ++t) {
        pool.emplace_back([&] {
          while (true) {
            std::size_t i;
            {
              std::lock_guard lock(mutex);
              if (next == jobs.size()) return;
              i = next++;
            }
            try {
              done[i] = evaluate(trace, ref, jobs[i].policy, jobs[i].budget, page_tokens, from_step, needle);
            } catch (...) {
              errors[i] = std::current_exception();
            }
          }
        });
      }
      for (auto& t : pool) t.join();
    }
    for (const auto& e : errors)
      if (e) std::rethrow_exception(e);

    // Rows by budget, then in policy order.
    std::vector<Result> rows;
    for (std::uint32_t b : budgets) {
      for (const auto& p : policies) {
        for (const Result& r : done) {
          if (r.policy == p && (r.budget == b || p == "dense")) {
            rows.push_back(r);
            rows.back().budget = b;
          }
        }
      }
    }

    std::string out;
    if (args.has("--json")) {
      out = "[\n";
      for (std::size_t i = 0; i < rows.size(); ++i) {
        const Result& r = rows[i];
        std::vector<std::string> layers;
        for (std::uint32_t l = 0; l < trace.header.layers; ++l) {
          const auto first = r.head_recall.begin() + std::ptrdiff_t{l} * trace.header.kv_heads;
          layers.push_back(fmt::format("[{:.4f}]", fmt::join(first, first + trace.header.kv_heads, ", ")));
        }
        std::string needle_fields;
        if (!needle.empty()) {
          const auto ratios = [](const std::vector<double>& part, const std::vector<double>& whole) {
            std::vector<std::string> v;
            for (std::size_t k = 0; k < part.size(); ++k) v.push_back(fmt::format("{:.4f}", share(part[k], whole[k])));
            return v;
          };
          const std::uint32_t kv = trace.header.kv_heads;
          const std::vector<std::string> steps = ratios(r.step_needle_attended, r.step_needle_mass);
          const std::vector<std::string> heads = ratios(r.head_needle_attended, r.head_needle_mass);
          std::vector<std::string> mass_layers, recall_layers;
          for (std::uint32_t l = 0; l < trace.header.layers; ++l) {
            const auto first = r.head_needle_mass.begin() + std::ptrdiff_t{l} * kv;
            std::vector<std::string> m;
            for (auto it = first; it != first + kv; ++it)
              m.push_back(fmt::format("{:.4f}", *it / needle_norm(trace.header, from_step)));
            mass_layers.push_back(fmt::format("[{}]", fmt::join(m, ", ")));
            recall_layers.push_back(fmt::format("[{}]", fmt::join(heads.begin() + std::ptrdiff_t{l} * kv,
                                                                  heads.begin() + std::ptrdiff_t{l + 1} * kv, ", ")));
          }
          needle_fields = fmt::format(
              ", \"needle_mass\": {:.6f}, \"needle_recall\": {:.6f}, \"needle_recall_by_step\": [{}], "
              "\"needle_mass_by_layer_head\": [{}], \"needle_recall_by_layer_head\": [{}]",
              mean_needle_mass(r, trace.header, from_step), r.needle_recall(),
              fmt::join(steps.begin() + from_step, steps.end(), ", "), fmt::join(mass_layers, ", "),
              fmt::join(recall_layers, ", "));
        }
        out += fmt::format(
            "  {{\"policy\": \"{}\", \"budget_tokens\": {}, \"rel_error\": {:.6g}, \"mass_recall\": {:.6f}, "
            "\"pages_selected\": {:.2f}, \"mass_recall_by_layer_head\": [{}]{}}}{}\n",
            r.policy, r.budget, r.rel_error, r.mass_recall, r.pages_selected, fmt::join(layers, ", "), needle_fields,
            i + 1 < rows.size() ? "," : "");
      }
      out += "]\n";
    } else {
      const auto& h = trace.header;
      out = fmt::format(
          "trace: {}: {} layers, {} q heads / {} kv heads, head_dim {}, {} prompt tokens + {} decode steps ({})\n"
          "page {} tokens; budget = tokens per kv head and step; rel error = ||o - o_dense|| / ||o_dense||, mass "
          "recall = dense softmax mass on the attended tokens (selected pages + decode tail), both means over "
          "(step, layer, q head); pages and tokens per (step, layer, kv head)\n",
          args.has("--trace") ? args.text("--trace", "") : "synthetic", h.layers, h.q_heads, h.kv_heads, h.head_dim,
          h.prompt_tokens, h.decode_steps, h.model.empty() ? "unnamed" : h.model, page_tokens);
      if (from_step > 0) out += fmt::format("measured: decode steps {}..{}\n", from_step, h.decode_steps - 1);
      if (!needle.empty()) {
        out += fmt::format(
            "needle: prompt tokens {}..{}; needle mass = dense softmax mass on them (mean over step, layer, q head), "
            "needle recall = the share of that mass on the tokens the policy attended\n",
            needle.first, needle.end - 1);
      }
      for (std::size_t i = 0; i < rows.size(); ++i) {
        if (i == 0 || rows[i].budget != rows[i - 1].budget) {
          out += fmt::format("\n{:<7} {:<25} {:>10} {:>12} {:>8} {:>8}", "budget", "policy", "rel error", "mass recall",
                             "pages", "tokens");
          out += needle.empty() ? "\n" : fmt::format(" {:>12} {:>13}\n", "needle mass", "needle recall");
        }
        const Result& r = rows[i];
        out += fmt::format("{:<7} {:<25} {:>10.4f} {:>11.2f}% {:>8.1f} {:>8.1f}", r.budget, r.policy, r.rel_error,
                           100 * r.mass_recall, r.pages_selected, r.tokens_attended);
        out += needle.empty() ? "\n"
                              : fmt::format(" {:>11.2f}% {:>12.2f}%\n", 100 * mean_needle_mass(r, h, from_step),
                                            100 * r.needle_recall());
      }
      // Per budget: one line per step (or layer), the dense needle mass and each policy's needle recall.
      const auto needle_table = [&](const char* what, std::uint32_t from, std::uint32_t count, auto&& mass_of,
                                    auto&& recall_of) {
        for (std::size_t i = 0; i < rows.size();) {
          std::size_t end = i;
          while (end < rows.size() && rows[end].budget == rows[i].budget) ++end;
          out +=
              fmt::format("\nneedle recall by {}, budget {}\n{:<6} {:>12}", what, rows[i].budget, what, "needle mass");
          for (std::size_t j = i; j < end; ++j) out += fmt::format(" {:>12.12}", rows[j].policy);
          out += "\n";
          for (std::uint32_t k = from; k < count; ++k) {
            out += fmt::format("{:<6} {:>11.2f}%", k, 100 * mass_of(rows[i], k));
            for (std::size_t j = i; j < end; ++j) out += fmt::format(" {:>11.2f}%", 100 * recall_of(rows[j], k));
            out += "\n";
          }
          i = end;
        }
      };
      if (!needle.empty()) {
        needle_table(
            "step", from_step, h.decode_steps,
            [&](const Result& r, std::uint32_t s) { return r.step_needle_mass[s] / (double(h.layers) * h.q_heads); },
            [&](const Result& r, std::uint32_t s) { return share(r.step_needle_attended[s], r.step_needle_mass[s]); });
      }
      if (!needle.empty() && args.has("--per-layer")) {
        const auto layer_sum = [&](const std::vector<double>& v, std::uint32_t l) {
          const auto first = v.begin() + std::ptrdiff_t{l} * h.kv_heads;
          return std::accumulate(first, first + h.kv_heads, 0.0);
        };
        needle_table(
            "layer", 0, h.layers,
            [&](const Result& r, std::uint32_t l) {
              return layer_sum(r.head_needle_mass, l) / (needle_norm(h, from_step) * h.kv_heads);
            },
            [&](const Result& r, std::uint32_t l) {
              return share(layer_sum(r.head_needle_attended, l), layer_sum(r.head_needle_mass, l));
            });
      }
      if (args.has("--per-layer")) {
        // Per budget: one line per layer, each policy's mass recall (mean over kv heads).
        const std::uint32_t kv = h.kv_heads;
        for (std::size_t i = 0; i < rows.size();) {
          std::size_t end = i;
          while (end < rows.size() && rows[end].budget == rows[i].budget) ++end;
          out += fmt::format("\nmass recall by layer, budget {}\n{:<6}", rows[i].budget, "layer");
          for (std::size_t j = i; j < end; ++j) out += fmt::format(" {:>12.12}", rows[j].policy);
          out += "\n";
          for (std::uint32_t l = 0; l < h.layers; ++l) {
            out += fmt::format("{:<6}", l);
            for (std::size_t j = i; j < end; ++j) {
              const auto first = rows[j].head_recall.begin() + std::ptrdiff_t{l} * kv;
              out += fmt::format(" {:>11.2f}%", 100 * std::accumulate(first, first + kv, 0.0) / kv);
            }
            out += "\n";
          }
          i = end;
        }
      }
    }
    std::fputs(out.c_str(), stdout);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "sparsekv-accuracy: %s\n", e.what());
    usage();
    return 2;
  }
}
