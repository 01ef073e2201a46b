// CUDA kernels of the Plan step (attention/attend_plan_cuda.hpp): the AttendPlan
// CSR from the bucketed-LRU output, with the host plan's run split.
#include <cuda_runtime.h>

#include <cub/block/block_scan.cuh>
#include <cub/device/device_scan.cuh>
#include <cstdint>
#include <string>

#include "core/launch_support.cuh"
#include "sparsekv/core/error_code.hpp"
#include "sparsekv/attention/attend_plan_cuda.hpp"

namespace sparsekv::cuda {
namespace {

using namespace detail;  // core/launch_support.cuh

constexpr std::uint32_t kCountThreads = 256;
constexpr std::size_t kAlign = 256;

std::size_t aligned_bytes(std::size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

// The workspace: per-row runs and pages (scan inputs), each row's page end
// (scan output), then CUB's temporary storage.
struct Workspace {
  std::int64_t* row_runs;
  std::int64_t* row_pages;
  std::int64_t* page_ends;
  void* scan;
  std::size_t scan_bytes;
};

std::size_t scan_bytes(std::uint32_t rows) {
  std::size_t bytes = 0;
  const cudaError_t status = cub::DeviceScan::InclusiveSum(nullptr, bytes, static_cast<const std::int64_t*>(nullptr),
                                                           static_cast<std::int64_t*>(nullptr), static_cast<int>(rows));
  if (status != cudaSuccess)
    throw_cuda("device_plan_workspace_bytes", "cub::DeviceScan::InclusiveSum size query", status);
  return bytes;
}

Workspace carve(void* base, std::uint32_t rows) {
  auto* bytes = static_cast<std::byte*>(base);
  const std::size_t row_bytes = aligned_bytes(std::size_t{rows} * sizeof(std::int64_t));
  Workspace w;
  w.row_runs = reinterpret_cast<std::int64_t*>(bytes);
  w.row_pages = reinterpret_cast<std::int64_t*>(bytes + row_bytes);
  w.page_ends = reinterpret_cast<std::int64_t*>(bytes + 2 * row_bytes);
  w.scan = bytes + 3 * row_bytes;
  w.scan_bytes = scan_bytes(rows);
  return w;
}

// One thread per row: its pages and runs, zero for a row that breaks a capacity.
__global__ void plan_count_kernel(DevicePlanInput in, DevicePlanOutput out, Workspace w) {
  const std::uint32_t row = blockIdx.x * blockDim.x + threadIdx.x;
  if (row == 0) {
    out.indptr[0] = 0;
    out.head_entries[0] = 0;
  }
  if (row >= in.rows) return;
  PlanRowCounts c = plan_row_counts(in, row);
  if (!plan_row_fits(c, in)) {
    atomicAdd(out.overflow_rows, 1u);
    c = {};
  }
  w.row_runs[row] = c.runs;
  w.row_pages[row] = c.pages;
}

// One block per row, its pages in tiles of kPlanFillThreads; the run-end flags'
// exclusive scan (carried over tiles) numbers the runs.
__global__ void __launch_bounds__(kPlanFillThreads)
    plan_fill_kernel(DevicePlanInput in, DevicePlanOutput out, Workspace w) {
  using BlockScan = cub::BlockScan<std::uint32_t, kPlanFillThreads>;
  __shared__ typename BlockScan::TempStorage scan;
  const std::uint32_t row = blockIdx.x;
  const auto pages = static_cast<std::uint32_t>(w.row_pages[row]);
  const std::int64_t first_page = w.page_ends[row] - pages;
  const std::int64_t first_entry = out.head_entries[row];
  std::uint32_t runs_before = 0;
  for (std::uint32_t tile = 0; tile < pages; tile += kPlanFillThreads) {
    const std::uint32_t q = tile + threadIdx.x;
    PlanPage p;
    bool run_end = false;
    if (q < pages) {
      p = plan_row_page(in, row, q);
      run_end = plan_run_end(p, q, pages, in.page_tokens);
    }
    std::uint32_t rank = 0, tile_runs = 0;
    BlockScan(scan).ExclusiveSum(run_end ? 1u : 0u, rank, tile_runs);
    if (q < pages) plan_emit_page(out, p, run_end, first_page + q, first_entry + runs_before + rank);
    runs_before += tile_runs;
    __syncthreads();  // the scan storage is reused by the next tile
  }
}

}  // namespace

std::size_t device_plan_workspace_bytes(std::uint32_t rows) {
  return 3 * aligned_bytes(std::size_t{rows} * sizeof(std::int64_t)) + scan_bytes(rows);
}

void build_device_plan(const DevicePlanInput& in, const DevicePlanOutput& out, void* workspace,
                       std::size_t workspace_bytes, void* stream) {
  // Validation first: nothing is enqueued when an argument is wrong.
  constexpr const char* kFunction = "build_device_plan";
  if (in.page_tokens == 0) throw_invalid(kFunction, "page_tokens is 0");
  if (in.rows > 0x7fffffffu) throw_invalid(kFunction, "rows " + std::to_string(in.rows) + " exceed 2^31 - 1");
  if (in.rows == 0) return;
  if (in.selection_offsets == nullptr || in.partition_offsets == nullptr || in.gpu_pages == nullptr ||
      in.partition_tokens == nullptr || in.tail_pages == nullptr || in.tail_tokens == nullptr)
    throw_invalid(kFunction, "null input array");
  if (out.indptr == nullptr || out.indices == nullptr || out.last_page_len == nullptr || out.head_entries == nullptr ||
      out.overflow_rows == nullptr)
    throw_invalid(kFunction, "null output array");
  const std::size_t needed = device_plan_workspace_bytes(in.rows);
  if (workspace == nullptr || workspace_bytes < needed)
    throw_invalid(kFunction,
                  "workspace of " + std::to_string(workspace_bytes) + " bytes, " + std::to_string(needed) + " needed");
  const auto s = static_cast<cudaStream_t>(stream);
  const Workspace w = carve(workspace, in.rows);
  cudaError_t status = cudaMemsetAsync(out.overflow_rows, 0, sizeof(std::uint32_t), s);
  if (status != cudaSuccess) throw_cuda(kFunction, "cudaMemsetAsync", status);
  plan_count_kernel<<<(in.rows + kCountThreads - 1) / kCountThreads, kCountThreads, 0, s>>>(in, out, w);
  check_launch(kFunction);
  std::size_t bytes = w.scan_bytes;
  status = cub::DeviceScan::InclusiveSum(w.scan, bytes, w.row_runs, out.head_entries + 1, static_cast<int>(in.rows), s);
  if (status != cudaSuccess) throw_cuda(kFunction, "cub::DeviceScan::InclusiveSum", status);
  status = cub::DeviceScan::InclusiveSum(w.scan, bytes, w.row_pages, w.page_ends, static_cast<int>(in.rows), s);
  if (status != cudaSuccess) throw_cuda(kFunction, "cub::DeviceScan::InclusiveSum", status);
  plan_fill_kernel<<<in.rows, kPlanFillThreads, 0, s>>>(in, out, w);
  check_launch(kFunction);
}

}  // namespace sparsekv::cuda
