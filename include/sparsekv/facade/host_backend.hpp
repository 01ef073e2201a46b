#pragma once
// HostBackend: the GPU tier in host memory standing in for HBM, memcpy
// transfers (HostPageTransfer) and the host Attend (SplitPlanAttention, whose
// chunks the host step runs on the engine's threads). The default backend, a
// real one for CPU engines, and the reference the CUDA backend is tested against.
#include <string_view>

#include "sparsekv/attention/split_plan_attention.hpp"
#include "sparsekv/memory/memory_resource.hpp"
#include "sparsekv/step/backend.hpp"
#include "sparsekv/transfer/page_transfer.hpp"

namespace sparsekv {

class HostBackend final : public Backend {
 public:
  std::string_view name() const noexcept override { return "host"; }
  MemoryResource& cpu_tier() override { return cpu_memory_; }
  MemoryResource& gpu_pages() override { return gpu_memory_; }
  MemoryResource& gpu_tables() override { return gpu_memory_; }
  PageTransfer& transfer() override { return transfer_; }
  void attend(const AttendCall& call) override { attention_.attend(call); }
  bool attends_on_host() const noexcept override { return true; }

 private:
  HostMemoryResource cpu_memory_{true};                             // pinned when a CUDA device is present
  HostMemoryResource gpu_memory_{false, Residency::at_allocation};  // stands in for HBM
  HostPageTransfer transfer_;
  SplitPlanAttention attention_;
};

}  // namespace sparsekv
