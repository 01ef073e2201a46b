#pragma once
// A host emulation of the select kernels' parallel decomposition
// (cuda/policy/select_kernels.cu) over rows as the kernels address them
// (HostRows, select_test_data.hpp): per-thread scores, strided block maxima,
// warp-0 lane sums, ranking rounds of a tile (radix-select threshold passes
// over 8-bit digit histograms, then a sort), thread 0's greedy fill, the
// output sort in runs merged by rank; RetroInfer's estimate kernel. Shared by
// the Select rules (test_select_rules.cpp: emulation = host policies) and the
// emulated device runtime (device_runtime_emulation.hpp), with the mutations
// those tests plant.
#include <catch2/catch.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <utility>
#include <vector>

#include "select_test_data.hpp"
#include "sparsekv/core/numeric.hpp"
#include "sparsekv/policy/select_cuda.hpp"
#include "sparsekv/policy/select_rules.hpp"

namespace sparsekv::test {

// ---- the emulation ---------------------------------------------------------------

constexpr std::uint32_t kSelectThreads = 256;  // the kernels' block
constexpr float kMinusInf = -std::numeric_limits<float>::infinity();
constexpr std::uint64_t kNoKey = std::numeric_limits<std::uint64_t>::max();

struct Emulation {
  std::uint32_t tile = cuda::kSelectTile;
  bool ties_to_higher = false;      // mutation: ties rank the higher index first
  bool skip_stops = false;          // mutation: a candidate that does not fit ends the fill
  bool estimate_retrieved = false;  // mutation: the estimate ignores the selection
  bool candidate_order = false;     // mutation: the estimate folds its zone in candidate order
  bool csr_extent = false;          // mutation: a row ends where the next row's first candidate is (a CSR habit)
};

inline std::uint64_t key_of(const Emulation& e, float score, std::uint32_t i) {
  return e.ties_to_higher ? (rank_key(score, i) & ~std::uint64_t{0xffffffffu}) | ~i : rank_key(score, i);
}
inline std::uint32_t index_of(const Emulation& e, std::uint64_t key) {
  return e.ties_to_higher ? ~rank_key_index(key) : rank_key_index(key);
}

// block_max: 256 strided thread partials, then merged as a tree (not in order).
template <class Value, class Include>
inline float emulated_max(std::uint32_t n, Value value, Include include) {
  std::vector<float> partial(kSelectThreads, kMinusInf);
  for (std::uint32_t i = 0; i < n; ++i) {
    if (include(i)) partial[i % kSelectThreads] = fold_max_score(partial[i % kSelectThreads], value(i));
  }
  for (std::uint32_t width = kSelectThreads / 2; width > 0; width /= 2) {
    for (std::uint32_t t = 0; t < width; ++t) partial[t] = fold_max_score(partial[t + width], partial[t]);
  }
  return partial[0];
}

// block_lane_sum: lane l of warp 0 adds i = l, l + 32, ... in order; __shfl_down tree.
template <class T, class Value, class Include>
T emulated_lane_sum(std::uint32_t n, Value value, Include include) {
  T lanes[kSumLanes] = {};
  for (std::uint32_t l = 0; l < kSumLanes; ++l) {
    for (std::uint32_t i = l; i < n; i += kSumLanes) {
      if (include(i)) lanes[l] = lanes[l] + value(i);
    }
  }
  return tree_combine(lanes);
}

// block_ranked_fill, round by round.
template <class Filler, class Score, class Eligible, class Take>
inline void emulated_ranked_fill(const Emulation& e, std::uint32_t n, const std::uint32_t* tokens, Filler& fill,
                                 Score score, Eligible eligible, Take take) {
  std::uint64_t bound = 0;
  for (;;) {
    std::vector<std::uint64_t> left;
    for (std::uint32_t i = 0; i < n; ++i) {
      if (!eligible(i)) continue;
      const std::uint64_t key = key_of(e, score(i), i);
      if (key > bound) left.push_back(key);
    }
    if (left.empty()) return;
    std::uint64_t last = kNoKey;
    if (left.size() > e.tile) {
      TileThreshold t;
      t.needed = e.tile;
      while (!t.done) {
        std::uint32_t histogram[kRadixBins] = {};
        for (const std::uint64_t key : left) {
          if (t.matches(key)) ++histogram[t.digit(key)];
        }
        t.step(histogram);
      }
      last = t.threshold();
    }
    std::vector<std::uint64_t> tile;
    for (const std::uint64_t key : left) {
      if (key <= last) tile.push_back(key);
    }
    REQUIRE(tile.size() == std::min<std::size_t>(left.size(), e.tile));
    std::sort(tile.begin(), tile.end());
    for (const std::uint64_t key : tile) {
      const std::uint32_t i = index_of(e, key);
      Fill f = fill.offer(tokens[i]);
      if (e.skip_stops && f == Fill::skip) f = Fill::stop;
      if (f == Fill::stop) return;
      if (f == Fill::take) take(i);
    }
    if (left.size() <= e.tile) return;
    bound = tile.back();
  }
}

// write_sorted: runs of a tile sorted, placed by merged_position.
inline std::vector<PartitionId> emulated_sorted(const Emulation& e, std::vector<PartitionId> ids) {
  const auto count = static_cast<std::uint32_t>(ids.size());
  for (std::uint32_t first = 0; first < count; first += e.tile) {
    std::sort(ids.begin() + first, ids.begin() + std::min(count, first + e.tile));
  }
  std::vector<PartitionId> out(count, kInvalidPartition);
  for (std::uint32_t j = 0; j < count; ++j) out[merged_position(ids.data(), count, e.tile, j)] = ids[j];
  return out;
}

// row_view's span: first / count through select_row_span, clamped to the
// region capacity (max_row) and the arrays' extent.
inline cuda::SelectRowSpan row_span(const Emulation& e, const HostRows& rows, std::uint32_t r) {
  std::uint32_t count = rows.count[r];
  if (e.csr_extent) count = (r + 1 < rows.rows() ? rows.first[r + 1] : rows.candidates()) - rows.first[r];
  return cuda::select_row_span(rows.first[r], count, rows.max_row, rows.candidates());
}

inline std::vector<PartitionId> row_partitions(const HostRows& rows, cuda::SelectRowSpan span) {
  return {rows.partitions.begin() + span.first, rows.partitions.begin() + span.first + span.n};
}

inline std::uint64_t row_total(const HostRows& rows, cuda::SelectRowSpan span) {
  std::uint64_t total = 0;
  for (std::uint32_t i = span.first; i < span.first + span.n; ++i) total += rows.tokens[i];
  return total;
}

inline const float* row_q(const HostRows& rows, std::uint32_t r) {
  return rows.q.data() + std::size_t{r} * rows.group * rows.head_dim;
}

// add_softmax_shares for every q head g over the candidates [0, m), from
// logits[g * m ..]: a strided block max, the warp-0 double lane sum, the
// shares summed over the group into scores.
inline void emulated_softmax_shares(const HostRows& rows, std::uint32_t m, const std::vector<float>& logits,
                                    std::vector<float>& scores) {
  const auto all = [](std::uint32_t) { return true; };
  scores.assign(m, 0.0f);
  for (std::uint32_t g = 0; g < rows.group; ++g) {
    const float* s = logits.data() + std::size_t{g} * m;
    const float top = emulated_max(
        m, [&](std::uint32_t i) { return s[i]; }, all);
    const double sum = emulated_lane_sum<double>(
        m, [&](std::uint32_t i) { return static_cast<double>(portable_exp(add_rn(s[i], -top))); }, all);
    const float inverse = softmax_inverse_sum(sum);
    for (std::uint32_t i = 0; i < m; ++i) {
      scores[i] = add_rn(g == 0 ? 0.0f : scores[i], softmax_share(s[i], top, inverse));
    }
  }
}

// group_softmax_rank: per q head g the logits logit(qh, i) of [0, m) (kept
// in logits[g * m ..]), then the shares.
template <class Logit>
void emulated_group_softmax_rank(const HostRows& rows, std::uint32_t r, std::uint32_t m, std::vector<float>& logits,
                                 std::vector<float>& scores, Logit logit) {
  logits.assign(std::size_t{rows.group} * m, 0.0f);
  for (std::uint32_t g = 0; g < rows.group; ++g) {
    const float* qh = row_q(rows, r) + std::size_t{g} * rows.head_dim;
    for (std::uint32_t i = 0; i < m; ++i) logits[std::size_t{g} * m + i] = logit(qh, i);
  }
  emulated_softmax_shares(rows, m, logits, scores);
}

// select_logits_kernel for row r: thread i < m takes candidate i's summary
// rows (arrays[a] + (first + i) * head_dim) a piece of kLogitPiece dimensions
// at a time, as the warp stages them, into the sums of each kLogitHeads of
// the group (make(q, h0), add(group, piece, d0, d1), then finish(group,
// last piece, its d0, h0, emit)); the logits at logits[g * m + i].
template <std::size_t kArrays, class Make, class Add, class Finish>
std::vector<float> emulated_logits_kernel(const HostRows& rows, std::uint32_t r, std::uint32_t first, std::uint32_t m,
                                          const std::array<const float*, kArrays>& arrays, Make make, Add add,
                                          Finish finish) {
  const std::uint32_t dim = rows.head_dim;
  std::vector<float> out(std::size_t{rows.group} * m, 0.0f);
  std::array<std::array<float, kLogitPiece>, kArrays> staged{};
  const float* piece[kArrays];
  for (std::size_t a = 0; a < kArrays; ++a) piece[a] = staged[a].data();
  for (std::uint32_t i = 0; i < m; ++i) {
    for (std::uint32_t h0 = 0; h0 < rows.group; h0 += kLogitHeads) {
      auto group = make(row_q(rows, r), h0);
      std::uint32_t d0 = 0;
      for (;; d0 += kLogitPiece) {
        const std::uint32_t d1 = std::min(d0 + kLogitPiece, dim);
        for (std::size_t a = 0; a < kArrays; ++a) {
          const float* row = arrays[a] + (std::size_t{first} + i) * dim;
          std::copy(row + d0, row + d1, staged[a].begin());
        }
        add(group, piece, d0, d1);
        if (d1 == dim) break;
      }
      finish(group, piece, d0, h0, [&](std::uint32_t g, float x) { out[std::size_t{g} * m + i] = x; });
    }
  }
  return out;
}

inline std::vector<PartitionId> emulate_quest(const Emulation& e, const HostRows& rows, std::uint32_t r,
                                              const cuda::QuestSelect& quest) {
  const cuda::SelectRowSpan span = row_span(e, rows, r);
  const std::uint32_t first = span.first, n = span.n, dim = rows.head_dim;
  if (quest.dense_layer || row_total(rows, span) <= quest.budget_tokens) return row_partitions(rows, span);
  const std::uint32_t newest = n - 1;
  const float scale = logit_scale(dim);
  const std::vector<float> logits = emulated_logits_kernel<2>(
      rows, r, first, newest, {rows.a.data(), rows.b.data()},
      [&](const float* q, std::uint32_t h0) { return QuestGroupLogits(q, rows.group, h0, dim, quest.spread, scale); },
      [](QuestGroupLogits& g, const float* const* piece, std::uint32_t d0, std::uint32_t d1) {
        g.add(piece[0], piece[1], d0, d1);
      },
      [&](const QuestGroupLogits& g, const float* const* piece, std::uint32_t d0, std::uint32_t h0, auto&& emit) {
        g.finish(piece[0], piece[1], d0, dim, rows.group, h0, emit);
      });
  std::vector<float> scores;
  emulated_softmax_shares(rows, newest, logits, scores);
  scores.resize(n);
  const QuestSteady steady = quest_steady(
      n, [&](std::uint32_t i) { return rows.tokens[first + i]; }, quest.budget_tokens, quest.sink_tokens,
      quest.window_tokens);
  std::vector<PartitionId> chosen;
  for (std::uint32_t i = 0; i < steady.sinks; ++i) chosen.push_back(rows.partitions[first + i]);
  for (std::uint32_t i = steady.window_first; i < n; ++i) chosen.push_back(rows.partitions[first + i]);
  SkipFill fill{steady.left};
  emulated_ranked_fill(
      e, n, rows.tokens.data() + first, fill, [&](std::uint32_t i) { return scores[i]; },
      [&](std::uint32_t i) { return i >= steady.sinks && i < steady.window_first; },
      [&](std::uint32_t i) { chosen.push_back(rows.partitions[first + i]); });
  return emulated_sorted(e, chosen);
}

// positional_select_kernel for row r: the row's span, thread 0's zone
// (streaming_zone; Dense: {0, 0}), then the zone's j-th candidate's id at j.
inline std::vector<PartitionId> emulate_positional(const Emulation& e, const HostRows& rows, std::uint32_t r,
                                                   const cuda::StreamingSelect* streaming) {
  const cuda::SelectRowSpan span = row_span(e, rows, r);
  PositionalZone zone;
  if (streaming != nullptr) {
    const std::uint32_t* tokens = rows.tokens.data() + span.first;
    zone = streaming_zone(
        span.n, [&](std::uint32_t i) { return tokens[i]; }, streaming->sink_pages, streaming->budget_tokens);
  }
  std::vector<PartitionId> out(positional_count(zone, span.n));
  for (std::uint32_t j = 0; j < out.size(); ++j) out[j] = rows.partitions[span.first + positional_candidate(zone, j)];
  return out;
}

inline std::vector<PartitionId> emulate_shadowkv(const Emulation& e, const HostRows& rows, std::uint32_t r,
                                                 const cuda::ShadowKVSelect& shadowkv) {
  const cuda::SelectRowSpan span = row_span(e, rows, r);
  const std::uint32_t first = span.first, n = span.n, dim = rows.head_dim;
  if (row_total(rows, span) <= shadowkv.budget_tokens) return row_partitions(rows, span);
  const std::uint32_t* tokens = rows.tokens.data() + first;
  std::vector<char> taken(n, 0);
  std::vector<float> scores(n), scratch(n);
  std::vector<PartitionId> chosen;
  const auto untaken = [&](std::uint32_t i) { return taken[i] == 0; };
  const auto take = [&](std::uint32_t i) {
    taken[i] = 1;
    chosen.push_back(rows.partitions[first + i]);
  };
  const ShadowKVWindow window = shadowkv_window(
      n, [&](std::uint32_t i) { return tokens[i]; }, shadowkv.recent_tokens, shadowkv.budget_tokens);
  for (std::uint32_t i = n - window.pages; i < n; ++i) take(i);
  SkipFill outliers{window.left, shadowkv.outlier_pages};
  emulated_ranked_fill(
      e, n, tokens, outliers, [&](std::uint32_t i) { return -rows.b[first + i]; }, untaken, take);
  const float scale = logit_scale(dim);
  const std::vector<float> logits = emulated_logits_kernel<1>(
      rows, r, first, n, {rows.a.data()},
      [&](const float* q, std::uint32_t h0) { return ShadowKVGroupLogits(q, rows.group, h0, dim, scale); },
      [](ShadowKVGroupLogits& g, const float* const* piece, std::uint32_t d0, std::uint32_t d1) {
        g.add(piece[0], d0, d1);
      },
      [&](const ShadowKVGroupLogits& g, const float* const*, std::uint32_t, std::uint32_t h0, auto&& emit) {
        g.finish(rows.group, h0, emit);
      });
  for (std::uint32_t g = 0; g < rows.group; ++g) {
    for (std::uint32_t i = 0; i < n; ++i) {
      if (untaken(i)) scratch[i] = logits[std::size_t{g} * n + i];
    }
    const float top = emulated_max(
        n, [&](std::uint32_t i) { return scratch[i]; }, untaken);
    for (std::uint32_t i = 0; i < n; ++i) {
      if (untaken(i)) scratch[i] = portable_exp(add_rn(scratch[i], -top));
    }
    const float sum = emulated_lane_sum<float>(
        n, [&](std::uint32_t i) { return scratch[i]; }, untaken);
    for (std::uint32_t i = 0; i < n; ++i) {
      if (untaken(i)) scores[i] = fold_max_score(g == 0 ? kMinusInf : scores[i], div_rn(scratch[i], sum));
    }
  }
  SkipFill top_k{outliers.left};
  emulated_ranked_fill(
      e, n, tokens, top_k, [&](std::uint32_t i) { return scores[i]; }, untaken, take);
  return emulated_sorted(e, chosen);
}

// retroinfer_rank: the rank of the centroid logits.
inline void emulated_retroinfer_rank(const HostRows& rows, std::uint32_t r, cuda::SelectRowSpan span, std::uint32_t m,
                                     std::vector<float>& logits, std::vector<float>& scores) {
  const std::uint32_t dim = rows.head_dim;
  const float scale = logit_scale(dim);
  emulated_group_softmax_rank(rows, r, m, logits, scores, [&](const float* qh, std::uint32_t i) {
    return retroinfer_logit(qh, rows.a.data() + (std::size_t{span.first} + i) * dim, dim, scale);
  });
}

inline SteadyZone emulated_steady_zone(const HostRows& rows, std::uint32_t r, cuda::SelectRowSpan span,
                                       const cuda::RetroInferSelect& retro) {
  const std::uint32_t* tokens = rows.tokens.data() + span.first;
  const std::uint32_t recent = std::min(rows.recent[r], span.n), older = span.n - recent;
  return steady_zone(
      recent, [&](std::uint32_t i) { return tokens[older + i]; }, rows.sink_tokens[r],
      cuda::retroinfer_row_window(retro, r), retroinfer_token_cap(retro.budget_tokens));
}

inline std::vector<PartitionId> emulate_retroinfer(const Emulation& e, const HostRows& rows, std::uint32_t r,
                                                   const cuda::RetroInferSelect& retro) {
  const cuda::SelectRowSpan span = row_span(e, rows, r);
  const std::uint32_t first = span.first, n = span.n;
  const std::uint32_t* tokens = rows.tokens.data() + first;
  const std::uint32_t sink_tokens = rows.sink_tokens[r];
  if (retroinfer_covers(retro.budget_tokens, row_total(rows, span) + sink_tokens)) {
    std::vector<PartitionId> all;
    if (sink_tokens > 0) all.push_back(rows.sink_partitions[r]);
    const auto rest = row_partitions(rows, span);
    all.insert(all.end(), rest.begin(), rest.end());
    return all;
  }
  const SteadyZone steady = emulated_steady_zone(rows, r, span, retro);
  std::vector<PartitionId> chosen;
  if (steady.sink) chosen.push_back(rows.sink_partitions[r]);
  for (std::uint32_t i = n - steady.window_parts; i < n; ++i) chosen.push_back(rows.partitions[first + i]);
  const std::uint32_t m = n - steady.window_parts;
  if (m > 0) {
    std::vector<float> logits, scores;
    emulated_retroinfer_rank(rows, r, span, m, logits, scores);
    BreakFill fill = retroinfer_retrieval_fill(steady.tokens, retro.budget_tokens, retro.retrieval_fraction, m);
    emulated_ranked_fill(
        e, m, tokens, fill, [&](std::uint32_t i) { return scores[i]; }, [](std::uint32_t) { return true; },
        [&](std::uint32_t i) { chosen.push_back(rows.partitions[first + i]); });
  }
  return emulated_sorted(e, chosen);
}

// retroinfer_estimate_kernel for row r: the rank, the selection's candidates
// marked, thread 0's zone list in rank order, then each (q head, dimension)
// thread's fold over the list. Returns the row's group of terms.
inline std::vector<AttentionPartial> emulate_estimate(const Emulation& e, const HostRows& rows, std::uint32_t r,
                                                      const cuda::RetroInferSelect& retro,
                                                      const cuda::RetroInferEstimate& estimate,
                                                      const std::vector<PartitionId>& selection) {
  const cuda::SelectRowSpan span = row_span(e, rows, r);
  const std::uint32_t first = span.first, n = span.n, dim = rows.head_dim;
  const std::uint32_t* tokens = rows.tokens.data() + first;
  std::vector<AttentionPartial> terms(rows.group, AttentionPartial(dim));
  const bool covered = retroinfer_covers(retro.budget_tokens, row_total(rows, span) + rows.sink_tokens[r]);
  if (!estimate.estimation || covered) return terms;
  const std::uint32_t m = n - emulated_steady_zone(rows, r, span, retro).window_parts;
  if (m == 0) return terms;
  std::vector<float> logits, scores;
  emulated_retroinfer_rank(rows, r, span, m, logits, scores);
  std::vector<char> taken(m);
  for (std::uint32_t i = 0; i < m; ++i) {
    taken[i] =
        !e.estimate_retrieved && std::binary_search(selection.begin(), selection.end(), rows.partitions[first + i]);
  }
  std::vector<std::uint32_t> members;
  BreakFill zone = retroinfer_estimation_fill(estimate.estimation_fraction, m);
  emulated_ranked_fill(
      e, m, tokens, zone, [&](std::uint32_t i) { return scores[i]; }, [&](std::uint32_t i) { return !taken[i]; },
      [&](std::uint32_t i) { members.push_back(i); });
  if (e.candidate_order) std::sort(members.begin(), members.end());
  for (std::uint32_t p = 0; p < rows.group * dim; ++p) {
    const std::uint32_t g = p / dim, d = p % dim;
    SoftmaxState state;
    float acc = 0.0f;
    for (const std::uint32_t i : members) {
      const RescaleStep step = estimation_fold(state, logits[std::size_t{g} * m + i], static_cast<float>(tokens[i]));
      acc = estimation_rescale_add(acc, step, rows.b[(std::size_t{first} + i) * dim + d]);
    }
    terms[g].acc[d] = acc;
    if (d == 0) {
      terms[g].max = state.max;
      terms[g].sum = state.sum;
    }
  }
  return terms;
}

}  // namespace sparsekv::test
