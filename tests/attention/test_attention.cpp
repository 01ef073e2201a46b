// Host decode attention (with live-slot masks and slot weights, SpvLLM §2
// / H2O), dtype conversions, HostBackend::attend over an AttendPlan with
// masks, and Dense through the whole pipeline (policy -> offload -> retrieve
// -> attend) against a naive reference.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "attention_test_data.hpp"
#include "sparse_pipeline.hpp"
#include "sparsekv/attention/decode_attention.hpp"
#include "sparsekv/core/numeric.hpp"
#include "sparsekv/facade/host_backend.hpp"
#include "sparsekv/policy/dense.hpp"
#include "sparsekv/policy/streaming_window.hpp"
#include "test_support.hpp"

using namespace sparsekv;

namespace {

// softmax(q.K^T * scale) V for one q head over explicit rows.
std::vector<float> naive_attention(const float* q, const std::vector<const float*>& keys,
                                   const std::vector<const float*>& values, std::uint32_t d) {
  const float scale = 1.0f / std::sqrt(float(d));
  std::vector<double> scores;
  double max = -1e300;
  for (const float* k : keys) {
    double s = 0;
    for (std::uint32_t i = 0; i < d; ++i) s += double(q[i]) * k[i];
    scores.push_back(s * scale);
    max = std::max(max, scores.back());
  }
  std::vector<double> acc(d, 0.0);
  double sum = 0;
  for (std::size_t t = 0; t < keys.size(); ++t) {
    const double p = std::exp(scores[t] - max);
    sum += p;
    for (std::uint32_t i = 0; i < d; ++i) acc[i] += p * values[t][i];
  }
  std::vector<float> out(d);
  for (std::uint32_t i = 0; i < d; ++i) out[i] = float(acc[i] / sum);
  return out;
}

float max_relative_error(const std::vector<float>& got, const std::vector<float>& want) {
  float num = 0, den = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    num = std::max(num, std::abs(got[i] - want[i]));
    den = std::max(den, std::abs(want[i]));
  }
  return num / std::max(den, 1e-30f);
}

}  // namespace

TEST_CASE("fp16 and bf16 conversions round to nearest even", "[attention][numeric]") {
  REQUIRE(float_to_f16(1.0f) == 0x3c00);
  REQUIRE(float_to_f16(-2.5f) == 0xc100);
  REQUIRE(float_to_f16(65504.0f) == 0x7bff);
  REQUIRE(float_to_f16(65520.0f) == 0x7c00);               // rounds past the largest finite half
  REQUIRE(float_to_f16(std::ldexp(1.0f, -24)) == 0x0001);  // smallest subnormal
  REQUIRE(float_to_f16(std::ldexp(1.5f, -24)) == 0x0002);  // tie -> even
  REQUIRE(f16_to_float(0x0001) == std::ldexp(1.0f, -24));
  REQUIRE(f16_to_float(0x3555) == Approx(0.333251953125f).epsilon(0));
  REQUIRE(std::isnan(f16_to_float(float_to_f16(std::nanf("")))));
  REQUIRE(float_to_bf16(1.0f) == 0x3f80);
  REQUIRE(float_to_bf16(bits_float(0x3f808000u)) == 0x3f80);  // tie -> even
  REQUIRE(float_to_bf16(bits_float(0x3f818000u)) == 0x3f82);
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  for (int i = 0; i < 10000; ++i) {
    const float x = normal(rng);
    REQUIRE(std::abs(f16_to_float(float_to_f16(x)) - x) <= std::abs(x) * 0x1p-11f + 0x1p-24f);
    REQUIRE(std::abs(bf16_to_float(float_to_bf16(x)) - x) <= std::abs(x) * 0x1p-8f);
  }
}

TEST_CASE("AttentionPartial merges disjoint key sets exactly", "[attention]") {
  std::mt19937 rng(2);
  std::normal_distribution<float> normal;
  const std::uint32_t d = 4;
  AttentionPartial whole(d), a(d), b(d);
  for (int t = 0; t < 50; ++t) {
    const float score = normal(rng) * 5;
    const float v[d] = {normal(rng), normal(rng), normal(rng), normal(rng)};
    whole.add(score, 1.0f, v);
    (t % 3 == 0 ? a : b).add(score, 1.0f, v);
  }
  a.merge(b);
  std::vector<float> x(d), y(d);
  whole.write_output(x.data());
  a.write_output(y.data());
  REQUIRE(max_relative_error(y, x) < 1e-6f);
  REQUIRE(a.log_sum_exp() == Approx(whole.log_sum_exp()).epsilon(1e-6));
  // A weighted add is `weight` keys of one score whose values sum to value_sum.
  AttentionPartial cluster(d), keys(d);
  const float v[d] = {1.0f, -2.0f, 0.5f, 3.0f};
  const float three_v[d] = {3.0f, -6.0f, 1.5f, 9.0f};
  cluster.add(0.7f, 3.0f, three_v);
  for (int i = 0; i < 3; ++i) keys.add(0.7f, 1.0f, v);
  keys.add(-1.0f, 1.0f, three_v);
  cluster.add(-1.0f, 1.0f, three_v);
  std::vector<float> c(d), k(d);
  cluster.write_output(c.data());
  keys.write_output(k.data());
  REQUIRE(max_relative_error(c, k) < 1e-6f);
  REQUIRE(cluster.log_sum_exp() == Approx(keys.log_sum_exp()).epsilon(1e-6));
  AttentionPartial empty(d);
  a.merge(empty);
  REQUIRE(a.log_sum_exp() == Approx(whole.log_sum_exp()).epsilon(1e-6));
}

TEST_CASE("decode_attention over scattered partial pages matches a naive reference", "[attention]") {
  const std::uint32_t d = 16, q_heads = 6, kv_heads = 2;
  for (const DType dtype : {DType::f32, DType::f16, DType::bf16}) {
    const PageLayout layout{8, d, dtype};
    std::mt19937 rng(3);
    std::normal_distribution<float> normal;
    std::vector<std::vector<std::byte>> pages;
    std::vector<HeadKv> kv(kv_heads);
    std::vector<std::vector<std::vector<float>>> keys(kv_heads), values(kv_heads);  // rounded to dtype
    for (std::uint32_t h = 0; h < kv_heads; ++h) {
      for (int p = 0; p < 7; ++p) {
        pages.emplace_back(layout.page_bytes());
        const std::uint32_t tokens = 1 + rng() % 8;
        for (std::uint32_t t = 0; t < tokens; ++t) {
          std::vector<float> k(d), v(d);
          for (std::uint32_t i = 0; i < d; ++i) {
            store_element(pages.back().data() + layout.k_offset(t), i, dtype, normal(rng));
            store_element(pages.back().data() + layout.v_offset(t), i, dtype, normal(rng));
            k[i] = load_element(pages.back().data() + layout.k_offset(t), i, dtype);
            v[i] = load_element(pages.back().data() + layout.v_offset(t), i, dtype);
          }
          keys[h].push_back(k);
          values[h].push_back(v);
        }
        kv[h].add(nullptr, tokens);
      }
    }
    // Addresses only after `pages` stopped growing.
    for (std::uint32_t h = 0, n = 0; h < kv_heads; ++h)
      for (auto& page : kv[h].pages) page = pages[n++].data();
    std::vector<float> q(q_heads * d), out(q_heads * d), lse(q_heads);
    for (float& x : q) x = normal(rng);
    decode_attention(layout, q_heads, 1.0f / std::sqrt(float(d)), q.data(), kv, {}, out.data(), lse.data());
    for (std::uint32_t h = 0; h < q_heads; ++h) {
      const std::uint32_t g = h / (q_heads / kv_heads);
      std::vector<const float*> k, v;
      for (auto& row : keys[g]) k.push_back(row.data());
      for (auto& row : values[g]) v.push_back(row.data());
      const auto want = naive_attention(q.data() + h * d, k, v, d);
      const std::vector<float> got(out.begin() + h * d, out.begin() + (h + 1) * d);
      REQUIRE(max_relative_error(got, want) < 1e-5f);
      REQUIRE(std::isfinite(lse[h]));
    }
  }
}

namespace {

// One kv head's pages with random tokens and live masks, the rows rounded to
// the dtype, and the same live rows compacted into dense pages (no masks).
struct MaskedHead {
  std::vector<std::vector<std::byte>> pages, compact_pages;
  std::vector<std::uint32_t> tokens;
  std::vector<SlotMask> live;
  std::vector<std::vector<float>> keys, values;  // live rows in (page, slot) order
  std::vector<std::size_t> live_slot;            // page * page_tokens + slot of each live row

  HeadKv masked() const {
    HeadKv kv;
    for (std::size_t p = 0; p < pages.size(); ++p) kv.add(pages[p].data(), tokens[p], live[p]);
    return kv;
  }
  HeadKv compacted(const PageLayout& layout) const {
    HeadKv kv;
    for (std::size_t p = 0; p < compact_pages.size(); ++p)
      kv.add(compact_pages[p].data(),
             std::min<std::uint32_t>(layout.page_tokens, std::uint32_t(keys.size() - p * layout.page_tokens)));
    return kv;
  }
};

MaskedHead random_masked_head(std::mt19937& rng, const PageLayout& layout, std::uint32_t page_count, bool all_dead) {
  std::normal_distribution<float> normal;
  const std::uint32_t d = layout.head_dim, pt = layout.page_tokens;
  MaskedHead h;
  for (std::uint32_t p = 0; p < page_count; ++p) {
    h.pages.emplace_back(layout.page_bytes());
    // A quarter of the pages full; dead bits past the token count must be ignored.
    h.tokens.push_back(rng() % 4 == 0 ? pt : 1 + std::uint32_t(rng() % pt));
    const std::uint32_t kind = rng() % 6;
    const SlotMask bits = (SlotMask{rng()} << 32) | rng();
    h.live.push_back(all_dead || kind == 0 ? SlotMask{0} : kind == 1 ? ~SlotMask{0} : bits);
    for (std::uint32_t t = 0; t < pt; ++t) {
      std::byte* page = h.pages.back().data();
      std::vector<float> k(d), v(d);
      for (std::uint32_t i = 0; i < d; ++i) {
        store_element(page + layout.k_offset(t), i, layout.dtype, normal(rng));
        store_element(page + layout.v_offset(t), i, layout.dtype, normal(rng));
        k[i] = load_element(page + layout.k_offset(t), i, layout.dtype);
        v[i] = load_element(page + layout.v_offset(t), i, layout.dtype);
      }
      if (t < h.tokens.back() && slot_live(h.live.back(), t)) {
        h.keys.push_back(k);
        h.values.push_back(v);
        h.live_slot.push_back(std::size_t{p} * pt + t);
      }
    }
  }
  for (std::size_t r = 0; r < h.keys.size(); ++r) {
    if (r % pt == 0) h.compact_pages.emplace_back(layout.page_bytes());
    std::byte* page = h.compact_pages.back().data();
    const auto t = std::uint32_t(r % pt);
    for (std::uint32_t i = 0; i < d; ++i) {
      store_element(page + layout.k_offset(t), i, layout.dtype, h.keys[r][i]);
      store_element(page + layout.v_offset(t), i, layout.dtype, h.values[r][i]);
    }
  }
  return h;
}

// Scores q.k * scale of one q head over rows, in double.
std::vector<double> exact_scores(const float* q, const std::vector<std::vector<float>>& keys, double scale) {
  std::vector<double> s;
  for (const auto& k : keys) {
    double dot = 0;
    for (std::size_t i = 0; i < k.size(); ++i) dot += double(q[i]) * k[i];
    s.push_back(dot * scale);
  }
  return s;
}

double exact_lse(const std::vector<double>& scores) {
  if (scores.empty()) return -INFINITY;
  const double m = *std::max_element(scores.begin(), scores.end());
  double sum = 0;
  for (double x : scores) sum += std::exp(x - m);
  return m + std::log(sum);
}

}  // namespace

TEST_CASE("decode_attention over live slots is dense attention over exactly the live rows", "[attention][masks]") {
  int cases = 0;
  for (const DType dtype : {DType::f32, DType::f16, DType::bf16}) {
    for (const std::uint32_t page_tokens : {8u, 5u, 64u}) {
      for (const std::uint32_t group : {1u, 3u, 4u}) {
        std::mt19937 rng(100 + cases);
        const PageLayout layout{page_tokens, 16, dtype};
        const std::uint32_t kv_heads = 3, q_heads = kv_heads * group, d = layout.head_dim;
        const float scale = (rng() % 2 ? 4.0f : 1.0f) / std::sqrt(float(d));
        std::vector<MaskedHead> heads;
        // kv head 2 has every slot dead: it attends to nothing.
        for (std::uint32_t h = 0; h < kv_heads; ++h)
          heads.push_back(random_masked_head(rng, layout, 1 + std::uint32_t(rng() % 9), h == 2));
        std::vector<HeadKv> masked, compact;
        std::size_t total_pages = 0;
        for (const MaskedHead& h : heads) {
          masked.push_back(h.masked());
          compact.push_back(h.compacted(layout));
          total_pages += h.pages.size();
        }
        std::normal_distribution<float> normal;
        std::vector<float> q(q_heads * d);
        for (float& x : q) x = normal(rng);
        std::vector<float> out(q.size()), lse(q_heads), weights(total_pages * page_tokens, -1.0f);
        std::vector<float> compact_out(q.size()), compact_lse(q_heads), plain_out(q.size()), plain_lse(q_heads);
        decode_attention(layout, q_heads, scale, q.data(), masked, {}, out.data(), lse.data(), weights);
        decode_attention(layout, q_heads, scale, q.data(), compact, {}, compact_out.data(), compact_lse.data());
        // Without weights the same pass gives the same bits.
        decode_attention(layout, q_heads, scale, q.data(), masked, {}, plain_out.data(), plain_lse.data());
        CAPTURE(to_string(dtype), page_tokens, group);
        // The same live rows in the same order fold identically.
        REQUIRE(out == compact_out);
        REQUIRE(lse == compact_lse);
        REQUIRE(out == plain_out);
        REQUIRE(lse == plain_lse);
        std::size_t first_slot = 0;
        for (std::uint32_t kh = 0; kh < kv_heads; ++kh) {
          const MaskedHead& h = heads[kh];
          const std::size_t slots = h.pages.size() * page_tokens;
          std::vector<double> want_weight(slots, 0.0);
          for (std::uint32_t j = 0; j < group; ++j) {
            const std::uint32_t qh = kh * group + j;
            CAPTURE(kh, j, h.keys.size());
            const std::vector<float> got(out.begin() + qh * d, out.begin() + (qh + 1) * d);
            if (h.keys.empty()) {
              REQUIRE(got == std::vector<float>(d, 0.0f));
              REQUIRE(lse[qh] == -INFINITY);
              continue;
            }
            // Naive dense attention over the compacted live rows, in double.
            const std::vector<double> s = exact_scores(q.data() + qh * d, h.keys, scale);
            const double l = exact_lse(s);
            std::vector<float> want(d);
            for (std::uint32_t i = 0; i < d; ++i) {
              double acc = 0;
              for (std::size_t r = 0; r < s.size(); ++r) acc += std::exp(s[r] - l) * h.values[r][i];
              want[i] = float(acc);
            }
            // fp32 online softmax over up to ~500 rows vs double.
            REQUIRE(max_relative_error(got, want) <= 2e-6f);
            REQUIRE(std::abs(lse[qh] - l) <= 1e-6 * std::max(1.0, std::abs(l)));
            for (std::size_t r = 0; r < s.size(); ++r) want_weight[h.live_slot[r]] += std::exp(s[r] - l);
          }
          double sum = 0;
          for (std::size_t slot = 0; slot < slots; ++slot) {
            const float got = weights[first_slot + slot];
            CAPTURE(kh, slot);
            if (want_weight[slot] == 0.0) REQUIRE(got == 0.0f);  // dead or unused: exactly 0
            REQUIRE(std::abs(got - want_weight[slot]) <= 1e-6 * group);
            sum += got;
          }
          REQUIRE(std::abs(sum - (h.keys.empty() ? 0.0 : double(group))) <= 1e-5 * group);
          first_slot += slots;
        }
        ++cases;
      }
    }
  }
  REQUIRE(cases == 3 * 3 * 3);
}

TEST_CASE("slot weights are measured against the lse with the extra term merged", "[attention][masks]") {
  std::mt19937 rng(7);
  const PageLayout layout{8, 16, DType::f32};
  const std::uint32_t group = 2, d = layout.head_dim;
  std::vector<MaskedHead> heads{random_masked_head(rng, layout, 6, false)};
  while (heads[0].keys.empty()) heads[0] = random_masked_head(rng, layout, 6, false);
  const std::vector<HeadKv> kv{heads[0].masked()};
  std::normal_distribution<float> normal;
  std::vector<float> q(group * d), value(d);
  for (float& x : q) x = normal(rng);
  for (float& x : value) x = normal(rng);
  std::vector<AttentionPartial> extra(group, AttentionPartial(d));
  extra[0].add(1.5f, 3.0f, value.data());  // head 1 has no term
  std::vector<float> out(q.size()), lse(group), weights(6 * 8);
  const float scale = 0.25f;
  decode_attention(layout, group, scale, q.data(), kv, extra, out.data(), lse.data(), weights);
  double want_sum = 0;
  for (std::uint32_t j = 0; j < group; ++j) {
    const std::vector<double> s = exact_scores(q.data() + j * d, heads[0].keys, scale);
    double l = exact_lse(s);
    if (j == 0) l = std::log(std::exp(l) + 3.0 * std::exp(1.5));
    REQUIRE(std::abs(lse[j] - l) <= 1e-6 * std::max(1.0, std::abs(l)));
    for (double x : s) want_sum += std::exp(x - l);
  }
  // Head 0 gives part of its mass to the extra term: the slots sum to less than the group.
  const double got_sum = std::accumulate(weights.begin(), weights.end(), 0.0);
  REQUIRE(got_sum < group - 1e-3);
  REQUIRE(std::abs(got_sum - want_sum) <= 1e-6);
  REQUIRE(softmax_weight(2.0f, -INFINITY) == 0.0f);
  REQUIRE(softmax_weight(-INFINITY, 1.0f) == 0.0f);
  REQUIRE(softmax_weight(1.0f, 1.0f) == 1.0f);
}

TEST_CASE("HeadKv keeps no masks until a page is not fully live", "[attention][masks]") {
  HeadKv kv;
  std::byte page{};
  kv.add(&page, 3);
  kv.add(&page, 8, ~SlotMask{0});
  REQUIRE(kv.live.empty());
  kv.add(&page, 8, 0b101);
  REQUIRE(kv.live == std::vector<SlotMask>{~SlotMask{0}, ~SlotMask{0}, 0b101});
  kv.add(&page, 2);
  REQUIRE(kv.live.size() == 4);
  REQUIRE(kv.live[3] == ~SlotMask{0});
  kv.clear();
  REQUIRE((kv.pages.empty() && kv.tokens.empty() && kv.live.empty()));
}

TEST_CASE("decode_attention rejects inconsistent shapes", "[attention][errors]") {
  const PageLayout layout{8, 4, DType::f32};
  std::vector<HeadKv> kv(2);
  std::vector<float> q(12), out(12);
  REQUIRE_SPARSEKV_ERROR(decode_attention(layout, 3, 1.0f, q.data(), kv, {}, out.data()), ErrorCode::invalid_argument);
  kv[0].pages.push_back(nullptr);
  REQUIRE_SPARSEKV_ERROR(decode_attention(layout, 2, 1.0f, q.data(), kv, {}, out.data()), ErrorCode::invalid_argument);
  kv[0].tokens.push_back(9);  // more than a page holds
  REQUIRE_SPARSEKV_ERROR(decode_attention(layout, 2, 1.0f, q.data(), kv, {}, out.data()), ErrorCode::invalid_argument);
  std::vector<AttentionPartial> extra(1);
  kv[0].tokens.back() = 1;
  REQUIRE_SPARSEKV_ERROR(decode_attention(layout, 2, 1.0f, q.data(), kv, extra, out.data()),
                         ErrorCode::invalid_argument);
}

TEST_CASE("decode_attention rejects bad masks and slot weights and writes nothing", "[attention][errors][masks]") {
  const PageLayout layout{8, 4, DType::f32};
  std::vector<std::byte> page(layout.page_bytes(), std::byte{0});
  std::vector<HeadKv> kv(2);
  kv[0].add(page.data(), 8, 0b11);
  kv[1].add(page.data(), 4);
  std::vector<float> q(8, 1.0f), out(8, 7.0f), lse(2, 7.0f), weights(16, 7.0f);
  const auto unchanged = [&] {
    REQUIRE(std::all_of(out.begin(), out.end(), [](float x) { return x == 7.0f; }));
    REQUIRE(std::all_of(lse.begin(), lse.end(), [](float x) { return x == 7.0f; }));
    REQUIRE(std::all_of(weights.begin(), weights.end(), [](float x) { return x == 7.0f; }));
  };
  // slot_weights of the wrong size (one page short, one slot over).
  REQUIRE_SPARSEKV_ERROR(
      decode_attention(layout, 2, 1.0f, q.data(), kv, {}, out.data(), lse.data(), std::span(weights).first(8)),
      ErrorCode::invalid_argument);
  weights.push_back(7.0f);
  REQUIRE_SPARSEKV_ERROR(decode_attention(layout, 2, 1.0f, q.data(), kv, {}, out.data(), lse.data(), weights),
                         ErrorCode::invalid_argument);
  weights.pop_back();
  unchanged();
  // Masks not parallel to the pages.
  kv[0].live.push_back(1);
  REQUIRE_SPARSEKV_ERROR(decode_attention(layout, 2, 1.0f, q.data(), kv, {}, out.data(), lse.data(), weights),
                         ErrorCode::invalid_argument);
  kv[0].live.pop_back();
  unchanged();
  // Masks cover 64 slots: pages of 65 cannot carry them.
  const PageLayout wide{65, 4, DType::f32};
  std::vector<std::byte> wide_page(wide.page_bytes(), std::byte{0});
  std::vector<HeadKv> wide_kv(1);
  wide_kv[0].add(wide_page.data(), 65, 1);
  REQUIRE_SPARSEKV_ERROR(decode_attention(wide, 1, 1.0f, q.data(), wide_kv, {}, out.data(), lse.data()),
                         ErrorCode::invalid_argument);
  unchanged();
  // attend_pages' scores: [pages * page_tokens][group].
  std::vector<AttentionPartial> states(1, AttentionPartial(4));
  std::vector<float> scores(9, 7.0f);
  REQUIRE_SPARSEKV_ERROR(attend_pages(layout, q.data(), 1.0f, kv[0], states, scores), ErrorCode::invalid_argument);
  REQUIRE(states[0].empty());
  scores.pop_back();
  attend_pages(layout, q.data(), 1.0f, kv[0], states, scores);
  REQUIRE((scores[0] == 0.0f && scores[1] == 0.0f && scores[2] == -INFINITY && scores[7] == -INFINITY));
  // The same call with the right sizes runs: kv head 0 sees slots 0 and 1 only.
  decode_attention(layout, 2, 1.0f, q.data(), kv, {}, out.data(), lse.data(), weights);
  REQUIRE(weights[0] + weights[1] == Approx(1.0f).epsilon(1e-6));
  REQUIRE(std::all_of(weights.begin() + 2, weights.begin() + 8, [](float x) { return x == 0.0f; }));
  REQUIRE(std::accumulate(weights.begin() + 8, weights.end(), 0.0f) == Approx(1.0f).epsilon(1e-6));
}

TEST_CASE("HostBackend::attend honours AttendPlan::live_masks and fills AttendCall::slot_weights",
          "[attention][masks][backend]") {
  std::mt19937 rng(31);
  for (const std::uint32_t group : {1u, 4u}) {
    test::AttentionBatch b = test::random_runs_batch(rng, 3, 2, group, PageLayout{8, 16, DType::bf16}, false);
    test::random_masks(b, rng);
    std::vector<float> want_out, want_lse, want_weights;
    test::reference_attention(b, want_out, want_lse, &want_weights);
    AttendPlan plan = test::attend_plan_of(b, b.pool.data());
    AttendCall call = test::attend_call_of(b, plan);
    std::vector<float> out(want_out.size(), -1.0f), weights(b.indices.size() * 8, -1.0f);
    call.out = out.data();
    call.slot_weights = weights.data();
    HostBackend backend;
    backend.attend(call);
    CAPTURE(group);
    // HostBackend's Attend is the vectorized fold (attention/page_fold.hpp):
    // within 1e-5 relative of the scalar reference, and a dead or unused
    // slot's weight exactly 0 as there.
    const auto close = [](float got, float want) {
      return std::abs(got - want) <= 1e-5f * std::max(1.0f, std::abs(want));
    };
    REQUIRE(out.size() == want_out.size());
    for (std::size_t i = 0; i < out.size(); ++i) REQUIRE(close(out[i], want_out[i]));
    REQUIRE(weights.size() == want_weights.size());
    for (std::size_t i = 0; i < weights.size(); ++i) {
      REQUIRE(close(weights[i], want_weights[i]));
      REQUIRE((weights[i] == 0.0f) == (want_weights[i] == 0.0f));
    }
    // Every row that attends to something gives its group a total weight of `group`.
    for (std::uint32_t row = 0; row < b.batch * b.kv_heads; ++row) {
      const std::int64_t first = b.indptr[b.row_entries[row]], end = b.indptr[b.row_entries[row + 1]];
      const double sum = std::accumulate(weights.begin() + first * 8, weights.begin() + end * 8, 0.0);
      REQUIRE((sum == 0.0 || std::abs(sum - group) <= 1e-5 * group));
    }
    // The masks matter: all live gives another answer, equal to the unmasked plan's.
    std::vector<float> unmasked(out.size()), all_live(out.size());
    plan.live_masks.assign(plan.indices.size(), ~SlotMask{0});
    call.out = all_live.data();
    call.slot_weights = nullptr;
    backend.attend(call);
    plan.live_masks.clear();
    call.out = unmasked.data();
    backend.attend(call);
    REQUIRE(all_live == unmasked);
    REQUIRE(unmasked != out);
    // live_masks not parallel to indices: refused before anything is written.
    plan.live_masks.assign(plan.indices.size() - 1, 0);
    std::fill(out.begin(), out.end(), 7.0f);
    std::fill(weights.begin(), weights.end(), 7.0f);
    call.out = out.data();
    call.slot_weights = weights.data();
    REQUIRE_SPARSEKV_ERROR(backend.attend(call), ErrorCode::invalid_argument);
    REQUIRE(std::all_of(out.begin(), out.end(), [](float x) { return x == 7.0f; }));
    REQUIRE(std::all_of(weights.begin(), weights.end(), [](float x) { return x == 7.0f; }));
    plan.clear();
    REQUIRE(plan.live_masks.empty());
  }
}

namespace {

// Runs prefill + decode through the pipeline and compares every step with
// naive attention over all tokens so far; returns the worst relative error.
float pipeline_error(AnyPolicy policy, std::uint32_t prompt, std::uint32_t steps) {
  const ModelShape shape{2, 4, 2, 16, DType::f32};
  const std::uint32_t d = shape.head_dim, kvh = shape.kv_heads;
  tools::SparsePipeline pipeline(shape, std::move(policy), prompt + steps);
  std::mt19937 rng(4);
  std::normal_distribution<float> normal;
  std::vector<std::vector<float>> keys(shape.layers), values(shape.layers);  // [token][head][d]
  const auto grow = [&](std::uint32_t layer, std::uint32_t tokens) {
    for (std::uint32_t i = 0; i < tokens * kvh * d; ++i) {
      keys[layer].push_back(normal(rng));
      values[layer].push_back(normal(rng));
    }
  };
  for (std::uint32_t l = 0; l < shape.layers; ++l) {
    grow(l, prompt);
    pipeline.prefill(l, KvView{keys[l], values[l], prompt, kvh, d, 0});
  }
  float worst = 0;
  std::vector<float> q(shape.q_heads * d), out(q.size());
  for (std::uint32_t s = 0; s < steps; ++s) {
    for (std::uint32_t l = 0; l < shape.layers; ++l) {
      grow(l, 1);
      const std::size_t last = keys[l].size() - kvh * d;
      pipeline.append(l, keys[l].data() + last, values[l].data() + last);
      for (float& x : q) x = normal(rng);
      pipeline.attend(l, DecodeQuery{q, prompt + s}, out.data());
      const std::uint32_t tokens = prompt + s + 1;
      for (std::uint32_t h = 0; h < shape.q_heads; ++h) {
        const std::uint32_t g = h / shape.group_size();
        std::vector<const float*> k, v;
        for (std::uint32_t t = 0; t < tokens; ++t) {
          k.push_back(keys[l].data() + (std::size_t{t} * kvh + g) * d);
          v.push_back(values[l].data() + (std::size_t{t} * kvh + g) * d);
        }
        const auto want = naive_attention(q.data() + h * d, k, v, d);
        worst = std::max(worst, max_relative_error({out.begin() + h * d, out.begin() + (h + 1) * d}, want));
      }
    }
  }
  return worst;
}

}  // namespace

TEST_CASE("Dense through the pipeline equals naive attention to 1e-5 in fp32", "[attention][policy]") {
  REQUIRE(pipeline_error(AnyPolicy(DensePolicy{}), 101, 40) < 1e-5f);
}

TEST_CASE("StreamingWindow with a budget covering the context equals Dense", "[attention][policy]") {
  REQUIRE(pipeline_error(AnyPolicy(StreamingWindowPolicy({4096, 4})), 101, 40) < 1e-5f);
  // A small budget is no longer exact: the comparison can fail.
  REQUIRE(pipeline_error(AnyPolicy(StreamingWindowPolicy({32, 4})), 101, 8) > 1e-3f);
}

TEST_CASE("StreamingWindow keeps the sinks and the newest pages within its budget", "[policy]") {
  StreamingWindowPolicy policy({40, 4});  // 5 pages: 1 sink page + 4 newest
  const LayerContext ctx{0, 1, 2, 2, 4, 8, 160};
  StreamingWindowPolicy::LayerState state;
  std::vector<float> kv(160 * 2 * 4);
  policy.index(ctx, KvView{kv, kv, 160, 2, 4, 0}, state);
  Selection s;
  policy.select(ctx, DecodeQuery{}, state, s);
  REQUIRE(s.partitions[1] == std::vector<PartitionId>{0, 16, 17, 18, 19});
  REQUIRE(policy.mandatory_pages(ctx) == 5);
  REQUIRE_SPARSEKV_ERROR(StreamingWindowPolicy({0, 4}), ErrorCode::invalid_argument);
}
