// select_scoring.hpp: compiled once per Highway target by foreach_target.h,
// dispatched at run time. Built with -ffp-contract=off (CMakeLists.txt): a
// multiply and an add must stay two roundings, as in the rules.
#include "sparsekv/policy/select_scoring.hpp"

#include <cstddef>
#include <vector>

#include "sparsekv/policy/select_rules.hpp"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "policy/select_scoring.cpp"
#include <hwy/foreach_target.h>  // before highway.h
#include <hwy/highway.h>

HWY_BEFORE_NAMESPACE();
namespace sparsekv {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// The rule's eight lanes as `parts` vectors of up to eight lanes each.
constexpr std::size_t kRuleLanes = 8;

void QuestLogits(const float* q, std::uint32_t group, const float* min, const float* max, std::uint32_t n,
                 std::uint32_t head_dim, float spread, float scale, float* out) {
  const hn::CappedTag<float, kRuleLanes> d8;
  const std::size_t lanes = hn::Lanes(d8);
  const std::size_t parts = kRuleLanes / lanes;
  const std::uint32_t whole = head_dim / kRuleLanes * kRuleLanes;
  thread_local std::vector<float> scratch;
  scratch.resize(std::size_t{group} * head_dim + 2 * std::size_t{whole});
  float* q_abs = scratch.data();  // |q|: exact
  float* centre = q_abs + std::size_t{group} * head_dim;
  float* half_width = centre + whole;
  for (std::size_t j = 0; j < std::size_t{group} * head_dim; ++j) q_abs[j] = q[j] < 0.0f ? -q[j] : q[j];
  const auto vhalf = hn::Set(d8, 0.5f);
  const auto vspread = hn::Set(d8, spread);
  alignas(64) float lane[kRuleLanes];
  for (std::uint32_t i = 0; i < n; ++i) {
    const float* lo = min + std::size_t{i} * head_dim;
    const float* hi = max + std::size_t{i} * head_dim;
    // The box's centre and half-width, once for the group.
    for (std::uint32_t d = 0; d < whole; d += static_cast<std::uint32_t>(lanes)) {
      const auto l = hn::LoadU(d8, lo + d), h = hn::LoadU(d8, hi + d);
      hn::StoreU(hn::Mul(hn::Add(l, h), vhalf), d8, centre + d);
      hn::StoreU(hn::Mul(hn::Sub(h, l), vhalf), d8, half_width + d);
    }
    for (std::uint32_t g = 0; g < group; ++g) {
      const float* qg = q + std::size_t{g} * head_dim;
      const float* ag = q_abs + std::size_t{g} * head_dim;
      hn::Vec<decltype(d8)> acc[kRuleLanes];
      for (std::size_t p = 0; p < parts; ++p) acc[p] = hn::Zero(d8);
      for (std::uint32_t d = 0; d < whole; d += kRuleLanes) {
        for (std::size_t p = 0; p < parts; ++p) {
          const std::size_t at = d + p * lanes;
          const auto reach = hn::Mul(hn::LoadU(d8, ag + at), hn::LoadU(d8, half_width + at));
          const auto term = hn::Add(hn::Mul(hn::LoadU(d8, qg + at), hn::LoadU(d8, centre + at)), hn::Mul(vspread, reach));
          acc[p] = hn::Add(acc[p], term);
        }
      }
      for (std::size_t p = 0; p < parts; ++p) hn::StoreU(acc[p], d8, lane + p * lanes);
      // The rule's combination (lane_order_sum), then its tail, in order.
      float halves[4];
      for (std::uint32_t j = 0; j < 4; ++j) halves[j] = lane[j] + lane[j + 4];
      float sum = (halves[0] + halves[2]) + (halves[1] + halves[3]);
      for (std::uint32_t d = whole; d < head_dim; ++d) {
        const float c = mul_rn(add_rn(lo[d], hi[d]), 0.5f);
        const float w = mul_rn(add_rn(hi[d], -lo[d]), 0.5f);
        sum = add_rn(sum, add_rn(mul_rn(qg[d], c), mul_rn(spread, mul_rn(ag[d], w))));
      }
      out[std::size_t{g} * n + i] = mul_rn(sum, scale);
    }
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace sparsekv
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace sparsekv {

HWY_EXPORT(QuestLogits);

void quest_logits_simd(const float* q, std::uint32_t group, const float* min, const float* max, std::uint32_t n,
                       std::uint32_t head_dim, float spread, float scale, float* out) {
  HWY_DYNAMIC_DISPATCH(QuestLogits)(q, group, min, max, n, head_dim, spread, scale, out);
}

}  // namespace sparsekv
#endif  // HWY_ONCE
