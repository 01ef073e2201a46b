#include <cmath>
#include <vector>

#include "sparsekv/metadata/metadata_footprint.hpp"
#include "test_support.hpp"

using namespace sparsekv;

namespace {

// Builds the working set for real and returns the table's mapped bytes.
MetadataBytes build(const PageTableGeometry& g, const MetadataWorkingSet& ws) {
  HostMemoryResource memory(false);
  HierarchicalPageTable table(g, memory, memory);
  const MetadataHeadCounts c = head_counts(ws, g.page_tokens);
  std::vector<std::uint32_t> tokens(c.partitions, ws.partition_tokens);
  if (ws.context_tokens % ws.partition_tokens != 0) tokens.back() = ws.context_tokens % ws.partition_tokens;
  std::vector<PageId> pages(c.cpu_pages);
  for (PageId i = 0; i < c.cpu_pages; ++i) pages[i] = i;
  for (RequestId r = 0; r < ws.requests; ++r) {
    table.add_request(r);
    for (std::uint32_t l = 0; l < g.layers; ++l) {
      for (std::uint32_t h = 0; h < g.kv_heads; ++h) {
        table.append_partitions(r, l, h, tokens, pages);
        table.resize_gpu_slots(r, l, h, c.gpu_slots);
      }
    }
  }
  table.validate();
  return table.bytes();
}

}  // namespace

TEST_CASE("Footprint model equals the bytes a real table maps", "[metadata]") {
  Config config;
  config.max_requests = 3;
  config.max_context_tokens = 5000;
  config.page_tokens = 8;
  config.metadata_segment_entries = 64;
  const ModelShape shape{3, 4, 2, 64, DType::bf16};
  const PageTableGeometry g = PageTableGeometry::for_config(config, shape);
  for (const MetadataWorkingSet ws : {MetadataWorkingSet{3, 5000, 8, 0.1}, MetadataWorkingSet{2, 1234, 16, 0.25},
                                      MetadataWorkingSet{1, 77, 8, 1.0}}) {
    const MetadataFootprint f = estimate_metadata_footprint(g, config.max_context_tokens, ws);
    const MetadataBytes real = build(g, ws);
    REQUIRE(f.two_level_gpu_bytes == real.gpu_mapped);
    REQUIRE(f.two_level_cpu_bytes == real.cpu_mapped);
    REQUIRE(f.two_level_bytes == real.gpu_mapped + real.cpu_mapped);
    REQUIRE(f.directory_bytes + f.segment_bytes == f.two_level_bytes);
  }
}

TEST_CASE("Flat layout scales with the worst case and two-level with the working set", "[metadata]") {
  Config config;
  config.max_requests = 32;
  config.max_context_tokens = 128 * 1024;
  const ModelShape llama70b{80, 64, 8, 128, DType::bf16};
  const auto g = PageTableGeometry::for_config(config, llama70b);
  const MetadataWorkingSet full{32, 128 * 1024, 8, 0.1};
  const auto f = estimate_metadata_footprint(g, config.max_context_tokens, full);
  // 32 x 80 x 8 heads x 16384 pages x 24 bytes (4 + 12 + 4 + 4).
  REQUIRE(f.flat_bytes == std::size_t{32} * 80 * 8 * 16384 * 24);
  REQUIRE(f.flat_token_granular_bytes == f.flat_bytes * 8);
  REQUIRE(f.two_level_gpu_bytes < f.two_level_bytes);
  REQUIRE(f.two_level_bytes < f.flat_bytes);
  // A shorter working set shrinks the two-level layout but not the flat one.
  const MetadataWorkingSet half{16, 64 * 1024, 8, 0.1};
  const auto h = estimate_metadata_footprint(g, config.max_context_tokens, half);
  REQUIRE(h.flat_bytes == f.flat_bytes);
  // Half the requests at half the context: a quarter of the segments, up to
  // one partly filled GPU-table segment per head.
  REQUIRE(h.segment_bytes * 4 >= f.segment_bytes - std::size_t{32} * 80 * 8 * 256 * sizeof(GpuPageEntry));
  REQUIRE(h.segment_bytes * 4 <= f.segment_bytes + std::size_t{32} * 80 * 8 * 256 * sizeof(GpuPageEntry));
  REQUIRE_SPARSEKV_ERROR(estimate_metadata_footprint(g, config.max_context_tokens, MetadataWorkingSet{33, 1024, 8, 0.1}),
                         ErrorCode::invalid_argument);
  REQUIRE_SPARSEKV_ERROR(estimate_metadata_footprint(g, config.max_context_tokens, MetadataWorkingSet{1, 1024, 8, 1.5}),
                         ErrorCode::invalid_argument);
}
