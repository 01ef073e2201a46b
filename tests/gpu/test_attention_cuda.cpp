// Split-K sparse paged decode attention kernel against the host backend
// (decode_attention) on random batches: variable page counts per (request,
// kv head) including 0 and 1 page, partial last pages, GQA groups 1 / 3 / 4 /
// 8 / 12, head_dim 64 / 128, fp32 / fp16 / bf16 pages, page strides wider
// than a page, forced and automatic chunk sizes, with and without the extra
// term; and the runs form (row_entries: AttendPlan's several runs per row,
// partial pages mid-row, empty rows and entries, tail-only rows) in one
// launch, eagerly and replayed from a CUDA graph while the plan changes;
// live-slot masks (SpvLLM §2) in both forms, with and without slot weights
// (each slot's softmax probability summed over its GQA group, H2O's scores).
// Both backends read the same page bytes; they differ only in fp32
// summation order.
//
// Relative error of an output head (request, q head): max_d |kernel - host|
// / max_d |host| (the head's L-inf norm, so near-zero elements do not blow
// it up); a head that attended to nothing must be exactly 0 in both. lse:
// |kernel - host| / max(1, |host|), and -inf exactly where the host has -inf.
// Bound: 2e-3 (the bf16 bound, applied to every dtype). Slot
// weights: |kernel - host| <= 1e-4 per slot (scores differ only in fp32
// summation order), exactly 0 for dead and unused slots.
#include <catch2/catch.hpp>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <numeric>
#include <random>
#include <span>
#include <vector>

#include "attention_test_data.hpp"
#include "gpu_support.hpp"
#include "sparsekv/attention/decode_attention.hpp"
#include "sparsekv/attention/sparse_decode_attention_cuda.hpp"
#include "sparsekv/core/numeric.hpp"

using namespace sparsekv;
using namespace sparsekv::gpu_test;
using namespace sparsekv::test;

namespace {

constexpr float kTolerance = 2e-3f;

template <class T>
std::vector<T> download(const DeviceBytes& buffer, std::size_t count) {
  std::vector<T> values(count);
  check(cudaMemcpy(values.data(), buffer.data, count * sizeof(T), cudaMemcpyDeviceToHost));
  return values;
}

struct CaseSpec {
  std::uint32_t batch, kv_heads, group;
  PageLayout layout;
  std::uint32_t max_row_pages;  // row page counts drawn from 0..max_row_pages (runs form: pages per run)
  bool extra;
  std::uint32_t chunk_pages;  // 0 = automatic
  std::size_t stride_pad;     // bytes added to page_bytes for the pool stride (multiple of 16)
  float scale_factor;         // scale = factor / sqrt(head_dim); 4 makes peaky softmaxes
  std::uint32_t understate;   // pages subtracted from the true max_pages passed to the kernel
  // 0: one entry per row. Else the runs form: up to `runs` runs of
  // 1..max_row_pages pages per row (random_run_shapes).
  std::uint32_t runs;
  std::uint32_t pool_pages;  // at least this many pool pages (a graph's fixed capacity); 0: just enough
  bool masks = false;        // random live masks on every page (random_masks)
  bool weights = false;      // slot weights asked for (shape.max_indices = the batch's pages)
};

// A random batch in a host pool laid out exactly like the device pool.
AttentionBatch make_batch(std::mt19937& rng, const CaseSpec& spec) {
  std::normal_distribution<float> normal;
  const PageLayout& layout = spec.layout;
  AttentionBatch b;
  b.batch = spec.batch;
  b.kv_heads = spec.kv_heads;
  b.q_heads = spec.kv_heads * spec.group;
  b.layout = layout;
  b.stride = layout.page_bytes() + spec.stride_pad;
  b.scale = spec.scale_factor / std::sqrt(float(layout.head_dim));
  const std::uint32_t rows = spec.batch * spec.kv_heads;
  std::vector<std::uint32_t> counts(rows);
  std::vector<std::vector<std::uint32_t>> shapes;
  std::uint32_t total = 0;
  if (spec.runs == 0) {
    for (std::uint32_t r = 0; r < rows; ++r)
      counts[r] = r % 5 == 1 ? 0 : r % 5 == 3 ? 1 : std::uint32_t(rng() % (spec.max_row_pages + 1));
    if (rows > 0) counts[rows - 1] = spec.max_row_pages;  // one row at the maximum
    total = std::accumulate(counts.begin(), counts.end(), 0u);
  } else {
    shapes = random_run_shapes(rng, rows, spec.runs, spec.max_row_pages);
    total = total_pages(shapes);
  }
  const std::uint32_t pool_pages = std::max(total + 3, spec.pool_pages);
  b.pool.assign(pool_pages * b.stride, std::byte{0xff});  // padding and unused rows hold NaN patterns
  fill_pages(b, pool_pages, normal, rng);
  // Slots past a partial last page are never read: NaN.
  if (spec.runs == 0) {
    random_rows(b, counts, pool_pages, rng, true);
  } else {
    random_runs(b, shapes, pool_pages, rng, true);
  }
  random_queries(b, normal, rng);
  if (spec.extra) random_extra(b, normal, rng, 4, 2, 16);  // no term for heads 2, 6, 10, ...
  if (spec.masks) random_masks(b, rng);
  return b;
}

struct Errors {
  float out = 0, lse = 0, weights = 0;
};

// The kernel's outputs against the host's, head by head (REQUIREs the bound).
Errors compare(const std::vector<float>& got_out, const std::vector<float>& got_lse, const std::vector<float>& want_out,
               const std::vector<float>& want_lse, std::uint32_t d) {
  Errors worst;
  for (std::size_t h = 0; h < want_lse.size(); ++h) {
    float num = 0, den = 0;
    bool finite = true;
    for (std::uint32_t i = 0; i < d; ++i) {
      finite = finite && std::isfinite(got_out[h * d + i]);
      num = std::max(num, std::abs(got_out[h * d + i] - want_out[h * d + i]));
      den = std::max(den, std::abs(want_out[h * d + i]));
    }
    const float out_error = !finite ? INFINITY : den == 0 ? num : num / den;
    float lse_error = 0;
    if (std::isinf(want_lse[h]) || !std::isfinite(got_lse[h]))
      lse_error = got_lse[h] == want_lse[h] ? 0.0f : INFINITY;
    else
      lse_error = std::abs(got_lse[h] - want_lse[h]) / std::max(1.0f, std::abs(want_lse[h]));
    CAPTURE(h, want_lse[h], got_lse[h], out_error, lse_error);
    REQUIRE(out_error <= kTolerance);
    REQUIRE(lse_error <= kTolerance);
    worst.out = std::max(worst.out, out_error);
    worst.lse = std::max(worst.lse, lse_error);
  }
  return worst;
}

// A batch's arrays on the device, each at least `capacity` of its kind so
// that a captured launch keeps its pointers while later batches are loaded.
struct DeviceBatch {
  DeviceArray<std::byte> pool;
  DeviceArray<float> q, extra_max, extra_sum, extra_acc, out, lse;
  DeviceArray<std::int64_t> indptr, indices, row_entries;
  DeviceArray<std::int32_t> last;
  DeviceArray<SlotMask> live;
  DeviceArray<float> weights;
  DeviceArray<std::byte> workspace;

  // Uploads b (fills out and lse with NaN: an output the kernel does not write fails the comparison).
  void load(const AttentionBatch& b, std::size_t workspace_bytes) {
    pool.upload(b.pool);
    q.upload(b.q);
    indptr.upload(b.indptr);
    indices.upload(b.indices);
    last.upload(b.last_page_len);
    row_entries.upload(b.row_entries);
    live.upload(b.live_masks);
    std::vector<float> max, sum, acc;
    for (const AttentionPartial& e : b.extra) {
      max.push_back(e.max);
      sum.push_back(e.sum);
      acc.insert(acc.end(), e.acc.begin(), e.acc.end());
    }
    extra_max.upload(max);
    extra_sum.upload(sum);
    extra_acc.upload(acc);
    const std::size_t heads = std::size_t{b.batch} * b.q_heads;
    out.reserve(heads * b.layout.head_dim);
    lse.reserve(heads);
    workspace.reserve(workspace_bytes);
    check(cudaMemset(out.data, 0xff, out.size * sizeof(float)));
    check(cudaMemset(lse.data, 0xff, lse.size * sizeof(float)));
    check(cudaMemset(workspace.data, 0xff, workspace_bytes));
    weights.reserve(std::max<std::size_t>(b.indices.size() * b.layout.page_tokens, 1));
    check(cudaMemset(weights.data, 0xff, weights.size * sizeof(float)));
    // The fills ran on the legacy default stream, which a cudaStreamNonBlocking
    // stream does not wait for: finish them before launching.
    check(cudaDeviceSynchronize());
  }

  cuda::DecodeAttentionArgs args(const AttentionBatch& b, std::size_t workspace_bytes) const {
    cuda::DecodeAttentionArgs a;
    a.q = q.data;
    a.page_base = pool.data;
    a.page_stride = b.stride;
    a.indptr = indptr.data;
    a.indices = indices.data;
    a.last_page_len = last.data;
    a.row_entries = b.row_entries.empty() ? nullptr : row_entries.data;
    a.live_masks = b.live_masks.empty() ? nullptr : live.data;
    a.scale = b.scale;
    if (!b.extra.empty()) a.extra = {extra_max.data, extra_sum.data, extra_acc.data};
    a.out = out.data;
    a.lse = lse.data;
    a.workspace = workspace.data;
    a.workspace_bytes = workspace_bytes;
    return a;
  }
};

// Per slot weight ([indices.size()][page_tokens]): whether a row attends the
// slot (below its page's token count, live in its mask).
std::vector<char> live_slots(const AttentionBatch& b) {
  const std::uint32_t pt = b.layout.page_tokens;
  std::vector<char> live(b.indices.size() * pt, 0);
  for (std::uint32_t row = 0; row < b.batch * b.kv_heads; ++row) {
    for (std::int64_t e = b.row_first_entry(row); e < std::int64_t(b.row_first_entry(row + 1)); ++e) {
      for (std::int64_t i = b.indptr[e]; i < b.indptr[e + 1]; ++i) {
        const std::uint32_t tokens = i + 1 == b.indptr[e + 1] ? std::uint32_t(b.last_page_len[e]) : pt;
        const SlotMask mask = b.live_masks.empty() ? ~SlotMask{0} : b.live_masks[std::size_t(i)];
        for (std::uint32_t t = 0; t < tokens; ++t) live[std::size_t(i) * pt + t] = slot_live(mask, t) ? 1 : 0;
      }
    }
  }
  return live;
}

Errors run_case(std::mt19937& rng, const CaseSpec& spec, cudaStream_t stream) {
  const AttentionBatch b = make_batch(rng, spec);
  const std::uint32_t d = spec.layout.head_dim;
  std::vector<float> want_out, want_lse, want_weights;
  reference_attention(b, want_out, want_lse, &want_weights);

  cuda::DecodeAttentionShape shape;
  shape.batch = spec.batch;
  shape.q_heads = b.q_heads;
  shape.kv_heads = spec.kv_heads;
  shape.layout = spec.layout;
  shape.max_pages = b.max_pages > spec.understate ? b.max_pages - spec.understate : 0;
  shape.chunk_pages = spec.chunk_pages;
  const bool weights = spec.weights && !b.indices.empty();
  if (weights) shape.max_indices = static_cast<std::uint32_t>(b.indices.size());
  const cuda::DecodeAttentionSplit split = cuda::plan_sparse_decode_attention(shape);

  DeviceBatch dev;
  dev.load(b, split.workspace_bytes);
  cuda::DecodeAttentionArgs args = dev.args(b, split.workspace_bytes);
  if (weights) args.slot_weights = dev.weights.data;
  cuda::sparse_decode_attention(shape, args, stream);
  check(cudaStreamSynchronize(stream));
  check(cudaGetLastError());
  Errors e = compare(dev.out.download(), dev.lse.download(), want_out, want_lse, d);
  if (weights) {
    const std::vector<float> got = dev.weights.download(want_weights.size());
    const std::vector<char> live = live_slots(b);
    for (std::size_t i = 0; i < want_weights.size(); ++i) {
      CAPTURE(i, got[i], want_weights[i], int(live[i]));
      // A live slot's weight may underflow to 0 on the host and be a denormal
      // on the device: only dead and unused slots must be exactly 0.
      if (!live[i]) REQUIRE(got[i] == 0.0f);
      const float error = std::abs(got[i] - want_weights[i]);
      REQUIRE(error <= 1e-4f);  // also false for a NaN: a slot the kernel left unwritten
      e.weights = std::max(e.weights, error);
    }
  }
  return e;
}

// What a sweep of one form varies: both forms run the same loop (sweep below).
struct SweepForm {
  const char* name;
  std::vector<std::uint32_t> groups, page_tokens;
  std::uint32_t min_batch, batch_choices;  // batch = min_batch + rng() % batch_choices
  std::uint32_t min_kv_heads, kv_choices;  // likewise; group 12 takes min_kv_heads
  std::uint32_t max_row_pages;             // per row (runs form: per run); 64-token pages at most 6
  std::uint32_t runs;                      // 0: one entry per row
  std::uint32_t chunk_choices;             // chunk_pages = rng() % chunk_choices (0 = automatic)
  std::uint32_t understate;                // pages understated in max_pages, a quarter of the cases
};

// dtype x head_dim x group x page_tokens, each combination one random case of
// `form` (batch, heads, extra term, chunking, stride, scale, understated
// max_pages, stream), against the host; returns the cases run.
int sweep(std::uint32_t seed, const SweepForm& form) {
  std::mt19937 rng(seed);
  const Stream stream;
  Errors worst;
  int cases = 0;
  for (const DType dtype : {DType::bf16, DType::f16, DType::f32}) {
    for (const std::uint32_t head_dim : {64u, 128u}) {
      for (const std::uint32_t group : form.groups) {
        for (const std::uint32_t page_tokens : form.page_tokens) {
          CaseSpec spec{};
          spec.batch = form.min_batch + std::uint32_t(rng() % form.batch_choices);
          spec.kv_heads = group == 12 ? form.min_kv_heads : form.min_kv_heads + std::uint32_t(rng() % form.kv_choices);
          spec.group = group;
          spec.layout = PageLayout{page_tokens, head_dim, dtype};
          spec.max_row_pages = page_tokens == 64 ? std::min(6u, form.max_row_pages) : form.max_row_pages;
          spec.runs = form.runs;
          spec.extra = rng() % 2 == 0;
          spec.chunk_pages = std::uint32_t(rng() % form.chunk_choices);
          spec.stride_pad = rng() % 2 == 0 ? 0 : 16 * (1 + rng() % 3);
          spec.scale_factor = rng() % 2 == 0 ? 1.0f : 4.0f;
          spec.understate = rng() % 4 == 0 ? form.understate : 0;
          CAPTURE(form.name, to_string(dtype), head_dim, group, page_tokens, spec.batch, spec.kv_heads, spec.extra,
                  spec.chunk_pages, spec.stride_pad, spec.scale_factor, spec.understate);
          const Errors e = run_case(rng, spec, rng() % 2 == 0 ? stream.stream : nullptr);
          worst.out = std::max(worst.out, e.out);
          worst.lse = std::max(worst.lse, e.lse);
          ++cases;
        }
      }
    }
  }
  std::printf("sparse_decode_attention, %s, vs host: %d cases, max relative error out %.3g, lse %.3g\n", form.name,
              cases, double(worst.out), double(worst.lse));
  return cases;
}

}  // namespace

TEST_CASE("sparse_decode_attention matches the host decode_attention", "[gpu][attention]") {
  // Row page counts 0..20 (0..6 with 64-token pages), 1 or 2 pages per chunk
  // forced or automatic.
  const SweepForm entries{"one entry per row", {1, 3, 4, 8, 12}, {16, 5, 64}, 1, 6, 1, 4, 20, 0, 3, 3};
  REQUIRE(sweep(71, entries) == 3 * 2 * 5 * 3);
}

TEST_CASE("sparse_decode_attention splits long selections over many chunks", "[gpu][attention]") {
  std::mt19937 rng(72);
  // The benchmark's shape at small scale: 2048-token selections (128 pages of
  // 16), bf16, GQA 4, head_dim 128, automatic split (many chunks per row).
  for (const std::uint32_t batch : {1u, 4u}) {
    for (const bool extra : {false, true}) {
      CaseSpec spec{batch, 8, 4, PageLayout{16, 128, DType::bf16}, 128, extra, 0, 0, 1.0f, 0, 0, 0};
      CAPTURE(batch, extra);
      const Errors e = run_case(rng, spec, nullptr);
      std::printf("2048-token rows, batch %u, extra %d: max relative error out %.3g, lse %.3g\n", batch, int(extra),
                  double(e.out), double(e.lse));
    }
  }
  cuda::DecodeAttentionShape shape{1, 32, 8, PageLayout{16, 128, DType::bf16}, 128, 0};
  REQUIRE(cuda::plan_sparse_decode_attention(shape).chunks > 1);
}

TEST_CASE("sparse_decode_attention attends a plan's runs in one launch", "[gpu][attention]") {
  // >= 4 rows (every kind of row); up to 4 runs of 1..6 pages; chunks of 1..3
  // pages that cut runs anywhere, or automatic.
  const SweepForm runs{"runs form", {1, 4, 12}, {16, 5}, 2, 4, 2, 3, 6, 4, 4, 5};
  REQUIRE(sweep(73, runs) == 3 * 2 * 3 * 2);
}

TEST_CASE("sparse_decode_attention over runs captured once replays new plans", "[gpu][attention]") {
  std::mt19937 rng(74);
  // Fixed capacities: rows x (4 runs of <= 6 pages); every replay draws a new
  // plan (counts, runs, pages, lengths, q, extra terms) into the same arrays.
  CaseSpec spec{4, 4, 4, PageLayout{16, 128, DType::bf16}, 6, true, 0, 16, 1.0f, 0, 4, 0};
  const std::uint32_t rows = spec.batch * spec.kv_heads;
  const std::uint32_t max_pages = 4 * spec.max_row_pages;
  spec.pool_pages = rows * max_pages + 3;
  cuda::DecodeAttentionShape shape{spec.batch, spec.kv_heads * spec.group, spec.kv_heads, spec.layout, max_pages, 0};
  const cuda::DecodeAttentionSplit split = cuda::plan_sparse_decode_attention(shape);
  const Stream stream;
  DeviceBatch dev;
  // Reserve the capacities once: loads below never reallocate, so the graph's pointers stay valid.
  dev.indptr.reserve(rows * 5 + 1);
  dev.indices.reserve(rows * max_pages);
  dev.last.reserve(rows * 5);
  AttentionBatch b = make_batch(rng, spec);
  dev.load(b, split.workspace_bytes);  // the warm-up reads what a real step would: never uninitialised memory
  const cuda::DecodeAttentionArgs args = dev.args(b, split.workspace_bytes);
  cuda::sparse_decode_attention(shape, args, stream.stream);  // warms the memoised device queries outside the capture
  check(cudaStreamSynchronize(stream.stream));
  cudaGraph_t graph = nullptr;
  check(cudaStreamBeginCapture(stream.stream, cudaStreamCaptureModeThreadLocal));
  cuda::sparse_decode_attention(shape, args, stream.stream);
  check(cudaStreamEndCapture(stream.stream, &graph));
  cudaGraphExec_t exec = nullptr;
  check(cudaGraphInstantiate(&exec, graph, 0));
  const std::size_t heads = std::size_t{spec.batch} * shape.q_heads;
  DeviceArray<float> eager_out(heads * spec.layout.head_dim), eager_lse(heads);
  cuda::DecodeAttentionArgs eager = args;
  eager.out = eager_out.data;
  eager.lse = eager_lse.data;
  Errors worst;
  for (int replay = 0; replay < 12; ++replay) {
    INFO("replay " << replay);
    if (replay > 0) {
      b = make_batch(rng, spec);
      dev.load(b, split.workspace_bytes);
    }
    REQUIRE(dev.pool.data == args.page_base);
    REQUIRE(dev.indices.data == args.indices);
    std::vector<float> want_out, want_lse;
    reference_attention(b, want_out, want_lse);
    // The eager launch with the same shape, then the graph: the same split, so bit for bit the same outputs.
    cuda::sparse_decode_attention(shape, eager, stream.stream);
    check(cudaGraphLaunch(exec, stream.stream));
    check(cudaStreamSynchronize(stream.stream));
    const std::vector<float> got_out = dev.out.download(), got_lse = dev.lse.download();
    REQUIRE(got_out == eager_out.download());
    REQUIRE(got_lse == eager_lse.download());
    const Errors e = compare(got_out, got_lse, want_out, want_lse, spec.layout.head_dim);
    worst.out = std::max(worst.out, e.out);
    worst.lse = std::max(worst.lse, e.lse);
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  std::printf("sparse_decode_attention, runs form, graph replays: max relative error out %.3g, lse %.3g\n",
              double(worst.out), double(worst.lse));
}

TEST_CASE("sparse_decode_attention over live masks with slot weights matches the host", "[gpu][attention][masks]") {
  std::mt19937 rng(75);
  const Stream stream;
  Errors worst;
  int cases = 0;
  for (const DType dtype : {DType::bf16, DType::f32}) {
    for (const std::uint32_t head_dim : {64u, 128u}) {
      for (const std::uint32_t group : {1u, 4u, 16u}) {  // 16: two head slices, each storing its own scores
        for (const std::uint32_t page_tokens : {16u, 5u, 64u}) {
          for (const std::uint32_t runs : {0u, 4u}) {
            CaseSpec spec{};
            spec.batch = 2 + std::uint32_t(rng() % 3);
            spec.kv_heads = group == 16 ? 2 : 2 + std::uint32_t(rng() % 2);
            spec.group = group;
            spec.layout = PageLayout{page_tokens, head_dim, dtype};
            spec.max_row_pages = page_tokens == 64 ? 6 : runs == 0 ? 20 : 6;
            spec.runs = runs;
            spec.extra = rng() % 2 == 0;
            spec.chunk_pages = std::uint32_t(rng() % 4);  // chunks of 1..3 pages cut pages' runs anywhere
            spec.scale_factor = rng() % 2 == 0 ? 1.0f : 4.0f;
            spec.masks = true;
            spec.weights = rng() % 4 != 0;  // a quarter of the cases masks only
            CAPTURE(to_string(dtype), head_dim, group, page_tokens, runs, spec.batch, spec.kv_heads, spec.extra,
                    spec.chunk_pages, spec.scale_factor, spec.weights);
            const Errors e = run_case(rng, spec, stream.stream);
            worst.out = std::max(worst.out, e.out);
            worst.lse = std::max(worst.lse, e.lse);
            worst.weights = std::max(worst.weights, e.weights);
            ++cases;
          }
        }
      }
    }
  }
  std::printf("sparse_decode_attention, live masks: %d cases, max error out %.3g, lse %.3g, slot weights %.3g\n", cases,
              double(worst.out), double(worst.lse), double(worst.weights));
  REQUIRE(cases == 2 * 2 * 3 * 3 * 2);
}

TEST_CASE("sparse_decode_attention rejects bad arguments before launching", "[gpu][attention]") {
  const PageLayout layout{16, 128, DType::bf16};
  cuda::DecodeAttentionShape shape{2, 8, 2, layout, 4, 0};
  const cuda::DecodeAttentionSplit split = cuda::plan_sparse_decode_attention(shape);
  const std::size_t batch_q = 2 * 8;
  DeviceBytes pool(8 * layout.page_bytes() + 16), q(batch_q * 128 * 4), out(batch_q * 128 * 4), lse(batch_q * 4),
      indptr(5 * 8), indices(16 * 8), last(4 * 4), workspace(split.workspace_bytes + 16);
  check(cudaMemset(indptr.data, 0, 5 * 8));  // all rows empty: a valid call is harmless
  check(cudaMemset(out.data, 0x7f, batch_q * 128 * 4));
  cuda::DecodeAttentionArgs ok;
  ok.q = q.as<float>();
  ok.page_base = pool.data;
  ok.page_stride = layout.page_bytes();
  ok.indptr = indptr.as<std::int64_t>();
  ok.indices = indices.as<std::int64_t>();
  ok.last_page_len = last.as<std::int32_t>();
  ok.scale = 0.1f;
  ok.out = out.as<float>();
  ok.lse = lse.as<float>();
  ok.workspace = workspace.data;
  ok.workspace_bytes = split.workspace_bytes;
  auto code = [&](cuda::DecodeAttentionShape s, cuda::DecodeAttentionArgs a) {
    return code_of([&] { cuda::sparse_decode_attention(s, a, nullptr); });
  };
  auto with_shape = [&](auto change) {
    cuda::DecodeAttentionShape s = shape;
    change(s);
    return code(s, ok);
  };
  auto with_args = [&](auto change) {
    cuda::DecodeAttentionArgs a = ok;
    change(a);
    return code(shape, a);
  };
  const ErrorCode bad = ErrorCode::invalid_argument;
  CHECK(with_shape([](auto& s) { s.kv_heads = 0; }) == bad);
  CHECK(with_shape([](auto& s) { s.q_heads = 7; }) == bad);  // not a multiple of 2
  CHECK(with_shape([](auto& s) { s.q_heads = 0; }) == bad);
  CHECK(with_shape([](auto& s) { s.layout.head_dim = 96; }) == bad);
  CHECK(with_shape([](auto& s) { s.layout.page_tokens = 0; }) == bad);
  CHECK(with_shape([](auto& s) { s.max_pages = 200000, s.chunk_pages = 1; }) == bad);  // > 65535 chunks
  CHECK(with_args([](auto& a) { a.page_stride += 8; }) == bad);
  CHECK(with_args([&](auto& a) { a.page_stride = layout.page_bytes() - 16; }) == bad);
  CHECK(with_args([](auto& a) { a.page_base += 8; }) == bad);
  CHECK(with_args([](auto& a) { a.q = nullptr; }) == bad);
  CHECK(with_args([](auto& a) { a.out = nullptr; }) == bad);
  CHECK(with_args([](auto& a) { a.indptr = nullptr; }) == bad);
  CHECK(with_args([](auto& a) { a.indices = nullptr; }) == bad);
  CHECK(with_args([](auto& a) { a.last_page_len = nullptr; }) == bad);
  CHECK(with_args([](auto& a) { a.workspace = nullptr; }) == bad);
  CHECK(with_args([](auto& a) { a.workspace = static_cast<std::byte*>(a.workspace) + 4; }) == bad);
  CHECK(with_args([](auto& a) { a.workspace_bytes -= 4; }) == bad);
  CHECK(with_args([&](auto& a) { a.extra.max = q.as<float>(); }) == bad);       // partial extra term
  CHECK(with_args([&](auto& a) { a.slot_weights = out.as<float>(); }) == bad);  // no max_indices: no room for scores
  cuda::DecodeAttentionShape wide = shape;
  wide.layout.page_tokens = 65;  // masks cover 64 slots
  cuda::DecodeAttentionArgs masked = ok;
  masked.page_stride = wide.layout.page_bytes();
  masked.live_masks = indices.as<SlotMask>();
  CHECK(code(wide, masked) == bad);
  CHECK(cudaDeviceSynchronize() == cudaSuccess);
  // Nothing was launched: out keeps its fill pattern.
  const std::vector<std::uint32_t> untouched = download<std::uint32_t>(out, batch_q * 128);
  REQUIRE(std::all_of(untouched.begin(), untouched.end(), [](std::uint32_t x) { return x == 0x7f7f7f7fu; }));
  // batch 0 enqueues nothing, even with null pointers.
  cuda::DecodeAttentionShape empty = shape;
  empty.batch = 0;
  cuda::sparse_decode_attention(empty, cuda::DecodeAttentionArgs{}, nullptr);
  // The valid call over empty rows writes zeros and -inf.
  cuda::sparse_decode_attention(shape, ok, nullptr);
  check(cudaDeviceSynchronize());
  const std::vector<float> zeros = download<float>(out, batch_q * 128);
  REQUIRE(std::all_of(zeros.begin(), zeros.end(), [](float x) { return x == 0.0f; }));
  const std::vector<float> lses = download<float>(lse, batch_q);
  REQUIRE(std::all_of(lses.begin(), lses.end(), [](float x) { return x == -INFINITY; }));
}
