// Byte-level BPE tokenizer (examples/model/bpe_tokenizer.hpp).
//
// Unit tests use a tiny vocabulary written as a GGUF fixture
// (model_test::write_tokenizer_fixture in test_model_gguf.cpp). Tests tagged
// [model-file] are hidden and use the real SmolLM2 vocabulary; their expected
// ids come from Hugging Face `tokenizers` (see kReference).
#include <catch2/catch.hpp>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "model/bpe_tokenizer.hpp"
#include "model/gguf.hpp"
#include "test_support.hpp"

using sparsekv::ErrorCode;
using namespace sparsekv::model;

namespace model_test {
std::string write_tokenizer_fixture(const std::string& model, const std::string& pre, bool drop_a_byte);
std::filesystem::path model_file();
}  // namespace model_test

namespace {

std::vector<std::string> pieces_of(const BpeTokenizer& tok, std::string_view text) {
  std::vector<std::string> out;
  for (std::string_view p : tok.pre_tokenize(text)) out.emplace_back(p);
  return out;
}

std::string read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::uint64_t fnv1a(const std::vector<std::int32_t>& ids) {
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (std::int32_t id : ids) {
    const auto u = static_cast<std::uint32_t>(id);
    for (int k = 0; k < 4; ++k) {
      h ^= (u >> (8 * k)) & 0xffu;
      h *= 0x100000001b3ull;
    }
  }
  return h;
}

// Strings with the cases the pre-tokenizer must get right.
const std::vector<std::string> kTricky = {
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world! It's 2024 and we've got 3.14159 reasons; don't we'll they'd I'm you're.",
    "  leading spaces,   inner   runs\tand tabs\n\nnew lines \n end  ",
    "Ünïcödé: naïve café, Straße, Ελληνικά, русский, 日本語のテキスト, 한국어, emoji 😀🎉 and ½ ² ٣ Ⅻ",
    "<|im_start|>user\nWhat is 12+34?<|im_end|>\n<|im_start|>assistant\n",
    "x\u00a0y\u3000z\u2028w \u00a0 v\v\fq\r\n",
    "O'Neil's 'quoted' ''s '' 'S 'LL",
    "def f(x):\n    return x**2  # square\n\n\n\tprint(f(10))",
};

}  // namespace

TEST_CASE("pre-tokenizer splits like Hugging Face's smollm pre-tokenizer", "[model][tokenizer]") {
  const GgufFile f = GgufFile::open(model_test::write_tokenizer_fixture("gpt2", "smollm", false));
  const BpeTokenizer tok(f);
  // Expected pieces: tokenizers 0.23, pre_tokenizers.Sequence([Digits(individual_digits=True),
  // ByteLevel(add_prefix_space=False)]).pre_tokenize_str(s), mapped back to bytes.
  using V = std::vector<std::string>;
  CHECK(pieces_of(tok, "Hello world") == V{"Hello", " world"});
  CHECK(pieces_of(tok, "it's  don't 'LL") == V{"it", "'s", " ", " don", "'t", " '", "LL"});
  CHECK(pieces_of(tok, "a  b   c\n\n d \t") == V{"a", " ", " b", "  ", " c", "\n\n", " d", " \t"});
  CHECK(pieces_of(tok, "x1234y 56 z") == V{"x", "1", "2", "3", "4", "y", " ", "5", "6", " z"});
  CHECK(pieces_of(tok, "¿Qué? ¡Sí!...") == V{"¿", "Qué", "?", " ¡", "Sí", "!..."});
  CHECK(pieces_of(tok, "tab\tend  ") == V{"tab", "\t", "end", "  "});
  CHECK(pieces_of(tok, "   ") == V{"   "});
  CHECK(pieces_of(tok, "a\u00a0\u00a0b") == V{"a", "\u00a0", "\u00a0", "b"});
  CHECK(pieces_of(tok, "Ⅻ½x٣") == V{"Ⅻ", "½", "x", "٣"});
  CHECK(pieces_of(tok, "O'Neil's'") == V{"O", "'", "Neil", "'s", "'"});
  CHECK(pieces_of(tok, "").empty());
}

TEST_CASE("BPE merges by rank on a tiny vocabulary", "[model][tokenizer]") {
  const GgufFile f = GgufFile::open(model_test::write_tokenizer_fixture("gpt2", "smollm", false));
  const BpeTokenizer tok(f);
  CHECK(tok.vocab_size() == 3 + 256 + 6);
  CHECK(tok.bos() == 1);
  CHECK(tok.eos() == 2);
  CHECK_FALSE(tok.add_bos());
  CHECK(tok.token(261) == "Ġthe");
  CHECK(tok.token_id("hello") == 264);
  const auto byte = [](char c) { return 3 + static_cast<std::int32_t>(static_cast<unsigned char>(c)); };
  CHECK(tok.encode("hello the") == std::vector<std::int32_t>{264, 261});
  CHECK(tok.encode("thell") == std::vector<std::int32_t>{byte('t'), 263});
  CHECK(tok.encode("hehe") == std::vector<std::int32_t>{260, 260});
  CHECK(tok.encode(" t") == std::vector<std::int32_t>{259});
  CHECK(tok.encode("") == std::vector<std::int32_t>{});
  // Control tokens written in the text, unless parse_special is off.
  CHECK(tok.encode("<|im_start|>hello<|im_end|>") == std::vector<std::int32_t>{1, 264, 2});
  CHECK(tok.encode("<|im_start|>", false).size() == 12);
  CHECK(tok.decode(std::vector<std::int32_t>{1, 264, 261, 2}) == "<|im_start|>hello the<|im_end|>");
  REQUIRE_SPARSEKV_ERROR(tok.decode(std::vector<std::int32_t>{265}), ErrorCode::out_of_range);
  REQUIRE_SPARSEKV_ERROR(tok.decode(std::vector<std::int32_t>{-1}), ErrorCode::out_of_range);
}

TEST_CASE("round trip of arbitrary bytes on a tiny vocabulary", "[model][tokenizer]") {
  const GgufFile f = GgufFile::open(model_test::write_tokenizer_fixture("gpt2", "smollm", false));
  const BpeTokenizer tok(f);
  for (const std::string& s : kTricky) CHECK(tok.decode(tok.encode(s)) == s);
  std::mt19937 rng(7);
  for (int trial = 0; trial < 50; ++trial) {
    std::string s(static_cast<std::size_t>(rng() % 200), '\0');
    for (char& c : s) c = static_cast<char>(rng() & 0xff);  // mostly invalid UTF-8
    CHECK(tok.decode(tok.encode(s, false)) == s);
  }
}

TEST_CASE("tokenizer construction errors", "[model][tokenizer]") {
  REQUIRE_SPARSEKV_ERROR(BpeTokenizer(GgufFile::open(model_test::write_tokenizer_fixture("llama", "smollm", false))),
                         ErrorCode::invalid_argument);
  REQUIRE_SPARSEKV_ERROR(BpeTokenizer(GgufFile::open(model_test::write_tokenizer_fixture("gpt2", "qwen9", false))),
                         ErrorCode::invalid_argument);
  // A byte without a token is dropped (as Hugging Face tokenizers does without an unk token).
  const BpeTokenizer no_q(GgufFile::open(model_test::write_tokenizer_fixture("gpt2", "smollm", true)));
  CHECK(no_q.missing_bytes() == std::vector<std::uint8_t>{'q'});
  CHECK(no_q.encode("hqello") == std::vector<std::int32_t>{264});
  CHECK(no_q.decode(no_q.encode("a q b")) == "a  b");
  // The plain GPT-2 pre-tokenizer keeps digit runs together.
  const BpeTokenizer gpt2(GgufFile::open(model_test::write_tokenizer_fixture("gpt2", "gpt2", false)));
  CHECK(pieces_of(gpt2, "x1234y 56 z") == std::vector<std::string>{"x", "1234", "y", " 56", " z"});
}

// ---- the real SmolLM2 vocabulary ------------------------------------------------

namespace {

struct Reference {
  std::string text;
  std::size_t count;
  std::vector<std::int32_t> ids;  // empty: check count and fnv only
  std::uint64_t fnv = 0;
};

// Produced once with Hugging Face `tokenizers` 0.23.3 (PyPI): Tokenizer(models.BPE(vocab, merges))
// from this GGUF's tokenizer.ggml.tokens/merges, pre_tokenizer Sequence([Digits(individual_digits=True),
// ByteLevel(add_prefix_space=False, use_regex=True)]) (SmolLM2's tokenizer.json), the 17 control
// tokens added as special tokens; encode(s, add_special_tokens=False).ids. fnv: FNV-1a 64 over
// the ids as little-endian uint32.
const std::vector<Reference> kReference = {
    {kTricky[0], 10, {504, 2365, 6354, 16438, 27003, 690, 260, 23790, 2767, 30}},
    {kTricky[1], 36, {19556, 28, 905, 17, 657, 506,  216, 34,   32,  34,  36,   284, 392,  3543, 3363, 216, 35,   30,
                      33,    36, 33,  37, 41,  3710, 43,  1326, 982, 392, 3060, 502, 6737, 339,  5248, 346, 2316, 30}},
    {kTricky[2],
     18,
     {216, 2899, 5600, 28, 256, 6210, 256, 7313, 197, 397, 29416, 198, 198, 2241, 3204, 3717, 1112, 256}},
    {kTricky[3], 81, {}, 0x398845a19ca10d80ull},
    {kTricky[4], 18, {1, 4093, 198, 1780, 314, 216, 33, 34, 27, 35, 36, 47, 2, 198, 1, 520, 9531, 198}},
    {kTricky[5], 16, {104, 15442, 105, 12109, 218, 106, 321, 118, 103, 3351, 250, 386, 199, 200, 97, 2738}},
    {kTricky[6], 15, {63, 23, 47917, 506, 637, 385, 5036, 23, 10922, 99, 10922, 637, 67, 637, 16421}},
    {kTricky[7], 22, {1604, 275,  24,    104, 727,  472, 1003, 1792, 828, 34, 216,
                      907,  5222, 16506, 197, 3272, 24,  86,   24,   33,  32, 1292}},
};

// Same tool on whole licence texts from /usr/share/common-licenses: bytes, token count, fnv.
struct LicenceReference {
  const char* name;
  std::size_t bytes;
  std::size_t count;
  std::uint64_t fnv;
};
const std::vector<LicenceReference> kLicences = {
    {"GPL-3", 35149, 7639, 0xc8408003babe0d68ull},
    {"Apache-2.0", 11358, 2215, 0xbae433a4e5729fd0ull},
    {"MPL-2.0", 16726, 3669, 0x7ecdda1fd61e687dull},
};

const BpeTokenizer& smollm_tokenizer() {
  static const GgufFile file = GgufFile::open(model_test::model_file());
  static const BpeTokenizer tok(file);
  return tok;
}

}  // namespace

TEST_CASE("SmolLM2 tokenizer: vocabulary and special tokens", "[.][model-file]") {
  const auto t0 = std::chrono::steady_clock::now();
  const BpeTokenizer& tok = smollm_tokenizer();
  const auto t1 = std::chrono::steady_clock::now();
  const double build_ms = std::chrono::duration<double>(t1 - t0).count() * 1e3;
  WARN("open + build tokenizer " << build_ms << " ms");
  CHECK(tok.vocab_size() == 49152);
  CHECK(tok.bos() == 1);
  CHECK(tok.eos() == 2);
  CHECK_FALSE(tok.add_bos());
  CHECK(tok.pre() == "smollm");
  CHECK(tok.token(1) == "<|im_start|>");
  CHECK(tok.token(2) == "<|im_end|>");
  CHECK(tok.is_special(0));
  CHECK_FALSE(tok.is_special(504));
  CHECK(tok.encode("<|im_start|>", false) != std::vector<std::int32_t>{1});
  // The bytes SmolLM2's vocabulary lacks (checked with the gguf package: their
  // GPT-2 characters are not in tokenizer.ggml.tokens); Hugging Face drops them.
  CHECK(tok.missing_bytes() == std::vector<std::uint8_t>{0x04, 0x06, 0x13, 0x14, 0x16, 0x1d, 0xc0,
                                                         0xc1, 0xf1, 0xf2, 0xf5, 0xf6, 0xf7, 0xf8,
                                                         0xf9, 0xfa, 0xfb, 0xfc, 0xfd, 0xfe, 0xff});
  CHECK(tok.encode("a\x04"
                   "b") == std::vector<std::int32_t>{81, 82});  // tokenizers gives [81, 82] too
}

TEST_CASE("SmolLM2 tokenizer: ids equal the Hugging Face reference", "[.][model-file]") {
  const BpeTokenizer& tok = smollm_tokenizer();
  for (const Reference& r : kReference) {
    INFO(r.text);
    const std::vector<std::int32_t> ids = tok.encode(r.text);
    CHECK(ids.size() == r.count);
    if (!r.ids.empty()) CHECK(ids == r.ids);
    if (r.fnv != 0) CHECK(fnv1a(ids) == r.fnv);
    CHECK(tok.decode(ids) == r.text);
  }
}

TEST_CASE("SmolLM2 tokenizer: licence texts encode like the reference, fast, and round-trip", "[.][model-file]") {
  const BpeTokenizer& tok = smollm_tokenizer();
  const std::filesystem::path dir = "/usr/share/common-licenses";
  for (const LicenceReference& l : kLicences) {
    INFO(l.name);
    const std::string text = read_file(dir / l.name);
    if (text.size() != l.bytes) {
      WARN(l.name << " here has " << text.size() << " bytes, the reference had " << l.bytes << ": ids not compared");
    }
    const auto t0 = std::chrono::steady_clock::now();
    const std::vector<std::int32_t> ids = tok.encode(text);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    WARN(l.name << ": " << text.size() << " bytes -> " << ids.size() << " tokens in " << seconds * 1e3 << " ms");
    CHECK(seconds < 1.0);
    if (text.size() == l.bytes) {
      CHECK(ids.size() == l.count);
      CHECK(fnv1a(ids) == l.fnv);
    }
    CHECK(tok.decode(ids) == text);
  }
  // Every licence text shipped here round-trips.
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    if (!entry.is_regular_file()) continue;
    const std::string text = read_file(entry.path());
    INFO(entry.path());
    CHECK(tok.decode(tok.encode(text)) == text);
  }
}
