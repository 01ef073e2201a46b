#pragma once
// StepStats: what a Manager's prefills and decode steps did, summed over its
// life (Manager::stats()).
#include <cstdint>

#include "sparsekv/cache/cache_step.hpp"

namespace sparsekv {

struct StepStats {
  CacheStepStats cache;           // hits + misses = selected pages
  std::uint64_t pages_moved = 0;  // CPU -> GPU by Retrieve
  std::uint64_t bytes_moved = 0;
  std::uint64_t pages_saved = 0;   // GPU tail -> CPU by decode appends, one per kv head (as BufferStats)
  std::uint64_t decode_steps = 0;  // (request, layer) decode steps
  // What host steps' selections held (HostStep; the device-resident step
  // leaves them 0), every kv head, in place too where no page is a hit or a
  // miss: pages of the selected partitions, and their tokens (the rows
  // Attend reads).
  std::uint64_t pages_selected = 0;
  std::uint64_t tokens_selected = 0;
  // Wall time per operation, seconds. A step split across threads counts its
  // phases' wall time (Select and Attend from the end of the phase before to
  // the start of the one after).
  double index_s = 0, offload_s = 0, append_s = 0, select_s = 0, retrieve_s = 0, attend_s = 0;

  double hit_ratio() const { return cache.hit_ratio(); }
};

}  // namespace sparsekv
