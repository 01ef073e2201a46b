// ReservedBytes (memory/reserved_bytes.hpp): appends within the reserved
// capacity, refusals that change nothing, release.
#include <cstdio>
#include <cstring>
#include <vector>

#if defined(__linux__)
#include <unistd.h>
#endif

#include <catch2/catch.hpp>

#include "sparsekv/core/error.hpp"
#include "sparsekv/memory/reserved_bytes.hpp"

using namespace sparsekv;

TEST_CASE("ReservedBytes: appends into its reservation, refuses past it, releases", "[memory][reserved-bytes]") {
  ReservedBytes bytes;
  REQUIRE(bytes.data() == nullptr);
  REQUIRE(bytes.size() == 0);
  const std::size_t capacity = std::size_t{3} << 20;  // a mapping, as a long prompt's
  bytes.reserve(capacity);
  bytes.reserve(capacity);  // the same again: nothing changes
  REQUIRE(bytes.capacity() == capacity);
  std::vector<std::byte> chunk(1000);
  for (std::size_t i = 0; i < chunk.size(); ++i) chunk[i] = std::byte(i * 7);
  std::size_t appended = 0;
  while (appended + chunk.size() <= capacity) {
    bytes.append(chunk.data(), chunk.size());
    appended += chunk.size();
  }
  REQUIRE(bytes.size() == appended);
  for (std::size_t at = 0; at < appended; at += 997 * chunk.size()) {
    REQUIRE(std::memcmp(bytes.data() + at, chunk.data(), chunk.size()) == 0);
  }
  const std::byte* before = bytes.data();
  REQUIRE_THROWS_MATCHES(bytes.append(chunk.data(), chunk.size()), Error,
                         Catch::Predicate<Error>([](const Error& e) { return e.code() == ErrorCode::out_of_range; }));
  REQUIRE_THROWS_MATCHES(bytes.reserve(capacity / 2), Error, Catch::Predicate<Error>([](const Error& e) {
                           return e.code() == ErrorCode::invalid_argument;
                         }));
  REQUIRE(bytes.size() == appended);
  REQUIRE(bytes.data() == before);
  ReservedBytes moved = std::move(bytes);
  REQUIRE(moved.size() == appended);
  REQUIRE(bytes.size() == 0);
  REQUIRE(bytes.capacity() == 0);
  moved.release();
  REQUIRE(moved.data() == nullptr);
  REQUIRE(moved.capacity() == 0);
  moved.reserve(64);  // small, after a release
  moved.append(chunk.data(), 64);
  REQUIRE(std::memcmp(moved.data(), chunk.data(), 64) == 0);
}

#if defined(__linux__)
namespace {
// This process's resident bytes (/proc/self/statm).
std::size_t resident_bytes() {
  std::FILE* f = std::fopen("/proc/self/statm", "r");
  REQUIRE(f != nullptr);
  unsigned long size = 0, resident = 0;
  REQUIRE(std::fscanf(f, "%lu %lu", &size, &resident) == 2);
  std::fclose(f);
  return resident * std::size_t(sysconf(_SC_PAGESIZE));
}
}  // namespace

TEST_CASE("ReservedBytes: resident as written, returned to the system when released", "[memory][reserved-bytes]") {
  const std::size_t reserved = std::size_t{256} << 20, written = std::size_t{48} << 20;
  const std::size_t before = resident_bytes();
  ReservedBytes bytes;
  bytes.reserve(reserved);
  REQUIRE(resident_bytes() < before + (std::size_t{8} << 20));  // a reservation costs nothing resident
  std::vector<std::byte> chunk(std::size_t{1} << 20, std::byte{1});
  for (std::size_t at = 0; at < written; at += chunk.size()) bytes.append(chunk.data(), chunk.size());
  const std::size_t full = resident_bytes();
  REQUIRE(full >= before + written - (std::size_t{4} << 20));
  REQUIRE(full < before + written + (std::size_t{16} << 20));  // what was written, not the reservation
  bytes.release();
  REQUIRE(resident_bytes() < full - written + (std::size_t{4} << 20));
}
#endif
