#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <random>
#include <set>
#include <vector>

#include "sparsekv/core/device.hpp"
#include "sparsekv/memory/page_pool.hpp"
#include "test_support.hpp"

using namespace sparsekv;

namespace {

constexpr PageLayout kLayout{2, 8, DType::f32};  // 128-byte pages

// Every allocated page carries its id and generation in its bytes, so an
// overlap of two live pages or a page handed out twice shows up as a mismatch.
void stamp(PagePool& pool, PageId page, std::uint32_t generation) {
  std::vector<std::uint32_t> words(pool.page_bytes() / 4);
  for (std::size_t i = 0; i < words.size(); ++i) words[i] = page * 0x9E3779B1u ^ generation ^ std::uint32_t(i);
  std::memcpy(pool.data(page), words.data(), pool.page_bytes());
}
bool stamped(const PagePool& pool, PageId page, std::uint32_t generation) {
  std::vector<std::uint32_t> words(pool.page_bytes() / 4);
  std::memcpy(words.data(), pool.data(page), pool.page_bytes());
  for (std::size_t i = 0; i < words.size(); ++i) {
    if (words[i] != (page * 0x9E3779B1u ^ generation ^ std::uint32_t(i))) return false;
  }
  return true;
}

}  // namespace

TEST_CASE("PagePool layout: K block then V block", "[memory]") {
  const PageLayout layout{8, 128, DType::bf16};
  REQUIRE(layout.row_bytes() == 256);
  REQUIRE(layout.block_bytes() == 8 * 256);
  REQUIRE(layout.page_bytes() == 2 * 8 * 256);
  REQUIRE(layout.k_offset(3) == 3 * 256);
  REQUIRE(layout.v_offset(3) == 8 * 256 + 3 * 256);
}

TEST_CASE("PagePool random alloc/free/share/release against a reference", "[memory][random]") {
  for (const std::uint32_t seed : {1u, 2u, 3u, 4u}) {
    HostMemoryResource memory(false);
    PagePool pool(kLayout, 257, memory, 64);
    std::mt19937 rng(seed);
    std::map<PageId, std::uint32_t> refs;  // reference: live page -> count
    std::map<PageId, std::uint32_t> generation;
    std::uint32_t next_generation = 1;
    const auto random_live = [&] {
      auto it = refs.begin();
      std::advance(it, std::uniform_int_distribution<std::size_t>(0, refs.size() - 1)(rng));
      return it->first;
    };
    const auto take = [&](PageId page) {
      REQUIRE(page < pool.capacity());
      REQUIRE(refs.count(page) == 0);  // never handed out twice
      refs[page] = 1;
      generation[page] = next_generation++;
      stamp(pool, page, generation[page]);
    };
    for (int op = 0; op < 100000; ++op) {
      const int kind = std::uniform_int_distribution<int>(0, 9)(rng);
      if (kind <= 2) {
        if (refs.size() == pool.capacity()) {
          REQUIRE_SPARSEKV_ERROR(pool.allocate(), ErrorCode::resource_exhausted);
        } else {
          take(pool.allocate());
        }
      } else if (kind == 3) {
        std::vector<PageId> batch(std::uniform_int_distribution<std::size_t>(1, 40)(rng));
        if (batch.size() > pool.available()) {
          const std::uint32_t used = pool.used();
          REQUIRE_SPARSEKV_ERROR(pool.allocate(batch), ErrorCode::resource_exhausted);
          REQUIRE(pool.used() == used);  // all or nothing
        } else {
          pool.allocate(batch);
          for (PageId page : batch) take(page);
        }
      } else if (kind == 4 && !refs.empty()) {
        const PageId page = random_live();
        pool.share(page);
        ++refs[page];
      } else if (kind <= 7 && !refs.empty()) {
        const PageId page = random_live();
        REQUIRE(stamped(pool, page, generation[page]));
        const bool freed = pool.release(page);
        REQUIRE(freed == (--refs[page] == 0));
        if (freed) refs.erase(page);
      } else if (kind == 8 && !refs.empty()) {
        // Batch release of distinct pages plus one over-release: rejected whole.
        std::vector<PageId> batch{random_live()};
        for (std::uint32_t i = 0; i < refs[batch[0]]; ++i) batch.push_back(batch[0]);
        const std::uint32_t used = pool.used();
        REQUIRE_SPARSEKV_ERROR(pool.release(batch), ErrorCode::failed_precondition);
        REQUIRE(pool.used() == used);
        REQUIRE(pool.ref_count(batch[0]) == refs[batch[0]]);
      } else {
        // Releasing a free page or an id out of range is an error and changes nothing.
        PageId page = std::uniform_int_distribution<PageId>(0, pool.capacity() + 5)(rng);
        if (refs.count(page) == 0) {
          const std::uint32_t used = pool.used();
          REQUIRE_SPARSEKV_ERROR(pool.release(page),
                                 page < pool.capacity() ? ErrorCode::failed_precondition : ErrorCode::out_of_range);
          REQUIRE(pool.used() == used);
        }
      }
      REQUIRE(pool.used() == refs.size());
      if (op % 2000 == 0) {
        for (const auto& [page, count] : refs) {
          REQUIRE(pool.ref_count(page) == count);
          REQUIRE(stamped(pool, page, generation[page]));
        }
      }
    }
    // Drain to empty: no leak.
    for (const auto& [page, count] : refs) {
      for (std::uint32_t i = 0; i < count; ++i) pool.release(page);
    }
    REQUIRE(pool.used() == 0);
    REQUIRE(pool.reserved_bytes() <= std::size_t{pool.capacity()} * pool.page_bytes());
    // Refill: every page id comes back exactly once.
    std::vector<PageId> all(pool.capacity());
    pool.allocate(all);
    std::sort(all.begin(), all.end());
    for (PageId i = 0; i < pool.capacity(); ++i) REQUIRE(all[i] == i);
    REQUIRE(pool.available() == 0);
    REQUIRE(pool.reserved_bytes() == std::size_t{pool.capacity()} * pool.page_bytes());
  }
}

TEST_CASE("PagePool reserves memory lazily, a chunk at a time", "[memory]") {
  HostMemoryResource memory(false);
  PagePool pool(kLayout, 100, memory, 32);
  REQUIRE(pool.reserved_bytes() == 0);
  const PageId first = pool.allocate();
  REQUIRE(first == 0);
  REQUIRE(pool.reserved_bytes() == 32 * pool.page_bytes());
  std::vector<PageId> more(40);
  pool.allocate(more);
  REQUIRE(pool.reserved_bytes() == 64 * pool.page_bytes());
  std::vector<PageId> rest(pool.available());
  pool.allocate(rest);
  // The last chunk holds only the 4 remaining pages: no rounding up.
  REQUIRE(pool.reserved_bytes() == 100 * pool.page_bytes());
}

TEST_CASE("PagePool shared page is freed by its last user", "[memory]") {
  HostMemoryResource memory(false);
  PagePool pool(kLayout, 4, memory);
  const PageId page = pool.allocate();
  pool.share(page);
  pool.share(page);
  REQUIRE(pool.ref_count(page) == 3);
  REQUIRE_FALSE(pool.release(page));
  REQUIRE_FALSE(pool.release(page));
  REQUIRE(pool.is_allocated(page));
  REQUIRE(pool.release(page));
  REQUIRE_FALSE(pool.is_allocated(page));
  REQUIRE(pool.used() == 0);
}

TEST_CASE("PagePool bad input gets a clear error", "[memory][errors]") {
  HostMemoryResource memory(false);
  REQUIRE_SPARSEKV_ERROR(PagePool(kLayout, 0, memory), ErrorCode::invalid_argument);
  REQUIRE_SPARSEKV_ERROR(PagePool(PageLayout{0, 8, DType::f32}, 4, memory), ErrorCode::invalid_argument);
  PagePool pool(kLayout, 2, memory);
  REQUIRE_SPARSEKV_ERROR(pool.share(0), ErrorCode::failed_precondition);
  REQUIRE_SPARSEKV_ERROR(pool.data(1), ErrorCode::failed_precondition);
  REQUIRE_SPARSEKV_ERROR(pool.ref_count(2), ErrorCode::out_of_range);
  pool.allocate();
  pool.allocate();
  REQUIRE_SPARSEKV_ERROR(pool.allocate(), ErrorCode::resource_exhausted);
  REQUIRE(pool.used() == 2);
}

TEST_CASE("Device memory without a device reports unavailable", "[memory]") {
  if (cuda_device_count() > 0) {
    DeviceMemoryResource device;
    PagePool pool(kLayout, 8, device);
    REQUIRE(pool.memory_kind() == MemoryKind::device);
    REQUIRE(pool.allocate() == 0);
  } else {
    REQUIRE_SPARSEKV_ERROR(DeviceMemoryResource(), ErrorCode::unavailable);
    HostMemoryResource host;  // falls back to plain aligned memory
    REQUIRE(host.kind() == MemoryKind::host);
  }
}

TEST_CASE("plain host memory: zeroed, 256-byte aligned, large blocks on 2 MiB boundaries", "[memory]") {
  const Residency residency = GENERATE(Residency::on_first_touch, Residency::at_allocation);
  CAPTURE(residency == Residency::at_allocation);
  HostMemoryResource memory(false, residency);
  for (const std::size_t bytes : {std::size_t{1}, std::size_t{300}, (std::size_t{2} << 20) - 1, std::size_t{2} << 20,
                                  (std::size_t{5} << 20) + 77}) {
    CAPTURE(bytes);
    auto* p = static_cast<unsigned char*>(memory.allocate(bytes));
    REQUIRE(p != nullptr);
    const auto address = reinterpret_cast<std::uintptr_t>(p);
    REQUIRE(address % 256 == 0);
    // Blocks of 2 MiB or more start on a huge-page boundary, so THP can back them.
    if (bytes >= (std::size_t{2} << 20)) REQUIRE(address % (std::size_t{2} << 20) == 0);
    REQUIRE(std::all_of(p, p + bytes, [](unsigned char c) { return c == 0; }));
    p[bytes - 1] = 1;  // the whole block is writable
    memory.deallocate(p, bytes);
  }
  // Memory given back and asked for again comes back zeroed, whoever wrote it.
  for (int round = 0; round < 3; ++round) {
    const std::size_t bytes = (std::size_t{4} << 20) + 4096 * round;
    auto* p = static_cast<unsigned char*>(memory.allocate(bytes));
    REQUIRE(std::all_of(p, p + bytes, [](unsigned char c) { return c == 0; }));
    std::fill(p, p + bytes, static_cast<unsigned char>(0xff));
    memory.deallocate(p, bytes);
  }
  REQUIRE(memory.allocate(0) == nullptr);
}
