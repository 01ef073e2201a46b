#pragma once
// TailAppender: each decode token goes to a tail page per (layer, kv head), a
// GPU-tier page (a CPU-tier one attending in place); when the tail is full it
// is saved to a new CPU page as a new one-page partition (SparseServe
// §3.2.2). The tail always takes part in attention. A request that evicts
// has no tail: its tokens go through TokenEvictor::place_token. Every call
// that throws changes nothing.
#include <cstdint>
#include <span>
#include <vector>

#include "sparsekv/buffer/buffer_request.hpp"
#include "sparsekv/buffer/buffer_tiers.hpp"
#include "sparsekv/buffer/regrouper.hpp"

namespace sparsekv {

// What a decode append that fills the tail takes, with the regroup that may
// follow it (TailAppender::save_demand). The save takes `saved_pages` CPU
// pages; the regroup then returns `freed_pages` to the pool (its runs' pages,
// the saved ones included, that no other request shares) before it takes
// `regroup_pages`.
struct SaveDemand {
  std::uint64_t saved_pages = 0;
  std::uint64_t freed_pages = 0;
  std::uint64_t regroup_pages = 0;
  SegmentDemand segments;  // metadata segments beyond those mapped now, at the most demanding point
};

class TailAppender {
 public:
  TailAppender(BufferTiers& tiers, BufferRequests& requests, const Regrouper& regrouper)
      : tiers_(tiers), requests_(requests), regrouper_(regrouper) {}

  void append(RequestId request, std::uint32_t layer, const KvChunk& token);
  // The device decode step's append (docs/device-decode.md): the checks and
  // bookkeeping of append() with no byte moved, the device writing the row
  // into tail slot `tail_slot` of each head's tail_page() and, when the token
  // fills the tail, copying the page to the CPU page reserved here. A filling
  // token maps the full page as a new one-page partition per kv head, as
  // append() does, and writes head h's reserved CPU page to cpu_pages[h]
  // (kv_heads entries; untouched otherwise). Throws what append() throws for
  // the request, layer and pools, changing nothing.
  struct DeviceAppendSlot {
    std::uint32_t tail_slot = 0;  // tokens in the tail before this one
    bool fills_tail = false;
  };
  DeviceAppendSlot append_on_device(RequestId request, std::uint32_t layer, std::span<PageId> cpu_pages);
  // Sizes an append() that fills the tail of `layer` (the full tail becomes a
  // one-page partition per kv head) followed, when `specs` is not empty, by
  // Regrouper::repartition(request, layer, first_partitions, specs) over runs
  // that end with the saved pages: a policy regrouping as a decode page
  // arrives. The runs are replaced, not added to. Throws what those two calls
  // would for bad arguments or the page table's per-head maxima (at both
  // points); changes nothing. Pools are the caller's to check, in call order.
  SaveDemand save_demand(RequestId request, std::uint32_t layer, std::span<const PartitionId> first_partitions = {},
                         std::span<const PartitionSpec> specs = {}) const;
  PageId tail_page(RequestId request, std::uint32_t layer, std::uint32_t head) const;
  std::uint32_t tail_tokens(RequestId request, std::uint32_t layer) const;

 private:
  void check_tail_save(RequestId request, std::uint32_t layer) const;
  // The bookkeeping of a token that filled the tail: the full page maps as a
  // new one-page partition per kv head; cpu_pages[h] gets head h's CPU page.
  void map_saved_page(RequestId request, BufferRequest& s, std::uint32_t layer, std::span<PageId> cpu_pages);

  BufferTiers& tiers_;
  BufferRequests& requests_;
  const Regrouper& regrouper_;
  std::vector<PageMove> moves_;                // scratch: a token's rows, a full tail's saves
  std::vector<std::byte> token_rows_;          // scratch: a token's rows converted to the storage dtype
  std::vector<PartitionId> saved_partitions_;  // scratch: a saved page's partition per kv head
  std::vector<PageId> saved_pages_;            // scratch: a saved page's CPU page per kv head
};

}  // namespace sparsekv
