#pragma once
// EvictionHead: the host-side bookkeeping of one (request, layer, kv head)
// whose policy evicts tokens for good (SpvLLM §2). The page table's slot
// masks say which slots are live; this maps sequence positions to slots and
// back, so policies deal in positions while the buffer moves rows
// (sparse_copy) or refills dead slots (slot_reuse). Every partition of such a
// head is one page, so a slot is numbered partition * page_tokens + slot.
//
// A page whose slots all die (free_block, slot_reuse) leaves a freed
// tombstone in the page table, and the next page the head opens takes the
// lowest tombstone's id instead of a new one. Without the reuse a head whose
// pages die before they fill (a budget near one page) would open a partition
// per token and outgrow a table sized for max_context_tokens / page_tokens;
// with it, the head holds at most that many partitions (docs/buffer.md), and
// ids already in the LRU, the working-set window and selections stay valid,
// which renumbering (compacting tombstones) would break.
#include <bit>
#include <cstdint>
#include <set>
#include <unordered_map>
#include <utility>
#include <vector>

#include "sparsekv/core/ids.hpp"
#include "sparsekv/memory/page_layout.hpp"

namespace sparsekv {

// A slot that holds no live token.
inline constexpr std::uint32_t kNoPosition = 0xffffffffu;

// Slots below `tokens` that are not live.
constexpr std::uint32_t dead_slots(SlotMask mask, std::uint32_t tokens) noexcept {
  return static_cast<std::uint32_t>(std::popcount(full_slot_mask(tokens) & ~mask));
}

struct EvictionHead {
  std::vector<std::uint32_t> slot_position;               // [partition * page_tokens + slot]; kNoPosition unless live
  std::unordered_map<std::uint32_t, std::uint32_t> live;  // position -> partition * page_tokens + slot
  std::set<std::pair<std::uint32_t, PartitionId>> reusable;  // (dead slots, partition) of held pages with a dead slot
  std::uint32_t held_pages = 0;                              // partitions not freed
  std::set<PartitionId> freed;                               // tombstones, the lowest reused first
  PartitionId open = kInvalidPartition;                      // the page fresh tokens fill in order: the last opened
};

}  // namespace sparsekv
