#pragma once
// DeviceRuntime: what the library keeps and runs on the device for the
// device-tensor API (docs/device-decode.md): the replica of the GPU-side
// tables and its syncs with the host's, the summary store, the prompt's
// Index and Offload, and each decode step's chain of launches. The device
// step (device_step.hpp) keeps the host's part of a step -- checks, the
// buffer's bookkeeping of tails and saves, the new table entries -- and hands
// the runtime one DeviceStepInput per layer step; the runtime enqueues
// everything else on the engine's stream: append (+ summaries and save of
// full tails), Select, the LRU step on the device tables, the gather of the
// misses, the plan and the attention. Nothing in a step reads device data on
// the host.
//
// The interface is host-only; the CUDA library implements it
// (cuda/step/device_runtime.cpp, made by CudaBackend::make_device_runtime). A
// backend without one (HostBackend) serves the host-tensor API only.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

#include "sparsekv/attention/attend_plan.hpp"
#include "sparsekv/cache/cache_step.hpp"
#include "sparsekv/core/ids.hpp"
#include "sparsekv/core/model_shape.hpp"
#include "sparsekv/partition/partition_map.hpp"
#include "sparsekv/policy/device_select.hpp"
#include "sparsekv/policy/host_state_feed.hpp"

namespace sparsekv {

class TieredKVBuffer;

// Fixed capacities of the runtime's device arrays, so a step of any batch up
// to max_batch can be captured in a CUDA graph and replayed.
struct DeviceRuntimeSetup {
  ModelShape shape;
  std::uint32_t page_tokens = 0;
  std::uint32_t max_batch = 0;                // entries per step
  std::uint32_t max_requests = 0;             // table slots (Config::max_requests)
  std::uint32_t max_partitions_per_head = 0;  // summary rows per (request, layer, kv head)
  std::uint32_t max_selected_per_head = 0;    // partitions one Select returns at most
  std::uint32_t max_pages_per_head = 0;       // pages one selection covers at most (mandatory pages)
  std::uint32_t timestamp_buckets = 0;
  // Any layer's device Select: the summaries the store keeps and the first
  // candidate's partition id are the same in every layer.
  DeviceSelect select;
  float scale = 1.0f;
};

// One layer's decode step: the host's part, computed without device data.
// Row r = b * kv_heads + h.
struct DeviceStepInput {
  std::uint32_t layer = 0;
  std::uint32_t batch = 0;
  const void* q = nullptr;      // device, [batch][q_heads][head_dim], model dtype
  const void* k_new = nullptr;  // device, [batch][kv_heads][head_dim]
  const void* v_new = nullptr;
  float* out = nullptr;                          // device, [batch][q_heads][head_dim] fp32; null: plan only
  void* stream = nullptr;                        // the engine's cudaStream_t
  DeviceSelect select;                           // this layer's
  std::span<const std::uint32_t> request_slots;  // [batch]: the table slot of each entry's request
  std::span<const std::uint32_t> tail_slots;     // [batch]: tokens in the tail before this one
  std::span<const PageId> tail_pages;            // [rows]
  std::span<const std::uint32_t> tail_tokens;    // [rows]: tokens attended in the tail after the append
  std::span<const std::uint32_t> candidates;     // [rows]: partitions Select sees (before this step's save)
  // [rows]: the CPU page a filling tail is saved to, which the host mapped as
  // partition candidates[r] (its meta entry reaches the device tables in
  // this step's arguments); unread for entries whose tail does not fill.
  std::span<const PageId> save_pages;
  std::span<const std::size_t> instances;  // [rows]: HierarchicalPageTable::instance
  // [rows]: what each row reads of the host policy state (host_state_row);
  // empty for the kinds whose rows read none.
  std::span<const HostStateRow> host_state_rows;
};

// Accumulated device time of the timed steps' stages (DeviceRuntime::time_stages),
// milliseconds between cudaEvents recorded on the step's stream at the stage
// boundaries: append = the step's argument upload, the table writes and the
// append launch; select; lru = the LRU batch and the LRU step; gather = the
// miss gather and the stats totals; attend = the plan and the attention (or
// the plan alone for plan()). Their sum is the step's stream time from its
// first enqueue to its last; the host work before that (Manager's part of
// the step) is not in it.
struct DeviceStageTimes {
  std::uint64_t steps = 0;  // timed steps completed
  // Stream time of each stage, between events recorded at its ends.
  double append_ms = 0, select_ms = 0, lru_ms = 0, gather_ms = 0, attend_ms = 0;
  // Host wall time the runtime spent enqueuing each stage (append's from the
  // step's entry: the argument slot and its copy included), and its whole
  // step, entry to return: beside the stream times, where a host-bound step
  // spends its time.
  double host_append_ms = 0, host_select_ms = 0, host_lru_ms = 0, host_gather_ms = 0, host_attend_ms = 0;
  double host_step_ms = 0;
};

class DeviceRuntime {
 public:
  virtual ~DeviceRuntime() = default;

  // The request's device tables made equal to the master's (after
  // add_request, prefill, resize); returns with the copies complete.
  virtual void upload_tables(RequestId request) = 0;
  // Waits for every step enqueued so far, then copies the request's device
  // tables back into the master (before the host reads or changes what the
  // LRU kernel owns: finish, resize, reclaim). A sync, off the step's path.
  virtual void download_tables(RequestId request) = 0;
  // The Index summaries of a prompt's one-page partitions of (slot, layer),
  // from device keys [tokens][kv_heads][head_dim], enqueued on `stream`.
  virtual void index_prompt(std::uint32_t slot, std::uint32_t layer, const void* keys, std::uint32_t tokens,
                            void* stream) = 0;
  // The index of the first non-finite value among `count` model-dtype values
  // at device `data`, or kNoNonFinite, read on `stream` after the work
  // enqueued there; waits (prefill is off the step's path): a prompt's
  // non-finite K/V must never reach the CPU tier, the source of truth.
  static constexpr std::uint64_t kNoNonFinite = ~std::uint64_t{0};
  virtual std::uint64_t first_non_finite(const void* data, std::uint64_t count, void* stream) = 0;
  // Offload of a prompt's device K / V into the CPU tier through the staged
  // D2H path (transfer/flash_d2h_save.hpp; SparseServe §3.2.2 FlashD2H, §3.4
  // layer-segmented prefill): one contiguous copy per tensor into pinned
  // staging after the work enqueued on `stream`, host workers scattering the
  // rows into their pages. Row t * kv_heads + h of K and of V goes to
  // placements[t * kv_heads + h] (PromptOffloader::offload_on_device). Returns
  // with every row written: the caller may free or reuse k and v at once,
  // and no device copy of the prompt is kept.
  virtual void offload_prompt(const void* k, const void* v, std::span<const TokenPlacement> placements,
                              void* stream) = 0;
  // Whether `stream` is being captured into a CUDA graph (a step that must
  // wait for the device, RetroInfer's index update, cannot be captured).
  virtual bool capturing(void* stream) const = 0;
  // Candidates [0, rows.tokens.size()) of (slot, layer, head)'s summary
  // region from the host state's rows (host_summary_rows); waits. At
  // prefill and after an index update, off the step's path.
  virtual void write_summary_rows(std::uint32_t slot, std::uint32_t layer, std::uint32_t head,
                                  const HostSummaryRows& rows, void* stream) = 0;
  // Enqueues one layer's step on step.stream; returns without waiting.
  // Dispatches on step.select once, at its entry.
  virtual void step(const DeviceStepInput& step) = 0;
  virtual DeviceAttendPlan plan() const = 0;
  // Totals of the steps so far (waits for them: for inspection, not the loop).
  virtual CacheStepStats cache_stats() = 0;
  // Throws invalid_argument naming the first non-finite q / k / v value a
  // completed step found (its row was not written), then clears the report.
  // Reads only what earlier steps left in pinned memory: no sync, and nothing
  // while `stream` is being captured into a graph.
  virtual void check_values(void* stream) = 0;
  virtual void synchronize() = 0;
  // Opt-in stage timing of later eager steps (off by default): timing
  // events recorded on the step's stream between its stages, read when the
  // step's ring slot is harvested -- no host sync added to the step. Steps
  // captured into a CUDA graph are not timed.
  virtual void time_stages(bool on) = 0;
  // Totals over the timed steps so far (waits for them: for inspection, not
  // the loop).
  virtual DeviceStageTimes stage_times() = 0;
};

}  // namespace sparsekv
