#pragma once
// Backend: where the GPU tier lives, how bytes move between the tiers and how
// the built-in Attend runs -- the one runtime choice at the facade edge
// (everything below it is shared). Two exist:
//
//   HostBackend (here)            GPU tier in host memory standing in for HBM,
//                                 memcpy transfers, host decode attention.
//   sparsekv::cuda::CudaBackend   GPU-tier pages in device memory, the Gather
//   (facade/cuda_backend.hpp,     H2D kernel and asynchronous saves on the
//    library sparsekv::cuda)      backend's stream, the split-K decode kernel.
//
// In both, the CPU tier is host memory (pinned when a device exists) and the
// metadata tables are host-accessible: the replacement step runs on the host.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string_view>

#include "sparsekv/attention/decode_attention.hpp"
#include "sparsekv/core/error.hpp"
#include "sparsekv/facade/attend_plan.hpp"
#include "sparsekv/facade/device_decoder.hpp"
#include "sparsekv/memory/memory_resource.hpp"
#include "sparsekv/memory/page_layout.hpp"
#include "sparsekv/transfer/page_transfer.hpp"

namespace sparsekv {

// What the built-in Attend computes for one decode step of one layer.
struct AttendCall {
  const AttendPlan* plan = nullptr;
  PageLayout layout;
  std::uint32_t batch = 0;
  std::uint32_t q_heads = 0;
  std::uint32_t kv_heads = 0;
  float scale = 1.0f;
  const float* q = nullptr;  // [batch][q_heads][head_dim], host memory
  float* out = nullptr;      // [batch][q_heads][head_dim], host memory
  // Null, or [plan->indices.size()][layout.page_tokens] in host memory: slot
  // t of page indices[i] gets its softmax probability summed over the q heads
  // of its kv head's GQA group (decode_attention's slot_weights), 0 for a
  // dead or unused slot; taken from the attention pass itself.
  float* slot_weights = nullptr;
};

// Throws invalid_argument unless call.plan->live_masks is empty, or parallel
// to its indices with page_tokens <= kMaxMaskedPageTokens. Every backend's
// attend() asks it before it writes anything.
void check_attend_masks(const AttendCall& call);

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
  // Throws invalid_argument when attend() cannot run this shape; decode()
  // asks before it changes anything.
  virtual void check_attend(const PageLayout& /*layout*/, std::uint32_t /*q_heads*/,
                            std::uint32_t /*kv_heads*/) const {}
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
  // The device half of the device-tensor API (facade/device_decoder.hpp)
  // for a buffer made on this backend's memory, or null: host tensors only.
  virtual std::unique_ptr<DeviceDecoder> make_device_decoder(const DeviceDecoderSetup& /*setup*/,
                                                             TieredKVBuffer& /*buffer*/) {
    return nullptr;
  }
};

class HostBackend final : public Backend {
 public:
  std::string_view name() const noexcept override { return "host"; }
  MemoryResource& cpu_tier() override { return cpu_memory_; }
  MemoryResource& gpu_pages() override { return gpu_memory_; }
  MemoryResource& gpu_tables() override { return gpu_memory_; }
  PageTransfer& transfer() override { return transfer_; }
  void attend(const AttendCall& call) override;

 private:
  HostMemoryResource cpu_memory_{true};   // pinned when a CUDA device is present
  HostMemoryResource gpu_memory_{false};  // stands in for HBM
  HostPageTransfer transfer_;
};

}  // namespace sparsekv
