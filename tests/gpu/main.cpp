// GPU test runner: without a usable CUDA device every test is skipped, and the
// process says so and exits 77 (ctest SKIP_RETURN_CODE), never "passed".
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <cstdio>

#include "sparsekv/core/device.hpp"

int main(int argc, char** argv) {
  if (sparsekv::cuda_device_count() == 0) {
    std::puts("SKIPPED: no usable CUDA device; GPU tests did not run");
    return 77;
  }
  return Catch::Session().run(argc, argv);
}
