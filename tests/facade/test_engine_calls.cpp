// What a real engine's calls need from the Manager (docs/integration.md,
// "Prompts in chunks", "Continuations", "Attention scale"), each against a
// twin that gets the same tokens the plain way:
//  - a prompt in chunks (prefill_chunk, then the first decode or end_prompt)
//    decodes bit for bit as one prefill() of the whole prompt;
//  - extend() of n tokens leaves the request exactly as n decode steps would:
//    every later output and selection is the same, bit for bit;
//  - Config::attention_scale s attends by s * q.k: the same outputs as the
//    default scale with q * s * sqrt(head_dim), and the softmax of s * q.k;
//  - each misuse is refused with its code and changes nothing.
// Every selection policy and both evicting ones.
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "sparsekv/core/numeric.hpp"
#include "sparsekv/facade/manager_inspection.hpp"
#include "sparsekv/sparsekv.hpp"
#include "test_support.hpp"

using namespace sparsekv;

namespace {

constexpr ModelShape kShape{2, 4, 2, 8, DType::f32};
constexpr std::uint32_t kPageTokens = 4;
constexpr std::uint32_t kMaxTokens = 128;
constexpr std::size_t kRow = std::size_t{kShape.kv_heads} * kShape.head_dim;
constexpr std::size_t kQRow = std::size_t{kShape.q_heads} * kShape.head_dim;

Config config() { return test::small_config(kShape, kPageTokens, 4, kMaxTokens, 1024); }

std::vector<std::string> all_policies() {
  std::vector<std::string> p = policy_names();
  for (const std::string& e : eviction_policy_names()) p.push_back(e);
  return p;
}

std::vector<float> draw(std::mt19937& rng, std::size_t n) {
  std::normal_distribution<float> normal;
  std::vector<float> x(n);
  for (float& e : x) e = normal(rng);
  return x;
}

// `from` stored in `dtype` (core/numeric.hpp's rule) into `to`.
void narrow(const std::vector<float>& from, DType dtype, std::vector<std::byte>& to) {
  for (std::size_t i = 0; i < from.size(); ++i) store_element(to.data(), std::uint32_t(i), dtype, from[i]);
}

// One decode step of request 1 in every layer of both managers, compared bit for bit.
void step_both(RuntimeManager& a, RuntimeManager& b, std::mt19937& rng) {
  const RequestId one[] = {1};
  for (std::uint32_t l = 0; l < kShape.layers; ++l) {
    const std::vector<float> q = draw(rng, kQRow), k = draw(rng, kRow), v = draw(rng, kRow);
    std::vector<float> out_a(kQRow), out_b(kQRow);
    a.decode(one, l, q.data(), k.data(), v.data(), out_a.data());
    b.decode(one, l, q.data(), k.data(), v.data(), out_b.data());
    REQUIRE(std::memcmp(out_a.data(), out_b.data(), out_a.size() * sizeof(float)) == 0);
    REQUIRE(a.retrieval(0).partitions == b.retrieval(0).partitions);
    REQUIRE(a.retrieval(0).token_counts == b.retrieval(0).token_counts);
  }
}

}  // namespace

TEST_CASE("engine calls: a prompt in chunks decodes as one prefill, bit for bit", "[facade][engine-calls]") {
  for (const std::string& policy : all_policies()) {
    for (const std::uint32_t seed : {1u, 2u, 3u}) {
      CAPTURE(policy, seed);
      std::mt19937 rng(seed);
      const std::uint32_t prompt = std::uniform_int_distribution<std::uint32_t>(1, 70)(rng);
      std::vector<std::vector<float>> k, v;
      for (std::uint32_t l = 0; l < kShape.layers; ++l) {
        k.push_back(draw(rng, prompt * kRow));
        v.push_back(draw(rng, prompt * kRow));
      }
      RuntimeManager whole(kShape, config(), make_policy(policy, 16));
      RuntimeManager chunked(kShape, config(), make_policy(policy, 16));
      whole.add_request(1, kMaxTokens);
      chunked.add_request(1, kMaxTokens);
      for (std::uint32_t l = 0; l < kShape.layers; ++l) whole.prefill(1, l, k[l].data(), v[l].data(), prompt);
      // Layers get different cuts; chunks of 1..prompt tokens, not page-aligned.
      for (std::uint32_t l = 0; l < kShape.layers; ++l) {
        for (std::uint32_t at = 0; at < prompt;) {
          const std::uint32_t n = std::min(prompt - at, std::uniform_int_distribution<std::uint32_t>(1, 23)(rng));
          chunked.prefill_chunk(1, l, k[l].data() + at * kRow, v[l].data() + at * kRow, n);
          at += n;
        }
        REQUIRE(chunked.staged_tokens(1, l) == prompt);
        REQUIRE_FALSE(chunked.prefilled(1, l));
      }
      if (seed == 2) {
        chunked.end_prompt(1);
        REQUIRE(chunked.prefilled(1, 0));
        REQUIRE(chunked.staged_tokens(1, 0) == 0);
      }
      for (std::uint32_t s = 0; s < 12; ++s) step_both(whole, chunked, rng);
      REQUIRE(chunked.prefilled(1, 1));
      inspect_buffer(whole).validate();
      inspect_buffer(chunked).validate();
    }
  }
}

TEST_CASE("engine calls: extend() leaves a request as that many decode steps would", "[facade][engine-calls]") {
  for (const std::string& policy : all_policies()) {
    for (const std::uint32_t seed : {1u, 2u}) {
      CAPTURE(policy, seed);
      std::mt19937 rng(seed);
      const std::uint32_t prompt = std::uniform_int_distribution<std::uint32_t>(1, 40)(rng);
      RuntimeManager stepped(kShape, config(), make_policy(policy, 16));
      RuntimeManager extended(kShape, config(), make_policy(policy, 16));
      for (RuntimeManager* m : {&stepped, &extended}) m->add_request(1, kMaxTokens);
      for (std::uint32_t l = 0; l < kShape.layers; ++l) {
        const std::vector<float> k = draw(rng, prompt * kRow), v = draw(rng, prompt * kRow);
        for (RuntimeManager* m : {&stepped, &extended}) m->prefill(1, l, k.data(), v.data(), prompt);
      }
      for (std::uint32_t s = 0; s < 3; ++s) step_both(stepped, extended, rng);
      // A continuation of n tokens: the twin decodes them one by one.
      const std::uint32_t n = std::uniform_int_distribution<std::uint32_t>(1, 30)(rng);
      const RequestId one[] = {1};
      for (std::uint32_t l = 0; l < kShape.layers; ++l) {
        const std::vector<float> q = draw(rng, n * kQRow), k = draw(rng, n * kRow), v = draw(rng, n * kRow);
        // Every other layer keeps the steps' outputs: each is that decode step's, bit for bit.
        std::vector<float> kept(l % 2 == 0 ? n * kQRow : 0, -1.0f);
        extended.extend(1, l, q.data(), k.data(), v.data(), n, kept.empty() ? nullptr : kept.data());
        std::vector<float> out(kQRow);
        for (std::uint32_t t = 0; t < n; ++t) {
          stepped.decode(one, l, q.data() + t * kQRow, k.data() + t * kRow, v.data() + t * kRow, out.data());
          if (!kept.empty()) REQUIRE(std::memcmp(kept.data() + t * kQRow, out.data(), kQRow * sizeof(float)) == 0);
        }
      }
      REQUIRE(inspect_buffer(extended).admission().sequence_length(1, 0) == prompt + 3 + n);
      for (std::uint32_t s = 0; s < 10; ++s) step_both(stepped, extended, rng);
      inspect_buffer(extended).validate();
    }
  }
}

TEST_CASE("engine calls: prompt_chunk attends the staged prompt causally, as the reference does",
          "[facade][engine-calls][prompt-attention]") {
  for (const DType dtype : {DType::f32, DType::f16}) {
    CAPTURE(to_string(dtype));
    ModelShape shape = kShape;
    shape.dtype = dtype;
    std::mt19937 rng(11);
    RuntimeManager m(shape, test::small_config(shape, kPageTokens, 4, kMaxTokens, 1024), make_policy("quest", 16));
    m.add_request(1, kMaxTokens);
    m.add_request(2, kMaxTokens);
    const std::size_t size = dtype_size(dtype);
    std::vector<std::byte> all_k, all_v;  // request 1's prompt, in the model dtype
    std::vector<float> out_lib, out_ref;
    // Request 1 in chunks of 5, 1 and 9 rows, each attended after staging, beside a 3-row chunk of request 2.
    for (const std::uint32_t rows : {5u, 1u, 9u}) {
      const std::vector<float> kf = draw(rng, rows * kRow), vf = draw(rng, rows * kRow), q = draw(rng, rows * kQRow);
      std::vector<std::byte> k(rows * kRow * size), v(rows * kRow * size);
      narrow(kf, dtype, k);
      narrow(vf, dtype, v);
      m.prefill_chunk(1, 0, k.data(), v.data(), rows);
      all_k.insert(all_k.end(), k.begin(), k.end());
      all_v.insert(all_v.end(), v.begin(), v.end());
      const std::vector<float> k2 = draw(rng, 3 * kRow), v2 = draw(rng, 3 * kRow), q2 = draw(rng, 3 * kQRow);
      std::vector<std::byte> k2n(3 * kRow * size), v2n(3 * kRow * size);
      narrow(k2, dtype, k2n);
      narrow(v2, dtype, v2n);
      m.prefill_chunk(2, 0, k2n.data(), v2n.data(), 3);
      std::vector<float> out(rows * kQRow, -7.0f), out2(3 * kQRow, -7.0f);
      const PromptChunk chunks[] = {m.prompt_chunk(1, 0, q.data(), rows, out.data()),
                                    m.prompt_chunk(2, 0, q2.data(), 3, out2.data())};
      REQUIRE(chunks[0].first == m.staged_tokens(1, 0) - rows);
      PromptAttention attention;
      attention.plan(m.prompt_attention_shape(), chunks, 2);
      std::thread other([&] { attention.run(1, 2); });
      attention.run(0, 2);
      other.join();
      // The reference over the same bytes, read back through read_kv.
      const std::uint32_t first = m.staged_tokens(1, 0) - rows;
      std::vector<std::byte> rk(m.staged_tokens(1, 0) * kRow * size), rv(rk.size());
      m.read_kv(1, 0, 0, m.staged_tokens(1, 0), rk.data(), rv.data());
      REQUIRE(rk == all_k);
      REQUIRE(rv == all_v);
      std::vector<float> ref(rows * kQRow);
      prompt_attention_scalar(m.prompt_attention_shape(),
                              PromptChunk{q.data(), 0, rk.data(), rv.data(), first, rows, ref.data(), 0});
      for (std::size_t i = 0; i < ref.size(); ++i) {
        REQUIRE(out[i] == Approx(ref[i]).margin(1e-5));
      }
    }
    REQUIRE(m.prompt_attention_shape().scale == Approx(1.0f / std::sqrt(float(kShape.head_dim))));
    // Refused, changing nothing: more rows than staged, a null q, a prefilled layer.
    std::vector<float> q(kQRow), out(kQRow);
    REQUIRE_THROWS_MATCHES(m.prompt_chunk(1, 0, q.data(), 16, out.data()), Error,
                           Catch::Predicate<Error>([](const Error& e) { return e.code() == ErrorCode::out_of_range; }));
    REQUIRE_THROWS_MATCHES(
        m.prompt_chunk(1, 0, nullptr, 1, out.data()), Error,
        Catch::Predicate<Error>([](const Error& e) { return e.code() == ErrorCode::invalid_argument; }));
    m.end_prompt(1);
    REQUIRE_THROWS_MATCHES(
        m.prompt_chunk(1, 0, q.data(), 1, out.data()), Error,
        Catch::Predicate<Error>([](const Error& e) { return e.code() == ErrorCode::failed_precondition; }));
  }
}

TEST_CASE("engine calls: a prefill converts V only for a policy whose Index reads it; non-finite V refused either way",
          "[facade][engine-calls]") {
  for (const std::string& policy : all_policies()) {
    CAPTURE(policy);
    const bool reads = index_reads_values(make_policy(policy, 16));
    CHECK(reads == policy.starts_with("retroinfer"));
    // 600 tokens: the non-finite value in the third of the V blocks host_prefill checks.
    const std::uint32_t prompt = 600;
    RuntimeManager m(kShape, test::small_config(kShape, kPageTokens, 2, 1024, 8192), make_policy(policy, 16));
    m.add_request(1, 1024);
    std::mt19937 rng(5);
    std::vector<float> k = draw(rng, prompt * kRow), v = draw(rng, prompt * kRow);
    v[(prompt - 3) * kRow + 5] = std::nanf("");
    REQUIRE_THROWS_MATCHES(
        m.prefill(1, 0, k.data(), v.data(), prompt), Error, Catch::Predicate<Error>([&](const Error& e) {
          return e.code() == ErrorCode::invalid_argument &&
                 std::string(e.what()).find("token " + std::to_string(prompt - 3)) != std::string::npos;
        }));
    REQUIRE_FALSE(m.prefilled(1, 0));
  }
}

TEST_CASE("engine calls: chunks and continuations refused where they cannot be served, changing nothing",
          "[facade][engine-calls][errors]") {
  std::mt19937 rng(7);
  RuntimeManager m(kShape, config(), make_policy("quest", 16));
  RuntimeManager twin(kShape, config(), make_policy("quest", 16));
  const std::vector<float> k = draw(rng, 20 * kRow), v = draw(rng, 20 * kRow), q = draw(rng, 20 * kQRow);
  for (RuntimeManager* x : {&m, &twin}) x->add_request(1, 40);
  // A chunk past max_tokens, a null or non-finite chunk: nothing staged.
  std::vector<float> bad = k;
  bad[3 * kRow + 5] = std::nanf("");
  REQUIRE_SPARSEKV_ERROR(m.prefill_chunk(1, 0, k.data(), v.data(), 41), ErrorCode::resource_exhausted);
  REQUIRE_SPARSEKV_ERROR(m.prefill_chunk(1, 0, nullptr, v.data(), 4), ErrorCode::invalid_argument);
  REQUIRE_SPARSEKV_ERROR(m.prefill_chunk(1, 0, bad.data(), v.data(), 10), ErrorCode::invalid_argument);
  REQUIRE_SPARSEKV_ERROR(m.prefill_chunk(1, 2, k.data(), v.data(), 4), ErrorCode::out_of_range);
  REQUIRE_SPARSEKV_ERROR(m.prefill_chunk(9, 0, k.data(), v.data(), 4), ErrorCode::not_found);
  REQUIRE(m.staged_tokens(1, 0) == 0);
  for (std::uint32_t l = 0; l < kShape.layers; ++l) {
    m.prefill_chunk(1, l, k.data(), v.data(), 12);
    m.prefill_chunk(1, l, k.data() + 12 * kRow, v.data() + 12 * kRow, 8);
    twin.prefill(1, l, k.data(), v.data(), 20);
  }
  // A staged prompt is not mixed with a whole one; a chunk over max_tokens in total is refused.
  REQUIRE_SPARSEKV_ERROR(m.prefill(1, 0, k.data(), v.data(), 4), ErrorCode::failed_precondition);
  REQUIRE_SPARSEKV_ERROR(m.prefill_chunk(1, 0, k.data(), v.data(), 21), ErrorCode::resource_exhausted);
  REQUIRE(m.staged_tokens(1, 0) == 20);
  // extend checks before it prefills a staged prompt: a refusal leaves the layer staged.
  REQUIRE_SPARSEKV_ERROR(m.extend(1, 0, q.data(), bad.data(), v.data(), 10), ErrorCode::invalid_argument);
  REQUIRE_SPARSEKV_ERROR(m.extend(1, 0, q.data(), k.data(), v.data(), 21), ErrorCode::resource_exhausted);
  REQUIRE(m.staged_tokens(1, 0) == 20);
  REQUIRE_FALSE(m.prefilled(1, 0));
  m.end_prompt(1);
  // Once prefilled, the layer grows by extend(), not by chunks.
  REQUIRE_SPARSEKV_ERROR(m.prefill_chunk(1, 0, k.data(), v.data(), 1), ErrorCode::failed_precondition);
  // extend: past max_tokens (20 + 21 > 40), a non-finite value, before any prefill: refused whole.
  REQUIRE_SPARSEKV_ERROR(m.extend(1, 0, q.data(), k.data(), v.data(), 21), ErrorCode::resource_exhausted);
  REQUIRE_SPARSEKV_ERROR(m.extend(1, 0, q.data(), bad.data(), v.data(), 10), ErrorCode::invalid_argument);
  REQUIRE_SPARSEKV_ERROR(m.extend(1, 0, nullptr, k.data(), v.data(), 1), ErrorCode::invalid_argument);
  m.add_request(2, 40);
  twin.add_request(2, 40);
  REQUIRE_SPARSEKV_ERROR(m.extend(2, 0, q.data(), k.data(), v.data(), 1), ErrorCode::failed_precondition);
  REQUIRE(inspect_buffer(m).admission().sequence_length(1, 0) == 20);
  // Nothing changed: the two decode alike.
  for (std::uint32_t s = 0; s < 6; ++s) step_both(m, twin, rng);
  inspect_buffer(m).validate();
}

TEST_CASE("engine calls: Config::attention_scale attends by s * q.k", "[facade][engine-calls][scale]") {
  constexpr float kScale = 1.0f;  // Gemma 3's: q arrives pre-scaled
  for (const std::string& policy : all_policies()) {
    CAPTURE(policy);
    std::mt19937 rng(11);
    Config scaled_config = config();
    scaled_config.attention_scale = kScale;
    RuntimeManager scaled(kShape, scaled_config, make_policy(policy, 16));
    RuntimeManager plain(kShape, config(), make_policy(policy, 16));
    const std::uint32_t prompt = 30;
    std::vector<std::vector<float>> hk(kShape.layers), hv(kShape.layers);
    for (RuntimeManager* m : {&scaled, &plain}) m->add_request(1, kMaxTokens);
    for (std::uint32_t l = 0; l < kShape.layers; ++l) {
      hk[l] = draw(rng, prompt * kRow);
      hv[l] = draw(rng, prompt * kRow);
      for (RuntimeManager* m : {&scaled, &plain}) m->prefill(1, l, hk[l].data(), hv[l].data(), prompt);
    }
    const float factor = kScale * std::sqrt(static_cast<float>(kShape.head_dim));
    const RequestId one[] = {1};
    for (std::uint32_t s = 0; s < 8; ++s) {
      for (std::uint32_t l = 0; l < kShape.layers; ++l) {
        std::vector<float> q = draw(rng, kQRow);
        const std::vector<float> k = draw(rng, kRow), v = draw(rng, kRow);
        std::vector<float> q_folded = q;
        for (float& x : q_folded) x *= factor;
        std::vector<float> out_s(kQRow), out_p(kQRow);
        scaled.decode(one, l, q.data(), k.data(), v.data(), out_s.data());
        plain.decode(one, l, q_folded.data(), k.data(), v.data(), out_p.data());
        REQUIRE(std::memcmp(out_s.data(), out_p.data(), out_s.size() * sizeof(float)) == 0);
        hk[l].insert(hk[l].end(), k.begin(), k.end());
        hv[l].insert(hv[l].end(), v.begin(), v.end());
        if (policy != "dense") continue;
        // Dense attends everything: the softmax of kScale * q.k, in double.
        const std::size_t tokens = hk[l].size() / kRow;
        const std::uint32_t group = kShape.group_size(), d = kShape.head_dim;
        for (std::uint32_t h = 0; h < kShape.q_heads; ++h) {
          const std::uint32_t kv = h / group;
          std::vector<double> w(tokens);
          double max = -INFINITY, sum = 0;
          for (std::size_t t = 0; t < tokens; ++t) {
            double dot = 0;
            for (std::uint32_t i = 0; i < d; ++i) dot += double(q[h * d + i]) * hk[l][t * kRow + kv * d + i];
            w[t] = kScale * dot;
            max = std::max(max, w[t]);
          }
          for (double& x : w) sum += x = std::exp(x - max);
          for (std::uint32_t i = 0; i < d; ++i) {
            double o = 0;
            for (std::size_t t = 0; t < tokens; ++t) o += w[t] * hv[l][t * kRow + kv * d + i];
            REQUIRE(out_s[h * d + i] == Approx(o / sum).margin(1e-5));
          }
        }
      }
    }
  }
  Config bad = config();
  for (const float s : {-1.0f, std::nanf(""), INFINITY}) {
    bad.attention_scale = s;
    REQUIRE_SPARSEKV_ERROR(RuntimeManager(kShape, bad, make_policy("dense", 16)), ErrorCode::invalid_argument);
  }
}

TEST_CASE("engine calls: read_kv gives back the prompt staged and the CPU tier's rows in order",
          "[facade][engine-calls][read-kv]") {
  for (const std::string& policy : all_policies()) {
    CAPTURE(policy);
    std::mt19937 rng(7);
    const std::uint32_t prompt = 37;
    const std::vector<float> k = draw(rng, prompt * kRow), v = draw(rng, prompt * kRow);
    RuntimeManager m(kShape, config(), make_policy(policy, 16));
    m.add_request(1, kMaxTokens);
    m.prefill_chunk(1, 0, k.data(), v.data(), 20);
    m.prefill_chunk(1, 0, k.data() + 20 * kRow, v.data() + 20 * kRow, prompt - 20);
    m.prefill_chunk(1, 1, k.data(), v.data(), prompt);
    REQUIRE(m.readable_tokens(1, 0) == prompt);
    std::vector<float> rk(prompt * kRow, -1.0f), rv(prompt * kRow, -1.0f);
    m.read_kv(1, 0, 3, prompt, rk.data(), rv.data());
    REQUIRE(std::memcmp(rk.data(), k.data() + 3 * kRow, (prompt - 3) * kRow * sizeof(float)) == 0);
    REQUIRE(std::memcmp(rv.data(), v.data() + 3 * kRow, (prompt - 3) * kRow * sizeof(float)) == 0);

    // Refusals write nothing.
    std::fill(rk.begin(), rk.end(), -1.0f);
    REQUIRE_SPARSEKV_ERROR(m.read_kv(1, 0, 0, prompt + 1, rk.data(), rv.data()), ErrorCode::out_of_range);
    REQUIRE_SPARSEKV_ERROR(m.read_kv(1, 0, 5, 4, rk.data(), rv.data()), ErrorCode::out_of_range);
    REQUIRE_SPARSEKV_ERROR(m.read_kv(2, 0, 0, 1, rk.data(), rv.data()), ErrorCode::not_found);
    REQUIRE(rk[0] == -1.0f);

    // Prefilled: what is readable is the CPU tier's, and it is the prompt.
    m.end_prompt(1);
    const std::uint32_t readable = m.readable_tokens(1, 0);
    REQUIRE(readable == inspect_buffer(m).forks().saved_tokens(1, 0));
    REQUIRE(readable <= prompt);
    if (policy == "quest" || policy == "dense") REQUIRE(readable == prompt);
    m.read_kv(1, 0, 0, readable, rk.data(), rv.data());
    REQUIRE(std::memcmp(rk.data(), k.data(), readable * kRow * sizeof(float)) == 0);
    REQUIRE(std::memcmp(rv.data(), v.data(), readable * kRow * sizeof(float)) == 0);
    REQUIRE_SPARSEKV_ERROR(m.read_kv(1, 0, 0, readable + 1, rk.data(), rv.data()), ErrorCode::out_of_range);
    if (policy != "quest" && policy != "dense") continue;

    // Decoded tokens: the saved decode pages go on from a prompt that ends
    // off a page boundary (37 = 9 pages + 1); the unsaved tail page is not read.
    std::vector<float> all_k = k, all_v = v;
    const RequestId one[] = {1};
    for (std::uint32_t step = 0; step < 2 * kPageTokens + 1; ++step) {
      for (std::uint32_t l = 0; l < kShape.layers; ++l) {
        const std::vector<float> q = draw(rng, kQRow), dk = draw(rng, kRow), dv = draw(rng, kRow);
        std::vector<float> out(kQRow);
        m.decode(one, l, q.data(), dk.data(), dv.data(), out.data());
        if (l == 0) {
          all_k.insert(all_k.end(), dk.begin(), dk.end());
          all_v.insert(all_v.end(), dv.begin(), dv.end());
        }
      }
    }
    const std::uint32_t held = prompt + 2 * kPageTokens + 1;
    REQUIRE(m.readable_tokens(1, 0) == held - 1);
    rk.resize(held * kRow);
    rv.resize(held * kRow);
    m.read_kv(1, 0, 0, held - 1, rk.data(), rv.data());
    REQUIRE(std::memcmp(rk.data(), all_k.data(), (held - 1) * kRow * sizeof(float)) == 0);
    REQUIRE(std::memcmp(rv.data(), all_v.data(), (held - 1) * kRow * sizeof(float)) == 0);
    REQUIRE_SPARSEKV_ERROR(m.read_kv(1, 0, 0, held, rk.data(), rv.data()), ErrorCode::out_of_range);
  }
}
