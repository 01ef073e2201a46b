#pragma once
// Helpers shared by the tests: asserting a sparsekv::Error with a given code,
// comparing an fp32 page row with the values a test wrote, and a small Config.
#include <catch2/catch.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "sparsekv/core/config.hpp"
#include "sparsekv/core/error.hpp"
#include "sparsekv/core/model_shape.hpp"
#include "sparsekv/memory/page_layout.hpp"

namespace sparsekv::test {

// Whether row `slot` of an fp32 `page` holds K[d] = expected(d, false) and
// V[d] = expected(d, true) for every d < layout.head_dim.
template <class Expected>
bool fp32_row_matches(const std::byte* page, const PageLayout& layout, std::uint32_t slot, Expected&& expected) {
  for (std::uint32_t d = 0; d < layout.head_dim; ++d) {
    float k, v;
    std::memcpy(&k, page + layout.k_offset(slot) + d * sizeof(float), sizeof(float));
    std::memcpy(&v, page + layout.v_offset(slot) + d * sizeof(float), sizeof(float));
    if (k != expected(d, false) || v != expected(d, true)) return false;
  }
  return true;
}

// A Config for facade tests at a tiny shape: `page_tokens`-token pages, small
// metadata segments, a buffer ratio of 1 and both tiers `tier_pages` pages.
inline Config small_config(const ModelShape& shape, std::uint32_t page_tokens, std::uint32_t max_requests,
                           std::uint32_t max_context_tokens, std::size_t tier_pages) {
  Config c;
  c.page_tokens = page_tokens;
  c.max_requests = max_requests;
  c.max_context_tokens = max_context_tokens;
  c.min_buffer_ratio = 1.0;
  c.metadata_segment_entries = 32;
  const std::size_t page = c.page_bytes(shape);
  c.host_chunk_bytes = 16 * page;
  c.cpu_tier_bytes = tier_pages * page;
  c.gpu_tier_bytes = tier_pages * page;
  return c;
}

}  // namespace sparsekv::test

#define REQUIRE_SPARSEKV_ERROR(expression, error_code) \
  do {                                                 \
    bool sparsekv_thrown_ = false;                     \
    try {                                              \
      (void)(expression);                              \
    } catch (const sparsekv::Error& sparsekv_error_) { \
      sparsekv_thrown_ = true;                         \
      INFO(sparsekv_error_.what());                    \
      REQUIRE(sparsekv_error_.code() == (error_code)); \
    }                                                  \
    REQUIRE(sparsekv_thrown_);                         \
  } while (false)
