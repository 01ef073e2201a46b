// widen_to_float (core/convert.hpp): compiled once per Highway target by
// foreach_target.h, dispatched at run time. f16 and bf16 widen exactly to
// fp32, so every target equals the scalar rule.
#include "sparsekv/core/convert.hpp"

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "sparsekv/core/numeric.hpp"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "core/convert.cpp"
#include <hwy/foreach_target.h>  // before highway.h
#include <hwy/highway.h>

HWY_BEFORE_NAMESPACE();
namespace sparsekv {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Whether this target widens f16 in hardware. Highway 1.0.3 emulates it on
// x86 below AVX2 (no F16C) and on the emulated targets, and that emulation
// turns an infinity into 65536: those take the scalar rule instead.
constexpr bool kNativeF16 = !(HWY_TARGET == HWY_SSSE3 || HWY_TARGET == HWY_SSE4 || HWY_TARGET == HWY_EMU128 ||
                              HWY_TARGET == HWY_SCALAR);

// Widens in[0, n) into out; returns whether every value is finite (a mask
// gathered on the way, so that the caller's check needs no second pass).
template <class T>
bool Widen(const T* HWY_RESTRICT in, std::size_t n, float* HWY_RESTRICT out) {
  const hn::ScalableTag<float> df;
  const hn::Rebind<T, decltype(df)> dh;
  const std::size_t lanes = hn::Lanes(df);
  std::size_t i = 0;
  auto finite = hn::Eq(hn::Zero(df), hn::Zero(df));  // all true
  if (std::is_same_v<T, hwy::bfloat16_t> || kNativeF16) {
    for (; i + lanes <= n; i += lanes) {
      const auto v = hn::PromoteTo(df, hn::LoadU(dh, in + i));
      finite = hn::And(finite, hn::IsFinite(v));
      hn::StoreU(v, df, out + i);
    }
  }
  bool all_finite = hn::AllTrue(df, finite);
  // The tail (or all of it) by the scalar rule, which every lane above equals.
  for (; i < n; ++i) {
    std::uint16_t bits;
    std::memcpy(&bits, in + i, sizeof(bits));
    out[i] = std::is_same_v<T, hwy::bfloat16_t> ? bf16_to_float(bits) : f16_to_float(bits);
    all_finite = all_finite && is_finite(out[i]);
  }
  return all_finite;
}

bool WidenToFloat(const void* data, bool bf16, std::size_t n, float* out) {
  return bf16 ? Widen(static_cast<const hwy::bfloat16_t*>(data), n, out)
              : Widen(static_cast<const hwy::float16_t*>(data), n, out);
}

}  // namespace HWY_NAMESPACE
}  // namespace sparsekv
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace sparsekv {

HWY_EXPORT(WidenToFloat);

bool widen_to_float(const void* data, DType dtype, std::size_t n, float* out) {
  if (dtype == DType::f32) {
    const auto* in = static_cast<const float*>(data);
    std::uint32_t non_finite = 0;  // no early exit: the copy and the check in one pass, vectorized
    for (std::size_t i = 0; i < n; ++i) {
      out[i] = in[i];
      non_finite |= is_finite(in[i]) ? 0u : 1u;
    }
    return non_finite == 0;
  }
  return HWY_DYNAMIC_DISPATCH(WidenToFloat)(data, dtype == DType::bf16, n, out);
}

}  // namespace sparsekv
#endif  // HWY_ONCE
