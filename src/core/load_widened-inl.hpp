// LoadWidened: a vector of fp32 lanes from a row of fp32, f16 or bf16
// values (16-bit values widened exactly), for the Highway kernels of every
// layer; Q8Scale and LoadQ8Lanes: the same from q8_0 blocks (a block's scale,
// its q widened). A per-target header: included after hwy/highway.h by a source that
// foreach_target.h compiles once per target; the guard follows
// HWY_TARGET_TOGGLE so that each target's pass gets its own copy.
#if defined(SPARSEKV_CORE_LOAD_WIDENED_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef SPARSEKV_CORE_LOAD_WIDENED_INL_H_
#undef SPARSEKV_CORE_LOAD_WIDENED_INL_H_
#else
#define SPARSEKV_CORE_LOAD_WIDENED_INL_H_
#endif

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include <hwy/highway.h>

#include "sparsekv/core/numeric.hpp"

#ifndef SPARSEKV_CORE_Q8_ROW_TAG_
#define SPARSEKV_CORE_Q8_ROW_TAG_
namespace sparsekv {
// The element type of a row of q8_0 blocks (core/dtype.hpp) for the kernels' templates.
struct Q8Row {};
}  // namespace sparsekv
#endif

HWY_BEFORE_NAMESPACE();
namespace sparsekv {
namespace HWY_NAMESPACE {

template <class T, class D>
HWY_INLINE hwy::HWY_NAMESPACE::Vec<D> LoadWidened(D d, const T* HWY_RESTRICT p) {
  namespace hn = hwy::HWY_NAMESPACE;
  if constexpr (std::is_same_v<T, float>) {
    return hn::LoadU(d, p);
  } else {
    const hn::Rebind<T, D> narrow;
    return hn::PromoteTo(d, hn::LoadU(narrow, p));
  }
}

// A q8_0 block's scale d, as fp32.
HWY_INLINE float Q8Scale(const std::byte* block) {
  std::uint16_t bits;
  std::memcpy(&bits, block, 2);
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX2  // these targets imply F16C
  return _cvtsh_ss(bits);
#else
  return f16_to_float(bits);
#endif
}

// q of lanes i .. i + Lanes(d) of a q8_0 block, as fp32 (exact), unscaled.
template <class D>
HWY_INLINE hwy::HWY_NAMESPACE::Vec<D> LoadQ8Lanes(D d, const std::byte* HWY_RESTRICT block, std::size_t i) {
  namespace hn = hwy::HWY_NAMESPACE;
  const hn::Rebind<std::int32_t, D> di;
  const hn::Rebind<std::int8_t, D> d8;
  return hn::ConvertTo(d, hn::PromoteTo(di, hn::LoadU(d8, reinterpret_cast<const std::int8_t*>(block + 2 + i))));
}

// Whether rows of T are read with vectors of `lanes` (Q8Row: whole vectors within a block).
template <class T>
constexpr bool RowLanesFit(std::size_t lanes) {
  return !std::is_same_v<T, Q8Row> || (lanes <= kQ8BlockValues && kQ8BlockValues % lanes == 0);
}

}  // namespace HWY_NAMESPACE
}  // namespace sparsekv
HWY_AFTER_NAMESPACE();

#endif  // SPARSEKV_CORE_LOAD_WIDENED_INL_H_
