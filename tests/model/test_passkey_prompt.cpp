// The passkey-retrieval prompt and answer check of sparsekv-passkey
// (tools/passkey_prompt.hpp). The answer check and the number need nothing;
// the prompt tests ([model-file], hidden) use the real SmolLM2 tokenizer.
#include <catch2/catch.hpp>

#include <algorithm>
#include <filesystem>
#include <set>
#include <string>
#include <vector>

#include "model/bpe_tokenizer.hpp"
#include "model/gguf.hpp"
#include "passkey_prompt.hpp"

namespace model_test {
std::filesystem::path model_file();
}  // namespace model_test

namespace {

namespace pk = sparsekv::tools::passkey;
using sparsekv::model::BpeTokenizer;
using sparsekv::model::GgufFile;

const BpeTokenizer& tokenizer() {
  static const GgufFile file = GgufFile::open(model_test::model_file());
  static const BpeTokenizer tok(file);
  return tok;
}

std::size_t count(const std::string& text, const std::string& what) {
  std::size_t n = 0;
  for (std::size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

}  // namespace

TEST_CASE("passkey: the answer check finds the 5 digits and nothing else", "[passkey]") {
  CHECK(pk::answer_matches("12345", "12345"));
  CHECK(pk::answer_matches(" 12345. Remember it.", "12345"));
  CHECK(pk::answer_matches("The pass key is 12345", "12345"));
  CHECK(pk::answer_matches("It is 99 or 12345!", "12345"));
  CHECK_FALSE(pk::answer_matches("", "12345"));
  CHECK_FALSE(pk::answer_matches(" 12346.", "12345"));
  CHECK_FALSE(pk::answer_matches(" 1234.", "12345"));
  CHECK_FALSE(pk::answer_matches(" 54321", "12345"));
  CHECK_FALSE(pk::answer_matches(" 1 2 3 4 5", "12345"));
  CHECK_FALSE(pk::answer_matches(" 123456", "12345"));  // part of a longer number
  CHECK_FALSE(pk::answer_matches(" 012345", "12345"));
  CHECK(pk::answer_matches(" 123456 and 12345", "12345"));
  CHECK_FALSE(pk::answer_matches("anything", ""));
}

TEST_CASE("passkey: the number has 5 digits, is reproducible and differs per depth and trial", "[passkey]") {
  std::set<std::string> seen;
  for (std::uint32_t depth : {10u, 30u, 50u, 70u, 90u}) {
    for (std::uint32_t trial = 0; trial < 4; ++trial) {
      const std::string key = pk::make_passkey(1, depth, trial);
      REQUIRE(key.size() == 5);
      CHECK(std::all_of(key.begin(), key.end(), [](char ch) { return ch >= '0' && ch <= '9'; }));
      CHECK(key[0] != '0');
      CHECK(key == pk::make_passkey(1, depth, trial));
      seen.insert(key);
    }
  }
  CHECK(seen.size() == 20);
  CHECK(pk::make_passkey(1, 50, 0) != pk::make_passkey(2, 50, 0));
}

TEST_CASE("passkey: the prompt has the requested length and the needle sits at the requested depth",
          "[.][model-file][passkey]") {
  const BpeTokenizer& tok = tokenizer();
  for (const pk::Format format : {pk::Format::raw, pk::Format::chat}) {
    for (const std::uint32_t context : {1024u, 6144u}) {
      for (const double depth : {0.0, 0.1, 0.3, 0.5, 0.7, 0.9, 1.0}) {
        const std::string key = pk::make_passkey(7, static_cast<std::uint32_t>(depth * 100), 0);
        INFO("format " << (format == pk::Format::chat ? "chat" : "raw") << ", context " << context << ", depth "
                       << depth << ", key " << key);
        const pk::Prompt p = pk::build_prompt(tok, context, depth, key, format);
        const std::size_t T = p.tokens.size();
        // The longest prompt that fits: within one filler sentence (<= 8 tokens) of the context.
        CHECK(T <= context);
        CHECK(T + 8 >= context);
        CHECK(p.tokens == tok.encode(p.text, format == pk::Format::chat));
        // The needle: its tokens decode to the needle sentence, at the requested
        // depth of the filler (to one sentence) and of the whole prompt (to a few %:
        // the instruction and the question are outside the filler).
        REQUIRE(p.needle_end > p.needle_begin);
        REQUIRE(p.needle_end <= T);
        const std::vector<std::int32_t> needle(p.tokens.begin() + p.needle_begin, p.tokens.begin() + p.needle_end);
        CHECK(tok.decode(needle) == " " + pk::needle_sentence(key));
        CHECK(std::abs(p.depth() - depth) <= 1.0 / p.filler_sentences);
        const double position = double(p.needle_begin) / double(T);
        CHECK(std::abs(position - depth) <= (context >= 4096 ? 0.02 : 0.05));
        // The number appears in the needle only (twice), and the prompt ends with the question.
        CHECK(count(p.text, key) == 2);
        if (format == pk::Format::raw) {
          CHECK(p.text.ends_with(" What is the pass key? The pass key is"));
          CHECK(tok.decode(p.tokens) == p.text);
        } else {
          CHECK(p.text.starts_with("<|im_start|>user\nThere is an important info"));
          CHECK(p.text.ends_with("What is the pass key?<|im_end|>\n<|im_start|>assistant\n"));
          CHECK(p.tokens.front() == 1);  // <|im_start|> as a control token
        }
      }
    }
  }
  // A context too short even for the instruction and the question.
  CHECK_THROWS_AS(pk::build_prompt(tok, 20, 0.5, "12345", pk::Format::raw), std::invalid_argument);
}
