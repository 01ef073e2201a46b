#pragma once
// CudaBackend (library sparsekv::cuda): the GPU tier in device memory.
//  - CPU tier and all four metadata tables: pinned, mapped host memory (the
//    replacement step runs on the host; kernels read the tables through UVA).
//  - GPU-tier pages: one cudaMalloc'd region, so an AttendPlan's
//    gpu_tier_base is a device pointer a FlashInfer-style kernel reads.
//  - Transfers: DevicePageTransfer (gather kernel, async saves and writes) on
//    the backend's stream; plan() leaves them in flight there (stream()).
//  - Built-in Attend: the split-K sparse decode kernel
//    (attention/sparse_decode_attention_cuda.hpp) on the same stream, one
//    launch per step over the plan in its runs form (row_entries =
//    head_entries), so a (request, kv head) whose pages form several runs (a
//    partial page mid-selection, the decode tail) is one kernel row and its
//    runs and the policy's extra term merge on the device. q goes up and the
//    output comes down once: AttendCall's tensors are host memory.
//
// Construction throws ErrorCode::unavailable without a usable CUDA device.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "sparsekv/facade/host_backend.hpp"
#include "sparsekv/step/backend.hpp"
#include "sparsekv/transfer/page_transfer_cuda.hpp"

namespace sparsekv::cuda {

class CudaBackend final : public Backend {
 public:
  CudaBackend();
  ~CudaBackend() override;
  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;

  std::string_view name() const noexcept override { return "cuda"; }
  MemoryResource& cpu_tier() override { return pinned_; }
  MemoryResource& gpu_pages() override { return device_; }
  MemoryResource& gpu_tables() override { return pinned_; }
  PageTransfer& transfer() override { return *transfer_; }
  void attend(const AttendCall& call) override;
  // The kernel's instantiations: head_dim 64 or 128 (plan() serves any shape).
  void check_attend(const PageLayout& layout, std::uint32_t q_heads, std::uint32_t kv_heads) const override;
  void* stream() const noexcept override { return transfer_->stream(); }
  bool has_device_memory() const noexcept override { return true; }
  // Device memory (or managed), asked of cudaPointerGetAttributes.
  bool is_device_pointer(const void* p) const override;
  void copy_to_host(void* host, const void* device, std::size_t bytes, void* stream) override;
  void copy_to_device(void* device, const void* host, std::size_t bytes, void* stream) override;
  // The device-tensor API's runtime (cuda/step/device_runtime.cpp).
  std::unique_ptr<DeviceRuntime> make_device_runtime(const DeviceRuntimeSetup& setup, TieredKVBuffer& buffer) override;

 private:
  // A device buffer that only grows.
  struct DeviceBuffer {
    void* data = nullptr;
    std::size_t bytes = 0;
  };
  void* device_bytes(DeviceBuffer& buffer, std::size_t bytes);

  HostMemoryResource pinned_{true};
  DeviceMemoryResource device_;
  std::unique_ptr<DevicePageTransfer> transfer_;
  DeviceBuffer q_, indptr_, indices_, last_page_len_, head_entries_, extra_, out_, workspace_, live_masks_,
      slot_weights_;
  // The plan's extra terms as DecodeAttentionExtra's arrays: max, sum
  // [batch * q_heads] then acc [batch * q_heads][head_dim].
  std::vector<float> extra_host_;
};

// A CudaBackend when a CUDA device can be used, else a HostBackend.
std::unique_ptr<Backend> make_best_backend();

}  // namespace sparsekv::cuda
