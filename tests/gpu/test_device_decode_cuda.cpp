// The device-tensor API (step/device_runtime.hpp) against the host backend:
// the same requests, arriving and finishing at random, through a Manager on
// HostBackend with host tensors and one on CudaBackend with device tensors on
// the test's stream. Every step: the plans (selections, LRU page ids, runs)
// identical, outputs within 2e-3; hit / miss totals identical -- for every
// built-in policy, RetroInfer's index updates included. Then one layer's step
// captured in a CUDA graph (which fails on any host sync) and replayed equals
// the eager step of a twin manager. The device manager's prefill offloads
// through the staged D2H path (no host copy of the prompt; RetroInfer's comes
// down once, to cluster), so equal plans and outputs also check the CPU pages
// it wrote.
#include <catch2/catch.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <random>
#include <vector>

#include "device_decode_test_data.hpp"
#include "gpu_support.hpp"
#include "sparsekv/core/numeric.hpp"
#include "sparsekv/facade/cuda_backend.hpp"
#include "sparsekv/facade/manager.hpp"
#include "sparsekv/facade/manager_inspection.hpp"
#include "sparsekv/policy/dense.hpp"
#include "sparsekv/policy/quest.hpp"
#include "sparsekv/policy/retroinfer.hpp"
#include "sparsekv/policy/shadowkv.hpp"
#include "sparsekv/policy/streaming_window.hpp"

using namespace sparsekv;
using namespace sparsekv::gpu_test;
using namespace sparsekv::test;

namespace {

// A GPU tier that admits 4 requests of 1024 tokens under every policy (Quest's
// two dense layers and the default min_buffer_ratio of 5 ask 2,346 pages of
// 4 KiB each): with 8 MiB, Quest, Dense and RetroInfer admitted none and their
// lockstep passed without a step (found on an H100).
Config device_config() {
  Config c;
  c.page_tokens = 16;
  c.cpu_tier_bytes = std::size_t{64} << 20;
  c.gpu_tier_bytes = std::size_t{48} << 20;
  c.max_requests = 6;
  c.max_context_tokens = 2048;
  c.host_chunk_bytes = std::size_t{4} << 20;
  return c;
}

struct PlanCopy {
  std::vector<std::int64_t> head_entries, indptr, indices;
  std::vector<std::int32_t> last_page_len;
};

PlanCopy download_plan(const DeviceAttendPlan& p) {
  PlanCopy c;
  c.head_entries.resize(p.rows + 1);
  check(cudaMemcpy(c.head_entries.data(), p.head_entries, c.head_entries.size() * 8, cudaMemcpyDeviceToHost));
  const std::int64_t entries = c.head_entries.back();
  c.indptr.resize(entries + 1);
  c.last_page_len.resize(entries);
  check(cudaMemcpy(c.indptr.data(), p.indptr, c.indptr.size() * 8, cudaMemcpyDeviceToHost));
  check(cudaMemcpy(c.last_page_len.data(), p.last_page_len, c.last_page_len.size() * 4, cudaMemcpyDeviceToHost));
  c.indices.resize(c.indptr.back());
  check(cudaMemcpy(c.indices.data(), p.indices, c.indices.size() * 8, cudaMemcpyDeviceToHost));
  return c;
}

// `enqueue` inside a global-mode capture of `stream` (any synchronizing call
// or allocation fails it); the graph. When it throws, the capture is ended
// first, or every later CUDA call of the process fails with it.
template <class Enqueue>
cudaGraph_t capture(cudaStream_t stream, Enqueue&& enqueue) {
  check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  cudaGraph_t graph = nullptr;
  try {
    enqueue();
  } catch (...) {
    cudaStreamEndCapture(stream, &graph);
    if (graph != nullptr) cudaGraphDestroy(graph);
    cudaGetLastError();
    throw;
  }
  check(cudaStreamEndCapture(stream, &graph));
  return graph;
}

template <class Policy>
void run_lockstep(const Policy& policy, std::uint32_t seed) {
  const ModelShape shape = device_shape();
  const Config config = device_config();
  Manager<Policy> host(shape, config, policy);
  Manager<Policy> device(shape, config, policy, std::make_unique<cuda::CudaBackend>());
  Stream stream;
  std::mt19937 rng(seed);
  const std::size_t kv_row = std::size_t{shape.kv_heads} * shape.head_dim;
  const std::size_t q_row = std::size_t{shape.q_heads} * shape.head_dim;
  std::vector<RequestId> live;
  RequestId next = 1;
  CacheStepStats host_cache;
  int admitted = 0, decodes = 0, plans = 0;
  for (int step = 0; step < 160; ++step) {
    INFO("seed " << seed << " step " << step);
    if (live.size() < 4 && rng() % 4 == 0) {
      const std::uint32_t prompt = 40 + rng() % 400;
      const RequestId id = next++;
      if (host.can_admit(prompt, 1024).admit) {
        host.add_request(id, 1024);
        device.add_request(id, 1024);
        for (std::uint32_t l = 0; l < shape.layers; ++l) {
          const auto k = random_bf16(prompt * kv_row, rng);
          const auto v = random_bf16(prompt * kv_row, rng);
          host.prefill(id, l, k.data(), v.data(), prompt);
          DeviceArray<std::uint16_t> dk(k), dv(v);
          device.prefill(id, l, dk.data, dv.data, prompt, stream.stream);
        }
        live.push_back(id);
        ++admitted;
      }
    }
    if (!live.empty() && rng() % 23 == 0) {
      const std::size_t i = rng() % live.size();
      host.finish(live[i]);
      device.finish(live[i]);
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(i));
    }
    if (live.empty()) continue;
    std::vector<RequestId> batch = live;
    std::shuffle(batch.begin(), batch.end(), rng);
    batch.resize(1 + rng() % batch.size());
    for (std::uint32_t l = 0; l < shape.layers; ++l) {
      const auto q = random_bf16(batch.size() * q_row, rng);
      const auto k = random_bf16(batch.size() * kv_row, rng);
      const auto v = random_bf16(batch.size() * kv_row, rng);
      DeviceArray<std::uint16_t> dq(q), dk(k), dv(v);
      if (step % 2 == 1) {
        // plan(): selections, LRU page ids and runs identical to the host plan.
        const AttendPlan& want = host.plan(batch, l, q.data(), k.data(), v.data());
        for (std::size_t b = 0; b < batch.size(); ++b) host_cache += host.retrieval(b).stats;
        const DeviceAttendPlan plan = device.plan(batch, l, dq.data, dk.data, dv.data, stream.stream);
        // The test's stream does not block the legacy stream download_plan copies on.
        check(cudaStreamSynchronize(stream.stream));
        const PlanCopy got = download_plan(plan);
        ++plans;
        REQUIRE(got.head_entries == want.head_entries);
        REQUIRE(got.indptr == want.indptr);
        REQUIRE(got.indices == want.indices);
        REQUIRE(got.last_page_len == want.last_page_len);
        continue;
      }
      std::vector<float> want(batch.size() * q_row);
      host.decode(batch, l, q.data(), k.data(), v.data(), want.data());
      for (std::size_t b = 0; b < batch.size(); ++b) host_cache += host.retrieval(b).stats;
      DeviceArray<float> out(want.size());
      device.decode(batch, l, dq.data, dk.data, dv.data, out.data, stream.stream);
      // The step is on a non-blocking stream: cudaMemcpy (legacy stream) would not wait for it.
      check(cudaStreamSynchronize(stream.stream));
      const std::vector<float> got = out.download();
      ++decodes;
      for (std::size_t i = 0; i < want.size(); ++i) REQUIRE(std::abs(got[i] - want[i]) <= 2e-3f);
    }
  }
  device.synchronize();
  CAPTURE(admitted, decodes, plans);
  REQUIRE(admitted >= 4);  // a lockstep that admitted nothing compared nothing
  REQUIRE(decodes > 0);
  REQUIRE(plans > 0);
  REQUIRE(device.stats().cache.hit_pages == host_cache.hit_pages);
  REQUIRE(device.stats().cache.miss_pages == host_cache.miss_pages);
}

}  // namespace

TEST_CASE("device-tensor decode equals the host backend (Quest, ShadowKV)", "[gpu][device-decode]") {
  QuestPolicy::Options quest;
  quest.budget_tokens = 256;
  quest.page_tokens_per_partition = 16;
  run_lockstep(QuestPolicy(quest), 1);
  ShadowKVPolicy::Options shadow;
  shadow.budget_tokens = 256;
  run_lockstep(ShadowKVPolicy(shadow), 2);
}

TEST_CASE("device-tensor decode equals the host backend (StreamingWindow, Dense)", "[gpu][device-decode]") {
  StreamingWindowPolicy::Options streaming;
  streaming.budget_tokens = 256;
  streaming.sink_tokens = 20;  // sinks reaching into a second page
  run_lockstep(StreamingWindowPolicy(streaming), 3);
  run_lockstep(DensePolicy(), 4);
}

TEST_CASE("device-tensor decode equals the host backend (RetroInfer)", "[gpu][device-decode]") {
  // Short index updates: the host regroups between steps and re-uploads the
  // regions; the estimation zone is merged by the attention kernel.
  run_lockstep(RetroInferPolicy(frequent_update_retroinfer(256, true)), 5);
  run_lockstep(RetroInferPolicy(frequent_update_retroinfer(256, false)), 6);
}

TEST_CASE("device-tensor decode: one layer's step captured in a CUDA graph equals the eager step",
          "[gpu][device-decode]") {
  const ModelShape shape = device_shape();
  const Config config = device_config();
  QuestPolicy::Options options;
  options.budget_tokens = 128;
  options.page_tokens_per_partition = 16;
  Manager<QuestPolicy> eager(shape, config, QuestPolicy(options), std::make_unique<cuda::CudaBackend>());
  Manager<QuestPolicy> graph(shape, config, QuestPolicy(options), std::make_unique<cuda::CudaBackend>());
  Stream stream;
  std::mt19937 rng(9);
  const std::size_t kv_row = std::size_t{shape.kv_heads} * shape.head_dim;
  const std::size_t q_row = std::size_t{shape.q_heads} * shape.head_dim;
  const std::vector<RequestId> batch = {4, 7};
  for (RequestId id : batch) {
    eager.add_request(id, 1024);
    graph.add_request(id, 1024);
    for (std::uint32_t l = 0; l < shape.layers; ++l) {
      const std::uint32_t prompt = 300 + 17 * id;
      DeviceArray<std::uint16_t> k(random_bf16(prompt * kv_row, rng)), v(random_bf16(prompt * kv_row, rng));
      eager.prefill(id, l, k.data, v.data, prompt, stream.stream);
      graph.prefill(id, l, k.data, v.data, prompt, stream.stream);
    }
  }
  // Steps up to one that fills a tail (a save and a new partition in the captured step): request 7's
  // tails fill at steps 36-38, one a layer, each captured on its own. The captures take as many
  // steps as there are layers (a forward pass), then an eager step makes room again (step 39).
  for (int step = 0; step < 40; ++step) {
    const std::uint32_t l = static_cast<std::uint32_t>(step) % shape.layers;
    DeviceArray<std::uint16_t> q(random_bf16(batch.size() * q_row, rng)), k(random_bf16(batch.size() * kv_row, rng)),
        v(random_bf16(batch.size() * kv_row, rng));
    DeviceArray<float> a(batch.size() * q_row), b(batch.size() * q_row);
    eager.decode(batch, l, q.data, k.data, v.data, a.data, stream.stream);
    if (step < 36 || step == 39) {
      graph.decode(batch, l, q.data, k.data, v.data, b.data, stream.stream);
      check(cudaStreamSynchronize(stream.stream));
      continue;
    }
    cudaGraph_t captured =
        capture(stream.stream, [&] { graph.decode(batch, l, q.data, k.data, v.data, b.data, stream.stream); });
    cudaGraphExec_t exec = nullptr;
    check(cudaGraphInstantiate(&exec, captured, 0));
    check(cudaGraphLaunch(exec, stream.stream));
    check(cudaStreamSynchronize(stream.stream));
    REQUIRE(a.download() == b.download());
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(captured);
  }
  eager.synchronize();
  graph.synchronize();
  REQUIRE(eager.stats().cache.hit_pages == graph.stats().cache.hit_pages);
  REQUIRE(eager.stats().cache.miss_pages == graph.stats().cache.miss_pages);
}

TEST_CASE("device-tensor decode: a capture takes one step a layer, the next is refused unchanged",
          "[gpu][device-decode]") {
  // The captured steps' argument blocks are allocated ahead, one a layer (no
  // allocation is permitted inside a capture): a whole forward pass fits, one
  // more step is refused before the buffer changes, and an eager step after
  // the capture makes room again.
  const ModelShape shape = device_shape();
  QuestPolicy::Options options;
  options.budget_tokens = 128;
  options.page_tokens_per_partition = 16;
  Manager<QuestPolicy> m(shape, device_config(), QuestPolicy(options), std::make_unique<cuda::CudaBackend>());
  Stream stream;
  std::mt19937 rng(12);
  const std::size_t kv_row = std::size_t{shape.kv_heads} * shape.head_dim;
  const std::size_t q_row = std::size_t{shape.q_heads} * shape.head_dim;
  const std::vector<RequestId> batch = {1};
  m.add_request(1, 1024);
  DeviceArray<std::uint16_t> k(random_bf16(200 * kv_row, rng)), v(random_bf16(200 * kv_row, rng));
  for (std::uint32_t l = 0; l < shape.layers; ++l) m.prefill(1, l, k.data, v.data, 200, stream.stream);
  DeviceArray<std::uint16_t> q(random_bf16(q_row, rng)), k_new(random_bf16(kv_row, rng)),
      v_new(random_bf16(kv_row, rng));
  DeviceArray<float> out(q_row);
  for (std::uint32_t l = 0; l < shape.layers; ++l)
    m.decode(batch, l, q.data, k_new.data, v_new.data, out.data, stream.stream);
  check(cudaStreamSynchronize(stream.stream));
  ErrorCode refused = ErrorCode::internal;
  std::uint32_t length_before = 0, length_after = 0;
  cudaGraph_t captured = capture(stream.stream, [&] {
    for (std::uint32_t l = 0; l < shape.layers; ++l) {
      m.decode(batch, l, q.data, k_new.data, v_new.data, out.data, stream.stream);
    }
    length_before = inspect_buffer(m).admission().sequence_length(1, 0);
    refused = code_of([&] { m.decode(batch, 0, q.data, k_new.data, v_new.data, out.data, stream.stream); });
    length_after = inspect_buffer(m).admission().sequence_length(1, 0);
  });
  REQUIRE(refused == ErrorCode::failed_precondition);
  REQUIRE(length_after == length_before);
  cudaGraphExec_t exec = nullptr;
  check(cudaGraphInstantiate(&exec, captured, 0));
  check(cudaGraphLaunch(exec, stream.stream));
  check(cudaStreamSynchronize(stream.stream));
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(captured);
  m.decode(batch, 0, q.data, k_new.data, v_new.data, out.data, stream.stream);  // eager: refills the blocks
  m.synchronize();
  REQUIRE(inspect_buffer(m).admission().sequence_length(1, 0) == length_before + 1);
}

TEST_CASE("device-tensor API: bad input is refused before anything is enqueued", "[gpu][device-decode]") {
  const ModelShape shape = device_shape();
  QuestPolicy::Options options;
  options.page_tokens_per_partition = 16;
  Manager<QuestPolicy> m(shape, device_config(), QuestPolicy(options), std::make_unique<cuda::CudaBackend>());
  Stream stream;
  std::mt19937 rng(3);
  const std::size_t kv_row = std::size_t{shape.kv_heads} * shape.head_dim;
  m.add_request(1, 512);
  std::vector<std::uint16_t> host_k = random_bf16(64 * kv_row, rng);
  REQUIRE(code_of([&] { m.prefill(1, 0, host_k.data(), host_k.data(), 64, stream.stream); }) ==
          ErrorCode::invalid_argument);  // host pointers where device ones are required
  DeviceArray<std::uint16_t> k(host_k);
  // A non-finite prompt value is found on the device and refused before the CPU tier changes.
  std::vector<std::uint16_t> nan_v = host_k;
  nan_v[(37 * shape.kv_heads + 1) * shape.head_dim + 5] = 0x7fc0;  // token 37, kv head 1, dim 5: a bf16 NaN
  DeviceArray<std::uint16_t> bad_v(nan_v);
  REQUIRE(code_of([&] { m.prefill(1, 0, k.data, bad_v.data, 64, stream.stream); }) == ErrorCode::invalid_argument);
  REQUIRE(inspect_buffer(m).admission().sequence_length(1, 0) == 0);
  REQUIRE(inspect_buffer(m).tiers().cpu_pool.used() == 0);
  for (std::uint32_t l = 0; l < shape.layers; ++l) m.prefill(1, l, k.data, k.data, 64, stream.stream);
  REQUIRE(code_of([&] { m.prefill(1, 0, k.data, k.data, 64, stream.stream); }) == ErrorCode::failed_precondition);
  DeviceArray<std::uint16_t> q(random_bf16(shape.q_heads * shape.head_dim, rng));
  DeviceArray<float> out(shape.q_heads * shape.head_dim);
  const std::vector<RequestId> unknown = {2};
  REQUIRE(code_of([&] { m.decode(unknown, 0, q.data, k.data, k.data, out.data, stream.stream); }) ==
          ErrorCode::not_found);
  const std::vector<RequestId> one = {1};
  REQUIRE(code_of([&] { m.decode(one, 0, host_k.data(), k.data, k.data, out.data, stream.stream); }) ==
          ErrorCode::invalid_argument);
  REQUIRE(code_of([&] { m.decode(one, 0, q.data, k.data, k.data, out.data); }) == ErrorCode::failed_precondition);
  REQUIRE(inspect_buffer(m).admission().sequence_length(1, 0) == 64);  // nothing changed
  m.decode(one, 0, q.data, k.data, k.data, out.data, stream.stream);
  m.synchronize();
  REQUIRE(inspect_buffer(m).admission().sequence_length(1, 0) == 65);
}

TEST_CASE("device-tensor decode: opt-in stage timing splits the steps' stream time", "[gpu][device-decode]") {
  const ModelShape shape = device_shape();
  QuestPolicy::Options options;
  options.budget_tokens = 128;
  options.page_tokens_per_partition = 16;
  Manager<QuestPolicy> m(shape, device_config(), QuestPolicy(options), std::make_unique<cuda::CudaBackend>());
  m.time_device_stages(false);  // makes the runtime before the first add_request
  Stream stream;
  std::mt19937 rng(11);
  const std::size_t kv_row = std::size_t{shape.kv_heads} * shape.head_dim;
  const std::size_t q_row = std::size_t{shape.q_heads} * shape.head_dim;
  const std::vector<RequestId> batch = {1, 2};
  for (RequestId id : batch) {
    m.add_request(id, 1024);
    DeviceArray<std::uint16_t> k(random_bf16(600 * kv_row, rng)), v(random_bf16(600 * kv_row, rng));
    for (std::uint32_t l = 0; l < shape.layers; ++l) m.prefill(id, l, k.data, v.data, 600, stream.stream);
  }
  DeviceArray<std::uint16_t> q(random_bf16(batch.size() * q_row, rng)), k(random_bf16(batch.size() * kv_row, rng)),
      v(random_bf16(batch.size() * kv_row, rng));
  DeviceArray<float> out(batch.size() * q_row);
  m.decode(batch, 0, q.data, k.data, v.data, out.data, stream.stream);  // untimed
  REQUIRE(m.device_stage_times().steps == 0);
  m.time_device_stages(true);
  cudaEvent_t start = nullptr, stop = nullptr;
  check(cudaEventCreate(&start));
  check(cudaEventCreate(&stop));
  check(cudaEventRecord(start, stream.stream));
  const auto host_start = std::chrono::steady_clock::now();
  for (int s = 0; s < 6; ++s) m.decode(batch, s % 3, q.data, k.data, v.data, out.data, stream.stream);
  const double host_decode_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - host_start).count();
  check(cudaEventRecord(stop, stream.stream));
  const DeviceStageTimes t = m.device_stage_times();
  float wall = 0;
  check(cudaEventElapsedTime(&wall, start, stop));
  REQUIRE(t.steps == 6);
  for (const double ms : {t.append_ms, t.select_ms, t.lru_ms, t.gather_ms, t.attend_ms}) REQUIRE(ms > 0);
  // The stages tile each step's stream time, which the events around all steps contain.
  REQUIRE(t.append_ms + t.select_ms + t.lru_ms + t.gather_ms + t.attend_ms <= double(wall) * 1.001 + 1e-3);
  // The host's enqueue times: each stage's, within the runtime's whole step, within the host's calls.
  const double host_stages = t.host_append_ms + t.host_select_ms + t.host_lru_ms + t.host_gather_ms + t.host_attend_ms;
  for (const double ms : {t.host_append_ms, t.host_select_ms, t.host_lru_ms, t.host_gather_ms, t.host_attend_ms}) {
    REQUIRE(ms > 0);
  }
  REQUIRE(host_stages <= t.host_step_ms);
  REQUIRE(t.host_step_ms <= host_decode_ms);
  m.time_device_stages(false);
  m.decode(batch, 1, q.data, k.data, v.data, out.data, stream.stream);
  REQUIRE(m.device_stage_times().steps == 6);
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
}
