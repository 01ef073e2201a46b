#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "sparsekv/attention/page_fold.hpp"
#include "sparsekv/core/config.hpp"
#include "sparsekv/core/convert.hpp"
#include "sparsekv/core/device.hpp"
#include "sparsekv/core/dtype.hpp"
#include "sparsekv/core/error_slot.hpp"
#include "sparsekv/core/numeric.hpp"
#include "test_support.hpp"

using namespace sparsekv;

namespace {
ModelShape small_shape() { return {2, 4, 2, 64, DType::bf16}; }
}  // namespace

TEST_CASE("ModelShape validates each field", "[core]") {
  REQUIRE_NOTHROW(small_shape().validate());
  REQUIRE(small_shape().group_size() == 2);
  REQUIRE(small_shape().head_token_bytes() == 2 * 64 * 2);
  REQUIRE(small_shape().token_bytes() == 2 * 64 * 2 * 2 * 2);
  auto bad = small_shape();
  bad.layers = 0;
  REQUIRE_SPARSEKV_ERROR(bad.validate(), ErrorCode::invalid_argument);
  bad = small_shape();
  bad.q_heads = 5;  // not a multiple of kv_heads
  REQUIRE_SPARSEKV_ERROR(bad.validate(), ErrorCode::invalid_argument);
  bad = small_shape();
  bad.head_dim = 12;
  REQUIRE_SPARSEKV_ERROR(bad.validate(), ErrorCode::invalid_argument);
  bad = small_shape();
  bad.kv_heads = 0;
  REQUIRE_SPARSEKV_ERROR(bad.validate(), ErrorCode::invalid_argument);
}

TEST_CASE("Config defaults follow the papers and validate", "[core]") {
  const Config config;
  REQUIRE(config.page_tokens == 8);
  REQUIRE(config.timestamp_buckets == 64);
  REQUIRE(config.min_buffer_ratio == 5.0);
  REQUIRE(config.working_set_window == 12);
  REQUIRE_NOTHROW(config.validate(small_shape()));
  REQUIRE(config.page_bytes(small_shape()) == 8 * 2 * 64 * 2);
  REQUIRE(config.max_pages_per_head() == 128 * 1024 / 8);
}

TEST_CASE("Config rejects each bad field with a message naming it", "[core]") {
  const auto rejects = [](auto mutate, const char* field) {
    Config config;
    mutate(config);
    try {
      config.validate(small_shape());
      FAIL("no error for " << field);
    } catch (const Error& e) {
      REQUIRE(e.code() == ErrorCode::invalid_argument);
      REQUIRE(std::string(e.what()).find(field) != std::string::npos);
    }
  };
  rejects([](Config& c) { c.page_tokens = 0; }, "page_tokens");
  rejects([](Config& c) { c.page_tokens = 12; }, "page_tokens");
  rejects([](Config& c) { c.page_tokens = 2048; }, "page_tokens");
  rejects([](Config& c) { c.max_requests = 0; }, "max_requests");
  rejects([](Config& c) { c.max_context_tokens = 0; }, "max_context_tokens");
  rejects([](Config& c) { c.max_context_tokens = 0xffffffffu; }, "max_context_tokens");
  rejects([](Config& c) { c.cpu_tier_bytes = std::size_t{1} << 50; }, "tier");
  rejects([](Config& c) { c.timestamp_buckets = 1; }, "timestamp_buckets");
  rejects([](Config& c) { c.timestamp_buckets = 257; }, "timestamp_buckets");
  rejects([](Config& c) { c.min_buffer_ratio = -1.0; }, "min_buffer_ratio");
  rejects([](Config& c) { c.working_set_window = 0; }, "working_set_window");
  rejects([](Config& c) { c.metadata_segment_entries = 100; }, "metadata_segment_entries");
  rejects([](Config& c) { c.cpu_tier_bytes = 10; }, "cpu_tier_bytes");
  rejects([](Config& c) { c.gpu_tier_bytes = 10; }, "gpu_tier_bytes");
  rejects([](Config& c) { c.host_chunk_bytes = 10; }, "host_chunk_bytes");
}

TEST_CASE("dtype names parse and unknown names are rejected", "[core]") {
  REQUIRE(parse_dtype("bf16") == DType::bf16);
  REQUIRE(parse_dtype("fp16") == DType::f16);
  REQUIRE(parse_dtype("float32") == DType::f32);
  REQUIRE(dtype_size(DType::f32) == 4);
  REQUIRE(dtype_size(DType::bf16) == 2);
  REQUIRE_SPARSEKV_ERROR(parse_dtype("int8"), ErrorCode::invalid_argument);
}

TEST_CASE("Error carries its code and a prefixed message", "[core]") {
  const Error e(ErrorCode::not_found, "unknown request 7");
  REQUIRE(e.code() == ErrorCode::not_found);
  REQUIRE(std::string(e.what()) == "sparsekv not_found: unknown request 7");
}

TEST_CASE("device query never fails, with or without a driver", "[core]") {
  const int devices = cuda_device_count();
  REQUIRE(devices >= 0);
  if (!built_with_cuda()) REQUIRE(devices == 0);
}

TEST_CASE("widen_to_float equals the scalar rule for every f16 and bf16 value, on every target", "[core][convert]") {
  // Every 16-bit pattern, then a few more so that the tail past the last whole vector is exercised.
  std::vector<std::uint16_t> all(65536 + 5);
  for (std::size_t i = 0; i < all.size(); ++i) all[i] = static_cast<std::uint16_t>(i);
  std::vector<float> got(all.size() + 1);  // one past: nothing may be written there
  std::uint32_t ran = 0;
  for (const sparsekv::FoldTarget& target : sparsekv::fold_page_targets()) {
    if (!target.supported) continue;
    sparsekv::use_fold_page_target(target.bits);
    ++ran;
    for (const sparsekv::DType dtype : {sparsekv::DType::f16, sparsekv::DType::bf16}) {
      for (const std::size_t n : {all.size(), std::size_t{1}, std::size_t{7}, std::size_t{17}}) {
        CAPTURE(target.name, sparsekv::to_string(dtype), n);
        std::fill(got.begin(), got.end(), -1.0f);
        sparsekv::widen_to_float(all.data(), dtype, n, got.data());
        for (std::size_t i = 0; i < n; ++i) {
          const float want = sparsekv::load_element(all.data(), static_cast<std::uint32_t>(i), dtype);
          if (std::isnan(want)) {
            REQUIRE(std::isnan(got[i]));
          } else {
            REQUIRE(sparsekv::float_bits(got[i]) == sparsekv::float_bits(want));
          }
        }
        REQUIRE(got[n] == -1.0f);  // nothing written past n
      }
    }
  }
  sparsekv::use_fold_page_target(0);
  REQUIRE(ran > 0);
  const std::vector<float> f32{1.5f, -0.0f, 3e-40f};
  std::vector<float> copy(3);
  CHECK(sparsekv::widen_to_float(f32.data(), sparsekv::DType::f32, 3, copy.data()));
  REQUIRE(std::memcmp(copy.data(), f32.data(), sizeof(float) * 3) == 0);
}

TEST_CASE("widen_to_float tells whether every value is finite, wherever the first that is not lies, on every target",
          "[core][convert]") {
  // Runs of finite values with one infinity or NaN at each place: in a whole
  // vector of any target or in the tail past the last one.
  const std::uint16_t bad_f16[] = {0x7c00, 0xfc00, 0x7e00, 0x7c01};  // +inf, -inf, NaNs
  const std::uint16_t bad_bf16[] = {0x7f80, 0xff80, 0x7fc0, 0xffc1};
  const float bad_f32[] = {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                           std::numeric_limits<float>::quiet_NaN()};
  std::uint32_t ran = 0, checked = 0;
  for (const sparsekv::FoldTarget& target : sparsekv::fold_page_targets()) {
    if (!target.supported) continue;
    sparsekv::use_fold_page_target(target.bits);
    ++ran;
    for (const std::size_t n : {std::size_t{1}, std::size_t{15}, std::size_t{16}, std::size_t{37}}) {
      std::vector<float> out(n);
      for (const sparsekv::DType dtype : {sparsekv::DType::f16, sparsekv::DType::bf16}) {
        // 0x3c00 is 1.0 in f16; 0x3f80 in bf16.
        std::vector<std::uint16_t> rows(n, dtype == sparsekv::DType::f16 ? 0x3c00 : 0x3f80);
        CAPTURE(target.name, sparsekv::to_string(dtype), n);
        REQUIRE(sparsekv::widen_to_float(rows.data(), dtype, n, out.data()));
        for (std::size_t at = 0; at < n; ++at) {
          for (const std::uint16_t bad : dtype == sparsekv::DType::f16 ? std::span(bad_f16) : std::span(bad_bf16)) {
            const std::uint16_t kept = rows[at];
            rows[at] = bad;
            CAPTURE(at, bad);
            REQUIRE_FALSE(sparsekv::widen_to_float(rows.data(), dtype, n, out.data()));
            rows[at] = kept;
            ++checked;
          }
        }
      }
    }
  }
  sparsekv::use_fold_page_target(0);
  REQUIRE(ran > 0);
  for (const std::size_t n : {std::size_t{1}, std::size_t{37}}) {
    std::vector<float> rows(n, 2.0f), out(n);
    REQUIRE(sparsekv::widen_to_float(rows.data(), sparsekv::DType::f32, n, out.data()));
    for (std::size_t at = 0; at < n; ++at) {
      for (const float bad : bad_f32) {
        rows[at] = bad;
        REQUIRE_FALSE(sparsekv::widen_to_float(rows.data(), sparsekv::DType::f32, n, out.data()));
        rows[at] = 2.0f;
        ++checked;
      }
    }
  }
  CHECK(checked == ran * 2 * 4 * (1 + 15 + 16 + 37) + 3 * (1 + 37));
}

TEST_CASE("ErrorSlot keeps the first error any thread captures, with its code", "[core][error-slot]") {
  ErrorSlot slot;
  REQUIRE_FALSE(slot.failed());
  REQUIRE_FALSE(slot.error().has_value());
  std::vector<std::thread> threads;
  std::atomic<int> first{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&slot, &first, t] {
      try {
        fail(ErrorCode::out_of_range, "thread {}", t);
      } catch (...) {
        if (slot.capture()) ++first;
      }
    });
  }
  for (std::thread& t : threads) t.join();
  REQUIRE(first == 1);
  REQUIRE(slot.failed());
  REQUIRE(slot.error()->code == ErrorCode::out_of_range);
  REQUIRE(slot.error()->message.starts_with("sparsekv out_of_range: thread "));
  slot.clear();
  REQUIRE_FALSE(slot.failed());
  try {
    throw std::bad_alloc();
  } catch (...) {
    REQUIRE(slot.capture());
  }
  REQUIRE(slot.error()->code == ErrorCode::resource_exhausted);
  slot.clear();
  try {
    throw std::logic_error("outside");
  } catch (...) {
    REQUIRE(slot.capture());
  }
  REQUIRE(slot.error()->code == ErrorCode::internal);
  REQUIRE(slot.error()->message == "outside");
  REQUIRE_FALSE(slot.set(ErrorCode::invalid_argument, "second"));
  REQUIRE(to_string(ErrorCode::internal) == "internal");
}
