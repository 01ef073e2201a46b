#pragma once
// Types shared by the replacement policies of one GPU buffer (Spin §5.3): the
// bucketed LRU the library runs, and the references it is judged against
// (exact LRU, Belady's offline optimum). Every policy sees the same step: a
// selection of partitions that must all be resident afterwards; it decides
// only which unselected partitions to evict when the misses need room.
#include <cstdint>

namespace sparsekv {

struct CacheStepStats {
  std::uint64_t hit_partitions = 0;  // 64-bit: summed over every step of a long run
  std::uint64_t miss_partitions = 0;
  std::uint64_t hit_pages = 0;
  std::uint64_t miss_pages = 0;  // = pages moved CPU -> GPU this step
  std::uint64_t evicted_pages = 0;

  CacheStepStats& operator+=(const CacheStepStats& o) {
    hit_partitions += o.hit_partitions;
    miss_partitions += o.miss_partitions;
    hit_pages += o.hit_pages;
    miss_pages += o.miss_pages;
    evicted_pages += o.evicted_pages;
    return *this;
  }
  // Hit ratio by pages: the share of selected KV bytes already on the GPU.
  double hit_ratio() const {
    const std::uint64_t total = hit_pages + miss_pages;
    return total == 0 ? 0.0 : double(hit_pages) / double(total);
  }
};

}  // namespace sparsekv
