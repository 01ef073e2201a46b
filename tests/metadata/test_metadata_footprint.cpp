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

// Mapped bytes of a table with no request: its directories alone.
std::size_t directories(const PageTableGeometry& g) {
  HostMemoryResource memory(false);
  const MetadataBytes b = HierarchicalPageTable(g, memory, memory).bytes();
  return b.gpu_mapped + b.cpu_mapped;
}

// 3 requests of up to 5000 tokens, 8-token pages, 64-entry segments; 3 layers, 2 kv heads.
Config small_config() {
  Config config;
  config.max_requests = 3;
  config.max_context_tokens = 5000;
  config.page_tokens = 8;
  config.metadata_segment_entries = 64;
  return config;
}
ModelShape small_shape() { return {3, 4, 2, 64, DType::bf16}; }

}  // namespace

TEST_CASE("Footprint model equals the bytes a real table maps", "[metadata]") {
  const Config config = small_config();
  const ModelShape shape = small_shape();
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

TEST_CASE("Footprint model with slot masks equals a real table's bytes; without, nothing changes",
          "[metadata][slot-masks]") {
  const Config config = small_config();
  const ModelShape shape = small_shape();
  HeadCapacity capacity = config.head_capacity();
  const PageTableGeometry off = PageTableGeometry::for_config(config, shape, capacity);
  capacity.slot_masks = true;
  const PageTableGeometry on = PageTableGeometry::for_config(config, shape, capacity);
  REQUIRE(on.slot_masks);
  // 3 requests x 3 layers x 2 kv heads; the mask directory is as long as the CPU page table's.
  const std::size_t instances = 18;
  const std::size_t mask_directory = 4 * instances * ((on.max_cpu_pages_per_head + 63) / 64 + 1);
  for (const MetadataWorkingSet ws : {MetadataWorkingSet{3, 5000, 8, 0.1}, MetadataWorkingSet{2, 1234, 16, 0.25},
                                      MetadataWorkingSet{1, 77, 8, 1.0}, MetadataWorkingSet{1, 512, 8, 0.5}}) {
    INFO("requests " << ws.requests << ", context " << ws.context_tokens << ", partitions of " << ws.partition_tokens);
    const MetadataFootprint with = estimate_metadata_footprint(on, config.max_context_tokens, ws);
    const MetadataFootprint without = estimate_metadata_footprint(off, config.max_context_tokens, ws);
    const MetadataBytes real = build(on, ws);
    const MetadataBytes real_without = build(off, ws);
    REQUIRE(with.two_level_gpu_bytes == real.gpu_mapped);
    REQUIRE(with.two_level_cpu_bytes == real.cpu_mapped);
    REQUIRE(with.two_level_bytes == real.gpu_mapped + real.cpu_mapped);
    REQUIRE(with.slot_mask_bytes == real.cpu_mapped - real_without.cpu_mapped);
    REQUIRE(with.directory_bytes == directories(on));
    REQUIRE(with.directory_bytes + with.segment_bytes == with.two_level_bytes);
    // Segments: ceil(cpu_pages / E) per live head, 8 B an entry.
    const std::size_t live_heads = std::size_t{ws.requests} * 6;
    const std::size_t pages = head_counts(ws, 8).cpu_pages;
    REQUIRE(with.slot_mask_bytes == mask_directory + live_heads * ((pages + 63) / 64) * 64 * sizeof(SlotMask));

    // Off: no mask bytes anywhere, and the estimate matches a table without masks.
    REQUIRE(without.slot_mask_bytes == 0);
    REQUIRE(without.two_level_cpu_bytes == real_without.cpu_mapped);
    REQUIRE(without.two_level_gpu_bytes == real_without.gpu_mapped);
    REQUIRE(without.directory_bytes == directories(off));
    REQUIRE(with.two_level_gpu_bytes == without.two_level_gpu_bytes);
    REQUIRE(with.two_level_cpu_bytes - without.two_level_cpu_bytes == with.slot_mask_bytes);
    REQUIRE(with.directory_bytes - without.directory_bytes == mask_directory);
    REQUIRE(with.segment_bytes - without.segment_bytes == with.slot_mask_bytes - mask_directory);
    // Flat layouts: 8 B more per page entry (one page per token in the token-granular one).
    REQUIRE(with.flat_bytes - without.flat_bytes == instances * pages_for_tokens(5000, 8) * sizeof(SlotMask));
    REQUIRE(with.flat_token_granular_bytes - without.flat_token_granular_bytes == instances * 5000 * sizeof(SlotMask));
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
  REQUIRE(f.slot_mask_bytes == 0);
  // Slot masks: 8 B more per page entry, 24 + 8 = 32 B.
  HeadCapacity masked = config.head_capacity();
  masked.slot_masks = true;
  const auto m = estimate_metadata_footprint(PageTableGeometry::for_config(config, llama70b, masked),
                                             config.max_context_tokens, full);
  REQUIRE(m.flat_bytes == std::size_t{32} * 80 * 8 * 16384 * 32);
  REQUIRE(m.two_level_gpu_bytes == f.two_level_gpu_bytes);
  REQUIRE(m.two_level_bytes < m.flat_bytes);
  // A shorter working set shrinks the two-level layout but not the flat one.
  const MetadataWorkingSet half{16, 64 * 1024, 8, 0.1};
  const auto h = estimate_metadata_footprint(g, config.max_context_tokens, half);
  REQUIRE(h.flat_bytes == f.flat_bytes);
  // Half the requests at half the context: a quarter of the segments, up to
  // one partly filled GPU-table segment per head.
  REQUIRE(h.segment_bytes * 4 >= f.segment_bytes - std::size_t{32} * 80 * 8 * 256 * sizeof(GpuPageEntry));
  REQUIRE(h.segment_bytes * 4 <= f.segment_bytes + std::size_t{32} * 80 * 8 * 256 * sizeof(GpuPageEntry));
  REQUIRE_SPARSEKV_ERROR(
      estimate_metadata_footprint(g, config.max_context_tokens, MetadataWorkingSet{33, 1024, 8, 0.1}),
      ErrorCode::invalid_argument);
  REQUIRE_SPARSEKV_ERROR(estimate_metadata_footprint(g, config.max_context_tokens, MetadataWorkingSet{1, 1024, 8, 1.5}),
                         ErrorCode::invalid_argument);
}
