#pragma once
// PageRetriever: Retrieve (Spin §4.1). Per kv head, the selected partitions'
// GPU pages (hits and misses) from a BucketedLru step, and the copies of the
// misses, which it runs before returning. Attending in place
// (AttendSite::cpu_tier) nothing is cached: it returns the selected
// partitions' CPU pages themselves (Retrieval::in_place), with no copy and no
// LRU step. Each step's selection also feeds the request's working-set window
// (SparseServe §3.3). Every call that throws changes nothing.
#include <cstdint>
#include <span>
#include <vector>

#include "sparsekv/buffer/buffer_request.hpp"
#include "sparsekv/buffer/buffer_tiers.hpp"

namespace sparsekv {

// What one retrieve() of one layer returns, for all kv heads.
struct Retrieval {
  // Selected partitions of head h: partitions[head_offsets[h] .. head_offsets[h + 1]).
  std::vector<std::uint32_t> head_offsets;
  std::vector<PartitionId> partitions;
  std::vector<std::uint32_t> token_counts;  // per selected partition
  // Pages of selected partition i: pages.gpu_pages[pages.partition_offsets[i] ..
  // pages.partition_offsets[i + 1]); pages.copies were run before return.
  // In place (a buffer of AttendSite::cpu_tier), these are CPU-tier pages,
  // the tails too, and nothing is copied.
  bool in_place = false;
  RetrievedPages pages;
  // The resident tail of each head: page and token count (0 = empty).
  std::vector<PageId> tail_pages;
  std::vector<std::uint32_t> tail_tokens;
  // Requests that evict only (else empty): the slot mask of each page of
  // pages.gpu_pages, and the sequence position each of its slots holds,
  // slot_positions[i * page_tokens + t], kNoPosition for a slot not live.
  std::vector<SlotMask> page_masks;
  std::vector<std::uint32_t> slot_positions;
  CacheStepStats stats;

  // Calls fn(gpu_page, tokens) for every page kv head h attends: the selected
  // partitions' pages in order (a partition's last page may be partial), then
  // the tail if it holds tokens.
  template <class Fn>
  void for_each_page(std::uint32_t head, std::uint32_t page_tokens, Fn&& fn) const {
    for_each_page_masked(head, page_tokens, [&fn](PageId page, std::uint32_t tokens, SlotMask) { fn(page, tokens); });
  }
  // As for_each_page, with fn(gpu_page, tokens, mask): the page's slot mask,
  // all of its tokens live unless page_masks says otherwise.
  template <class Fn>
  void for_each_page_masked(std::uint32_t head, std::uint32_t page_tokens, Fn&& fn) const {
    for (std::uint32_t i = head_offsets[head]; i < head_offsets[head + 1]; ++i) {
      std::uint32_t left = token_counts[i];
      for (std::uint32_t p = pages.partition_offsets[i]; p < pages.partition_offsets[i + 1]; ++p) {
        const std::uint32_t tokens = left < page_tokens ? left : page_tokens;
        fn(pages.gpu_pages[p], tokens, page_masks.empty() ? full_slot_mask(tokens) : page_masks[p]);
        left -= tokens;
      }
    }
    if (tail_tokens[head] > 0) fn(tail_pages[head], tail_tokens[head], full_slot_mask(tail_tokens[head]));
  }
};

class PageRetriever {
 public:
  PageRetriever(BufferTiers& tiers, BufferRequests& requests) : tiers_(tiers), requests_(requests) {}

  // `selections[h]`: distinct partition ids of kv head h. Fills `out`.
  void retrieve(RequestId request, std::uint32_t layer, std::span<const std::vector<PartitionId>> selections,
                Retrieval& out);
  // The checks retrieve() makes first, changing nothing: one selection per kv
  // head, distinct partitions in range, within the request's mandatory pages
  // and GPU slots. Throws what retrieve() would.
  void check_selection(RequestId request, std::uint32_t layer, std::span<const std::vector<PartitionId>> selections);

 private:
  // retrieve() in place: the selected partitions' CPU pages, in order.
  void locate(RequestId request, std::uint32_t layer, std::uint32_t head, std::span<const PartitionId> selected,
              RetrievedPages& out) const;

  BufferTiers& tiers_;
  BufferRequests& requests_;
  std::vector<PageMove> moves_;  // scratch: the misses' copies
};

}  // namespace sparsekv
