// Selection traces: the text format's round trip and errors, and the synthetic
// generator's determinism and locality knobs (SparseServe §3.3, Fig. 8).
#include <sstream>
#include <string>

#include "research/selection_trace.hpp"
#include "test_support.hpp"

using namespace sparsekv;

namespace {

std::string to_text(const SelectionTrace& trace) {
  std::ostringstream out;
  write_selection_trace(out, trace);
  return out.str();
}

SelectionTrace from_text(const std::string& text) {
  std::istringstream in(text);
  return read_selection_trace(in);
}

// The reader must fail with invalid_argument and name the offending line.
void require_line_error(const std::string& text, std::size_t line) {
  INFO(text);
  bool thrown = false;
  try {
    from_text(text);
  } catch (const Error& e) {
    thrown = true;
    INFO(e.what());
    REQUIRE(e.code() == ErrorCode::invalid_argument);
    REQUIRE(std::string(e.what()).find("line " + std::to_string(line) + ":") != std::string::npos);
  }
  REQUIRE(thrown);
}

SyntheticTraceOptions small_options() {
  SyntheticTraceOptions o;
  o.layers = 2;
  o.kv_heads = 2;
  o.steps = 200;
  o.partitions = 512;
  o.selected = 32;
  return o;
}

}  // namespace

TEST_CASE("Selection traces round-trip through the text format", "[cache][trace]") {
  SelectionTrace t;
  t.layers = 1;
  t.kv_heads = 2;
  t.partition_pages = {{1, 3, 2}, {4, 1}};
  t.selections = {{{2, 0}, {1}}, {{}, {}}, {{1, 2, 0}, {0, 1}}};
  const std::string text = to_text(t);
  const SelectionTrace back = from_text(text);
  REQUIRE(back.layers == 1);
  REQUIRE(back.kv_heads == 2);
  REQUIRE(back.partition_pages == t.partition_pages);
  REQUIRE(back.selections == t.selections);
  REQUIRE(back.mandatory_pages(0) == 6);
  REQUIRE(back.mandatory_pages(1) == 5);

  // Generated traces, variable pages: selections and page counts survive.
  SyntheticTraceOptions o = small_options();
  o.max_pages = 4;
  const SelectionTrace synthetic = synthetic_selection_trace(o);
  const SelectionTrace read = from_text(to_text(synthetic));
  REQUIRE(read.selections == synthetic.selections);
  for (std::uint32_t h = 0; h < synthetic.heads(); ++h) {
    for (const auto& step : synthetic.selections) {
      for (PartitionId p : step[h]) REQUIRE(read.partition_pages[h][p] == synthetic.partition_pages[h][p]);
    }
  }
  REQUIRE(to_text(read) == to_text(synthetic));
}

TEST_CASE("The reader accepts comments, any head order and missing heads", "[cache][trace]") {
  const SelectionTrace t = from_text(
      "# a trace\n"
      "\n"
      "sparsekv-selection-trace 1 2 1   # two layers, one kv head\n"
      "0 1 0 5:2 # layer 1\n"
      "0 0 0 1:1 3:1\n"
      "1 0 0\n"
      "2 1 0 5:2 0:3\n");
  REQUIRE(t.steps() == 3);
  REQUIRE(t.selections[0][1] == std::vector<PartitionId>{5});
  REQUIRE(t.selections[0][0] == std::vector<PartitionId>{1, 3});
  REQUIRE(t.selections[1][0].empty());
  REQUIRE(t.selections[1][1].empty());  // missing head: empty selection
  REQUIRE(t.selections[2][1] == std::vector<PartitionId>{5, 0});
  // Ids below the largest that never appear get one page.
  REQUIRE(t.partition_pages[0] == std::vector<std::uint32_t>{1, 1, 1, 1});
  REQUIRE(t.partition_pages[1] == std::vector<std::uint32_t>{3, 1, 1, 1, 1, 2});
  // A header alone is an empty trace.
  REQUIRE(from_text("sparsekv-selection-trace 1 1 1\n").steps() == 0);
}

TEST_CASE("Reader errors name the line", "[cache][trace]") {
  const std::string h = "sparsekv-selection-trace 1 2 2\n";
  require_line_error("\n# x\nsparsekv-trace 1 2 2\n", 3);
  require_line_error("sparsekv-selection-trace 2 2 2\n", 1);
  require_line_error("sparsekv-selection-trace 1 2\n", 1);
  require_line_error("sparsekv-selection-trace 1 0 2\n", 1);
  require_line_error(h + "0 0 0 1:1\n0 2 0 1:1\n", 3);             // layer out of range
  require_line_error(h + "0 0 2 1:1\n", 2);                        // kv head out of range
  require_line_error(h + "0 0\n", 2);                              // too few fields
  require_line_error(h + "0 0 0 1:1 x:1\n", 2);                    // bad id
  require_line_error(h + "0 0 0 1\n", 2);                          // no page count
  require_line_error(h + "0 0 0 1:0\n", 2);                        // 0 pages
  require_line_error(h + "0 0 0 1:65537\n", 2);                    // too many pages
  require_line_error(h + "0 0 0 16777216:1\n", 2);                 // id too large
  require_line_error(h + "0 0 0 1:1 2:1 1:1\n", 2);                // repeated id
  require_line_error(h + "0 0 0 1:1\n\n1 0 0 1:2\n", 4);           // page count changed
  require_line_error(h + "0 0 0 1:1\n0 0 1 4:1\n0 0 0 2:1\n", 4);  // head listed twice
  require_line_error(h + "0 0 0 1:1\n1 0 0 1:1\n0 1 0 1:1\n", 4);  // step goes back
  require_line_error(h + "0 0 0 1:1\n2 0 0 1:1\n", 3);             // step skipped
  require_line_error(h + "-1 0 0 1:1\n", 2);
  REQUIRE_SPARSEKV_ERROR(from_text(""), ErrorCode::invalid_argument);
  REQUIRE_SPARSEKV_ERROR(from_text("# only a comment\n"), ErrorCode::invalid_argument);
}

TEST_CASE("The writer rejects malformed traces and writes nothing", "[cache][trace]") {
  SelectionTrace t;
  t.layers = 1;
  t.kv_heads = 1;
  t.partition_pages = {{1, 1}};
  t.selections = {{{0, 1}}, {{1, 1}}};
  std::ostringstream out;
  REQUIRE_SPARSEKV_ERROR(write_selection_trace(out, t), ErrorCode::invalid_argument);
  t.selections = {{{0, 2}}};
  REQUIRE_SPARSEKV_ERROR(write_selection_trace(out, t), ErrorCode::invalid_argument);
  t.selections = {{{0}, {1}}};
  REQUIRE_SPARSEKV_ERROR(write_selection_trace(out, t), ErrorCode::invalid_argument);
  t.selections = {{{0}}};
  t.partition_pages = {{0}};
  REQUIRE_SPARSEKV_ERROR(write_selection_trace(out, t), ErrorCode::invalid_argument);
  REQUIRE(out.str().empty());
}

TEST_CASE("The generator is deterministic and well formed", "[cache][trace]") {
  SyntheticTraceOptions o = small_options();
  o.max_pages = 3;
  const SelectionTrace a = synthetic_selection_trace(o);
  REQUIRE(to_text(a) == to_text(synthetic_selection_trace(o)));
  validate_selection_trace(a);
  REQUIRE(a.steps() == o.steps);
  REQUIRE(a.heads() == 4);
  for (const auto& step : a.selections) {
    for (const auto& sel : step) REQUIRE(sel.size() == o.selected);
  }
  bool multi_page = false;
  for (const auto& head : a.partition_pages) {
    REQUIRE(head.size() == o.partitions);
    for (auto pages : head) {
      REQUIRE((pages >= 1 && pages <= 3));
      multi_page |= pages > 1;
    }
  }
  REQUIRE(multi_page);
  o.seed = 2;
  REQUIRE(to_text(a) != to_text(synthetic_selection_trace(o)));
  // Pinned: std::mt19937_64 and the generator's own distributions are fully
  // specified, so this holds with any standard library.
  SyntheticTraceOptions tiny;
  tiny.layers = tiny.kv_heads = 1;
  tiny.steps = 3;
  tiny.partitions = 16;
  tiny.selected = 3;
  const std::vector<std::vector<std::vector<PartitionId>>> pinned = {{{11, 5, 9}}, {{5, 10, 9}}, {{9, 5, 11}}};
  REQUIRE(synthetic_selection_trace(tiny).selections == pinned);
}

TEST_CASE("Generator knobs move locality the expected way", "[cache][trace]") {
  SyntheticTraceOptions o = small_options();
  const SelectionTrace base = synthetic_selection_trace(o);
  // SparseServe Fig. 8: high overlap with the previous step, decaying with
  // distance; the union of a longer window covers more.
  const double d1 = selection_overlap(base, 1), d4 = selection_overlap(base, 4, true);
  const double d12 = selection_overlap(base, 12, true);
  INFO("overlap with t-1 " << d1 << ", t-4 " << d4 << ", t-12 " << d12);
  REQUIRE(d1 > 0.6);
  REQUIRE(d1 > d4);
  REQUIRE(d4 > d12);
  REQUIRE(selection_overlap(base, 12) > selection_overlap(base, 4));
  REQUIRE(selection_overlap(base, 4) > d1);

  double previous = -1.0;
  for (double reuse : {0.0, 0.5, 0.85, 0.95}) {
    o.reuse = reuse;
    const double overlap = selection_overlap(synthetic_selection_trace(o), 1);
    INFO("reuse " << reuse << ": overlap " << overlap);
    REQUIRE(overlap > previous + 0.02);
    previous = overlap;
  }
  // Fresh picks only: a steeper Zipf makes a hotter, more repeated hot set.
  o.reuse = 0.0;
  o.zipf = 0.0;
  const double uniform = selection_overlap(synthetic_selection_trace(o), 1);
  o.zipf = 1.2;
  REQUIRE(selection_overlap(synthetic_selection_trace(o), 1) > uniform + 0.05);
  // Drift cools the hot set: less overlap with distant steps.
  o = small_options();
  o.drift = 0.0;
  const double still = selection_overlap(synthetic_selection_trace(o), 12, true);
  o.drift = 50.0;
  REQUIRE(selection_overlap(synthetic_selection_trace(o), 12, true) < still);
}

TEST_CASE("Generator options are checked", "[cache][trace]") {
  const auto bad = [](auto change) {
    SyntheticTraceOptions o = small_options();
    change(o);
    REQUIRE_SPARSEKV_ERROR(synthetic_selection_trace(o), ErrorCode::invalid_argument);
  };
  bad([](auto& o) { o.layers = 0; });
  bad([](auto& o) { o.steps = 0; });
  bad([](auto& o) { o.partitions = 0; });
  bad([](auto& o) { o.selected = o.partitions + 1; });
  bad([](auto& o) { o.selected = 0; });
  bad([](auto& o) { o.max_pages = 0; });
  bad([](auto& o) { o.reuse = 1.5; });
  bad([](auto& o) { o.window = 0; });
  bad([](auto& o) { o.recency_decay = 0.0; });
  bad([](auto& o) { o.zipf = -1.0; });
  bad([](auto& o) { o.drift = -1.0; });
  // Selecting every partition is legal: the fallback scan fills the step.
  SyntheticTraceOptions all = small_options();
  all.partitions = all.selected = 8;
  validate_selection_trace(synthetic_selection_trace(all));
}
