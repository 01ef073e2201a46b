#pragma once
// The CUDA backend's PageTransfer (library sparsekv::cuda). Everything runs in
// order on one non-blocking stream the object owns:
//  - load: Retrieve's misses, read straight from pinned CPU-tier pages through
//    unified virtual addressing by the warp-per-page gather kernel (Spin §5.5,
//    SparseServe §3.2.1 FlashH2D) -- one launch per call, whatever the heads
//    (pages whose size or addresses are not multiples of 16 bytes, which the
//    kernel's vector accesses need, fall back to one cudaMemcpyAsync each);
//  - save: a full decode tail, one cudaMemcpyAsync device -> pinned host per
//    page (a few pages per step; batched prefill-size saves go through
//    transfer/flash_d2h_save.hpp);
//  - write: a decode token's rows, staged in mapped pinned memory so the
//    engine's buffer may be reused at once, then one gather launch scatters
//    them into the tail pages.
// The page-address arrays the kernel reads are double-buffered in mapped
// pinned memory: a call waits only for the launch before the previous one.
//
// Needs a CUDA device (throws ErrorCode::unavailable otherwise); CUDA failures
// throw ErrorCode::cuda_error. Not thread-safe, like the buffer that drives it.
#include <cstddef>
#include <span>
#include <vector>

#include "sparsekv/transfer/page_gather_cuda.hpp"
#include "sparsekv/transfer/page_transfer.hpp"

namespace sparsekv::cuda {

class DevicePageTransfer final : public PageTransfer {
 public:
  // `write_staging_bytes`: pinned bytes for staged rows; when they run out
  // the transfer completes what is in flight and starts over (growing it if
  // one call needs more).
  explicit DevicePageTransfer(GatherConfig gather = {}, std::size_t write_staging_bytes = std::size_t{1} << 20);
  ~DevicePageTransfer() override;
  DevicePageTransfer(const DevicePageTransfer&) = delete;
  DevicePageTransfer& operator=(const DevicePageTransfer&) = delete;

  void load(std::span<const PageMove> moves, std::size_t page_bytes) override;
  void save(std::span<const PageMove> moves, std::size_t page_bytes) override;
  void write(std::span<const PageMove> rows, std::size_t row_bytes) override;
  void synchronize() override;
  bool reaches_device_memory() const noexcept override { return true; }

  // The cudaStream_t everything runs on.
  void* stream() const noexcept { return stream_; }

 private:
  struct AddressBuffer {
    const std::byte** src = nullptr;  // mapped pinned: the kernel reads them through UVA
    std::byte** dst = nullptr;
    std::size_t capacity = 0;
    void* done = nullptr;  // cudaEvent_t recorded after the launch that reads them
  };
  void reserve(AddressBuffer& buffer, std::size_t pages);
  void release() noexcept;
  // One gather launch (or one copy per page when sizes or addresses are not
  // multiples of 16 bytes).
  void gather(std::span<const PageMove> moves, std::size_t bytes);

  GatherConfig gather_;
  void* stream_ = nullptr;
  AddressBuffer addresses_[2];
  unsigned next_ = 0;
  std::byte* write_staging_ = nullptr;
  std::size_t write_capacity_ = 0;
  std::size_t write_used_ = 0;
  std::vector<PageMove> staged_;  // scratch: staged rows -> destinations
};

}  // namespace sparsekv::cuda
