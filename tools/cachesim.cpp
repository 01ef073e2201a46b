// sparsekv-cachesim: replays a selection trace (selection_trace.hpp) through
// the GPU-buffer replacement policies of Spin §5.3 — bucketed LRU, exact LRU
// and Belady's offline bound — at buffers of 1x, 2x, 5x and 10x each head's
// mandatory pages (Spin §5.3 "Buffer Elasticity" sets the minimum at 5x), and
// prints hit ratio, pages moved and the replacement time per (layer, head)
// step. With --overlap it prints instead the step-to-step selection overlap
// (SparseServe §3.3, Fig. 8) for windows 1..16. docs/cachesim.md describes the
// trace format, generator and columns.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <exception>
#include <fstream>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>

#include "command_line.hpp"
#include "research/selection_trace.hpp"
#include "sparsekv/cache/belady.hpp"
#include "sparsekv/cache/bucketed_lru.hpp"
#include "sparsekv/cache/exact_lru.hpp"
#include "sparsekv/core/error.hpp"

namespace {

using sparsekv::CacheStepStats;
using sparsekv::SelectionTrace;

constexpr std::uint32_t kRatios[] = {1, 2, 5, 10};
constexpr const char* kPolicies[] = {"bucketed_lru", "exact_lru", "belady"};
constexpr std::uint32_t kMaxOverlapWindow = 16;

struct Result {
  const char* policy;
  std::uint32_t ratio;
  CacheStepStats stats;
  double ns_per_step;
};

void usage() {
  std::fputs(
      "usage: sparsekv-cachesim --trace FILE [--json] [--buckets N | --overlap]\n"
      "       sparsekv-cachesim --synthetic [knobs] [--write-trace FILE] [--json] [--buckets N | --overlap]\n"
      "  --trace FILE       replay a selection trace (format: docs/cachesim.md)\n"
      "  --synthetic        generate one; knobs (defaults):\n"
      "    --seed 1 --layers 2 --kv-heads 4 --steps 512 --partitions 2048 --selected 64 --max-pages 1\n"
      "    --reuse 0.85 --window 12 --recency-decay 0.3 --zipf 0.8 --drift 2\n"
      "  --write-trace FILE also save the trace that was replayed\n"
      "  --buckets N        bucketed-LRU timestamp buckets (default 64)\n"
      "  --overlap          instead of the replay, print the selection overlap (SparseServe Fig. 8) for\n"
      "                     windows 1..16: with the union of the last w steps and with step t-w alone\n"
      "  --json             print [{policy, buffer_ratio, hit_ratio, pages_moved, ns_per_step}, ...]\n"
      "                     (with --overlap: [{window, union_overlap, distance_overlap}, ...])\n",
      stderr);
}

SelectionTrace load(const std::string& path) {
  std::ifstream in(path);
  if (!in) sparsekv::fail(sparsekv::ErrorCode::not_found, "cannot open trace '{}'", path);
  return sparsekv::read_selection_trace(in);
}

// Replays every head through one policy at one buffer ratio.
Result simulate(const SelectionTrace& trace, const char* policy, std::uint32_t ratio, std::uint32_t buckets) {
  using Clock = std::chrono::steady_clock;
  Result result{policy, ratio, {}, 0.0};
  Clock::duration elapsed{};
  std::uint64_t head_steps = 0;
  const std::string_view name = policy;
  for (std::uint32_t h = 0; h < trace.heads(); ++h) {
    const std::uint64_t mandatory = trace.mandatory_pages(h);
    if (mandatory == 0) continue;  // a head that never selects has no buffer
    if (mandatory * ratio > UINT32_MAX) {
      sparsekv::fail(sparsekv::ErrorCode::invalid_argument, "head {}: {}x {} mandatory pages overflow 32 bits", h,
                     ratio, mandatory);
    }
    const auto capacity = std::uint32_t(mandatory * ratio);
    const auto& pages = trace.partition_pages[h];
    Clock::time_point start;
    if (name == "bucketed_lru") {
      sparsekv::BucketedLruCache cache(capacity, pages, buckets);
      start = Clock::now();
      for (const auto& step : trace.selections) result.stats += cache.step(step[h]);
    } else if (name == "exact_lru") {
      sparsekv::ExactLru lru(capacity);
      start = Clock::now();
      for (const auto& step : trace.selections) result.stats += lru.step(step[h], pages);
    } else {
      // Offline: the next-use precomputation in the constructor is not timed.
      sparsekv::Belady belady(capacity, trace.head_selections(h), pages);
      start = Clock::now();
      while (!belady.done()) result.stats += belady.step();
    }
    elapsed += Clock::now() - start;
    head_steps += trace.steps();
  }
  const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(elapsed).count();
  result.ns_per_step = head_steps == 0 ? 0.0 : double(ns) / double(head_steps);
  return result;
}

std::string describe(const SelectionTrace& trace, const std::string& source) {
  std::uint64_t lo = UINT64_MAX, hi = 0, selected = 0, nonempty = 0;
  for (std::uint32_t h = 0; h < trace.heads(); ++h) {
    const std::uint64_t m = trace.mandatory_pages(h);
    lo = std::min(lo, m);
    hi = std::max(hi, m);
  }
  for (const auto& step : trace.selections) {
    for (const auto& sel : step) {
      selected += sel.size();
      nonempty += !sel.empty();
    }
  }
  std::string out = fmt::format(
      "{}: {} layers x {} kv heads, {} steps, {:.1f} partitions selected per (step, head); mandatory pages per head "
      "{}..{}\n",
      source, trace.layers, trace.kv_heads, trace.steps(), nonempty ? double(selected) / double(nonempty) : 0.0, lo,
      hi);
  if (trace.steps() > 12) {
    out += fmt::format(
        "selection overlap (SparseServe Fig. 8): with step t-1 {:.1f}%, t-4 {:.1f}%, t-12 {:.1f}%; with the union of "
        "the last 4 steps {:.1f}%, of the last 12 steps {:.1f}%\n",
        100 * sparsekv::selection_overlap(trace, 1), 100 * sparsekv::selection_overlap(trace, 4, true),
        100 * sparsekv::selection_overlap(trace, 12, true), 100 * sparsekv::selection_overlap(trace, 4),
        100 * sparsekv::selection_overlap(trace, 12));
  }
  return out;
}

// SparseServe Fig. 8's overlap for windows 1..kMaxOverlapWindow: the union of
// the last w steps, and step t-w alone. Windows the trace is too short for
// (steps <= w) are left out.
std::string overlap_report(const SelectionTrace& trace, const std::string& source, bool json) {
  const auto last = std::uint32_t(std::min<std::size_t>(kMaxOverlapWindow, trace.steps() == 0 ? 0 : trace.steps() - 1));
  std::string out;
  if (json) {
    out = "[\n";
  } else {
    out = describe(trace, source);
    out +=
        "overlap = mean share of a step's selected partitions that the same head selected in the union of the last "
        "w steps (union) or in step t-w alone (distance), over steps >= w and all heads (SparseServe Fig. 8)\n\n";
    out += fmt::format("{:>6} {:>14} {:>17}\n", "window", "union overlap", "distance overlap");
  }
  for (std::uint32_t w = 1; w <= last; ++w) {
    const double all = sparsekv::selection_overlap(trace, w);
    const double only = sparsekv::selection_overlap(trace, w, true);
    if (json) {
      out += fmt::format("  {{\"window\": {}, \"union_overlap\": {:.6f}, \"distance_overlap\": {:.6f}}}{}\n", w, all,
                         only, w < last ? "," : "");
    } else {
      out += fmt::format("{:>6} {:>13.1f}% {:>16.1f}%\n", w, 100 * all, 100 * only);
    }
  }
  if (json) out += "]\n";
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const std::set<std::string> knobs = {"--seed",       "--layers",        "--kv-heads",  "--steps",
                                         "--partitions", "--selected",      "--max-pages", "--reuse",
                                         "--window",     "--recency-decay", "--zipf",      "--drift"};
    std::set<std::string> flags = knobs;
    flags.insert({"--trace", "--write-trace", "--buckets"});
    const sparsekv::tools::CommandLine args(argc, argv, flags, {"--synthetic", "--json", "--overlap", "--help"});
    if (args.has("--help")) {
      usage();
      return 0;
    }
    if (args.has("--trace") == args.has("--synthetic")) {
      throw std::invalid_argument("give exactly one of --trace FILE and --synthetic");
    }
    for (const auto& knob : knobs) {
      if (args.has(knob) && !args.has("--synthetic")) throw std::invalid_argument(knob + " needs --synthetic");
    }
    if (args.has("--overlap") && args.has("--buckets")) {
      throw std::invalid_argument("--buckets does not apply to --overlap");
    }
    const auto buckets = args.number<std::uint32_t>("--buckets", 64);

    SelectionTrace trace;
    std::string source;
    if (args.has("--trace")) {
      source = args.text("--trace", "");
      trace = load(source);
    } else {
      sparsekv::SyntheticTraceOptions o;
      o.seed = args.number<std::uint64_t>("--seed", o.seed);
      o.layers = args.number<std::uint32_t>("--layers", o.layers);
      o.kv_heads = args.number<std::uint32_t>("--kv-heads", o.kv_heads);
      o.steps = args.number<std::uint32_t>("--steps", o.steps);
      o.partitions = args.number<std::uint32_t>("--partitions", o.partitions);
      o.selected = args.number<std::uint32_t>("--selected", o.selected);
      o.max_pages = args.number<std::uint32_t>("--max-pages", o.max_pages);
      o.reuse = args.number<double>("--reuse", o.reuse);
      o.window = args.number<std::uint32_t>("--window", o.window);
      o.recency_decay = args.number<double>("--recency-decay", o.recency_decay);
      o.zipf = args.number<double>("--zipf", o.zipf);
      o.drift = args.number<double>("--drift", o.drift);
      trace = sparsekv::synthetic_selection_trace(o);
      source = fmt::format("synthetic (seed {})", o.seed);
    }
    sparsekv::validate_selection_trace(trace);
    if (args.has("--write-trace")) {
      const std::string path = args.text("--write-trace", "");
      std::ofstream out(path);
      sparsekv::write_selection_trace(out, trace);
      out.close();
      if (!out) sparsekv::fail(sparsekv::ErrorCode::invalid_argument, "cannot write trace '{}'", path);
    }

    if (args.has("--overlap")) {
      std::fputs(overlap_report(trace, source, args.has("--json")).c_str(), stdout);
      return 0;
    }

    std::vector<Result> results;
    for (std::uint32_t ratio : kRatios) {
      for (const char* policy : kPolicies) results.push_back(simulate(trace, policy, ratio, buckets));
    }

    std::string out;
    if (args.has("--json")) {
      out = "[\n";
      for (std::size_t i = 0; i < results.size(); ++i) {
        const Result& r = results[i];
        out += fmt::format(
            "  {{\"policy\": \"{}\", \"buffer_ratio\": {}, \"hit_ratio\": {:.6f}, \"pages_moved\": {}, "
            "\"ns_per_step\": {:.1f}}}{}\n",
            r.policy, r.ratio, r.stats.hit_ratio(), r.stats.miss_pages, r.ns_per_step,
            i + 1 < results.size() ? "," : "");
      }
      out += "]\n";
    } else {
      out = describe(trace, source);
      out += fmt::format(
          "buffer = ratio x the head's mandatory pages; hit ratio by pages; pages moved = CPU->GPU pages of misses, "
          "all heads; ns/step = replacement time per (layer, head) step ({} timestamp buckets)\n\n",
          buckets);
      out +=
          fmt::format("{:<7} {:<13} {:>10} {:>12} {:>9}\n", "buffer", "policy", "hit ratio", "pages moved", "ns/step");
      for (const Result& r : results) {
        out += fmt::format("{:<7} {:<13} {:>9.2f}% {:>12} {:>9.1f}\n", fmt::format("{}x", r.ratio), r.policy,
                           100 * r.stats.hit_ratio(), r.stats.miss_pages, r.ns_per_step);
      }
    }
    std::fputs(out.c_str(), stdout);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "sparsekv-cachesim: %s\n", e.what());
    usage();
    return 2;
  }
}
