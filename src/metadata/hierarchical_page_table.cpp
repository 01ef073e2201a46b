#include "sparsekv/metadata/hierarchical_page_table.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <unordered_set>

#include "sparsekv/core/error.hpp"

namespace sparsekv {
namespace {

std::uint32_t pool_segments(std::uint64_t entries, std::size_t instances, std::uint32_t segment_entries) {
  const std::uint64_t segments = (entries + segment_entries - 1) / segment_entries + instances;
  return static_cast<std::uint32_t>(std::min<std::uint64_t>(segments, std::numeric_limits<std::uint32_t>::max() - 1));
}

}  // namespace

PageTableGeometry PageTableGeometry::for_config(const Config& config, const ModelShape& shape) {
  return for_config(config, shape, config.head_capacity());
}

PageTableGeometry PageTableGeometry::for_config(const Config& config, const ModelShape& shape,
                                                const HeadCapacity& capacity) {
  config.validate(shape);
  PageTableGeometry g;
  g.max_requests = config.max_requests;
  g.layers = shape.layers;
  g.kv_heads = shape.kv_heads;
  g.page_tokens = config.page_tokens;
  g.segment_entries = config.metadata_segment_entries;
  g.max_partitions_per_head = capacity.partitions;
  g.max_cpu_pages_per_head = capacity.cpu_pages;
  // A request's buffer is its mandatory pages (at most every page of the
  // head) plus min_buffer_ratio times that, rounded as the buffer rounds it;
  // directory slots cost 4 bytes per segment, so the bound is generous
  // rather than tight.
  const double pages = capacity.cpu_pages;
  const double buffer = pages + std::ceil(config.min_buffer_ratio * pages);
  g.max_gpu_pages_per_head = static_cast<std::uint32_t>(std::min(buffer, 4294967294.0));
  const std::size_t page = config.page_bytes(shape);
  const std::uint64_t cpu_pages = config.cpu_tier_bytes / page;
  const std::uint64_t gpu_pages = config.gpu_tier_bytes / page;
  const std::size_t instances = g.instances();
  g.meta_segments = pool_segments(cpu_pages, instances, g.segment_entries);
  g.offset_segments = g.meta_segments;
  g.cpu_page_segments = pool_segments(cpu_pages, instances, g.segment_entries);
  g.gpu_page_segments = pool_segments(gpu_pages, instances, g.segment_entries);
  g.slot_masks = capacity.slot_masks;
  g.mask_segments = capacity.slot_masks ? g.cpu_page_segments : 0;
  return g;
}

void PageTableGeometry::validate() const {
  if (max_requests == 0 || layers == 0 || kv_heads == 0) {
    fail(ErrorCode::invalid_argument, "PageTableGeometry: max_requests ({}), layers ({}) and kv_heads ({}) must be > 0",
         max_requests, layers, kv_heads);
  }
  if (page_tokens == 0 || !std::has_single_bit(page_tokens)) {
    fail(ErrorCode::invalid_argument, "PageTableGeometry: page_tokens ({}) must be a power of two", page_tokens);
  }
  if (max_partitions_per_head == 0 || max_cpu_pages_per_head == 0 || max_gpu_pages_per_head == 0) {
    fail(ErrorCode::invalid_argument, "PageTableGeometry: per-head maxima must be > 0");
  }
  if (segment_entries < 32 || !std::has_single_bit(segment_entries)) {
    fail(ErrorCode::invalid_argument, "PageTableGeometry: segment_entries ({}) must be a power of two >= 32",
         segment_entries);
  }
  if (meta_segments == 0 || gpu_page_segments == 0 || offset_segments == 0 || cpu_page_segments == 0) {
    fail(ErrorCode::invalid_argument, "PageTableGeometry: every segment pool needs at least one segment");
  }
  if (slot_masks && mask_segments == 0) {
    fail(ErrorCode::invalid_argument, "PageTableGeometry: the slot mask table needs at least one segment");
  }
  if (!slot_masks && mask_segments != 0) {
    fail(ErrorCode::invalid_argument, "PageTableGeometry: mask_segments ({}) given without slot_masks", mask_segments);
  }
  if (slot_masks && page_tokens > kMaxMaskedPageTokens) {
    fail(ErrorCode::invalid_argument, "PageTableGeometry: a slot mask covers at most {} tokens, pages hold {}",
         kMaxMaskedPageTokens, page_tokens);
  }
}

namespace {
const PageTableGeometry& validated(const PageTableGeometry& g) {
  g.validate();
  return g;
}
}  // namespace

HierarchicalPageTable::HierarchicalPageTable(const PageTableGeometry& geometry, MemoryResource& gpu_tier,
                                             MemoryResource& cpu_tier)
    : geometry_(validated(geometry)),
      meta_("meta-partition table", geometry.instances(), geometry.max_partitions_per_head, geometry.segment_entries,
            geometry.meta_segments, gpu_tier),
      gpu_pages_("GPU page table", geometry.instances(), geometry.max_gpu_pages_per_head, geometry.segment_entries,
                 geometry.gpu_page_segments, gpu_tier),
      offsets_("partition offset table", geometry.instances(), geometry.max_partitions_per_head,
               geometry.segment_entries, geometry.offset_segments, cpu_tier),
      cpu_pages_("CPU page table", geometry.instances(), geometry.max_cpu_pages_per_head, geometry.segment_entries,
                 geometry.cpu_page_segments, cpu_tier) {
  if (geometry.slot_masks) {
    masks_.emplace("slot mask table", geometry.instances(), geometry.max_cpu_pages_per_head, geometry.segment_entries,
                   geometry.mask_segments, cpu_tier);
  }
  free_slots_.resize(geometry.max_requests);
  // Highest first, so that slot 0 is taken first.
  std::iota(free_slots_.rbegin(), free_slots_.rend(), 0u);
}

void HierarchicalPageTable::add_request(RequestId request) {
  if (slots_.contains(request)) fail(ErrorCode::already_exists, "request {} is already registered", request);
  if (free_slots_.empty()) {
    fail(ErrorCode::resource_exhausted, "no request slot left ({} requests, max_requests = {})", slots_.size(),
         geometry_.max_requests);
  }
  slots_.emplace(request, free_slots_.back());
  free_slots_.pop_back();
}

void HierarchicalPageTable::remove_request(RequestId request) {
  const std::uint32_t slot = slot_of(request);
  const std::size_t heads = std::size_t{geometry_.layers} * geometry_.kv_heads;
  // The table never forgets a page it names: the caller releases them first.
  for (std::size_t i = 0; i < heads; ++i) {
    const std::size_t inst = slot * heads + i;
    if (cpu_pages_.length(inst) != 0 || gpu_pages_.length(inst) != 0) {
      fail(ErrorCode::failed_precondition,
           "request {} still maps {} CPU pages / {} GPU slots in head ({}, {}); unmap and shrink first", request,
           cpu_pages_.length(inst), gpu_pages_.length(inst), i / geometry_.kv_heads, i % geometry_.kv_heads);
    }
  }
  slots_.erase(request);
  free_slots_.push_back(slot);
}

std::uint32_t HierarchicalPageTable::slot_of(RequestId request) const {
  const auto it = slots_.find(request);
  if (it == slots_.end()) fail(ErrorCode::not_found, "unknown request {}", request);
  return it->second;
}

std::size_t HierarchicalPageTable::instance(RequestId request, std::uint32_t layer, std::uint32_t head) const {
  const std::uint32_t slot = slot_of(request);
  check_index("layer", layer, geometry_.layers);
  check_index("kv head", head, geometry_.kv_heads);
  return (std::size_t{slot} * geometry_.layers + layer) * geometry_.kv_heads + head;
}

SegmentDemand HierarchicalPageTable::append_demand(RequestId request, std::uint32_t layer, std::uint32_t head,
                                                   std::uint64_t partitions, std::uint64_t pages) const {
  return replace_demand(request, layer, head, partition_count(request, layer, head), partitions, pages);
}

SegmentDemand HierarchicalPageTable::replace_demand(RequestId request, std::uint32_t layer, std::uint32_t head,
                                                    std::uint32_t keep, std::uint64_t partitions,
                                                    std::uint64_t pages) const {
  const std::size_t inst = instance(request, layer, head);
  const std::uint32_t count = meta_.length(inst);
  if (keep > count) {
    fail(ErrorCode::out_of_range, "head ({}, {}) of request {} has {} partitions; cannot keep {}", layer, head, request,
         count, keep);
  }
  const std::uint64_t kept_pages = keep == count ? cpu_pages_.length(inst) : offsets_.at(inst, keep);
  const std::uint64_t new_partitions = keep + partitions;
  const std::uint64_t new_pages = kept_pages + pages;
  if (new_partitions > geometry_.max_partitions_per_head || new_pages > geometry_.max_cpu_pages_per_head) {
    fail(ErrorCode::resource_exhausted,
         "head ({}, {}) of request {} would hold {} partitions / {} CPU pages (max {} / {})", layer, head, request,
         new_partitions, new_pages, geometry_.max_partitions_per_head, geometry_.max_cpu_pages_per_head);
  }
  SegmentDemand d;
  d.meta = meta_.segments_to_grow(inst, static_cast<std::uint32_t>(new_partitions));
  d.offsets = offsets_.segments_to_grow(inst, static_cast<std::uint32_t>(new_partitions));
  d.cpu_pages = cpu_pages_.segments_to_grow(inst, static_cast<std::uint32_t>(new_pages));
  if (masks_) d.masks = masks_->segments_to_grow(inst, static_cast<std::uint32_t>(new_pages));
  return d;
}

SegmentDemand HierarchicalPageTable::gpu_slots_demand(RequestId request, std::uint32_t layer, std::uint32_t head,
                                                      std::uint32_t slots) const {
  const std::size_t inst = instance(request, layer, head);
  if (slots > geometry_.max_gpu_pages_per_head) {
    fail(ErrorCode::resource_exhausted, "head ({}, {}) of request {}: {} GPU slots exceed the maximum of {}", layer,
         head, request, slots, geometry_.max_gpu_pages_per_head);
  }
  SegmentDemand d;
  d.gpu_pages = gpu_pages_.segments_to_grow(inst, slots);
  return d;
}

void HierarchicalPageTable::check_segments(const SegmentDemand& d) const {
  if (std::string shortfall = segment_shortfall(d); !shortfall.empty()) {
    fail(ErrorCode::resource_exhausted, "{}", shortfall);
  }
}

std::string HierarchicalPageTable::segment_shortfall(const SegmentDemand& d) const {
  struct Need {
    const char* table;
    std::uint64_t segments;
    const SegmentPool& pool;
  };
  for (const Need& n :
       {Need{"meta-partition table", d.meta, meta_.pool()}, Need{"GPU page table", d.gpu_pages, gpu_pages_.pool()},
        Need{"partition offset table", d.offsets, offsets_.pool()},
        Need{"CPU page table", d.cpu_pages, cpu_pages_.pool()}}) {
    if (n.segments > n.pool.available()) {
      return fmt::format("{}: {} more segments needed, {} of {} free", n.table, n.segments, n.pool.available(),
                         n.pool.capacity());
    }
  }
  if (masks_ && d.masks > masks_->pool().available()) {
    return fmt::format("slot mask table: {} more segments needed, {} of {} free", d.masks, masks_->pool().available(),
                       masks_->pool().capacity());
  }
  return {};
}

void HierarchicalPageTable::append_partitions(RequestId request, std::uint32_t layer, std::uint32_t head,
                                              std::span<const std::uint32_t> token_counts,
                                              std::span<const PageId> cpu_pages) {
  const std::size_t inst = instance(request, layer, head);
  std::uint64_t pages = 0;
  for (std::size_t i = 0; i < token_counts.size(); ++i) {
    // GpuPageEntry numbers a partition's pages with 16 bits.
    const std::uint64_t max_tokens = std::uint64_t{kMaxPagesPerPartition} * geometry_.page_tokens;
    if (token_counts[i] == 0 || token_counts[i] > max_tokens || token_counts[i] > MetaPartitionEntry::kMaxTokens) {
      fail(ErrorCode::invalid_argument, "partition {} of the batch has {} tokens (must be in [1, {}])", i,
           token_counts[i], std::min<std::uint64_t>(max_tokens, MetaPartitionEntry::kMaxTokens));
    }
    pages += pages_for_tokens(token_counts[i], geometry_.page_tokens);
  }
  if (pages != cpu_pages.size()) {
    fail(ErrorCode::invalid_argument, "{} partitions need {} CPU pages, {} given", token_counts.size(), pages,
         cpu_pages.size());
  }
  for (std::size_t i = 0; i < cpu_pages.size(); ++i) {
    if (cpu_pages[i] == kInvalidPage) fail(ErrorCode::invalid_argument, "CPU page {} of the batch is invalid", i);
  }
  const std::uint32_t old_partitions = meta_.length(inst);
  const std::uint32_t old_pages = cpu_pages_.length(inst);
  // All three tables are checked before any grows: all or nothing.
  check_segments(append_demand(request, layer, head, token_counts.size(), pages));
  const std::uint64_t new_partitions = old_partitions + token_counts.size();
  const std::uint64_t new_pages = old_pages + pages;
  resize_pages(inst, static_cast<std::uint32_t>(new_partitions), static_cast<std::uint32_t>(new_pages));
  std::uint32_t offset = old_pages;
  for (std::size_t i = 0; i < token_counts.size(); ++i) {
    const auto p = static_cast<std::uint32_t>(old_partitions + i);
    meta_.at(inst, p) = MetaPartitionEntry::make(token_counts[i], false);
    offsets_.at(inst, p) = offset;
    const std::uint32_t pages_of = pages_for_tokens(token_counts[i], geometry_.page_tokens);
    for (std::uint32_t k = 0; masks_ && k < pages_of; ++k) {
      masks_->at(inst, offset + k) =
          full_slot_mask(std::min(geometry_.page_tokens, token_counts[i] - k * geometry_.page_tokens));
    }
    offset += pages_of;
  }
  for (std::size_t i = 0; i < cpu_pages.size(); ++i) {
    cpu_pages_.at(inst, static_cast<std::uint32_t>(old_pages + i)) = cpu_pages[i];
  }
}

void HierarchicalPageTable::truncate_partitions(RequestId request, std::uint32_t layer, std::uint32_t head,
                                                std::uint32_t partitions) {
  const std::size_t inst = instance(request, layer, head);
  const std::uint32_t count = meta_.length(inst);
  if (partitions > count) {
    fail(ErrorCode::out_of_range, "head ({}, {}) of request {} has {} partitions; cannot keep {}", layer, head, request,
         count, partitions);
  }
  for (std::uint32_t s = 0; s < gpu_pages_.length(inst); ++s) {
    const GpuPageEntry& e = gpu_pages_.at(inst, s);
    if (e.occupied() && e.partition >= partitions) {
      fail(ErrorCode::failed_precondition, "GPU slot {} of head ({}, {}) of request {} still caches partition {}", s,
           layer, head, request, e.partition);
    }
  }
  const std::uint32_t pages = partitions == count ? cpu_pages_.length(inst) : offsets_.at(inst, partitions);
  resize_pages(inst, partitions, pages);
}

void HierarchicalPageTable::resize_pages(std::size_t inst, std::uint32_t partitions, std::uint32_t pages) {
  meta_.resize(inst, partitions);
  offsets_.resize(inst, partitions);
  cpu_pages_.resize(inst, pages);
  if (masks_) masks_->resize(inst, pages);
}

void HierarchicalPageTable::clear_partitions(RequestId request, std::uint32_t layer, std::uint32_t head) {
  const std::size_t inst = instance(request, layer, head);
  // An occupied slot would otherwise name a partition id that a later append reuses.
  for (std::uint32_t s = 0; s < gpu_pages_.length(inst); ++s) {
    if (gpu_pages_.at(inst, s).occupied()) {
      fail(ErrorCode::failed_precondition, "GPU slot {} of head ({}, {}) of request {} still caches partition {}", s,
           layer, head, request, gpu_pages_.at(inst, s).partition);
    }
  }
  resize_pages(inst, 0, 0);
}

std::uint32_t HierarchicalPageTable::partition_count(RequestId request, std::uint32_t layer, std::uint32_t head) const {
  return meta_.length(instance(request, layer, head));
}

std::uint32_t HierarchicalPageTable::cpu_page_count(RequestId request, std::uint32_t layer, std::uint32_t head) const {
  return cpu_pages_.length(instance(request, layer, head));
}

MetaPartitionEntry HierarchicalPageTable::meta(RequestId request, std::uint32_t layer, std::uint32_t head,
                                               PartitionId partition) const {
  const std::size_t inst = instance(request, layer, head);
  check_index("partition", partition, meta_.length(inst));
  return meta_.at(inst, partition);
}

void HierarchicalPageTable::set_resident(RequestId request, std::uint32_t layer, std::uint32_t head,
                                         PartitionId partition, bool resident) {
  const std::size_t inst = instance(request, layer, head);
  check_index("partition", partition, meta_.length(inst));
  if (resident && freed(inst, partition)) {
    fail(ErrorCode::failed_precondition, "partition {} of head ({}, {}) of request {} is freed; it cannot be resident",
         partition, layer, head, request);
  }
  MetaPartitionEntry& entry = meta_.at(inst, partition);
  entry = MetaPartitionEntry::make(entry.token_count(), resident);
}

std::uint32_t HierarchicalPageTable::page_count(RequestId request, std::uint32_t layer, std::uint32_t head,
                                                PartitionId partition) const {
  return pages_for_tokens(meta(request, layer, head, partition).token_count(), geometry_.page_tokens);
}

void HierarchicalPageTable::cpu_pages(RequestId request, std::uint32_t layer, std::uint32_t head, PartitionId partition,
                                      std::vector<PageId>& out) const {
  const std::size_t inst = instance(request, layer, head);
  check_index("partition", partition, meta_.length(inst));
  const PartitionLookup paths = lookup();
  const std::size_t old_size = out.size();
  out.resize(old_size + paths.page_count(inst, partition));
  paths.copy_pages(inst, partition, out.data() + old_size);
}

void HierarchicalPageTable::all_cpu_pages(RequestId request, std::uint32_t layer, std::uint32_t head,
                                          std::vector<PageId>& out) const {
  const std::size_t inst = instance(request, layer, head);
  for (std::uint32_t i = 0; i < cpu_pages_.length(inst); ++i) out.push_back(cpu_pages_.at(inst, i));
}

std::uint32_t HierarchicalPageTable::first_page_index(RequestId request, std::uint32_t layer, std::uint32_t head,
                                                      PartitionId partition) const {
  const std::size_t inst = instance(request, layer, head);
  check_index("partition", partition, meta_.length(inst));
  return offsets_.at(inst, partition);
}

bool HierarchicalPageTable::freed(std::size_t inst, PartitionId partition) const {
  return cpu_pages_.at(inst, offsets_.at(inst, partition)) == kInvalidPage;
}

bool HierarchicalPageTable::partition_freed(RequestId request, std::uint32_t layer, std::uint32_t head,
                                            PartitionId partition) const {
  const std::size_t inst = instance(request, layer, head);
  check_index("partition", partition, meta_.length(inst));
  return freed(inst, partition);
}

void HierarchicalPageTable::check_open_page(std::size_t inst, PartitionId partition, const char* call) const {
  check_index("partition", partition, meta_.length(inst));
  const std::uint32_t tokens = meta_.at(inst, partition).token_count();
  if (tokens > geometry_.page_tokens) {
    fail(ErrorCode::invalid_argument, "{}: partition {} spans {} pages; only one-page partitions qualify", call,
         partition, pages_for_tokens(tokens, geometry_.page_tokens));
  }
  if (freed(inst, partition)) fail(ErrorCode::failed_precondition, "{}: partition {} is freed", call, partition);
}

void HierarchicalPageTable::set_token_count(RequestId request, std::uint32_t layer, std::uint32_t head,
                                            PartitionId partition, std::uint32_t tokens) {
  const std::size_t inst = instance(request, layer, head);
  check_open_page(inst, partition, "set_token_count");
  if (tokens == 0 || tokens > geometry_.page_tokens) {
    fail(ErrorCode::invalid_argument, "set_token_count: {} tokens for a one-page partition (must be in [1, {}])",
         tokens, geometry_.page_tokens);
  }
  const std::uint32_t page = offsets_.at(inst, partition);
  if (masks_ && (masks_->at(inst, page) & ~full_slot_mask(tokens)) != 0) {
    fail(ErrorCode::failed_precondition, "set_token_count: partition {} has a live slot at or past {} tokens",
         partition, tokens);
  }
  MetaPartitionEntry& entry = meta_.at(inst, partition);
  entry = MetaPartitionEntry::make(tokens, entry.resident());
}

const TwoLevelTable<SlotMask>& HierarchicalPageTable::masks() const {
  if (!masks_) fail(ErrorCode::failed_precondition, "the page table was built without slot masks");
  return *masks_;
}

TwoLevelView<SlotMask> HierarchicalPageTable::slot_mask_view() const { return masks().view(); }

std::uint32_t HierarchicalPageTable::tokens_on_page(std::size_t inst, std::uint32_t page_index) const {
  // The last partition whose first page is at or before page_index holds it.
  std::uint32_t lo = 0, hi = meta_.length(inst);
  while (hi - lo > 1) {
    const std::uint32_t mid = lo + (hi - lo) / 2;
    if (offsets_.at(inst, mid) <= page_index)
      lo = mid;
    else
      hi = mid;
  }
  const std::uint32_t before = (page_index - offsets_.at(inst, lo)) * geometry_.page_tokens;
  return std::min(geometry_.page_tokens, meta_.at(inst, lo).token_count() - before);
}

SlotMask HierarchicalPageTable::slot_mask(RequestId request, std::uint32_t layer, std::uint32_t head,
                                          std::uint32_t page_index) const {
  const TwoLevelTable<SlotMask>& table = masks();
  const std::size_t inst = instance(request, layer, head);
  check_index("CPU page", page_index, table.length(inst));
  return table.at(inst, page_index);
}

void HierarchicalPageTable::set_slot_mask(RequestId request, std::uint32_t layer, std::uint32_t head,
                                          std::uint32_t page_index, SlotMask mask) {
  masks();
  const std::size_t inst = instance(request, layer, head);
  check_index("CPU page", page_index, masks_->length(inst));
  const std::uint32_t tokens = tokens_on_page(inst, page_index);
  if ((mask & ~full_slot_mask(tokens)) != 0) {
    fail(ErrorCode::invalid_argument,
         "slot mask {:#x} of CPU page {} of head ({}, {}) of request {} marks a slot "
         "at or past its {} tokens live",
         mask, page_index, layer, head, request, tokens);
  }
  if (mask != 0 && cpu_pages_.at(inst, page_index) == kInvalidPage) {
    fail(ErrorCode::failed_precondition, "CPU page {} of head ({}, {}) of request {} is freed; no slot can be live",
         page_index, layer, head, request);
  }
  masks_->at(inst, page_index) = mask;
}

PageId HierarchicalPageTable::free_page(RequestId request, std::uint32_t layer, std::uint32_t head,
                                        PartitionId partition) {
  masks();
  const std::size_t inst = instance(request, layer, head);
  check_open_page(inst, partition, "free_page");
  if (meta_.at(inst, partition).resident()) {
    fail(ErrorCode::failed_precondition,
         "free_page: partition {} of head ({}, {}) of request {} is resident; evict "
         "its GPU copy first",
         partition, layer, head, request);
  }
  const std::uint32_t page = offsets_.at(inst, partition);
  const PageId held = cpu_pages_.at(inst, page);
  cpu_pages_.at(inst, page) = kInvalidPage;
  masks_->at(inst, page) = 0;
  return held;
}

void HierarchicalPageTable::reuse_freed(RequestId request, std::uint32_t layer, std::uint32_t head,
                                        PartitionId partition, PageId page) {
  masks();
  const std::size_t inst = instance(request, layer, head);
  check_index("partition", partition, meta_.length(inst));
  if (!freed(inst, partition)) {
    fail(ErrorCode::failed_precondition, "reuse_freed: partition {} of head ({}, {}) of request {} is not freed",
         partition, layer, head, request);
  }
  if (page == kInvalidPage) fail(ErrorCode::invalid_argument, "reuse_freed: the CPU page is invalid");
  const std::uint32_t index = offsets_.at(inst, partition);
  meta_.at(inst, partition) = MetaPartitionEntry::make(1, false);
  cpu_pages_.at(inst, index) = page;
  masks_->at(inst, index) = full_slot_mask(1);
}

PageId HierarchicalPageTable::replace_page(RequestId request, std::uint32_t layer, std::uint32_t head,
                                           PartitionId partition, PageId page) {
  const std::size_t inst = instance(request, layer, head);
  check_open_page(inst, partition, "replace_page");
  if (page == kInvalidPage) fail(ErrorCode::invalid_argument, "replace_page: the CPU page is invalid");
  const std::uint32_t index = offsets_.at(inst, partition);
  const PageId held = cpu_pages_.at(inst, index);
  cpu_pages_.at(inst, index) = page;
  return held;
}

std::uint32_t HierarchicalPageTable::gpu_slots(RequestId request, std::uint32_t layer, std::uint32_t head) const {
  return gpu_pages_.length(instance(request, layer, head));
}

void HierarchicalPageTable::resize_gpu_slots(RequestId request, std::uint32_t layer, std::uint32_t head,
                                             std::uint32_t slots) {
  const std::size_t inst = instance(request, layer, head);
  for (std::uint32_t s = slots; s < gpu_pages_.length(inst); ++s) {
    const GpuPageEntry& e = gpu_pages_.at(inst, s);
    if (e.occupied() || e.gpu_page != kInvalidPage) {
      fail(ErrorCode::failed_precondition, "GPU slot {} of head ({}, {}) of request {} still owns GPU page {}", s,
           layer, head, request, e.gpu_page);
    }
  }
  gpu_pages_.resize(inst, slots);
}

GpuPageEntry HierarchicalPageTable::gpu_entry(RequestId request, std::uint32_t layer, std::uint32_t head,
                                              std::uint32_t slot) const {
  const std::size_t inst = instance(request, layer, head);
  check_index("GPU slot", slot, gpu_pages_.length(inst));
  return gpu_pages_.at(inst, slot);
}

void HierarchicalPageTable::set_gpu_entry(RequestId request, std::uint32_t layer, std::uint32_t head,
                                          std::uint32_t slot, const GpuPageEntry& entry) {
  const std::size_t inst = instance(request, layer, head);
  check_index("GPU slot", slot, gpu_pages_.length(inst));
  if (entry.occupied()) {
    check_index("partition", entry.partition, meta_.length(inst));
    const std::uint32_t pages = pages_for_tokens(meta_.at(inst, entry.partition).token_count(), geometry_.page_tokens);
    check_index("page of partition", entry.page_in_partition, pages);
    if (entry.gpu_page == kInvalidPage) fail(ErrorCode::invalid_argument, "an occupied GPU slot needs a GPU page");
    if (freed(inst, entry.partition)) {
      fail(ErrorCode::failed_precondition,
           "partition {} of head ({}, {}) of request {} is freed; no GPU slot caches it", entry.partition, layer, head,
           request);
    }
  }
  gpu_pages_.at(inst, slot) = entry;
}

MetadataBytes HierarchicalPageTable::bytes() const noexcept {
  MetadataBytes b;
  b.gpu_reserved =
      meta_.directory_bytes() + meta_.pool_bytes() + gpu_pages_.directory_bytes() + gpu_pages_.pool_bytes();
  b.cpu_reserved =
      offsets_.directory_bytes() + offsets_.pool_bytes() + cpu_pages_.directory_bytes() + cpu_pages_.pool_bytes();
  b.gpu_mapped = meta_.directory_bytes() + meta_.used_segment_bytes() + gpu_pages_.directory_bytes() +
                 gpu_pages_.used_segment_bytes();
  b.cpu_mapped = offsets_.directory_bytes() + offsets_.used_segment_bytes() + cpu_pages_.directory_bytes() +
                 cpu_pages_.used_segment_bytes();
  if (masks_) {
    b.cpu_reserved += masks_->directory_bytes() + masks_->pool_bytes();
    b.cpu_mapped += masks_->directory_bytes() + masks_->used_segment_bytes();
  }
  return b;
}

namespace {

[[noreturn]] void broken(std::size_t inst, const std::string& what) {
  fail(ErrorCode::failed_precondition, "page table invariant broken at instance {}: {}", inst, what);
}

// Directory slots below the length's segment count are mapped, each to a
// distinct allocated segment; the rest are unmapped.
template <class Entry>
std::uint32_t check_directory(const TwoLevelTable<Entry>& table, std::size_t inst,
                              std::unordered_set<std::uint32_t>& seen) {
  const std::uint32_t need = table.segments_for(table.length(inst));
  if (table.length(inst) > table.max_entries()) broken(inst, "length above the per-head maximum");
  for (std::uint32_t s = 0; s < table.directory_length(); ++s) {
    const std::uint32_t seg = table.directory_segment(inst, s);
    if (s < need) {
      if (seg == kNoSegment || !table.pool().is_allocated(seg)) broken(inst, "mapped entry without a live segment");
      if (!seen.insert(seg).second) broken(inst, fmt::format("segment {} mapped twice", seg));
    } else if (seg != kNoSegment) {
      broken(inst, "segment mapped past the length");
    }
  }
  return need;
}

}  // namespace

void HierarchicalPageTable::validate_instance(std::size_t inst) const {
  const std::uint32_t partitions = meta_.length(inst);
  if (offsets_.length(inst) != partitions) broken(inst, "meta-partition and offset tables disagree on length");
  std::uint32_t offset = 0;
  std::vector<std::uint32_t> pages_of(partitions);
  for (std::uint32_t p = 0; p < partitions; ++p) {
    const MetaPartitionEntry m = meta_.at(inst, p);
    if (m.token_count() == 0) broken(inst, fmt::format("partition {} has no tokens", p));
    if (offsets_.at(inst, p) != offset) broken(inst, fmt::format("partition {} offset is not the running page sum", p));
    pages_of[p] = pages_for_tokens(m.token_count(), geometry_.page_tokens);
    offset += pages_of[p];
  }
  if (cpu_pages_.length(inst) != offset) broken(inst, "CPU page table length is not the partitions' page total");
  if (masks_ && masks_->length(inst) != offset) broken(inst, "slot mask table length is not the CPU page table's");
  std::vector<bool> freed_partition(partitions, false);
  for (std::uint32_t p = 0; p < partitions; ++p) {
    const std::uint32_t first = offsets_.at(inst, p);
    freed_partition[p] = cpu_pages_.at(inst, first) == kInvalidPage;
    if (freed_partition[p] && !masks_)
      broken(inst, fmt::format("partition {} is freed in a table without slot masks", p));
    if (freed_partition[p] && meta_.at(inst, p).resident())
      broken(inst, fmt::format("freed partition {} is resident", p));
    for (std::uint32_t k = 0; k < pages_of[p]; ++k) {
      if ((cpu_pages_.at(inst, first + k) == kInvalidPage) != freed_partition[p]) {
        broken(inst, fmt::format("partition {} mixes freed and held CPU pages", p));
      }
      if (!masks_) continue;
      const SlotMask mask = masks_->at(inst, first + k);
      if (freed_partition[p] && mask != 0) broken(inst, fmt::format("freed partition {} has a live slot", p));
      const std::uint32_t tokens =
          std::min(geometry_.page_tokens, meta_.at(inst, p).token_count() - k * geometry_.page_tokens);
      if ((mask & ~full_slot_mask(tokens)) != 0) {
        broken(inst, fmt::format("page {} of partition {} has a live slot at or past its {} tokens", k, p, tokens));
      }
    }
  }
  std::vector<std::uint32_t> cached(partitions, 0);
  std::unordered_set<std::uint64_t> keys;
  for (std::uint32_t s = 0; s < gpu_pages_.length(inst); ++s) {
    const GpuPageEntry e = gpu_pages_.at(inst, s);
    if (!e.occupied()) continue;
    if (e.partition >= partitions) broken(inst, fmt::format("GPU slot {} names missing partition {}", s, e.partition));
    if (e.page_in_partition >= pages_of[e.partition]) broken(inst, fmt::format("GPU slot {} names a missing page", s));
    if (e.gpu_page == kInvalidPage) broken(inst, fmt::format("occupied GPU slot {} has no GPU page", s));
    if (!keys.insert((std::uint64_t{e.partition} << 16) | e.page_in_partition).second) {
      broken(inst, fmt::format("page {} of partition {} cached twice", e.page_in_partition, e.partition));
    }
    ++cached[e.partition];
  }
  for (std::uint32_t p = 0; p < partitions; ++p) {
    const bool resident = meta_.at(inst, p).resident();
    if (resident && cached[p] != pages_of[p]) broken(inst, fmt::format("resident partition {} is missing pages", p));
    if (!resident && cached[p] != 0) broken(inst, fmt::format("non-resident partition {} has cached pages", p));
  }
}

void HierarchicalPageTable::validate() const {
  std::unordered_set<std::uint32_t> seen_meta, seen_gpu, seen_offsets, seen_cpu, seen_masks;
  std::uint64_t used_meta = 0, used_gpu = 0, used_offsets = 0, used_cpu = 0, used_masks = 0;
  std::unordered_set<PageId> gpu_pages;
  std::vector<bool> active(geometry_.max_requests, false);
  for (const auto& [request, slot] : slots_) active[slot] = true;
  const std::size_t heads = std::size_t{geometry_.layers} * geometry_.kv_heads;
  for (std::size_t inst = 0; inst < geometry_.instances(); ++inst) {
    if (!active[inst / heads] && (meta_.length(inst) | gpu_pages_.length(inst) | offsets_.length(inst) |
                                  cpu_pages_.length(inst) | (masks_ ? masks_->length(inst) : 0)) != 0) {
      broken(inst, "a free request slot holds entries");
    }
    used_meta += check_directory(meta_, inst, seen_meta);
    used_gpu += check_directory(gpu_pages_, inst, seen_gpu);
    used_offsets += check_directory(offsets_, inst, seen_offsets);
    used_cpu += check_directory(cpu_pages_, inst, seen_cpu);
    if (masks_) used_masks += check_directory(*masks_, inst, seen_masks);
    validate_instance(inst);
    for (std::uint32_t s = 0; s < gpu_pages_.length(inst); ++s) {
      const PageId page = gpu_pages_.at(inst, s).gpu_page;
      if (page != kInvalidPage && !gpu_pages.insert(page).second) {
        broken(inst, fmt::format("GPU page {} owned by two slots", page));
      }
    }
  }
  if (used_meta != meta_.pool().used() || used_gpu != gpu_pages_.pool().used() ||
      used_offsets != offsets_.pool().used() || used_cpu != cpu_pages_.pool().used() ||
      (masks_ && used_masks != masks_->pool().used())) {
    fail(ErrorCode::failed_precondition, "page table invariant broken: segment pools hold unmapped segments");
  }
  if (slots_.size() + free_slots_.size() != geometry_.max_requests) {
    fail(ErrorCode::failed_precondition, "page table invariant broken: request slots leaked");
  }
}

}  // namespace sparsekv
