// Slot masks in the page table (SpvLLM §2): the fifth table, freed
// tombstones, the invariants validate() checks, the ref-count rule of
// PartitionMap::evict_slots / release_page, and that a table built without
// masks is unchanged.
#include <catch2/catch.hpp>

#include <vector>

#include "sparsekv/metadata/hierarchical_page_table.hpp"
#include "sparsekv/partition/partition_map.hpp"
#include "test_support.hpp"

using namespace sparsekv;
using Catch::Matchers::Contains;

namespace {

PageTableGeometry geometry(bool slot_masks) {
  PageTableGeometry g;
  g.max_requests = 3;
  g.layers = 2;
  g.kv_heads = 2;
  g.page_tokens = 4;
  g.max_partitions_per_head = 100;
  g.max_cpu_pages_per_head = 150;
  g.max_gpu_pages_per_head = 20;
  g.segment_entries = 32;
  g.meta_segments = 12;
  g.offset_segments = 12;
  g.cpu_page_segments = 14;
  g.gpu_page_segments = 8;
  g.slot_masks = slot_masks;
  g.mask_segments = slot_masks ? 14 : 0;
  return g;
}

// Bytes of one TwoLevelTable built for `g` with `max_entries` per head, `segments` in its pool.
std::size_t table_bytes(const PageTableGeometry& g, std::uint32_t max_entries, std::uint32_t segments,
                        std::size_t entry) {
  const std::size_t directory = (max_entries + g.segment_entries - 1) / g.segment_entries;
  return 4 * g.instances() * (directory + 1) + entry * g.segment_entries * segments;
}

// Runs `planted` (which breaks one invariant through a view), checks that
// validate() names it, then runs `restore` and checks validate() passes again.
template <class Plant, class Restore>
void require_caught(const HierarchicalPageTable& table, const char* what, Plant planted, Restore restore) {
  REQUIRE_NOTHROW(table.validate());
  planted();
  bool thrown = false;
  try {
    table.validate();
  } catch (const Error& e) {
    thrown = true;
    INFO(e.what());
    REQUIRE(e.code() == ErrorCode::failed_precondition);
    REQUIRE_THAT(e.what(), Contains(what));
  }
  REQUIRE(thrown);
  restore();
  REQUIRE_NOTHROW(table.validate());
}

}  // namespace

TEST_CASE("Slot masks: a table without them is unchanged and refuses mask calls", "[metadata][slot-masks]") {
  HostMemoryResource memory(false);
  const PageTableGeometry off = geometry(false);
  HierarchicalPageTable table(off, memory, memory);
  REQUIRE_FALSE(table.has_slot_masks());
  // The CPU tier holds exactly the offset and CPU page tables, as before masks existed.
  const MetadataBytes b = table.bytes();
  REQUIRE(b.cpu_reserved == table_bytes(off, off.max_partitions_per_head, off.offset_segments, 4) +
                                table_bytes(off, off.max_cpu_pages_per_head, off.cpu_page_segments, 4));
  HierarchicalPageTable with(geometry(true), memory, memory);
  REQUIRE(with.has_slot_masks());
  REQUIRE(with.bytes().gpu_reserved == b.gpu_reserved);
  REQUIRE(with.bytes().gpu_mapped == b.gpu_mapped);
  const std::size_t mask_table = table_bytes(off, off.max_cpu_pages_per_head, 14, sizeof(SlotMask));
  REQUIRE(with.bytes().cpu_reserved - b.cpu_reserved == mask_table);

  // Growth maps no mask segment; mask calls are refused.
  table.add_request(1);
  with.add_request(1);
  const MetadataBytes with_empty = with.bytes();
  const std::vector<std::uint32_t> tokens(40, 4);
  std::vector<PageId> pages(40);
  for (PageId i = 0; i < 40; ++i) pages[i] = i;
  table.append_partitions(1, 0, 1, tokens, pages);
  with.append_partitions(1, 0, 1, tokens, pages);
  REQUIRE(table.append_demand(1, 0, 1, 30, 30).masks == 0);
  REQUIRE(with.append_demand(1, 0, 1, 30, 30).masks == 1);
  // 40 pages: two segments of the offset and CPU page tables, and of the mask table when there is one.
  REQUIRE(table.bytes().cpu_mapped - b.cpu_mapped == 2 * 32 * (sizeof(PartitionOffset) + sizeof(CpuPageEntry)));
  REQUIRE(with.bytes().cpu_mapped - with_empty.cpu_mapped ==
          2 * 32 * (sizeof(PartitionOffset) + sizeof(CpuPageEntry) + sizeof(SlotMask)));
  REQUIRE_SPARSEKV_ERROR(table.slot_mask(1, 0, 1, 0), ErrorCode::failed_precondition);
  REQUIRE_SPARSEKV_ERROR(table.set_slot_mask(1, 0, 1, 0, 0), ErrorCode::failed_precondition);
  REQUIRE_SPARSEKV_ERROR(table.free_page(1, 0, 1, 0), ErrorCode::failed_precondition);
  REQUIRE_SPARSEKV_ERROR(table.slot_mask_view(), ErrorCode::failed_precondition);
  REQUIRE_NOTHROW(table.validate());
  // set_token_count needs no mask.
  table.truncate_partitions(1, 0, 1, 39);
  table.set_token_count(1, 0, 1, 38, 2);
  REQUIRE(table.meta(1, 0, 1, 38).token_count() == 2);
  REQUIRE_NOTHROW(table.validate());

  // Geometry rules: masks need a pool and pages of at most 64 tokens; a pool needs the flag.
  PageTableGeometry bad = geometry(true);
  bad.mask_segments = 0;
  REQUIRE_SPARSEKV_ERROR(HierarchicalPageTable(bad, memory, memory), ErrorCode::invalid_argument);
  bad = geometry(false);
  bad.mask_segments = 3;
  REQUIRE_SPARSEKV_ERROR(HierarchicalPageTable(bad, memory, memory), ErrorCode::invalid_argument);
  bad = geometry(true);
  bad.page_tokens = 128;
  REQUIRE_SPARSEKV_ERROR(HierarchicalPageTable(bad, memory, memory), ErrorCode::invalid_argument);
  Config config;
  config.cpu_tier_bytes = std::size_t{1} << 26;
  config.gpu_tier_bytes = std::size_t{1} << 24;
  const ModelShape shape{2, 4, 2, 64, DType::bf16};
  HeadCapacity capacity = config.head_capacity();
  REQUIRE(PageTableGeometry::for_config(config, shape, capacity).mask_segments == 0);
  capacity.slot_masks = true;
  const PageTableGeometry sized = PageTableGeometry::for_config(config, shape, capacity);
  REQUIRE(sized.slot_masks);
  REQUIRE(sized.mask_segments == sized.cpu_page_segments);
}

TEST_CASE("Slot masks: set, clear, token counts and segments follow the CPU page table", "[metadata][slot-masks]") {
  HostMemoryResource memory(false);
  HierarchicalPageTable table(geometry(true), memory, memory);
  table.add_request(7);
  // Partitions of 3, 10 (three pages: 4 + 4 + 2) and 4 tokens.
  table.append_partitions(7, 1, 0, std::vector<std::uint32_t>{3, 10, 4}, std::vector<PageId>{11, 12, 13, 14, 15});
  const std::vector<SlotMask> full{0b111, 0b1111, 0b1111, 0b11, 0b1111};
  for (std::uint32_t i = 0; i < 5; ++i) REQUIRE(table.slot_mask(7, 1, 0, i) == full[i]);
  REQUIRE(table.first_page_index(7, 1, 0, 2) == 4);
  REQUIRE(table.slot_mask_view().length(table.instance(7, 1, 0)) == 5);
  REQUIRE(*table.slot_mask_view().find(table.instance(7, 1, 0), 3) == 0b11);

  table.set_slot_mask(7, 1, 0, 3, 0b10);
  REQUIRE(table.slot_mask(7, 1, 0, 3) == 0b10);
  table.set_slot_mask(7, 1, 0, 0, 0);
  REQUIRE(table.slot_mask(7, 1, 0, 0) == 0);
  // Past the page's tokens (page 3 holds 2, page 0 holds 3); past the table.
  REQUIRE_SPARSEKV_ERROR(table.set_slot_mask(7, 1, 0, 3, 0b100), ErrorCode::invalid_argument);
  REQUIRE_SPARSEKV_ERROR(table.set_slot_mask(7, 1, 0, 0, 0b1000), ErrorCode::invalid_argument);
  REQUIRE_SPARSEKV_ERROR(table.set_slot_mask(7, 1, 0, 5, 0), ErrorCode::out_of_range);
  REQUIRE_SPARSEKV_ERROR(table.slot_mask(7, 1, 0, 5), ErrorCode::out_of_range);
  REQUIRE(table.slot_mask(7, 1, 0, 3) == 0b10);
  REQUIRE_NOTHROW(table.validate());

  // The open page grows a token at a time; the new slot is dead until marked.
  table.set_token_count(7, 1, 0, 0, 4);
  REQUIRE(table.meta(7, 1, 0, 0).token_count() == 4);
  REQUIRE(table.slot_mask(7, 1, 0, 0) == 0);
  table.set_slot_mask(7, 1, 0, 0, 0b1001);
  // Shrinking below a live slot, a multi-page partition, 0 or past a page: refused, nothing changes.
  REQUIRE_SPARSEKV_ERROR(table.set_token_count(7, 1, 0, 0, 3), ErrorCode::failed_precondition);
  REQUIRE_SPARSEKV_ERROR(table.set_token_count(7, 1, 0, 1, 4), ErrorCode::invalid_argument);
  REQUIRE_SPARSEKV_ERROR(table.set_token_count(7, 1, 0, 0, 0), ErrorCode::invalid_argument);
  REQUIRE_SPARSEKV_ERROR(table.set_token_count(7, 1, 0, 0, 5), ErrorCode::invalid_argument);
  REQUIRE_SPARSEKV_ERROR(table.set_token_count(7, 1, 0, 3, 1), ErrorCode::out_of_range);
  REQUIRE(table.meta(7, 1, 0, 0).token_count() == 4);
  // Residency survives a count change.
  table.set_resident(7, 1, 0, 2, true);
  table.resize_gpu_slots(7, 1, 0, 1);
  table.set_gpu_entry(7, 1, 0, 0, GpuPageEntry{2, 3, 0, 0, 0});
  table.set_slot_mask(7, 1, 0, 4, 0b0011);
  table.set_token_count(7, 1, 0, 2, 2);
  REQUIRE(table.meta(7, 1, 0, 2).resident());
  REQUIRE(table.meta(7, 1, 0, 2).token_count() == 2);
  REQUIRE_NOTHROW(table.validate());
  table.set_gpu_entry(7, 1, 0, 0, GpuPageEntry{});
  table.set_resident(7, 1, 0, 2, false);
  table.resize_gpu_slots(7, 1, 0, 0);

  // Truncation drops masks with the pages; pages appended again start full.
  table.truncate_partitions(7, 1, 0, 1);
  REQUIRE(table.slot_mask_view().length(table.instance(7, 1, 0)) == 1);
  table.append_partitions(7, 1, 0, std::vector<std::uint32_t>{2}, std::vector<PageId>{20});
  REQUIRE(table.slot_mask(7, 1, 0, 1) == 0b11);
  // Mask segments are taken and returned with the CPU page table's.
  const MetadataBytes before = table.bytes();
  const std::vector<std::uint32_t> ones(40, 1);
  const std::vector<PageId> pages(40, 1);
  REQUIRE(table.append_demand(7, 1, 0, 40, 40).masks == 1);
  table.append_partitions(7, 1, 0, ones, pages);
  REQUIRE(table.bytes().cpu_mapped - before.cpu_mapped == 32 * (sizeof(PartitionOffset) + sizeof(CpuPageEntry) + 8));
  table.clear_partitions(7, 1, 0);
  table.remove_request(7);
  REQUIRE(table.bytes().cpu_mapped == HierarchicalPageTable(geometry(true), memory, memory).bytes().cpu_mapped);
  REQUIRE_NOTHROW(table.validate());
}

TEST_CASE("Slot masks: the mask pool runs short on its own", "[metadata][slot-masks][errors]") {
  HostMemoryResource memory(false);
  PageTableGeometry g = geometry(true);
  g.mask_segments = 1;  // other pools hold more
  HierarchicalPageTable table(g, memory, memory);
  table.add_request(1);
  const std::vector<std::uint32_t> ones(33, 1);
  const std::vector<PageId> pages(33, 1);
  REQUIRE(table.segment_shortfall(table.append_demand(1, 0, 0, 33, 33)).find("slot mask table") == 0);
  REQUIRE_SPARSEKV_ERROR(table.append_partitions(1, 0, 0, ones, pages), ErrorCode::resource_exhausted);
  REQUIRE(table.partition_count(1, 0, 0) == 0);
  REQUIRE(table.cpu_page_count(1, 0, 0) == 0);
  REQUIRE_NOTHROW(table.validate());
}

TEST_CASE("Slot masks: freed tombstones keep partition ids", "[metadata][slot-masks]") {
  HostMemoryResource memory(false);
  HierarchicalPageTable table(geometry(true), memory, memory);
  table.add_request(2);
  table.append_partitions(2, 0, 0, std::vector<std::uint32_t>{4, 8, 3}, std::vector<PageId>{5, 6, 7, 8});
  table.resize_gpu_slots(2, 0, 0, 2);
  table.set_gpu_entry(2, 0, 0, 0, GpuPageEntry{2, 40, 0, 0, 0});
  table.set_resident(2, 0, 0, 2, true);
  REQUIRE_SPARSEKV_ERROR(table.free_page(2, 0, 0, 2), ErrorCode::failed_precondition);  // resident
  REQUIRE_SPARSEKV_ERROR(table.free_page(2, 0, 0, 1), ErrorCode::invalid_argument);     // two pages
  REQUIRE_SPARSEKV_ERROR(table.free_page(2, 0, 0, 3), ErrorCode::out_of_range);
  REQUIRE_FALSE(table.partition_freed(2, 0, 0, 0));

  REQUIRE(table.free_page(2, 0, 0, 0) == 5);
  REQUIRE(table.partition_freed(2, 0, 0, 0));
  REQUIRE(table.partition_count(2, 0, 0) == 3);
  REQUIRE(table.meta(2, 0, 0, 0).token_count() == 4);  // the tombstone keeps its count
  std::vector<PageId> held;
  table.cpu_pages(2, 0, 0, 0, held);
  REQUIRE(held == std::vector<PageId>{kInvalidPage});
  REQUIRE(table.slot_mask(2, 0, 0, 0) == 0);
  REQUIRE_NOTHROW(table.validate());
  // A tombstone takes no live slot, no residency, no GPU slot, no count change, no second free.
  REQUIRE_SPARSEKV_ERROR(table.set_slot_mask(2, 0, 0, 0, 1), ErrorCode::failed_precondition);
  REQUIRE_NOTHROW(table.set_slot_mask(2, 0, 0, 0, 0));
  REQUIRE_SPARSEKV_ERROR(table.set_resident(2, 0, 0, 0, true), ErrorCode::failed_precondition);
  REQUIRE_SPARSEKV_ERROR(table.set_gpu_entry(2, 0, 0, 1, GpuPageEntry{0, 41, 0, 0, 0}), ErrorCode::failed_precondition);
  REQUIRE_SPARSEKV_ERROR(table.set_token_count(2, 0, 0, 0, 2), ErrorCode::failed_precondition);
  REQUIRE_SPARSEKV_ERROR(table.free_page(2, 0, 0, 0), ErrorCode::failed_precondition);
  REQUIRE(table.gpu_entry(2, 0, 0, 1).partition == kInvalidPartition);
  REQUIRE_FALSE(table.meta(2, 0, 0, 0).resident());
  REQUIRE_NOTHROW(table.validate());

  // The last partition freed too; a later append takes the next id.
  table.set_gpu_entry(2, 0, 0, 0, GpuPageEntry{});
  table.set_resident(2, 0, 0, 2, false);
  REQUIRE(table.free_page(2, 0, 0, 2) == 8);
  table.append_partitions(2, 0, 0, std::vector<std::uint32_t>{1}, std::vector<PageId>{9});
  REQUIRE(table.partition_count(2, 0, 0) == 4);
  REQUIRE(table.slot_mask(2, 0, 0, 4) == 1);
  REQUIRE_NOTHROW(table.validate());
  table.resize_gpu_slots(2, 0, 0, 0);
  table.clear_partitions(2, 0, 0);
  table.remove_request(2);
  REQUIRE_NOTHROW(table.validate());
}

TEST_CASE("Slot masks: validate() catches each planted violation", "[metadata][slot-masks][errors]") {
  HostMemoryResource memory(false);
  HierarchicalPageTable table(geometry(true), memory, memory);
  table.add_request(3);
  table.append_partitions(3, 1, 1, std::vector<std::uint32_t>{3, 6, 4}, std::vector<PageId>{1, 2, 3, 4});
  table.free_page(3, 1, 1, 2);  // partition 2 (page 3) is a tombstone
  const std::size_t inst = table.instance(3, 1, 1);
  const TwoLevelView<SlotMask> masks = table.slot_mask_view();
  const TwoLevelView<CpuPageEntry> cpu = table.cpu_page_view();
  const TwoLevelView<MetaPartitionEntry> meta = table.meta_view();

  // A live bit at or past the page's tokens (page 0 holds 3; page 2 holds 2).
  require_caught(
      table, "at or past its 3 tokens", [&] { *masks.find(inst, 0) = 0b1000; }, [&] { *masks.find(inst, 0) = 0b111; });
  require_caught(
      table, "at or past its 2 tokens", [&] { *masks.find(inst, 2) = 0b111; }, [&] { *masks.find(inst, 2) = 0b11; });
  // kInvalidPage on a partition that still holds another page.
  require_caught(
      table, "mixes freed and held", [&] { *cpu.find(inst, 2) = kInvalidPage; }, [&] { *cpu.find(inst, 2) = 3; });
  // A freed partition with a live slot.
  require_caught(
      table, "freed partition 2 has a live slot", [&] { *masks.find(inst, 3) = 1; }, [&] { *masks.find(inst, 3) = 0; });
  // A freed partition marked resident.
  require_caught(
      table, "freed partition 2 is resident", [&] { *meta.find(inst, 2) = MetaPartitionEntry::make(4, true); },
      [&] { *meta.find(inst, 2) = MetaPartitionEntry::make(4, false); });
  // Mask table length out of step with the CPU page table (same segment count).
  auto* lengths = const_cast<std::uint32_t*>(masks.lengths);
  require_caught(
      table, "slot mask table length", [&] { lengths[inst] = 3; }, [&] { lengths[inst] = 4; });
  // kInvalidPage in a table without masks.
  HierarchicalPageTable plain(geometry(false), memory, memory);
  plain.add_request(3);
  plain.append_partitions(3, 1, 1, std::vector<std::uint32_t>{2}, std::vector<PageId>{8});
  const std::size_t plain_inst = plain.instance(3, 1, 1);
  require_caught(
      plain, "without slot masks", [&] { *plain.cpu_page_view().find(plain_inst, 0) = kInvalidPage; },
      [&] { *plain.cpu_page_view().find(plain_inst, 0) = 8; });
}

TEST_CASE("PartitionMap: evict_slots and release_page follow the ref-count rule", "[partition][slot-masks]") {
  HostMemoryResource memory(false);
  HierarchicalPageTable table(geometry(true), memory, memory);
  PagePool pool(PageLayout{4, 8, DType::f32}, 64, memory);
  PartitionMap map(table, pool);
  table.add_request(1);
  table.add_request(2);
  map.map(1, 0, 0, PartitionSpec::uniform(10, 4));  // partitions of 4, 4, 2 tokens
  map.map(1, 0, 0, PartitionSpec::uniform(8, 8));   // partition 3: two pages
  REQUIRE(pool.used() == 5);

  REQUIRE(map.evict_slots(1, 0, 0, 0, 0b0101) == 0b1010);
  REQUIRE(table.slot_mask(1, 0, 0, 0) == 0b1010);
  // Not live (evicted twice, past the tokens), several pages, released with live slots: nothing changes.
  REQUIRE_SPARSEKV_ERROR(map.evict_slots(1, 0, 0, 0, 0b0001), ErrorCode::invalid_argument);
  REQUIRE_SPARSEKV_ERROR(map.evict_slots(1, 0, 0, 2, 0b0100), ErrorCode::invalid_argument);
  REQUIRE_SPARSEKV_ERROR(map.evict_slots(1, 0, 0, 3, 0b0001), ErrorCode::invalid_argument);
  REQUIRE_SPARSEKV_ERROR(map.release_page(1, 0, 0, 0), ErrorCode::failed_precondition);
  REQUIRE(table.slot_mask(1, 0, 0, 0) == 0b1010);
  REQUIRE(map.evict_slots(1, 0, 0, 0, 0b1010) == 0);
  REQUIRE(map.release_page(1, 0, 0, 0));
  REQUIRE(pool.used() == 4);
  REQUIRE(table.partition_freed(1, 0, 0, 0));
  REQUIRE_SPARSEKV_ERROR(map.evict_slots(1, 0, 0, 0, 0), ErrorCode::failed_precondition);
  REQUIRE_SPARSEKV_ERROR(map.release_page(1, 0, 0, 0), ErrorCode::failed_precondition);
  REQUIRE_NOTHROW(table.validate());

  // A tombstone takes a fresh page again: one live token in slot 0; a held partition is refused, changing nothing.
  REQUIRE_SPARSEKV_ERROR(map.reuse_freed(1, 0, 0, 1), ErrorCode::failed_precondition);
  REQUIRE_SPARSEKV_ERROR(table.reuse_freed(1, 0, 0, 1, 7), ErrorCode::failed_precondition);
  REQUIRE_SPARSEKV_ERROR(table.reuse_freed(1, 0, 0, 0, kInvalidPage), ErrorCode::invalid_argument);
  REQUIRE(pool.used() == 4);
  const PageId fresh = map.reuse_freed(1, 0, 0, 0);
  REQUIRE(pool.used() == 5);
  REQUIRE_FALSE(table.partition_freed(1, 0, 0, 0));
  REQUIRE(map.pages(1, 0, 0, 0) == std::vector<PageId>{fresh});
  REQUIRE(table.meta(1, 0, 0, 0).token_count() == 1);
  REQUIRE_FALSE(table.meta(1, 0, 0, 0).resident());
  REQUIRE(table.slot_mask(1, 0, 0, 0) == 0b1);
  REQUIRE(table.partition_count(1, 0, 0) == 4);
  REQUIRE_NOTHROW(table.validate());
  REQUIRE(map.evict_slots(1, 0, 0, 0, 0b1) == 0);
  REQUIRE(map.release_page(1, 0, 0, 0));
  REQUIRE(pool.used() == 4);

  // A prefix holding a freed partition cannot be shared.
  REQUIRE_SPARSEKV_ERROR(map.map_shared_prefix(2, 1, 0, 0, 2), ErrorCode::failed_precondition);
  REQUIRE(table.partition_count(2, 0, 0) == 0);
  REQUIRE(pool.used() == 4);
  map.map(1, 1, 0, PartitionSpec::uniform(7, 4));  // partitions of 4 and 3 tokens
  map.evict_slots(1, 1, 0, 1, 0b010);
  map.map_shared_prefix(2, 1, 1, 0, 2);
  REQUIRE(table.slot_mask(2, 1, 0, 1) == 0b101);  // the sharer sees the source's dead slot as dead
  REQUIRE(table.slot_mask(2, 1, 0, 0) == 0b1111);
  // Shared pages are masked by neither request; a refusal changes nothing.
  REQUIRE_SPARSEKV_ERROR(map.evict_slots(2, 1, 0, 0, 0b1), ErrorCode::failed_precondition);
  REQUIRE_SPARSEKV_ERROR(map.evict_slots(1, 1, 0, 1, 0b1), ErrorCode::failed_precondition);
  REQUIRE(table.slot_mask(1, 1, 0, 1) == 0b101);
  REQUIRE(table.slot_mask(2, 1, 0, 0) == 0b1111);
  // Once the other request lets go, the page is the source's alone again.
  map.unmap(2);
  REQUIRE(map.evict_slots(1, 1, 0, 1, 0b101) == 0);
  REQUIRE(map.release_page(1, 1, 0, 1));

  // truncate and unmap skip tombstones: every page goes back exactly once.
  map.truncate(1, 1, 0, 0);  // partition 0 and the tombstone 1
  REQUIRE(pool.used() == 4);
  map.truncate(1, 0, 0, 2);  // keeps the tombstone 0 and partition 1
  REQUIRE(pool.used() == 1);
  REQUIRE_NOTHROW(table.validate());
  map.unmap(1);
  REQUIRE(pool.used() == 0);
  REQUIRE_NOTHROW(table.validate());
}
