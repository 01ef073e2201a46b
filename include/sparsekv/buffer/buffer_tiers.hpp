#pragma once
// BufferTiers: what every part of a TieredKVBuffer works on (Spin §4.1,
// §5.3): the CPU tier (the source of truth), the GPU tier (a cache of what
// recent steps selected), the four page tables over them, the partition map
// that lays tokens into pages, the bucketed LRU that fills the GPU slots, and
// the transfer that moves bytes between the tiers. The parts
// (buffer_admission.hpp, prompt_offloader.hpp, tail_appender.hpp,
// page_retriever.hpp, regrouper.hpp, token_evictor.hpp, prefix_forks.hpp)
// share one BufferTiers and one BufferRequests; TieredKVBuffer owns them.
//
// Engine layout of K/V: `k` and `v` are separate row-major arrays
// [tokens][kv_heads][head_dim] of the model's dtype (f32 / f16 / bf16, bytes
// copied unchanged; no conversion), or of the storage dtype.
#include <cstdint>

#include "sparsekv/cache/bucketed_lru.hpp"
#include "sparsekv/core/config.hpp"
#include "sparsekv/core/model_shape.hpp"
#include "sparsekv/memory/page_pool.hpp"
#include "sparsekv/metadata/hierarchical_page_table.hpp"
#include "sparsekv/partition/partition_map.hpp"
#include "sparsekv/transfer/page_transfer.hpp"

namespace sparsekv {

// Where a step's Attend reads the selected pages: GPU-tier copies (the
// cache), or the CPU pages where they are (a CPU engine: both tiers are host
// memory, so nothing is cached and a request's tails are CPU pages).
enum class AttendSite : std::uint8_t { gpu_tier, cpu_tier };

// K/V of `tokens` tokens of one layer, engine layout [tokens][kv_heads][head_dim].
struct KvChunk {
  const void* k = nullptr;
  const void* v = nullptr;
  std::uint32_t tokens = 0;
  DType dtype = DType::bf16;
};

struct BufferStats {
  CacheStepStats cache;
  std::uint64_t retrieve_steps = 0;   // (request, layer, kv head) steps
  std::uint64_t bytes_loaded = 0;     // CPU -> GPU by retrieve
  std::uint64_t pages_saved = 0;      // GPU tail -> CPU by append
  std::uint64_t bytes_offloaded = 0;  // prefill K/V written to the CPU tier
  std::uint64_t pages_freed = 0;      // CPU pages evict() released (free_block, slot_reuse)
  std::uint64_t pages_copied = 0;     // CPU pages a sparse_copy compaction wrote
  std::uint64_t slots_copied = 0;     // live rows it moved into them
  std::uint64_t pages_shared = 0;     // CPU pages offload_shared mapped by reference instead of writing
  std::uint64_t pages_unshared = 0;   // shared pages evict() copied for the request masking them
};

// Transfers run in order (one stream), so a page released and reused while a
// copy to it is in flight is safe; before a part reads or rewrites CPU pages
// on the host (offload, regroup, compaction) it completes the transfers in flight.
struct BufferTiers {
  // Refuses (invalid_argument) memory the parts cannot use: see TieredKVBuffer's constructors.
  BufferTiers(const ModelShape& shape, const Config& config, MemoryResource& cpu_tier, MemoryResource& gpu_pages,
              MemoryResource& gpu_tables, PageTransfer& transfer, const HeadCapacity& capacity, AttendSite site);

  ModelShape shape;
  Config config;
  PageLayout layout;
  AttendSite site = AttendSite::gpu_tier;
  PageTransfer& transfer;
  PagePool cpu_pool;
  PagePool gpu_pool;
  HierarchicalPageTable table;
  PartitionMap partitions;
  BucketedLru lru;
  BufferStats stats;

  std::uint64_t heads() const noexcept { return std::uint64_t{shape.layers} * shape.kv_heads; }
  // Where the tails live: the GPU tier, or the CPU tier in place.
  PagePool& tail_pool() noexcept { return site == AttendSite::cpu_tier ? cpu_pool : gpu_pool; }
  const PagePool& tail_pool() const noexcept { return site == AttendSite::cpu_tier ? cpu_pool : gpu_pool; }
};

}  // namespace sparsekv
