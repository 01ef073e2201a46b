#pragma once
// Rows of the model's dtype as fp32, a vector at a time (Google Highway,
// dispatched at run time to the best target the CPU has): what a host
// prefill or decode step hands its policy. Equal to load_element
// (core/numeric.hpp) for every value; a NaN stays a NaN (its payload may
// come back quieted).
#include <cstddef>
#include <cstdint>

#include "sparsekv/core/dtype.hpp"

namespace sparsekv {

// out[i] = element i of the `n` values at `data`, stored in `dtype`.
// Returns whether every value is finite (checked in the same pass).
bool widen_to_float(const void* data, DType dtype, std::size_t n, float* out);

// The `n` values of x (n a multiple of kQ8BlockValues) as q8_0 blocks at
// `out`, by ggml's rule (quantize_row_q8_0_ref, bit for bit): per block,
// d = max|x| / 127 (stored as f16), q = round(x / d) half away from zero.
void quantize_row_q8_0(const float* x, std::size_t n, void* out);

// `rows` rows of `values` elements from dtype `from` into dtype `to`: a copy
// when they agree, q8_0 by quantize_row_q8_0, out of q8_0 by load_element
// rounded to `to` (the model's dtype). Sources and targets do not overlap.
void convert_rows(const void* from_rows, DType from, void* to_rows, DType to, std::size_t rows, std::uint32_t values);

}  // namespace sparsekv
