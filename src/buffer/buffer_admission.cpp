#include "sparsekv/buffer/buffer_admission.hpp"

#include <algorithm>
#include <cmath>
#include <map>
#include <vector>

#include "sparsekv/core/error.hpp"
#include "tier_access.hpp"

namespace sparsekv {

std::uint32_t BufferAdmission::min_slots_per_head(const RequestPages& pages) const {
  if (tiers_.site == AttendSite::cpu_tier) return 0;  // nothing is cached: selected pages are read where they are
  // In double, then saturated: a budget too large to hold is refused by its caller.
  const double slots = pages.mandatory_pages + std::ceil(tiers_.config.min_buffer_ratio * pages.mandatory_pages);
  return slots >= 4294967295.0 ? 0xffffffffu : static_cast<std::uint32_t>(slots);
}

std::uint64_t BufferAdmission::reclaimable_slots(const BufferRequest& s) const {
  return s.slots - min_slots_per_head(s.pages);
}

std::optional<Refusal> BufferAdmission::refusal(const RequestPages& pages) const {
  if (pages.mandatory_pages == 0) return Refusal{ErrorCode::invalid_argument, "mandatory_pages must be > 0"};
  if (pages.evicts && !tiers_.table.has_slot_masks()) {
    return Refusal{ErrorCode::failed_precondition,
                   "a request that evicts needs slot masks; build the buffer with HeadCapacity::slot_masks"};
  }
  const std::uint32_t min_slots = min_slots_per_head(pages);
  if (tiers_.site == AttendSite::cpu_tier && pages.buffer_pages != 0) {
    return Refusal{ErrorCode::invalid_argument,
                   fmt::format("buffer_pages {}: a buffer that attends the CPU tier in place has no GPU pages",
                               pages.buffer_pages)};
  }
  if (pages.buffer_pages != 0 && pages.buffer_pages < min_slots) {
    return Refusal{ErrorCode::invalid_argument,
                   fmt::format("buffer_pages {} is below the minimum {} (mandatory {} x (1 + min_buffer_ratio {}))",
                               pages.buffer_pages, min_slots, pages.mandatory_pages, tiers_.config.min_buffer_ratio)};
  }
  const std::uint32_t slots = std::max(pages.buffer_pages, min_slots);
  if (slots > tiers_.table.geometry().max_gpu_pages_per_head) {
    return Refusal{ErrorCode::resource_exhausted, fmt::format("{} GPU pages per head exceed the maximum of {}", slots,
                                                              tiers_.table.geometry().max_gpu_pages_per_head)};
  }
  if (tiers_.table.request_count() >= tiers_.table.geometry().max_requests) {
    return Refusal{ErrorCode::resource_exhausted,
                   fmt::format("all {} request slots are in use", tiers_.table.geometry().max_requests)};
  }
  std::uint64_t reclaimable = 0;
  for (const auto& [id, s] : requests_) reclaimable += tiers_.heads() * reclaimable_slots(s);
  const std::uint64_t needed = tiers_.heads() * (std::uint64_t{slots} + tail_pages_per_head(pages));
  if (tiers_.site == AttendSite::cpu_tier) {
    if (needed > tiers_.cpu_pool.available()) {
      return Refusal{ErrorCode::resource_exhausted,
                     fmt::format("needs {} CPU pages for its tails, {} free", needed, tiers_.cpu_pool.available())};
    }
  } else if (needed > tiers_.gpu_pool.available() + reclaimable) {
    return Refusal{ErrorCode::resource_exhausted, fmt::format("needs {} GPU pages, {} free and {} reclaimable", needed,
                                                              tiers_.gpu_pool.available(), reclaimable)};
  }
  // A new request's GPU page tables start empty in every head.
  const std::uint64_t entries = tiers_.table.geometry().segment_entries;
  SegmentDemand demand;
  demand.gpu_pages = tiers_.heads() * ((std::uint64_t{slots} + entries - 1) / entries);
  if (std::string shortfall = tiers_.table.segment_shortfall(demand); !shortfall.empty()) {
    return Refusal{ErrorCode::resource_exhausted, std::move(shortfall)};
  }
  return std::nullopt;
}

AdmissionAdvice BufferAdmission::can_admit(std::uint32_t prompt_tokens, const RequestPages& pages,
                                           std::optional<std::uint32_t> prompt_pages_per_head) const {
  return can_admit_pages(
      prompt_tokens, pages,
      tiers_.heads() * prompt_pages_per_head.value_or((std::uint64_t{prompt_tokens} + tiers_.config.page_tokens - 1) /
                                                      tiers_.config.page_tokens));
}

AdmissionAdvice BufferAdmission::can_admit_pages(std::uint32_t prompt_tokens, const RequestPages& pages,
                                                 std::uint64_t prompt_pages) const {
  AdmissionAdvice a;
  const std::uint64_t slots = std::max(pages.buffer_pages, min_slots_per_head(pages));
  a.request_slot_free = tiers_.table.request_count() < tiers_.table.geometry().max_requests;
  a.gpu_pages_needed = tiers_.heads() * (slots + tail_pages_per_head(pages));
  a.gpu_pages_free = tiers_.gpu_pool.available();
  for (const auto& [id, s] : requests_) a.gpu_pages_reclaimable += tiers_.heads() * reclaimable_slots(s);
  a.cpu_pages_needed = prompt_pages;
  if (tiers_.site == AttendSite::cpu_tier) {
    // The tails are CPU pages too, and there is no GPU tier.
    a.cpu_pages_needed += a.gpu_pages_needed;
    a.gpu_pages_needed = a.gpu_pages_free = 0;
  }
  a.cpu_pages_free = tiers_.cpu_pool.available();
  if (const std::optional<Refusal> r = refusal(pages)) {
    a.reason = r->message;
  } else if (a.cpu_pages_needed > a.cpu_pages_free) {
    a.reason = fmt::format("the {}-token prompt needs {} CPU pages, {} free", prompt_tokens, a.cpu_pages_needed,
                           a.cpu_pages_free);
  }
  a.admit = a.reason.empty();
  return a;
}

void BufferAdmission::add_request(RequestId request, const RequestPages& pages,
                                  std::unique_ptr<RequestAttachment> attachment) {
  if (requests_.contains(request)) fail(ErrorCode::already_exists, "request {} is already registered", request);
  if (const std::optional<Refusal> r = refusal(pages)) fail(r->code, "request {}: {}", request, r->message);
  const std::uint32_t slots = std::max(pages.buffer_pages, min_slots_per_head(pages));
  const std::uint64_t needed = tiers_.heads() * (std::uint64_t{slots} + tail_pages_per_head(pages));
  // Every check has passed (refusal()) before reclaim() shrinks anyone else.
  tiers_.table.add_request(request);
  BufferRequest s;
  s.pages = pages;
  s.attachment = std::move(attachment);
  s.tokens.assign(tiers_.shape.layers, 0);
  s.tail_tokens.assign(tiers_.shape.layers, 0);
  s.ordered_tokens.assign(tiers_.shape.layers, 0);
  s.scattered.resize(tiers_.heads());
  s.saved_tail.resize(tiers_.heads());
  s.windows.assign(tiers_.heads(), WorkingSetWindow(tiers_.config.working_set_window));
  s.tail_pages.resize(tiers_.heads() * tail_pages_per_head(pages));
  if (pages.evicts) s.eviction.resize(tiers_.heads());
  if (tiers_.site == AttendSite::gpu_tier && needed > tiers_.gpu_pool.available())
    reclaim(needed - tiers_.gpu_pool.available());
  tiers_.tail_pool().allocate(s.tail_pages);
  auto& stored = requests_.add(request, std::move(s));
  grow_slots(request, stored, slots);
}

void BufferAdmission::grow_slots(RequestId request, BufferRequest& s, std::uint32_t slots) {
  const std::uint32_t old = s.slots;
  if (slots == old) return;
  std::vector<PageId> pages(tiers_.heads() * (slots - old));
  tiers_.gpu_pool.allocate(pages);  // checked by the callers, like the segments
  std::size_t next = 0;
  for (std::uint32_t l = 0; l < tiers_.shape.layers; ++l) {
    for (std::uint32_t h = 0; h < tiers_.shape.kv_heads; ++h) {
      tiers_.table.resize_gpu_slots(request, l, h, slots);
      for (std::uint32_t slot = old; slot < slots; ++slot) {
        tiers_.table.set_gpu_entry(request, l, h, slot, GpuPageEntry{kInvalidPartition, pages[next++], 0, 0, 0});
      }
    }
  }
  s.slots = slots;
}

void BufferAdmission::shrink_slots(RequestId request, BufferRequest& s, std::uint32_t slots) {
  // Reclaim from the tail of each GPU page table (Spin §5.3): a partition with
  // any page there is evicted whole, so the remaining table stays consistent.
  for (std::uint32_t l = 0; l < tiers_.shape.layers; ++l) {
    for (std::uint32_t h = 0; h < tiers_.shape.kv_heads; ++h) {
      for (std::uint32_t slot = slots; slot < s.slots; ++slot) {
        const GpuPageEntry e = tiers_.table.gpu_entry(request, l, h, slot);
        if (e.occupied()) uncache(tiers_, request, l, h, e.partition);
        tiers_.gpu_pool.release(e.gpu_page);
        tiers_.table.set_gpu_entry(request, l, h, slot, GpuPageEntry{});
      }
      tiers_.table.resize_gpu_slots(request, l, h, slots);
    }
  }
  s.slots = slots;
}

void BufferAdmission::resize(RequestId request, std::uint32_t slots_per_head) {
  BufferRequest& s = requests_.at(request);
  if (tiers_.site == AttendSite::cpu_tier && slots_per_head != 0) {
    fail(ErrorCode::failed_precondition, "request {}: a buffer that attends the CPU tier in place has no GPU pages",
         request);
  }
  if (slots_per_head < min_slots_per_head(s.pages)) {
    fail(ErrorCode::invalid_argument,
         "request {}: {} GPU pages per head are below its minimum of {} (mandatory {} plus the minimum buffer)",
         request, slots_per_head, min_slots_per_head(s.pages), s.pages.mandatory_pages);
  }
  if (slots_per_head < s.slots) {
    shrink_slots(request, s, slots_per_head);
    return;
  }
  if (slots_per_head == s.slots) return;
  SegmentDemand demand;
  for (std::uint32_t l = 0; l < tiers_.shape.layers; ++l)
    for (std::uint32_t h = 0; h < tiers_.shape.kv_heads; ++h)
      demand += tiers_.table.gpu_slots_demand(request, l, h, slots_per_head);
  tiers_.table.check_segments(demand);
  const std::uint64_t needed = tiers_.heads() * (slots_per_head - s.slots);
  if (needed > tiers_.gpu_pool.available()) {
    fail(ErrorCode::resource_exhausted, "request {}: growing to {} pages per head needs {} GPU pages, {} free", request,
         slots_per_head, needed, tiers_.gpu_pool.available());
  }
  grow_slots(request, s, slots_per_head);
}

std::uint64_t BufferAdmission::reclaim(std::uint64_t gpu_pages) {
  // Slots per head to take, spread in proportion to sequence length and capped
  // by each request's buffering above its minimum (water-filling; remainders
  // go to the longest requests first, ties by request id).
  std::uint64_t wanted = (gpu_pages + tiers_.heads() - 1) / tiers_.heads();
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
    BufferRequest& s = requests_.at(id);
    shrink_slots(id, s, static_cast<std::uint32_t>(s.slots - slots));
    freed += slots * tiers_.heads();
  }
  return freed;
}

void BufferAdmission::finish(RequestId request) {
  BufferRequest& s = requests_.at(request);
  for (std::uint32_t l = 0; l < tiers_.shape.layers; ++l) {
    for (std::uint32_t h = 0; h < tiers_.shape.kv_heads; ++h) {
      for (std::uint32_t slot = 0; slot < s.slots; ++slot) {
        const GpuPageEntry e = tiers_.table.gpu_entry(request, l, h, slot);
        if (e.occupied()) tiers_.table.set_resident(request, l, h, e.partition, false);
        tiers_.gpu_pool.release(e.gpu_page);
        tiers_.table.set_gpu_entry(request, l, h, slot, GpuPageEntry{});
      }
      tiers_.table.resize_gpu_slots(request, l, h, 0);
    }
  }
  tiers_.tail_pool().release(s.tail_pages);
  tiers_.partitions.unmap(request);
  tiers_.table.remove_request(request);
  requests_.erase(request);
}

std::vector<RequestId> BufferAdmission::request_ids() const {
  std::vector<RequestId> ids;
  for (const auto& entry : requests_) ids.push_back(entry.first);
  return ids;
}

std::uint64_t BufferAdmission::working_set_pages(RequestId request) const {
  const BufferRequest& s = requests_.at(request);
  std::uint64_t pages = 0;
  for (std::uint32_t l = 0; l < tiers_.shape.layers; ++l) {
    for (std::uint32_t h = 0; h < tiers_.shape.kv_heads; ++h) {
      for (PartitionId p : s.windows[std::size_t{l} * tiers_.shape.kv_heads + h].partitions()) {
        pages += tiers_.table.page_count(request, l, h, p);
      }
    }
  }
  return pages;
}

std::uint32_t BufferAdmission::slots_per_head(RequestId request) const { return requests_.at(request).slots; }

std::uint32_t BufferAdmission::sequence_length(RequestId request, std::uint32_t layer) const {
  check_index("layer", layer, tiers_.shape.layers);
  return requests_.at(request).tokens[layer];
}

}  // namespace sparsekv
