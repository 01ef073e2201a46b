#pragma once
// TokenEvictor: token eviction (SpvLLM §2) for requests whose RequestPages say
// `evicts` (the page table then needs slot masks, HeadCapacity::slot_masks):
// every partition is one page, a decode token is written through to a CPU
// page slot (and to the page's GPU copy when resident) by place_token
// instead of going to a tail, and evict() masks positions out, then frees or
// compacts pages as Config::eviction_strategy says (docs/buffer.md). It maps
// sequence positions to (partition, slot); policies deal in positions only.
// The dry run (append_demand_evicting) and the calls it predicts share one
// plan, so they agree. Calls on a request that does not evict throw
// failed_precondition; every call that throws changes nothing.
#include <cstdint>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "sparsekv/buffer/buffer_request.hpp"
#include "sparsekv/buffer/buffer_tiers.hpp"

namespace sparsekv {

// What one decode step of a request that evicts takes, as a dry run of
// evict() then place_token() (TokenEvictor::append_demand_evicting).
// evict() first takes `copied_pages` CPU pages (private copies of the shared
// pages it masks), then returns `freed_pages` to the pool (a sparse_copy
// compaction's new pages already netted out: it frees its run before taking
// them); place_token() then takes `placed_pages`.
struct EvictionDemand {
  std::uint64_t copied_pages = 0;
  std::uint64_t freed_pages = 0;
  std::uint64_t placed_pages = 0;
  SegmentDemand segments;                      // beyond those mapped now, at the most demanding point
  std::vector<std::uint32_t> live_partitions;  // per kv head, once the token is placed
};

class TokenEvictor {
 public:
  TokenEvictor(BufferTiers& tiers, BufferRequests& requests) : tiers_(tiers), requests_(requests) {}

  // positions[h]: the sequence positions kv head h drops, each live and listed
  // once (else invalid_argument). A page another request shares (a fork's
  // prefix) is copied first (copy-on-evict): the request masks its own copy
  // and the other keeps the page as it was. check_evict makes evict()'s
  // checks only.
  void check_evict(RequestId request, std::uint32_t layer, std::span<const std::vector<std::uint32_t>> positions) const;
  void evict(RequestId request, std::uint32_t layer, std::span<const std::vector<std::uint32_t>> positions);
  // The next position's K/V rows (one token, engine layout), written per kv
  // head into the slot the strategy picks: slot_reuse the lowest dead slot of
  // the fullest page with one (fewest dead slots, then lowest partition id);
  // otherwise the next slot of the open page (the last one opened); otherwise
  // a new one-page partition, under the lowest freed partition's id when the
  // head has one (EvictionHead). Throws resource_exhausted, changing nothing,
  // when a new page does not fit.
  void place_token(RequestId request, std::uint32_t layer, const KvChunk& token);
  // evict(positions) followed by place_token, as a dry run: checks what
  // check_evict checks and changes nothing.
  EvictionDemand append_demand_evicting(RequestId request, std::uint32_t layer,
                                        std::span<const std::vector<std::uint32_t>> positions) const;
  // Held partitions of one head with a live slot, ascending: the selection of
  // dense attention over the live tokens.
  void live_partitions(RequestId request, std::uint32_t layer, std::uint32_t head, std::vector<PartitionId>& out) const;
  std::uint32_t live_tokens(RequestId request, std::uint32_t layer, std::uint32_t head) const;
  // CPU pages the request holds and live slots in them, over every (layer, kv head).
  std::uint64_t held_pages(RequestId request) const;
  std::uint64_t live_slots(RequestId request) const;
  // Where a live position sits: partition * page_tokens + slot; nullopt when it is not live.
  std::optional<std::uint32_t> position_slot(RequestId request, std::uint32_t layer, std::uint32_t head,
                                             std::uint32_t position) const;
  // Maps the first `partitions` partitions of `source`'s layer into the same
  // layer of `request` in every kv head, sharing their pages, positions and
  // masks; `request`'s layer must be empty. Both must evict.
  void share_prefix(RequestId request, RequestId source, std::uint32_t layer, std::uint32_t partitions);
  // TieredKVBuffer::validate()'s checks of one head: the position map, the
  // held, reusable and freed pages agree with the page table's slot masks.
  void validate_head(RequestId request, std::uint32_t layer, std::uint32_t head) const;

 private:
  // What evict() does to one head: the checks' result, computed before any change.
  struct HeadEviction {
    std::vector<std::pair<PartitionId, SlotMask>> cleared;  // partition, slots dying; ascending partitions
    std::vector<PartitionId> released;                      // pages whose last slot dies (free_block, slot_reuse)
    std::vector<PartitionId> copied;                        // shared pages that get a private copy first
    std::optional<PartitionId> run;                         // sparse_copy: first partition compacted
    std::uint32_t run_live = 0;                             // live rows of the run once evicted
    std::uint32_t run_pages = 0;                            // CPU pages the run holds now
  };

  // The request's books, refusing (failed_precondition) one that does not evict.
  const BufferRequest& evicting(RequestId request, std::uint32_t layer) const;
  bool shared(RequestId request, std::uint32_t layer, std::uint32_t head, PartitionId partition) const;
  std::vector<HeadEviction> plan_evict(RequestId request, std::uint32_t layer,
                                       std::span<const std::vector<std::uint32_t>> positions) const;
  // Where place_token puts head h's row now: an existing slot, or nullopt for a new page.
  std::optional<std::uint32_t> place_target(RequestId request, std::uint32_t layer, std::uint32_t head) const;
  void compact(RequestId request, BufferRequest& s, std::uint32_t layer, std::uint32_t head, PartitionId first);

  BufferTiers& tiers_;
  BufferRequests& requests_;
  std::vector<PageMove> moves_;        // scratch: a token's rows, written through
  std::vector<std::byte> token_rows_;  // scratch: a token's rows converted to the storage dtype
};

}  // namespace sparsekv
