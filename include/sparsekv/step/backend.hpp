#pragma once
// Backend: what a decode step runs on -- where the GPU tier lives, how bytes
// move between the tiers, how the built-in Attend runs and, for device
// tensors, the device runtime. The Manager picks one at its edge (the backend
// choice is the facade's: facade/host_backend.hpp, facade/cuda_backend.hpp);
// everything below that choice is shared. Three exist:
//
//   HostBackend                   GPU tier in host memory standing in for HBM,
//   (facade/host_backend.hpp)     memcpy transfers, host decode attention
//                                 (attention/split_plan_attention.hpp).
//   InPlaceBackend                No GPU tier: Attend reads the selected CPU
//   (facade/in_place_backend.hpp) pages where they are (a CPU engine's choice).
//   sparsekv::cuda::CudaBackend   GPU-tier pages in device memory, the Gather
//   (facade/cuda_backend.hpp,     H2D kernel and asynchronous saves on the
//    library sparsekv::cuda)      backend's stream, the split-K decode kernel.
//
// In all, the CPU tier is host memory (pinned when a device exists) and the
// metadata tables are host-accessible: the replacement step runs on the host.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string_view>

#include "sparsekv/attention/attend_plan.hpp"
#include "sparsekv/buffer/tiered_kv_buffer.hpp"
#include "sparsekv/core/error.hpp"
#include "sparsekv/memory/memory_resource.hpp"
#include "sparsekv/memory/page_layout.hpp"
#include "sparsekv/step/device_runtime.hpp"
#include "sparsekv/transfer/page_transfer.hpp"

namespace sparsekv {

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string_view name() const noexcept = 0;
  virtual MemoryResource& cpu_tier() = 0;    // CPU pages and CPU-side tables
  virtual MemoryResource& gpu_pages() = 0;   // GPU-tier pages
  virtual MemoryResource& gpu_tables() = 0;  // meta-partition and GPU page tables (host-accessible)
  virtual PageTransfer& transfer() = 0;
  // For batch entry b and q head h: attention of q[b][h] over the plan's runs
  // of (b, h / group), merged with plan.extra[b * q_heads + h] when the plan
  // has extra terms, over the slots plan.live_masks leaves live. Returns when
  // `out` (and slot_weights when set) hold the result. Throws
  // invalid_argument, before writing anything, when live_masks is neither
  // empty nor parallel to indices.
  virtual void attend(const AttendCall& call) = 0;
  // Whether attend() is SplitPlanAttention over host memory: the host step
  // then runs its chunks on the engine's threads itself (step/host_step.hpp)
  // rather than calling attend(), with the same result.
  virtual bool attends_on_host() const noexcept { return false; }
  // Where Attend reads the selected pages: GPU-tier copies (the cache), or
  // the CPU tier in place (a CPU engine's backend: no GPU tier at all).
  virtual AttendSite attend_site() const noexcept { return AttendSite::gpu_tier; }
  // Throws invalid_argument when attend() cannot run this shape; decode()
  // asks before it changes anything.
  virtual void check_attend(const PageLayout& /*layout*/, std::uint32_t /*q_heads*/, std::uint32_t /*kv_heads*/) const {
  }
  // The cudaStream_t Retrieve's copies run on (nullptr: the host backend,
  // nothing in flight). An engine running its own kernel over an AttendPlan
  // orders it after this stream.
  virtual void* stream() const noexcept { return nullptr; }
  // Device tensors at the facade edge: whether `p` is device memory this
  // backend's kernels may read or write, and copies between device and host
  // memory ordered after the work enqueued on `stream`, returning once
  // complete (off the step's path: a prompt that clusters on the host, the
  // slower path of a policy with only a host Select). A backend without
  // device memory (HostBackend) knows none: copies throw unavailable.
  virtual bool has_device_memory() const noexcept { return false; }
  virtual bool is_device_pointer(const void* /*p*/) const { return false; }
  virtual void copy_to_host(void* /*host*/, const void* /*device*/, std::size_t /*bytes*/, void* /*stream*/) {
    fail(ErrorCode::unavailable, "backend {} has no device memory", name());
  }
  virtual void copy_to_device(void* /*device*/, const void* /*host*/, std::size_t /*bytes*/, void* /*stream*/) {
    fail(ErrorCode::unavailable, "backend {} has no device memory", name());
  }
  // The device half of the device-tensor API (step/device_runtime.hpp)
  // for a buffer made on this backend's memory, or null: host tensors only.
  virtual std::unique_ptr<DeviceRuntime> make_device_runtime(const DeviceRuntimeSetup& /*setup*/,
                                                             TieredKVBuffer& /*buffer*/) {
    return nullptr;
  }
};

}  // namespace sparsekv
