#pragma once
// CUDA backend of the Plan step: the AttendPlan CSR (attend_plan.hpp) built
// on the device from the bucketed-LRU step's output and the rows' tails, so
// that Retrieve -> Plan -> Attend needs no host round trip and one layer's
// step can be captured in a CUDA graph. The arrays equal, bit for bit, the
// host plan Manager::build_plan makes from the same retrievals
// (detail::append_head_runs), over rows r = b * kv_heads + h.
//
// Three launches on the caller's stream, none reading a count on the host:
//   1. counts: one thread per row walks its selected partitions (pages and
//      runs: plan_row_counts) and zeroes a row that breaks a capacity;
//   2. two CUB DeviceScan::InclusiveSum over the rows: entries -> head_entries,
//      pages -> where each row's pages start;
//   3. fill: one block per row walks its pages a tile at a time, each thread
//      locating its page by binary search over the row's partition offsets
//      (plan_row_page); a CUB BlockScan over the run-end flags (carried across
//      tiles) gives each run its entry, so the run split is append_runs'.
// The rules below are plain C++ shared with the host emulation CI runs
// (tests/attention/test_plan_rules.cpp).
//
// fmt-free: kernel translation units and their callers can include it.
#include <cstddef>
#include <cstdint>

#include "sparsekv/core/host_device.hpp"
#include "sparsekv/core/ids.hpp"

namespace sparsekv::cuda {

// Threads of a fill block: a row's pages are walked in tiles of this many.
inline constexpr std::uint32_t kPlanFillThreads = 128;

// Every array is device-accessible. Row r's selected partitions are
// i in [selection_offsets[r], selection_offsets[r + 1]), the LRU launch's
// selection CSR (bucketed_lru_cuda.hpp: LruStepBatch), whose output gives
// partition i's pages gpu_pages[partition_offsets[i] .. partition_offsets[i + 1]).
struct DevicePlanInput {
  std::uint32_t rows = 0;  // capacity: max batch x kv heads; an unused row has no selection and no tail
  const std::uint32_t* selection_offsets = nullptr;  // [rows + 1]
  const std::uint32_t* partition_offsets = nullptr;  // [selection_offsets[rows] + 1] (LruStepOutput)
  const PageId* gpu_pages = nullptr;                 // LruStepOutput::gpu_pages
  const std::uint32_t* partition_tokens = nullptr;   // [selection_offsets[rows]]: tokens of each selected partition
  const PageId* tail_pages = nullptr;                // [rows]: the row's resident tail page
  const std::uint32_t* tail_tokens = nullptr;        // [rows]: its tokens, 0 (no tail) .. page_tokens
  std::uint32_t page_tokens = 0;
  std::uint32_t max_pages_per_row = 0;    // capacity: pages a row attends (selected + tail)
  std::uint32_t max_entries_per_row = 0;  // capacity: runs of a row
};

// Fixed-capacity outputs (device memory). The first head_entries[rows]
// entries and indptr[head_entries[rows]] indices are written, compact as the
// host plan's; the rest is left alone.
struct DevicePlanOutput {
  std::int64_t* indptr = nullptr;         // [rows * max_entries_per_row + 1]
  std::int64_t* indices = nullptr;        // [rows * max_pages_per_row]
  std::int32_t* last_page_len = nullptr;  // [rows * max_entries_per_row]
  std::int64_t* head_entries = nullptr;   // [rows + 1]
  // [1]: rows that broke max_pages_per_row or max_entries_per_row; such a
  // row gets no entries. Zero when the plan is complete.
  std::uint32_t* overflow_rows = nullptr;
};

struct PlanRowCounts {
  std::uint32_t pages = 0;
  std::uint32_t runs = 0;
};

struct PlanPage {
  PageId page = 0;
  std::uint32_t tokens = 0;
};

// Tokens of page k of a partition of `tokens` tokens: full pages until the
// tokens run out (Retrieval::for_each_page).
SPARSEKV_HOST_DEVICE inline std::uint32_t plan_page_tokens(std::uint32_t tokens, std::uint32_t k,
                                                           std::uint32_t page_tokens) {
  const std::uint64_t used = std::uint64_t{k} * page_tokens;
  const std::uint32_t left = used < tokens ? tokens - static_cast<std::uint32_t>(used) : 0;
  return left < page_tokens ? left : page_tokens;
}

// Pages of row r and the runs append_runs splits them into: every page that
// is not full ends a run, and so does the row's last page.
SPARSEKV_HOST_DEVICE inline PlanRowCounts plan_row_counts(const DevicePlanInput& in, std::uint32_t row) {
  PlanRowCounts c;
  std::uint32_t not_full = 0;
  bool last_full = false;
  for (std::uint32_t i = in.selection_offsets[row]; i < in.selection_offsets[row + 1]; ++i) {
    const std::uint32_t n = in.partition_offsets[i + 1] - in.partition_offsets[i];
    if (n == 0) continue;
    const std::uint32_t whole = in.partition_tokens[i] / in.page_tokens;  // page k is full iff k < whole
    not_full += whole < n ? n - whole : 0;
    last_full = n - 1 < whole;
    c.pages += n;
  }
  if (in.tail_tokens[row] > 0) {
    const bool full = in.tail_tokens[row] == in.page_tokens;
    not_full += full ? 0 : 1;
    last_full = full;
    c.pages += 1;
  }
  c.runs = c.pages == 0 ? 0 : not_full + (last_full ? 1 : 0);
  return c;
}

// Whether a row's counts fit the capacities; a row that does not is planned empty.
SPARSEKV_HOST_DEVICE inline bool plan_row_fits(const PlanRowCounts& c, const DevicePlanInput& in) {
  return c.pages <= in.max_pages_per_row && c.runs <= in.max_entries_per_row;
}

// Page q of row r (q < its page count): the selected partitions' pages in
// order, then the tail. The partition holding it is the last selection
// starting at or before it (empty selections share a start and are skipped).
SPARSEKV_HOST_DEVICE inline PlanPage plan_row_page(const DevicePlanInput& in, std::uint32_t row, std::uint32_t q) {
  std::uint32_t lo = in.selection_offsets[row];
  std::uint32_t hi = in.selection_offsets[row + 1];
  const std::uint32_t first = in.partition_offsets[lo];
  if (q >= in.partition_offsets[hi] - first) return {in.tail_pages[row], in.tail_tokens[row]};
  const std::uint32_t target = first + q;
  while (hi - lo > 1) {
    const std::uint32_t mid = lo + (hi - lo) / 2;
    if (in.partition_offsets[mid] <= target) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return {in.gpu_pages[target],
          plan_page_tokens(in.partition_tokens[lo], target - in.partition_offsets[lo], in.page_tokens)};
}

// Writes page q of a row: its index at `page_at` (the row's first page's
// index + q) and, when it ends run `entry`, that run's end and length.
SPARSEKV_HOST_DEVICE inline void plan_emit_page(const DevicePlanOutput& out, const PlanPage& p, bool run_end,
                                                std::int64_t page_at, std::int64_t entry) {
  out.indices[page_at] = p.page;
  if (run_end) {
    out.indptr[entry + 1] = page_at + 1;
    out.last_page_len[entry] = static_cast<std::int32_t>(p.tokens);
  }
}

// Page q of a row of `pages` pages ends a run.
SPARSEKV_HOST_DEVICE inline bool plan_run_end(const PlanPage& p, std::uint32_t q, std::uint32_t pages,
                                              std::uint32_t page_tokens) {
  return p.tokens != page_tokens || q + 1 == pages;
}

// Bytes of the caller-owned workspace build_device_plan needs for `rows`
// rows (three int64 row arrays and CUB's scan storage). Throws
// ErrorCode::cuda_error if CUB's size query fails.
std::size_t device_plan_workspace_bytes(std::uint32_t rows);

// Builds the plan of `in` into `out` on `stream` (a cudaStream_t; nullptr =
// default stream). Preconditions (not re-checked on the device): the offsets
// are non-decreasing, page_tokens matches the tokens, tail_tokens <=
// page_tokens. Checked on the host before launching
// (ErrorCode::invalid_argument): page_tokens > 0; rows <= 2^31 - 1; non-null
// inputs, outputs and workspace when rows > 0; workspace_bytes >=
// device_plan_workspace_bytes(rows).
// rows == 0 enqueues nothing. Throws ErrorCode::cuda_error if a launch fails.
void build_device_plan(const DevicePlanInput& in, const DevicePlanOutput& out, void* workspace,
                       std::size_t workspace_bytes, void* stream);

}  // namespace sparsekv::cuda
