// LoadWidened: a vector of fp32 lanes from a row of fp32, f16 or bf16
// values (16-bit values widened exactly), for the Highway kernels of every
// layer. A per-target header: included after hwy/highway.h by a source that
// foreach_target.h compiles once per target; the guard follows
// HWY_TARGET_TOGGLE so that each target's pass gets its own copy.
#if defined(SPARSEKV_CORE_LOAD_WIDENED_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef SPARSEKV_CORE_LOAD_WIDENED_INL_H_
#undef SPARSEKV_CORE_LOAD_WIDENED_INL_H_
#else
#define SPARSEKV_CORE_LOAD_WIDENED_INL_H_
#endif

#include <type_traits>

#include <hwy/highway.h>

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

}  // namespace HWY_NAMESPACE
}  // namespace sparsekv
HWY_AFTER_NAMESPACE();

#endif  // SPARSEKV_CORE_LOAD_WIDENED_INL_H_
