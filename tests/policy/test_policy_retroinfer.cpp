#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include "sparsekv/policy/retroinfer.hpp"
#include "test_support.hpp"

using namespace sparsekv;

namespace {

static_assert(SparseAttention<RetroInferPolicy>);
static_assert(CustomAttend<RetroInferPolicy>);
static_assert(DeclaresHeadCapacity<RetroInferPolicy>);

// K/V of one layer, [token][kv_head][dim], as the facade hands them to a policy.
struct Kv {
  std::uint32_t heads = 0;
  std::uint32_t dim = 0;
  std::vector<float> keys, values;

  std::uint32_t tokens() const { return static_cast<std::uint32_t>(keys.size() / (std::size_t{heads} * dim)); }
  float* key(std::uint32_t t, std::uint32_t h) { return keys.data() + (std::size_t{t} * heads + h) * dim; }
  float* value(std::uint32_t t, std::uint32_t h) { return values.data() + (std::size_t{t} * heads + h) * dim; }
  const float* key(std::uint32_t t, std::uint32_t h) const { return keys.data() + (std::size_t{t} * heads + h) * dim; }
  const float* value(std::uint32_t t, std::uint32_t h) const {
    return values.data() + (std::size_t{t} * heads + h) * dim;
  }
  KvView view(std::uint32_t first, std::uint32_t count) const {
    const std::size_t row = std::size_t{heads} * dim;
    KvView v;
    v.keys = std::span<const float>(keys).subspan(first * row, count * row);
    v.values = std::span<const float>(values).subspan(first * row, count * row);
    v.tokens = count;
    v.kv_heads = heads;
    v.head_dim = dim;
    v.first_position = first;
    return v;
  }
};

Kv random_kv(std::uint32_t tokens, std::uint32_t heads, std::uint32_t dim, std::mt19937& rng) {
  std::normal_distribution<float> normal;
  Kv kv{heads, dim, std::vector<float>(std::size_t{tokens} * heads * dim),
        std::vector<float>(std::size_t{tokens} * heads * dim)};
  for (float& x : kv.keys) x = normal(rng);
  for (float& x : kv.values) x = normal(rng);
  return kv;
}

std::vector<float> unit_vector(std::uint32_t dim, std::mt19937& rng) {
  std::normal_distribution<float> normal;
  std::vector<float> u(dim);
  float norm = 0.0f;
  for (float& x : u) {
    x = normal(rng);
    norm += x * x;
  }
  for (float& x : u) x /= std::sqrt(norm);
  return u;
}

LayerContext context(std::uint32_t q_heads, std::uint32_t kv_heads, std::uint32_t dim, std::uint32_t page,
                     std::uint32_t tokens) {
  LayerContext ctx;
  ctx.q_heads = q_heads;
  ctx.kv_heads = kv_heads;
  ctx.head_dim = dim;
  ctx.page_tokens = page;
  ctx.tokens = tokens;
  return ctx;
}

// Which tokens each partition id holds, per kv head, as the library keeps it.
struct Layout {
  std::vector<std::vector<std::vector<std::uint32_t>>> parts;  // [kv head][partition] -> token positions

  explicit Layout(const std::vector<PartitionSpec>& specs) {
    for (const PartitionSpec& spec : specs) {
      auto& head = parts.emplace_back();
      for (std::uint32_t p = 0; p < spec.partition_count(); ++p) {
        auto& tokens = head.emplace_back();
        for (std::uint32_t i = 0; i < spec.size(p); ++i) tokens.push_back(spec.token(p, i));
      }
    }
  }
  std::vector<PartitionId> append_page(std::uint32_t first_token, std::uint32_t page) {
    std::vector<PartitionId> ids;
    for (auto& head : parts) {
      ids.push_back(static_cast<PartitionId>(head.size()));
      auto& tokens = head.emplace_back(page);
      std::iota(tokens.begin(), tokens.end(), first_token);
    }
    return ids;
  }
  void apply(const Repartition& r) {
    REQUIRE(r.first_partitions.size() == parts.size());
    REQUIRE(r.specs.size() == parts.size());
    for (std::size_t h = 0; h < parts.size(); ++h) {
      auto& head = parts[h];
      REQUIRE(r.first_partitions[h] <= head.size());
      std::vector<std::uint32_t> run;
      for (std::size_t p = r.first_partitions[h]; p < head.size(); ++p) {
        run.insert(run.end(), head[p].begin(), head[p].end());
      }
      REQUIRE(run.size() == r.specs[h].token_count());
      head.resize(r.first_partitions[h]);
      for (std::uint32_t p = 0; p < r.specs[h].partition_count(); ++p) {
        auto& tokens = head.emplace_back();
        for (std::uint32_t i = 0; i < r.specs[h].size(p); ++i) tokens.push_back(run[r.specs[h].token(p, i)]);
      }
    }
  }
  std::vector<std::uint32_t> tokens(std::uint32_t h, const std::vector<PartitionId>& ids) const {
    std::vector<std::uint32_t> out;
    for (PartitionId p : ids) {
      REQUIRE(p < parts[h].size());
      out.insert(out.end(), parts[h][p].begin(), parts[h][p].end());
    }
    return out;
  }
  std::uint32_t pages(std::uint32_t h, const std::vector<PartitionId>& ids, std::uint32_t page) const {
    std::uint32_t n = 0;
    for (PartitionId p : ids) n += static_cast<std::uint32_t>((parts[h][p].size() + page - 1) / page);
    return n;
  }
  // Every token once per head.
  void check_covers(std::uint32_t tokens) const {
    for (const auto& head : parts) {
      std::vector<std::uint32_t> all;
      for (const auto& p : head) all.insert(all.end(), p.begin(), p.end());
      std::sort(all.begin(), all.end());
      std::vector<std::uint32_t> expected(tokens);
      std::iota(expected.begin(), expected.end(), 0u);
      REQUIRE(all == expected);
    }
  }
};

// Attention of one q head over `tokens` of kv head h (scores q.k / sqrt(d)),
// merged with `extra` by log-sum-exp, exactly as decode_attention does.
std::vector<float> attention(const Kv& kv, std::uint32_t h, const float* q, const std::vector<std::uint32_t>& tokens,
                             const AttentionPartial* extra) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(kv.dim));
  AttentionPartial state(kv.dim);
  for (std::uint32_t t : tokens) {
    float s = 0.0f;
    for (std::uint32_t i = 0; i < kv.dim; ++i) s += q[i] * kv.key(t, h)[i];
    state.add(s * scale, 1.0f, kv.value(t, h));
  }
  if (extra != nullptr) state.merge(*extra);
  std::vector<float> out(kv.dim);
  state.write_output(out.data());
  return out;
}

std::vector<std::uint32_t> all_tokens(std::uint32_t n) {
  std::vector<std::uint32_t> t(n);
  std::iota(t.begin(), t.end(), 0u);
  return t;
}

float relative_error(const std::vector<float>& a, const std::vector<float>& b) {
  float num = 0.0f, den = 0.0f;
  for (std::size_t i = 0; i < a.size(); ++i) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return std::sqrt(num / den);
}

void check_distinct(const std::vector<PartitionId>& ids, std::uint32_t partitions) {
  std::set<PartitionId> unique(ids.begin(), ids.end());
  REQUIRE(unique.size() == ids.size());
  for (PartitionId p : ids) REQUIRE(p < partitions);
}

}  // namespace

TEST_CASE("spherical k-means recovers planted clusters", "[retroinfer][kmeans]") {
  std::mt19937 rng(7);
  std::normal_distribution<float> noise(0.0f, 0.15f);
  constexpr std::uint32_t dim = 32, clusters = 8, per = 48, n = clusters * per;
  std::vector<std::vector<float>> dirs;
  for (std::uint32_t c = 0; c < clusters; ++c) dirs.push_back(unit_vector(dim, rng));
  std::vector<std::uint32_t> truth(n);
  for (std::uint32_t t = 0; t < n; ++t) truth[t] = t % clusters;
  std::shuffle(truth.begin(), truth.end(), rng);
  std::vector<float> data(std::size_t{n} * dim);
  for (std::uint32_t t = 0; t < n; ++t) {
    for (std::uint32_t i = 0; i < dim; ++i) data[t * dim + i] = 3.0f * dirs[truth[t]][i] + 1.0f + noise(rng);
  }
  const auto labels = spherical_kmeans(data, n, dim, clusters, 10, 42);
  REQUIRE(labels.size() == n);
  REQUIRE(labels[0] == 0);  // numbered by first row
  std::vector<std::uint32_t> found(clusters, ~0u);
  std::set<std::uint32_t> used;
  for (std::uint32_t t = 0; t < n; ++t) {
    if (found[truth[t]] == ~0u) {
      found[truth[t]] = labels[t];
      used.insert(labels[t]);
    }
    REQUIRE(labels[t] == found[truth[t]]);  // pure
  }
  REQUIRE(used.size() == clusters);                                     // and one found cluster per planted one
  REQUIRE(spherical_kmeans(data, n, dim, clusters, 10, 42) == labels);  // deterministic

  // k == n: every row its own cluster; identical rows collapse into one.
  std::vector<float> same(4 * dim, 1.0f);
  const auto one = spherical_kmeans(same, 4, dim, 4, 10, 1);
  REQUIRE(std::all_of(one.begin(), one.end(), [](std::uint32_t l) { return l == 0; }));

  REQUIRE_SPARSEKV_ERROR(spherical_kmeans(data, n, dim, 0, 10, 1), ErrorCode::invalid_argument);
  REQUIRE_SPARSEKV_ERROR(spherical_kmeans(data, n, dim, n + 1, 10, 1), ErrorCode::invalid_argument);
  REQUIRE_SPARSEKV_ERROR(spherical_kmeans(data, n - 1, dim, 4, 10, 1), ErrorCode::invalid_argument);
  REQUIRE_SPARSEKV_ERROR(spherical_kmeans({}, 0, dim, 1, 10, 1), ErrorCode::invalid_argument);
}

TEST_CASE("retroinfer clusters one 8K segment at the paper's defaults", "[retroinfer][kmeans]") {
  // 8192 + 68 tokens x 64 dims: one segment of 8192 tokens, 512 clusters, 10 rounds.
  std::mt19937 rng(3);
  const Kv kv = random_kv(8192 + 68, 1, 64, rng);
  const RetroInferPolicy policy;
  RetroInferPolicy::LayerState state;
  const auto specs = policy.index(context(4, 1, 64, 16, kv.tokens()), kv.view(0, kv.tokens()), state);
  REQUIRE(specs.size() == 1);
  const auto& head = state.heads[0];
  REQUIRE(head.sink.tokens == 4);
  REQUIRE(head.clusters.size() > 480);
  REQUIRE(head.clusters.size() <= 512);
  REQUIRE(head.recent.size() == 4);  // the 64-token window in pages of 16
  std::uint32_t clustered = 0;
  for (const auto& c : head.clusters) clustered += c.tokens;
  REQUIRE(clustered == 8192);
}

TEST_CASE("retroinfer finds planted critical tokens", "[retroinfer]") {
  std::mt19937 rng(11);
  constexpr std::uint32_t n = 4096, kv_heads = 2, q_heads = 8, dim = 64, page = 16;
  Kv kv = random_kv(n, kv_heads, dim, rng);
  const std::vector<float> u = unit_vector(dim, rng);
  const std::vector<std::uint32_t> planted{300, 1500, 2600, 3700};  // two per segment, none steady
  for (std::uint32_t t : planted) {
    for (std::uint32_t i = 0; i < dim; ++i) kv.key(t, 0)[i] = 40.0f * u[i] + 0.1f * kv.key(t, 0)[i];
  }
  RetroInferPolicy::Options options;
  options.budget_tokens = 512;
  options.segment_tokens = 2048;
  const RetroInferPolicy policy(options);
  const LayerContext ctx = context(q_heads, kv_heads, dim, page, n);
  RetroInferPolicy::LayerState state;
  const Layout layout(policy.index(ctx, kv.view(0, n), state));
  layout.check_covers(n);

  std::normal_distribution<float> normal;
  std::vector<float> q(std::size_t{q_heads} * dim);
  for (float& x : q) x = normal(rng);
  for (std::uint32_t g = 0; g < q_heads / kv_heads; ++g) {  // kv head 0's group looks for u
    for (std::uint32_t i = 0; i < dim; ++i) q[g * dim + i] = 8.0f * u[i] + 0.3f * normal(rng);
  }
  Selection selection;
  policy.select(ctx, DecodeQuery{q, n}, state, selection);
  const auto chosen = layout.tokens(0, selection.partitions[0]);
  for (std::uint32_t t : planted) REQUIRE(std::find(chosen.begin(), chosen.end(), t) != chosen.end());
  // The steady zone is in every head's selection.
  for (std::uint32_t h = 0; h < kv_heads; ++h) {
    const auto tokens = layout.tokens(h, selection.partitions[h]);
    for (std::uint32_t t : {0u, 3u, n - 64, n - 1}) REQUIRE(std::find(tokens.begin(), tokens.end(), t) != tokens.end());
    REQUIRE(tokens.size() <= options.budget_tokens);
  }
  // And the sparse output of head 0 matches dense closely (the needle dominates).
  std::vector<AttentionPartial> extra(q_heads);
  policy.attend(ctx, DecodeQuery{q, n}, state, selection, extra);
  const auto sparse = attention(kv, 0, q.data(), chosen, &extra[0]);
  const auto dense = attention(kv, 0, q.data(), all_tokens(n), nullptr);
  REQUIRE(relative_error(sparse, dense) < 1e-3f);
}

TEST_CASE("retroinfer respects its token budget and mandatory pages", "[retroinfer]") {
  std::mt19937 rng(5);
  constexpr std::uint32_t prefill = 2000, decode_pages = 40, kv_heads = 2, q_heads = 4, dim = 32, page = 8;
  constexpr std::uint32_t total = prefill + decode_pages * page;
  const Kv kv = random_kv(total, kv_heads, dim, rng);
  std::normal_distribution<float> normal;
  for (std::uint32_t budget : {0u, 2u, 16u, 70u, 100u, 250u, 600u, 2100u}) {  // 0: no budget, no token cap
    CAPTURE(budget);
    RetroInferPolicy::Options options;
    options.budget_tokens = budget;
    options.segment_tokens = 1024;
    options.update_tokens = 128;
    const RetroInferPolicy policy(options);
    LayerContext ctx = context(q_heads, kv_heads, dim, page, prefill);
    RetroInferPolicy::LayerState state;
    Layout layout(policy.index(ctx, kv.view(0, prefill), state));
    const std::uint32_t bound = policy.mandatory_pages(context(q_heads, kv_heads, dim, page, total));
    std::uint32_t tokens = prefill;
    for (std::uint32_t step = 0; step <= decode_pages; ++step) {
      if (step % 8 == 0) {
        std::vector<float> q(std::size_t{q_heads} * dim);
        for (float& x : q) x = normal(rng);
        Selection selection;
        policy.select(ctx, DecodeQuery{q, tokens}, state, selection);
        REQUIRE(selection.partitions.size() == kv_heads);
        for (std::uint32_t h = 0; h < kv_heads; ++h) {
          check_distinct(selection.partitions[h], state.heads[h].partitions);
          if (budget > 0) REQUIRE(layout.tokens(h, selection.partitions[h]).size() <= budget);
          REQUIRE(layout.pages(h, selection.partitions[h], page) <= bound);
        }
      }
      if (step == decode_pages) break;
      const auto ids = layout.append_page(tokens, page);
      const auto repartition = policy.append(ctx, AppendedPage{kv.view(tokens, page), ids}, state);
      if (repartition) layout.apply(*repartition);
      tokens += page;
      ctx.tokens = tokens;
      layout.check_covers(tokens);
    }
  }
  // At 128K tokens in 16-token pages: a budget's tokens may spread over as
  // many partitions as fit (one-token clusters at worst), each padding a
  // page, so up to the budget in pages.
  const LayerContext long_context = context(32, 8, 128, 16, 128 * 1024);
  RetroInferPolicy::Options budgeted;
  budgeted.budget_tokens = 2048;
  CHECK(RetroInferPolicy(budgeted).mandatory_pages(long_context) == 2048);
  // Without a budget (the defaults) the fraction counts clusters, not tokens:
  // the sink, 6 window pages and 148 of 8194 partitions, their tokens bounded
  // by the context alone, (131072 + 155 * 15) / 16 pages.
  const RetroInferPolicy defaults;
  CHECK(defaults.mandatory_pages(long_context) == 8337);
  CHECK(defaults.mandatory_pages(long_context) <= defaults.head_capacity(long_context).cpu_pages);
}

// 6000 random tokens over 2 kv heads (4 q heads, 32 dims, 16-token pages) and
// one query: some 370 clusters per head in 2048-token segments.
struct SixThousand {
  static constexpr std::uint32_t n = 6000, kv_heads = 2, q_heads = 4, dim = 32, page = 16;
  std::vector<float> q;
  Kv kv;
  LayerContext ctx;
  explicit SixThousand(std::uint32_t seed) : kv(make(seed, q)), ctx(context(q_heads, kv_heads, dim, page, n)) {}

  // Indexes the tokens in 2048-token segments with a budget of `budget`
  // tokens (0: none) into `state`, then selects for the query.
  struct Run {
    RetroInferPolicy::LayerState state;
    Layout layout;
    Selection selection;
  };
  Run run(std::uint32_t budget) const {
    RetroInferPolicy::Options options;
    options.budget_tokens = budget;
    options.segment_tokens = 2048;
    const RetroInferPolicy policy(options);
    RetroInferPolicy::LayerState state;
    Run r{{}, Layout(policy.index(ctx, kv.view(0, n), state)), {}};
    policy.select(ctx, DecodeQuery{q, n}, state, r.selection);
    r.state = std::move(state);
    return r;
  }

 private:
  static Kv make(std::uint32_t seed, std::vector<float>& q) {
    std::mt19937 rng(seed);
    Kv kv = random_kv(n, kv_heads, dim, rng);
    std::normal_distribution<float> normal;
    q.resize(std::size_t{q_heads} * dim);
    for (float& x : q) x = normal(rng);
    return kv;
  }
};

TEST_CASE("RetroInfer's selection grows with the budget", "[retroinfer]") {
  // 6000 tokens in three segments, about 370 clusters per kv head: the
  // paper's 1.8% of them (7 clusters, some 110 tokens, with the 68-token
  // steady zone under 200) would leave every budget from 256 up unspent.
  const SixThousand six(23);
  constexpr std::uint32_t n = SixThousand::n, kv_heads = SixThousand::kv_heads;
  std::vector<std::uint32_t> previous(kv_heads, 0);
  for (const std::uint32_t budget : {128u, 256u, 512u, 1024u, 2048u, n}) {
    CAPTURE(budget);
    const auto [state, layout, selection] = six.run(budget);
    for (std::uint32_t h = 0; h < kv_heads; ++h) {
      const RetroInferPolicy::HeadState& head = state.heads[h];
      std::uint32_t largest = 0;  // the largest ranked partition: a cluster or a recent page
      for (const auto& g : head.clusters) largest = std::max(largest, g.tokens);
      for (const auto& g : head.recent) largest = std::max(largest, g.tokens);
      const auto tokens = static_cast<std::uint32_t>(layout.tokens(h, selection.partitions[h]).size());
      CAPTURE(h, tokens, largest, head.clusters.size());
      REQUIRE(tokens > previous[h]);  // strictly more at each budget
      previous[h] = tokens;
      if (budget >= n) {
        REQUIRE(tokens == n);  // the budget covers the context: Dense
        continue;
      }
      // The budget is spent: what is left is less than the next cluster.
      REQUIRE(tokens <= budget);
      REQUIRE(tokens + largest >= budget);
    }
  }
}

TEST_CASE("RetroInfer without a budget retrieves the paper's fraction of the clusters", "[retroinfer]") {
  REQUIRE(RetroInferPolicy::Options{}.budget_tokens == 0);  // the default: no budget given
  const SixThousand six(29);
  constexpr std::uint32_t n = SixThousand::n, kv_heads = SixThousand::kv_heads;
  const auto [state, layout, selection] = six.run(0);
  for (std::uint32_t h = 0; h < kv_heads; ++h) {
    const RetroInferPolicy::HeadState& head = state.heads[h];
    const auto clusters = static_cast<std::uint32_t>(head.clusters.size());
    CAPTURE(h, clusters);
    REQUIRE(clusters > 300);
    REQUIRE(head.recent.size() == 4);  // the 64-token window, every page steady
    // The sink, the window's 4 pages and ceil(1.8%) of the ranked clusters.
    const auto retrieved = static_cast<std::size_t>(std::ceil(0.018 * clusters));
    REQUIRE(selection.partitions[h].size() == 1 + 4 + retrieved);
    REQUIRE(std::find(selection.partitions[h].begin(), selection.partitions[h].end(), head.sink.id) !=
            selection.partitions[h].end());
    REQUIRE(layout.tokens(h, selection.partitions[h]).size() < n);
  }
}

TEST_CASE("retroinfer's head capacity and mandatory pages bound what it builds and selects", "[retroinfer]") {
  // Random options around the page size: clusters smaller and larger than a
  // page, short windows and frequent updates (re-index runs shorter than a
  // cluster), prompts from one token to several segments.
  std::mt19937 rng(12);
  constexpr std::uint32_t kv_heads = 2, q_heads = 4, dim = 8, total = 700;
  const Kv kv = random_kv(total, kv_heads, dim, rng);
  std::normal_distribution<float> normal;
  const auto pick = [&](std::initializer_list<std::uint32_t> values) {
    return *(values.begin() + rng() % values.size());
  };
  for (int run = 0; run < 300; ++run) {
    RetroInferPolicy::Options o;
    const std::uint32_t page = pick({1, 8, 16, 32, 64});
    o.tokens_per_cluster = pick({3, 16, 40});
    o.segment_tokens = pick({64, 8192});
    o.window_tokens = pick({0, 10, 64});
    o.sink_tokens = pick({0, 4, 20});
    o.update_tokens = pick({8, 50, 1024});
    o.budget_tokens = pick({0, 1, 100, 300, 100000});
    const std::uint32_t prompt = pick({1, 30, 90, 400});
    CAPTURE(run, page, o.tokens_per_cluster, o.segment_tokens, o.window_tokens, o.sink_tokens, o.update_tokens,
            o.budget_tokens, prompt);
    const RetroInferPolicy policy(o);
    const std::uint32_t mandatory = policy.mandatory_pages(context(q_heads, kv_heads, dim, page, total));
    REQUIRE(mandatory <= policy.head_capacity(context(q_heads, kv_heads, dim, page, total)).cpu_pages);
    LayerContext ctx = context(q_heads, kv_heads, dim, page, prompt);
    RetroInferPolicy::LayerState state;
    Layout layout(policy.index(ctx, kv.view(0, prompt), state));
    const auto check_held = [&](std::uint32_t tokens) {
      const HeadCapacity cap = policy.head_capacity(context(q_heads, kv_heads, dim, page, tokens));
      for (std::uint32_t h = 0; h < kv_heads; ++h) {
        std::vector<PartitionId> all(layout.parts[h].size());
        std::iota(all.begin(), all.end(), PartitionId{0});
        REQUIRE(all.size() <= cap.partitions);
        REQUIRE(layout.pages(h, all, page) <= cap.cpu_pages);
      }
    };
    check_held(prompt);
    for (std::uint32_t tokens = prompt; tokens + page <= total;) {
      std::vector<float> q(std::size_t{q_heads} * dim);
      for (float& x : q) x = normal(rng);
      Selection selection;
      policy.select(ctx, DecodeQuery{q, tokens}, state, selection);
      for (std::uint32_t h = 0; h < kv_heads; ++h) REQUIRE(layout.pages(h, selection.partitions[h], page) <= mandatory);
      const auto ids = layout.append_page(tokens, page);
      tokens += page;
      check_held(tokens);  // the saved page, before the re-index it may trigger
      ctx.tokens = tokens;
      if (const auto repartition = policy.append(ctx, AppendedPage{kv.view(tokens - page, page), ids}, state)) {
        layout.apply(*repartition);
        check_held(tokens);
      }
    }
  }
  // Clusters of 16 tokens in 32-token pages: more partitions than pages, up to
  // about three times the pages; in 8-token pages, fewer partitions.
  RetroInferPolicy::Options wide;
  wide.budget_tokens = 64;
  const RetroInferPolicy policy(wide);
  CHECK(policy.head_capacity(context(4, 1, 16, 32, 2048)).partitions == 130);
  CHECK(policy.head_capacity(context(4, 1, 16, 32, 2048)).cpu_pages == 190);
  CHECK(policy.head_capacity(context(4, 1, 16, 8, 1100)).partitions == 139);
  CHECK(policy.head_capacity(context(4, 1, 16, 8, 1100)).cpu_pages == 199);
  REQUIRE_SPARSEKV_ERROR(policy.head_capacity(context(4, 1, 16, 0, 100)), ErrorCode::invalid_argument);
}

TEST_CASE("retroinfer with a budget covering the context equals Dense", "[retroinfer]") {
  std::mt19937 rng(9);
  constexpr std::uint32_t n = 1500, kv_heads = 2, q_heads = 6, dim = 32, page = 8;
  const Kv kv = random_kv(n, kv_heads, dim, rng);
  for (std::uint32_t budget : {n, 4 * n}) {
    RetroInferPolicy::Options options;
    options.budget_tokens = budget;
    const RetroInferPolicy policy(options);
    const LayerContext ctx = context(q_heads, kv_heads, dim, page, n);
    RetroInferPolicy::LayerState state;
    const Layout layout(policy.index(ctx, kv.view(0, n), state));
    std::normal_distribution<float> normal;
    std::vector<float> q(std::size_t{q_heads} * dim);
    for (float& x : q) x = 2.0f * normal(rng);
    Selection selection;
    policy.select(ctx, DecodeQuery{q, n}, state, selection);
    std::vector<AttentionPartial> extra(q_heads);
    policy.attend(ctx, DecodeQuery{q, n}, state, selection, extra);
    for (std::uint32_t h = 0; h < kv_heads; ++h) {
      REQUIRE(selection.partitions[h].size() == state.heads[h].partitions);
      const auto tokens = layout.tokens(h, selection.partitions[h]);
      REQUIRE(tokens.size() == n);
      for (std::uint32_t g = 0; g < q_heads / kv_heads; ++g) {
        const std::uint32_t qh = h * (q_heads / kv_heads) + g;
        REQUIRE(extra[qh].empty());
        const auto sparse = attention(kv, h, q.data() + qh * dim, tokens, &extra[qh]);
        const auto dense = attention(kv, h, q.data() + qh * dim, all_tokens(n), nullptr);
        REQUIRE(relative_error(sparse, dense) < 1e-5f);
      }
    }
  }
}

TEST_CASE("retroinfer's estimation zone lowers the attention error", "[retroinfer]") {
  // Structured keys: 96 directions, tokens scattered over them; values follow
  // their direction. Queries spread their attention over many directions, so
  // the retrieval zone (a 128-token budget: the steady zone and a few of
  // about 250 clusters) misses real mass.
  std::mt19937 rng(21);
  constexpr std::uint32_t n = 4096, kv_heads = 1, q_heads = 4, dim = 64, page = 16, directions = 96;
  std::normal_distribution<float> normal;
  std::vector<std::vector<float>> dir, val;
  for (std::uint32_t c = 0; c < directions; ++c) {
    dir.push_back(unit_vector(dim, rng));
    std::vector<float> v(dim);
    for (float& x : v) x = normal(rng);
    val.push_back(v);
  }
  Kv kv{kv_heads, dim, std::vector<float>(std::size_t{n} * dim), std::vector<float>(std::size_t{n} * dim)};
  std::uniform_int_distribution<std::uint32_t> pick(0, directions - 1);
  for (std::uint32_t t = 0; t < n; ++t) {
    const std::uint32_t c = pick(rng);
    for (std::uint32_t i = 0; i < dim; ++i) {
      kv.key(t, 0)[i] = 6.0f * dir[c][i] + 0.25f * normal(rng);
      kv.value(t, 0)[i] = val[c][i] + 0.3f * normal(rng);
    }
  }
  RetroInferPolicy::Options options;
  options.budget_tokens = 128;
  const RetroInferPolicy policy(options);
  options.estimation = false;
  const RetroInferPolicy retrieval_only(options);
  const LayerContext ctx = context(q_heads, kv_heads, dim, page, n);
  RetroInferPolicy::LayerState state, state_ro;
  const Layout layout(policy.index(ctx, kv.view(0, n), state));
  retrieval_only.index(ctx, kv.view(0, n), state_ro);

  double with = 0.0, without = 0.0;
  std::uint32_t better = 0, samples = 0;
  for (std::uint32_t trial = 0; trial < 8; ++trial) {
    std::vector<float> q(std::size_t{q_heads} * dim, 0.0f);
    for (std::uint32_t g = 0; g < q_heads; ++g) {
      for (std::uint32_t c = 0; c < directions; ++c) {
        const float w = 0.6f * normal(rng);
        for (std::uint32_t i = 0; i < dim; ++i) q[g * dim + i] += w * dir[c][i];
      }
      for (std::uint32_t i = 0; i < dim; ++i) q[g * dim + i] *= std::sqrt(static_cast<float>(dim)) / 6.0f * 2.0f;
    }
    Selection selection, selection_ro;
    policy.select(ctx, DecodeQuery{q, n}, state, selection);
    retrieval_only.select(ctx, DecodeQuery{q, n}, state_ro, selection_ro);
    REQUIRE(selection.partitions == selection_ro.partitions);  // same zones, only the estimate differs
    std::vector<AttentionPartial> extra(q_heads), extra_ro(q_heads);
    policy.attend(ctx, DecodeQuery{q, n}, state, selection, extra);
    retrieval_only.attend(ctx, DecodeQuery{q, n}, state_ro, selection_ro, extra_ro);
    const auto tokens = layout.tokens(0, selection.partitions[0]);
    REQUIRE(tokens.size() <= options.budget_tokens);
    for (std::uint32_t g = 0; g < q_heads; ++g) {
      REQUIRE_FALSE(extra[g].empty());
      REQUIRE(extra_ro[g].empty());
      const auto dense = attention(kv, 0, q.data() + g * dim, all_tokens(n), nullptr);
      const float e = relative_error(attention(kv, 0, q.data() + g * dim, tokens, &extra[g]), dense);
      const float r = relative_error(attention(kv, 0, q.data() + g * dim, tokens, &extra_ro[g]), dense);
      with += e;
      without += r;
      better += e < r ? 1 : 0;
      ++samples;
    }
  }
  with /= samples;
  without /= samples;
  INFO("mean relative L2 error vs dense: retrieval+estimation "
       << with << ", retrieval only " << without << ", estimation better in " << better << "/" << samples);
  CHECK(with < 0.6 * without);
  CHECK(better >= samples * 3 / 4);
}

TEST_CASE("retroinfer clusters each new decode segment", "[retroinfer]") {
  std::mt19937 rng(13);
  constexpr std::uint32_t prefill = 600, kv_heads = 2, q_heads = 4, dim = 16, page = 8, update = 128;
  const Kv kv = random_kv(prefill + 4 * update, kv_heads, dim, rng);
  RetroInferPolicy::Options options;
  options.budget_tokens = 200;
  options.update_tokens = update;
  const RetroInferPolicy policy(options);
  LayerContext ctx = context(q_heads, kv_heads, dim, page, prefill);
  RetroInferPolicy::LayerState state;
  Layout layout(policy.index(ctx, kv.view(0, prefill), state));
  REQUIRE(state.heads[0].recent.size() == 8);  // the 64-token window, one page each
  std::uint32_t tokens = prefill;
  std::uint32_t updates = 0;
  for (std::uint32_t step = 1; step <= 2 * update / page; ++step) {
    const std::vector<std::uint32_t> before = {state.heads[0].partitions, state.heads[1].partitions};
    const std::vector<PartitionId> window_first = {state.heads[0].recent.front().id, state.heads[1].recent.front().id};
    const auto ids = layout.append_page(tokens, page);
    const auto repartition = policy.append(ctx, AppendedPage{kv.view(tokens, page), ids}, state);
    tokens += page;
    ctx.tokens = tokens;
    if (step % (update / page) != 0) {
      REQUIRE_FALSE(repartition);
      for (std::uint32_t h = 0; h < kv_heads; ++h) REQUIRE(state.heads[h].partitions == before[h] + 1);
      continue;
    }
    REQUIRE(repartition);
    ++updates;
    REQUIRE(repartition->first_partitions == window_first);
    for (std::uint32_t h = 0; h < kv_heads; ++h) {
      // The run: the previous window (64 tokens) and the new segment's 128.
      REQUIRE(repartition->specs[h].token_count() == 64 + update);
      // 128 tokens left the window: 8 clusters at most, then the kept 8 window pages.
      const std::uint32_t parts = repartition->specs[h].partition_count();
      REQUIRE(parts <= 8 + 8);
      REQUIRE(parts >= 1 + 8);
      for (std::uint32_t p = parts - 8; p < parts; ++p) REQUIRE(repartition->specs[h].size(p) == page);
    }
    layout.apply(*repartition);
    layout.check_covers(tokens);
    for (std::uint32_t h = 0; h < kv_heads; ++h) {
      const auto& head = state.heads[h];
      REQUIRE(head.partitions == layout.parts[h].size());
      REQUIRE(head.tokens == tokens);
      REQUIRE(head.recent.size() == 8);
      // The kept window is the newest 64 tokens, one page per partition.
      for (std::size_t i = 0; i < head.recent.size(); ++i) {
        const auto& part = layout.parts[h][head.recent[i].id];
        REQUIRE(part.front() == tokens - 64 + i * page);
      }
      // The meta index describes exactly the tokens the library now holds per cluster.
      for (std::size_t c = 0; c < head.clusters.size(); ++c) {
        const auto& part = layout.parts[h][head.clusters[c].id];
        REQUIRE(part.size() == head.clusters[c].tokens);
        for (std::uint32_t i = 0; i < dim; ++i) {
          float mean = 0.0f, sum = 0.0f;
          for (std::uint32_t t : part) {
            mean += kv.key(t, h)[i];
            sum += kv.value(t, h)[i];
          }
          REQUIRE(head.centroids[c * dim + i] == Approx(mean / part.size()).margin(1e-4));
          REQUIRE(head.value_sums[c * dim + i] == Approx(sum).margin(1e-3));
        }
      }
    }
    // The updated index serves selections within the budget.
    std::vector<float> q(std::size_t{q_heads} * dim, 0.5f);
    Selection selection;
    policy.select(ctx, DecodeQuery{q, tokens}, state, selection);
    std::vector<AttentionPartial> extra(q_heads);
    policy.attend(ctx, DecodeQuery{q, tokens}, state, selection, extra);
    for (std::uint32_t h = 0; h < kv_heads; ++h) {
      check_distinct(selection.partitions[h], state.heads[h].partitions);
      REQUIRE(layout.tokens(h, selection.partitions[h]).size() <= options.budget_tokens);
    }
    for (const auto& partial : extra) REQUIRE(partial.acc.size() == dim);
  }
  REQUIRE(updates == 2);
}

TEST_CASE("retroinfer keeps a short prefill steady", "[retroinfer]") {
  std::mt19937 rng(17);
  const Kv kv = random_kv(80, 1, 16, rng);  // 4 sinks + 76 < 4 + 64 + 16
  RetroInferPolicy::Options options;
  options.budget_tokens = 79;
  const RetroInferPolicy policy(options);
  const LayerContext ctx = context(2, 1, 16, 8, 80);
  RetroInferPolicy::LayerState state;
  const Layout layout(policy.index(ctx, kv.view(0, 80), state));
  REQUIRE(state.heads[0].clusters.empty());
  REQUIRE(state.heads[0].sink.tokens == 4);
  REQUIRE(state.window == 76);
  std::vector<float> q(2 * 16, 1.0f);
  Selection selection;
  policy.select(ctx, DecodeQuery{q, 80}, state, selection);
  // Everything is steady; the budget of 79 takes the whole 76-token window,
  // newest first, and leaves out the sinks, which no longer fit.
  REQUIRE(layout.tokens(0, selection.partitions[0]).size() == 80 - 4);
  REQUIRE(selection.partitions[0].front() != state.heads[0].sink.id);

  // A prompt no longer than the sinks is one partition; decode pages follow it.
  RetroInferPolicy::LayerState tiny;
  const auto specs = policy.index(context(2, 1, 16, 8, 3), kv.view(0, 3), tiny);
  REQUIRE(specs.size() == 1);
  REQUIRE(specs[0].partition_count() == 1);
  REQUIRE(tiny.heads[0].sink.tokens == 3);
  REQUIRE_FALSE(policy.append(context(2, 1, 16, 8, 3), AppendedPage{kv.view(3, 8), {1}}, tiny));
  REQUIRE(tiny.heads[0].partitions == 2);
}

TEST_CASE("retroinfer rejects bad input and leaves its state unchanged", "[retroinfer][errors]") {
  const auto with = [](auto change) {
    RetroInferPolicy::Options o;
    change(o);
    return o;
  };
  using O = RetroInferPolicy::Options;
  REQUIRE_NOTHROW(RetroInferPolicy(with([](O& o) { o.budget_tokens = 0; })));  // no budget: the fraction rule
  REQUIRE_SPARSEKV_ERROR(RetroInferPolicy(with([](O& o) { o.tokens_per_cluster = 0; })), ErrorCode::invalid_argument);
  REQUIRE_SPARSEKV_ERROR(RetroInferPolicy(with([](O& o) { o.segment_tokens = 8; })), ErrorCode::invalid_argument);
  REQUIRE_SPARSEKV_ERROR(RetroInferPolicy(with([](O& o) { o.update_tokens = 0; })), ErrorCode::invalid_argument);
  REQUIRE_SPARSEKV_ERROR(RetroInferPolicy(with([](O& o) { o.kmeans_iterations = 0; })), ErrorCode::invalid_argument);
  REQUIRE_SPARSEKV_ERROR(RetroInferPolicy(with([](O& o) { o.retrieval_fraction = -0.1f; })),
                         ErrorCode::invalid_argument);
  REQUIRE_SPARSEKV_ERROR(RetroInferPolicy(with([](O& o) { o.estimation_fraction = 0.99f; })),
                         ErrorCode::invalid_argument);

  std::mt19937 rng(1);
  const Kv kv = random_kv(300, 2, 16, rng);
  const RetroInferPolicy policy;
  const LayerContext ctx = context(4, 2, 16, 8, 300);
  RetroInferPolicy::LayerState state;
  std::vector<float> q(4 * 16, 0.1f);
  Selection selection;
  REQUIRE_SPARSEKV_ERROR(policy.select(ctx, DecodeQuery{q, 0}, state, selection), ErrorCode::failed_precondition);
  REQUIRE_SPARSEKV_ERROR(policy.index(context(4, 3, 16, 8, 300), kv.view(0, 300), state), ErrorCode::invalid_argument);
  REQUIRE_SPARSEKV_ERROR(policy.index(context(4, 2, 8, 8, 300), kv.view(0, 300), state), ErrorCode::invalid_argument);
  REQUIRE_SPARSEKV_ERROR(policy.index(context(3, 2, 16, 8, 300), kv.view(0, 300), state), ErrorCode::invalid_argument);
  REQUIRE_SPARSEKV_ERROR(policy.index(ctx, kv.view(0, 0), state), ErrorCode::invalid_argument);
  KvView short_values = kv.view(0, 300);
  short_values.values = short_values.values.first(10);
  REQUIRE_SPARSEKV_ERROR(policy.index(ctx, short_values, state), ErrorCode::invalid_argument);
  REQUIRE(state.heads.empty());

  policy.index(ctx, kv.view(0, 296), state);
  const RetroInferPolicy::LayerState saved = state;
  const auto same = [&] {
    for (std::uint32_t h = 0; h < 2; ++h) {
      REQUIRE(state.heads[h].partitions == saved.heads[h].partitions);
      REQUIRE(state.heads[h].tokens == saved.heads[h].tokens);
      REQUIRE(state.heads[h].recent.size() == saved.heads[h].recent.size());
      REQUIRE(state.heads[h].recent_keys == saved.heads[h].recent_keys);
    }
    REQUIRE(state.generated == saved.generated);
  };
  const std::vector<PartitionId> next = {state.heads[0].partitions, state.heads[1].partitions};
  REQUIRE_SPARSEKV_ERROR(policy.append(ctx, AppendedPage{kv.view(296, 4), next}, state), ErrorCode::invalid_argument);
  REQUIRE_SPARSEKV_ERROR(policy.append(ctx, AppendedPage{kv.view(292, 8), {next[0]}}, state),
                         ErrorCode::invalid_argument);
  REQUIRE_SPARSEKV_ERROR(policy.append(ctx, AppendedPage{kv.view(292, 8), {next[0], next[1] + 1}}, state),
                         ErrorCode::invalid_argument);
  same();
  REQUIRE_SPARSEKV_ERROR(policy.select(ctx, DecodeQuery{std::span<const float>(q).first(16), 0}, state, selection),
                         ErrorCode::invalid_argument);
  REQUIRE_SPARSEKV_ERROR(policy.select(context(4, 2, 32, 8, 300), DecodeQuery{q, 0}, state, selection),
                         ErrorCode::invalid_argument);
  policy.select(ctx, DecodeQuery{q, 0}, state, selection);
  std::vector<AttentionPartial> extra(3);
  REQUIRE_SPARSEKV_ERROR(policy.attend(ctx, DecodeQuery{q, 0}, state, selection, extra), ErrorCode::invalid_argument);
  REQUIRE_SPARSEKV_ERROR(policy.mandatory_pages(context(4, 2, 16, 0, 300)), ErrorCode::invalid_argument);
  same();
}
