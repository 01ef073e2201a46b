// fold_page (attention/page_fold.hpp) on every Highway target this build has,
// against the scalar reference fold_page_scalar: random head sizes (vector
// tails included), GQA groups 1-12, pages of 1-64 slots, live masks, fp32 /
// fp16 / bf16 / q8_0, up to 12 pages folded in turn into non-empty states, one at a
// time or in multi-page tiles (fold_pages). Outputs
// (acc / sum), log-sum-exps and slot scores agree within 1e-5 relative. A
// target the CPU lacks is reported skipped: with SPARSEKV_FOLD_TARGET=<name>
// (ctest fold-page-<name>) the process exits 77, else a warning names it.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "sparsekv/attention/page_fold.hpp"
#include "sparsekv/core/convert.hpp"
#include "sparsekv/core/numeric.hpp"

using namespace sparsekv;

namespace {

struct Heads {
  std::vector<SoftmaxState> states;
  std::vector<float> acc, weights, scores;
};

Heads start(std::mt19937& rng, std::uint32_t group, std::uint32_t d, std::uint32_t pt) {
  Heads h;
  std::normal_distribution<float> normal;
  h.states.resize(group);
  h.acc.resize(std::size_t{group} * d);
  // A state that already folded something: max around 1, a positive sum.
  for (auto& s : h.states) s = {normal(rng), 1.0f + std::abs(normal(rng))};
  for (auto& a : h.acc) a = normal(rng);
  h.weights.resize(page_fold_scratch_floats(pt));
  h.scores.resize(std::size_t{pt} * group);
  return h;
}

bool close(float got, float want) {
  if (std::isinf(want)) return got == want;
  return std::abs(got - want) <= 1e-5f * std::max(1.0f, std::abs(want));
}

// fold_page's arguments over h's arrays.
PageFold fold_over(Heads& h, const PageLayout& layout, std::uint32_t group, const std::vector<float>& q, bool scored) {
  PageFold f;
  f.layout = layout;
  f.group = group;
  f.scale = 1.0f / std::sqrt(static_cast<float>(layout.head_dim));
  f.q = q.data();
  f.states = h.states.data();
  f.acc = h.acc.data();
  f.weights = h.weights.data();
  f.scores = scored ? h.scores.data() : nullptr;
  return f;
}

// One random case on the current target: `pages` pages folded into the same
// states, one page at a time (fold_page) or in tiles of consecutive pages
// (fold_pages, up to fold_tile_tokens slots, cut at random as a chunk's
// pages are cut), against the reference one slot at a time.
void check_case(std::mt19937& rng) {
  const DType dtypes[] = {DType::f32, DType::f16, DType::bf16, DType::q8_0};
  const std::uint32_t dims[] = {4, 8, 16, 24, 32, 40, 64, 96, 128, 136, 160, 256};
  const std::uint32_t d = dims[rng() % std::size(dims)];
  const std::uint32_t group = 1 + rng() % 12;
  const std::uint32_t pt = 1 + rng() % 64;
  const DType dtype = dtypes[rng() % (d % kQ8BlockValues == 0 ? 4 : 3)];
  const PageLayout layout{pt, d, dtype};
  const std::uint32_t pages = 1 + rng() % 12;
  const bool scored = rng() % 2 == 0;
  const bool tiled = rng() % 2 == 0;
  CAPTURE(d, group, pt, to_string(dtype), pages, scored, tiled);
  std::normal_distribution<float> normal;
  std::vector<std::byte> data(pages * layout.page_bytes());
  const std::size_t rows = data.size() / layout.row_bytes();
  std::vector<float> values(rows * d);
  for (float& x : values) x = 1.5f * normal(rng);
  convert_rows(values.data(), DType::f32, data.data(), dtype, rows, d);
  std::vector<float> q(std::size_t{group} * d);
  for (auto& x : q) x = normal(rng);
  std::vector<FoldPageRef> refs(pages);
  for (std::uint32_t p = 0; p < pages; ++p) {
    refs[p].data = data.data() + p * layout.page_bytes();
    refs[p].tokens = 1 + rng() % pt;
    if (rng() % 3 == 0) refs[p].live = (SlotMask{rng()} << 32 | rng());  // some slots dead, maybe all
  }
  Heads want = start(rng, group, d, pt), got = want;
  want.scores.assign(std::size_t{pages} * pt * group, 0.0f);
  got.scores = want.scores;
  const auto fold_of = [&](Heads& h, std::uint32_t p) {
    PageFold f = fold_over(h, layout, group, q, scored);
    if (scored) f.scores = h.scores.data() + std::size_t{p} * pt * group;
    return f;
  };
  for (std::uint32_t p = 0; p < pages; ++p)
    fold_page_scalar(fold_of(want, p), refs[p].data, refs[p].tokens, refs[p].live);
  for (std::uint32_t p = 0; p < pages;) {
    std::uint32_t count = 1, tokens = refs[p].tokens;
    while (tiled && p + count < pages && tokens + refs[p + count].tokens <= fold_tile_tokens(layout) &&
           rng() % 4 != 0) {
      tokens += refs[p + count++].tokens;
    }
    const std::byte* next = p + count < pages ? refs[p + count].data : nullptr;
    if (count == 1 && rng() % 2 == 0) {
      fold_page(fold_of(got, p), refs[p].data, refs[p].tokens, refs[p].live, next);
    } else {
      fold_pages(fold_of(got, p), std::span(refs).subspan(p, count), next);
    }
    p += count;
  }
  if (scored) {
    for (std::size_t i = 0; i < want.scores.size(); ++i) {
      CAPTURE(i);
      REQUIRE(close(got.scores[i], want.scores[i]));
    }
  }
  for (std::uint32_t g = 0; g < group; ++g) {
    CAPTURE(g);
    REQUIRE(close(softmax_lse(got.states[g]), softmax_lse(want.states[g])));
    for (std::uint32_t j = 0; j < d; ++j) {
      const std::size_t i = std::size_t{g} * d + j;
      REQUIRE(close(softmax_output(got.acc[i], got.states[g]), softmax_output(want.acc[i], want.states[g])));
    }
  }
}

// A NaN K element makes every head's state NaN, on the vector path as in the
// reference (a vector max may drop a NaN; the fold must not).
void check_nan_case(std::uint32_t group, std::uint32_t pt, std::uint32_t nan_slot) {
  const std::uint32_t d = 64;
  const PageLayout layout{pt, d, DType::f32};
  std::mt19937 rng(group * 131 + pt);
  std::normal_distribution<float> normal;
  std::vector<std::byte> page(layout.page_bytes());
  for (std::uint32_t i = 0; i < 2 * pt * d; ++i) store_element(page.data(), i, DType::f32, normal(rng));
  store_element(page.data() + layout.k_offset(nan_slot), 3, DType::f32, std::numeric_limits<float>::quiet_NaN());
  std::vector<float> q(std::size_t{group} * d);
  for (auto& x : q) x = normal(rng);
  Heads want = start(rng, group, d, pt), got = want;
  const auto fold_of = [&](Heads& h) { return fold_over(h, layout, group, q, false); };
  fold_page_scalar(fold_of(want), page.data(), pt, full_slot_mask(pt));
  fold_page(fold_of(got), page.data(), pt, full_slot_mask(pt), nullptr);
  for (std::uint32_t g = 0; g < group; ++g) {
    CAPTURE(group, pt, nan_slot, g, got.states[g].max, got.states[g].sum, want.states[g].max, want.states[g].sum);
    REQUIRE(std::isnan(softmax_lse(want.states[g])));
    REQUIRE(std::isnan(softmax_lse(got.states[g])));
    REQUIRE(std::isnan(softmax_output(got.acc[std::size_t{g} * d], got.states[g])));
  }
}

}  // namespace

TEST_CASE("fold_page equals the scalar reference on every target the CPU has", "[fold-page]") {
  const char* only = std::getenv("SPARSEKV_FOLD_TARGET");
  std::uint32_t ran = 0;
  const std::vector<FoldTarget> targets = fold_page_targets();
  if (only != nullptr &&
      std::none_of(targets.begin(), targets.end(), [&](const FoldTarget& t) { return t.name == only; })) {
    std::printf("fold_page: target %s is not compiled in this build: skipped\n", only);
    std::exit(77);
  }
  for (const FoldTarget& t : targets) {
    if (only != nullptr && t.name != only) continue;
    if (!t.supported) {
      if (only != nullptr) {
        std::printf("fold_page: this CPU lacks %s: skipped\n", t.name.c_str());
        std::exit(77);
      }
      WARN("fold_page target " << t.name << ": skipped, this CPU lacks it");
      continue;
    }
    INFO("target " << t.name);
    use_fold_page_target(t.bits);
    REQUIRE(fold_page_target() == t.name);
    std::mt19937 rng(17);
    for (int i = 0; i < 300; ++i) check_case(rng);
    for (const std::uint32_t group : {1u, 3u, 4u, 8u, 12u}) {
      for (const std::uint32_t pt : {1u, 8u, 16u, 64u}) check_nan_case(group, pt, pt / 2);
    }
    ++ran;
  }
  use_fold_page_target(0);
  REQUIRE(ran > 0);
}

TEST_CASE("fold_pages refuses a tile past its slots, changing nothing", "[fold-page]") {
  const PageLayout layout{16, 64, DType::f16};
  const std::uint32_t group = 3;
  std::mt19937 rng(3);
  std::normal_distribution<float> normal;
  std::vector<std::byte> data(8 * layout.page_bytes());
  for (std::size_t i = 0; i < data.size() / 2; ++i)
    store_element(data.data(), static_cast<std::uint32_t>(i), DType::f16, normal(rng));
  std::vector<float> q(std::size_t{group} * layout.head_dim);
  for (auto& x : q) x = normal(rng);
  Heads h = start(rng, group, layout.head_dim, layout.page_tokens);
  const Heads before = h;
  const PageFold f = fold_over(h, layout, group, q, false);
  const auto unchanged = [&] {
    for (std::uint32_t g = 0; g < group; ++g) {
      if (h.states[g].max != before.states[g].max || h.states[g].sum != before.states[g].sum) return false;
    }
    return h.acc == before.acc;
  };
  const std::uint32_t fit = fold_tile_tokens(layout) / layout.page_tokens;  // pages that fill a tile
  REQUIRE(fit + 1 <= 8);
  std::vector<FoldPageRef> refs;
  for (std::uint32_t p = 0; p <= fit; ++p) refs.push_back({data.data() + p * layout.page_bytes(), layout.page_tokens});
  CHECK_THROWS_WITH(fold_pages(f, refs, nullptr), Catch::Contains("at most " + std::to_string(fit * 16)));
  CHECK(unchanged());
  refs[0].tokens = layout.page_tokens + 1;
  CHECK_THROWS_WITH(fold_pages(f, std::span(refs).first(1), nullptr), Catch::Contains("a page holds 17 tokens"));
  CHECK(unchanged());
  refs[0].tokens = layout.page_tokens;
  CHECK_NOTHROW(fold_pages(f, std::span(refs).first(fit), nullptr));
  CHECK_FALSE(unchanged());
}
