#pragma once
// Passkey retrieval (Mohtashami & Jaggi 2023, "Landmark Attention"): the
// prompt and the answer check of sparsekv-passkey, as pure functions of the
// tokenizer so that tests can check them without the model's weights.
//
// The prompt: an instruction line, then filler sentences ("The grass is
// green. The sky is blue. The sun is yellow. Here we go. There and back
// again." repeated), with the needle "The pass key is NNNNN. Remember it.
// NNNNN is the pass key." inserted at a sentence boundary `depth` of the way
// through the filler, then the question "What is the pass key? The pass key
// is". The number of filler sentences is chosen so that the whole prompt is
// as long as possible without exceeding `context` tokens (one filler sentence,
// ~6 tokens, is the granularity).
//
// Two formats: raw (a plain completion: the model continues "... The pass key
// is") and chat (SmolLM2's template: <|im_start|>user\n ... <|im_end|>\n
// <|im_start|>assistant\n, control tokens parsed as such; the model answers
// in its own words).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>

#include "model/bpe_tokenizer.hpp"

namespace sparsekv::tools::passkey {

enum class Format { raw, chat };

inline constexpr std::string_view kInstruction =
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the important information there.";
inline constexpr std::string_view kFiller[] = {"The grass is green.", "The sky is blue.", "The sun is yellow.",
                                               "Here we go.", "There and back again."};
inline constexpr std::string_view kQuestion = "What is the pass key? The pass key is";

struct Prompt {
  std::vector<std::int32_t> tokens;
  std::string text;
  std::string passkey;
  std::uint32_t needle_begin = 0;      // token index of the needle's first token
  std::uint32_t needle_end = 0;        // one past its last token
  std::uint32_t filler_sentences = 0;  // filler sentences in the prompt (the needle excluded)
  std::uint32_t needle_after = 0;      // filler sentences before the needle
  double depth() const { return filler_sentences ? double(needle_after) / filler_sentences : 0.0; }
};

inline std::string needle_sentence(std::string_view passkey) {
  return fmt::format("The pass key is {0}. Remember it. {0} is the pass key.", passkey);
}

// A 5-digit number (10000..99999) for one (seed, depth, trial): different per
// depth and trial, the same on every run with the same seed.
inline std::string make_passkey(std::uint64_t seed, std::uint32_t depth_percent, std::uint32_t trial) {
  std::seed_seq seq{static_cast<std::uint32_t>(seed), static_cast<std::uint32_t>(seed >> 32), depth_percent, trial};
  std::mt19937_64 rng(seq);
  return std::to_string(std::uniform_int_distribution<std::uint32_t>(10000, 99999)(rng));
}

namespace detail {

// The prompt's text up to the needle (`before`) and the whole text, for
// `sentences` filler sentences with the needle after `after` of them.
inline void compose(Format format, std::string_view passkey, std::uint32_t sentences, std::uint32_t after,
                    std::string& before, std::string& whole) {
  before.clear();
  if (format == Format::chat) before += "<|im_start|>user\n";
  before += kInstruction;
  std::uint32_t i = 0;
  const auto add_filler = [&](std::string& s, std::uint32_t until) {
    for (; i < until; ++i) {
      s += ' ';
      s += kFiller[i % std::size(kFiller)];
    }
  };
  add_filler(before, after);
  whole = before;
  whole += ' ';
  whole += needle_sentence(passkey);
  add_filler(whole, sentences);
  whole += ' ';
  if (format == Format::chat) {
    whole += "What is the pass key?<|im_end|>\n<|im_start|>assistant\n";
  } else {
    whole += kQuestion;
  }
}

}  // namespace detail

// The longest prompt of at most `context` tokens with the needle `depth`
// (0..1) of the way through the filler. Throws std::invalid_argument when
// even a prompt without filler exceeds `context`.
inline Prompt build_prompt(const model::BpeTokenizer& tokenizer, std::uint32_t context, double depth,
                           std::string_view passkey, Format format) {
  if (depth < 0 || depth > 1) throw std::invalid_argument(fmt::format("passkey depth {} is outside 0..1", depth));
  const bool special = format == Format::chat;
  std::string before, whole;
  Prompt p;
  p.passkey = std::string(passkey);
  const auto encode = [&](std::uint32_t sentences) {
    const auto after = static_cast<std::uint32_t>(std::lround(depth * sentences));
    detail::compose(format, passkey, sentences, after, before, whole);
    p.tokens = tokenizer.encode(whole, special);
    p.filler_sentences = sentences;
    p.needle_after = after;
    return p.tokens.size();
  };
  const std::size_t base = encode(0);
  if (base > context) {
    throw std::invalid_argument(
        fmt::format("a passkey prompt needs at least {} tokens; the context is {}", base, context));
  }
  // Tokens per filler sentence (~6): estimate, then step to the longest fit
  // (the length grows with every sentence added).
  const double per_sentence = double(encode(50) - base) / 50;
  auto n = static_cast<std::uint32_t>((context - base) / per_sentence);
  while (n > 0 && encode(n) > context) {
    const std::size_t over = p.tokens.size() - context;
    n -= std::min<std::uint32_t>(n, std::max<std::uint32_t>(1, static_cast<std::uint32_t>(over / per_sentence)));
  }
  while (encode(n + 1) <= context) ++n;
  const std::uint32_t lo = n;
  encode(lo);
  p.text = whole;
  const std::vector<std::int32_t> head = tokenizer.encode(before, special);
  const std::vector<std::int32_t> needle = tokenizer.encode(" " + needle_sentence(passkey), false);
  if (head.size() + needle.size() > p.tokens.size() || !std::equal(head.begin(), head.end(), p.tokens.begin()) ||
      !std::equal(needle.begin(), needle.end(), p.tokens.begin() + static_cast<std::ptrdiff_t>(head.size()))) {
    throw std::logic_error("passkey prompt: the needle's tokens are not where its text is");
  }
  p.needle_begin = static_cast<std::uint32_t>(head.size());
  p.needle_end = static_cast<std::uint32_t>(head.size() + needle.size());
  return p;
}

// Whether the decoded answer holds the passkey's digits in a row (not as part
// of a longer number: "123456" does not answer "12345").
inline bool answer_matches(std::string_view answer, std::string_view passkey) {
  if (passkey.empty()) return false;
  const auto digit = [](char c) { return c >= '0' && c <= '9'; };
  for (std::size_t at = answer.find(passkey); at != std::string_view::npos; at = answer.find(passkey, at + 1)) {
    const bool left = at == 0 || !digit(answer[at - 1]);
    const bool right = at + passkey.size() == answer.size() || !digit(answer[at + passkey.size()]);
    if (left && right) return true;
  }
  return false;
}

}  // namespace sparsekv::tools::passkey
