#pragma once
// PageTransfer: how K/V bytes move between the tiers. TieredKVBuffer decides
// what moves (Retrieve's misses, a full decode tail, the rows of a decode
// token); a PageTransfer moves it. The host backend copies with memcpy; the
// CUDA backend (transfer/page_transfer_cuda.hpp) runs the Gather H2D kernel
// (Spin §5.5, SparseServe §3.2.1) and asynchronous copies on its own stream.
//
// Addresses are plain pointers so this layer needs nothing above core/: CPU-
// tier pages are host memory (pinned when a device exists), GPU-tier pages are
// wherever the GPU tier lives (host memory for the host backend, device
// memory for the CUDA one). Calls may return with the copy still in flight;
// synchronize() completes everything enqueued so far. Sources must stay
// unchanged until then, except `write`, whose source may be reused at once.
#include <cstddef>
#include <cstring>
#include <span>

namespace sparsekv {

struct PageMove {
  const std::byte* src = nullptr;
  std::byte* dst = nullptr;
};

class PageTransfer {
 public:
  virtual ~PageTransfer() = default;
  // Whole pages CPU tier -> GPU tier (Retrieve's misses).
  virtual void load(std::span<const PageMove> moves, std::size_t page_bytes) = 0;
  // Whole pages GPU tier -> CPU tier (a full decode tail, SparseServe §3.2.2).
  virtual void save(std::span<const PageMove> moves, std::size_t page_bytes) = 0;
  // Rows of `row_bytes` from host memory into the GPU tier (a decode token's
  // K and V rows of every kv head, in one call).
  virtual void write(std::span<const PageMove> rows, std::size_t row_bytes) = 0;
  virtual void synchronize() = 0;
  // Whether the GPU tier's pages may live in device memory (else they must be
  // host-accessible).
  virtual bool reaches_device_memory() const noexcept = 0;
};

// The host backend: every call completes before it returns.
class HostPageTransfer final : public PageTransfer {
 public:
  void load(std::span<const PageMove> moves, std::size_t page_bytes) override { copy(moves, page_bytes); }
  void save(std::span<const PageMove> moves, std::size_t page_bytes) override { copy(moves, page_bytes); }
  void write(std::span<const PageMove> rows, std::size_t row_bytes) override { copy(rows, row_bytes); }
  void synchronize() override {}
  bool reaches_device_memory() const noexcept override { return false; }

 private:
  static void copy(std::span<const PageMove> moves, std::size_t page_bytes) {
    for (const PageMove& m : moves) std::memcpy(m.dst, m.src, page_bytes);
  }
};

}  // namespace sparsekv
