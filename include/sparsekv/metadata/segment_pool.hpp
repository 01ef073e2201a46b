#pragma once
// A pre-allocated pool of fixed-size metadata segments shared by all requests
// and heads of one table (Spin §5.4). Its size is bounded by the memory given
// to the tier, not by the logical address space; a bitmap allocator hands out
// segments, and a finished request returns them.
#include <cstddef>
#include <cstdint>

#include "sparsekv/memory/memory_resource.hpp"
#include "sparsekv/metadata/bitmap_allocator.hpp"

namespace sparsekv {

class SegmentPool {
 public:
  // `segments` segments of `segment_bytes` each, in one allocation from `memory`.
  SegmentPool(std::size_t segment_bytes, std::uint32_t segments, MemoryResource& memory);
  ~SegmentPool();
  SegmentPool(const SegmentPool&) = delete;
  SegmentPool& operator=(const SegmentPool&) = delete;

  std::uint32_t allocate() { return bitmap_.allocate(); }
  // The next owner initialises the entries it maps (TwoLevelTable::resize).
  void free(std::uint32_t segment) { bitmap_.free(segment); }

  std::byte* data(std::uint32_t segment) noexcept { return base_ + segment * segment_bytes_; }
  const std::byte* data(std::uint32_t segment) const noexcept { return base_ + segment * segment_bytes_; }
  std::byte* base() noexcept { return base_; }

  std::size_t segment_bytes() const noexcept { return segment_bytes_; }
  std::uint32_t capacity() const noexcept { return bitmap_.capacity(); }
  std::uint32_t used() const noexcept { return bitmap_.used(); }
  std::uint32_t available() const noexcept { return bitmap_.available(); }
  bool is_allocated(std::uint32_t segment) const { return bitmap_.is_allocated(segment); }
  std::size_t reserved_bytes() const noexcept { return segment_bytes_ * capacity(); }
  MemoryKind memory_kind() const noexcept { return memory_->kind(); }

 private:
  std::size_t segment_bytes_;
  MemoryResource* memory_;
  std::byte* base_ = nullptr;
  BitmapAllocator bitmap_;
};

}  // namespace sparsekv
