#pragma once
// PromptAttention: causal attention of a prompt chunk's queries over the
// sequence's K/V on the host -- the prefill counterpart of the decode Attend
// (page_fold.hpp), for an engine whose prompt ubatches the library attends.
//
// The rule, for each query row at position p and q head h (kv head h / group):
// the keys 0 .. p in blocks of kPromptBlockTokens aligned at position 0, each
// block folded as one tile (softmax_fold_tile: scores q.k * scale, the
// running max and sum rescaled once per block, then the block's V rows added
// with their weights in token order), the output acc / sum (softmax_output).
// prompt_attention_scalar runs that rule one row and head at a time: the
// reference the vectorized kernel is tested against.
//
// The kernel: plan() cuts the chunks into tiles of (chunk, kv head, a block
// of up to 8 of its GQA group's q heads, tile_rows() query rows aligned at a
// multiple of tile_rows() positions). A tile's rows x heads are one matrix
// of queries; for each K/V block it widens the block's K and V rows once
// (f16 / bf16 with vector instructions) for all of them, computes the
// scores as a register-blocked product, masks the diagonal block only, folds
// the softmax a vector of queries at a time, and adds the V rows as a second
// product. Vectorized for the best target the CPU has (Google Highway,
// runtime dispatch; the target choice is global: use_fold_page_target in
// page_fold.hpp selects it for this kernel too).
//
// Every (row, head) sees the same blocks, scores, weights and sums, in the
// same order, whichever tile, chunk or thread computes it: tile rows divide
// the block size and are aligned, so a row's last block is its tile's last;
// keys past a row are masked to weight exactly 0. So the output does not
// depend on how a prompt is cut into chunks, nor on the thread count.
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "sparsekv/core/dtype.hpp"

namespace sparsekv {

// The shape every chunk shares.
struct PromptAttentionShape {
  DType dtype = DType::f16;  // K/V dtype: f32, f16, bf16, or q8_0 (head_dim a multiple of 32)
  std::uint32_t q_heads = 0, kv_heads = 0, head_dim = 0;  // GQA: q head h reads kv head h / (q_heads / kv_heads)
  float scale = 0.0f;                                     // scores are q.k * scale (positive, finite)
};

// One sequence's chunk: `rows` queries at positions first .. first + rows - 1,
// each attending positions 0 .. its own (causal).
struct PromptChunk {
  const float* q = nullptr;      // [rows][q_heads][head_dim] fp32, rows q_stride floats apart
  std::size_t q_stride = 0;      // 0: q_heads * head_dim
  const std::byte* k = nullptr;  // [first + rows][kv_heads][head_dim] in shape.dtype, token-major, contiguous
  const std::byte* v = nullptr;  // same
  std::uint32_t first = 0;
  std::uint32_t rows = 0;
  float* out = nullptr;        // [rows][q_heads][head_dim] fp32, rows out_stride floats apart
  std::size_t out_stride = 0;  // 0: q_heads * head_dim
};

// Keys per block of the rule (and of the kernel's K/V loop).
inline constexpr std::uint32_t kPromptBlockTokens = 64;

class PromptAttention {
 public:
  // A unit of work: q heads [head0, head0 + heads) of kv head kv_head, the
  // chunk's rows at positions [lo, hi), inside the aligned row block that
  // starts at row0. cost: its K/V blocks times its heads.
  struct Tile {
    std::uint32_t chunk = 0, kv_head = 0, head0 = 0, heads = 0;
    std::uint32_t row0 = 0, lo = 0, hi = 0;
    std::uint64_t cost = 0;
  };

  // Checks the shape and every chunk (null pointers, rows 0, strides shorter
  // than a row, q heads not a multiple of kv heads, positions past 2^31 - 1,
  // max_threads 0): throws invalid_argument, changing nothing. Then lays out
  // the tiles and sizes the scratch of max_threads threads. Keeps a copy of
  // the chunks; their arrays must outlive the runs.
  void plan(const PromptAttentionShape& shape, std::span<const PromptChunk> chunks, std::size_t max_threads);
  // Thread ith of nth (nth <= max_threads) runs its share of the tiles:
  // tiles sorted by cost, dealt out in a snake order (0 .. nth-1, nth-1 .. 0,
  // ...) so that shares balance by work. Call it on each of nth threads
  // concurrently, each with its own ith; it reads the chunks' q, k and v,
  // writes its tiles' output rows and its own scratch slice, allocates
  // nothing. A tile's arithmetic never depends on which thread runs it, so
  // the output is bit for bit the same for any nth. Throws invalid_argument
  // if ith >= nth or nth > max_threads (when there are tiles).
  void run(std::size_t ith, std::size_t nth) const;

  std::size_t tiles() const noexcept { return tiles_.size(); }
  const Tile& tile(std::size_t i) const { return tiles_[i]; }
  // Query rows per tile (a divisor of kPromptBlockTokens) and q heads per tile at most.
  std::uint32_t tile_rows() const noexcept { return tile_rows_; }
  std::uint32_t tile_heads() const noexcept { return tile_heads_; }

 private:
  PromptAttentionShape shape_;
  std::vector<PromptChunk> chunks_;
  std::vector<Tile> tiles_;  // by cost, largest first
  std::uint32_t tile_rows_ = 0, tile_heads_ = 0;
  std::size_t max_threads_ = 0;
  std::size_t slice_floats_ = 0;        // one thread's scratch, a multiple of 16 floats
  mutable std::vector<float> scratch_;  // max_threads slices from its first 64-byte boundary; run() writes its own
};

// The rule one query row and head at a time, in scalar code: the reference.
// Checks as plan() does (throws invalid_argument before writing).
void prompt_attention_scalar(const PromptAttentionShape& shape, const PromptChunk& chunk);

}  // namespace sparsekv
