// PromptAttention (attention/prompt_attention.hpp): compiled once per Highway
// target by foreach_target.h, dispatched at run time to the best the CPU has.
#include "sparsekv/attention/prompt_attention.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "sparsekv/attention/attention_partial.hpp"
#include "sparsekv/core/error.hpp"
#include "sparsekv/core/numeric.hpp"

#ifndef SPARSEKV_SRC_PROMPT_ATTENTION_LAYOUT_
#define SPARSEKV_SRC_PROMPT_ATTENTION_LAYOUT_
namespace sparsekv {
namespace {

// Rows a tile's K scratch holds: a block and the scores' register-block tail.
constexpr std::size_t kBlockRowsPadded = kPromptBlockTokens + 8;
// Floats of the widest vector of any target: plan() sizes scratch for it.
constexpr std::size_t kMaxLanes = 64;

constexpr std::size_t round_up(std::size_t n, std::size_t to) { return (n + to - 1) / to * to; }

// A tile's scratch, in floats from a 64-byte boundary, for `queries` (rows x
// heads) queries of head_dim d on vectors of `lanes` floats (a power of two:
// the total only grows with lanes, so plan() sizes a slice with kMaxLanes).
struct ScratchLayout {
  std::size_t mp = 0, dp = 0;               // queries and head_dim rounded up to whole vectors
  std::size_t qt = 0;                       // [d][mp] the queries transposed
  std::size_t qpos = 0;                     // [mp] each query's position past its diagonal block's first
  std::size_t max = 0, sum = 0, scale = 0;  // [mp] softmax state, and the block's accumulator scale
  std::size_t s = 0;                        // [kBlockRowsPadded][mp] the block's scores, then weights
  std::size_t o = 0;                        // [queries][dp] accumulators
  std::size_t k = 0, v = 0;                 // [kBlockRowsPadded][dp] the block's K and V rows in fp32
  std::size_t total = 0;
};

constexpr ScratchLayout scratch_layout(std::size_t queries, std::size_t d, std::size_t lanes) {
  ScratchLayout l;
  l.mp = round_up(queries, lanes);
  l.dp = round_up(d, lanes);
  const auto take = [&l](std::size_t n) {
    const std::size_t at = l.total;
    l.total += round_up(n, 16);
    return at;
  };
  l.qt = take(d * l.mp);
  l.qpos = take(l.mp);
  l.max = take(l.mp);
  l.sum = take(l.mp);
  l.scale = take(l.mp);
  l.s = take(kBlockRowsPadded * l.mp);
  l.o = take(queries * l.dp);
  l.k = take(kBlockRowsPadded * l.dp);
  l.v = take(kBlockRowsPadded * l.dp);
  return l;
}

}  // namespace
}  // namespace sparsekv
#endif  // SPARSEKV_SRC_PROMPT_ATTENTION_LAYOUT_

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "attention/prompt_attention.cpp"
#include <hwy/foreach_target.h>  // before highway.h
#include <hwy/cache_control.h>
#include <hwy/highway.h>
#include <hwy/contrib/math/math-inl.h>

#include "core/load_widened-inl.hpp"

HWY_BEFORE_NAMESPACE();
namespace sparsekv {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Register blocks of the two products: the scores take kScoreRows key rows
// by kScoreVectors query vectors, the V sum kValueRows queries by
// kValueVectors vectors of head_dim; their product is the accumulators kept
// in registers (16 where the target has 32 vector registers, 8 where 16).
#if HWY_TARGET == HWY_SCALAR || HWY_TARGET == HWY_EMU128
constexpr std::size_t kScoreRows = 2, kScoreVectors = 2, kValueRows = 2, kValueVectors = 2;
#elif (HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3) || HWY_ARCH_ARM
constexpr std::size_t kScoreRows = 4, kScoreVectors = 4, kValueRows = 4, kValueVectors = 4;
#else
constexpr std::size_t kScoreRows = 4, kScoreVectors = 2, kValueRows = 2, kValueVectors = 4;
#endif
static_assert(kScoreRows <= kBlockRowsPadded - kPromptBlockTokens && kPromptBlockTokens % kScoreRows == 0);

// f(integral_constant<count>) for a count in [1, N]: the register blocks' tails.
template <std::size_t N, class F>
HWY_INLINE void WithCount(std::size_t count, const F& f) {
  if constexpr (N > 1) {
    if (count < N) return WithCount<N - 1>(count, f);
  }
  f(std::integral_constant<std::size_t, N>());
}

// One row of K or V (d elements of T: float, hwy::float16_t,
// hwy::bfloat16_t or Q8Row blocks) as fp32 in dst, zeros up to dp.
template <class T, class D>
HWY_INLINE void WidenRow(D df, const std::byte* HWY_RESTRICT src, std::uint32_t d, DType dtype, std::size_t dp,
                         float* HWY_RESTRICT dst) {
  const std::size_t lanes = hn::Lanes(df);
  std::size_t j = 0;
  if constexpr (std::is_same_v<T, Q8Row>) {
    if (RowLanesFit<T>(lanes)) {
      for (; j < d; j += kQ8BlockValues) {
        const std::byte* block = src + j / kQ8BlockValues * kQ8BlockBytes;
        const auto scale = hn::Set(df, Q8Scale(block));
        for (std::size_t i = 0; i < kQ8BlockValues; i += lanes) {
          hn::Store(hn::Mul(LoadQ8Lanes(df, block, i), scale), df, dst + j + i);
        }
      }
    }
  } else {
    for (; j + lanes <= d; j += lanes) hn::Store(LoadWidened(df, reinterpret_cast<const T*>(src) + j), df, dst + j);
  }
  for (; j < d; ++j) dst[j] = load_element(src, static_cast<std::uint32_t>(j), dtype);
  for (; j < dp; ++j) dst[j] = 0.0f;
}

// Scores of RT key rows (k, dp apart) for RV query vectors (qt, the queries
// transposed, mp apart per dimension): s[r][v] = scale * sum over i of
// k[r][i] * qt[i][v], one FMA chain per score in i order, written mp apart.
template <std::size_t RT, std::size_t RV, class D>
HWY_INLINE void ScoreRows(D df, const float* HWY_RESTRICT qt, std::size_t mp, const float* HWY_RESTRICT k,
                          std::size_t dp, std::uint32_t d, float scale, float* HWY_RESTRICT s) {
  const std::size_t lanes = hn::Lanes(df);
  hn::Vec<D> acc[RT][RV];
  for (std::size_t r = 0; r < RT; ++r)
    for (std::size_t v = 0; v < RV; ++v) acc[r][v] = hn::Zero(df);
  for (std::uint32_t i = 0; i < d; ++i) {
    hn::Vec<D> q[RV];
    for (std::size_t v = 0; v < RV; ++v) q[v] = hn::Load(df, qt + i * mp + v * lanes);
    for (std::size_t r = 0; r < RT; ++r) {
      const auto kb = hn::Set(df, k[r * dp + i]);
      for (std::size_t v = 0; v < RV; ++v) acc[r][v] = hn::MulAdd(kb, q[v], acc[r][v]);
    }
  }
  const auto sc = hn::Set(df, scale);
  for (std::size_t r = 0; r < RT; ++r)
    for (std::size_t v = 0; v < RV; ++v) hn::Store(hn::Mul(acc[r][v], sc), df, s + r * mp + v * lanes);
}

// o[r][j] = scale[r] * o[r][j] (0 on the first block) + sum over the block's
// n tokens t of w[t][r] * v[t][j], for RM queries (o rows dp apart, weights
// mp apart per token) and RJ vectors of head_dim: one FMA chain per element
// in token order.
template <std::size_t RM, std::size_t RJ, class D>
HWY_INLINE void AddValues(D df, const float* HWY_RESTRICT w, std::size_t mp, const float* HWY_RESTRICT v,
                          std::size_t dp, std::uint32_t n, const float* HWY_RESTRICT scale, bool first,
                          float* HWY_RESTRICT o) {
  const std::size_t lanes = hn::Lanes(df);
  hn::Vec<D> acc[RM][RJ];
  for (std::size_t r = 0; r < RM; ++r) {
    const auto sc = hn::Set(df, scale[r]);
    for (std::size_t j = 0; j < RJ; ++j) {
      acc[r][j] = first ? hn::Zero(df) : hn::Mul(hn::Load(df, o + r * dp + j * lanes), sc);
    }
  }
  for (std::uint32_t t = 0; t < n; ++t) {
    hn::Vec<D> row[RJ];
    for (std::size_t j = 0; j < RJ; ++j) row[j] = hn::Load(df, v + t * dp + j * lanes);
    for (std::size_t r = 0; r < RM; ++r) {
      const auto wb = hn::Set(df, w[t * mp + r]);
      for (std::size_t j = 0; j < RJ; ++j) acc[r][j] = hn::MulAdd(wb, row[j], acc[r][j]);
    }
  }
  for (std::size_t r = 0; r < RM; ++r)
    for (std::size_t j = 0; j < RJ; ++j) hn::Store(acc[r][j], df, o + r * dp + j * lanes);
}

// The block's softmax fold for one vector of queries (softmax_fold_tile,
// a lane per query): the block max over its nt rows of scores s (mp apart),
// the new max, the accumulator scale e^(old - new) (0 for the first block:
// e^-inf), the weights e^(score - new) in place of the scores (exactly 0 for
// a masked -inf score) and the sum scale * sum + the weights' sum. A lane
// with a NaN score gets a NaN sum, which every later block keeps (NaN * 0 is
// NaN): its output is NaN, as the rule's (a vector max may drop a NaN, and
// Highway's Exp gives 0 for one).
template <class D>
HWY_INLINE void FoldScores(D df, float* HWY_RESTRICT s, std::size_t mp, std::size_t nt, float* HWY_RESTRICT max,
                           float* HWY_RESTRICT sum, float* HWY_RESTRICT scale) {
  auto m0 = hn::Set(df, kNegativeInfinity), m1 = m0;
  auto nan = hn::MaskFromVec(hn::Zero(df));
  std::size_t t = 0;
  for (; t + 2 <= nt; t += 2) {
    const auto x0 = hn::Load(df, s + t * mp), x1 = hn::Load(df, s + (t + 1) * mp);
    nan = hn::Or(nan, hn::Or(hn::IsNaN(x0), hn::IsNaN(x1)));
    m0 = hn::Max(m0, x0);
    m1 = hn::Max(m1, x1);
  }
  if (t < nt) {
    const auto x0 = hn::Load(df, s + t * mp);
    nan = hn::Or(nan, hn::IsNaN(x0));
    m0 = hn::Max(m0, x0);
  }
  const auto old_max = hn::Load(df, max);
  const auto new_max = hn::Max(old_max, hn::Max(m0, m1));
  const auto sc = hn::Exp(df, hn::Sub(old_max, new_max));
  auto s0 = hn::Zero(df), s1 = s0;
  for (t = 0; t + 2 <= nt; t += 2) {
    const auto e0 = hn::Exp(df, hn::Sub(hn::Load(df, s + t * mp), new_max));
    const auto e1 = hn::Exp(df, hn::Sub(hn::Load(df, s + (t + 1) * mp), new_max));
    hn::Store(e0, df, s + t * mp);
    hn::Store(e1, df, s + (t + 1) * mp);
    s0 = hn::Add(s0, e0);
    s1 = hn::Add(s1, e1);
  }
  if (t < nt) {
    const auto e0 = hn::Exp(df, hn::Sub(hn::Load(df, s + t * mp), new_max));
    hn::Store(e0, df, s + t * mp);
    s0 = hn::Add(s0, e0);
  }
  const auto new_sum = hn::MulAdd(hn::Load(df, sum), sc, hn::Add(s0, s1));
  hn::Store(hn::IfThenElse(nan, hn::Set(df, std::numeric_limits<float>::quiet_NaN()), new_sum), df, sum);
  hn::Store(new_max, df, max);
  hn::Store(sc, df, scale);
}

template <class T>
void RunTileOf(const PromptAttentionShape& shape, const PromptChunk& chunk, const PromptAttention::Tile& tile,
               std::uint32_t tile_rows, float* HWY_RESTRICT scratch) {
  const hn::ScalableTag<float> df;
  const std::size_t lanes = hn::Lanes(df);
  constexpr std::uint32_t B = kPromptBlockTokens;
  const std::uint32_t d = shape.head_dim, R = tile_rows;
  const std::size_t queries = std::size_t{R} * tile.heads;
  const ScratchLayout l = scratch_layout(queries, d, lanes);
  const std::size_t mp = l.mp, dp = l.dp, vectors = mp / lanes;
  float* HWY_RESTRICT qt = scratch + l.qt;
  float* HWY_RESTRICT qpos = scratch + l.qpos;
  float* HWY_RESTRICT run_max = scratch + l.max;
  float* HWY_RESTRICT run_sum = scratch + l.sum;
  float* HWY_RESTRICT scale = scratch + l.scale;
  float* HWY_RESTRICT s = scratch + l.s;
  float* HWY_RESTRICT o = scratch + l.o;
  float* HWY_RESTRICT kf = scratch + l.k;
  float* HWY_RESTRICT vf = scratch + l.v;
  const std::size_t row_floats = std::size_t{shape.q_heads} * d;
  const std::size_t q_stride = chunk.q_stride != 0 ? chunk.q_stride : row_floats;
  const std::size_t out_stride = chunk.out_stride != 0 ? chunk.out_stride : row_floats;
  const std::size_t row_bytes = dtype_row_bytes(shape.dtype, d);
  const std::size_t kv_row = std::size_t{shape.kv_heads} * row_bytes;  // bytes a token
  const std::byte* HWY_RESTRICT k_head = chunk.k + std::size_t{tile.kv_head} * row_bytes;
  const std::byte* HWY_RESTRICT v_head = chunk.v + std::size_t{tile.kv_head} * row_bytes;

  // Queries m = head * R + row, transposed; a lane without a query of this
  // chunk (rows outside [lo, hi), padding) has q = 0 and the last row's
  // position, so that every lane attends at least its diagonal block's first key.
  const std::uint32_t diag = (tile.hi - 1) / B, diag_first = diag * B;
  for (std::size_t m = 0; m < mp; ++m) {
    const std::uint32_t head = static_cast<std::uint32_t>(m / R), pos = tile.row0 + static_cast<std::uint32_t>(m % R);
    const bool real = m < queries && pos >= tile.lo && pos < tile.hi;
    qpos[m] = static_cast<float>((real ? pos : tile.hi - 1) - diag_first);
    if (real) {
      const float* q = chunk.q + (pos - chunk.first) * q_stride + std::size_t{tile.head0 + head} * d;
      for (std::uint32_t i = 0; i < d; ++i) qt[i * mp + m] = q[i];
    } else {
      for (std::uint32_t i = 0; i < d; ++i) qt[i * mp + m] = 0.0f;
    }
  }
  std::fill_n(run_max, mp, kNegativeInfinity);
  std::fill_n(run_sum, mp, 0.0f);

  const auto prefetch_row = [&](const std::byte* row) {
    for (std::size_t at = 0; at < row_bytes; at += 64) hwy::Prefetch(row + at);
  };
  for (std::uint32_t b = 0; b <= diag; ++b) {
    const std::uint32_t first = b * B;
    const std::uint32_t n = b < diag ? B : tile.hi - first;
    const std::size_t nt = (n + kScoreRows - 1) / kScoreRows * kScoreRows;
    // 1. The block's K rows in fp32 (rows past n zero).
    for (std::uint32_t t = 0; t < n; ++t) {
      WidenRow<T>(df, k_head + (std::size_t{first} + t) * kv_row, d, shape.dtype, dp, kf + t * dp);
    }
    for (std::size_t t = n; t < nt; ++t) std::fill_n(kf + t * dp, dp, 0.0f);
    // 2. Scores, a register block of query vectors at a time over the block's
    //    rows, masked past each query on the diagonal block; then their fold.
    //    With the first register block, the block's V rows and the next
    //    block's K rows are asked for, spread between its score blocks
    //    rather than in one burst.
    for (std::size_t v0 = 0; v0 < vectors; v0 += kScoreVectors) {
      const std::size_t count = std::min(kScoreVectors, vectors - v0);
      WithCount<kScoreVectors>(count, [&](auto rv) {
        for (std::size_t t = 0; t < nt; t += kScoreRows) {
          if (v0 == 0) {
            for (std::size_t u = t; u < std::min<std::size_t>(t + kScoreRows, n); ++u) {
              const std::size_t token = first + u;
              prefetch_row(v_head + token * kv_row);
              if (b < diag && token + B < tile.hi) prefetch_row(k_head + (token + B) * kv_row);
            }
          }
          ScoreRows<kScoreRows, decltype(rv)::value>(df, qt + v0 * lanes, mp, kf + t * dp, dp, d, shape.scale,
                                                     s + t * mp + v0 * lanes);
        }
      });
      for (std::size_t v = v0; v < v0 + count; ++v) {
        float* sv = s + v * lanes;
        if (b == diag) {
          const auto pos = hn::Load(df, qpos + v * lanes);
          const auto neg_inf = hn::Set(df, kNegativeInfinity);
          for (std::size_t t = 0; t < nt; ++t) {
            const auto masked = hn::Gt(hn::Set(df, static_cast<float>(t)), pos);
            hn::Store(hn::IfThenElse(masked, neg_inf, hn::Load(df, sv + t * mp)), df, sv + t * mp);
          }
        }
        FoldScores(df, sv, mp, nt, run_max + v * lanes, run_sum + v * lanes, scale + v * lanes);
      }
    }
    // 3. The V rows in fp32, then added with their weights, a register block
    //    of each head's rows of this chunk at a time.
    for (std::uint32_t t = 0; t < n; ++t) {
      WidenRow<T>(df, v_head + (std::size_t{first} + t) * kv_row, d, shape.dtype, dp, vf + t * dp);
    }
    const std::size_t jv = dp / lanes;
    for (std::uint32_t head = 0; head < tile.heads; ++head) {
      const std::size_t m_end = std::size_t{head} * R + (tile.hi - tile.row0);
      for (std::size_t m = std::size_t{head} * R + (tile.lo - tile.row0); m < m_end; m += kValueRows) {
        WithCount<kValueRows>(std::min(kValueRows, m_end - m), [&](auto rm) {
          for (std::size_t j = 0; j < jv; j += kValueVectors) {
            WithCount<kValueVectors>(std::min(kValueVectors, jv - j), [&](auto rj) {
              AddValues<decltype(rm)::value, decltype(rj)::value>(df, s + m, mp, vf + j * lanes, dp, n, scale + m,
                                                                  b == 0, o + m * dp + j * lanes);
            });
          }
        });
      }
    }
  }
  // 4. The outputs: acc / sum (softmax_output; every sum is positive, or NaN).
  for (std::uint32_t head = 0; head < tile.heads; ++head) {
    for (std::uint32_t pos = tile.lo; pos < tile.hi; ++pos) {
      const std::size_t m = std::size_t{head} * R + (pos - tile.row0);
      float* out = chunk.out + (pos - chunk.first) * out_stride + std::size_t{tile.head0 + head} * d;
      const float* acc = o + m * dp;
      const auto sum = hn::Set(df, run_sum[m]);
      std::size_t j = 0;
      for (; j + lanes <= d; j += lanes) hn::StoreU(hn::Div(hn::Load(df, acc + j), sum), df, out + j);
      for (; j < d; ++j) out[j] = acc[j] / run_sum[m];
    }
  }
}

void RunTile(const PromptAttentionShape& shape, const PromptChunk& chunk, const PromptAttention::Tile& tile,
             std::uint32_t tile_rows, float* scratch) {
  switch (shape.dtype) {
    case DType::f32:
      RunTileOf<float>(shape, chunk, tile, tile_rows, scratch);
      return;
    case DType::f16:
      RunTileOf<hwy::float16_t>(shape, chunk, tile, tile_rows, scratch);
      return;
    case DType::bf16:
      RunTileOf<hwy::bfloat16_t>(shape, chunk, tile, tile_rows, scratch);
      return;
    case DType::q8_0:
      RunTileOf<Q8Row>(shape, chunk, tile, tile_rows, scratch);
      return;
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace sparsekv
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace sparsekv {

HWY_EXPORT(RunTile);

namespace {

void check_shape(const PromptAttentionShape& shape) {
  if (shape.dtype != DType::f32 && shape.dtype != DType::f16 && shape.dtype != DType::bf16 &&
      shape.dtype != DType::q8_0) {
    fail(ErrorCode::invalid_argument, "prompt attention: unknown K/V dtype {}", static_cast<int>(shape.dtype));
  }
  if (shape.dtype == DType::q8_0 && shape.head_dim % kQ8BlockValues != 0) {
    fail(ErrorCode::invalid_argument, "prompt attention: q8_0 K/V need head_dim ({}) a multiple of {}", shape.head_dim,
         kQ8BlockValues);
  }
  if (shape.q_heads == 0 || shape.kv_heads == 0 || shape.head_dim == 0) {
    fail(ErrorCode::invalid_argument, "prompt attention: {} q heads, {} kv heads, head_dim {}: each must be positive",
         shape.q_heads, shape.kv_heads, shape.head_dim);
  }
  if (shape.q_heads % shape.kv_heads != 0) {
    fail(ErrorCode::invalid_argument, "prompt attention: {} q heads cannot be grouped onto {} kv heads", shape.q_heads,
         shape.kv_heads);
  }
  if (!(std::isfinite(shape.scale) && shape.scale > 0.0f)) {
    fail(ErrorCode::invalid_argument, "prompt attention: scale {} is not positive and finite", shape.scale);
  }
}

void check_chunk(const PromptAttentionShape& shape, const PromptChunk& chunk, std::size_t index) {
  if (chunk.q == nullptr || chunk.k == nullptr || chunk.v == nullptr || chunk.out == nullptr) {
    fail(ErrorCode::invalid_argument, "prompt attention: chunk {} has a null q, k, v or out", index);
  }
  if (chunk.rows == 0) fail(ErrorCode::invalid_argument, "prompt attention: chunk {} has no rows", index);
  const std::size_t row = std::size_t{shape.q_heads} * shape.head_dim;
  if ((chunk.q_stride != 0 && chunk.q_stride < row) || (chunk.out_stride != 0 && chunk.out_stride < row)) {
    fail(ErrorCode::invalid_argument, "prompt attention: chunk {}: q stride {} or out stride {} below a row of {}",
         index, chunk.q_stride, chunk.out_stride, row);
  }
  const std::uint64_t end = std::uint64_t{chunk.first} + chunk.rows;
  if (end > static_cast<std::uint64_t>(std::numeric_limits<std::int32_t>::max())) {
    fail(ErrorCode::invalid_argument, "prompt attention: chunk {} ends at position {}, past 2^31 - 1", index, end);
  }
}

// Tile heads and rows: up to 8 q heads of a group, and rows -- a divisor of
// the block, so that a tile's rows share their diagonal block -- such that
// a tile holds up to 128 queries: its accumulators, transposed queries and
// scores stay within L2 beside the block's K and V rows, and each widened K
// or V row serves at least 64 queries.
constexpr std::uint32_t kMaxTileHeads = 8;
constexpr std::uint32_t kMaxTileQueries = 128;

std::uint32_t tile_rows_for(std::uint32_t heads) {
  std::uint32_t rows = kPromptBlockTokens;
  while (rows > 16 && rows * heads > kMaxTileQueries) rows /= 2;
  return rows;
}

}  // namespace

void PromptAttention::plan(const PromptAttentionShape& shape, std::span<const PromptChunk> chunks,
                           std::size_t max_threads) {
  check_shape(shape);
  for (std::size_t i = 0; i < chunks.size(); ++i) check_chunk(shape, chunks[i], i);
  if (max_threads == 0) fail(ErrorCode::invalid_argument, "prompt attention: max_threads must be positive");
  const std::uint32_t group = shape.q_heads / shape.kv_heads;
  const std::uint32_t heads = std::min(group, kMaxTileHeads);
  const std::uint32_t rows = tile_rows_for(heads);
  std::vector<Tile> tiles;
  for (std::uint32_t c = 0; c < chunks.size(); ++c) {
    const PromptChunk& chunk = chunks[c];
    const std::uint32_t end = chunk.first + chunk.rows;
    for (std::uint32_t row0 = chunk.first / rows * rows; row0 < end; row0 += rows) {
      const std::uint32_t lo = std::max(row0, chunk.first), hi = std::min(row0 + rows, end);
      const std::uint64_t blocks = (hi - 1) / kPromptBlockTokens + 1;
      for (std::uint32_t kv = 0; kv < shape.kv_heads; ++kv) {
        for (std::uint32_t h = 0; h < group; h += heads) {
          const std::uint32_t n = std::min(heads, group - h);
          tiles.push_back({c, kv, kv * group + h, n, row0, lo, hi, blocks * n});
        }
      }
    }
  }
  std::stable_sort(tiles.begin(), tiles.end(), [](const Tile& a, const Tile& b) { return a.cost > b.cost; });
  const std::size_t slice = scratch_layout(std::size_t{rows} * heads, shape.head_dim, kMaxLanes).total;
  const std::size_t need = max_threads * slice + 16;
  if (scratch_.size() < need) scratch_.resize(need);
  shape_ = shape;
  chunks_.assign(chunks.begin(), chunks.end());
  tiles_ = std::move(tiles);
  tile_rows_ = rows;
  tile_heads_ = heads;
  max_threads_ = max_threads;
  slice_floats_ = slice;
}

void PromptAttention::run(std::size_t ith, std::size_t nth) const {
  if (tiles_.empty()) return;
  if (ith >= nth || nth > max_threads_) {
    fail(ErrorCode::invalid_argument, "prompt attention: thread {} of {} (planned for at most {})", ith, nth,
         max_threads_);
  }
  const auto address = reinterpret_cast<std::uintptr_t>(scratch_.data());
  float* slice = scratch_.data() + (round_up(address, 64) - address) / sizeof(float) + ith * slice_floats_;
  for (std::size_t i = ith; i < tiles_.size(); ++i) {
    const std::size_t round = i / nth, at = i % nth;
    if ((round % 2 == 0 ? at : nth - 1 - at) != ith) continue;
    const Tile& t = tiles_[i];
    HWY_DYNAMIC_DISPATCH(RunTile)(shape_, chunks_[t.chunk], t, tile_rows_, slice);
  }
}

void prompt_attention_scalar(const PromptAttentionShape& shape, const PromptChunk& chunk) {
  check_shape(shape);
  check_chunk(shape, chunk, 0);
  const std::uint32_t d = shape.head_dim, group = shape.q_heads / shape.kv_heads;
  const std::size_t row = std::size_t{shape.q_heads} * d;
  const std::size_t q_stride = chunk.q_stride != 0 ? chunk.q_stride : row;
  const std::size_t out_stride = chunk.out_stride != 0 ? chunk.out_stride : row;
  const std::size_t head_bytes = dtype_row_bytes(shape.dtype, d);
  const std::size_t token_bytes = std::size_t{shape.kv_heads} * head_bytes;
  std::vector<float> scores(kPromptBlockTokens), weights(kPromptBlockTokens), acc(d);
  for (std::uint32_t r = 0; r < chunk.rows; ++r) {
    const std::uint32_t pos = chunk.first + r;
    for (std::uint32_t h = 0; h < shape.q_heads; ++h) {
      const float* q = chunk.q + r * q_stride + std::size_t{h} * d;
      const std::size_t head = (h / group) * head_bytes;
      SoftmaxState state;
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (std::uint32_t first = 0; first <= pos; first += kPromptBlockTokens) {
        const std::uint32_t n = std::min(kPromptBlockTokens, pos + 1 - first);
        for (std::uint32_t t = 0; t < n; ++t) {
          const std::byte* k = chunk.k + (std::size_t{first} + t) * token_bytes + head;
          float dot = 0.0f;
          for (std::uint32_t i = 0; i < d; ++i) dot += q[i] * load_element(k, i, shape.dtype);
          scores[t] = dot * shape.scale;
        }
        const float scale = softmax_fold_tile(state, scores.data(), n, weights.data());
        for (float& a : acc) a = softmax_rescale_tile(a, scale);
        for (std::uint32_t t = 0; t < n; ++t) {
          const std::byte* v = chunk.v + (std::size_t{first} + t) * token_bytes + head;
          for (std::uint32_t j = 0; j < d; ++j) acc[j] += weights[t] * load_element(v, j, shape.dtype);
        }
      }
      float* out = chunk.out + r * out_stride + std::size_t{h} * d;
      for (std::uint32_t j = 0; j < d; ++j) out[j] = softmax_output(acc[j], state);
    }
  }
}

}  // namespace sparsekv
#endif  // HWY_ONCE
