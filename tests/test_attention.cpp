// Host decode attention, dtype conversions, and Dense through the whole
// pipeline (policy -> offload -> retrieve -> attend) against a naive reference.
#include <cmath>
#include <random>
#include <vector>

#include "sparse_pipeline.hpp"
#include "sparsekv/attention/decode_attention.hpp"
#include "sparsekv/core/numeric.hpp"
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
  REQUIRE(float_to_f16(65520.0f) == 0x7c00);  // rounds past the largest finite half
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
