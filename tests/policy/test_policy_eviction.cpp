// Token-evicting policies (policy/token_eviction.hpp): H2O's scores and
// eviction order, StreamingLLM's, the protected tokens, the budget's bound,
// bad input, Quest / ShadowKV summary rewrites, AnyPolicy and make_policy.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "sparsekv/policy/any_policy.hpp"
#include "sparsekv/policy/h2o.hpp"
#include "sparsekv/policy/policy_registry.hpp"
#include "sparsekv/policy/quest.hpp"
#include "sparsekv/policy/shadowkv.hpp"
#include "sparsekv/policy/streaming_eviction.hpp"
#include "test_support.hpp"

using namespace sparsekv;

static_assert(EvictsTokens<H2OPolicy>);
static_assert(EvictsTokens<StreamingEvictionPolicy>);
static_assert(!EvictsTokens<QuestPolicy>);
static_assert(RewritesSummaries<QuestPolicy>);
static_assert(RewritesSummaries<ShadowKVPolicy>);
static_assert(!RewritesSummaries<H2OPolicy>);

namespace {

using Positions = std::vector<std::uint32_t>;

// Two kv heads of two q heads each, 4-token pages.
LayerContext context(std::uint32_t kv_heads = 2, std::uint32_t head_dim = 4, std::uint32_t page_tokens = 4) {
  LayerContext ctx;
  ctx.layer = 2;
  ctx.layers = 4;
  ctx.q_heads = 2 * kv_heads;
  ctx.kv_heads = kv_heads;
  ctx.head_dim = head_dim;
  ctx.page_tokens = page_tokens;
  return ctx;
}

// K/V of `tokens` tokens, [token][kv head][dim], random keys.
struct Chunk {
  std::uint32_t tokens, kv_heads, dim;
  std::vector<float> keys, values;
  Chunk(const LayerContext& ctx, std::uint32_t n, std::uint32_t seed)
      : tokens(n),
        kv_heads(ctx.kv_heads),
        dim(ctx.head_dim),
        keys(std::size_t{n} * kv_heads * dim),
        values(keys.size()) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (float& k : keys) k = normal(rng);
    for (float& v : values) v = normal(rng);
  }
  float* key(std::uint32_t t, std::uint32_t h) { return keys.data() + (std::size_t{t} * kv_heads + h) * dim; }
  KvView view() const { return KvView{keys, values, tokens, kv_heads, dim, 0}; }
  // The keys of `rows` of kv head h as a one-head view (RewrittenPage::live_rows).
  std::vector<float> rows_of(std::uint32_t h, const Positions& rows) const {
    std::vector<float> out;
    for (const std::uint32_t t : rows) {
      const float* k = keys.data() + (std::size_t{t} * kv_heads + h) * dim;
      out.insert(out.end(), k, k + dim);
    }
    return out;
  }
};

KvView one_head_view(const std::vector<float>& keys, std::uint32_t tokens, std::uint32_t dim) {
  return KvView{keys, {}, tokens, 1, dim, 0};
}

// A prompt of `tokens` tokens (keys only matter for the shape).
template <class P>
typename P::LayerState indexed(const P& policy, const LayerContext& ctx, std::uint32_t tokens) {
  const Chunk chunk(ctx, tokens, 1);
  typename P::LayerState state;
  policy.index(ctx, chunk.view(), state);
  return state;
}

// The context of an eviction at `newest`: the state's own live counts.
EvictionContext eviction_at(const LiveTokens& live, std::uint32_t newest, Positions prefix = {}) {
  EvictionContext e;
  e.newest = newest;
  for (const auto& head : live.positions) e.live_tokens.push_back(static_cast<std::uint32_t>(head.size()));
  e.protected_prefix = std::move(prefix);
  return e;
}

TokenWeights weights(const std::vector<std::vector<std::pair<std::uint32_t, float>>>& per_head) {
  TokenWeights w;
  for (const auto& head : per_head) {
    w.heads.emplace_back();
    for (const auto& [position, weight] : head) w.heads.back().push_back({position, weight});
  }
  return w;
}

// The same weight for every live token of every head.
TokenWeights flat_weights(const LiveTokens& live, float weight) {
  TokenWeights w;
  w.reset(static_cast<std::uint32_t>(live.positions.size()));
  for (std::size_t h = 0; h < live.positions.size(); ++h) {
    for (const std::uint32_t p : live.positions[h]) w.heads[h].push_back({p, weight});
  }
  return w;
}

H2OPolicy h2o(std::uint32_t budget, std::uint32_t recent, std::uint32_t sinks = 0, std::uint32_t per_step = 1) {
  H2OPolicy::Options o;
  o.budget_tokens = budget;
  o.recent_tokens = recent;
  o.sink_tokens = sinks;
  o.evict_per_step = per_step;
  return H2OPolicy(o);
}

// One decode step of an H2O state: place, observe, evict.
Eviction h2o_step(const H2OPolicy& policy, const LayerContext& ctx, H2OPolicy::LayerState& state,
                  std::uint32_t position, const TokenWeights& w) {
  policy.placed(ctx, position, state);
  policy.observe(ctx, w, state);
  Eviction out;
  policy.evict(ctx, eviction_at(state.live, position), state, out);
  return out;
}

}  // namespace

TEST_CASE("h2o: cumulative scores and the eviction order, hand computed", "[policy][eviction][h2o]") {
  const LayerContext ctx = context();
  const H2OPolicy policy = h2o(4, 2);
  auto state = indexed(policy, ctx, 4);
  REQUIRE(state.live.positions == std::vector<Positions>{{0, 1, 2, 3}, {0, 1, 2, 3}});

  // Step 4: 5 live, 6 once token 5 is placed: two over the budget of 4.
  // Evictable: p + 2 <= 5, i.e. 0..3. Head 0: the two lowest, 3 then 1.
  // Head 1: 0, 1 and 2 tie at 0.25; the older go first.
  Eviction out = h2o_step(policy, ctx, state, 4,
                          weights({{{0, 0.5f}, {1, 0.25f}, {2, 1.0f}, {3, 0.125f}, {4, 0.125f}},
                                   {{0, 0.25f}, {1, 0.25f}, {2, 0.25f}, {3, 0.5f}, {4, 0.75f}}}));
  CHECK(out.positions == std::vector<Positions>{{1, 3}, {0, 1}});
  CHECK(state.live.positions == std::vector<Positions>{{0, 2, 4}, {2, 3, 4}});
  CHECK(state.scores == std::vector<std::vector<double>>{{0.5, 1.0, 0.125}, {0.25, 0.5, 0.75}});

  // Step 5: 4 live, one over. Head 0's step weights alone would drop 2 (the
  // older of 2 and 4 at 0.0625); the cumulative scores are 1.25 / 1.0625 /
  // 0.1875, so 4 goes. Head 1: 2.25 / 0.5625 / 0.8125 -> 3.
  out = h2o_step(policy, ctx, state, 5,
                 weights({{{0, 0.75f}, {2, 0.0625f}, {4, 0.0625f}, {5, 0.125f}},
                          {{2, 2.0f}, {3, 0.0625f}, {4, 0.0625f}, {5, 0.0f}}}));
  CHECK(out.positions == std::vector<Positions>{{4}, {3}});
  CHECK(state.live.positions == std::vector<Positions>{{0, 2, 5}, {2, 4, 5}});
  CHECK(state.scores == std::vector<std::vector<double>>{{1.25, 1.0625, 0.125}, {2.25, 0.8125, 0.0}});
}

TEST_CASE("h2o: the recent window, the sinks and the shared prefix are never evicted", "[policy][eviction][h2o]") {
  const LayerContext ctx = context();
  // Budget 6 = 2 sinks + a window of 2 + 2 heavy hitters. Prompt of 8, token 8
  // placed: 9 live, 10 with the next: 4 to go. Every token weighs 0 but
  // 2 and 3, so the sinks 0, 1 and the window (8 and the next token) would
  // go first if they were evictable; 7 is just outside the window.
  const H2OPolicy policy = h2o(6, 2, 2);
  const auto w = [] {
    TokenWeights t;
    t.reset(2);
    for (std::uint32_t h = 0; h < 2; ++h) {
      for (std::uint32_t p = 0; p <= 8; ++p) t.heads[h].push_back({p, p == 2 || p == 3 ? 1.0f : 0.0f});
    }
    return t;
  };
  {
    auto state = indexed(policy, ctx, 8);
    policy.placed(ctx, 8, state);
    policy.observe(ctx, w(), state);
    Eviction out;
    policy.evict(ctx, eviction_at(state.live, 8), state, out);
    CHECK(out.positions == std::vector<Positions>{{4, 5, 6, 7}, {4, 5, 6, 7}});
  }
  {
    // Head 0 shares positions 0..4, head 1 0..5: only 5..7 and 6..7 are left
    // to evict, and both heads stay over the budget (shared tokens cannot go).
    auto state = indexed(policy, ctx, 8);
    policy.placed(ctx, 8, state);
    policy.observe(ctx, w(), state);
    Eviction out;
    policy.evict(ctx, eviction_at(state.live, 8, {5, 6}), state, out);
    CHECK(out.positions == std::vector<Positions>{{5, 6, 7}, {6, 7}});
    CHECK(state.live.positions == std::vector<Positions>{{0, 1, 2, 3, 4, 8}, {0, 1, 2, 3, 4, 5, 8}});
  }
}

TEST_CASE("h2o: catch-up after a large prompt, then one eviction per step", "[policy][eviction][h2o]") {
  const LayerContext ctx = context();
  const H2OPolicy policy = h2o(8, 4);
  auto state = indexed(policy, ctx, 20);
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> uniform(0.0f, 1.0f);
  // The reference: each live position's summed weights, added in double in step order as the policy does.
  std::vector<std::map<std::uint32_t, double>> sums(ctx.kv_heads);
  const auto random_weights = [&](const LiveTokens& live) {
    TokenWeights w;
    w.reset(ctx.kv_heads);
    for (std::uint32_t h = 0; h < ctx.kv_heads; ++h) {
      for (const std::uint32_t p : live.positions[h]) {
        w.heads[h].push_back({p, uniform(rng)});
        sums[h][p] += w.heads[h].back().weight;
      }
    }
    return w;
  };
  // Per head: the `count` lowest sums among the positions outside the window
  // (p + 4 <= newest + 1), older first on a tie; the rest survive.
  const auto lowest = [&](std::uint32_t h, std::uint32_t newest, std::size_t count) {
    Positions order;
    for (const auto& [p, sum] : sums[h]) {
      if (p + 4 <= newest + 1) order.push_back(p);
    }
    std::stable_sort(order.begin(), order.end(),
                     [&](std::uint32_t a, std::uint32_t b) { return sums[h].at(a) < sums[h].at(b); });
    order.resize(std::min(count, order.size()));
    std::sort(order.begin(), order.end());
    return order;
  };
  const auto check_survivors = [&](const Eviction& out, std::uint32_t newest) {
    for (std::uint32_t h = 0; h < ctx.kv_heads; ++h) {
      CAPTURE(h, newest);
      REQUIRE(out.positions[h] == lowest(h, newest, out.positions[h].size()));
      for (const std::uint32_t p : out.positions[h]) sums[h].erase(p);
      Positions survivors;
      for (const auto& [p, sum] : sums[h]) survivors.push_back(p);
      REQUIRE(state.live.positions[h] == survivors);
    }
  };
  // Token 20 placed: 21 live, 22 with the next, so 14 go at once; 18 are
  // evictable (p + 4 <= 21).
  policy.placed(ctx, 20, state);
  policy.observe(ctx, random_weights(state.live), state);
  Eviction out;
  policy.evict(ctx, eviction_at(state.live, 20), state, out);
  for (std::uint32_t h = 0; h < ctx.kv_heads; ++h) {
    CHECK(out.positions[h].size() == 14);
    CHECK(state.live.positions[h].size() == 7);
    // The window: 18, 19, 20 stay (with 21 they are the 4 newest).
    CHECK(std::find(state.live.positions[h].begin(), state.live.positions[h].end(), 18) !=
          state.live.positions[h].end());
  }
  // The four heavy hitters kept are the highest sums of the first step.
  check_survivors(out, 20);
  for (std::uint32_t t = 21; t < 80; ++t) {
    policy.placed(ctx, t, state);
    for (const auto& head : state.live.positions) REQUIRE(head.size() == 8);  // the budget, once placed
    policy.observe(ctx, random_weights(state.live), state);
    policy.evict(ctx, eviction_at(state.live, t), state, out);
    for (std::uint32_t h = 0; h < ctx.kv_heads; ++h) REQUIRE(out.positions[h].size() == 1);
    check_survivors(out, t);  // the lowest sum outside the window goes
  }
}

TEST_CASE("h2o: nothing below the budget, evict_per_step tokens at once above it", "[policy][eviction][h2o]") {
  const LayerContext ctx = context();
  {
    const H2OPolicy policy = h2o(16, 4);
    auto state = indexed(policy, ctx, 4);
    for (std::uint32_t t = 4; t < 20; ++t) {
      const Eviction out = h2o_step(policy, ctx, state, t, flat_weights(state.live, 0.5f));
      // Live t + 1; the next token fits while t + 2 <= 16.
      const std::size_t expected = t + 2 <= 16 ? 0 : 1;
      for (const auto& head : out.positions) REQUIRE(head.size() == expected);
    }
  }
  {
    // 3 at a time once over: 3, then two steps with room, then 3 again.
    const H2OPolicy policy = h2o(8, 4, 0, 3);
    auto state = indexed(policy, ctx, 7);
    std::vector<std::size_t> counts;
    for (std::uint32_t t = 7; t < 16; ++t) {
      counts.push_back(h2o_step(policy, ctx, state, t, flat_weights(state.live, 0.5f)).positions[0].size());
    }
    CHECK(counts == std::vector<std::size_t>{3, 0, 0, 3, 0, 0, 3, 0, 0});
  }
}

TEST_CASE("h2o: bad input is refused and changes nothing", "[policy][eviction][h2o]") {
  const LayerContext ctx = context();
  const H2OPolicy policy = h2o(4, 2);
  auto state = indexed(policy, ctx, 4);
  policy.placed(ctx, 4, state);
  policy.observe(ctx, flat_weights(state.live, 0.25f), state);
  const auto before = state;
  const auto unchanged = [&] {
    REQUIRE(state.live.positions == before.live.positions);
    REQUIRE(state.live.partitions == before.live.partitions);
    REQUIRE(state.scores == before.scores);
  };
  // Weights: a position not live (head 1, the last entry), twice, negative, NaN, one head short.
  REQUIRE_SPARSEKV_ERROR(policy.observe(ctx, weights({{{0, 1.0f}}, {{1, 1.0f}, {9, 1.0f}}}), state),
                         ErrorCode::invalid_argument);
  unchanged();
  REQUIRE_SPARSEKV_ERROR(policy.observe(ctx, weights({{{0, 1.0f}}, {{1, 1.0f}, {1, 1.0f}}}), state),
                         ErrorCode::invalid_argument);
  unchanged();
  REQUIRE_SPARSEKV_ERROR(policy.observe(ctx, weights({{{0, 1.0f}}, {{1, -0.5f}}}), state), ErrorCode::invalid_argument);
  unchanged();
  REQUIRE_SPARSEKV_ERROR(
      policy.observe(ctx, weights({{{0, 1.0f}}, {{1, std::numeric_limits<float>::quiet_NaN()}}}), state),
      ErrorCode::invalid_argument);
  unchanged();
  REQUIRE_SPARSEKV_ERROR(policy.observe(ctx, weights({{{0, 1.0f}}}), state), ErrorCode::invalid_argument);
  unchanged();
  // Placing a position that is not after the newest.
  REQUIRE_SPARSEKV_ERROR(policy.placed(ctx, 4, state), ErrorCode::invalid_argument);
  unchanged();
  // An eviction context out of step with the state: newest, live counts, prefixes.
  Eviction out;
  out.positions = {{42}};
  REQUIRE_SPARSEKV_ERROR(policy.evict(ctx, eviction_at(state.live, 3), state, out), ErrorCode::invalid_argument);
  auto wrong_count = eviction_at(state.live, 4);
  wrong_count.live_tokens[1] = 4;
  REQUIRE_SPARSEKV_ERROR(policy.evict(ctx, wrong_count, state, out), ErrorCode::invalid_argument);
  REQUIRE_SPARSEKV_ERROR(policy.evict(ctx, eviction_at(state.live, 4, {1}), state, out), ErrorCode::invalid_argument);
  unchanged();
  REQUIRE(out.positions == std::vector<Positions>{{42}});
  // A state never indexed.
  H2OPolicy::LayerState fresh;
  REQUIRE_SPARSEKV_ERROR(policy.placed(ctx, 0, fresh), ErrorCode::invalid_argument);
}

TEST_CASE("h2o and streaming_evict: constructors refuse a budget below the protected window", "[policy][eviction]") {
  REQUIRE_SPARSEKV_ERROR(h2o(0, 0), ErrorCode::invalid_argument);
  REQUIRE_SPARSEKV_ERROR(h2o(5, 4, 2), ErrorCode::invalid_argument);
  REQUIRE_NOTHROW(h2o(6, 4, 2));
  // Without a window the placed token still needs its own place.
  REQUIRE_SPARSEKV_ERROR(h2o(3, 0, 3), ErrorCode::invalid_argument);
  REQUIRE_NOTHROW(h2o(4, 0, 3));
  REQUIRE_SPARSEKV_ERROR(h2o(8, 4, 0, 0), ErrorCode::invalid_argument);
  try {
    h2o(5, 4, 2);
  } catch (const Error& e) {
    CHECK(std::string(e.what()).find("budget below protected window") != std::string::npos);
  }
  H2OPolicy::Options o;
  o.budget_tokens = 64;
  CHECK(H2OPolicy(o).recent_tokens() == 32);  // half the budget by default

  StreamingEvictionPolicy::Options s;
  s.budget_tokens = 4;
  REQUIRE_SPARSEKV_ERROR(StreamingEvictionPolicy{s}, ErrorCode::invalid_argument);
  s.budget_tokens = 5;
  REQUIRE_NOTHROW(StreamingEvictionPolicy{s});
}

TEST_CASE("streaming_evict: sinks stay, the token leaving the window goes", "[policy][eviction][streaming]") {
  const LayerContext ctx = context();
  StreamingEvictionPolicy::Options o;
  o.budget_tokens = 8;
  const StreamingEvictionPolicy policy(o);
  STATIC_REQUIRE(!StreamingEvictionPolicy::kNeedsTokenWeights);
  auto state = indexed(policy, ctx, 10);
  // At prefill: 10 live, 11 with the next token: 3 go, the oldest after the 4 sinks.
  Eviction out;
  policy.evict(ctx, eviction_at(state.live, 9), state, out);
  CHECK(out.positions == std::vector<Positions>{{4, 5, 6}, {4, 5, 6}});
  for (std::uint32_t t = 10; t < 30; ++t) {
    policy.placed(ctx, t, state);
    for (const auto& head : state.live.positions) REQUIRE(head.size() == 8);
    // Weights play no part.
    policy.observe(ctx, flat_weights(state.live, 1.0f), state);
    policy.evict(ctx, eviction_at(state.live, t), state, out);
    REQUIRE(out.positions == std::vector<Positions>{{t - 3}, {t - 3}});
  }
  CHECK(state.live.positions[0] == Positions{0, 1, 2, 3, 27, 28, 29});
  // A shared prefix of 6 in head 1: its oldest after the prefix goes instead.
  auto shared = indexed(policy, ctx, 10);
  policy.evict(ctx, eviction_at(shared.live, 9, {0, 6}), shared, out);
  CHECK(out.positions == std::vector<Positions>{{4, 5, 6}, {6, 7, 8}});
  // Below the budget: nothing.
  auto small = indexed(policy, ctx, 6);
  policy.evict(ctx, eviction_at(small.live, 5), small, out);
  CHECK(out.positions == std::vector<Positions>{{}, {}});
}

TEST_CASE("eviction policies: one-page partitions, select all, the whole context mandatory", "[policy][eviction]") {
  LayerContext ctx = context();
  const H2OPolicy policy = h2o(8, 4);
  const Chunk chunk(ctx, 10, 3);
  H2OPolicy::LayerState state;
  const auto specs = policy.index(ctx, chunk.view(), state);
  REQUIRE(specs.size() == 1);
  CHECK(specs[0].partition_count() == 3);
  CHECK(specs[0].size(2) == 2);
  const Chunk page(ctx, 4, 4);
  policy.append(ctx, AppendedPage{page.view(), {3, 3}}, state);
  Selection s;
  policy.select(ctx, DecodeQuery{}, state, s);
  CHECK(s.partitions == std::vector<std::vector<PartitionId>>{{0, 1, 2, 3}, {0, 1, 2, 3}});
  ctx.tokens = 10;
  CHECK(policy.mandatory_pages(ctx) == 4);
  ctx.tokens = 12;
  CHECK(StreamingEvictionPolicy().mandatory_pages(ctx) == 4);
}

TEST_CASE("quest / shadowkv rewrite: a summary of the live rows only", "[policy][eviction][rewrite]") {
  const LayerContext ctx = context(2, 16, 8);
  Chunk chunk(ctx, 16, 11);
  // Token 3 of kv head 1 holds the box's extremes in every dimension.
  for (std::uint32_t d = 0; d < ctx.head_dim; ++d) chunk.key(3, 1)[d] = d % 2 == 0 ? 9.0f : -9.0f;
  const Positions live{0, 1, 2, 4, 5, 7};  // partition 0 of head 1 after evicting 3 and 6
  const std::vector<float> rows = chunk.rows_of(1, live);
  const RewrittenPage page{1, 0, one_head_view(rows, 6, ctx.head_dim)};
  // The reference: a fresh index of the live rows alone, as one kv head.
  const LayerContext one = context(1, 16, 8);

  QuestPolicy::Options qo;
  qo.dense_layers = 0;
  const QuestPolicy quest(qo);
  QuestPolicy::LayerState q;
  quest.index(ctx, chunk.view(), q);
  const auto q_before = q;
  quest.rewrite(ctx, page, q);
  QuestPolicy::LayerState q_fresh;
  quest.index(one, one_head_view(rows, 6, ctx.head_dim), q_fresh);
  const auto box = [](const std::vector<float>& v, std::uint32_t i) {
    return std::vector<float>(v.begin() + i * 16, v.begin() + (i + 1) * 16);
  };
  CHECK(box(q.min[1].widened(), 0) == q_fresh.min[0].widened());
  CHECK(box(q.max[1].widened(), 0) == q_fresh.max[0].widened());
  for (std::uint32_t d = 0; d < 16; ++d) {
    CHECK((d % 2 == 0 ? q.max[1].at(0, d) < 9.0f : q.min[1].at(0, d) > -9.0f));  // the box shrank
  }
  CHECK(q.min[0] == q_before.min[0]);  // other heads and partitions as they were
  CHECK(box(q.max[1].widened(), 1) == box(q_before.max[1].widened(), 1));
  CHECK(q.tokens == q_before.tokens);

  ShadowKVPolicy::Options so;
  so.budget_tokens = 8;
  const ShadowKVPolicy shadow(so);
  ShadowKVPolicy::LayerState s;
  shadow.index(ctx, chunk.view(), s);
  const auto s_before = s;
  shadow.rewrite(ctx, page, s);
  ShadowKVPolicy::LayerState s_fresh;
  shadow.index(one, one_head_view(rows, 6, ctx.head_dim), s_fresh);
  CHECK(box(s.landmarks[1], 0) == s_fresh.landmarks[0]);
  CHECK(s.outlier_score[1][0] == s_fresh.outlier_score[0][0]);
  CHECK(s.outlier_score[1][0] != s_before.outlier_score[1][0]);
  CHECK(s.landmarks[0] == s_before.landmarks[0]);
  CHECK(s.outlier_score[1][1] == s_before.outlier_score[1][1]);

  // Bad pages: unknown partition, no rows, more rows than the partition, two
  // heads' rows, a head out of range. Nothing changes.
  const auto q_after = q;
  const std::vector<float> nine = chunk.rows_of(1, {0, 1, 2, 3, 4, 5, 6, 7, 8});
  const std::vector<float> none;
  const std::vector<float> two_heads(std::size_t{2} * 2 * 16, 0.0f);
  for (const RewrittenPage& bad :
       {RewrittenPage{1, 7, one_head_view(rows, 6, 16)}, RewrittenPage{1, 0, one_head_view(none, 0, 16)},
        RewrittenPage{1, 0, one_head_view(nine, 9, 16)}, RewrittenPage{1, 0, KvView{two_heads, {}, 2, 2, 16, 0}}}) {
    REQUIRE_SPARSEKV_ERROR(quest.rewrite(ctx, bad, q), ErrorCode::invalid_argument);
    REQUIRE_SPARSEKV_ERROR(shadow.rewrite(ctx, bad, s), ErrorCode::invalid_argument);
  }
  REQUIRE_SPARSEKV_ERROR(quest.rewrite(ctx, RewrittenPage{2, 0, one_head_view(rows, 6, 16)}, q),
                         ErrorCode::out_of_range);
  CHECK(q.min == q_after.min);
  CHECK(q.max == q_after.max);
}

TEST_CASE("AnyPolicy forwards the eviction calls; make_policy knows h2o and streaming_evict",
          "[policy][eviction][any]") {
  const LayerContext ctx = context();
  const AnyPolicy any = make_policy("h2o", 8);
  CHECK(any.name() == "h2o");
  CHECK(any.evicts_tokens());
  CHECK(any.needs_token_weights());
  CHECK(!any.rewrites_summaries());
  // make_policy's recent window is half the budget: prompt 8, token 8 placed,
  // 0..4 heavy. With a window of 4, 5 and then the oldest go (a window of 2
  // would evict 5 and 6).
  const Chunk chunk(ctx, 8, 5);
  std::any state = any.make_state();
  any.index(ctx, chunk.view(), state);
  any.placed(ctx, 8, state);
  TokenWeights w;
  w.reset(2);
  for (std::uint32_t h = 0; h < 2; ++h) {
    for (std::uint32_t p = 0; p <= 8; ++p) w.heads[h].push_back({p, p < 5 ? 1.0f : 0.0f});
  }
  any.observe(ctx, w, state);
  Eviction out;
  any.evict(ctx, eviction_at(std::any_cast<H2OPolicy::LayerState&>(state).live, 8), state, out);
  CHECK(out.positions == std::vector<Positions>{{0, 5}, {0, 5}});

  const AnyPolicy streaming = make_policy("streaming_evict", 8);
  CHECK(streaming.evicts_tokens());
  CHECK(!streaming.needs_token_weights());
  REQUIRE_SPARSEKV_ERROR(make_policy("streaming_evict", 4), ErrorCode::invalid_argument);

  const AnyPolicy quest = make_policy("quest", 8);
  CHECK(!quest.evicts_tokens());
  CHECK(!quest.needs_token_weights());
  CHECK(quest.rewrites_summaries());
  std::any q = quest.make_state();
  quest.index(ctx, chunk.view(), q);
  out.positions = {{1}};
  quest.evict(ctx, EvictionContext{}, q, out);
  CHECK(out.positions == std::vector<Positions>{{}, {}});
  quest.placed(ctx, 8, q);  // a no-op
  const auto before = std::any_cast<const QuestPolicy::LayerState&>(q).max;
  std::vector<float> rows = chunk.rows_of(0, {0});
  quest.rewrite(ctx, RewrittenPage{0, 0, one_head_view(rows, 1, ctx.head_dim)}, q);
  CHECK(std::any_cast<const QuestPolicy::LayerState&>(q).max != before);
  CHECK(!make_policy("dense", 0).rewrites_summaries());

  const auto names = policy_names();
  CHECK(eviction_policy_names() == std::vector<std::string>{"h2o", "streaming_evict"});
  for (const auto& name : eviction_policy_names()) {
    CHECK(std::find(names.begin(), names.end(), name) == names.end());
    CHECK(make_policy(name, 64).name() == name);
  }
}
