#pragma once
// Rows of the model's dtype as fp32, a vector at a time (Google Highway,
// dispatched at run time to the best target the CPU has): what a host
// prefill or decode step hands its policy. Equal to load_element
// (core/numeric.hpp) for every value; a NaN stays a NaN (its payload may
// come back quieted).
#include <cstddef>

#include "sparsekv/core/dtype.hpp"

namespace sparsekv {

// out[i] = element i of the `n` values at `data`, stored in `dtype`.
// Returns whether every value is finite (checked in the same pass).
bool widen_to_float(const void* data, DType dtype, std::size_t n, float* out);

}  // namespace sparsekv
