#pragma once
// One side of Quest's key boxes (Tang et al. 2024, §3.2: per page the
// channel-wise min and max of its keys) for one kv head: a row of head_dim
// values per partition, stored in the K/V's own dtype. The min or max of
// f16 or bf16 keys is one of those keys, so a box of such keys loses nothing
// in their dtype and Select reads half the bytes that fp32 rows take
// (docs/performance.md, "Quest's boxes in the K/V dtype"). A value that the
// dtype cannot hold (keys that were not rounded to it) is rounded outward,
// the lower side down and the upper side up, so that the box still holds
// every key and the bound stays a bound.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "sparsekv/core/dtype.hpp"
#include "sparsekv/core/error.hpp"
#include "sparsekv/core/numeric.hpp"

namespace sparsekv {

// Which side of a box a row is: where a value the dtype cannot hold goes.
enum class BoxSide : std::uint8_t { lower, upper };

// x in `dtype`'s bits (16-bit dtypes), the nearest value on `side`'s side
// of x: x itself when the dtype holds it, NaN as NaN.
inline std::uint16_t round_outward(float x, DType dtype, BoxSide side) {
  const std::uint32_t bits = float_bits(x);
  if (dtype == DType::bf16 && (bits & 0xffffu) == 0)
    return static_cast<std::uint16_t>(bits >> 16);  // held: the usual case
  const std::uint16_t h = dtype == DType::bf16 ? float_to_bf16(x) : float_to_f16(x);
  const float back = dtype == DType::bf16 ? bf16_to_float(h) : f16_to_float(h);
  if (back == x || x != x) return h;
  // Both 16-bit formats are sign-magnitude: one step of the bits toward -inf
  // (lower) or +inf (upper); from a zero of either sign the step leaves zero.
  const bool negative = (h & 0x8000u) != 0;
  const bool magnitude_zero = (h & 0x7fffu) == 0;
  if (side == BoxSide::lower) {
    if (!(back > x)) return h;
    if (magnitude_zero) return 0x8001u;
    return static_cast<std::uint16_t>(negative ? h + 1 : h - 1);
  }
  if (!(back < x)) return h;
  if (magnitude_zero) return 0x0001u;
  return static_cast<std::uint16_t>(negative ? h - 1 : h + 1);
}

class BoxRows {
 public:
  BoxRows() = default;
  BoxRows(DType dtype, std::uint32_t dim) : dtype_(dtype), dim_(dim) {}
  // Rows of fp32 `values` (a whole number of rows of dim), each rounded to `side`.
  BoxRows(DType dtype, std::uint32_t dim, const std::vector<float>& values, BoxSide side) : BoxRows(dtype, dim) {
    if (dim == 0 || values.size() % dim != 0) {
      fail(ErrorCode::invalid_argument, "quest: {} box values are not rows of {}", values.size(), dim);
    }
    reserve(static_cast<std::uint32_t>(values.size() / dim));
    for (std::size_t at = 0; at < values.size(); at += dim) push_back(values.data() + at, side);
  }

  DType dtype() const noexcept { return dtype_; }
  std::uint32_t dim() const noexcept { return dim_; }
  std::uint32_t rows() const noexcept {
    return dim_ == 0 ? 0 : static_cast<std::uint32_t>(bytes_.size() / row_bytes());
  }
  std::size_t row_bytes() const noexcept { return std::size_t{dim_} * dtype_size(dtype_); }
  std::size_t bytes() const noexcept { return bytes_.size(); }
  const std::byte* data() const noexcept { return bytes_.data(); }
  const std::byte* row(std::uint32_t i) const noexcept { return bytes_.data() + i * row_bytes(); }

  void reserve(std::uint32_t rows) { bytes_.reserve(rows * row_bytes()); }
  // Appends `values` (dim of them) as row rows(), each rounded to `side`.
  void push_back(const float* values, BoxSide side) {
    bytes_.resize(bytes_.size() + row_bytes());
    set(rows() - 1, values, side);
  }
  // Row i becomes `values`, each rounded to `side`.
  void set(std::uint32_t i, const float* values, BoxSide side) {
    std::byte* at = bytes_.data() + i * row_bytes();
    if (dtype_ == DType::f32) {
      std::memcpy(at, values, row_bytes());
      return;
    }
    auto* out = reinterpret_cast<std::uint16_t*>(at);
    for (std::uint32_t d = 0; d < dim_; ++d) out[d] = round_outward(values[d], dtype_, side);
  }
  // This becomes the first `rows` rows of `from` (the same dtype and dim).
  void assign_prefix(const BoxRows& from, std::uint32_t rows) {
    if (from.dtype_ != dtype_ || from.dim_ != dim_ || rows > from.rows()) {
      fail(ErrorCode::invalid_argument, "quest: boxes of {} x {} ({}) taken from {} rows of {} ({})", rows, dim_,
           to_string(dtype_), from.rows(), from.dim_, to_string(from.dtype_));
    }
    bytes_.assign(from.bytes_.begin(), from.bytes_.begin() + static_cast<std::ptrdiff_t>(rows * row_bytes()));
  }
  // Same dtype, dim and bits.
  friend bool operator==(const BoxRows&, const BoxRows&) = default;

  float at(std::uint32_t i, std::uint32_t d) const { return load_element(row(i), d, dtype_); }
  // Every row in fp32, row after row.
  std::vector<float> widened() const {
    std::vector<float> out(std::size_t{rows()} * dim_);
    for (std::uint32_t i = 0; i < rows(); ++i)
      for (std::uint32_t d = 0; d < dim_; ++d) out[std::size_t{i} * dim_ + d] = at(i, d);
    return out;
  }

 private:
  DType dtype_ = DType::f32;
  std::uint32_t dim_ = 0;
  std::vector<std::byte> bytes_;
};

}  // namespace sparsekv
