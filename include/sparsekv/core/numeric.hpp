#pragma once
// fp16 / bf16 <-> fp32 conversions shared by both backends (plain bit
// manipulation: no CUDA headers, so the host backend and CI use the same
// rounding the kernels do). Round to nearest even; NaN stays NaN.
#include <cstdint>
#include <cstring>

#include "sparsekv/core/dtype.hpp"
#include "sparsekv/core/host_device.hpp"

namespace sparsekv {

SPARSEKV_HOST_DEVICE inline std::uint32_t float_bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
SPARSEKV_HOST_DEVICE inline float bits_float(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

SPARSEKV_HOST_DEVICE inline float bf16_to_float(std::uint16_t h) { return bits_float(std::uint32_t{h} << 16); }

SPARSEKV_HOST_DEVICE inline std::uint16_t float_to_bf16(float f) {
  const std::uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x40u);  // quiet NaN
  return static_cast<std::uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

SPARSEKV_HOST_DEVICE inline float f16_to_float(std::uint16_t h) {
  const std::uint32_t sign = std::uint32_t{h & 0x8000u} << 16;
  const std::uint32_t exponent = (h >> 10) & 0x1fu;
  std::uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0x1f) return bits_float(sign | 0x7f800000u | (mantissa << 13));  // inf / NaN
  if (exponent != 0) return bits_float(sign | ((exponent + 112) << 23) | (mantissa << 13));
  if (mantissa == 0) return bits_float(sign);
  // Subnormal: normalise.
  std::uint32_t e = 113;
  while ((mantissa & 0x400u) == 0) {
    mantissa <<= 1;
    --e;
  }
  return bits_float(sign | (e << 23) | ((mantissa & 0x3ffu) << 13));
}

SPARSEKV_HOST_DEVICE inline std::uint16_t float_to_f16(float f) {
  const std::uint32_t u = float_bits(f);
  const std::uint32_t sign = (u >> 16) & 0x8000u;
  const std::uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<std::uint16_t>(sign | 0x7e00u);   // NaN
  if (abs >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // overflow -> inf
  if (abs < 0x38800000u) {                                                    // subnormal or zero in fp16
    if (abs < 0x33000000u) return static_cast<std::uint16_t>(sign);
    const std::uint32_t shift = 126 - (abs >> 23);
    const std::uint32_t mantissa = (abs & 0x7fffffu) | 0x800000u;
    std::uint32_t half = mantissa >> shift;  // value / 2^-24, truncated
    const std::uint32_t rest = mantissa & ((1u << shift) - 1);
    const std::uint32_t halfway = 1u << (shift - 1);
    if (rest > halfway || (rest == halfway && (half & 1u))) ++half;
    return static_cast<std::uint16_t>(sign | half);
  }
  std::uint32_t v = abs - 0x38000000u;  // rebias exponent 127 -> 15
  v = (v + 0xfffu + ((v >> 13) & 1u)) >> 13;
  return static_cast<std::uint16_t>(sign | v);
}

// std::isfinite by the exponent bits, so that host and device agree without a
// CUDA math header (no exponent of all ones: neither an infinity nor a NaN).
SPARSEKV_HOST_DEVICE inline bool is_finite(float f) { return (float_bits(f) & 0x7f800000u) != 0x7f800000u; }

// Element `i` of a row stored in `dtype`, as fp32 (q8_0: q * d of its block,
// exact in fp32).
SPARSEKV_HOST_DEVICE inline float load_element(const void* row, std::uint32_t i, DType dtype) {
  if (dtype == DType::f32) return static_cast<const float*>(row)[i];
  if (dtype == DType::q8_0) {
    const auto* block = static_cast<const unsigned char*>(row) + std::size_t{i / kQ8BlockValues} * kQ8BlockBytes;
    std::uint16_t d;
    std::memcpy(&d, block, 2);
    return static_cast<float>(static_cast<std::int8_t>(block[2 + i % kQ8BlockValues])) * f16_to_float(d);
  }
  const std::uint16_t h = static_cast<const std::uint16_t*>(row)[i];
  return dtype == DType::bf16 ? bf16_to_float(h) : f16_to_float(h);
}

// One element of an f32, f16 or bf16 row (q8_0 rows are written a row at a
// time: core/convert.hpp).
SPARSEKV_HOST_DEVICE inline void store_element(void* row, std::uint32_t i, DType dtype, float value) {
  if (dtype == DType::f32) {
    static_cast<float*>(row)[i] = value;
  } else {
    static_cast<std::uint16_t*>(row)[i] = dtype == DType::bf16 ? float_to_bf16(value) : float_to_f16(value);
  }
}

}  // namespace sparsekv
