// sparsekv-bench-decode: one layer's decode step through the facade's
// device-tensor API (Manager::decode with device q / k / v on the engine's
// stream) at Llama-3.1-8B attention shape (32 q / 8 kv heads, head_dim 128,
// bf16), budget 2048, Quest and ShadowKV, queries drifting step to step as in
// decode_loop. Beside each row, measured in the same process:
//  - floor_ms: the bytes the step must move -- the selected pages read once
//    from HBM, the misses over PCIe (this run's miss count), the summaries
//    Select reads -- over the D2D (HBM) and pinned H2D (PCIe) bandwidths;
//  - dense_ms: the project's own attention kernel over the whole context.
// Targets (issue 13): step_ms <= 2 x floor_ms at batch >= 8; at 128K and
// batch 8, step_ms <= 0.25 x dense_ms.
#include <benchmark/benchmark.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "cuda_bench_support.hpp"
#include "sparsekv/attention/sparse_decode_attention_cuda.hpp"
#include "sparsekv/facade/cuda_backend.hpp"
#include "sparsekv/facade/manager.hpp"

namespace {

using namespace sparsekv;
using namespace sparsekv::bench;

constexpr std::uint32_t kBudget = 2048;
constexpr int kWarmSteps = 8;
constexpr int kTimedSteps = 16;

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
  for (auto& x : out) {
    const float f = d(rng);
    std::uint32_t bits;
    std::memcpy(&bits, &f, 4);
    x = static_cast<std::uint16_t>(bits >> 16);
  }
  return out;
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
  auto* d_indptr = device_alloc<std::int64_t>(indptr.size());
  auto* d_indices = device_alloc<std::int64_t>(indices.size());
  auto* d_last = device_alloc<std::int32_t>(last.size());
  check(cudaMemcpy(d_indptr, indptr.data(), indptr.size() * 8, cudaMemcpyHostToDevice), "cudaMemcpy");
  check(cudaMemcpy(d_indices, indices.data(), indices.size() * 8, cudaMemcpyHostToDevice), "cudaMemcpy");
  check(cudaMemcpy(d_last, last.data(), last.size() * 4, cudaMemcpyHostToDevice), "cudaMemcpy");
  a.indptr = d_indptr;
  a.indices = d_indices;
  a.last_page_len = d_last;
  a.scale = 1.0f / std::sqrt(float(shape.head_dim));
  a.out = device_alloc<float>(std::size_t{batch} * shape.q_heads * shape.head_dim);
  a.workspace = device_alloc<std::byte>(split.workspace_bytes + 16);
  a.workspace_bytes = split.workspace_bytes + 16;
  cuda::sparse_decode_attention(s, a, stream);
  const Events events;
  const float ms = elapsed_ms(events, stream, [&] {
    for (int r = 0; r < 5; ++r) cuda::sparse_decode_attention(s, a, stream);
  });
  for (void* p : {static_cast<void*>(pool), static_cast<void*>(d_indptr), static_cast<void*>(d_indices),
                  static_cast<void*>(d_last), const_cast<void*>(static_cast<const void*>(a.q)),
                  static_cast<void*>(a.out), a.workspace}) {
    cudaFree(p);
  }
  return ms / 5.0;
}

template <class Policy>
void decode_step(benchmark::State& state, Policy policy) {
  const auto batch = static_cast<std::uint32_t>(state.range(0));
  const auto context = static_cast<std::uint32_t>(state.range(1));
  const ModelShape shape = llama_layer();
  Config config;
  config.page_tokens = 16;
  config.max_requests = batch;
  config.max_context_tokens = context + 1024;
  const PageLayout layout{config.page_tokens, shape.head_dim, shape.dtype};
  const std::size_t head_pages = (config.max_context_tokens + config.page_tokens - 1) / config.page_tokens;
  config.cpu_tier_bytes = std::size_t{batch} * shape.kv_heads * head_pages * layout.page_bytes() + (std::size_t{64} << 20);
  const std::size_t gpu_pages_per_head = std::size_t{kBudget / config.page_tokens} * 7 + 2;
  config.gpu_tier_bytes = std::size_t{batch} * shape.kv_heads * gpu_pages_per_head * layout.page_bytes();
  const cudaStream_t stream = non_blocking_stream();
  std::mt19937 rng(17);
  Manager<Policy> manager(shape, config, policy, std::make_unique<cuda::CudaBackend>());
  std::vector<RequestId> ids;
  {
    const std::size_t kv = std::size_t{context} * shape.kv_heads * shape.head_dim;
    const std::vector<std::uint16_t> k = bf16_values(kv, rng, 1.0f), v = bf16_values(kv, rng, 1.0f);
    std::uint16_t* dk = device_alloc<std::uint16_t>(kv);
    std::uint16_t* dv = device_alloc<std::uint16_t>(kv);
    check(cudaMemcpy(dk, k.data(), kv * 2, cudaMemcpyHostToDevice), "cudaMemcpy");
    check(cudaMemcpy(dv, v.data(), kv * 2, cudaMemcpyHostToDevice), "cudaMemcpy");
    for (std::uint32_t b = 0; b < batch; ++b) {
      manager.add_request(b + 1, config.max_context_tokens);
      manager.prefill(b + 1, 0, dk, dv, context, stream);
      ids.push_back(b + 1);
    }
    cudaFree(dk);
    cudaFree(dv);
  }
  const std::size_t q_n = std::size_t{batch} * shape.q_heads * shape.head_dim;
  const std::size_t kv_n = std::size_t{batch} * shape.kv_heads * shape.head_dim;
  std::vector<std::uint16_t> q_base = bf16_values(q_n, rng, 1.0f);
  auto* dq = device_alloc<std::uint16_t>(q_n);
  auto* dk = device_alloc<std::uint16_t>(kv_n);
  auto* dv = device_alloc<std::uint16_t>(kv_n);
  auto* out = device_alloc<float>(q_n);
  const auto drift = [&] {  // decode_loop's drifting queries: a small step from the last one
    const std::vector<std::uint16_t> noise = bf16_values(q_n, rng, 0.3f);
    for (std::size_t i = 0; i < q_n; ++i) q_base[i] = (i + rng()) % 7 == 0 ? noise[i] : q_base[i];
    check(cudaMemcpyAsync(dq, q_base.data(), q_n * 2, cudaMemcpyHostToDevice, stream), "cudaMemcpyAsync");
    const std::vector<std::uint16_t> kv = bf16_values(kv_n, rng, 1.0f);
    check(cudaMemcpyAsync(dk, kv.data(), kv_n * 2, cudaMemcpyHostToDevice, stream), "cudaMemcpyAsync");
    check(cudaMemcpyAsync(dv, kv.data(), kv_n * 2, cudaMemcpyHostToDevice, stream), "cudaMemcpyAsync");
    check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  };
  for (int s = 0; s < kWarmSteps; ++s) {
    drift();
    manager.decode(ids, 0, dq, dk, dv, out, stream);
  }
  manager.synchronize();
  const CacheStepStats before = manager.stats().cache;
  const Events events;
  double total_ms = 0;
  int steps = 0;
  for (auto _ : state) {
    for (int s = 0; s < kTimedSteps; ++s) {
      drift();
      const float ms = elapsed_ms(events, stream, [&] { manager.decode(ids, 0, dq, dk, dv, out, stream); });
      state.SetIterationTime(ms * 1e-3);
      total_ms += ms;
      ++steps;
    }
  }
  manager.synchronize();
  const CacheStepStats after = manager.stats().cache;
  const double step_ms = total_ms / steps;
  const double miss_pages = double(after.miss_pages - before.miss_pages) / steps;
  const double selected_pages = double(after.hit_pages + after.miss_pages - before.hit_pages - before.miss_pages) / steps;
  const double page_bytes = double(layout.page_bytes());
  const double summary_bytes = double(batch) * shape.kv_heads * (double(context) / config.page_tokens) * shape.head_dim *
                               sizeof(float) * 2;
  const double hbm = device_copy_timing().d2d_gbps * 1e9 / 2;  // read + write counted: one direction's rate
  const double pcie = pcie_reference().h2d_gbps * 1e9;
  const double floor_ms = ((selected_pages * page_bytes + summary_bytes) / hbm + miss_pages * page_bytes / pcie) * 1e3;
  const double dense = dense_ms(batch, context, shape, config.page_tokens, stream);
  state.counters["step_ms"] = step_ms;
  state.counters["tokens_per_s"] = batch * 1e3 / step_ms;
  state.counters["hit_ratio"] = (after.hit_pages - before.hit_pages) / std::max(1.0, selected_pages * steps);
  state.counters["floor_ms"] = floor_ms;
  state.counters["over_floor"] = step_ms / floor_ms;
  state.counters["dense_ms"] = dense;
  state.counters["over_dense"] = dense > 0 ? step_ms / dense : -1;
  for (void* p : {static_cast<void*>(dq), static_cast<void*>(dk), static_cast<void*>(dv), static_cast<void*>(out)}) {
    cudaFree(p);
  }
  cudaStreamDestroy(stream);
}

void quest(benchmark::State& state) {
  QuestPolicy::Options o;
  o.budget_tokens = kBudget;
  o.page_tokens_per_partition = 16;
  decode_step(state, QuestPolicy(o));
}
void shadowkv(benchmark::State& state) {
  ShadowKVPolicy::Options o;
  o.budget_tokens = kBudget;
  decode_step(state, ShadowKVPolicy(o));
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
