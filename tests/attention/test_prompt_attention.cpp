// PromptAttention (attention/prompt_attention.hpp): the tiled kernel on every
// Highway target this CPU has against prompt_attention_scalar (fp32 / fp16 /
// bf16 / q8_0, GQA groups 1, 3, 4 and 8, head_dim 64 and 128, chunks of 1, 7, 64
// and 513 rows at position 0 and later, several chunks in one plan, strides
// past the row); the reference against a double-precision softmax written
// here; a NaN key reaching exactly the outputs that attend it; a prompt
// attended whole or in chunks, and on 1, 2, 3 or 5 threads, bit for bit the
// same; bad shapes refused before anything is written.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "sparsekv/attention/page_fold.hpp"
#include "sparsekv/attention/prompt_attention.hpp"
#include "sparsekv/core/convert.hpp"
#include "sparsekv/core/error.hpp"
#include "sparsekv/core/numeric.hpp"
#include "test_support.hpp"

using namespace sparsekv;

namespace {

constexpr float kSentinel = -12345.0f;  // out's padding and unwritten rows

// One sequence: K/V of `tokens` positions, and q / out for a chunk of rows
// at `first` (strides past the row when `padded`).
struct Sequence {
  PromptAttentionShape shape;
  std::uint32_t tokens = 0, first = 0, rows = 0;
  std::size_t q_stride = 0, out_stride = 0;
  std::vector<std::byte> k, v;
  std::vector<float> q, out;

  Sequence(const PromptAttentionShape& s, std::uint32_t first_row, std::uint32_t n, bool padded, std::mt19937& rng)
      : shape(s), tokens(first_row + n), first(first_row), rows(n) {
    const std::size_t row = std::size_t{s.q_heads} * s.head_dim;
    q_stride = padded ? row + 5 : row;
    out_stride = padded ? row + 3 : row;
    std::normal_distribution<float> normal;
    const std::size_t rows_kv = std::size_t{tokens} * s.kv_heads, elements = rows_kv * s.head_dim;
    std::vector<float> kf(elements), vf(elements);
    for (std::size_t i = 0; i < elements; ++i) {
      kf[i] = 1.5f * normal(rng);
      vf[i] = normal(rng);
    }
    k.resize(rows_kv * dtype_row_bytes(s.dtype, s.head_dim));
    v.resize(k.size());
    convert_rows(kf.data(), DType::f32, k.data(), s.dtype, rows_kv, s.head_dim);
    convert_rows(vf.data(), DType::f32, v.data(), s.dtype, rows_kv, s.head_dim);
    q.resize(n * q_stride);
    for (float& x : q) x = normal(rng);
    out.assign(n * out_stride, kSentinel);
  }
  // The chunk of rows [first + from, first + from + n) writing into `into` (out's layout).
  PromptChunk chunk(std::vector<float>& into, std::uint32_t from, std::uint32_t n) const {
    PromptChunk c;
    c.q = q.data() + from * q_stride;
    c.q_stride = q_stride;
    c.k = k.data();
    c.v = v.data();
    c.first = first + from;
    c.rows = n;
    c.out = into.data() + from * out_stride;
    c.out_stride = out_stride;
    return c;
  }
  PromptChunk chunk() { return chunk(out, 0, rows); }
  const float* out_row(const std::vector<float>& o, std::uint32_t r, std::uint32_t h) const {
    return o.data() + r * out_stride + std::size_t{h} * shape.head_dim;
  }
};

// Every (row, head) of `got` within `tolerance` of `want`'s largest |value| in
// that row and head; the strides' padding left as it was. One assertion for
// the worst element (named), one for the padding.
void require_close(const Sequence& s, const std::vector<float>& got, const std::vector<float>& want, double tolerance) {
  const std::uint32_t d = s.shape.head_dim;
  double worst = 0;  // |got - want| / (tolerance * largest), at most 1
  std::uint32_t worst_row = 0, worst_head = 0, worst_j = 0;
  bool padding_kept = true;
  for (std::uint32_t r = 0; r < s.rows; ++r) {
    for (std::uint32_t h = 0; h < s.shape.q_heads; ++h) {
      const float* g = s.out_row(got, r, h);
      const float* w = s.out_row(want, r, h);
      double largest = 0;
      for (std::uint32_t j = 0; j < d; ++j) largest = std::max(largest, double(std::abs(w[j])));
      for (std::uint32_t j = 0; j < d; ++j) {
        const double err = std::abs(double(g[j]) - double(w[j])) / (tolerance * largest);
        if (!(err <= worst)) {  // a NaN is the worst
          worst = std::isnan(err) ? std::numeric_limits<double>::infinity() : err;
          worst_row = r, worst_head = h, worst_j = j;
        }
      }
    }
    for (std::size_t i = std::size_t{s.shape.q_heads} * d; i < s.out_stride; ++i) {
      padding_kept = padding_kept && got[r * s.out_stride + i] == kSentinel;
    }
  }
  const float got_worst = s.out_row(got, worst_row, worst_head)[worst_j];
  const float want_worst = s.out_row(want, worst_row, worst_head)[worst_j];
  CAPTURE(worst_row, worst_head, worst_j, got_worst, want_worst);
  REQUIRE(worst <= 1.0);
  REQUIRE(padding_kept);
}

void run_on_threads(const PromptAttention& attention, std::size_t nth) {
  std::vector<std::thread> threads;
  for (std::size_t i = 1; i < nth; ++i) threads.emplace_back([&attention, i, nth] { attention.run(i, nth); });
  attention.run(0, nth);
  for (std::thread& t : threads) t.join();
}

PromptAttentionShape shape_of(DType dtype, std::uint32_t kv_heads, std::uint32_t group, std::uint32_t d) {
  return {dtype, kv_heads * group, kv_heads, d, 1.0f / std::sqrt(static_cast<float>(d))};
}

// The targets the CPU has, each made current in turn for f(name); the best again after.
template <class F>
void on_every_target(F&& f) {
  std::uint32_t ran = 0;
  for (const FoldTarget& t : fold_page_targets()) {
    if (!t.supported) {
      WARN("prompt attention target " << t.name << ": skipped, this CPU lacks it");
      continue;
    }
    use_fold_page_target(t.bits);
    REQUIRE(fold_page_target() == t.name);
    f(t.name);
    ++ran;
  }
  use_fold_page_target(0);
  REQUIRE(ran > 0);
}

}  // namespace

TEST_CASE("PromptAttention equals the scalar reference on every target the CPU has", "[prompt-attention]") {
  struct Part {
    std::uint32_t first, rows;
    bool padded;
  };
  // Chunks of 1, 7, 64 rows at position 0 and past it in every plan.
  const std::vector<Part> small = {{0, 1, false}, {0, 7, true},   {0, 64, false},
                                   {1, 1, true},  {57, 7, false}, {130, 64, true}};
  std::mt19937 rng(11);
  std::uint32_t long_chunks = 0;
  const DType dtypes[] = {DType::f32, DType::f16, DType::bf16, DType::q8_0};
  const std::uint32_t groups[] = {1, 3, 4, 8}, dims[] = {64, 128};
  for (std::uint32_t di = 0; di < 4; ++di) {
    for (std::uint32_t gi = 0; gi < 4; ++gi) {
      for (std::uint32_t ki = 0; ki < 2; ++ki) {
        const DType dtype = dtypes[di];
        const std::uint32_t group = groups[gi], d = dims[ki];
        const std::uint32_t kv_heads = group == 8 ? 1 : 2;
        const PromptAttentionShape shape = shape_of(dtype, kv_heads, group, d);
        std::vector<Part> parts = small;
        // Half the cases (every dtype, group and head_dim among them) add a
        // 513-row chunk, at position 0 and 90 in turn.
        if ((di + gi + ki) % 2 == 0) {
          parts.push_back({long_chunks % 2 == 0 ? 0u : 90u, 513, long_chunks % 3 == 0});
          ++long_chunks;
        }
        std::vector<Sequence> seqs;
        for (const Part& p : parts) seqs.emplace_back(shape, p.first, p.rows, p.padded, rng);
        std::vector<std::vector<float>> want;
        for (Sequence& s : seqs) {
          want.push_back(s.out);
          const PromptChunk c = s.chunk(want.back(), 0, s.rows);
          prompt_attention_scalar(shape, c);
        }
        on_every_target([&](const std::string& target) {
          CAPTURE(target, to_string(dtype), group, d);
          std::vector<PromptChunk> chunks;
          for (Sequence& s : seqs) {
            std::fill(s.out.begin(), s.out.end(), kSentinel);
            chunks.push_back(s.chunk());
          }
          PromptAttention attention;
          attention.plan(shape, chunks, 2);
          REQUIRE(attention.tiles() > 0);
          run_on_threads(attention, 2);
          for (std::size_t i = 0; i < seqs.size(); ++i) {
            CAPTURE(seqs[i].first, seqs[i].rows);
            require_close(seqs[i], seqs[i].out, want[i], 1e-5);
          }
        });
      }
    }
  }
}

TEST_CASE("prompt_attention_scalar equals a double-precision softmax", "[prompt-attention]") {
  std::mt19937 rng(5);
  for (const DType dtype : {DType::f32, DType::f16, DType::bf16}) {
    for (const std::uint32_t group : {1u, 3u}) {
      const PromptAttentionShape shape = shape_of(dtype, 2, group, 64);
      Sequence s(shape, 150, 40, true, rng);
      prompt_attention_scalar(shape, s.chunk());
      std::vector<float> want = s.out;
      const std::uint32_t d = shape.head_dim;
      const std::size_t token = std::size_t{shape.kv_heads} * d;
      for (std::uint32_t r = 0; r < s.rows; ++r) {
        const std::uint32_t pos = s.first + r;
        for (std::uint32_t h = 0; h < shape.q_heads; ++h) {
          const float* q = s.q.data() + r * s.q_stride + std::size_t{h} * d;
          const std::size_t head = std::size_t{h / group} * d;
          std::vector<double> scores(pos + 1), acc(d, 0.0);
          double max = -std::numeric_limits<double>::infinity(), sum = 0;
          for (std::uint32_t t = 0; t <= pos; ++t) {
            double dot = 0;
            for (std::uint32_t i = 0; i < d; ++i) {
              dot += double(q[i]) * load_element(s.k.data(), static_cast<std::uint32_t>(t * token + head + i), dtype);
            }
            scores[t] = dot * shape.scale;
            max = std::max(max, scores[t]);
          }
          for (std::uint32_t t = 0; t <= pos; ++t) {
            const double w = std::exp(scores[t] - max);
            sum += w;
            for (std::uint32_t j = 0; j < d; ++j) {
              acc[j] += w * load_element(s.v.data(), static_cast<std::uint32_t>(t * token + head + j), dtype);
            }
          }
          float* row = want.data() + r * s.out_stride + std::size_t{h} * d;
          for (std::uint32_t j = 0; j < d; ++j) row[j] = static_cast<float>(acc[j] / sum);
        }
      }
      CAPTURE(to_string(dtype), group);
      require_close(s, s.out, want, 1e-5);
    }
  }
}

TEST_CASE("The first position's output is V row 0 exactly, on the reference and every target", "[prompt-attention]") {
  std::mt19937 rng(9);
  for (const DType dtype : {DType::f32, DType::f16, DType::bf16}) {
    const PromptAttentionShape shape = shape_of(dtype, 2, 3, 64);
    Sequence s(shape, 0, 1, false, rng);
    const auto require_v0 = [&] {
      for (std::uint32_t h = 0; h < shape.q_heads; ++h) {
        const float* row = s.out_row(s.out, 0, h);
        for (std::uint32_t j = 0; j < shape.head_dim; ++j) {
          const float v = load_element(s.v.data(), (h / 3) * shape.head_dim + j, dtype);
          CAPTURE(to_string(dtype), h, j);
          REQUIRE(row[j] == v);
        }
      }
    };
    prompt_attention_scalar(shape, s.chunk());
    require_v0();
    on_every_target([&](const std::string& target) {
      CAPTURE(target);
      std::fill(s.out.begin(), s.out.end(), kSentinel);
      const PromptChunk c = s.chunk();
      PromptAttention attention;
      attention.plan(shape, std::span(&c, 1), 1);
      attention.run(0, 1);
      require_v0();
    });
  }
}

TEST_CASE("A NaN key makes exactly the outputs that attend it NaN, on the reference and every target",
          "[prompt-attention]") {
  std::mt19937 rng(13);
  // Not f16: Highway's f16 widening on targets without F16C (SSE4 and below)
  // reads an all-ones exponent as a finite number.
  for (const DType dtype : {DType::f32, DType::bf16}) {
    const PromptAttentionShape shape = shape_of(dtype, 2, 3, 64);
    Sequence s(shape, 40, 100, false, rng);
    constexpr std::uint32_t kNanToken = 70;  // kv head 1: q heads 3-5 of rows at positions >= 70
    store_element(s.k.data(), (kNanToken * 2 + 1) * shape.head_dim + 5, dtype, std::numeric_limits<float>::quiet_NaN());
    const auto require_nan_where_attended = [&] {
      for (std::uint32_t r = 0; r < s.rows; ++r) {
        for (std::uint32_t h = 0; h < shape.q_heads; ++h) {
          const bool attends = s.first + r >= kNanToken && h >= 3;
          const float* row = s.out_row(s.out, r, h);
          const bool all_nan = std::all_of(row, row + shape.head_dim, [](float x) { return std::isnan(x); });
          const bool all_finite = std::all_of(row, row + shape.head_dim, [](float x) { return std::isfinite(x); });
          CAPTURE(to_string(dtype), r, h);
          REQUIRE((attends ? all_nan : all_finite));
        }
      }
    };
    prompt_attention_scalar(shape, s.chunk());
    require_nan_where_attended();
    on_every_target([&](const std::string& target) {
      CAPTURE(target);
      std::fill(s.out.begin(), s.out.end(), kSentinel);
      const PromptChunk c = s.chunk();
      PromptAttention attention;
      attention.plan(shape, std::span(&c, 1), 1);
      attention.run(0, 1);
      require_nan_where_attended();
    });
  }
}

TEST_CASE("A prompt attended whole or in chunks gives the same bits", "[prompt-attention]") {
  std::mt19937 rng(21);
  for (const auto& [shape, first] :
       {std::pair{shape_of(DType::f16, 3, 3, 64), 0u}, std::pair{shape_of(DType::bf16, 2, 4, 128), 0u},
        std::pair{shape_of(DType::f32, 1, 8, 64), 33u}}) {
    Sequence s(shape, first, 300, false, rng);
    // Cuts: chunks of 64 (each with its first), and uneven ones.
    const std::vector<std::vector<std::uint32_t>> cuts = {{64, 64, 64, 64, 44}, {7, 100, 13, 1, 120, 59}};
    on_every_target([&](const std::string& target) {
      CAPTURE(target, to_string(shape.dtype), shape.q_heads, first);
      std::fill(s.out.begin(), s.out.end(), kSentinel);
      const PromptChunk whole = s.chunk();
      PromptAttention attention;
      attention.plan(shape, std::span(&whole, 1), 1);
      attention.run(0, 1);
      for (const auto& cut : cuts) {
        std::vector<float> parts(s.out.size(), kSentinel);
        std::vector<PromptChunk> chunks;
        std::uint32_t from = 0;
        for (const std::uint32_t n : cut) {
          chunks.push_back(s.chunk(parts, from, n));
          from += n;
        }
        REQUIRE(from == s.rows);
        // One plan of every chunk, and each chunk in a plan of its own.
        attention.plan(shape, chunks, 1);
        attention.run(0, 1);
        REQUIRE(std::memcmp(parts.data(), s.out.data(), parts.size() * sizeof(float)) == 0);
        std::fill(parts.begin(), parts.end(), kSentinel);
        for (const PromptChunk& c : chunks) {
          attention.plan(shape, std::span(&c, 1), 1);
          attention.run(0, 1);
        }
        REQUIRE(std::memcmp(parts.data(), s.out.data(), parts.size() * sizeof(float)) == 0);
      }
    });
  }
}

TEST_CASE("PromptAttention gives the same bits on 1, 2, 3 or 5 threads", "[prompt-attention]") {
  std::mt19937 rng(4);
  for (const PromptAttentionShape& shape : {shape_of(DType::f16, 3, 3, 64), shape_of(DType::f16, 2, 4, 128)}) {
    std::vector<Sequence> seqs;
    seqs.emplace_back(shape, 0, 300, false, rng);
    seqs.emplace_back(shape, 700, 129, true, rng);
    seqs.emplace_back(shape, 5, 3, false, rng);
    std::vector<std::vector<float>> first_run;
    for (const std::size_t nth : {1u, 2u, 3u, 5u}) {
      CAPTURE(shape.q_heads, nth);
      std::vector<PromptChunk> chunks;
      for (Sequence& s : seqs) {
        std::fill(s.out.begin(), s.out.end(), kSentinel);
        chunks.push_back(s.chunk());
      }
      PromptAttention attention;
      attention.plan(shape, chunks, 5);
      REQUIRE(attention.tiles() >= nth);
      run_on_threads(attention, nth);
      for (std::size_t i = 0; i < seqs.size(); ++i) {
        if (nth == 1) {
          REQUIRE(std::count(seqs[i].out.begin(), seqs[i].out.end(), kSentinel) ==
                  std::ptrdiff_t(seqs[i].rows * (seqs[i].out_stride - std::size_t{shape.q_heads} * shape.head_dim)));
          first_run.push_back(seqs[i].out);
        } else {
          REQUIRE(std::memcmp(seqs[i].out.data(), first_run[i].data(), first_run[i].size() * sizeof(float)) == 0);
        }
      }
    }
  }
}

TEST_CASE("PromptAttention refuses bad shapes before writing anything", "[prompt-attention]") {
  std::mt19937 rng(2);
  const PromptAttentionShape good = shape_of(DType::f16, 2, 3, 64);
  Sequence s(good, 10, 20, true, rng);
  const PromptChunk ok = s.chunk();
  PromptAttention attention;
  attention.plan(good, std::span(&ok, 1), 2);
  const std::size_t planned = attention.tiles();
  REQUIRE(planned > 0);
  const std::vector<float> before = s.out;

  const auto refused = [&](const PromptAttentionShape& shape, const PromptChunk& c, std::size_t max_threads) {
    const std::vector<PromptChunk> chunks = {ok, c};
    REQUIRE_SPARSEKV_ERROR(attention.plan(shape, chunks, max_threads), ErrorCode::invalid_argument);
    REQUIRE(attention.tiles() == planned);  // the earlier plan stands
    if (max_threads != 0) REQUIRE_SPARSEKV_ERROR(prompt_attention_scalar(shape, c), ErrorCode::invalid_argument);
    REQUIRE(s.out == before);
  };
  PromptAttentionShape shape = good;
  shape.q_heads = 7;  // not a multiple of 2 kv heads
  refused(shape, ok, 2);
  shape = good;
  shape.kv_heads = 0;
  refused(shape, ok, 2);
  shape = good;
  shape.head_dim = 0;
  refused(shape, ok, 2);
  shape = good;
  shape.scale = 0.0f;
  refused(shape, ok, 2);
  shape = good;
  shape.scale = std::numeric_limits<float>::quiet_NaN();
  refused(shape, ok, 2);
  shape = good;
  shape.dtype = static_cast<DType>(7);
  refused(shape, ok, 2);

  PromptChunk c = ok;
  c.q = nullptr;
  refused(good, c, 2);
  c = ok;
  c.k = nullptr;
  refused(good, c, 2);
  c = ok;
  c.v = nullptr;
  refused(good, c, 2);
  c = ok;
  c.out = nullptr;
  refused(good, c, 2);
  c = ok;
  c.rows = 0;
  refused(good, c, 2);
  c = ok;
  c.q_stride = std::size_t{good.q_heads} * good.head_dim - 1;
  refused(good, c, 2);
  c = ok;
  c.out_stride = 1;
  refused(good, c, 2);
  c = ok;
  c.first = std::numeric_limits<std::int32_t>::max() - 5;
  refused(good, c, 2);
  refused(good, ok, 0);

  // More threads than planned for, or an ith past nth.
  REQUIRE_SPARSEKV_ERROR(attention.run(0, 3), ErrorCode::invalid_argument);
  REQUIRE_SPARSEKV_ERROR(attention.run(2, 2), ErrorCode::invalid_argument);
  REQUIRE(s.out == before);
  // The plan still runs.
  run_on_threads(attention, 2);
  REQUIRE(s.out != before);
}
