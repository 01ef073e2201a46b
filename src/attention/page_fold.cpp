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
template <class T, std::uint32_t G>
void FoldHeads(const PageFold& f, const std::byte* page, std::uint32_t tokens, SlotMask live, std::uint32_t g0) {
  const hn::ScalableTag<float> df;
  const std::size_t lanes = hn::Lanes(df);
  const PageLayout& layout = f.layout;
  const std::uint32_t d = layout.head_dim, pt = layout.page_tokens, group = f.group;
  const std::size_t full = d / lanes * lanes;  // the tail [full, d) in scalar code
  float* HWY_RESTRICT w = f.weights + std::size_t{g0} * pt;  // [G][pt]: scores, then weights
  const float* HWY_RESTRICT q = f.q + std::size_t{g0} * d;
  // 1. Scores.
  for (std::uint32_t t = 0; t < tokens; ++t) {
    if (!slot_live(live, t)) {
      for (std::uint32_t b = 0; b < G; ++b) w[b * pt + t] = kNegativeInfinity;
      continue;
    }
    const auto* HWY_RESTRICT k = reinterpret_cast<const T*>(page + layout.k_offset(t));
    hn::Vec<decltype(df)> sums[G];
    for (std::uint32_t b = 0; b < G; ++b) sums[b] = hn::Zero(df);
    for (std::size_t j = 0; j < full; j += lanes) {
      const auto kv = LoadRow(df, k + j);
      for (std::uint32_t b = 0; b < G; ++b) sums[b] = hn::MulAdd(hn::LoadU(df, q + std::size_t{b} * d + j), kv, sums[b]);
    }
    for (std::uint32_t b = 0; b < G; ++b) {
      float dot = hn::GetLane(hn::SumOfLanes(df, sums[b]));
      for (std::size_t j = full; j < d; ++j) {
        dot += q[std::size_t{b} * d + j] * load_element(k, static_cast<std::uint32_t>(j), layout.dtype);
      }
      w[b * pt + t] = dot * f.scale;
    }
  }
  if (f.scores != nullptr) {
    for (std::uint32_t t = 0; t < pt; ++t) {
      for (std::uint32_t b = 0; b < G; ++b) {
        f.scores[t * group + g0 + b] = t < tokens ? w[b * pt + t] : kNegativeInfinity;
      }
    }
  }
  // 2. One max and one exponential pass per q head over the tile, the
  //    accumulator rescaled once (softmax_fold_tile / softmax_rescale_tile).
  float scales[G];
  for (std::uint32_t b = 0; b < G; ++b) scales[b] = softmax_fold_tile(f.states[g0 + b], w + b * pt, tokens, w + b * pt);
  // 3. The weighted V rows, in slot order.
  float* HWY_RESTRICT acc = f.acc + std::size_t{g0} * d;
  for (std::size_t j = 0; j < full; j += lanes) {
    hn::Vec<decltype(df)> accs[G];
    for (std::uint32_t b = 0; b < G; ++b) {
      const auto a = hn::LoadU(df, acc + std::size_t{b} * d + j);
      accs[b] = scales[b] == 0.0f ? hn::Zero(df) : scales[b] == 1.0f ? a : hn::Mul(a, hn::Set(df, scales[b]));
    }
    for (std::uint32_t t = 0; t < tokens; ++t) {
      if (!slot_live(live, t)) continue;
      const auto vv = LoadRow(df, reinterpret_cast<const T*>(page + layout.v_offset(t)) + j);
      for (std::uint32_t b = 0; b < G; ++b) accs[b] = hn::MulAdd(hn::Set(df, w[b * pt + t]), vv, accs[b]);
    }
    for (std::uint32_t b = 0; b < G; ++b) hn::StoreU(accs[b], df, acc + std::size_t{b} * d + j);
  }
  for (std::size_t j = full; j < d; ++j) {
    for (std::uint32_t b = 0; b < G; ++b) acc[b * d + j] = softmax_rescale_tile(acc[b * d + j], scales[b]);
    for (std::uint32_t t = 0; t < tokens; ++t) {
      if (!slot_live(live, t)) continue;
      const float v = load_element(page + layout.v_offset(t), static_cast<std::uint32_t>(j), layout.dtype);
      for (std::uint32_t b = 0; b < G; ++b) acc[b * d + j] += w[b * pt + t] * v;
    }
  }
}

// The group in blocks of up to kGroupBlock heads.
template <class T>
void FoldPageOf(const PageFold& f, const std::byte* page, std::uint32_t tokens, SlotMask live) {
  for (std::uint32_t g0 = 0; g0 < f.group; g0 += kGroupBlock) {
    switch (std::min(kGroupBlock, f.group - g0)) {
      case 1: FoldHeads<T, 1>(f, page, tokens, live, g0); break;
      case 2: FoldHeads<T, 2>(f, page, tokens, live, g0); break;
      case 3: FoldHeads<T, 3>(f, page, tokens, live, g0); break;
      case 4: FoldHeads<T, 4>(f, page, tokens, live, g0); break;
      case 5: FoldHeads<T, 5>(f, page, tokens, live, g0); break;
      case 6: FoldHeads<T, 6>(f, page, tokens, live, g0); break;
      case 7: FoldHeads<T, 7>(f, page, tokens, live, g0); break;
      default: FoldHeads<T, 8>(f, page, tokens, live, g0); break;
    }
  }
}

void FoldPage(const PageFold& f, const std::byte* page, std::uint32_t tokens, SlotMask live, const std::byte* next) {
  if (next != nullptr) {
    for (std::size_t at = 0; at < f.layout.page_bytes(); at += 64) hwy::Prefetch(next + at);
  }
  switch (f.layout.dtype) {
    case DType::f32:
      FoldPageOf<float>(f, page, tokens, live);
      return;
    case DType::f16:
      FoldPageOf<hwy::float16_t>(f, page, tokens, live);
      return;
    case DType::bf16:
      FoldPageOf<hwy::bfloat16_t>(f, page, tokens, live);
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
