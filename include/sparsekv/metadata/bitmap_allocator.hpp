#pragma once
// The lightweight allocator behind a SegmentPool (Spin §5.4): one bit per slot,
// first-fit search over 64-bit words starting from a rotating cursor, so a
// steady stream of allocations and frees stays close to O(1) per call.
#include <cstdint>
#include <span>
#include <vector>

namespace sparsekv {

class BitmapAllocator {
 public:
  explicit BitmapAllocator(std::uint32_t capacity);

  // Index of a newly taken slot; ErrorCode::resource_exhausted when full.
  std::uint32_t allocate();
  // out.size() slots, all or nothing.
  void allocate(std::span<std::uint32_t> out);
  // ErrorCode::out_of_range / failed_precondition for a bad or free slot.
  void free(std::uint32_t index);

  bool is_allocated(std::uint32_t index) const;
  std::uint32_t capacity() const noexcept { return capacity_; }
  std::uint32_t used() const noexcept { return used_; }
  std::uint32_t available() const noexcept { return capacity_ - used_; }

 private:
  std::uint32_t take_one();

  std::uint32_t capacity_;
  std::uint32_t used_ = 0;
  std::uint32_t cursor_ = 0;  // word where the next search starts
  std::vector<std::uint64_t> words_;
};

}  // namespace sparsekv
