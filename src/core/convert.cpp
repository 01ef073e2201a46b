// widen_to_float (core/convert.hpp): compiled once per Highway target by
// foreach_target.h, dispatched at run time. f16 and bf16 widen exactly to
// fp32, so every target equals the scalar rule.
#include "sparsekv/core/convert.hpp"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

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
constexpr bool kNativeF16 =
    !(HWY_TARGET == HWY_SSSE3 || HWY_TARGET == HWY_SSE4 || HWY_TARGET == HWY_EMU128 || HWY_TARGET == HWY_SCALAR);

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
  if (dtype == DType::q8_0) {
    // A block at a time: its scale once, then q * d (vectorized by the
    // compiler); a value is finite when its block's scale is (|q| <= 127).
    const auto* block = static_cast<const unsigned char*>(data);
    bool finite = true;
    std::size_t i = 0;
    for (; i + kQ8BlockValues <= n; i += kQ8BlockValues, block += kQ8BlockBytes) {
      std::uint16_t bits;
      std::memcpy(&bits, block, 2);
      const float d = f16_to_float(bits);
      finite = finite && is_finite(d);
      for (std::uint32_t j = 0; j < kQ8BlockValues; ++j) {
        out[i + j] = static_cast<float>(static_cast<std::int8_t>(block[2 + j])) * d;
      }
    }
    for (; i < n; ++i) {
      out[i] = load_element(data, static_cast<std::uint32_t>(i), dtype);
      finite = finite && is_finite(out[i]);
    }
    return finite;
  }
  return HWY_DYNAMIC_DISPATCH(WidenToFloat)(data, dtype == DType::bf16, n, out);
}

void quantize_row_q8_0(const float* x, std::size_t n, void* out) {
  auto* block = static_cast<unsigned char*>(out);
  for (std::size_t b = 0; b < n / kQ8BlockValues; ++b, x += kQ8BlockValues, block += kQ8BlockBytes) {
    float amax = 0.0f;
    for (std::uint32_t j = 0; j < kQ8BlockValues; ++j) {
      const float v = std::fabs(x[j]);
      amax = amax > v ? amax : v;  // ggml's MAX: a NaN value makes the block's scale NaN
    }
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    const std::uint16_t d16 = float_to_f16(d);
    std::memcpy(block, &d16, 2);
    for (std::uint32_t j = 0; j < kQ8BlockValues; ++j) {
      block[2 + j] = static_cast<unsigned char>(static_cast<std::int8_t>(std::round(x[j] * id)));
    }
  }
}

void convert_rows(const void* from_rows, DType from, void* to_rows, DType to, std::size_t rows, std::uint32_t values) {
  const std::size_t from_bytes = dtype_row_bytes(from, values), to_bytes = dtype_row_bytes(to, values);
  if (from == to) {
    std::memcpy(to_rows, from_rows, rows * to_bytes);
    return;
  }
  const auto* in = static_cast<const std::byte*>(from_rows);
  auto* out = static_cast<std::byte*>(to_rows);
  thread_local std::vector<float> row;
  row.resize(values);
  for (std::size_t r = 0; r < rows; ++r, in += from_bytes, out += to_bytes) {
    if (to == DType::q8_0) {
      if (from == DType::f32) {
        quantize_row_q8_0(reinterpret_cast<const float*>(in), values, out);
      } else {
        widen_to_float(in, from, values, row.data());
        quantize_row_q8_0(row.data(), values, out);
      }
    } else {
      for (std::uint32_t i = 0; i < values; ++i) store_element(out, i, to, load_element(in, i, from));
    }
  }
}

}  // namespace sparsekv
#endif  // HWY_ONCE
