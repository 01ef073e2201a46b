#include "sparsekv/transfer/page_transfer_cuda.hpp"

#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

#include "sparsekv/core/device.hpp"
#include "sparsekv/core/error.hpp"

namespace sparsekv::cuda {
namespace {

void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess)
    fail(ErrorCode::cuda_error, "DevicePageTransfer: {} failed: {}", what, cudaGetErrorString(status));
}

cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }
cudaEvent_t as_event(void* e) { return static_cast<cudaEvent_t>(e); }

}  // namespace

DevicePageTransfer::DevicePageTransfer(GatherConfig gather, std::size_t write_staging_bytes) : gather_(gather) {
  if (cuda_device_count() == 0) fail(ErrorCode::unavailable, "DevicePageTransfer: no usable CUDA device");
  if (write_staging_bytes == 0)
    fail(ErrorCode::invalid_argument, "DevicePageTransfer: write staging must not be empty");
  // Checked here, not at the first load(): a bad config would otherwise fail mid-step.
  if (gather.warps_per_block == 0 || gather.warps_per_block > 32) {
    fail(ErrorCode::invalid_argument, "DevicePageTransfer: warps_per_block {} is not in 1..32", gather.warps_per_block);
  }
  cudaStream_t stream = nullptr;
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  stream_ = stream;
  try {
    for (AddressBuffer& b : addresses_) {
      cudaEvent_t event = nullptr;
      check(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreateWithFlags");
      b.done = event;
    }
    void* staging = nullptr;
    // Mapped: the gather kernel reads the staged rows through UVA.
    check(cudaHostAlloc(&staging, write_staging_bytes, cudaHostAllocMapped | cudaHostAllocPortable), "cudaHostAlloc");
    write_staging_ = static_cast<std::byte*>(staging);
    write_capacity_ = write_staging_bytes;
  } catch (...) {
    release();
    throw;
  }
}

DevicePageTransfer::~DevicePageTransfer() { release(); }

void DevicePageTransfer::release() noexcept {
  if (stream_ != nullptr) cudaStreamSynchronize(as_stream(stream_));
  for (AddressBuffer& b : addresses_) {
    cudaFreeHost(b.src);
    cudaFreeHost(b.dst);
    if (b.done != nullptr) cudaEventDestroy(as_event(b.done));
    b = {};
  }
  cudaFreeHost(write_staging_);
  write_staging_ = nullptr;
  if (stream_ != nullptr) cudaStreamDestroy(as_stream(stream_));
  stream_ = nullptr;
}

void DevicePageTransfer::reserve(AddressBuffer& b, std::size_t pages) {
  // The launch that last read this buffer must be done before it is rewritten.
  check(cudaEventSynchronize(as_event(b.done)), "cudaEventSynchronize");
  if (pages <= b.capacity) return;
  std::size_t capacity = b.capacity == 0 ? 1024 : b.capacity;
  while (capacity < pages) capacity *= 2;
  void* src = nullptr;
  void* dst = nullptr;
  // Mapped (the kernel reads them through UVA) and portable, like the CPU tier.
  constexpr unsigned kFlags = cudaHostAllocMapped | cudaHostAllocPortable;
  check(cudaHostAlloc(&src, capacity * sizeof(void*), kFlags), "cudaHostAlloc");
  if (const cudaError_t status = cudaHostAlloc(&dst, capacity * sizeof(void*), kFlags); status != cudaSuccess) {
    cudaFreeHost(src);
    check(status, "cudaHostAlloc");
  }
  cudaFreeHost(b.src);
  cudaFreeHost(b.dst);
  b.src = static_cast<const std::byte**>(src);
  b.dst = static_cast<std::byte**>(dst);
  b.capacity = capacity;
}

void DevicePageTransfer::load(std::span<const PageMove> moves, std::size_t page_bytes) { gather(moves, page_bytes); }

void DevicePageTransfer::gather(std::span<const PageMove> moves, std::size_t page_bytes) {
  if (moves.empty()) return;
  // The gather kernel moves 16-byte vectors: pages whose size or addresses are
  // not multiples of 16 (tiny head_dim x page_tokens) go page by page instead.
  std::uintptr_t address_bits = page_bytes;
  for (const PageMove& m : moves) {
    address_bits |= reinterpret_cast<std::uintptr_t>(m.src) | reinterpret_cast<std::uintptr_t>(m.dst);
  }
  if (address_bits % 16 != 0 || moves.size() > UINT32_MAX) {
    for (const PageMove& m : moves) {
      check(cudaMemcpyAsync(m.dst, m.src, page_bytes, cudaMemcpyDefault, as_stream(stream_)), "cudaMemcpyAsync");
    }
    return;
  }
  AddressBuffer& b = addresses_[next_];
  reserve(b, moves.size());
  for (std::size_t i = 0; i < moves.size(); ++i) {
    b.src[i] = moves[i].src;
    b.dst[i] = moves[i].dst;
  }
  gather_page_addresses(b.src, b.dst, static_cast<std::uint32_t>(moves.size()), page_bytes, gather_, stream_);
  check(cudaEventRecord(as_event(b.done), as_stream(stream_)), "cudaEventRecord");
  next_ ^= 1u;
}

void DevicePageTransfer::save(std::span<const PageMove> moves, std::size_t page_bytes) {
  for (const PageMove& m : moves) {
    check(cudaMemcpyAsync(m.dst, m.src, page_bytes, cudaMemcpyDeviceToHost, as_stream(stream_)), "cudaMemcpyAsync D2H");
  }
}

void DevicePageTransfer::write(std::span<const PageMove> rows, std::size_t row_bytes) {
  if (rows.empty()) return;
  constexpr std::size_t kAlign = 16;  // staged rows keep the gather kernel's alignment
  const std::size_t bytes = (rows.size() * row_bytes + kAlign - 1) / kAlign * kAlign;
  if (write_used_ + bytes > write_capacity_) synchronize();  // every staged row has landed
  if (bytes > write_capacity_) {
    std::size_t capacity = write_capacity_;
    while (capacity < bytes) capacity *= 2;
    void* staging = nullptr;
    check(cudaHostAlloc(&staging, capacity, cudaHostAllocMapped | cudaHostAllocPortable), "cudaHostAlloc");
    cudaFreeHost(write_staging_);
    write_staging_ = static_cast<std::byte*>(staging);
    write_capacity_ = capacity;
  }
  staged_.resize(rows.size());
  std::byte* staged = write_staging_ + write_used_;
  for (std::size_t i = 0; i < rows.size(); ++i) {
    std::memcpy(staged + i * row_bytes, rows[i].src, row_bytes);
    staged_[i] = {staged + i * row_bytes, rows[i].dst};
  }
  write_used_ += bytes;
  gather(staged_, row_bytes);
}

void DevicePageTransfer::synchronize() {
  check(cudaStreamSynchronize(as_stream(stream_)), "cudaStreamSynchronize");
  write_used_ = 0;
}

}  // namespace sparsekv::cuda
