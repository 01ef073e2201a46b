#pragma once
// HierarchicalPageTable: the four metadata tables of Spin §5.2 with the
// two-level indexing of Spin §5.4.
//
//   table                  tier  indexed by             entry
//   meta-partition         GPU   partition id           token count, residency
//   GPU page table         GPU   GPU buffer slot        partition, GPU page, timestamp
//   partition offset       CPU   partition id           first index in the CPU page table
//   CPU page table         CPU   flat page index        CPU page id
//   slot mask (optional)   CPU   flat page index        live slots of the page
//
// Each table keeps, per (request, layer, kv head), a logical array behind a
// static directory; segments come from a per-table SegmentPool on demand and
// return when the request is removed. The host backend keeps all four tables
// in host memory and accounts each to its tier; the CUDA backend reads the
// CPU-tier tables from pinned memory through the same TwoLevelView.
//
// Slot masks (SpvLLM §2, permanent token eviction) are a fifth table,
// parallel to the CPU page table and grown and shrunk with it, built only when
// the geometry asks for them. A partition whose page has been released stays
// in the tables as a *freed* tombstone (CPU page kInvalidPage, mask 0), so
// that partition ids never change.
//
// Not thread-safe. Every call that throws changes nothing.
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "sparsekv/core/config.hpp"
#include "sparsekv/core/ids.hpp"
#include "sparsekv/core/model_shape.hpp"
#include "sparsekv/memory/page_layout.hpp"
#include "sparsekv/metadata/page_table_entries.hpp"
#include "sparsekv/metadata/partition_lookup.hpp"
#include "sparsekv/metadata/two_level_table.hpp"

namespace sparsekv {

// Sizes the directories and segment pools are built for.
struct PageTableGeometry {
  std::uint32_t max_requests = 0;
  std::uint32_t layers = 0;
  std::uint32_t kv_heads = 0;
  std::uint32_t page_tokens = 8;
  std::uint32_t max_partitions_per_head = 0;  // directory length of the partition tables
  std::uint32_t max_cpu_pages_per_head = 0;   // directory length of the CPU page table
  std::uint32_t max_gpu_pages_per_head = 0;   // directory length of the GPU page table
  std::uint32_t segment_entries = 256;
  // Segment pool capacity of each table, shared by all requests and heads.
  std::uint32_t meta_segments = 0;
  std::uint32_t gpu_page_segments = 0;
  std::uint32_t offset_segments = 0;
  std::uint32_t cpu_page_segments = 0;
  // A SlotMask per CPU page (requests that evict tokens); mask_segments is
  // that table's pool and must be 0 without it. Pages then hold at most
  // kMaxMaskedPageTokens tokens.
  bool slot_masks = false;
  std::uint32_t mask_segments = 0;

  // Directories sized for Config's max_requests and `capacity` per head
  // (Config::head_capacity() unless a policy declares its own); pools sized
  // for the pages the two tiers can hold, plus one partly filled segment per
  // head and table. `capacity.slot_masks` adds the slot mask table, its pool
  // sized like the CPU page table's.
  static PageTableGeometry for_config(const Config& config, const ModelShape& shape);
  static PageTableGeometry for_config(const Config& config, const ModelShape& shape, const HeadCapacity& capacity);
  void validate() const;
  std::size_t instances() const noexcept { return std::size_t{max_requests} * layers * kv_heads; }
};

// Bytes per tier. `reserved` counts directories plus whole pre-allocated pools;
// `mapped` counts directories plus the segments in use.
struct MetadataBytes {
  std::size_t gpu_reserved = 0;
  std::size_t cpu_reserved = 0;
  std::size_t gpu_mapped = 0;
  std::size_t cpu_mapped = 0;
};

// Segments an operation would take from each pool. Callers that change many
// heads at once sum the demands and check them before changing any head.
struct SegmentDemand {
  std::uint64_t meta = 0;
  std::uint64_t gpu_pages = 0;
  std::uint64_t offsets = 0;
  std::uint64_t cpu_pages = 0;
  std::uint64_t masks = 0;
  SegmentDemand& operator+=(const SegmentDemand& o) {
    meta += o.meta;
    gpu_pages += o.gpu_pages;
    offsets += o.offsets;
    cpu_pages += o.cpu_pages;
    masks += o.masks;
    return *this;
  }
};

class HierarchicalPageTable {
 public:
  // `gpu_tier` backs the meta-partition and GPU page tables, `cpu_tier` the
  // partition offset and CPU page tables. Both must outlive the table.
  HierarchicalPageTable(const PageTableGeometry& geometry, MemoryResource& gpu_tier, MemoryResource& cpu_tier);

  // Requests. add_request throws already_exists / resource_exhausted (no slot).
  // remove_request returns every segment of the request; it refuses
  // (failed_precondition) while any head still maps CPU pages or GPU slots:
  // the pages are the caller's to release first (all_cpu_pages() lists them).
  void add_request(RequestId request);
  void remove_request(RequestId request);
  bool has_request(RequestId request) const noexcept { return slots_.contains(request); }
  std::size_t request_count() const noexcept { return slots_.size(); }

  // Partitions: appends partitions with the given token counts whose pages are
  // `cpu_pages` in order (sum of ceil(tokens / page_tokens) ids). All
  // partition-side tables grow together or not at all; each new page's slot
  // mask has its tokens live.
  void append_partitions(RequestId request, std::uint32_t layer, std::uint32_t head,
                         std::span<const std::uint32_t> token_counts, std::span<const PageId> cpu_pages);
  // Segments appending `partitions` partitions of `pages` CPU pages to one head
  // would take; throws resource_exhausted past the per-head maxima.
  SegmentDemand append_demand(RequestId request, std::uint32_t layer, std::uint32_t head, std::uint64_t partitions,
                              std::uint64_t pages) const;
  // Net segments replacing partitions [keep, end) of one head by `partitions`
  // partitions of `pages` CPU pages would take (the dropped entries' segments
  // are reused); append_demand is the case keep == partition_count.
  SegmentDemand replace_demand(RequestId request, std::uint32_t layer, std::uint32_t head, std::uint32_t keep,
                               std::uint64_t partitions, std::uint64_t pages) const;
  // Segments growing one head's GPU page table to `slots` would take.
  SegmentDemand gpu_slots_demand(RequestId request, std::uint32_t layer, std::uint32_t head, std::uint32_t slots) const;
  // Throws resource_exhausted naming the first pool that cannot supply `demand`.
  void check_segments(const SegmentDemand& demand) const;
  // What check_segments would throw, without throwing; empty when every pool can supply `demand`.
  std::string segment_shortfall(const SegmentDemand& demand) const;
  // Keeps the first `partitions` partitions of one head and drops the rest
  // (their CPU pages are the caller's to release first); refuses while a GPU
  // slot caches a dropped one.
  void truncate_partitions(RequestId request, std::uint32_t layer, std::uint32_t head, std::uint32_t partitions);
  // Drops every partition of one head; refuses while a GPU slot caches any.
  void clear_partitions(RequestId request, std::uint32_t layer, std::uint32_t head);
  std::uint32_t partition_count(RequestId request, std::uint32_t layer, std::uint32_t head) const;
  std::uint32_t cpu_page_count(RequestId request, std::uint32_t layer, std::uint32_t head) const;
  MetaPartitionEntry meta(RequestId request, std::uint32_t layer, std::uint32_t head, PartitionId partition) const;
  void set_resident(RequestId request, std::uint32_t layer, std::uint32_t head, PartitionId partition, bool resident);
  std::uint32_t page_count(RequestId request, std::uint32_t layer, std::uint32_t head, PartitionId partition) const;
  // Appends the partition's CPU page ids to `out`, in page order.
  void cpu_pages(RequestId request, std::uint32_t layer, std::uint32_t head, PartitionId partition,
                 std::vector<PageId>& out) const;
  // Every CPU page id of one head, in page order (kInvalidPage for freed partitions).
  void all_cpu_pages(RequestId request, std::uint32_t layer, std::uint32_t head, std::vector<PageId>& out) const;
  // Index of the partition's first page in the head's CPU page table (and slot mask table).
  std::uint32_t first_page_index(RequestId request, std::uint32_t layer, std::uint32_t head,
                                 PartitionId partition) const;
  // Changes the token count of a one-page, unfreed partition to `tokens` in
  // [1, page_tokens] (a request that evicts fills its open page a token at a
  // time). Residency is kept; a slot at or past the new count must not be live.
  void set_token_count(RequestId request, std::uint32_t layer, std::uint32_t head, PartitionId partition,
                       std::uint32_t tokens);

  // Slot masks; the calls below throw failed_precondition when the geometry
  // has none. `page_index` indexes the head's CPU page table.
  bool has_slot_masks() const noexcept { return masks_.has_value(); }
  SlotMask slot_mask(RequestId request, std::uint32_t layer, std::uint32_t head, std::uint32_t page_index) const;
  // Refuses (invalid_argument) a live bit at or past the page's token count,
  // and (failed_precondition) a live bit on a freed page.
  void set_slot_mask(RequestId request, std::uint32_t layer, std::uint32_t head, std::uint32_t page_index,
                     SlotMask mask);
  // Turns a one-page partition into a freed tombstone: its CPU page entry
  // becomes kInvalidPage and its mask 0; returns the page it held, which is
  // the caller's to release. Refuses a resident or already freed partition.
  PageId free_page(RequestId request, std::uint32_t layer, std::uint32_t head, PartitionId partition);
  // Maps CPU page `page` into a freed tombstone, making it a one-page
  // partition of one live token (slot 0), not resident: a request that evicts
  // reuses the ids of its freed pages, so its table never holds more
  // partitions than pages it can hold at once. Refuses (failed_precondition)
  // a partition that is not freed and (invalid_argument) an invalid page.
  void reuse_freed(RequestId request, std::uint32_t layer, std::uint32_t head, PartitionId partition, PageId page);
  // Points a one-page, unfreed partition at CPU page `page` instead (a
  // private copy of the page it shares); returns the page it held, the
  // caller's to release. Mask, token count and residency are kept.
  PageId replace_page(RequestId request, std::uint32_t layer, std::uint32_t head, PartitionId partition, PageId page);
  bool partition_freed(RequestId request, std::uint32_t layer, std::uint32_t head, PartitionId partition) const;

  // GPU page table: `gpu_slots` entries per head, the head's GPU buffer. Each
  // slot may own a page of the GPU-tier pool. Shrinking drops slots from the
  // tail; dropped slots must be empty and own no GPU page (release it first).
  std::uint32_t gpu_slots(RequestId request, std::uint32_t layer, std::uint32_t head) const;
  void resize_gpu_slots(RequestId request, std::uint32_t layer, std::uint32_t head, std::uint32_t slots);
  GpuPageEntry gpu_entry(RequestId request, std::uint32_t layer, std::uint32_t head, std::uint32_t slot) const;
  // Writes a slot; an occupied entry must name an existing partition and page.
  void set_gpu_entry(RequestId request, std::uint32_t layer, std::uint32_t head, std::uint32_t slot,
                     const GpuPageEntry& entry);

  // Checks every cross-table invariant (docs/metadata.md); throws
  // ErrorCode::failed_precondition describing the first violation.
  void validate() const;

  MetadataBytes bytes() const noexcept;
  const PageTableGeometry& geometry() const noexcept { return geometry_; }

  // The plain-data views kernels index through; instance() numbers a head as
  // (request slot * layers + layer) * kv_heads + head.
  TwoLevelView<MetaPartitionEntry> meta_view() const noexcept { return meta_.view(); }
  TwoLevelView<GpuPageEntry> gpu_page_view() const noexcept { return gpu_pages_.view(); }
  TwoLevelView<PartitionOffset> offset_view() const noexcept { return offsets_.view(); }
  TwoLevelView<CpuPageEntry> cpu_page_view() const noexcept { return cpu_pages_.view(); }
  // Throws failed_precondition when the geometry has no slot masks.
  TwoLevelView<SlotMask> slot_mask_view() const;
  PartitionLookup lookup() const noexcept {
    return {meta_.view(), offsets_.view(), cpu_pages_.view(), geometry_.page_tokens};
  }
  std::size_t instance(RequestId request, std::uint32_t layer, std::uint32_t head) const;
  // The GPU-side tables themselves, for a replica in device memory
  // (metadata/gpu_tables_replica.hpp).
  const TwoLevelTable<MetaPartitionEntry>& meta_table() const noexcept { return meta_; }
  const TwoLevelTable<GpuPageEntry>& gpu_page_table() const noexcept { return gpu_pages_; }

 private:
  std::uint32_t slot_of(RequestId request) const;
  void validate_instance(std::size_t instance) const;
  const TwoLevelTable<SlotMask>& masks() const;
  // Tokens page `page_index` of an instance holds (its partition's count past the page's start, at most page_tokens).
  std::uint32_t tokens_on_page(std::size_t instance, std::uint32_t page_index) const;
  bool freed(std::size_t instance, PartitionId partition) const;
  // One-page, unfreed partition checks shared by set_token_count and free_page.
  void check_open_page(std::size_t instance, PartitionId partition, const char* call) const;
  void resize_pages(std::size_t instance, std::uint32_t partitions, std::uint32_t pages);

  PageTableGeometry geometry_;
  TwoLevelTable<MetaPartitionEntry> meta_;
  TwoLevelTable<GpuPageEntry> gpu_pages_;
  TwoLevelTable<PartitionOffset> offsets_;
  TwoLevelTable<CpuPageEntry> cpu_pages_;
  std::optional<TwoLevelTable<SlotMask>> masks_;
  std::unordered_map<RequestId, std::uint32_t> slots_;
  std::vector<std::uint32_t> free_slots_;
};

}  // namespace sparsekv
