#pragma once
// Entry formats of the four tables of Spin §5.2. Widths are chosen so that the
// GPU-resident tables stay small: 4 bytes per partition in the meta-partition
// table, 12 bytes per cached page in the GPU page table.
#include <cstdint>

#include "sparsekv/core/host_device.hpp"
#include "sparsekv/core/ids.hpp"

namespace sparsekv {

// Meta-partition table (GPU tier): token count and residency of a partition.
// Resident means every page of the partition has an entry in the GPU page table.
struct MetaPartitionEntry {
  static constexpr std::uint32_t kResidentBit = 1u << 31;
  static constexpr std::uint32_t kMaxTokens = kResidentBit - 1;
  std::uint32_t bits = 0;

  SPARSEKV_HOST_DEVICE std::uint32_t token_count() const { return bits & kMaxTokens; }
  SPARSEKV_HOST_DEVICE bool resident() const { return (bits & kResidentBit) != 0; }
  SPARSEKV_HOST_DEVICE static MetaPartitionEntry make(std::uint32_t tokens, bool resident) {
    return {(tokens & kMaxTokens) | (resident ? kResidentBit : 0u)};
  }
};
static_assert(sizeof(MetaPartitionEntry) == 4);

// GPU page table (GPU tier): one entry per page slot of a (request, layer, kv
// head) GPU buffer. Page-centric, so the LRU scan walks one dense array.
struct GpuPageEntry {
  PartitionId partition = kInvalidPartition;  // kInvalidPartition: slot holds no partition page
  PageId gpu_page = kInvalidPage;             // page of the GPU-tier PagePool owned by the slot
  std::uint16_t page_in_partition = 0;        // which page of the partition's page list
  std::uint8_t timestamp = 0;                 // bucketed-LRU recency, larger = more recent
  std::uint8_t reserved = 0;

  SPARSEKV_HOST_DEVICE bool occupied() const { return partition != kInvalidPartition; }
};
static_assert(sizeof(GpuPageEntry) == 12);

// Pages one partition may span (GpuPageEntry::page_in_partition is 16 bits).
inline constexpr std::uint32_t kMaxPagesPerPartition = 1u << 16;

// Partition offset table (CPU tier): index of a partition's first page in the
// CPU page table. Its page count follows from its token count (Spin §5.2).
using PartitionOffset = std::uint32_t;
// CPU page table (CPU tier): flat per-head array of CPU page ids.
using CpuPageEntry = PageId;

SPARSEKV_HOST_DEVICE constexpr std::uint32_t pages_for_tokens(std::uint32_t tokens, std::uint32_t page_tokens) {
  return (tokens + page_tokens - 1) / page_tokens;
}

}  // namespace sparsekv
