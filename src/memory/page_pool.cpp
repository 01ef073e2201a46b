#include "sparsekv/memory/page_pool.hpp"

#include <algorithm>
#include <limits>

#include "sparsekv/core/error.hpp"

namespace sparsekv {

PagePool::PagePool(PageLayout layout, std::uint32_t capacity_pages, MemoryResource& memory,
                   std::uint32_t pages_per_chunk)
    : layout_(layout),
      page_bytes_(layout.page_bytes()),
      capacity_(capacity_pages),
      pages_per_chunk_(pages_per_chunk == 0 ? capacity_pages : std::min(pages_per_chunk, capacity_pages)),
      memory_(&memory) {
  if (layout.page_tokens == 0 || layout.head_dim == 0) {
    fail(ErrorCode::invalid_argument, "PagePool: page_tokens ({}) and head_dim ({}) must be > 0", layout.page_tokens,
         layout.head_dim);
  }
  if (capacity_pages == 0 || capacity_pages == std::numeric_limits<std::uint32_t>::max()) {
    fail(ErrorCode::invalid_argument, "PagePool: capacity_pages ({}) must be in [1, 2^32 - 1)", capacity_pages);
  }
  ref_counts_.assign(capacity_, 0);
  chunks_.reserve((std::size_t{capacity_} + pages_per_chunk_ - 1) / pages_per_chunk_);  // push_back never throws
  free_list_.reserve(capacity_);
}

PagePool::~PagePool() {
  for (std::size_t i = 0; i < chunks_.size(); ++i) memory_->deallocate(chunks_[i], chunk_pages(i) * page_bytes_);
}

std::size_t PagePool::chunk_pages(std::size_t chunk) const noexcept {
  return std::min<std::size_t>(pages_per_chunk_, capacity_ - chunk * pages_per_chunk_);
}

std::size_t PagePool::reserved_bytes() const noexcept {
  std::size_t bytes = 0;
  for (std::size_t i = 0; i < chunks_.size(); ++i) bytes += chunk_pages(i) * page_bytes_;
  return bytes;
}

void PagePool::reserve_chunk() {
  const auto first = static_cast<PageId>(chunks_.size() * std::size_t{pages_per_chunk_});
  const auto count = static_cast<std::uint32_t>(chunk_pages(chunks_.size()));
  // Only the last chunk may be short, so page -> (chunk, offset) stays one division.
  chunks_.push_back(static_cast<std::byte*>(memory_->allocate(std::size_t{count} * page_bytes_)));
  // Push in reverse so that the lowest id of the chunk is popped first.
  for (std::uint32_t i = count; i-- > 0;) free_list_.push_back(first + i);
}

PageId PagePool::allocate() {
  PageId page = kInvalidPage;
  allocate(std::span<PageId>(&page, 1));
  return page;
}

void PagePool::allocate(std::span<PageId> out) {
  if (out.size() > available()) {
    fail(ErrorCode::resource_exhausted, "PagePool: {} pages requested, {} of {} available", out.size(), available(),
         capacity_);
  }
  // Reserve the chunks first: if the memory resource throws, no page changed owner.
  while (free_list_.size() < out.size()) reserve_chunk();
  for (PageId& page : out) {
    page = free_list_.back();
    free_list_.pop_back();
    ref_counts_[page] = 1;
  }
  used_ += static_cast<std::uint32_t>(out.size());
}

void PagePool::check_page(PageId page) const {
  check_index("PagePool: page", page, capacity_);
  if (ref_counts_[page] == 0) fail(ErrorCode::failed_precondition, "PagePool: page {} is not allocated", page);
}

void PagePool::share(PageId page) {
  check_page(page);
  if (ref_counts_[page] == std::numeric_limits<std::uint32_t>::max()) {
    fail(ErrorCode::resource_exhausted, "PagePool: reference count of page {} would overflow", page);
  }
  ++ref_counts_[page];
}

bool PagePool::release(PageId page) {
  check_page(page);
  if (--ref_counts_[page] != 0) return false;
  free_list_.push_back(page);
  --used_;
  return true;
}

void PagePool::release(std::span<const PageId> pages) {
  // A page listed k times needs a count of at least k; check before changing anything.
  std::vector<PageId> sorted(pages.begin(), pages.end());
  std::sort(sorted.begin(), sorted.end());
  for (std::size_t i = 0; i < sorted.size();) {
    std::size_t j = i;
    while (j < sorted.size() && sorted[j] == sorted[i]) ++j;
    check_page(sorted[i]);
    if (ref_counts_[sorted[i]] < j - i) {
      fail(ErrorCode::failed_precondition, "PagePool: page {} released {} times but has {} references", sorted[i],
           j - i, ref_counts_[sorted[i]]);
    }
    i = j;
  }
  for (PageId page : pages) release(page);
}

std::uint32_t PagePool::ref_count(PageId page) const {
  check_index("PagePool: page", page, capacity_);
  return ref_counts_[page];
}

bool PagePool::is_allocated(PageId page) const { return page < capacity_ && ref_counts_[page] != 0; }

std::byte* PagePool::data(PageId page) {
  check_page(page);
  return chunks_[page / pages_per_chunk_] + std::size_t{page % pages_per_chunk_} * page_bytes_;
}

const std::byte* PagePool::data(PageId page) const { return const_cast<PagePool*>(this)->data(page); }

}  // namespace sparsekv
