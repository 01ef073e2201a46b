// sparsekv-eviction-report: what permanent token eviction does to the pages a
// request holds (SpvLLM §3.2), on a synthetic decode run long enough for the
// strategies to part ways. For each eviction policy (h2o, streaming_evict)
// and budget, one request per strategy (no_op, free_block, sparse_copy,
// slot_reuse; docs/eviction.md) decodes the same random stream in lockstep
// through a RuntimeManager: a prompt, then --steps decode steps. After every
// step it records the CPU pages the request holds and the live slots in them;
// utilisation is live slots / slots of the pages held, internal fragmentation
// one minus it. The reference line is what an unsparsified paged cache of the
// same live tokens would hold (ceil(live / page_tokens) pages per head: only
// the last page partial), SpvLLM's dashed line. Also reported: pages freed,
// pages and rows copied by sparse_copy, wall time per step, and the largest
// difference of each strategy's attention output from no_op's (the strategies
// move bytes, never change which tokens are live, so it is round-off only).
//
// The stream: keys and values N(0, 1); one token in 32 is a heavy hitter,
// its key pushed along a unit per-head direction that the queries share
// (scaled logit about 4 above the rest), so H2O has something to keep. The model run of the same figures is
// `sparsekv-eval-model --policies h2o,streaming_evict --strategies ...`.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <exception>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "command_line.hpp"
#include "sparsekv/facade/manager_inspection.hpp"
#include "sparsekv/sparsekv.hpp"

namespace {

using Clock = std::chrono::steady_clock;
constexpr const char* kProgram = "sparsekv-eviction-report";

void usage() {
  std::fputs(
      "usage: sparsekv-eviction-report [--policies h2o,streaming_evict] [--budgets 256,512,1024]\n"
      "                                [--strategies no_op,free_block,sparse_copy,slot_reuse]\n"
      "                                [--prompt 512] [--steps 4000] [--layers 2] [--kv-heads 2] [--group 2]\n"
      "                                [--head-dim 64] [--seed 1] [--every 20] [--json]\n"
      "  --prompt N     prompt tokens, prefilled before the decode steps\n"
      "  --steps N      decode steps\n"
      "  --every N      timeline sample period in steps (--json)\n",
      stderr);
}

// One strategy's run of one (policy, budget).
struct Run {
  sparsekv::EvictionStrategy strategy{};
  std::unique_ptr<sparsekv::RuntimeManager> manager;
  std::vector<std::uint64_t> held, live;  // per step, over every (layer, kv head)
  std::vector<float> out;
  double max_out_diff = 0;
  double decode_s = 0;
};

double mean(const std::vector<double>& x) {
  double s = 0;
  for (double v : x) s += v;
  return x.empty() ? 0.0 : s / x.size();
}

double p99(std::vector<double> x) {
  if (x.empty()) return 0;
  std::sort(x.begin(), x.end());
  return x[std::min(x.size() - 1, static_cast<std::size_t>(std::ceil(0.99 * x.size())) - 1)];
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const sparsekv::tools::CommandLine args(
        argc, argv,
        std::set<std::string>{"--policies", "--budgets", "--strategies", "--prompt", "--steps", "--layers",
                              "--kv-heads", "--group", "--head-dim", "--seed", "--every"},
        std::set<std::string>{"--json", "--help"});
    if (args.has("--help")) {
      usage();
      return 0;
    }
    const std::vector<std::string> policies = args.list("--policies", "h2o,streaming_evict");
    const std::vector<std::uint32_t> budgets = args.number_list("--budgets", "256,512,1024", 1);
    std::vector<sparsekv::EvictionStrategy> strategies;
    for (const std::string& s : args.list("--strategies", "no_op,free_block,sparse_copy,slot_reuse")) {
      strategies.push_back(sparsekv::parse_eviction_strategy(s));
    }
    const auto prompt = args.number<std::uint32_t>("--prompt", 512);
    const auto steps = args.number<std::uint32_t>("--steps", 4000);
    const auto every = args.number<std::uint32_t>("--every", 20);
    const auto seed = args.number<std::uint32_t>("--seed", 1);
    sparsekv::ModelShape shape;
    shape.layers = args.number<std::uint32_t>("--layers", 2);
    shape.kv_heads = args.number<std::uint32_t>("--kv-heads", 2);
    shape.q_heads = shape.kv_heads * args.number<std::uint32_t>("--group", 2);
    shape.head_dim = args.number<std::uint32_t>("--head-dim", 64);
    shape.dtype = sparsekv::DType::f32;
    if (prompt == 0 || steps == 0 || every == 0)
      throw std::invalid_argument("--prompt, --steps and --every must be > 0");
    const auto names = sparsekv::eviction_policy_names();
    for (const std::string& p : policies) {
      if (std::find(names.begin(), names.end(), p) == names.end()) {
        throw std::invalid_argument(
            fmt::format("--policies: '{}' does not evict tokens (eviction policies: {})", p, fmt::join(names, ", ")));
      }
      for (std::uint32_t b : budgets) sparsekv::make_policy(p, b);  // a budget below the protected window fails here
    }
    const bool json = args.has("--json");

    sparsekv::Config config;
    config.max_requests = 1;
    config.max_context_tokens = prompt + steps + config.page_tokens;
    config.min_buffer_ratio = 0;  // every live page is selected each step: no buffering pages to fill
    const std::size_t heads = std::size_t{shape.layers} * shape.kv_heads;
    const std::size_t context_pages = config.max_pages_per_head() + 1;
    config.cpu_tier_bytes = heads * (context_pages + 64) * config.page_bytes(shape);
    config.gpu_tier_bytes = heads * (context_pages + 2) * config.page_bytes(shape);
    config.host_chunk_bytes = std::min<std::size_t>(config.cpu_tier_bytes, std::size_t{64} << 20);
    const std::uint32_t pt = config.page_tokens;
    const std::uint32_t hd = shape.head_dim;
    const std::size_t kv_row = heads / shape.layers * hd, q_row = std::size_t{shape.q_heads} * hd;

    if (!json) {
      fmt::print(
          "{}: {} prompt tokens + {} decode steps, {} layers x {} kv heads (group {}), head_dim {}, page {} tokens\n",
          kProgram, prompt, steps, shape.layers, shape.kv_heads, shape.group_size(), hd, pt);
      fmt::print("  {:<16} {:>7} {:>12} {:>12} {:>14} {:>10} {:>10} {:>10} {:>10} {:>9} {:>12}\n", "policy", "budget",
                 "strategy", "utilisation", "p99 fragment.", "held mean", "held max", "freed", "copied", "step us",
                 "max out diff");
    } else {
      fmt::print(
          "{{\"prompt_tokens\": {}, \"steps\": {}, \"layers\": {}, \"kv_heads\": {}, \"q_heads\": {}, \"head_dim\": "
          "{}, "
          "\"page_tokens\": {}, \"seed\": {}, \"every\": {}, \"results\": [",
          prompt, steps, shape.layers, shape.kv_heads, shape.q_heads, hd, pt, seed, every);
    }
    bool first_row = true;
    for (const std::string& policy : policies) {
      for (const std::uint32_t budget : budgets) {
        std::vector<Run> runs(strategies.size());
        for (std::size_t i = 0; i < runs.size(); ++i) {
          sparsekv::Config c = config;
          c.eviction_strategy = strategies[i];
          runs[i].strategy = strategies[i];
          runs[i].manager = std::make_unique<sparsekv::RuntimeManager>(shape, c, sparsekv::make_policy(policy, budget));
          runs[i].manager->add_request(1, prompt + steps);
          runs[i].out.resize(q_row);
        }
        // The same stream for every strategy (and every budget and policy).
        std::mt19937_64 rng(seed);
        std::normal_distribution<float> normal(0.0f, 1.0f);
        std::bernoulli_distribution heavy(1.0 / 32);
        std::vector<float> direction(kv_row);
        for (float& x : direction) x = normal(rng) / std::sqrt(float(hd));
        const auto token = [&](std::vector<float>& k, std::vector<float>& v, std::size_t rows) {
          k.resize(rows * kv_row);
          v.resize(rows * kv_row);
          for (std::size_t r = 0; r < rows; ++r) {
            const float push = heavy(rng) ? 8.0f : 0.0f;
            for (std::size_t i = 0; i < kv_row; ++i) {
              k[r * kv_row + i] = normal(rng) + push * direction[i];
              v[r * kv_row + i] = normal(rng);
            }
          }
        };
        std::vector<float> k, v, q(q_row);
        token(k, v, prompt);
        for (std::uint32_t l = 0; l < shape.layers; ++l) {
          for (Run& run : runs) run.manager->prefill(1, l, k.data(), v.data(), prompt);
        }
        const sparsekv::RequestId id = 1;
        for (std::uint32_t s = 0; s < steps; ++s) {
          token(k, v, 1);
          for (std::uint32_t h = 0; h < shape.q_heads; ++h) {
            const std::uint32_t kvh = h / shape.group_size();
            for (std::uint32_t d = 0; d < hd; ++d) q[h * hd + d] = 0.5f * normal(rng) + 4.0f * direction[kvh * hd + d];
          }
          for (std::uint32_t l = 0; l < shape.layers; ++l) {
            for (Run& run : runs) {
              const auto t0 = Clock::now();
              run.manager->decode(std::span(&id, 1), l, q.data(), k.data(), v.data(), run.out.data());
              run.decode_s += std::chrono::duration<double>(Clock::now() - t0).count();
            }
            for (Run& run : runs) {
              for (std::size_t i = 0; i < q_row; ++i) {
                const double diff = std::abs(double(run.out[i]) - double(runs.front().out[i]));
                // A NaN must show, not vanish in std::max.
                run.max_out_diff = std::isnan(diff) ? diff : std::max(run.max_out_diff, diff);
              }
            }
          }
          for (Run& run : runs) {
            run.held.push_back(sparsekv::inspect_buffer(*run.manager).evictor().held_pages(id));
            run.live.push_back(sparsekv::inspect_buffer(*run.manager).evictor().live_slots(id));
          }
        }
        // Unsparsified paged cache of the same live tokens: only each head's last page is partial.
        std::uint64_t unsparsified = 0;
        for (std::uint32_t l = 0; l < shape.layers; ++l) {
          for (std::uint32_t h = 0; h < shape.kv_heads; ++h) {
            unsparsified +=
                (sparsekv::inspect_buffer(*runs.front().manager).evictor().live_tokens(id, l, h) + pt - 1) / pt;
          }
        }
        for (const Run& run : runs) {
          std::vector<double> u, frag;
          double held_sum = 0;
          for (std::size_t s = 0; s < run.held.size(); ++s) {
            u.push_back(run.held[s] ? double(run.live[s]) / double(run.held[s] * pt) : 1.0);
            frag.push_back(1 - u.back());
            held_sum += double(run.held[s]);
          }
          const sparsekv::BufferStats st = run.manager->tier_usage().stats;
          const double held_mean = held_sum / double(run.held.size());
          const std::uint64_t held_max = *std::max_element(run.held.begin(), run.held.end());
          const double step_us = 1e6 * run.decode_s / (double(steps) * shape.layers);
          if (json) {
            std::vector<std::string> timeline;
            for (std::size_t s = every - 1; s < run.held.size(); s += every) {
              timeline.push_back(fmt::format("[{}, {}, {}]", s + 1, run.held[s], run.live[s]));
            }
            fmt::print(
                "{}{{\"policy\": \"{}\", \"budget_tokens\": {}, \"strategy\": \"{}\", \"utilisation_mean\": {:.6f}, "
                "\"fragmentation_p99\": {:.6f}, \"pages_held_mean\": {:.1f}, \"pages_held_max\": {}, "
                "\"pages_held_final\": {}, \"unsparsified_pages_final\": {}, \"pages_freed\": {}, "
                "\"pages_copied\": {}, \"slots_copied\": {}, \"step_us\": {:.2f}, \"max_out_diff\": {:.3g}, "
                "\"timeline\": [{}]}}",
                first_row ? "" : ", ", policy, budget, sparsekv::to_string(run.strategy), mean(u), p99(frag), held_mean,
                held_max, run.held.back(), unsparsified, st.pages_freed, st.pages_copied, st.slots_copied, step_us,
                run.max_out_diff, fmt::join(timeline, ", "));
          } else {
            fmt::print(
                "  {:<16} {:>7} {:>12} {:>11.1f}% {:>13.1f}% {:>10.0f} {:>10} {:>10} {:>10} {:>9.1f} {:>12.2g}\n",
                policy, budget, sparsekv::to_string(run.strategy), 100 * mean(u), 100 * p99(frag), held_mean, held_max,
                st.pages_freed, st.pages_copied, step_us, run.max_out_diff);
          }
          first_row = false;
        }
        if (!json) {
          fmt::print(
              "  {:<16} {:>7} {:>12} {:>11.1f}%   (a paged cache of the live tokens alone: {} pages at the end)\n",
              policy, budget, "unsparsified", 100.0 * double(runs.front().live.back()) / double(unsparsified * pt),
              unsparsified);
        }
      }
    }
    if (json) fmt::print("]}}\n");
    return 0;
  } catch (const std::exception& e) {  // every failure is the user's to fix: one line, exit 2
    std::fprintf(stderr, "%s: %s\n", kProgram, e.what());
    return 2;
  }
}
