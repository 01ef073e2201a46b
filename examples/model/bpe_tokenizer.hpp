#pragma once
// GPT-2 style byte-level BPE tokenizer built from a GGUF file's vocabulary
// (tokenizer.ggml.model == "gpt2"): tokens, merges, special-token ids and the
// pre-tokenizer named by tokenizer.ggml.pre.
//
// encode(): the text is cut at control tokens ("<|im_start|>", ...; the way
// Hugging Face tokenizers treat added special tokens), each remaining segment
// is pre-tokenized (for "smollm": every \p{N} code point alone, then the GPT-2
// split 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+),
// each piece's bytes are mapped to the GPT-2 byte alphabet and merged by rank.
// The split is hand-written (no std::regex); Unicode classes come from tables
// generated from Python's unicodedata (Unicode 14).
// Bytes whose GPT-2 character is not in the vocabulary are dropped, as Hugging
// Face tokenizers (no unk token) and llama.cpp do. SmolLM2 lacks 21:
// 0x04 0x06 0x13 0x14 0x16 0x1d, and 0xc0 0xc1 0xf1 0xf2 0xf5-0xff, which
// valid UTF-8 never has (0xf1/0xf2 only for the unassigned planes 4-11).
// decode(): the inverse byte mapping, so decode(encode(s)) == s for any text
// without those bytes; missing_bytes() lists them.
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "model/gguf.hpp"

namespace sparsekv::model {

class BpeTokenizer {
 public:
  // Throws invalid_argument when the file's tokenizer is not "gpt2", its
  // pre-tokenizer is unknown, or the vocabulary lacks a byte token.
  explicit BpeTokenizer(const GgufFile& gguf);

  // Control tokens written in the text are encoded as themselves. No BOS added.
  std::vector<std::int32_t> encode(std::string_view text) const;
  // parse_special = false encodes "<|im_start|>" as ordinary text.
  std::vector<std::int32_t> encode(std::string_view text, bool parse_special) const;
  // Throws out_of_range for an id outside the vocabulary.
  std::string decode(std::span<const std::int32_t> ids) const;

  std::int32_t bos() const { return bos_; }  // -1 when the file names none
  std::int32_t eos() const { return eos_; }
  bool add_bos() const { return add_bos_; }  // tokenizer.ggml.add_bos_token (false for SmolLM2)
  std::size_t vocab_size() const { return tokens_.size(); }
  const std::string& pre() const { return pre_; }

  // The vocabulary entry (byte-mapped form, e.g. "Ġthe") and its reverse; -1 when absent.
  const std::string& token(std::int32_t id) const;
  std::int32_t token_id(std::string_view token) const;
  bool is_special(std::int32_t id) const;
  // The bytes that have no token and that encode() therefore drops.
  std::vector<std::uint8_t> missing_bytes() const;

  // The pre-tokenizer alone: the byte ranges [begin, end) of `text` it cuts
  // into (exposed for tests).
  std::vector<std::string_view> pre_tokenize(std::string_view text) const;

 private:
  struct Merge {
    std::int32_t rank;
    std::int32_t result;
  };
  void encode_segment(std::string_view text, std::vector<std::int32_t>& out,
                      std::unordered_map<std::string_view, std::vector<std::int32_t>>& cache) const;
  void bpe(std::string_view piece, std::vector<std::int32_t>& out) const;

  std::vector<std::string> tokens_;
  std::unordered_map<std::string, std::int32_t> ids_;
  std::vector<bool> special_;
  std::vector<std::int32_t> specials_;  // ids of control tokens, longest text first
  std::unordered_map<std::uint64_t, Merge> merges_;
  std::int32_t byte_token_[256] = {};  // -1 where the vocabulary has no token for the byte
  int byte_tokens_ = 0;
  std::string pre_;
  bool split_digits_ = true;
  std::int32_t bos_ = -1;
  std::int32_t eos_ = -1;
  bool add_bos_ = false;
};

}  // namespace sparsekv::model
