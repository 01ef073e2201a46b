#pragma once
// A pool of fixed-size head-wise pages (layout: page_layout.hpp) with O(1)
// allocation and release from a free list and reference counts for shared
// prefixes (PagedAttention+FlexAttention, Alg. 1: RESERVE pops pages from a
// global free list). Memory is reserved lazily in chunks of whole pages, so a
// pool sized for a large tier costs only what its requests have touched, and
// host chunks are pinned one bounded registration at a time.
//
// Not thread-safe: the engine drives one pool from one thread, or serialises.
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "sparsekv/core/ids.hpp"
#include "sparsekv/memory/memory_resource.hpp"
#include "sparsekv/memory/page_layout.hpp"

namespace sparsekv {

class PagePool {
 public:
  // `capacity_pages` pages of `layout.page_bytes()` each, reserved from
  // `memory` in chunks of `pages_per_chunk` pages (0: the whole capacity in one
  // chunk). `memory` must outlive the pool.
  PagePool(PageLayout layout, std::uint32_t capacity_pages, MemoryResource& memory, std::uint32_t pages_per_chunk = 0);
  ~PagePool();
  PagePool(const PagePool&) = delete;
  PagePool& operator=(const PagePool&) = delete;

  // One page with reference count 1; ErrorCode::resource_exhausted when full.
  PageId allocate();
  // out.size() pages, all or nothing.
  void allocate(std::span<PageId> out);
  // Another user of an allocated page (a shared prefix): count + 1.
  void share(PageId page);
  // Count - 1; the page returns to the free list at 0. Returns whether it did.
  bool release(PageId page);
  // Releases each page, all or nothing: every id is checked before any changes.
  void release(std::span<const PageId> pages);

  std::uint32_t ref_count(PageId page) const;
  bool is_allocated(PageId page) const;

  // Address of a page: host-dereferenceable unless the memory kind is device.
  std::byte* data(PageId page);
  const std::byte* data(PageId page) const;

  // Page 0's address when the pool is one chunk (pages_per_chunk == capacity)
  // and reserved: then page p lives at base() + p * page_bytes(), the
  // base-plus-index addressing paged attention kernels use. nullptr otherwise.
  const std::byte* base() const noexcept {
    return chunks_.size() == 1 && pages_per_chunk_ == capacity_ ? chunks_[0] : nullptr;
  }

  const PageLayout& layout() const noexcept { return layout_; }
  std::size_t page_bytes() const noexcept { return page_bytes_; }
  std::uint32_t capacity() const noexcept { return capacity_; }
  std::uint32_t used() const noexcept { return used_; }
  std::uint32_t available() const noexcept { return capacity_ - used_; }
  // Bytes reserved from the memory resource so far (whole chunks).
  std::size_t reserved_bytes() const noexcept;
  std::uint32_t pages_per_chunk() const noexcept { return pages_per_chunk_; }
  // Base address of every chunk reserved so far (chunk c holds pages
  // c * pages_per_chunk() ..): the table a device-side page-id -> address map
  // (ChunkedPages, transfer/miss_list.hpp) is built from. It grows when an
  // allocation reserves a chunk; a device copy is refreshed then.
  std::span<std::byte* const> chunks() const noexcept { return chunks_; }
  MemoryKind memory_kind() const noexcept { return memory_->kind(); }

 private:
  void check_page(PageId page) const;
  void reserve_chunk();
  std::size_t chunk_pages(std::size_t chunk) const noexcept;

  PageLayout layout_;
  std::size_t page_bytes_;
  std::uint32_t capacity_;
  std::uint32_t pages_per_chunk_;
  MemoryResource* memory_;
  std::vector<std::byte*> chunks_;
  std::vector<PageId> free_list_;          // LIFO stack of free reserved pages
  std::vector<std::uint32_t> ref_counts_;  // 0 = free
  std::uint32_t used_ = 0;
};

}  // namespace sparsekv
