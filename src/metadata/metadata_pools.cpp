#include <bit>

#include "sparsekv/core/error.hpp"
#include "sparsekv/metadata/bitmap_allocator.hpp"
#include "sparsekv/metadata/segment_pool.hpp"

namespace sparsekv {

BitmapAllocator::BitmapAllocator(std::uint32_t capacity) : capacity_(capacity), words_((capacity + 63) / 64, 0) {
  if (capacity == 0) fail(ErrorCode::invalid_argument, "BitmapAllocator: capacity must be > 0");
  // Bits past the capacity in the last word are marked taken so searches skip them.
  if (capacity % 64 != 0) words_.back() = ~std::uint64_t{0} << (capacity % 64);
}

std::uint32_t BitmapAllocator::take_one() {
  const auto words = static_cast<std::uint32_t>(words_.size());
  for (std::uint32_t n = 0; n < words; ++n) {
    const std::uint32_t w = cursor_ + n < words ? cursor_ + n : cursor_ + n - words;
    if (words_[w] != ~std::uint64_t{0}) {
      const auto bit = static_cast<std::uint32_t>(std::countr_one(words_[w]));
      words_[w] |= std::uint64_t{1} << bit;
      cursor_ = w;
      ++used_;
      return w * 64 + bit;
    }
  }
  // Unreachable: callers check available() first.
  fail(ErrorCode::resource_exhausted, "BitmapAllocator: all {} slots are taken", capacity_);
}

std::uint32_t BitmapAllocator::allocate() {
  if (available() == 0) fail(ErrorCode::resource_exhausted, "BitmapAllocator: all {} slots are taken", capacity_);
  return take_one();
}

void BitmapAllocator::allocate(std::span<std::uint32_t> out) {
  if (out.size() > available()) {
    fail(ErrorCode::resource_exhausted, "BitmapAllocator: {} slots requested, {} of {} free", out.size(), available(),
         capacity_);
  }
  for (std::uint32_t& slot : out) slot = take_one();
}

void BitmapAllocator::free(std::uint32_t index) {
  check_index("BitmapAllocator: slot", index, capacity_);
  if (!is_allocated(index)) fail(ErrorCode::failed_precondition, "BitmapAllocator: slot {} is not allocated", index);
  words_[index / 64] &= ~(std::uint64_t{1} << (index % 64));
  --used_;
  // Freed space is found first by the next search.
  if (index / 64 < cursor_) cursor_ = index / 64;
}

bool BitmapAllocator::is_allocated(std::uint32_t index) const {
  return index < capacity_ && ((words_[index / 64] >> (index % 64)) & 1u) != 0;
}

SegmentPool::SegmentPool(std::size_t segment_bytes, std::uint32_t segments, MemoryResource& memory)
    : segment_bytes_(segment_bytes), memory_(&memory), bitmap_(segments) {
  if (segment_bytes == 0) fail(ErrorCode::invalid_argument, "SegmentPool: segment_bytes must be > 0");
  base_ = static_cast<std::byte*>(memory.allocate(segment_bytes_ * segments));
}

SegmentPool::~SegmentPool() { memory_->deallocate(base_, reserved_bytes()); }

}  // namespace sparsekv
