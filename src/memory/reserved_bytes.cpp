#include "sparsekv/memory/reserved_bytes.hpp"

#include <cstdlib>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace sparsekv {

void* ReservedBytes::allocate(std::size_t bytes) {
#if defined(__linux__)
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) fail(ErrorCode::resource_exhausted, "ReservedBytes: reserving {} bytes failed", bytes);
  // Resident a base page at a time: a short prompt of a long request holds little.
  madvise(p, bytes, MADV_NOHUGEPAGE);
  return p;
#else
  void* p = std::malloc(bytes);
  if (p == nullptr) fail(ErrorCode::resource_exhausted, "ReservedBytes: reserving {} bytes failed", bytes);
  return p;
#endif
}

void ReservedBytes::deallocate(void* pointer, std::size_t bytes) noexcept {
#if defined(__linux__)
  munmap(pointer, bytes);
#else
  (void)bytes;
  std::free(pointer);
#endif
}

}  // namespace sparsekv
