#pragma once
// TieredKVBuffer: the library-owned operations Offload and Retrieve (Spin
// §4.1) over a CPU tier that is the source of truth and a GPU tier that caches
// what recent steps selected (Spin §5.3).
//
//  - Offload: a request's prefill K/V of one layer, in the engine's layout
//    (below), becomes head-wise CPU pages grouped by the policy's
//    PartitionSpec; tokens of a variable-size partition are packed into
//    contiguous pages.
//  - Append: each decode token goes to a GPU-resident tail page per (layer, kv
//    head); when the tail is full it is saved to a new CPU page as a new
//    one-page partition (SparseServe §3.2.2). The tail always takes part in
//    attention.
//  - Retrieve: per kv head, the selected partitions' GPU pages (hits and
//    misses) from a BucketedLru step, and the copies of the misses, which the
//    buffer runs before returning.
//  - Elasticity: each request owns `slots` GPU pages per (layer, kv head):
//    its mandatory pages (the most one step selects) plus buffering pages, at
//    least min_buffer_ratio x mandatory (Spin's 5x). resize() changes it;
//    reclaim() takes buffering pages back from the tail of every request's GPU
//    page table in proportion to its sequence length, never below its minimum.
//  - Admission advice (the engine queues, never the library): can_admit()
//    and the SparseServe §3.3 working set.
//  - Token eviction (SpvLLM §2), for requests whose budget says `evicts`
//    (the page table then needs slot masks, HeadCapacity::slot_masks): every
//    partition is one page, a decode token is written through to a CPU page
//    slot (and to the page's GPU copy when resident) by place_token instead of
//    going to a tail, and evict() masks positions out, then frees or compacts
//    pages as Config::eviction_strategy says (docs/buffer.md). The buffer maps
//    sequence positions to (partition, slot); policies deal in positions only.
//
//  - Attending in place (AttendSite::cpu_tier, a CPU engine's backend): on a
//    CPU both tiers are host memory, so nothing is cached: a request has no
//    GPU slots, its tails are CPU pages, and retrieve() returns the selected
//    partitions' CPU pages themselves (Retrieval::in_place), with no copy and
//    no LRU step. Selections, tails and saves are otherwise the same.
//
// Engine layout of K/V: `k` and `v` are separate row-major arrays
// [tokens][kv_heads][head_dim] of the model's dtype (f32 / f16 / bf16, bytes
// copied unchanged; no conversion).
//
// Bytes move through a PageTransfer (transfer/page_transfer.hpp): the host
// backend keeps the GPU tier in host memory standing in for HBM and copies
// with memcpy; the CUDA backend keeps GPU-tier pages in device memory and
// moves them with the gather kernel and asynchronous copies, leaving them in
// flight on its stream. The metadata (all four tables) stays host-accessible
// in both: the bucketed-LRU step runs on the host, the GPU-side tables living
// in mapped pinned memory that kernels read through UVA. Transfers run in
// order (one stream), so a page released and reused while a copy to it is in
// flight is safe; before the buffer reads or rewrites CPU pages on the host
// (offload, repartition) it completes the transfers in flight.
// Not thread-safe; every call that throws changes nothing.
#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "sparsekv/buffer/eviction_head.hpp"
#include "sparsekv/buffer/working_set_window.hpp"
#include "sparsekv/cache/bucketed_lru.hpp"
#include "sparsekv/core/config.hpp"
#include "sparsekv/core/error_code.hpp"
#include "sparsekv/core/model_shape.hpp"
#include "sparsekv/memory/page_pool.hpp"
#include "sparsekv/metadata/hierarchical_page_table.hpp"
#include "sparsekv/partition/partition_map.hpp"
#include "sparsekv/partition/partition_spec.hpp"
#include "sparsekv/transfer/page_transfer.hpp"

namespace sparsekv {

// Where a step's Attend reads the selected pages: GPU-tier copies (the
// cache), or the CPU pages where they are.
enum class AttendSite : std::uint8_t { gpu_tier, cpu_tier };

// K/V of `tokens` tokens of one layer, engine layout [tokens][kv_heads][head_dim].
struct KvChunk {
  const void* k = nullptr;
  const void* v = nullptr;
  std::uint32_t tokens = 0;
  DType dtype = DType::bf16;
};

// What a request reserves in the GPU tier, in pages per (layer, kv head) (a
// policy's budget is in tokens), and whether it evicts tokens.
struct RequestPages {
  // Most pages one step selects in any (layer, kv head): the policy's budget in pages.
  std::uint32_t mandatory_pages = 0;
  // GPU pages per (layer, kv head); 0 = the minimum, mandatory x (1 + min_buffer_ratio).
  std::uint32_t buffer_pages = 0;
  // The policy evicts tokens for good: no GPU tail page, decode tokens go
  // through place_token, and evict() applies Config::eviction_strategy.
  bool evicts = false;
};

// What a decode append that fills the tail takes, with the regroup that may
// follow it (TieredKVBuffer::save_demand). The save takes `saved_pages` CPU
// pages; the regroup then returns `freed_pages` to the pool (its runs' pages,
// the saved ones included, that no other request shares) before it takes
// `regroup_pages`.
struct SaveDemand {
  std::uint64_t saved_pages = 0;
  std::uint64_t freed_pages = 0;
  std::uint64_t regroup_pages = 0;
  SegmentDemand segments;  // metadata segments beyond those mapped now, at the most demanding point
};

// What one decode step of a request that evicts takes, as a dry run of
// evict() then place_token() (TieredKVBuffer::append_demand_evicting).
// evict() first takes `copied_pages` CPU pages (private copies of the shared
// pages it masks), then returns `freed_pages` to the pool (a sparse_copy
// compaction's new pages already netted out: it frees its run before taking
// them); place_token() then takes `placed_pages`.
struct EvictionDemand {
  std::uint64_t copied_pages = 0;
  std::uint64_t freed_pages = 0;
  std::uint64_t placed_pages = 0;
  SegmentDemand segments;                      // beyond those mapped now, at the most demanding point
  std::vector<std::uint32_t> live_partitions;  // per kv head, once the token is placed
};

// admit is true exactly when add_request(budget) would succeed now and the
// prompt fits the CPU tier; otherwise `reason` says why (the first check that fails).
struct AdmissionAdvice {
  bool admit = false;
  std::string reason;
  bool request_slot_free = false;
  std::uint64_t gpu_pages_needed = 0;  // slots + one tail page per (layer, kv head)
  std::uint64_t gpu_pages_free = 0;
  std::uint64_t gpu_pages_reclaimable = 0;  // buffering pages above the other requests' minimum
  std::uint64_t cpu_pages_needed = 0;       // the prompt's CPU pages over all (layer, kv head)
  std::uint64_t cpu_pages_free = 0;
};

// What one retrieve() of one layer returns, for all kv heads.
struct Retrieval {
  // Selected partitions of head h: partitions[head_offsets[h] .. head_offsets[h + 1]).
  std::vector<std::uint32_t> head_offsets;
  std::vector<PartitionId> partitions;
  std::vector<std::uint32_t> token_counts;  // per selected partition
  // Pages of selected partition i: pages.gpu_pages[pages.partition_offsets[i] ..
  // pages.partition_offsets[i + 1]); pages.copies were run before return.
  // In place (a buffer of AttendSite::cpu_tier), these are CPU-tier pages,
  // the tails too, and nothing is copied.
  bool in_place = false;
  RetrievedPages pages;
  // The resident tail of each head: page and token count (0 = empty).
  std::vector<PageId> tail_pages;
  std::vector<std::uint32_t> tail_tokens;
  // Requests that evict only (else empty): the slot mask of each page of
  // pages.gpu_pages, and the sequence position each of its slots holds,
  // slot_positions[i * page_tokens + t], kNoPosition for a slot not live.
  std::vector<SlotMask> page_masks;
  std::vector<std::uint32_t> slot_positions;
  CacheStepStats stats;

  // Calls fn(gpu_page, tokens) for every page kv head h attends: the selected
  // partitions' pages in order (a partition's last page may be partial), then
  // the tail if it holds tokens.
  template <class Fn>
  void for_each_page(std::uint32_t head, std::uint32_t page_tokens, Fn&& fn) const {
    for_each_page_masked(head, page_tokens, [&fn](PageId page, std::uint32_t tokens, SlotMask) { fn(page, tokens); });
  }
  // As for_each_page, with fn(gpu_page, tokens, mask): the page's slot mask,
  // all of its tokens live unless page_masks says otherwise.
  template <class Fn>
  void for_each_page_masked(std::uint32_t head, std::uint32_t page_tokens, Fn&& fn) const {
    for (std::uint32_t i = head_offsets[head]; i < head_offsets[head + 1]; ++i) {
      std::uint32_t left = token_counts[i];
      for (std::uint32_t p = pages.partition_offsets[i]; p < pages.partition_offsets[i + 1]; ++p) {
        const std::uint32_t tokens = left < page_tokens ? left : page_tokens;
        fn(pages.gpu_pages[p], tokens, page_masks.empty() ? full_slot_mask(tokens) : page_masks[p]);
        left -= tokens;
      }
    }
    if (tail_tokens[head] > 0) fn(tail_pages[head], tail_tokens[head], full_slot_mask(tail_tokens[head]));
  }
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

class TieredKVBuffer {
 public:
  // `cpu_tier` backs the CPU pages and CPU-side tables, `gpu_tier` the GPU
  // pages and GPU-side tables; the host backend needs both host-accessible.
  TieredKVBuffer(const ModelShape& shape, const Config& config, MemoryResource& cpu_tier, MemoryResource& gpu_tier);
  // A backend of its own: GPU-tier pages from `gpu_pages` (device memory when
  // `transfer` reaches it), the meta-partition and GPU page tables in
  // host-accessible `gpu_tables`, bytes moved by `transfer`. All three must
  // outlive the buffer. `capacity`: the most partitions and CPU pages a head
  // can hold (the policy's, or Config::head_capacity()); the page table is
  // sized for it. `site`: AttendSite::cpu_tier attends the CPU tier in place
  // (host memory only; gpu_pages then holds nothing).
  TieredKVBuffer(const ModelShape& shape, const Config& config, MemoryResource& cpu_tier, MemoryResource& gpu_pages,
                 MemoryResource& gpu_tables, PageTransfer& transfer);
  TieredKVBuffer(const ModelShape& shape, const Config& config, MemoryResource& cpu_tier, MemoryResource& gpu_pages,
                 MemoryResource& gpu_tables, PageTransfer& transfer, const HeadCapacity& capacity,
                 AttendSite site = AttendSite::gpu_tier);

  // Registers a request and gives it its GPU pages, reclaiming buffering
  // pages from other requests when the GPU tier is short.
  void add_request(RequestId request, const RequestPages& budget);
  // Releases every page of the request and forgets it.
  void finish(RequestId request);

  void offload(RequestId request, std::uint32_t layer, const KvChunk& kv, std::span<const PartitionSpec> specs);
  // The device prefill's Offload (docs/device-decode.md): the checks and
  // mapping of offload() with no byte moved; placements[t * kv_heads + h]
  // ([tokens][kv_heads], the engine layout's row order) is where token t of
  // kv head h goes, for the caller to write (DeviceRuntime::offload_prompt,
  // through the staged D2H path) before anything reads those pages. Throws
  // what offload() throws, changing nothing.
  void offload_on_device(RequestId request, std::uint32_t layer, std::uint32_t tokens,
                         std::span<const PartitionSpec> specs, std::vector<TokenPlacement>& placements);
  void append(RequestId request, std::uint32_t layer, const KvChunk& token);
  // The device decode step's append (docs/device-decode.md): the checks and
  // bookkeeping of append() with no byte moved, the device writing the row
  // into tail slot `tail_slot` of each head's tail_page() and, when the token
  // fills the tail, copying the page to the CPU page reserved here. A filling
  // token maps the full page as a new one-page partition per kv head, as
  // append() does, and writes head h's reserved CPU page to cpu_pages[h]
  // (kv_heads entries; untouched otherwise). Throws what append() throws for
  // the request, layer and pools, changing nothing.
  struct DeviceAppendSlot {
    std::uint32_t tail_slot = 0;  // tokens in the tail before this one
    bool fills_tail = false;
  };
  DeviceAppendSlot append_on_device(RequestId request, std::uint32_t layer, std::span<PageId> cpu_pages);
  // `selections[h]`: distinct partition ids of kv head h. Fills `out`.
  void retrieve(RequestId request, std::uint32_t layer, std::span<const std::vector<PartitionId>> selections,
                Retrieval& out);
  // The checks retrieve() makes first, changing nothing: one selection per kv
  // head, distinct partitions in range, within the request's mandatory pages
  // and GPU slots. Throws what retrieve() would.
  void check_selection(RequestId request, std::uint32_t layer, std::span<const std::vector<PartitionId>> selections);

  // Regroups, in every kv head h, the tokens of partitions
  // [first_partitions[h], end) -- in their page order, token i of the run is
  // specs[h]'s token i -- into specs[h]'s partitions, which take ids
  // first_partitions[h] onwards (a policy re-indexing decode tokens, e.g.
  // RetroInfer's per-segment clustering). Cached copies of the regrouped
  // partitions are evicted first; the CPU tier keeps every byte.
  void repartition(RequestId request, std::uint32_t layer, std::span<const PartitionId> first_partitions,
                   std::span<const PartitionSpec> specs);
  // Sizes an append() that fills the tail of `layer` (the full tail becomes a
  // one-page partition per kv head) followed, when `specs` is not empty, by
  // repartition(request, layer, first_partitions, specs) over runs that end
  // with the saved pages: a policy regrouping as a decode page arrives. The
  // runs are replaced, not added to. Throws what those two calls would for
  // bad arguments or the page table's per-head maxima (at both points);
  // changes nothing. Pools are the caller's to check, in call order.
  SaveDemand save_demand(RequestId request, std::uint32_t layer, std::span<const PartitionId> first_partitions = {},
                         std::span<const PartitionSpec> specs = {}) const;

  void resize(RequestId request, std::uint32_t slots_per_head);
  // Frees at least `gpu_pages` GPU pages if the requests' buffering allows;
  // returns how many it freed (a multiple of layers x kv_heads).
  std::uint64_t reclaim(std::uint64_t gpu_pages);

  // `prompt_pages_per_head`: the most CPU pages one (layer, kv head) of the
  // prompt takes (a policy whose partitions pad their last page knows it);
  // by default the prompt in one-page partitions.
  AdmissionAdvice can_admit(std::uint32_t prompt_tokens, const RequestPages& budget,
                            std::optional<std::uint32_t> prompt_pages_per_head = std::nullopt) const;
  // The same for a prompt whose CPU pages over every (layer, kv head) are
  // `prompt_pages` in all (a fork's: fork_pages summed over the layers).
  AdmissionAdvice can_admit_pages(std::uint32_t prompt_tokens, const RequestPages& budget,
                                  std::uint64_t prompt_pages) const;
  // Pages of the partitions selected over the last working_set_window steps, summed over heads.
  std::uint64_t working_set_pages(RequestId request) const;

  // ---- Token eviction (requests whose budget evicts; others: failed_precondition) ----
  // positions[h]: the sequence positions kv head h drops, each live and listed
  // once (else invalid_argument). A page another request shares (a fork's
  // prefix) is copied first (copy-on-evict): the request masks its own copy
  // and the other keeps the page as it was. check_evict makes evict()'s
  // checks only.
  void check_evict(RequestId request, std::uint32_t layer, std::span<const std::vector<std::uint32_t>> positions) const;
  void evict(RequestId request, std::uint32_t layer, std::span<const std::vector<std::uint32_t>> positions);
  // The next position's K/V rows (one token, engine layout), written per kv
  // head into the slot the strategy picks: slot_reuse the lowest dead slot of
  // the fullest page with one (fewest dead slots, then lowest partition id);
  // otherwise the next slot of the open page (the last one opened); otherwise
  // a new one-page partition, under the lowest freed partition's id when the
  // head has one (EvictionHead). Throws resource_exhausted, changing nothing,
  // when a new page does not fit.
  void place_token(RequestId request, std::uint32_t layer, const KvChunk& token);
  // evict(positions) followed by place_token, as a dry run: checks what
  // check_evict checks and changes nothing.
  EvictionDemand append_demand_evicting(RequestId request, std::uint32_t layer,
                                        std::span<const std::vector<std::uint32_t>> positions) const;
  // Held partitions of one head with a live slot, ascending: the selection of
  // dense attention over the live tokens.
  void live_partitions(RequestId request, std::uint32_t layer, std::uint32_t head, std::vector<PartitionId>& out) const;
  std::uint32_t live_tokens(RequestId request, std::uint32_t layer, std::uint32_t head) const;
  // CPU pages the request holds and live slots in them, over every (layer, kv head).
  std::uint64_t held_pages(RequestId request) const;
  std::uint64_t live_slots(RequestId request) const;
  // Where a live position sits: partition * page_tokens + slot; nullopt when it is not live.
  std::optional<std::uint32_t> position_slot(RequestId request, std::uint32_t layer, std::uint32_t head,
                                             std::uint32_t position) const;
  // Maps the first `partitions` partitions of `source`'s layer into the same
  // layer of `request` in every kv head, sharing their pages, positions and
  // masks; `request`'s layer must be empty. Both must evict.
  void share_prefix(RequestId request, RequestId source, std::uint32_t layer, std::uint32_t partitions);

  // ---- Forks: a request started from another's first tokens (prefix caching) ----
  // How many of the layer's first tokens `request` holds saved in its CPU
  // pages: positions 0 .. n-1 in every kv head. Without eviction, the
  // prompt's tokens in page order from partition 0 or in its scattered
  // placements, then the decode pages saved after them (none once a policy
  // regroups them); with eviction, the leading positions all still live.
  std::uint32_t saved_tokens(RequestId request, std::uint32_t layer) const;
  // How many of the layer's first tokens read_prefix can read, and so a fork
  // can take: the saved ones, and in place (AttendSite::cpu_tier, where the
  // unsaved decode page is a CPU-tier page too) that page's tokens when they
  // go on from them.
  std::uint32_t readable_tokens(RequestId request, std::uint32_t layer) const;
  // Copies the K/V rows of positions [first, end) of the layer into k and v
  // ([end - first][kv_heads][head_dim]) in dtype `as`: the model's (what a
  // fork's policy indexes; q8_0 storage comes back dequantized) or the
  // storage dtype (the stored bytes). Refuses (out_of_range) `end` beyond
  // readable_tokens(), (invalid_argument) any other dtype.
  void read_prefix(RequestId request, std::uint32_t layer, std::uint32_t first, std::uint32_t end, void* k, void* v,
                   DType as) const;
  // offload() of `source`'s first `tokens` tokens into `request`'s empty
  // layer, laid out by `specs`: where the specs' partitions are the same full
  // pages (a uniform spec of page-sized partitions) the pages are `source`'s,
  // shared by reference count, and only the partial last page is written;
  // any other spec, or a request that evicts, has every row copied (the
  // partitions differ, or masks must stay the request's own). The rows come
  // from `source`'s CPU pages. Same checks as offload(), changing nothing on
  // failure.
  void offload_shared(RequestId request, RequestId source, std::uint32_t layer, std::uint32_t tokens,
                      std::span<const PartitionSpec> specs);
  // The CPU pages offload_shared(·, source, layer, tokens, specs) takes, over
  // every kv head: what it writes, its shared pages counted once (the
  // source's). Throws what offload_shared throws for bad arguments.
  std::uint64_t fork_pages(RequestId source, std::uint32_t layer, std::uint32_t tokens,
                           std::span<const PartitionSpec> specs) const;

  bool has_request(RequestId request) const noexcept { return requests_.contains(request); }
  std::uint32_t slots_per_head(RequestId request) const;
  std::uint32_t min_slots_per_head(const RequestPages& budget) const;
  std::uint32_t sequence_length(RequestId request, std::uint32_t layer) const;
  PageId tail_page(RequestId request, std::uint32_t layer, std::uint32_t head) const;
  std::uint32_t tail_tokens(RequestId request, std::uint32_t layer) const;

  // Checks the page table and the buffer's own bookkeeping; throws
  // failed_precondition naming the first violation.
  void validate() const;

  const BufferStats& stats() const noexcept { return stats_; }
  const ModelShape& shape() const noexcept { return shape_; }
  const Config& config() const noexcept { return config_; }
  const PagePool& cpu_pool() const noexcept { return cpu_pool_; }
  const PagePool& gpu_pool() const noexcept { return gpu_pool_; }
  AttendSite attend_site() const noexcept { return site_; }
  const HierarchicalPageTable& table() const noexcept { return table_; }
  const PartitionMap& partitions() const noexcept { return partitions_; }
  PageTransfer& transfer() const noexcept { return *transfer_; }

 private:
  struct RequestState {
    RequestPages budget;
    std::uint32_t slots = 0;
    std::vector<std::uint32_t> tokens;       // per layer
    std::vector<std::uint32_t> tail_tokens;  // per layer
    std::vector<PageId> tail_pages;          // per (layer, kv head)
    std::vector<WorkingSetWindow> windows;   // per (layer, kv head)
    std::vector<EvictionHead> eviction;      // per (layer, kv head); empty unless budget.evicts
    // Per layer: its first tokens that lie in page order from partition 0
    // (positions p * page_tokens .. in partition p), in every kv head.
    std::vector<std::uint32_t> ordered_tokens;
    // Per (layer, kv head): the decode tail's saved pages that go on from the
    // layer's prompt where its order ended off a page boundary (or the prompt
    // was scattered): positions first_position .. + tokens, a page each in
    // partitions first_partition ... What a fork or read_prefix reads past
    // the prompt; cut where a regroup reaches its partitions.
    struct SavedTail {
      std::uint32_t first_position = 0;
      PartitionId first_partition = 0;
      std::uint32_t tokens = 0;
    };
    std::vector<SavedTail> saved_tail;
    // Per (layer, kv head): where each prompt token went when the prompt was
    // laid out off page order (a clustering policy), while no regroup has
    // reached its partitions [0, end); empty otherwise. What a fork reads.
    struct ScatteredPrompt {
      std::vector<TokenPlacement> placements;  // by position
      PartitionId end = 0;
    };
    std::vector<ScatteredPrompt> scattered;
  };
  // What evict() does to one head: the checks' result, computed before any change.
  struct HeadEviction {
    std::vector<std::pair<PartitionId, SlotMask>> cleared;  // partition, slots dying; ascending partitions
    std::vector<PartitionId> released;                      // pages whose last slot dies (free_block, slot_reuse)
    std::vector<PartitionId> copied;                        // shared pages that get a private copy first
    std::optional<PartitionId> run;                         // sparse_copy: first partition compacted
    std::uint32_t run_live = 0;                             // live rows of the run once evicted
    std::uint32_t run_pages = 0;                            // CPU pages the run holds now
  };

  // Why add_request(budget) would be refused now, or nothing: can_admit and add_request share it.
  std::optional<Refusal> refusal(const RequestPages& budget) const;
  RequestState& state(RequestId request);
  const RequestState& state(RequestId request) const;
  std::uint64_t heads() const noexcept { return std::uint64_t{shape_.layers} * shape_.kv_heads; }
  std::uint64_t reclaimable_slots(const RequestState& s) const;
  void check_chunk(const KvChunk& kv, std::uint32_t layer) const;
  // The device writes rows as the engine holds them: refused when the storage dtype differs.
  void check_device_rows(const char* call) const;
  // A token's rows (kv_heads of K, then of V) in the storage dtype: `token`'s
  // own when it is already, else converted into token_rows_.
  std::pair<const std::byte*, const std::byte*> stored_token(const KvChunk& token);
  // offload()'s checks of the request's state and the specs, then of the pools.
  void check_offload_specs(RequestId request, std::uint32_t layer, std::uint32_t tokens,
                           std::span<const PartitionSpec> specs) const;
  // The leading pages of `source`'s layer a fork of `tokens` tokens laid out
  // by `specs` shares (the same in every kv head).
  std::uint32_t fork_shared_pages(RequestId source, std::uint32_t layer, std::uint32_t tokens,
                                  std::span<const PartitionSpec> specs) const;
  void check_offload(RequestId request, std::uint32_t layer, std::uint32_t tokens,
                     std::span<const PartitionSpec> specs) const;
  void check_tail_save(RequestId request, std::uint32_t layer) const;
  // Refuses (failed_precondition) a request that evicts: it has no GPU tail.
  void check_has_tail(RequestId request, const RequestState& s) const;
  static std::uint32_t tail_pages_per_head(const RequestPages& budget) noexcept { return budget.evicts ? 0 : 1; }
  // Where the tails live: the GPU tier, or the CPU tier in place.
  PagePool& tail_pool() noexcept { return site_ == AttendSite::cpu_tier ? cpu_pool_ : gpu_pool_; }
  const PagePool& tail_pool() const noexcept { return site_ == AttendSite::cpu_tier ? cpu_pool_ : gpu_pool_; }
  // retrieve() in place: the selected partitions' CPU pages, in order.
  void locate(RequestId request, std::uint32_t layer, std::uint32_t head, std::span<const PartitionId> selected,
              RetrievedPages& out) const;
  const RequestState& evicting(RequestId request, std::uint32_t layer) const;
  EvictionHead& eviction_head(RequestState& s, std::uint32_t layer, std::uint32_t head);
  const EvictionHead& eviction_head(const RequestState& s, std::uint32_t layer, std::uint32_t head) const;
  bool shared(RequestId request, std::uint32_t layer, std::uint32_t head, PartitionId partition) const;
  std::vector<HeadEviction> plan_evict(RequestId request, std::uint32_t layer,
                                       std::span<const std::vector<std::uint32_t>> positions) const;
  // Where place_token puts head h's row now: an existing slot, or nullopt for a new page.
  std::optional<std::uint32_t> place_target(RequestId request, std::uint32_t layer, std::uint32_t head) const;
  void record_offload(RequestState& s, std::uint32_t layer, std::uint32_t head, PartitionId first,
                      const PartitionSpec& spec, std::uint32_t first_position);
  // Extends ordered_tokens over an offload of `tokens` tokens about to start
  // at s.tokens[layer]: while the layer is in page order so far, page-sized
  // uniform specs keep it so; returns whether it did.
  bool record_order(RequestState& s, std::uint32_t layer, std::span<const PartitionSpec> specs, std::uint32_t tokens);
  // Extends it over the page a full tail just became (saved[h]: its partition
  // in head h), when the order reached the page's first position on a page
  // boundary; else extends or starts the layer's saved-tail run.
  void record_save_order(RequestState& s, std::uint32_t layer, std::span<const PartitionId> saved) const;
  // The layer's first tokens readable from the prompt's layout alone (page
  // order or scattered placements), without eviction.
  std::uint32_t prompt_readable(const RequestState& s, std::uint32_t layer) const;
  void compact(RequestId request, RequestState& s, std::uint32_t layer, std::uint32_t head, PartitionId first);
  // validate()'s checks of one head of a request that evicts.
  void validate_eviction(RequestId request, const RequestState& s, std::uint32_t layer, std::uint32_t head) const;
  // The rows of partitions [first, end) of one head in page order, [token][K row, V row]
  // (only live slots when `live_only`; freed partitions hold none), their resident copies evicted first.
  void collect_run(RequestId request, std::uint32_t layer, std::uint32_t head, PartitionId first, bool live_only,
                   std::vector<std::byte>& rows);
  void grow_slots(RequestId request, RequestState& s, std::uint32_t slots);
  void shrink_slots(RequestId request, RequestState& s, std::uint32_t slots);
  void evict_partition(RequestId request, std::uint32_t layer, std::uint32_t head, PartitionId partition);
  // repartition's checks over runs [first_partitions[h], end), extended by one
  // full page per head not saved yet when `pending_page`; sets `out`'s freed
  // and regroup pages, and `segments[h]` to what head h demands once its run
  // is replaced.
  void regroup_demand(RequestId request, std::uint32_t layer, std::span<const PartitionId> first_partitions,
                      std::span<const PartitionSpec> specs, bool pending_page, SaveDemand& out,
                      std::vector<SegmentDemand>& segments) const;

  HostPageTransfer host_transfer_;  // used when no transfer is given
  PageTransfer* transfer_;
  AttendSite site_ = AttendSite::gpu_tier;
  ModelShape shape_;
  Config config_;
  PageLayout layout_;
  PagePool cpu_pool_;
  PagePool gpu_pool_;
  HierarchicalPageTable table_;
  PartitionMap partitions_;
  BucketedLru lru_;
  std::map<RequestId, RequestState> requests_;  // ordered: reclaim walks requests deterministically
  BufferStats stats_;
  std::vector<PageMove> moves_;                // scratch: a decode token's rows, Retrieve's copies
  std::vector<std::byte> token_rows_;          // scratch: a decode token's rows converted to the storage dtype
  std::vector<PartitionId> saved_partitions_;  // scratch: a saved tail page's partition per kv head
};

}  // namespace sparsekv
