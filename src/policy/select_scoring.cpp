// select_scoring.hpp: compiled once per Highway target by foreach_target.h,
// dispatched at run time. Built with -ffp-contract=off (CMakeLists.txt): a
// multiply and an add must stay two roundings, as in the rules.
#include "sparsekv/policy/select_scoring.hpp"

#include <cstddef>
#include <vector>

#include "sparsekv/core/numeric.hpp"

#include "sparsekv/policy/select_rules.hpp"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "policy/select_scoring.cpp"
#include <hwy/foreach_target.h>  // before highway.h
#include <hwy/cache_control.h>
#include <hwy/highway.h>

#include "core/load_widened-inl.hpp"

HWY_BEFORE_NAMESPACE();
namespace sparsekv {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// The rule's eight lanes as `parts` vectors of up to eight lanes each.
constexpr std::size_t kRuleLanes = 8;
// Heads whose Quest sums are kept at once.
constexpr std::uint32_t kQuestHeads = 4;

// One box's sums for q heads [0, H) (H a compile-time count, so that the
// sums stay in registers and the heads' loop unrolls): the box's sum and
// width taken from lo / hi a vector at a time and used at once, never
// stored. halves / reach_halves: quest_halves of each head's q (rows of
// head_dim). sums[b]: head b's lane_order_sum over the `whole` dimensions
// (its lanes combined in the rule's order; the tail is the caller's).
template <std::uint32_t H, class T, class D>
HWY_INLINE void QuestBox(D d8, const float* HWY_RESTRICT halves, const float* HWY_RESTRICT reach_halves,
                         const T* HWY_RESTRICT lo, const T* HWY_RESTRICT hi, std::uint32_t head_dim,
                         std::uint32_t whole, float* HWY_RESTRICT sums) {
  const std::size_t n = hn::Lanes(d8), parts = kRuleLanes / n;
  hn::Vec<D> acc[H][kRuleLanes];
  for (std::uint32_t b = 0; b < H; ++b)
    for (std::size_t p = 0; p < parts; ++p) acc[b][p] = hn::Zero(d8);
  for (std::uint32_t d = 0; d < whole; d += kRuleLanes) {
    for (std::size_t p = 0; p < parts; ++p) {
      const std::size_t at = d + p * n;
      const auto l = LoadWidened(d8, lo + at), h = LoadWidened(d8, hi + at);
      const auto sum = hn::Add(l, h), width = hn::Sub(h, l);
      for (std::uint32_t b = 0; b < H; ++b) {
        const std::size_t row = std::size_t{b} * head_dim + at;
        const auto term =
            hn::Add(hn::Mul(hn::LoadU(d8, halves + row), sum), hn::Mul(hn::LoadU(d8, reach_halves + row), width));
        acc[b][p] = hn::Add(acc[b][p], term);
      }
    }
  }
  alignas(64) float lanes[kRuleLanes];
  for (std::uint32_t b = 0; b < H; ++b) {
    for (std::size_t p = 0; p < parts; ++p) hn::StoreU(acc[b][p], d8, lanes + p * n);
    float half[4];
    for (std::uint32_t j = 0; j < 4; ++j) half[j] = lanes[j] + lanes[j + 4];
    sums[b] = (half[0] + half[2]) + (half[1] + half[3]);
  }
}

template <class T>
void QuestLogitsOf(const float* q, std::uint32_t group, const T* min, const T* max, DType dtype, std::uint32_t n,
                   std::uint32_t head_dim, float spread, float scale, float* out) {
  const hn::CappedTag<float, kRuleLanes> d8;
  const std::uint32_t whole = head_dim / kRuleLanes * kRuleLanes;
  // The rule's per-head factors, once for all the boxes.
  thread_local std::vector<float> halves, reach_halves;
  halves.resize(std::size_t{group} * head_dim);
  reach_halves.resize(halves.size());
  for (std::size_t j = 0; j < halves.size(); ++j) {
    const QuestHalves f = quest_halves(q[j], spread);
    halves[j] = f.half;
    reach_halves[j] = f.reach_half;
  }
  float sums[kQuestHeads];
  for (std::uint32_t i = 0; i < n; ++i) {
    const T* lo = min + std::size_t{i} * head_dim;
    const T* hi = max + std::size_t{i} * head_dim;
    // Up to kQuestHeads heads at once: their sums are independent chains of
    // adds, which one head alone would leave waiting on the add latency.
    for (std::uint32_t g0 = 0; g0 < group; g0 += kQuestHeads) {
      const std::uint32_t heads = group - g0 < kQuestHeads ? group - g0 : kQuestHeads;
      const float* hb = halves.data() + std::size_t{g0} * head_dim;
      const float* rb = reach_halves.data() + std::size_t{g0} * head_dim;
      switch (heads) {
        case 1:
          QuestBox<1>(d8, hb, rb, lo, hi, head_dim, whole, sums);
          break;
        case 2:
          QuestBox<2>(d8, hb, rb, lo, hi, head_dim, whole, sums);
          break;
        case 3:
          QuestBox<3>(d8, hb, rb, lo, hi, head_dim, whole, sums);
          break;
        default:
          QuestBox<kQuestHeads>(d8, hb, rb, lo, hi, head_dim, whole, sums);
          break;
      }
      for (std::uint32_t b = 0; b < heads; ++b) {
        // The rule's tail, in order.
        float sum = sums[b];
        for (std::uint32_t d = whole; d < head_dim; ++d) {
          const std::size_t at = std::size_t{b} * head_dim + d;
          sum = add_rn(sum, quest_term({hb[at], rb[at]}, load_element(lo, d, dtype), load_element(hi, d, dtype)));
        }
        out[std::size_t{g0 + b} * n + i] = mul_rn(sum, scale);
      }
    }
  }
}

void QuestLogits(const float* q, std::uint32_t group, const void* min, const void* max, DType dtype, std::uint32_t n,
                 std::uint32_t head_dim, float spread, float scale, float* out) {
  switch (dtype) {
    case DType::f32:
      QuestLogitsOf(q, group, static_cast<const float*>(min), static_cast<const float*>(max), dtype, n, head_dim,
                    spread, scale, out);
      return;
    case DType::f16:
      QuestLogitsOf(q, group, static_cast<const hwy::float16_t*>(min), static_cast<const hwy::float16_t*>(max), dtype,
                    n, head_dim, spread, scale, out);
      return;
    case DType::bf16:
      QuestLogitsOf(q, group, static_cast<const hwy::bfloat16_t*>(min), static_cast<const hwy::bfloat16_t*>(max), dtype,
                    n, head_dim, spread, scale, out);
      return;
  }
}

#if HWY_TARGET != HWY_SCALAR
// columns[k] lane j = rows[j * stride + k] for j, k < 8: eight rows of eight
// floats transposed (8-lane vectors only).
template <class D>
HWY_INLINE void Transpose8(D d8, const float* rows, std::size_t stride, hn::Vec<D> (&columns)[8]) {
  const hn::Repartition<double, D> d64;
  hn::Vec<D> r[8];
  for (std::size_t j = 0; j < 8; ++j) r[j] = hn::LoadU(d8, rows + j * stride);
  // Pairs of rows, then pairs of pairs (64-bit), within each 128-bit half.
  hn::Vec<D> t[8], u[8];
  for (std::size_t p = 0; p < 4; ++p) {
    t[2 * p] = hn::InterleaveLower(d8, r[2 * p], r[2 * p + 1]);      // j0 j1 of elements 0 1 | 4 5
    t[2 * p + 1] = hn::InterleaveUpper(d8, r[2 * p], r[2 * p + 1]);  // 2 3 | 6 7
  }
  for (std::size_t h = 0; h < 2; ++h) {  // rows 0-3, rows 4-7
    const auto a = hn::BitCast(d64, t[4 * h]), b = hn::BitCast(d64, t[4 * h + 2]);
    const auto c = hn::BitCast(d64, t[4 * h + 1]), e = hn::BitCast(d64, t[4 * h + 3]);
    u[4 * h + 0] = hn::BitCast(d8, hn::InterleaveLower(d64, a, b));  // element 0 | 4
    u[4 * h + 1] = hn::BitCast(d8, hn::InterleaveUpper(d64, a, b));  // 1 | 5
    u[4 * h + 2] = hn::BitCast(d8, hn::InterleaveLower(d64, c, e));  // 2 | 6
    u[4 * h + 3] = hn::BitCast(d8, hn::InterleaveUpper(d64, c, e));  // 3 | 7
  }
  for (std::size_t k = 0; k < 4; ++k) {
    columns[k] = hn::ConcatLowerLower(d8, u[4 + k], u[k]);
    columns[k + 4] = hn::ConcatUpperUpper(d8, u[4 + k], u[k]);
  }
}
#endif

// Heads whose accumulators are kept at once for one block of candidates.
constexpr std::uint32_t kHeadBlock = 4;
// Blocks of candidates ahead whose landmarks are asked for: a block's read
// takes 32 bytes of each of its eight rows in turn, which the hardware
// prefetcher does not follow. Out of cache (as a decode step finds them):
// 38-42 -> 22-23 us a kv head at 512 x 128; 1 block ahead beat 2 and 4.
constexpr std::size_t kPrefetchBlocks = 1;

// One block of eight candidates (a lane each) for heads q[0 .. H) (H a
// compile-time count, so the sums and the transposed columns stay in
// registers): each lane runs dot_in_order over its landmark, element d taken
// from the lane's row, q[d] broadcast. out[b * n + lane] = scale * sum.
template <std::uint32_t H, class D, class VI>
HWY_INLINE void ShadowKVBlock(D d8, const float* HWY_RESTRICT q, const float* HWY_RESTRICT block,
                              std::uint32_t head_dim, std::uint32_t whole, VI rows, hn::Vec<D> vscale, std::uint32_t n,
                              float* HWY_RESTRICT out) {
  hn::Vec<D> acc[H];
  for (std::uint32_t b = 0; b < H; ++b) acc[b] = hn::Zero(d8);
  const auto step = [&](std::uint32_t d, hn::Vec<D> l) {
    for (std::uint32_t b = 0; b < H; ++b)
      acc[b] = hn::Add(acc[b], hn::Mul(hn::Set(d8, q[std::size_t{b} * head_dim + d]), l));
  };
#if HWY_TARGET != HWY_SCALAR
  for (std::uint32_t d = 0; d < whole; d += 8) {
    hn::Vec<D> columns[8];
    Transpose8(d8, block + d, head_dim, columns);
    for (std::uint32_t k = 0; k < 8; ++k) step(d + k, columns[k]);
  }
#endif
  for (std::uint32_t d = whole; d < head_dim; ++d) step(d, hn::GatherIndex(d8, block + d, rows));
  for (std::uint32_t b = 0; b < H; ++b) hn::StoreU(hn::Mul(vscale, acc[b]), d8, out + std::size_t{b} * n);
}

void ShadowKVLogits(const float* q, std::uint32_t group, const float* landmarks, std::uint32_t n,
                    std::uint32_t head_dim, float scale, float* out) {
  // A lane per candidate: each lane runs dot_in_order for its own landmark,
  // element d gathered from the lane's row, q[d] broadcast; each gathered
  // vector serves up to kHeadBlock heads.
  const hn::CappedTag<float, 8> d8;
  const hn::RebindToSigned<decltype(d8)> di;
  const auto lanes = static_cast<std::uint32_t>(hn::Lanes(d8));
  const auto rows = hn::Mul(hn::Iota(di, 0), hn::Set(di, static_cast<std::int32_t>(head_dim)));
  const auto vscale = hn::Set(d8, scale);
  // With eight lanes, eight candidates' next eight elements are loaded as
  // rows and transposed (no gather); a last partial block of dimensions and
  // narrower vectors gather.
  const bool transpose = lanes == 8;
  const std::uint32_t whole = transpose ? head_dim / 8 * 8 : 0;
  std::uint32_t i = 0;
  const std::size_t block_bytes = std::size_t{lanes} * head_dim * sizeof(float);
  for (; i + lanes <= n; i += lanes) {
    const float* block = landmarks + std::size_t{i} * head_dim;
    if (i + (kPrefetchBlocks + 1) * lanes <= n) {
      const auto* ahead = reinterpret_cast<const std::byte*>(block) + kPrefetchBlocks * block_bytes;
      for (std::size_t at = 0; at < block_bytes; at += 64) hwy::Prefetch(ahead + at);
    }
    for (std::uint32_t g0 = 0; g0 < group; g0 += kHeadBlock) {
      const float* qb = q + std::size_t{g0} * head_dim;
      float* ob = out + std::size_t{g0} * n + i;
      switch (group - g0 < kHeadBlock ? group - g0 : kHeadBlock) {
        case 1:
          ShadowKVBlock<1>(d8, qb, block, head_dim, whole, rows, vscale, n, ob);
          break;
        case 2:
          ShadowKVBlock<2>(d8, qb, block, head_dim, whole, rows, vscale, n, ob);
          break;
        case 3:
          ShadowKVBlock<3>(d8, qb, block, head_dim, whole, rows, vscale, n, ob);
          break;
        default:
          ShadowKVBlock<kHeadBlock>(d8, qb, block, head_dim, whole, rows, vscale, n, ob);
          break;
      }
    }
  }
  for (; i < n; ++i) {
    for (std::uint32_t g = 0; g < group; ++g) {
      out[std::size_t{g} * n + i] =
          shadowkv_logit(q + std::size_t{g} * head_dim, landmarks + std::size_t{i} * head_dim, head_dim, scale);
    }
  }
}

// out[i] = portable_exp(add_rn(x[i], bias)), a vector at a time: the rule's
// steps, each one rounding; a vector with a lane outside the rule's normal
// path (NaN, beyond its range, a result that overflows or is subnormal)
// takes the scalar rule for all its lanes.
void PortableExps(const float* x, float bias, std::uint32_t n, float* out) {
  const hn::ScalableTag<float> df;
  const hn::RebindToSigned<decltype(df)> di;
  const auto lanes = static_cast<std::uint32_t>(hn::Lanes(df));
  const auto vbias = hn::Set(df, bias);
  const auto magic = hn::Set(df, 12582912.0f);
  const auto ln2_hi = hn::Set(df, 0.693145751953125f), ln2_lo = hn::Set(df, 1.42860677e-06f);
  const float terms[] = {1.38888889e-3f, 8.33333333e-3f, 4.16666667e-2f, 1.66666667e-1f, 0.5f, 1.0f, 1.0f};
  std::uint32_t i = 0;
  for (; i + lanes <= n; i += lanes) {
    const auto v = hn::Add(hn::LoadU(df, x + i), vbias);
    const auto k = hn::Sub(hn::Add(hn::Mul(v, hn::Set(df, 1.44269502f)), magic), magic);
    const auto r = hn::Add(hn::Add(v, hn::Neg(hn::Mul(k, ln2_hi))), hn::Neg(hn::Mul(k, ln2_lo)));
    auto p = hn::Set(df, 1.98412698e-4f);
    for (const float t : terms) p = hn::Add(hn::Mul(p, r), hn::Set(df, t));
    const auto e = hn::ConvertTo(di, k);
    const auto out_of_range =
        hn::Or(hn::Not(hn::Eq(v, v)), hn::Or(hn::Gt(v, hn::Set(df, 88.72283f)), hn::Lt(v, hn::Set(df, -103.972084f))));
    const auto not_normal = hn::Or(hn::Gt(e, hn::Set(di, 127)), hn::Lt(e, hn::Set(di, -126)));
    if (!hn::AllFalse(df, hn::Or(out_of_range, hn::RebindMask(df, not_normal)))) {
      for (std::uint32_t j = i; j < i + lanes; ++j) out[j] = portable_exp(add_rn(x[j], bias));
      continue;
    }
    const auto scale = hn::BitCast(df, hn::ShiftLeft<23>(hn::Add(e, hn::Set(di, 127))));
    hn::StoreU(hn::Mul(p, scale), df, out + i);
  }
  for (; i < n; ++i) out[i] = portable_exp(add_rn(x[i], bias));
}

// shadowkv_head_scores with vectors of up to eight lanes: the max and the
// folds are lane-wise (a max's order does not matter, see select_rules.hpp),
// the sum keeps lane_sum's kSumLanes partials as kSumLanes / lanes vectors,
// each lane adding its candidates in index order.
void ShadowKVHeadScores(std::uint32_t n, const float* logits, const char* taken, float* shares, float* scores) {
  const hn::CappedTag<float, 8> df;
  const hn::Rebind<std::int32_t, decltype(df)> di;
  const hn::Rebind<std::uint8_t, decltype(df)> d8;
  const auto lanes = static_cast<std::uint32_t>(hn::Lanes(df));
  static_assert(kSumLanes % 8 == 0);
  const std::uint32_t whole = n / lanes * lanes;
  const auto untaken_at = [&](std::uint32_t i) {
    return hn::RebindMask(
        df, hn::Eq(hn::PromoteTo(di, hn::LoadU(d8, reinterpret_cast<const std::uint8_t*>(taken) + i)), hn::Zero(di)));
  };
  auto vtop = hn::Set(df, kNegativeInfinity);
  for (std::uint32_t i = 0; i < whole; i += lanes) {
    const auto x = hn::LoadU(df, logits + i);
    vtop = hn::IfThenElse(hn::And(untaken_at(i), hn::Lt(vtop, x)), x, vtop);
  }
  alignas(64) float lane[kSumLanes];
  hn::StoreU(vtop, df, lane);
  float top = kNegativeInfinity;
  for (std::uint32_t l = 0; l < lanes; ++l) top = fold_max_score(top, lane[l]);
  for (std::uint32_t i = whole; i < n; ++i) {
    if (taken[i] == 0) top = fold_max_score(top, logits[i]);
  }
  PortableExps(logits, -top, n, shares);
  // lane_sum: candidate i in partial i % kSumLanes.
  const std::uint32_t parts = kSumLanes / lanes;
  hn::Vec<decltype(df)> sums[kSumLanes];
  for (std::uint32_t p = 0; p < parts; ++p) sums[p] = hn::Zero(df);
  for (std::uint32_t i = 0; i < whole; i += lanes) {
    const std::uint32_t p = (i % kSumLanes) / lanes;
    sums[p] = hn::Add(sums[p], hn::IfThenElseZero(untaken_at(i), hn::LoadU(df, shares + i)));
  }
  for (std::uint32_t p = 0; p < parts; ++p) hn::StoreU(sums[p], df, lane + p * lanes);
  for (std::uint32_t i = whole; i < n; ++i) {
    if (taken[i] == 0) lane[i % kSumLanes] = lane[i % kSumLanes] + shares[i];
  }
  const float sum = tree_combine(lane);
  const auto vsum = hn::Set(df, sum);
  for (std::uint32_t i = 0; i < whole; i += lanes) {
    const auto share = hn::Div(hn::LoadU(df, shares + i), vsum);
    const auto old = hn::LoadU(df, scores + i);
    hn::StoreU(hn::IfThenElse(hn::And(untaken_at(i), hn::Lt(old, share)), share, old), df, scores + i);
  }
  for (std::uint32_t i = whole; i < n; ++i) {
    if (taken[i] == 0) scores[i] = fold_max_score(scores[i], div_rn(shares[i], sum));
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace sparsekv
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace sparsekv {

HWY_EXPORT(QuestLogits);
HWY_EXPORT(ShadowKVLogits);
HWY_EXPORT(PortableExps);
HWY_EXPORT(ShadowKVHeadScores);

void quest_logits_simd(const float* q, std::uint32_t group, const void* min, const void* max, DType dtype,
                       std::uint32_t n, std::uint32_t head_dim, float spread, float scale, float* out) {
  HWY_DYNAMIC_DISPATCH(QuestLogits)(q, group, min, max, dtype, n, head_dim, spread, scale, out);
}

void shadowkv_logits_simd(const float* q, std::uint32_t group, const float* landmarks, std::uint32_t n,
                          std::uint32_t head_dim, float scale, float* out) {
  HWY_DYNAMIC_DISPATCH(ShadowKVLogits)(q, group, landmarks, n, head_dim, scale, out);
}

void portable_exps(const float* x, float bias, std::uint32_t n, float* out) {
  HWY_DYNAMIC_DISPATCH(PortableExps)(x, bias, n, out);
}

void shadowkv_head_scores_simd(std::uint32_t n, const float* logits, const char* taken, float* shares, float* scores) {
  HWY_DYNAMIC_DISPATCH(ShadowKVHeadScores)(n, logits, taken, shares, scores);
}

void softmax_rank_add_simd(std::uint32_t m, const float* logits, float* rank) {
  softmax_rank_add(m, logits, rank, [&](float bias, float* out) { portable_exps(logits, bias, m, out); });
}

}  // namespace sparsekv
#endif  // HWY_ONCE
