// sparsekv-bench-host: the host backend's Attend and Select on the CPU,
// each beside its bounds measured in the same process.
//
// Attend/<shape>/<dtype>/budget:B/page:P/threads:N
//   SplitPlanAttention (the host Attend) of one decode step of one layer:
//   `batch` requests x kv heads rows of B selected tokens each, in P-token
//   pages at random places of a 1 GiB page pool (every page read comes from
//   DRAM: the pool is 32x the 32 MiB LLC, and each iteration takes the next
//   of up to 64 disjoint page sets). batch makes one step read >= 32 MiB of
//   f16 K/V (Llama 4/8/16 requests at budget 2048/1024/512). Shapes: llama =
//   Llama-3-8B (32 q / 8 kv heads, head_dim 128), smollm = SmolLM2-135M
//   (9 q / 3 kv heads, head_dim 64). Timed: prepare(), run() over the chunks
//   (N = 2: split in halves over a persistent 2-thread pool,
//   tools/thread_pool.hpp, as HostStep slices them), finish(). No slot
//   weights (H2O's), no extra term (RetroInfer's). Counters:
//     GBps          K/V bytes of the step / the step's mean time
//     read_GBps     the read bound: an AVX2 sum over the same number of bytes,
//                   contiguous, on the same thread count, from the same 1 GiB
//                   pool (a new place each time), mean time; measured just
//                   before the row, as ggml's time is (the VM's bandwidth drifts)
//     over_read_bw  read-bound time / our time = GBps / read_GBps: the
//                   fraction of the streaming-read bandwidth the Attend
//                   reaches (target >= 0.6)
//     scattered_GBps the read bound of the same pages where they are: an
//                   AVX2 sum of the step's pages in the Attend's order, split
//                   over the threads as its chunks are, the next page asked
//                   for before each (one page ahead, as fold_page does)
//     over_scattered scattered-read time / our time: how much of what the
//                   memory gives for scattered pages the Attend reaches
//     over_ggml     our time / ggml's time for the same tokens: ggml's CPU
//                   ggml_flash_attn_ext (llama.cpp's decode attention, from
//                   llama-cpp-python 0.3.36's vendored source) on f16 K/V,
//                   contiguous [head_dim, B, kv_heads] per request, one
//                   query token per request, the same q heads, scale and
//                   thread count (ggml's own thread pool), graph built once;
//                   the faster of two layouts (label): one node per request
//                   (ggml's split-KV decode path) or one node with the
//                   requests as ggml's streams (dim 3). Below 1: we are
//                   faster. Against f16 K/V, so bf16 rows compare a
//                   dtype ggml's CPU flash attention does not take with its
//                   nearest, and f32 rows read twice ggml's bytes; q8_0 rows
//                   (the CPU tier's Config::kv_storage, from their own pool
//                   of quantized unit-order values) against q8_0 K/V, as
//                   llama.cpp's -ctk q8_0 -ctv q8_0 cache holds them. Absent
//                   (and the label says so) when the benchmark was built
//                   without llama.cpp's source (scripts/setup fetches it).
//     ggml_GBps     ggml's K/V bytes / ggml's time
//     tokens        selected tokens per (request, kv head): B
//     batch         requests
//   Before timing, the first configuration of each (shape, budget, f16 or
//   q8_0 peer) checks our output against ggml's on the same K/V (ggml's
//   first set is filled from our pages) and fails the row beyond 3e-2
//   absolute (5e-2 for f32 and q8_0: ggml quantizes q to q8_0 for q8_0 K).
//
// Select/<policy>/context:C/threads:N
//   Quest's and ShadowKV's host Select (select_head for each kv head) of one
//   (request, layer) at the Llama shape, 16-token pages (Quest: one page per
//   partition), budget 1024 and C context tokens, summaries built by index()
//   from random keys and copied enough times (>= 128 MiB) that each
//   iteration reads another copy from DRAM. threads:2 splits the kv heads in
//   halves over the pool. Counters: us (per (request, layer)), over_attend =
//   Select time / Attend time per (request, layer) for the same budget
//   (Attend/llama/bf16/budget:1024/page:16 at the same thread count; the
//   target is <= 0.15).
// Select/shadowkv/smollm/context:{4096,4142}/page:8/threads:N
//   The same at smollm-demo's Select: the SmolLM2 shape, ShadowKV over
//   8-token pages, budget 512, a 4,096-token context (whole pages) or the
//   demo's 4,142-token prompt (a partial last page, so the budget left after
//   the window and outliers is not a multiple of 8); over_attend against
//   Attend/smollm/f16/budget:512/page:8. Its 3 kv heads split 2 + 1 over
//   two threads, as the demo's step splits them.
//
// FoldInCache/<shape>/<dtype>/page:P
//   The fold alone, one core, on 8 pages of one kv head folded in turn over
//   and over (all in L1/L2), in tiles as the Attend cuts them (fold_pages,
//   fold_tile_tokens): the fold's arithmetic without DRAM, for kernel
//   work that the Attend rows' misses and the VM's drifting bandwidth would
//   hide. Counters: ns_per_token (a slot folded into the whole GQA group),
//   GBps (K/V bytes folded a second), target (the Highway target).
//
// PromptAttention/<shape>/f16/context:C/threads:N
//   PromptAttention (plan() and run() on N threads of the persistent pool)
//   of one prompt chunk of one layer: the 512 rows at positions C - 512 ..
//   C - 1 (llama.cpp's ubatch) attending causally over C positions of f16
//   K/V, token-major as llama.cpp's cache holds them. Counters:
//     tokens_per_s      query rows a second
//     ggml_tokens_per_s the same for ggml's CPU ggml_flash_attn_ext on the same
//                       bytes, as llama.cpp's graph has it (q permuted from
//                       [d, q_heads, rows], K and V views of the cache, an f16
//                       causal mask [C, 512]), ggml's thread pool of N threads,
//                       measured just before the row
//     over_ggml         our time / ggml's time (below 1: we are faster)
//     tiles             the plan's tiles
//   Before timing, our output is checked against ggml's on the same chunk
//   (the row fails beyond 1e-3 absolute).
//
// SharedPrefix/<policy>
//   Eight requests starting from one 4,096-token prompt at the SmolLM2 shape
//   (30 layers, 3 kv heads, head_dim 64, f16, 8-token pages) through a
//   Manager on the in-place backend (a CPU engine's): request 1 is prefilled,
//   then requests 2-8 are either forked from it (Manager::fork, the shared
//   run) or added and prefilled with the same K/V (the unshared run), both
//   in each iteration. Counters: shared_ms / unshared_ms (mean time to start
//   one of requests 2-8: Index + Offload, or the fork's read-back + Index +
//   sharing), time_ratio (shared / unshared), shared_MiB / unshared_MiB (the
//   CPU tier's pages in use once all eight hold the prompt), bytes_ratio.
//
// Runs in about 2 minutes on 2 cores; --benchmark_filter picks rows (e.g.
// 'Attend/llama/f16/budget:1024' or 'Select'); --benchmark_format=json.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <stdexcept>
#include <tuple>
#include <type_traits>
#include <vector>

#include <immintrin.h>

#include "sparsekv/attention/attend_plan.hpp"
#include "sparsekv/attention/page_fold.hpp"
#include "sparsekv/attention/prompt_attention.hpp"
#include "sparsekv/attention/split_plan_attention.hpp"
#include "sparsekv/core/convert.hpp"
#include "sparsekv/core/numeric.hpp"
#include "sparsekv/memory/page_layout.hpp"
#include "sparsekv/policy/quest.hpp"
#include "sparsekv/policy/shadowkv.hpp"
#include "sparsekv/sparsekv.hpp"
#include "thread_pool.hpp"

#ifndef SPARSEKV_BENCH_GGML
#define SPARSEKV_BENCH_GGML 0
#endif
#if SPARSEKV_BENCH_GGML
#include "ggml-cpu.h"
#include "ggml.h"
#endif

namespace {

using namespace sparsekv;
using Clock = std::chrono::steady_clock;

constexpr std::size_t kMiB = std::size_t{1} << 20;
constexpr std::size_t kPoolBytes = std::size_t{1} << 30;  // 32x the LLC
constexpr std::size_t kStepBytes = 32 * kMiB;             // f16 K/V a step reads at least
constexpr std::size_t kRotationBytes = 160 * kMiB;        // >= 4x the LLC of distinct data
constexpr std::size_t kMaxSets = 64;
constexpr double kMeasureSeconds = 0.25;  // each bound's measurement

struct Shape {
  const char* name;
  std::uint32_t q_heads, kv_heads, head_dim;
};
constexpr Shape kShapes[] = {{"llama", 32, 8, 128}, {"smollm", 9, 3, 64}};

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

// Mean seconds of fn() over at least kMeasureSeconds and 5 calls, after one untimed call.
template <class Fn>
double mean_seconds(Fn&& fn) {
  fn();
  int n = 0;
  const auto start = Clock::now();
  double elapsed = 0;
  do {
    fn();
    ++n;
    elapsed = seconds_since(start);
  } while (elapsed < kMeasureSeconds || n < 5);
  return elapsed / n;
}

tools::ThreadPool& pool(unsigned threads) {
  static tools::ThreadPool one(1), two(2);
  return threads == 1 ? one : two;
}

// [first, end) of n items for part i of parts.
std::pair<std::size_t, std::size_t> slice(std::size_t n, std::size_t i, std::size_t parts) {
  return {n * i / parts, n * (i + 1) / parts};
}

// ---- the page pool --------------------------------------------------------

// 1 GiB of 32-bit words, each two bf16 values in [-1, 1]: finite and of unit
// order read as f32, as two bf16 or as two f16 (|x| in [2^-4, 2)), so that
// every dtype reads the same pool.
std::byte* page_pool() {
  static std::byte* pool = [] {
    // As the CPU tier holds its pages: the library's host memory (2 MiB
    // aligned, transparent huge pages where Linux gives them).
    static HostMemoryResource memory(false);
    auto* p = static_cast<std::byte*>(memory.allocate(kPoolBytes));
    auto* words = reinterpret_cast<std::uint32_t*>(p);
    std::uint64_t x = 0x9e3779b97f4a7c15ull;
    for (std::size_t i = 0; i < kPoolBytes / 4; ++i) {
      x = x * 6364136223846793005ull + 1442695040888963407ull;
      const auto half = [](std::uint32_t r) {
        return float_to_bf16(static_cast<float>(r & 0xffffff) * (2.0f / 0x1000000) - 1.0f);
      };
      words[i] =
          (std::uint32_t{half(static_cast<std::uint32_t>(x >> 40))} << 16) | half(static_cast<std::uint32_t>(x >> 16));
    }
    return p;
  }();
  return pool;
}

// The pool for q8_0 pages: 1 GiB of q8_0 blocks, each 32 values uniform in
// [-1, 1] quantized by ggml's rule (the bf16 pool read as q8_0 would hold
// values of up to 254).
std::byte* q8_page_pool() {
  static std::byte* pool = [] {
    static HostMemoryResource memory(false);
    auto* p = static_cast<std::byte*>(memory.allocate(kPoolBytes));
    std::uint64_t x = 0x2545f4914f6cdd1dull;
    float values[kQ8BlockValues];
    for (std::size_t at = 0; at + kQ8BlockBytes <= kPoolBytes; at += kQ8BlockBytes) {
      for (float& v : values) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        v = static_cast<float>(x >> 40) * (2.0f / 0x1000000) - 1.0f;
      }
      quantize_row_q8_0(values, kQ8BlockValues, p + at);
    }
    return p;
  }();
  return pool;
}

std::byte* page_pool(DType dtype) { return dtype == DType::q8_0 ? q8_page_pool() : page_pool(); }

// ---- the read bound -------------------------------------------------------

__attribute__((target("avx2"))) std::uint64_t sum_avx2(const std::byte* p, std::size_t bytes) {
  __m256i a = _mm256_setzero_si256(), b = a, c = a, d = a;
  const auto* v = reinterpret_cast<const __m256i*>(p);
  const std::size_t n = bytes / 128;
  for (std::size_t i = 0; i < n; ++i) {
    a = _mm256_add_epi64(a, _mm256_load_si256(v + 4 * i));
    b = _mm256_add_epi64(b, _mm256_load_si256(v + 4 * i + 1));
    c = _mm256_add_epi64(c, _mm256_load_si256(v + 4 * i + 2));
    d = _mm256_add_epi64(d, _mm256_load_si256(v + 4 * i + 3));
  }
  a = _mm256_add_epi64(_mm256_add_epi64(a, b), _mm256_add_epi64(c, d));
  alignas(32) std::uint64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), a);
  return lanes[0] + lanes[1] + lanes[2] + lanes[3];
}

std::uint64_t sum_scalar(const std::byte* p, std::size_t bytes) {
  const auto* v = reinterpret_cast<const std::uint64_t*>(p);
  std::uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  for (std::size_t i = 0; i + 4 <= bytes / 8; i += 4) {
    s0 += v[i];
    s1 += v[i + 1];
    s2 += v[i + 2];
    s3 += v[i + 3];
  }
  return s0 + s1 + s2 + s3;
}

// Mean seconds of a streaming read of `bytes` on `threads` threads.
double read_seconds(std::size_t bytes, unsigned threads) {
  const bool avx2 = __builtin_cpu_supports("avx2");
  std::byte* pool_bytes = page_pool();
  const std::size_t span = (bytes + 4095) / 4096 * 4096;
  std::size_t offset = 0;
  std::vector<std::uint64_t> sinks(threads);
  const double s = mean_seconds([&] {
    if (offset + span > kPoolBytes) offset = 0;
    const std::byte* base = pool_bytes + offset;
    offset += span;
    pool(threads).parallel_for(threads, [&](std::size_t i) {
      auto [first, end] = slice(span / 128, i, threads);
      const std::byte* p = base + first * 128;
      const std::size_t n = (end - first) * 128;
      sinks[i] += avx2 ? sum_avx2(p, n) : sum_scalar(p, n);
    });
  });
  benchmark::DoNotOptimize(sinks.data());
  return s;
}

// ---- the Attend -----------------------------------------------------------

struct AttendKey {
  int shape;
  std::uint32_t budget;
  DType dtype;
  std::uint32_t page_tokens;
  auto operator<=>(const AttendKey&) const = default;
};

std::uint32_t attend_batch(const Shape& s, std::uint32_t budget) {
  const std::size_t per_request = std::size_t{s.kv_heads} * budget * s.head_dim * 2 * 2;  // f16 K + V
  return static_cast<std::uint32_t>((kStepBytes + per_request - 1) / per_request);
}

// One configuration's plans (disjoint page sets of the pool), q and output.
struct AttendWork {
  AttendKey key;
  Shape shape;
  PageLayout layout;
  std::uint32_t batch = 0;
  std::vector<AttendPlan> plans;
  std::vector<float> q, out;
  SplitPlanAttention attention;
  std::size_t next = 0;

  std::size_t step_bytes() const { return std::size_t{batch} * shape.kv_heads * key.budget * layout.row_bytes() * 2; }
  AttendCall call(const AttendPlan& plan) {
    AttendCall c;
    c.plan = &plan;
    c.layout = layout;
    c.batch = batch;
    c.q_heads = shape.q_heads;
    c.kv_heads = shape.kv_heads;
    c.scale = 1.0f / std::sqrt(static_cast<float>(shape.head_dim));
    c.q = q.data();
    c.out = out.data();
    return c;
  }
  // One decode step's Attend on `threads` threads, on the next page set.
  void step(unsigned threads) {
    attention.prepare(call(plans[next]));
    next = (next + 1) % plans.size();
    const std::size_t chunks = attention.chunks();
    pool(threads).parallel_for(threads, [&](std::size_t i) {
      const auto [first, end] = slice(chunks, i, threads);
      attention.run(first, end);
    });
    attention.finish();
  }
  // Token t of (request b, kv head h) in plan set 0: its K and V rows.
  const std::byte* k_row(std::uint32_t b, std::uint32_t h, std::uint32_t t) const {
    return row(b, h, t) + layout.k_offset(t % layout.page_tokens);
  }
  const std::byte* v_row(std::uint32_t b, std::uint32_t h, std::uint32_t t) const {
    return row(b, h, t) + layout.v_offset(t % layout.page_tokens);
  }

 private:
  const std::byte* row(std::uint32_t b, std::uint32_t h, std::uint32_t t) const {
    const AttendPlan& p = plans[0];
    const std::int64_t entry = p.head_entries[std::size_t{b} * shape.kv_heads + h];
    const std::int64_t page = p.indices[static_cast<std::size_t>(p.indptr[entry] + t / layout.page_tokens)];
    return p.gpu_tier_base + static_cast<std::size_t>(page) * p.page_bytes;
  }
};

AttendWork& attend_work(const AttendKey& key) {
  static std::unique_ptr<AttendWork> work;
  if (work && work->key == key) return *work;
  work.reset();
  auto w = std::make_unique<AttendWork>();
  w->key = key;
  w->shape = kShapes[key.shape];
  w->layout = PageLayout{key.page_tokens, w->shape.head_dim, key.dtype};
  w->batch = attend_batch(w->shape, key.budget);
  const std::size_t rows = std::size_t{w->batch} * w->shape.kv_heads;
  const std::uint32_t row_pages = key.budget / key.page_tokens;
  const std::size_t set_pages = rows * row_pages;
  const std::size_t pool_pages = kPoolBytes / w->layout.page_bytes();
  const std::size_t sets = std::min(kMaxSets, pool_pages / set_pages);
  std::vector<PageId> pages(pool_pages);
  std::iota(pages.begin(), pages.end(), PageId{0});
  std::shuffle(pages.begin(), pages.end(), std::mt19937(1234 + key.budget + key.page_tokens));
  const std::vector<std::uint32_t> tokens(row_pages, key.page_tokens);
  w->plans.resize(sets);
  for (std::size_t s = 0; s < sets; ++s) {
    AttendPlan& plan = w->plans[s];
    for (std::size_t r = 0; r < rows; ++r) {
      append_runs(plan, std::span<const PageId>(pages.data() + s * set_pages + r * row_pages, row_pages), tokens,
                  key.page_tokens);
      plan.head_entries.push_back(static_cast<std::int64_t>(plan.entries()));
    }
    plan.gpu_tier_base = page_pool(key.dtype);
    plan.page_bytes = w->layout.page_bytes();
  }
  w->q.resize(std::size_t{w->batch} * w->shape.q_heads * w->shape.head_dim);
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  for (float& x : w->q) x = normal(rng);
  w->out.assign(w->q.size(), 0.0f);
  work = std::move(w);
  return *work;
}

// Our Attend's mean seconds a step, per configuration and threads: recorded
// by the Attend rows, measured here when a filter left them out.
std::map<std::pair<AttendKey, unsigned>, double>& attend_times() {
  static std::map<std::pair<AttendKey, unsigned>, double> times;
  return times;
}

double attend_seconds(const AttendKey& key, unsigned threads) {
  auto& times = attend_times();
  if (auto it = times.find({key, threads}); it != times.end()) return it->second;
  AttendWork& w = attend_work(key);
  const double s = mean_seconds([&] { w.step(threads); });
  times[{key, threads}] = s;
  return s;
}

// ---- ggml's flash attention -------------------------------------------------

#if SPARSEKV_BENCH_GGML
// ggml's thread pool for `threads` threads (the caller is one of them),
// alive while one measurement lasts: its threads poll between graphs.
struct GgmlRunner {
  explicit GgmlRunner(unsigned threads) : threads(static_cast<int>(threads)) {
    ggml_threadpool_params p = ggml_threadpool_params_default(this->threads);
    pool = ggml_threadpool_new(&p);
  }
  ~GgmlRunner() { ggml_threadpool_free(pool); }
  GgmlRunner(const GgmlRunner&) = delete;
  GgmlRunner& operator=(const GgmlRunner&) = delete;
  void compute(ggml_cgraph* graph) {
    ggml_cplan plan = ggml_graph_plan(graph, threads, pool);
    if (plan.work_size > work.size()) work.resize(plan.work_size);
    plan.work_data = work.data();
    if (ggml_graph_compute(graph, &plan) != GGML_STATUS_SUCCESS) throw std::runtime_error("ggml_graph_compute failed");
  }
  int threads;
  ggml_threadpool* pool;
  std::vector<std::uint8_t> work;
};

// ggml_flash_attn_ext over the same shape and tokens as an Attend
// configuration, f16 K/V contiguous per request, in sets enough to rotate
// through kRotationBytes; set 0 holds the Attend's plan-0 K/V (as f16).
class GgmlAttention {
 public:
  GgmlAttention(const AttendWork& w)
      : shape_(w.shape),
        budget_(w.key.budget),
        batch_(w.batch),
        type_(w.layout.dtype == DType::q8_0 ? GGML_TYPE_Q8_0 : GGML_TYPE_F16) {
    const std::size_t kv_bytes =
        std::size_t{batch_} * shape_.kv_heads * budget_ * ggml_row_size(type_, shape_.head_dim);
    sets_ = std::max<std::size_t>(2, (kRotationBytes + 2 * kv_bytes - 1) / (2 * kv_bytes));
    const std::size_t tensors = sets_ * (2 + 2 * (1 + 4 * std::size_t{batch_})) + 4;
    const std::size_t graph_nodes = 8 + 4 * std::size_t{batch_};
    ggml_init_params params{};
    // K, V and two outputs (one a layout) a set, q, the tensors' headers and padding, the graphs.
    params.mem_size = sets_ * (2 * kv_bytes + 2 * w.q.size() * sizeof(float)) + w.q.size() * sizeof(float) +
                      tensors * (ggml_tensor_overhead() + 64) +
                      2 * sets_ * ggml_graph_overhead_custom(graph_nodes, false) + kMiB;
    params.mem_buffer = nullptr;
    params.no_alloc = false;
    ctx_ = ggml_init(params);
    if (ctx_ == nullptr) throw std::runtime_error("ggml_init failed");
    const std::int64_t d = shape_.head_dim;
    q_ = ggml_new_tensor_4d(ctx_, GGML_TYPE_F32, d, 1, shape_.q_heads, batch_);
    std::memcpy(q_->data, w.q.data(), w.q.size() * sizeof(float));  // the same [batch][q_heads][d]
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    std::uint64_t x = 11;  // the other sets: uniform in [-1, 1) from an LCG
    std::vector<float> row(d);
    for (std::size_t s = 0; s < sets_; ++s) {
      ggml_tensor* k = ggml_new_tensor_4d(ctx_, type_, d, budget_, shape_.kv_heads, batch_);
      ggml_tensor* v = ggml_new_tensor_4d(ctx_, type_, d, budget_, shape_.kv_heads, batch_);
      const std::size_t row_bytes = ggml_row_size(type_, d);
      for (std::uint32_t b = 0; b < batch_; ++b) {
        for (std::uint32_t h = 0; h < shape_.kv_heads; ++h) {
          for (std::uint32_t t = 0; t < budget_; ++t) {
            const std::size_t at = ((std::size_t{b} * shape_.kv_heads + h) * budget_ + t) * d;
            for (int kv = 0; kv < 2; ++kv) {
              auto* target = static_cast<std::byte*>((kv == 0 ? k : v)->data) + at / d * row_bytes;
              const std::byte* src = kv == 0 ? w.k_row(b, h, t) : w.v_row(b, h, t);
              if (s == 0 && type_ == GGML_TYPE_Q8_0) {  // the page's blocks as they are
                std::memcpy(target, src, row_bytes);
                continue;
              }
              if (s == 0) {
                for (std::int64_t j = 0; j < d; ++j) row[j] = load_element(src, j, w.layout.dtype);
              } else {
                for (float& r : row) {
                  x = x * 6364136223846793005ull + 1442695040888963407ull;
                  r = static_cast<float>(x >> 40) * (2.0f / 0x1000000) - 1.0f;
                }
              }
              if (type_ == GGML_TYPE_Q8_0) {
                quantize_row_q8_0(row.data(), d, target);
              } else {
                ggml_fp32_to_fp16_row(row.data(), reinterpret_cast<ggml_fp16_t*>(target), d);
              }
            }
          }
        }
      }
      // One node, the requests as ggml's streams (dim 3).
      ggml_cgraph* streams = ggml_new_graph_custom(ctx_, graph_nodes, false);
      ggml_tensor* o = ggml_flash_attn_ext(ctx_, q_, k, v, nullptr, scale, 0.0f, 0.0f);
      ggml_build_forward_expand(streams, o);
      streams_.push_back(streams);
      if (s == 0) streams_out_ = o;
      // One node per request: ggml's split-KV decode path.
      ggml_cgraph* per_request = ggml_new_graph_custom(ctx_, graph_nodes, false);
      for (std::uint32_t b = 0; b < batch_; ++b) {
        ggml_tensor* qb =
            ggml_view_4d(ctx_, q_, d, 1, shape_.q_heads, 1, q_->nb[1], q_->nb[2], q_->nb[3], b * q_->nb[3]);
        ggml_tensor* kb =
            ggml_view_4d(ctx_, k, d, budget_, shape_.kv_heads, 1, k->nb[1], k->nb[2], k->nb[3], b * k->nb[3]);
        ggml_tensor* vb =
            ggml_view_4d(ctx_, v, d, budget_, shape_.kv_heads, 1, v->nb[1], v->nb[2], v->nb[3], b * v->nb[3]);
        ggml_tensor* ob = ggml_flash_attn_ext(ctx_, qb, kb, vb, nullptr, scale, 0.0f, 0.0f);
        ggml_build_forward_expand(per_request, ob);
        if (s == 0) per_request_out_.push_back(ob);
      }
      per_request_.push_back(per_request);
    }
  }
  ~GgmlAttention() { ggml_free(ctx_); }
  GgmlAttention(const GgmlAttention&) = delete;
  GgmlAttention& operator=(const GgmlAttention&) = delete;

  struct Timing {
    double seconds;
    bool per_request;  // the faster layout
  };
  // Both layouts the first time for `threads`, then the faster one only.
  Timing measure(unsigned threads) {
    GgmlRunner runner(threads);
    std::size_t next = 0;
    const auto time = [&](std::vector<ggml_cgraph*>& graphs) {
      return mean_seconds([&] { runner.compute(graphs[next++ % sets_]); });
    };
    if (auto it = faster_.find(threads); it != faster_.end()) {
      return {time(it->second ? per_request_ : streams_), it->second};
    }
    const double streams = time(streams_), per_request = time(per_request_);
    faster_[threads] = per_request < streams;
    return {std::min(streams, per_request), per_request < streams};
  }
  // Largest |ggml - ours| over set 0 (both layouts), `ours` [batch][q_heads][d].
  double max_difference(const std::vector<float>& ours) {
    GgmlRunner runner(1);
    runner.compute(streams_[0]);
    runner.compute(per_request_[0]);
    double worst = 0;
    const std::size_t per = std::size_t{shape_.q_heads} * shape_.head_dim;
    // Output [d, q_heads, 1, batch]: the same order as ours.
    const auto* all = static_cast<const float*>(streams_out_->data);
    for (std::size_t i = 0; i < ours.size(); ++i) worst = std::max(worst, double(std::fabs(all[i] - ours[i])));
    for (std::uint32_t b = 0; b < batch_; ++b) {
      const auto* o = static_cast<const float*>(per_request_out_[b]->data);
      for (std::size_t i = 0; i < per; ++i) worst = std::max(worst, double(std::fabs(o[i] - ours[b * per + i])));
    }
    return worst;
  }
  std::size_t kv_bytes() const {
    return std::size_t{batch_} * shape_.kv_heads * budget_ * ggml_row_size(type_, shape_.head_dim) * 2;
  }

 private:
  Shape shape_;
  std::uint32_t budget_, batch_;
  ggml_type type_;
  std::size_t sets_ = 0;
  ggml_context* ctx_ = nullptr;
  ggml_tensor* q_ = nullptr;
  ggml_tensor* streams_out_ = nullptr;
  std::vector<ggml_tensor*> per_request_out_;
  std::vector<ggml_cgraph*> streams_, per_request_;
  std::map<unsigned, bool> faster_;  // threads -> per-request layout faster
};

// The ggml side of (shape, budget), built at its first Attend row (and
// checked against it); one alive at a time.
GgmlAttention& ggml_attention(AttendWork& w, std::string& error) {
  static std::unique_ptr<GgmlAttention> current;
  static std::tuple<int, std::uint32_t, bool> current_key{-1, 0, false};
  static std::string current_error;
  const auto key = std::make_tuple(w.key.shape, w.key.budget, w.key.dtype == DType::q8_0);
  if (current && current_key == key) {
    error = current_error;
    return *current;
  }
  current.reset();
  current = std::make_unique<GgmlAttention>(w);
  current_key = key;
  // Our output on plan set 0, then ggml's on the same K/V.
  w.attention.attend(w.call(w.plans[0]));
  const double diff = current->max_difference(w.out);
  // ggml: f16 q.k and an f16 V accumulator; with q8_0 K it quantizes q to q8_0 too.
  const double tolerance = w.key.dtype == DType::f32 || w.key.dtype == DType::q8_0 ? 5e-2 : 3e-2;
  std::fprintf(stderr, "bench_host: %s budget %u (%s pages): max |ggml - sparsekv| = %.2e\n", w.shape.name,
               w.key.budget, std::string(to_string(w.key.dtype)).c_str(), diff);
  current_error.clear();
  if (!(diff <= tolerance)) current_error = "ggml and sparsekv disagree: max abs difference " + std::to_string(diff);
  error = current_error;
  return *current;
}
#endif

// Mean seconds of reading the pages of w's plans (each call the next set),
// in the Attend's order, split in halves of the pages as its chunks are:
// each page summed with AVX2, the next page's lines asked for before it (one
// page ahead, as fold_page asks for the next page's K).
double scattered_read_seconds(AttendWork& w, unsigned threads) {
  const bool avx2 = __builtin_cpu_supports("avx2");
  const std::size_t page_bytes = w.layout.page_bytes();
  std::vector<std::uint64_t> sinks(threads);
  std::size_t set = 0;
  const double s = mean_seconds([&] {
    const AttendPlan& plan = w.plans[set];
    set = (set + 1) % w.plans.size();
    const std::size_t pages = plan.indices.size();
    pool(threads).parallel_for(threads, [&](std::size_t i) {
      const auto [first, end] = slice(pages, i, threads);
      for (std::size_t p = first; p < end; ++p) {
        if (p + 1 < end) {
          const std::byte* next = plan.page(p + 1);
          for (std::size_t at = 0; at < page_bytes; at += 64) __builtin_prefetch(next + at);
        }
        sinks[i] += avx2 ? sum_avx2(plan.page(p), page_bytes) : sum_scalar(plan.page(p), page_bytes);
      }
    });
  });
  benchmark::DoNotOptimize(sinks.data());
  return s;
}

// The bounds of a row, measured just before it (once, though Google Benchmark
// calls the row's function several times): the VM's bandwidth drifts.
struct Bounds {
  double read_s = 0, scattered_s = 0;
#if SPARSEKV_BENCH_GGML
  GgmlAttention::Timing ggml{};
  double ggml_bytes = 0;
#endif
  std::string error;
};

const Bounds& row_bounds(AttendWork& w, unsigned threads) {
  static std::map<std::pair<AttendKey, unsigned>, Bounds> rows;
  const auto key = std::make_pair(w.key, threads);
  if (auto it = rows.find(key); it != rows.end()) return it->second;
  Bounds b;
  b.read_s = read_seconds(w.step_bytes(), threads);
  b.scattered_s = scattered_read_seconds(w, threads);
#if SPARSEKV_BENCH_GGML
  GgmlAttention& ggml = ggml_attention(w, b.error);
  if (b.error.empty()) {
    b.ggml = ggml.measure(threads);
    b.ggml_bytes = double(ggml.kv_bytes());
  }
#endif
  return rows[key] = b;
}

void BM_Attend(benchmark::State& state, AttendKey key, unsigned threads) {
  AttendWork& w = attend_work(key);
  const Bounds& bounds = row_bounds(w, threads);
  if (!bounds.error.empty()) {
    state.SkipWithError(bounds.error.c_str());
    return;
  }
  const double read_s = bounds.read_s;
  double total = 0;
  for (auto _ : state) {
    const auto start = Clock::now();
    w.step(threads);
    const double s = seconds_since(start);
    state.SetIterationTime(s);
    total += s;
  }
  benchmark::DoNotOptimize(w.out.data());
  const double ours = total / double(state.iterations());
  attend_times()[{key, threads}] = ours;
  const double bytes = double(w.step_bytes());
  state.counters["GBps"] = bytes / ours / 1e9;
  state.counters["read_GBps"] = bytes / read_s / 1e9;
  state.counters["over_read_bw"] = read_s / ours;
  state.counters["scattered_GBps"] = bytes / bounds.scattered_s / 1e9;
  state.counters["over_scattered"] = bounds.scattered_s / ours;
  state.counters["tokens"] = key.budget;
  state.counters["batch"] = w.batch;
#if SPARSEKV_BENCH_GGML
  state.counters["over_ggml"] = ours / bounds.ggml.seconds;
  state.counters["ggml_GBps"] = bounds.ggml_bytes / bounds.ggml.seconds / 1e9;
  state.SetLabel(bounds.ggml.per_request ? "ggml:per-request" : "ggml:streams");
#else
  state.SetLabel("no ggml (no llama.cpp source at build time)");
#endif
}

// ---- Select ---------------------------------------------------------------

constexpr std::uint32_t kSelectBudget = 1024;
constexpr std::uint32_t kSelectPageTokens = 16;
constexpr std::size_t kSelectRotationBytes = 128 * kMiB;

template <class Policy>
std::size_t state_bytes(const typename Policy::LayerState& s) {
  std::size_t n = s.tokens.size() * 4;
  for (const auto& ids : s.ids) n += ids.size() * sizeof(PartitionId);
  if constexpr (std::is_same_v<Policy, QuestPolicy>) {
    for (std::size_t h = 0; h < s.min.size(); ++h) n += s.min[h].bytes() + s.max[h].bytes();
  } else {
    for (std::size_t h = 0; h < s.landmarks.size(); ++h) n += (s.landmarks[h].size() + s.outlier_score[h].size()) * 4;
  }
  return n;
}

// One Select row: the shape, its context and pages, the budget, and the
// Attend row its time is compared with.
struct SelectCase {
  int shape = 0;
  std::uint32_t context = 0;
  std::uint32_t page_tokens = kSelectPageTokens;
  std::uint32_t budget = kSelectBudget;
  DType attend_dtype = DType::bf16;
  auto operator<=>(const SelectCase&) const = default;
};

template <class Policy>
void BM_Select(benchmark::State& state, SelectCase select, unsigned threads) {
  const Shape& shape = kShapes[select.shape];
  const std::uint32_t context = select.context;
  LayerContext ctx;
  ctx.layer = 2;  // past Quest's dense layers
  ctx.layers = 32;
  ctx.q_heads = shape.q_heads;
  ctx.kv_heads = shape.kv_heads;
  ctx.head_dim = shape.head_dim;
  ctx.page_tokens = select.page_tokens;
  ctx.tokens = context;
  ctx.kv_dtype = select.attend_dtype;  // as the facade: the K/V's dtype (Quest keeps its boxes in it)
  typename Policy::Options options;
  options.budget_tokens = select.budget;
  const Policy policy(options);

  // Summaries of random keys (index), copied for the rotation; kept across
  // Google Benchmark's repeated calls of this function.
  struct Work {
    SelectCase select;
    std::vector<typename Policy::LayerState> states;
    std::vector<float> q;
  };
  static Work work;
  if (work.select != select) {
    work = Work{};
    std::mt19937 rng(3);
    std::normal_distribution<float> normal;
    std::vector<float> keys(std::size_t{context} * shape.kv_heads * shape.head_dim), values(keys.size());
    // Keys of neighbouring tokens alike (a drifting direction per head), as in real models.
    std::vector<float> dir(std::size_t{shape.kv_heads} * shape.head_dim);
    for (float& x : dir) x = normal(rng);
    for (std::uint32_t t = 0; t < context; ++t) {
      for (std::size_t i = 0; i < dir.size(); ++i) {
        dir[i] = 0.98f * dir[i] + 0.2f * normal(rng);
        keys[std::size_t{t} * dir.size() + i] = dir[i] + 0.3f * normal(rng);
      }
    }
    // Widened from the K/V dtype, as the facade hands keys to a policy.
    if (select.attend_dtype != DType::f32) {
      for (float& x : keys) {
        std::uint16_t h = 0;
        store_element(&h, 0, select.attend_dtype, x);
        x = load_element(&h, 0, select.attend_dtype);
      }
    }
    const KvView kv{keys, values, context, shape.kv_heads, shape.head_dim, 0};
    typename Policy::LayerState first;
    policy.index(ctx, kv, first);
    const std::size_t copies = std::clamp<std::size_t>(kSelectRotationBytes / state_bytes<Policy>(first) + 1, 2, 64);
    work.states.assign(copies, first);
    work.q.resize(std::size_t{shape.q_heads} * shape.head_dim);
    for (float& x : work.q) x = normal(rng);
    work.select = select;
  }
  const DecodeQuery query{work.q, context};
  std::vector<std::vector<PartitionId>> chosen(shape.kv_heads);
  std::size_t next = 0;
  double total = 0;
  std::size_t selected = 0;
  for (auto _ : state) {
    const auto& st = work.states[next];
    next = (next + 1) % work.states.size();
    const auto start = Clock::now();
    pool(threads).parallel_for(threads, [&](std::size_t i) {
      const auto [first, end] = slice(shape.kv_heads, i, threads);
      for (std::size_t h = first; h < end; ++h)
        policy.select_head(ctx, query, st, static_cast<std::uint32_t>(h), chosen[h]);
    });
    const double s = seconds_since(start);
    state.SetIterationTime(s);
    total += s;
    selected += chosen[0].size();
  }
  const double ours = total / double(state.iterations());
  const AttendKey attend{select.shape, select.budget, select.attend_dtype, select.page_tokens};
  const double attend_per_request = attend_seconds(attend, threads) / attend_batch(shape, select.budget);
  state.counters["us"] = ours * 1e6;
  state.counters["over_attend"] = ours / attend_per_request;
  state.counters["attend_us"] = attend_per_request * 1e6;
  state.counters["partitions"] = double(selected) / double(state.iterations());
  state.counters["context"] = context;
}

void BM_SharedPrefix(benchmark::State& state, const std::string& policy) {
  constexpr std::uint32_t kPrompt = 4096, kRequests = 8;
  const ModelShape shape{30, 9, 3, 64, DType::f16};
  Config config;
  config.page_tokens = 8;
  config.max_requests = 2 * kRequests;
  config.max_context_tokens = 8192;
  config.cpu_tier_bytes = std::size_t{1} << 30;
  config.host_chunk_bytes = 16 * kMiB;
  const std::size_t row = std::size_t{shape.kv_heads} * shape.head_dim;
  std::mt19937 rng(5);
  std::normal_distribution<float> normal;
  std::vector<std::vector<std::uint16_t>> k(shape.layers), v(shape.layers);
  for (std::uint32_t l = 0; l < shape.layers; ++l) {
    for (std::size_t i = 0; i < kPrompt * row; ++i) {
      k[l].push_back(float_to_f16(normal(rng)));
      v[l].push_back(float_to_f16(normal(rng)));
    }
  }
  // Starts requests 1..8 on a fresh Manager; returns the mean seconds of 2..8 and the CPU tier's bytes in use.
  const auto start_all = [&](bool shared) {
    RuntimeManager m(shape, config, make_policy(policy, 1024), std::make_unique<InPlaceBackend>());
    m.add_request(1, 8192);
    for (std::uint32_t l = 0; l < shape.layers; ++l) m.prefill(1, l, k[l].data(), v[l].data(), kPrompt);
    const auto t0 = Clock::now();
    for (RequestId id = 2; id <= kRequests; ++id) {
      if (shared) {
        m.fork(id, 1, kPrompt, 8192);
      } else {
        m.add_request(id, 8192);
        for (std::uint32_t l = 0; l < shape.layers; ++l) m.prefill(id, l, k[l].data(), v[l].data(), kPrompt);
      }
    }
    const double s = seconds_since(t0) / (kRequests - 1);
    return std::pair{s, double(m.tier_usage().cpu.used * m.tier_usage().page_bytes)};
  };
  double shared_s = 0, unshared_s = 0, shared_bytes = 0, unshared_bytes = 0;
  for (auto _ : state) {
    const auto [ss, sb] = start_all(true);
    const auto [us, ub] = start_all(false);
    shared_s += ss;
    unshared_s += us;
    shared_bytes = sb;
    unshared_bytes = ub;
    state.SetIterationTime(ss + us);
  }
  const double n = double(state.iterations());
  state.counters["shared_ms"] = shared_s / n * 1e3;
  state.counters["unshared_ms"] = unshared_s / n * 1e3;
  state.counters["time_ratio"] = shared_s / unshared_s;
  state.counters["shared_MiB"] = shared_bytes / double(kMiB);
  state.counters["unshared_MiB"] = unshared_bytes / double(kMiB);
  state.counters["bytes_ratio"] = shared_bytes / unshared_bytes;
}

void BM_FoldInCache(benchmark::State& state, int shape_index, DType dtype, std::uint32_t page_tokens) {
  const Shape& shape = kShapes[shape_index];
  const PageLayout layout{page_tokens, shape.head_dim, dtype};
  const std::uint32_t group = shape.q_heads / shape.kv_heads;
  constexpr std::size_t kPages = 8;
  const std::byte* pages = page_pool(dtype);  // the first pages of the pool: finite values of unit order
  std::vector<float> q(std::size_t{group} * shape.head_dim), acc(q.size()),
      scratch(page_fold_scratch_floats(page_tokens));
  std::mt19937 rng(3);
  std::normal_distribution<float> normal;
  for (float& x : q) x = normal(rng);
  std::vector<SoftmaxState> states(group);
  PageFold fold;
  fold.layout = layout;
  fold.group = group;
  fold.scale = 1.0f / std::sqrt(static_cast<float>(shape.head_dim));
  fold.q = q.data();
  fold.states = states.data();
  fold.acc = acc.data();
  fold.weights = scratch.data();
  // The pages in tiles, as SplitPlanAttention cuts a chunk's.
  const std::size_t tile_pages = std::max<std::size_t>(1, fold_tile_tokens(layout) / page_tokens);
  std::vector<FoldPageRef> refs;
  for (std::size_t p = 0; p < kPages; ++p) refs.push_back({pages + p * layout.page_bytes(), page_tokens});
  double total = 0;
  for (auto _ : state) {
    const auto start = Clock::now();
    for (std::size_t p = 0; p < kPages; p += tile_pages) {
      const std::size_t count = std::min(tile_pages, kPages - p);
      fold_pages(fold, std::span(refs).subspan(p, count), p + count < kPages ? refs[p + count].data : nullptr);
    }
    const double s = seconds_since(start);
    state.SetIterationTime(s);
    total += s;
  }
  benchmark::DoNotOptimize(acc.data());
  const double folds = double(state.iterations()) * kPages;
  state.counters["ns_per_token"] = total / (folds * page_tokens) * 1e9;
  state.counters["GBps"] = folds * double(layout.page_bytes()) / total / 1e9;
  state.SetLabel("target " + fold_page_target());
}

// ---- PromptAttention ---------------------------------------------------------

constexpr std::uint32_t kPromptRows = 512;  // llama.cpp's default ubatch

// One (shape, context) configuration: f16 K/V of `context` positions,
// token-major as llama.cpp's cache holds them ([token][kv head][head_dim]),
// q and outputs of the last kPromptRows positions as one chunk; with ggml,
// its graph reads the same bytes.
class PromptWork {
 public:
  PromptWork(int shape_index, std::uint32_t context) : shape_(kShapes[shape_index]), context_(context) {
    const Shape& s = shape_;
    shape.dtype = DType::f16;
    shape.q_heads = s.q_heads;
    shape.kv_heads = s.kv_heads;
    shape.head_dim = s.head_dim;
    shape.scale = 1.0f / std::sqrt(static_cast<float>(s.head_dim));
    const std::size_t kv = std::size_t{context} * s.kv_heads * s.head_dim;
    k_.resize(kv);
    v_.resize(kv);
    std::uint64_t x = 29;  // uniform in [-1, 1) from an LCG, as f16
    const auto next = [&x] {
      x = x * 6364136223846793005ull + 1442695040888963407ull;
      return static_cast<float>(x >> 40) * (2.0f / 0x1000000) - 1.0f;
    };
    for (std::size_t i = 0; i < kv; ++i) k_[i] = float_to_f16(2.0f * next());
    for (std::size_t i = 0; i < kv; ++i) v_[i] = float_to_f16(next());
    q_.resize(std::size_t{kPromptRows} * s.q_heads * s.head_dim);
    for (float& f : q_) f = 2.0f * next();
    out_.assign(q_.size(), 0.0f);
    chunk.q = q_.data();
    chunk.k = reinterpret_cast<const std::byte*>(k_.data());
    chunk.v = reinterpret_cast<const std::byte*>(v_.data());
    chunk.first = context - kPromptRows;
    chunk.rows = kPromptRows;
    chunk.out = out_.data();
#if SPARSEKV_BENCH_GGML
    build_ggml();
#endif
  }
  ~PromptWork() {
#if SPARSEKV_BENCH_GGML
    if (ctx_ != nullptr) ggml_free(ctx_);
#endif
  }
  PromptWork(const PromptWork&) = delete;
  PromptWork& operator=(const PromptWork&) = delete;

  // plan() and run() on `threads` threads, as an engine's threads would share one op.
  void attend(unsigned threads) {
    attention.plan(shape, std::span(&chunk, 1), 2);
    pool(threads).parallel_for(threads, [&](std::size_t i) { attention.run(i, threads); });
  }

#if SPARSEKV_BENCH_GGML
  double ggml_seconds(unsigned threads) {
    GgmlRunner runner(threads);
    return mean_seconds([&] { runner.compute(graph_); });
  }
  // Largest |ggml - ours| over the chunk.
  double max_difference() {
    attend(1);
    GgmlRunner runner(1);
    runner.compute(graph_);
    double worst = 0;
    for (std::size_t i = 0; i < out_.size(); ++i) worst = std::max(worst, double(std::fabs(ggml_out_[i] - out_[i])));
    return worst;
  }
#endif

  PromptAttentionShape shape;
  PromptChunk chunk;
  PromptAttention attention;
  std::string error;  // ggml's output and ours disagree

 private:
#if SPARSEKV_BENCH_GGML
  // llama.cpp's graph of the chunk: q [d, q_heads, rows] permuted to [d, rows,
  // q_heads], K and V viewed from the cache as [d, context, kv_heads], the
  // causal mask [context, rows] in f16 (-inf past each row's position); the
  // result [d, q_heads, rows] is our output's layout.
  void build_ggml() {
    const Shape& s = shape_;
    const std::int64_t d = s.head_dim, n_kv = context_, rows = kPromptRows;
    mask_.resize(std::size_t{kPromptRows} * context_);
    for (std::uint32_t i = 0; i < kPromptRows; ++i) {
      for (std::uint32_t j = 0; j < context_; ++j) {
        mask_[std::size_t{i} * context_ + j] = float_to_f16(j <= chunk.first + i ? 0.0f : kNegativeInfinity);
      }
    }
    ggml_out_.assign(out_.size(), 0.0f);
    ggml_init_params params{};
    params.mem_size = 16 * ggml_tensor_overhead() + ggml_graph_overhead() + kMiB;
    params.no_alloc = true;  // the tensors' data are this object's arrays
    ctx_ = ggml_init(params);
    if (ctx_ == nullptr) throw std::runtime_error("ggml_init failed");
    ggml_tensor* q = ggml_new_tensor_3d(ctx_, GGML_TYPE_F32, d, s.q_heads, rows);
    q->data = q_.data();
    ggml_tensor* k = ggml_new_tensor_1d(ctx_, GGML_TYPE_F16, n_kv * s.kv_heads * d);
    k->data = k_.data();
    ggml_tensor* v = ggml_new_tensor_1d(ctx_, GGML_TYPE_F16, n_kv * s.kv_heads * d);
    v->data = v_.data();
    ggml_tensor* mask = ggml_new_tensor_2d(ctx_, GGML_TYPE_F16, n_kv, rows);
    mask->data = mask_.data();
    const std::size_t token = std::size_t(s.kv_heads) * d * 2, head = std::size_t(d) * 2;
    ggml_tensor* kv_k = ggml_view_4d(ctx_, k, d, n_kv, s.kv_heads, 1, token, head, token * n_kv, 0);
    ggml_tensor* kv_v = ggml_view_4d(ctx_, v, d, n_kv, s.kv_heads, 1, token, head, token * n_kv, 0);
    ggml_tensor* o =
        ggml_flash_attn_ext(ctx_, ggml_permute(ctx_, q, 0, 2, 1, 3), kv_k, kv_v, mask, shape.scale, 0.0f, 0.0f);
    o->data = ggml_out_.data();
    graph_ = ggml_new_graph(ctx_);
    ggml_build_forward_expand(graph_, o);
  }

  ggml_context* ctx_ = nullptr;
  ggml_cgraph* graph_ = nullptr;
  std::vector<std::uint16_t> mask_;
  std::vector<float> ggml_out_;
#endif
  Shape shape_;
  std::uint32_t context_;
  std::vector<std::uint16_t> k_, v_;
  std::vector<float> q_, out_;
};

PromptWork& prompt_work(int shape_index, std::uint32_t context) {
  static std::unique_ptr<PromptWork> work;
  static std::pair<int, std::uint32_t> key{-1, 0};
  if (!work || key != std::pair{shape_index, context}) {
    work.reset();
    work = std::make_unique<PromptWork>(shape_index, context);
    key = {shape_index, context};
#if SPARSEKV_BENCH_GGML
    const double diff = work->max_difference();
    std::fprintf(stderr, "bench_host: prompt %s context %u: max |ggml - sparsekv| = %.2e\n", kShapes[shape_index].name,
                 context, diff);
    if (!(diff <= 1e-3)) work->error = "ggml and sparsekv disagree: max abs difference " + std::to_string(diff);
#endif
  }
  return *work;
}

void BM_PromptAttention(benchmark::State& state, int shape_index, std::uint32_t context, unsigned threads) {
  PromptWork& w = prompt_work(shape_index, context);
  if (!w.error.empty()) {
    state.SkipWithError(w.error.c_str());
    return;
  }
#if SPARSEKV_BENCH_GGML
  // Measured once per row, just before it (the VM's speed drifts).
  static std::map<std::tuple<int, std::uint32_t, unsigned>, double> ggml_times;
  const auto key = std::make_tuple(shape_index, context, threads);
  if (!ggml_times.contains(key)) ggml_times[key] = w.ggml_seconds(threads);
  const double ggml = ggml_times[key];
#endif
  double total = 0;
  for (auto _ : state) {
    const auto start = Clock::now();
    w.attend(threads);
    const double s = seconds_since(start);
    state.SetIterationTime(s);
    total += s;
  }
  const double ours = total / double(state.iterations());
  state.counters["tokens_per_s"] = kPromptRows / ours;
  state.counters["context"] = context;
  state.counters["tiles"] = double(w.attention.tiles());
#if SPARSEKV_BENCH_GGML
  state.counters["ggml_tokens_per_s"] = kPromptRows / ggml;
  state.counters["over_ggml"] = ours / ggml;
  state.SetLabel("target " + fold_page_target());
#else
  state.SetLabel("no ggml (no llama.cpp source at build time); target " + fold_page_target());
#endif
}

void register_all() {
  const std::pair<DType, const char*> dtypes[] = {
      {DType::f16, "f16"}, {DType::bf16, "bf16"}, {DType::f32, "f32"}, {DType::q8_0, "q8_0"}};
  for (int s = 0; s < 2; ++s) {
    for (const std::uint32_t budget : {512u, 1024u, 2048u}) {
      for (const auto& [dtype, dname] : dtypes) {
        for (const std::uint32_t page : {8u, 16u}) {
          for (const unsigned threads : {1u, 2u}) {
            const std::string name = std::string("Attend/") + kShapes[s].name + "/" + dname +
                                     "/budget:" + std::to_string(budget) + "/page:" + std::to_string(page) +
                                     "/threads:" + std::to_string(threads);
            benchmark::RegisterBenchmark(name.c_str(), BM_Attend, AttendKey{s, budget, dtype, page}, threads)
                ->UseManualTime()
                ->Unit(benchmark::kMicrosecond)
                ->MinTime(0.2);
          }
        }
      }
    }
  }
  for (int s = 0; s < 2; ++s) {
    for (const auto& [dtype, dname] : dtypes) {
      for (const std::uint32_t page : {8u, 16u}) {
        const std::string name =
            std::string("FoldInCache/") + kShapes[s].name + "/" + dname + "/page:" + std::to_string(page);
        benchmark::RegisterBenchmark(name.c_str(), BM_FoldInCache, s, dtype, page)->UseManualTime()->MinTime(0.2);
      }
    }
  }
  for (int s = 0; s < 2; ++s) {
    for (const std::uint32_t context : {kPromptRows, 2048u, 8192u}) {
      for (const unsigned threads : {1u, 2u}) {
        const std::string name = std::string("PromptAttention/") + kShapes[s].name +
                                 "/f16/context:" + std::to_string(context) + "/threads:" + std::to_string(threads);
        benchmark::RegisterBenchmark(name.c_str(), BM_PromptAttention, s, context, threads)
            ->UseManualTime()
            ->Unit(benchmark::kMillisecond)
            ->MinTime(0.5);
      }
    }
  }
  for (const std::uint32_t context : {8192u, 32768u}) {
    for (const unsigned threads : {1u, 2u}) {
      const std::string suffix = "/context:" + std::to_string(context) + "/threads:" + std::to_string(threads);
      const SelectCase select{0, context};
      benchmark::RegisterBenchmark(("Select/quest" + suffix).c_str(), BM_Select<QuestPolicy>, select, threads)
          ->UseManualTime()
          ->Unit(benchmark::kMicrosecond)
          ->MinTime(0.2);
      benchmark::RegisterBenchmark(("Select/shadowkv" + suffix).c_str(), BM_Select<ShadowKVPolicy>, select, threads)
          ->UseManualTime()
          ->Unit(benchmark::kMicrosecond)
          ->MinTime(0.2);
    }
  }
  for (const std::uint32_t context : {4096u, 4142u}) {
    for (const unsigned threads : {1u, 2u}) {
      const SelectCase select{1, context, 8, 512, DType::f16};
      benchmark::RegisterBenchmark(
          ("Select/shadowkv/smollm/context:" + std::to_string(context) + "/page:8/threads:" + std::to_string(threads))
              .c_str(),
          BM_Select<ShadowKVPolicy>, select, threads)
          ->UseManualTime()
          ->Unit(benchmark::kMicrosecond)
          ->MinTime(0.2);
    }
  }
  // RetroInfer is left out: its fork re-indexes (k-means of the whole prefix) as its prefill does, about 8 s each.
  for (const char* policy : {"quest", "shadowkv", "h2o"}) {
    benchmark::RegisterBenchmark((std::string("SharedPrefix/") + policy).c_str(), BM_SharedPrefix, std::string(policy))
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond)
        ->Iterations(2);
  }
}

}  // namespace

int main(int argc, char** argv) {
  register_all();
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::AddCustomContext("ggml", SPARSEKV_BENCH_GGML
                                          ? "llama-cpp-python 0.3.36 (vendor/llama.cpp/ggml), CPU backend"
                                          : "absent (no llama.cpp source at build time)");
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
