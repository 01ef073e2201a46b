#include <random>
#include <set>
#include <vector>

#include "sparsekv/metadata/bitmap_allocator.hpp"
#include "test_support.hpp"

using namespace sparsekv;

TEST_CASE("BitmapAllocator random allocate/free against std::set", "[metadata][random]") {
  for (const std::uint32_t capacity : {1u, 63u, 64u, 65u, 1000u}) {
    for (const std::uint32_t seed : {11u, 12u, 13u}) {
      BitmapAllocator bitmap(capacity);
      std::set<std::uint32_t> live;
      std::mt19937 rng(seed * 1000 + capacity);
      for (int op = 0; op < 20000; ++op) {
        const int kind = std::uniform_int_distribution<int>(0, 5)(rng);
        if (kind <= 1) {
          if (live.size() == capacity) {
            REQUIRE_SPARSEKV_ERROR(bitmap.allocate(), ErrorCode::resource_exhausted);
          } else {
            const std::uint32_t slot = bitmap.allocate();
            REQUIRE(slot < capacity);
            REQUIRE(live.insert(slot).second);
          }
        } else if (kind == 2) {
          std::vector<std::uint32_t> batch(std::uniform_int_distribution<std::uint32_t>(1, 9)(rng));
          if (batch.size() > capacity - live.size()) {
            REQUIRE_SPARSEKV_ERROR(bitmap.allocate(batch), ErrorCode::resource_exhausted);
          } else {
            bitmap.allocate(batch);
            for (std::uint32_t slot : batch) REQUIRE(live.insert(slot).second);
          }
        } else if (kind <= 4 && !live.empty()) {
          auto it = live.begin();
          std::advance(it, std::uniform_int_distribution<std::size_t>(0, live.size() - 1)(rng));
          bitmap.free(*it);
          live.erase(it);
        } else {
          const std::uint32_t slot = std::uniform_int_distribution<std::uint32_t>(0, capacity + 3)(rng);
          if (!live.count(slot)) {
            REQUIRE_SPARSEKV_ERROR(bitmap.free(slot),
                                   slot < capacity ? ErrorCode::failed_precondition : ErrorCode::out_of_range);
          }
        }
        REQUIRE(bitmap.used() == live.size());
      }
      for (std::uint32_t slot = 0; slot < capacity; ++slot)
        REQUIRE(bitmap.is_allocated(slot) == (live.count(slot) == 1));
    }
  }
}

TEST_CASE("BitmapAllocator fills every slot exactly once", "[metadata]") {
  BitmapAllocator bitmap(130);
  std::set<std::uint32_t> seen;
  for (int i = 0; i < 130; ++i) REQUIRE(seen.insert(bitmap.allocate()).second);
  REQUIRE(*seen.rbegin() == 129);
  REQUIRE_SPARSEKV_ERROR(bitmap.allocate(), ErrorCode::resource_exhausted);
  bitmap.free(77);
  REQUIRE(bitmap.allocate() == 77);
  REQUIRE_SPARSEKV_ERROR(BitmapAllocator(0), ErrorCode::invalid_argument);
}
