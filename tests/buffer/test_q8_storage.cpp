// q8_0 storage of the CPU tier (Config::kv_storage): ggml's block rule,
// written as rows arrive and read back without loss of what was stored:
//  - quantize_row_q8_0 by hand-checked blocks (scale, rounding half away
//    from zero, an all-zero block) and load_element reading them back;
//  - the buffer stores exactly quantize(row) for prefill, decode and a
//    fork's rows, and read_prefix gives them back as stored or dequantized;
//  - a Manager storing q8_0 decodes as one storing f32 that is handed the
//    dequantized rows (dense), on the host and in-place backends, within
//    1e-5 relative (the same values, summed in another order);
//    every policy serves prefill, decode, extend and fork with read_kv giving
//    the dequantized rows, or the stored blocks, which prefill takes back
//    byte for byte;
//  - what q8_0 cannot serve is refused with a message.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "sparsekv/core/convert.hpp"
#include "sparsekv/core/numeric.hpp"
#include "sparsekv/sparsekv.hpp"
#include "test_support.hpp"

using namespace sparsekv;

namespace {

constexpr ModelShape kShape{2, 4, 2, 64, DType::f32};
constexpr std::uint32_t kPageTokens = 4;
constexpr std::uint32_t kMaxTokens = 96;
constexpr std::size_t kRow = std::size_t{kShape.kv_heads} * kShape.head_dim;
constexpr std::size_t kQRow = std::size_t{kShape.q_heads} * kShape.head_dim;

Config q8_config() {
  Config c = test::small_config(kShape, kPageTokens, 4, kMaxTokens, 1024);
  c.kv_storage = DType::q8_0;
  return c;
}

std::vector<float> draw(std::mt19937& rng, std::size_t n) {
  std::normal_distribution<float> normal;
  std::vector<float> x(n);
  for (float& e : x) e = 2.0f * normal(rng);
  return x;
}

// Rows of kShape.head_dim fp32 values as q8_0 blocks, and those blocks read back.
std::vector<std::byte> quantized(const std::vector<float>& x) {
  std::vector<std::byte> q(x.size() / kQ8BlockValues * kQ8BlockBytes);
  convert_rows(x.data(), DType::f32, q.data(), DType::q8_0, x.size() / kShape.head_dim, kShape.head_dim);
  return q;
}
std::vector<float> dequantized(const std::vector<float>& x) {
  const std::vector<std::byte> q = quantized(x);
  std::vector<float> out(x.size());
  convert_rows(q.data(), DType::q8_0, out.data(), DType::f32, x.size() / kShape.head_dim, kShape.head_dim);
  return out;
}

std::vector<std::string> all_policies() {
  std::vector<std::string> p = policy_names();
  for (const std::string& e : eviction_policy_names()) p.push_back(e);
  return p;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

}  // namespace

TEST_CASE("quantize_row_q8_0 follows ggml's rule; load_element reads it back", "[q8-storage]") {
  std::vector<float> x(2 * kQ8BlockValues, 0.0f);
  // Block 0: max |x| = 254 gives d = 2; 5 / 2 = 2.5 rounds away from zero to 3, -5 to -3, 3 / 2 = 1.5 to 2.
  x[0] = 254.0f;
  x[1] = 5.0f;
  x[2] = -5.0f;
  x[3] = 3.0f;
  x[4] = -254.0f;
  x[5] = 0.9f;  // 0.45 -> 0
  // Block 1 stays all zero: d = 0, q = 0.
  std::vector<std::byte> q(2 * kQ8BlockBytes);
  quantize_row_q8_0(x.data(), x.size(), q.data());
  std::uint16_t d0, d1;
  std::memcpy(&d0, q.data(), 2);
  std::memcpy(&d1, q.data() + kQ8BlockBytes, 2);
  REQUIRE(f16_to_float(d0) == 2.0f);
  REQUIRE(d1 == 0);
  const auto qs = [&](std::size_t i) { return static_cast<int>(static_cast<std::int8_t>(q[2 + i])); };
  REQUIRE(qs(0) == 127);
  REQUIRE(qs(1) == 3);
  REQUIRE(qs(2) == -3);
  REQUIRE(qs(3) == 2);
  REQUIRE(qs(4) == -127);
  REQUIRE(qs(5) == 0);
  REQUIRE(load_element(q.data(), 0, DType::q8_0) == 254.0f);
  REQUIRE(load_element(q.data(), 1, DType::q8_0) == 6.0f);
  REQUIRE(load_element(q.data(), 2, DType::q8_0) == -6.0f);
  for (std::uint32_t i = kQ8BlockValues; i < 2 * kQ8BlockValues; ++i)
    REQUIRE(load_element(q.data(), i, DType::q8_0) == 0.0f);

  // Any row: each value within half a step of its block's scale, and widen_to_float agrees with load_element.
  std::mt19937 rng(5);
  const std::vector<float> row = draw(rng, 4 * kQ8BlockValues);
  std::vector<std::byte> blocks(4 * kQ8BlockBytes);
  quantize_row_q8_0(row.data(), row.size(), blocks.data());
  std::vector<float> wide(row.size());
  REQUIRE(widen_to_float(blocks.data(), DType::q8_0, row.size(), wide.data()));
  for (std::uint32_t i = 0; i < row.size(); ++i) {
    std::uint16_t d;
    std::memcpy(&d, blocks.data() + i / kQ8BlockValues * kQ8BlockBytes, 2);
    REQUIRE(wide[i] == load_element(blocks.data(), i, DType::q8_0));
    // Half a step, plus what rounding d to f16 moves the largest q (127 * 2^-11 steps).
    REQUIRE(std::abs(wide[i] - row[i]) <= 0.57f * f16_to_float(d));
  }
  REQUIRE(dtype_row_bytes(DType::q8_0, 128) == 4 * 34);
  REQUIRE(parse_dtype("q8_0") == DType::q8_0);
  REQUIRE(to_string(DType::q8_0) == "q8_0");
}

TEST_CASE("q8_0 storage is refused where it cannot be served", "[q8-storage]") {
  ModelShape model = kShape;
  model.dtype = DType::q8_0;
  REQUIRE_SPARSEKV_ERROR(model.validate(), ErrorCode::invalid_argument);
  Config c = q8_config();
  ModelShape narrow = kShape;
  narrow.head_dim = 48;  // not whole blocks
  REQUIRE_SPARSEKV_ERROR(c.validate(narrow), ErrorCode::invalid_argument);
  c.kv_storage = DType::bf16;  // neither the model's dtype nor q8_0
  REQUIRE_SPARSEKV_ERROR(c.validate(kShape), ErrorCode::invalid_argument);
  c.kv_storage = DType::q8_0;
  REQUIRE(c.page_bytes(kShape) == std::size_t{kPageTokens} * 2 * 2 * kQ8BlockBytes);

  HostMemoryResource memory(false);
  TieredKVBuffer buffer(kShape, c, memory, memory);
  buffer.admission().add_request(1, RequestPages{2, 0});
  std::vector<PageId> saved(kShape.kv_heads);
  REQUIRE_SPARSEKV_ERROR(buffer.tails().append_on_device(1, 0, saved), ErrorCode::failed_precondition);
  std::vector<TokenPlacement> placements;
  const std::vector<PartitionSpec> specs(kShape.kv_heads, PartitionSpec::uniform(4, kPageTokens));
  REQUIRE_SPARSEKV_ERROR(buffer.offloader().offload_on_device(1, 0, 4, specs, placements),
                         ErrorCode::failed_precondition);
  REQUIRE(buffer.admission().sequence_length(1, 0) == 0);
}

TEST_CASE("the buffer stores q8_0 rows exactly as quantized, and reads them back", "[q8-storage]") {
  HostMemoryResource memory(false);
  const Config c = q8_config();
  TieredKVBuffer buffer(kShape, c, memory, memory);
  buffer.admission().add_request(1, RequestPages{2, 0});
  buffer.admission().add_request(2, RequestPages{2, 0});
  std::mt19937 rng(11);
  const std::uint32_t prompt = 10, decoded = 2 * kPageTokens;
  std::vector<float> k = draw(rng, prompt * kRow), v = draw(rng, prompt * kRow);
  const std::vector<PartitionSpec> specs(kShape.kv_heads, PartitionSpec::uniform(prompt, kPageTokens));
  buffer.offloader().offload(1, 0, KvChunk{k.data(), v.data(), prompt, DType::f32}, specs);
  for (std::uint32_t t = 0; t < decoded; ++t) {
    const std::vector<float> tk = draw(rng, kRow), tv = draw(rng, kRow);
    buffer.tails().append(1, 0, KvChunk{tk.data(), tv.data(), 1, DType::f32});
    k.insert(k.end(), tk.begin(), tk.end());
    v.insert(v.end(), tv.begin(), tv.end());
  }
  const std::uint32_t n = buffer.forks().saved_tokens(1, 0);
  REQUIRE(n == prompt + decoded);  // the prompt and the two decode pages saved
  k.resize(n * kRow);
  v.resize(n * kRow);
  std::vector<std::byte> raw_k(n * kRow / kQ8BlockValues * kQ8BlockBytes), raw_v(raw_k.size());
  buffer.forks().read_prefix(1, 0, 0, n, raw_k.data(), raw_v.data(), DType::q8_0);
  REQUIRE(raw_k == quantized(k));
  REQUIRE(raw_v == quantized(v));
  std::vector<float> wide_k(n * kRow), wide_v(n * kRow);
  buffer.forks().read_prefix(1, 0, 0, n, wide_k.data(), wide_v.data(), DType::f32);
  REQUIRE(same_bits(wide_k, dequantized(k)));
  REQUIRE(same_bits(wide_v, dequantized(v)));
  REQUIRE_SPARSEKV_ERROR(buffer.forks().read_prefix(1, 0, 0, n, wide_k.data(), wide_v.data(), DType::bf16),
                         ErrorCode::invalid_argument);

  // A fork's rows (shared pages and the copied rest) are the source's stored bytes, not quantized twice.
  const std::uint32_t forked = n - 1;
  buffer.forks().offload_shared(
      2, 1, 0, forked, std::vector<PartitionSpec>(kShape.kv_heads, PartitionSpec::uniform(forked, kPageTokens)));
  const std::uint32_t readable = buffer.forks().saved_tokens(2, 0);
  REQUIRE(readable >= 2 * kPageTokens);
  std::vector<std::byte> fork_k(readable * kRow / kQ8BlockValues * kQ8BlockBytes), fork_v(fork_k.size());
  buffer.forks().read_prefix(2, 0, 0, readable, fork_k.data(), fork_v.data(), DType::q8_0);
  REQUIRE(std::equal(fork_k.begin(), fork_k.end(), raw_k.begin()));
  REQUIRE(std::equal(fork_v.begin(), fork_v.end(), raw_v.begin()));
  buffer.validate();
}

TEST_CASE("a Manager storing q8_0 decodes as one storing the dequantized rows", "[q8-storage]") {
  for (const bool in_place : {false, true}) {
    CAPTURE(in_place);
    const auto make = [&](const Config& c) {
      return in_place ? RuntimeManager(kShape, c, make_policy("dense", 16), std::make_unique<InPlaceBackend>())
                      : RuntimeManager(kShape, c, make_policy("dense", 16));
    };
    RuntimeManager q8 = make(q8_config());
    RuntimeManager twin = make(test::small_config(kShape, kPageTokens, 4, kMaxTokens, 1024));
    std::mt19937 rng(3);
    const std::uint32_t prompt = 13;
    q8.add_request(1, kMaxTokens);
    twin.add_request(1, kMaxTokens);
    for (std::uint32_t l = 0; l < kShape.layers; ++l) {
      const std::vector<float> k = draw(rng, prompt * kRow), v = draw(rng, prompt * kRow);
      q8.prefill(1, l, k.data(), v.data(), prompt);
      twin.prefill(1, l, dequantized(k).data(), dequantized(v).data(), prompt);
    }
    const RequestId one[] = {1};
    for (std::uint32_t step = 0; step < 40; ++step) {
      for (std::uint32_t l = 0; l < kShape.layers; ++l) {
        const std::vector<float> q = draw(rng, kQRow), k = draw(rng, kRow), v = draw(rng, kRow);
        std::vector<float> out_q8(kQRow), out_twin(kQRow);
        q8.decode(one, l, q.data(), k.data(), v.data(), out_q8.data());
        twin.decode(one, l, q.data(), dequantized(k).data(), dequantized(v).data(), out_twin.data());
        CAPTURE(step, l);
        // The same values attended; the fold scales a q8_0 V row's weights by its block's d (w * d * q
        // against w * (q * d)), and f32 rows fold in smaller tiles: sums that round apart, no more.
        for (std::size_t i = 0; i < out_q8.size(); ++i) {
          REQUIRE(std::abs(out_q8[i] - out_twin[i]) <= 1e-5f * std::max(1.0f, std::abs(out_twin[i])));
        }
      }
    }
  }
}

TEST_CASE("every policy serves q8_0 storage: prefill, decode, extend, fork, read_kv", "[q8-storage]") {
  for (const std::string& policy : all_policies()) {
    CAPTURE(policy);
    RuntimeManager m(kShape, q8_config(), make_policy(policy, 16), std::make_unique<InPlaceBackend>());
    std::mt19937 rng(7);
    const std::uint32_t prompt = 40;
    m.add_request(1, kMaxTokens);
    std::vector<std::vector<float>> ks, vs;
    for (std::uint32_t l = 0; l < kShape.layers; ++l) {
      ks.push_back(draw(rng, prompt * kRow));
      vs.push_back(draw(rng, prompt * kRow));
      m.prefill(1, l, ks[l].data(), vs[l].data(), prompt);
    }
    const RequestId one[] = {1};
    for (std::uint32_t step = 0; step < 2 * kPageTokens; ++step) {
      for (std::uint32_t l = 0; l < kShape.layers; ++l) {
        const std::vector<float> q = draw(rng, kQRow), k = draw(rng, kRow), v = draw(rng, kRow);
        std::vector<float> out(kQRow);
        m.decode(one, l, q.data(), k.data(), v.data(), out.data());
        for (const float x : out) REQUIRE(std::isfinite(x));
      }
    }
    for (std::uint32_t l = 0; l < kShape.layers; ++l) {
      const std::vector<float> q = draw(rng, 3 * kQRow), k = draw(rng, 3 * kRow), v = draw(rng, 3 * kRow);
      std::vector<float> out(3 * kQRow);
      m.extend(1, l, q.data(), k.data(), v.data(), 3, out.data());
      for (const float x : out) REQUIRE(std::isfinite(x));
    }
    // What read_kv gives back of the prompt: its rows quantized, then widened.
    for (std::uint32_t l = 0; l < kShape.layers; ++l) {
      if (m.readable_tokens(1, l) < prompt) continue;  // an evicting policy dropped some
      std::vector<float> k(prompt * kRow), v(prompt * kRow);
      m.read_kv(1, l, 0, prompt, k.data(), v.data());
      REQUIRE(same_bits(k, dequantized(ks[l])));
      REQUIRE(same_bits(v, dequantized(vs[l])));
    }
    // The stored bytes read back and prefilled into another request: the same bytes, not quantized twice.
    // (An evicting policy may hold no position in order.)
    bool readable = true;
    for (std::uint32_t l = 0; l < kShape.layers; ++l) readable = readable && m.readable_tokens(1, l) > 0;
    if (readable) m.add_request(3, kMaxTokens);
    for (std::uint32_t l = 0; l < kShape.layers && readable; ++l) {
      const std::uint32_t n = std::min(prompt, m.readable_tokens(1, l));
      std::vector<std::byte> k(std::size_t{n} * kRow / kQ8BlockValues * kQ8BlockBytes), v(k.size());
      m.read_kv(1, l, 0, n, k.data(), v.data(), DType::q8_0);
      m.prefill(3, l, k.data(), v.data(), n, DType::q8_0);
      std::vector<std::byte> again_k(k.size()), again_v(v.size());
      m.read_kv(3, l, 0, std::min(n, m.readable_tokens(3, l)), again_k.data(), again_v.data(), DType::q8_0);
      const std::size_t readable =
          std::size_t{std::min(n, m.readable_tokens(3, l))} * kRow / kQ8BlockValues * kQ8BlockBytes;
      REQUIRE(std::equal(again_k.begin(), again_k.begin() + std::ptrdiff_t(readable), k.begin()));
      REQUIRE(std::equal(again_v.begin(), again_v.begin() + std::ptrdiff_t(readable), v.begin()));
      REQUIRE_SPARSEKV_ERROR(m.read_kv(3, l, 0, 1, again_k.data(), again_v.data(), DType::bf16),
                             ErrorCode::invalid_argument);
    }
    if (readable) m.finish(3);
    if (m.can_fork(1, prompt, kMaxTokens).admit) {
      m.fork(2, 1, prompt, kMaxTokens);
      std::vector<float> k(prompt * kRow), v(prompt * kRow), fk(prompt * kRow), fv(prompt * kRow);
      m.read_kv(1, 0, 0, prompt, k.data(), v.data());
      m.read_kv(2, 0, 0, prompt, fk.data(), fv.data());
      REQUIRE(same_bits(k, fk));
      REQUIRE(same_bits(v, fv));
    }
  }
}

TEST_CASE("q8_0 storage: a prompt in chunks (staged as blocks) decodes as one prefill, bit for bit", "[q8-storage]") {
  for (const std::string& policy : all_policies()) {
    CAPTURE(policy);
    RuntimeManager whole(kShape, q8_config(), make_policy(policy, 16), std::make_unique<InPlaceBackend>());
    RuntimeManager chunked(kShape, q8_config(), make_policy(policy, 16), std::make_unique<InPlaceBackend>());
    std::mt19937 rng(13);
    const std::uint32_t prompt = 37, cut = 16;
    whole.add_request(1, kMaxTokens);
    chunked.add_request(1, kMaxTokens);
    for (std::uint32_t l = 0; l < kShape.layers; ++l) {
      const std::vector<float> k = draw(rng, prompt * kRow), v = draw(rng, prompt * kRow);
      whole.prefill(1, l, k.data(), v.data(), prompt);
      chunked.prefill_chunk(1, l, k.data(), v.data(), cut);
      chunked.prefill_chunk(1, l, k.data() + cut * kRow, v.data() + cut * kRow, prompt - cut);
      // The staged prompt is its blocks: read back as stored and as values.
      std::vector<std::byte> blocks_k(prompt * kRow / kQ8BlockValues * kQ8BlockBytes), blocks_v(blocks_k.size());
      chunked.read_kv(1, l, 0, prompt, blocks_k.data(), blocks_v.data(), DType::q8_0);
      REQUIRE(blocks_k == quantized(k));
      REQUIRE(blocks_v == quantized(v));
      std::vector<float> wide_k(prompt * kRow), wide_v(prompt * kRow);
      chunked.read_kv(1, l, 0, prompt, wide_k.data(), wide_v.data());
      REQUIRE(same_bits(wide_k, dequantized(k)));
      REQUIRE(same_bits(wide_v, dequantized(v)));
    }
    REQUIRE(chunked.prompt_attention_shape().dtype == DType::q8_0);
    const RequestId one[] = {1};
    for (std::uint32_t step = 0; step < 2 * kPageTokens; ++step) {
      for (std::uint32_t l = 0; l < kShape.layers; ++l) {
        const std::vector<float> q = draw(rng, kQRow), k = draw(rng, kRow), v = draw(rng, kRow);
        std::vector<float> out_whole(kQRow), out_chunked(kQRow);
        whole.decode(one, l, q.data(), k.data(), v.data(), out_whole.data());
        chunked.decode(one, l, q.data(), k.data(), v.data(), out_chunked.data());
        CAPTURE(step, l);
        REQUIRE(same_bits(out_whole, out_chunked));
      }
    }
  }
}
