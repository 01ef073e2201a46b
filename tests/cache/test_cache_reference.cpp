// The reference replacement policies (exact LRU, Belady) against brute-force
// models, and bucketed LRU (Spin §5.3) judged against them.
#include <algorithm>
#include <bit>
#include <cmath>
#include <map>
#include <random>
#include <vector>

#include "research/selection_trace.hpp"
#include "sparsekv/cache/belady.hpp"
#include "sparsekv/cache/bucketed_lru.hpp"
#include "sparsekv/cache/exact_lru.hpp"
#include "test_support.hpp"

using namespace sparsekv;

namespace {

using Steps = std::vector<std::vector<PartitionId>>;

// Random selections whose pages fit `capacity`, drawn from a small id range so
// that hits and evictions both happen.
Steps random_steps(std::mt19937& rng, std::uint32_t count, const std::vector<std::uint32_t>& pages,
                   std::uint32_t capacity, std::uint32_t max_selected) {
  Steps steps(count);
  std::vector<PartitionId> ids(pages.size());
  for (PartitionId p = 0; p < ids.size(); ++p) ids[p] = p;
  for (auto& step : steps) {
    std::shuffle(ids.begin(), ids.end(), rng);
    const auto want = std::uniform_int_distribution<std::uint32_t>(0, max_selected)(rng);
    std::uint32_t used = 0;
    for (PartitionId p : ids) {
      if (step.size() == want) break;
      if (used + pages[p] <= capacity) {
        step.push_back(p);
        used += pages[p];
      }
    }
  }
  return steps;
}

std::vector<std::uint32_t> random_pages(std::mt19937& rng, std::uint32_t partitions, std::uint32_t max_pages) {
  std::vector<std::uint32_t> pages(partitions);
  for (auto& p : pages) p = std::uniform_int_distribution<std::uint32_t>(1, max_pages)(rng);
  return pages;
}

// Exact LRU written as plainly as possible: a vector, least recent first.
struct RecencyModel {
  std::uint32_t capacity;
  std::vector<std::pair<PartitionId, std::uint32_t>> order;

  CacheStepStats step(const std::vector<PartitionId>& selected, const std::vector<std::uint32_t>& pages) {
    CacheStepStats s;
    const auto is_resident = [&](PartitionId p) {
      return std::any_of(order.begin(), order.end(), [&](const auto& e) { return e.first == p; });
    };
    for (PartitionId p : selected) {
      (is_resident(p) ? s.hit_pages : s.miss_pages) += pages[p];
      ++(is_resident(p) ? s.hit_partitions : s.miss_partitions);
    }
    std::uint64_t used = 0;
    for (const auto& e : order) used += e.second;
    for (std::size_t i = 0; capacity - used < s.miss_pages;) {
      if (std::find(selected.begin(), selected.end(), order[i].first) != selected.end()) {
        ++i;
        continue;
      }
      used -= order[i].second;
      s.evicted_pages += order[i].second;
      order.erase(order.begin() + std::ptrdiff_t(i));
    }
    for (PartitionId p : selected) {
      std::erase_if(order, [&](const auto& e) { return e.first == p; });
      order.emplace_back(p, pages[p]);
    }
    return s;
  }
  std::vector<PartitionId> ids() const {
    std::vector<PartitionId> out;
    for (const auto& e : order) out.push_back(e.first);
    return out;
  }
};

void require_same(const CacheStepStats& a, const CacheStepStats& b) {
  REQUIRE(a.hit_partitions == b.hit_partitions);
  REQUIRE(a.miss_partitions == b.miss_partitions);
  REQUIRE(a.hit_pages == b.hit_pages);
  REQUIRE(a.miss_pages == b.miss_pages);
  REQUIRE(a.evicted_pages == b.evicted_pages);
}

// The true optimum with one-page partitions: dynamic programming over every
// resident set (bitmask) that a policy may keep, eviction on demand or not.
std::uint64_t optimal_misses(const Steps& steps, std::uint32_t capacity) {
  std::map<std::uint32_t, std::uint64_t> best{{0u, 0u}};
  for (const auto& step : steps) {
    std::uint32_t need = 0;
    for (PartitionId p : step) need |= 1u << p;
    std::map<std::uint32_t, std::uint64_t> next;
    for (const auto& [state, cost] : best) {
      const std::uint32_t pool = state | need;
      const std::uint64_t step_cost = std::uint64_t(std::popcount(need & ~state));
      for (std::uint32_t keep = pool;; keep = (keep - 1) & pool) {  // every subset of pool
        const std::uint32_t t = keep | need;
        if (std::uint32_t(std::popcount(t)) <= capacity) {
          auto [it, fresh] = next.emplace(t, cost + step_cost);
          if (!fresh) it->second = std::min(it->second, cost + step_cost);
        }
        if (keep == 0) break;
      }
    }
    best = std::move(next);
  }
  std::uint64_t out = ~std::uint64_t{0};
  for (const auto& [state, cost] : best) out = std::min(out, cost);
  return out;
}

template <class Policy>
CacheStepStats replay_all(Policy&& step_fn, std::size_t steps) {
  CacheStepStats total;
  for (std::size_t t = 0; t < steps; ++t) total += step_fn(t);
  return total;
}

}  // namespace

TEST_CASE("ExactLru matches a brute-force recency model", "[cache][exact_lru]") {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 60; ++trial) {
    const auto pages = random_pages(rng, 24, trial % 2 == 0 ? 1 : 4);
    const auto capacity = std::uniform_int_distribution<std::uint32_t>(4, 40)(rng);
    const Steps steps = random_steps(rng, 80, pages, capacity, 8);
    ExactLru lru(capacity);
    RecencyModel model{capacity, {}};
    for (const auto& step : steps) {
      require_same(lru.step(step, pages), model.step(step, pages));
      REQUIRE(lru.recency_order() == model.ids());
      REQUIRE(lru.used_pages() <= capacity);
      for (PartitionId p : step) REQUIRE(lru.resident(p));
    }
  }
}

TEST_CASE("ExactLru orders by selection and evicts exactly enough", "[cache][exact_lru]") {
  const std::vector<std::uint32_t> pages = {1, 1, 1, 1, 2};
  ExactLru lru(4);
  lru.step(std::vector<PartitionId>{2, 0, 1}, pages);
  REQUIRE(lru.recency_order() == std::vector<PartitionId>{2, 0, 1});
  // One free page, partition 3 needs one: nothing goes.
  auto s = lru.step(std::vector<PartitionId>{3}, pages);
  REQUIRE(s.evicted_pages == 0);
  // Partition 4 needs two pages, none are free: the two least recent
  // unselected partitions, 2 then 0, go; 1 stays.
  s = lru.step(std::vector<PartitionId>{4, 3}, pages);
  REQUIRE(s.hit_partitions == 1);
  REQUIRE(s.miss_pages == 2);
  REQUIRE(s.evicted_pages == 2);
  REQUIRE(lru.recency_order() == std::vector<PartitionId>{1, 4, 3});
}

TEST_CASE("ExactLru errors change nothing", "[cache][exact_lru]") {
  REQUIRE_SPARSEKV_ERROR(ExactLru(0), ErrorCode::invalid_argument);
  const std::vector<std::uint32_t> pages = {1, 2, 1, 0, 3};
  ExactLru lru(5);
  lru.step(std::vector<PartitionId>{0, 1, 2}, pages);
  const auto order = lru.recency_order();
  const auto check_unchanged = [&] {
    REQUIRE(lru.recency_order() == order);
    REQUIRE(lru.used_pages() == 4);
  };
  REQUIRE_SPARSEKV_ERROR(lru.step(std::vector<PartitionId>{4, 9}, pages), ErrorCode::out_of_range);
  check_unchanged();
  REQUIRE_SPARSEKV_ERROR(lru.step(std::vector<PartitionId>{4, 0, 4}, pages), ErrorCode::invalid_argument);
  check_unchanged();
  REQUIRE_SPARSEKV_ERROR(lru.step(std::vector<PartitionId>{3}, pages), ErrorCode::invalid_argument);
  check_unchanged();
  REQUIRE_SPARSEKV_ERROR(lru.step(std::vector<PartitionId>{4, 1, 0}, pages), ErrorCode::resource_exhausted);
  check_unchanged();
  const std::vector<std::uint32_t> changed = {1, 3, 1, 1, 3};
  REQUIRE_SPARSEKV_ERROR(lru.step(std::vector<PartitionId>{1}, changed), ErrorCode::invalid_argument);
  check_unchanged();
  // Still usable afterwards.
  REQUIRE(lru.step(std::vector<PartitionId>{4}, pages).evicted_pages == 3);  // 0, then 1
}

TEST_CASE("Belady matches the brute-force optimum on tiny uniform traces", "[cache][belady]") {
  std::mt19937 rng(11);
  for (int trial = 0; trial < 300; ++trial) {
    const std::uint32_t partitions = std::uniform_int_distribution<std::uint32_t>(2, 7)(rng);
    const std::uint32_t capacity = std::uniform_int_distribution<std::uint32_t>(1, 4)(rng);
    const std::vector<std::uint32_t> pages(partitions, 1);
    const Steps steps =
        random_steps(rng, std::uniform_int_distribution<std::uint32_t>(1, 9)(rng), pages, capacity, capacity);
    Belady belady(capacity, steps, pages);
    const auto total = replay_all([&](std::size_t) { return belady.step(); }, steps.size());
    INFO("trial " << trial << " partitions " << partitions << " capacity " << capacity);
    REQUIRE(total.miss_pages == optimal_misses(steps, capacity));
  }
}

TEST_CASE("Belady is never worse than exact LRU on uniform pages", "[cache][belady]") {
  std::mt19937 rng(13);
  for (int trial = 0; trial < 40; ++trial) {
    const std::vector<std::uint32_t> pages(64, 1);
    const auto capacity = std::uniform_int_distribution<std::uint32_t>(4, 48)(rng);
    const Steps steps = random_steps(rng, 200, pages, capacity, std::min<std::uint32_t>(capacity, 12));
    Belady belady(capacity, steps, pages);
    ExactLru lru(capacity);
    std::uint64_t belady_misses = 0, lru_misses = 0;
    for (const auto& step : steps) {
      belady_misses += belady.step().miss_pages;
      lru_misses += lru.step(step, pages).miss_pages;
      REQUIRE(belady.used_pages() <= capacity);
      for (PartitionId p : step) REQUIRE(belady.resident(p));
    }
    REQUIRE(belady.done());
    REQUIRE(belady_misses <= lru_misses);
  }
}

TEST_CASE("Belady keeps invariants with variable pages and breaks ties as documented", "[cache][belady]") {
  std::mt19937 rng(17);
  for (int trial = 0; trial < 20; ++trial) {
    const auto pages = random_pages(rng, 40, 5);
    const auto capacity = std::uniform_int_distribution<std::uint32_t>(8, 60)(rng);
    const Steps steps = random_steps(rng, 150, pages, capacity, 10);
    Belady belady(capacity, steps, pages);
    for (const auto& step : steps) {
      const std::uint32_t free_before = capacity - belady.used_pages();
      const auto s = belady.step();
      if (s.evicted_pages > 0) REQUIRE(free_before < s.miss_pages);  // evicts only on demand
      REQUIRE(belady.used_pages() <= capacity);
      for (PartitionId p : step) REQUIRE(belady.resident(p));
    }
  }
  // Never used again is farthest; among those the larger partition goes first.
  Belady sizes(3, {{0, 1}, {2}}, {1, 2, 1});
  sizes.step();
  REQUIRE(sizes.step().evicted_pages == 2);
  REQUIRE(sizes.resident(0));
  REQUIRE_FALSE(sizes.resident(1));
  // Equal next use and size: the higher id goes.
  Belady ids(3, {{0, 1, 2}, {3}, {0, 1, 2}}, {1, 1, 1, 1});
  ids.step();
  ids.step();
  REQUIRE_FALSE(ids.resident(2));
  // Otherwise the farthest next use goes, whatever its id or size.
  Belady far(3, {{0, 1, 2}, {3}, {1}, {0}, {2}}, {1, 1, 1, 1});
  far.step();
  far.step();
  REQUIRE_FALSE(far.resident(2));
}

TEST_CASE("Belady errors", "[cache][belady]") {
  const std::vector<std::uint32_t> pages = {1, 2, 0};
  REQUIRE_SPARSEKV_ERROR(Belady(0, {{0}}, pages), ErrorCode::invalid_argument);
  REQUIRE_SPARSEKV_ERROR(Belady(4, {{0}, {1, 3}}, pages), ErrorCode::out_of_range);
  REQUIRE_SPARSEKV_ERROR(Belady(4, {{0, 1, 0}}, pages), ErrorCode::invalid_argument);
  REQUIRE_SPARSEKV_ERROR(Belady(4, {{2}}, pages), ErrorCode::invalid_argument);
  REQUIRE_SPARSEKV_ERROR(Belady(2, {{0}, {0, 1}}, pages), ErrorCode::resource_exhausted);
  Belady belady(3, {{0}, {1}}, pages);
  belady.step();
  belady.step();
  REQUIRE(belady.done());
  REQUIRE_SPARSEKV_ERROR(belady.step(), ErrorCode::failed_precondition);
  REQUIRE(belady.next_step() == 2);
  REQUIRE(belady.used_pages() == 3);
}

// The bucketed LRU's promise: on synthetic locality traces, bucketed LRU is within 2
// percentage points of exact LRU at 2x-10x buffers, and Belady >= both.
TEST_CASE("Bucketed LRU tracks exact LRU on locality traces; Belady bounds both", "[cache][bucketed_lru]") {
  for (std::uint64_t seed : {1, 2, 3}) {
    SyntheticTraceOptions o;
    o.seed = seed;
    o.layers = 1;
    o.kv_heads = 2;
    o.steps = 300;
    o.partitions = 1024;
    o.selected = 32;
    const SelectionTrace trace = synthetic_selection_trace(o);
    for (std::uint32_t ratio : {1u, 2u, 5u, 10u}) {
      CacheStepStats bucketed, exact, belady;
      for (std::uint32_t h = 0; h < trace.heads(); ++h) {
        const auto capacity = std::uint32_t(ratio * trace.mandatory_pages(h));
        const auto& pages = trace.partition_pages[h];
        BucketedLruCache bucketed_cache(capacity, pages);
        ExactLru lru(capacity);
        Belady opt(capacity, trace.head_selections(h), pages);
        for (const auto& step : trace.selections) {
          bucketed += bucketed_cache.step(step[h]);
          exact += lru.step(step[h], pages);
          belady += opt.step();
        }
      }
      INFO("seed " << seed << " ratio " << ratio << ": bucketed " << bucketed.hit_ratio() << ", exact "
                   << exact.hit_ratio() << ", belady " << belady.hit_ratio());
      if (ratio >= 2) REQUIRE(std::abs(bucketed.hit_ratio() - exact.hit_ratio()) <= 0.02);
      REQUIRE(belady.hit_ratio() >= exact.hit_ratio());
      REQUIRE(belady.hit_ratio() >= bucketed.hit_ratio());
    }
  }
}
