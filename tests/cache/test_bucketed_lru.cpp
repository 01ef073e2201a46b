// Bucketed LRU (Spin §5.3) step by step, against hand-computed outcomes: the
// exact tie-breaking the CUDA kernel has to reproduce.
#include <vector>

#include "sparsekv/cache/bucketed_lru.hpp"
#include "test_support.hpp"

using namespace sparsekv;

namespace {

// One request, one head, `slots` GPU slots owning GPU pages 100, 101, ...;
// partitions with the given page counts (page_tokens = 1), CPU pages 0, 1, ...
struct OneHead {
  HostMemoryResource memory{false};
  HierarchicalPageTable table;
  BucketedLru lru;
  RetrievedPages pages;

  static PageTableGeometry geometry() {
    PageTableGeometry g;
    g.max_requests = g.layers = g.kv_heads = 1;
    g.page_tokens = 1;
    g.max_partitions_per_head = 64;
    g.max_cpu_pages_per_head = 256;
    g.max_gpu_pages_per_head = 64;
    g.segment_entries = 32;
    g.meta_segments = g.offset_segments = 2;
    g.cpu_page_segments = 8;
    g.gpu_page_segments = 2;
    return g;
  }

  OneHead(std::vector<std::uint32_t> pages, std::uint32_t slots, std::uint32_t buckets)
      : table(geometry(), memory, memory), lru(buckets) {
    table.add_request(0);
    std::uint32_t total = 0;
    for (auto p : pages) total += p;
    std::vector<PageId> cpu(total);
    for (PageId i = 0; i < total; ++i) cpu[i] = i;
    table.append_partitions(0, 0, 0, pages, cpu);
    table.resize_gpu_slots(0, 0, 0, slots);
    for (std::uint32_t s = 0; s < slots; ++s) table.set_gpu_entry(0, 0, 0, s, {kInvalidPartition, 100 + s, 0, 0, 0});
  }

  CacheStepStats step(std::vector<PartitionId> selected, std::uint32_t budget = 64) {
    lru.check(table, 0, 0, 0, selected, budget);
    pages.clear();
    const CacheStepStats stats = lru.step(table, 0, 0, 0, selected, pages);
    table.validate();
    return stats;
  }
  GpuPageEntry slot(std::uint32_t s) const { return table.gpu_entry(0, 0, 0, s); }
};

}  // namespace

TEST_CASE("BucketedLru: promotion, demotion, threshold eviction and ascending admission", "[cache]") {
  OneHead h({1, 1, 1, 1, 1, 1}, 4, 4);  // T = 4 buckets: top = 3
  auto s = h.step({1, 0});
  REQUIRE(s.miss_partitions == 2);
  // Misses in selection order take free slots in ascending order.
  REQUIRE(h.slot(0).partition == 1);
  REQUIRE(h.slot(1).partition == 0);
  REQUIRE(h.pages.gpu_pages == std::vector<PageId>{100, 101});
  REQUIRE(h.pages.copies.size() == 2);
  REQUIRE(h.pages.copies[0].cpu_page == 1);
  REQUIRE(h.pages.copies[0].gpu_page == 100);
  h.step({2});
  h.step({3});
  REQUIRE(h.slot(0).timestamp == 1);  // demoted twice from 3
  REQUIRE(h.slot(2).timestamp == 2);
  REQUIRE(h.slot(3).timestamp == 3);
  // Partition 3 again: a hit, promoted to the top; the others demote.
  s = h.step({3});
  REQUIRE(s.hit_partitions == 1);
  REQUIRE(s.miss_pages == 0);
  REQUIRE(h.pages.copies.empty());
  REQUIRE(h.pages.gpu_pages == std::vector<PageId>{103});
  REQUIRE(h.slot(0).timestamp == 0);
  REQUIRE(h.slot(2).timestamp == 1);
  // Full buffer, one miss. After demotion p1, p0 and p2 all sit in bucket 0:
  // threshold 0 evicts the whole bucket (bucket granularity, 3 pages for a
  // demand of 1) and the miss takes the lowest freed slot.
  s = h.step({4});
  REQUIRE(s.evicted_pages == 3);
  REQUIRE(h.slot(0).partition == 4);
  REQUIRE_FALSE(h.slot(1).occupied());
  REQUIRE_FALSE(h.slot(2).occupied());
  for (PartitionId p : {0u, 1u, 2u}) REQUIRE_FALSE(h.table.meta(0, 0, 0, p).resident());
  REQUIRE(h.table.meta(0, 0, 0, 3).resident());
  // Timestamps saturate at 0: a page unused for many steps stays at 0.
  for (int i = 0; i < 6; ++i) h.step({4});
  REQUIRE(h.slot(3).timestamp == 0);
  // Two misses, two free slots: nothing is evicted.
  s = h.step({5, 0});
  REQUIRE(s.evicted_pages == 0);
  REQUIRE(h.slot(1).partition == 5);
  REQUIRE(h.slot(2).partition == 0);
  REQUIRE(h.slot(3).partition == 3);
  // Two misses, none free: p3 (bucket 0) and p4 (bucket 1) cover the demand of
  // 2 at threshold 1; p5 and p0 (bucket 2) stay. Misses fill slots 0 and 3.
  s = h.step({1, 2});
  REQUIRE(s.evicted_pages == 2);
  REQUIRE(h.slot(0).partition == 1);
  REQUIRE(h.slot(3).partition == 2);
  REQUIRE(h.slot(1).partition == 5);
  REQUIRE(h.slot(2).partition == 0);
  REQUIRE(h.pages.gpu_pages == std::vector<PageId>{100, 103});
}

TEST_CASE("BucketedLru: multi-page partitions keep page order and move together", "[cache]") {
  OneHead h({3, 2, 1, 2}, 6, 64);  // top = 63
  h.step({1});                     // p1 -> slots 0-1
  h.step({0, 2});                  // p0 -> slots 2-4, p2 -> slot 5
  REQUIRE(h.pages.gpu_pages == std::vector<PageId>{102, 103, 104, 105});
  h.step({1, 0});
  REQUIRE(h.pages.gpu_pages == std::vector<PageId>{100, 101, 102, 103, 104});
  REQUIRE(h.pages.partition_offsets == std::vector<std::uint32_t>{0, 2, 5});
  h.step({2, 1});
  h.step({0, 2});  // now p0, p2 at 63 and p1 at 62
  // p3 needs 2 pages, none free. After demotion p1 (2 pages) sits at 61 and
  // p0 (3 pages) at 62: threshold 61 evicts exactly p1, whose slots p3 takes.
  const auto s = h.step({3, 2});
  REQUIRE(s.miss_pages == 2);
  REQUIRE(s.evicted_pages == 2);
  REQUIRE(h.pages.gpu_pages == std::vector<PageId>{100, 101, 105});
  REQUIRE(h.slot(0).page_in_partition == 0);
  REQUIRE(h.slot(1).page_in_partition == 1);
  REQUIRE_FALSE(h.table.meta(0, 0, 0, 1).resident());
  REQUIRE(h.table.meta(0, 0, 0, 0).resident());
}

TEST_CASE("BucketedLru: bad selections are refused and change nothing", "[cache][errors]") {
  OneHead h({1, 2, 4, 1}, 5, 64);
  h.step({0, 1});
  const GpuPageEntry before = h.slot(0);
  REQUIRE_SPARSEKV_ERROR(h.step({3, 3}), ErrorCode::invalid_argument);       // duplicate
  REQUIRE_SPARSEKV_ERROR(h.step({0, 9}), ErrorCode::out_of_range);           // no partition 9
  REQUIRE_SPARSEKV_ERROR(h.step({2, 1}, 4), ErrorCode::resource_exhausted);  // 6 pages > budget 4
  REQUIRE_SPARSEKV_ERROR(h.step({2, 1, 3}), ErrorCode::resource_exhausted);  // 7 pages > 5 slots
  REQUIRE(h.slot(0).timestamp == before.timestamp);
  REQUIRE(h.slot(0).partition == before.partition);
  // The scratch marks were cleaned up: a valid step still works.
  const auto s = h.step({3, 0});
  REQUIRE(s.hit_partitions == 1);
  REQUIRE_SPARSEKV_ERROR(BucketedLru(1), ErrorCode::invalid_argument);
}

TEST_CASE("BucketedLruCache runs the same steps on its own table", "[cache]") {
  const std::vector<std::uint32_t> pages{1, 1, 2, 1, 3};
  BucketedLruCache cache(5, pages, 4);
  OneHead h(pages, 5, 4);
  for (const std::vector<PartitionId>& sel :
       std::vector<std::vector<PartitionId>>{{0, 1}, {2}, {4}, {0, 3}, {1, 2}, {4, 1}, {3}, {2, 0, 1}}) {
    const CacheStepStats a = cache.step(sel);
    const CacheStepStats b = h.step(sel);
    REQUIRE(a.hit_pages == b.hit_pages);
    REQUIRE(a.miss_pages == b.miss_pages);
    REQUIRE(a.evicted_pages == b.evicted_pages);
  }
  const std::vector<PartitionId> too_many{4, 2, 0};  // 6 pages > 5
  REQUIRE_SPARSEKV_ERROR(cache.step(too_many), ErrorCode::resource_exhausted);
}
