#pragma once
// DeviceDecoder: the device half of Manager's device-tensor API
// (docs/device-decode.md; ARCHITECTURE.md, "The decode step on the GPU").
// The Manager keeps the host's part of a step -- checks, the buffer's
// bookkeeping of tails and saves, the new table entries -- and hands the
// decoder one DeviceStep per layer step; the decoder enqueues everything else
// on the engine's stream: append (+ summaries and save of full tails), Select,
// the LRU step on the device tables, the gather of the misses, the plan and
// the attention. Nothing in a step reads device data on the host.
//
// The interface is host-only; the CUDA library implements it
// (CudaBackend::make_device_decoder). A backend without one (HostBackend)
// serves the host-tensor API only.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

#include "sparsekv/cache/cache_step.hpp"
#include "sparsekv/core/ids.hpp"
#include "sparsekv/core/model_shape.hpp"
#include "sparsekv/policy/device_select.hpp"

namespace sparsekv {

class TieredKVBuffer;

// Fixed capacities of the decoder's device arrays, so a step of any batch up
// to max_batch can be captured in a CUDA graph and replayed.
struct DeviceDecoderSetup {
  ModelShape shape;
  std::uint32_t page_tokens = 0;
  std::uint32_t max_batch = 0;               // entries per step
  std::uint32_t max_requests = 0;            // table slots (Config::max_requests)
  std::uint32_t max_partitions_per_head = 0; // summary rows per (request, layer, kv head)
  std::uint32_t max_selected_per_head = 0;   // partitions one Select returns at most
  std::uint32_t max_pages_per_head = 0;      // pages one selection covers at most (mandatory pages)
  std::uint32_t timestamp_buckets = 0;
  DeviceSelectSpec::Kind select = DeviceSelectSpec::Kind::none;
  float scale = 1.0f;
};

// One layer's decode step: the host's part, computed without device data.
// Row r = b * kv_heads + h.
struct DeviceStep {
  std::uint32_t layer = 0;
  std::uint32_t batch = 0;
  const void* q = nullptr;      // device, [batch][q_heads][head_dim], model dtype
  const void* k_new = nullptr;  // device, [batch][kv_heads][head_dim]
  const void* v_new = nullptr;
  float* out = nullptr;         // device, [batch][q_heads][head_dim] fp32; null: plan only
  void* stream = nullptr;       // the engine's cudaStream_t
  DeviceSelectSpec select;
  std::span<const std::uint32_t> request_slots;  // [batch]: the table slot of each entry's request
  std::span<const std::uint32_t> tail_slots;     // [batch]: tokens in the tail before this one
  std::span<const PageId> tail_pages;            // [rows]
  std::span<const std::uint32_t> tail_tokens;    // [rows]: tokens attended in the tail after the append
  std::span<const std::uint32_t> candidates;     // [rows]: partitions Select sees (before this step's save)
  // [rows]: the CPU page a filling tail is saved to, which the host mapped as
  // partition candidates[r] (its meta entry reaches the device tables in
  // this step's arguments); unread for entries whose tail does not fill.
  std::span<const PageId> save_pages;
  std::span<const std::size_t> instances;        // [rows]: HierarchicalPageTable::instance
};

// Where the last step's AttendPlan lives (device memory), FlashInfer's CSR
// over runs (facade/attend_plan.hpp has the meaning of every array).
struct DeviceAttendPlan {
  const std::int64_t* head_entries = nullptr;  // [rows + 1]
  const std::int64_t* indptr = nullptr;
  const std::int64_t* indices = nullptr;
  const std::int32_t* last_page_len = nullptr;
  const std::byte* gpu_tier_base = nullptr;
  std::size_t page_bytes = 0;
  std::uint32_t rows = 0;
};

class DeviceDecoder {
 public:
  virtual ~DeviceDecoder() = default;

  // Whether `p` is device memory the decoder's kernels may read or write.
  virtual bool is_device_pointer(const void* p) const = 0;
  // The request's device tables made equal to the master's (after
  // add_request, prefill, resize); returns with the copies complete.
  virtual void upload_tables(RequestId request) = 0;
  // Waits for every step enqueued so far, then copies the request's device
  // tables back into the master (before the host reads or changes what the
  // LRU kernel owns: finish, resize, reclaim). A sync, off the step's path.
  virtual void download_tables(RequestId request) = 0;
  // The Index summaries of a prompt's partitions of (slot, layer), from
  // device keys [tokens][kv_heads][head_dim], enqueued on `stream`.
  virtual void index_prompt(std::uint32_t slot, std::uint32_t layer, const void* keys, std::uint32_t tokens,
                            const DeviceSelectSpec& select, void* stream) = 0;
  // Copies `bytes` of device memory to host memory on `stream` and waits.
  virtual void copy_to_host(void* host, const void* device, std::size_t bytes, void* stream) = 0;
  // Enqueues one layer's step on step.stream; returns without waiting.
  virtual void step(const DeviceStep& step) = 0;
  virtual DeviceAttendPlan plan() const = 0;
  // Totals of the steps so far (waits for them: for inspection, not the loop).
  virtual CacheStepStats cache_stats() = 0;
  // Throws invalid_argument naming the first non-finite q / k / v value a
  // completed step found (its row was not written), then clears the report.
  // Reads only what earlier steps left in pinned memory: no sync, and nothing
  // while `stream` is being captured into a graph.
  virtual void check_values(void* stream) = 0;
  virtual void synchronize() = 0;
};

}  // namespace sparsekv
