#pragma once
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "sparsekv/core/host_device.hpp"

namespace sparsekv {

// Element type of K/V. f32, f16 and bf16 are what an engine hands over (the
// model's dtype); q8_0 is a storage type of the CPU tier only (Config::
// kv_storage): ggml's block layout, each run of 32 values stored as one f16
// scale d and 32 int8 q, value = q * d.
enum class DType : std::uint8_t { f32, f16, bf16, q8_0 };

inline constexpr std::uint32_t kQ8BlockValues = 32;
inline constexpr std::size_t kQ8BlockBytes = 2 + kQ8BlockValues;

// Bytes of one element of f32, f16 or bf16 (a model dtype); q8_0 has no
// per-element size: its rows are measured by dtype_row_bytes.
SPARSEKV_HOST_DEVICE constexpr std::size_t dtype_size(DType dtype) noexcept { return dtype == DType::f32 ? 4 : 2; }

// Bytes of a row of `values` elements (for q8_0 a multiple of kQ8BlockValues).
SPARSEKV_HOST_DEVICE constexpr std::size_t dtype_row_bytes(DType dtype, std::size_t values) noexcept {
  return dtype == DType::q8_0 ? values / kQ8BlockValues * kQ8BlockBytes : values * dtype_size(dtype);
}

constexpr std::string_view to_string(DType dtype) noexcept {
  switch (dtype) {
    case DType::f32:
      return "f32";
    case DType::f16:
      return "f16";
    case DType::bf16:
      return "bf16";
    case DType::q8_0:
      return "q8_0";
  }
  return "unknown";
}

// Accepts f32/fp32/float32, f16/fp16/float16, bf16/bfloat16 and q8_0; throws invalid_argument otherwise.
DType parse_dtype(std::string_view name);

}  // namespace sparsekv
