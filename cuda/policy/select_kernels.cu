// CUDA kernels of the Select stage (Spin §4.1): Quest, ShadowKV (Spin §4.2),
// RetroInfer (RetroInfer §4.2), StreamingWindow (StreamingLLM) and Dense
// selections, one block per (request, kv head) row. Quest's and ShadowKV's
// logits come first from their own kernel over (row, tile of candidates), a
// thread a candidate and the group's heads in one pass over its summary row
// (quest_group_logits / shadowkv_group_logits), into the workspace;
// RetroInfer's from the row's block, one candidate per thread. (One block a row scoring its
// candidates took about 5 ms a row at 8,192 candidates on an H100, whatever
// the batch.) Sums over candidates run in the lane order the rules define
// (warp 0, strided, then a __shfl_down tree); the ranked list is produced in
// rounds of kSelectTile keys (a radix-select threshold pass when more keys
// are left, then cub::BlockRadixSort) and consumed by thread 0 with the
// policy's greedy fill. RetroInfer's estimate kernel ranks the same way,
// thread 0 lists the estimation zone in rank order, and each thread folds
// one (q head, dimension) pair over the list in that order. tests/
// test_select_rules.cpp emulates this decomposition on the host against the
// host policies.
#include <cuda_runtime.h>

#include <cub/block/block_radix_sort.cuh>
#include <cub/block/block_reduce.cuh>
#include <cstdint>
#include <limits>
#include <string>

#include "core/launch_support.cuh"
#include "sparsekv/core/error_code.hpp"
#include "sparsekv/core/numeric.hpp"
#include "sparsekv/policy/select_cuda.hpp"
#include "sparsekv/policy/select_rules.hpp"

namespace sparsekv::cuda {
namespace {

using namespace detail;  // core/launch_support.cuh

constexpr std::uint32_t kThreads = 256;
constexpr std::uint32_t kItems = kSelectTile / kThreads;
constexpr std::uint32_t kWarp = 32;
static_assert(kThreads * kItems == kSelectTile && kWarp == kSumLanes);
constexpr float kMinusInf = -std::numeric_limits<float>::infinity();
constexpr std::uint64_t kNoKey = std::numeric_limits<std::uint64_t>::max();
constexpr std::uint32_t kNoId = std::numeric_limits<std::uint32_t>::max();

using KeySort = cub::BlockRadixSort<std::uint64_t, kThreads, kItems>;
using IdSort = cub::BlockRadixSort<std::uint32_t, kThreads, kItems>;
using MaxReduce = cub::BlockReduce<float, kThreads>;
using CountReduce = cub::BlockReduce<std::uint64_t, kThreads>;

// The workspace: one slice per row, so its size follows the batch and the
// region capacity (max_row_candidates), not the arena the rows point into.
// A row's slice: per candidate a score, the group's logits
// ([group][max_row_candidates]: the logits kernel's output for Quest and
// ShadowKV, the estimate's kept terms; RetroInfer's Select reuses the first)
// and a taken flag; max_row_candidates + 1 chosen ids (RetroInfer's sink is
// one more).
constexpr std::size_t kAlign = 256;
constexpr std::size_t aligned(std::size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }
struct Workspace {
  float* scores;
  float* scratch;
  std::uint8_t* taken;
  std::uint32_t* ids;
  std::size_t slice;  // candidates per row: max_row_candidates
  std::size_t logits;
};
std::size_t workspace_bytes(std::uint32_t rows, std::uint32_t max_row_candidates, std::uint32_t logits) {
  const std::size_t slots = std::size_t{rows} * max_row_candidates;
  return aligned(slots * sizeof(float)) + aligned(slots * logits * sizeof(float)) + aligned(slots) +
         aligned((slots + rows) * sizeof(std::uint32_t));
}
Workspace carve(void* base, std::uint32_t rows, std::uint32_t max_row_candidates, std::uint32_t logits) {
  const std::size_t slots = std::size_t{rows} * max_row_candidates;
  auto* p = static_cast<std::byte*>(base);
  Workspace w;
  w.slice = max_row_candidates;
  w.logits = logits;
  w.scores = reinterpret_cast<float*>(p);
  p += aligned(slots * sizeof(float));
  w.scratch = reinterpret_cast<float*>(p);
  p += aligned(slots * logits * sizeof(float));
  w.taken = reinterpret_cast<std::uint8_t*>(p);
  p += aligned(slots);
  w.ids = reinterpret_cast<std::uint32_t*>(p);
  return w;
}

struct Shared {
  union {
    KeySort::TempStorage key_sort;
    IdSort::TempStorage id_sort;
    MaxReduce::TempStorage max_reduce;
    CountReduce::TempStorage count_reduce;
  } cub;
  std::uint64_t tile[kSelectTile];
  std::uint32_t histogram[kRadixBins];
  std::uint64_t u64;  // broadcasts
  float f32;
  double f64;
  std::uint32_t tile_count;
  std::uint32_t chosen;  // ids chosen so far
  bool done;
};

// One row's view: its candidates [0, n) (candidate i of the per-candidate
// arrays at first + i), its workspace slice and where its chosen ids go.
struct Row {
  std::uint32_t index, first, n;
  const std::uint32_t* tokens;
  const PartitionId* partitions;
  float* scores;
  float* scratch;  // [logits][max_row_candidates]
  std::uint8_t* taken;
  std::uint32_t* ids;  // capacity max_row_candidates + 1
  const float* q;      // [group][head_dim]
};

__device__ Row row_view(const SelectRows& rows, const Workspace& w) {
  Row r;
  r.index = blockIdx.x;
  const SelectRowSpan span =
      select_row_span(rows.first[r.index], rows.count[r.index], rows.max_row_candidates, rows.candidates);
  r.first = span.first;
  r.n = span.n;
  r.tokens = rows.tokens + r.first;
  r.partitions = rows.partitions + r.first;
  r.scores = w.scores + r.index * w.slice;
  r.scratch = w.scratch + r.index * w.slice * w.logits;
  r.taken = w.taken + r.index * w.slice;
  r.ids = w.ids + r.index * (w.slice + 1);
  r.q = rows.q + static_cast<std::size_t>(r.index) * rows.group * rows.head_dim;
  return r;
}

__device__ std::uint64_t block_sum(Shared& s, std::uint64_t x) {
  const std::uint64_t sum = CountReduce(s.cub.count_reduce).Sum(x);
  if (threadIdx.x == 0) s.u64 = sum;
  __syncthreads();
  const std::uint64_t out = s.u64;
  __syncthreads();
  return out;
}

// std::max fold of every thread's partial (partials never NaN: any order).
__device__ float block_max(Shared& s, float x) {
  const float top = MaxReduce(s.cub.max_reduce).Reduce(x, [](float a, float b) { return fold_max_score(a, b); });
  if (threadIdx.x == 0) s.f32 = top;
  __syncthreads();
  const float out = s.f32;
  __syncthreads();
  return out;
}

__device__ float lane_add(float a, float b) { return add_rn(a, b); }
__device__ double lane_add(double a, double b) { return __dadd_rn(a, b); }

// lane_sum's order: lane l of warp 0 adds the included i = l, l + 32, ... in
// order, then tree_combine's tree by __shfl_down.
template <class T, class Value, class Include>
__device__ T block_lane_sum(Shared& s, std::uint32_t n, Value value, Include include) {
  if (threadIdx.x < kWarp) {
    T partial = 0;
    for (std::uint32_t i = threadIdx.x; i < n; i += kWarp) {
      if (include(i)) partial = lane_add(partial, value(i));
    }
    for (std::uint32_t offset = kSumLanes / 2; offset > 0; offset /= 2) {
      partial = lane_add(partial, __shfl_down_sync(0xffffffffu, partial, offset));
    }
    if (threadIdx.x == 0) s.f64 = static_cast<double>(partial);
  }
  __syncthreads();
  const T out = static_cast<T>(s.f64);
  __syncthreads();
  return out;
}

// Offers the eligible candidates of the row to `fill`, best first by
// rank_key(score(i), i), in rounds of at most kSelectTile keys: a round
// takes the keys above the last one consumed, up to the kSelectTile-th
// (TileThreshold passes when more are left), sorts them and lets thread 0
// offer them in order. take(i) runs on thread 0.
template <class Filler, class Score, class Eligible, class Take>
__device__ void block_ranked_fill(Shared& s, const Row& row, Filler& fill, Score score, Eligible eligible, Take take) {
  std::uint64_t bound = 0;  // keys are never 0: the high half is at least ~order(+inf)
  for (;;) {
    std::uint64_t left = 0;
    for (std::uint32_t i = threadIdx.x; i < row.n; i += kThreads) {
      if (eligible(i) && rank_key(score(i), i) > bound) ++left;
    }
    left = block_sum(s, left);
    if (left == 0) return;
    std::uint64_t last = kNoKey;
    if (left > kSelectTile) {
      TileThreshold t;
      t.needed = kSelectTile;
      while (!t.done) {
        for (std::uint32_t b = threadIdx.x; b < kRadixBins; b += kThreads) s.histogram[b] = 0;
        __syncthreads();
        for (std::uint32_t i = threadIdx.x; i < row.n; i += kThreads) {
          if (!eligible(i)) continue;
          const std::uint64_t key = rank_key(score(i), i);
          if (key > bound && t.matches(key)) atomicAdd(&s.histogram[t.digit(key)], 1u);
        }
        __syncthreads();
        t.step(s.histogram);  // every thread the same step: no broadcast needed
        __syncthreads();
      }
      last = t.threshold();
    }
    if (threadIdx.x == 0) s.tile_count = 0;
    __syncthreads();
    for (std::uint32_t i = threadIdx.x; i < row.n; i += kThreads) {
      if (!eligible(i)) continue;
      const std::uint64_t key = rank_key(score(i), i);
      if (key > bound && key <= last) s.tile[atomicAdd(&s.tile_count, 1u)] = key;
    }
    __syncthreads();
    const std::uint32_t count = s.tile_count;
    std::uint64_t keys[kItems];
    for (std::uint32_t j = 0; j < kItems; ++j) {
      const std::uint32_t at = threadIdx.x * kItems + j;
      keys[j] = at < count ? s.tile[at] : kNoKey;
    }
    __syncthreads();
    KeySort(s.cub.key_sort).Sort(keys);
    for (std::uint32_t j = 0; j < kItems; ++j) s.tile[threadIdx.x * kItems + j] = keys[j];
    __syncthreads();
    if (threadIdx.x == 0) {
      s.done = false;
      for (std::uint32_t j = 0; j < count && !s.done; ++j) {
        const std::uint32_t i = rank_key_index(s.tile[j]);
        const Fill f = fill.offer(row.tokens[i]);
        if (f == Fill::stop) s.done = true;
        if (f == Fill::take) take(i);
      }
    }
    __syncthreads();
    if (s.done || left <= kSelectTile) return;
    bound = s.tile[count - 1];
    __syncthreads();
  }
}

// Thread 0 appends a chosen id (the row's slice holds max_row_candidates + 1 >= n + 1).
__device__ void choose(Shared& s, const Row& row, PartitionId id) { row.ids[s.chosen++] = id; }

// Writes the s.chosen ids of the row sorted ascending: runs of kSelectTile
// sorted by BlockRadixSort, merged by merged_position. The ids must be
// distinct (a selection is a set; a sink id equal to a candidate's would leave
// one output slot unwritten and another written twice).
__device__ void write_sorted(Shared& s, const Row& row, const SelectOutput& out) {
  const std::uint32_t count = s.chosen;
  for (std::uint32_t first = 0; first < count; first += kSelectTile) {
    std::uint32_t ids[kItems];
    for (std::uint32_t j = 0; j < kItems; ++j) {
      const std::uint32_t at = first + threadIdx.x * kItems + j;
      ids[j] = at < count ? row.ids[at] : kNoId;
    }
    IdSort(s.cub.id_sort).Sort(ids);
    for (std::uint32_t j = 0; j < kItems; ++j) {
      const std::uint32_t at = first + threadIdx.x * kItems + j;
      if (at < count) row.ids[at] = ids[j];
    }
    __syncthreads();
  }
  PartitionId* selected = out.selected + static_cast<std::size_t>(row.index) * out.max_selected;
  for (std::uint32_t j = threadIdx.x; j < count; j += kThreads) {
    const std::uint32_t at = count <= kSelectTile ? j : merged_position(row.ids, count, kSelectTile, j);
    if (at < out.max_selected) selected[at] = row.ids[j];
  }
  if (threadIdx.x == 0) out.selected_count[row.index] = count;
}

// Everything, in candidate order (after RetroInfer's sink).
__device__ void write_all(const Row& row, const SelectOutput& out, std::uint32_t sink_tokens, PartitionId sink) {
  PartitionId* selected = out.selected + static_cast<std::size_t>(row.index) * out.max_selected;
  const std::uint32_t skip = sink_tokens > 0 ? 1 : 0;
  if (threadIdx.x == 0 && skip == 1 && out.max_selected > 0) selected[0] = sink;
  for (std::uint32_t i = threadIdx.x; i < row.n; i += kThreads) {
    if (i + skip < out.max_selected) selected[i + skip] = row.partitions[i];
  }
  if (threadIdx.x == 0) out.selected_count[row.index] = row.n + skip;
}

__device__ std::uint64_t row_tokens(Shared& s, const Row& row) {
  std::uint64_t total = 0;
  for (std::uint32_t i = threadIdx.x; i < row.n; i += kThreads) total += row.tokens[i];
  return block_sum(s, total);
}

// Q head g's share of the group-summed softmax rank (softmax_rank_add's
// rule) over the candidates [0, m), from its logits: their block max and
// lane-ordered double sum, the shares added into row.scores.
__device__ void add_softmax_shares(Shared& s, const Row& row, std::uint32_t g, std::uint32_t m, const float* logits) {
  float top = kMinusInf;
  for (std::uint32_t i = threadIdx.x; i < m; i += kThreads) top = fold_max_score(top, logits[i]);
  top = block_max(s, top);
  const double sum = block_lane_sum<double>(
      s, m, [&](std::uint32_t i) { return static_cast<double>(portable_exp(add_rn(logits[i], -top))); },
      [](std::uint32_t) { return true; });
  const float inverse = softmax_inverse_sum(sum);
  for (std::uint32_t i = threadIdx.x; i < m; i += kThreads) {
    row.scores[i] = add_rn(g == 0 ? 0.0f : row.scores[i], softmax_share(logits[i], top, inverse));
  }
  __syncthreads();
}

// The group-summed softmax rank over [0, m) with the logits computed here:
// q head g's logit(qh, i) at row.scratch + g * stride (stride 0: one row reused).
template <class Logit>
__device__ void group_softmax_rank(Shared& s, const Row& row, const SelectRows& rows, std::uint32_t m,
                                   std::size_t stride, Logit logit) {
  for (std::uint32_t g = 0; g < rows.group; ++g) {
    const float* qh = row.q + static_cast<std::size_t>(g) * rows.head_dim;
    float* logits = row.scratch + g * stride;
    for (std::uint32_t i = threadIdx.x; i < m; i += kThreads) logits[i] = logit(qh, i);
    // add_softmax_shares reads back only this thread's logits before its first barrier.
    add_softmax_shares(s, row, g, m, logits);
  }
}

// ---- the logits kernel (Quest, ShadowKV) --------------------------------------
// Thread i of a row writes the group's logits of candidate i at the row's
// scratch + g * slice + i, for i < count(n) (the candidates its Select
// kernel scores), from the candidate's summary rows (kArrays of head_dim
// floats). A warp a block takes 32 candidates and walks their rows a piece
// of kLogitPiece dimensions at a time: the warp copies the piece of each
// row into shared memory with coalesced loads (a thread reading its own row
// from global memory would make each warp load touch 32 rows), then each
// thread adds its candidate's piece to its heads' sums (the rules'
// *GroupLogits, which carry the sums across pieces). A piece rather than
// the whole row keeps a block at 8 KB of shared memory whatever head_dim,
// so that registers, not shared memory, bound the warps an SM holds (21
// for Quest at 90 registers, against 6 when whole Quest rows of
// head_dim 128 took 33 KB a warp).

struct QuestLogits {
  static constexpr std::uint32_t kArrays = 2;  // min, max
  using Group = QuestGroupLogits;
  QuestSelect quest;
  float scale;
  __device__ std::uint32_t count(std::uint32_t n) const { return n > 0 ? n - 1 : 0; }  // all but the newest
  __device__ const float* array(std::uint32_t a) const { return a == 0 ? quest.min : quest.max; }
  __device__ Group group(const SelectRows& rows, const float* q, std::uint32_t h0) const {
    return Group(q, rows.group, h0, rows.head_dim, quest.spread, scale);
  }
  __device__ void add(Group& g, const float* const* piece, std::uint32_t d0, std::uint32_t d1) const {
    g.add(piece[0], piece[1], d0, d1);
  }
  template <class Emit>
  __device__ void finish(const Group& g, const SelectRows& rows, const float* const* piece, std::uint32_t d0,
                         std::uint32_t h0, Emit&& emit) const {
    g.finish(piece[0], piece[1], d0, rows.head_dim, rows.group, h0, emit);
  }
};

struct ShadowKVLogits {
  static constexpr std::uint32_t kArrays = 1;  // the landmark
  using Group = ShadowKVGroupLogits;
  const float* landmarks;
  float scale;
  __device__ std::uint32_t count(std::uint32_t n) const { return n; }
  __device__ const float* array(std::uint32_t) const { return landmarks; }
  __device__ Group group(const SelectRows& rows, const float* q, std::uint32_t h0) const {
    return Group(q, rows.group, h0, rows.head_dim, scale);
  }
  __device__ void add(Group& g, const float* const* piece, std::uint32_t d0, std::uint32_t d1) const {
    g.add(piece[0], d0, d1);
  }
  template <class Emit>
  __device__ void finish(const Group& g, const SelectRows& rows, const float* const*, std::uint32_t, std::uint32_t h0,
                         Emit&& emit) const {
    g.finish(rows.group, h0, emit);
  }
};

constexpr std::uint32_t kLogitCandidates = kWarp;  // a block
constexpr std::uint32_t kMaxGridY = 65535;
// A staged piece's stride in floats: odd, so that the 32 lanes reading
// dimension d of their own candidates hit 32 different banks.
constexpr std::uint32_t kPieceStride = kLogitPiece + 1;

template <class Logits>
__global__ void __launch_bounds__(kLogitCandidates) select_logits_kernel(SelectRows rows, Logits logits, Workspace w) {
  __shared__ float staged[Logits::kArrays][kLogitCandidates][kPieceStride];
  const std::uint32_t r = blockIdx.x;
  const SelectRowSpan span = select_row_span(rows.first[r], rows.count[r], rows.max_row_candidates, rows.candidates);
  const std::uint32_t count = logits.count(span.n);
  const std::uint32_t i0 = blockIdx.y * kLogitCandidates;
  if (i0 >= count) return;  // the whole block
  const std::uint32_t here = min(kLogitCandidates, count - i0);
  const std::uint32_t dim = rows.head_dim;
  const std::uint32_t lane = threadIdx.x;
  const float* q = rows.q + static_cast<std::size_t>(r) * rows.group * dim;
  float* out = w.scratch + static_cast<std::size_t>(r) * w.logits * w.slice + i0 + lane;
  const float* piece[Logits::kArrays];
  for (std::uint32_t a = 0; a < Logits::kArrays; ++a) piece[a] = staged[a][lane];
  for (std::uint32_t h0 = 0; h0 < rows.group; h0 += kLogitHeads) {
    typename Logits::Group group = logits.group(rows, q, h0);
    std::uint32_t d0 = 0;
    for (;; d0 += kLogitPiece) {
      const std::uint32_t d1 = min(d0 + kLogitPiece, dim);
      __syncwarp();  // every lane is done with the last piece
      for (std::uint32_t a = 0; a < Logits::kArrays; ++a) {
        const float* source = logits.array(a) + (static_cast<std::size_t>(span.first) + i0) * dim;
        for (std::uint32_t c = 0; c < here; ++c) {
          if (d0 + lane < d1) staged[a][c][lane] = source[static_cast<std::size_t>(c) * dim + d0 + lane];
        }
      }
      __syncwarp();
      if (lane < here) logits.add(group, piece, d0, d1);
      if (d1 == dim) break;
    }
    if (lane < here) logits.finish(group, rows, piece, d0, h0, [&](std::uint32_t g, float x) { out[g * w.slice] = x; });
  }
}

// Enqueues the logits kernel of every row (nothing without candidates).
template <class Logits>
void launch_select_logits(const char* function, const SelectRows& rows, const Logits& logits, const Workspace& w,
                          cudaStream_t stream) {
  static_assert(kLogitPiece == kWarp, "a lane copies one dimension of a piece");
  if (rows.rows == 0 || rows.max_row_candidates == 0) return;
  const std::uint32_t tiles = (rows.max_row_candidates + kLogitCandidates - 1) / kLogitCandidates;
  if (tiles > kMaxGridY) {
    throw_invalid(function, "max_row_candidates " + std::to_string(rows.max_row_candidates) + " exceeds " +
                                std::to_string(kMaxGridY * kLogitCandidates) + " (the logits kernel's grid)");
  }
  select_logits_kernel<<<dim3(rows.rows, tiles), kLogitCandidates, 0, stream>>>(rows, logits, w);
  check_launch(function);
}

__global__ void __launch_bounds__(kThreads)
    quest_select_kernel(SelectRows rows, QuestSelect quest, SelectOutput out, Workspace w) {
  __shared__ Shared s;
  const Row row = row_view(rows, w);
  const std::uint64_t total = row_tokens(s, row);
  if (quest.dense_layer || total <= quest.budget_tokens) {
    write_all(row, out, 0, 0);
    return;
  }
  const std::uint32_t newest = row.n - 1;
  for (std::uint32_t g = 0; g < rows.group; ++g) add_softmax_shares(s, row, g, newest, row.scratch + g * w.slice);
  __shared__ QuestSteady steady;
  if (threadIdx.x == 0) {
    s.chosen = 0;
    steady = quest_steady(
        row.n, [&](std::uint32_t i) { return row.tokens[i]; }, quest.budget_tokens, quest.sink_tokens,
        quest.window_tokens);
    for (std::uint32_t i = 0; i < steady.sinks; ++i) choose(s, row, row.partitions[i]);
    for (std::uint32_t i = steady.window_first; i < row.n; ++i) choose(s, row, row.partitions[i]);
  }
  __syncthreads();
  SkipFill fill{steady.left};
  block_ranked_fill(
      s, row, fill, [&](std::uint32_t i) { return row.scores[i]; },
      [&](std::uint32_t i) { return i >= steady.sinks && i < steady.window_first; },
      [&](std::uint32_t i) { choose(s, row, row.partitions[i]); });
  write_sorted(s, row, out);
}

__global__ void __launch_bounds__(kThreads)
    shadowkv_select_kernel(SelectRows rows, ShadowKVSelect shadowkv, SelectOutput out, Workspace w) {
  __shared__ Shared s;
  __shared__ std::int64_t window_left;
  const Row row = row_view(rows, w);
  const std::uint64_t total = row_tokens(s, row);
  if (total <= shadowkv.budget_tokens) {
    write_all(row, out, 0, 0);
    return;
  }
  const auto tokens = [&](std::uint32_t i) { return row.tokens[i]; };
  const auto untaken = [&](std::uint32_t i) { return row.taken[i] == 0; };
  const auto take = [&](std::uint32_t i) {
    row.taken[i] = 1;
    choose(s, row, row.partitions[i]);
  };
  for (std::uint32_t i = threadIdx.x; i < row.n; i += kThreads) row.taken[i] = 0;
  __syncthreads();
  if (threadIdx.x == 0) {
    s.chosen = 0;
    const ShadowKVWindow window = shadowkv_window(row.n, tokens, shadowkv.recent_tokens, shadowkv.budget_tokens);
    for (std::uint32_t i = row.n - window.pages; i < row.n; ++i) take(i);
    window_left = window.left;
  }
  __syncthreads();
  SkipFill outliers{window_left, shadowkv.outlier_pages};
  const float* outlier = shadowkv.outlier_scores + row.first;
  block_ranked_fill(
      s, row, outliers, [&](std::uint32_t i) { return -outlier[i]; }, untaken, take);
  for (std::uint32_t g = 0; g < rows.group; ++g) {
    float* logits = row.scratch + g * w.slice;  // the logits kernel's; exponentiated in place
    float top = kMinusInf;
    for (std::uint32_t i = threadIdx.x; i < row.n; i += kThreads) {
      if (untaken(i)) top = fold_max_score(top, logits[i]);
    }
    top = block_max(s, top);
    for (std::uint32_t i = threadIdx.x; i < row.n; i += kThreads) {
      if (untaken(i)) logits[i] = portable_exp(add_rn(logits[i], -top));
    }
    __syncthreads();
    const float sum = block_lane_sum<float>(
        s, row.n, [&](std::uint32_t i) { return logits[i]; }, untaken);
    for (std::uint32_t i = threadIdx.x; i < row.n; i += kThreads) {
      if (untaken(i)) row.scores[i] = fold_max_score(g == 0 ? kMinusInf : row.scores[i], div_rn(logits[i], sum));
    }
    __syncthreads();
  }
  SkipFill top_k{outliers.left};
  block_ranked_fill(
      s, row, top_k, [&](std::uint32_t i) { return row.scores[i]; }, untaken, take);
  write_sorted(s, row, out);
}

// The steady zone of a RetroInfer row (thread 0; RetroInferPolicy's head_steady_zone).
__device__ SteadyZone row_steady_zone(const Row& row, const RetroInferSelect& retro, std::uint32_t sink_tokens) {
  // Device data the host cannot check: a count past the row must not index before it.
  const std::uint32_t recent = retro.recent[row.index] < row.n ? retro.recent[row.index] : row.n;
  const std::uint32_t older = row.n - recent;
  return steady_zone(
      recent, [&](std::uint32_t i) { return row.tokens[older + i]; }, sink_tokens,
      retroinfer_row_window(retro, row.index), retroinfer_token_cap(retro.budget_tokens));
}

// RetroInferPolicy's score(): the rank of the centroid logits.
__device__ void retroinfer_rank(Shared& s, const Row& row, const SelectRows& rows, const float* centroids,
                                std::uint32_t m, std::size_t stride) {
  const float scale = logit_scale(rows.head_dim);
  group_softmax_rank(s, row, rows, m, stride, [&](const float* qh, std::uint32_t i) {
    const float* centroid = centroids + (static_cast<std::size_t>(row.first) + i) * rows.head_dim;
    return retroinfer_logit(qh, centroid, rows.head_dim, scale);
  });
}

__global__ void __launch_bounds__(kThreads)
    retroinfer_select_kernel(SelectRows rows, RetroInferSelect retro, SelectOutput out, Workspace w) {
  __shared__ Shared s;
  // Plain variables: __shared__ variables take no constructor (SteadyZone has one).
  __shared__ std::uint32_t window_parts, steady_tokens;
  const Row row = row_view(rows, w);
  const std::uint32_t sink_tokens = retro.sink_tokens[row.index];
  const PartitionId sink = retro.sink_partitions[row.index];
  const std::uint64_t total = row_tokens(s, row) + sink_tokens;
  if (retroinfer_covers(retro.budget_tokens, total)) {
    write_all(row, out, sink_tokens, sink);
    return;
  }
  if (threadIdx.x == 0) {
    const SteadyZone steady = row_steady_zone(row, retro, sink_tokens);
    s.chosen = 0;
    if (steady.sink) choose(s, row, sink);
    for (std::uint32_t i = row.n - steady.window_parts; i < row.n; ++i) choose(s, row, row.partitions[i]);
    window_parts = steady.window_parts;
    steady_tokens = steady.tokens;
  }
  __syncthreads();
  const std::uint32_t m = row.n - window_parts;
  if (m > 0) {
    retroinfer_rank(s, row, rows, retro.centroids, m, 0);
    BreakFill fill = retroinfer_retrieval_fill(steady_tokens, retro.budget_tokens, retro.retrieval_fraction, m);
    block_ranked_fill(
        s, row, fill, [&](std::uint32_t i) { return row.scores[i]; }, [&](std::uint32_t i) { return i < m; },
        [&](std::uint32_t i) { choose(s, row, row.partitions[i]); });
  }
  write_sorted(s, row, out);
}

// Whether the ascending ids[0, count) hold id (binary search, as attend()'s).
__device__ bool holds(const PartitionId* ids, std::uint32_t count, PartitionId id) {
  std::uint32_t lo = 0, hi = count;
  while (lo < hi) {
    const std::uint32_t mid = (lo + hi) / 2;
    if (ids[mid] < id) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo < count && ids[lo] == id;
}

// RetroInferPolicy::attend for one row: the rank of retroinfer_select (every
// q head's logits kept), candidates in the selection marked taken, thread 0
// lists the retroinfer_estimation_fill of the untaken in rank order
// (row.ids), then thread p folds q head p / head_dim, dimension
// p % head_dim over that list in order: each thread recomputes its head's
// (max, sum) chain, so every add happens in attend()'s order.
__global__ void __launch_bounds__(kThreads)
    retroinfer_estimate_kernel(SelectRows rows, RetroInferSelect retro, RetroInferEstimate estimate, EstimateOutput out,
                               Workspace w) {
  __shared__ Shared s;
  __shared__ std::uint32_t window_parts;
  const Row row = row_view(rows, w);
  const std::uint32_t sink_tokens = retro.sink_tokens[row.index];
  const bool covered = retroinfer_covers(retro.budget_tokens, row_tokens(s, row) + sink_tokens);
  const bool estimated = estimate.estimation && !covered;
  if (threadIdx.x == 0) {
    s.chosen = 0;
    window_parts = estimated ? row_steady_zone(row, retro, sink_tokens).window_parts : row.n;
  }
  __syncthreads();
  const std::uint32_t m = row.n - window_parts;
  const std::size_t stride = rows.max_row_candidates;
  if (m > 0) {
    retroinfer_rank(s, row, rows, retro.centroids, m, stride);
    const PartitionId* selected = estimate.selected + static_cast<std::size_t>(row.index) * estimate.max_selected;
    const std::uint32_t count = min(estimate.selected_count[row.index], estimate.max_selected);
    for (std::uint32_t i = threadIdx.x; i < m; i += kThreads) {
      row.taken[i] = holds(selected, count, row.partitions[i]) ? 1 : 0;
    }
    __syncthreads();
    BreakFill zone = retroinfer_estimation_fill(estimate.estimation_fraction, m);
    block_ranked_fill(
        s, row, zone, [&](std::uint32_t i) { return row.scores[i]; },
        [&](std::uint32_t i) { return i < m && row.taken[i] == 0; }, [&](std::uint32_t i) { row.ids[s.chosen++] = i; });
  }
  const std::uint32_t members = s.chosen;
  const std::uint32_t dim = rows.head_dim;
  const std::size_t head0 = static_cast<std::size_t>(row.index) * rows.group;
  for (std::uint32_t p = threadIdx.x; p < rows.group * dim; p += kThreads) {
    const std::uint32_t g = p / dim;
    const std::uint32_t d = p % dim;
    const float* logits = row.scratch + g * stride;
    SoftmaxState state;
    float acc = 0.0f;
    for (std::uint32_t j = 0; j < members; ++j) {
      const std::uint32_t i = row.ids[j];
      const RescaleStep step = estimation_fold(state, logits[i], static_cast<float>(row.tokens[i]));
      acc = estimation_rescale_add(acc, step, estimate.value_sums[(static_cast<std::size_t>(row.first) + i) * dim + d]);
    }
    out.acc[(head0 + g) * dim + d] = acc;
    if (d == 0) {
      out.max[head0 + g] = state.max;
      out.sum[head0 + g] = state.sum;
    }
  }
}

// StreamingWindow (everything false) and Dense (true, the zone {0, 0}): thread
// 0 walks the zone (streaming_zone stops at the budget, so it reads only the
// candidates it selects and the two that end its loops), then every thread
// writes its share of [0, sinks) then [window, n), ascending as the host's.
__global__ void __launch_bounds__(kThreads)
    positional_select_kernel(SelectRows rows, StreamingSelect streaming, bool everything, SelectOutput out) {
  __shared__ std::uint32_t sinks, window;
  const std::uint32_t r = blockIdx.x;
  const SelectRowSpan span = select_row_span(rows.first[r], rows.count[r], rows.max_row_candidates, rows.candidates);
  if (threadIdx.x == 0) {
    PositionalZone zone;
    if (!everything) {
      const std::uint32_t* tokens = rows.tokens + span.first;
      zone = streaming_zone(
          span.n, [&](std::uint32_t i) { return tokens[i]; }, streaming.sink_pages, streaming.budget_tokens);
    }
    sinks = zone.sinks;
    window = zone.window;
  }
  __syncthreads();
  const PositionalZone zone{sinks, window};
  const std::uint32_t count = positional_count(zone, span.n);
  PartitionId* selected = out.selected + static_cast<std::size_t>(r) * out.max_selected;
  for (std::uint32_t j = threadIdx.x; j < count && j < out.max_selected; j += kThreads) {
    selected[j] = rows.partitions[span.first + positional_candidate(zone, j)];
  }
  if (threadIdx.x == 0) out.selected_count[r] = count;
}

// ---- host side ---------------------------------------------------------------

std::uint32_t capacity(const SelectRows& rows, std::uint32_t budget, bool everything, std::uint32_t extra) {
  return select_capacity(rows.max_row_candidates, budget, everything, extra);
}

// The rows' shape, as every entry point checks it: whole requests of
// kv_heads rows, and a row capacity within the candidates.
void check_row_shape(const char* function, const SelectRows& rows) {
  if (rows.kv_heads == 0) throw_invalid(function, "kv_heads must be > 0");
  if (rows.rows % rows.kv_heads != 0) {
    throw_invalid(function, std::to_string(rows.rows) + " rows are not a whole number of requests of " +
                                std::to_string(rows.kv_heads) + " kv heads");
  }
  if (rows.max_row_candidates > rows.candidates) {
    throw_invalid(function, "max_row_candidates " + std::to_string(rows.max_row_candidates) + " exceeds " +
                                std::to_string(rows.candidates) + " candidates");
  }
}

// `selected`, `selected_count` and `max_selected`: a select call's output or
// the estimate's input selection.
void check_rows(const char* function, const SelectRows& rows, std::uint32_t budget, const void* selected,
                const void* selected_count, std::uint32_t max_selected, std::uint32_t needed, const void* workspace,
                std::size_t bytes, std::size_t needed_bytes) {
  if (rows.group == 0 || rows.head_dim == 0) {
    throw_invalid(function, "group " + std::to_string(rows.group) + " and head_dim " + std::to_string(rows.head_dim) +
                                " must be > 0");
  }
  check_row_shape(function, rows);
  if (budget == 0) throw_invalid(function, "budget_tokens must be > 0");
  if (rows.rows == 0) return;
  if (max_selected < needed) {
    throw_invalid(function, "max_selected " + std::to_string(max_selected) + " is below the " + std::to_string(needed) +
                                " partitions a row may select");
  }
  if (rows.first == nullptr || rows.count == nullptr || rows.q == nullptr || selected_count == nullptr ||
      (max_selected > 0 && selected == nullptr) ||
      (rows.candidates > 0 && (rows.tokens == nullptr || rows.partitions == nullptr))) {
    throw_invalid(function, "null first, count, tokens, partitions, q or selection");
  }
  if (workspace == nullptr || bytes < needed_bytes) {
    throw_invalid(function,
                  "workspace of " + std::to_string(bytes) + " bytes, " + std::to_string(needed_bytes) + " needed");
  }
}

void check_retroinfer(const char* function, const SelectRows& rows, const RetroInferSelect& retroinfer) {
  if (!(retroinfer.retrieval_fraction >= 0.0f && retroinfer.retrieval_fraction <= 1.0f)) {
    throw_invalid(function,
                  "retrieval_fraction " + std::to_string(retroinfer.retrieval_fraction) + " is outside [0, 1]");
  }
  if (rows.rows == 0) return;
  if ((rows.candidates > 0 && retroinfer.centroids == nullptr) || retroinfer.sink_partitions == nullptr ||
      retroinfer.sink_tokens == nullptr || retroinfer.recent == nullptr) {
    throw_invalid(function, "null centroids, sink or recent arrays");
  }
}

// The positional selections' checks (streaming: its parameters and the
// tokens it reads; null: Dense, which reads neither q nor tokens).
void check_positional(const char* function, const SelectRows& rows, const StreamingSelect* streaming,
                      const SelectOutput& out, std::uint32_t needed) {
  check_row_shape(function, rows);
  if (streaming != nullptr && (streaming->budget_tokens == 0 || streaming->page_tokens == 0)) {
    throw_invalid(function, "budget_tokens " + std::to_string(streaming->budget_tokens) + " and page_tokens " +
                                std::to_string(streaming->page_tokens) + " must be > 0");
  }
  if (rows.rows == 0) return;
  if (out.max_selected < needed) {
    throw_invalid(function, "max_selected " + std::to_string(out.max_selected) + " is below the " +
                                std::to_string(needed) + " partitions a row may select");
  }
  if (rows.first == nullptr || rows.count == nullptr || out.selected_count == nullptr ||
      (out.max_selected > 0 && out.selected == nullptr) ||
      (rows.candidates > 0 && (rows.partitions == nullptr || (streaming != nullptr && rows.tokens == nullptr)))) {
    throw_invalid(function, "null first, count, tokens, partitions or selection");
  }
}

}  // namespace

std::size_t select_workspace_bytes(const SelectRows& rows) {
  return workspace_bytes(rows.rows, rows.max_row_candidates, rows.group);
}

std::uint32_t quest_select_capacity(const SelectRows& rows, const QuestSelect& quest) {
  return capacity(rows, quest.budget_tokens, quest.dense_layer, 0);
}
std::uint32_t shadowkv_select_capacity(const SelectRows& rows, const ShadowKVSelect& shadowkv) {
  return capacity(rows, shadowkv.budget_tokens, false, 0);
}
std::uint32_t retroinfer_select_capacity(const SelectRows& rows, const RetroInferSelect& retroinfer) {
  return capacity(rows, retroinfer.budget_tokens, retroinfer.budget_tokens == 0, 1);
}

std::uint32_t streaming_select_capacity(const SelectRows& rows, const StreamingSelect& streaming) {
  if (streaming.page_tokens == 0) return rows.max_row_candidates;
  const std::uint64_t pages =
      (std::uint64_t{streaming.budget_tokens} + streaming.page_tokens - 1) / streaming.page_tokens;
  return capacity(rows, static_cast<std::uint32_t>(pages), false, 0);
}
std::uint32_t dense_select_capacity(const SelectRows& rows) { return capacity(rows, 0, true, 0); }

void quest_select(const SelectRows& rows, const QuestSelect& quest, const SelectOutput& out, void* workspace,
                  std::size_t workspace_bytes, void* stream) {
  check_rows("quest_select", rows, quest.budget_tokens, out.selected, out.selected_count, out.max_selected,
             quest_select_capacity(rows, quest), workspace, workspace_bytes, select_workspace_bytes(rows));
  if (rows.rows == 0) return;
  if (rows.candidates > 0 && (quest.min == nullptr || quest.max == nullptr)) {
    throw_invalid("quest_select", "null min or max");
  }
  const Workspace w = carve(workspace, rows.rows, rows.max_row_candidates, rows.group);
  const auto s = static_cast<cudaStream_t>(stream);
  if (!quest.dense_layer) {
    launch_select_logits("quest_select", rows, QuestLogits{quest, logit_scale(rows.head_dim)}, w, s);
  }
  quest_select_kernel<<<rows.rows, kThreads, 0, s>>>(rows, quest, out, w);
  check_launch("quest_select");
}

void shadowkv_select(const SelectRows& rows, const ShadowKVSelect& shadowkv, const SelectOutput& out, void* workspace,
                     std::size_t workspace_bytes, void* stream) {
  check_rows("shadowkv_select", rows, shadowkv.budget_tokens, out.selected, out.selected_count, out.max_selected,
             shadowkv_select_capacity(rows, shadowkv), workspace, workspace_bytes, select_workspace_bytes(rows));
  if (rows.rows == 0) return;
  if (rows.candidates > 0 && (shadowkv.landmarks == nullptr || shadowkv.outlier_scores == nullptr)) {
    throw_invalid("shadowkv_select", "null landmarks or outlier scores");
  }
  const Workspace w = carve(workspace, rows.rows, rows.max_row_candidates, rows.group);
  const auto s = static_cast<cudaStream_t>(stream);
  const ShadowKVLogits logits{shadowkv.landmarks, logit_scale(rows.head_dim)};
  launch_select_logits("shadowkv_select", rows, logits, w, s);
  shadowkv_select_kernel<<<rows.rows, kThreads, 0, s>>>(rows, shadowkv, out, w);
  check_launch("shadowkv_select");
}

void retroinfer_select(const SelectRows& rows, const RetroInferSelect& retroinfer, const SelectOutput& out,
                       void* workspace, std::size_t workspace_bytes, void* stream) {
  // budget_tokens 0 is no budget (the fraction rule), not a missing one.
  check_rows("retroinfer_select", rows, retroinfer_token_cap(retroinfer.budget_tokens), out.selected,
             out.selected_count, out.max_selected, retroinfer_select_capacity(rows, retroinfer), workspace,
             workspace_bytes, select_workspace_bytes(rows));
  check_retroinfer("retroinfer_select", rows, retroinfer);
  if (rows.rows == 0) return;
  retroinfer_select_kernel<<<rows.rows, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      rows, retroinfer, out, carve(workspace, rows.rows, rows.max_row_candidates, rows.group));
  check_launch("retroinfer_select");
}

void streaming_select(const SelectRows& rows, const StreamingSelect& streaming, const SelectOutput& out, void* stream) {
  check_positional("streaming_select", rows, &streaming, out, streaming_select_capacity(rows, streaming));
  if (rows.rows == 0) return;
  positional_select_kernel<<<rows.rows, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(rows, streaming, false, out);
  check_launch("streaming_select");
}

void dense_select(const SelectRows& rows, const SelectOutput& out, void* stream) {
  check_positional("dense_select", rows, nullptr, out, dense_select_capacity(rows));
  if (rows.rows == 0) return;
  positional_select_kernel<<<rows.rows, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(rows, StreamingSelect{}, true,
                                                                                          out);
  check_launch("dense_select");
}

void retroinfer_estimate(const SelectRows& rows, const RetroInferSelect& retroinfer, const RetroInferEstimate& estimate,
                         const EstimateOutput& out, void* workspace, std::size_t workspace_bytes, void* stream) {
  check_rows("retroinfer_estimate", rows, retroinfer_token_cap(retroinfer.budget_tokens), estimate.selected,
             estimate.selected_count, estimate.max_selected, retroinfer_select_capacity(rows, retroinfer), workspace,
             workspace_bytes, select_workspace_bytes(rows));
  check_retroinfer("retroinfer_estimate", rows, retroinfer);
  // RetroInferPolicy::Options' rule.
  if (!(estimate.estimation_fraction >= 0.0f &&
        static_cast<double>(retroinfer.retrieval_fraction) + estimate.estimation_fraction <= 1.0 + 1e-6)) {
    throw_invalid("retroinfer_estimate", "estimation_fraction " + std::to_string(estimate.estimation_fraction) +
                                             " is negative or the zones exceed 1");
  }
  if (rows.rows == 0) return;
  if ((rows.candidates > 0 && estimate.value_sums == nullptr) || out.max == nullptr || out.sum == nullptr ||
      out.acc == nullptr) {
    throw_invalid("retroinfer_estimate", "null value sums or output");
  }
  retroinfer_estimate_kernel<<<rows.rows, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      rows, retroinfer, estimate, out, carve(workspace, rows.rows, rows.max_row_candidates, rows.group));
  check_launch("retroinfer_estimate");
}

}  // namespace sparsekv::cuda
