#pragma once
// Selection traces: what a sparse-attention policy selected, per decode step,
// layer and KV head — the input on which the replacement policies of one GPU
// buffer (Spin §5.3) are compared by sparsekv-cachesim (docs/cachesim.md).
//
// Text format v1 (`#` starts a comment, blank lines are ignored):
//
//   sparsekv-selection-trace 1 <layers> <kv_heads>
//   <step> <layer> <kv_head> <pid>:<pages> <pid>:<pages> ...
//
// One line per (step, layer, kv head) selection. Steps count from 0; lines
// come in non-decreasing step order and a step may not skip one (an all-empty
// step is written as lines without partitions); within a step the heads may
// come in any order, each at most once, and a missing head selects nothing.
// A partition keeps one page count (1 to 65536) across the whole trace.
// Partition ids are below 2^24 per head; ids below a head's largest id that
// are never selected get 1 page, which changes nothing: a partition that is
// never selected never occupies a buffer.
//
// The synthetic generator models the temporal locality SparseServe §3.3
// measures (Fig. 8): consecutive steps select highly overlapping partitions,
// the overlap with older steps decays with distance, and the union of the
// last ~12 steps covers nearly all of the next selection.
#include <cstdint>
#include <istream>
#include <ostream>
#include <vector>

#include "sparsekv/core/ids.hpp"

namespace sparsekv {

struct SelectionTrace {
  std::uint32_t layers = 0;
  std::uint32_t kv_heads = 0;
  // [head = layer * kv_heads + kv_head][partition] -> pages
  std::vector<std::vector<std::uint32_t>> partition_pages;
  // [step][head] -> the selected partitions, in selection order
  std::vector<std::vector<std::vector<PartitionId>>> selections;

  std::uint32_t heads() const noexcept { return layers * kv_heads; }
  std::size_t steps() const noexcept { return selections.size(); }
  // The head's mandatory pages: its largest selection, in pages, over all steps.
  std::uint64_t mandatory_pages(std::uint32_t head) const;
  // Selections of one head, step by step (the input Belady needs).
  std::vector<std::vector<PartitionId>> head_selections(std::uint32_t head) const;
};

inline constexpr std::uint32_t kMaxTracePartitions = 1u << 24;

// Throws invalid_argument unless the trace is well formed: layers, kv_heads
// > 0, partition_pages and every step sized heads(), selected ids in range,
// distinct within a selection, with 1 to 65536 pages.
void validate_selection_trace(const SelectionTrace& trace);

// Errors name the line: "selection trace line 7: ..." (invalid_argument).
SelectionTrace read_selection_trace(std::istream& in);
// Validates, then writes every (step, head) line, empty selections included.
void write_selection_trace(std::ostream& out, const SelectionTrace& trace);

// Generator knobs. Each head is generated independently from its own stream
// (seeded from `seed` and the head index); the output is identical across
// platforms and standard libraries for one seed.
struct SyntheticTraceOptions {
  std::uint64_t seed = 1;
  std::uint32_t layers = 2;
  std::uint32_t kv_heads = 4;
  std::uint32_t steps = 512;
  std::uint32_t partitions = 2048;  // per head
  std::uint32_t selected = 64;      // partitions selected per step and head: the mandatory budget
  std::uint32_t max_pages = 1;      // page count of each partition, uniform in [1, max_pages]; 1 = uniform partitions
  // Locality. Each pick re-uses, with probability `reuse`, a partition that
  // one of the last `window` steps selected: step t-d is chosen with weight
  // recency_decay^(d-1), so the overlap with a past step decays with its
  // distance (16 draws that find only partitions this step already picked
  // make the pick fresh). Otherwise the pick is fresh: a Zipf(`zipf`) draw
  // over the head's popularity ranking (0 = uniform over all partitions).
  double reuse = 0.85;
  std::uint32_t window = 12;
  double recency_decay = 0.3;
  double zipf = 0.8;
  // Hot-set drift: expected swaps per step of a Zipf-drawn (hot) rank with a
  // uniformly drawn rank, so popular partitions slowly cool and others heat up.
  double drift = 2.0;
};

// Throws invalid_argument on a knob out of range (0 sizes, selected >
// partitions, probabilities outside [0, 1], ...).
SelectionTrace synthetic_selection_trace(const SyntheticTraceOptions& options);

// Mean share of a step's selected partitions that the same head selected in
// the previous `window` steps (SparseServe Fig. 8's overlap ratio), over all
// steps >= window and heads; `distance_only` counts only step t - window.
double selection_overlap(const SelectionTrace& trace, std::uint32_t window, bool distance_only = false);

}  // namespace sparsekv
