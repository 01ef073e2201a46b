// fold_page (attention/page_fold.hpp): compiled once per Highway target by
// foreach_target.h, dispatched at run time to the best the CPU has.
#include "sparsekv/attention/page_fold.hpp"

#include <algorithm>
#include <type_traits>
#include <vector>

#include "sparsekv/core/numeric.hpp"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "attention/page_fold.cpp"
#include <hwy/foreach_target.h>  // before highway.h
#include <hwy/cache_control.h>
#include <hwy/highway.h>
#include <hwy/contrib/math/math-inl.h>

HWY_BEFORE_NAMESPACE();
namespace sparsekv {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// q heads whose accumulators stay in registers at once.
constexpr std::uint32_t kGroupBlock = 8;

template <class T, class D>
HWY_INLINE hn::Vec<D> LoadRow(D d, const T* HWY_RESTRICT p) {
  if constexpr (std::is_same_v<T, float>) {
    return hn::LoadU(d, p);
  } else {
    const hn::Rebind<T, D> narrow;
    return hn::PromoteTo(d, hn::LoadU(narrow, p));
  }
}

// The page's tile for q heads [g0, g0 + G) (G a compile-time count, so the
// accumulators stay in registers): the scores of every live slot, each K row
// loaded once for the G heads; the tile fold per head; then the weighted V
// rows, each loaded once for the G heads.
// softmax_fold_tile with the exponentials a vector at a time (Highway's Exp,
// within 1 ulp of std::exp; 0 below -104, so -inf gives exactly 0): one max
// and one exponential pass over the tile's n scores, which become weights.
template <class D>
HWY_INLINE float FoldTile(D df, SoftmaxState& s, float* HWY_RESTRICT w, std::uint32_t n) {
  const std::size_t lanes = hn::Lanes(df);
  float tile_max = kNegativeInfinity;
  for (std::uint32_t j = 0; j < n; ++j) tile_max = !(w[j] <= tile_max) ? w[j] : tile_max;
  if (tile_max == kNegativeInfinity) {
    std::fill_n(w, n, 0.0f);
    return 1.0f;
  }
  const float m = s.max > tile_max ? s.max : tile_max;
  const float scale = softmax_exp(s.max - m);  // 0 for an empty state (m finite)
  const auto vm = hn::Set(df, m);
  auto sums = hn::Zero(df);
  std::uint32_t j = 0;
  for (; j + lanes <= n; j += static_cast<std::uint32_t>(lanes)) {
    const auto e = hn::Exp(df, hn::Sub(hn::LoadU(df, w + j), vm));
    hn::StoreU(e, df, w + j);
    sums = hn::Add(sums, e);
  }
  float sum = s.sum * scale + hn::GetLane(hn::SumOfLanes(df, sums));
  for (; j < n; ++j) {
    w[j] = softmax_exp(w[j] - m);
    sum += w[j];
  }
  s.sum = sum;
  s.max = m;
  return scale;
}

// Prefetches one K or V row (whole cache lines).
HWY_INLINE void PrefetchRow(const std::byte* row, std::size_t bytes) {
  for (std::size_t at = 0; at < bytes; at += 64) hwy::Prefetch(row + at);
}

// q.k for `R` rows of K (one or two tokens) and G q heads: R * G independent
// FMA chains, each q vector loaded once for the R rows.
template <class T, std::uint32_t G, std::uint32_t R, class D>
HWY_INLINE void Dots(D df, const float* HWY_RESTRICT q, const T* const (&k)[R], std::uint32_t d, std::size_t full,
                     DType dtype, float (&out)[R][G]) {
  const std::size_t lanes = hn::Lanes(df);
  hn::Vec<D> sums[R][G];
  for (std::uint32_t r = 0; r < R; ++r)
    for (std::uint32_t b = 0; b < G; ++b) sums[r][b] = hn::Zero(df);
  for (std::size_t j = 0; j < full; j += lanes) {
    hn::Vec<D> rows[R];
    for (std::uint32_t r = 0; r < R; ++r) rows[r] = LoadRow(df, k[r] + j);
    for (std::uint32_t b = 0; b < G; ++b) {
      const auto qv = hn::LoadU(df, q + std::size_t{b} * d + j);
      for (std::uint32_t r = 0; r < R; ++r) sums[r][b] = hn::MulAdd(qv, rows[r], sums[r][b]);
    }
  }
  for (std::uint32_t r = 0; r < R; ++r) {
    for (std::uint32_t b = 0; b < G; ++b) {
      float dot = hn::GetLane(hn::SumOfLanes(df, sums[r][b]));
      for (std::size_t j = full; j < d; ++j) {
        dot += q[std::size_t{b} * d + j] * load_element(k[r], static_cast<std::uint32_t>(j), dtype);
      }
      out[r][b] = dot;
    }
  }
}

// out[b][j .. j + R lanes) = scale[b] * acc + sum over live t of w[b][t] * V[t]:
// R vectors of each of G heads, R * G independent FMA chains, each weight
// broadcast once for the R vectors.
template <class T, std::uint32_t G, std::uint32_t R, class D>
HWY_INLINE void WeightedRows(D df, const PageLayout& layout, const std::byte* page, std::uint32_t tokens,
                             SlotMask live, bool all_live, const float* HWY_RESTRICT w, const float (&scales)[G],
                             float* HWY_RESTRICT acc, std::size_t j) {
  const std::size_t lanes = hn::Lanes(df);
  const std::uint32_t d = layout.head_dim, pt = layout.page_tokens;
  hn::Vec<D> accs[R][G];
  for (std::uint32_t b = 0; b < G; ++b) {
    for (std::uint32_t r = 0; r < R; ++r) {
      const auto a = hn::LoadU(df, acc + std::size_t{b} * d + j + r * lanes);
      accs[r][b] = scales[b] == 0.0f ? hn::Zero(df) : scales[b] == 1.0f ? a : hn::Mul(a, hn::Set(df, scales[b]));
    }
  }
  for (std::uint32_t t = 0; t < tokens; ++t) {
    if (!all_live && !slot_live(live, t)) continue;
    const T* v = reinterpret_cast<const T*>(page + layout.v_offset(t)) + j;
    hn::Vec<D> rows[R];
    for (std::uint32_t r = 0; r < R; ++r) rows[r] = LoadRow(df, v + r * lanes);
    for (std::uint32_t b = 0; b < G; ++b) {
      const auto wb = hn::Set(df, w[b * pt + t]);
      for (std::uint32_t r = 0; r < R; ++r) accs[r][b] = hn::MulAdd(wb, rows[r], accs[r][b]);
    }
  }
  for (std::uint32_t b = 0; b < G; ++b)
    for (std::uint32_t r = 0; r < R; ++r) hn::StoreU(accs[r][b], df, acc + std::size_t{b} * d + j + r * lanes);
}

// The page's tile for q heads [g0, g0 + G) (G a compile-time count, so the
// accumulators stay in registers): the scores of every live slot, each K row
// loaded once for the G heads; the tile fold per head; then the weighted V
// rows, each loaded once for the G heads. Up to 4 heads, two tokens (scores)
// and two vectors (V) go at once: eight FMA chains hide the FMA latency that
// four would wait on.
template <class T, std::uint32_t G>
void FoldHeads(const PageFold& f, const std::byte* page, std::uint32_t tokens, SlotMask live, std::uint32_t g0,
               const std::byte* next) {
  constexpr std::uint32_t R = G <= 4 ? 2 : 1;
  const hn::ScalableTag<float> df;
  const std::size_t lanes = hn::Lanes(df);
  const PageLayout& layout = f.layout;
  const std::uint32_t d = layout.head_dim, pt = layout.page_tokens, group = f.group;
  const std::size_t full = d / lanes * lanes;  // the tail [full, d) in scalar code
  const bool all_live = (live & full_slot_mask(tokens)) == full_slot_mask(tokens);
  float* HWY_RESTRICT w = f.weights + std::size_t{g0} * pt;  // [G][pt]: scores, then weights
  const float* HWY_RESTRICT q = f.q + std::size_t{g0} * d;
  // 1. Scores (a dead slot's is computed, then -inf). Each token's turn also
  //    asks for its V row (read in step 3 column by column, which the
  //    hardware prefetcher does not follow) and for the next page's K row t:
  //    a few lines at a time, within what the core keeps in flight.
  const std::size_t row_bytes = layout.row_bytes();
  const auto k_row = [&](std::uint32_t t) { return reinterpret_cast<const T*>(page + layout.k_offset(t)); };
  const auto put = [&](std::uint32_t t, const float (&dots)[G]) {
    const bool alive = slot_live(live, t);
    for (std::uint32_t b = 0; b < G; ++b) w[b * pt + t] = alive ? dots[b] * f.scale : kNegativeInfinity;
  };
  std::uint32_t t = 0;
  for (; t + R <= tokens; t += R) {
    const T* rows[R];
    for (std::uint32_t r = 0; r < R; ++r) {
      PrefetchRow(page + layout.v_offset(t + r), row_bytes);
      if (next != nullptr) PrefetchRow(next + layout.k_offset(t + r), row_bytes);
      rows[r] = k_row(t + r);
    }
    float dots[R][G];
    Dots<T, G, R>(df, q, rows, d, full, layout.dtype, dots);
    for (std::uint32_t r = 0; r < R; ++r) put(t + r, dots[r]);
  }
  for (; t < tokens; ++t) {
    PrefetchRow(page + layout.v_offset(t), row_bytes);
    if (next != nullptr) PrefetchRow(next + layout.k_offset(t), row_bytes);
    const T* rows[1] = {k_row(t)};
    float dots[1][G];
    Dots<T, G, 1>(df, q, rows, d, full, layout.dtype, dots);
    put(t, dots[0]);
  }
  if (f.scores != nullptr) {
    for (std::uint32_t i = 0; i < pt; ++i) {
      for (std::uint32_t b = 0; b < G; ++b) {
        f.scores[i * group + g0 + b] = i < tokens ? w[b * pt + i] : kNegativeInfinity;
      }
    }
  }
  // 2. One max and one exponential pass per q head over the tile, the
  //    accumulator rescaled once (FoldTile: softmax_fold_tile's rule;
  //    softmax_rescale_tile).
  float scales[G];
  for (std::uint32_t b = 0; b < G; ++b) scales[b] = FoldTile(df, f.states[g0 + b], w + b * pt, tokens);
  // 3. The weighted V rows, in slot order.
  float* HWY_RESTRICT acc = f.acc + std::size_t{g0} * d;
  std::size_t j = 0;
  for (; j + R * lanes <= full; j += R * lanes) {
    WeightedRows<T, G, R>(df, layout, page, tokens, live, all_live, w, scales, acc, j);
  }
  for (; j < full; j += lanes) WeightedRows<T, G, 1>(df, layout, page, tokens, live, all_live, w, scales, acc, j);
  for (j = full; j < d; ++j) {
    for (std::uint32_t b = 0; b < G; ++b) acc[b * d + j] = softmax_rescale_tile(acc[b * d + j], scales[b]);
    for (std::uint32_t u = 0; u < tokens; ++u) {
      if (!slot_live(live, u)) continue;
      const float v = load_element(page + layout.v_offset(u), static_cast<std::uint32_t>(j), layout.dtype);
      for (std::uint32_t b = 0; b < G; ++b) acc[b * d + j] += w[b * pt + u] * v;
    }
  }
}

// The group in blocks of up to kGroupBlock heads; the first block prefetches.
template <class T>
void FoldPageOf(const PageFold& f, const std::byte* page, std::uint32_t tokens, SlotMask live, const std::byte* next) {
  for (std::uint32_t g0 = 0; g0 < f.group; g0 += kGroupBlock) {
    const std::byte* ahead = g0 == 0 ? next : nullptr;
    switch (std::min(kGroupBlock, f.group - g0)) {
      case 1: FoldHeads<T, 1>(f, page, tokens, live, g0, ahead); break;
      case 2: FoldHeads<T, 2>(f, page, tokens, live, g0, ahead); break;
      case 3: FoldHeads<T, 3>(f, page, tokens, live, g0, ahead); break;
      case 4: FoldHeads<T, 4>(f, page, tokens, live, g0, ahead); break;
      case 5: FoldHeads<T, 5>(f, page, tokens, live, g0, ahead); break;
      case 6: FoldHeads<T, 6>(f, page, tokens, live, g0, ahead); break;
      case 7: FoldHeads<T, 7>(f, page, tokens, live, g0, ahead); break;
      default: FoldHeads<T, 8>(f, page, tokens, live, g0, ahead); break;
    }
  }
}

void FoldPage(const PageFold& f, const std::byte* page, std::uint32_t tokens, SlotMask live, const std::byte* next) {
  switch (f.layout.dtype) {
    case DType::f32:
      FoldPageOf<float>(f, page, tokens, live, next);
      return;
    case DType::f16:
      FoldPageOf<hwy::float16_t>(f, page, tokens, live, next);
      return;
    case DType::bf16:
      FoldPageOf<hwy::bfloat16_t>(f, page, tokens, live, next);
      return;
  }
}

const char* TargetHere() { return hwy::TargetName(HWY_TARGET); }

}  // namespace HWY_NAMESPACE
}  // namespace sparsekv
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace sparsekv {

HWY_EXPORT(FoldPage);
HWY_EXPORT(TargetHere);

void fold_page(const PageFold& f, const std::byte* page, std::uint32_t tokens, SlotMask live, const std::byte* next) {
  HWY_DYNAMIC_DISPATCH(FoldPage)(f, page, tokens, live, next);
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
