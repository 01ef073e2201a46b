// The online-softmax rules shared by the host backend and the CUDA split-K
// decode attention kernel (attention_partial.hpp: softmax_fold / _merge /
// _rescale_add / _lse / _output), the kernel's split planning
// (split_decode_attention) and page walk over a row's runs
// (decode_attention_row / _chunk / _chunk_slots / DecodeAttentionCursor), and
// a host emulation of the kernel's decomposition (rows -> chunks -> token
// groups -> workspace partials -> merge with the extra term,
// attention_test_data.hpp) against the host decode_attention, in both forms:
// one entry per row, and an AttendPlan's runs (row_entries); with live-slot
// masks and slot weights (SpvLLM §2, H2O): the split kernel's mask test
// (decode_attention_slot_live), its stored scores and the weights kernel's
// walk (decode_attention_slot_weight) emulated against decode_attention.
//
// Relative error of an output head: max_d |got - want| / max_d |want|; of an
// lse: |got - want| / max(1, |want|).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <utility>
#include <vector>

#include "attention_test_data.hpp"
#include "sparsekv/attention/attention_partial.hpp"
#include "sparsekv/attention/decode_attention.hpp"
#include "sparsekv/attention/sparse_decode_attention_cuda.hpp"
#include "sparsekv/core/numeric.hpp"
#include "test_support.hpp"

using namespace sparsekv;
using namespace sparsekv::test;

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

float head_relative_error(const float* got, const float* want, std::size_t n) {
  float num = 0, den = 0;
  for (std::size_t i = 0; i < n; ++i) {
    num = std::max(num, std::abs(got[i] - want[i]));
    den = std::max(den, std::abs(want[i]));
  }
  return den == 0 ? num : num / den;
}

float lse_relative_error(float got, float want) {
  if (std::isinf(want) || std::isinf(got)) return got == want ? 0.0f : kInf;
  return std::abs(got - want) / std::max(1.0f, std::abs(want));
}

struct Keys {
  std::vector<float> scores, weights, values;  // values: [n][d]
};

Keys random_keys(std::mt19937& rng, std::size_t n, std::uint32_t d, float spread) {
  std::normal_distribution<float> normal;
  std::uniform_int_distribution<int> cluster(1, 4);
  Keys k;
  for (std::size_t t = 0; t < n; ++t) {
    k.scores.push_back(spread * normal(rng));
    k.weights.push_back(t % 5 == 0 ? float(cluster(rng)) : 1.0f);  // some RetroInfer-style clusters
    for (std::uint32_t i = 0; i < d; ++i) k.values.push_back(normal(rng));
  }
  return k;
}

// softmax-weighted mean in double: the exact answer both fp32 paths approximate.
std::vector<double> exact_output(const Keys& k, std::uint32_t d, double* lse) {
  double m = -1e300;
  for (float s : k.scores) m = std::max(m, double(s));
  double sum = 0;
  std::vector<double> acc(d, 0.0);
  for (std::size_t t = 0; t < k.scores.size(); ++t) {
    const double e = std::exp(double(k.scores[t]) - m);
    sum += k.weights[t] * e;
    for (std::uint32_t i = 0; i < d; ++i) acc[i] += e * k.values[t * d + i];
  }
  for (double& a : acc) a /= sum;
  *lse = m + std::log(sum);
  return acc;
}

}  // namespace

TEST_CASE("merging partials of any split of a key set equals the one-pass fold", "[attention-rules]") {
  std::mt19937 rng(61);
  const std::uint32_t d = 16;
  for (const float spread : {0.5f, 3.0f, 30.0f}) {
    for (int trial = 0; trial < 20; ++trial) {
      const std::size_t n = 1 + rng() % 48;
      const Keys keys = random_keys(rng, n, d, spread);
      SoftmaxHead whole(d);
      for (std::size_t t = 0; t < n; ++t) whole.fold(keys.scores[t], keys.weights[t], &keys.values[t * d]);
      const std::vector<float> want = whole.output();
      const float want_lse = softmax_lse(whole.state);

      double exact_lse = 0;
      const std::vector<double> exact = exact_output(keys, d, &exact_lse);
      for (std::uint32_t i = 0; i < d; ++i) REQUIRE(std::abs(want[i] - exact[i]) <= 1e-5 + 1e-5 * std::abs(exact[i]));
      REQUIRE(std::abs(want_lse - exact_lse) <= 1e-5 * std::max(1.0, std::abs(exact_lse)));

      // Any split: each key to a random part (some parts empty), parts merged in random order.
      const std::size_t parts = 1 + rng() % 6;
      std::vector<SoftmaxHead> part(parts, SoftmaxHead(d));
      for (std::size_t t = 0; t < n; ++t)
        part[rng() % parts].fold(keys.scores[t], keys.weights[t], &keys.values[t * d]);
      std::vector<std::size_t> order(parts);
      std::iota(order.begin(), order.end(), 0);
      std::shuffle(order.begin(), order.end(), rng);
      SoftmaxHead merged(d);
      for (std::size_t p : order) merged.merge(part[p]);
      CAPTURE(spread, n, parts);
      const std::vector<float> got = merged.output();
      REQUIRE(head_relative_error(got.data(), want.data(), d) <= 1e-6f);
      REQUIRE(lse_relative_error(softmax_lse(merged.state), want_lse) <= 1e-6f);
      REQUIRE(std::abs(merged.state.sum * std::exp(merged.state.max - whole.state.max) - whole.state.sum) <=
              1e-6f * whole.state.sum);
    }
  }
}

// The split kernel folds a batch of scores at once (softmax_fold_tile): in
// batches of any size, -inf scores mixed in, it gives the exact answer as
// the one-at-a-time fold does.
TEST_CASE("folding scores a batch at a time equals the one-at-a-time fold", "[attention-rules]") {
  std::mt19937 rng(67);
  const std::uint32_t d = 16;
  for (const float spread : {0.5f, 3.0f, 30.0f}) {
    for (int trial = 0; trial < 30; ++trial) {
      const std::size_t n = 1 + rng() % 48;
      Keys keys = random_keys(rng, n, d, spread);
      for (std::size_t t = 0; t < n; ++t) {
        keys.weights[t] = 1.0f;                                  // the kernel's keys are single tokens
        if (rng() % 4 == 0) keys.scores[t] = kNegativeInfinity;  // unused or dead slots
      }
      keys.scores[rng() % n] = spread;  // at least one live key
      SoftmaxHead one(d);
      for (std::size_t t = 0; t < n; ++t) one.fold(keys.scores[t], 1.0f, &keys.values[t * d]);
      const std::uint32_t batch = 1 + rng() % 9;
      SoftmaxHead batched(d);
      for (std::size_t t0 = 0; t0 < n; t0 += batch) {
        const std::uint32_t m = static_cast<std::uint32_t>(std::min<std::size_t>(batch, n - t0));
        std::vector<float> weights(keys.scores.begin() + std::ptrdiff_t(t0),
                                   keys.scores.begin() + std::ptrdiff_t(t0 + m));
        const float scale = softmax_fold_tile(batched.state, weights.data(), m, weights.data());
        for (float& a : batched.acc) a = softmax_rescale_tile(a, scale);
        for (std::uint32_t j = 0; j < m; ++j) {
          if (keys.scores[t0 + j] == kNegativeInfinity) REQUIRE(weights[j] == 0.0f);
          for (std::uint32_t i = 0; i < d; ++i) batched.acc[i] += weights[j] * keys.values[(t0 + j) * d + i];
        }
      }
      CAPTURE(spread, n, batch);
      const std::vector<float> want = one.output();
      REQUIRE(head_relative_error(batched.output().data(), want.data(), d) <= 1e-6f);
      REQUIRE(lse_relative_error(softmax_lse(batched.state), softmax_lse(one.state)) <= 1e-6f);
    }
  }
  // A batch of only -inf scores changes nothing; a first batch on an empty state scales by 0.
  SoftmaxState s{1.5f, 2.0f};
  float dead[3] = {kNegativeInfinity, kNegativeInfinity, kNegativeInfinity};
  REQUIRE(softmax_fold_tile(s, dead, 3, dead) == 1.0f);
  REQUIRE((s.max == 1.5f && s.sum == 2.0f && dead[0] == 0.0f && dead[2] == 0.0f));
  SoftmaxState empty;
  float live[2] = {0.0f, kNegativeInfinity};
  REQUIRE(softmax_fold_tile(empty, live, 2, live) == 0.0f);
  REQUIRE((empty.max == 0.0f && empty.sum == 1.0f && live[0] == 1.0f && live[1] == 0.0f));
  REQUIRE(softmax_rescale_tile(std::numeric_limits<float>::infinity(), 0.0f) == 0.0f);
  // A NaN score poisons the state, alone or beside -inf, as softmax_fold's does.
  SoftmaxState poisoned{0.5f, 1.0f};
  float nan_batch[2] = {kNegativeInfinity, std::numeric_limits<float>::quiet_NaN()};
  softmax_fold_tile(poisoned, nan_batch, 2, nan_batch);
  REQUIRE(std::isnan(poisoned.sum));
}

TEST_CASE("empty and -inf partials change nothing", "[attention-rules]") {
  const std::uint32_t d = 4;
  const float v1[d] = {1, 2, 3, 4}, v2[d] = {-1, 0.5f, 2, 8};
  SoftmaxHead a(d);
  a.fold(0.25f, 1.0f, v1);
  a.fold(1.5f, 2.0f, v2);
  const SoftmaxHead before = a;

  SECTION("an empty state is s == 0, m == -inf, lse -inf, output 0") {
    const SoftmaxHead empty(d);
    REQUIRE(softmax_empty(empty.state));
    REQUIRE(empty.state.max == -kInf);
    REQUIRE(softmax_lse(empty.state) == -kInf);
    REQUIRE(softmax_output(5.0f, empty.state) == 0.0f);
  }
  SECTION("merging an empty state is bit-exact identity, both ways") {
    SoftmaxHead empty(d);
    // An empty side's accumulator is never read into the result, even when it holds inf / NaN.
    empty.acc = {kInf, -kInf, std::nanf(""), 7.0f};
    SoftmaxHead x = a;
    x.merge(empty);
    REQUIRE(std::memcmp(&x.state, &before.state, sizeof(SoftmaxState)) == 0);
    REQUIRE(x.acc == before.acc);
    SoftmaxHead y(d);
    y.acc = {kInf, std::nanf(""), -kInf, 3.0f};
    y.state = SoftmaxState{};
    y.merge(a);
    REQUIRE(y.state.max == before.state.max);
    REQUIRE(y.state.sum == before.state.sum);
    REQUIRE(y.acc == before.acc);
    SoftmaxHead both(d);
    both.merge(SoftmaxHead(d));
    REQUIRE(softmax_empty(both.state));
    REQUIRE(both.acc == std::vector<float>(d, 0.0f));
  }
  SECTION("a -inf score, a zero or negative weight, or a NaN weight folds nothing") {
    SoftmaxHead x = a;
    x.fold(-kInf, 1.0f, v1);
    x.fold(3.0f, 0.0f, v1);
    x.fold(3.0f, -1.0f, v1);
    x.fold(3.0f, std::nanf(""), v1);
    REQUIRE(x.state.max == before.state.max);
    REQUIRE(x.state.sum == before.state.sum);
    REQUIRE(x.acc == before.acc);
    SoftmaxHead e(d);
    e.fold(-kInf, 1.0f, v1);
    REQUIRE(softmax_empty(e.state));
  }
  SECTION("very negative finite scores and a later huge max stay finite") {
    SoftmaxHead x(d);
    x.fold(-1e30f, 1.0f, v1);
    REQUIRE(x.state.max == -1e30f);
    REQUIRE(x.state.sum == 1.0f);
    x.fold(1e30f, 1.0f, v2);  // the old mass underflows to exactly 0
    const std::vector<float> out = x.output();
    for (std::uint32_t i = 0; i < d; ++i) REQUIRE(out[i] == v2[i]);
    REQUIRE(softmax_lse(x.state) == 1e30f);
  }
  SECTION("AttentionPartial runs the same rules") {
    AttentionPartial p(d), q;  // q default-constructed: takes the other's size on merge
    p.add(0.25f, 1.0f, v1);
    p.add(1.5f, 2.0f, v2);
    REQUIRE(p.max == before.state.max);
    REQUIRE(p.sum == before.state.sum);
    REQUIRE(p.acc == before.acc);
    q.merge(p);
    REQUIRE(q.acc == p.acc);
    REQUIRE(q.log_sum_exp() == softmax_lse(before.state));
    REQUIRE(AttentionPartial(d).log_sum_exp() == -kInf);
  }
}

TEST_CASE("the extra term merges like any disjoint key set", "[attention-rules]") {
  std::mt19937 rng(62);
  const std::uint32_t d = 8;
  for (int trial = 0; trial < 30; ++trial) {
    const Keys pages = random_keys(rng, 1 + rng() % 30, d, 2.0f);
    const Keys estimated = random_keys(rng, 1 + rng() % 10, d, 2.0f);
    // One pass over everything vs pages, then the extra term merged (the kernel's order), vs extra first.
    SoftmaxHead all(d), exact_part(d), extra(d);
    for (std::size_t t = 0; t < pages.scores.size(); ++t) {
      all.fold(pages.scores[t], pages.weights[t], &pages.values[t * d]);
      exact_part.fold(pages.scores[t], pages.weights[t], &pages.values[t * d]);
    }
    for (std::size_t t = 0; t < estimated.scores.size(); ++t) {
      all.fold(estimated.scores[t], estimated.weights[t], &estimated.values[t * d]);
      extra.fold(estimated.scores[t], estimated.weights[t], &estimated.values[t * d]);
    }
    SoftmaxHead after = exact_part;
    after.merge(extra);
    SoftmaxHead before = extra;
    before.merge(exact_part);
    const std::vector<float> want = all.output();
    REQUIRE(head_relative_error(after.output().data(), want.data(), d) <= 1e-6f);
    REQUIRE(head_relative_error(before.output().data(), want.data(), d) <= 1e-6f);
    REQUIRE(lse_relative_error(softmax_lse(after.state), softmax_lse(all.state)) <= 1e-6f);
    // Only an extra term (no pages): the output is the term's own normalised value.
    SoftmaxHead only(d);
    only.merge(extra);
    REQUIRE(only.output() == extra.output());
  }
}

TEST_CASE("split_decode_attention covers every page with bounded chunks", "[attention-rules]") {
  cuda::DecodeAttentionShape shape;
  shape.q_heads = 32;
  shape.kv_heads = 8;
  shape.layout = PageLayout{16, 128, DType::bf16};
  for (const std::uint32_t batch : {1u, 3u, 8u, 64u, 1000u}) {
    for (const std::uint32_t max_pages : {0u, 1u, 2u, 5u, 128u, 1000u}) {
      for (const std::uint32_t target : {1u, 132u, 1056u, 8448u}) {
        shape.batch = batch;
        shape.max_pages = max_pages;
        const cuda::DecodeAttentionSplit s = cuda::split_decode_attention(shape, target);
        CAPTURE(batch, max_pages, target, s.chunk_pages, s.chunks);
        const std::uint32_t pages = std::max(max_pages, 1u);
        REQUIRE(s.head_slices == 1);
        REQUIRE(s.chunks >= 1);
        REQUIRE(std::uint64_t{s.chunks} * s.chunk_pages >= pages);     // every page in a chunk
        REQUIRE(std::uint64_t{s.chunks - 1} * s.chunk_pages < pages);  // no chunk past the last page
        REQUIRE(std::uint64_t{s.chunk_pages} * 16 >= cuda::kMinChunkTokens);
        // At least half of the CTAs the target and the chunk floor allow.
        const std::uint64_t rows = std::uint64_t{batch} * 8;
        const std::uint64_t floor_chunks = (pages + cuda::kMinChunkTokens / 16 - 1) / (cuda::kMinChunkTokens / 16);
        REQUIRE(2 * rows * s.chunks >= std::min<std::uint64_t>(target, rows * floor_chunks));
        REQUIRE(s.workspace_bytes == std::size_t{s.chunks} * batch * 32 * 130 * sizeof(float));
      }
    }
  }
  shape.batch = 2;
  shape.max_pages = 10;
  shape.chunk_pages = 3;
  cuda::DecodeAttentionSplit forced = cuda::split_decode_attention(shape, 1000);
  REQUIRE(forced.chunk_pages == 3);
  REQUIRE(forced.chunks == 4);
  shape.chunk_pages = 0;
  shape.q_heads = 96;  // group 12: two head slices of 8 and 4
  REQUIRE(cuda::split_decode_attention(shape, 1).head_slices == 2);
  shape.layout.page_tokens = 1;  // tiny pages: the chunk floor is kMinChunkTokens pages
  shape.max_pages = 1000;
  REQUIRE(cuda::split_decode_attention(shape, 100000).chunk_pages == cuda::kMinChunkTokens);
  // Slot weights add the scores of max_indices pages and one lse per q head.
  const std::size_t without = cuda::split_decode_attention(shape, 100000).workspace_bytes;
  shape.max_indices = 300;
  REQUIRE(cuda::split_decode_attention(shape, 100000).workspace_bytes ==
          without + (std::size_t{300} * 1 * 12 + 2 * 96) * sizeof(float));
}

// An engine sizes the workspace once for its largest batch: the capacity
// covers every smaller batch's plan, which the largest batch's alone need not.
TEST_CASE("decode_attention_workspace_capacity covers every batch up to the largest", "[attention-rules]") {
  cuda::DecodeAttentionShape shape;
  shape.q_heads = 32;
  shape.kv_heads = 8;
  shape.layout = PageLayout{16, 128, DType::bf16};
  bool short_somewhere = false;
  for (const std::uint32_t max_pages : {8u, 129u, 1000u}) {
    for (const std::uint32_t target : {132u, 528u, 924u}) {
      shape.max_pages = max_pages;
      shape.batch = 64;
      const std::size_t capacity = cuda::decode_attention_workspace_capacity(shape, target);
      const std::size_t largest = cuda::split_decode_attention(shape, target).workspace_bytes;
      std::size_t most = 0;
      for (std::uint32_t batch = 1; batch <= 64; ++batch) {
        shape.batch = batch;
        most = std::max(most, cuda::split_decode_attention(shape, target).workspace_bytes);
      }
      CAPTURE(max_pages, target, capacity, largest);
      REQUIRE(capacity == most);
      short_somewhere = short_somewhere || largest < capacity;
    }
  }
  REQUIRE(short_somewhere);  // the case the capacity exists for
}

// The split CTA's geometry (the kernel static_asserts its own against
// these): 128 threads in rows of 16-byte lanes, rows dealt over the heads.
TEST_CASE("split CTA rows and token groups follow head_dim, dtype and the group", "[attention-rules]") {
  REQUIRE(cuda::decode_attention_group_width(1) == 1);
  REQUIRE(cuda::decode_attention_group_width(3) == 4);
  REQUIRE(cuda::decode_attention_group_width(5) == 8);
  REQUIRE(cuda::decode_attention_group_width(12) == cuda::kMaxGroupPerCta);
  REQUIRE(cuda::decode_attention_rows(128, DType::bf16) == 8);  // 16 lanes of 8 elements
  REQUIRE(cuda::decode_attention_rows(64, DType::f16) == 16);
  REQUIRE(cuda::decode_attention_rows(128, DType::f32) == 4);  // 32 lanes of 4 elements
  REQUIRE(cuda::decode_attention_token_groups(128, DType::bf16, 4) == 2);
  REQUIRE(cuda::decode_attention_token_groups(128, DType::bf16, 1) == 8);
  REQUIRE(cuda::decode_attention_token_groups(128, DType::bf16, 3) == 2);  // width 4
  REQUIRE(cuda::decode_attention_token_groups(128, DType::bf16, 8) == 1);
  REQUIRE(cuda::decode_attention_token_groups(128, DType::f32, 8) == 1);  // 4 rows, two heads a thread
  REQUIRE(cuda::decode_attention_token_groups(64, DType::bf16, 1) == 16);
  REQUIRE(cuda::decode_attention_token_groups(64, DType::bf16, 12) == 2);
  // A token group's share of a 16-token tile, folded at most 8 at a time.
  REQUIRE(cuda::decode_attention_fold_batch(128, DType::bf16, 4) == 8);
  REQUIRE(cuda::decode_attention_fold_batch(128, DType::bf16, 8) == 8);  // share 16: two batches
  REQUIRE(cuda::decode_attention_fold_batch(128, DType::bf16, 1) == 2);
  REQUIRE(cuda::decode_attention_fold_batch(64, DType::bf16, 1) == 1);
}

// Brute force over every chunk count: the split's modelled cost (waves x
// (chunk tokens + a chunk's fixed cost)) is the least of any split of at
// most kSplitWaves waves, with the fewest chunks among equals.
TEST_CASE("split_decode_attention picks the cheapest whole-wave split", "[attention-rules]") {
  cuda::DecodeAttentionShape shape;
  shape.q_heads = 32;
  shape.kv_heads = 8;
  for (const std::uint32_t page_tokens : {1u, 8u, 16u}) {
    shape.layout = PageLayout{page_tokens, 128, DType::bf16};
    const std::uint32_t min_pages = (cuda::kMinChunkTokens + page_tokens - 1) / page_tokens;
    for (const std::uint32_t batch : {1u, 3u, 8u, 32u, 64u, 66u, 200u}) {
      for (const std::uint32_t max_pages : {1u, 7u, 128u, 256u, 1000u}) {
        for (const std::uint32_t target : {1u, 132u, 528u, 1056u}) {
          shape.batch = batch;
          shape.max_pages = max_pages;
          const cuda::DecodeAttentionSplit s = cuda::split_decode_attention(shape, target);
          CAPTURE(page_tokens, batch, max_pages, target, s.chunks, s.chunk_pages);
          const std::uint64_t rows = std::uint64_t{batch} * 8;
          const std::uint64_t cost =
              cuda::decode_attention_split_cost(rows, target, max_pages, s.chunk_pages, page_tokens);
          for (std::uint32_t c = 1; c <= max_pages; ++c) {
            const std::uint32_t pages = cuda::decode_attention_chunk_pages(max_pages, c, min_pages);
            const std::uint32_t chunks = (max_pages + pages - 1) / pages;
            if ((rows * chunks + target - 1) / target > cuda::kSplitWaves) continue;
            const std::uint64_t other = cuda::decode_attention_split_cost(rows, target, max_pages, pages, page_tokens);
            CAPTURE(c, pages, other);
            REQUIRE(cost <= other);
            if (cost == other) REQUIRE(s.chunks <= chunks);
          }
        }
      }
    }
  }
  // The H100 shapes of the attention benchmark (132 SMs x 4 resident CTAs,
  // 8 kv heads, 128 pages per row): one whole wave where the old rule
  // (chunks = ceil(target / rows)) made 1.09 and 1.45 waves at batch 8 and 32.
  shape.layout = PageLayout{16, 128, DType::bf16};
  shape.max_pages = 128;
  const std::pair<std::uint32_t, std::uint32_t> expected[] = {{1, 32}, {8, 8}, {32, 2}, {64, 1}};
  for (const auto& [batch, chunks] : expected) {
    shape.batch = batch;
    CAPTURE(batch);
    REQUIRE(cuda::split_decode_attention(shape, 528).chunks == chunks);
  }
  // The fixed cost keeps a one-wave split where more waves would save a few
  // percent of walk (batch 16, 142 pages, 924 CTAs: 7 chunks, not 36).
  shape.batch = 16;
  shape.max_pages = 142;
  REQUIRE(cuda::split_decode_attention(shape, 924).chunks == 7);
  // An empty batch: one chunk, whatever the capacity.
  shape.batch = 0;
  shape.max_pages = 1u << 20;
  REQUIRE(cuda::split_decode_attention(shape, 924).chunks == 1);
  shape.max_pages = ~0u;  // chunk counts in 64 bits: no wrap to 0
  shape.batch = 1;
  REQUIRE(cuda::split_decode_attention(shape, 924).chunks >= 1);
}

TEST_CASE("the kernel's live-slot test and slot weight follow the mask and the group", "[attention-rules][masks]") {
  const std::vector<SlotMask> masks{0b1011, 0, ~SlotMask{0}, SlotMask{1} << 63};
  for (std::uint32_t slot = 0; slot < 64; ++slot) {
    CAPTURE(slot);
    REQUIRE(cuda::decode_attention_slot_live(nullptr, 3, slot));
    REQUIRE(cuda::decode_attention_slot_live(masks.data(), 0, slot) == (slot < 4 && slot != 2));
    REQUIRE_FALSE(cuda::decode_attention_slot_live(masks.data(), 1, slot));
    REQUIRE(cuda::decode_attention_slot_live(masks.data(), 2, slot));
    REQUIRE(cuda::decode_attention_slot_live(masks.data(), 3, slot) == (slot == 63));
  }
  // Scores [pos * page_tokens + slot][group]; row 1's q heads are lse[2], lse[3].
  const std::uint32_t pt = 4, group = 2;
  std::vector<float> scores(4 * pt * group, std::nanf(""));
  const std::size_t at = cuda::decode_attention_score_index(2, 1, pt, group);
  REQUIRE(at == (2 * 4 + 1) * 2);
  scores[at] = 0.5f;
  scores[at + 1] = -kInf;
  const std::vector<float> lse{9.0f, 9.0f, 1.0f, -kInf};
  REQUIRE(cuda::decode_attention_slot_weight(scores.data(), lse.data(), nullptr, 1, 2, 1, 4, pt, group) ==
          std::exp(0.5f - 1.0f));
  // Unused (slot >= tokens) and dead slots are 0 without reading their NaN scores.
  REQUIRE(cuda::decode_attention_slot_weight(scores.data(), lse.data(), nullptr, 1, 2, 3, 3, pt, group) == 0.0f);
  REQUIRE(cuda::decode_attention_slot_weight(scores.data(), lse.data(), masks.data(), 1, 1, 1, 4, pt, group) == 0.0f);
}

namespace {

using Batch = AttentionBatch;

// A random batch in a host page pool of page_bytes-strided pages.
Batch random_batch(std::mt19937& rng, std::uint32_t batch, std::uint32_t kv_heads, std::uint32_t group,
                   PageLayout layout, bool with_extra) {
  std::normal_distribution<float> normal;
  Batch b = batch_shape(rng, batch, kv_heads, group, layout);
  const std::uint32_t rows = batch * kv_heads;
  std::vector<std::uint32_t> counts(rows);
  for (std::uint32_t r = 0; r < rows; ++r) counts[r] = r % 7 == 1 ? 0 : r % 7 == 2 ? 1 : rng() % 12;
  const std::uint32_t total = std::accumulate(counts.begin(), counts.end(), 0u);
  const std::uint32_t pool_pages = total + 5;
  b.pool.resize(std::size_t{pool_pages} * layout.page_bytes());
  fill_pages(b, pool_pages, normal, rng);
  random_rows(b, counts, pool_pages, rng, false);
  random_queries(b, normal, rng);
  if (with_extra) random_extra(b, normal, rng, 3, 0, 8);  // no term for heads 0, 3, 6, ...
  return b;
}

void require_close(const Batch& b, const std::vector<float>& got_out, const std::vector<float>& got_lse,
                   const std::vector<float>& want_out, const std::vector<float>& want_lse) {
  const std::uint32_t d = b.layout.head_dim;
  for (std::size_t h = 0; h < want_lse.size(); ++h) {
    CAPTURE(h);
    REQUIRE(head_relative_error(&got_out[h * d], &want_out[h * d], d) <= 1e-5f);
    REQUIRE(lse_relative_error(got_lse[h], want_lse[h]) <= 1e-5f);
  }
}

}  // namespace

TEST_CASE("host emulation of the split-K kernel matches decode_attention", "[attention-rules]") {
  std::mt19937 rng(63);
  int cases = 0;
  for (const DType dtype : {DType::f32, DType::f16, DType::bf16}) {
    for (const std::uint32_t head_dim : {64u, 128u}) {
      for (const std::uint32_t group : {1u, 3u, 4u, 8u, 12u}) {
        const PageLayout layout{rng() % 2 ? 16u : 5u, head_dim, dtype};
        const std::uint32_t batch = 1 + rng() % 3;
        const std::uint32_t kv_heads = 1 + rng() % 3;
        const Batch b = random_batch(rng, batch, kv_heads, group, layout, rng() % 2 == 0);
        std::vector<float> want_out, want_lse;
        reference_attention(b, want_out, want_lse);
        cuda::DecodeAttentionShape shape{batch, b.q_heads, kv_heads, layout, b.max_pages, 0};
        for (const std::uint32_t chunk_pages : {0u, 1u, 3u}) {
          shape.chunk_pages = chunk_pages;
          // Auto split with a large target (small chunks) and with max_pages understated:
          // the last chunk must still run to each row's end.
          for (const std::uint32_t understate : {0u, 4u}) {
            shape.max_pages = b.max_pages > understate ? b.max_pages - understate : 0;
            const cuda::DecodeAttentionSplit split = cuda::split_decode_attention(shape, 4096);
            std::vector<float> got_out, got_lse;
            emulate_split_k(b, split, got_out, got_lse);
            CAPTURE(to_string(dtype), head_dim, group, layout.page_tokens, batch, kv_heads, chunk_pages, understate,
                    split.chunks, split.chunk_pages, b.extra.size());
            require_close(b, got_out, got_lse, want_out, want_lse);
            ++cases;
          }
        }
      }
    }
  }
  REQUIRE(cases == 3 * 2 * 5 * 3 * 2);
}

TEST_CASE("the page walk finds each page's run and token count", "[attention-rules]") {
  // Row 0: runs of 3 (last page 2 tokens), 0, 0 and 2 pages (full), one of 1 page (len 0: clamped to 1);
  // row 1: no entries; row 2: one empty entry; row 3: a tail (len 9: clamped to page_tokens 4).
  const std::vector<std::int64_t> indptr{0, 3, 3, 3, 5, 6, 6, 7};
  const std::vector<std::int32_t> last{2, 4, 4, 4, 0, 1, 9};
  const std::vector<std::int64_t> row_entries{0, 5, 5, 6, 7};
  const cuda::DecodeAttentionPages pages{indptr.data(), last.data(), row_entries.data(), 4};
  const std::vector<std::uint32_t> want_tokens{4, 4, 2, 4, 4, 1, 4};
  const std::vector<std::int64_t> want_entry{0, 0, 0, 3, 3, 4, 6};
  for (std::uint32_t row : {1u, 2u}) REQUIRE(cuda::decode_attention_row(pages, row).pages() == 0);
  for (std::uint32_t row : {0u, 3u}) {
    const cuda::DecodeAttentionRow r = cuda::decode_attention_row(pages, row);
    REQUIRE(r.pages() == (row == 0 ? 6u : 1u));
    // From every start page, a cursor agrees with the binary search and the
    // expected counts on every later page of the row.
    for (std::int64_t start = r.begin; start < r.end; ++start) {
      cuda::DecodeAttentionCursor cursor(pages, r, start);
      for (std::int64_t pos = start; pos < r.end; pos += 1 + (start % 2)) {
        CAPTURE(row, start, pos);
        REQUIRE(cuda::decode_attention_entry_of(pages, r, pos) == want_entry[pos]);
        REQUIRE(cuda::decode_attention_page_tokens(pages, want_entry[pos], pos) == want_tokens[pos]);
        REQUIRE(cursor.tokens_at(pages, pos) == want_tokens[pos]);
        REQUIRE(cursor.entry == want_entry[pos]);
      }
    }
  }
  // Chunks of 4 pages over row 0: slots end at the last token of the chunk's last page.
  const cuda::DecodeAttentionRow r0 = cuda::decode_attention_row(pages, 0);
  const cuda::DecodeAttentionChunk c0 = cuda::decode_attention_chunk(r0.pages(), 0, 4, 2);
  const cuda::DecodeAttentionChunk c1 = cuda::decode_attention_chunk(r0.pages(), 1, 4, 2);
  REQUIRE((c0.first == 0 && c0.last == 4 && c1.first == 4 && c1.last == 6));
  REQUIRE(cuda::decode_attention_chunk_slots(pages, r0, c0) == 16);
  REQUIRE(cuda::decode_attention_chunk_slots(pages, r0, c1) == 5);
  REQUIRE(cuda::decode_attention_chunk_slots(pages, r0, cuda::decode_attention_chunk(r0.pages(), 0, 3, 3)) == 10);
  // A chunk past the row's end (max_pages overstated) is empty; the last chunk runs to the end (understated).
  REQUIRE(cuda::decode_attention_chunk_slots(pages, r0, cuda::decode_attention_chunk(r0.pages(), 2, 4, 3)) == 0);
  REQUIRE(cuda::decode_attention_chunk(r0.pages(), 0, 2, 1).last == 6);
  // Without row_entries, entry r is row r.
  const cuda::DecodeAttentionPages one{indptr.data(), last.data(), nullptr, 4};
  const cuda::DecodeAttentionRow r4 = cuda::decode_attention_row(one, 4);
  REQUIRE((r4.first_entry == 4 && r4.end_entry == 5 && r4.begin == 5 && r4.end == 6));
}

TEST_CASE("host emulation of the split-K kernel over a plan's runs matches decode_attention", "[attention-rules]") {
  std::mt19937 rng(64);
  int cases = 0;
  for (const DType dtype : {DType::f32, DType::f16, DType::bf16}) {
    for (const std::uint32_t head_dim : {64u, 128u}) {
      for (const std::uint32_t group : {1u, 4u, 12u}) {
        for (const std::uint32_t page_tokens : {16u, 5u}) {
          for (const bool with_extra : {false, true}) {
            const PageLayout layout{page_tokens, head_dim, dtype};
            const std::uint32_t batch = 2 + rng() % 2;
            const std::uint32_t kv_heads = group == 12 ? 2 : 2 + rng() % 2;  // >= 4 rows: every row kind
            const Batch b = random_runs_batch(rng, batch, kv_heads, group, layout, with_extra);
            std::vector<float> want_out, want_lse;
            reference_attention(b, want_out, want_lse);
            cuda::DecodeAttentionShape shape{batch, b.q_heads, kv_heads, layout, b.max_pages, 0};
            // Automatic splits (one chunk per row, and small chunks), forced chunks that cut runs
            // anywhere, and max_pages understated (the last chunk runs to each row's end).
            struct Split {
              std::uint32_t chunk_pages, target, understate;
            };
            for (const Split s : {Split{0, 1, 0}, Split{0, 4096, 0}, Split{1, 0, 0}, Split{2, 0, 0}, Split{3, 0, 7},
                                  Split{5, 0, 0}, Split{0, 4096, 9}}) {
              shape.chunk_pages = s.chunk_pages;
              shape.max_pages = b.max_pages > s.understate ? b.max_pages - s.understate : 0;
              const cuda::DecodeAttentionSplit split = cuda::split_decode_attention(shape, s.target);
              std::vector<float> got_out, got_lse;
              emulate_split_k(b, split, got_out, got_lse);
              CAPTURE(to_string(dtype), head_dim, group, page_tokens, batch, kv_heads, with_extra, s.chunk_pages,
                      s.target, s.understate, split.chunks, split.chunk_pages, b.max_pages);
              require_close(b, got_out, got_lse, want_out, want_lse);
              ++cases;
            }
          }
        }
      }
    }
  }
  REQUIRE(cases == 3 * 2 * 3 * 2 * 2 * 7);
}

namespace {

void require_weights_close(const std::vector<float>& got, const std::vector<float>& want, std::uint32_t group) {
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < want.size(); ++i) {
    CAPTURE(i, got[i], want[i]);
    if (want[i] == 0.0f) REQUIRE(got[i] == 0.0f);  // dead and unused slots, and heads with no keys
    REQUIRE(std::abs(got[i] - want[i]) <= 1e-5f * group);
  }
}

}  // namespace

TEST_CASE("host emulation of the masked split-K kernel with slot weights matches decode_attention",
          "[attention-rules][masks]") {
  std::mt19937 rng(65);
  int cases = 0;
  for (const DType dtype : {DType::f32, DType::bf16}) {
    for (const std::uint32_t group : {1u, 4u, 12u}) {
      for (const std::uint32_t page_tokens : {16u, 5u, 64u}) {
        for (const bool runs : {false, true}) {
          const PageLayout layout{page_tokens, 64, dtype};
          const std::uint32_t batch = 2 + rng() % 2;
          const std::uint32_t kv_heads = group == 12 ? 2 : 2 + rng() % 2;
          const bool with_extra = rng() % 2 == 0;
          Batch b = runs ? random_runs_batch(rng, batch, kv_heads, group, layout, with_extra)
                         : random_batch(rng, batch, kv_heads, group, layout, with_extra);
          random_masks(b, rng);
          std::vector<float> want_out, want_lse, want_weights;
          reference_attention(b, want_out, want_lse, &want_weights);
          cuda::DecodeAttentionShape shape{batch, b.q_heads, kv_heads, layout, b.max_pages, 0};
          const auto max_indices = static_cast<std::uint32_t>(b.indices.size());
          shape.max_indices = max_indices;
          for (const std::uint32_t chunk_pages : {0u, 1u, 3u}) {
            shape.chunk_pages = chunk_pages;
            const cuda::DecodeAttentionSplit split = cuda::split_decode_attention(shape, 4096);
            std::vector<float> got_out, got_lse, got_weights;
            // 128 threads per row as the kernel, and 3 so that every thread walks several pages.
            emulate_split_k(b, split, got_out, got_lse, &got_weights, max_indices, chunk_pages == 1 ? 3 : 128);
            CAPTURE(to_string(dtype), group, page_tokens, runs, with_extra, chunk_pages, split.chunks);
            require_close(b, got_out, got_lse, want_out, want_lse);
            require_weights_close(got_weights, want_weights, group);
            ++cases;
          }
          // Positions at or past an understated max_indices get no score and no weight; the rest are unchanged.
          const std::uint32_t short_indices = max_indices / 2;
          std::vector<float> got_out, got_lse, got_weights;
          emulate_split_k(b, cuda::split_decode_attention(shape, 4096), got_out, got_lse, &got_weights, short_indices);
          REQUIRE(got_weights.size() == std::size_t{short_indices} * page_tokens);
          require_weights_close(
              got_weights,
              std::vector<float>(want_weights.begin(), want_weights.begin() + std::ptrdiff_t(got_weights.size())),
              group);
        }
      }
    }
  }
  REQUIRE(cases == 2 * 3 * 3 * 2 * 3);
}
