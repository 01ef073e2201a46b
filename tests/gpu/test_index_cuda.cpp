// Index kernels (policy/index_cuda.hpp) against the host backend on random
// inputs: Quest min / max and ShadowKV landmarks / outlier scores against the
// policies' LayerState for fp32, fp16 and bf16 keys; k-means assignment and
// update against sparsekv::kmeans_assign / kmeans_update. All bit-exact: both
// sides run the rules of summary_rules.hpp in the same order.
#include <catch2/catch.hpp>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "index_test_data.hpp"
#include "gpu_support.hpp"
#include "sparsekv/core/numeric.hpp"
#include "sparsekv/policy/index_cuda.hpp"
#include "sparsekv/policy/quest.hpp"
#include "sparsekv/policy/retroinfer.hpp"
#include "sparsekv/policy/shadowkv.hpp"

using namespace sparsekv;
using namespace sparsekv::gpu_test;
using namespace sparsekv::test;

namespace {

// Index of the first differing element (for the failure message), or size.
std::size_t first_difference(const std::vector<float>& a, const std::vector<float>& b) {
  for (std::size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    if (std::memcmp(&a[i], &b[i], sizeof(float)) != 0) return i;
  }
  return std::min(a.size(), b.size());
}

// Random keys [tokens][kv_heads][dim] stored in `dtype`, and the fp32 view the
// host policies see (load_element of the same bytes).
struct Keys {
  Keys(DType type, std::uint32_t tokens, std::uint32_t kv_heads, std::uint32_t dim, std::mt19937& rng)
      : dtype(type),
        tokens(tokens),
        kv_heads(kv_heads),
        dim(dim),
        count(std::size_t{tokens} * kv_heads * dim),
        bytes(count * dtype_size(type)),
        fp32(count) {
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (std::size_t i = 0; i < count; ++i)
      store_element(bytes.data(), static_cast<std::uint32_t>(i), dtype, normal(rng));
    // A zero key (token 1, head 0) and an exact repeat (token 3 = token 2) when there are enough tokens.
    if (tokens > 3) {
      const std::size_t row = std::size_t{kv_heads} * dim * dtype_size(dtype);
      std::fill_n(bytes.begin() + row, std::size_t{dim} * dtype_size(dtype), std::byte{0});
      std::copy_n(bytes.begin() + 2 * row, row, bytes.begin() + 3 * row);
    }
    for (std::size_t i = 0; i < count; ++i) fp32[i] = load_element(bytes.data(), static_cast<std::uint32_t>(i), dtype);
  }
  DType dtype;
  std::uint32_t tokens, kv_heads, dim;
  std::size_t count;
  std::vector<std::byte> bytes;
  std::vector<float> fp32;
};

// Per-head host vectors laid end to end: the kernels' [kv_head][page]... layout.
std::vector<float> concat(const std::vector<std::vector<float>>& per_head) {
  std::vector<float> out;
  for (const auto& v : per_head) out.insert(out.end(), v.begin(), v.end());
  return out;
}

constexpr DType kDTypes[] = {DType::f32, DType::f16, DType::bf16};

// page_min_max or page_mean_outlier.
using SummaryKernel = void (*)(const cuda::KeyBlock&, std::uint32_t, float*, float*, void*);

// One of a summary kernel's two outputs: its size in floats and the host
// policy's per-head vectors it must equal.
struct Summary {
  const char* name;
  std::size_t size;
  const std::vector<std::vector<float>>& want;
};

// Runs `kernel` on `keys` into NaN-filled outputs; both must equal the host's bit for bit.
void require_same_summaries(SummaryKernel kernel, const Keys& keys, std::uint32_t page_tokens, const Summary& first,
                            const Summary& second) {
  DeviceArray<std::byte> d_keys(keys.bytes);
  DeviceArray<float> d_first(first.size), d_second(second.size);
  check(cudaMemset(d_first.data, 0xff, d_first.size * sizeof(float)));
  check(cudaMemset(d_second.data, 0xff, d_second.size * sizeof(float)));
  kernel(cuda::KeyBlock{d_keys.data, keys.dtype, keys.tokens, keys.kv_heads, keys.dim}, page_tokens, d_first.data,
         d_second.data, nullptr);
  check(cudaDeviceSynchronize());
  const auto got_first = d_first.download();
  const auto got_second = d_second.download();
  const auto want_first = concat(first.want);
  const auto want_second = concat(second.want);
  INFO("first difference: " << first.name << " " << first_difference(got_first, want_first) << ", " << second.name
                            << " " << first_difference(got_second, want_second));
  REQUIRE(same_bits(got_first, want_first));
  REQUIRE(same_bits(got_second, want_second));
}

}  // namespace

TEST_CASE("page_min_max equals Quest's bounds bit for bit", "[gpu][index]") {
  std::mt19937 rng(21);
  for (const DType dtype : kDTypes) {
    for (const std::uint32_t dim : {64u, 128u}) {
      for (const std::uint32_t kv_heads : {1u, 4u}) {
        for (const std::uint32_t page_tokens : {8u, 16u}) {
          for (const std::uint32_t tokens : {1u, 37u, 256u, 1001u}) {
            CAPTURE(to_string(dtype), dim, kv_heads, page_tokens, tokens);
            Keys keys(dtype, tokens, kv_heads, dim, rng);
            // A NaN inside a page (not its first token) is ignored by both backends.
            if (tokens > 5) {
              const std::uint32_t at = 5 * kv_heads * dim;
              store_element(keys.bytes.data(), at, dtype, std::numeric_limits<float>::quiet_NaN());
              keys.fp32[at] = load_element(keys.bytes.data(), at, dtype);
            }
            LayerContext ctx = layer_context(kv_heads, dim, 8, 1);
            ctx.kv_dtype = dtype;  // boxes in the keys' dtype (box_rows.hpp): the device's fp32 values exactly
            QuestPolicy::Options options;
            options.page_tokens_per_partition = page_tokens;
            QuestPolicy::LayerState state;
            QuestPolicy(options).index(ctx, key_view(keys.fp32, tokens, ctx), state);

            const std::uint32_t pages = cuda::page_count(tokens, page_tokens);
            REQUIRE(pages == state.tokens.size());
            const std::size_t bounds = std::size_t{kv_heads} * pages * dim;
            std::vector<std::vector<float>> min, max;
            for (std::uint32_t h = 0; h < kv_heads; ++h) {
              REQUIRE(state.min[h].dtype() == dtype);
              min.push_back(state.min[h].widened());
              max.push_back(state.max[h].widened());
            }
            require_same_summaries(cuda::page_min_max, keys, page_tokens, {"min", bounds, min}, {"max", bounds, max});
          }
        }
      }
    }
  }
}

TEST_CASE("page_mean_outlier equals ShadowKV's landmarks and outlier scores bit for bit", "[gpu][index]") {
  std::mt19937 rng(22);
  for (const DType dtype : kDTypes) {
    for (const std::uint32_t dim : {64u, 128u}) {
      for (const std::uint32_t kv_heads : {1u, 4u}) {
        for (const std::uint32_t page_tokens : {5u, 8u, 16u}) {
          for (const std::uint32_t tokens : {1u, 37u, 256u, 1001u}) {
            CAPTURE(to_string(dtype), dim, kv_heads, page_tokens, tokens);
            const Keys keys(dtype, tokens, kv_heads, dim, rng);
            const LayerContext ctx = layer_context(kv_heads, dim, page_tokens, 1);
            ShadowKVPolicy::LayerState state;
            ShadowKVPolicy().index(ctx, key_view(keys.fp32, tokens, ctx), state);

            const std::uint32_t pages = cuda::page_count(tokens, page_tokens);
            REQUIRE(pages == state.tokens.size());
            require_same_summaries(cuda::page_mean_outlier, keys, page_tokens,
                                   {"mean", std::size_t{kv_heads} * pages * dim, state.landmarks},
                                   {"score", std::size_t{kv_heads} * pages, state.outlier_score});
          }
        }
      }
    }
  }
}

TEST_CASE("kmeans_assign and kmeans_update equal the host steps bit for bit", "[gpu][index]") {
  std::mt19937 rng(23);
  for (const std::uint32_t dim : {64u, 128u}) {
    for (const auto& [n, k] : {std::pair{1u, 1u}, std::pair{100u, 7u}, std::pair{1000u, 64u}, std::pair{8192u, 512u},
                               std::pair{3001u, 300u}}) {
      CAPTURE(dim, n, k);
      const auto rows = unit_rows(n, dim, rng);
      // Centroids: k rows (as k-means++ seeds them), centroid 2 repeating centroid 1 (exact ties).
      std::vector<float> centroids(std::size_t{k} * dim);
      for (std::uint32_t c = 0; c < k; ++c) {
        std::copy_n(&rows[std::size_t{rng() % n} * dim], dim, &centroids[std::size_t{c} * dim]);
      }
      if (k >= 3) std::copy_n(&centroids[dim], dim, &centroids[2 * std::size_t{dim}]);
      // A previous assignment: random, some rows already right.
      std::vector<std::uint32_t> labels(n);
      for (auto& l : labels) l = static_cast<std::uint32_t>(rng() % k);

      DeviceArray<float> d_rows(rows), d_centroids(centroids);
      DeviceArray<std::uint32_t> d_labels(labels), d_changed(1);
      std::vector<std::uint32_t> host_labels = labels;
      std::vector<float> host_centroids = centroids;
      // Three Lloyd rounds on both sides, compared after every step.
      for (int round = 0; round < 3; ++round) {
        CAPTURE(round);
        const std::uint32_t host_changed = kmeans_assign(rows, n, dim, host_centroids, k, host_labels);
        cuda::kmeans_assign(d_rows.data, n, dim, d_centroids.data, k, d_labels.data, d_changed.data, nullptr);
        check(cudaDeviceSynchronize());
        REQUIRE(d_labels.download() == host_labels);
        REQUIRE(d_changed.download()[0] == host_changed);
        if (round == 1 && k > 1) {  // an empty cluster: nobody keeps label k - 1
          std::replace(host_labels.begin(), host_labels.end(), k - 1, 0u);
          check(cudaMemcpy(d_labels.data, host_labels.data(), n * sizeof(std::uint32_t), cudaMemcpyHostToDevice));
        }
        kmeans_update(rows, n, dim, host_labels, k, host_centroids);
        cuda::kmeans_update(d_rows.data, n, dim, d_labels.data, k, d_centroids.data, nullptr);
        check(cudaDeviceSynchronize());
        const auto got = d_centroids.download();
        INFO("first difference " << first_difference(got, host_centroids));
        REQUIRE(same_bits(got, host_centroids));
      }
    }
  }
}

TEST_CASE("kmeans_update keeps the centroid of a zero-sum cluster", "[gpu][index]") {
  // Rows (3,4), (1,0), (-1,0): cluster 0 = {(3,4)}, cluster 1 sums to zero, cluster 2 is empty.
  const std::vector<float> rows = {3, 4, 1, 0, -1, 0};
  const std::vector<std::uint32_t> labels = {0, 1, 1};
  std::vector<float> centroids = {9, 9, 8, 8, 7, 7};
  DeviceArray<float> d_rows(rows), d_centroids(centroids);
  DeviceArray<std::uint32_t> d_labels(labels);
  cuda::kmeans_update(d_rows.data, 3, 2, d_labels.data, 3, d_centroids.data, nullptr);
  check(cudaDeviceSynchronize());
  kmeans_update(rows, 3, 2, labels, 3, centroids);
  CHECK(same_bits(d_centroids.download(), centroids));
  CHECK(centroids[2] == 8.0f);
}

TEST_CASE("index kernels reject bad arguments before launching", "[gpu][index]") {
  DeviceArray<float> buffer(1 << 12);
  DeviceArray<std::uint32_t> labels(64);
  float* f = buffer.data;
  const cuda::KeyBlock ok{f, DType::f32, 16, 2, 64};
  const auto with = [&](auto change) {
    cuda::KeyBlock k = ok;
    change(k);
    return k;
  };
  for (const auto& summary :
       {std::function<void(const cuda::KeyBlock&, std::uint32_t, float*, float*)>(
            [](const cuda::KeyBlock&k, std::uint32_t p, float*a, float*b) { cuda::page_min_max(k, p, a, b, nullptr); }),
        std::function<void(const cuda::KeyBlock&, std::uint32_t, float*, float*)>(
            [](const cuda::KeyBlock&k, std::uint32_t p, float*a, float*b) {
              cuda::page_mean_outlier(k, p, a, b, nullptr);
            })}) {
    CHECK(code_of([&] { summary(ok, 0, f, f); }) == ErrorCode::invalid_argument);
    CHECK(code_of([&] { summary(with([](auto& k) { k.kv_heads = 0; }), 8, f, f); }) == ErrorCode::invalid_argument);
    CHECK(code_of([&] { summary(with([](auto& k) { k.head_dim = 0; }), 8, f, f); }) == ErrorCode::invalid_argument);
    CHECK(code_of([&] { summary(with([](auto& k) { k.dtype = static_cast<DType>(7); }), 8, f, f); }) ==
          ErrorCode::invalid_argument);
    CHECK(code_of([&] { summary(with([](auto& k) { k.keys = nullptr; }), 8, f, f); }) == ErrorCode::invalid_argument);
    CHECK(code_of([&] { summary(ok, 8, nullptr, f); }) == ErrorCode::invalid_argument);
    CHECK(code_of([&] { summary(ok, 8, f, nullptr); }) == ErrorCode::invalid_argument);
    // No tokens: nothing to do, nothing launched.
    summary(with([](auto& k) { k.tokens = 0; }), 8, nullptr, nullptr);
  }
  CHECK(code_of([&] {
          cuda::page_mean_outlier(with([](auto& k) { k.head_dim = cuda::kMaxIndexDim + 1; }), 8, f, f, nullptr);
        }) == ErrorCode::invalid_argument);
  CHECK(code_of([&] { cuda::page_mean_outlier(ok, 4097, f, f, nullptr); }) == ErrorCode::invalid_argument);

  std::uint32_t* l = labels.data;
  CHECK(code_of([&] { cuda::kmeans_assign(f, 0, 64, f, 4, l, nullptr, nullptr); }) == ErrorCode::invalid_argument);
  CHECK(code_of([&] { cuda::kmeans_assign(f, 8, 0, f, 4, l, nullptr, nullptr); }) == ErrorCode::invalid_argument);
  CHECK(code_of([&] { cuda::kmeans_assign(f, 8, 64, f, 0, l, nullptr, nullptr); }) == ErrorCode::invalid_argument);
  CHECK(code_of([&] { cuda::kmeans_assign(f, 8, cuda::kMaxIndexDim + 1, f, 4, l, nullptr, nullptr); }) ==
        ErrorCode::invalid_argument);
  CHECK(code_of([&] { cuda::kmeans_assign(nullptr, 8, 64, f, 4, l, nullptr, nullptr); }) ==
        ErrorCode::invalid_argument);
  CHECK(code_of([&] { cuda::kmeans_assign(f, 8, 64, nullptr, 4, l, nullptr, nullptr); }) ==
        ErrorCode::invalid_argument);
  CHECK(code_of([&] { cuda::kmeans_assign(f, 8, 64, f, 4, nullptr, nullptr, nullptr); }) ==
        ErrorCode::invalid_argument);
  CHECK(code_of([&] { cuda::kmeans_update(f, 0, 64, l, 4, f, nullptr); }) == ErrorCode::invalid_argument);
  CHECK(code_of([&] { cuda::kmeans_update(f, 8, 64, l, 0, f, nullptr); }) == ErrorCode::invalid_argument);
  CHECK(code_of([&] { cuda::kmeans_update(f, 8, cuda::kMaxIndexDim + 1, l, 4, f, nullptr); }) ==
        ErrorCode::invalid_argument);
  CHECK(code_of([&] { cuda::kmeans_update(f, 8, 64, nullptr, 4, f, nullptr); }) == ErrorCode::invalid_argument);
  CHECK(code_of([&] { cuda::kmeans_update(nullptr, 8, 64, l, 4, f, nullptr); }) == ErrorCode::invalid_argument);
  check(cudaDeviceSynchronize());
}
