#pragma once
// Random retrievals, the device Plan step's input built from them, the host
// plan (detail::append_head_runs, as Manager::build_plan) and the comparison,
// shared by the host emulation of the plan kernels (test_plan_rules.cpp) and
// their GPU test (gpu/test_plan_cuda.cpp).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "sparsekv/facade/attend_plan_cuda.hpp"
#include "sparsekv/facade/manager.hpp"

namespace sparsekv::test {

// Rows r = b * kv_heads + h of a batch of `rows / kv_heads` capacity, the
// first `batch` of them retrieved; the rest have no selection and no tail.
struct PlanCase {
  std::uint32_t kv_heads = 0, page_tokens = 0, rows = 0, batch = 0;
  std::vector<Retrieval> retrievals;
  std::vector<std::uint32_t> selection_offsets{0}, partition_offsets{0}, partition_tokens, tail_tokens;
  std::vector<PageId> gpu_pages, tail_pages;
  std::uint32_t max_row_pages = 0, max_row_runs = 0;  // the largest row's
  AttendPlan host;

  cuda::DevicePlanInput input(const std::uint32_t* selections, const std::uint32_t* partitions, const PageId* pages,
                              const std::uint32_t* tokens, const PageId* tails, const std::uint32_t* tail_counts,
                              std::uint32_t max_pages, std::uint32_t max_entries) const {
    return {rows, selections, partitions, pages, tokens, tails, tail_counts, page_tokens, max_pages, max_entries};
  }
  cuda::DevicePlanInput host_input(std::uint32_t max_pages, std::uint32_t max_entries) const {
    return input(selection_offsets.data(), partition_offsets.data(), gpu_pages.data(), partition_tokens.data(),
                 tail_pages.data(), tail_tokens.data(), max_pages, max_entries);
  }
};

// A random retrieval per request: empty heads, partitions of 0 to 5 pages
// (usually ceil(tokens / page_tokens), sometimes more pages than tokens fill),
// long heads spanning several fill tiles, tails empty, partial or full.
inline Retrieval random_retrieval(std::uint32_t kv_heads, std::uint32_t page_tokens, std::mt19937& rng,
                                  PageId& next_page) {
  Retrieval r;
  r.head_offsets.push_back(0);
  for (std::uint32_t h = 0; h < kv_heads; ++h) {
    const std::uint32_t shape = rng() % 8;
    const std::uint32_t selections = shape == 0 ? 0 : shape == 1 ? 40 + rng() % 60 : rng() % 8;
    for (std::uint32_t s = 0; s < selections; ++s) {
      std::uint32_t pages = rng() % 6 == 0 ? 0 : 1 + rng() % 4;
      std::uint32_t tokens = pages == 0 ? 0 : (pages - 1) * page_tokens + 1 + rng() % page_tokens;
      if (rng() % 7 == 0) tokens = rng() % (tokens + 1);  // pages past the tokens: 0-token pages
      if (rng() % 5 == 0) tokens = pages * page_tokens;   // every page full
      r.partitions.push_back(static_cast<PartitionId>(r.partitions.size()));
      r.token_counts.push_back(tokens);
      for (std::uint32_t p = 0; p < pages; ++p) r.plan.gpu_pages.push_back(next_page++ * 13 % 999983);
      r.plan.partition_offsets.push_back(static_cast<std::uint32_t>(r.plan.gpu_pages.size()));
    }
    r.head_offsets.push_back(static_cast<std::uint32_t>(r.partitions.size()));
    const std::uint32_t tail = rng() % 4;
    r.tail_tokens.push_back(tail == 0 ? 0 : tail == 1 ? page_tokens : 1 + rng() % page_tokens);
    r.tail_pages.push_back(next_page++ * 13 % 999983);
  }
  return r;
}

// `kv_heads` and `capacity` (requests) random when 0.
inline PlanCase random_plan_case(std::mt19937& rng, std::uint32_t kv_heads = 0, std::uint32_t capacity = 0) {
  PlanCase c;
  const std::uint32_t page_token_choices[] = {1, 2, 3, 4, 16};
  c.page_tokens = page_token_choices[rng() % 5];
  c.kv_heads = kv_heads != 0 ? kv_heads : 1 + rng() % 8;
  capacity = capacity != 0 ? capacity : 1 + rng() % 6;
  c.batch = rng() % (capacity + 1);
  c.rows = capacity * c.kv_heads;
  PageId next_page = rng() % 1000;
  std::vector<PageId> pages;
  std::vector<std::uint32_t> tokens;
  for (std::uint32_t b = 0; b < c.batch; ++b) {
    c.retrievals.push_back(random_retrieval(c.kv_heads, c.page_tokens, rng, next_page));
    const Retrieval& r = c.retrievals.back();
    for (std::uint32_t h = 0; h < c.kv_heads; ++h) {
      const auto indices_before = static_cast<std::uint32_t>(c.host.indices.size());
      const auto runs = static_cast<std::uint32_t>(detail::append_head_runs(c.host, r, h, c.page_tokens, pages, tokens));
      c.host.head_entries.push_back(c.host.head_entries.back() + runs);
      c.max_row_pages = std::max(c.max_row_pages, static_cast<std::uint32_t>(c.host.indices.size()) - indices_before);
      c.max_row_runs = std::max(c.max_row_runs, runs);
      for (std::uint32_t i = r.head_offsets[h]; i < r.head_offsets[h + 1]; ++i) {
        for (std::uint32_t p = r.plan.partition_offsets[i]; p < r.plan.partition_offsets[i + 1]; ++p)
          c.gpu_pages.push_back(r.plan.gpu_pages[p]);
        c.partition_offsets.push_back(static_cast<std::uint32_t>(c.gpu_pages.size()));
        c.partition_tokens.push_back(r.token_counts[i]);
      }
      c.selection_offsets.push_back(static_cast<std::uint32_t>(c.partition_tokens.size()));
      c.tail_pages.push_back(r.tail_pages[h]);
      c.tail_tokens.push_back(r.tail_tokens[h]);
    }
  }
  for (std::uint32_t row = c.batch * c.kv_heads; row < c.rows; ++row) {
    c.selection_offsets.push_back(c.selection_offsets.back());
    c.tail_pages.push_back(kInvalidPage);
    c.tail_tokens.push_back(0);
  }
  return c;
}

// A device plan's arrays as downloaded (capacity-sized).
struct PlanArrays {
  std::vector<std::int64_t> indptr, indices, head_entries;
  std::vector<std::int32_t> last_page_len;
  std::uint32_t overflow_rows = 0;
};

// The device plan equals `host` (the first rows; the unused rows add no
// entries); past the written prefix the arrays still hold `sentinel`.
inline void require_same_plan(const PlanArrays& got, const AttendPlan& host, std::uint32_t rows,
                              std::int64_t sentinel) {
  REQUIRE(got.overflow_rows == 0);
  const std::size_t used_rows = host.head_entries.size() - 1;
  REQUIRE(got.head_entries.size() == std::size_t{rows} + 1);
  for (std::size_t r = 0; r <= rows; ++r)
    REQUIRE(got.head_entries[r] == host.head_entries[std::min(r, used_rows)]);
  const std::size_t entries = host.entries();
  const std::size_t indices = host.indices.size();
  REQUIRE(std::equal(host.indptr.begin(), host.indptr.end(), got.indptr.begin()));
  REQUIRE(std::equal(host.last_page_len.begin(), host.last_page_len.end(), got.last_page_len.begin()));
  REQUIRE(std::equal(host.indices.begin(), host.indices.end(), got.indices.begin()));
  REQUIRE(std::all_of(got.indptr.begin() + static_cast<std::ptrdiff_t>(entries + 1), got.indptr.end(),
                      [&](std::int64_t v) { return v == sentinel; }));
  REQUIRE(std::all_of(got.last_page_len.begin() + static_cast<std::ptrdiff_t>(entries), got.last_page_len.end(),
                      [&](std::int32_t v) { return v == static_cast<std::int32_t>(sentinel); }));
  REQUIRE(std::all_of(got.indices.begin() + static_cast<std::ptrdiff_t>(indices), got.indices.end(),
                      [&](std::int64_t v) { return v == sentinel; }));
}

}  // namespace sparsekv::test
