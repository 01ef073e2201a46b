#include <algorithm>
#include <array>
#include <catch2/catch.hpp>
#include <cmath>
#include <limits>
#include <numeric>
#include <string>
#include <random>
#include <vector>

#include "research/oracle.hpp"
#include "sparsekv/policy/dense.hpp"
#include "sparsekv/policy/quest.hpp"
#include "sparsekv/policy/shadowkv.hpp"
#include "test_support.hpp"

using namespace sparsekv;

static_assert(SparseAttention<QuestPolicy>);
static_assert(SparseAttention<ShadowKVPolicy>);
static_assert(SparseAttention<OraclePolicy>);

namespace {

// GQA with two q heads per kv head, 8-token pages.
LayerContext context(std::uint32_t layer = 2, std::uint32_t q_heads = 4, std::uint32_t kv_heads = 2) {
  LayerContext ctx;
  ctx.layer = layer;
  ctx.layers = 4;
  ctx.q_heads = q_heads;
  ctx.kv_heads = kv_heads;
  ctx.head_dim = 16;
  ctx.page_tokens = 8;
  return ctx;
}

using Vec = std::vector<float>;

Vec normalized(Vec v) {
  const float norm = std::sqrt(std::inner_product(v.begin(), v.end(), v.begin(), 0.0f));
  for (float& x : v) x /= norm;
  return v;
}

// K/V of consecutive tokens, [token][kv head][dim].
struct Chunk {
  std::uint32_t tokens, kv_heads, dim;
  Vec keys, values;

  // Independent noise keys, or (coherent) per-page base directions plus a
  // little noise, the way neighbouring keys of real models look alike.
  Chunk(const LayerContext& ctx, std::uint32_t n, std::uint32_t seed, bool coherent = false)
      : tokens(n),
        kv_heads(ctx.kv_heads),
        dim(ctx.head_dim),
        keys(std::size_t{n} * kv_heads * dim),
        values(keys.size()) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (std::uint32_t t = 0; t < n; ++t) {
      for (std::uint32_t h = 0; h < kv_heads; ++h) {
        for (std::uint32_t d = 0; d < dim; ++d) key(t, h)[d] = (coherent ? 0.05f : 0.1f) * normal(rng);
      }
    }
    if (!coherent) return;
    for (std::uint32_t first = 0; first < n; first += ctx.page_tokens) {
      for (std::uint32_t h = 0; h < kv_heads; ++h) {
        Vec base(dim);
        for (float& x : base) x = normal(rng);
        set_page(first, std::min(n, first + ctx.page_tokens), h, normalized(base), 1.0f);
      }
    }
  }
  float* key(std::uint32_t t, std::uint32_t h) { return keys.data() + (std::size_t{t} * kv_heads + h) * dim; }
  // key(t) = scale * dir, plus its noise when `add`.
  void set(std::uint32_t t, std::uint32_t h, const Vec& dir, float scale, bool add = false) {
    for (std::uint32_t d = 0; d < dim; ++d) key(t, h)[d] = scale * dir[d] + (add ? key(t, h)[d] : 0.0f);
  }
  // Tokens [first, end) of head h get the base direction scale * dir (keeping their noise).
  void set_page(std::uint32_t first, std::uint32_t end, std::uint32_t h, const Vec& dir, float scale) {
    for (std::uint32_t t = first; t < end; ++t) set(t, h, dir, scale, true);
  }
  KvView view() const { return KvView{keys, values, tokens, kv_heads, dim, 0}; }
};

Vec random_query(const LayerContext& ctx, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  Vec q(std::size_t{ctx.q_heads} * ctx.head_dim);
  for (float& x : q) x = normal(rng);
  return q;
}

// The direction kv head h's q heads look at together: their normalised sum.
Vec group_direction(const LayerContext& ctx, const Vec& q, std::uint32_t h) {
  Vec dir(ctx.head_dim, 0.0f);
  for (std::uint32_t g = 0; g < ctx.group_size(); ++g) {
    for (std::uint32_t d = 0; d < ctx.head_dim; ++d)
      dir[d] += q[(std::size_t{h} * ctx.group_size() + g) * ctx.head_dim + d];
  }
  return normalized(dir);
}

// The library's side of a request in one layer: token counts per partition id
// (ids are dense in these tests) and the policy's state.
template <class P>
struct Run {
  const P& policy;
  LayerContext ctx;
  typename P::LayerState state;
  std::vector<std::uint32_t> sizes;

  Run(const P& p, LayerContext c, const Chunk& prefill) : policy(p), ctx(c) {
    const auto specs = policy.index(ctx, prefill.view(), state);
    REQUIRE(specs.size() == 1);
    for (std::uint32_t i = 0; i < specs[0].partition_count(); ++i) sizes.push_back(specs[0].size(i));
    ctx.tokens = prefill.tokens;
  }
  PartitionId append(const Chunk& page) {
    const auto id = static_cast<PartitionId>(sizes.size());
    const AppendedPage appended{page.view(), std::vector<PartitionId>(ctx.kv_heads, id)};
    REQUIRE_FALSE(policy.append(ctx, appended, state).has_value());
    sizes.push_back(page.tokens);
    ctx.tokens += page.tokens;
    return id;
  }
  Selection select(const Vec& q) const {
    Selection s;
    policy.select(ctx, DecodeQuery{q, ctx.tokens}, state, s);
    return s;
  }
  // Every head's selection: distinct known ids, at most `most_tokens` tokens
  // and at most mandatory_pages pages.
  void check(const Selection& s, std::uint64_t most_tokens) const {
    REQUIRE(s.partitions.size() == ctx.kv_heads);
    for (const auto& chosen : s.partitions) {
      REQUIRE(std::is_sorted(chosen.begin(), chosen.end()));
      REQUIRE(std::adjacent_find(chosen.begin(), chosen.end()) == chosen.end());
      std::uint64_t tokens = 0, pages = 0;
      for (PartitionId p : chosen) {
        REQUIRE(p < sizes.size());
        tokens += sizes[p];
        pages += (sizes[p] + ctx.page_tokens - 1) / ctx.page_tokens;
      }
      REQUIRE(tokens <= most_tokens);
      REQUIRE(pages <= policy.mandatory_pages(ctx));
    }
  }
  std::vector<PartitionId> all() const {
    std::vector<PartitionId> ids(sizes.size());
    std::iota(ids.begin(), ids.end(), 0u);
    return ids;
  }
};

bool has(const std::vector<PartitionId>& ids, PartitionId p) {
  return std::find(ids.begin(), ids.end(), p) != ids.end();
}

}  // namespace

// ---- Quest ----------------------------------------------------------------

TEST_CASE("Quest finds planted critical tokens", "[policy][quest]") {
  const LayerContext ctx = context();
  const Vec q = random_query(ctx, 7);
  Chunk kv(ctx, 512, 1);  // 32 Quest partitions of 16 tokens
  const std::vector<std::vector<std::uint32_t>> planted = {{37, 200, 411}, {90, 300, 470}};
  for (std::uint32_t h = 0; h < 2; ++h) {
    for (std::uint32_t t : planted[h]) kv.set(t, h, group_direction(ctx, q, h), 4.0f);
  }
  // k = 4: the newest and the three planted.
  const QuestPolicy quest(
      {.budget_tokens = 64, .page_tokens_per_partition = 16, .sink_tokens = 0, .recent_fraction = 0.0f});
  Run run(quest, ctx, kv);
  const Selection s = run.select(q);
  run.check(s, 64);
  for (std::uint32_t h = 0; h < 2; ++h) {
    std::vector<PartitionId> expected{31};
    for (std::uint32_t t : planted[h]) expected.push_back(t / 16);
    std::sort(expected.begin(), expected.end());
    CHECK(s.partitions[h] == expected);
  }
}

TEST_CASE("Quest always keeps the newest partition and handles decode pages", "[policy][quest]") {
  const LayerContext ctx = context();
  const Vec q = random_query(ctx, 3);
  Chunk kv(ctx, 256, 2);
  for (std::uint32_t h = 0; h < 2; ++h) kv.set(100, h, group_direction(ctx, q, h), 4.0f);
  // The newest partition scores lowest of all: its keys point away from q.
  for (std::uint32_t t = 240; t < 256; ++t) {
    for (std::uint32_t h = 0; h < 2; ++h) kv.set(t, h, group_direction(ctx, q, h), -4.0f);
  }
  const QuestPolicy quest(
      {.budget_tokens = 32, .page_tokens_per_partition = 16, .sink_tokens = 0, .recent_fraction = 0.0f});
  Run run(quest, ctx, kv);
  Selection s = run.select(q);
  run.check(s, 32);
  for (const auto& chosen : s.partitions) CHECK(chosen == std::vector<PartitionId>{6, 15});

  // A decode page with a critical token, then two that point away: the newest
  // (8 tokens), the critical page (8) and partition 6 (16) fill the budget.
  Chunk critical(ctx, 8, 10), away(ctx, 8, 11);
  for (std::uint32_t h = 0; h < 2; ++h) {
    critical.set(5, h, group_direction(ctx, q, h), 8.0f);
    for (std::uint32_t t = 0; t < 8; ++t) away.set(t, h, group_direction(ctx, q, h), -4.0f);
  }
  const PartitionId c = run.append(critical);
  run.append(away);
  const PartitionId newest = run.append(away);
  s = run.select(q);
  run.check(s, 32);
  for (const auto& chosen : s.partitions) CHECK(chosen == std::vector<PartitionId>{6, c, newest});
}

TEST_CASE("Quest ranks by the group's summed softmax: a flat head does not outvote a sharp one", "[policy][quest]") {
  // One kv head, q heads 10 e0 and 4 e1, one-key pages (zero-width boxes), so
  // a page's logit is q . key / 4. Every page but 5 has key 1.2 e0: q head 0
  // gives them all logit 3 and page 5 logit 0; page 5 has key 2 e1, which q
  // head 1 alone likes (logit 2, the rest 0). Summed logits would rank the
  // pages at 3 first (page 0); summed softmaxes give page 5 about a third of
  // head 1's vote against about 1/31 of head 0's for any other page.
  const LayerContext ctx = context(2, 2, 1);
  Vec q(2 * 16, 0.0f);
  q[0] = 10.0f;
  q[16 + 1] = 4.0f;
  Vec e0(16, 0.0f), e1(16, 0.0f);
  e0[0] = 1.0f;
  e1[1] = 1.0f;
  Chunk kv(ctx, 256, 5);
  for (std::uint32_t t = 0; t < 256; ++t) kv.set(t, 0, t / 8 == 5 ? e1 : e0, t / 8 == 5 ? 2.0f : 1.2f);
  const QuestPolicy quest({.budget_tokens = 16, .sink_tokens = 0, .recent_fraction = 0.0f});
  Run run(quest, ctx, kv);
  CHECK(run.select(q).partitions[0] == std::vector<PartitionId>{5, 31});
}

TEST_CASE("Quest's spread: 1 ranks by the paper's bound, 0 and the default by the key box's centre",
          "[policy][quest]") {
  // One q head, q = e0. Page 3's keys alternate +3 e0 and -3 e0 (a box of
  // centre 0 and half-width 3 on e0: bound 3, centre 0); page 9's are all
  // 2 e0 (bound and centre 2); every other key is 0. The bound picks page 3,
  // the centre and the default spread (0 + 0.5 * 3 = 1.5 < 2) page 9.
  const LayerContext ctx = context(2, 1, 1);
  Vec q(16, 0.0f);
  q[0] = 1.0f;
  Vec e0(16, 0.0f);
  e0[0] = 1.0f;
  Chunk kv(ctx, 256, 5);
  for (std::uint32_t t = 0; t < 256; ++t) {
    kv.set(t, 0, e0, t / 8 == 3 ? (t % 2 == 0 ? 3.0f : -3.0f) : t / 8 == 9 ? 2.0f : 0.0f);
  }
  for (const auto& [spread, page] : {std::pair{1.0f, 3u}, std::pair{0.5f, 9u}, std::pair{0.0f, 9u}}) {
    CAPTURE(spread);
    const QuestPolicy quest({.budget_tokens = 16, .sink_tokens = 0, .recent_fraction = 0.0f, .spread = spread});
    Run run(quest, ctx, kv);
    CHECK(run.select(q).partitions[0] == std::vector<PartitionId>{page, 31});
  }
  CHECK(QuestPolicy::Options{}.spread == 0.5f);
}

TEST_CASE("Quest keeps the first layers dense", "[policy][quest]") {
  const Vec q = random_query(context(), 5);
  const Chunk kv(context(), 512, 4);
  const QuestPolicy quest(
      {.budget_tokens = 32, .page_tokens_per_partition = 16, .sink_tokens = 0, .recent_fraction = 0.0f});
  for (std::uint32_t layer : {0u, 1u}) {
    Run run(quest, context(layer), kv);
    const Selection s = run.select(q);
    for (const auto& chosen : s.partitions) CHECK(chosen == run.all());
    CHECK(quest.mandatory_pages(run.ctx) == 512 / 8 + 1);  // the whole context
    run.check(s, 512);
  }
  Run sparse(quest, context(2), kv);
  CHECK(quest.mandatory_pages(sparse.ctx) == 32 / 8);
  for (const auto& chosen : sparse.select(q).partitions) CHECK(chosen.size() == 2);

  const QuestPolicy all_sparse({.budget_tokens = 32,
                                .page_tokens_per_partition = 16,
                                .dense_layers = 0,
                                .sink_tokens = 0,
                                .recent_fraction = 0.0f});
  Run layer0(all_sparse, context(0), kv);
  for (const auto& chosen : layer0.select(q).partitions) CHECK(chosen.size() == 2);
}

TEST_CASE("Quest keeps the attention sink and a recent window before ranking", "[policy][quest]") {
  // Every key but one points away from q, so the bound alone would take the
  // newest partition and the planted one. The defaults (sink 4 tokens, a
  // window of a quarter of the budget) keep partition 0 and the partitions
  // before the newest first: budget 128 = newest (16) + sink (16) + window
  // 32 (two partitions) + the planted partition + three more by bound.
  const LayerContext ctx = context();
  const Vec q = random_query(ctx, 11);
  Chunk kv(ctx, 512, 12);
  for (std::uint32_t h = 0; h < 2; ++h) {
    for (std::uint32_t t = 0; t < 512; ++t) kv.set(t, h, group_direction(ctx, q, h), -2.0f, true);
    kv.set(200, h, group_direction(ctx, q, h), 6.0f);
  }
  const QuestPolicy quest({.budget_tokens = 128, .page_tokens_per_partition = 16});
  CHECK(quest.window_tokens() == 32);
  Run run(quest, ctx, kv);
  const Selection s = run.select(q);
  run.check(s, 128);
  for (const auto& chosen : s.partitions) {
    REQUIRE(chosen.size() == 8);
    for (PartitionId p : {0u, 12u, 29u, 30u, 31u}) CHECK(has(chosen, p));  // 12 holds token 200
  }
  // The paper's rule on the same keys: the sink and the window are dropped
  // for partitions ranked by bound.
  const QuestPolicy paper(
      {.budget_tokens = 128, .page_tokens_per_partition = 16, .sink_tokens = 0, .recent_fraction = 0.0f});
  Run plain(paper, ctx, kv);
  const Selection p = plain.select(q);
  for (const auto& chosen : p.partitions) {
    CHECK(has(chosen, 12));
    CHECK(has(chosen, 31));
  }
  CHECK(p.partitions != s.partitions);
}

TEST_CASE("Quest finds the needle the oracle finds, with a heavy attention sink", "[policy][quest][oracle]") {
  // A 2K context of coherent pages, an attention sink at token 0 (a key the
  // group's queries all favour) and one needle token the query looks for.
  // The oracle (dense attention mass) selects the needle's page and the
  // sink's; Quest must select both within the same budget, with the defaults
  // (one KV page per Quest page, sink and window) and with the paper's rule
  // (16-token pages, neither).
  const LayerContext ctx = context();
  const std::uint32_t tokens = 2048, needle = 1337, budget = 128;
  const Vec q = random_query(ctx, 21);
  Chunk kv(ctx, tokens, 22, /*coherent=*/true);
  for (std::uint32_t h = 0; h < 2; ++h) {
    kv.set(needle, h, group_direction(ctx, q, h), 3.0f);
    kv.set(0, h, group_direction(ctx, q, h), 4.0f);
  }
  const OraclePolicy oracle({.budget_tokens = budget});
  Run oracle_run(oracle, ctx, kv);
  const Selection best = oracle_run.select(q);
  oracle_run.check(best, budget);
  for (const auto& chosen : best.partitions) {
    REQUIRE(has(chosen, needle / 8));  // the oracle's partitions are 8-token pages
    REQUIRE(has(chosen, 0));
  }
  for (const QuestPolicy& quest :
       {QuestPolicy({.budget_tokens = budget}),
        QuestPolicy(
            {.budget_tokens = budget, .page_tokens_per_partition = 16, .sink_tokens = 0, .recent_fraction = 0.0f})}) {
    Run run(quest, ctx, kv);
    const Selection got = run.select(q);
    run.check(got, budget);
    for (const auto& chosen : got.partitions) {
      CHECK(has(chosen, needle / quest.partition_tokens(ctx)));
      CHECK(has(chosen, 0));
    }
  }
}

TEST_CASE("Quest respects its budget", "[policy][quest]") {
  const LayerContext ctx = context();
  const std::uint32_t budget = GENERATE(8u, 16u, 24u, 40u, 64u, 100u, 200u);
  const QuestPolicy quest({.budget_tokens = budget, .page_tokens_per_partition = 16});
  Chunk kv(ctx, 100, 6);  // six 16-token partitions and a 4-token one
  const Vec q0 = random_query(ctx, 1);
  for (std::uint32_t h = 0; h < 2; ++h) kv.set(98, h, group_direction(ctx, q0, h), 4.0f);  // the short one scores high
  Run run(quest, ctx, kv);
  for (std::uint32_t step = 0; step < 6; ++step) {
    for (std::uint32_t seed = 0; seed < 8; ++seed) {
      const Vec q = seed == 0 ? q0 : random_query(ctx, 100 * step + seed);
      const Selection s = run.select(q);
      run.check(s, std::max(budget, 16u));
      const std::uint64_t total = std::accumulate(run.sizes.begin(), run.sizes.end(), std::uint64_t{0});
      for (const auto& chosen : s.partitions) {
        CHECK(has(chosen, static_cast<PartitionId>(run.sizes.size() - 1)));
        if (budget >= total) CHECK(chosen == run.all());
      }
    }
    run.append(Chunk(ctx, 8, 50 + step));
  }
}

TEST_CASE("Quest rejects bad input", "[policy][quest]") {
  REQUIRE_SPARSEKV_ERROR(QuestPolicy({.budget_tokens = 0, .page_tokens_per_partition = 16}),
                         ErrorCode::invalid_argument);
  for (const float bad_fraction : {-0.1f, 1.5f, std::nanf("")}) {
    REQUIRE_SPARSEKV_ERROR(QuestPolicy({.recent_fraction = bad_fraction}), ErrorCode::invalid_argument);
    REQUIRE_SPARSEKV_ERROR(QuestPolicy({.spread = bad_fraction}), ErrorCode::invalid_argument);
  }
  const LayerContext ctx = context();
  const QuestPolicy quest;
  const Chunk kv(ctx, 64, 1);
  QuestPolicy::LayerState state;
  // A Quest page that is not a whole number of KV pages.
  REQUIRE_SPARSEKV_ERROR(QuestPolicy({.page_tokens_per_partition = 12}).index(ctx, kv.view(), state),
                         ErrorCode::invalid_argument);
  REQUIRE_SPARSEKV_ERROR(quest.mandatory_pages(context(2, 3, 2)), ErrorCode::invalid_argument);  // 3 q on 2 kv heads
  KvView bad = kv.view();
  bad.kv_heads = 1;
  REQUIRE_SPARSEKV_ERROR(quest.index(ctx, bad, state), ErrorCode::invalid_argument);
  bad = kv.view();
  bad.head_dim = 8;
  REQUIRE_SPARSEKV_ERROR(quest.index(ctx, bad, state), ErrorCode::invalid_argument);
  bad = kv.view();
  bad.keys = bad.keys.first(bad.keys.size() - 1);
  REQUIRE_SPARSEKV_ERROR(quest.index(ctx, bad, state), ErrorCode::invalid_argument);
  bad = kv.view();
  bad.tokens = 0;
  bad.keys = {};
  REQUIRE_SPARSEKV_ERROR(quest.index(ctx, bad, state), ErrorCode::invalid_argument);

  const Vec q = random_query(ctx, 1);
  Selection s;
  REQUIRE_SPARSEKV_ERROR(quest.select(ctx, DecodeQuery{q, 64}, state, s), ErrorCode::invalid_argument);  // not indexed
  quest.index(ctx, kv.view(), state);
  REQUIRE_SPARSEKV_ERROR(quest.select(ctx, DecodeQuery{std::span(q).first(q.size() - 16), 64}, state, s),
                         ErrorCode::invalid_argument);
  REQUIRE_SPARSEKV_ERROR(quest.select(context(2, 4, 4), DecodeQuery{q, 64}, state, s), ErrorCode::invalid_argument);

  const Chunk half(ctx, 4, 2), page(ctx, 8, 3);
  REQUIRE_SPARSEKV_ERROR(quest.append(ctx, AppendedPage{half.view(), {4, 4}}, state), ErrorCode::invalid_argument);
  REQUIRE_SPARSEKV_ERROR(quest.append(ctx, AppendedPage{page.view(), {4}}, state), ErrorCode::invalid_argument);
  CHECK(state.tokens.size() == 8);  // unchanged: 64 tokens in 8-token Quest pages
  CHECK(state.min[0].rows() == 8);
}

// ---- ShadowKV ---------------------------------------------------------------

TEST_CASE("ShadowKV finds planted critical tokens", "[policy][shadowkv]") {
  const LayerContext ctx = context();
  const Vec q = random_query(ctx, 9);
  Chunk kv(ctx, 1024, 1, /*coherent=*/true);  // 128 pages
  // Head 0: whole pages that agree with q; head 1: one critical token per page.
  const std::vector<std::vector<std::uint32_t>> planted = {{10, 50, 90}, {20, 60, 100}};
  for (std::uint32_t p : planted[0]) kv.set_page(p * 8, p * 8 + 8, 0, group_direction(ctx, q, 0), 3.0f);
  for (std::uint32_t p : planted[1]) kv.set(p * 8 + 3, 1, group_direction(ctx, q, 1), 12.0f);
  // With and without outliers: a lone critical token also makes its page an
  // outlier, so without them the landmarks alone must find it.
  const std::uint32_t outliers = GENERATE(0u, 48u);
  const ShadowKVPolicy shadow({.budget_tokens = 256, .outlier_pages = outliers});
  Run run(shadow, ctx, kv);
  const Selection s = run.select(q);
  run.check(s, 256);
  for (std::uint32_t h = 0; h < 2; ++h) {
    CHECK(s.partitions[h].size() == 256 / 8);  // full pages: the budget is used exactly
    for (std::uint32_t p : planted[h]) CHECK(has(s.partitions[h], p));
  }
}

TEST_CASE("ShadowKV keeps the recent window and the outlier pages", "[policy][shadowkv]") {
  const LayerContext ctx = context();
  const Vec q = random_query(ctx, 4);
  Chunk kv(ctx, 1004, 2, true);  // 125 full pages and a 4-token one
  const std::vector<std::uint32_t> outliers = {5, 33, 77};
  for (std::uint32_t h = 0; h < 2; ++h) {
    const Vec away = group_direction(ctx, q, h);
    // Static pages point away from q: only the static rules can select them.
    for (std::uint32_t p = 121; p < 126; ++p) kv.set_page(p * 8, std::min(1004u, p * 8 + 8), h, away, -2.0f);
    for (std::uint32_t p : outliers) {
      kv.set_page(p * 8, p * 8 + 8, h, away, -2.0f);
      kv.set(p * 8 + 3, h, away, 4.0f);  // one key against its landmark: cos < 0
    }
  }
  const ShadowKVPolicy shadow({.budget_tokens = 128});
  REQUIRE(shadow.outlier_count() == 3);  // 48 * 128 / 2048
  Run run(shadow, ctx, kv);
  Selection s = run.select(q);
  run.check(s, 128);
  for (const auto& chosen : s.partitions) {
    // 5 recent pages (4 + 3 x 8 tokens fall short of 32), 3 outliers, 8 by landmark.
    CHECK(chosen.size() == 16);
    for (std::uint32_t p = 121; p < 126; ++p) CHECK(has(chosen, p));
    for (std::uint32_t p : outliers) CHECK(has(chosen, p));
  }

  // Four decode pages (pointing away too) now make the whole window; the old
  // window pages compete by landmark and lose.
  Chunk page(ctx, 8, 20, true);
  for (std::uint32_t h = 0; h < 2; ++h) page.set_page(0, 8, h, group_direction(ctx, q, h), -2.0f);
  for (int i = 0; i < 4; ++i) run.append(page);
  s = run.select(q);
  run.check(s, 128);
  for (const auto& chosen : s.partitions) {
    CHECK(chosen.size() == 16);  // 4 recent + 3 outliers + 9 by landmark
    for (std::uint32_t p = 126; p < 130; ++p) CHECK(has(chosen, p));
    for (std::uint32_t p = 121; p < 126; ++p) CHECK_FALSE(has(chosen, p));
    for (std::uint32_t p : outliers) CHECK(has(chosen, p));
  }
}

TEST_CASE("ShadowKV scales its outlier pages with the budget", "[policy][shadowkv]") {
  CHECK(ShadowKVPolicy().outlier_count() == 48);
  CHECK(ShadowKVPolicy({.budget_tokens = 1024}).outlier_count() == 24);
  CHECK(ShadowKVPolicy({.budget_tokens = 4096}).outlier_count() == 96);
  CHECK(ShadowKVPolicy({.budget_tokens = 100}).outlier_count() == 2);  // 2.34
  CHECK(ShadowKVPolicy({.budget_tokens = 64}).outlier_count() == 2);   // 1.5, half up
  CHECK(ShadowKVPolicy({.budget_tokens = 8}).outlier_count() == 0);
}

TEST_CASE("ShadowKV takes the max of each q head's softmax", "[policy][shadowkv]") {
  // One kv head, two q heads: q0 = 10 e0 sharply prefers page A, q1 = e1
  // mildly prefers page B. Raw logits would fill both slots from q0's
  // runners-up; per-head softmax puts B above all of them.
  const LayerContext ctx = context(2, 2, 1);
  Vec q(2 * 16, 0.0f);
  q[0] = 10.0f;
  q[16 + 1] = 1.0f;
  Chunk kv(ctx, 1024, 3, true);
  Vec e0(16, 0.0f), e1(16, 0.0f);
  e0[0] = 1.0f;
  e1[1] = 1.0f;
  kv.set_page(10 * 8, 11 * 8, 0, e0, 3.0f);
  kv.set_page(20 * 8, 21 * 8, 0, e1, 3.0f);
  const ShadowKVPolicy shadow({.budget_tokens = 48, .outlier_pages = 0});  // 4 recent pages + 2 by landmark
  Run run(shadow, ctx, kv);
  const Selection s = run.select(q);
  run.check(s, 48);
  CHECK(s.partitions[0] == std::vector<PartitionId>{10, 20, 124, 125, 126, 127});
}

TEST_CASE("ShadowKV respects its budget", "[policy][shadowkv]") {
  const LayerContext ctx = context();
  const std::uint32_t budget = GENERATE(4u, 8u, 16u, 40u, 100u, 256u, 1100u);
  const ShadowKVPolicy shadow({.budget_tokens = budget});
  Run run(shadow, ctx, Chunk(ctx, 1004, 8, true));
  for (std::uint32_t step = 0; step < 6; ++step) {
    for (std::uint32_t seed = 0; seed < 4; ++seed) {
      const Selection s = run.select(random_query(ctx, 100 * step + seed));
      run.check(s, std::max(budget, 8u));
      for (const auto& chosen : s.partitions) CHECK(has(chosen, static_cast<PartitionId>(run.sizes.size() - 1)));
    }
    run.append(Chunk(ctx, 8, 50 + step, true));
  }
}

TEST_CASE("ShadowKV rejects bad input", "[policy][shadowkv]") {
  REQUIRE_SPARSEKV_ERROR(ShadowKVPolicy({.budget_tokens = 0}), ErrorCode::invalid_argument);
  const LayerContext ctx = context();
  const ShadowKVPolicy shadow;
  const Chunk kv(ctx, 64, 1);
  ShadowKVPolicy::LayerState state;
  KvView bad = kv.view();
  bad.kv_heads = 1;
  REQUIRE_SPARSEKV_ERROR(shadow.index(ctx, bad, state), ErrorCode::invalid_argument);
  bad = kv.view();
  bad.head_dim = 8;
  REQUIRE_SPARSEKV_ERROR(shadow.index(ctx, bad, state), ErrorCode::invalid_argument);
  bad = kv.view();
  bad.keys = bad.keys.first(bad.keys.size() - 1);
  REQUIRE_SPARSEKV_ERROR(shadow.index(ctx, bad, state), ErrorCode::invalid_argument);
  REQUIRE_SPARSEKV_ERROR(shadow.mandatory_pages(context(2, 3, 2)), ErrorCode::invalid_argument);

  const Vec q = random_query(ctx, 1);
  Selection s;
  REQUIRE_SPARSEKV_ERROR(shadow.select(ctx, DecodeQuery{q, 64}, state, s), ErrorCode::invalid_argument);
  shadow.index(ctx, kv.view(), state);
  REQUIRE_SPARSEKV_ERROR(shadow.select(ctx, DecodeQuery{std::span(q).first(16), 64}, state, s),
                         ErrorCode::invalid_argument);
  const Chunk half(ctx, 4, 2), page(ctx, 8, 3);
  REQUIRE_SPARSEKV_ERROR(shadow.append(ctx, AppendedPage{half.view(), {8, 8}}, state), ErrorCode::invalid_argument);
  REQUIRE_SPARSEKV_ERROR(shadow.append(ctx, AppendedPage{page.view(), {8, 8, 8}}, state), ErrorCode::invalid_argument);
  CHECK(state.tokens.size() == 8);  // unchanged
  CHECK(state.landmarks[1].size() == 8 * 16);
}

// ---- Both -------------------------------------------------------------------

// ---- Oracle ---------------------------------------------------------------

TEST_CASE("The oracle selects the pages with the most dense softmax mass", "[policy][oracle]") {
  const LayerContext ctx = context();
  const Chunk prompt(ctx, 300, 31, /*coherent=*/true);  // 37 full pages and a 4-token one
  const Chunk decode(ctx, 8, 32, /*coherent=*/true);
  const OraclePolicy oracle({.budget_tokens = 64});
  Run run(oracle, ctx, prompt);
  run.append(decode);
  REQUIRE(run.sizes.size() == 39);
  const std::uint32_t group = ctx.group_size(), d = ctx.head_dim;
  const auto key = [&](std::uint32_t t, std::uint32_t h) {
    const Chunk& c = t < 300 ? prompt : decode;
    return c.keys.data() + (std::size_t{t < 300 ? t : t - 300} * ctx.kv_heads + h) * d;
  };
  for (std::uint32_t seed = 0; seed < 6; ++seed) {
    const Vec q = random_query(ctx, 40 + seed);
    const Selection s = run.select(q);
    run.check(s, 64);
    for (std::uint32_t h = 0; h < ctx.kv_heads; ++h) {
      // The group's softmax mass per page, from scratch.
      std::vector<double> mass(run.sizes.size(), 0.0);
      for (std::uint32_t g = 0; g < group; ++g) {
        const float* qh = q.data() + std::size_t{h * group + g} * d;
        std::vector<double> p(308);
        double sum = 0;
        for (std::uint32_t t = 0; t < 308; ++t) {
          double dot = 0;
          for (std::uint32_t i = 0; i < d; ++i) dot += double(qh[i]) * key(t, h)[i];
          sum += p[t] = std::exp(dot / std::sqrt(double(d)));
        }
        for (std::uint32_t t = 0; t < 308; ++t) mass[t < 296 ? t / 8 : t < 300 ? 37 : 38] += p[t] / sum;
      }
      // 64 tokens: the 8 heaviest pages when they are all full; the short
      // page (4 tokens) is taken where it ranks only if it still fits.
      std::vector<PartitionId> order(mass.size());
      std::iota(order.begin(), order.end(), 0u);
      std::stable_sort(order.begin(), order.end(), [&](PartitionId a, PartitionId b) { return mass[a] > mass[b]; });
      std::vector<PartitionId> want;
      std::int64_t left = 64;
      for (PartitionId p : order) {
        if (left <= 0) break;
        if (run.sizes[p] > left) continue;
        want.push_back(p);
        left -= run.sizes[p];
      }
      std::sort(want.begin(), want.end());
      CHECK(s.partitions[h] == want);
    }
  }
  // A budget covering the context selects everything; a zero budget is refused.
  const OraclePolicy all({.budget_tokens = 308});
  Run whole(all, ctx, prompt);
  whole.append(decode);
  for (const auto& chosen : whole.select(random_query(ctx, 9)).partitions) CHECK(chosen == whole.all());
  REQUIRE_SPARSEKV_ERROR(OraclePolicy({.budget_tokens = 0}), ErrorCode::invalid_argument);
  OraclePolicy::LayerState empty;
  Selection none;
  REQUIRE_SPARSEKV_ERROR(oracle.select(ctx, DecodeQuery{random_query(ctx, 1), 8}, empty, none),
                         ErrorCode::invalid_argument);
}

TEST_CASE("A budget covering the context makes Quest and ShadowKV select what Dense selects", "[policy]") {
  const LayerContext ctx = context();
  const Chunk kv(ctx, 300, 12, true);
  const DensePolicy dense;
  const QuestPolicy quest({.budget_tokens = 300 + 3 * 8, .page_tokens_per_partition = 16});
  const ShadowKVPolicy shadow({.budget_tokens = 300 + 3 * 8});
  Run d(dense, ctx, kv);
  Run qr(quest, ctx, kv);
  Run sr(shadow, ctx, kv);
  for (int step = 0; step < 4; ++step) {
    const Vec q = random_query(ctx, 40 + step);
    const Selection ds = d.select(q), qs = qr.select(q), ss = sr.select(q);
    for (std::uint32_t h = 0; h < ctx.kv_heads; ++h) {
      CHECK(ds.partitions[h] == d.all());
      CHECK(ss.partitions[h] == ds.partitions[h]);  // same pages, same partitions
      CHECK(qs.partitions[h] == qr.all());          // every 16-token partition
    }
    if (step < 3) {
      const Chunk page(ctx, 8, 60 + step, true);
      d.append(page);
      qr.append(page);
      sr.append(page);
    }
  }
}

// ---- Index reserves for the request's max_tokens ---------------------------

namespace {

// Where each of a state's growing arrays lives: a reallocation moves one.
std::vector<const void*> homes(const QuestPolicy::LayerState& s) {
  std::vector<const void*> at{s.tokens.data()};
  for (std::size_t h = 0; h < s.ids.size(); ++h)
    at.insert(at.end(), {s.ids[h].data(), s.min[h].data(), s.max[h].data()});
  return at;
}
std::vector<const void*> homes(const ShadowKVPolicy::LayerState& s) {
  std::vector<const void*> at{s.tokens.data()};
  for (std::size_t h = 0; h < s.ids.size(); ++h) {
    at.insert(at.end(), {s.ids[h].data(), s.landmarks[h].data(), s.outlier_score[h].data()});
  }
  return at;
}
std::vector<const void*> homes(const OraclePolicy::LayerState& s) {
  std::vector<const void*> at{s.tokens.data()};
  for (std::size_t h = 0; h < s.ids.size(); ++h) at.insert(at.end(), {s.ids[h].data(), s.keys[h].data()});
  return at;
}

// Index (or a fork's Index) with reserve_tokens 83 past the prompt: the
// eleven decode pages that reach it (the last one partial) append without
// moving any array of the state; the pages past it may.
template <class P>
void check_reserved(const P& policy, bool fork) {
  LayerContext ctx = context();
  const Chunk prompt(ctx, 100, 21);
  ctx.tokens = prompt.tokens;
  ctx.reserve_tokens = prompt.tokens + 83;
  typename P::LayerState state;
  if (fork) {
    typename P::LayerState source;
    LayerContext plain = ctx;
    plain.reserve_tokens = 0;
    policy.index(plain, prompt.view(), source);
    const std::uint32_t reused = policy.reused_tokens(ctx, source);
    REQUIRE(reused > 0);
    const std::size_t row = std::size_t{ctx.kv_heads} * ctx.head_dim;
    const Vec keys(prompt.keys.begin() + reused * row, prompt.keys.end()),
        values(prompt.values.begin() + reused * row, prompt.values.end());
    sparsekv::fork_index(policy, ctx, source,
                         KvView{keys, values, prompt.tokens - reused, ctx.kv_heads, ctx.head_dim, reused}, state);
  } else {
    policy.index(ctx, prompt.view(), state);
  }
  const std::vector<const void*> before = homes(state);
  auto id = static_cast<PartitionId>(state.tokens.size());
  for (std::uint32_t page = 0; page < 11; ++page, ++id) {
    const Chunk kv(ctx, ctx.page_tokens, 30 + page);
    REQUIRE_FALSE(
        policy.append(ctx, AppendedPage{kv.view(), std::vector<PartitionId>(ctx.kv_heads, id)}, state).has_value());
    ctx.tokens += ctx.page_tokens;
    INFO("decode page " << page);
    CHECK(homes(state) == before);
  }
}

}  // namespace

TEST_CASE("Index reserves the summaries for the request's max_tokens: no decode page moves them", "[policy]") {
  const bool fork = GENERATE(false, true);
  CAPTURE(fork);
  check_reserved(QuestPolicy({.budget_tokens = 32}), fork);
  check_reserved(QuestPolicy({.budget_tokens = 32, .page_tokens_per_partition = 16}), fork);
  check_reserved(ShadowKVPolicy({.budget_tokens = 32}), fork);
  check_reserved(OraclePolicy({.budget_tokens = 32}), fork);
}

TEST_CASE("LayerContext::reserved_partitions counts a partition per decode page up to reserve_tokens", "[policy]") {
  LayerContext ctx = context();
  ctx.tokens = 100;
  CHECK(ctx.reserved_partitions(13) == 13);  // no hint
  ctx.reserve_tokens = 100;
  CHECK(ctx.reserved_partitions(13) == 13);
  ctx.reserve_tokens = 101;
  CHECK(ctx.reserved_partitions(13) == 14);
  ctx.reserve_tokens = 100 + 83;
  CHECK(ctx.reserved_partitions(13) == 24);
  ctx.reserve_tokens = 50;  // below the prompt: nothing to add
  CHECK(ctx.reserved_partitions(13) == 13);
}

TEST_CASE("A query with a NaN or an infinity anywhere is refused, naming the value", "[policy]") {
  LayerContext ctx = context();
  const Chunk prompt(ctx, 64, 41);
  ctx.tokens = prompt.tokens;
  const QuestPolicy quest({.budget_tokens = 16});
  const ShadowKVPolicy shadow({.budget_tokens = 16});
  QuestPolicy::LayerState quest_state;
  ShadowKVPolicy::LayerState shadow_state;
  quest.index(ctx, prompt.view(), quest_state);
  shadow.index(ctx, prompt.view(), shadow_state);
  const std::size_t n = std::size_t{ctx.q_heads} * ctx.head_dim;
  for (const std::size_t at : {std::size_t{0}, n / 2 + 3, n - 1}) {
    for (const float bad :
         {std::nanf(""), std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity()}) {
      Vec q = random_query(ctx, 5);
      q[at] = bad;
      const DecodeQuery query{q, ctx.tokens};
      const auto refused = [&](const auto& call) {
        try {
          call();
        } catch (const Error& e) {
          CHECK(e.code() == ErrorCode::invalid_argument);
          return std::string(e.what()).find("query value " + std::to_string(at) + " is not finite") !=
                 std::string::npos;
        }
        return false;
      };
      INFO("value " << at << " = " << bad);
      std::vector<PartitionId> chosen;
      CHECK(refused([&] { quest.select_head(ctx, query, quest_state, 1, chosen); }));
      CHECK(refused([&] { shadow.select_head(ctx, query, shadow_state, 0, chosen); }));
    }
  }
}

TEST_CASE("round_outward keeps what a 16-bit dtype holds and steps one value outward otherwise", "[policy][quest]") {
  const float inf = std::numeric_limits<float>::infinity();
  for (const DType dtype : {DType::f16, DType::bf16}) {
    CAPTURE(to_string(dtype));
    const auto widen = [&](std::uint16_t h) { return load_element(&h, 0, dtype); };
    const auto lower = [&](float x) { return widen(round_outward(x, dtype, BoxSide::lower)); };
    const auto upper = [&](float x) { return widen(round_outward(x, dtype, BoxSide::upper)); };
    std::mt19937 rng(17);
    std::normal_distribution<float> normal(0.0f, 3.0f);
    for (int i = 0; i < 20000; ++i) {
      const float x = i % 4 == 0 ? normal(rng) * 1e-6f : normal(rng);
      const float lo = lower(x), hi = upper(x);
      const float held = widen(dtype == DType::f16 ? float_to_f16(x) : float_to_bf16(x));
      CAPTURE(x, lo, hi);
      if (held == x) {
        REQUIRE((lo == x && hi == x));
      } else {
        REQUIRE((lo < x && x < hi));
        // Adjacent: the nearest value is one of them, and nothing lies between.
        REQUIRE((held == lo || held == hi));
        REQUIRE((upper(lo) == lo && lower(hi) == hi));
      }
    }
    CHECK(std::signbit(lower(-0.0f)));
    CHECK(!std::signbit(upper(0.0f)));
    const float tiny = std::numeric_limits<float>::denorm_min();  // below either dtype's smallest value
    CHECK((lower(tiny) == 0.0f && upper(tiny) > 0.0f));
    CHECK((upper(-tiny) == 0.0f && lower(-tiny) < 0.0f));
    CHECK(std::isnan(lower(std::numeric_limits<float>::quiet_NaN())));
    CHECK((upper(inf) == inf && lower(-inf) == -inf));
  }
  // Past f16's largest value (65504): the lower side stays finite.
  CHECK(load_element(std::array{round_outward(1e6f, DType::f16, BoxSide::lower)}.data(), 0, DType::f16) == 65504.0f);
  CHECK(load_element(std::array{round_outward(1e6f, DType::f16, BoxSide::upper)}.data(), 0, DType::f16) ==
        std::numeric_limits<float>::infinity());
}

TEST_CASE("Quest's boxes in a 16-bit K/V dtype: the fp32 boxes' values in half the bytes, the same selections",
          "[policy][quest]") {
  for (const DType dtype : {DType::f16, DType::bf16}) {
    CAPTURE(to_string(dtype));
    const LayerContext wide = context(2, 8, 2);
    LayerContext narrow = wide;
    narrow.kv_dtype = dtype;
    // Keys as the facade hands them over: widened from the K/V dtype.
    Chunk kv(wide, 400, 9, true);
    for (float& x : kv.keys) {
      std::uint16_t h = 0;
      store_element(&h, 0, dtype, x);
      x = load_element(&h, 0, dtype);
    }
    const QuestPolicy quest({.budget_tokens = 96, .page_tokens_per_partition = 16});
    QuestPolicy::LayerState fp32, half;
    quest.index(wide, kv.view(), fp32);
    quest.index(narrow, kv.view(), half);
    for (std::uint32_t h = 0; h < wide.kv_heads; ++h) {
      REQUIRE(fp32.min[h].dtype() == DType::f32);
      REQUIRE(half.min[h].dtype() == dtype);
      CHECK(half.min[h].bytes() * 2 == fp32.min[h].bytes());
      // Bit for bit: the widened rows stored as fp32 rows again.
      CHECK(BoxRows(DType::f32, wide.head_dim, half.min[h].widened(), BoxSide::lower) == fp32.min[h]);
      CHECK(BoxRows(DType::f32, wide.head_dim, half.max[h].widened(), BoxSide::upper) == fp32.max[h]);
    }
    LayerContext at = wide;
    at.tokens = kv.tokens;
    for (std::uint32_t seed = 0; seed < 24; ++seed) {
      const Vec q = random_query(wide, 100 + seed);
      Selection a, b;
      quest.select(at, DecodeQuery{q, kv.tokens}, fp32, a);
      quest.select(at, DecodeQuery{q, kv.tokens}, half, b);
      CHECK(a.partitions == b.partitions);
    }
  }
}

TEST_CASE("Keys a 16-bit K/V dtype cannot hold get boxes rounded outward that still hold them", "[policy][quest]") {
  LayerContext ctx = context();
  ctx.kv_dtype = DType::f16;
  const Chunk kv(ctx, 100, 4);  // fp32 noise: most values are not f16 values
  const QuestPolicy quest({.budget_tokens = 32});
  QuestPolicy::LayerState state;
  quest.index(ctx, kv.view(), state);
  LayerContext wide = ctx;
  wide.kv_dtype = DType::f32;
  QuestPolicy::LayerState exact;
  quest.index(wide, kv.view(), exact);
  std::size_t rounded = 0;
  for (std::uint32_t h = 0; h < ctx.kv_heads; ++h) {
    for (std::uint32_t t = 0; t < kv.tokens; ++t) {
      const std::uint32_t i = t / ctx.page_tokens;
      for (std::uint32_t d = 0; d < ctx.head_dim; ++d) {
        const float key = kv.view().key(t, h)[d];
        REQUIRE((state.min[h].at(i, d) <= key && key <= state.max[h].at(i, d)));
      }
    }
    for (std::uint32_t i = 0; i < state.min[h].rows(); ++i) {
      for (std::uint32_t d = 0; d < ctx.head_dim; ++d) {
        const float lo = exact.min[h].at(i, d);
        REQUIRE(state.min[h].at(i, d) ==
                load_element(std::array{round_outward(lo, DType::f16, BoxSide::lower)}.data(), 0, DType::f16));
        rounded += state.min[h].at(i, d) != lo ? 1 : 0;
      }
    }
  }
  CHECK(rounded > 0);
}
