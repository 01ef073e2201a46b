#pragma once
// Where pages and metadata segments live. Host memory is pinned (cudaHostAlloc,
// mapped so GPU kernels read it through unified virtual addressing) whenever a
// CUDA device is present, and plain 256-byte aligned memory otherwise (on
// Linux, blocks of 2 MiB or more are anonymous mappings, 2 MiB aligned, on
// transparent huge pages where Linux gives them, and zero-filled by the
// kernel as each page is first touched: reserving one costs no pass over its
// bytes); device memory comes from cudaMalloc and needs a device.
#include <cstddef>
#include <string_view>

namespace sparsekv {

enum class MemoryKind { host, pinned_host, device };

constexpr std::string_view to_string(MemoryKind kind) noexcept {
  switch (kind) {
    case MemoryKind::host:
      return "host";
    case MemoryKind::pinned_host:
      return "pinned_host";
    case MemoryKind::device:
      return "device";
  }
  return "unknown";
}

class MemoryResource {
 public:
  virtual ~MemoryResource() = default;
  // Returns zero-filled memory aligned to at least 256 bytes, or throws
  // ErrorCode::resource_exhausted (host) / cuda_error (device).
  virtual void* allocate(std::size_t bytes) = 0;
  // `bytes` as passed to the allocate() that returned `pointer`.
  virtual void deallocate(void* pointer, std::size_t bytes) noexcept = 0;
  virtual MemoryKind kind() const noexcept = 0;
  // Whether host code may dereference the memory.
  bool host_accessible() const noexcept { return kind() != MemoryKind::device; }
};

// When plain host memory becomes resident. A pool reserved in chunks as it
// grows (the CPU tier) wants on_first_touch: the decode step that reserves the
// next chunk then pays for no page it does not write. Memory standing in for
// HBM (HostBackend's GPU tier) wants at_allocation, as cudaMalloc's is, so
// no step pays the first touch of a slot. Pinned memory is always resident.
enum class Residency { on_first_touch, at_allocation };

// Host memory: pinned when `prefer_pinned` and a CUDA device is present.
class HostMemoryResource final : public MemoryResource {
 public:
  explicit HostMemoryResource(bool prefer_pinned = true, Residency residency = Residency::on_first_touch);
  void* allocate(std::size_t bytes) override;
  void deallocate(void* pointer, std::size_t bytes) noexcept override;
  MemoryKind kind() const noexcept override { return pinned_ ? MemoryKind::pinned_host : MemoryKind::host; }

 private:
  bool pinned_;
  Residency residency_;
};

// GPU memory on the current device. Construction throws ErrorCode::unavailable
// when no CUDA device can be used.
class DeviceMemoryResource final : public MemoryResource {
 public:
  DeviceMemoryResource();
  void* allocate(std::size_t bytes) override;
  void deallocate(void* pointer, std::size_t bytes) noexcept override;
  MemoryKind kind() const noexcept override { return MemoryKind::device; }
};

}  // namespace sparsekv
