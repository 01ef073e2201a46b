// fold_page (attention/page_fold.hpp): compiled once per Highway target by
// foreach_target.h, dispatched at run time to the best the CPU has.
#include "sparsekv/attention/page_fold.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "sparsekv/core/error.hpp"
#include "sparsekv/core/numeric.hpp"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "attention/page_fold.cpp"
#include <hwy/foreach_target.h>  // before highway.h
#include <hwy/cache_control.h>
#include <hwy/highway.h>
#include <hwy/contrib/math/math-inl.h>

#include "core/load_widened-inl.hpp"

HWY_BEFORE_NAMESPACE();
namespace sparsekv {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// q heads whose accumulators stay in registers at once.
constexpr std::uint32_t kGroupBlock = 8;
// The tile holds each slot's scores (then weights) for a block of G heads in
// one row of RowWidth(G) floats, G rounded up to a power of two: a vector then
// holds whole rows (or a row whole vectors), so one pass of vector max and
// exponentials serves every head of the block, and a slot's G dot products
// reduce into one vector store. The lanes past G are never read as weights.
constexpr std::uint32_t RowWidth(std::uint32_t g) { return g == 1 ? 1 : g == 2 ? 2 : g <= 4 ? 4 : 8; }
constexpr std::size_t kMaxLanes = HWY_MAX_BYTES / sizeof(float);
static_assert(RowWidth(kGroupBlock) <= kPageFoldRowFloats && kMaxLanes <= kPageFoldPadFloats);
// One pattern period of the tile: max(row width, lanes) floats.
constexpr std::size_t kMaxPeriod = kMaxLanes > RowWidth(kGroupBlock) ? kMaxLanes : RowWidth(kGroupBlock);

// Prefetches one K or V row (whole cache lines).
HWY_INLINE void PrefetchRow(const std::byte* row, std::size_t bytes) {
  for (std::size_t at = 0; at < bytes; at += 64) hwy::Prefetch(row + at);
}

// v, which the compiler must keep in a register: GCC otherwise folds a
// vector loaded once for several FMAs into each of them as a memory operand,
// one load per FMA, and Dots becomes bound by loads (4.7 against 4 cycles
// for eight FMAs on AVX2).
template <class V>
HWY_INLINE V InRegister(V v) {
#if HWY_ARCH_X86 && (HWY_COMPILER_GCC_ACTUAL || HWY_COMPILER_CLANG) && HWY_TARGET != HWY_SCALAR && \
    HWY_TARGET != HWY_EMU128
#if HWY_TARGET <= HWY_AVX3
  __asm__("" : "+v"(v.raw));
#else
  __asm__("" : "+x"(v.raw));
#endif
#endif
  return v;
}

#if HWY_TARGET != HWY_SCALAR
// Per 128-bit block, the sums of a, b, c and e over the block's four lanes,
// in that order: the first step of reducing four dot products at once.
template <class D>
HWY_INLINE hn::Vec<D> BlockSums4(D d, hn::Vec<D> a, hn::Vec<D> b, hn::Vec<D> c, hn::Vec<D> e) {
  const hn::Repartition<std::uint64_t, D> d64;
  const auto ab = hn::Add(hn::InterleaveLower(d, a, b), hn::InterleaveUpper(d, a, b));
  const auto ce = hn::Add(hn::InterleaveLower(d, c, e), hn::InterleaveUpper(d, c, e));
  const auto lo = hn::InterleaveLower(d64, hn::BitCast(d64, ab), hn::BitCast(d64, ce));
  const auto hi = hn::InterleaveUpper(d64, hn::BitCast(d64, ab), hn::BitCast(d64, ce));
  return hn::Add(hn::BitCast(d, lo), hn::BitCast(d, hi));
}

// out[4i .. 4i + 4) = scale * the lane sums of the i-th four of `x` (Q fours,
// Q <= 2), where each x is already summed per 128-bit block (BlockSums4) and
// the vectors have 4 or 8 lanes.
template <class D>
HWY_INLINE void StoreQuadSums(D d, const hn::Vec<D> (&x)[2], std::uint32_t quads, float scale,
                              float* HWY_RESTRICT out) {
  if constexpr (hn::MaxLanes(d) == 4) {
    for (std::uint32_t i = 0; i < quads; ++i) hn::StoreU(hn::Mul(x[i], hn::Set(d, scale)), d, out + 4 * i);
  } else {
    static_assert(hn::MaxLanes(d) == 8);
    const hn::Half<D> dh;
    if (quads == 2) {
      const auto both = hn::Add(hn::ConcatLowerLower(d, x[1], x[0]), hn::ConcatUpperUpper(d, x[1], x[0]));
      hn::StoreU(hn::Mul(both, hn::Set(d, scale)), d, out);
    } else {
      const auto one = hn::Add(hn::LowerHalf(dh, x[0]), hn::UpperHalf(dh, x[0]));
      hn::StoreU(hn::Mul(one, hn::Set(dh, scale)), dh, out);
    }
  }
}

#endif  // HWY_TARGET != HWY_SCALAR

// Whether Dots reduces its sums four at a time on this target: fixed vectors
// of 4, 8 or 16 lanes (otherwise each sum is reduced alone).
template <class D>
constexpr bool kQuadSums = !HWY_HAVE_SCALABLE && HWY_TARGET != HWY_SCALAR &&
                           (hn::MaxLanes(D()) == 4 || hn::MaxLanes(D()) == 8 || hn::MaxLanes(D()) == 16);

// scale * q.k for R rows of K (one or two slots) and G q heads, written as R
// tile rows: out[r * RowWidth(G) + b] (0 in the padding lanes). R * G
// independent FMA chains, each q vector loaded once for the R rows; the R * G
// sums reduce four at a time into whole rows where the target allows.
template <class T, std::uint32_t G, std::uint32_t R, class D>
HWY_INLINE void Dots(D df, const float* HWY_RESTRICT q, const std::byte* const (&k)[R], std::uint32_t d,
                     std::size_t full, DType dtype, float scale, float* HWY_RESTRICT out) {
  constexpr std::uint32_t W = RowWidth(G);
  const std::size_t lanes = hn::Lanes(df);
  hn::Vec<D> sums[R][G];
  for (std::uint32_t r = 0; r < R; ++r)
    for (std::uint32_t b = 0; b < G; ++b) sums[r][b] = hn::Zero(df);
  const auto add = [&](std::size_t j, const hn::Vec<D>(&rows)[R]) {
    for (std::uint32_t b = 0; b < G; ++b) {
      const auto qv = InRegister(hn::LoadU(df, q + std::size_t{b} * d + j));
      for (std::uint32_t r = 0; r < R; ++r) sums[r][b] = hn::MulAdd(qv, rows[r], sums[r][b]);
    }
  };
  if constexpr (std::is_same_v<T, Q8Row>) {
    // Block by block, each row's scale converted and broadcast once per block.
    for (std::size_t j0 = 0; j0 < full; j0 += kQ8BlockValues) {
      const std::byte* blocks[R];
      hn::Vec<D> scales[R];
      for (std::uint32_t r = 0; r < R; ++r) {
        blocks[r] = k[r] + j0 / kQ8BlockValues * kQ8BlockBytes;
        scales[r] = hn::Set(df, Q8Scale(blocks[r]));
      }
      for (std::size_t i = 0; i < kQ8BlockValues; i += lanes) {
        hn::Vec<D> rows[R];
        for (std::uint32_t r = 0; r < R; ++r) rows[r] = hn::Mul(LoadQ8Lanes(df, blocks[r], i), scales[r]);
        add(j0 + i, rows);
      }
    }
  } else {
    for (std::size_t j = 0; j < full; j += lanes) {
      hn::Vec<D> rows[R];
      for (std::uint32_t r = 0; r < R; ++r) rows[r] = LoadWidened(df, reinterpret_cast<const T*>(k[r]) + j);
      add(j, rows);
    }
  }
#if HWY_TARGET != HWY_SCALAR
  if constexpr (kQuadSums<D> && R * W <= 8) {
    if (full == d) {
      // The rows' sums in tile order, padded with zeros to whole fours.
      constexpr std::uint32_t kQuads = (R * W + 3) / 4;
      const auto sum_at = [&](std::uint32_t i) {
        const std::uint32_t r = i / W, b = i % W;
        return r < R && b < G ? sums[r][b] : hn::Zero(df);
      };
      if constexpr (hn::MaxLanes(df) == 16) {
        const hn::Half<D> dh;
        hn::Vec<decltype(dh)> x[2];
        for (std::uint32_t i = 0; i < kQuads; ++i) {
          const auto blocks = BlockSums4(df, sum_at(4 * i), sum_at(4 * i + 1), sum_at(4 * i + 2), sum_at(4 * i + 3));
          x[i] = hn::Add(hn::LowerHalf(dh, blocks), hn::UpperHalf(dh, blocks));
        }
        StoreQuadSums(dh, x, kQuads, scale, out);
      } else {
        hn::Vec<D> x[2];
        for (std::uint32_t i = 0; i < kQuads; ++i) {
          x[i] = BlockSums4(df, sum_at(4 * i), sum_at(4 * i + 1), sum_at(4 * i + 2), sum_at(4 * i + 3));
        }
        StoreQuadSums(df, x, kQuads, scale, out);
      }
      return;
    }
  }
#endif
  for (std::uint32_t r = 0; r < R; ++r) {
    for (std::uint32_t b = 0; b < W; ++b) {
      float dot = 0.0f;
      if (b < G) {
        dot = hn::GetLane(hn::SumOfLanes(df, sums[r][b]));
        for (std::size_t j = full; j < d; ++j) {
          dot += q[std::size_t{b} * d + j] * load_element(k[r], static_cast<std::uint32_t>(j), dtype);
        }
      }
      out[r * W + b] = dot * scale;
    }
  }
}

// softmax_fold_tile for the G heads of a tile at once, the exponentials a
// vector at a time (Highway's Exp, within 1 ulp of std::exp; 0 below -104, so
// -inf gives exactly 0): one max pass and one exponential pass over the
// tile's rows, which become weights; scales[b] is head b's accumulator scale.
// A head whose tile is all -inf changes nothing (scale 1, weights 0); a tile
// with a NaN score takes std::exp, so the NaN reaches the state as in the rule.
template <std::uint32_t G, class D>
HWY_INLINE void FoldTile(D df, SoftmaxState* HWY_RESTRICT states, float* HWY_RESTRICT w, std::uint32_t tokens,
                         float (&scales)[G]) {
  constexpr std::uint32_t W = RowWidth(G);
  const std::size_t lanes = hn::Lanes(df);
  const std::size_t period = std::max<std::size_t>(W, lanes), phases = period / lanes;
  const std::size_t n = std::size_t{tokens} * W, vectors = (n + lanes - 1) / lanes;
  std::fill(w + n, w + vectors * lanes, kNegativeInfinity);
  alignas(64) float lane_of[kMaxPeriod];  // per pattern lane: maxes, then m, then sums
  std::fill_n(lane_of, period, kNegativeInfinity);
  // Max pass: phase p holds the vectors whose lane i is head (p * lanes + i) % W.
  bool has_nan = false;
  if (phases <= 2) {
    auto max0 = hn::Set(df, kNegativeInfinity), max1 = max0;
    auto nan = hn::MaskFromVec(hn::Zero(df));
    for (std::size_t v = 0; v < vectors; ++v) {
      const auto x = hn::LoadU(df, w + v * lanes);
      nan = hn::Or(nan, hn::IsNaN(x));
      if (v % phases == 0) {
        max0 = hn::Max(max0, x);
      } else {
        max1 = hn::Max(max1, x);
      }
    }
    hn::StoreU(max0, df, lane_of);
    if (phases == 2) hn::StoreU(max1, df, lane_of + lanes);
    has_nan = !hn::AllFalse(df, nan);
  } else {  // one-lane vectors (the scalar target)
    for (std::size_t v = 0; v < vectors; ++v) {
      float& m = lane_of[v % phases];
      m = !(w[v] <= m) ? w[v] : m;
      has_nan = has_nan || std::isnan(w[v]);
    }
  }
  float tile_max[W];
  for (std::uint32_t b = 0; b < W; ++b) tile_max[b] = kNegativeInfinity;
  for (std::size_t i = 0; i < period; ++i) {
    const float x = lane_of[i];
    float& m = tile_max[i % W];
    m = !(x <= m) ? x : m;
  }
  if (has_nan) {  // a vector max may drop a NaN: a head with one gets a NaN max, as softmax_fold's state
    for (std::uint32_t b = 0; b < G; ++b) {
      for (std::uint32_t t = 0; t < tokens; ++t) {
        if (std::isnan(w[t * W + b])) tile_max[b] = w[t * W + b];
      }
    }
  }
  // Each head's new max; an all -inf head (and the padding) gets +inf, so its weights are exactly 0.
  float m[W];
  for (std::uint32_t b = 0; b < W; ++b) m[b] = std::numeric_limits<float>::infinity();
  for (std::uint32_t b = 0; b < G; ++b) {
    scales[b] = 1.0f;
    if (tile_max[b] == kNegativeInfinity) continue;
    const SoftmaxState& s = states[b];
    m[b] = s.max > tile_max[b] ? s.max : tile_max[b];
    scales[b] = softmax_exp(s.max - m[b]);  // 0 for an empty state (m finite)
  }
  float tile_sum[W] = {};
  if (phases <= 2 && !has_nan) {
    for (std::size_t i = 0; i < period; ++i) lane_of[i] = m[i % W];
    auto sum0 = hn::Zero(df), sum1 = sum0;
    const auto m0 = hn::LoadU(df, lane_of), m1 = phases == 2 ? hn::LoadU(df, lane_of + lanes) : m0;
    for (std::size_t v = 0; v < vectors; ++v) {
      const auto e = hn::Exp(df, hn::Sub(hn::LoadU(df, w + v * lanes), v % phases == 0 ? m0 : m1));
      hn::StoreU(e, df, w + v * lanes);
      if (v % phases == 0) {
        sum0 = hn::Add(sum0, e);
      } else {
        sum1 = hn::Add(sum1, e);
      }
    }
    hn::StoreU(sum0, df, lane_of);
    if (phases == 2) hn::StoreU(sum1, df, lane_of + lanes);
    for (std::size_t i = 0; i < period; ++i) tile_sum[i % W] += lane_of[i];
  } else {  // one-lane vectors, or a NaN score, which Highway's Exp does not carry: std::exp
    for (std::size_t i = 0; i < vectors * lanes; ++i) {
      w[i] = softmax_exp(w[i] - m[i % W]);
      tile_sum[i % W] += w[i];
    }
  }
  for (std::uint32_t b = 0; b < G; ++b) {
    if (tile_max[b] == kNegativeInfinity) continue;
    SoftmaxState& s = states[b];
    s.sum = s.sum * scales[b] + tile_sum[b];
    s.max = m[b];
  }
}

// out[b][j .. j + R lanes) = scale[b] * acc + sum over the tile's live
// slots t of w[t][b] * V[t], page by page in tile order: R vectors of each of
// G heads, R * G independent FMA chains, each weight broadcast once for the R
// vectors; the accumulators are loaded and stored once for the whole tile.
template <class T, std::uint32_t G, std::uint32_t R, class D>
HWY_INLINE void WeightedRows(D df, const PageLayout& layout, const FoldPageRef* pages, std::uint32_t count,
                             const float* HWY_RESTRICT w, const float (&scales)[G], float* HWY_RESTRICT acc,
                             std::size_t j) {
  constexpr std::uint32_t W = RowWidth(G);
  const std::size_t lanes = hn::Lanes(df);
  const std::uint32_t d = layout.head_dim;
  hn::Vec<D> accs[R][G];
  for (std::uint32_t b = 0; b < G; ++b) {
    for (std::uint32_t r = 0; r < R; ++r) {
      const auto a = hn::LoadU(df, acc + std::size_t{b} * d + j + r * lanes);
      accs[r][b] = scales[b] == 0.0f ? hn::Zero(df) : scales[b] == 1.0f ? a : hn::Mul(a, hn::Set(df, scales[b]));
    }
  }
  const std::size_t row_bytes = layout.row_bytes();
  // q8_0: the R vectors lie in one block (R * lanes divides it), whose scale
  // goes into the weights: w * (q * d) as (w * d) * q.
  constexpr bool kQ8 = std::is_same_v<T, Q8Row>;
  const auto add_row = [&](const std::byte* row, const float* HWY_RESTRICT wt) {
    hn::Vec<D> rows[R];
    float scale = 1.0f;
    if constexpr (kQ8) {
      const std::byte* block = row + j / kQ8BlockValues * kQ8BlockBytes;
      scale = Q8Scale(block);
      for (std::uint32_t r = 0; r < R; ++r) rows[r] = LoadQ8Lanes(df, block, j % kQ8BlockValues + r * lanes);
    } else {
      for (std::uint32_t r = 0; r < R; ++r) rows[r] = LoadWidened(df, reinterpret_cast<const T*>(row) + j + r * lanes);
    }
    for (std::uint32_t b = 0; b < G; ++b) {
      const auto wb = hn::Set(df, kQ8 ? wt[b] * scale : wt[b]);
      for (std::uint32_t r = 0; r < R; ++r) accs[r][b] = hn::MulAdd(wb, rows[r], accs[r][b]);
    }
  };
  for (std::uint32_t p = 0; p < count; ++p) {
    const FoldPageRef& page = pages[p];
    // A whole page's rows by pointer steps, with no per-slot test (the
    // loop is bound by instructions issued, not by its FMAs alone).
    const std::byte* row = page.data + layout.v_offset(0);
    const std::byte* const end = row + std::size_t{page.tokens} * row_bytes;
    if ((page.live & full_slot_mask(page.tokens)) == full_slot_mask(page.tokens)) {
      for (; row != end; row += row_bytes, w += W) add_row(row, w);
    } else {
      for (std::uint32_t t = 0; row != end; ++t, row += row_bytes, w += W) {
        if (slot_live(page.live, t)) add_row(row, w);
      }
    }
  }
  for (std::uint32_t b = 0; b < G; ++b)
    for (std::uint32_t r = 0; r < R; ++r) hn::StoreU(accs[r][b], df, acc + std::size_t{b} * d + j + r * lanes);
}

// The tile -- `count` pages, in order -- for q heads [g0, g0 + G) (G a
// compile-time count, so the accumulators stay in registers): the scores of
// every slot, each K row loaded once for the G heads; the tile fold of all G
// heads; then the weighted V rows, each loaded once for the G heads. Up to 4
// heads, two slots (scores) and two vectors (V) go at once: eight FMA chains
// hide the FMA latency that four would wait on. A tile of several small pages
// pays the fold's fixed costs (the max and exponential passes, the rescale,
// the accumulators' loads and stores) once for all of them.
template <class T, std::uint32_t G>
void FoldHeads(const PageFold& f, const FoldPageRef* pages, std::uint32_t count, std::uint32_t g0,
               const std::byte* next) {
  constexpr std::uint32_t R = G <= 4 ? 2 : 1;
  constexpr std::uint32_t W = RowWidth(G);
  const hn::ScalableTag<float> df;
  const std::size_t lanes = hn::Lanes(df);
  const PageLayout& layout = f.layout;
  const std::uint32_t d = layout.head_dim, group = f.group, pt = layout.page_tokens;
  const std::size_t full = RowLanesFit<T>(lanes) ? d / lanes * lanes : 0;  // the tail [full, d) in scalar code
  float* HWY_RESTRICT w = f.weights;                                       // [tile slots][W]: scores, then weights
  const float* HWY_RESTRICT q = f.q + std::size_t{g0} * d;
  // 1. Scores (a dead slot's is computed, then -inf). Each slot's turn also
  //    asks for its V row (read in step 3 column by column, which the
  //    hardware prefetcher does not follow) and for the next page's K row t:
  //    a few lines at a time, within what the core keeps in flight.
  const std::size_t row_bytes = layout.row_bytes();
  std::uint32_t tile_tokens = 0;
  for (std::uint32_t p = 0; p < count; ++p) {
    const std::byte* page = pages[p].data;
    const std::uint32_t tokens = pages[p].tokens;
    const SlotMask live = pages[p].live;
    const std::byte* ahead = p + 1 < count ? pages[p + 1].data : next;
    float* HWY_RESTRICT page_w = w + std::size_t{tile_tokens} * W;
    const bool all_live = (live & full_slot_mask(tokens)) == full_slot_mask(tokens);
    const auto k_row = [&](std::uint32_t t) { return page + layout.k_offset(t); };
    const auto scored = [&](std::uint32_t t, std::uint32_t n) {
      if (all_live) return;
      for (std::uint32_t u = t; u < t + n; ++u) {
        if (!slot_live(live, u)) std::fill_n(page_w + std::size_t{u} * W, W, kNegativeInfinity);
      }
    };
    std::uint32_t t = 0;
    for (; t + R <= tokens; t += R) {
      const std::byte* rows[R];
      for (std::uint32_t r = 0; r < R; ++r) {
        PrefetchRow(page + layout.v_offset(t + r), row_bytes);
        if (ahead != nullptr) PrefetchRow(ahead + layout.k_offset(t + r), row_bytes);
        rows[r] = k_row(t + r);
      }
      Dots<T, G, R>(df, q, rows, d, full, layout.dtype, f.scale, page_w + std::size_t{t} * W);
      scored(t, R);
    }
    for (; t < tokens; ++t) {
      PrefetchRow(page + layout.v_offset(t), row_bytes);
      if (ahead != nullptr) PrefetchRow(ahead + layout.k_offset(t), row_bytes);
      const std::byte* rows[1] = {k_row(t)};
      Dots<T, G, 1>(df, q, rows, d, full, layout.dtype, f.scale, page_w + std::size_t{t} * W);
      scored(t, 1);
    }
    if (f.scores != nullptr) {
      float* scores = f.scores + std::size_t{p} * pt * group;
      for (std::uint32_t i = 0; i < pt; ++i) {
        for (std::uint32_t b = 0; b < G; ++b) {
          scores[i * group + g0 + b] = i < tokens ? page_w[i * W + b] : kNegativeInfinity;
        }
      }
    }
    tile_tokens += tokens;
  }
  // 2. One max and one exponential pass over the tile for the G heads, each
  //    accumulator rescaled once (softmax_fold_tile's rule; softmax_rescale_tile).
  float scales[G];
  FoldTile<G>(df, f.states + g0, w, tile_tokens, scales);
  // 3. The weighted V rows, in slot order.
  float* HWY_RESTRICT acc = f.acc + std::size_t{g0} * d;
  std::size_t j = 0;
  // (q8_0: R vectors a block holds whole; RowLanesFit keeps `full` 0 where a vector does not fit one)
  if (!std::is_same_v<T, Q8Row> || kQ8BlockValues % (R * lanes) == 0) {
    for (; j + R * lanes <= full; j += R * lanes) WeightedRows<T, G, R>(df, layout, pages, count, w, scales, acc, j);
  }
  for (; j < full; j += lanes) WeightedRows<T, G, 1>(df, layout, pages, count, w, scales, acc, j);
  for (j = full; j < d; ++j) {
    for (std::uint32_t b = 0; b < G; ++b) acc[b * d + j] = softmax_rescale_tile(acc[b * d + j], scales[b]);
    const float* slot_w = w;
    for (std::uint32_t p = 0; p < count; ++p) {
      for (std::uint32_t u = 0; u < pages[p].tokens; ++u, slot_w += W) {
        if (!slot_live(pages[p].live, u)) continue;
        const float v = load_element(pages[p].data + layout.v_offset(u), static_cast<std::uint32_t>(j), layout.dtype);
        for (std::uint32_t b = 0; b < G; ++b) acc[b * d + j] += slot_w[b] * v;
      }
    }
  }
}

// The group in blocks of up to kGroupBlock heads; the first block prefetches.
template <class T>
void FoldPagesOf(const PageFold& f, const FoldPageRef* pages, std::uint32_t count, const std::byte* next) {
  for (std::uint32_t g0 = 0; g0 < f.group; g0 += kGroupBlock) {
    const std::byte* ahead = g0 == 0 ? next : nullptr;
    switch (std::min(kGroupBlock, f.group - g0)) {
      case 1:
        FoldHeads<T, 1>(f, pages, count, g0, ahead);
        break;
      case 2:
        FoldHeads<T, 2>(f, pages, count, g0, ahead);
        break;
      case 3:
        FoldHeads<T, 3>(f, pages, count, g0, ahead);
        break;
      case 4:
        FoldHeads<T, 4>(f, pages, count, g0, ahead);
        break;
      case 5:
        FoldHeads<T, 5>(f, pages, count, g0, ahead);
        break;
      case 6:
        FoldHeads<T, 6>(f, pages, count, g0, ahead);
        break;
      case 7:
        FoldHeads<T, 7>(f, pages, count, g0, ahead);
        break;
      default:
        FoldHeads<T, 8>(f, pages, count, g0, ahead);
        break;
    }
  }
}

void FoldPages(const PageFold& f, const FoldPageRef* pages, std::uint32_t count, const std::byte* next) {
  switch (f.layout.dtype) {
    case DType::f32:
      FoldPagesOf<float>(f, pages, count, next);
      return;
    case DType::f16:
      FoldPagesOf<hwy::float16_t>(f, pages, count, next);
      return;
    case DType::bf16:
      FoldPagesOf<hwy::bfloat16_t>(f, pages, count, next);
      return;
    case DType::q8_0:
      FoldPagesOf<Q8Row>(f, pages, count, next);
      return;
  }
}

const char* TargetHere() { return hwy::TargetName(HWY_TARGET); }

}  // namespace HWY_NAMESPACE
}  // namespace sparsekv
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace sparsekv {

HWY_EXPORT(FoldPages);
HWY_EXPORT(TargetHere);

void fold_page(const PageFold& f, const std::byte* page, std::uint32_t tokens, SlotMask live, const std::byte* next) {
  const FoldPageRef one{page, tokens, live};
  HWY_DYNAMIC_DISPATCH(FoldPages)(f, &one, 1, next);
}

void fold_pages(const PageFold& f, std::span<const FoldPageRef> pages, const std::byte* next) {
  if (pages.empty()) return;
  std::size_t tokens = 0;
  for (const FoldPageRef& page : pages) {
    if (page.tokens > f.layout.page_tokens) {
      fail(ErrorCode::invalid_argument, "fold_pages: a page holds {} tokens, at most {}", page.tokens,
           f.layout.page_tokens);
    }
    tokens += page.tokens;
  }
  if (pages.size() > 1 && tokens > fold_tile_tokens(f.layout)) {
    fail(ErrorCode::invalid_argument, "fold_pages: a tile of {} pages holds {} tokens, at most {}", pages.size(),
         tokens, fold_tile_tokens(f.layout));
  }
  HWY_DYNAMIC_DISPATCH(FoldPages)(f, pages.data(), static_cast<std::uint32_t>(pages.size()), next);
}

void fold_page_scalar(const PageFold& f, const std::byte* page, std::uint32_t tokens, SlotMask live) {
  const PageLayout& layout = f.layout;
  const std::uint32_t d = layout.head_dim;
  std::vector<float> rows(2 * std::size_t{d});  // one K and one V row in fp32
  float* k = rows.data();
  float* v = k + d;
  if (f.scores != nullptr) std::fill_n(f.scores, std::size_t{layout.page_tokens} * f.group, kNegativeInfinity);
  for (std::uint32_t t = 0; t < tokens; ++t) {
    if (!slot_live(live, t)) continue;
    const void* k_row = page + layout.k_offset(t);
    const void* v_row = page + layout.v_offset(t);
    for (std::uint32_t i = 0; i < d; ++i) k[i] = load_element(k_row, i, layout.dtype);
    for (std::uint32_t i = 0; i < d; ++i) v[i] = load_element(v_row, i, layout.dtype);
    for (std::uint32_t g = 0; g < f.group; ++g) {
      const float* qg = f.q + std::size_t{g} * d;
      float dot = 0.0f;
      for (std::uint32_t i = 0; i < d; ++i) dot += qg[i] * k[i];
      const float score = dot * f.scale;
      const RescaleStep step = softmax_fold(f.states[g], score, 1.0f);
      float* ag = f.acc + std::size_t{g} * d;
      if (step.value_weight != 0.0f || step.acc_scale != 1.0f) {
        for (std::uint32_t i = 0; i < d; ++i) ag[i] = softmax_rescale_add(ag[i], step, v[i]);
      }
      if (f.scores != nullptr) f.scores[std::size_t{t} * f.group + g] = score;
    }
  }
}

std::vector<FoldTarget> fold_page_targets() {
  hwy::SetSupportedTargetsForTest(0);
  const std::int64_t supported = hwy::SupportedTargets();
  std::vector<FoldTarget> out;
  for (std::int64_t targets = HWY_TARGETS; targets != 0; targets &= targets - 1) {
    const std::int64_t bit = targets & ~(targets - 1);
    out.push_back({hwy::TargetName(bit), bit, (supported & bit) != 0});
  }
  return out;
}

void use_fold_page_target(std::int64_t bits) { hwy::SetSupportedTargetsForTest(bits); }

std::string fold_page_target() { return HWY_DYNAMIC_DISPATCH(TargetHere)(); }

}  // namespace sparsekv
#endif  // HWY_ONCE
