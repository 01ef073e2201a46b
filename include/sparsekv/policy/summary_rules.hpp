#pragma once
// Per-element rules of the Index stage (Spin §4.1) that the host policies and
// the CUDA kernels (cuda/index_kernels.cu) both call, so both backends produce
// the same bits and CI tests the code the kernels run:
//  - Quest (Tang et al. 2024): a page's channel-wise min / max of its keys;
//  - ShadowKV (Sun et al. 2024; Spin §4.2): a page's mean key (landmark) and
//    the lowest cosine between one of its keys and the landmark;
//  - RetroInfer (Chen et al. 2025, §4.2): a decode page's mean key and value
//    sum, and the assignment and update steps of spherical k-means (a row
//    goes to its most similar centroid; a centroid becomes its members'
//    renormalised sum).
//
// Bit-identical results need the same roundings in the same order on both
// sides. Every sum runs in a fixed order (tokens / rows in order, dimensions
// in order, starting from +0) and every step is rounded on its own: on the
// device through the _rn intrinsics, which nvcc never fuses into an FMA; on
// the host as plain operations, which the host build keeps separate (no
// -ffp-contract=fast on an FMA target: x86-64 without -march, C++ without
// GNU extensions). Division and square root are IEEE round-to-nearest on both.
//
// fmt-free and free of CUDA headers: kernel translation units include it.
#include <cmath>
#include <cstdint>
#include <limits>

#include "sparsekv/core/dtype.hpp"
#include "sparsekv/core/host_device.hpp"
#include "sparsekv/core/numeric.hpp"

namespace sparsekv {

// ---- single roundings ------------------------------------------------------

// A GPU's float arithmetic returns one NaN pattern (0x7fffffff) whatever NaN
// went in; x86 keeps an input's payload. Summaries that add up elements (a
// page of raw bytes can hold any NaN) end in this, so that they have the same
// bits on host and device (found on an H100: ShadowKV's and RetroInfer's
// append summaries differed in NaN payloads alone).
inline constexpr std::uint32_t kCanonicalNaNBits = 0x7fffffffu;
SPARSEKV_HOST_DEVICE inline float canonical_nan(float x) { return x != x ? bits_float(kCanonicalNaNBits) : x; }

SPARSEKV_HOST_DEVICE inline float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
SPARSEKV_HOST_DEVICE inline float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
SPARSEKV_HOST_DEVICE inline float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
SPARSEKV_HOST_DEVICE inline float sqrt_rn(float a) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(a);
#else
  return std::sqrt(a);
#endif
}

// ---- Quest: channel-wise min / max -----------------------------------------
// A page's bounds start as its first key and fold the following keys in token
// order with the std::min / std::max comparisons: a NaN in a later key is
// ignored (it never compares smaller or larger), a NaN in the first key stays;
// between -0 and +0 the earlier value stays.

SPARSEKV_HOST_DEVICE inline float fold_min(float current, float x) { return x < current ? x : current; }
SPARSEKV_HOST_DEVICE inline float fold_max(float current, float x) { return current < x ? x : current; }

SPARSEKV_HOST_DEVICE inline void fold_min_max(float* lo, float* hi, const float* key, std::uint32_t dim) {
  for (std::uint32_t d = 0; d < dim; ++d) {
    lo[d] = fold_min(lo[d], key[d]);
    hi[d] = fold_max(hi[d], key[d]);
  }
}

// ---- ShadowKV: mean key and its worst cosine --------------------------------

// One step of a dot product accumulated in dimension order.
SPARSEKV_HOST_DEVICE inline float dot_step(float acc, float a, float b) { return add_rn(acc, mul_rn(a, b)); }

SPARSEKV_HOST_DEVICE inline float dot_in_order(const float* a, const float* b, std::uint32_t dim) {
  float acc = 0.0f;
  for (std::uint32_t d = 0; d < dim; ++d) acc = dot_step(acc, a[d], b[d]);
  return acc;
}

// The landmark element: the page's keys summed in token order from +0 (with
// add_rn), divided by the token count.
SPARSEKV_HOST_DEVICE inline float page_mean(float sum, std::uint32_t count) {
  return canonical_nan(div_rn(sum, static_cast<float>(count)));
}

// cos(key, landmark) from key.key, key.landmark and |landmark|. A zero key or
// landmark has no direction to agree with: it counts as orthogonal (0). NaN
// inputs give NaN (or 0 when the norm product is NaN).
SPARSEKV_HOST_DEVICE inline float landmark_cosine(float key_dot_key, float key_dot_landmark, float landmark_norm) {
  const float norm = mul_rn(sqrt_rn(key_dot_key), landmark_norm);
  return norm > 0.0f ? div_rn(key_dot_landmark, norm) : 0.0f;
}

// A page's outlier score starts at 1 and folds each key's cosine in token
// order with fold_min (a NaN cosine is ignored).
inline constexpr float kOutlierScoreStart = 1.0f;

// ---- per-thread steps of the page-summary kernels ---------------------------
// One thread's share of a page's summaries, called by the kernels
// (cuda/policy/index_kernels.cu, cuda/step/append_summaries_kernels.cu) and
// by the tests' host emulations of their decompositions, so CI runs the code
// the kernels run. `key(t)` is the address of the page's t-th key row, stored
// in `dtype`; count >= 1.

// Quest: channel d's bounds over the page (thread over dimensions).
template <class KeyRow>
SPARSEKV_HOST_DEVICE inline void page_min_max_channel(const KeyRow& key, std::uint32_t count, std::uint32_t d,
                                                      DType dtype, float& lo, float& hi) {
  lo = load_element(key(0), d, dtype);
  hi = lo;
  for (std::uint32_t t = 1; t < count; ++t) {
    const float x = load_element(key(t), d, dtype);
    lo = fold_min(lo, x);
    hi = fold_max(hi, x);
  }
}

// ShadowKV: channel d of the landmark (thread over dimensions).
template <class KeyRow>
SPARSEKV_HOST_DEVICE inline float page_mean_channel(const KeyRow& key, std::uint32_t count, std::uint32_t d,
                                                    DType dtype) {
  float sum = 0.0f;
  for (std::uint32_t t = 0; t < count; ++t) sum = add_rn(sum, load_element(key(t), d, dtype));
  return page_mean(sum, count);
}

// ShadowKV: cos(key t, landmark) (thread over tokens); |landmark| is
// sqrt_rn(dot_in_order(landmark, landmark, dim)), taken once per page.
template <class KeyRow>
SPARSEKV_HOST_DEVICE inline float page_key_cosine(const KeyRow& key, std::uint32_t t, const float* landmark,
                                                  float landmark_norm, std::uint32_t dim, DType dtype) {
  float kk = 0.0f;
  float km = 0.0f;
  for (std::uint32_t d = 0; d < dim; ++d) {
    const float x = load_element(key(t), d, dtype);
    kk = dot_step(kk, x, x);
    km = dot_step(km, x, landmark[d]);
  }
  return landmark_cosine(kk, km, landmark_norm);
}

// RetroInfer: channel d of a decode page's summary (thread over dimensions),
// as RetroInferPolicy::append records it: the mean key (the keys summed in
// token order from +0, times float(1 / count)) and the summed values.
// `value(t)` is the address of the page's t-th value row.
template <class KeyRow, class ValueRow>
SPARSEKV_HOST_DEVICE inline void page_key_mean_value_sum_channel(const KeyRow& key, const ValueRow& value,
                                                                 std::uint32_t count, std::uint32_t d, DType dtype,
                                                                 float& mean, float& value_sum) {
  float keys = 0.0f;
  float values = 0.0f;
  for (std::uint32_t t = 0; t < count; ++t) {
    keys = add_rn(keys, load_element(key(t), d, dtype));
    values = add_rn(values, load_element(value(t), d, dtype));
  }
  mean = canonical_nan(mul_rn(keys, div_rn(1.0f, static_cast<float>(count))));
  value_sum = canonical_nan(values);
}

// ---- RetroInfer: spherical k-means -----------------------------------------
// Rows and centroids are fp32 [count][dim]; similarity = dot_in_order(row,
// centroid). Assignment: the largest similarity wins, ties go to the lowest
// centroid index; NaN similarities never win (nor does -inf); a row with no
// winner (all NaN / -inf) goes to centroid 0.

inline constexpr std::uint32_t kNoCentroid = std::numeric_limits<std::uint32_t>::max();

struct CentroidChoice {
  float similarity = -std::numeric_limits<float>::infinity();
  std::uint32_t index = kNoCentroid;
};

// Sequential form: call with centroids in increasing index.
SPARSEKV_HOST_DEVICE inline void consider_centroid(CentroidChoice& best, float similarity, std::uint32_t index) {
  if (similarity > best.similarity) {
    best.similarity = similarity;
    best.index = index;
  }
}

// Parallel form: the choice over the union of two disjoint centroid sets, each
// chosen by the rule; equals the sequential scan over the union in any order
// of merging.
SPARSEKV_HOST_DEVICE inline CentroidChoice merge_choices(CentroidChoice a, CentroidChoice b) {
  if (a.index == kNoCentroid) return b;
  if (b.index == kNoCentroid) return a;
  if (a.similarity > b.similarity) return a;
  if (b.similarity > a.similarity) return b;
  return a.index < b.index ? a : b;
}

SPARSEKV_HOST_DEVICE inline std::uint32_t chosen_label(CentroidChoice best) {
  return best.index == kNoCentroid ? 0u : best.index;
}

// Update: per cluster and dimension, the members' elements summed in row
// order from +0 with add_rn; then |sum|^2 in double (exact float products,
// summed in dimension order) and the centroid = sum * float(1 / sqrt(|sum|^2)).
// An empty cluster, or one whose members sum to zero, keeps its centroid
// (centroid_inverse_norm returns false); a NaN sum makes the centroid NaN.

SPARSEKV_HOST_DEVICE inline double norm_sq_step(double acc, float s) {
#if defined(__CUDA_ARCH__)
  return __dadd_rn(acc, __dmul_rn(static_cast<double>(s), static_cast<double>(s)));
#else
  return acc + static_cast<double>(s) * static_cast<double>(s);
#endif
}

SPARSEKV_HOST_DEVICE inline bool centroid_inverse_norm(double norm_sq, std::uint32_t members, float& inverse) {
  if (members == 0 || norm_sq <= 0.0) return false;
#if defined(__CUDA_ARCH__)
  inverse = __double2float_rn(__ddiv_rn(1.0, __dsqrt_rn(norm_sq)));
#else
  inverse = static_cast<float>(1.0 / std::sqrt(norm_sq));
#endif
  return true;
}

}  // namespace sparsekv
