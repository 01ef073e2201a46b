#pragma once
// PartitionMap: partition -> page list and token count, per request, layer and
// kv head (Spin §5.2). It turns a PartitionSpec into CPU-tier pages: it takes
// the pages from the CPU PagePool, records them in the HierarchicalPageTable's
// partition-side tables (meta-partition, partition offset, CPU page table) and
// tells the caller where each token's K/V row goes. Tokens of a partition are
// packed into its pages in spec order, `page_tokens` per page.
//
// Shared prefixes reuse another request's pages by reference count
// (PagedAttention+FlexAttention, Alg. 1); a shared page is never written,
// masked or reused, so sharing needs no copy-on-write.
//
// Token eviction (SpvLLM §2), on tables built with slot masks: evict_slots
// clears live bits of one-page partitions, and release_page turns a page none
// of whose slots is live into a freed tombstone and drops this request's
// reference to it; reuse_freed maps a fresh page into a tombstone again.
// unshare_page copies a shared page for this request alone, so that it can
// mask it (copy-on-evict). The ref-count rule: a page another request also maps
// (PagePool::ref_count > 1) is never masked, since its bytes and the other
// request's view of them are common.
#include <cstdint>
#include <vector>

#include "sparsekv/core/ids.hpp"
#include "sparsekv/memory/page_pool.hpp"
#include "sparsekv/metadata/hierarchical_page_table.hpp"
#include "sparsekv/partition/partition_spec.hpp"

namespace sparsekv {

// Where one token's row lands: page `cpu_page`, row `slot` of its K and V blocks.
struct TokenPlacement {
  PageId cpu_page = kInvalidPage;
  std::uint32_t slot = 0;
};

struct MappedPartitions {
  PartitionId first_partition = 0;         // id of the spec's partition 0 in this head
  std::vector<TokenPlacement> placements;  // indexed by the spec's token index
};

class PartitionMap {
 public:
  // Both must outlive the map; the CPU pool's page size must match the table's.
  PartitionMap(HierarchicalPageTable& table, PagePool& cpu_pool);

  // Appends the spec's partitions to one head, taking fresh CPU pages. All or
  // nothing: on any error no page is taken and no table changes.
  MappedPartitions map(RequestId request, std::uint32_t layer, std::uint32_t head, const PartitionSpec& spec);
  // Appends the first `partitions` partitions of `source`'s head to the same
  // head of `request`, sharing their pages (reference count + 1 each) and
  // copying their slot masks. Refuses (failed_precondition) a prefix holding a
  // freed partition.
  void map_shared_prefix(RequestId request, RequestId source, std::uint32_t layer, std::uint32_t head,
                         std::uint32_t partitions);
  // Keeps the first `partitions` partitions of one head, releasing the CPU
  // pages of the rest (none may be cached in a GPU slot; freed ones hold none).
  void truncate(RequestId request, std::uint32_t layer, std::uint32_t head, std::uint32_t partitions);
  // Releases every CPU page of every head of the request and drops its
  // partitions (no GPU slot may cache one). The request stays registered.
  void unmap(RequestId request);

  // Clears the `slots` bits of a one-page partition's slot mask and returns
  // what stays live. Refuses (invalid_argument) a slot that is not live, and
  // (failed_precondition) a page shared with another request.
  SlotMask evict_slots(RequestId request, std::uint32_t layer, std::uint32_t head, PartitionId partition,
                       SlotMask slots);
  // Makes a one-page partition with no live slot a freed tombstone and drops
  // this request's reference to its page (PagePool::release); returns whether
  // the page went back to the pool. Refuses (failed_precondition) a live slot,
  // a resident or an already freed partition.
  bool release_page(RequestId request, std::uint32_t layer, std::uint32_t head, PartitionId partition);
  // Takes a fresh CPU page for a freed tombstone, which becomes a one-page
  // partition whose slot 0 is live; returns the page. Refuses
  // (failed_precondition) a partition that is not freed; on any error no page
  // is taken.
  PageId reuse_freed(RequestId request, std::uint32_t layer, std::uint32_t head, PartitionId partition);
  // Gives this request a private copy of a one-page partition's page that
  // another request also maps (copy-on-evict): a fresh page with the same
  // bytes takes its place here, and this request's reference to the shared
  // page is dropped. Refuses (failed_precondition) a page no other request
  // maps, and a freed or multi-page partition; on any error nothing changes.
  void unshare_page(RequestId request, std::uint32_t layer, std::uint32_t head, PartitionId partition);

  std::uint32_t partition_count(RequestId request, std::uint32_t layer, std::uint32_t head) const {
    return table_->partition_count(request, layer, head);
  }
  std::uint32_t token_count(RequestId request, std::uint32_t layer, std::uint32_t head, PartitionId partition) const {
    return table_->meta(request, layer, head, partition).token_count();
  }
  std::vector<PageId> pages(RequestId request, std::uint32_t layer, std::uint32_t head, PartitionId partition) const;

  const HierarchicalPageTable& table() const noexcept { return *table_; }
  const PagePool& cpu_pool() const noexcept { return *cpu_pool_; }

 private:
  HierarchicalPageTable* table_;
  PagePool* cpu_pool_;
};

}  // namespace sparsekv
