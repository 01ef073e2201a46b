#pragma once
// StepPlan: one decode step of (batch, layer) planned against the pools
// before anything changes, then committed -- llama.cpp's
// llama_kv_cache::prepare() / apply_ubatch(). Every runner (host_step.hpp,
// evicting_step.hpp, device_step.hpp) records each batch entry here while it
// prepares: whether its tail fills, the policy state it commits (a copy that
// saw the full page, or the token placed), the regroup the policy asked for,
// and what the entry takes from and gives back to the CPU pool. check() then
// replays the pool in the exact order the runner's commit will take and free
// pages, so it neither refuses a step that fits nor lets one fail half-way,
// and sums the metadata segments the step may map. Nothing in the buffer
// changes until the runner commits.
#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

#include "sparsekv/buffer/tiered_kv_buffer.hpp"
#include "sparsekv/core/ids.hpp"
#include "sparsekv/policy/sparse_attention.hpp"
#include "sparsekv/policy/token_eviction.hpp"

namespace sparsekv {

// The order a runner's commit takes and frees CPU pages in.
enum class CommitOrder : std::uint8_t {
  entry_by_entry,  // host: each entry's save (or eviction then placement), then its regroup
  saves_first,     // device: every save (enqueued with the step), then the regroups in batch order
};

// What one batch entry takes and frees, in its commit's order.
struct EntryDemand {
  RequestId request = 0;
  bool placement = false;          // an evicting entry: copies, frees `freed_first`, then places its token
  std::uint64_t copied_first = 0;  // private copies of the shared pages it evicts from, taken before any frees
  std::uint64_t freed_first = 0;
  std::uint64_t taken = 0;  // pages a save or placement takes
  bool regroups = false;    // then frees regroup_freed and takes regroup_taken
  std::uint64_t regroup_taken = 0, regroup_freed = 0;
  SegmentDemand segments;
};

// The replay of a step's entries over the CPU pool and the segment pools
// (non-template: src/step/step_plan.cpp).
class PoolReplay {
 public:
  void reset() { entries_.clear(); }
  void add(const EntryDemand& demand) { entries_.push_back(demand); }
  // Throws resource_exhausted naming the first entry (in commit order) that
  // would not fit `cpu_free` pages, or the segments the table cannot map.
  void check(std::uint64_t cpu_free, CommitOrder order, const HierarchicalPageTable& table) const;

 private:
  std::vector<EntryDemand> entries_;
};

// A regroup the policy asks for must describe each kv head as it will be once
// the page is saved: one first partition and spec per kv head, its run ending
// at the saved partition and covering exactly its tokens plus the saved
// page's. Checked before anything changes: a policy bug must not leave a
// request half-stepped. Throws failed_precondition.
void check_regroup(std::string_view policy, const HierarchicalPageTable& table, RequestId request, std::uint32_t layer,
                   std::uint32_t head, std::uint32_t kv_heads, std::uint32_t page_tokens, const Repartition& regroup,
                   PartitionId saved_partition);

// Per batch entry, what the step commits besides the buffer's own changes.
template <class State>
struct PlannedEntry {
  bool saves = false;                   // this token fills the tail page
  State state;                          // the policy state to commit (saves, or an evicting entry)
  std::optional<Repartition> regroup;   // the policy's, with the save
  std::vector<float> page_k, page_v;    // the full page, fp32 [token][kv_head][dim]
  std::vector<PartitionId> partitions;  // its partition id in each kv head
  // The policy never regroups (kRegroups): it sees the page at commit, on its
  // own state, and `state` is unused.
  bool appends_at_commit = false;
  bool feeds = false;  // device path: the state was fed the pages since its last update
};

template <class State>
class StepPlan {
 public:
  // Starts a step of `batch` entries.
  void begin(std::size_t batch) {
    entries_.resize(batch);
    for (PlannedEntry<State>& e : entries_) {
      e.saves = false;
      e.regroup.reset();
      e.appends_at_commit = false;
      e.feeds = false;
    }
    replay_.reset();
  }
  PlannedEntry<State>& entry(std::size_t b) { return entries_[b]; }
  const PlannedEntry<State>& entry(std::size_t b) const { return entries_[b]; }
  std::size_t size() const noexcept { return entries_.size(); }

  // An entry whose tail fills: its save, then its regroup when it has one.
  void add_save(RequestId request, const SaveDemand& d, bool regroups) {
    replay_.add({request, false, 0, 0, d.saved_pages, regroups, d.regroup_pages, d.freed_pages, d.segments});
  }
  // An evicting entry: its evictions copy shared pages and free pages, then its token takes some.
  void add_placement(RequestId request, const EvictionDemand& d) {
    replay_.add({request, true, d.copied_pages, d.freed_pages, d.placed_pages, false, 0, 0, d.segments});
  }
  // Throws resource_exhausted when the step as recorded would not fit.
  void check(const TieredKVBuffer& buffer, CommitOrder order) const {
    replay_.check(buffer.tiers().cpu_pool.available(), order, buffer.tiers().table);
  }

 private:
  std::vector<PlannedEntry<State>> entries_;
  PoolReplay replay_;
};

}  // namespace sparsekv
