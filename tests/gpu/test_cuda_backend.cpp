// The facade on the CUDA backend against the host backend: the lockstep of
// tests/support/backend_lockstep.hpp (CI runs it on a deferred-copy host twin), every
// built-in policy. Metadata (hits, misses, pages moved, GPU page ids) must be
// identical, refusals too; attention outputs within 2e-3 relative (bf16
// pages, fp32 accumulation in both). Also the address-list gather the
// backend's loads use, and attend() over a plan with live masks and slot
// weights (SpvLLM §2, H2O) against HostBackend::attend, and H2O through
// the facade in lockstep (fp32: outputs within 1e-4, identical live sets).
#include <catch2/catch.hpp>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <random>
#include <vector>

#include "attention_test_data.hpp"
#include "backend_lockstep.hpp"
#include "eviction_stream.hpp"
#include "gpu_support.hpp"
#include "sparsekv/facade/cuda_backend.hpp"
#include "sparsekv/facade/manager_inspection.hpp"
#include "sparsekv/sparsekv.hpp"
#include "sparsekv/transfer/page_gather_cuda.hpp"

using namespace sparsekv;
using namespace sparsekv::gpu_test;

TEST_CASE("CudaBackend: the facade on device memory matches the host backend", "[gpu][backend]") {
  const test::LockstepShape s;
  for (const std::string& name : policy_names()) {
    INFO(name);
    const Config config = test::lockstep_config(s, name);
    RuntimeManager host(s.shape, config, make_policy(name, s.budget_tokens));
    RuntimeManager cuda(s.shape, config, make_policy(name, s.budget_tokens), std::make_unique<cuda::CudaBackend>());
    REQUIRE(cuda.backend().name() == "cuda");
    REQUIRE(inspect_buffer(cuda).tiers().gpu_pool.memory_kind() == MemoryKind::device);
    const test::LockstepResult r = test::lockstep(host, cuda, s, 11, 2e-3);
    CHECK(r.refused > 0);
  }
}

TEST_CASE("CudaBackend::attend honours live masks and returns slot weights as HostBackend does",
          "[gpu][backend][masks]") {
  std::mt19937 rng(12);
  cuda::CudaBackend cuda_backend;
  HostBackend host_backend;
  for (const std::uint32_t group : {1u, 4u}) {
    test::AttentionBatch b = test::random_runs_batch(rng, 3, 2, group, PageLayout{8, 64, DType::bf16}, false);
    test::random_masks(b, rng);
    const DeviceArray<std::byte> device_pool(b.pool);
    AttendPlan plan = test::attend_plan_of(b, b.pool.data());
    AttendCall call = test::attend_call_of(b, plan);
    const std::size_t outputs = std::size_t{b.batch} * b.q_heads * 64, slots = b.indices.size() * 8;
    std::vector<float> want_out(outputs), want_weights(slots), got_out(outputs, -1.0f), got_weights(slots, -1.0f);
    call.out = want_out.data();
    call.slot_weights = want_weights.data();
    host_backend.attend(call);
    plan.gpu_tier_base = device_pool.data;
    call.out = got_out.data();
    call.slot_weights = got_weights.data();
    cuda_backend.attend(call);
    CAPTURE(group);
    for (std::size_t i = 0; i < outputs; ++i)
      REQUIRE(std::abs(got_out[i] - want_out[i]) <= 2e-3f * (1 + std::abs(want_out[i])));
    for (std::size_t i = 0; i < slots; ++i) {
      CAPTURE(i);
      if (want_weights[i] == 0.0f) REQUIRE(got_weights[i] == 0.0f);
      REQUIRE(std::abs(got_weights[i] - want_weights[i]) <= 1e-4f);
    }
    // live_masks not parallel to indices: refused before anything is written.
    plan.live_masks.pop_back();
    std::fill(got_weights.begin(), got_weights.end(), 7.0f);
    REQUIRE(code_of([&] { cuda_backend.attend(call); }) == ErrorCode::invalid_argument);
    REQUIRE(std::all_of(got_weights.begin(), got_weights.end(), [](float x) { return x == 7.0f; }));
  }
}

TEST_CASE("CudaBackend: h2o through the facade evicts as on the host backend", "[gpu][backend][eviction]") {
  // H2O's scores come from the kernel's slot weights: the same evictions need
  // them within the float noise of the host's (fp32 pages, no near-ties).
  const test::EvictionStream s({30, 75}, 100, 21, 1, 64);  // the kernel's smallest head_dim
  for (const EvictionStrategy strategy : {EvictionStrategy::slot_reuse, EvictionStrategy::sparse_copy}) {
    CAPTURE(to_string(strategy));
    const Config config = s.config(strategy);
    RuntimeManager host(s.shape, config, make_policy("h2o", 48));
    RuntimeManager cuda(s.shape, config, make_policy("h2o", 48), std::make_unique<cuda::CudaBackend>());
    REQUIRE(inspect_buffer(cuda).tiers().gpu_pool.memory_kind() == MemoryKind::device);
    s.add_and_prefill(host);
    s.add_and_prefill(cuda);
    std::vector<float> want, got;
    std::uint64_t evicted = 0;
    for (std::uint32_t t = 0; t < s.steps; ++t) {
      for (std::uint32_t l = 0; l < s.shape.layers; ++l) {
        CAPTURE(t, l);
        s.decode(host, t, l, want);
        s.decode(cuda, t, l, got);
        for (std::size_t i = 0; i < want.size(); ++i) REQUIRE(std::abs(got[i] - want[i]) <= 1e-4f);
        for (const RequestId id : s.batch()) {
          for (std::uint32_t h = 0; h < s.shape.kv_heads; ++h) {
            const std::vector<std::uint32_t> live = test::live_positions(host, id, l, h);
            REQUIRE(test::live_positions(cuda, id, l, h) == live);
            evicted += inspect_buffer(host).admission().sequence_length(id, l) - live.size();
          }
        }
      }
    }
    CHECK(evicted > 0);
    inspect_buffer(cuda).validate();
  }
}

TEST_CASE("gather_page_addresses copies each listed page", "[gpu][gather]") {
  constexpr std::size_t kPage = 4096;
  constexpr std::uint32_t kPages = 300;
  std::mt19937 rng(5);
  PinnedBytes host(kPages * kPage);
  DeviceBytes device(2 * kPages * kPage);
  PinnedBytes src_list(kPages * sizeof(void*)), dst_list(kPages * sizeof(void*));
  fill_random(host.data, kPages * kPage, rng);
  const auto* bytes = host.as<const std::uint8_t>();
  check(cudaMemset(device.data, 0, 2 * kPages * kPage));
  std::vector<std::uint32_t> order(kPages);
  for (std::uint32_t i = 0; i < kPages; ++i) order[i] = i;
  std::shuffle(order.begin(), order.end(), rng);
  auto** src = src_list.as<const std::byte*>();
  auto** dst = dst_list.as<std::byte*>();
  for (std::uint32_t i = 0; i < kPages; ++i) {
    src[i] = host.data + std::size_t{order[i]} * kPage;
    dst[i] = device.data + std::size_t{2 * i + 1} * kPage;  // every other page
  }
  cuda::gather_page_addresses(src, dst, kPages, kPage, {}, nullptr);
  check(cudaDeviceSynchronize());
  std::vector<std::uint8_t> back(2 * kPages * kPage);
  check(cudaMemcpy(back.data(), device.data, back.size(), cudaMemcpyDeviceToHost));
  for (std::uint32_t i = 0; i < kPages; ++i) {
    REQUIRE(std::equal(back.begin() + std::size_t{2 * i + 1} * kPage, back.begin() + std::size_t{2 * i + 2} * kPage,
                       bytes + std::size_t{order[i]} * kPage));
    REQUIRE(std::all_of(back.begin() + std::size_t{2 * i} * kPage, back.begin() + std::size_t{2 * i + 1} * kPage,
                        [](std::uint8_t x) { return x == 0; }));
  }
}
