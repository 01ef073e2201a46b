// The Select rules (policy/select_rules.hpp) and a host emulation of the
// select kernels' parallel decomposition (cuda/policy/select_kernels.cu;
// tests/support/select_emulation.hpp):
// per-thread scores, strided block maxima, warp-0 lane sums, ranking rounds
// of a tile (radix-select threshold passes over 8-bit digit histograms, then
// a sort), thread 0's greedy fill, the output sort in runs merged by rank.
// The emulation must equal the host policies' select bit for bit over random
// batches with planted ties, budgets below one partition, covering budgets,
// GQA groups 1..8 and rows longer than a tile, with rows laid end to end and
// scattered over an arena of fixed-capacity regions (another order, spare
// regions and garbage between, a capacity above the counts: the decode
// step's summary store); planted mutations (ties to the higher index, a skip
// that stops the fill, a row read as a CSR up to the next row's first) must
// be caught. The same for RetroInfer's estimate kernel against
// RetroInferPolicy::attend: every max, sum and accumulator element bit for
// bit; planted mutations (retrieved clusters estimated too, the zone folded
// in candidate order) caught. And the summary store's host geometry
// (policy/summary_store_cuda.hpp): shapes and prompt pages checked, regions,
// prompt page token counts, RetroInfer's host rows, and rows over a store
// selecting as the host policies. RetroInfer rows with per-row steady
// windows (RetroInferSelect::windows) against the host policy's select and
// attend on each request's own window. StreamingWindow's and Dense's
// positional selections over a token-counts-only store against their host
// select, bit for bit.
#include <any>
#include <catch2/catch.hpp>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <variant>
#include <vector>

#include "research/oracle.hpp"
#include "select_emulation.hpp"
#include "select_test_data.hpp"
#include "sparsekv/attention/page_fold.hpp"
#include "sparsekv/core/numeric.hpp"
#include "sparsekv/policy/any_policy.hpp"
#include "sparsekv/policy/box_rows.hpp"
#include "sparsekv/policy/device_select.hpp"
#include "sparsekv/policy/index_cuda.hpp"
#include "sparsekv/policy/select_cuda.hpp"
#include "sparsekv/policy/select_rules.hpp"
#include "sparsekv/policy/select_scoring.hpp"
#include "sparsekv/policy/summary_store_cuda.hpp"
#include "sparsekv/policy/dense.hpp"
#include "sparsekv/policy/quest.hpp"
#include "sparsekv/policy/retroinfer.hpp"
#include "sparsekv/policy/shadowkv.hpp"
#include "sparsekv/policy/streaming_window.hpp"
#include "test_support.hpp"

using namespace sparsekv;
using namespace sparsekv::test;

namespace {

// ---- sweeps: emulation against the host policies ------------------------------------

constexpr std::uint32_t kGroups[] = {1, 2, 4, 8};
// One piece of the logits kernel (8, 32), and three with a tail past the last whole 8 (76).
constexpr std::uint32_t sweep_head_dim(std::uint32_t group) { return group == 8 ? 8 : group == 2 ? 76 : 32; }

// How a sweep lays its rows out: end to end in row order (a CSR would
// address them too), or scattered over an arena of fixed-capacity regions
// as the decode step keeps them (in_arena: another order, spare regions and
// garbage between, a capacity above the counts).
enum class Layout { end_to_end, arena };

HostRows laid_out(HostRows rows, Layout layout, std::mt19937& rng) {
  if (layout == Layout::end_to_end) return rows;
  return in_arena(rows, 1 + static_cast<std::uint32_t>(rng() % 9), 1 + rows.rows() / 2, rng);
}

// Rows where the emulation differs from the host policy.
struct Sweep {
  std::uint32_t rows = 0, differing = 0;
  void compare(const std::vector<PartitionId>& got, const std::vector<PartitionId>& want) {
    ++rows;
    if (got != want) ++differing;
  }
};

std::uint32_t covering(const std::vector<std::uint32_t>& sizes) {
  std::uint32_t total = 0;
  for (auto s : sizes) total += s;
  return total;
}

Sweep quest_sweep(const Emulation& e, std::uint32_t seed, Layout layout = Layout::end_to_end) {
  std::mt19937 rng(seed);
  std::mt19937 arena_rng(seed + 1000);  // apart: both layouts see the same batches
  Sweep sweep;
  for (const std::uint32_t group : kGroups) {
    for (const std::uint32_t n : {1u, 2u, 19u, 300u, 2300u}) {
      const LayerContext base = layer_context(2, sweep_head_dim(group), 8, group);
      std::vector<SelectRequest<QuestPolicy::LayerState>> batch;
      for (int b = 0; b < 2; ++b) batch.push_back(quest_request(base, n, 16, rng));
      const std::uint32_t total = covering(batch[0].state.tokens);
      const HostRows rows = laid_out(quest_rows(base, batch), layout, arena_rng);
      for (const std::uint32_t budget : {1u, 8u, 64u, 700u, total, total + 5}) {
        for (const std::uint32_t layer : {0u, 5u}) {
          // The paper's rule (no steady zone, the bound), the defaults, and a
          // sink over two partitions with a window of most of the budget and
          // the box centre's score.
          for (const auto& [sink, recent, spread] :
               {std::tuple{0u, 0.0f, 1.0f}, std::tuple{4u, 0.25f, 0.5f}, std::tuple{20u, 0.75f, 0.0f}}) {
            LayerContext ctx = base;
            ctx.layer = layer;
            QuestPolicy::Options options;
            options.budget_tokens = budget;
            options.sink_tokens = sink;
            options.recent_fraction = recent;
            options.spread = spread;
            const QuestPolicy policy(options);
            const auto want = host_select(policy, ctx, batch);
            const cuda::QuestSelect quest{
                nullptr, nullptr, budget, layer < options.dense_layers, sink, policy.window_tokens(), spread};
            for (std::uint32_t r = 0; r < rows.rows(); ++r) sweep.compare(emulate_quest(e, rows, r, quest), want[r]);
          }
        }
      }
    }
  }
  return sweep;
}

Sweep shadowkv_sweep(const Emulation& e, std::uint32_t seed, Layout layout = Layout::end_to_end) {
  std::mt19937 rng(seed);
  std::mt19937 arena_rng(seed + 1000);  // apart: both layouts see the same batches
  Sweep sweep;
  for (const std::uint32_t group : kGroups) {
    for (const std::uint32_t n : {1u, 3u, 40u, 500u, 2200u}) {
      const LayerContext ctx = layer_context(2, sweep_head_dim(group), 8, group);
      std::vector<SelectRequest<ShadowKVPolicy::LayerState>> batch;
      for (int b = 0; b < 2; ++b) batch.push_back(shadowkv_request(ctx, n, rng));
      const std::uint32_t total = covering(batch[0].state.tokens);
      const HostRows rows = laid_out(shadowkv_rows(ctx, batch), layout, arena_rng);
      for (const std::uint32_t budget : {1u, 4u, 16u, 200u, 2048u, total}) {
        for (const std::uint32_t recent : {0u, 32u}) {
          ShadowKVPolicy::Options options;
          options.budget_tokens = budget;
          options.recent_tokens = recent;
          options.outlier_pages = rng() % 2 == 0 ? 48 : 300;
          const ShadowKVPolicy policy(options);
          const auto want = host_select(policy, ctx, batch);
          const cuda::ShadowKVSelect shadowkv{nullptr, nullptr, budget, recent, policy.outlier_count()};
          for (std::uint32_t r = 0; r < rows.rows(); ++r) {
            sweep.compare(emulate_shadowkv(e, rows, r, shadowkv), want[r]);
          }
        }
      }
    }
  }
  return sweep;
}

Sweep retroinfer_sweep(const Emulation& e, std::uint32_t seed, Layout layout = Layout::end_to_end) {
  std::mt19937 rng(seed);
  std::mt19937 arena_rng(seed + 1000);  // apart: both layouts see the same batches
  Sweep sweep;
  for (const std::uint32_t group : kGroups) {
    for (const std::uint32_t clusters : {0u, 6u, 250u, 2400u}) {
      for (const std::uint32_t recent : {0u, 3u, 12u}) {
        const LayerContext ctx = layer_context(2, group == 8 ? 12 : 36, 8, group);
        const std::uint32_t window = recent == 3 ? 16 : 64;
        std::vector<SelectRequest<RetroInferPolicy::LayerState>> batch;
        for (int b = 0; b < 2; ++b) batch.push_back(retroinfer_request(ctx, clusters, recent, window, rng));
        const std::uint32_t total = std::max(1u, batch[0].state.heads[0].tokens);
        const HostRows rows = laid_out(retroinfer_rows(ctx, batch), layout, arena_rng);
        for (const std::uint32_t budget : {0u, 1u, 3u, 40u, 300u, 2048u, total}) {  // 0: the fraction rule
          for (const float fraction : {0.018f, 0.3f, 1.0f}) {
            RetroInferPolicy::Options options;
            options.budget_tokens = budget;
            options.retrieval_fraction = fraction;
            options.estimation_fraction = 0.0f;
            const auto want = host_select(RetroInferPolicy(options), ctx, batch);
            const cuda::RetroInferSelect retro{nullptr, nullptr, nullptr, nullptr, budget, window, fraction};
            for (std::uint32_t r = 0; r < rows.rows(); ++r) {
              sweep.compare(emulate_retroinfer(e, rows, r, retro), want[r]);
            }
          }
        }
      }
    }
  }
  return sweep;
}

// ---- the decode step's summary store (policy/summary_store_cuda.hpp) ------------------

// A request of the store: its slot and the host policy's state, indexed from
// a random prompt and grown by `appended` decode pages, ids 0, 1, ... as the
// store numbers a region's pages.
template <class State>
struct StoredRequest {
  std::uint32_t slot = 0, prompt = 0;
  std::vector<float> q;
  State state;
};

template <class Policy, class State>
StoredRequest<State> stored_request(const Policy& policy, const LayerContext& base, std::uint32_t slot,
                                    std::uint32_t prompt, std::uint32_t appended, std::mt19937& rng) {
  StoredRequest<State> r;
  r.slot = slot;
  r.prompt = prompt;
  r.q = random_values(std::size_t{base.q_heads} * base.head_dim, rng);
  LayerContext ctx = base;
  ctx.tokens = prompt;
  const std::vector<float> keys = random_values(std::size_t{prompt} * ctx.kv_heads * ctx.head_dim, rng);
  policy.index(ctx, key_view(keys, prompt, ctx), r.state);
  for (std::uint32_t page = 0; page < appended; ++page) {
    ctx.tokens += ctx.page_tokens;
    const std::vector<float> page_keys = random_values(std::size_t{ctx.page_tokens} * ctx.kv_heads * ctx.head_dim, rng);
    const auto id = static_cast<PartitionId>(r.state.tokens.size());
    const AppendedPage appended{key_view(page_keys, ctx.page_tokens, ctx), std::vector<PartitionId>(ctx.kv_heads, id)};
    policy.append(ctx, appended, r.state);
  }
  return r;
}

// One layer of the store on the host, garbage in every candidate first; then
// per request and kv head what the device writes into region(slot, h):
// write_prefill's token counts (prefill_page_tokens) and the append kernel's
// (page_tokens), the summaries (the index and append kernels equal the
// policies bit for bit: test_index_rules.cpp, test_append_rules.cpp), the
// identity ids of construction. Rows (b, h) in batch order, first = the
// region, count = the request's pages, max_row = the capacity.
template <class State, class Summaries>
HostRows store_rows(const cuda::SummaryShape& shape, const LayerContext& ctx,
                    const std::vector<StoredRequest<State>>& batch, std::uint32_t b_width, Summaries summaries,
                    std::mt19937& rng) {
  HostRows rows = store_layer(shape, ctx, rng);
  rows.b_width = b_width;
  const std::size_t extent = shape.candidates();
  rows.a = random_values(extent * ctx.head_dim, rng, 64.0f);
  rows.b = random_values(extent * b_width, rng, 64.0f);
  for (const auto& r : batch) {
    rows.q.insert(rows.q.end(), r.q.begin(), r.q.end());
    const auto n = static_cast<std::uint32_t>(r.state.tokens.size());
    const std::uint32_t prompt_pages = cuda::page_count(r.prompt, ctx.page_tokens);
    for (std::uint32_t h = 0; h < ctx.kv_heads; ++h) {
      const std::uint32_t first = shape.region(r.slot, h);
      for (std::uint32_t p = 0; p < n; ++p) {
        rows.tokens[first + p] =
            p < prompt_pages ? cuda::prefill_page_tokens(p, r.prompt, ctx.page_tokens) : ctx.page_tokens;
      }
      const auto [a, b] = summaries(r.state, h);
      std::copy(a.begin(), a.end(), rows.a.begin() + std::size_t{first} * ctx.head_dim);
      std::copy(b.begin(), b.end(), rows.b.begin() + std::size_t{first} * b_width);
      rows.first.push_back(first);
      rows.count.push_back(n);
    }
  }
  return rows;
}

// Requests in slots out of row order (other slots garbage), prompts with a
// partial last page and whole pages, a few appended pages; Quest and ShadowKV
// over the store's rows against their host select.
Sweep store_sweep(const Emulation& e, std::uint32_t seed) {
  std::mt19937 rng(seed);
  Sweep sweep;
  for (const std::uint32_t group : {1u, 2u, 4u}) {
    LayerContext ctx = layer_context(2, 32, 8, group);
    ctx.layer = 5;  // past Quest's dense layers
    ctx.layers = 8;
    const cuda::SummaryShape shape{cuda::AppendSummary::quest, 1, 5, ctx.kv_heads, ctx.head_dim, 80};
    const std::uint32_t slots[] = {3, 0, 4}, prompts[] = {9, 64, 555}, appended[] = {3, 0, 6};
    QuestPolicy::Options quest_options;
    quest_options.page_tokens_per_partition = ctx.page_tokens;
    const QuestPolicy quest_indexer(quest_options);
    std::vector<StoredRequest<QuestPolicy::LayerState>> quest_batch;
    std::vector<StoredRequest<ShadowKVPolicy::LayerState>> shadowkv_batch;
    for (int b = 0; b < 3; ++b) {
      quest_batch.push_back(stored_request<QuestPolicy, QuestPolicy::LayerState>(quest_indexer, ctx, slots[b],
                                                                                 prompts[b], appended[b], rng));
      shadowkv_batch.push_back(stored_request<ShadowKVPolicy, ShadowKVPolicy::LayerState>(
          ShadowKVPolicy(), ctx, slots[b], prompts[b], appended[b], rng));
    }
    const HostRows quest_rows = store_rows(
        shape, ctx, quest_batch, ctx.head_dim,
        [](const QuestPolicy::LayerState& s, std::uint32_t h) {
          return std::pair{s.min[h].widened(), s.max[h].widened()};
        },
        rng);
    const HostRows shadowkv_rows = store_rows(
        shape, ctx, shadowkv_batch, 1,
        [](const ShadowKVPolicy::LayerState& s, std::uint32_t h) {
          return std::pair{s.landmarks[h], s.outlier_score[h]};
        },
        rng);
    for (const std::uint32_t budget : {1u, 16u, 100u, 400u, 100000u}) {
      QuestPolicy::Options q = quest_options;
      q.budget_tokens = budget;
      ShadowKVPolicy::Options o;
      o.budget_tokens = budget;
      const QuestPolicy quest(q);
      const ShadowKVPolicy shadowkv(o);
      const cuda::QuestSelect quest_select{nullptr, nullptr, budget, false, q.sink_tokens, quest.window_tokens(),
                                           q.spread};
      const cuda::ShadowKVSelect shadowkv_select{nullptr, nullptr, budget, o.recent_tokens, shadowkv.outlier_count()};
      for (std::uint32_t b = 0; b < 3; ++b) {
        LayerContext at = ctx;
        at.tokens = prompts[b] + appended[b] * ctx.page_tokens;
        Selection want_quest, want_shadowkv;
        quest.select(at, DecodeQuery{quest_batch[b].q, 0}, quest_batch[b].state, want_quest);
        shadowkv.select(at, DecodeQuery{shadowkv_batch[b].q, 0}, shadowkv_batch[b].state, want_shadowkv);
        for (std::uint32_t h = 0; h < ctx.kv_heads; ++h) {
          const std::uint32_t r = b * ctx.kv_heads + h;
          sweep.compare(emulate_quest(e, quest_rows, r, quest_select), want_quest.partitions[h]);
          sweep.compare(emulate_shadowkv(e, shadowkv_rows, r, shadowkv_select), want_shadowkv.partitions[h]);
        }
      }
    }
  }
  return sweep;
}

// ---- the positional selections: StreamingWindow and Dense ---------------------------

// The shapes of the streaming selections a sweep met: a gap between the
// sinks and the window (the policy's point), a window alone, everything.
struct PositionalSweep {
  Sweep sweep;
  std::uint32_t gapped = 0, window_only = 0, whole = 0;
};

// Requests in slots out of row order (other slots garbage), prompts of one
// token, a partial last page, whole pages and a long one, 0..10 appended
// pages; page_tokens 1, 4 and 8; sinks within a page, on a boundary, past it;
// budgets below one page up to covering. StreamingWindow with the spec
// device_select gives, and Dense, against their host select.
PositionalSweep positional_sweep(const Emulation& e, std::uint32_t seed) {
  std::mt19937 rng(seed);
  PositionalSweep out;
  for (const std::uint32_t page_tokens : {1u, 4u, 8u}) {
    const LayerContext ctx = layer_context(2, 8, page_tokens, 2);
    const cuda::SummaryShape shape{cuda::AppendSummary::tokens, 1, 6, ctx.kv_heads, ctx.head_dim, 320};
    const std::uint32_t slots[] = {4, 0, 2, 5}, prompts[] = {1, 7, 9, 300}, appended[] = {0, 3, 10, 1};
    std::vector<PositionalRequest<StreamingWindowPolicy>> streaming_batch;
    std::vector<PositionalRequest<DensePolicy>> dense_batch;
    for (int b = 0; b < 4; ++b) {
      streaming_batch.push_back(positional_request(StreamingWindowPolicy(), ctx, slots[b], prompts[b], appended[b]));
      dense_batch.push_back(positional_request(DensePolicy(), ctx, slots[b], prompts[b], appended[b]));
    }
    const HostRows rows = positional_rows(shape, ctx, streaming_batch, rng);
    const DensePolicy dense;
    const auto want_dense = host_select(dense, ctx, dense_batch);
    REQUIRE(device_select(dense, ctx).holds<DenseDeviceSelect>());
    for (std::uint32_t r = 0; r < rows.rows(); ++r)
      out.sweep.compare(emulate_positional(e, rows, r, nullptr), want_dense[r]);
    for (const std::uint32_t budget : {1u, 2u, 3u, 5u, 8u, 17u, 64u, 100u, 1000u, 100000u}) {
      for (const std::uint32_t sinks : {0u, 1u, 3u, 4u, 8u, 9u, 40u}) {
        StreamingWindowPolicy::Options options;
        options.budget_tokens = budget;
        options.sink_tokens = sinks;
        const StreamingWindowPolicy policy(options);
        const DeviceSelect select = device_select(policy, ctx);
        REQUIRE(select.holds<StreamingDeviceSelect>());
        const auto& spec = select.get<StreamingDeviceSelect>();
        const cuda::StreamingSelect streaming{spec.budget_tokens, spec.sink_pages, ctx.page_tokens};
        const auto want = host_select(policy, ctx, streaming_batch);
        for (std::uint32_t r = 0; r < rows.rows(); ++r) {
          const auto got = emulate_positional(e, rows, r, &streaming);
          out.sweep.compare(got, want[r]);
          // Within the capacity the runtime sizes its selection for.
          CHECK(got.size() <= std::max(1u, (budget + page_tokens - 1) / page_tokens));
          const std::uint32_t n = rows.count[r];
          bool gap = false;
          for (std::size_t j = 1; j < got.size(); ++j) gap = gap || got[j] != got[j - 1] + 1;
          if (gap) ++out.gapped;
          if (!got.empty() && got.front() != 0 && got.back() == n - 1) ++out.window_only;
          if (got.size() == n) ++out.whole;
        }
      }
    }
  }
  return out;
}

// Rows of estimation terms that differ from the host's in any bit, and how
// many terms were not empty.
struct EstimateSweep {
  std::uint32_t rows = 0, differing = 0, terms = 0, nonempty = 0;
};

bool same_term(const AttentionPartial& a, const AttentionPartial& b) {
  return same_bits(a.max, b.max) && same_bits(a.sum, b.sum) && same_bits(a.acc, b.acc);
}

// RetroInfer rows with budgets from 1 token to covering, zones from the
// default split to everything, estimation on and off.
EstimateSweep estimate_sweep(const Emulation& e, std::uint32_t seed, Layout layout = Layout::end_to_end) {
  struct Zones {
    float retrieval, estimation;
  };
  constexpr Zones kZones[] = {{0.018f, 0.232f}, {0.3f, 0.7f}, {0.0f, 1.0f}};
  std::mt19937 rng(seed);
  std::mt19937 arena_rng(seed + 1000);  // apart: both layouts see the same batches
  EstimateSweep sweep;
  for (const std::uint32_t group : kGroups) {
    for (const std::uint32_t clusters : {0u, 7u, 300u, 2400u}) {
      for (const std::uint32_t recent : {0u, 3u, 12u}) {
        const LayerContext ctx = layer_context(2, group == 8 ? 12 : 36, 8, group);
        const std::uint32_t window = recent == 3 ? 16 : 64;
        std::vector<SelectRequest<RetroInferPolicy::LayerState>> batch;
        for (int b = 0; b < 2; ++b) batch.push_back(retroinfer_request(ctx, clusters, recent, window, rng));
        const HostRows rows = laid_out(retroinfer_rows(ctx, batch), layout, arena_rng);
        const std::uint32_t total = std::max(1u, batch[0].state.heads[0].tokens);
        for (const std::uint32_t budget : {0u, 1u, 40u, 300u, 2048u, total}) {  // 0: the fraction rule
          for (const Zones zones : kZones) {
            for (const bool estimation : {true, false}) {
              if (!estimation && zones.retrieval != kZones[0].retrieval) continue;
              RetroInferPolicy::Options options;
              options.budget_tokens = budget;
              options.retrieval_fraction = zones.retrieval;
              options.estimation_fraction = zones.estimation;
              options.estimation = estimation;
              const RetroInferPolicy policy(options);
              const auto selections = host_select(policy, ctx, batch);
              const auto want = host_estimate(policy, ctx, batch);
              const cuda::RetroInferSelect retro{nullptr, nullptr, nullptr, nullptr, budget, window, zones.retrieval};
              const cuda::RetroInferEstimate estimate{nullptr, nullptr, nullptr, 0, zones.estimation, estimation};
              for (std::uint32_t r = 0; r < rows.rows(); ++r) {
                const auto got = emulate_estimate(e, rows, r, retro, estimate, selections[r]);
                bool same = true;
                for (std::uint32_t j = 0; j < group; ++j) {
                  const AttentionPartial& host = want[std::size_t{r} * group + j];
                  same = same && same_term(got[j], host);
                  ++sweep.terms;
                  if (!host.empty()) ++sweep.nonempty;
                }
                ++sweep.rows;
                if (!same) ++sweep.differing;
              }
            }
          }
        }
      }
    }
  }
  return sweep;
}

// Distance in representable floats (same sign, finite).
std::int64_t ulps(float a, float b) {
  return std::abs(static_cast<std::int64_t>(float_bits(a)) - static_cast<std::int64_t>(float_bits(b)));
}

}  // namespace

TEST_CASE("portable_exp is within 2 ulp of exp and exact at the edges", "[select-rules]") {
  std::int64_t worst = 0;
  for (float x = -103.9f; x < 88.7f; x = std::nextafter(x, 100.0f) + 1e-4f * std::abs(x) + 1e-7f) {
    const auto want = static_cast<float>(std::exp(static_cast<double>(x)));
    worst = std::max(worst, ulps(portable_exp(x), want));
  }
  for (float x = -1.0f; x < 1.0f; x += 1.0f / 4096.0f) {
    worst = std::max(worst, ulps(portable_exp(x), static_cast<float>(std::exp(static_cast<double>(x)))));
  }
  INFO("worst ulp distance " << worst);
  CHECK(worst <= 2);
  CHECK(portable_exp(0.0f) == 1.0f);
  CHECK(portable_exp(-0.0f) == 1.0f);
  CHECK(portable_exp(-std::numeric_limits<float>::infinity()) == 0.0f);
  CHECK(portable_exp(-200.0f) == 0.0f);
  CHECK(std::isinf(portable_exp(89.0f)));
  CHECK(std::isnan(portable_exp(std::numeric_limits<float>::quiet_NaN())));
  CHECK(portable_exp(88.7f) > 1e38f);  // k = 128: scaled in two steps, not an inf exponent
}

TEST_CASE("lane sums add lane i % 32 in order, then a fixed tree", "[select-rules]") {
  std::mt19937 rng(3);
  for (const std::uint32_t n : {0u, 1u, 31u, 32u, 33u, 100u, 1000u}) {
    const std::vector<float> v = random_values(n, rng, 1e3f);
    const auto odd = [](std::uint32_t i) { return i % 3 != 1; };
    const auto value = [&](std::uint32_t i) { return v[i]; };
    // The tree by hand: lane l + 16, then + 8, 4, 2, 1.
    float lanes[kSumLanes] = {};
    for (std::uint32_t i = 0; i < n; ++i) {
      if (odd(i)) lanes[i % kSumLanes] += v[i];
    }
    for (std::uint32_t offset : {16u, 8u, 4u, 2u, 1u}) {
      for (std::uint32_t l = 0; l < offset; ++l) lanes[l] += lanes[l + offset];
    }
    CHECK(same_bits(lane_sum<float>(n, value, odd), lanes[0]));
    CHECK(same_bits(emulated_lane_sum<float>(n, value, odd), lanes[0]));
  }
  // The order matters: a sequential sum of these differs.
  std::vector<float> v(64, 1.0f);
  v[0] = 1e8f;
  float sequential = 0.0f;
  for (float x : v) sequential += x;
  const float lanes = lane_sum<float>(
      64, [&](std::uint32_t i) { return v[i]; }, [](std::uint32_t) { return true; });
  CHECK(sequential == 1e8f);
  CHECK(lanes > sequential);
}

TEST_CASE("rank keys order by descending score, ties to the lower index", "[select-rules]") {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  CHECK(rank_key(2.0f, 5) < rank_key(1.0f, 0));
  CHECK(rank_key(1.0f, 3) < rank_key(1.0f, 4));
  CHECK(rank_key(-0.0f, 3) < rank_key(0.0f, 4));  // -0 and +0 tie
  CHECK(rank_key(0.0f, 3) < rank_key(-0.0f, 4));
  CHECK(rank_key(inf, 9) < rank_key(3e38f, 0));
  CHECK(rank_key(-inf, 9) < rank_key(nan, 0));  // NaN last
  CHECK(rank_key(-1.0f, 0) < rank_key(-2.0f, 0));
  CHECK(rank_key_index(rank_key(-1.5f, 77)) == 77);
  // score_order_bits (branch-free) orders any two floats as < does, over
  // random bit patterns: subnormals, infinities and NaNs included.
  std::mt19937 bits_rng(9);
  for (int i = 0; i < 200000; ++i) {
    const float a = std::bit_cast<float>(static_cast<std::uint32_t>(bits_rng()));
    const float b = i % 4 == 0 ? -a : std::bit_cast<float>(static_cast<std::uint32_t>(bits_rng()));
    CAPTURE(a, b);
    if (std::isnan(a)) {
      REQUIRE(score_order_bits(a) == 0);
    } else if (!std::isnan(b)) {
      REQUIRE((score_order_bits(a) < score_order_bits(b)) == (a < b));
      REQUIRE((score_order_bits(a) == score_order_bits(b)) == (a == b));
      REQUIRE(score_order_bits(a) > 0);
    }
  }
  // The same order as top_k on finite scores with ties.
  std::mt19937 rng(4);
  std::vector<float> scores(500);
  for (float& s : scores) s = static_cast<float>(static_cast<int>(rng() % 40) - 20) * 0.25f;
  std::vector<std::uint64_t> keys;
  for (std::uint32_t i = 0; i < scores.size(); ++i) keys.push_back(rank_key(scores[i], i));
  std::sort(keys.begin(), keys.end());
  const auto want = top_k(scores, 500);
  for (std::uint32_t j = 0; j < 500; ++j) REQUIRE(rank_key_index(keys[j]) == want[j]);
}

// The fill over a full sort of the keys: what ranked_fill's rounds of
// partial selection must offer, in the same order.
template <class Filler>
std::vector<std::uint32_t> fill_over_full_sort(const std::vector<float>& scores, const std::vector<char>& eligible,
                                               const std::vector<std::uint32_t>& tokens, Filler fill) {
  std::vector<std::uint64_t> keys;
  for (std::uint32_t i = 0; i < scores.size(); ++i) {
    if (eligible[i]) keys.push_back(rank_key(scores[i], i));
  }
  std::sort(keys.begin(), keys.end());
  std::vector<std::uint32_t> taken;
  for (const std::uint64_t key : keys) {
    const std::uint32_t i = rank_key_index(key);
    const Fill f = fill.offer(tokens[i]);
    if (f == Fill::stop) break;
    if (f == Fill::take) taken.push_back(i);
  }
  return taken;
}

TEST_CASE("ranked_fill's partial selection takes what a full sort takes, in order", "[select-rules]") {
  std::mt19937 rng(11);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (int trial = 0; trial < 400; ++trial) {
    const std::uint32_t n = 1 + rng() % 1500;
    std::vector<float> scores(n);
    std::vector<char> eligible(n);
    std::vector<std::uint32_t> tokens(n);
    for (std::uint32_t i = 0; i < n; ++i) {
      const std::uint32_t r = rng() % 100;
      // Ties, NaN and infinities as well as spread values.
      scores[i] = r < 3 ? nan : r < 5 ? -std::numeric_limits<float>::infinity() : static_cast<float>(rng() % 64) * 0.5f;
      eligible[i] = rng() % 8 != 0;
      // Pages of 8 tokens but a last partial one (a prompt's), as Select sees them, or any size.
      tokens[i] = trial % 4 == 1 ? (i + 1 == n ? 1 + rng() % 8 : 8) : 1 + rng() % 16;
    }
    const std::int64_t budget = rng() % (16 * n + 1);
    const std::uint32_t limit = trial % 3 == 0 ? std::numeric_limits<std::uint32_t>::max() : rng() % (n + 1);
    const auto score = [&](std::uint32_t i) { return scores[i]; };
    const auto is_eligible = [&](std::uint32_t i) { return eligible[i] != 0; };
    const auto token_count = [&](std::uint32_t i) { return tokens[i]; };
    {
      std::vector<std::uint32_t> taken;
      SkipFill fill{budget, limit};
      ranked_fill(n, fill, score, is_eligible, token_count, [&](std::uint32_t i) { taken.push_back(i); });
      REQUIRE(taken == fill_over_full_sort(scores, eligible, tokens, SkipFill{budget, limit}));
    }
    {
      std::vector<std::uint32_t> taken;
      BreakFill fill{0, static_cast<std::uint32_t>(budget), limit};
      ranked_fill(n, fill, score, is_eligible, token_count, [&](std::uint32_t i) { taken.push_back(i); });
      REQUIRE(taken ==
              fill_over_full_sort(scores, eligible, tokens, BreakFill{0, static_cast<std::uint32_t>(budget), limit}));
    }
  }
}

TEST_CASE("tile thresholds pick the kth smallest key", "[select-rules]") {
  std::mt19937 rng(5);
  for (const std::uint32_t n : {2u, 17u, 300u, 5000u}) {
    std::vector<std::uint64_t> keys;
    for (std::uint32_t i = 0; i < n; ++i) keys.push_back(rank_key(static_cast<float>(rng() % 7), i));
    std::vector<std::uint64_t> sorted = keys;
    std::sort(sorted.begin(), sorted.end());
    for (const std::uint32_t k : {1u, n / 3 + 1, n - 1}) {
      TileThreshold t;
      t.needed = k;
      while (!t.done) {
        std::uint32_t histogram[kRadixBins] = {};
        for (auto key : keys) {
          if (t.matches(key)) ++histogram[t.digit(key)];
        }
        t.step(histogram);
      }
      CAPTURE(n, k);
      CHECK(std::count_if(keys.begin(), keys.end(), [&](auto key) { return key <= t.threshold(); }) == k);
      CHECK(t.threshold() >= sorted[k - 1]);
      if (k < n) CHECK(t.threshold() < sorted[k]);
    }
  }
}

TEST_CASE("merged_position merges sorted runs", "[select-rules]") {
  std::mt19937 rng(6);
  std::vector<PartitionId> ids(1000);
  std::iota(ids.begin(), ids.end(), 0u);
  std::shuffle(ids.begin(), ids.end(), rng);
  for (const std::uint32_t tile : {7u, 64u, 1000u, 2048u}) {
    Emulation e;
    e.tile = tile;
    std::vector<PartitionId> want = ids;
    std::sort(want.begin(), want.end());
    CHECK(emulated_sorted(e, ids) == want);
  }
}

namespace {

// A policy's sweep through the emulation at the kernel's tile and at a tiny
// one (many ranking rounds): no row may differ from the host policy.
template <class SweepFn>
void require_sweep_equal_at_both_tiles(SweepFn sweep_fn, std::uint32_t seed, Layout layout = Layout::end_to_end) {
  for (const std::uint32_t tile : {cuda::kSelectTile, 16u}) {
    Emulation e;
    e.tile = tile;
    const Sweep sweep = sweep_fn(e, seed, layout);
    CAPTURE(tile, sweep.rows);
    CHECK(sweep.differing == 0);
  }
}

}  // namespace

TEST_CASE("the select kernels' decomposition equals QuestPolicy::select", "[select-rules]") {
  require_sweep_equal_at_both_tiles(quest_sweep, 31);
}

TEST_CASE("the select kernels' decomposition equals ShadowKVPolicy::select", "[select-rules]") {
  require_sweep_equal_at_both_tiles(shadowkv_sweep, 32);
}

TEST_CASE("the select kernels' decomposition equals RetroInferPolicy::select", "[select-rules]") {
  require_sweep_equal_at_both_tiles(retroinfer_sweep, 33);
}

TEST_CASE("rows in scattered fixed-capacity regions of an arena select as the host policies", "[select-rules]") {
  require_sweep_equal_at_both_tiles(quest_sweep, 31, Layout::arena);
  require_sweep_equal_at_both_tiles(shadowkv_sweep, 32, Layout::arena);
  require_sweep_equal_at_both_tiles(retroinfer_sweep, 33, Layout::arena);
  // The estimate at the small tile only: the layout is independent of the tile, and this sweep is the slow one.
  Emulation e;
  e.tile = 16;
  const EstimateSweep sweep = estimate_sweep(e, 34, Layout::arena);
  CAPTURE(sweep.rows, sweep.nonempty);
  CHECK(sweep.differing == 0);
  CHECK(sweep.nonempty > sweep.terms / 4);
}

TEST_CASE("the summary store's regions select as the host policies", "[select-rules]") {
  for (const std::uint32_t tile : {cuda::kSelectTile, 16u}) {
    Emulation e;
    e.tile = tile;
    const Sweep sweep = store_sweep(e, 35);
    CAPTURE(tile, sweep.rows);
    CHECK(sweep.differing == 0);
  }
  Emulation csr;
  csr.csr_extent = true;
  CHECK(store_sweep(csr, 35).differing > 0);
}

TEST_CASE("the positional selections equal StreamingWindowPolicy / DensePolicy::select", "[select-rules]") {
  const PositionalSweep sweep = positional_sweep(Emulation{}, 37);
  CAPTURE(sweep.sweep.rows, sweep.gapped, sweep.window_only, sweep.whole);
  CHECK(sweep.sweep.differing == 0);
  // Every shape of selection was met, not only the trivial ones.
  CHECK(sweep.gapped > 20);
  CHECK(sweep.window_only > 20);
  CHECK(sweep.whole > 20);
  // Rows read as a CSR up to the next row's region: caught on the store's scattered regions.
  Emulation csr;
  csr.csr_extent = true;
  CHECK(positional_sweep(csr, 37).sweep.differing > 0);
}

TEST_CASE("the positional zones keep the sinks' and the window's budget rules", "[select-rules]") {
  // Pages of 4 tokens but a short third one (3 tokens) -- the prompt's last.
  const std::vector<std::uint32_t> sizes{4, 4, 3, 4, 4, 4, 4};
  const auto tokens = [&](std::uint32_t i) { return sizes[i]; };
  struct Case {
    std::uint32_t sink_pages, budget, sinks, window;
  };
  for (const Case c : {Case{1, 12, 1, 5},     // one sink page, two newest pages
                       Case{1, 3, 0, 7},      // the sink does not fit: nothing fits
                       Case{2, 11, 2, 7},     // both sinks, 3 left: no window page
                       Case{0, 100, 0, 0},    // covering: everything
                       Case{9, 100, 7, 7},    // more sink pages than candidates
                       Case{1, 7, 1, 7},      // 3 left after the sink: a full page does not fit
                       Case{0, 19, 0, 2},     // the short page ends the window
                       Case{3, 27, 3, 3}}) {  // the window meets the sinks
    const PositionalZone z = streaming_zone(7, tokens, c.sink_pages, c.budget);
    CAPTURE(c.sink_pages, c.budget, z.sinks, z.window);
    CHECK(z.sinks == c.sinks);
    CHECK(z.window == c.window);
    CHECK(positional_count(z, 7) == c.sinks + 7 - c.window);
  }
  const PositionalZone z{2, 5};
  CHECK(positional_candidate(z, 0) == 0);
  CHECK(positional_candidate(z, 1) == 1);
  CHECK(positional_candidate(z, 2) == 5);
  CHECK(positional_candidate(z, 3) == 6);
  // The specs: one page per partition, ceil(sink_tokens / page_tokens) sink pages.
  StreamingWindowPolicy::Options options;
  options.budget_tokens = 96;
  options.sink_tokens = 9;
  const LayerContext ctx = layer_context(2, 8, 4, 1);
  const DeviceSelect streaming = device_select(StreamingWindowPolicy(options), ctx);
  REQUIRE(streaming.holds<StreamingDeviceSelect>());
  const auto& spec = streaming.get<StreamingDeviceSelect>();
  CHECK(spec.budget_tokens == 96);
  CHECK(spec.sink_pages == 3);
  CHECK(streaming.summary() == cuda::AppendSummary::tokens);  // one page per partition, token counts only
  CHECK(device_select(AnyPolicy(StreamingWindowPolicy(options)), ctx).holds<StreamingDeviceSelect>());
  CHECK(device_select(AnyPolicy(DensePolicy()), ctx).holds<DenseDeviceSelect>());
  CHECK_FALSE(device_select(AnyPolicy(OraclePolicy()), ctx).on_device());
  // RetroInfer: its sink is no candidate, its rows read the host state, and
  // an index update is due once the fed tokens reach update_tokens.
  RetroInferPolicy::Options retro;
  retro.update_tokens = 48;
  const DeviceSelect retro_select = device_select(AnyPolicy(RetroInferPolicy(retro)), ctx);
  REQUIRE(retro_select.holds<RetroInferDeviceSelect>());
  const auto& r = retro_select.get<RetroInferDeviceSelect>();
  CHECK(r.first_partition == 1);
  CHECK(retro_select.first_partition() == 1);
  CHECK(retro_select.reads_host_state());
  CHECK_FALSE(streaming.reads_host_state());
  CHECK(r.estimation);
  CHECK(r.retrieval_fraction == retro.retrieval_fraction);
  // No budget (the default): the fraction counts candidates, not tokens, so a row may select all of them.
  CHECK(r.budget_tokens == 0);
  CHECK(retro_select.capacity(50, ctx.page_tokens) == 51);
  retro.budget_tokens = 10;
  CHECK(device_select(RetroInferPolicy(retro), ctx).capacity(50, ctx.page_tokens) == 10);
  RetroInferPolicy::LayerState state;
  state.generated = 16;
  CHECK_FALSE(host_index_update_due(RetroInferPolicy(retro), state, 16));
  CHECK(host_index_update_due(RetroInferPolicy(retro), state, 32));
  CHECK_FALSE(host_index_update_due(QuestPolicy(), QuestPolicy::LayerState{}, 1u << 30));
  // The feeding is one optional capability: RetroInfer has it, and through
  // AnyPolicy answers the same; a policy without it reads nothing of its state.
  STATIC_REQUIRE(FeedsHostState<RetroInferPolicy>);
  STATIC_REQUIRE_FALSE(FeedsHostState<QuestPolicy>);
  STATIC_REQUIRE_FALSE(FeedsHostState<ShadowKVPolicy>);
  CHECK(host_index_update_due(AnyPolicy(RetroInferPolicy(retro)), std::any(state), 32));
  state.window = 64;
  state.heads.resize(1);
  state.heads[0].sink = {0, 4};
  state.heads[0].recent = {{7, 16}, {8, 16}};
  state.heads[0].clusters = {{1, 20}};
  state.heads[0].centroids = {1.0f, 2.0f};
  state.heads[0].recent_centroids = {3.0f, 4.0f, 5.0f, 6.0f};
  const HostStateRow row = host_state_row(RetroInferPolicy(retro), state, 0, 3);
  CHECK(row.sink_partition == 0);
  CHECK(row.sink_tokens == 4);
  CHECK(row.recent == 5);  // two recent partitions and three unfed pages
  CHECK(row.window == 64);
  HostSummaryRows rows;
  host_summary_rows(RetroInferPolicy(retro), state, 0, rows);
  CHECK(rows.tokens == std::vector<std::uint32_t>{20, 16, 16});
  CHECK(rows.centroids == std::vector<float>{1.0f, 2.0f, 3.0f, 4.0f, 5.0f, 6.0f});
  rows.tokens = {9};
  host_summary_rows(QuestPolicy(), QuestPolicy::LayerState{}, 0, rows);
  CHECK(rows.tokens.empty());
  const HostStateRow none = host_state_row(QuestPolicy(), QuestPolicy::LayerState{}, 0, 3);
  CHECK(none.sink_tokens == 0);
  CHECK(none.recent == 0);
}

TEST_CASE("the summary store's geometry is checked on the host", "[select-rules]") {
  using cuda::AppendSummary;
  using cuda::SummaryShape;
  const SummaryShape shape{AppendSummary::shadowkv, 2, 3, 4, 64, 5};
  cuda::check_summary_shape("test", shape);
  CHECK(shape.candidates() == 60);
  // Regions tile the layer in (slot, head) order, `capacity` candidates each.
  std::uint32_t next = 0;
  for (std::uint32_t slot = 0; slot < shape.slots; ++slot) {
    for (std::uint32_t h = 0; h < shape.kv_heads; ++h) {
      CHECK(shape.region(slot, h) == next);
      next += shape.capacity;
    }
  }
  CHECK(next == shape.candidates());
  const auto refused_shape = [](SummaryShape s) {
    REQUIRE_SPARSEKV_ERROR(cuda::check_summary_shape("test", s), ErrorCode::invalid_argument);
  };
  SummaryShape bad = shape;
  bad.kind = AppendSummary::none;
  refused_shape(bad);
  bad.kind = AppendSummary::tokens;  // the positional policies' token counts alone
  cuda::check_summary_shape("test", bad);
  for (std::uint32_t SummaryShape::*field : {&SummaryShape::layers, &SummaryShape::slots, &SummaryShape::kv_heads,
                                             &SummaryShape::head_dim, &SummaryShape::capacity}) {
    bad = shape;
    bad.*field = 0;
    refused_shape(bad);
  }
  bad = SummaryShape{AppendSummary::quest, 1, 65536, 256, 8, 256};  // 2^32 candidates
  refused_shape(bad);
  bad.capacity = 255;
  cuda::check_summary_shape("test", bad);
  // RetroInfer's candidates start at partition 1 (its sink, 0, is no candidate); ids stay within 32 bits.
  SummaryShape retro{AppendSummary::retroinfer, 2, 3, 4, 64, 5, 1};
  cuda::check_summary_shape("test", retro);
  retro.first_partition = 0xffffffffu - 5;
  cuda::check_summary_shape("test", retro);
  ++retro.first_partition;
  refused_shape(retro);

  // write_rows: RetroInfer's host rows, within a region, centroids and value sums of rows x head_dim.
  retro.first_partition = 1;
  cuda::check_summary_rows("test", retro, 2, 1, 3, 5, 5 * 64, 5 * 64);
  cuda::check_summary_rows("test", retro, 0, 0, 0, 0, 0, 0);
  const auto refused_rows = [](const SummaryShape& s, std::uint32_t slot, std::uint32_t layer, std::uint32_t head,
                               std::size_t rows, std::size_t centroids, std::size_t value_sums) {
    REQUIRE_SPARSEKV_ERROR(cuda::check_summary_rows("test", s, slot, layer, head, rows, centroids, value_sums),
                           ErrorCode::invalid_argument);
  };
  refused_rows(shape, 0, 0, 0, 1, 64, 64);  // shadowkv: no host rows
  refused_rows(retro, 3, 0, 0, 1, 64, 64);
  refused_rows(retro, 0, 2, 0, 1, 64, 64);
  refused_rows(retro, 0, 0, 4, 1, 64, 64);
  refused_rows(retro, 0, 0, 0, 6, 6 * 64, 6 * 64);  // above the capacity
  refused_rows(retro, 0, 0, 0, 2, 64, 2 * 64);
  refused_rows(retro, 0, 0, 0, 2, 2 * 64, 2 * 64 + 1);

  // Prompt pages: page_count, within the capacity, for a slot and layer of the store.
  CHECK(cuda::prefill_pages("test", shape, 2, 1, 40, 8) == 5);
  CHECK(cuda::prefill_pages("test", shape, 0, 0, 33, 8) == 5);
  CHECK(cuda::prefill_pages("test", shape, 0, 0, 0, 8) == 0);
  REQUIRE_SPARSEKV_ERROR(cuda::prefill_pages("test", shape, 0, 0, 41, 8), ErrorCode::invalid_argument);
  REQUIRE_SPARSEKV_ERROR(cuda::prefill_pages("test", shape, 3, 0, 8, 8), ErrorCode::invalid_argument);
  REQUIRE_SPARSEKV_ERROR(cuda::prefill_pages("test", shape, 0, 2, 8, 8), ErrorCode::invalid_argument);
  REQUIRE_SPARSEKV_ERROR(cuda::prefill_pages("test", shape, 0, 0, 8, 0), ErrorCode::invalid_argument);

  // Each prompt page's token count is what the policies' index records.
  std::mt19937 rng(36);
  for (const std::uint32_t tokens : {1u, 7u, 8u, 9u, 64u, 555u}) {
    LayerContext ctx = layer_context(2, 4, 8, 1);
    ctx.tokens = tokens;
    const std::vector<float> keys = random_values(std::size_t{tokens} * 2 * 4, rng);
    ShadowKVPolicy::LayerState state;
    ShadowKVPolicy().index(ctx, key_view(keys, tokens, ctx), state);
    std::vector<std::uint32_t> pages;
    for (std::uint32_t p = 0; p < cuda::page_count(tokens, 8); ++p) {
      pages.push_back(cuda::prefill_page_tokens(p, tokens, 8));
    }
    CAPTURE(tokens);
    CHECK(pages == state.tokens);
  }
}

TEST_CASE("select_row_span clamps a row to the capacity and the arrays", "[select-rules]") {
  struct Case {
    std::uint32_t first, count, max_row, candidates, want_first, want_n;
  };
  for (const Case c : {Case{40, 7, 10, 100, 40, 7}, Case{40, 17, 10, 100, 40, 10},  // a count above the capacity
                       Case{95, 10, 10, 100, 95, 5},                                // past the arrays
                       Case{100, 3, 10, 100, 100, 0}, Case{0xfffffff0u, 0x20u, 0x40u, 100, 100, 0},  // no wrap
                       Case{0, 0, 10, 100, 0, 0}}) {
    const cuda::SelectRowSpan span = cuda::select_row_span(c.first, c.count, c.max_row, c.candidates);
    CAPTURE(c.first, c.count, c.max_row, c.candidates, span.first, span.n);
    CHECK(span.first == c.want_first);
    CHECK(span.n == c.want_n);
  }
}

TEST_CASE("planted mutations of the decomposition are caught", "[select-rules]") {
  Emulation ties;
  ties.ties_to_higher = true;
  ties.tile = 16;
  Emulation stops;
  stops.skip_stops = true;
  const Sweep quest_ties = quest_sweep(ties, 31), quest_stops = quest_sweep(stops, 31);
  const Sweep shadowkv_ties = shadowkv_sweep(ties, 32), shadowkv_stops = shadowkv_sweep(stops, 32);
  const Sweep retro_ties = retroinfer_sweep(ties, 33);
  CAPTURE(quest_ties.differing, quest_stops.differing, shadowkv_ties.differing, shadowkv_stops.differing,
          retro_ties.differing);
  CHECK(quest_ties.differing > 0);
  CHECK(quest_stops.differing > 0);
  CHECK(shadowkv_ties.differing > 0);
  CHECK(shadowkv_stops.differing > 0);
  CHECK(retro_ties.differing > 0);
  // Rows read as a CSR ([first[r], first[r + 1])): invisible on rows laid end
  // to end, caught on the arena.
  Emulation csr;
  csr.csr_extent = true;
  CHECK(quest_sweep(csr, 31).differing == 0);
  const Sweep quest_csr = quest_sweep(csr, 31, Layout::arena), shadowkv_csr = shadowkv_sweep(csr, 32, Layout::arena);
  const Sweep retro_csr = retroinfer_sweep(csr, 33, Layout::arena);
  const EstimateSweep estimate_csr = estimate_sweep(csr, 34, Layout::arena);
  CAPTURE(quest_csr.differing, shadowkv_csr.differing, retro_csr.differing, estimate_csr.differing);
  CHECK(quest_csr.differing > 0);
  CHECK(shadowkv_csr.differing > 0);
  CHECK(retro_csr.differing > 0);
  CHECK(estimate_csr.differing > 0);
}

TEST_CASE("the estimation rules fold like softmax_fold and skip empty sides", "[select-rules]") {
  std::mt19937 rng(7);
  const std::vector<float> v = random_values(4 * 16, rng, 3.0f);
  AttentionPartial reference(16), rules(16);
  const float scores[] = {0.5f, 2.0f, -1.0f, 2.0f};
  const float weights[] = {3.0f, 1.0f, 40.0f, 0.0f};
  for (int c = 0; c < 4; ++c) {
    reference.add(scores[c], weights[c], v.data() + c * 16);
    SoftmaxState s = rules.state();
    const RescaleStep step = estimation_fold(s, scores[c], weights[c]);
    rules.max = s.max;
    rules.sum = s.sum;
    for (std::uint32_t d = 0; d < 16; ++d) rules.acc[d] = estimation_rescale_add(rules.acc[d], step, v[c * 16 + d]);
  }
  CHECK(rules.max == reference.max);
  CHECK(rules.sum == Approx(reference.sum).epsilon(1e-6));
  for (std::uint32_t d = 0; d < 16; ++d) CHECK(rules.acc[d] == Approx(reference.acc[d]).epsilon(1e-5).margin(1e-6));
  // The first fold takes the value alone: an empty side's accumulator is never multiplied.
  SoftmaxState empty;
  const RescaleStep first = estimation_fold(empty, 1.0f, 2.0f);
  CHECK(first.acc_scale == 0.0f);
  CHECK(estimation_rescale_add(std::numeric_limits<float>::infinity(), first, 3.0f) == 3.0f);
  CHECK(empty.sum == 2.0f);
  // -inf scores and non-positive weights add nothing.
  SoftmaxState s = empty;
  const RescaleStep none = estimation_fold(s, kMinusInf, 5.0f);
  CHECK((s.max == empty.max && s.sum == empty.sum && none.acc_scale == 1.0f && none.value_weight == 0.0f));
}

TEST_CASE("RetroInfer's zones: a budget fills the retrieval zone, no budget takes the fraction", "[select-rules]") {
  constexpr std::uint32_t kMax = std::numeric_limits<std::uint32_t>::max();
  // No budget (0): never Dense, no token cap, the top retrieval_fraction.
  CHECK_FALSE(retroinfer_covers(0, 0));
  CHECK_FALSE(retroinfer_covers(0, 5));
  CHECK(retroinfer_token_cap(0) == kMax);
  const BreakFill fraction = retroinfer_retrieval_fill(70, 0, 0.018f, 1000);
  CHECK((fraction.used == 70 && fraction.budget == kMax && fraction.limit == 18));
  // A budget: Dense once it covers the head, else every ranked candidate while it fits.
  CHECK(retroinfer_covers(100, 100));
  CHECK_FALSE(retroinfer_covers(99, 100));
  CHECK(retroinfer_token_cap(99) == 99);
  const BreakFill budget = retroinfer_retrieval_fill(70, 512, 0.018f, 1000);
  CHECK((budget.used == 70 && budget.budget == 512 && budget.limit == 1000));
  // The estimation zone: the next fraction_count(estimation_fraction, m) ranked, whatever was retrieved.
  const BreakFill zone = retroinfer_estimation_fill(0.232f, 1000);
  CHECK((zone.used == 0 && zone.budget == kMax && zone.limit == 232));
  CHECK(retroinfer_estimation_fill(0.7f, 7).limit == 5);
  CHECK(retroinfer_estimation_fill(1.0f, 7).limit == 7);
}

TEST_CASE("the estimate kernel's decomposition equals RetroInferPolicy::attend", "[select-rules]") {
  for (const std::uint32_t tile : {cuda::kSelectTile, 16u}) {
    Emulation e;
    e.tile = tile;
    const EstimateSweep sweep = estimate_sweep(e, 34);
    CAPTURE(tile, sweep.rows, sweep.terms, sweep.nonempty);
    CHECK(sweep.differing == 0);
    CHECK(sweep.nonempty > sweep.terms / 4);
    CHECK(sweep.nonempty < sweep.terms);
  }
}

// Requests whose LayerState windows differ (a short prompt's whole tail
// until the first update), rows reading them through
// RetroInferSelect::windows: selections and estimation terms against
// RetroInferPolicy::select / attend on each request's own state.
struct WindowsSweep {
  std::uint32_t rows = 0, differing_selections = 0, differing_terms = 0, nonempty = 0;
};

WindowsSweep windows_sweep(const Emulation& e, bool per_row_windows, std::uint32_t seed) {
  constexpr std::uint32_t kWindows[] = {0, 11, 40, 150};  // window_tokens below is none of them
  std::mt19937 rng(seed);
  WindowsSweep sweep;
  for (const std::uint32_t group : {1u, 4u}) {
    for (const std::uint32_t clusters : {0u, 9u, 300u}) {
      for (const std::uint32_t recent : {3u, 20u}) {
        const LayerContext ctx = layer_context(2, 36, 8, group);
        std::vector<SelectRequest<RetroInferPolicy::LayerState>> batch;
        for (const std::uint32_t window : kWindows) {
          batch.push_back(retroinfer_request(ctx, clusters, recent, window, rng));
        }
        std::shuffle(batch.begin(), batch.end(), rng);
        const HostRows rows = retroinfer_rows(ctx, batch);
        const std::uint32_t total = std::max(1u, batch[0].state.heads[0].tokens);
        for (const std::uint32_t budget : {0u, 1u, 30u, 200u, total}) {  // 0: the fraction rule
          RetroInferPolicy::Options options;
          options.budget_tokens = budget;
          options.retrieval_fraction = 0.3f;
          options.estimation_fraction = 0.5f;
          const RetroInferPolicy policy(options);
          const auto selections = host_select(policy, ctx, batch);
          const auto terms = host_estimate(policy, ctx, batch);
          cuda::RetroInferSelect retro{nullptr, nullptr, nullptr, nullptr, budget, 64, options.retrieval_fraction};
          if (per_row_windows) retro.windows = rows.windows.data();
          const cuda::RetroInferEstimate estimate{nullptr, nullptr, nullptr, 0, options.estimation_fraction, true};
          for (std::uint32_t r = 0; r < rows.rows(); ++r) {
            ++sweep.rows;
            if (emulate_retroinfer(e, rows, r, retro) != selections[r]) ++sweep.differing_selections;
            const auto got = emulate_estimate(e, rows, r, retro, estimate, selections[r]);
            for (std::uint32_t j = 0; j < group; ++j) {
              const AttentionPartial& host = terms[std::size_t{r} * group + j];
              if (!same_term(got[j], host)) ++sweep.differing_terms;
              if (!host.empty()) ++sweep.nonempty;
            }
          }
        }
      }
    }
  }
  return sweep;
}

TEST_CASE("RetroInfer's select and estimate kernels read each row's own window", "[select-rules]") {
  for (const std::uint32_t tile : {cuda::kSelectTile, 16u}) {
    Emulation e;
    e.tile = tile;
    const WindowsSweep sweep = windows_sweep(e, true, 37);
    CAPTURE(tile, sweep.rows, sweep.nonempty);
    CHECK(sweep.differing_selections == 0);
    CHECK(sweep.differing_terms == 0);
    CHECK(sweep.nonempty > 0);
  }
  // One window for every row (RetroInferSelect::window_tokens) reads other zones: the windows matter here.
  const WindowsSweep shared = windows_sweep(Emulation{}, false, 37);
  CAPTURE(shared.rows);
  CHECK(shared.differing_selections > 0);
  CHECK(shared.differing_terms > 0);
}

TEST_CASE("planted mutations of the estimate's decomposition are caught", "[select-rules]") {
  Emulation retrieved;
  retrieved.estimate_retrieved = true;
  Emulation order;
  order.candidate_order = true;
  Emulation ties;
  ties.ties_to_higher = true;
  const EstimateSweep a = estimate_sweep(retrieved, 34), b = estimate_sweep(order, 34), c = estimate_sweep(ties, 34);
  CAPTURE(a.differing, b.differing, c.differing, a.rows);
  CHECK(a.differing > 0);
  CHECK(b.differing > 0);
  CHECK(c.differing > 0);
}

// fn(target name) once on every Highway target the CPU runs (the choice is
// global: every dispatched kernel follows it), then the best target again.
template <class Fn>
void on_every_target(Fn&& fn) {
  std::uint32_t targets_run = 0;
  for (const FoldTarget& target : fold_page_targets()) {
    if (!target.supported) continue;
    use_fold_page_target(target.bits);
    ++targets_run;
    fn(target.name);
  }
  use_fold_page_target(0);
  CHECK(targets_run > 0);
}

TEST_CASE("Quest's term from q's halves equals the centre / half-width form for power-of-two spreads",
          "[select-rules]") {
  // quest_term takes q / 2 and spread |q| / 2 once per head; the form it
  // replaced halved the box's sum and width per box. The same bits for the
  // default spread and the paper's, whenever nothing falls below 2^-125.
  const auto centre_form = [](float q, float lo, float hi, float spread) {
    const float centre = mul_rn(add_rn(lo, hi), 0.5f);
    const float half_width = mul_rn(add_rn(hi, -lo), 0.5f);
    return add_rn(mul_rn(q, centre), mul_rn(spread, mul_rn(q < 0.0f ? -q : q, half_width)));
  };
  std::mt19937 rng(29);
  std::uniform_real_distribution<float> exponent(-40.0f, 40.0f);
  std::uniform_int_distribution<int> sign(0, 1);
  const auto draw = [&] { return (sign(rng) ? -1.0f : 1.0f) * std::exp2(exponent(rng)); };
  std::uint32_t checked = 0;
  for (int i = 0; i < 200000; ++i) {
    const float q = draw(), a = draw(), b = draw();
    const float lo = std::min(a, b), hi = std::max(a, b);
    for (const float spread : {0.0f, 0.25f, 0.5f, 1.0f}) {
      const float got = quest_term(quest_halves(q, spread), lo, hi);
      const float want = centre_form(q, lo, hi, spread);
      CAPTURE(q, lo, hi, spread);
      REQUIRE(std::bit_cast<std::uint32_t>(got) == std::bit_cast<std::uint32_t>(want));
      ++checked;
    }
  }
  CHECK(checked == 800000);
  // Below 2^-125 halving rounds, and the two forms may part.
  const float tiny = std::numeric_limits<float>::denorm_min() * 3.0f;
  CHECK(quest_term(quest_halves(tiny, 1.0f), 1.0f, 1.0f) != centre_form(tiny, 1.0f, 1.0f, 1.0f));
}

TEST_CASE("quest_logits_simd equals quest_logit bit for bit for every head, on every target", "[select-rules]") {
  std::mt19937 rng(31);
  std::normal_distribution<float> normal;
  on_every_target([&](const std::string& target) {
    for (const std::uint32_t d : {1u, 7u, 8u, 13u, 16u, 64u, 100u, 128u}) {
      for (const std::uint32_t group : {1u, 3u, 4u, 6u, 8u}) {
        const std::uint32_t n = 1 + static_cast<std::uint32_t>(rng() % 60);
        std::vector<float> q(std::size_t{group} * d), lo(std::size_t{n} * d), hi(lo.size());
        for (auto& x : q) x = rng() % 9 == 0 ? -0.0f : normal(rng) * 3.0f;  // negative zeros keep their sign rule
        for (std::size_t i = 0; i < lo.size(); ++i) {
          const float a = normal(rng), b = normal(rng);
          lo[i] = std::min(a, b);
          hi[i] = std::max(a, b);
        }
        // Boxes of keys in each dtype (policy/box_rows.hpp): 16-bit rows of
        // values they hold, widened in the kernel.
        const DType dtype = std::array{DType::f32, DType::f16, DType::bf16}[rng() % 3];
        const BoxRows lo_rows(dtype, d, lo, BoxSide::lower), hi_rows(dtype, d, hi, BoxSide::upper);
        lo = lo_rows.widened();
        hi = hi_rows.widened();
        for (const float spread : {1.0f, 0.0f, 0.5f, 0.3f}) {
          std::vector<float> got(std::size_t{group} * n);
          quest_logits_simd(q.data(), group, lo_rows.data(), hi_rows.data(), dtype, n, d, spread, logit_scale(d),
                            got.data());
          for (std::uint32_t g = 0; g < group; ++g) {
            for (std::uint32_t i = 0; i < n; ++i) {
              const float want = quest_logit(q.data() + std::size_t{g} * d, lo.data() + std::size_t{i} * d,
                                             hi.data() + std::size_t{i} * d, d, spread, logit_scale(d));
              CAPTURE(target, d, group, n, g, i, spread, to_string(dtype));
              REQUIRE(std::bit_cast<std::uint32_t>(got[std::size_t{g} * n + i]) == std::bit_cast<std::uint32_t>(want));
            }
          }
        }
      }
    }
  });
}

TEST_CASE("shadowkv_logits_simd equals shadowkv_logit bit for bit for every head, on every target", "[select-rules]") {
  std::mt19937 rng(37);
  std::normal_distribution<float> normal;
  on_every_target([&](const std::string& target) {
    for (const std::uint32_t d : {1u, 5u, 7u, 16u, 64u, 100u, 128u}) {
      for (const std::uint32_t group : {1u, 3u, 4u, 5u, 8u}) {
        const std::uint32_t n = 1 + static_cast<std::uint32_t>(rng() % 70);
        std::vector<float> q(std::size_t{group} * d), landmarks(std::size_t{n} * d);
        for (auto& x : q) x = normal(rng);
        for (auto& x : landmarks) x = rng() % 11 == 0 ? -0.0f : normal(rng);
        std::vector<float> got(std::size_t{group} * n);
        shadowkv_logits_simd(q.data(), group, landmarks.data(), n, d, logit_scale(d), got.data());
        for (std::uint32_t g = 0; g < group; ++g) {
          for (std::uint32_t i = 0; i < n; ++i) {
            const float want =
                shadowkv_logit(q.data() + std::size_t{g} * d, landmarks.data() + std::size_t{i} * d, d, logit_scale(d));
            CAPTURE(target, d, group, n, g, i);
            REQUIRE(std::bit_cast<std::uint32_t>(got[std::size_t{g} * n + i]) == std::bit_cast<std::uint32_t>(want));
          }
        }
      }
    }
  });
}

TEST_CASE("shadowkv_head_scores_simd equals shadowkv_head_scores bit for bit on every target", "[select-rules]") {
  // Random taken masks (none, some, all), a head after others (scores already
  // folded), logits with NaN and infinities, and spreads wide enough that
  // some shares underflow.
  std::mt19937 rng(47);
  const float specials[] = {-0.0f, 0.0f, std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()};
  on_every_target([&](const std::string& target) {
    for (int trial = 0; trial < 300; ++trial) {
      const std::uint32_t n = 1 + static_cast<std::uint32_t>(rng() % 150);
      const float spread = trial % 3 == 0 ? 150.0f : 8.0f;
      std::vector<float> logits(n), scores(n);
      std::vector<char> taken(n);
      const std::uint32_t taken_every = 1 + static_cast<std::uint32_t>(rng() % 5);
      for (std::uint32_t i = 0; i < n; ++i) {
        logits[i] = rng() % 29 == 0 ? specials[rng() % 5] : std::uniform_real_distribution<float>(-spread, 4.0f)(rng);
        scores[i] = trial % 2 == 0 ? -std::numeric_limits<float>::infinity()
                                   : std::uniform_real_distribution<float>(0.0f, 0.05f)(rng);
        taken[i] = trial % 7 == 0 ? 1 : static_cast<char>(rng() % taken_every == 0);
      }
      std::vector<float> want = scores, got = scores, want_shares(n), got_shares(n);
      shadowkv_head_scores(n, logits.data(), taken.data(), want_shares.data(), want.data());
      shadowkv_head_scores_simd(n, logits.data(), taken.data(), got_shares.data(), got.data());
      for (std::uint32_t i = 0; i < n; ++i) {
        CAPTURE(target, trial, n, i, logits[i], int(taken[i]));
        REQUIRE(std::bit_cast<std::uint32_t>(got[i]) == std::bit_cast<std::uint32_t>(want[i]));
        if (taken[i] == 0)
          REQUIRE(std::bit_cast<std::uint32_t>(got_shares[i]) == std::bit_cast<std::uint32_t>(want_shares[i]));
      }
    }
  });
}

TEST_CASE("a candidate's group logits, whole or in pieces, equal quest_logit and shadowkv_logit bit for bit",
          "[select-rules]") {
  // What the GPU's logits kernel runs: kLogitHeads heads a pass over the
  // summary row, which it takes in pieces cut at multiples of 8 (each piece a
  // copy, as the kernel stages it); groups past kLogitHeads take more passes.
  // NaN, infinities and signed zeros included.
  std::mt19937 rng(43);
  std::normal_distribution<float> normal;
  const float specials[] = {-0.0f, 0.0f, std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()};
  const auto draw = [&] { return rng() % 23 == 0 ? specials[rng() % 5] : normal(rng) * 2.0f; };
  for (const std::uint32_t d : {1u, 7u, 8u, 13u, 64u, 100u, 128u, 200u, 256u}) {
    for (const std::uint32_t group : {1u, 2u, 3u, 4u, 5u, 8u, 12u}) {
      for (int trial = 0; trial < 4; ++trial) {
        std::vector<float> q(std::size_t{group} * d), lo(d), hi(d), landmark(d);
        for (auto& x : q) x = draw();
        for (std::uint32_t j = 0; j < d; ++j) {
          const float a = draw(), b = draw();
          lo[j] = std::min(a, b);
          hi[j] = std::max(a, b);
          landmark[j] = draw();
        }
        const float spread = trial % 2 == 0 ? 1.0f : 0.5f;
        std::vector<float> quest(group, -7.0f), shadow(group, -7.0f);
        std::vector<int> emitted(group, 0);
        quest_group_logits(q.data(), group, lo.data(), hi.data(), d, spread, logit_scale(d),
                           [&](std::uint32_t g, float x) {
                             quest[g] = x;
                             ++emitted[g];
                           });
        shadowkv_group_logits(q.data(), group, landmark.data(), d, logit_scale(d),
                              [&](std::uint32_t g, float x) { shadow[g] = x; });
        // The same in pieces of 8 x (1..5) dimensions, the last one shorter.
        std::vector<float> quest_pieces(group, -7.0f), shadow_pieces(group, -7.0f);
        for (std::uint32_t h0 = 0; h0 < group; h0 += kLogitHeads) {
          QuestGroupLogits pieced_quest(q.data(), group, h0, d, spread, logit_scale(d));
          ShadowKVGroupLogits pieced_shadow(q.data(), group, h0, d, logit_scale(d));
          std::vector<float> lo_piece, hi_piece, landmark_piece;
          std::uint32_t d0 = 0;
          for (;;) {
            const std::uint32_t d1 = std::min<std::uint32_t>(d0 + 8 * (1 + rng() % 5), d);
            lo_piece.assign(lo.begin() + d0, lo.begin() + d1);
            hi_piece.assign(hi.begin() + d0, hi.begin() + d1);
            landmark_piece.assign(landmark.begin() + d0, landmark.begin() + d1);
            pieced_quest.add(lo_piece.data(), hi_piece.data(), d0, d1);
            pieced_shadow.add(landmark_piece.data(), d0, d1);
            if (d1 == d) break;
            d0 = d1;
          }
          pieced_quest.finish(lo_piece.data(), hi_piece.data(), d0, d, group, h0,
                              [&](std::uint32_t g, float x) { quest_pieces[g] = x; });
          pieced_shadow.finish(group, h0, [&](std::uint32_t g, float x) { shadow_pieces[g] = x; });
        }
        for (std::uint32_t g = 0; g < group; ++g) {
          CAPTURE(d, group, trial, g);
          REQUIRE(emitted[g] == 1);
          const float* qh = q.data() + std::size_t{g} * d;
          const float want_quest = quest_logit(qh, lo.data(), hi.data(), d, spread, logit_scale(d));
          const float want_shadow = shadowkv_logit(qh, landmark.data(), d, logit_scale(d));
          // Bits, but a NaN only as a NaN: its payload is the platform's (GPUs return one pattern).
          const auto same = [](float got, float want) {
            return std::isnan(want) ? std::isnan(got)
                                    : std::bit_cast<std::uint32_t>(got) == std::bit_cast<std::uint32_t>(want);
          };
          REQUIRE(same(quest[g], want_quest));
          REQUIRE(same(quest_pieces[g], want_quest));
          REQUIRE(same(shadow[g], want_shadow));
          REQUIRE(same(shadow_pieces[g], want_shadow));
        }
      }
    }
  }
}

TEST_CASE("portable_exps and softmax_rank_add_simd equal the scalar rules bit for bit on every target",
          "[select-rules]") {
  std::mt19937 rng(41);
  const float specials[] = {0.0f,
                            -0.0f,
                            88.72283f,
                            88.8f,
                            89.0f,
                            -87.3f,
                            -87.4f,
                            -100.0f,
                            -103.9f,
                            -103.972084f,
                            -104.0f,
                            -1e30f,
                            1e30f,
                            std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(),
                            std::numeric_limits<float>::quiet_NaN()};
  on_every_target([&](const std::string& target) {
    for (int trial = 0; trial < 200; ++trial) {
      const std::uint32_t n = 1 + static_cast<std::uint32_t>(rng() % 100);
      std::vector<float> x(n);
      for (auto& v : x) {
        const std::uint32_t pick = rng() % 10;
        v = pick == 0
                ? specials[rng() % std::size(specials)]
                : std::uniform_real_distribution<float>(pick < 5 ? -20.0f : -110.0f, pick < 8 ? 0.0f : 90.0f)(rng);
      }
      const float bias = trial % 4 == 0 ? 0.0f : std::uniform_real_distribution<float>(-5.0f, 5.0f)(rng);
      std::vector<float> got(n);
      portable_exps(x.data(), bias, n, got.data());
      for (std::uint32_t i = 0; i < n; ++i) {
        CAPTURE(target, x[i], bias);
        REQUIRE(std::bit_cast<std::uint32_t>(got[i]) == std::bit_cast<std::uint32_t>(portable_exp(add_rn(x[i], bias))));
      }
      // Logits as a Select sees them (finite), ranked both ways.
      for (auto& v : x) v = std::uniform_real_distribution<float>(-30.0f, 10.0f)(rng);
      std::vector<float> want_rank(n, 0.25f), got_rank(n, 0.25f);
      softmax_rank_add(n, x.data(), want_rank.data());
      softmax_rank_add_simd(n, x.data(), got_rank.data());
      for (std::uint32_t i = 0; i < n; ++i) {
        CAPTURE(target, n, i);
        REQUIRE(std::bit_cast<std::uint32_t>(got_rank[i]) == std::bit_cast<std::uint32_t>(want_rank[i]));
      }
    }
  });
}
