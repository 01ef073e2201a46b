#include "sparsekv/buffer/regrouper.hpp"

#include <algorithm>
#include <cstring>

#include "sparsekv/core/error.hpp"
#include "prefix_order.hpp"
#include "tier_access.hpp"

namespace sparsekv {

RegroupDemand Regrouper::regroup_demand(RequestId request, std::uint32_t layer,
                                        std::span<const PartitionId> first_partitions,
                                        std::span<const PartitionSpec> specs, bool pending_page) const {
  requests_.at(request);
  check_index("layer", layer, tiers_.shape.layers);
  if (first_partitions.size() != tiers_.shape.kv_heads || specs.size() != tiers_.shape.kv_heads) {
    fail(ErrorCode::invalid_argument,
         "repartition needs one first partition and one spec per kv head ({}), got {} / {}", tiers_.shape.kv_heads,
         first_partitions.size(), specs.size());
  }
  RegroupDemand out;
  std::vector<PageId> dropped;
  std::vector<SegmentDemand>& segments = out.head_segments;
  segments.assign(tiers_.shape.kv_heads, SegmentDemand{});
  for (std::uint32_t h = 0; h < tiers_.shape.kv_heads; ++h) {
    const std::uint32_t count = tiers_.table.partition_count(request, layer, h);
    if (first_partitions[h] > count) {
      fail(ErrorCode::out_of_range, "repartition: kv head {} has {} partitions, first is {}", h, count,
           first_partitions[h]);
    }
    std::uint64_t tokens = pending_page ? tiers_.config.page_tokens : 0;
    for (PartitionId p = first_partitions[h]; p < count; ++p) {
      tokens += tiers_.table.meta(request, layer, h, p).token_count();
      tiers_.table.cpu_pages(request, layer, h, p, dropped);
    }
    if (tokens != specs[h].token_count()) {
      fail(ErrorCode::invalid_argument, "repartition: kv head {} regroups {} tokens, its spec covers {}", h, tokens,
           specs[h].token_count());
    }
    std::uint64_t head_pages = 0;
    for (std::uint32_t p = 0; p < specs[h].partition_count(); ++p) {
      const std::uint32_t pages = pages_for_tokens(specs[h].size(p), tiers_.config.page_tokens);
      if (pages > kMaxPagesPerPartition) {
        fail(ErrorCode::invalid_argument, "repartition: partition {} of kv head {} spans more than {} pages", p, h,
             kMaxPagesPerPartition);
      }
      head_pages += pages;
    }
    // The run's entries are dropped first, so the new partitions replace them
    // (and reuse their segments) rather than being added on top.
    segments[h] =
        tiers_.table.replace_demand(request, layer, h, first_partitions[h], specs[h].partition_count(), head_pages);
    out.regroup_pages += head_pages;
  }
  // Dropping the runs releases each page once per use, and a page returns to
  // the pool with its last reference: one a shared prefix still holds stays.
  // A tail page saved just before is the run's alone.
  out.freed_pages = pending_page ? tiers_.shape.kv_heads : 0;
  std::sort(dropped.begin(), dropped.end());
  for (auto i = dropped.begin(); i != dropped.end();) {
    const auto next = std::upper_bound(i, dropped.end(), *i);
    if (static_cast<std::uint32_t>(next - i) == tiers_.cpu_pool.ref_count(*i)) ++out.freed_pages;
    i = next;
  }
  return out;
}

void Regrouper::repartition(RequestId request, std::uint32_t layer, std::span<const PartitionId> first_partitions,
                            std::span<const PartitionSpec> specs) {
  BufferRequest& s = requests_.at(request);
  check_index("layer", layer, tiers_.shape.layers);
  if (s.pages.evicts) {
    fail(ErrorCode::failed_precondition,
         "request {} evicts tokens; its partitions are regrouped only by the eviction "
         "strategy",
         request);
  }
  // Everything is checked before anything changes: the run's rows live only
  // in the CPU tier until the new partitions hold them.
  const RegroupDemand regroup = regroup_demand(request, layer, first_partitions, specs, false);
  // The runs' pages are freed before the new ones are taken.
  if (regroup.regroup_pages > tiers_.cpu_pool.available() + regroup.freed_pages) {
    fail(ErrorCode::resource_exhausted, "repartition needs {} CPU pages; {} free plus {} freed by the run",
         regroup.regroup_pages, tiers_.cpu_pool.available(), regroup.freed_pages);
  }
  SegmentDemand demand;
  for (const SegmentDemand& head : regroup.head_segments) demand += head;
  tiers_.table.check_segments(demand);

  // Gather every head's run (rows in page order: [token][K row, V row]), drop
  // the runs, then lay the rows out in the new partitions.
  const std::size_t row = tiers_.layout.row_bytes();
  tiers_.transfer.synchronize();  // the run may end in a tail page still being saved
  std::vector<std::vector<std::byte>> rows(tiers_.shape.kv_heads);
  for (std::uint32_t h = 0; h < tiers_.shape.kv_heads; ++h) {
    rows[h].reserve(std::size_t{specs[h].token_count()} * 2 * row);
    collect_run(tiers_, request, layer, h, first_partitions[h], false, rows[h]);
  }
  for (std::uint32_t h = 0; h < tiers_.shape.kv_heads; ++h) {
    tiers_.partitions.truncate(request, layer, h, first_partitions[h]);
    s.windows[std::size_t{layer} * tiers_.shape.kv_heads + h].forget_from(first_partitions[h]);
    cut_prefix_order(tiers_, s, layer, h, first_partitions[h]);
  }
  for (std::uint32_t h = 0; h < tiers_.shape.kv_heads; ++h) {
    const MappedPartitions mapped = tiers_.partitions.map(request, layer, h, specs[h]);
    for (std::uint32_t t = 0; t < specs[h].token_count(); ++t) {
      std::byte* page = tiers_.cpu_pool.data(mapped.placements[t].cpu_page);
      std::memcpy(page + tiers_.layout.k_offset(mapped.placements[t].slot), rows[h].data() + 2 * t * row, row);
      std::memcpy(page + tiers_.layout.v_offset(mapped.placements[t].slot), rows[h].data() + (2 * t + 1) * row, row);
    }
  }
}

}  // namespace sparsekv
