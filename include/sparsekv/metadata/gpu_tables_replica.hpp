#pragma once
// GpuTablesReplica: the tier split of Spin §5.2 for the device decode step
// (docs/device-decode.md). The meta-partition and GPU page tables, which the
// bucketed-LRU kernel reads and writes every step, are replicated in
// `memory` (device memory on the device path); the partition offset and CPU
// page tables stay the HierarchicalPageTable's own (pinned host memory,
// written by the host, read by kernels through UVA). The host table remains
// the master for the host's bookkeeping: it uploads a request's heads after
// changing them (add, new partitions, resize) and downloads them before it
// reads or changes what the LRU kernel wrote (reclaim, finish, repartition).
// The copies' ordering against the kernels is the caller's (table_replica.hpp),
// and the table's CPU tier must be device-reachable (pinned, mapped) for the
// lookup the kernels read through.
#include <cstdint>
#include <vector>

#include "sparsekv/core/ids.hpp"
#include "sparsekv/memory/memory_resource.hpp"
#include "sparsekv/metadata/hierarchical_page_table.hpp"
#include "sparsekv/metadata/partition_lookup.hpp"
#include "sparsekv/metadata/table_replica.hpp"

namespace sparsekv {

class GpuTablesReplica {
 public:
  GpuTablesReplica(const HierarchicalPageTable& table, MemoryResource& memory, ReplicaCopy& copy)
      : meta_(table.meta_table(), memory, copy), gpu_pages_(table.gpu_page_table(), memory, copy) {}

  // Every (layer, kv head) of `request`, master -> replica; enqueued on `copy`.
  void upload(const HierarchicalPageTable& table, RequestId request, ReplicaCopy& copy) {
    for_each_head(table, request, [&](std::size_t i) {
      meta_.upload(table.meta_table(), i, copy);
      gpu_pages_.upload(table.gpu_page_table(), i, copy);
    });
  }
  // Every (layer, kv head) of `request`, replica -> master; returns with the
  // bytes in the master (one copy.wait()).
  void download(const HierarchicalPageTable& table, RequestId request, ReplicaCopy& copy) {
    for_each_head(table, request, [&](std::size_t i) {
      meta_.download(table.meta_table(), i, copy);
      gpu_pages_.download(table.gpu_page_table(), i, copy);
    });
    copy.wait();
  }

  // The writes that bring meta-partition entries [first, first + count) of
  // `instance`, appended on the host, into the replica without touching the
  // entries the LRU kernel owns (TableReplica::entry_writes).
  void meta_entry_writes(const HierarchicalPageTable& table, std::size_t instance, std::uint32_t first,
                         std::uint32_t count, std::vector<ReplicaWordWrite>& out) const {
    meta_.entry_writes(table.meta_table(), instance, first, count, out);
  }

  // What the LRU step kernel takes: the replicated GPU page table, and the
  // lookup through the replicated meta-partition table and the master's
  // partition offset and CPU page tables.
  TwoLevelView<GpuPageEntry> gpu_page_view() const noexcept { return gpu_pages_.view(); }
  PartitionLookup lookup(const HierarchicalPageTable& table) const noexcept {
    return {meta_.view(), table.offset_view(), table.cpu_page_view(), table.geometry().page_tokens};
  }

 private:
  template <class Fn>
  static void for_each_head(const HierarchicalPageTable& table, RequestId request, Fn&& fn) {
    const PageTableGeometry& g = table.geometry();
    for (std::uint32_t l = 0; l < g.layers; ++l) {
      for (std::uint32_t h = 0; h < g.kv_heads; ++h) fn(table.instance(request, l, h));
    }
  }

  TableReplica<MetaPartitionEntry> meta_;
  TableReplica<GpuPageEntry> gpu_pages_;
};

}  // namespace sparsekv
