#include "sparsekv/step/step_plan.hpp"

#include "sparsekv/core/error.hpp"

namespace sparsekv {

void PoolReplay::check(std::uint64_t cpu_free, CommitOrder order, const HierarchicalPageTable& table) const {
  const auto take = [&](const EntryDemand& e) {
    if (e.copied_first > cpu_free) {
      fail(ErrorCode::resource_exhausted,
           "decode: request {} evicts from {} shared pages, whose private copies need as many CPU pages; {} free",
           e.request, e.copied_first, cpu_free);
    }
    cpu_free = cpu_free - e.copied_first + e.freed_first;
    if (e.taken > cpu_free) {
      if (e.placement) {
        fail(ErrorCode::resource_exhausted, "decode: placing the token of request {} needs {} CPU pages, {} free",
             e.request, e.taken, cpu_free);
      }
      fail(ErrorCode::resource_exhausted, "decode: saving the full tail of request {} needs {} CPU pages, {} free",
           e.request, e.taken, cpu_free);
    }
    cpu_free -= e.taken;
  };
  const auto regroup = [&](const EntryDemand& e) {
    if (!e.regroups) return;
    if (e.regroup_taken > cpu_free + e.regroup_freed) {
      fail(ErrorCode::resource_exhausted,
           "decode: the regroup of request {} needs {} CPU pages; {} free plus {} freed by its run", e.request,
           e.regroup_taken, cpu_free, e.regroup_freed);
    }
    cpu_free = cpu_free + e.regroup_freed - e.regroup_taken;
  };
  if (order == CommitOrder::entry_by_entry) {
    for (const EntryDemand& e : entries_) {
      take(e);
      regroup(e);
    }
  } else {
    for (const EntryDemand& e : entries_) take(e);
    for (const EntryDemand& e : entries_) regroup(e);
  }
  // Summed without what earlier regroups free: a slight overestimate.
  SegmentDemand segments;
  for (const EntryDemand& e : entries_) segments += e.segments;
  table.check_segments(segments);
}

void check_regroup(std::string_view policy, const HierarchicalPageTable& table, RequestId request, std::uint32_t layer,
                   std::uint32_t head, std::uint32_t kv_heads, std::uint32_t page_tokens, const Repartition& regroup,
                   PartitionId saved_partition) {
  if (regroup.first_partitions.size() != kv_heads || regroup.specs.size() != kv_heads ||
      regroup.first_partitions[head] > saved_partition) {
    fail(ErrorCode::failed_precondition, "policy {}: malformed regroup of request {} layer {}", policy, request, layer);
  }
  std::uint64_t tokens = page_tokens;  // the page being saved
  for (PartitionId p = regroup.first_partitions[head]; p < saved_partition; ++p) {
    tokens += table.meta(request, layer, head, p).token_count();
  }
  if (tokens != regroup.specs[head].token_count()) {
    fail(ErrorCode::failed_precondition, "policy {}: regroup of kv head {} covers {} tokens, the run holds {}", policy,
         head, regroup.specs[head].token_count(), tokens);
  }
}

}  // namespace sparsekv
