// The device Plan step and the miss-list gather in plain C++: host
// emulations of the kernels' decompositions (plan: one thread per row
// counting, scans, one block per row filling in tiles with a block scan of the
// run ends; gather: warps owning the flattened (head, entry) space
// round-robin, walking heads 32 at a time) against the host paths they
// replace: HostStep::build_plan's runs and the LRU host step's copy list. This
// is CI's coverage of plan_kernels.cu and gather_miss_list_kernel.
#include <algorithm>
#include <cstddef>
#include <numeric>
#include <random>
#include <vector>

#include "bucketed_lru_test_data.hpp"
#include "plan_test_data.hpp"
#include "sparsekv/memory/memory_resource.hpp"
#include "sparsekv/memory/page_pool.hpp"
#include "sparsekv/transfer/miss_list.hpp"
#include "test_support.hpp"

using namespace sparsekv;
using namespace sparsekv::test;

namespace {
constexpr std::int64_t kSentinel = -7;
}  // namespace

TEST_CASE("plan rules: page tokens and row counts follow for_each_page and append_runs", "[plan-rules]") {
  REQUIRE(cuda::plan_page_tokens(10, 0, 4) == 4);
  REQUIRE(cuda::plan_page_tokens(10, 2, 4) == 2);
  REQUIRE(cuda::plan_page_tokens(10, 3, 4) == 0);  // a page past the tokens
  REQUIRE(cuda::plan_page_tokens(8, 1, 4) == 4);
  // Row 0: partitions of 10 tokens / 3 pages (4, 4, 2), 0 pages, 8 tokens / 2 pages (4, 4); tail 3.
  // Runs: [4 4 2] [4 4 3]. Row 1: nothing. Row 2: only a full tail: one run.
  const std::uint32_t selections[] = {0, 3, 3, 3};
  const std::uint32_t partitions[] = {0, 3, 3, 5};
  const PageId pages[] = {10, 11, 12, 13, 14};
  const std::uint32_t tokens[] = {10, 0, 8};
  const PageId tails[] = {20, 21, 22};
  const std::uint32_t tail_tokens[] = {3, 0, 4};
  const cuda::DevicePlanInput in{3, selections, partitions, pages, tokens, tails, tail_tokens, 4, 8, 4};
  const cuda::PlanRowCounts row0 = cuda::plan_row_counts(in, 0);
  REQUIRE(row0.pages == 6);
  REQUIRE(row0.runs == 2);
  REQUIRE(cuda::plan_row_counts(in, 1).pages == 0);
  REQUIRE(cuda::plan_row_counts(in, 1).runs == 0);
  REQUIRE(cuda::plan_row_counts(in, 2).runs == 1);
  REQUIRE(cuda::plan_row_page(in, 0, 2).page == 12);
  REQUIRE(cuda::plan_row_page(in, 0, 2).tokens == 2);
  REQUIRE(cuda::plan_row_page(in, 0, 3).page == 13);  // the empty partition is skipped
  REQUIRE(cuda::plan_row_page(in, 0, 5).page == 20);
  REQUIRE(cuda::plan_row_page(in, 0, 5).tokens == 3);
  REQUIRE(cuda::plan_row_fits(row0, in));
  REQUIRE_FALSE(cuda::plan_row_fits({9, 1}, in));
  REQUIRE_FALSE(cuda::plan_row_fits({1, 5}, in));
}

TEST_CASE("plan emulation: the kernels' decomposition reproduces build_plan bit for bit", "[plan-rules]") {
  std::mt19937 rng(2024);
  const std::uint32_t tiles[] = {1, 3, 32, cuda::kPlanFillThreads};
  std::size_t entries = 0, multi_run_rows = 0, zero_token_runs = 0;
  for (int trial = 0; trial < 300; ++trial) {
    const PlanCase c = random_plan_case(rng);
    INFO("trial " << trial << " rows " << c.rows << " batch " << c.batch << " page_tokens " << c.page_tokens);
    // Capacities exactly the largest row's, or with room to spare.
    const std::uint32_t spare = rng() % 2 == 0 ? 0 : 1 + rng() % 5;
    const cuda::DevicePlanInput in = c.host_input(c.max_row_pages + spare, c.max_row_runs + spare);
    require_same_plan(emulate_plan(in, tiles[trial % 4], rng, kSentinel), c.host, c.rows, kSentinel);
    entries += c.host.entries();
    for (std::size_t r = 0; r + 1 < c.host.head_entries.size(); ++r)
      multi_run_rows += c.host.head_entries[r + 1] - c.host.head_entries[r] > 1 ? 1 : 0;
    zero_token_runs +=
        static_cast<std::size_t>(std::count(c.host.last_page_len.begin(), c.host.last_page_len.end(), 0));
  }
  // The random cases exercised multi-run rows and pages past their partition's tokens.
  REQUIRE(entries > 5000);
  REQUIRE(multi_run_rows > 500);
  REQUIRE(zero_token_runs > 50);
}

TEST_CASE("plan emulation: rows past a capacity are planned empty and counted", "[plan-rules]") {
  std::mt19937 rng(77);
  std::size_t overflowed = 0;
  for (int trial = 0; trial < 100; ++trial) {
    const PlanCase c = random_plan_case(rng);
    if (c.max_row_pages < 2) continue;
    const std::uint32_t max_pages = c.max_row_pages / 2;
    const std::uint32_t max_entries = std::max(1u, c.max_row_runs / 2);
    // The host plan of the rows that fit, the others empty.
    AttendPlan want;
    std::uint32_t want_overflow = 0;
    std::vector<PageId> pages;
    std::vector<std::uint32_t> tokens;
    for (std::uint32_t b = 0; b < c.batch; ++b) {
      for (std::uint32_t h = 0; h < c.kv_heads; ++h) {
        AttendPlan row;
        const std::int64_t runs = append_head_runs(row, c.retrievals[b], h, c.page_tokens, pages, tokens);
        const bool fits = row.indices.size() <= max_pages && runs <= max_entries;
        want_overflow += fits ? 0 : 1;
        want.head_entries.push_back(
            want.head_entries.back() +
            (fits ? append_head_runs(want, c.retrievals[b], h, c.page_tokens, pages, tokens) : 0));
      }
    }
    PlanArrays got = emulate_plan(c.host_input(max_pages, max_entries), cuda::kPlanFillThreads, rng, kSentinel);
    INFO("trial " << trial);
    REQUIRE(got.overflow_rows == want_overflow);
    overflowed += want_overflow;
    got.overflow_rows = 0;
    require_same_plan(got, want, c.rows, kSentinel);
  }
  REQUIRE(overflowed > 20);
}

TEST_CASE("chunked pages: the device address map equals PagePool::data", "[plan-rules]") {
  HostMemoryResource memory(false);
  for (const std::uint32_t per_chunk : {0u, 1u, 3u, 7u, 64u}) {
    PagePool pool(PageLayout{4, 64, DType::f16}, 50, memory, per_chunk);
    std::vector<PageId> all(50);
    pool.allocate(all);
    const ChunkedPages map{pool.chunks().data(), pool.pages_per_chunk(), pool.page_bytes()};
    for (PageId p = 0; p < 50; ++p) REQUIRE(map.address(p) == pool.data(p));
  }
}

TEST_CASE("miss list rules: a warp's first entry of a head and the capacity cut", "[plan-rules]") {
  REQUIRE(miss_list_first(0, 0, 4) == 0);
  REQUIRE(miss_list_first(0, 3, 4) == 3);
  REQUIRE(miss_list_first(5, 1, 4) == 5);  // 5 % 4 == 1
  REQUIRE(miss_list_first(5, 0, 4) == 8);
  REQUIRE(miss_list_first(5, 3, 4) == 7);
  REQUIRE(miss_list_first(6, 0, 1) == 6);  // one warp takes everything
  REQUIRE(miss_list_entries(10, 4, 20) == 4);
  REQUIRE(miss_list_entries(18, 4, 20) == 2);
  REQUIRE(miss_list_entries(25, 4, 20) == 0);
}

TEST_CASE("miss list emulation: the gather copies exactly the LRU host plan's copies", "[plan-rules]") {
  std::uint64_t total_copies = 0, zero_miss_heads = 0;
  const std::uint32_t warp_choices[] = {1, 2, 5, 32, 33, 1000};
  for (std::uint32_t seed = 1; seed <= 6; ++seed) {
    HostMemoryResource memory(false);
    HierarchicalPageTable table(emulation_geometry(), memory, memory);
    build_emulation_table(table, seed);
    std::mt19937 rng(seed * 131);
    BucketedLru lru(64);
    std::vector<Head> all;
    const PageTableGeometry& g = table.geometry();
    for (RequestId r = 0; r < g.max_requests; ++r)
      for (std::uint32_t l = 0; l < g.layers; ++l)
        for (std::uint32_t h = 0; h < g.kv_heads; ++h) all.push_back({r * 10 + 3, l, h});
    for (int step = 0; step < 20; ++step) {
      std::vector<Head> heads = all;
      std::shuffle(heads.begin(), heads.end(), rng);
      heads.resize(1 + rng() % heads.size());
      HostStepBatch batch;
      for (const Head& h : heads) batch.add(lru, table, table, h, random_selection(table, h, rng, 0.5));
      // The LRU launch's output layout: per-head copy regions, the tail of
      // each region garbage; the counts read in place from the stats.
      const std::uint32_t capacity = batch.page_offsets.back();
      std::vector<PageId> cpu(capacity), gpu(capacity);
      for (auto& p : cpu) p = static_cast<PageId>(rng());
      for (auto& p : gpu) p = static_cast<PageId>(rng());
      std::size_t copy = 0;
      for (std::size_t h = 0; h < heads.size(); ++h) {
        zero_miss_heads += batch.host_stats[h].miss_pages == 0 ? 1 : 0;
        for (std::uint64_t c = 0; c < batch.host_stats[h].miss_pages; ++c, ++copy) {
          cpu[batch.page_offsets[h] + c] = batch.retrieved.copies[copy].cpu_page;
          gpu[batch.page_offsets[h] + c] = batch.retrieved.copies[copy].gpu_page;
        }
      }
      static_assert(sizeof(CacheStepStats) % sizeof(std::uint64_t) == 0);
      const DeviceMissList misses{static_cast<std::uint32_t>(heads.size()),
                                  capacity,
                                  batch.page_offsets.data(),
                                  &batch.host_stats.data()->miss_pages,
                                  sizeof(CacheStepStats) / sizeof(std::uint64_t),
                                  cpu.data(),
                                  gpu.data()};
      const std::uint32_t warps = warp_choices[rng() % 6];
      std::vector<Copy> got = emulate_gather(misses, warps);
      std::sort(got.begin(), got.end());
      INFO("seed " << seed << " step " << step << " warps " << warps);
      REQUIRE(got.size() == batch.retrieved.copies.size());
      for (std::size_t i = 0; i < got.size(); ++i) {
        REQUIRE(got[i].flat == i);  // every entry once
        REQUIRE(got[i].cpu == batch.retrieved.copies[i].cpu_page);
        REQUIRE(got[i].gpu == batch.retrieved.copies[i].gpu_page);
      }
      total_copies += got.size();
    }
  }
  REQUIRE(total_copies > 1000);
  REQUIRE(zero_miss_heads > 10);
}

TEST_CASE("miss list emulation: counts past the copy arrays are cut, many heads", "[plan-rules]") {
  std::mt19937 rng(9);
  for (int trial = 0; trial < 50; ++trial) {
    const std::uint32_t heads = 1 + rng() % 300;
    std::vector<std::uint32_t> offsets(heads);
    std::vector<std::uint64_t> counts(heads);
    std::uint32_t at = 0;
    for (std::uint32_t h = 0; h < heads; ++h) {
      offsets[h] = at;
      const std::uint32_t region = rng() % 4 == 0 ? 0 : rng() % 9;
      counts[h] = rng() % 3 == 0 ? 0 : rng() % (region + 1);
      at += region;
    }
    // The last head claims more than the arrays hold: only what fits is copied.
    const std::uint32_t capacity = at;
    counts[heads - 1] += 5;
    std::vector<PageId> cpu(capacity), gpu(capacity);
    std::iota(cpu.begin(), cpu.end(), PageId{0});
    std::iota(gpu.begin(), gpu.end(), PageId{100000});
    const DeviceMissList misses{heads, capacity, offsets.data(), counts.data(), 1, cpu.data(), gpu.data()};
    std::vector<Copy> want;
    for (std::uint32_t h = 0; h < heads; ++h) {
      for (std::uint64_t c = 0; c < counts[h] && offsets[h] + c < capacity; ++c)
        want.push_back({want.size(), cpu[offsets[h] + c], gpu[offsets[h] + c]});
    }
    std::vector<Copy> got = emulate_gather(misses, 1 + rng() % 200);
    std::sort(got.begin(), got.end());
    REQUIRE(got.size() == want.size());
    for (std::size_t i = 0; i < got.size(); ++i) {
      REQUIRE(got[i].flat == want[i].flat);
      REQUIRE(got[i].cpu == want[i].cpu);
      REQUIRE(got[i].gpu == want[i].gpu);
    }
  }
}
