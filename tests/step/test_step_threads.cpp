// The host step split across threads (step/host_step.hpp): for
// every built-in policy, evicting ones included, random shapes, dtypes,
// budgets and batches, managers driven by identical calls through
//   - decode() on this thread (the reference),
//   - the phases on this thread with a random nth per phase and the slices
//     in random order,
//   - decode() with an engine's parallel_for on 2 and on 4 real threads,
//   - the phases from 4 real threads with (ith, nth), as llama.cpp drives an
//     operator,
// must give bit-identical outputs, selections, hits / misses, page tables
// and CPU pages after every step. Run under ThreadSanitizer too (ctest
// step-threads-tsan).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "bucketed_lru_test_data.hpp"
#include "step_scenarios.hpp"
#include "sparsekv/core/numeric.hpp"
#include "sparsekv/facade/manager_inspection.hpp"
#include "sparsekv/sparsekv.hpp"
#include "test_support.hpp"
#include "thread_pool.hpp"

using namespace sparsekv;

namespace {

enum class Drive { serial, phases_shuffled, executor_2, executor_4, engine_threads_4 };
constexpr Drive kDrives[] = {Drive::serial, Drive::phases_shuffled, Drive::executor_2, Drive::executor_4,
                             Drive::engine_threads_4};

using test::random_rows;
using Scenario = test::StepScenario;

// One decode of `m` by `drive` (pools as the engine lends them).
void decode(RuntimeManager& m, Drive drive, std::span<const RequestId> batch, std::uint32_t layer, const void* q,
            const void* k, const void* v, float* out, std::mt19937& rng, tools::ThreadPool& two,
            tools::ThreadPool& four) {
  switch (drive) {
    case Drive::serial:
      m.decode(batch, layer, q, k, v, out);
      return;
    case Drive::executor_2:
      m.decode(batch, layer, q, k, v, out, two.executor());
      return;
    case Drive::executor_4:
      m.decode(batch, layer, q, k, v, out, four.executor());
      return;
    case Drive::phases_shuffled: {
      DecodePhases<AnyPolicy> step = m.begin_decode(batch, layer, q, k, v, out);
      const auto shuffled = [&](auto&& slice) {
        const std::size_t nth = 1 + rng() % 8;
        std::vector<std::size_t> order(nth);
        std::iota(order.begin(), order.end(), std::size_t{0});
        std::shuffle(order.begin(), order.end(), rng);
        for (const std::size_t ith : order) slice(ith, nth);
      };
      shuffled([&](std::size_t ith, std::size_t nth) { step.select(ith, nth); });
      step.commit();
      shuffled([&](std::size_t ith, std::size_t nth) { step.attend(ith, nth); });
      step.finish();
      return;
    }
    case Drive::engine_threads_4: {
      DecodePhases<AnyPolicy> step = m.begin_decode(batch, layer, q, k, v, out);
      four.parallel_for(4, [&](std::size_t ith) { step.select(ith, 4); });
      step.commit();
      four.parallel_for(4, [&](std::size_t ith) { step.attend(ith, 4); });
      step.finish();
      return;
    }
  }
}

void require_same_retrieval(const Retrieval& a, const Retrieval& b) {
  REQUIRE(a.head_offsets == b.head_offsets);
  REQUIRE(a.partitions == b.partitions);
  REQUIRE(a.token_counts == b.token_counts);
  REQUIRE(a.pages.gpu_pages == b.pages.gpu_pages);
  REQUIRE(a.pages.partition_offsets == b.pages.partition_offsets);
  REQUIRE(a.pages.copies.size() == b.pages.copies.size());
  for (std::size_t i = 0; i < a.pages.copies.size(); ++i) {
    REQUIRE(a.pages.copies[i].cpu_page == b.pages.copies[i].cpu_page);
    REQUIRE(a.pages.copies[i].gpu_page == b.pages.copies[i].gpu_page);
  }
  REQUIRE(a.tail_pages == b.tail_pages);
  REQUIRE(a.tail_tokens == b.tail_tokens);
  REQUIRE(a.page_masks == b.page_masks);
  REQUIRE(a.slot_positions == b.slot_positions);
  REQUIRE(a.stats.hit_partitions == b.stats.hit_partitions);
  REQUIRE(a.stats.miss_partitions == b.stats.miss_partitions);
  REQUIRE(a.stats.miss_pages == b.stats.miss_pages);
  REQUIRE(a.stats.evicted_pages == b.stats.evicted_pages);
}

// Every table entry of every live request: GPU page slots, meta entries, CPU pages, slot masks.
void require_same_tables(const RuntimeManager& a, const RuntimeManager& b, std::span<const RequestId> live,
                         const ModelShape& shape) {
  const HierarchicalPageTable& x = inspect_buffer(a).tiers().table;
  const HierarchicalPageTable& y = inspect_buffer(b).tiers().table;
  std::vector<PageId> xp, yp;
  for (const RequestId id : live) {
    for (std::uint32_t l = 0; l < shape.layers; ++l) {
      REQUIRE(inspect_buffer(a).admission().sequence_length(id, l) ==
              inspect_buffer(b).admission().sequence_length(id, l));
      for (std::uint32_t h = 0; h < shape.kv_heads; ++h) {
        REQUIRE(x.partition_count(id, l, h) == y.partition_count(id, l, h));
        test::require_same_head(x, y, test::Head{id, l, h});
        xp.clear();
        yp.clear();
        x.all_cpu_pages(id, l, h, xp);
        y.all_cpu_pages(id, l, h, yp);
        REQUIRE(xp == yp);
        if (x.has_slot_masks()) {
          for (std::uint32_t i = 0; i < xp.size(); ++i) REQUIRE(x.slot_mask(id, l, h, i) == y.slot_mask(id, l, h, i));
        }
      }
    }
  }
}

// Runs one scenario through every drive; returns the decodes made.
std::uint64_t run(const Scenario& s, const std::string& policy, std::uint32_t budget, std::uint32_t seed) {
  std::vector<std::unique_ptr<RuntimeManager>> managers;
  for (std::size_t d = 0; d < std::size(kDrives); ++d) {
    managers.push_back(std::make_unique<RuntimeManager>(s.shape, s.config, make_policy(policy, budget)));
  }
  tools::ThreadPool two(2), four(4);
  std::mt19937 rng(seed);
  std::mt19937 shuffle_rng(seed + 7);
  const ModelShape& shape = s.shape;
  const std::size_t kv_row = std::size_t{shape.kv_heads} * shape.head_dim;
  const std::size_t q_row = std::size_t{shape.q_heads} * shape.head_dim;
  std::vector<RequestId> live;
  std::map<RequestId, std::uint32_t> max_tokens;
  for (std::uint32_t r = 0; r < s.requests; ++r) {
    const RequestId id = 10 + r;
    const std::uint32_t prompt = 1 + rng() % 600;
    max_tokens[id] = prompt + 1 + rng() % s.steps;
    for (auto& m : managers) m->add_request(id, max_tokens[id]);
    for (std::uint32_t l = 0; l < shape.layers; ++l) {
      const auto k = random_rows(rng, prompt * kv_row, shape.dtype), v = random_rows(rng, prompt * kv_row, shape.dtype);
      for (auto& m : managers) m->prefill(id, l, k.data(), v.data(), prompt);
    }
    live.push_back(id);
  }
  std::uint64_t decodes = 0;
  for (std::uint32_t step = 0; step < s.steps && !live.empty(); ++step) {
    // A random non-empty subset of the live requests, in random order.
    std::vector<RequestId> batch = live;
    std::shuffle(batch.begin(), batch.end(), rng);
    batch.resize(1 + rng() % batch.size());
    for (std::uint32_t l = 0; l < shape.layers; ++l) {
      const auto q = random_rows(rng, batch.size() * q_row, shape.dtype);
      const auto k = random_rows(rng, batch.size() * kv_row, shape.dtype);
      const auto v = random_rows(rng, batch.size() * kv_row, shape.dtype);
      std::vector<std::vector<float>> outs(managers.size(), std::vector<float>(batch.size() * q_row));
      for (std::size_t d = 0; d < managers.size(); ++d) {
        decode(*managers[d], kDrives[d], batch, l, q.data(), k.data(), v.data(), outs[d].data(), shuffle_rng, two,
               four);
      }
      for (std::size_t d = 1; d < managers.size(); ++d) {
        CAPTURE(step, l, d, batch.size());
        REQUIRE(std::memcmp(outs[d].data(), outs[0].data(), outs[0].size() * sizeof(float)) == 0);
        for (std::size_t b = 0; b < batch.size(); ++b) {
          require_same_retrieval(managers[d]->retrieval(b), managers[0]->retrieval(b));
        }
        const StepStats& got = managers[d]->stats();
        const StepStats& want = managers[0]->stats();
        REQUIRE(got.cache.hit_partitions == want.cache.hit_partitions);
        REQUIRE(got.cache.miss_pages == want.cache.miss_pages);
        REQUIRE(got.pages_saved == want.pages_saved);
        REQUIRE(got.decode_steps == want.decode_steps);
      }
      ++decodes;
    }
    for (std::size_t d = 1; d < managers.size(); ++d) require_same_tables(*managers[d], *managers[0], live, shape);
    // Requests at their max_tokens finish on every manager.
    for (auto it = live.begin(); it != live.end();) {
      if (inspect_buffer(*managers[0]).admission().sequence_length(*it, 0) < max_tokens.at(*it)) {
        ++it;
        continue;
      }
      for (auto& m : managers) m->finish(*it);
      it = live.erase(it);
    }
  }
  return decodes;
}

}  // namespace

TEST_CASE("host step: the phases on any threads, in any order, equal the serial decode() bit for bit", "[threads]") {
  CHECK(test::for_each_policy_scenario(5, run) > 100);
}

TEST_CASE("host step: a phase with a slice that never ran is refused", "[threads]") {
  const ModelShape shape{1, 4, 2, 16, DType::bf16};
  Config config;
  config.page_tokens = 8;
  config.max_requests = 4;
  config.max_context_tokens = 2048;
  const std::size_t page = config.page_bytes(shape);
  config.cpu_tier_bytes = config.gpu_tier_bytes = std::size_t{4} * shape.kv_heads * 600 * page;
  config.host_chunk_bytes = 64 * page;
  RuntimeManager m(shape, config, make_policy("dense", 0));
  std::mt19937 rng(5);
  const std::size_t kv_row = std::size_t{shape.kv_heads} * shape.head_dim;
  const std::size_t q_row = std::size_t{shape.q_heads} * shape.head_dim;
  const std::vector<RequestId> batch{1, 2};
  for (const RequestId id : batch) {
    m.add_request(id, 1024);
    const auto k = random_rows(rng, 600 * kv_row, shape.dtype), v = random_rows(rng, 600 * kv_row, shape.dtype);
    m.prefill(id, 0, k.data(), v.data(), 600);
  }
  const auto q = random_rows(rng, batch.size() * q_row, shape.dtype);
  const auto k = random_rows(rng, batch.size() * kv_row, shape.dtype);
  const auto v = random_rows(rng, batch.size() * kv_row, shape.dtype);
  std::vector<float> out(batch.size() * q_row, -1.0f);

  // Select: 4 units (2 requests x 2 kv heads), ith 1 of 2 never runs.
  DecodePhases<AnyPolicy> step = m.begin_decode(batch, 0, q.data(), k.data(), v.data(), out.data());
  REQUIRE(step.select_units() == 4);
  step.select(0, 2);
  REQUIRE_SPARSEKV_ERROR(step.commit(), ErrorCode::failed_precondition);
  REQUIRE(inspect_buffer(m).admission().sequence_length(1, 0) == 600);  // nothing changed
  REQUIRE(step.attend_units() == 0);                                    // the step is over

  // Attend: 601 tokens a row are 3 chunks (32 pages of 8 tokens each), 12 in
  // all (2 requests x 2 kv heads); ith 2 of 3 never runs.
  DecodePhases<AnyPolicy> again = m.begin_decode(batch, 0, q.data(), k.data(), v.data(), out.data());
  for (std::size_t ith = 0; ith < 3; ++ith) again.select(ith, 3);
  again.commit();
  REQUIRE(inspect_buffer(m).admission().sequence_length(1, 0) == 601);
  REQUIRE(again.attend_units() == 12);
  again.attend(0, 3);
  again.attend(1, 3);
  REQUIRE_SPARSEKV_ERROR(again.finish(), ErrorCode::failed_precondition);
  REQUIRE(std::all_of(out.begin(), out.end(), [](float x) { return x == -1.0f; }));  // not written

  // The next step runs whole.
  m.decode(batch, 0, q.data(), k.data(), v.data(), out.data());
  REQUIRE(inspect_buffer(m).admission().sequence_length(1, 0) == 602);
  REQUIRE(std::none_of(out.begin(), out.end(), [](float x) { return x == -1.0f; }));
}

namespace {

// Dense that counts the pages append() saw and never regroups (kRegroups).
struct CountingDense {
  struct Options {};
  struct LayerState {
    DensePolicy::LayerState dense;
    std::uint32_t appends = 0;
  };
  static constexpr std::string_view kName = "counting_dense";
  static constexpr RopeStage kRope = RopeStage::post_rope;
  static constexpr bool kRegroups = false;
  std::vector<PartitionSpec> index(const LayerContext& c, const KvView& kv, LayerState& s) const {
    return dense.index(c, kv, s.dense);
  }
  std::optional<Repartition> append(const LayerContext& c, const AppendedPage& page, LayerState& s) const {
    ++s.appends;
    return dense.append(c, page, s.dense);
  }
  void select(const LayerContext& c, const DecodeQuery& q, const LayerState& s, Selection& out) const {
    dense.select(c, q, s.dense, out);
  }
  std::uint32_t mandatory_pages(const LayerContext& c) const { return dense.mandatory_pages(c); }
  DensePolicy dense;
};

}  // namespace

TEST_CASE("host step: a policy that never regroups sees each saved page once, at commit; a refused step none",
          "[threads]") {
  const ModelShape shape{1, 2, 1, 16, DType::f32};
  Config config;
  config.page_tokens = 4;
  config.max_requests = 2;
  config.max_context_tokens = 64;
  config.min_buffer_ratio = 1.0;
  const std::size_t page = config.page_bytes(shape);
  config.cpu_tier_bytes = 5 * page;  // two prompts of two pages, and one decode page
  config.gpu_tier_bytes = 80 * page;
  config.host_chunk_bytes = page;
  Manager<CountingDense> m(shape, config, CountingDense{});
  std::mt19937 rng(9);
  for (const RequestId id : {1, 2}) {
    m.add_request(id, 64);
    const auto prompt = random_rows(rng, 8 * 16, DType::f32);
    m.prefill(id, 0, prompt.data(), prompt.data(), 8);
  }
  const std::vector<RequestId> one{1};
  std::vector<float> out(32);
  const auto decode = [&] {
    const auto q = random_rows(rng, 32, DType::f32), k = random_rows(rng, 16, DType::f32);
    m.decode(one, 0, q.data(), k.data(), k.data(), out.data());
  };
  for (int t = 0; t < 4; ++t) decode();  // the fourth token fills the tail: its page is saved
  REQUIRE(m.stats().pages_saved == 1);
  for (int t = 0; t < 3; ++t) decode();
  REQUIRE(m.retrieval(0).partitions.size() == 3);  // Dense selects every partition it was shown
  // The next fill needs another CPU page: refused, and the policy is not shown the page.
  REQUIRE_SPARSEKV_ERROR(decode(), ErrorCode::resource_exhausted);
  REQUIRE(inspect_buffer(m).admission().sequence_length(1, 0) == 15);
  REQUIRE(m.stats().pages_saved == 1);
  m.finish(2);  // frees two CPU pages
  decode();     // the same fill, now committed: Select saw the state before it
  REQUIRE(m.stats().pages_saved == 2);
  REQUIRE(m.retrieval(0).partitions.size() == 3);
  decode();  // the page the retry saved, shown to the policy once
  REQUIRE(m.retrieval(0).partitions.size() == 4);
}
