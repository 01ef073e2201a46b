#include "research/selection_trace.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <iterator>
#include <random>
#include <string>
#include <string_view>

#include <fmt/format.h>

#include "research/portable_random.hpp"
#include "research/text_fields.hpp"
#include "sparsekv/core/error.hpp"
#include "sparsekv/metadata/page_table_entries.hpp"

namespace sparsekv {

namespace {

constexpr std::string_view kMagic = "sparsekv-selection-trace";
constexpr std::uint32_t kMaxTraceHeads = 1u << 20;

void check_heads(std::uint64_t layers, std::uint64_t kv_heads, std::string_view who) {
  if (layers == 0 || kv_heads == 0 || layers * kv_heads > kMaxTraceHeads) {
    fail(ErrorCode::invalid_argument, "{}: layers ({}) and kv_heads ({}) must be > 0, with at most {} heads", who,
         layers, kv_heads, kMaxTraceHeads);
  }
}

// ---- reader ----------------------------------------------------------------

template <class... Args>
[[noreturn]] void line_error(std::size_t line, fmt::format_string<Args...> format, Args&&... args) {
  fail(ErrorCode::invalid_argument, "selection trace line {}: {}", line,
       fmt::format(format, std::forward<Args>(args)...));
}

std::uint32_t parse_u32(std::string_view token, std::size_t line, std::string_view what) {
  std::uint32_t value = 0;
  const auto [end, ec] = std::from_chars(token.data(), token.data() + token.size(), value);
  if (ec != std::errc{} || end != token.data() + token.size()) {
    line_error(line, "{} must be an unsigned 32-bit number, got '{}'", what, token);
  }
  return value;
}

// ---- generator -------------------------------------------------------------

std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

void check_options(const SyntheticTraceOptions& o) {
  const auto bad = [](std::string_view knob, auto value, std::string_view rule) {
    fail(ErrorCode::invalid_argument, "synthetic trace: {} = {}: {}", knob, value, rule);
  };
  check_heads(o.layers, o.kv_heads, "synthetic trace");
  if (o.steps == 0) bad("steps", o.steps, "must be > 0");
  if (o.partitions == 0 || o.partitions > kMaxTracePartitions) bad("partitions", o.partitions, "must be in [1, 2^24]");
  if (o.selected == 0 || o.selected > o.partitions) bad("selected", o.selected, "must be in [1, partitions]");
  if (o.max_pages == 0 || o.max_pages > kMaxPagesPerPartition) bad("max_pages", o.max_pages, "must be in [1, 65536]");
  if (!(o.reuse >= 0.0 && o.reuse <= 1.0)) bad("reuse", o.reuse, "must be in [0, 1]");
  if (o.window == 0 || o.window > 65536) bad("window", o.window, "must be in [1, 65536]");
  if (!(o.recency_decay > 0.0 && o.recency_decay <= 1.0)) bad("recency_decay", o.recency_decay, "must be in (0, 1]");
  if (!(o.zipf >= 0.0 && o.zipf <= 16.0)) bad("zipf", o.zipf, "must be in [0, 16]");
  if (!(o.drift >= 0.0 && o.drift <= double(o.partitions))) bad("drift", o.drift, "must be in [0, partitions]");
}

// One head's steps; see SyntheticTraceOptions for the model.
void generate_head(const SyntheticTraceOptions& o, std::uint32_t head, const std::vector<double>& zipf_cdf,
                   const std::vector<double>& distance_cdf, SelectionTrace& trace) {
  detail::PortableRandom rng(splitmix64(o.seed ^ splitmix64(head)));
  std::vector<std::uint32_t>& pages = trace.partition_pages[head];
  pages.resize(o.partitions);
  for (auto& p : pages) p = o.max_pages == 1 ? 1 : 1 + std::uint32_t(rng.below(o.max_pages));
  // Popularity ranking: rank r is partition ranked[r] (Fisher-Yates).
  std::vector<PartitionId> ranked(o.partitions);
  for (PartitionId p = 0; p < o.partitions; ++p) ranked[p] = p;
  for (std::uint32_t i = o.partitions; i > 1; --i) std::swap(ranked[i - 1], ranked[rng.below(i)]);

  const auto fresh = [&] { return ranked[rng.pick(zipf_cdf, o.partitions)]; };
  const std::uint32_t whole_swaps = std::uint32_t(o.drift);
  const double extra_swap = o.drift - whole_swaps;
  std::vector<std::uint32_t> picked_in(o.partitions, 0);  // step + 1 of the last pick
  for (std::uint32_t t = 0; t < o.steps; ++t) {
    const std::uint32_t swaps = whole_swaps + (rng.unit() < extra_swap ? 1 : 0);
    for (std::uint32_t s = 0; s < swaps; ++s) {
      std::swap(ranked[rng.pick(zipf_cdf, o.partitions)], ranked[rng.below(o.partitions)]);
    }
    std::vector<PartitionId>& sel = trace.selections[t][head];
    const std::uint32_t history = std::min(t, o.window);
    const auto take = [&](PartitionId p) {
      if (picked_in[p] == t + 1) return false;
      picked_in[p] = t + 1;
      sel.push_back(p);
      return true;
    };
    while (sel.size() < o.selected) {
      bool done = false;
      if (history > 0 && rng.unit() < o.reuse) {
        // Bounded retries: when the recent steps are exhausted the pick turns fresh.
        for (int attempt = 0; attempt < 16 && !done; ++attempt) {
          const auto& past = trace.selections[t - 1 - rng.pick(distance_cdf, history)][head];
          done = !past.empty() && take(past[rng.below(past.size())]);
        }
      }
      for (int attempt = 0; attempt < 64 && !done; ++attempt) done = take(fresh());
      // A hot set smaller than the demand: take the next unpicked partition.
      for (PartitionId p = PartitionId(rng.below(o.partitions)); !done; p = (p + 1) % o.partitions) done = take(p);
    }
  }
}

}  // namespace

std::uint64_t SelectionTrace::mandatory_pages(std::uint32_t head) const {
  check_index("SelectionTrace: head", head, heads());
  std::uint64_t most = 0;
  for (const auto& step : selections) {
    std::uint64_t pages = 0;
    for (PartitionId p : step[head]) pages += partition_pages[head][p];
    most = std::max(most, pages);
  }
  return most;
}

std::vector<std::vector<PartitionId>> SelectionTrace::head_selections(std::uint32_t head) const {
  check_index("SelectionTrace: head", head, heads());
  std::vector<std::vector<PartitionId>> out;
  out.reserve(selections.size());
  for (const auto& step : selections) out.push_back(step[head]);
  return out;
}

void validate_selection_trace(const SelectionTrace& trace) {
  check_heads(trace.layers, trace.kv_heads, "selection trace");
  const std::uint32_t heads = trace.heads();
  if (trace.partition_pages.size() != heads) {
    fail(ErrorCode::invalid_argument, "selection trace: partition_pages has {} heads, expected {}",
         trace.partition_pages.size(), heads);
  }
  std::vector<std::vector<std::uint64_t>> seen(heads);  // step + 1 of the last selection of each partition
  for (std::uint32_t h = 0; h < heads; ++h) seen[h].assign(trace.partition_pages[h].size(), 0);
  for (std::size_t t = 0; t < trace.steps(); ++t) {
    if (trace.selections[t].size() != heads) {
      fail(ErrorCode::invalid_argument, "selection trace: step {} has {} heads, expected {}", t,
           trace.selections[t].size(), heads);
    }
    for (std::uint32_t h = 0; h < heads; ++h) {
      for (PartitionId p : trace.selections[t][h]) {
        if (p >= trace.partition_pages[h].size() || p >= kMaxTracePartitions) {
          fail(ErrorCode::invalid_argument, "selection trace: step {} head {} selects partition {}, head has {}", t, h,
               p, trace.partition_pages[h].size());
        }
        const std::uint32_t pages = trace.partition_pages[h][p];
        if (pages == 0 || pages > kMaxPagesPerPartition) {
          fail(ErrorCode::invalid_argument, "selection trace: head {} partition {} has {} pages, not in [1, {}]", h, p,
               pages, kMaxPagesPerPartition);
        }
        if (seen[h][p] == t + 1) {
          fail(ErrorCode::invalid_argument, "selection trace: step {} head {} selects partition {} twice", t, h, p);
        }
        seen[h][p] = t + 1;
      }
    }
  }
}

SelectionTrace read_selection_trace(std::istream& in) {
  SelectionTrace trace;
  std::vector<std::vector<std::size_t>> last_line;  // [head][pid]: latest line selecting it, 0 = unseen
  std::vector<std::size_t> head_line;               // line of each head in the current step, 0 = none yet
  bool header = false;
  std::string text;
  std::size_t line = 0;
  while (std::getline(in, text)) {
    ++line;
    const auto tokens = detail::split_fields(std::string_view(text).substr(0, text.find('#')));
    if (tokens.empty()) continue;
    if (!header) {
      if (tokens[0] != kMagic) line_error(line, "expected the header '{} 1 <layers> <kv_heads>'", kMagic);
      if (tokens.size() != 4) line_error(line, "the header has {} fields, expected 4", tokens.size());
      if (tokens[1] != "1") line_error(line, "unsupported trace version '{}' (this reader knows 1)", tokens[1]);
      trace.layers = parse_u32(tokens[2], line, "layers");
      trace.kv_heads = parse_u32(tokens[3], line, "kv_heads");
      if (trace.layers == 0 || trace.kv_heads == 0 || std::uint64_t{trace.layers} * trace.kv_heads > kMaxTraceHeads) {
        line_error(line, "layers ({}) and kv_heads ({}) must be > 0, with at most {} heads", trace.layers,
                   trace.kv_heads, kMaxTraceHeads);
      }
      trace.partition_pages.resize(trace.heads());
      last_line.resize(trace.heads());
      header = true;
      continue;
    }
    if (tokens.size() < 3) line_error(line, "expected '<step> <layer> <kv_head> <pid>:<pages>...'");
    const std::uint32_t step = parse_u32(tokens[0], line, "step");
    const std::uint32_t layer = parse_u32(tokens[1], line, "layer");
    const std::uint32_t kv_head = parse_u32(tokens[2], line, "kv_head");
    if (layer >= trace.layers) line_error(line, "layer {} out of range [0, {})", layer, trace.layers);
    if (kv_head >= trace.kv_heads) line_error(line, "kv_head {} out of range [0, {})", kv_head, trace.kv_heads);
    if (step + std::size_t{1} < trace.steps()) {
      line_error(line, "step {} after step {}: lines must come in step order", step, trace.steps() - 1);
    }
    if (step > trace.steps()) line_error(line, "step {} skips step {}", step, trace.steps());
    if (step == trace.steps()) {
      trace.selections.emplace_back(trace.heads());
      head_line.assign(trace.heads(), 0);
    }
    const std::uint32_t head = layer * trace.kv_heads + kv_head;
    if (head_line[head] != 0) {
      line_error(line, "step {} layer {} kv_head {} is already listed on line {}", step, layer, kv_head,
                 head_line[head]);
    }
    head_line[head] = line;
    auto& pages = trace.partition_pages[head];
    auto& last = last_line[head];
    auto& sel = trace.selections.back()[head];
    for (std::size_t i = 3; i < tokens.size(); ++i) {
      const std::size_t colon = tokens[i].find(':');
      if (colon == std::string_view::npos) line_error(line, "expected <pid>:<pages>, got '{}'", tokens[i]);
      const std::uint32_t pid = parse_u32(tokens[i].substr(0, colon), line, "partition id");
      const std::uint32_t count = parse_u32(tokens[i].substr(colon + 1), line, "page count");
      if (pid >= kMaxTracePartitions) line_error(line, "partition id {} is not below 2^24", pid);
      if (count == 0 || count > kMaxPagesPerPartition) {
        line_error(line, "partition {} has {} pages, not in [1, {}]", pid, count, kMaxPagesPerPartition);
      }
      if (pid >= pages.size()) {
        pages.resize(pid + 1, 0);
        last.resize(pid + 1, 0);
      }
      if (last[pid] == line) line_error(line, "partition {} is selected twice", pid);
      if (last[pid] != 0 && pages[pid] != count) {
        line_error(line, "partition {} has {} pages here but {} on line {}", pid, count, pages[pid], last[pid]);
      }
      pages[pid] = count;
      last[pid] = line;
      sel.push_back(pid);
    }
  }
  if (in.bad()) fail(ErrorCode::invalid_argument, "selection trace: read error after line {}", line);
  if (!header) fail(ErrorCode::invalid_argument, "selection trace: no '{}' header line", kMagic);
  for (auto& pages : trace.partition_pages) std::replace(pages.begin(), pages.end(), 0u, 1u);
  return trace;
}

void write_selection_trace(std::ostream& out, const SelectionTrace& trace) {
  validate_selection_trace(trace);
  fmt::memory_buffer buf;
  fmt::format_to(std::back_inserter(buf), "{} 1 {} {}\n# <step> <layer> <kv_head> <partition>:<pages> ...\n", kMagic,
                 trace.layers, trace.kv_heads);
  for (std::size_t t = 0; t < trace.steps(); ++t) {
    for (std::uint32_t h = 0; h < trace.heads(); ++h) {
      fmt::format_to(std::back_inserter(buf), "{} {} {}", t, h / trace.kv_heads, h % trace.kv_heads);
      for (PartitionId p : trace.selections[t][h]) {
        fmt::format_to(std::back_inserter(buf), " {}:{}", p, trace.partition_pages[h][p]);
      }
      buf.push_back('\n');
    }
    if (buf.size() > (1u << 20)) {
      out.write(buf.data(), std::streamsize(buf.size()));
      buf.clear();
    }
  }
  out.write(buf.data(), std::streamsize(buf.size()));
}

SelectionTrace synthetic_selection_trace(const SyntheticTraceOptions& o) {
  check_options(o);
  // Zipf weights use std::pow, whose last-bit rounding is the only platform input.
  std::vector<double> zipf_cdf(o.partitions);
  double sum = 0.0;
  for (std::uint32_t r = 0; r < o.partitions; ++r) zipf_cdf[r] = sum += std::pow(double(r) + 1.0, -o.zipf);
  std::vector<double> distance_cdf(o.window);  // [d - 1]: weight of step t - d
  sum = 0.0;
  for (std::uint32_t d = 0; d < o.window; ++d) distance_cdf[d] = sum += std::pow(o.recency_decay, double(d));

  SelectionTrace trace;
  trace.layers = o.layers;
  trace.kv_heads = o.kv_heads;
  trace.partition_pages.resize(trace.heads());
  trace.selections.assign(o.steps, std::vector<std::vector<PartitionId>>(trace.heads()));
  for (std::uint32_t h = 0; h < trace.heads(); ++h) generate_head(o, h, zipf_cdf, distance_cdf, trace);
  return trace;
}

double selection_overlap(const SelectionTrace& trace, std::uint32_t window, bool distance_only) {
  if (window == 0) fail(ErrorCode::invalid_argument, "selection_overlap: window must be > 0");
  validate_selection_trace(trace);
  double sum = 0.0;
  std::size_t count = 0;
  for (std::uint32_t h = 0; h < trace.heads(); ++h) {
    // last[p] = step + 1 of p's latest selection before the current step.
    std::vector<std::size_t> last(trace.partition_pages[h].size(), 0);
    std::vector<std::size_t> marked(last.size(), 0);  // distance_only: step + 1 of step t - window's marks
    for (std::size_t t = 0; t < trace.steps(); ++t) {
      const auto& sel = trace.selections[t][h];
      if (t >= window && !sel.empty()) {
        if (distance_only) {
          for (PartitionId p : trace.selections[t - window][h]) marked[p] = t + 1;
        }
        std::size_t hits = 0;
        for (PartitionId p : sel) {
          hits += distance_only ? marked[p] == t + 1 : last[p] != 0 && last[p] + window >= t + 1;
        }
        sum += double(hits) / double(sel.size());
        ++count;
      }
      for (PartitionId p : sel) last[p] = t + 1;
    }
  }
  return count == 0 ? 0.0 : sum / double(count);
}

}  // namespace sparsekv
