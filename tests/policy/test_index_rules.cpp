// The Index rules both backends share (policy/summary_rules.hpp), on known
// data and against plain formulas on random data, and the host policies'
// summaries (Quest min / max, ShadowKV landmark and outlier score, RetroInfer's
// k-means steps) against those rules: what CI can check of the CUDA kernels.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "index_test_data.hpp"
#include "sparsekv/policy/index_cuda.hpp"
#include "sparsekv/policy/summary_rules.hpp"
#include "sparsekv/policy/quest.hpp"
#include "sparsekv/policy/retroinfer.hpp"
#include "sparsekv/policy/shadowkv.hpp"
#include "test_support.hpp"

using namespace sparsekv;
using namespace sparsekv::test;

namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

// The scalar form of the assignment rule: one dot_in_order per pair, centroids in order.
std::vector<std::uint32_t> reference_assign(const std::vector<float>& rows, std::uint32_t n, std::uint32_t dim,
                                            const std::vector<float>& centroids, std::uint32_t k) {
  std::vector<std::uint32_t> labels(n);
  for (std::uint32_t t = 0; t < n; ++t) {
    CentroidChoice best;
    for (std::uint32_t c = 0; c < k; ++c) {
      consider_centroid(best, dot_in_order(&rows[std::size_t{t} * dim], &centroids[std::size_t{c} * dim], dim), c);
    }
    labels[t] = chosen_label(best);
  }
  return labels;
}

// The update rule written per cluster: members scanned in row order.
std::vector<float> reference_update(const std::vector<float>& rows, std::uint32_t n, std::uint32_t dim,
                                    const std::vector<std::uint32_t>& labels, std::uint32_t k,
                                    std::vector<float> centroids) {
  for (std::uint32_t c = 0; c < k; ++c) {
    std::vector<float> sum(dim, 0.0f);
    std::uint32_t members = 0;
    for (std::uint32_t t = 0; t < n; ++t) {
      if (labels[t] != c) continue;
      ++members;
      for (std::uint32_t d = 0; d < dim; ++d) sum[d] = add_rn(sum[d], rows[std::size_t{t} * dim + d]);
    }
    double norm = 0.0;
    for (float s : sum) norm = norm_sq_step(norm, s);
    float inverse = 0.0f;
    if (!centroid_inverse_norm(norm, members, inverse)) continue;
    for (std::uint32_t d = 0; d < dim; ++d) centroids[std::size_t{c} * dim + d] = mul_rn(sum[d], inverse);
  }
  return centroids;
}

}  // namespace

TEST_CASE("min / max fold: order, NaN and signed zero", "[index-rules]") {
  CHECK(fold_min(2.0f, 1.0f) == 1.0f);
  CHECK(fold_min(1.0f, 2.0f) == 1.0f);
  CHECK(fold_max(1.0f, 2.0f) == 2.0f);
  CHECK(fold_max(2.0f, 1.0f) == 2.0f);
  // A later NaN is ignored, an earlier one stays.
  CHECK(fold_min(1.0f, kNaN) == 1.0f);
  CHECK(fold_max(1.0f, kNaN) == 1.0f);
  CHECK(std::isnan(fold_min(kNaN, 1.0f)));
  CHECK(std::isnan(fold_max(kNaN, 1.0f)));
  // Between -0 and +0 the earlier value stays.
  CHECK(std::signbit(fold_min(-0.0f, 0.0f)));
  CHECK(!std::signbit(fold_min(0.0f, -0.0f)));
  CHECK(std::signbit(fold_max(-0.0f, 0.0f)));
  CHECK(fold_min(kInf, -kInf) == -kInf);
  CHECK(fold_max(-kInf, kInf) == kInf);

  const float keys[3][4] = {{1, -2, 0, 5}, {3, -4, kNaN, 5}, {-1, 7, -3, 4}};
  float lo[4], hi[4];
  std::copy_n(keys[0], 4, lo);
  std::copy_n(keys[0], 4, hi);
  fold_min_max(lo, hi, keys[1], 4);
  fold_min_max(lo, hi, keys[2], 4);
  const float want_lo[4] = {-1, -4, -3, 4};
  const float want_hi[4] = {3, 7, 0, 5};
  for (int d = 0; d < 4; ++d) {
    CHECK(lo[d] == want_lo[d]);
    CHECK(hi[d] == want_hi[d]);
  }
}

TEST_CASE("min / max fold equals std::min / std::max on random keys", "[index-rules]") {
  std::mt19937 rng(1);
  const std::uint32_t dim = 64;
  const auto keys = random_values(std::size_t{33} * dim, rng);
  std::vector<float> lo(keys.begin(), keys.begin() + dim), hi = lo, want_lo = lo, want_hi = lo;
  for (std::uint32_t t = 1; t < 33; ++t) {
    fold_min_max(lo.data(), hi.data(), &keys[std::size_t{t} * dim], dim);
    for (std::uint32_t d = 0; d < dim; ++d) {
      want_lo[d] = std::min(want_lo[d], keys[std::size_t{t} * dim + d]);
      want_hi[d] = std::max(want_hi[d], keys[std::size_t{t} * dim + d]);
    }
  }
  CHECK(same_bits(lo, want_lo));
  CHECK(same_bits(hi, want_hi));
}

TEST_CASE("dot, mean and cosine rules on known data", "[index-rules]") {
  const float a[4] = {1, 2, 3, 4};
  const float b[4] = {4, 3, 2, 1};
  CHECK(dot_in_order(a, b, 4) == 20.0f);
  CHECK(dot_in_order(a, b, 0) == 0.0f);
  // The order is fixed: 1e8 + 1 - 1e8 loses the 1 in fp32 (a tree sum would not).
  const float big[3] = {1e8f, 1.0f, -1e8f};
  const float ones[3] = {1, 1, 1};
  CHECK(dot_in_order(big, ones, 3) == 0.0f);
  CHECK(page_mean(10.0f, 4) == 2.5f);
  CHECK(page_mean(1.0f, 3) == 1.0f / 3.0f);
  // Any NaN sum gives the one NaN a GPU's arithmetic returns (payloads differ on x86).
  for (const std::uint32_t nan : {0x7fc00001u, 0xffc12345u, 0x7f800001u}) {
    CHECK(float_bits(page_mean(bits_float(nan), 3)) == kCanonicalNaNBits);
  }
  // key (3, 4) against landmark (3, 4): cos 1; against (4, -3): 0; zero key or landmark: 0.
  CHECK(landmark_cosine(25.0f, 25.0f, 5.0f) == 1.0f);
  CHECK(landmark_cosine(25.0f, 0.0f, 5.0f) == 0.0f);
  CHECK(landmark_cosine(25.0f, -25.0f, 5.0f) == -1.0f);
  CHECK(landmark_cosine(0.0f, 0.0f, 5.0f) == 0.0f);
  CHECK(landmark_cosine(25.0f, 0.0f, 0.0f) == 0.0f);
  CHECK(landmark_cosine(kNaN, 1.0f, 1.0f) == 0.0f);  // NaN norm: no direction
  CHECK(std::isnan(landmark_cosine(1.0f, kNaN, 1.0f)));
  // The outlier score folds with fold_min from 1: a NaN cosine is ignored.
  CHECK(fold_min(fold_min(kOutlierScoreStart, 0.5f), kNaN) == 0.5f);
}

TEST_CASE("page sums end in the NaN a GPU returns, whatever payload the page held", "[index-rules]") {
  // Two tokens of one channel, the second a NaN with a payload x86 would keep.
  const float keys[2] = {1.0f, bits_float(0x7fc0beefu)};
  const float values[2] = {bits_float(0xffc0beefu), 2.0f};
  const auto key = [&](std::uint32_t t) { return &keys[t]; };
  const auto value = [&](std::uint32_t t) { return &values[t]; };
  CHECK(float_bits(page_mean_channel(key, 2, 0, DType::f32)) == kCanonicalNaNBits);
  float mean = 0.0f, value_sum = 0.0f;
  page_key_mean_value_sum_channel(key, value, 2, 0, DType::f32, mean, value_sum);
  CHECK(float_bits(mean) == kCanonicalNaNBits);
  CHECK(float_bits(value_sum) == kCanonicalNaNBits);
  // Finite pages are untouched by it.
  page_key_mean_value_sum_channel(key, key, 1, 0, DType::f32, mean, value_sum);
  CHECK(mean == 1.0f);
  CHECK(value_sum == 1.0f);
}

TEST_CASE("dot_in_order equals a sequential float inner product", "[index-rules]") {
  std::mt19937 rng(2);
  for (const std::uint32_t dim : {1u, 7u, 64u, 128u}) {
    const auto a = random_values(dim, rng);
    const auto b = random_values(dim, rng);
    float want = 0.0f;
    for (std::uint32_t d = 0; d < dim; ++d) want = want + a[d] * b[d];
    CHECK(same_bits(dot_in_order(a.data(), b.data(), dim), want));
  }
}

TEST_CASE("assignment rule: ties to the lowest index, NaN never wins", "[index-rules]") {
  const auto scan = [](std::initializer_list<float> similarities) {
    CentroidChoice best;
    std::uint32_t i = 0;
    for (float s : similarities) consider_centroid(best, s, i++);
    return chosen_label(best);
  };
  CHECK(scan({0.1f, 0.5f, 0.3f}) == 1);
  CHECK(scan({0.5f, 0.2f, 0.5f}) == 0);  // tie: lowest
  CHECK(scan({0.1f, 0.7f, 0.7f}) == 1);
  CHECK(scan({kNaN, 0.2f, kNaN, 0.3f}) == 3);
  CHECK(scan({kNaN, kNaN}) == 0);  // no winner: centroid 0
  CHECK(scan({kNaN, -kInf}) == 0);
  CHECK(scan({-kInf, -1.0f}) == 1);
  CHECK(scan({-0.0f, 0.0f}) == 0);  // -0 == +0: a tie

  // Merging the choices of any split, in any tree, equals the sequential scan.
  std::mt19937 rng(3);
  const float pool[] = {0.25f, 0.5f, 0.5f, -1.0f, kNaN, -kInf, 0.75f, 0.75f};
  for (int trial = 0; trial < 2000; ++trial) {
    const std::uint32_t k = 1 + rng() % 40;
    std::vector<float> s(k);
    for (float& x : s) x = pool[rng() % std::size(pool)];
    CentroidChoice sequential;
    for (std::uint32_t c = 0; c < k; ++c) consider_centroid(sequential, s[c], c);
    // Strided slices (as threads own centroids c, c + w, ...) merged pairwise from a random start.
    const std::uint32_t lanes = 1 + rng() % 8;
    std::vector<CentroidChoice> part(lanes);
    for (std::uint32_t c = 0; c < k; ++c) consider_centroid(part[c % lanes], s[c], c);
    std::shuffle(part.begin(), part.end(), rng);
    while (part.size() > 1) {
      part[0] = merge_choices(part[0], part.back());
      part.pop_back();
      std::rotate(part.begin(), part.begin() + 1, part.end());
    }
    INFO("trial " << trial);
    REQUIRE(chosen_label(part[0]) == chosen_label(sequential));
  }
}

TEST_CASE("update rule: renormalised sum, empty and zero-sum clusters keep their centroid", "[index-rules]") {
  float inverse = -1.0f;
  CHECK_FALSE(centroid_inverse_norm(4.0, 0, inverse));  // empty
  CHECK_FALSE(centroid_inverse_norm(0.0, 3, inverse));  // members summing to zero
  CHECK(inverse == -1.0f);
  REQUIRE(centroid_inverse_norm(25.0, 2, inverse));
  CHECK(inverse == 0.2f);
  CHECK(norm_sq_step(norm_sq_step(0.0, 3.0f), 4.0f) == 25.0);

  // Rows (3,4), (1,0), (-1,0): cluster 0 = {(3,4)}, cluster 1 = {(1,0), (-1,0)} sums to 0, cluster 2 is empty.
  const std::vector<float> rows = {3, 4, 1, 0, -1, 0};
  const std::vector<std::uint32_t> labels = {0, 1, 1};
  std::vector<float> centroids = {9, 9, 8, 8, 7, 7};
  kmeans_update(rows, 3, 2, labels, 3, centroids);
  CHECK(centroids == std::vector<float>{3 * 0.2f, 4 * 0.2f, 8, 8, 7, 7});
}

TEST_CASE("host k-means steps follow the shared rules bit for bit", "[index-rules]") {
  std::mt19937 rng(4);
  for (const std::uint32_t dim : {64u, 128u}) {
    for (const auto& [n, k] : {std::pair{1u, 1u}, std::pair{37u, 5u}, std::pair{301u, 19u}, std::pair{1024u, 64u}}) {
      CAPTURE(dim, n, k);
      const auto rows = unit_rows(n, dim, rng);
      std::vector<float> centroids = unit_rows(k, dim, rng);
      if (k >= 3) {  // exact ties: centroid 2 repeats centroid 1
        std::copy_n(&centroids[dim], dim, &centroids[2 * std::size_t{dim}]);
      }
      std::vector<std::uint32_t> labels(n, kNoCentroid);
      const auto want = reference_assign(rows, n, dim, centroids, k);
      CHECK(kmeans_assign(rows, n, dim, centroids, k, labels) == n);
      REQUIRE(labels == want);
      if (k >= 3) CHECK(std::count(labels.begin(), labels.end(), 2u) == 0);  // ties go to centroid 1
      CHECK(kmeans_assign(rows, n, dim, centroids, k, labels) == 0);         // nothing changes the second time

      // An empty cluster: nobody keeps label k - 1 when k > 1.
      if (k > 1) std::replace(labels.begin(), labels.end(), k - 1, 0u);
      const auto want_centroids = reference_update(rows, n, dim, labels, k, centroids);
      kmeans_update(rows, n, dim, labels, k, centroids);
      REQUIRE(same_bits(centroids, want_centroids));
    }
  }
}

TEST_CASE("host k-means steps reject bad input and change nothing", "[index-rules]") {
  const std::vector<float> rows = {1, 0, 0, 1};
  std::vector<float> centroids = {1, 0};
  std::vector<std::uint32_t> labels = {0, 1};  // label 1 is not below k = 1
  REQUIRE_SPARSEKV_ERROR(kmeans_update(rows, 2, 2, labels, 1, centroids), ErrorCode::invalid_argument);
  CHECK(centroids == std::vector<float>{1, 0});
  REQUIRE_SPARSEKV_ERROR(kmeans_update(rows, 2, 2, labels, 0, centroids), ErrorCode::invalid_argument);
  REQUIRE_SPARSEKV_ERROR(kmeans_assign(rows, 2, 2, centroids, 2, labels), ErrorCode::invalid_argument);  // size
  REQUIRE_SPARSEKV_ERROR(kmeans_assign(rows, 3, 2, centroids, 1, labels), ErrorCode::invalid_argument);
  REQUIRE_SPARSEKV_ERROR(kmeans_assign(rows, 2, 0, centroids, 1, labels), ErrorCode::invalid_argument);
  CHECK(labels == std::vector<std::uint32_t>{0, 1});
}

TEST_CASE("Quest's bounds equal the shared fold on random keys", "[index-rules]") {
  std::mt19937 rng(5);
  for (const std::uint32_t tokens : {1u, 16u, 53u}) {
    const LayerContext ctx = layer_context(2, 64, 8, 2);
    const auto keys = random_values(std::size_t{tokens} * ctx.kv_heads * ctx.head_dim, rng);
    QuestPolicy::Options options;
    options.page_tokens_per_partition = 16;
    QuestPolicy::LayerState state;
    QuestPolicy(options).index(ctx, key_view(keys, tokens, ctx), state);
    const KvView kv = key_view(keys, tokens, ctx);
    for (std::uint32_t h = 0; h < ctx.kv_heads; ++h) {
      std::vector<float> lo, hi;
      for (std::uint32_t first = 0; first < tokens; first += 16) {
        std::vector<float> l(kv.key(first, h), kv.key(first, h) + ctx.head_dim), u = l;
        for (std::uint32_t t = first + 1; t < std::min(tokens, first + 16); ++t) {
          fold_min_max(l.data(), u.data(), kv.key(t, h), ctx.head_dim);
        }
        lo.insert(lo.end(), l.begin(), l.end());
        hi.insert(hi.end(), u.begin(), u.end());
      }
      CAPTURE(tokens, h);
      CHECK(same_bits(state.min[h].widened(), lo));
      CHECK(same_bits(state.max[h].widened(), hi));
    }
  }
}

TEST_CASE("ShadowKV's landmarks and outlier scores equal the plain formulas", "[index-rules]") {
  std::mt19937 rng(6);
  for (const std::uint32_t tokens : {1u, 8u, 45u}) {
    const LayerContext ctx = layer_context(2, 128, 8, 2);
    auto keys = random_values(std::size_t{tokens} * ctx.kv_heads * ctx.head_dim, rng);
    // A zero key (token 2, head 1) takes the orthogonal path.
    if (tokens > 2) std::fill_n(keys.begin() + (2 * ctx.kv_heads + 1) * ctx.head_dim, ctx.head_dim, 0.0f);
    ShadowKVPolicy::LayerState state;
    ShadowKVPolicy().index(ctx, key_view(keys, tokens, ctx), state);
    const KvView kv = key_view(keys, tokens, ctx);
    const std::uint32_t dim = ctx.head_dim;
    for (std::uint32_t h = 0; h < ctx.kv_heads; ++h) {
      std::vector<float> landmarks, scores;
      for (std::uint32_t first = 0; first < tokens; first += 8) {
        const std::uint32_t count = std::min(tokens - first, 8u);
        std::vector<float> mean(dim, 0.0f);
        for (std::uint32_t t = first; t < first + count; ++t) {
          for (std::uint32_t d = 0; d < dim; ++d) mean[d] += kv.key(t, h)[d];
        }
        for (float& m : mean) m /= static_cast<float>(count);
        const float mean_norm = std::sqrt(std::inner_product(mean.begin(), mean.end(), mean.begin(), 0.0f));
        float lowest = 1.0f;
        for (std::uint32_t t = first; t < first + count; ++t) {
          const float* k = kv.key(t, h);
          const float norm = std::sqrt(std::inner_product(k, k + dim, k, 0.0f)) * mean_norm;
          lowest = std::min(lowest, norm > 0.0f ? std::inner_product(k, k + dim, mean.data(), 0.0f) / norm : 0.0f);
        }
        landmarks.insert(landmarks.end(), mean.begin(), mean.end());
        scores.push_back(lowest);
      }
      CAPTURE(tokens, h);
      CHECK(same_bits(state.landmarks[h], landmarks));
      CHECK(same_bits(state.outlier_score[h], scores));
    }
  }
}

// The index kernels' dynamic shared memory (policy/index_cuda.hpp) for every
// shape their entry points accept: each array, widened to the 16-byte
// granules nvcc's vector loads touch, lies inside the allocation and clear of
// the next array. Sizing to the floats used (dim = 2 k-means sums in 8 bytes)
// is what memcheck caught on the first GPU run.
namespace {
struct SharedArray {
  std::size_t offset, floats;  // in floats
};
// Bytes [first granule, last granule end) a vectorised walk over `a` may read.
std::pair<std::size_t, std::size_t> granule_span(SharedArray a) {
  constexpr std::size_t kGranule = 16;
  const std::size_t first = a.offset * sizeof(float) / kGranule * kGranule;
  const std::size_t end = ((a.offset + a.floats) * sizeof(float) + kGranule - 1) / kGranule * kGranule;
  return {first, end};
}
}  // namespace

TEST_CASE("index kernels' shared arrays stay inside their allocation at 16-byte granules", "[index-rules]") {
  constexpr std::uint32_t kMaxPageTokens = 4096;  // page_mean_outlier's limit
  for (std::uint32_t dim = 1; dim <= cuda::kMaxIndexDim; ++dim) {
    CAPTURE(dim);
    REQUIRE(granule_span({0, dim}).second <= cuda::kmeans_update_shared_bytes(dim));
    REQUIRE(granule_span({0, std::size_t{cuda::kKmeansAssignRows} * dim}).second <=
            cuda::kmeans_assign_shared_bytes(dim));
    for (std::uint32_t page_tokens = 1; page_tokens <= kMaxPageTokens; ++page_tokens) {
      const SharedArray landmark{0, dim};
      const SharedArray cosine{cuda::mean_outlier_cosine_offset(dim), page_tokens};
      const std::size_t bytes = cuda::mean_outlier_shared_bytes(dim, page_tokens);
      if (granule_span(landmark).second > granule_span(cosine).first || granule_span(cosine).second > bytes) {
        FAIL("page_tokens " << page_tokens << ": landmark ends at " << granule_span(landmark).second
                            << ", cosine spans [" << granule_span(cosine).first << ", " << granule_span(cosine).second
                            << ") of " << bytes << " bytes");
      }
    }
  }
}
