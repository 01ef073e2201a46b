#pragma once
// A backend whose copies run only at synchronize(): the host twin of a device
// backend whose stream the host never waits on (tests/facade/test_manager.cpp,
// tests/facade/test_backend_lockstep.cpp).
#include <cstddef>
#include <cstring>
#include <span>
#include <string_view>
#include <vector>

#include "sparsekv/core/error.hpp"
#include "sparsekv/facade/host_backend.hpp"

namespace sparsekv::test {

// A transfer that runs nothing until synchronize(), like a device stream the
// host never waits on: a buffer that touches bytes before completing the
// copies in flight (a regroup reading a tail still being saved, a freed page
// reused while a save still targets it) computes from stale bytes.
class DeferredTransfer final : public PageTransfer {
 public:
  void load(std::span<const PageMove> moves, std::size_t page_bytes) override { enqueue(moves, page_bytes); }
  void save(std::span<const PageMove> moves, std::size_t page_bytes) override { enqueue(moves, page_bytes); }
  void write(std::span<const PageMove> rows, std::size_t row_bytes) override {
    for (const PageMove& r : rows)
      queue_.push_back({r.dst, nullptr, std::vector<std::byte>(r.src, r.src + row_bytes), row_bytes});
  }
  void synchronize() override {
    for (const Op& op : queue_) std::memcpy(op.dst, op.src != nullptr ? op.src : op.bytes.data(), op.size);
    queue_.clear();
    ++synchronizations;
  }
  bool reaches_device_memory() const noexcept override { return false; }
  std::size_t in_flight() const { return queue_.size(); }
  std::uint64_t synchronizations = 0;

 private:
  struct Op {
    std::byte* dst;
    const std::byte* src;  // nullptr: `bytes` holds the source (a write)
    std::vector<std::byte> bytes;
    std::size_t size;
  };
  void enqueue(std::span<const PageMove> moves, std::size_t page_bytes) {
    for (const PageMove& m : moves) queue_.push_back({m.dst, m.src, {}, page_bytes});
  }
  std::vector<Op> queue_;
};

class DeferredBackend final : public Backend {
 public:
  std::string_view name() const noexcept override { return "deferred"; }
  MemoryResource& cpu_tier() override { return cpu_; }
  MemoryResource& gpu_pages() override { return gpu_; }
  MemoryResource& gpu_tables() override { return gpu_; }
  PageTransfer& transfer() override { return transfer_; }
  void attend(const AttendCall& call) override {
    transfer_.synchronize();  // the attention kernel runs after the copies on the same stream
    host_.attend(call);
  }
  void check_attend(const PageLayout& layout, std::uint32_t, std::uint32_t) const override {
    if (layout.head_dim == refused_head_dim) fail(ErrorCode::invalid_argument, "head_dim {} refused", layout.head_dim);
  }
  DeferredTransfer transfer_;
  std::uint32_t refused_head_dim = 0;

 private:
  HostMemoryResource cpu_{false}, gpu_{false};
  HostBackend host_;
};

}  // namespace sparsekv::test
