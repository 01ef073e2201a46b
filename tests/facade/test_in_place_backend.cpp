// InPlaceBackend (facade/in_place_backend.hpp): a CPU
// engine's backend attends the CPU tier where it is. For every built-in
// policy, evicting ones included, over random shapes, dtypes, page sizes,
// budgets, batches and requests that arrive and finish, a Manager on it and
// one on HostBackend driven by identical calls must select the same
// partitions, attend the same token counts and write the same outputs (bit
// for bit: the same fold over the same bytes in the same order; the issue
// asks 1e-6), and keep the same K/V bytes in every partition and tail --
// while the in-place buffer holds no GPU page, copies nothing and keeps its
// own invariants.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "sparsekv/facade/manager_inspection.hpp"
#include "sparsekv/sparsekv.hpp"
#include "step_scenarios.hpp"

using namespace sparsekv;

namespace {

using test::random_rows;
using Scenario = test::StepScenario;

// What a retrieval attends, without where the pages are: the selections,
// their token counts, the tails' token counts and an evicting request's masks.
void require_same_selection(const Retrieval& in_place, const Retrieval& host) {
  REQUIRE(in_place.in_place);
  REQUIRE_FALSE(host.in_place);
  REQUIRE(in_place.head_offsets == host.head_offsets);
  REQUIRE(in_place.partitions == host.partitions);
  REQUIRE(in_place.token_counts == host.token_counts);
  REQUIRE(in_place.pages.partition_offsets == host.pages.partition_offsets);
  REQUIRE(in_place.pages.copies.empty());
  REQUIRE(in_place.tail_tokens == host.tail_tokens);
  REQUIRE(in_place.page_masks == host.page_masks);
  REQUIRE(in_place.slot_positions == host.slot_positions);
}

// The bytes of every partition's pages and of the tail, per (layer, kv head):
// the same K/V must be kept whatever page ids hold it.
void require_same_bytes(const RuntimeManager& in_place, const RuntimeManager& host, RequestId id,
                        const ModelShape& shape) {
  const TieredKVBuffer& x = inspect_buffer(in_place);
  const TieredKVBuffer& y = inspect_buffer(host);
  std::vector<PageId> xp, yp;
  for (std::uint32_t l = 0; l < shape.layers; ++l) {
    REQUIRE(x.admission().sequence_length(id, l) == y.admission().sequence_length(id, l));
    REQUIRE(x.tails().tail_tokens(id, l) == y.tails().tail_tokens(id, l));
    for (std::uint32_t h = 0; h < shape.kv_heads; ++h) {
      REQUIRE(x.tiers().table.partition_count(id, l, h) == y.tiers().table.partition_count(id, l, h));
      const PageLayout layout = x.tiers().cpu_pool.layout();
      // A slot's K and V rows, compared where a token is (a slot past the
      // partition's tokens, or evicted, holds whatever the page held before).
      const auto same_slot = [&](const std::byte* a, const std::byte* b, std::uint32_t t) {
        REQUIRE(std::memcmp(a + layout.k_offset(t), b + layout.k_offset(t), layout.row_bytes()) == 0);
        REQUIRE(std::memcmp(a + layout.v_offset(t), b + layout.v_offset(t), layout.row_bytes()) == 0);
      };
      std::uint32_t page_index = 0;  // of the head's pages, for its slot masks
      for (PartitionId p = 0; p < x.tiers().table.partition_count(id, l, h); ++p) {
        REQUIRE(x.tiers().table.partition_freed(id, l, h, p) == y.tiers().table.partition_freed(id, l, h, p));
        REQUIRE(x.tiers().table.meta(id, l, h, p).token_count() == y.tiers().table.meta(id, l, h, p).token_count());
        xp.clear();
        yp.clear();
        if (x.tiers().table.partition_freed(id, l, h, p)) {
          ++page_index;
          continue;
        }
        x.tiers().table.cpu_pages(id, l, h, p, xp);
        y.tiers().table.cpu_pages(id, l, h, p, yp);
        REQUIRE(xp.size() == yp.size());
        std::uint32_t left = x.tiers().table.meta(id, l, h, p).token_count();
        for (std::size_t i = 0; i < xp.size(); ++i, ++page_index) {
          SlotMask live = ~SlotMask{0};
          if (x.tiers().table.has_slot_masks()) {
            live = x.tiers().table.slot_mask(id, l, h, page_index);
            REQUIRE(live == y.tiers().table.slot_mask(id, l, h, page_index));
            left = layout.page_tokens;
          }
          const std::uint32_t tokens = std::min(left, layout.page_tokens);
          for (std::uint32_t t = 0; t < tokens; ++t) {
            if (slot_live(live, t)) same_slot(x.tiers().cpu_pool.data(xp[i]), y.tiers().cpu_pool.data(yp[i]), t);
          }
          left -= tokens;
        }
      }
      const std::uint32_t tail = x.tails().tail_tokens(id, l);
      if (tail == 0) continue;
      // The tail's rows: in a CPU page here, in a GPU-tier page there.
      const std::byte* a = x.tiers().cpu_pool.data(x.tails().tail_page(id, l, h));
      const std::byte* b = y.tiers().gpu_pool.data(y.tails().tail_page(id, l, h));
      const std::size_t rows = tail * layout.row_bytes();
      REQUIRE(std::memcmp(a + layout.k_offset(0), b + layout.k_offset(0), rows) == 0);
      REQUIRE(std::memcmp(a + layout.v_offset(0), b + layout.v_offset(0), rows) == 0);
    }
  }
}

// Runs one scenario on both backends; returns the decodes compared.
std::uint64_t run(const Scenario& s, const std::string& policy, std::uint32_t budget, std::uint32_t seed) {
  RuntimeManager in_place(s.shape, s.config, make_policy(policy, budget), std::make_unique<InPlaceBackend>());
  RuntimeManager host(s.shape, s.config, make_policy(policy, budget), std::make_unique<HostBackend>());
  std::mt19937 rng(seed);
  const ModelShape& shape = s.shape;
  const std::size_t kv_row = std::size_t{shape.kv_heads} * shape.head_dim;
  const std::size_t q_row = std::size_t{shape.q_heads} * shape.head_dim;
  std::vector<RequestId> live;
  std::map<RequestId, std::uint32_t> max_tokens;
  RequestId next_id = 10;
  const auto arrive = [&] {
    const RequestId id = next_id++;
    const std::uint32_t prompt = 1 + rng() % 600;
    max_tokens[id] = prompt + 1 + rng() % s.steps;
    REQUIRE(in_place.can_admit(prompt, max_tokens[id]).admit == host.can_admit(prompt, max_tokens[id]).admit);
    in_place.add_request(id, max_tokens[id]);
    host.add_request(id, max_tokens[id]);
    for (std::uint32_t l = 0; l < shape.layers; ++l) {
      const auto k = random_rows(rng, prompt * kv_row, shape.dtype), v = random_rows(rng, prompt * kv_row, shape.dtype);
      in_place.prefill(id, l, k.data(), v.data(), prompt);
      host.prefill(id, l, k.data(), v.data(), prompt);
    }
    live.push_back(id);
  };
  for (std::uint32_t r = 0; r < s.requests; ++r) arrive();
  std::uint64_t decodes = 0;
  for (std::uint32_t step = 0; step < s.steps && !live.empty(); ++step) {
    std::vector<RequestId> batch = live;
    std::shuffle(batch.begin(), batch.end(), rng);
    batch.resize(1 + rng() % batch.size());
    for (std::uint32_t l = 0; l < shape.layers; ++l) {
      const auto q = random_rows(rng, batch.size() * q_row, shape.dtype);
      const auto k = random_rows(rng, batch.size() * kv_row, shape.dtype);
      const auto v = random_rows(rng, batch.size() * kv_row, shape.dtype);
      std::vector<float> a(batch.size() * q_row), b(batch.size() * q_row);
      in_place.decode(batch, l, q.data(), k.data(), v.data(), a.data());
      host.decode(batch, l, q.data(), k.data(), v.data(), b.data());
      CAPTURE(step, l, batch.size());
      for (std::size_t i = 0; i < a.size(); ++i) REQUIRE(a[i] == b[i]);
      for (std::size_t e = 0; e < batch.size(); ++e) require_same_selection(in_place.retrieval(e), host.retrieval(e));
      ++decodes;
    }
    for (const RequestId id : live) require_same_bytes(in_place, host, id, shape);
    inspect_buffer(in_place).validate();
    REQUIRE(inspect_buffer(in_place).tiers().gpu_pool.used() == 0);
    REQUIRE(inspect_buffer(in_place).tiers().gpu_pool.reserved_bytes() == 0);
    REQUIRE(in_place.stats().bytes_moved == 0);
    // Requests at their max_tokens finish; now and then a new one arrives.
    for (auto it = live.begin(); it != live.end();) {
      if (inspect_buffer(host).admission().sequence_length(*it, 0) < max_tokens.at(*it)) {
        ++it;
        continue;
      }
      in_place.finish(*it);
      host.finish(*it);
      it = live.erase(it);
    }
    if (rng() % 6 == 0 && live.size() < s.config.max_requests) arrive();  // arrivals mid-run
  }
  for (const RequestId id : live) {
    in_place.finish(id);
    host.finish(id);
  }
  REQUIRE(inspect_buffer(in_place).tiers().cpu_pool.used() == 0);  // the tails went back too
  return decodes;
}

// The small shape the hand-written cases below use: 8-token pages.
constexpr ModelShape kSmallShape{2, 4, 2, 16, DType::f32};
Config small_config(std::uint32_t max_context_tokens, std::uint32_t max_requests) {
  Config config;
  config.page_tokens = 8;
  config.max_context_tokens = max_context_tokens;
  config.max_requests = max_requests;
  return config;
}

}  // namespace

TEST_CASE("in place: every policy selects, keeps and attends as HostBackend, with no GPU tier", "[in-place]") {
  CHECK(test::for_each_policy_scenario(6, run) > 100);
}

TEST_CASE("in place: the tails are CPU pages, counted by can_admit and refused when the tier is full", "[in-place]") {
  const ModelShape shape = kSmallShape;
  Config config = small_config(256, 4);
  const std::size_t page = config.page_bytes(shape);
  config.host_chunk_bytes = 16 * page;
  // Room for one 64-token prompt (8 pages per (layer, kv head): 32) and the
  // four tails, not for a second request's tails.
  config.cpu_tier_bytes = 38 * page;
  RuntimeManager m(shape, config, make_policy("quest", 32), std::make_unique<InPlaceBackend>());
  const AdmissionAdvice first = m.can_admit(64, 128);
  REQUIRE(first.admit);
  CHECK(first.gpu_pages_needed == 0);
  CHECK(first.cpu_pages_needed == 32 + 4);
  m.add_request(1, 128);
  CHECK(inspect_buffer(m).tiers().cpu_pool.used() == 4);  // the tails, before any prompt
  std::vector<float> kv(64 * 2 * 16, 0.5f);
  for (std::uint32_t l = 0; l < 2; ++l) m.prefill(1, l, kv.data(), kv.data(), 64);
  CHECK(inspect_buffer(m).tiers().cpu_pool.used() == 36);
  const AdmissionAdvice second = m.can_admit(1, 128);
  CHECK_FALSE(second.admit);
  CHECK(second.reason.find("CPU pages") != std::string::npos);
  REQUIRE_THROWS_AS(m.add_request(2, 128), Error);
  CHECK(inspect_buffer(m).tiers().cpu_pool.used() == 36);  // the refusal changed nothing
  inspect_buffer(m).validate();

  m.finish(1);
  CHECK(inspect_buffer(m).tiers().cpu_pool.used() == 0);
}

TEST_CASE("in place: a buffer refuses GPU slots and device memory", "[in-place]") {
  const ModelShape shape{1, 2, 1, 16, DType::f32};
  Config config;
  config.page_tokens = 8;
  config.max_context_tokens = 64;
  config.max_requests = 2;
  HostMemoryResource memory(false);
  HostPageTransfer transfer;
  TieredKVBuffer buffer(shape, config, memory, memory, memory, transfer, config.head_capacity(), AttendSite::cpu_tier);
  RequestPages with_slots;
  with_slots.mandatory_pages = 2;
  with_slots.buffer_pages = 4;
  REQUIRE_THROWS_AS(buffer.admission().add_request(1, with_slots), Error);
  CHECK_FALSE(buffer.admission().has_request(1));
  buffer.admission().add_request(1, RequestPages{2, 0, false});
  CHECK(buffer.admission().slots_per_head(1) == 0);
  // No GPU pages to grow into: refused, nothing changed.
  try {
    buffer.admission().resize(1, 4);
    FAIL("resize in place was not refused");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::failed_precondition);
  }
  CHECK(buffer.admission().slots_per_head(1) == 0);
  CHECK(buffer.tiers().gpu_pool.used() == 0);
  buffer.validate();
}

TEST_CASE("in place: the unsaved decode page reads back with the rest, on the GPU tier it does not", "[in-place]") {
  // 10 prompt tokens in 8-token pages, then 3 decode tokens: the tail page
  // holds positions 10..12. In place it is a CPU-tier page, so read_kv reads
  // all 13; HostBackend keeps it on its GPU tier and reads the prompt's 10.
  const ModelShape shape = kSmallShape;
  Config config = small_config(64, 2);
  const std::size_t row = std::size_t{shape.kv_heads} * shape.head_dim;
  std::vector<float> k(13 * row), v(13 * row), q(shape.q_heads * shape.head_dim, 0.25f), out(q.size());
  for (std::size_t i = 0; i < k.size(); ++i) {
    k[i] = float(i % 31) - 15.0f;
    v[i] = float(i % 29) * 0.5f;
  }
  for (const bool in_place : {true, false}) {
    CAPTURE(in_place);
    RuntimeManager m(shape, config, make_policy("quest", 16),
                     in_place ? std::unique_ptr<Backend>(std::make_unique<InPlaceBackend>())
                              : std::unique_ptr<Backend>(std::make_unique<HostBackend>()));
    m.add_request(1, 64);
    for (std::uint32_t l = 0; l < shape.layers; ++l) m.prefill(1, l, k.data(), v.data(), 10);
    const RequestId one[] = {1};
    for (std::uint32_t t = 10; t < 13; ++t) {
      for (std::uint32_t l = 0; l < shape.layers; ++l) {
        m.decode(one, l, q.data(), k.data() + t * row, v.data() + t * row, out.data());
      }
    }
    for (std::uint32_t l = 0; l < shape.layers; ++l) {
      const std::uint32_t readable = m.readable_tokens(1, l);
      CHECK(readable == (in_place ? 13u : inspect_buffer(m).forks().saved_tokens(1, l)));
      std::vector<float> rk(readable * row), rv(readable * row);
      m.read_kv(1, l, 0, readable, rk.data(), rv.data());
      CHECK(std::equal(rk.begin(), rk.end(), k.begin()));
      CHECK(std::equal(rv.begin(), rv.end(), v.begin()));
      std::vector<float> past(14 * row);
      REQUIRE_THROWS_AS(m.read_kv(1, l, 0, readable + 1, past.data(), past.data()), Error);
    }
    inspect_buffer(m).validate();
  }
}

TEST_CASE("in place: a fork takes the unsaved decode page too, and decodes as a request prefilled with its tokens",
          "[in-place][shared-prefix]") {
  // 10 prompt tokens in 8-token pages, 19 decoded: positions 10..17 and
  // 18..25 lie in saved decode pages, 26..28 in the unsaved one. In place a
  // fork of any length copies them from the CPU tier; on HostBackend's GPU
  // tier the fork is refused past 26.
  const ModelShape shape = kSmallShape;
  Config config = small_config(64, 4);
  const std::size_t row = std::size_t{shape.kv_heads} * shape.head_dim;
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  std::vector<float> k(40 * row), v(k.size()), q(shape.q_heads * shape.head_dim);
  for (std::vector<float>* x : {&k, &v, &q}) std::generate(x->begin(), x->end(), [&] { return normal(rng); });
  const auto decode = [&](RuntimeManager& m, RequestId id, std::uint32_t from, std::uint32_t to) {
    std::vector<float> out(q.size());
    const RequestId one[] = {id};
    for (std::uint32_t t = from; t < to; ++t) {
      for (std::uint32_t l = 0; l < shape.layers; ++l) {
        m.decode(one, l, q.data(), k.data() + t * row, v.data() + t * row, out.data());
      }
    }
    return out;
  };
  for (const char* policy : {"dense", "quest"}) {
    for (const bool in_place : {true, false}) {
      CAPTURE(policy, in_place);
      RuntimeManager m(shape, config, make_policy(policy, 16),
                       in_place ? std::unique_ptr<Backend>(std::make_unique<InPlaceBackend>())
                                : std::unique_ptr<Backend>(std::make_unique<HostBackend>()));
      m.add_request(1, 64);
      for (std::uint32_t l = 0; l < shape.layers; ++l) m.prefill(1, l, k.data(), v.data(), 10);
      decode(m, 1, 10, 29);
      if (!in_place) {
        CHECK(inspect_buffer(m).forks().saved_tokens(1, 0) == 26);
        CHECK(m.can_fork(1, 26, 64).reason.empty());
        CHECK_FALSE(m.can_fork(1, 27, 64).reason.empty());
        REQUIRE_THROWS_AS(m.fork(2, 1, 27, 64), Error);
        CHECK_FALSE(m.has_request(2));
        inspect_buffer(m).validate();
        continue;
      }
      for (const std::uint32_t keep : {5u, 8u, 9u, 11u, 16u, 20u, 26u, 27u, 29u}) {
        CAPTURE(keep);
        const RequestId fork = 10 + keep, fresh = 40 + keep;
        CHECK(m.can_fork(1, keep, 64).reason.empty());
        m.fork(fork, 1, keep, 64);
        m.add_request(fresh, 64);
        for (std::uint32_t l = 0; l < shape.layers; ++l) m.prefill(fresh, l, k.data(), v.data(), keep);
        for (std::uint32_t l = 0; l < shape.layers; ++l) {
          std::vector<float> rk(keep * row), rv(keep * row);
          m.read_kv(fork, l, 0, keep, rk.data(), rv.data());
          CHECK(std::equal(rk.begin(), rk.end(), k.begin()));
          CHECK(std::equal(rv.begin(), rv.end(), v.begin()));
        }
        const std::vector<float> a = decode(m, fork, keep, 35), b = decode(m, fresh, keep, 35);
        for (std::size_t i = 0; i < a.size(); ++i) CHECK(a[i] == Approx(b[i]).margin(1e-5));
        m.finish(fork);
        m.finish(fresh);
      }
      // The source decodes on, unchanged by its forks.
      decode(m, 1, 29, 33);
      CHECK(m.readable_tokens(1, 0) == 33);
      inspect_buffer(m).validate();
    }
  }
}
