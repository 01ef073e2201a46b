#include "sparsekv/buffer/page_retriever.hpp"

#include "sparsekv/core/error.hpp"
#include "eviction_books.hpp"

namespace sparsekv {

void PageRetriever::check_selection(RequestId request, std::uint32_t layer,
                                    std::span<const std::vector<PartitionId>> selections) {
  const BufferRequest& s = requests_.at(request);
  check_index("layer", layer, tiers_.shape.layers);
  if (selections.size() != tiers_.shape.kv_heads) {
    fail(ErrorCode::invalid_argument, "{} selections given for {} kv heads", selections.size(), tiers_.shape.kv_heads);
  }
  for (std::uint32_t h = 0; h < tiers_.shape.kv_heads; ++h) {
    tiers_.lru.check(tiers_.table, request, layer, h, selections[h], s.pages.mandatory_pages,
                     tiers_.site == AttendSite::gpu_tier);
    for (const PartitionId p : selections[h]) {
      if (s.pages.evicts && tiers_.table.partition_freed(request, layer, h, p)) {
        fail(ErrorCode::invalid_argument, "request {} layer {} kv head {}: partition {} is freed (every token evicted)",
             request, layer, h, p);
      }
    }
  }
}

void PageRetriever::retrieve(RequestId request, std::uint32_t layer,
                             std::span<const std::vector<PartitionId>> selections, Retrieval& out) {
  check_selection(request, layer, selections);
  BufferRequest& s = requests_.at(request);
  out.head_offsets.assign(1, 0);
  out.partitions.clear();
  out.token_counts.clear();
  out.pages.clear();
  out.tail_pages.clear();
  out.tail_tokens.clear();
  out.page_masks.clear();
  out.slot_positions.clear();
  out.stats = {};
  out.in_place = tiers_.site == AttendSite::cpu_tier;
  for (std::uint32_t h = 0; h < tiers_.shape.kv_heads; ++h) {
    const auto& selected = selections[h];
    if (out.in_place) {
      locate(request, layer, h, selected, out.pages);
    } else {
      out.stats += tiers_.lru.step(tiers_.table, request, layer, h, selected, out.pages);
    }
    for (PartitionId p : selected) {
      out.partitions.push_back(p);
      out.token_counts.push_back(tiers_.table.meta(request, layer, h, p).token_count());
    }
    out.head_offsets.push_back(static_cast<std::uint32_t>(out.partitions.size()));
    if (s.pages.evicts) {
      // One page per partition: the page's mask and each slot's position.
      const EvictionHead& e = eviction_head(tiers_, s, layer, h);
      for (PartitionId p : selected) {
        out.page_masks.push_back(
            tiers_.table.slot_mask(request, layer, h, tiers_.table.first_page_index(request, layer, h, p)));
        const auto first = e.slot_position.begin() + std::size_t{p} * tiers_.config.page_tokens;
        out.slot_positions.insert(out.slot_positions.end(), first, first + tiers_.config.page_tokens);
      }
      out.tail_pages.push_back(kInvalidPage);
      out.tail_tokens.push_back(0);
    } else {
      out.tail_pages.push_back(s.tail_pages[std::size_t{layer} * tiers_.shape.kv_heads + h]);
      out.tail_tokens.push_back(s.tail_tokens[layer]);
    }
    s.windows[std::size_t{layer} * tiers_.shape.kv_heads + h].record(selected);
  }
  moves_.resize(out.pages.copies.size());
  for (std::size_t i = 0; i < moves_.size(); ++i) {
    moves_[i] = {tiers_.cpu_pool.data(out.pages.copies[i].cpu_page),
                 tiers_.gpu_pool.data(out.pages.copies[i].gpu_page)};
  }
  tiers_.transfer.load(moves_, tiers_.layout.page_bytes());
  tiers_.stats.cache += out.stats;
  tiers_.stats.retrieve_steps += tiers_.shape.kv_heads;
  tiers_.stats.bytes_loaded += out.pages.copies.size() * tiers_.layout.page_bytes();
}

void PageRetriever::locate(RequestId request, std::uint32_t layer, std::uint32_t head,
                           std::span<const PartitionId> selected, RetrievedPages& out) const {
  for (const PartitionId p : selected) {
    tiers_.table.cpu_pages(request, layer, head, p, out.gpu_pages);
    out.partition_offsets.push_back(static_cast<std::uint32_t>(out.gpu_pages.size()));
  }
}

}  // namespace sparsekv
