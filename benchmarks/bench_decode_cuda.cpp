// sparsekv-bench-decode: one layer's decode step through the facade's
// device-tensor API (Manager::decode with device q / k / v on the engine's
// stream) at Llama-3.1-8B attention shape (32 q / 8 kv heads, head_dim 128,
// bf16), batch {1, 8, 32, 64}, context {32K, 128K}, budget 2048, Quest and
// ShadowKV, queries drifting step to step as in examples/decode_loop.cpp
// (q = 0.95 q + 0.31 N(0, 1) per element). Counters, all per layer step:
//  - step_ms: cudaEvents around Manager::decode on an idle stream (the host's
//    part of the step and the launches included), over kTimedSteps steps;
//  - host_ms: the host's wall time in Manager::decode in those steps (its
//    checks and bookkeeping, then the launches; the stream starts the step's
//    kernels only as they are enqueued). On an H100, step_ms minus the stage
//    times came to 1.8-3.4 ms at every batch, and host_ms (a second run)
//    1.9-2.8 ms: the step is host-bound;
//  - runtime_host_ms: of that, the device runtime's part (DeviceStageTimes::
//    host_step_ms: argument slot to the last enqueue), and host_append_ms /
//    host_select_ms / host_lru_ms / host_gather_ms / host_attend_ms its host
//    time enqueuing each stage; host_ms - runtime_host_ms is the Manager's
//    and DeviceStep's checks and bookkeeping;
//  - append_ms / select_ms / lru_ms / gather_ms / attend_ms: the split of
//    the step's stream time (DeviceRuntime::time_stages), over kTimedSteps
//    further steps with stage timing on -- a separate run, so that step_ms is
//    not taken with the timing events in the stream;
//  - floor_ms: the bytes the step must move over the bandwidths measured in
//    this process (HBM: the device-to-device copy, read + write traffic;
//    PCIe: the pinned 256 MiB copy, H2D and D2H): Select's summary reads,
//    then the misses over PCIe and their writes into HBM, then the attended
//    pages (selection + tail) read once, plus the step's share of tail saves
//    over D2H. Summed, not overlapped: each stage needs the last one's
//    output (the misses are known after Select, attention needs them);
//    step_over_floor = step_ms / floor_ms;
//  - dense_ms: the project's own attention kernel over the whole context of
//    every request (pages in device memory); step_over_dense = step_ms /
//    dense_ms;
//  - hit_ratio: GPU-cache hits over selected pages in the timed steps;
//  - tokens/s: batch / step_ms -- of ONE layer (a model of L layers: / L).
// Targets: step_ms <= 2 x floor_ms at batch >= 8; at 128K and
// batch 8, step_ms <= 0.25 x dense_ms.
//
// Memory: the CPU tier (pinned host memory) holds every request's context:
// batch x (context + 1024) x 8 kv heads x 128 x 2 B x 2 (K, V), 34.6 GB at
// 128K x 64; the dense reference holds the same in device memory (34.4 GB),
// after the manager is gone. Each row first estimates its host and device
// peaks and skips (SkipWithError, the figures in the message) when they
// exceed what /proc/meminfo's MemAvailable and cudaMemGetInfo report; on an
// 80 GB H100 with 128 GiB of host memory every row of the grid fits (the
// largest, 128K x 64: about 36 GB device for the dense reference, 11 GB
// while the manager lives, and 36 GB host). Without a CUDA device
// the program prints "SKIPPED: no CUDA device" and exits 0, reporting nothing.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "cuda_bench_support.hpp"
#include "sparsekv/attention/sparse_decode_attention_cuda.hpp"
#include "sparsekv/core/error.hpp"
#include "sparsekv/facade/cuda_backend.hpp"
#include "sparsekv/facade/manager.hpp"
#include "sparsekv/policy/quest.hpp"
#include "sparsekv/policy/shadowkv.hpp"

namespace {

using namespace sparsekv;
using namespace sparsekv::bench;

constexpr std::uint32_t kBudget = 2048;
constexpr std::uint32_t kPageTokens = 16;
constexpr std::uint32_t kDecodeRoom = 1024;  // max_context_tokens beyond the prompt
constexpr int kWarmSteps = 8;
constexpr int kTimedSteps = 16;
constexpr double kGiB = double(1u << 30);

ModelShape llama_layer() {
  ModelShape s;
  s.layers = 1;
  s.q_heads = 32;
  s.kv_heads = 8;
  s.head_dim = 128;
  s.dtype = DType::bf16;
  return s;
}

std::vector<std::uint16_t> bf16_values(std::size_t n, std::mt19937& rng, float scale) {
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<std::uint16_t> out(n);
  for (auto& x : out) x = float_to_bf16(d(rng));
  return out;
}

// Host memory the kernel can still hand out without swapping (MemAvailable).
double host_available_bytes() {
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  double kib = 0;
  std::string unit;
  while (meminfo >> key >> kib >> unit) {
    if (key == "MemAvailable:") return kib * 1024;
  }
  return 0;
}

struct Sizing {
  Config config;
  PageLayout layout;
  double host_bytes = 0;    // CPU tier + host prompt + staging
  double sparse_bytes = 0;  // device, while the manager lives
  double dense_bytes = 0;   // device, the dense reference alone
};

Sizing sizing(std::uint32_t batch, std::uint32_t context, const ModelShape& shape, std::uint32_t mandatory_pages,
              std::uint32_t summary_vectors) {
  Sizing z;
  Config& c = z.config;
  c.page_tokens = kPageTokens;
  c.max_requests = batch;
  c.max_context_tokens = context + kDecodeRoom;
  z.layout = PageLayout{c.page_tokens, shape.head_dim, shape.dtype};
  const double page = double(z.layout.page_bytes());
  const std::size_t head_pages = c.max_pages_per_head();
  c.cpu_tier_bytes = std::size_t{batch} * shape.kv_heads * head_pages * z.layout.page_bytes() + (std::size_t{64} << 20);
  // The policy's mandatory pages plus Spin's buffering (min_buffer_ratio x
  // mandatory), the tail and a page of margin.
  const auto gpu_pages_per_head =
      static_cast<std::size_t>(std::ceil(mandatory_pages * (1 + c.min_buffer_ratio))) + mandatory_pages + 2;
  c.gpu_tier_bytes = std::size_t{batch} * shape.kv_heads * gpu_pages_per_head * z.layout.page_bytes();
  const double prompt = double(context) * shape.kv_heads * shape.head_dim * 2 * 2;  // K + V, bf16
  const double rows = double(batch) * shape.kv_heads;
  z.host_bytes = double(c.cpu_tier_bytes) + prompt + 2 * (32 << 20) + kGiB;
  // GPU tier, the prompt uploaded once, the summaries (fp32 vectors per page)
  // and a margin for the runtime's fixed arrays and the runtime.
  z.sparse_bytes =
      double(c.gpu_tier_bytes) + prompt + rows * double(head_pages) * shape.head_dim * 4 * summary_vectors + 2 * kGiB;
  z.dense_bytes = rows * std::ceil(double(context) / c.page_tokens) * page + kGiB;
  return z;
}

// Dense attention over `tokens` tokens per (request, kv head), the project's kernel.
double dense_ms(std::uint32_t batch, std::uint32_t tokens, const ModelShape& shape, std::uint32_t page_tokens,
                cudaStream_t stream) {
  const PageLayout layout{page_tokens, shape.head_dim, shape.dtype};
  const std::uint32_t pages_per_row = (tokens + page_tokens - 1) / page_tokens;
  const std::size_t rows = std::size_t{batch} * shape.kv_heads;
  const std::size_t pages = rows * pages_per_row;
  auto* pool = device_alloc<std::byte>(pages * layout.page_bytes());
  check(cudaMemset(pool, 0x11, pages * layout.page_bytes()), "cudaMemset");
  std::vector<std::int64_t> indptr(rows + 1), indices(pages);
  std::vector<std::int32_t> last(rows, static_cast<std::int32_t>(tokens - (pages_per_row - 1) * page_tokens));
  for (std::size_t r = 0; r <= rows; ++r) indptr[r] = static_cast<std::int64_t>(r * pages_per_row);
  for (std::size_t p = 0; p < pages; ++p) indices[p] = static_cast<std::int64_t>(p);
  cuda::DecodeAttentionShape s;
  s.batch = batch;
  s.q_heads = shape.q_heads;
  s.kv_heads = shape.kv_heads;
  s.layout = layout;
  s.max_pages = pages_per_row;
  const cuda::DecodeAttentionSplit split = cuda::plan_sparse_decode_attention(s);
  cuda::DecodeAttentionArgs a;
  a.q = device_alloc<float>(std::size_t{batch} * shape.q_heads * shape.head_dim);
  a.page_base = pool;
  a.page_stride = layout.page_bytes();
  auto* d_indptr = device_copy(indptr.data(), indptr.size());
  auto* d_indices = device_copy(indices.data(), indices.size());
  auto* d_last = device_copy(last.data(), last.size());
  a.indptr = d_indptr;
  a.indices = d_indices;
  a.last_page_len = d_last;
  a.scale = 1.0f / std::sqrt(float(shape.head_dim));
  a.out = device_alloc<float>(std::size_t{batch} * shape.q_heads * shape.head_dim);
  a.workspace = device_alloc<std::byte>(split.workspace_bytes + 16);
  a.workspace_bytes = split.workspace_bytes + 16;
  check(cudaMemset(const_cast<float*>(a.q), 0, std::size_t{batch} * shape.q_heads * shape.head_dim * 4), "cudaMemset");
  cuda::sparse_decode_attention(s, a, stream);
  const Events events;
  const float ms = elapsed_ms(events, stream, [&] {
    for (int r = 0; r < 5; ++r) cuda::sparse_decode_attention(s, a, stream);
  });
  for (void* p : {static_cast<void*>(pool), static_cast<void*>(d_indptr), static_cast<void*>(d_indices),
                  static_cast<void*>(d_last), const_cast<void*>(static_cast<const void*>(a.q)),
                  static_cast<void*>(a.out), a.workspace}) {
    check(cudaFree(p), "cudaFree");
  }
  check(cudaEventDestroy(events.start), "cudaEventDestroy");
  check(cudaEventDestroy(events.stop), "cudaEventDestroy");
  return ms / 5.0;
}

// What the sparse half of a row measured, per layer step.
struct SparseRun {
  double step_ms = 0;
  double host_ms = 0;
  DeviceStageTimes stages;  // per-step means
  double selected_pages = 0, miss_pages = 0, saved_pages = 0, hit_ratio = 0;
};

template <class Policy>
SparseRun run_sparse(const Policy& policy, std::uint32_t batch, std::uint32_t context, const ModelShape& shape,
                     const Config& config, cudaStream_t stream) {
  std::mt19937 rng(17);
  Manager<Policy> manager(shape, config, policy, std::make_unique<cuda::CudaBackend>());
  manager.time_device_stages(false);  // makes the device runtime before the first add_request
  std::vector<RequestId> ids;
  {
    // One prompt, uploaded once, prefilled into every request (each gets its own CPU pages).
    const std::size_t kv = std::size_t{context} * shape.kv_heads * shape.head_dim;
    const std::vector<std::uint16_t> k = bf16_values(kv, rng, 1.0f), v = bf16_values(kv, rng, 1.0f);
    std::uint16_t* dk = device_copy(k.data(), kv);
    std::uint16_t* dv = device_copy(v.data(), kv);
    for (std::uint32_t b = 0; b < batch; ++b) {
      manager.add_request(b + 1, config.max_context_tokens);
      manager.prefill(b + 1, 0, dk, dv, context, stream);
      ids.push_back(b + 1);
    }
    check(cudaFree(dk), "cudaFree");
    check(cudaFree(dv), "cudaFree");
  }
  const std::size_t q_n = std::size_t{batch} * shape.q_heads * shape.head_dim;
  const std::size_t kv_n = std::size_t{batch} * shape.kv_heads * shape.head_dim;
  std::normal_distribution<float> normal;
  std::vector<float> drift(q_n);
  for (auto& x : drift) x = normal(rng);
  std::vector<std::uint16_t> q(q_n);
  auto* dq = device_alloc<std::uint16_t>(q_n);
  auto* dk = device_alloc<std::uint16_t>(kv_n);
  auto* dv = device_alloc<std::uint16_t>(kv_n);
  auto* out = device_alloc<float>(q_n);
  // decode_loop's drifting queries; fresh k / v rows. Uploaded and waited for
  // before the step, so the step's timing starts on an idle stream.
  const auto next_inputs = [&] {
    for (std::size_t i = 0; i < q_n; ++i) {
      drift[i] = 0.95f * drift[i] + 0.31f * normal(rng);
      q[i] = float_to_bf16(drift[i]);
    }
    const std::vector<std::uint16_t> k = bf16_values(kv_n, rng, 1.0f), v = bf16_values(kv_n, rng, 1.0f);
    check(cudaMemcpyAsync(dq, q.data(), q_n * 2, cudaMemcpyHostToDevice, stream), "cudaMemcpyAsync");
    check(cudaMemcpyAsync(dk, k.data(), kv_n * 2, cudaMemcpyHostToDevice, stream), "cudaMemcpyAsync");
    check(cudaMemcpyAsync(dv, v.data(), kv_n * 2, cudaMemcpyHostToDevice, stream), "cudaMemcpyAsync");
    check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  };
  for (int s = 0; s < kWarmSteps; ++s) {
    next_inputs();
    manager.decode(ids, 0, dq, dk, dv, out, stream);
  }
  manager.synchronize();
  const StepStats before = manager.stats();
  const Events events;
  double total_ms = 0, host_ms = 0;
  for (int s = 0; s < kTimedSteps; ++s) {
    next_inputs();
    total_ms += elapsed_ms(events, stream, [&] {
      const auto t0 = std::chrono::steady_clock::now();
      manager.decode(ids, 0, dq, dk, dv, out, stream);
      host_ms += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    });
  }
  manager.synchronize();
  const StepStats after = manager.stats();
  // The split, over as many steps again with the stage events in the stream.
  manager.time_device_stages(true);
  const DeviceStageTimes stages_before = manager.device_stage_times();
  for (int s = 0; s < kTimedSteps; ++s) {
    next_inputs();
    manager.decode(ids, 0, dq, dk, dv, out, stream);
  }
  const DeviceStageTimes stages_after = manager.device_stage_times();
  manager.synchronize();

  SparseRun r;
  r.step_ms = total_ms / kTimedSteps;
  r.host_ms = host_ms / kTimedSteps;
  const double timed = double(stages_after.steps - stages_before.steps);
  if (timed != kTimedSteps) {
    std::fprintf(stderr, "stage timing saw %.0f of %d steps\n", timed, kTimedSteps);
    std::exit(1);
  }
  r.stages.steps = stages_after.steps - stages_before.steps;
  r.stages.append_ms = (stages_after.append_ms - stages_before.append_ms) / timed;
  r.stages.select_ms = (stages_after.select_ms - stages_before.select_ms) / timed;
  r.stages.lru_ms = (stages_after.lru_ms - stages_before.lru_ms) / timed;
  r.stages.gather_ms = (stages_after.gather_ms - stages_before.gather_ms) / timed;
  r.stages.attend_ms = (stages_after.attend_ms - stages_before.attend_ms) / timed;
  r.stages.host_append_ms = (stages_after.host_append_ms - stages_before.host_append_ms) / timed;
  r.stages.host_select_ms = (stages_after.host_select_ms - stages_before.host_select_ms) / timed;
  r.stages.host_lru_ms = (stages_after.host_lru_ms - stages_before.host_lru_ms) / timed;
  r.stages.host_gather_ms = (stages_after.host_gather_ms - stages_before.host_gather_ms) / timed;
  r.stages.host_attend_ms = (stages_after.host_attend_ms - stages_before.host_attend_ms) / timed;
  r.stages.host_step_ms = (stages_after.host_step_ms - stages_before.host_step_ms) / timed;
  const double hits = double(after.cache.hit_pages - before.cache.hit_pages);
  const double misses = double(after.cache.miss_pages - before.cache.miss_pages);
  r.selected_pages = (hits + misses) / kTimedSteps;
  r.miss_pages = misses / kTimedSteps;
  r.saved_pages = double(after.pages_saved - before.pages_saved) / kTimedSteps;
  r.hit_ratio = hits + misses > 0 ? hits / (hits + misses) : 0;
  for (void* p : {static_cast<void*>(dq), static_cast<void*>(dk), static_cast<void*>(dv), static_cast<void*>(out)}) {
    check(cudaFree(p), "cudaFree");
  }
  check(cudaEventDestroy(events.start), "cudaEventDestroy");
  check(cudaEventDestroy(events.stop), "cudaEventDestroy");
  return r;
}

// summary_vectors: fp32 head_dim vectors Select reads per candidate page
// (Quest: min and max; ShadowKV: the landmark, its outlier score aside).
template <class Policy>
void decode_step(benchmark::State& state, const Policy& policy, std::uint32_t summary_vectors) {
  const auto batch = static_cast<std::uint32_t>(state.range(0));
  const auto context = static_cast<std::uint32_t>(state.range(1));
  const ModelShape shape = llama_layer();
  const LayerContext ctx{0,           shape.layers,         shape.q_heads, shape.kv_heads, shape.head_dim,
                         kPageTokens, context + kDecodeRoom};
  const Sizing z = sizing(batch, context, shape, policy.mandatory_pages(ctx), summary_vectors);
  std::size_t device_free = 0, device_total = 0;
  check(cudaMemGetInfo(&device_free, &device_total), "cudaMemGetInfo");
  const double host_free = host_available_bytes();
  const double device_need = std::max(z.sparse_bytes, z.dense_bytes);
  if (device_need > 0.95 * double(device_free) || z.host_bytes > 0.9 * host_free) {
    const std::string why = "does not fit: needs " + std::to_string(device_need / kGiB) + " GiB device (" +
                            std::to_string(double(device_free) / kGiB) + " free) and " +
                            std::to_string(z.host_bytes / kGiB) + " GiB host (" + std::to_string(host_free / kGiB) +
                            " available)";
    state.SkipWithError(why.c_str());
    for (auto _ : state) {
    }
    return;
  }
  const cudaStream_t stream = non_blocking_stream();
  SparseRun r;
  try {
    r = run_sparse(policy, batch, context, shape, z.config, stream);  // the manager is gone on return
  } catch (const Error& e) {
    state.SkipWithError(e.what());
    for (auto _ : state) {
    }
    check(cudaStreamDestroy(stream), "cudaStreamDestroy");
    return;
  }
  for (auto _ : state) state.SetIterationTime(r.step_ms * 1e-3);

  const double page = double(z.layout.page_bytes());
  const double rows = double(batch) * shape.kv_heads;
  const double candidates = rows * (double(context) + kWarmSteps + 2 * kTimedSteps) / kPageTokens;
  const double summary_bytes = candidates * (double(summary_vectors) * shape.head_dim * 4 + 4);
  const double hbm = device_copy_timing().d2d_gbps * 1e9;  // read + write traffic, as d2d_gbps counts it
  const PcieReference& pcie = pcie_reference();
  const double hbm_bytes = summary_bytes + r.miss_pages * page + (r.selected_pages + rows) * page;
  const double floor_ms =
      (hbm_bytes / hbm + r.miss_pages * page / (pcie.h2d_gbps * 1e9) + r.saved_pages * page / (pcie.d2h_gbps * 1e9)) *
      1e3;
  const double dense = dense_ms(batch, context, shape, kPageTokens, stream);
  check(cudaStreamDestroy(stream), "cudaStreamDestroy");

  state.counters["step_ms"] = r.step_ms;
  state.counters["host_ms"] = r.host_ms;
  state.counters["append_ms"] = r.stages.append_ms;
  state.counters["select_ms"] = r.stages.select_ms;
  state.counters["lru_ms"] = r.stages.lru_ms;
  state.counters["gather_ms"] = r.stages.gather_ms;
  state.counters["runtime_host_ms"] = r.stages.host_step_ms;
  state.counters["host_append_ms"] = r.stages.host_append_ms;
  state.counters["host_select_ms"] = r.stages.host_select_ms;
  state.counters["host_lru_ms"] = r.stages.host_lru_ms;
  state.counters["host_gather_ms"] = r.stages.host_gather_ms;
  state.counters["host_attend_ms"] = r.stages.host_attend_ms;
  state.counters["attend_ms"] = r.stages.attend_ms;
  state.counters["floor_ms"] = floor_ms;
  state.counters["step_over_floor"] = r.step_ms / floor_ms;
  state.counters["dense_ms"] = dense;
  state.counters["step_over_dense"] = r.step_ms / dense;
  state.counters["hit_ratio"] = r.hit_ratio;
  state.counters["tokens/s"] = batch * 1e3 / r.step_ms;
}

void quest(benchmark::State& state) {
  QuestPolicy::Options o;
  o.budget_tokens = kBudget;
  o.page_tokens_per_partition = kPageTokens;
  o.dense_layers = 0;  // the timed layer is a sparse one (Quest keeps layers 0 and 1 dense by default)
  decode_step(state, QuestPolicy(o), 2);
}
void shadowkv(benchmark::State& state) {
  ShadowKVPolicy::Options o;
  o.budget_tokens = kBudget;
  decode_step(state, ShadowKVPolicy(o), 1);
}

void shapes(benchmark::internal::Benchmark* b) {
  for (std::int64_t context : {32 * 1024, 128 * 1024}) {
    for (std::int64_t batch : {1, 8, 32, 64}) b->Args({batch, context});
  }
  b->ArgNames({"batch", "context"})->UseManualTime()->Iterations(1)->Unit(benchmark::kMillisecond);
}

BENCHMARK(quest)->Apply(shapes);
BENCHMARK(shadowkv)->Apply(shapes);

}  // namespace

int main(int argc, char** argv) { return run_benchmarks(argc, argv, report_pcie_reference); }
