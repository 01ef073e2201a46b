// Select kernels (policy/select_cuda.hpp, docs/policies/select-gpu.md) on
// the decode step's shape, "many short rows, small k": rows = batch x 8 kv heads in
// {8, 64, 256}, candidates per row in {2048, 4096, 8192, 16384}, head_dim
// 128, GQA group 4, a 2048-token budget (Quest: 16-token partitions, k ~ 128;
// ShadowKV: 8-token pages, k ~ 256; RetroInfer: clusters of 1..40 tokens and
// 12 recent pages). Rows: quest_select, shadowkv_select, retroinfer_select,
// and retroinfer_select + retroinfer_estimate (both launches, one timing).
//
// Inputs are random as tests/support/select_test_data.hpp draws them (normal
// summaries, Quest max = min + |normal|, partial partitions planted, ids
// ascending with gaps, RetroInfer sinks on 3 rows in 4), drawn here with a
// fast generator on all cores: the largest Quest row holds 4.3 GB of
// summaries, too many for std::normal_distribution per configuration. Ties
// are not planted (the GPU tests cover them).
//
// Each launch is timed alone with cudaEvents behind a 64 MiB pad copy (so
// that the launch latency is not timed), manual time. Counters:
//   us            kernel time per call (mean over the iterations)
//   GBps          bytes the kernels must read / time: every summary, token
//                 count and partition id once, q once, first / count and
//                 the per-row scalars (RetroInfer's estimate: the value sums too)
//   d2d_GBps      a 256 MiB device-to-device cudaMemcpyAsync, measured once
//                 per process (read + write bytes / time, as bench_lru_cuda)
//   over_hbm      GBps / d2d_GBps
//   peer_sort_us  cub::DeviceSegmentedRadixSort::SortPairsDescending of the
//                 same rows' scores (one precomputed float + uint32 index per
//                 candidate): the "sort everything" a naive top-k does,
//                 timed the same way in the same run
//   over_peer_sort  peer_sort_us / us (> 1: faster than sorting everything)
//   k             mean selected partitions per row
// Every buffer (CUB's temporary storage included) is allocated before the
// timed loop. Each configuration is checked once, untimed, against the host
// policy (QuestPolicy / ShadowKVPolicy / RetroInferPolicy::select, and
// ::attend for the estimate) on the first and last request's rows: the same
// ids, and the same bits of every estimation term; a mismatch exits 1.
//
// The peer sort is in select_peer_sort.cu (nvcc does not compile the host
// policies' fmt format strings).
// Without a CUDA device it prints "SKIPPED: no CUDA device" and exits 0.
#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <numeric>
#include <thread>
#include <vector>

#include "cuda_bench_support.hpp"
#include "sparsekv/policy/quest.hpp"
#include "sparsekv/policy/retroinfer.hpp"
#include "sparsekv/policy/select_cuda.hpp"
#include "sparsekv/policy/shadowkv.hpp"

namespace sparsekv::bench {
// select_peer_sort.cu: cub::DeviceSegmentedRadixSort::SortPairsDescending
// over segments [offsets[i], offsets[i + 1]); temp == nullptr sizes temp_bytes.
cudaError_t segmented_sort_descending(void* temp, std::size_t& temp_bytes, const float* keys_in, float* keys_out,
                                      const std::uint32_t* values_in, std::uint32_t* values_out, std::int64_t items,
                                      std::int64_t segments, const std::uint32_t* offsets, cudaStream_t stream);
}  // namespace sparsekv::bench

namespace {

using namespace sparsekv;
using namespace sparsekv::bench;

constexpr std::uint32_t kKvHeads = 8;
constexpr std::uint32_t kGroup = 4;
constexpr std::uint32_t kHeadDim = 128;
constexpr std::uint32_t kBudget = 2048;
constexpr std::uint32_t kPageTokens = 8;       // ShadowKV's page, RetroInfer's recent pages
constexpr std::uint32_t kQuestPartition = 16;  // Quest's partition
constexpr std::uint32_t kRetroRecent = 12;     // recent partitions per RetroInfer row
constexpr std::uint32_t kRetroWindow = 64;
constexpr int kPeerReps = 20;

enum class Kind { quest, shadowkv, retroinfer, retroinfer_estimate };

// Device memory freed with its owner (configurations come and go: the
// largest holds several GB).
template <class T>
struct Buffer {
  T* data = nullptr;
  std::size_t size = 0;
  Buffer() = default;
  explicit Buffer(std::size_t n) : data(device_alloc<T>(n)), size(n) {}
  explicit Buffer(const std::vector<T>& host) : data(device_copy(host.data(), host.size())), size(host.size()) {}
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  Buffer& operator=(Buffer&& o) noexcept {
    std::swap(data, o.data);
    std::swap(size, o.size);
    return *this;
  }
  ~Buffer() {
    if (data != nullptr) cudaFree(data);
  }
};

// splitmix64: fast, seeded per row so that rows are drawn in parallel.
struct Rng {
  std::uint64_t s;
  std::uint64_t next() {
    std::uint64_t z = (s += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }
  std::uint32_t below(std::uint32_t n) { return static_cast<std::uint32_t>(next() % n); }
  float uniform() { return float(next() >> 40) * 0x1p-24f; }  // [0, 1)
  // About normal(0, scale): the sum of four 16-bit uniforms, unit variance.
  float normal(float scale) {
    const std::uint64_t z = next();
    const float sum = float((z & 0xffff) + ((z >> 16) & 0xffff) + ((z >> 32) & 0xffff) + (z >> 48)) * 0x1p-16f;
    return (sum - 2.0f) * 1.7320508f * scale;
  }
};

Rng row_rng(Kind kind, std::uint32_t rows, std::uint32_t n, std::uint32_t r) {
  return Rng{(std::uint64_t(kind) << 56) ^ (std::uint64_t(rows) << 40) ^ (std::uint64_t(n) << 20) ^ r};
}

template <class Fn>
void parallel_rows(std::uint32_t rows, Fn fn) {
  const std::uint32_t threads = std::max(1u, std::min(rows, std::thread::hardware_concurrency()));
  std::vector<std::thread> pool;
  for (std::uint32_t t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      for (std::uint32_t r = t; r < rows; r += threads) fn(r);
    });
  }
  for (auto& th : pool) th.join();
}

// One configuration: host inputs as the kernels address them (each row n
// candidates), their device copies, outputs, workspaces and the peer sort.
struct Setup {
  Kind kind{};
  std::uint32_t rows = 0, n = 0, requests = 0, capacity = 0;
  std::size_t candidates = 0;
  // Host: per candidate tokens, ids, summaries (a: Quest min, ShadowKV
  // landmark, RetroInfer centroid; b: Quest max, ShadowKV outlier score,
  // RetroInfer value sum); per row RetroInfer's sink and recent count.
  // h_first / h_count address the rows (row r's region is r * n: the arena
  // of DeviceSummaries with request b in slot b and capacity n); h_offsets,
  // the same rows as a CSR, is the peer sort's.
  std::vector<std::uint32_t> h_first, h_count, h_offsets, h_tokens, h_sink_tokens, h_recent;
  std::vector<PartitionId> h_ids, h_sinks;
  std::vector<float> h_q, h_a, h_b;

  Buffer<std::uint32_t> first, row_count, offsets, tokens, sink_tokens, recent, count;
  Buffer<PartitionId> ids, sinks, selected;
  Buffer<float> q, a, b;
  Buffer<std::byte> workspace, estimate_workspace;
  Buffer<float> term_max, term_sum, term_acc;
  cuda::SelectRows select_rows;
  cuda::QuestSelect quest;
  cuda::ShadowKVSelect shadowkv;
  cuda::RetroInferSelect retro;
  cuda::RetroInferEstimate estimate;
  RetroInferPolicy::Options retro_options;
  ShadowKVPolicy::Options shadowkv_options;

  // The peer: scores and indices in, sorted out, CUB's temporary storage.
  Buffer<float> peer_keys, peer_keys_out;
  Buffer<std::uint32_t> peer_values, peer_values_out;
  Buffer<std::byte> peer_temp;
  std::size_t peer_temp_bytes = 0;

  double bytes = 0, peer_ms = 0, mean_k = 0;

  void launch() const {
    const cuda::SelectOutput out{capacity, selected.data, count.data};
    switch (kind) {
      case Kind::quest:
        cuda::quest_select(select_rows, quest, out, workspace.data, workspace.size, nullptr);
        break;
      case Kind::shadowkv:
        cuda::shadowkv_select(select_rows, shadowkv, out, workspace.data, workspace.size, nullptr);
        break;
      case Kind::retroinfer:
        cuda::retroinfer_select(select_rows, retro, out, workspace.data, workspace.size, nullptr);
        break;
      case Kind::retroinfer_estimate:
        cuda::retroinfer_select(select_rows, retro, out, workspace.data, workspace.size, nullptr);
        cuda::retroinfer_estimate(select_rows, retro, estimate,
                                  cuda::EstimateOutput{term_max.data, term_sum.data, term_acc.data},
                                  estimate_workspace.data, estimate_workspace.size, nullptr);
        break;
    }
  }
  void peer_sort() const {
    std::size_t temp_bytes = peer_temp_bytes;
    check(segmented_sort_descending(peer_temp.data, temp_bytes, peer_keys.data, peer_keys_out.data, peer_values.data,
                                    peer_values_out.data, static_cast<std::int64_t>(candidates),
                                    static_cast<std::int64_t>(rows), offsets.data, nullptr),
          "SortPairsDescending");
  }
};

void fill_inputs(Setup& s) {
  const std::uint32_t n = s.n;
  const std::size_t summary = s.candidates * kHeadDim;
  s.h_offsets.resize(s.rows + 1);
  for (std::uint32_t r = 0; r <= s.rows; ++r) s.h_offsets[r] = r * n;
  s.h_first.assign(s.h_offsets.begin(), s.h_offsets.end() - 1);
  s.h_count.assign(s.rows, n);
  s.h_tokens.resize(s.candidates);
  s.h_ids.resize(s.candidates);
  s.h_a.resize(summary);
  s.h_b.resize(s.kind == Kind::shadowkv ? s.candidates : s.kind == Kind::retroinfer ? 0 : summary);
  s.h_q.resize(std::size_t{s.rows} * kGroup * kHeadDim);
  {
    Rng rng = row_rng(s.kind, s.rows, n, ~0u);
    for (float& x : s.h_q) x = rng.normal(1.0f);
  }
  if (s.kind == Kind::retroinfer || s.kind == Kind::retroinfer_estimate) {
    s.h_sinks.assign(s.rows, 0);
    s.h_sink_tokens.resize(s.rows);
    s.h_recent.assign(s.rows, kRetroRecent);
  }
  // Quest and ShadowKV keep one token count per partition for every kv head
  // of a request: drawn per request, copied to its rows.
  std::vector<std::uint32_t> request_tokens(std::size_t{s.requests} * n);
  for (std::uint32_t req = 0; req < s.requests; ++req) {
    Rng rng = row_rng(s.kind, s.rows, n, 0x80000000u + req);
    std::uint32_t* t = request_tokens.data() + std::size_t{req} * n;
    if (s.kind == Kind::quest) {
      for (std::uint32_t i = 0; i < n; ++i) t[i] = rng.below(4) == 0 ? 1 + rng.below(kQuestPartition) : kQuestPartition;
    } else {
      std::fill_n(t, n, kPageTokens);
      if (rng.below(2) == 0) t[rng.below(n)] = 1 + rng.below(kPageTokens);  // a partial page
    }
  }
  parallel_rows(s.rows, [&](std::uint32_t r) {
    Rng rng = row_rng(s.kind, s.rows, n, r);
    const std::size_t first = std::size_t{r} * n;
    std::uint32_t* tokens = s.h_tokens.data() + first;
    PartitionId* ids = s.h_ids.data() + first;
    float* a = s.h_a.data() + first * kHeadDim;
    switch (s.kind) {
      case Kind::quest: {
        std::copy_n(request_tokens.data() + std::size_t{r / kKvHeads} * n, n, tokens);
        float* b = s.h_b.data() + first * kHeadDim;
        for (std::size_t i = 0; i < std::size_t{n} * kHeadDim; ++i) {
          a[i] = rng.normal(1.0f);
          b[i] = a[i] + std::abs(rng.normal(1.0f));
        }
        break;
      }
      case Kind::shadowkv: {
        std::copy_n(request_tokens.data() + std::size_t{r / kKvHeads} * n, n, tokens);
        for (std::size_t i = 0; i < std::size_t{n} * kHeadDim; ++i) a[i] = rng.normal(0.5f);
        float* b = s.h_b.data() + first;
        for (std::uint32_t i = 0; i < n; ++i) b[i] = rng.uniform() * 2.0f - 1.0f;
        break;
      }
      case Kind::retroinfer:
      case Kind::retroinfer_estimate: {
        // Sink (id 0) on 3 rows in 4, clusters of 1..40 tokens, then one-page recent partitions.
        const bool sink = rng.below(4) != 0;
        s.h_sink_tokens[r] = sink ? 4 : 0;
        const std::uint32_t clusters = n - kRetroRecent;
        for (std::uint32_t i = 0; i < n; ++i) {
          ids[i] = (sink ? 1 : 0) + i;
          tokens[i] = i < clusters ? 1 + rng.below(40) : 1 + rng.below(kPageTokens);
        }
        for (std::size_t i = 0; i < std::size_t{n} * kHeadDim; ++i) a[i] = rng.normal(0.5f);
        if (s.kind == Kind::retroinfer_estimate) {
          float* b = s.h_b.data() + first * kHeadDim;
          for (std::size_t i = 0; i < std::size_t{n} * kHeadDim; ++i) b[i] = rng.normal(8.0f);
        }
        return;
      }
    }
    // Quest and ShadowKV: ascending ids with random gaps.
    PartitionId next = rng.below(3);
    for (std::uint32_t i = 0; i < n; ++i) {
      ids[i] = next;
      next += 1 + (rng.below(5) == 0 ? 1 : 0);
    }
  });
}

LayerContext context(const Setup& s) {
  LayerContext ctx;
  ctx.layer = 2;  // past Quest's two dense layers
  ctx.layers = 32;
  ctx.q_heads = kKvHeads * kGroup;
  ctx.kv_heads = kKvHeads;
  ctx.head_dim = kHeadDim;
  ctx.page_tokens = kPageTokens;
  (void)s;
  return ctx;
}

template <class T>
std::vector<T> slice(const std::vector<T>& v, std::size_t first, std::size_t count) {
  return std::vector<T>(v.begin() + first, v.begin() + first + count);
}

[[noreturn]] void fail_check(const Setup& s, const char* what, std::uint32_t row) {
  static const char* names[] = {"quest_select", "shadowkv_select", "retroinfer_select", "retroinfer_estimate"};
  std::fprintf(stderr, "%s disagrees with the host policy (%s) at row %u (%u rows x %u candidates)\n",
               names[int(s.kind)], what, row, s.rows, s.n);
  std::exit(1);
}

// One untimed launch; request `req`'s rows (and q heads' terms) against the host policy.
void verify(Setup& s) {
  s.launch();
  check(cudaDeviceSynchronize(), "select");
  const auto counts = host_copy(s.count.data, s.rows);
  const auto selected = host_copy(s.selected.data, std::size_t{s.rows} * s.capacity);
  std::vector<float> term_max, term_sum, term_acc;
  if (s.kind == Kind::retroinfer_estimate) {
    term_max = host_copy(s.term_max.data, s.term_max.size);
    term_sum = host_copy(s.term_sum.data, s.term_sum.size);
    term_acc = host_copy(s.term_acc.data, s.term_acc.size);
  }
  double total = 0;
  for (std::uint32_t r = 0; r < s.rows; ++r) {
    if (counts[r] > s.capacity) fail_check(s, "count above capacity", r);
    total += counts[r];
  }
  s.mean_k = total / s.rows;
  const LayerContext ctx = context(s);
  const std::size_t n = s.n, d = kHeadDim;
  for (const std::uint32_t req : {0u, s.requests - 1}) {
    const std::vector<float> q = slice(s.h_q, std::size_t{req} * ctx.q_heads * d, std::size_t{ctx.q_heads} * d);
    const DecodeQuery query{q, 0};
    Selection want;
    std::vector<AttentionPartial> terms;
    const std::uint32_t row0 = req * kKvHeads;
    switch (s.kind) {
      case Kind::quest: {
        QuestPolicy::LayerState st;
        st.head_dim = kHeadDim;
        st.tokens = slice(s.h_tokens, row0 * n, n);
        for (std::uint32_t h = 0; h < kKvHeads; ++h) {
          st.ids.push_back(slice(s.h_ids, (row0 + h) * n, n));
          st.min.emplace_back(DType::f32, d, slice(s.h_a, (row0 + h) * n * d, n * d), BoxSide::lower);
          st.max.emplace_back(DType::f32, d, slice(s.h_b, (row0 + h) * n * d, n * d), BoxSide::upper);
        }
        QuestPolicy::Options o;
        o.budget_tokens = kBudget;
        o.page_tokens_per_partition = kQuestPartition;
        QuestPolicy(o).select(ctx, query, st, want);
        break;
      }
      case Kind::shadowkv: {
        ShadowKVPolicy::LayerState st;
        st.head_dim = kHeadDim;
        st.tokens = slice(s.h_tokens, row0 * n, n);
        for (std::uint32_t h = 0; h < kKvHeads; ++h) {
          st.ids.push_back(slice(s.h_ids, (row0 + h) * n, n));
          st.landmarks.push_back(slice(s.h_a, (row0 + h) * n * d, n * d));
          st.outlier_score.push_back(slice(s.h_b, (row0 + h) * n, n));
        }
        ShadowKVPolicy(s.shadowkv_options).select(ctx, query, st, want);
        break;
      }
      case Kind::retroinfer:
      case Kind::retroinfer_estimate: {
        RetroInferPolicy::LayerState st;
        st.head_dim = kHeadDim;
        st.window = kRetroWindow;
        const std::uint32_t clusters = s.n - kRetroRecent;
        for (std::uint32_t h = 0; h < kKvHeads; ++h) {
          const std::uint32_t r = row0 + h;
          const std::size_t first = std::size_t{r} * n;
          RetroInferPolicy::HeadState head;
          if (s.h_sink_tokens[r] > 0) head.sink = {0, s.h_sink_tokens[r]};
          for (std::uint32_t i = 0; i < s.n; ++i) {
            auto& to = i < clusters ? head.clusters : head.recent;
            to.push_back({s.h_ids[first + i], s.h_tokens[first + i]});
          }
          head.centroids = slice(s.h_a, first * d, clusters * d);
          head.recent_centroids = slice(s.h_a, (first + clusters) * d, kRetroRecent * d);
          if (s.kind == Kind::retroinfer_estimate) {
            head.value_sums = slice(s.h_b, first * d, clusters * d);
            head.recent_value_sums = slice(s.h_b, (first + clusters) * d, kRetroRecent * d);
          } else {
            head.value_sums.assign(clusters * d, 0.0f);
            head.recent_value_sums.assign(kRetroRecent * d, 0.0f);
          }
          head.partitions = (s.h_sink_tokens[r] > 0 ? 1 : 0) + s.n;
          head.tokens = head.sink.tokens;
          for (const auto& g : head.clusters) head.tokens += g.tokens;
          for (const auto& g : head.recent) head.tokens += g.tokens;
          st.heads.push_back(std::move(head));
        }
        const RetroInferPolicy policy(s.retro_options);
        policy.select(ctx, query, st, want);
        if (s.kind == Kind::retroinfer_estimate) {
          terms.assign(ctx.q_heads, AttentionPartial(kHeadDim));
          policy.attend(ctx, query, st, want, terms);
        }
        break;
      }
    }
    for (std::uint32_t h = 0; h < kKvHeads; ++h) {
      const std::uint32_t r = row0 + h;
      const PartitionId* got = selected.data() + std::size_t{r} * s.capacity;
      if (want.partitions[h] != std::vector<PartitionId>(got, got + counts[r])) fail_check(s, "selected ids", r);
    }
    for (std::uint32_t j = 0; j < terms.size(); ++j) {
      const std::size_t at = std::size_t{req} * ctx.q_heads + j;
      const AttentionPartial& t = terms[j];
      if (std::memcmp(&t.max, &term_max[at], sizeof(float)) != 0 ||
          std::memcmp(&t.sum, &term_sum[at], sizeof(float)) != 0 ||
          std::memcmp(t.acc.data(), term_acc.data() + at * d, d * sizeof(float)) != 0) {
        fail_check(s, "estimation term", row0 + j / kGroup);
      }
    }
  }
}

std::unique_ptr<Setup> make_setup(Kind kind, std::uint32_t rows, std::uint32_t n) {
  auto s = std::make_unique<Setup>();
  s->kind = kind;
  s->rows = rows;
  s->n = n;
  s->requests = rows / kKvHeads;
  s->candidates = std::size_t{rows} * n;
  fill_inputs(*s);

  s->first = Buffer<std::uint32_t>(s->h_first);
  s->row_count = Buffer<std::uint32_t>(s->h_count);
  s->offsets = Buffer<std::uint32_t>(s->h_offsets);
  s->tokens = Buffer<std::uint32_t>(s->h_tokens);
  s->ids = Buffer<PartitionId>(s->h_ids);
  s->q = Buffer<float>(s->h_q);
  s->a = Buffer<float>(s->h_a);
  if (!s->h_b.empty()) s->b = Buffer<float>(s->h_b);
  cuda::SelectRows& sr = s->select_rows;
  sr.rows = rows;
  sr.kv_heads = kKvHeads;
  sr.group = kGroup;
  sr.head_dim = kHeadDim;
  sr.candidates = static_cast<std::uint32_t>(s->candidates);
  sr.max_row_candidates = n;
  sr.first = s->first.data;
  sr.count = s->row_count.data;
  sr.tokens = s->tokens.data;
  sr.partitions = s->ids.data;
  sr.q = s->q.data;
  s->workspace = Buffer<std::byte>(cuda::select_workspace_bytes(sr));

  const double cand = double(s->candidates);
  double summaries = 0;
  switch (kind) {
    case Kind::quest: {
      QuestPolicy::Options o;
      o.budget_tokens = kBudget;
      s->quest = {s->a.data, s->b.data, kBudget, false, o.sink_tokens, QuestPolicy(o).window_tokens(), o.spread};
      s->capacity = cuda::quest_select_capacity(sr, s->quest);
      summaries = 2 * cand * kHeadDim * 4;
      break;
    }
    case Kind::shadowkv: {
      s->shadowkv_options.budget_tokens = kBudget;
      const ShadowKVPolicy policy(s->shadowkv_options);
      s->shadowkv = {s->a.data, s->b.data, kBudget, s->shadowkv_options.recent_tokens, policy.outlier_count()};
      s->capacity = cuda::shadowkv_select_capacity(sr, s->shadowkv);
      summaries = cand * kHeadDim * 4 + cand * 4;
      break;
    }
    case Kind::retroinfer:
    case Kind::retroinfer_estimate: {
      s->retro_options.budget_tokens = kBudget;
      s->retro_options.window_tokens = kRetroWindow;
      if (kind == Kind::retroinfer) s->retro_options.estimation_fraction = 0.0f;
      s->sinks = Buffer<PartitionId>(s->h_sinks);
      s->sink_tokens = Buffer<std::uint32_t>(s->h_sink_tokens);
      s->recent = Buffer<std::uint32_t>(s->h_recent);
      s->retro = {s->a.data,
                  s->sinks.data,
                  s->sink_tokens.data,
                  s->recent.data,
                  kBudget,
                  kRetroWindow,
                  s->retro_options.retrieval_fraction};
      s->capacity = cuda::retroinfer_select_capacity(sr, s->retro);
      summaries = cand * kHeadDim * 4 + double(rows) * 12;
      if (kind == Kind::retroinfer_estimate) {
        s->estimate_workspace = Buffer<std::byte>(cuda::select_workspace_bytes(sr));
        const std::size_t terms = std::size_t{rows} * kGroup;
        s->term_max = Buffer<float>(terms);
        s->term_sum = Buffer<float>(terms);
        s->term_acc = Buffer<float>(terms * kHeadDim);
        s->estimate = {s->b.data, nullptr, nullptr, 0, s->retro_options.estimation_fraction, true};
        summaries += cand * kHeadDim * 4;
      }
      break;
    }
  }
  s->selected = Buffer<PartitionId>(std::size_t{rows} * s->capacity);
  s->count = Buffer<std::uint32_t>(rows);
  s->estimate.selected = s->selected.data;
  s->estimate.selected_count = s->count.data;
  s->estimate.max_selected = s->capacity;
  s->bytes = summaries + cand * 4 /* tokens */ + cand * 4 /* ids */ + double(s->h_q.size()) * 4 +
             double(rows) * 8 /* first, count */;

  verify(*s);

  // The peer: random scores, candidate indices, CUB's temporary storage; the mean of kPeerReps padded runs.
  {
    std::vector<float> scores(s->candidates);
    std::vector<std::uint32_t> index(s->candidates);
    parallel_rows(rows, [&](std::uint32_t r) {
      Rng rng = row_rng(kind, rows, n, 0x40000000u + r);
      for (std::uint32_t i = 0; i < n; ++i) {
        scores[std::size_t{r} * n + i] = rng.normal(1.0f);
        index[std::size_t{r} * n + i] = i;
      }
    });
    s->peer_keys = Buffer<float>(scores);
    s->peer_values = Buffer<std::uint32_t>(index);
    s->peer_keys_out = Buffer<float>(s->candidates);
    s->peer_values_out = Buffer<std::uint32_t>(s->candidates);
    check(segmented_sort_descending(nullptr, s->peer_temp_bytes, s->peer_keys.data, s->peer_keys_out.data,
                                    s->peer_values.data, s->peer_values_out.data,
                                    static_cast<std::int64_t>(s->candidates), static_cast<std::int64_t>(rows),
                                    s->offsets.data, nullptr),
          "SortPairsDescending (size)");
    s->peer_temp = Buffer<std::byte>(s->peer_temp_bytes);
    DeviceCopyTiming& t = device_copy_timing();
    s->peer_sort();  // warm-up
    double total = 0;
    for (int r = 0; r < kPeerReps; ++r) {
      t.pad();
      total += elapsed_ms(t.events, nullptr, [&] { s->peer_sort(); });
    }
    s->peer_ms = total / kPeerReps;
  }
  // The host inputs are no longer needed.
  s->h_tokens = {};
  s->h_ids = {};
  s->h_a = {};
  s->h_b = {};
  check(cudaDeviceSynchronize(), "setup");
  return s;
}

// One configuration alive at a time (the largest holds several GB).
Setup& setup(Kind kind, std::uint32_t rows, std::uint32_t n) {
  static std::unique_ptr<Setup> current;
  if (!current || current->kind != kind || current->rows != rows || current->n != n) {
    current.reset();
    current = make_setup(kind, rows, n);
  }
  return *current;
}

void run(benchmark::State& state, Kind kind) {
  DeviceCopyTiming& t = device_copy_timing();
  const Setup& s = setup(kind, static_cast<std::uint32_t>(state.range(0)), static_cast<std::uint32_t>(state.range(1)));
  double total_ms = 0;
  for (auto _ : state) {
    t.pad();
    const float ms = elapsed_ms(t.events, nullptr, [&] { s.launch(); });
    state.SetIterationTime(ms * 1e-3);
    total_ms += ms;
  }
  const double ms = total_ms / double(state.iterations());
  const double gbps = s.bytes / (ms * 1e-3) / 1e9;
  state.counters["us"] = ms * 1e3;
  state.counters["MB_read"] = s.bytes / 1e6;
  state.counters["GBps"] = gbps;
  state.counters["d2d_GBps"] = t.d2d_gbps;
  state.counters["over_hbm"] = gbps / t.d2d_gbps;
  state.counters["peer_sort_us"] = s.peer_ms * 1e3;
  state.counters["over_peer_sort"] = s.peer_ms / ms;
  state.counters["k"] = s.mean_k;
}

void BM_QuestSelect(benchmark::State& state) { run(state, Kind::quest); }
void BM_ShadowKVSelect(benchmark::State& state) { run(state, Kind::shadowkv); }
void BM_RetroInferSelect(benchmark::State& state) { run(state, Kind::retroinfer); }
void BM_RetroInferSelectEstimate(benchmark::State& state) { run(state, Kind::retroinfer_estimate); }

void shapes(benchmark::internal::Benchmark* b) {
  for (const std::int64_t rows : {8, 64, 256}) {
    for (const std::int64_t n : {2048, 4096, 8192, 16384}) b->Args({rows, n});
  }
  b->ArgNames({"rows", "candidates"})->UseManualTime()->Unit(benchmark::kMicrosecond);
}

BENCHMARK(BM_QuestSelect)->Apply(shapes);
BENCHMARK(BM_ShadowKVSelect)->Apply(shapes);
BENCHMARK(BM_RetroInferSelect)->Apply(shapes);
BENCHMARK(BM_RetroInferSelectEstimate)->Apply(shapes);

}  // namespace

int main(int argc, char** argv) { return sparsekv::bench::run_benchmarks(argc, argv); }
