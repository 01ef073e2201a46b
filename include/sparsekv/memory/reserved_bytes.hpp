#pragma once
// ReservedBytes: a byte array that grows by appends into a capacity reserved
// up front as host memory that becomes resident only as it is written, a
// base page at a time (an anonymous mapping without huge pages, on Linux). A
// staged prompt grows into it without a copy and costs what it holds, however
// large its request's max_tokens; its memory goes back to the system when it
// is released -- memory that a std::vector's reallocations would leave in the
// allocator's free lists, beside the CPU tier the prompt moves into.
#include <cstddef>
#include <cstring>
#include <utility>

#include "sparsekv/core/error.hpp"

namespace sparsekv {

class ReservedBytes {
 public:
  ReservedBytes() = default;
  ReservedBytes(ReservedBytes&& o) noexcept
      : data_(std::exchange(o.data_, nullptr)),
        size_(std::exchange(o.size_, 0)),
        capacity_(std::exchange(o.capacity_, 0)) {}
  ReservedBytes& operator=(ReservedBytes&& o) noexcept {
    if (this != &o) {
      release();
      data_ = std::exchange(o.data_, nullptr);
      size_ = std::exchange(o.size_, 0);
      capacity_ = std::exchange(o.capacity_, 0);
    }
    return *this;
  }
  ReservedBytes(const ReservedBytes&) = delete;
  ReservedBytes& operator=(const ReservedBytes&) = delete;
  ~ReservedBytes() { release(); }

  // Reserves `capacity` bytes when none are; throws invalid_argument for a
  // different capacity while some are, resource_exhausted when the memory
  // cannot be had.
  void reserve(std::size_t capacity) {
    if (capacity_ == capacity) return;
    if (capacity_ != 0) {
      fail(ErrorCode::invalid_argument, "ReservedBytes: {} bytes are reserved; cannot reserve {}", capacity_, capacity);
    }
    data_ = static_cast<std::byte*>(allocate(capacity));
    capacity_ = capacity;
  }
  // Appends n bytes; throws out_of_range, appending nothing, past the capacity.
  void append(const void* bytes, std::size_t n) {
    if (n > capacity_ - size_) {
      fail(ErrorCode::out_of_range, "ReservedBytes: {} + {} bytes exceed the {} reserved", size_, n, capacity_);
    }
    std::memcpy(data_ + size_, bytes, n);
    size_ += n;
  }
  // Frees the memory: empty, nothing reserved.
  void release() noexcept {
    if (data_ != nullptr) deallocate(data_, capacity_);
    data_ = nullptr;
    size_ = capacity_ = 0;
  }

  const std::byte* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return size_; }
  std::size_t capacity() const noexcept { return capacity_; }

 private:
  static void* allocate(std::size_t bytes);  // throws resource_exhausted
  static void deallocate(void* pointer, std::size_t bytes) noexcept;

  std::byte* data_ = nullptr;
  std::size_t size_ = 0, capacity_ = 0;
};

}  // namespace sparsekv
