#pragma once
// Helpers shared by the tests: asserting a sparsekv::Error with a given code.
#include <catch2/catch.hpp>

#include "sparsekv/core/error.hpp"

#define REQUIRE_SPARSEKV_ERROR(expression, error_code)                        \
  do {                                                                        \
    bool sparsekv_thrown_ = false;                                            \
    try {                                                                     \
      (void)(expression);                                                     \
    } catch (const sparsekv::Error& sparsekv_error_) {                        \
      sparsekv_thrown_ = true;                                                \
      INFO(sparsekv_error_.what());                                           \
      REQUIRE(sparsekv_error_.code() == (error_code));                        \
    }                                                                         \
    REQUIRE(sparsekv_thrown_);                                                \
  } while (false)
