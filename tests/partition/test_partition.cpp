#include <algorithm>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include "sparsekv/partition/partition_map.hpp"
#include "test_support.hpp"

using namespace sparsekv;

namespace {

PageTableGeometry geometry() {
  PageTableGeometry g;
  g.max_requests = 3;
  g.layers = 2;
  g.kv_heads = 2;
  g.page_tokens = 4;
  g.max_partitions_per_head = 128;
  g.max_cpu_pages_per_head = 256;
  g.max_gpu_pages_per_head = 64;
  g.segment_entries = 32;
  g.meta_segments = g.offset_segments = 64;
  g.cpu_page_segments = 64;
  g.gpu_page_segments = 16;
  return g;
}

struct Fixture {
  HostMemoryResource memory{false};
  HierarchicalPageTable table{geometry(), memory, memory};
  PagePool pool{PageLayout{4, 8, DType::f32}, 200, memory, 64};
  PartitionMap map{table, pool};
};

}  // namespace

TEST_CASE("PartitionSpec uniform and variable", "[partition]") {
  const auto uniform = PartitionSpec::uniform(10, 4);
  REQUIRE(uniform.partition_count() == 3);
  REQUIRE(uniform.size(2) == 2);
  REQUIRE(uniform.token(1, 3) == 7);
  const auto clusters = PartitionSpec::variable(6, {{5, 0}, {1, 2, 3}, {4}});
  REQUIRE_FALSE(clusters.is_uniform());
  REQUIRE(clusters.partition_count() == 3);
  REQUIRE(clusters.size(1) == 3);
  REQUIRE(clusters.token(0, 0) == 5);
  REQUIRE_SPARSEKV_ERROR(clusters.token(2, 1), ErrorCode::out_of_range);
  REQUIRE_SPARSEKV_ERROR(clusters.size(3), ErrorCode::out_of_range);
}

TEST_CASE("PartitionSpec rejects specs that lose or duplicate tokens", "[partition][errors]") {
  REQUIRE_SPARSEKV_ERROR(PartitionSpec::uniform(0, 4), ErrorCode::invalid_argument);
  REQUIRE_SPARSEKV_ERROR(PartitionSpec::uniform(4, 0), ErrorCode::invalid_argument);
  REQUIRE_SPARSEKV_ERROR(PartitionSpec::variable(4, {{0, 1}, {2}}), ErrorCode::invalid_argument);     // token 3 lost
  REQUIRE_SPARSEKV_ERROR(PartitionSpec::variable(3, {{0, 1}, {1, 2}}), ErrorCode::invalid_argument);  // duplicate
  REQUIRE_SPARSEKV_ERROR(PartitionSpec::variable(3, {{0, 1, 2}, {}}), ErrorCode::invalid_argument);   // empty
  REQUIRE_SPARSEKV_ERROR(PartitionSpec::variable(2, {{0, 7}}), ErrorCode::invalid_argument);          // range
  REQUIRE_SPARSEKV_ERROR(PartitionSpec::variable(2, {1, 2}, {0, 1}), ErrorCode::invalid_argument);    // offsets
}

TEST_CASE("PartitionMap places every token of a variable spec in its partition's pages", "[partition]") {
  Fixture f;
  f.table.add_request(1);
  std::mt19937 rng(5);
  // 60 tokens shuffled into clusters of random size (RetroInfer-style variable partitions).
  std::vector<std::uint32_t> order(60);
  std::iota(order.begin(), order.end(), 0u);
  std::shuffle(order.begin(), order.end(), rng);
  std::vector<std::vector<std::uint32_t>> clusters;
  for (std::size_t i = 0; i < order.size();) {
    const std::size_t n = std::min<std::size_t>(1 + rng() % 11, order.size() - i);
    clusters.emplace_back(order.begin() + i, order.begin() + i + n);
    i += n;
  }
  const auto spec = PartitionSpec::variable(60, clusters);
  const MappedPartitions mapped = f.map.map(1, 1, 0, spec);
  REQUIRE(mapped.first_partition == 0);
  REQUIRE(f.map.partition_count(1, 1, 0) == clusters.size());
  std::set<std::pair<PageId, std::uint32_t>> rows;
  for (std::uint32_t p = 0; p < clusters.size(); ++p) {
    const auto pages = f.map.pages(1, 1, 0, p);
    REQUIRE(pages.size() == (clusters[p].size() + 3) / 4);
    REQUIRE(f.map.token_count(1, 1, 0, p) == clusters[p].size());
    for (std::uint32_t i = 0; i < clusters[p].size(); ++i) {
      const TokenPlacement where = mapped.placements[clusters[p][i]];
      REQUIRE(where.cpu_page == pages[i / 4]);  // packed in spec order
      REQUIRE(where.slot == i % 4);
      REQUIRE(rows.insert({where.cpu_page, where.slot}).second);  // no two tokens share a row
    }
  }
  // A second chunk appends partitions after the first.
  const MappedPartitions next = f.map.map(1, 1, 0, PartitionSpec::uniform(9, 4));
  REQUIRE(next.first_partition == clusters.size());
  REQUIRE(f.map.partition_count(1, 1, 0) == clusters.size() + 3);
  f.table.validate();
}

TEST_CASE("PartitionMap is all or nothing when the pool or the tables are full", "[partition][errors]") {
  Fixture f;
  f.table.add_request(1);
  f.map.map(1, 0, 0, PartitionSpec::uniform(4 * 190, 8));  // 95 two-page partitions: 190 of 200 pages
  const std::uint32_t used = f.pool.used();
  const auto bytes = f.table.bytes();
  REQUIRE_SPARSEKV_ERROR(f.map.map(1, 0, 1, PartitionSpec::uniform(4 * 11, 4)), ErrorCode::resource_exhausted);
  REQUIRE(f.pool.used() == used);
  REQUIRE(f.table.partition_count(1, 0, 1) == 0);
  REQUIRE(f.table.bytes().cpu_mapped == bytes.cpu_mapped);
  // Enough pages, but the head's partition table is full: pages go back.
  f.map.unmap(1);
  f.map.map(1, 0, 0, PartitionSpec::uniform(120, 1));
  const std::uint32_t used2 = f.pool.used();
  REQUIRE_SPARSEKV_ERROR(f.map.map(1, 0, 0, PartitionSpec::uniform(9, 1)), ErrorCode::resource_exhausted);
  REQUIRE(f.pool.used() == used2);
  REQUIRE(f.table.partition_count(1, 0, 0) == 120);
  REQUIRE_SPARSEKV_ERROR(f.map.map(7, 0, 0, PartitionSpec::uniform(4, 4)), ErrorCode::not_found);
  REQUIRE_SPARSEKV_ERROR(f.map.map(1, 2, 0, PartitionSpec::uniform(4, 4)), ErrorCode::out_of_range);
  REQUIRE(f.pool.used() == used2);
  f.table.validate();
}

TEST_CASE("PartitionMap shares a prefix by reference count and frees it with its last user", "[partition]") {
  Fixture f;
  f.table.add_request(1);
  f.table.add_request(2);
  f.map.map(1, 0, 1, PartitionSpec::uniform(20, 4));  // 5 one-page partitions
  f.map.map_shared_prefix(2, 1, 0, 1, 3);
  REQUIRE(f.map.partition_count(2, 0, 1) == 3);
  for (PartitionId p = 0; p < 3; ++p) {
    REQUIRE(f.map.pages(2, 0, 1, p) == f.map.pages(1, 0, 1, p));
    REQUIRE(f.pool.ref_count(f.map.pages(1, 0, 1, p)[0]) == 2);
  }
  REQUIRE(f.pool.used() == 5);
  REQUIRE_SPARSEKV_ERROR(f.map.map_shared_prefix(2, 1, 0, 1, 6), ErrorCode::out_of_range);
  REQUIRE_SPARSEKV_ERROR(f.map.map_shared_prefix(1, 1, 0, 1, 1), ErrorCode::invalid_argument);
  REQUIRE(f.pool.ref_count(f.map.pages(1, 0, 1, 0)[0]) == 2);
  f.map.unmap(1);
  REQUIRE(f.pool.used() == 3);  // the shared prefix lives on
  const PageId shared = f.map.pages(2, 0, 1, 0)[0];
  REQUIRE(f.pool.ref_count(shared) == 1);
  f.map.unmap(2);
  REQUIRE(f.pool.used() == 0);
  f.table.remove_request(1);
  f.table.remove_request(2);
  f.table.validate();
}

TEST_CASE("PartitionMap refuses to unmap resident partitions", "[partition][errors]") {
  Fixture f;
  f.table.add_request(1);
  f.map.map(1, 0, 0, PartitionSpec::uniform(8, 4));
  f.table.resize_gpu_slots(1, 0, 0, 1);
  f.table.set_gpu_entry(1, 0, 0, 0, GpuPageEntry{1, 0, 0, 63, 0});
  f.table.set_resident(1, 0, 0, 1, true);
  const std::uint32_t used = f.pool.used();
  REQUIRE_SPARSEKV_ERROR(f.map.unmap(1), ErrorCode::failed_precondition);
  REQUIRE(f.pool.used() == used);
  REQUIRE(f.table.partition_count(1, 0, 0) == 2);
  HostMemoryResource memory(false);
  PagePool wrong_pool(PageLayout{8, 8, DType::f32}, 4, memory);
  REQUIRE_SPARSEKV_ERROR(PartitionMap(f.table, wrong_pool), ErrorCode::invalid_argument);
}
