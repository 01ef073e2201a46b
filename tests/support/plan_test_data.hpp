#pragma once
// Random retrievals, the device Plan step's input built from them, the host
// plan (append_head_runs, as HostStep::build_plan), the comparison and
// the host emulations of the plan and miss-list gather kernels, shared by
// their rules (test_plan_rules.cpp), their GPU test (gpu/test_plan_cuda.cpp)
// and the emulated device runtime (device_runtime_emulation.hpp).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "sparsekv/attention/attend_plan_cuda.hpp"
#include "sparsekv/facade/manager.hpp"
#include "sparsekv/transfer/miss_list.hpp"

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
      for (std::uint32_t p = 0; p < pages; ++p) r.pages.gpu_pages.push_back(next_page++ * 13 % 999983);
      r.pages.partition_offsets.push_back(static_cast<std::uint32_t>(r.pages.gpu_pages.size()));
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
      const auto runs = static_cast<std::uint32_t>(append_head_runs(c.host, r, h, c.page_tokens, pages, tokens));
      c.host.head_entries.push_back(c.host.head_entries.back() + runs);
      c.max_row_pages = std::max(c.max_row_pages, static_cast<std::uint32_t>(c.host.indices.size()) - indices_before);
      c.max_row_runs = std::max(c.max_row_runs, runs);
      for (std::uint32_t i = r.head_offsets[h]; i < r.head_offsets[h + 1]; ++i) {
        for (std::uint32_t p = r.pages.partition_offsets[i]; p < r.pages.partition_offsets[i + 1]; ++p)
          c.gpu_pages.push_back(r.pages.gpu_pages[p]);
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
  for (std::size_t r = 0; r <= rows; ++r) REQUIRE(got.head_entries[r] == host.head_entries[std::min(r, used_rows)]);
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

// plan_kernels.cu in plain C++: counts (overflowing rows zeroed), the two
// inclusive scans, then each row's pages in tiles of `tile` threads visited
// in a random order, run ends numbered by an exclusive scan carried over tiles;
// every array starts as `sentinel`.
inline PlanArrays emulate_plan(const cuda::DevicePlanInput& in, std::uint32_t tile, std::mt19937& rng,
                               std::int64_t sentinel) {
  PlanArrays a;
  a.indptr.assign(std::size_t{in.rows} * in.max_entries_per_row + 1, sentinel);
  a.indices.assign(std::size_t{in.rows} * in.max_pages_per_row, sentinel);
  a.last_page_len.assign(std::size_t{in.rows} * in.max_entries_per_row, static_cast<std::int32_t>(sentinel));
  a.head_entries.assign(std::size_t{in.rows} + 1, sentinel);
  const cuda::DevicePlanOutput out{a.indptr.data(), a.indices.data(), a.last_page_len.data(), a.head_entries.data(),
                                   &a.overflow_rows};
  std::vector<std::int64_t> row_runs(in.rows), row_pages(in.rows), page_ends(in.rows);
  out.indptr[0] = 0;
  out.head_entries[0] = 0;
  for (std::uint32_t row = 0; row < in.rows; ++row) {
    cuda::PlanRowCounts c = cuda::plan_row_counts(in, row);
    if (!cuda::plan_row_fits(c, in)) {
      ++a.overflow_rows;
      c = {};
    }
    row_runs[row] = c.runs;
    row_pages[row] = c.pages;
  }
  std::inclusive_scan(row_runs.begin(), row_runs.end(), a.head_entries.begin() + 1);
  std::inclusive_scan(row_pages.begin(), row_pages.end(), page_ends.begin());
  std::vector<std::uint32_t> threads(tile);
  std::iota(threads.begin(), threads.end(), 0u);
  for (std::uint32_t row = 0; row < in.rows; ++row) {
    const auto pages = static_cast<std::uint32_t>(row_pages[row]);
    const std::int64_t first_page = page_ends[row] - pages;
    const std::int64_t first_entry = a.head_entries[row];
    std::uint32_t runs_before = 0;
    for (std::uint32_t t0 = 0; t0 < pages; t0 += tile) {
      std::vector<cuda::PlanPage> page(tile);
      std::vector<std::uint32_t> flag(tile, 0), rank(tile, 0);
      for (std::uint32_t t = 0; t < tile && t0 + t < pages; ++t) {
        page[t] = cuda::plan_row_page(in, row, t0 + t);
        flag[t] = cuda::plan_run_end(page[t], t0 + t, pages, in.page_tokens) ? 1 : 0;
      }
      std::exclusive_scan(flag.begin(), flag.end(), rank.begin(), 0u);
      std::shuffle(threads.begin(), threads.end(), rng);
      for (const std::uint32_t t : threads) {
        if (t0 + t < pages)
          cuda::plan_emit_page(out, page[t], flag[t] != 0, first_page + t0 + t, first_entry + runs_before + rank[t]);
      }
      runs_before += rank[tile - 1] + flag[tile - 1];
    }
  }
  return a;
}

struct Copy {
  std::uint64_t flat;
  PageId cpu, gpu;
  bool operator<(const Copy& o) const { return flat < o.flat; }
};

// gather_miss_list_kernel in plain C++: each of `warps` warps walks the heads
// 32 at a time (lanes), scans their counts, and takes its round-robin share
// of each head's entries. Returns every copy made, tagged with its flattened
// index, in warp order.
inline std::vector<Copy> emulate_gather(const DeviceMissList& m, std::uint32_t warps) {
  std::vector<Copy> copies;
  for (std::uint32_t warp = 0; warp < warps; ++warp) {
    std::uint64_t before = 0;
    for (std::uint32_t group = 0; group < m.heads; group += 32) {
      std::uint64_t entries[32] = {}, start[32] = {};
      std::uint32_t offset[32] = {};
      for (std::uint32_t lane = 0; lane < 32 && group + lane < m.heads; ++lane) {
        offset[lane] = m.page_offsets[group + lane];
        entries[lane] =
            miss_list_entries(offset[lane], m.counts[std::size_t{group + lane} * m.count_stride], m.max_entries);
      }
      std::exclusive_scan(entries, entries + 32, start, std::uint64_t{0});
      for (std::uint32_t lane = 0; lane < 32; ++lane) {
        start[lane] += before;
        for (std::uint64_t j = miss_list_first(start[lane], warp, warps); j < start[lane] + entries[lane]; j += warps) {
          const std::size_t e = offset[lane] + (j - start[lane]);
          copies.push_back({j, m.cpu_pages[e], m.gpu_pages[e]});
        }
      }
      before = start[31] + entries[31];
    }
  }
  return copies;
}

}  // namespace sparsekv::test
