#pragma once
// Formatting helpers for raising sparsekv::Error (error_code.hpp) from host code.
#include <fmt/format.h>

#include <string_view>
#include <utility>

#include "sparsekv/core/error_code.hpp"

namespace sparsekv {

template <class... Args>
[[noreturn]] void fail(ErrorCode code, fmt::format_string<Args...> format, Args&&... args) {
  throw Error(code, fmt::format(format, std::forward<Args>(args)...));
}

// Bounds check used at every public entry point that takes an index.
template <class Index, class Bound>
void check_index(std::string_view what, Index index, Bound bound) {
  if (static_cast<unsigned long long>(index) >= static_cast<unsigned long long>(bound)) {
    fail(ErrorCode::out_of_range, "{} {} out of range [0, {})", what, index, bound);
  }
}

}  // namespace sparsekv
