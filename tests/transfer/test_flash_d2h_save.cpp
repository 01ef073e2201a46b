// Save D2H (SparseServe §3.2.2 FlashD2H), host path: FlashD2HSaver against a
// sequential reference scatter, byte for byte over the whole pool (rows not
// targeted, padding and other chunks included), with 1, 2 and 4 workers,
// saves waited one by one or pipelined, bad input and worker errors.
#include <algorithm>
#include <cstring>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "sparsekv/memory/memory_resource.hpp"
#include "sparsekv/memory/page_pool.hpp"
#include "sparsekv/transfer/flash_d2h_save.hpp"
#include "test_support.hpp"

using namespace sparsekv;

namespace {

// A CPU tier in `chunk_count` separately allocated chunks, like a chunked
// PagePool; the last chunk may be partly beyond page_count.
struct TestPool {
  TestPool(std::uint32_t page_tokens_, std::size_t row_bytes_, std::uint32_t pages_per_chunk_,
           std::uint32_t page_count_, std::size_t padding, std::mt19937& rng)
      : page_tokens(page_tokens_), row_bytes(row_bytes_), pages_per_chunk(pages_per_chunk_), page_count(page_count_) {
    page_stride = 2 * std::size_t{page_tokens} * row_bytes + padding;
    const std::uint32_t chunk_count = (page_count + pages_per_chunk - 1) / pages_per_chunk;
    storage.resize(chunk_count);
    for (auto& chunk : storage) {
      chunk.resize(std::size_t{pages_per_chunk} * page_stride);
      for (auto& b : chunk) b = static_cast<std::byte>(rng());
      chunks.push_back(chunk.data());
    }
  }
  SaveDestination destination() const {
    // V first, then K: the saver takes the offsets it is given, not a fixed order.
    const std::size_t block = std::size_t{page_tokens} * row_bytes;
    return SaveDestination{chunks, pages_per_chunk, page_count, page_stride, page_tokens, row_bytes, block, 0};
  }
  std::byte* row(const RowTarget& t) {
    const std::size_t block = std::size_t{page_tokens} * row_bytes;
    return storage[t.page / pages_per_chunk].data() + std::size_t{t.page % pages_per_chunk} * page_stride +
           (t.block == KvBlock::k ? block : 0) + std::size_t{t.slot} * row_bytes;
  }
  // The reference: one row after the other, in order.
  void scatter(const std::vector<std::byte>& source, const std::vector<RowTarget>& targets) {
    for (std::size_t i = 0; i < targets.size(); ++i) {
      std::memcpy(row(targets[i]), source.data() + i * row_bytes, row_bytes);
    }
  }

  std::uint32_t page_tokens;
  std::size_t row_bytes;
  std::uint32_t pages_per_chunk;
  std::uint32_t page_count;
  std::size_t page_stride = 0;
  std::vector<std::vector<std::byte>> storage;
  std::vector<std::byte*> chunks;
};

// Rows of a step: pages drawn from `hot_pages` of the pool so many rows share
// a page, and some rows repeat a (page, slot, block) the step already names.
std::vector<RowTarget> random_targets(std::size_t rows, const TestPool& pool, std::uint32_t hot_pages,
                                      std::mt19937& rng) {
  std::vector<PageId> hot(hot_pages);
  for (auto& p : hot) p = static_cast<PageId>(rng() % pool.page_count);
  std::vector<RowTarget> targets(rows);
  for (std::size_t i = 0; i < rows; ++i) {
    if (i > 0 && rng() % 8 == 0) {
      targets[i] = targets[rng() % i];
      continue;
    }
    targets[i] = RowTarget{hot[rng() % hot_pages], static_cast<std::uint32_t>(rng() % pool.page_tokens),
                           rng() % 2 == 0 ? KvBlock::k : KvBlock::v};
  }
  return targets;
}

std::vector<std::byte> random_bytes(std::size_t n, std::mt19937& rng) {
  std::vector<std::byte> bytes(n);
  for (auto& b : bytes) b = static_cast<std::byte>(rng());
  return bytes;
}

}  // namespace

TEST_CASE("FlashD2HSaver scatters like a sequential reference", "[flash-d2h-save]") {
  std::mt19937 rng(2024);
  struct Geometry {
    std::uint32_t page_tokens;
    std::uint32_t head_dim;
    std::size_t dtype_bytes;
    std::size_t padding;
  };
  // fp16 and fp32 rows, one page of padding bytes or none.
  const Geometry geometries[] = {{8, 64, 2, 0}, {16, 32, 4, 64}, {4, 128, 2, 16}, {8, 8, 4, 0}};
  for (const Geometry& g : geometries) {
    for (const std::uint32_t workers : {1u, 2u, 4u}) {
      for (const bool pipelined : {false, true}) {
        CAPTURE(g.page_tokens, g.head_dim, g.dtype_bytes, workers, pipelined);
        const std::size_t row_bytes = g.head_dim * g.dtype_bytes;
        TestPool pool(g.page_tokens, row_bytes, 5, 13, g.padding, rng);
        TestPool reference = pool;
        reference.chunks.clear();
        FlashD2HSaver saver(FlashD2HSaverConfig{workers, 2, 0, std::size_t{1} << 24});
        REQUIRE(saver.workers() == workers);
        saver.set_destination(pool.destination());
        std::vector<std::byte> source;
        SaveTicket last = 0;
        for (int step = 0; step < 6; ++step) {
          // kv_heads x tokens x {K, V}: 2 heads x 1 token (decode) up to 8 x 24 (a prefill chunk).
          const std::size_t rows = 2 * (1 + rng() % 8) * (1 + rng() % 24);
          const std::vector<RowTarget> targets = random_targets(rows, pool, 1 + rng() % 6, rng);
          source = random_bytes(rows * row_bytes, rng);
          reference.scatter(source, targets);
          last = saver.save(source.data(), source.size(), targets, nullptr);
          REQUIRE(last == SaveTicket(step + 1));
          // The host path has copied the source: overwriting it must not change the save.
          std::fill(source.begin(), source.end(), std::byte{0xEE});
          if (!pipelined) {
            saver.wait(last);
            REQUIRE(saver.finished(last));
            REQUIRE(pool.storage == reference.storage);
          }
        }
        saver.wait();
        REQUIRE(saver.finished(last));
        REQUIRE(pool.storage == reference.storage);
      }
    }
  }
}

TEST_CASE("FlashD2HSaver writes an engine chunk where PageLayout puts it", "[flash-d2h-save]") {
  // [tokens][kv_heads][head_dim], K then V in one buffer, into a single-chunk PagePool.
  std::mt19937 rng(7);
  const PageLayout layout{8, 16, DType::f16};
  HostMemoryResource memory(false);
  PagePool pool(layout, 32, memory, 32);
  constexpr std::uint32_t kHeads = 3;
  constexpr std::uint32_t kTokens = 11;
  std::vector<PageId> pages(6);
  pool.allocate(pages);
  REQUIRE(pool.base() != nullptr);
  std::byte* chunk = const_cast<std::byte*>(pool.base());
  const std::vector<std::byte*> chunks{chunk};
  FlashD2HSaver saver(FlashD2HSaverConfig{2});
  saver.set_destination(SaveDestination{chunks, pool.capacity(), pool.capacity(), pool.page_bytes(), layout.page_tokens,
                                        layout.row_bytes(), layout.k_offset(0), layout.v_offset(0)});
  // Token t of head h: page pages[2h + t / 8], slot t % 8 (TokenPlacement of a uniform spec).
  std::vector<RowTarget> targets;
  for (const KvBlock block : {KvBlock::k, KvBlock::v})
    for (std::uint32_t t = 0; t < kTokens; ++t)
      for (std::uint32_t h = 0; h < kHeads; ++h) targets.push_back({pages[2 * h + t / 8], t % 8, block});
  const std::vector<std::byte> kv = random_bytes(targets.size() * layout.row_bytes(), rng);
  saver.wait(saver.save(kv.data(), kv.size(), targets, nullptr));
  const std::size_t row = layout.row_bytes();
  for (std::uint32_t t = 0; t < kTokens; ++t) {
    for (std::uint32_t h = 0; h < kHeads; ++h) {
      const std::byte* page = pool.data(pages[2 * h + t / 8]);
      const std::size_t k_source = (std::size_t{t} * kHeads + h) * row;
      const std::size_t v_source = (std::size_t{kTokens} * kHeads + std::size_t{t} * kHeads + h) * row;
      REQUIRE(std::memcmp(page + layout.k_offset(t % 8), kv.data() + k_source, row) == 0);
      REQUIRE(std::memcmp(page + layout.v_offset(t % 8), kv.data() + v_source, row) == 0);
    }
  }
}

TEST_CASE("FlashD2HSaver keeps each save's destination and grows staging under back-pressure", "[flash-d2h-save]") {
  std::mt19937 rng(99);
  TestPool first(8, 64, 4, 8, 0, rng), second(8, 64, 4, 8, 0, rng);
  TestPool first_ref = first, second_ref = second;
  // One slot: every save waits for the previous one's scatter before reusing staging.
  FlashD2HSaver saver(FlashD2HSaverConfig{3, 1, 128, std::size_t{1} << 20});
  REQUIRE(saver.staging_bytes() == 128);
  std::vector<SaveTicket> tickets;
  for (int step = 0; step < 8; ++step) {
    TestPool& pool = step % 2 == 0 ? first : second;
    TestPool& ref = step % 2 == 0 ? first_ref : second_ref;
    saver.set_destination(pool.destination());
    const std::size_t rows = std::size_t{4} << step / 2;  // 4 .. 32 rows: staging must grow
    const std::vector<RowTarget> targets = random_targets(rows, pool, 3, rng);
    const std::vector<std::byte> source = random_bytes(rows * 64, rng);
    ref.scatter(source, targets);
    tickets.push_back(saver.save(source.data(), source.size(), targets, nullptr));
  }
  saver.wait(tickets.back());
  for (const SaveTicket t : tickets) REQUIRE(saver.finished(t));
  REQUIRE(saver.staging_bytes() >= 32 * 64);
  REQUIRE(first.storage == first_ref.storage);
  REQUIRE(second.storage == second_ref.storage);
}

TEST_CASE("FlashD2HSaver refuses bad input and leaves the pool unchanged", "[flash-d2h-save]") {
  std::mt19937 rng(3);
  TestPool pool(8, 32, 4, 10, 0, rng);  // chunks of 4 pages: the third holds pages 8, 9
  const auto before = pool.storage;
  FlashD2HSaver saver(FlashD2HSaverConfig{2, 2, 0, 64 * 32});
  const std::vector<RowTarget> one{{1, 0, KvBlock::k}};
  const std::vector<std::byte> source = random_bytes(32 * 64 + 32, rng);

  // No destination yet.
  REQUIRE_SPARSEKV_ERROR(saver.save(source.data(), 32, one, nullptr), ErrorCode::failed_precondition);
  saver.set_destination(pool.destination());

  // Bad geometry: the previous destination stays.
  SaveDestination d = pool.destination();
  d.v_block_offset = d.k_block_offset + 32;  // overlaps K
  REQUIRE_SPARSEKV_ERROR(saver.set_destination(d), ErrorCode::invalid_argument);
  d = pool.destination();
  d.page_stride -= 1;  // K block ends past the page
  REQUIRE_SPARSEKV_ERROR(saver.set_destination(d), ErrorCode::invalid_argument);
  d = pool.destination();
  d.page_count = 13;  // three chunks of four hold 12
  REQUIRE_SPARSEKV_ERROR(saver.set_destination(d), ErrorCode::invalid_argument);
  d = pool.destination();
  d.row_bytes = 0;
  REQUIRE_SPARSEKV_ERROR(saver.set_destination(d), ErrorCode::invalid_argument);
  d = pool.destination();
  d.chunks = {};
  REQUIRE_SPARSEKV_ERROR(saver.set_destination(d), ErrorCode::invalid_argument);

  std::vector<RowTarget> targets = random_targets(8, pool, 3, rng);
  auto with = [&](std::size_t i, RowTarget bad) {
    std::vector<RowTarget> t = targets;
    t[i] = bad;
    return t;
  };
  REQUIRE_SPARSEKV_ERROR(saver.save(source.data(), 7 * 32, targets, nullptr), ErrorCode::invalid_argument);
  REQUIRE_SPARSEKV_ERROR(saver.save(source.data(), 9 * 32, targets, nullptr), ErrorCode::invalid_argument);
  REQUIRE_SPARSEKV_ERROR(saver.save(nullptr, 8 * 32, targets, nullptr), ErrorCode::invalid_argument);
  REQUIRE_SPARSEKV_ERROR(saver.save(source.data(), 8 * 32, with(7, {10, 0, KvBlock::k}), nullptr),
                         ErrorCode::out_of_range);
  REQUIRE_SPARSEKV_ERROR(saver.save(source.data(), 8 * 32, with(3, {kInvalidPage, 0, KvBlock::v}), nullptr),
                         ErrorCode::out_of_range);
  REQUIRE_SPARSEKV_ERROR(saver.save(source.data(), 8 * 32, with(5, {2, 8, KvBlock::v}), nullptr),
                         ErrorCode::out_of_range);
  REQUIRE_SPARSEKV_ERROR(saver.save(source.data(), 8 * 32, with(0, {2, 1, static_cast<KvBlock>(2)}), nullptr),
                         ErrorCode::invalid_argument);
  // 65 rows of 32 bytes: above max_staging_bytes = 64 rows.
  const std::vector<RowTarget> too_many(65, RowTarget{0, 0, KvBlock::k});
  REQUIRE_SPARSEKV_ERROR(saver.save(source.data(), 65 * 32, too_many, nullptr), ErrorCode::resource_exhausted);
  // A chunk not reserved yet (null), as in a lazily reserved PagePool.
  std::vector<std::byte*> partial = pool.chunks;
  partial[2] = nullptr;
  d = pool.destination();
  d.chunks = partial;
  saver.set_destination(d);
  REQUIRE_SPARSEKV_ERROR(saver.save(source.data(), 8 * 32, with(4, {9, 0, KvBlock::k}), nullptr),
                         ErrorCode::failed_precondition);

  REQUIRE(saver.last_ticket() == 0);
  REQUIRE_SPARSEKV_ERROR(saver.wait(1), ErrorCode::invalid_argument);
  REQUIRE_SPARSEKV_ERROR(saver.wait_copy(1, nullptr), ErrorCode::invalid_argument);
  saver.wait();
  REQUIRE(pool.storage == before);

  // Empty saves enqueue nothing; the saver still works after every refusal.
  REQUIRE(saver.save(source.data(), 0, {}, nullptr) == 0);
  saver.wait(0);
  saver.set_destination(pool.destination());
  const SaveTicket t = saver.save(source.data(), 8 * 32, targets, nullptr);
  REQUIRE(t == 1);
  saver.wait_copy(t, nullptr);  // host path: the copy was done in save()
  saver.wait(t);
  TestPool reference = pool;
  reference.storage = before;
  reference.scatter(source, targets);
  REQUIRE(pool.storage == reference.storage);

  REQUIRE_SPARSEKV_ERROR(FlashD2HSaver(FlashD2HSaverConfig{0}), ErrorCode::invalid_argument);
  REQUIRE_SPARSEKV_ERROR(FlashD2HSaver(FlashD2HSaverConfig{65}), ErrorCode::invalid_argument);
  REQUIRE_SPARSEKV_ERROR(FlashD2HSaver(FlashD2HSaverConfig{2, 0}), ErrorCode::invalid_argument);
  REQUIRE_SPARSEKV_ERROR(FlashD2HSaver(FlashD2HSaverConfig{2, 2, 4096, 1024}), ErrorCode::invalid_argument);
}

TEST_CASE("FlashD2HSaver surfaces worker errors on wait, once each", "[flash-d2h-save]") {
  std::mt19937 rng(41);
  for (const std::uint32_t workers : {1u, 4u}) {
    CAPTURE(workers);
    TestPool pool(8, 16, 8, 8, 0, rng);
    TestPool reference = pool;
    FlashD2HSaver saver(FlashD2HSaverConfig{workers});
    saver.set_destination(pool.destination());
    // Callbacks of different saves may run concurrently on different workers.
    std::mutex completed_mutex;
    std::vector<int> completed;
    std::vector<SaveTicket> tickets;
    for (int step = 0; step < 5; ++step) {
      const std::vector<RowTarget> targets = random_targets(40, pool, 4, rng);
      const std::vector<std::byte> source = random_bytes(40 * 16, rng);
      reference.scatter(source, targets);
      // Steps 1 and 3 fail in their completion callback, after their rows are written.
      tickets.push_back(saver.save(source.data(), source.size(), targets, nullptr, [&, step] {
        if (step == 1 || step == 3) throw std::runtime_error("callback of step " + std::to_string(step));
        std::lock_guard lock(completed_mutex);
        completed.push_back(step);
      }));
    }
    saver.wait(tickets[0]);  // step 0 succeeded; step 1's error is not its business
    try {
      saver.wait(tickets[4]);
      FAIL("wait did not rethrow the callback's error");
    } catch (const std::runtime_error& e) {
      REQUIRE(std::string(e.what()) == "callback of step 1");
    }
    try {
      saver.wait();
      FAIL("wait did not rethrow the second error");
    } catch (const std::runtime_error& e) {
      REQUIRE(std::string(e.what()) == "callback of step 3");
    }
    saver.wait();  // both errors observed: nothing left to rethrow
    REQUIRE(pool.storage == reference.storage);
    std::sort(completed.begin(), completed.end());
    REQUIRE(completed == std::vector<int>{0, 2, 4});

    // The saver keeps working after errors.
    const std::vector<RowTarget> targets = random_targets(10, pool, 2, rng);
    const std::vector<std::byte> source = random_bytes(10 * 16, rng);
    reference.scatter(source, targets);
    saver.wait(saver.save(source.data(), source.size(), targets, nullptr));
    REQUIRE(pool.storage == reference.storage);
  }
}
