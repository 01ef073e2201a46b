#pragma once
// Select's fixed-stride output built from per-row selections, the glue's
// arrays, the comparisons against the host and the host emulations of the
// glue and stats kernels, shared by the Select -> LRU glue's rules
// (test_lru_batch_rules.cpp), its GPU test (gpu/test_lru_batch_cuda.cpp) and
// the emulated device runtime (device_runtime_emulation.hpp).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <random>
#include <utility>
#include <vector>

#include "sparsekv/cache/cache_step.hpp"
#include "sparsekv/cache/lru_batch_cuda.hpp"

namespace sparsekv::test {

// What the glue's outputs hold before the launches: anything it did not write still reads so.
inline constexpr std::uint32_t kGlueSentinel = 0xdeadbeefu;

// Select's output for given per-row selections: rows of `max_selected`
// entries, the unused tail of each row garbage (often a real partition id, so
// that reading past a count changes the sums), counts occasionally corrupt
// past a full row.
struct FixedStride {
  std::uint32_t max_selected = 0;
  std::vector<PartitionId> selected;
  std::vector<std::uint32_t> counts;
  std::vector<std::size_t> instances;

  cuda::LruBatchInput input() const {
    return {static_cast<std::uint32_t>(counts.size()), max_selected, selected.data(), counts.data(), instances.data()};
  }
};

inline std::uint32_t longest_row(const std::vector<std::vector<PartitionId>>& rows) {
  std::size_t n = 0;
  for (const auto& r : rows) n = std::max(n, r.size());
  return static_cast<std::uint32_t>(n);
}

// `max_selected`: the row stride, at least longest_row(rows).
inline FixedStride fixed_stride(const std::vector<std::vector<PartitionId>>& rows, std::vector<std::size_t> instances,
                                std::uint32_t max_selected, std::mt19937& rng) {
  REQUIRE(max_selected >= longest_row(rows));
  FixedStride f;
  f.max_selected = max_selected;
  f.selected.resize(rows.size() * f.max_selected);
  for (auto& p : f.selected) p = static_cast<PartitionId>(rng() % 3 == 0 ? rng() : rng() % 200);
  for (std::size_t r = 0; r < rows.size(); ++r) {
    std::copy(rows[r].begin(), rows[r].end(), f.selected.begin() + static_cast<std::ptrdiff_t>(r * f.max_selected));
    const auto n = static_cast<std::uint32_t>(rows[r].size());
    f.counts.push_back(n == f.max_selected && rng() % 3 == 0 ? n + 1 + static_cast<std::uint32_t>(rng() % 1000) : n);
  }
  f.instances = std::move(instances);
  return f;
}

// The glue's arrays as downloaded (capacity-sized).
struct LruBatchArrays {
  std::vector<std::uint32_t> selection_offsets, page_offsets, partition_tokens;
  std::vector<PartitionId> selected;

  // Capacity for `rows` rows of `max_selected`, every entry kGlueSentinel.
  LruBatchArrays(std::uint32_t rows, std::uint32_t max_selected)
      : selection_offsets(std::size_t{rows} + 1, kGlueSentinel),
        page_offsets(std::size_t{rows} + 1, kGlueSentinel),
        partition_tokens(std::size_t{rows} * max_selected, kGlueSentinel),
        selected(std::size_t{rows} * max_selected, kGlueSentinel) {}

  cuda::LruBatchOutput output() {
    return {selection_offsets.data(), selected.data(), page_offsets.data(), partition_tokens.data()};
  }
};

inline void require_same_stats(const CacheStepStats& got, const CacheStepStats& want) {
  REQUIRE(got.hit_partitions == want.hit_partitions);
  REQUIRE(got.miss_partitions == want.miss_partitions);
  REQUIRE(got.hit_pages == want.hit_pages);
  REQUIRE(got.miss_pages == want.miss_pages);
  REQUIRE(got.evicted_pages == want.evicted_pages);
}

// The glue's CSR equals the host's (offsets and partitions), its tokens
// `tokens`, and nothing past the selections was written.
inline void require_same_csr(const LruBatchArrays& got, const std::vector<std::uint32_t>& selection_offsets,
                             const std::vector<PartitionId>& selected, const std::vector<std::uint32_t>& page_offsets,
                             const std::vector<std::uint32_t>& tokens) {
  REQUIRE(got.selection_offsets == selection_offsets);
  REQUIRE(got.page_offsets == page_offsets);
  const std::size_t n = selected.size();
  REQUIRE(tokens.size() == n);
  REQUIRE(std::equal(selected.begin(), selected.end(), got.selected.begin()));
  REQUIRE(std::equal(tokens.begin(), tokens.end(), got.partition_tokens.begin()));
  const auto untouched = [](const auto& v, std::size_t from) {
    return std::all_of(v.begin() + static_cast<std::ptrdiff_t>(from), v.end(),
                       [](auto x) { return x == kGlueSentinel; });
  };
  REQUIRE(untouched(got.selected, n));
  REQUIRE(untouched(got.partition_tokens, n));
}

// 0 .. n - 1 in a random order: blocks or threads run in any order.
inline std::vector<std::uint32_t> shuffled_indices(std::uint32_t n, std::mt19937& rng) {
  std::vector<std::uint32_t> order(n);
  std::iota(order.begin(), order.end(), 0u);
  std::shuffle(order.begin(), order.end(), rng);
  return order;
}

// build_lru_batch in plain C++: count blocks in any order, each of `threads`
// threads summing its strided selections' pages (any order) before the
// block's reduction; the two inclusive scans; fill blocks, selections in any order.
inline LruBatchArrays emulate_lru_batch(const PartitionLookup& lookup, const cuda::LruBatchInput& in,
                                        std::uint32_t threads, std::mt19937& rng) {
  LruBatchArrays a(in.rows, in.max_selected);
  if (in.rows == 0) return a;  // nothing enqueued
  const cuda::LruBatchOutput out = a.output();
  std::vector<std::uint32_t> row_counts(in.rows), row_pages(in.rows);
  for (const std::uint32_t row : shuffled_indices(in.rows, rng)) {
    if (row == 0) {
      out.selection_offsets[0] = 0;
      out.page_offsets[0] = 0;
    }
    const std::uint32_t n = cuda::lru_batch_count(in, row);
    std::vector<std::uint32_t> partial(threads, 0);
    for (const std::uint32_t t : shuffled_indices(threads, rng)) {
      for (std::uint32_t i = t; i < n; i += threads) partial[t] += cuda::lru_batch_selection(lookup, in, row, i).pages;
    }
    row_counts[row] = n;
    row_pages[row] = std::accumulate(partial.begin(), partial.end(), 0u);
  }
  std::inclusive_scan(row_counts.begin(), row_counts.end(), a.selection_offsets.begin() + 1);
  std::inclusive_scan(row_pages.begin(), row_pages.end(), a.page_offsets.begin() + 1);
  if (in.max_selected == 0) return a;  // no fill launch
  for (const std::uint32_t row : shuffled_indices(in.rows, rng)) {
    const std::uint32_t first = out.selection_offsets[row];
    for (const std::uint32_t i : shuffled_indices(cuda::lru_batch_count(in, row), rng)) {
      cuda::lru_batch_emit(out, cuda::lru_batch_selection(lookup, in, row, i), first + i);
    }
  }
  return a;
}

// accumulate_step_stats in plain C++: per-thread strided partial sums, a
// reduction tree in any order, then the block's sum added to the total.
inline void emulate_accumulate(const std::vector<CacheStepStats>& stats, CacheStepStats& total, std::mt19937& rng) {
  const auto heads = static_cast<std::uint32_t>(stats.size());
  if (heads == 0) return;  // nothing enqueued
  std::vector<CacheStepStats> partial(cuda::kStepStatsThreads);
  for (const std::uint32_t t : shuffled_indices(cuda::kStepStatsThreads, rng)) {
    for (std::uint32_t h = t; h < heads; h += cuda::kStepStatsThreads) {
      partial[t] = cuda::step_stats_sum(partial[t], stats[h]);
    }
  }
  while (partial.size() > 1) {
    std::shuffle(partial.begin(), partial.end(), rng);
    std::vector<CacheStepStats> next;
    for (std::size_t i = 0; i + 1 < partial.size(); i += 2) {
      next.push_back(cuda::step_stats_sum(partial[i], partial[i + 1]));
    }
    if (partial.size() % 2 == 1) next.push_back(partial.back());
    partial = std::move(next);
  }
  total = cuda::step_stats_sum(total, partial[0]);
}

}  // namespace sparsekv::test
