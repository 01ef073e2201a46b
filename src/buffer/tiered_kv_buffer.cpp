#include "sparsekv/buffer/tiered_kv_buffer.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <unordered_set>

#include "sparsekv/core/convert.hpp"
#include "sparsekv/core/error.hpp"

namespace sparsekv {

std::vector<PartitionId> WorkingSetWindow::partitions() const {
  std::vector<PartitionId> all;
  for (const auto& step : steps_) all.insert(all.end(), step.begin(), step.end());
  std::sort(all.begin(), all.end());
  all.erase(std::unique(all.begin(), all.end()), all.end());
  return all;
}

namespace {

const Config& validated(const Config& config, const ModelShape& shape) {
  config.validate(shape);
  return config;
}

std::uint32_t tier_pages(std::size_t bytes, std::size_t page_bytes) {
  return static_cast<std::uint32_t>(bytes / page_bytes);
}

}  // namespace

TieredKVBuffer::TieredKVBuffer(const ModelShape& shape, const Config& config, MemoryResource& cpu_tier,
                               MemoryResource& gpu_tier)
    : TieredKVBuffer(shape, config, cpu_tier, gpu_tier, gpu_tier, host_transfer_) {}

TieredKVBuffer::TieredKVBuffer(const ModelShape& shape, const Config& config, MemoryResource& cpu_tier,
                               MemoryResource& gpu_pages, MemoryResource& gpu_tables, PageTransfer& transfer)
    : TieredKVBuffer(shape, config, cpu_tier, gpu_pages, gpu_tables, transfer, config.head_capacity()) {}

TieredKVBuffer::TieredKVBuffer(const ModelShape& shape, const Config& config, MemoryResource& cpu_tier,
                               MemoryResource& gpu_pages, MemoryResource& gpu_tables, PageTransfer& transfer,
                               const HeadCapacity& capacity, AttendSite site)
    : transfer_(&transfer),
      site_(site),
      shape_(shape),
      config_(validated(config, shape)),
      layout_{config.page_tokens, shape.head_dim, config.storage_dtype(shape)},
      cpu_pool_(layout_, tier_pages(config.cpu_tier_bytes, layout_.page_bytes()), cpu_tier,
                tier_pages(config.host_chunk_bytes, layout_.page_bytes())),
      gpu_pool_(layout_, tier_pages(config.gpu_tier_bytes, layout_.page_bytes()), gpu_pages),
      table_(PageTableGeometry::for_config(config, shape, capacity), gpu_tables, cpu_tier),
      partitions_(table_, cpu_pool_),
      lru_(config.timestamp_buckets) {
  if (!cpu_tier.host_accessible() || !gpu_tables.host_accessible()) {
    fail(ErrorCode::invalid_argument,
         "TieredKVBuffer: the CPU tier and the page tables must be host-accessible (got {} and {})",
         to_string(cpu_tier.kind()), to_string(gpu_tables.kind()));
  }
  if (site == AttendSite::cpu_tier && !gpu_pages.host_accessible()) {
    fail(ErrorCode::invalid_argument, "TieredKVBuffer: attending the CPU tier in place needs host memory");
  }
  if (layout_.dtype == DType::q8_0 && !gpu_pages.host_accessible()) {
    fail(ErrorCode::invalid_argument,
         "TieredKVBuffer: q8_0 storage is served by the host backends; the CUDA kernels read f32, f16 or bf16 pages");
  }
  if (!gpu_pages.host_accessible() && !transfer.reaches_device_memory()) {
    fail(ErrorCode::invalid_argument, "TieredKVBuffer: GPU-tier pages in device memory need a device transfer backend");
  }
}

TieredKVBuffer::RequestState& TieredKVBuffer::state(RequestId request) {
  const auto it = requests_.find(request);
  if (it == requests_.end()) fail(ErrorCode::not_found, "unknown request {}", request);
  return it->second;
}

const TieredKVBuffer::RequestState& TieredKVBuffer::state(RequestId request) const {
  return const_cast<TieredKVBuffer*>(this)->state(request);
}

std::uint32_t TieredKVBuffer::min_slots_per_head(const RequestPages& budget) const {
  if (site_ == AttendSite::cpu_tier) return 0;  // nothing is cached: selected pages are read where they are
  // In double, then saturated: a budget too large to hold is refused by its caller.
  const double slots = budget.mandatory_pages + std::ceil(config_.min_buffer_ratio * budget.mandatory_pages);
  return slots >= 4294967295.0 ? 0xffffffffu : static_cast<std::uint32_t>(slots);
}

std::uint64_t TieredKVBuffer::reclaimable_slots(const RequestState& s) const {
  return s.slots - min_slots_per_head(s.budget);
}

std::optional<Refusal> TieredKVBuffer::refusal(const RequestPages& budget) const {
  if (budget.mandatory_pages == 0) return Refusal{ErrorCode::invalid_argument, "mandatory_pages must be > 0"};
  if (budget.evicts && !table_.has_slot_masks()) {
    return Refusal{ErrorCode::failed_precondition,
                   "a request that evicts needs slot masks; build the buffer with HeadCapacity::slot_masks"};
  }
  const std::uint32_t min_slots = min_slots_per_head(budget);
  if (site_ == AttendSite::cpu_tier && budget.buffer_pages != 0) {
    return Refusal{ErrorCode::invalid_argument,
                   fmt::format("buffer_pages {}: a buffer that attends the CPU tier in place has no GPU pages",
                               budget.buffer_pages)};
  }
  if (budget.buffer_pages != 0 && budget.buffer_pages < min_slots) {
    return Refusal{ErrorCode::invalid_argument,
                   fmt::format("buffer_pages {} is below the minimum {} (mandatory {} x (1 + min_buffer_ratio {}))",
                               budget.buffer_pages, min_slots, budget.mandatory_pages, config_.min_buffer_ratio)};
  }
  const std::uint32_t slots = std::max(budget.buffer_pages, min_slots);
  if (slots > table_.geometry().max_gpu_pages_per_head) {
    return Refusal{ErrorCode::resource_exhausted, fmt::format("{} GPU pages per head exceed the maximum of {}", slots,
                                                              table_.geometry().max_gpu_pages_per_head)};
  }
  if (table_.request_count() >= table_.geometry().max_requests) {
    return Refusal{ErrorCode::resource_exhausted,
                   fmt::format("all {} request slots are in use", table_.geometry().max_requests)};
  }
  std::uint64_t reclaimable = 0;
  for (const auto& [id, s] : requests_) reclaimable += heads() * reclaimable_slots(s);
  const std::uint64_t needed = heads() * (std::uint64_t{slots} + tail_pages_per_head(budget));
  if (site_ == AttendSite::cpu_tier) {
    if (needed > cpu_pool_.available()) {
      return Refusal{ErrorCode::resource_exhausted,
                     fmt::format("needs {} CPU pages for its tails, {} free", needed, cpu_pool_.available())};
    }
  } else if (needed > gpu_pool_.available() + reclaimable) {
    return Refusal{ErrorCode::resource_exhausted, fmt::format("needs {} GPU pages, {} free and {} reclaimable", needed,
                                                              gpu_pool_.available(), reclaimable)};
  }
  // A new request's GPU page tables start empty in every head.
  const std::uint64_t entries = table_.geometry().segment_entries;
  SegmentDemand demand;
  demand.gpu_pages = heads() * ((std::uint64_t{slots} + entries - 1) / entries);
  if (std::string shortfall = table_.segment_shortfall(demand); !shortfall.empty()) {
    return Refusal{ErrorCode::resource_exhausted, std::move(shortfall)};
  }
  return std::nullopt;
}

AdmissionAdvice TieredKVBuffer::can_admit(std::uint32_t prompt_tokens, const RequestPages& budget,
                                          std::optional<std::uint32_t> prompt_pages_per_head) const {
  return can_admit_pages(prompt_tokens, budget,
                         heads() * prompt_pages_per_head.value_or(
                                       (std::uint64_t{prompt_tokens} + config_.page_tokens - 1) / config_.page_tokens));
}

AdmissionAdvice TieredKVBuffer::can_admit_pages(std::uint32_t prompt_tokens, const RequestPages& budget,
                                                std::uint64_t prompt_pages) const {
  AdmissionAdvice a;
  const std::uint64_t slots = std::max(budget.buffer_pages, min_slots_per_head(budget));
  a.request_slot_free = table_.request_count() < table_.geometry().max_requests;
  a.gpu_pages_needed = heads() * (slots + tail_pages_per_head(budget));
  a.gpu_pages_free = gpu_pool_.available();
  for (const auto& [id, s] : requests_) a.gpu_pages_reclaimable += heads() * reclaimable_slots(s);
  a.cpu_pages_needed = prompt_pages;
  if (site_ == AttendSite::cpu_tier) {
    // The tails are CPU pages too, and there is no GPU tier.
    a.cpu_pages_needed += a.gpu_pages_needed;
    a.gpu_pages_needed = a.gpu_pages_free = 0;
  }
  a.cpu_pages_free = cpu_pool_.available();
  if (const std::optional<Refusal> r = refusal(budget)) {
    a.reason = r->message;
  } else if (a.cpu_pages_needed > a.cpu_pages_free) {
    a.reason = fmt::format("the {}-token prompt needs {} CPU pages, {} free", prompt_tokens, a.cpu_pages_needed,
                           a.cpu_pages_free);
  }
  a.admit = a.reason.empty();
  return a;
}

void TieredKVBuffer::add_request(RequestId request, const RequestPages& budget) {
  if (requests_.contains(request)) fail(ErrorCode::already_exists, "request {} is already registered", request);
  if (const std::optional<Refusal> r = refusal(budget)) fail(r->code, "request {}: {}", request, r->message);
  const std::uint32_t slots = std::max(budget.buffer_pages, min_slots_per_head(budget));
  const std::uint64_t needed = heads() * (std::uint64_t{slots} + tail_pages_per_head(budget));
  // Every check has passed (refusal()) before reclaim() shrinks anyone else.
  table_.add_request(request);
  RequestState s;
  s.budget = budget;
  s.tokens.assign(shape_.layers, 0);
  s.tail_tokens.assign(shape_.layers, 0);
  s.ordered_tokens.assign(shape_.layers, 0);
  s.scattered.resize(heads());
  s.saved_tail.resize(heads());
  s.windows.assign(heads(), WorkingSetWindow(config_.working_set_window));
  s.tail_pages.resize(heads() * tail_pages_per_head(budget));
  if (budget.evicts) s.eviction.resize(heads());
  if (site_ == AttendSite::gpu_tier && needed > gpu_pool_.available()) reclaim(needed - gpu_pool_.available());
  tail_pool().allocate(s.tail_pages);
  auto& stored = requests_.emplace(request, std::move(s)).first->second;
  grow_slots(request, stored, slots);
}

void TieredKVBuffer::grow_slots(RequestId request, RequestState& s, std::uint32_t slots) {
  const std::uint32_t old = s.slots;
  if (slots == old) return;
  std::vector<PageId> pages(heads() * (slots - old));
  gpu_pool_.allocate(pages);  // checked by the callers, like the segments
  std::size_t next = 0;
  for (std::uint32_t l = 0; l < shape_.layers; ++l) {
    for (std::uint32_t h = 0; h < shape_.kv_heads; ++h) {
      table_.resize_gpu_slots(request, l, h, slots);
      for (std::uint32_t slot = old; slot < slots; ++slot) {
        table_.set_gpu_entry(request, l, h, slot, GpuPageEntry{kInvalidPartition, pages[next++], 0, 0, 0});
      }
    }
  }
  s.slots = slots;
}

void TieredKVBuffer::evict_partition(RequestId request, std::uint32_t layer, std::uint32_t head,
                                     PartitionId partition) {
  for (std::uint32_t slot = 0; slot < table_.gpu_slots(request, layer, head); ++slot) {
    GpuPageEntry e = table_.gpu_entry(request, layer, head, slot);
    if (e.partition == partition) {
      e.partition = kInvalidPartition;
      table_.set_gpu_entry(request, layer, head, slot, e);
    }
  }
  table_.set_resident(request, layer, head, partition, false);
}

void TieredKVBuffer::shrink_slots(RequestId request, RequestState& s, std::uint32_t slots) {
  // Reclaim from the tail of each GPU page table (Spin §5.3): a partition with
  // any page there is evicted whole, so the remaining table stays consistent.
  for (std::uint32_t l = 0; l < shape_.layers; ++l) {
    for (std::uint32_t h = 0; h < shape_.kv_heads; ++h) {
      for (std::uint32_t slot = slots; slot < s.slots; ++slot) {
        const GpuPageEntry e = table_.gpu_entry(request, l, h, slot);
        if (e.occupied()) evict_partition(request, l, h, e.partition);
        gpu_pool_.release(e.gpu_page);
        table_.set_gpu_entry(request, l, h, slot, GpuPageEntry{});
      }
      table_.resize_gpu_slots(request, l, h, slots);
    }
  }
  s.slots = slots;
}

void TieredKVBuffer::resize(RequestId request, std::uint32_t slots_per_head) {
  RequestState& s = state(request);
  if (site_ == AttendSite::cpu_tier && slots_per_head != 0) {
    fail(ErrorCode::failed_precondition, "request {}: a buffer that attends the CPU tier in place has no GPU pages",
         request);
  }
  if (slots_per_head < min_slots_per_head(s.budget)) {
    fail(ErrorCode::invalid_argument,
         "request {}: {} GPU pages per head are below its minimum of {} (mandatory {} plus the minimum buffer)",
         request, slots_per_head, min_slots_per_head(s.budget), s.budget.mandatory_pages);
  }
  if (slots_per_head < s.slots) {
    shrink_slots(request, s, slots_per_head);
    return;
  }
  if (slots_per_head == s.slots) return;
  SegmentDemand demand;
  for (std::uint32_t l = 0; l < shape_.layers; ++l)
    for (std::uint32_t h = 0; h < shape_.kv_heads; ++h)
      demand += table_.gpu_slots_demand(request, l, h, slots_per_head);
  table_.check_segments(demand);
  const std::uint64_t needed = heads() * (slots_per_head - s.slots);
  if (needed > gpu_pool_.available()) {
    fail(ErrorCode::resource_exhausted, "request {}: growing to {} pages per head needs {} GPU pages, {} free", request,
         slots_per_head, needed, gpu_pool_.available());
  }
  grow_slots(request, s, slots_per_head);
}

std::uint64_t TieredKVBuffer::reclaim(std::uint64_t gpu_pages) {
  // Slots per head to take, spread in proportion to sequence length and capped
  // by each request's buffering above its minimum (water-filling; remainders
  // go to the longest requests first, ties by request id).
  std::uint64_t wanted = (gpu_pages + heads() - 1) / heads();
  std::map<RequestId, std::uint64_t> take;
  while (wanted > 0) {
    std::uint64_t total_weight = 0;
    std::vector<std::pair<RequestId, std::uint64_t>> open;  // request, weight
    for (const auto& [id, s] : requests_) {
      if (reclaimable_slots(s) > take[id]) {
        const std::uint64_t weight = std::max<std::uint64_t>(1, *std::max_element(s.tokens.begin(), s.tokens.end()));
        open.emplace_back(id, weight);
        total_weight += weight;
      }
    }
    if (open.empty()) break;
    std::uint64_t given = 0;
    for (const auto& [id, weight] : open) {
      const std::uint64_t room = reclaimable_slots(requests_.at(id)) - take[id];
      const std::uint64_t share = std::min(room, wanted * weight / total_weight);
      take[id] += share;
      given += share;
    }
    if (given == 0) {
      std::stable_sort(open.begin(), open.end(), [](const auto& a, const auto& b) { return a.second > b.second; });
      for (const auto& [id, weight] : open) {
        if (given == wanted) break;
        ++take[id];
        ++given;
      }
    }
    wanted -= given;
  }
  std::uint64_t freed = 0;
  for (const auto& [id, slots] : take) {
    if (slots == 0) continue;
    RequestState& s = requests_.at(id);
    shrink_slots(id, s, static_cast<std::uint32_t>(s.slots - slots));
    freed += slots * heads();
  }
  return freed;
}

void TieredKVBuffer::finish(RequestId request) {
  RequestState& s = state(request);
  for (std::uint32_t l = 0; l < shape_.layers; ++l) {
    for (std::uint32_t h = 0; h < shape_.kv_heads; ++h) {
      for (std::uint32_t slot = 0; slot < s.slots; ++slot) {
        const GpuPageEntry e = table_.gpu_entry(request, l, h, slot);
        if (e.occupied()) table_.set_resident(request, l, h, e.partition, false);
        gpu_pool_.release(e.gpu_page);
        table_.set_gpu_entry(request, l, h, slot, GpuPageEntry{});
      }
      table_.resize_gpu_slots(request, l, h, 0);
    }
  }
  tail_pool().release(s.tail_pages);
  partitions_.unmap(request);
  table_.remove_request(request);
  requests_.erase(request);
}

void TieredKVBuffer::check_chunk(const KvChunk& kv, std::uint32_t layer) const {
  check_index("layer", layer, shape_.layers);
  if (kv.k == nullptr || kv.v == nullptr) fail(ErrorCode::invalid_argument, "K/V pointers must not be null");
  if (kv.tokens == 0) fail(ErrorCode::invalid_argument, "a K/V chunk needs at least one token");
  if (kv.dtype != shape_.dtype && kv.dtype != layout_.dtype) {
    fail(ErrorCode::invalid_argument, "K/V dtype {} does not match the model's {}", to_string(kv.dtype),
         to_string(shape_.dtype));
  }
}

void TieredKVBuffer::check_device_rows(const char* call) const {
  if (layout_.dtype != shape_.dtype) {
    fail(ErrorCode::failed_precondition, "{}: the device writes rows in the model's {}; this buffer stores {}", call,
         to_string(shape_.dtype), to_string(layout_.dtype));
  }
}

std::pair<const std::byte*, const std::byte*> TieredKVBuffer::stored_token(const KvChunk& token) {
  const auto* k = static_cast<const std::byte*>(token.k);
  const auto* v = static_cast<const std::byte*>(token.v);
  if (token.dtype == layout_.dtype) return {k, v};
  const std::size_t bytes = shape_.kv_heads * layout_.row_bytes();
  token_rows_.resize(2 * bytes);
  convert_rows(k, token.dtype, token_rows_.data(), layout_.dtype, shape_.kv_heads, shape_.head_dim);
  convert_rows(v, token.dtype, token_rows_.data() + bytes, layout_.dtype, shape_.kv_heads, shape_.head_dim);
  return {token_rows_.data(), token_rows_.data() + bytes};
}

void TieredKVBuffer::offload(RequestId request, std::uint32_t layer, const KvChunk& kv,
                             std::span<const PartitionSpec> specs) {
  state(request);
  check_chunk(kv, layer);
  check_offload(request, layer, kv.tokens, specs);
  const std::size_t row = layout_.row_bytes(), source_row = dtype_row_bytes(kv.dtype, shape_.head_dim);
  const auto* k = static_cast<const std::byte*>(kv.k);
  const auto* v = static_cast<const std::byte*>(kv.v);
  transfer_->synchronize();  // a page freed by finish() may still be a save's target
  RequestState& s = state(request);
  // In page order while page-sized partitions continue it (a fork's partial last page too); else a
  // first offload's layout is kept as scattered.
  const bool in_order = !s.budget.evicts && record_order(s, layer, specs, kv.tokens);
  const bool scatters = s.tokens[layer] == 0 && !s.budget.evicts && !in_order;
  for (std::uint32_t h = 0; h < shape_.kv_heads; ++h) {
    const PartitionSpec& spec = specs[specs.size() == 1 ? 0 : h];
    const MappedPartitions mapped = partitions_.map(request, layer, h, spec);
    if (s.budget.evicts) record_offload(s, layer, h, mapped.first_partition, spec, s.tokens[layer]);
    if (scatters) {
      s.scattered[std::size_t{layer} * shape_.kv_heads + h] = {mapped.placements,
                                                               mapped.first_partition + spec.partition_count()};
    }
    for (std::uint32_t t = 0; t < kv.tokens; ++t) {
      const TokenPlacement where = mapped.placements[t];
      std::byte* page = cpu_pool_.data(where.cpu_page);
      const std::size_t source = (std::size_t{t} * shape_.kv_heads + h) * source_row;
      if (kv.dtype == layout_.dtype) {
        std::memcpy(page + layout_.k_offset(where.slot), k + source, row);
        std::memcpy(page + layout_.v_offset(where.slot), v + source, row);
      } else {
        convert_rows(k + source, kv.dtype, page + layout_.k_offset(where.slot), layout_.dtype, 1, shape_.head_dim);
        convert_rows(v + source, kv.dtype, page + layout_.v_offset(where.slot), layout_.dtype, 1, shape_.head_dim);
      }
    }
  }
  s.tokens[layer] += kv.tokens;
  stats_.bytes_offloaded += 2 * std::uint64_t{kv.tokens} * shape_.kv_heads * row;
}

bool TieredKVBuffer::record_order(RequestState& s, std::uint32_t layer, std::span<const PartitionSpec> specs,
                                  std::uint32_t tokens) {
  if (s.ordered_tokens[layer] != s.tokens[layer] || s.tokens[layer] % config_.page_tokens != 0) return false;
  for (const PartitionSpec& spec : specs) {
    if (spec.partition_tokens() != config_.page_tokens) return false;
  }
  s.ordered_tokens[layer] += tokens;
  return true;
}

void TieredKVBuffer::record_save_order(RequestState& s, std::uint32_t layer, std::span<const PartitionId> saved) const {
  const std::uint32_t pt = config_.page_tokens;
  const std::uint32_t first = s.tokens[layer] - pt;
  if (s.ordered_tokens[layer] == first && first % pt == 0) {
    s.ordered_tokens[layer] = s.tokens[layer];
    return;
  }
  RequestState::SavedTail* run = &s.saved_tail[std::size_t{layer} * shape_.kv_heads];
  bool extends = true;
  for (std::uint32_t h = 0; h < shape_.kv_heads; ++h) {
    extends = extends && run[h].tokens != 0 && run[h].first_position + run[h].tokens == first &&
              run[h].first_partition + run[h].tokens / pt == saved[h];
  }
  const bool starts = !extends && prompt_readable(s, layer) == first;
  for (std::uint32_t h = 0; h < shape_.kv_heads; ++h) {
    if (extends) run[h].tokens += pt;
    if (starts) run[h] = {first, saved[h], pt};
  }
}

void TieredKVBuffer::offload_on_device(RequestId request, std::uint32_t layer, std::uint32_t tokens,
                                       std::span<const PartitionSpec> specs, std::vector<TokenPlacement>& placements) {
  state(request);
  check_index("layer", layer, shape_.layers);
  check_device_rows("offload_on_device");
  if (tokens == 0) fail(ErrorCode::invalid_argument, "a K/V chunk needs at least one token");
  check_offload(request, layer, tokens, specs);
  placements.resize(std::size_t{tokens} * shape_.kv_heads);
  transfer_->synchronize();  // a page freed by finish() may still be a save's target
  RequestState& s = state(request);
  record_order(s, layer, specs, tokens);
  for (std::uint32_t h = 0; h < shape_.kv_heads; ++h) {
    const PartitionSpec& spec = specs[specs.size() == 1 ? 0 : h];
    const MappedPartitions mapped = partitions_.map(request, layer, h, spec);
    if (s.budget.evicts) record_offload(s, layer, h, mapped.first_partition, spec, s.tokens[layer]);
    for (std::uint32_t t = 0; t < tokens; ++t) placements[std::size_t{t} * shape_.kv_heads + h] = mapped.placements[t];
  }
  s.tokens[layer] += tokens;
  stats_.bytes_offloaded += 2 * std::uint64_t{tokens} * shape_.kv_heads * layout_.row_bytes();
}

void TieredKVBuffer::check_offload_specs(RequestId request, std::uint32_t layer, std::uint32_t tokens,
                                         std::span<const PartitionSpec> specs) const {
  const RequestState& s = state(request);
  if (specs.size() != 1 && specs.size() != shape_.kv_heads) {
    fail(ErrorCode::invalid_argument, "{} partition specs given; expected 1 (shared) or {} (one per kv head)",
         specs.size(), shape_.kv_heads);
  }
  // Arguments first, then state, then resources.
  for (std::uint32_t h = 0; h < shape_.kv_heads; ++h) {
    const PartitionSpec& spec = specs[specs.size() == 1 ? 0 : h];
    if (spec.token_count() != tokens) {
      fail(ErrorCode::invalid_argument, "the spec of kv head {} covers {} tokens, the chunk has {}", h,
           spec.token_count(), tokens);
    }
    for (std::uint32_t p = 0; s.budget.evicts && p < spec.partition_count(); ++p) {
      if (spec.size(p) > config_.page_tokens) {
        fail(ErrorCode::invalid_argument,
             "request {} evicts tokens: partition {} of kv head {} holds {} tokens, more "
             "than one page ({})",
             request, p, h, spec.size(p), config_.page_tokens);
      }
    }
  }
  if (s.tail_tokens[layer] != 0) {
    fail(ErrorCode::failed_precondition, "request {} layer {}: offload after decode appends began", request, layer);
  }
}

void TieredKVBuffer::check_offload(RequestId request, std::uint32_t layer, std::uint32_t tokens,
                                   std::span<const PartitionSpec> specs) const {
  check_offload_specs(request, layer, tokens, specs);
  std::uint64_t pages = 0;
  SegmentDemand demand;
  for (std::uint32_t h = 0; h < shape_.kv_heads; ++h) {
    const PartitionSpec& spec = specs[specs.size() == 1 ? 0 : h];
    std::uint64_t head_pages = 0;
    for (std::uint32_t p = 0; p < spec.partition_count(); ++p) {
      if (pages_for_tokens(spec.size(p), config_.page_tokens) > kMaxPagesPerPartition) {
        fail(ErrorCode::invalid_argument, "partition {} of kv head {} spans more than {} pages", p, h,
             kMaxPagesPerPartition);
      }
      head_pages += pages_for_tokens(spec.size(p), config_.page_tokens);
    }
    demand += table_.append_demand(request, layer, h, spec.partition_count(), head_pages);
    pages += head_pages;
  }
  if (pages > cpu_pool_.available()) {
    fail(ErrorCode::resource_exhausted, "request {} layer {}: offload needs {} CPU pages, {} free", request, layer,
         pages, cpu_pool_.available());
  }
  table_.check_segments(demand);
}

void TieredKVBuffer::check_has_tail(RequestId request, const RequestState& s) const {
  if (s.budget.evicts) {
    fail(ErrorCode::failed_precondition,
         "request {} evicts tokens and has no GPU tail; decode tokens go through "
         "place_token",
         request);
  }
}

void TieredKVBuffer::check_tail_save(RequestId request, std::uint32_t layer) const {
  // The full tail becomes a one-page partition per head: check all heads first.
  const SaveDemand demand = save_demand(request, layer);
  if (demand.saved_pages > cpu_pool_.available()) {
    fail(ErrorCode::resource_exhausted, "request {} layer {}: saving the full tail needs {} CPU pages, {} free",
         request, layer, demand.saved_pages, cpu_pool_.available());
  }
  table_.check_segments(demand.segments);
}

TieredKVBuffer::DeviceAppendSlot TieredKVBuffer::append_on_device(RequestId request, std::uint32_t layer,
                                                                  std::span<PageId> cpu_pages) {
  RequestState& s = state(request);
  check_index("layer", layer, shape_.layers);
  check_device_rows("append_on_device");
  check_has_tail(request, s);
  if (cpu_pages.size() != shape_.kv_heads) {
    fail(ErrorCode::invalid_argument, "append_on_device: {} CPU page slots for {} kv heads", cpu_pages.size(),
         shape_.kv_heads);
  }
  const DeviceAppendSlot slot{s.tail_tokens[layer], s.tail_tokens[layer] + 1 == config_.page_tokens};
  if (slot.fills_tail) check_tail_save(request, layer);
  s.tokens[layer] += 1;
  s.tail_tokens[layer] = slot.tail_slot + 1;
  if (!slot.fills_tail) return slot;
  const PartitionSpec full = PartitionSpec::uniform(config_.page_tokens, config_.page_tokens);
  saved_partitions_.resize(shape_.kv_heads);
  for (std::uint32_t h = 0; h < shape_.kv_heads; ++h) {
    const MappedPartitions mapped = partitions_.map(request, layer, h, full);
    cpu_pages[h] = mapped.placements[0].cpu_page;
    saved_partitions_[h] = mapped.first_partition;
  }
  s.tail_tokens[layer] = 0;
  stats_.pages_saved += shape_.kv_heads;
  record_save_order(s, layer, saved_partitions_);
  return slot;
}

void TieredKVBuffer::append(RequestId request, std::uint32_t layer, const KvChunk& token) {
  RequestState& s = state(request);
  check_chunk(token, layer);
  check_has_tail(request, s);
  if (token.tokens != 1) fail(ErrorCode::invalid_argument, "append takes one token, got {}", token.tokens);
  const std::uint32_t slot = s.tail_tokens[layer];
  const bool fills_tail = slot + 1 == config_.page_tokens;
  if (fills_tail) check_tail_save(request, layer);
  const std::size_t row = layout_.row_bytes();
  const auto [k, v] = stored_token(token);
  moves_.resize(2 * std::size_t{shape_.kv_heads});
  for (std::uint32_t h = 0; h < shape_.kv_heads; ++h) {
    std::byte* tail = tail_pool().data(s.tail_pages[std::size_t{layer} * shape_.kv_heads + h]);
    moves_[2 * h] = {k + h * row, tail + layout_.k_offset(slot)};
    moves_[2 * h + 1] = {v + h * row, tail + layout_.v_offset(slot)};
  }
  transfer_->write(moves_, row);
  s.tokens[layer] += 1;
  s.tail_tokens[layer] = slot + 1;
  if (!fills_tail) return;
  // Save (SparseServe §3.2.2): the page moves whole; its layout is the CPU page's.
  const PartitionSpec full = PartitionSpec::uniform(config_.page_tokens, config_.page_tokens);
  std::vector<PageMove> saves(shape_.kv_heads);
  saved_partitions_.resize(shape_.kv_heads);
  for (std::uint32_t h = 0; h < shape_.kv_heads; ++h) {
    const MappedPartitions mapped = partitions_.map(request, layer, h, full);
    saves[h] = {tail_pool().data(s.tail_pages[std::size_t{layer} * shape_.kv_heads + h]),
                cpu_pool_.data(mapped.placements[0].cpu_page)};
    saved_partitions_[h] = mapped.first_partition;
  }
  transfer_->save(saves, layout_.page_bytes());
  s.tail_tokens[layer] = 0;
  stats_.pages_saved += shape_.kv_heads;
  record_save_order(s, layer, saved_partitions_);
}

void TieredKVBuffer::check_selection(RequestId request, std::uint32_t layer,
                                     std::span<const std::vector<PartitionId>> selections) {
  const RequestState& s = state(request);
  check_index("layer", layer, shape_.layers);
  if (selections.size() != shape_.kv_heads) {
    fail(ErrorCode::invalid_argument, "{} selections given for {} kv heads", selections.size(), shape_.kv_heads);
  }
  for (std::uint32_t h = 0; h < shape_.kv_heads; ++h) {
    lru_.check(table_, request, layer, h, selections[h], s.budget.mandatory_pages, site_ == AttendSite::gpu_tier);
    for (const PartitionId p : selections[h]) {
      if (s.budget.evicts && table_.partition_freed(request, layer, h, p)) {
        fail(ErrorCode::invalid_argument, "request {} layer {} kv head {}: partition {} is freed (every token evicted)",
             request, layer, h, p);
      }
    }
  }
}

void TieredKVBuffer::retrieve(RequestId request, std::uint32_t layer,
                              std::span<const std::vector<PartitionId>> selections, Retrieval& out) {
  check_selection(request, layer, selections);
  RequestState& s = state(request);
  out.head_offsets.assign(1, 0);
  out.partitions.clear();
  out.token_counts.clear();
  out.pages.clear();
  out.tail_pages.clear();
  out.tail_tokens.clear();
  out.page_masks.clear();
  out.slot_positions.clear();
  out.stats = {};
  out.in_place = site_ == AttendSite::cpu_tier;
  for (std::uint32_t h = 0; h < shape_.kv_heads; ++h) {
    const auto& selected = selections[h];
    if (out.in_place) {
      locate(request, layer, h, selected, out.pages);
    } else {
      out.stats += lru_.step(table_, request, layer, h, selected, out.pages);
    }
    for (PartitionId p : selected) {
      out.partitions.push_back(p);
      out.token_counts.push_back(table_.meta(request, layer, h, p).token_count());
    }
    out.head_offsets.push_back(static_cast<std::uint32_t>(out.partitions.size()));
    if (s.budget.evicts) {
      // One page per partition: the page's mask and each slot's position.
      const EvictionHead& e = eviction_head(s, layer, h);
      for (PartitionId p : selected) {
        out.page_masks.push_back(table_.slot_mask(request, layer, h, table_.first_page_index(request, layer, h, p)));
        const auto first = e.slot_position.begin() + std::size_t{p} * config_.page_tokens;
        out.slot_positions.insert(out.slot_positions.end(), first, first + config_.page_tokens);
      }
      out.tail_pages.push_back(kInvalidPage);
      out.tail_tokens.push_back(0);
    } else {
      out.tail_pages.push_back(s.tail_pages[std::size_t{layer} * shape_.kv_heads + h]);
      out.tail_tokens.push_back(s.tail_tokens[layer]);
    }
    s.windows[std::size_t{layer} * shape_.kv_heads + h].record(selected);
  }
  moves_.resize(out.pages.copies.size());
  for (std::size_t i = 0; i < moves_.size(); ++i) {
    moves_[i] = {cpu_pool_.data(out.pages.copies[i].cpu_page), gpu_pool_.data(out.pages.copies[i].gpu_page)};
  }
  transfer_->load(moves_, layout_.page_bytes());
  stats_.cache += out.stats;
  stats_.retrieve_steps += shape_.kv_heads;
  stats_.bytes_loaded += out.pages.copies.size() * layout_.page_bytes();
}

void TieredKVBuffer::locate(RequestId request, std::uint32_t layer, std::uint32_t head,
                            std::span<const PartitionId> selected, RetrievedPages& out) const {
  for (const PartitionId p : selected) {
    table_.cpu_pages(request, layer, head, p, out.gpu_pages);
    out.partition_offsets.push_back(static_cast<std::uint32_t>(out.gpu_pages.size()));
  }
}

void TieredKVBuffer::regroup_demand(RequestId request, std::uint32_t layer,
                                    std::span<const PartitionId> first_partitions, std::span<const PartitionSpec> specs,
                                    bool pending_page, SaveDemand& out, std::vector<SegmentDemand>& segments) const {
  if (first_partitions.size() != shape_.kv_heads || specs.size() != shape_.kv_heads) {
    fail(ErrorCode::invalid_argument,
         "repartition needs one first partition and one spec per kv head ({}), got {} / {}", shape_.kv_heads,
         first_partitions.size(), specs.size());
  }
  std::vector<PageId> dropped;
  segments.assign(shape_.kv_heads, SegmentDemand{});
  out.regroup_pages = 0;
  for (std::uint32_t h = 0; h < shape_.kv_heads; ++h) {
    const std::uint32_t count = table_.partition_count(request, layer, h);
    if (first_partitions[h] > count) {
      fail(ErrorCode::out_of_range, "repartition: kv head {} has {} partitions, first is {}", h, count,
           first_partitions[h]);
    }
    std::uint64_t tokens = pending_page ? config_.page_tokens : 0;
    for (PartitionId p = first_partitions[h]; p < count; ++p) {
      tokens += table_.meta(request, layer, h, p).token_count();
      table_.cpu_pages(request, layer, h, p, dropped);
    }
    if (tokens != specs[h].token_count()) {
      fail(ErrorCode::invalid_argument, "repartition: kv head {} regroups {} tokens, its spec covers {}", h, tokens,
           specs[h].token_count());
    }
    std::uint64_t head_pages = 0;
    for (std::uint32_t p = 0; p < specs[h].partition_count(); ++p) {
      const std::uint32_t pages = pages_for_tokens(specs[h].size(p), config_.page_tokens);
      if (pages > kMaxPagesPerPartition) {
        fail(ErrorCode::invalid_argument, "repartition: partition {} of kv head {} spans more than {} pages", p, h,
             kMaxPagesPerPartition);
      }
      head_pages += pages;
    }
    // The run's entries are dropped first, so the new partitions replace them
    // (and reuse their segments) rather than being added on top.
    segments[h] = table_.replace_demand(request, layer, h, first_partitions[h], specs[h].partition_count(), head_pages);
    out.regroup_pages += head_pages;
  }
  // Dropping the runs releases each page once per use, and a page returns to
  // the pool with its last reference: one a shared prefix still holds stays.
  // A tail page saved just before is the run's alone.
  out.freed_pages = pending_page ? shape_.kv_heads : 0;
  std::sort(dropped.begin(), dropped.end());
  for (auto i = dropped.begin(); i != dropped.end();) {
    const auto next = std::upper_bound(i, dropped.end(), *i);
    if (static_cast<std::uint32_t>(next - i) == cpu_pool_.ref_count(*i)) ++out.freed_pages;
    i = next;
  }
}

SaveDemand TieredKVBuffer::save_demand(RequestId request, std::uint32_t layer,
                                       std::span<const PartitionId> first_partitions,
                                       std::span<const PartitionSpec> specs) const {
  check_has_tail(request, state(request));
  check_index("layer", layer, shape_.layers);
  SaveDemand demand;
  demand.saved_pages = shape_.kv_heads;
  std::vector<SegmentDemand> regroup;
  if (!first_partitions.empty() || !specs.empty()) {
    regroup_demand(request, layer, first_partitions, specs, true, demand, regroup);
  }
  for (std::uint32_t h = 0; h < shape_.kv_heads; ++h) {
    SegmentDemand head = table_.append_demand(request, layer, h, 1, 1);  // the save, checked against the maxima
    if (!regroup.empty()) {  // then the regroup: whichever point needs more segments
      head.meta = std::max(head.meta, regroup[h].meta);
      head.offsets = std::max(head.offsets, regroup[h].offsets);
      head.cpu_pages = std::max(head.cpu_pages, regroup[h].cpu_pages);
    }
    demand.segments += head;
  }
  return demand;
}

void TieredKVBuffer::repartition(RequestId request, std::uint32_t layer, std::span<const PartitionId> first_partitions,
                                 std::span<const PartitionSpec> specs) {
  RequestState& s = state(request);
  check_index("layer", layer, shape_.layers);
  if (s.budget.evicts) {
    fail(ErrorCode::failed_precondition,
         "request {} evicts tokens; its partitions are regrouped only by the eviction "
         "strategy",
         request);
  }
  // Everything is checked before anything changes: the run's rows live only
  // in the CPU tier until the new partitions hold them.
  SaveDemand regroup;
  std::vector<SegmentDemand> heads;
  regroup_demand(request, layer, first_partitions, specs, false, regroup, heads);
  // The runs' pages are freed before the new ones are taken.
  if (regroup.regroup_pages > cpu_pool_.available() + regroup.freed_pages) {
    fail(ErrorCode::resource_exhausted, "repartition needs {} CPU pages; {} free plus {} freed by the run",
         regroup.regroup_pages, cpu_pool_.available(), regroup.freed_pages);
  }
  SegmentDemand demand;
  for (const SegmentDemand& head : heads) demand += head;
  table_.check_segments(demand);

  // Gather every head's run (rows in page order: [token][K row, V row]), drop
  // the runs, then lay the rows out in the new partitions.
  const std::size_t row = layout_.row_bytes();
  transfer_->synchronize();  // the run may end in a tail page still being saved
  std::vector<std::vector<std::byte>> rows(shape_.kv_heads);
  for (std::uint32_t h = 0; h < shape_.kv_heads; ++h) {
    rows[h].reserve(std::size_t{specs[h].token_count()} * 2 * row);
    collect_run(request, layer, h, first_partitions[h], false, rows[h]);
  }
  for (std::uint32_t h = 0; h < shape_.kv_heads; ++h) {
    partitions_.truncate(request, layer, h, first_partitions[h]);
    s.windows[std::size_t{layer} * shape_.kv_heads + h].forget_from(first_partitions[h]);
    s.ordered_tokens[layer] = std::min(s.ordered_tokens[layer], first_partitions[h] * config_.page_tokens);
    RequestState::ScatteredPrompt& prompt = s.scattered[std::size_t{layer} * shape_.kv_heads + h];
    if (first_partitions[h] < prompt.end) prompt = {};
    RequestState::SavedTail& run = s.saved_tail[std::size_t{layer} * shape_.kv_heads + h];
    run.tokens = first_partitions[h] <= run.first_partition
                     ? 0
                     : std::min(run.tokens, (first_partitions[h] - run.first_partition) * config_.page_tokens);
  }
  for (std::uint32_t h = 0; h < shape_.kv_heads; ++h) {
    const MappedPartitions mapped = partitions_.map(request, layer, h, specs[h]);
    for (std::uint32_t t = 0; t < specs[h].token_count(); ++t) {
      std::byte* page = cpu_pool_.data(mapped.placements[t].cpu_page);
      std::memcpy(page + layout_.k_offset(mapped.placements[t].slot), rows[h].data() + 2 * t * row, row);
      std::memcpy(page + layout_.v_offset(mapped.placements[t].slot), rows[h].data() + (2 * t + 1) * row, row);
    }
  }
}

std::uint64_t TieredKVBuffer::working_set_pages(RequestId request) const {
  const RequestState& s = state(request);
  std::uint64_t pages = 0;
  for (std::uint32_t l = 0; l < shape_.layers; ++l) {
    for (std::uint32_t h = 0; h < shape_.kv_heads; ++h) {
      for (PartitionId p : s.windows[std::size_t{l} * shape_.kv_heads + h].partitions()) {
        pages += table_.page_count(request, l, h, p);
      }
    }
  }
  return pages;
}

std::uint32_t TieredKVBuffer::slots_per_head(RequestId request) const { return state(request).slots; }

std::uint32_t TieredKVBuffer::sequence_length(RequestId request, std::uint32_t layer) const {
  check_index("layer", layer, shape_.layers);
  return state(request).tokens[layer];
}

PageId TieredKVBuffer::tail_page(RequestId request, std::uint32_t layer, std::uint32_t head) const {
  check_index("layer", layer, shape_.layers);
  check_index("kv head", head, shape_.kv_heads);
  check_has_tail(request, state(request));
  return state(request).tail_pages[std::size_t{layer} * shape_.kv_heads + head];
}

std::uint32_t TieredKVBuffer::tail_tokens(RequestId request, std::uint32_t layer) const {
  check_index("layer", layer, shape_.layers);
  return state(request).tail_tokens[layer];
}

void TieredKVBuffer::validate() const {
  table_.validate();
  const auto broken = [](const std::string& what) {
    fail(ErrorCode::failed_precondition, "buffer invariant broken: {}", what);
  };
  std::uint64_t gpu_pages = 0;
  std::unordered_set<PageId> owned, cpu_pages, tails;  // tails: in the CPU tier, attending in place
  std::vector<PageId> mapped;
  for (const auto& [id, s] : requests_) {
    if (s.slots < min_slots_per_head(s.budget)) broken(fmt::format("request {} is below its minimum buffer", id));
    if (site_ == AttendSite::cpu_tier && s.slots != 0) broken(fmt::format("request {} caches pages in place", id));
    for (std::uint32_t l = 0; l < shape_.layers; ++l) {
      if (s.tail_tokens[l] >= config_.page_tokens) broken(fmt::format("request {} layer {} tail overflows", id, l));
      if (s.budget.evicts && s.tail_tokens[l] != 0) broken(fmt::format("request {} evicts but has a tail", id));
      for (std::uint32_t h = 0; h < shape_.kv_heads; ++h) {
        if (table_.gpu_slots(id, l, h) != s.slots)
          broken(fmt::format("request {} head ({}, {}) has the wrong slot count", id, l, h));
        for (std::uint32_t slot = 0; slot < s.slots; ++slot) {
          const PageId page = table_.gpu_entry(id, l, h, slot).gpu_page;
          if (!gpu_pool_.is_allocated(page) || !owned.insert(page).second) {
            broken(
                fmt::format("GPU slot {} of request {} head ({}, {}) does not own a page of its own", slot, id, l, h));
          }
        }
        mapped.clear();
        table_.all_cpu_pages(id, l, h, mapped);
        for (const PageId page : mapped) {
          if (page != kInvalidPage) cpu_pages.insert(page);
        }
        if (s.budget.evicts) {
          validate_eviction(id, s, l, h);
          continue;
        }
        const PageId tail = s.tail_pages[std::size_t{l} * shape_.kv_heads + h];
        if (!tail_pool().is_allocated(tail) || !(site_ == AttendSite::cpu_tier ? tails : owned).insert(tail).second) {
          broken("a tail page is shared or free");
        }
        std::uint64_t tokens = 0;
        for (PartitionId p = 0; p < table_.partition_count(id, l, h); ++p)
          tokens += table_.meta(id, l, h, p).token_count();
        if (tokens + s.tail_tokens[l] != s.tokens[l]) {
          broken(fmt::format("request {} head ({}, {}): {} tokens mapped + {} in the tail != {}", id, l, h, tokens,
                             s.tail_tokens[l], s.tokens[l]));
        }
      }
    }
    gpu_pages += heads() * s.slots;
    if (site_ == AttendSite::gpu_tier) gpu_pages += heads() * tail_pages_per_head(s.budget);
  }
  for (const PageId tail : tails) {
    if (cpu_pages.contains(tail)) broken(fmt::format("tail page {} is also a mapped CPU page", tail));
  }
  if (gpu_pages != gpu_pool_.used())
    broken(fmt::format("{} GPU pages owned, the pool has {} in use", gpu_pages, gpu_pool_.used()));
  if (cpu_pages.size() + tails.size() != cpu_pool_.used()) {
    broken(fmt::format("{} CPU pages mapped and {} tails, the pool has {} in use", cpu_pages.size(), tails.size(),
                       cpu_pool_.used()));
  }
}

}  // namespace sparsekv
