#pragma once
// TierUsage: what a Manager's tiers hold, by value (Manager::tier_usage), for
// an engine's metrics and leak checks: pages in use and in all per tier, the
// bytes the CPU tier reserved, and the buffer's transfer counters.
#include <cstdint>

#include "sparsekv/buffer/tiered_kv_buffer.hpp"

namespace sparsekv {

struct TierUsage {
  // Pages of one tier: in use, and in all.
  struct Pages {
    std::uint32_t used = 0;
    std::uint32_t total = 0;
  };
  Pages cpu;
  Pages gpu;                             // none when attending in place (the tails are CPU pages then)
  std::uint64_t page_bytes = 0;          // one page: K and V of page_tokens tokens of one (layer, kv head)
  std::uint64_t cpu_reserved_bytes = 0;  // host memory the CPU tier reserved (pinned when a GPU is present)
  AttendSite site = AttendSite::gpu_tier;
  BufferStats stats;
};

inline TierUsage tier_usage(const TieredKVBuffer& buffer) {
  const BufferTiers& t = buffer.tiers();
  return TierUsage{.cpu = {t.cpu_pool.used(), t.cpu_pool.capacity()},
                   .gpu = {t.gpu_pool.used(), t.gpu_pool.capacity()},
                   .page_bytes = t.cpu_pool.page_bytes(),
                   .cpu_reserved_bytes = t.cpu_pool.reserved_bytes(),
                   .site = t.site,
                   .stats = t.stats};
}

}  // namespace sparsekv
