#pragma once
// InPlaceBackend: for CPU engines. On a CPU both tiers would be host memory,
// so copying the selected pages into a host "GPU tier" buys nothing and
// doubles the memory: this backend has no GPU tier. The buffer attends the
// CPU tier in place (AttendSite::cpu_tier): the tails are CPU pages, Retrieve
// moves nothing, and the host Attend (SplitPlanAttention, on the engine's
// threads through the host step) reads the selected CPU pages where they
// are. Selections and outputs are HostBackend's, bit for bit; HostBackend
// stays the two-tier reference the CUDA backend is tested against.
#include <string_view>

#include "sparsekv/attention/split_plan_attention.hpp"
#include "sparsekv/memory/memory_resource.hpp"
#include "sparsekv/step/backend.hpp"
#include "sparsekv/transfer/page_transfer.hpp"

namespace sparsekv {

class InPlaceBackend final : public Backend {
 public:
  std::string_view name() const noexcept override { return "in-place"; }
  MemoryResource& cpu_tier() override { return memory_; }
  // No GPU-tier page is ever taken from it (the buffer's GPU pool stays empty).
  MemoryResource& gpu_pages() override { return memory_; }
  MemoryResource& gpu_tables() override { return memory_; }
  PageTransfer& transfer() override { return transfer_; }
  void attend(const AttendCall& call) override { attention_.attend(call); }
  bool attends_on_host() const noexcept override { return true; }
  AttendSite attend_site() const noexcept override { return AttendSite::cpu_tier; }

 private:
  HostMemoryResource memory_{false};  // a CPU engine: pageable, never pinned
  HostPageTransfer transfer_;         // the tail's page save
  SplitPlanAttention attention_;
};

}  // namespace sparsekv
