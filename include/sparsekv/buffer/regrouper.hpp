#pragma once
// Regrouper: a policy re-indexing tokens already in the CPU tier (e.g.
// RetroInfer's per-segment clustering of decode tokens) lays a run of a
// head's partitions out again. Cached copies of the regrouped partitions are
// evicted first; the CPU tier keeps every byte. Every call that throws
// changes nothing.
#include <cstdint>
#include <span>
#include <vector>

#include "sparsekv/buffer/buffer_request.hpp"
#include "sparsekv/buffer/buffer_tiers.hpp"
#include "sparsekv/partition/partition_spec.hpp"

namespace sparsekv {

// What a regroup of one layer takes: it first returns `freed_pages` CPU pages
// to the pool (its runs' pages that no other request shares), then takes
// `regroup_pages`; `head_segments[h]` is what head h's page table demands
// once its run is replaced.
struct RegroupDemand {
  std::uint64_t freed_pages = 0;
  std::uint64_t regroup_pages = 0;
  std::vector<SegmentDemand> head_segments;
};

class Regrouper {
 public:
  Regrouper(BufferTiers& tiers, BufferRequests& requests) : tiers_(tiers), requests_(requests) {}

  // Regroups, in every kv head h, the tokens of partitions
  // [first_partitions[h], end) -- in their page order, token i of the run is
  // specs[h]'s token i -- into specs[h]'s partitions, which take ids
  // first_partitions[h] onwards. Refuses (failed_precondition) a request that evicts.
  void repartition(RequestId request, std::uint32_t layer, std::span<const PartitionId> first_partitions,
                   std::span<const PartitionSpec> specs);
  // repartition's checks over runs [first_partitions[h], end), extended by
  // one full page per head not saved yet when `pending_page` (a tail about to
  // be saved, TailAppender::save_demand); throws what repartition would for
  // bad arguments or the page table's per-head maxima.
  RegroupDemand regroup_demand(RequestId request, std::uint32_t layer, std::span<const PartitionId> first_partitions,
                               std::span<const PartitionSpec> specs, bool pending_page) const;

 private:
  BufferTiers& tiers_;
  BufferRequests& requests_;
};

}  // namespace sparsekv
