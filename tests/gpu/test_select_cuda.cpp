// Select kernels (policy/select_cuda.hpp) against the host policies' select
// on random batches with planted ties, budgets below one partition, covering
// budgets, GQA groups 1..8 and rows longer than one tile: the same
// partitions, bit for bit. Bad arguments are refused before any launch.
#include <catch2/catch.hpp>
#include <cuda_runtime.h>

#include <cstdint>
#include <random>
#include <vector>

#include "../select_test_data.hpp"
#include "gpu_support.hpp"
#include "sparsekv/policy/select_cuda.hpp"

using namespace sparsekv;
using namespace sparsekv::gpu_test;
using namespace sparsekv::test;

namespace {

// HostRows on the device, and the kernel's output read back row by row.
struct DeviceRows {
  explicit DeviceRows(const HostRows& h)
      : offsets(h.offsets), tokens(h.tokens), partitions(h.partitions), q(h.q), a(h.a), b(h.b) {
    rows.rows = h.rows();
    rows.kv_heads = h.kv_heads;
    rows.group = h.group;
    rows.head_dim = h.head_dim;
    rows.candidates = h.offsets.back();
    rows.max_row_candidates = h.max_row;
    rows.offsets = offsets.data;
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
    const auto ids = selected.download();
    const auto counts = count.download();
    std::vector<std::vector<PartitionId>> out(rows.rows);
    for (std::uint32_t r = 0; r < rows.rows; ++r) {
      REQUIRE(counts[r] <= capacity);
      out[r].assign(ids.begin() + std::size_t{r} * capacity, ids.begin() + std::size_t{r} * capacity + counts[r]);
    }
    return out;
  }
  DeviceArray<std::uint32_t> offsets, tokens;
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

}  // namespace

TEST_CASE("quest_select equals QuestPolicy::select", "[gpu][select]") {
  std::mt19937 rng(41);
  for (const std::uint32_t group : kGroups) {
    for (const std::uint32_t n : {1u, 19u, 300u, 5000u}) {
      LayerContext ctx = layer_context(4, 128, 8, group);
      std::vector<SelectRequest<QuestPolicy::LayerState>> batch;
      for (int b = 0; b < 3; ++b) batch.push_back(quest_request(ctx, n, 16, rng));
      const HostRows host = quest_rows(ctx, batch);
      DeviceRows dev(host);
      for (const std::uint32_t budget : {1u, 8u, 2048u, 100000u}) {
        for (const std::uint32_t layer : {0u, 5u}) {
          CAPTURE(group, n, budget, layer);
          ctx.layer = layer;
          QuestPolicy::Options options;
          options.budget_tokens = budget;
          const auto want = host_select(QuestPolicy(options), ctx, batch);
          const cuda::QuestSelect quest{dev.a.data, dev.b.data, budget, layer < options.dense_layers};
          const auto got = dev.run(cuda::quest_select_capacity(dev.rows, quest), [&](const cuda::SelectOutput& out,
                                                                                     cudaStream_t s) {
            cuda::quest_select(dev.rows, quest, out, dev.workspace.data, dev.workspace.size, s);
          });
          require_same(got, want);
        }
      }
    }
  }
}

TEST_CASE("shadowkv_select equals ShadowKVPolicy::select", "[gpu][select]") {
  std::mt19937 rng(42);
  for (const std::uint32_t group : kGroups) {
    for (const std::uint32_t n : {1u, 40u, 1500u, 16384u}) {
      const LayerContext ctx = layer_context(2, 128, 8, group);
      std::vector<SelectRequest<ShadowKVPolicy::LayerState>> batch;
      for (int b = 0; b < 2; ++b) batch.push_back(shadowkv_request(ctx, n, rng));
      const HostRows host = shadowkv_rows(ctx, batch);
      DeviceRows dev(host);
      for (const std::uint32_t budget : {1u, 16u, 2048u, 200000u}) {
        CAPTURE(group, n, budget);
        ShadowKVPolicy::Options options;
        options.budget_tokens = budget;
        const ShadowKVPolicy policy(options);
        const auto want = host_select(policy, ctx, batch);
        const cuda::ShadowKVSelect shadowkv{dev.a.data, dev.b.data, budget, options.recent_tokens,
                                            policy.outlier_count()};
        const auto got = dev.run(cuda::shadowkv_select_capacity(dev.rows, shadowkv),
                                 [&](const cuda::SelectOutput& out, cudaStream_t s) {
                                   cuda::shadowkv_select(dev.rows, shadowkv, out, dev.workspace.data,
                                                         dev.workspace.size, s);
                                 });
        require_same(got, want);
      }
    }
  }
}

TEST_CASE("retroinfer_select equals RetroInferPolicy::select", "[gpu][select]") {
  std::mt19937 rng(43);
  for (const std::uint32_t group : kGroups) {
    for (const std::uint32_t clusters : {0u, 250u, 8000u}) {
      const LayerContext ctx = layer_context(2, 128, 8, group);
      std::vector<SelectRequest<RetroInferPolicy::LayerState>> batch;
      for (int b = 0; b < 2; ++b) batch.push_back(retroinfer_request(ctx, clusters, 12, 64, rng));
      const HostRows host = retroinfer_rows(ctx, batch);
      DeviceRows dev(host);
      DeviceArray<PartitionId> sinks(host.sink_partitions);
      DeviceArray<std::uint32_t> sink_tokens(host.sink_tokens), recent(host.recent);
      for (const std::uint32_t budget : {1u, 40u, 2048u, 1000000u}) {
        for (const float fraction : {0.018f, 1.0f}) {
          CAPTURE(group, clusters, budget, fraction);
          RetroInferPolicy::Options options;
          options.budget_tokens = budget;
          options.retrieval_fraction = fraction;
          options.estimation_fraction = 0.0f;
          const auto want = host_select(RetroInferPolicy(options), ctx, batch);
          const cuda::RetroInferSelect retro{dev.a.data, sinks.data, sink_tokens.data, recent.data, budget, 64,
                                             fraction};
          const auto got = dev.run(cuda::retroinfer_select_capacity(dev.rows, retro),
                                   [&](const cuda::SelectOutput& out, cudaStream_t s) {
                                     cuda::retroinfer_select(dev.rows, retro, out, dev.workspace.data,
                                                             dev.workspace.size, s);
                                   });
          require_same(got, want);
        }
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
  const cuda::ShadowKVSelect shadowkv{dev.a.data, nullptr, 64, 32, 2};
  CHECK(code_of([&] { cuda::shadowkv_select(dev.rows, shadowkv, out, dev.workspace.data, bytes, nullptr); }) ==
        ErrorCode::invalid_argument);
  // Nothing was launched: the stream has no error and the counts are untouched.
  check(cudaDeviceSynchronize());
  check(cudaGetLastError());
}
