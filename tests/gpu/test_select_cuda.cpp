// Select kernels (policy/select_cuda.hpp) against the host policies' select
// on random batches with planted ties, budgets below one partition, covering
// budgets, GQA groups 1..8 and rows longer than one tile, laid end to end and
// scattered over an arena of fixed-capacity regions: the same partitions,
// bit for bit, RetroInfer's rows each with its request's steady window.
// retroinfer_estimate on retroinfer_select's device output against RetroInferPolicy::attend: every term bit for bit,
// and the attention with the device terms as its extra term within 2e-3 of
// the host decode_attention with the host's. streaming_select / dense_select
// over a tokens-only summary store against StreamingWindowPolicy /
// DensePolicy::select. Bad arguments are refused before any launch.
#include <catch2/catch.hpp>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <random>
#include <variant>
#include <vector>

#include "attention_test_data.hpp"
#include "select_test_data.hpp"
#include "gpu_support.hpp"
#include "sparsekv/attention/sparse_decode_attention_cuda.hpp"
#include "sparsekv/policy/device_select.hpp"
#include "sparsekv/policy/select_cuda.hpp"
#include "sparsekv/policy/dense.hpp"
#include "sparsekv/policy/quest.hpp"
#include "sparsekv/policy/retroinfer.hpp"
#include "sparsekv/policy/shadowkv.hpp"
#include "sparsekv/policy/streaming_window.hpp"

using namespace sparsekv;
using namespace sparsekv::gpu_test;
using namespace sparsekv::test;

namespace {

// HostRows on the device, and the kernel's output read back row by row.
struct DeviceRows {
  explicit DeviceRows(const HostRows& h)
      : first(h.first), count(h.count), tokens(h.tokens), partitions(h.partitions), q(h.q), a(h.a), b(h.b) {
    rows.rows = h.rows();
    rows.kv_heads = h.kv_heads;
    rows.group = h.group;
    rows.head_dim = h.head_dim;
    rows.candidates = h.candidates();
    rows.max_row_candidates = h.max_row;
    rows.first = first.data;
    rows.count = count.data;
    rows.tokens = tokens.data;
    rows.partitions = partitions.data;
    rows.q = q.data;
    workspace.reserve(cuda::select_workspace_bytes(rows));
  }
  template <class Launch>
  std::vector<std::vector<PartitionId>> run(std::uint32_t capacity, Launch launch) {
    DeviceArray<PartitionId> selected(std::size_t{rows.rows} * capacity);
    DeviceArray<std::uint32_t> count(rows.rows);
    Stream stream;
    launch(cuda::SelectOutput{capacity, selected.data, count.data}, stream.stream);
    check(cudaStreamSynchronize(stream.stream));
    const auto counts = count.download();
    // Row r's ids are the first counts[r] of its region; the rest is never written (initcheck must see that).
    std::vector<PartitionId> ids(std::size_t{rows.rows} * capacity, kInvalidPartition);
    for (std::uint32_t r = 0; r < rows.rows; ++r) {
      REQUIRE(counts[r] <= capacity);
      selected.download_into(ids, std::size_t{r} * capacity, counts[r]);
    }
    std::vector<std::vector<PartitionId>> out(rows.rows);
    for (std::uint32_t r = 0; r < rows.rows; ++r) {
      out[r].assign(ids.begin() + std::size_t{r} * capacity, ids.begin() + std::size_t{r} * capacity + counts[r]);
    }
    return out;
  }
  DeviceArray<std::uint32_t> first, count, tokens;
  DeviceArray<PartitionId> partitions;
  DeviceArray<float> q, a, b;
  DeviceArray<std::byte> workspace;
  cuda::SelectRows rows;
};

void require_same(const std::vector<std::vector<PartitionId>>& got, const std::vector<std::vector<PartitionId>>& want) {
  REQUIRE(got.size() == want.size());
  for (std::size_t r = 0; r < got.size(); ++r) {
    CAPTURE(r, got[r].size(), want[r].size());
    REQUIRE(got[r] == want[r]);
  }
}

constexpr std::uint32_t kGroups[] = {1, 2, 4, 8};

// RetroInfer rows on the device with both workspaces, the selection and the terms.
struct DeviceRetro {
  explicit DeviceRetro(const HostRows& h)
      : dev(h), sinks(h.sink_partitions), sink_tokens(h.sink_tokens), recent(h.recent), windows(h.windows) {
    estimate_workspace.reserve(cuda::select_workspace_bytes(dev.rows));
    const std::size_t terms = std::size_t{dev.rows.rows} * dev.rows.group;
    max.reserve(terms);
    sum.reserve(terms);
    acc.reserve(terms * dev.rows.head_dim);
  }
  // Each row's window from its request's state (RetroInferSelect::windows).
  cuda::RetroInferSelect select_params(std::uint32_t budget, float fraction) const {
    return {dev.a.data, sinks.data, sink_tokens.data, recent.data, budget, 0, fraction, windows.data};
  }
  // retroinfer_select then retroinfer_estimate on one stream; the terms read back.
  std::vector<AttentionPartial> run(const cuda::RetroInferSelect& retro, float estimation_fraction, bool estimation) {
    const std::uint32_t capacity = cuda::retroinfer_select_capacity(dev.rows, retro);
    selected.reserve(std::size_t{dev.rows.rows} * capacity);
    count.reserve(dev.rows.rows);
    // NaN first: a term the kernel does not write fails the comparison.
    check(cudaMemset(max.data, 0xff, max.size * sizeof(float)));
    check(cudaMemset(sum.data, 0xff, sum.size * sizeof(float)));
    check(cudaMemset(acc.data, 0xff, acc.size * sizeof(float)));
    check(cudaDeviceSynchronize());  // the uploads ran on the legacy stream
    Stream stream;
    cuda::retroinfer_select(dev.rows, retro, cuda::SelectOutput{capacity, selected.data, count.data},
                            dev.workspace.data, dev.workspace.size, stream.stream);
    const cuda::RetroInferEstimate estimate{dev.b.data, selected.data,       count.data,
                                            capacity,   estimation_fraction, estimation};
    cuda::retroinfer_estimate(dev.rows, retro, estimate, cuda::EstimateOutput{max.data, sum.data, acc.data},
                              estimate_workspace.data, estimate_workspace.size, stream.stream);
    check(cudaStreamSynchronize(stream.stream));
    check(cudaGetLastError());
    const auto m = max.download(), s = sum.download(), a = acc.download();
    const std::uint32_t d = dev.rows.head_dim;
    std::vector<AttentionPartial> terms(max.size, AttentionPartial(d));
    for (std::size_t j = 0; j < terms.size(); ++j) {
      terms[j].max = m[j];
      terms[j].sum = s[j];
      std::copy_n(a.begin() + j * d, d, terms[j].acc.begin());
    }
    return terms;
  }
  DeviceRows dev;
  DeviceArray<PartitionId> sinks, selected;
  DeviceArray<std::uint32_t> sink_tokens, recent, windows, count;
  DeviceArray<std::byte> estimate_workspace;
  DeviceArray<float> max, sum, acc;
};

bool same_term(const AttentionPartial& a, const AttentionPartial& b) {
  return same_bits(a.max, b.max) && same_bits(a.sum, b.sum) && same_bits(a.acc, b.acc);
}

// The attention over random pages with the device terms (still in `retro`'s
// arrays) as DecodeAttentionExtra, against the host decode_attention with
// the host's terms: the worst relative error of an output head.
float attention_with_terms(const DeviceRetro& retro, const std::vector<float>& q,
                           const std::vector<AttentionPartial>& host_terms, std::uint32_t kv_heads, std::mt19937& rng) {
  const cuda::SelectRows& rows = retro.dev.rows;
  AttentionBatch b;
  b.batch = rows.rows / kv_heads;
  b.kv_heads = kv_heads;
  b.q_heads = kv_heads * rows.group;
  b.layout = PageLayout{16, rows.head_dim, DType::bf16};
  b.stride = b.layout.page_bytes();
  b.scale = 1.0f / std::sqrt(float(rows.head_dim));
  std::normal_distribution<float> normal;
  std::vector<std::uint32_t> counts(rows.rows);
  for (auto& c : counts) c = std::uint32_t(rng() % 130);
  const std::uint32_t pool_pages = std::accumulate(counts.begin(), counts.end(), 0u) + 1;
  b.pool.assign(pool_pages * b.stride, std::byte{0});
  fill_pages(b, pool_pages, normal, rng);
  random_rows(b, counts, pool_pages, rng, true);
  b.q = q;
  b.extra = host_terms;
  std::vector<float> want_out, want_lse;
  reference_attention(b, want_out, want_lse);

  cuda::DecodeAttentionShape shape;
  shape.batch = b.batch;
  shape.q_heads = b.q_heads;
  shape.kv_heads = kv_heads;
  shape.layout = b.layout;
  shape.max_pages = b.max_pages;
  const cuda::DecodeAttentionSplit split = cuda::plan_sparse_decode_attention(shape);
  const DeviceArray<std::byte> pool(b.pool);
  const DeviceArray<float> dq(b.q);
  const DeviceArray<std::int64_t> indptr(b.indptr), indices(b.indices);
  const DeviceArray<std::int32_t> last(b.last_page_len);
  const std::size_t heads = std::size_t{b.batch} * b.q_heads;
  DeviceArray<float> out(heads * rows.head_dim);
  DeviceArray<std::byte> workspace(split.workspace_bytes);
  cuda::DecodeAttentionArgs args;
  args.q = dq.data;
  args.page_base = pool.data;
  args.page_stride = b.stride;
  args.indptr = indptr.data;
  args.indices = indices.data;
  args.last_page_len = last.data;
  args.scale = b.scale;
  args.extra = {retro.max.data, retro.sum.data, retro.acc.data};
  args.out = out.data;
  args.workspace = workspace.data;
  args.workspace_bytes = split.workspace_bytes;
  check(cudaDeviceSynchronize());
  cuda::sparse_decode_attention(shape, args, nullptr);
  check(cudaDeviceSynchronize());
  const std::vector<float> got = out.download();
  float worst = 0.0f;
  for (std::size_t h = 0; h < heads; ++h) {
    float num = 0.0f, den = 0.0f;
    for (std::uint32_t i = 0; i < rows.head_dim; ++i) {
      const std::size_t at = h * rows.head_dim + i;
      num = std::isfinite(got[at]) ? std::max(num, std::abs(got[at] - want_out[at])) : INFINITY;
      den = std::max(den, std::abs(want_out[at]));
    }
    worst = std::max(worst, den == 0.0f ? num : num / den);
  }
  return worst;
}

}  // namespace

TEST_CASE("quest_select equals QuestPolicy::select", "[gpu][select]") {
  std::mt19937 rng(41);
  // Rows end to end, then scattered over an arena of fixed-capacity regions (select_test_data.hpp).
  for (const bool arena : {false, true}) {
    for (const std::uint32_t group : kGroups) {
      for (const std::uint32_t n : {1u, 19u, 300u, 5000u}) {
        LayerContext ctx = layer_context(4, 128, 8, group);
        std::vector<SelectRequest<QuestPolicy::LayerState>> batch;
        for (int b = 0; b < 3; ++b) batch.push_back(quest_request(ctx, n, 16, rng));
        const HostRows host = arena ? in_arena(quest_rows(ctx, batch), 5, 3, rng) : quest_rows(ctx, batch);
        DeviceRows dev(host);
        for (const std::uint32_t budget : {1u, 8u, 2048u, 100000u}) {
          for (const std::uint32_t layer : {0u, 5u}) {
            CAPTURE(arena, group, n, budget, layer);
            ctx.layer = layer;
            QuestPolicy::Options options;
            options.budget_tokens = budget;
            const QuestPolicy policy(options);
            const auto want = host_select(policy, ctx, batch);
            const cuda::QuestSelect quest{dev.a.data,
                                          dev.b.data,
                                          budget,
                                          layer < options.dense_layers,
                                          options.sink_tokens,
                                          policy.window_tokens(),
                                          options.spread};
            const auto got = dev.run(
                cuda::quest_select_capacity(dev.rows, quest), [&](const cuda::SelectOutput& out, cudaStream_t s) {
                  cuda::quest_select(dev.rows, quest, out, dev.workspace.data, dev.workspace.size, s);
                });
            require_same(got, want);
          }
        }
      }
    }
  }
}

TEST_CASE("shadowkv_select equals ShadowKVPolicy::select", "[gpu][select]") {
  std::mt19937 rng(42);
  // Rows end to end, then scattered over an arena of fixed-capacity regions (select_test_data.hpp).
  for (const bool arena : {false, true}) {
    for (const std::uint32_t group : kGroups) {
      for (const std::uint32_t n : {1u, 40u, 1500u, 16384u}) {
        const LayerContext ctx = layer_context(2, 128, 8, group);
        std::vector<SelectRequest<ShadowKVPolicy::LayerState>> batch;
        for (int b = 0; b < 2; ++b) batch.push_back(shadowkv_request(ctx, n, rng));
        const HostRows host = arena ? in_arena(shadowkv_rows(ctx, batch), 5, 3, rng) : shadowkv_rows(ctx, batch);
        DeviceRows dev(host);
        for (const std::uint32_t budget : {1u, 16u, 2048u, 200000u}) {
          CAPTURE(arena, group, n, budget);
          ShadowKVPolicy::Options options;
          options.budget_tokens = budget;
          const ShadowKVPolicy policy(options);
          const auto want = host_select(policy, ctx, batch);
          const cuda::ShadowKVSelect shadowkv{dev.a.data, dev.b.data, budget, options.recent_tokens,
                                              policy.outlier_count()};
          const auto got = dev.run(
              cuda::shadowkv_select_capacity(dev.rows, shadowkv), [&](const cuda::SelectOutput& out, cudaStream_t s) {
                cuda::shadowkv_select(dev.rows, shadowkv, out, dev.workspace.data, dev.workspace.size, s);
              });
          require_same(got, want);
        }
      }
    }
  }
}

TEST_CASE("retroinfer_select equals RetroInferPolicy::select", "[gpu][select]") {
  std::mt19937 rng(43);
  // Rows end to end, then scattered over an arena of fixed-capacity regions (select_test_data.hpp).
  for (const bool arena : {false, true}) {
    for (const std::uint32_t group : kGroups) {
      for (const std::uint32_t clusters : {0u, 250u, 8000u}) {
        const LayerContext ctx = layer_context(2, 128, 8, group);
        std::vector<SelectRequest<RetroInferPolicy::LayerState>> batch;
        // Steady windows per request (a short prompt's whole tail until the first update).
        for (const std::uint32_t window : {64u, 19u}) {
          batch.push_back(retroinfer_request(ctx, clusters, 12, window, rng));
        }
        const HostRows host = arena ? in_arena(retroinfer_rows(ctx, batch), 5, 3, rng) : retroinfer_rows(ctx, batch);
        DeviceRows dev(host);
        DeviceArray<PartitionId> sinks(host.sink_partitions);
        DeviceArray<std::uint32_t> sink_tokens(host.sink_tokens), recent(host.recent), windows(host.windows);
        for (const std::uint32_t budget : {0u, 1u, 40u, 2048u, 1000000u}) {  // 0: the fraction rule
          for (const float fraction : {0.018f, 1.0f}) {
            CAPTURE(arena, group, clusters, budget, fraction);
            RetroInferPolicy::Options options;
            options.budget_tokens = budget;
            options.retrieval_fraction = fraction;
            options.estimation_fraction = 0.0f;
            const auto want = host_select(RetroInferPolicy(options), ctx, batch);
            const cuda::RetroInferSelect retro{dev.a.data, sinks.data, sink_tokens.data, recent.data,
                                               budget,     64,         fraction,         windows.data};
            const auto got = dev.run(
                cuda::retroinfer_select_capacity(dev.rows, retro), [&](const cuda::SelectOutput& out, cudaStream_t s) {
                  cuda::retroinfer_select(dev.rows, retro, out, dev.workspace.data, dev.workspace.size, s);
                });
            require_same(got, want);
          }
        }
      }
    }
  }
}

TEST_CASE("retroinfer_estimate equals RetroInferPolicy::attend", "[gpu][select]") {
  struct Zones {
    float retrieval, estimation;
  };
  std::mt19937 rng(45);
  float worst = 0.0f;
  // Rows end to end, then scattered over an arena of fixed-capacity regions (select_test_data.hpp).
  for (const bool arena : {false, true}) {
    for (const std::uint32_t group : kGroups) {
      for (const std::uint32_t clusters : {0u, 250u, 8000u}) {
        const LayerContext ctx = layer_context(2, 128, 8, group);
        std::vector<SelectRequest<RetroInferPolicy::LayerState>> batch;
        for (const std::uint32_t window : {64u, 19u}) {
          batch.push_back(retroinfer_request(ctx, clusters, 12, window, rng));
        }
        const HostRows host = arena ? in_arena(retroinfer_rows(ctx, batch), 5, 3, rng) : retroinfer_rows(ctx, batch);
        DeviceRetro dev(host);
        for (const std::uint32_t budget : {0u, 1u, 40u, 2048u, 1000000u}) {  // 0: the fraction rule
          for (const Zones zones : {Zones{0.018f, 0.232f}, Zones{0.3f, 0.7f}}) {
            for (const bool estimation : {true, false}) {
              CAPTURE(arena, group, clusters, budget, zones.retrieval, estimation);
              RetroInferPolicy::Options options;
              options.budget_tokens = budget;
              options.retrieval_fraction = zones.retrieval;
              options.estimation_fraction = zones.estimation;
              options.estimation = estimation;
              const auto want = host_estimate(RetroInferPolicy(options), ctx, batch);
              const auto got = dev.run(dev.select_params(budget, zones.retrieval), zones.estimation, estimation);
              REQUIRE(got.size() == want.size());
              for (std::size_t j = 0; j < got.size(); ++j) {
                CAPTURE(j, got[j].max, want[j].max, got[j].sum, want[j].sum);
                REQUIRE(same_term(got[j], want[j]));
              }
              if (estimation && budget == 2048u) {
                worst = std::max(worst, attention_with_terms(dev, host.q, want, ctx.kv_heads, rng));
                REQUIRE(worst <= 2e-3f);
              }
            }
          }
        }
      }
    }
  }
  std::printf("attention with retroinfer_estimate's terms vs host: max relative error %.3g\n", double(worst));
}

TEST_CASE("streaming_select and dense_select equal StreamingWindowPolicy / DensePolicy::select", "[gpu][select]") {
  std::mt19937 rng(45);
  // Requests scattered over a tokens-kind store (select_test_data.hpp): prompts
  // with a partial last page, appended pages, other slots garbage; one row
  // longer than a block of threads.
  for (const std::uint32_t page_tokens : {1u, 8u}) {
    const LayerContext ctx = layer_context(4, 64, page_tokens, 2);
    const cuda::SummaryShape shape{cuda::AppendSummary::tokens, 1, 5, ctx.kv_heads, ctx.head_dim, 1200};
    const std::uint32_t slots[] = {3, 0, 4}, prompts[] = {5, 77, 1100}, appended[] = {2, 0, 40};
    std::vector<PositionalRequest<StreamingWindowPolicy>> streaming_batch;
    std::vector<PositionalRequest<DensePolicy>> dense_batch;
    for (int b = 0; b < 3; ++b) {
      streaming_batch.push_back(positional_request(StreamingWindowPolicy(), ctx, slots[b], prompts[b], appended[b]));
      dense_batch.push_back(positional_request(DensePolicy(), ctx, slots[b], prompts[b], appended[b]));
    }
    DeviceRows dev(positional_rows(shape, ctx, streaming_batch, rng));
    {
      CAPTURE(page_tokens);
      const auto want = host_select(DensePolicy(), ctx, dense_batch);
      const auto got =
          dev.run(cuda::dense_select_capacity(dev.rows),
                  [&](const cuda::SelectOutput& out, cudaStream_t s) { cuda::dense_select(dev.rows, out, s); });
      require_same(got, want);
    }
    for (const std::uint32_t budget : {1u, 3u, 8u, 100u, 2048u, 100000u}) {
      for (const std::uint32_t sinks : {0u, 4u, 9u}) {
        CAPTURE(page_tokens, budget, sinks);
        StreamingWindowPolicy::Options options;
        options.budget_tokens = budget;
        options.sink_tokens = sinks;
        const StreamingWindowPolicy policy(options);
        const auto spec = device_select(policy, ctx).get<StreamingDeviceSelect>();
        const cuda::StreamingSelect streaming{spec.budget_tokens, spec.sink_pages, page_tokens};
        const auto want = host_select(policy, ctx, streaming_batch);
        const auto got = dev.run(cuda::streaming_select_capacity(dev.rows, streaming),
                                 [&](const cuda::SelectOutput& out, cudaStream_t s) {
                                   cuda::streaming_select(dev.rows, streaming, out, s);
                                 });
        require_same(got, want);
      }
    }
  }
}

TEST_CASE("select entry points refuse bad arguments before launching", "[gpu][select]") {
  std::mt19937 rng(44);
  const LayerContext ctx = layer_context(2, 64, 8, 2);
  const std::vector<SelectRequest<QuestPolicy::LayerState>> batch{quest_request(ctx, 50, 16, rng)};
  DeviceRows dev(quest_rows(ctx, batch));
  DeviceArray<PartitionId> selected(std::size_t{dev.rows.rows} * 64);
  DeviceArray<std::uint32_t> count(dev.rows.rows);
  const cuda::SelectOutput out{64, selected.data, count.data};
  const cuda::QuestSelect quest{dev.a.data, dev.b.data, 64, false};
  const auto quest_call = [&](cuda::SelectRows rows, cuda::QuestSelect params, cuda::SelectOutput o,
                              std::size_t bytes) {
    return code_of([&] { cuda::quest_select(rows, params, o, dev.workspace.data, bytes, nullptr); });
  };
  const std::size_t bytes = dev.workspace.size;
  auto rows = dev.rows;
  rows.kv_heads = 0;
  CHECK(quest_call(rows, quest, out, bytes) == ErrorCode::invalid_argument);
  rows = dev.rows;
  rows.rows = 3;  // not a whole number of requests of 2 kv heads
  CHECK(quest_call(rows, quest, out, bytes) == ErrorCode::invalid_argument);
  rows = dev.rows;
  rows.max_row_candidates = rows.candidates + 1;
  CHECK(quest_call(rows, quest, out, bytes) == ErrorCode::invalid_argument);
  rows = dev.rows;
  rows.q = nullptr;
  CHECK(quest_call(rows, quest, out, bytes) == ErrorCode::invalid_argument);
  rows = dev.rows;
  rows.first = nullptr;
  CHECK(quest_call(rows, quest, out, bytes) == ErrorCode::invalid_argument);
  rows = dev.rows;
  rows.count = nullptr;
  CHECK(quest_call(rows, quest, out, bytes) == ErrorCode::invalid_argument);
  CHECK(quest_call(dev.rows, quest, out, bytes - 1) == ErrorCode::invalid_argument);
  CHECK(quest_call(dev.rows, quest, cuda::SelectOutput{49, selected.data, count.data}, bytes) ==
        ErrorCode::invalid_argument);
  auto no_min = quest;
  no_min.min = nullptr;
  CHECK(quest_call(dev.rows, no_min, out, bytes) == ErrorCode::invalid_argument);
  auto zero_budget = quest;
  zero_budget.budget_tokens = 0;
  CHECK(quest_call(dev.rows, zero_budget, out, bytes) == ErrorCode::invalid_argument);
  const cuda::RetroInferSelect retro{dev.a.data, selected.data, count.data, count.data, 64, 64, 1.5f};
  CHECK(code_of([&] {
          cuda::retroinfer_select(dev.rows, retro, cuda::SelectOutput{65, selected.data, count.data},
                                  dev.workspace.data, bytes, nullptr);
        }) == ErrorCode::invalid_argument);
  DeviceArray<float> terms(std::size_t{dev.rows.rows} * dev.rows.group * dev.rows.head_dim);
  DeviceArray<std::byte> estimate_workspace(cuda::select_workspace_bytes(dev.rows));
  const cuda::EstimateOutput terms_out{terms.data, terms.data, terms.data};
  const auto estimate_call = [&](cuda::RetroInferSelect r, cuda::RetroInferEstimate e, cuda::EstimateOutput o,
                                 std::size_t ws) {
    return code_of([&] { cuda::retroinfer_estimate(dev.rows, r, e, o, estimate_workspace.data, ws, nullptr); });
  };
  const cuda::RetroInferSelect retro_ok{dev.a.data, selected.data, count.data, count.data, 64, 64, 0.3f};
  const cuda::RetroInferEstimate estimate_ok{dev.b.data, selected.data, count.data, 65, 0.7f, true};
  const std::size_t estimate_bytes = estimate_workspace.size;
  CHECK(estimate_call(retro_ok, estimate_ok, terms_out, estimate_bytes - 1) == ErrorCode::invalid_argument);
  auto too_much = estimate_ok;
  too_much.estimation_fraction = 0.75f;
  CHECK(estimate_call(retro_ok, too_much, terms_out, estimate_bytes) == ErrorCode::invalid_argument);
  auto small_selection = estimate_ok;
  small_selection.max_selected = 50;  // below retroinfer_select_capacity: 50 candidates and the sink
  CHECK(estimate_call(retro_ok, small_selection, terms_out, estimate_bytes) == ErrorCode::invalid_argument);
  auto no_values = estimate_ok;
  no_values.value_sums = nullptr;
  CHECK(estimate_call(retro_ok, no_values, terms_out, estimate_bytes) == ErrorCode::invalid_argument);
  auto no_count = estimate_ok;
  no_count.selected_count = nullptr;
  CHECK(estimate_call(retro_ok, no_count, terms_out, estimate_bytes) == ErrorCode::invalid_argument);
  CHECK(estimate_call(retro_ok, estimate_ok, cuda::EstimateOutput{terms.data, nullptr, terms.data}, estimate_bytes) ==
        ErrorCode::invalid_argument);
  const cuda::ShadowKVSelect shadowkv{dev.a.data, nullptr, 64, 32, 2};
  CHECK(code_of([&] { cuda::shadowkv_select(dev.rows, shadowkv, out, dev.workspace.data, bytes, nullptr); }) ==
        ErrorCode::invalid_argument);
  // The positional selections.
  const cuda::StreamingSelect streaming{64, 1, 8};
  const auto streaming_call = [&](cuda::SelectRows r, cuda::StreamingSelect params, cuda::SelectOutput o) {
    return code_of([&] { cuda::streaming_select(r, params, o, nullptr); });
  };
  const cuda::SelectOutput positional_out{50, selected.data, count.data};  // 50 candidates, budget 8 pages
  REQUIRE_NOTHROW(cuda::streaming_select(dev.rows, streaming, positional_out, nullptr));
  check(cudaDeviceSynchronize());
  auto zero = streaming;
  zero.budget_tokens = 0;
  CHECK(streaming_call(dev.rows, zero, positional_out) == ErrorCode::invalid_argument);
  zero = streaming;
  zero.page_tokens = 0;
  CHECK(streaming_call(dev.rows, zero, positional_out) == ErrorCode::invalid_argument);
  CHECK(streaming_call(dev.rows, streaming, cuda::SelectOutput{7, selected.data, count.data}) ==
        ErrorCode::invalid_argument);
  rows = dev.rows;
  rows.tokens = nullptr;
  CHECK(streaming_call(rows, streaming, positional_out) == ErrorCode::invalid_argument);
  rows = dev.rows;
  rows.rows = 3;
  CHECK(streaming_call(rows, streaming, positional_out) == ErrorCode::invalid_argument);
  CHECK(streaming_call(dev.rows, streaming, cuda::SelectOutput{64, selected.data, nullptr}) ==
        ErrorCode::invalid_argument);
  const auto dense_call = [&](cuda::SelectRows r, cuda::SelectOutput o) {
    return code_of([&] { cuda::dense_select(r, o, nullptr); });
  };
  CHECK(dense_call(dev.rows, cuda::SelectOutput{49, selected.data, count.data}) == ErrorCode::invalid_argument);
  rows = dev.rows;
  rows.partitions = nullptr;
  CHECK(dense_call(rows, positional_out) == ErrorCode::invalid_argument);
  rows = dev.rows;
  rows.max_row_candidates = rows.candidates + 1;
  CHECK(dense_call(rows, positional_out) == ErrorCode::invalid_argument);
  // Dense reads neither q nor tokens.
  rows = dev.rows;
  rows.q = nullptr;
  rows.tokens = nullptr;
  REQUIRE_NOTHROW(cuda::dense_select(rows, positional_out, nullptr));
  check(cudaDeviceSynchronize());
  // Nothing else was launched: the stream has no error and the counts are untouched.
  check(cudaDeviceSynchronize());
  check(cudaGetLastError());
}
