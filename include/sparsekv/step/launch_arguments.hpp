#pragma once
// The host's part of a device decode step (step/device_runtime.hpp): the
// per-row arguments its launches read, computed from the DeviceStepInput, the
// summary store's regions, the CPU tier and the page table. Host-only; the
// CUDA runtime (cuda/step/device_runtime.cpp) writes them into a pinned
// slot and the CI emulation (tests/support/device_runtime_emulation.hpp) into host
// vectors, so the emulation runs this very code rather than a copy of it.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "sparsekv/core/error.hpp"
#include "sparsekv/memory/page_pool.hpp"
#include "sparsekv/metadata/gpu_tables_replica.hpp"
#include "sparsekv/policy/summary_store_cuda.hpp"
#include "sparsekv/step/device_runtime.hpp"

namespace sparsekv {

// The summaries the device store keeps for `select` (DeviceSelect::summary);
// throws invalid_argument for a policy with no device Select.
inline cuda::AppendSummary store_summary_kind(const DeviceSelect& select) {
  if (!select.on_device()) fail(ErrorCode::invalid_argument, "DeviceRuntime: the policy has no device Select");
  return select.summary();
}

// Replica writes one step may carry: a filling row appends one meta entry --
// its word, its length and at most one new directory slot.
constexpr std::uint32_t launch_max_writes(std::uint32_t rows) noexcept { return 3 * rows; }

// Where the arguments go, rows = batch * kv_heads of the runtime's largest
// batch (a step fills the first batch / rows entries).
struct LaunchArguments {
  std::span<std::uint32_t> tail_slots;    // [batch]
  std::span<PageId> tail_pages;           // [rows]
  std::span<std::uint32_t> tail_tokens;   // [rows]
  std::span<std::uint32_t> first;         // [rows]: SelectRows::first, the row's summary region
  std::span<std::uint32_t> count;         // [rows]: SelectRows::count, the candidates
  std::span<std::uint32_t> summary_rows;  // [rows]: AppendSummaries::rows, the tail page's candidate
  std::span<std::size_t> instances;       // [rows]
  std::span<std::byte*> cpu_pages;        // [rows]: the save page's CPU address, null when none
  // [rows]: DeviceStepInput::host_state_rows unpacked as RetroInferSelect reads them
  // (zero when the step has none).
  std::span<PartitionId> sink_partitions;
  std::span<std::uint32_t> sink_tokens;
  std::span<std::uint32_t> recent;
  std::span<std::uint32_t> windows;
  std::span<ReplicaWordWrite> writes;  // [max_writes]
  std::uint32_t* write_count = nullptr;
};

// Fills `out` for `step`; `scratch` holds the writes while they are counted.
// Throws resource_exhausted when the saved pages' meta entries need more
// writes than out.writes holds (before anything is written there).
inline void fill_launch_arguments(const DeviceStepInput& step, std::uint32_t kv_heads,
                                  const cuda::SummaryShape& summaries, const PagePool& cpu,
                                  const GpuTablesReplica& replica, const HierarchicalPageTable& table,
                                  std::vector<ReplicaWordWrite>& scratch, const LaunchArguments& out) {
  const std::uint32_t rows = step.batch * kv_heads;
  std::copy(step.tail_slots.begin(), step.tail_slots.end(), out.tail_slots.begin());
  std::copy(step.tail_pages.begin(), step.tail_pages.end(), out.tail_pages.begin());
  std::copy(step.tail_tokens.begin(), step.tail_tokens.end(), out.tail_tokens.begin());
  std::copy(step.instances.begin(), step.instances.end(), out.instances.begin());
  scratch.clear();
  for (std::uint32_t r = 0; r < rows; ++r) {
    const std::uint32_t region = summaries.region(step.request_slots[r / kv_heads], r % kv_heads);
    out.first[r] = region;
    // Partitions below first_partition (RetroInfer's sink) are no candidates.
    out.count[r] = step.candidates[r] - summaries.first_partition;
    // The tail page is the row's next partition: the one after its candidates.
    out.summary_rows[r] = region + out.count[r];
    const HostStateRow row = step.host_state_rows.empty() ? HostStateRow{} : step.host_state_rows[r];
    out.sink_partitions[r] = row.sink_partition;
    out.sink_tokens[r] = row.sink_tokens;
    out.recent[r] = row.recent;
    out.windows[r] = row.window;
    const bool saves = step.save_pages[r] != kInvalidPage;
    out.cpu_pages[r] = saves ? const_cast<std::byte*>(cpu.data(step.save_pages[r])) : nullptr;
    if (saves) replica.meta_entry_writes(table, step.instances[r], step.candidates[r], 1, scratch);
  }
  if (scratch.size() > out.writes.size()) {
    fail(ErrorCode::resource_exhausted, "decode: {} table writes exceed the step's {}", scratch.size(),
         out.writes.size());
  }
  *out.write_count = static_cast<std::uint32_t>(scratch.size());
  std::copy(scratch.begin(), scratch.end(), out.writes.begin());
}

}  // namespace sparsekv
