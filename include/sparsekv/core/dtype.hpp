#pragma once
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "sparsekv/core/host_device.hpp"

namespace sparsekv {

// Element type of K/V as the engine hands it over; pages keep it unchanged.
enum class DType : std::uint8_t { f32, f16, bf16 };

SPARSEKV_HOST_DEVICE constexpr std::size_t dtype_size(DType dtype) noexcept {
  return dtype == DType::f32 ? 4 : 2;
}

constexpr std::string_view to_string(DType dtype) noexcept {
  switch (dtype) {
    case DType::f32: return "f32";
    case DType::f16: return "f16";
    case DType::bf16: return "bf16";
  }
  return "unknown";
}

// Accepts f32/fp32/float32, f16/fp16/float16, bf16/bfloat16; throws invalid_argument otherwise.
DType parse_dtype(std::string_view name);

}  // namespace sparsekv
