// Regressions of the facade's correctness, one or more per bug; each
// failed on the tree before its fix.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "sparsekv/core/numeric.hpp"
#include "sparsekv/facade/manager_inspection.hpp"
#include "sparsekv/policy/quest.hpp"
#include "sparsekv/policy/retroinfer.hpp"
#include "sparsekv/sparsekv.hpp"
#include "test_support.hpp"

using namespace sparsekv;

namespace {

// Selects the first `keep` partitions of every head and never the newest: a
// custom policy relying on the facade for the decode token (keep 0 selects
// nothing at all). It claims `mandatory` pages per head for admission.
struct OldestFirstPolicy {
  struct Options {};
  struct LayerState {
    std::uint32_t partitions = 0;
  };
  static constexpr std::string_view kName = "oldest_first";
  static constexpr RopeStage kRope = RopeStage::post_rope;

  std::uint32_t keep = 1;
  std::uint32_t mandatory = 1;

  std::vector<PartitionSpec> index(const LayerContext& ctx, const KvView& kv, LayerState& state) const {
    const PartitionSpec spec = PartitionSpec::uniform(kv.tokens, ctx.page_tokens);
    state.partitions = spec.partition_count();
    return {spec};
  }
  std::optional<Repartition> append(const LayerContext&, const AppendedPage&, LayerState& state) const {
    ++state.partitions;
    return std::nullopt;
  }
  void select(const LayerContext& ctx, const DecodeQuery&, const LayerState& state, Selection& out) const {
    out.reset(ctx.kv_heads);
    for (auto& ids : out.partitions) {
      for (PartitionId p = 0; p < std::min(keep, state.partitions); ++p) ids.push_back(p);
    }
  }
  std::uint32_t mandatory_pages(const LayerContext&) const { return mandatory; }
};

// OldestFirstPolicy that notes the reserve_tokens each Index is given.
struct ReserveNotingPolicy : OldestFirstPolicy {
  std::shared_ptr<std::vector<std::uint32_t>> seen = std::make_shared<std::vector<std::uint32_t>>();
  std::vector<PartitionSpec> index(const LayerContext& ctx, const KvView& kv, LayerState& state) const {
    seen->push_back(ctx.reserve_tokens);
    return OldestFirstPolicy::index(ctx, kv, state);
  }
};

// Tiers for two requests of up to `request_tokens` tokens, with room for
// RetroInfer's mandatory pages (up to one page per token); max_context_tokens
// sizes the per-head GPU slot maximum to match.
Config small_config(const ModelShape& shape, std::uint32_t page_tokens, std::uint32_t request_tokens) {
  Config c;
  c.page_tokens = page_tokens;
  c.max_requests = 2;
  c.max_context_tokens = std::max(request_tokens, 2048u);
  c.min_buffer_ratio = 1.0;
  const std::size_t page = c.page_bytes(shape);
  const std::size_t heads = std::size_t{2} * shape.layers * shape.kv_heads;
  c.cpu_tier_bytes = heads * (2 * std::size_t{request_tokens} + 8) * page;
  c.gpu_tier_bytes = heads * (3 * std::size_t{request_tokens} + 8) * page;
  c.host_chunk_bytes = 64 * page;
  return c;
}

std::vector<float> normal_values(std::mt19937& rng, std::size_t n, float mean = 0.0f) {
  std::normal_distribution<float> normal(mean, 1.0f);
  std::vector<float> out(n);
  for (float& x : out) x = normal(rng);
  return out;
}

// The message of the invalid_argument sparsekv::Error that `call` must throw.
std::string error_text(const std::function<void()>& call) {
  try {
    call();
  } catch (const Error& e) {
    REQUIRE(e.code() == ErrorCode::invalid_argument);
    return e.what();
  }
  FAIL("no sparsekv::Error thrown");
  return {};
}

}  // namespace

TEST_CASE("Facade: the token being decoded always takes part in attention, whatever the policy and budget",
          "[facade]") {
  // Head dims 0-7 carry small random keys; decode step s gives its own token
  // a key of 150 along dim 8 + s and its query a 1 there, so the token being
  // decoded outweighs every other by e^20 or more: the output is its value
  // exactly when it is attended, and far from it otherwise.
  constexpr ModelShape shape{3, 4, 2, 40, DType::f32};
  constexpr std::uint32_t d = shape.head_dim, row = shape.kv_heads * d, prompt = 16, steps = 24;
  std::vector<std::pair<std::string, std::function<AnyPolicy()>>> policies;
  for (const std::string& name : policy_names()) {
    for (std::uint32_t budget : {1u, 3u, 8u, 12u, 15u}) {
      policies.emplace_back(name + " budget " + std::to_string(budget),
                            [name, budget] { return make_policy(name, budget); });
    }
  }
  policies.emplace_back("custom: the oldest page only", [] { return AnyPolicy(OldestFirstPolicy{1, 1}); });
  policies.emplace_back("custom: nothing selected", [] { return AnyPolicy(OldestFirstPolicy{0, 1}); });
  for (const auto& [name, make] : policies) {
    INFO(name);
    RuntimeManager manager(shape, small_config(shape, 8, 64), make());
    std::mt19937 rng(12);
    const auto small_keys = [&](std::uint32_t tokens) {
      std::vector<float> k(std::size_t{tokens} * row, 0.0f);
      std::normal_distribution<float> normal;
      for (std::uint32_t t = 0; t < tokens * shape.kv_heads; ++t) {
        for (std::uint32_t i = 0; i < 8; ++i) k[std::size_t{t} * d + i] = normal(rng);
      }
      return k;
    };
    manager.add_request(1, 64);
    for (std::uint32_t l = 0; l < shape.layers; ++l) {
      const std::vector<float> k = small_keys(prompt), v = normal_values(rng, std::size_t{prompt} * row);
      manager.prefill(1, l, k.data(), v.data(), prompt);
    }
    const std::vector<RequestId> batch{1};
    for (std::uint32_t s = 0; s < steps; ++s) {
      for (std::uint32_t l = 0; l < shape.layers; ++l) {
        std::vector<float> k_new = small_keys(1), v_new = normal_values(rng, row, 3.0f);
        std::vector<float> q(std::size_t{shape.q_heads} * d, 0.0f);
        std::normal_distribution<float> normal;
        for (std::uint32_t h = 0; h < shape.q_heads; ++h) {
          for (std::uint32_t i = 0; i < 8; ++i) q[std::size_t{h} * d + i] = normal(rng);
          q[std::size_t{h} * d + 8 + s] = 1.0f;
        }
        for (std::uint32_t h = 0; h < shape.kv_heads; ++h) k_new[std::size_t{h} * d + 8 + s] = 150.0f;
        std::vector<float> out(q.size());
        manager.decode(batch, l, q.data(), k_new.data(), v_new.data(), out.data());
        INFO("decode step " << s + 1 << " (token " << prompt + s << "), layer " << l);
        for (std::uint32_t h = 0; h < shape.q_heads; ++h) {
          const float* want = v_new.data() + std::size_t{h / shape.group_size()} * d;
          for (std::uint32_t i = 0; i < d; ++i) REQUIRE(std::abs(out[std::size_t{h} * d + i] - want[i]) < 1e-3f);
        }
      }
    }
    inspect_buffer(manager).validate();
  }
}

TEST_CASE("Facade: streaming over one page attends the token it decodes", "[facade]") {
  constexpr ModelShape shape{1, 1, 1, 8, DType::f32};
  RuntimeManager manager(shape, small_config(shape, 8, 64), make_policy("streaming", 8));
  manager.add_request(1, 64);
  const std::vector<float> k(16 * 8, 0.0f), v(16 * 8, 0.0f);
  manager.prefill(1, 0, k.data(), v.data(), 16);
  const std::vector<RequestId> batch{1};
  const std::vector<float> q(8, 0.0f), k_new(8, 0.0f);
  std::vector<float> out(8);
  for (std::uint32_t step = 1; step <= 8; ++step) {
    const std::vector<float> v_new(8, static_cast<float>(step));  // token 15 + step
    manager.decode(batch, 0, q.data(), k_new.data(), v_new.data(), out.data());
  }
  // The 8th decode (token 23) fills the tail page. Equal scores: the output is
  // the mean value of the attended tokens, the sink page's zeros and tokens 16-23.
  const Retrieval& r = manager.retrieval(0);
  std::uint32_t attended = r.tail_tokens[0];
  for (std::uint32_t i = r.head_offsets[0]; i < r.head_offsets[1]; ++i) attended += r.token_counts[i];
  REQUIRE(r.tail_tokens[0] == 8);
  REQUIRE(attended == 16);
  REQUIRE(out[0] == Approx((1 + 2 + 3 + 4 + 5 + 6 + 7 + 8) / 16.0));
}

TEST_CASE("RetroInfer: the steady zone takes the newest window first, the sinks only if they fit",
          "[facade][retroinfer]") {
  RetroInferPolicy::Options o;
  o.sink_tokens = 4;
  o.window_tokens = 16;
  o.tokens_per_cluster = 8;
  const LayerContext ctx{0, 1, 1, 1, 8, 8, 64};
  std::mt19937 rng(5);
  const std::vector<float> k = normal_values(rng, 64 * 8), v = normal_values(rng, 64 * 8);
  const std::vector<float> q = normal_values(rng, 8);
  for (const auto& [budget, newest, sinks] :
       {std::tuple{10u, 1u, false}, std::tuple{12u, 1u, true}, std::tuple{16u, 2u, false}, std::tuple{20u, 2u, true}}) {
    INFO("budget " << budget);
    o.budget_tokens = budget;
    const RetroInferPolicy policy(o);
    RetroInferPolicy::LayerState state;
    policy.index(ctx, KvView{k, v, 64, 1, 8, 0}, state);
    Selection s;
    policy.select(ctx, DecodeQuery{q, 64}, state, s);
    const auto& head = state.heads[0];
    REQUIRE(head.recent.size() >= newest);
    std::vector<PartitionId> want;
    if (sinks) want.push_back(head.sink.id);
    for (std::size_t i = head.recent.size() - newest; i < head.recent.size(); ++i) want.push_back(head.recent[i].id);
    // The steady zone: the selection's sink and recent pages (the retrieval
    // zone may add clusters in what the budget leaves, never the sink, and
    // here no older page: a full one never fits what is left).
    std::vector<PartitionId> steady;
    for (const PartitionId id : s.partitions[0]) {
      const auto is_id = [&](const RetroInferPolicy::Group& g) { return g.id == id; };
      const bool recent = std::any_of(head.recent.begin(), head.recent.end(), is_id);
      if (id == head.sink.id || recent) steady.push_back(id);
    }
    REQUIRE(steady == want);
  }
}

TEST_CASE("Facade: a budget covering the context equals Dense, every policy and page size", "[facade]") {
  constexpr ModelShape shape{2, 4, 2, 16, DType::f32};
  constexpr std::uint32_t d = shape.head_dim, row = shape.kv_heads * d;
  const auto make = [](const std::string& name, std::uint32_t budget, std::uint32_t page_tokens) {
    if (name != "quest") return make_policy(name, budget);
    // Quest's partition must be a whole number of pages; no dense layers, so every layer is tested.
    return AnyPolicy(QuestPolicy({budget, std::max(16u, page_tokens), 0}));
  };
  for (std::uint32_t page_tokens : {1u, 2u, 4u, 8u, 16u, 32u}) {
    const Config config = small_config(shape, page_tokens, 128);
    for (const auto& [prompt, decodes] :
         std::vector<std::pair<std::uint32_t, std::uint32_t>>{{1, 1},
                                                              {12, 1},
                                                              {page_tokens, page_tokens},
                                                              {page_tokens + 3, page_tokens + 1},
                                                              {45, 2 * page_tokens + 1}}) {
      const std::uint32_t context = prompt + decodes;  // the budget, exactly
      for (const std::string& name : policy_names()) {
        INFO(name << ": page_tokens " << page_tokens << ", prompt " << prompt << ", " << decodes << " decodes");
        RuntimeManager sparse(shape, config, make(name, context, page_tokens));
        RuntimeManager dense(shape, config, make_policy("dense", context));
        std::mt19937 rng(page_tokens * 1000 + prompt);
        for (RuntimeManager* m : {&sparse, &dense}) m->add_request(1, context);
        for (std::uint32_t l = 0; l < shape.layers; ++l) {
          const std::vector<float> k = normal_values(rng, std::size_t{prompt} * row);
          const std::vector<float> v = normal_values(rng, std::size_t{prompt} * row);
          for (RuntimeManager* m : {&sparse, &dense}) m->prefill(1, l, k.data(), v.data(), prompt);
        }
        const std::vector<RequestId> batch{1};
        for (std::uint32_t s = 0; s < decodes; ++s) {
          for (std::uint32_t l = 0; l < shape.layers; ++l) {
            const std::vector<float> q = normal_values(rng, std::size_t{shape.q_heads} * d);
            const std::vector<float> k = normal_values(rng, row), v = normal_values(rng, row);
            std::vector<float> got(q.size()), want(q.size());
            sparse.decode(batch, l, q.data(), k.data(), v.data(), got.data());
            dense.decode(batch, l, q.data(), k.data(), v.data(), want.data());
            for (std::size_t i = 0; i < q.size(); ++i)
              REQUIRE(std::abs(got[i] - want[i]) <= 1e-5f * (1 + std::abs(want[i])));
          }
        }
      }
    }
  }
}

TEST_CASE("Facade: streaming with a budget over a partial prompt page equals Dense", "[facade]") {
  constexpr ModelShape shape{1, 2, 2, 16, DType::f32};
  const Config config = small_config(shape, 8, 64);
  RuntimeManager streaming(shape, config, make_policy("streaming", 15));
  RuntimeManager dense(shape, config, make_policy("dense", 15));
  std::mt19937 rng(15);
  const std::vector<float> k = normal_values(rng, 13 * 32), v = normal_values(rng, 13 * 32), q = normal_values(rng, 32);
  std::vector<float> got(32), want(32);
  for (const auto& [m, out] : {std::pair{&streaming, &got}, std::pair{&dense, &want}}) {
    m->add_request(1, 64);
    m->prefill(1, 0, k.data(), v.data(), 12);
    m->decode(std::vector<RequestId>{1}, 0, q.data(), k.data() + 12 * 32, v.data() + 12 * 32, out->data());
  }
  for (std::size_t i = 0; i < got.size(); ++i) REQUIRE(got[i] == Approx(want[i]).margin(1e-5));
}

TEST_CASE("Facade: can_admit agrees with add_request, huge max_tokens included", "[facade][errors]") {
  constexpr ModelShape shape{2, 4, 2, 16, DType::f32};
  Config config;
  config.page_tokens = 8;
  config.max_requests = 4;
  config.max_context_tokens = 4096;
  config.min_buffer_ratio = 5.0;  // a request's slots: 6 x its mandatory pages, at most 6144 per head
  const std::size_t page = config.page_bytes(shape);
  config.cpu_tier_bytes = std::size_t{4} * 600 * page;   // 2 x 2 heads: any prompt up to max_context_tokens fits
  config.gpu_tier_bytes = std::size_t{4} * 8000 * page;  // more than the per-head maximum allows
  config.host_chunk_bytes = 64 * page;

  // The bug's example: 4294967289 + 7 wrapped around in 32 bits.
  for (const std::string& name : {"dense", "streaming"}) {
    RuntimeManager m(shape, config, make_policy(name, 64));
    const AdmissionAdvice a = m.can_admit(16, 4294967289u);
    INFO(name << ": " << a.reason);
    REQUIRE_FALSE(a.admit);
    REQUIRE(a.reason.find("max_tokens") != std::string::npos);
    REQUIRE_SPARSEKV_ERROR(m.add_request(1, 4294967289u), ErrorCode::invalid_argument);
  }

  std::vector<std::pair<std::string, std::function<AnyPolicy()>>> policies;
  for (const std::string& name : {"dense", "streaming", "quest", "shadowkv", "retroinfer"}) {
    policies.emplace_back(name, [name] { return make_policy(name, 3000); });
  }
  // Three pages per page of context: past the per-head GPU slot maximum for long requests.
  policies.emplace_back("custom, large mandatory", [] { return AnyPolicy(OldestFirstPolicy{1, 0}); });
  std::mt19937 rng(6);
  std::uint32_t admitted = 0, refused = 0, beyond_slots = 0;
  for (int draw = 0; draw < 400; ++draw) {
    const auto& [name, make] = policies[draw % policies.size()];
    std::uint32_t max_tokens = 0;
    switch (rng() % 4) {
      case 0:
        max_tokens = 1 + rng() % 4096;
        break;
      case 1:
        max_tokens = 4096 - rng() % 1024;
        break;
      case 2:
        max_tokens = 4096 + 1 + rng() % 0x7fffffffu;
        break;
      default:
        max_tokens = 0xffffffffu - rng() % 64;
        break;
    }
    const std::uint32_t prompt = 1 + rng() % std::min(max_tokens, 4096u);
    AnyPolicy policy = make();
    if (name == "custom, large mandatory") {
      policy = AnyPolicy(OldestFirstPolicy{1, 3 * ((std::min(max_tokens, 8192u) + 7) / 8) + 1});
    }
    RuntimeManager fresh(shape, config, policy);
    const AdmissionAdvice advice = fresh.can_admit(prompt, max_tokens);
    bool added = true;
    std::string refusal;
    try {
      fresh.add_request(1, max_tokens);
    } catch (const Error& e) {
      added = false;
      refusal = e.what();
    }
    INFO(name << ": prompt " << prompt << ", max_tokens " << max_tokens << "; advice: " << advice.reason
              << "; add_request: " << refusal);
    REQUIRE(advice.admit == added);
    REQUIRE(advice.reason.empty() == advice.admit);
    (added ? admitted : refused) += 1;
    beyond_slots += refusal.find("exceed the maximum") != std::string::npos;
  }
  REQUIRE(admitted > 50);
  REQUIRE(refused > 50);
  REQUIRE(beyond_slots > 0);

  // A prompt longer than max_tokens could not be prefilled.
  RuntimeManager m(shape, config, make_policy("dense", 64));
  const AdmissionAdvice longer = m.can_admit(65, 64);
  REQUIRE_FALSE(longer.admit);
  REQUIRE_FALSE(longer.reason.empty());
}

TEST_CASE("Facade: StepStats::pages_saved counts pages, one per kv head, like BufferStats", "[facade]") {
  constexpr ModelShape shape{2, 8, 4, 16, DType::f32};
  RuntimeManager manager(shape, small_config(shape, 8, 64), make_policy("dense", 64));
  std::mt19937 rng(7);
  const std::vector<float> k = normal_values(rng, 8 * 64), v = normal_values(rng, 8 * 64);
  const std::vector<float> q = normal_values(rng, 8 * 16);
  std::vector<float> out(8 * 16);
  manager.add_request(1, 64);
  for (std::uint32_t l = 0; l < 2; ++l) manager.prefill(1, l, k.data(), v.data(), 1);
  for (std::uint32_t t = 1; t <= 8; ++t) {  // the 8th decode fills the tail page of each layer
    for (std::uint32_t l = 0; l < 2; ++l) {
      manager.decode(std::vector<RequestId>{1}, l, q.data(), k.data() + (t % 8) * 64, v.data() + (t % 8) * 64,
                     out.data());
    }
  }
  REQUIRE(inspect_buffer(manager).tiers().stats.pages_saved == 8);  // 2 layers x 4 kv heads
  REQUIRE(manager.stats().pages_saved == inspect_buffer(manager).tiers().stats.pages_saved);
}

TEST_CASE("Facade: non-finite K/V is refused, naming request, token and head, and changes nothing",
          "[facade][errors]") {
  for (DType dtype : {DType::f32, DType::f16, DType::bf16}) {
    INFO(to_string(dtype));
    const ModelShape shape{1, 4, 2, 8, dtype};
    constexpr std::uint32_t row = 2 * 8;
    const std::size_t elem = dtype_size(dtype);
    const Config config = small_config(shape, 8, 64);
    RuntimeManager manager(shape, config, make_policy("quest", 16));
    RuntimeManager twin(shape, config, make_policy("quest", 16));  // never sees the bad calls
    std::mt19937 rng(8);
    const auto encode = [&](const std::vector<float>& x) {
      std::vector<std::byte> out(x.size() * elem);
      for (std::size_t i = 0; i < x.size(); ++i) store_element(out.data(), static_cast<std::uint32_t>(i), dtype, x[i]);
      return out;
    };
    const std::vector<std::byte> k = encode(normal_values(rng, 15 * row)), v = encode(normal_values(rng, 15 * row));
    const auto poisoned = [&](const std::vector<std::byte>& x, std::size_t i, float value) {
      std::vector<std::byte> out = x;
      store_element(out.data(), static_cast<std::uint32_t>(i), dtype, value);
      return out;
    };
    const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
    for (RuntimeManager* m : {&manager, &twin}) {
      m->add_request(7, 64);
      m->add_request(9, 64);
    }

    // Prefill: token 5, kv head 1, dim 3 of k; token 6, kv head 0 of v.
    const auto bad_k = poisoned(k, 5 * row + 8 + 3, nan), bad_v = poisoned(v, 6 * row + 2, -inf);
    std::string what = error_text([&] { manager.prefill(7, 0, bad_k.data(), v.data(), 7); });
    CHECK(what.find("request 7") != std::string::npos);
    CHECK(what.find("token 5") != std::string::npos);
    CHECK(what.find("kv head 1") != std::string::npos);
    what = error_text([&] { manager.prefill(7, 0, k.data(), bad_v.data(), 7); });
    CHECK(what.find("token 6") != std::string::npos);
    CHECK(what.find("kv head 0") != std::string::npos);
    REQUIRE(inspect_buffer(manager).admission().sequence_length(7, 0) == 0);
    REQUIRE(inspect_buffer(manager).tiers().cpu_pool.used() == 0);
    const std::vector<std::byte> q = encode(normal_values(rng, 2 * 4 * 8));
    std::vector<float> out(2 * 4 * 8, -1.0f), want(out.size());
    for (RuntimeManager* m : {&manager, &twin}) {
      m->prefill(7, 0, k.data(), v.data(), 7);
      m->prefill(9, 0, k.data(), v.data(), 12);
      for (std::uint32_t t = 7; t < 14; ++t) {  // request 7's tail: one token short of a page
        m->decode(std::vector<RequestId>{7}, 0, q.data(), k.data() + t * row * elem, v.data() + t * row * elem,
                  want.data());
      }
    }
    const std::uint64_t steps = manager.stats().decode_steps;

    // Decode: the batch's second entry (request 9, position 12) carries a non-finite k_new / v_new.
    const std::vector<RequestId> batch{7, 9};
    std::vector<std::byte> k_new(2 * row * elem), v_new(2 * row * elem);
    std::memcpy(k_new.data(), k.data() + 14 * row * elem, row * elem);
    std::memcpy(k_new.data() + row * elem, k.data() + 12 * row * elem, row * elem);
    std::memcpy(v_new.data(), v.data() + 14 * row * elem, row * elem);
    std::memcpy(v_new.data() + row * elem, v.data() + 12 * row * elem, row * elem);
    const std::uint64_t used = inspect_buffer(manager).tiers().cpu_pool.used();
    for (const auto& [bad, value, is_k] : {std::tuple{poisoned(k_new, row + 9, inf), inf, true},
                                           std::tuple{poisoned(v_new, row + 1, nan), nan, false}}) {
      const void* kn = is_k ? bad.data() : k_new.data();
      const void* vn = is_k ? v_new.data() : bad.data();
      what = error_text([&] { manager.decode(batch, 0, q.data(), kn, vn, out.data()); });
      CHECK(what.find("request 9") != std::string::npos);
      CHECK(what.find("token 12") != std::string::npos);
      CHECK(what.find(is_k ? "kv head 1" : "kv head 0") != std::string::npos);
      what = error_text([&] { manager.plan(batch, 0, q.data(), kn, vn); });
      CHECK(what.find("request 9") != std::string::npos);
    }
    REQUIRE(inspect_buffer(manager).admission().sequence_length(7, 0) ==
            14);  // request 7's full tail page was not saved either
    REQUIRE(inspect_buffer(manager).tails().tail_tokens(7, 0) == 7);
    REQUIRE(inspect_buffer(manager).admission().sequence_length(9, 0) == 12);
    REQUIRE(inspect_buffer(manager).tiers().cpu_pool.used() == used);
    REQUIRE(manager.stats().decode_steps == steps);
    REQUIRE(manager.stats().pages_saved == 0);
    REQUIRE(std::all_of(out.begin(), out.end(), [](float x) { return x == -1.0f; }));
    inspect_buffer(manager).validate();

    // The refused calls left nothing behind: the same good step gives the twin's output bit for bit.
    manager.decode(batch, 0, q.data(), k_new.data(), v_new.data(), out.data());
    twin.decode(batch, 0, q.data(), k_new.data(), v_new.data(), want.data());
    REQUIRE(std::memcmp(out.data(), want.data(), out.size() * sizeof(float)) == 0);
    REQUIRE(std::all_of(out.begin(), out.end(), [](float x) { return std::isfinite(x); }));
  }
}

// ---- Found by an independent review of the fixes above ----------------------

namespace {

// A custom policy with two habits the facade must survive: index() adds to
// its state instead of replacing it, and a request prefilled with exactly
// `bogus_prompt` tokens selects a partition that does not exist.
struct CarelessPolicy {
  struct Options {};
  struct LayerState {
    std::uint32_t partitions = 0;
    bool bogus = false;
  };
  static constexpr std::string_view kName = "careless";
  static constexpr RopeStage kRope = RopeStage::post_rope;
  static constexpr std::uint32_t bogus_prompt = 13;

  std::vector<PartitionSpec> index(const LayerContext& ctx, const KvView& kv, LayerState& state) const {
    const PartitionSpec spec = PartitionSpec::uniform(kv.tokens, ctx.page_tokens);
    state.partitions += spec.partition_count();
    state.bogus = kv.tokens == bogus_prompt;
    return {spec};
  }
  std::optional<Repartition> append(const LayerContext&, const AppendedPage&, LayerState& state) const {
    ++state.partitions;
    return std::nullopt;
  }
  void select(const LayerContext& ctx, const DecodeQuery&, const LayerState& state, Selection& out) const {
    out.reset(ctx.kv_heads);
    for (auto& ids : out.partitions) {
      for (PartitionId p = 0; p < state.partitions; ++p) ids.push_back(p);
      if (state.bogus) ids.push_back(999);
    }
  }
  std::uint32_t mandatory_pages(const LayerContext& ctx) const { return ctx.tokens / ctx.page_tokens + 1; }
};

}  // namespace

TEST_CASE("Review: can_admit counts the CPU pages RetroInfer's clusters pad, so an admitted prompt prefills",
          "[facade][errors]") {
  constexpr ModelShape shape{1, 4, 1, 16, DType::f32};
  for (const std::uint32_t pages : {40u, 70u, 140u}) {
    Config c = small_config(shape, 32, 1100);
    c.cpu_tier_bytes = pages * c.page_bytes(shape);
    RuntimeManager manager(shape, c, make_policy("retroinfer", 64));
    std::mt19937 rng(pages);
    for (const std::uint32_t prompt : {100u, 500u, 1000u}) {
      CAPTURE(pages, prompt);
      const AdmissionAdvice advice = manager.can_admit(prompt, prompt + 100);
      if (!advice.admit) continue;
      const std::vector<float> k = normal_values(rng, 16 * prompt), v = normal_values(rng, 16 * prompt);
      manager.add_request(prompt, prompt + 100);
      manager.prefill(prompt, 0, k.data(), v.data(), prompt);  // admitted: must fit
      manager.finish(prompt);
    }
  }
  // The review's case: 40 CPU pages cannot hold a 1000-token prompt in 16-token clusters over 32-token pages.
  Config c = small_config(shape, 32, 1100);
  c.cpu_tier_bytes = 40 * c.page_bytes(shape);
  const AdmissionAdvice advice = RuntimeManager(shape, c, make_policy("retroinfer", 64)).can_admit(1000, 1100);
  REQUIRE_FALSE(advice.admit);
  REQUIRE(advice.reason.find("CPU pages") != std::string::npos);
}

TEST_CASE("Review: partition hit and miss counts do not wrap at 32 bits", "[facade]") {
  CacheStepStats total;
  CacheStepStats step;
  step.hit_partitions = std::numeric_limits<std::uint32_t>::max();
  step.miss_partitions = std::numeric_limits<std::uint32_t>::max();
  total += step;
  total += step;
  REQUIRE(total.hit_partitions == 2 * std::uint64_t{std::numeric_limits<std::uint32_t>::max()});
  REQUIRE(total.miss_partitions == total.hit_partitions);
}

TEST_CASE("Review: a refused decode leaves the timing stats, a refused prefill the policy state, unchanged",
          "[facade][errors]") {
  constexpr ModelShape shape{1, 4, 1, 16, DType::f32};
  std::mt19937 rng(3);
  const std::vector<float> k = normal_values(rng, 16 * 64), v = normal_values(rng, 16 * 64), q = normal_values(rng, 64);
  std::vector<float> out(2 * 64);
  {
    Manager<CarelessPolicy> manager(shape, small_config(shape, 8, 64), CarelessPolicy{});
    manager.add_request(1, 64);
    manager.add_request(2, 64);
    manager.prefill(1, 0, k.data(), v.data(), 20);
    manager.prefill(2, 0, k.data(), v.data(), CarelessPolicy::bogus_prompt);
    const std::vector<float> qq = normal_values(rng, 2 * 64), kk = normal_values(rng, 2 * 16);
    const StepStats before = manager.stats();
    REQUIRE_SPARSEKV_ERROR(manager.decode(std::vector<RequestId>{1, 2}, 0, qq.data(), kk.data(), kk.data(), out.data()),
                           ErrorCode::out_of_range);
    REQUIRE(manager.stats().append_s == before.append_s);
    REQUIRE(manager.stats().select_s == before.select_s);
    REQUIRE(manager.stats().decode_steps == before.decode_steps);
  }
  {
    // The CPU tier holds one 40-token prompt: the second request's prefill is refused until the first finishes.
    Config c = small_config(shape, 8, 64);
    c.cpu_tier_bytes = 5 * c.page_bytes(shape);
    Manager<CarelessPolicy> manager(shape, c, CarelessPolicy{});
    manager.add_request(1, 64);
    manager.add_request(2, 64);
    manager.prefill(1, 0, k.data(), v.data(), 40);
    REQUIRE_SPARSEKV_ERROR(manager.prefill(2, 0, k.data(), v.data(), 40), ErrorCode::resource_exhausted);
    manager.finish(1);
    manager.prefill(2, 0, k.data(), v.data(), 40);
    // With the refused index kept, the policy would count 10 partitions and select ids that do not exist.
    manager.decode(std::vector<RequestId>{2}, 0, q.data(), k.data(), v.data(), out.data());
    REQUIRE(manager.retrieval(0).partitions.size() == 5);
  }
}

TEST_CASE("Review: a policy that cannot serve the configuration is refused at construction", "[facade][errors]") {
  constexpr ModelShape shape{1, 4, 1, 16, DType::f32};
  // RetroInfer clusters of up to a whole 70000-token segment over 1-token pages: above 65536 pages per partition.
  Config c = small_config(shape, 1, 70100);
  RetroInferPolicy::Options o;
  o.segment_tokens = 70000;
  o.tokens_per_cluster = 70000;
  REQUIRE_SPARSEKV_ERROR(RuntimeManager(shape, c, AnyPolicy(RetroInferPolicy(o))), ErrorCode::invalid_argument);
  o.segment_tokens = 8192;  // the paper's segments and clusters fit
  o.tokens_per_cluster = 16;
  RuntimeManager fine(shape, c, AnyPolicy(RetroInferPolicy(o)));
  // Quest's 16-token pages over 32-token KV pages: refused by the constructor, not by every later call.
  QuestPolicy::Options quest;
  quest.page_tokens_per_partition = 16;
  REQUIRE_SPARSEKV_ERROR(RuntimeManager(shape, small_config(shape, 32, 64), AnyPolicy(QuestPolicy(quest))),
                         ErrorCode::invalid_argument);
  // Its default page is the KV page, whatever its size.
  RuntimeManager one_page(shape, small_config(shape, 32, 64), make_policy("quest", 512));
}

// Index learns each request's max_tokens (LayerContext::reserve_tokens), so
// that a policy can reserve its state once instead of reallocating it in a
// decode step.
TEST_CASE("Index is told the request's max_tokens to reserve for", "[facade]") {
  const ModelShape shape{2, 4, 2, 16, DType::f32};
  ReserveNotingPolicy policy;
  const auto seen = policy.seen;
  Manager<ReserveNotingPolicy> manager(shape, small_config(shape, 8, 64), policy);
  const std::size_t row = std::size_t{shape.kv_heads} * shape.head_dim;
  const std::vector<float> kv(20 * row, 0.5f);
  manager.add_request(1, 60);
  manager.add_request(2, 33);
  for (std::uint32_t layer = 0; layer < shape.layers; ++layer) {
    manager.prefill(1, layer, kv.data(), kv.data(), 20);
    manager.prefill(2, layer, kv.data(), kv.data(), 20);
  }
  CHECK(*seen == std::vector<std::uint32_t>{60, 33, 60, 33});
}
