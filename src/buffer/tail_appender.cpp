#include "sparsekv/buffer/tail_appender.hpp"

#include <algorithm>

#include "sparsekv/core/error.hpp"
#include "prefix_order.hpp"
#include "tier_access.hpp"

namespace sparsekv {

void TailAppender::check_tail_save(RequestId request, std::uint32_t layer) const {
  // The full tail becomes a one-page partition per head: check all heads first.
  const SaveDemand demand = save_demand(request, layer);
  if (demand.saved_pages > tiers_.cpu_pool.available()) {
    fail(ErrorCode::resource_exhausted, "request {} layer {}: saving the full tail needs {} CPU pages, {} free",
         request, layer, demand.saved_pages, tiers_.cpu_pool.available());
  }
  tiers_.table.check_segments(demand.segments);
}

TailAppender::DeviceAppendSlot TailAppender::append_on_device(RequestId request, std::uint32_t layer,
                                                              std::span<PageId> cpu_pages) {
  BufferRequest& s = requests_.at(request);
  check_index("layer", layer, tiers_.shape.layers);
  check_device_rows(tiers_, "append_on_device");
  check_has_tail(request, s);
  if (cpu_pages.size() != tiers_.shape.kv_heads) {
    fail(ErrorCode::invalid_argument, "append_on_device: {} CPU page slots for {} kv heads", cpu_pages.size(),
         tiers_.shape.kv_heads);
  }
  const DeviceAppendSlot slot{s.tail_tokens[layer], s.tail_tokens[layer] + 1 == tiers_.config.page_tokens};
  if (slot.fills_tail) check_tail_save(request, layer);
  s.tokens[layer] += 1;
  s.tail_tokens[layer] = slot.tail_slot + 1;
  if (slot.fills_tail) map_saved_page(request, s, layer, cpu_pages);
  return slot;
}

void TailAppender::append(RequestId request, std::uint32_t layer, const KvChunk& token) {
  BufferRequest& s = requests_.at(request);
  check_chunk(tiers_, token, layer);
  check_has_tail(request, s);
  if (token.tokens != 1) fail(ErrorCode::invalid_argument, "append takes one token, got {}", token.tokens);
  const std::uint32_t slot = s.tail_tokens[layer];
  const bool fills_tail = slot + 1 == tiers_.config.page_tokens;
  if (fills_tail) check_tail_save(request, layer);
  const std::size_t row = tiers_.layout.row_bytes();
  const auto [k, v] = stored_token(tiers_, token, token_rows_);
  moves_.resize(2 * std::size_t{tiers_.shape.kv_heads});
  for (std::uint32_t h = 0; h < tiers_.shape.kv_heads; ++h) {
    std::byte* tail = tiers_.tail_pool().data(s.tail_pages[std::size_t{layer} * tiers_.shape.kv_heads + h]);
    moves_[2 * h] = {k + h * row, tail + tiers_.layout.k_offset(slot)};
    moves_[2 * h + 1] = {v + h * row, tail + tiers_.layout.v_offset(slot)};
  }
  tiers_.transfer.write(moves_, row);
  s.tokens[layer] += 1;
  s.tail_tokens[layer] = slot + 1;
  if (!fills_tail) return;
  // Save (SparseServe §3.2.2): the page moves whole; its layout is the CPU page's.
  saved_pages_.resize(tiers_.shape.kv_heads);
  map_saved_page(request, s, layer, saved_pages_);
  moves_.resize(tiers_.shape.kv_heads);
  for (std::uint32_t h = 0; h < tiers_.shape.kv_heads; ++h) {
    moves_[h] = {tiers_.tail_pool().data(s.tail_pages[std::size_t{layer} * tiers_.shape.kv_heads + h]),
                 tiers_.cpu_pool.data(saved_pages_[h])};
  }
  tiers_.transfer.save(moves_, tiers_.layout.page_bytes());
}

void TailAppender::map_saved_page(RequestId request, BufferRequest& s, std::uint32_t layer,
                                  std::span<PageId> cpu_pages) {
  const PartitionSpec full = PartitionSpec::uniform(tiers_.config.page_tokens, tiers_.config.page_tokens);
  saved_partitions_.resize(tiers_.shape.kv_heads);
  for (std::uint32_t h = 0; h < tiers_.shape.kv_heads; ++h) {
    const MappedPartitions mapped = tiers_.partitions.map(request, layer, h, full);
    cpu_pages[h] = mapped.placements[0].cpu_page;
    saved_partitions_[h] = mapped.first_partition;
  }
  s.tail_tokens[layer] = 0;
  tiers_.stats.pages_saved += tiers_.shape.kv_heads;
  record_save_order(tiers_, s, layer, saved_partitions_);
}

SaveDemand TailAppender::save_demand(RequestId request, std::uint32_t layer,
                                     std::span<const PartitionId> first_partitions,
                                     std::span<const PartitionSpec> specs) const {
  check_has_tail(request, requests_.at(request));
  check_index("layer", layer, tiers_.shape.layers);
  SaveDemand demand;
  demand.saved_pages = tiers_.shape.kv_heads;
  std::vector<SegmentDemand> regroup;
  if (!first_partitions.empty() || !specs.empty()) {
    RegroupDemand r = regrouper_.regroup_demand(request, layer, first_partitions, specs, true);
    demand.freed_pages = r.freed_pages;
    demand.regroup_pages = r.regroup_pages;
    regroup = std::move(r.head_segments);
  }
  for (std::uint32_t h = 0; h < tiers_.shape.kv_heads; ++h) {
    SegmentDemand head = tiers_.table.append_demand(request, layer, h, 1, 1);  // the save, checked against the maxima
    if (!regroup.empty()) {  // then the regroup: whichever point needs more segments
      head.meta = std::max(head.meta, regroup[h].meta);
      head.offsets = std::max(head.offsets, regroup[h].offsets);
      head.cpu_pages = std::max(head.cpu_pages, regroup[h].cpu_pages);
    }
    demand.segments += head;
  }
  return demand;
}

PageId TailAppender::tail_page(RequestId request, std::uint32_t layer, std::uint32_t head) const {
  check_index("layer", layer, tiers_.shape.layers);
  check_index("kv head", head, tiers_.shape.kv_heads);
  check_has_tail(request, requests_.at(request));
  return requests_.at(request).tail_pages[std::size_t{layer} * tiers_.shape.kv_heads + head];
}

std::uint32_t TailAppender::tail_tokens(RequestId request, std::uint32_t layer) const {
  check_index("layer", layer, tiers_.shape.layers);
  return requests_.at(request).tail_tokens[layer];
}

}  // namespace sparsekv
