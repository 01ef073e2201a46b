#pragma once
// The Retrieve lookup path of Spin §5.2 (Figure 5): partition id -> token
// count (meta-partition table) -> page count, and partition offset -> the
// contiguous slice of the CPU page table holding its CPU page ids. Both
// backends call this: HierarchicalPageTable on the host, the resolve kernel on
// the GPU (reading the pinned CPU-tier tables through UVA).
#include <cstddef>
#include <cstdint>

#include "sparsekv/core/host_device.hpp"
#include "sparsekv/core/ids.hpp"
#include "sparsekv/metadata/page_table_entries.hpp"
#include "sparsekv/metadata/two_level_view.hpp"

namespace sparsekv {

struct PartitionLookup {
  TwoLevelView<MetaPartitionEntry> meta;
  TwoLevelView<PartitionOffset> offsets;
  TwoLevelView<CpuPageEntry> cpu_pages;
  std::uint32_t page_tokens;

  // Pages of a partition; 0 for a partition the instance does not have.
  SPARSEKV_HOST_DEVICE std::uint32_t page_count(std::size_t instance, PartitionId partition) const {
    const MetaPartitionEntry* m = meta.find(instance, partition);
    return m == nullptr ? 0 : pages_for_tokens(m->token_count(), page_tokens);
  }

  // Writes the partition's CPU page ids to out[0 .. page_count) and returns the count.
  SPARSEKV_HOST_DEVICE std::uint32_t copy_pages(std::size_t instance, PartitionId partition, PageId* out) const {
    const std::uint32_t count = page_count(instance, partition);
    if (count == 0) return 0;
    const PartitionOffset first = *offsets.find(instance, partition);
    for (std::uint32_t i = 0; i < count; ++i) out[i] = *cpu_pages.find(instance, first + i);
    return count;
  }
};

}  // namespace sparsekv
