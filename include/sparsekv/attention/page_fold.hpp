#pragma once
// fold_page: the host Attend's inner kernel -- head-wise pages folded into the
// partial softmax states of a GQA group (SplitPlanAttention runs it over each
// chunk's pages). The tile is a run of pages (fold_pages; one page for
// fold_page): every live slot's scores for the whole group first, each K row
// loaded once for the group, then one max and one exponential pass per q head
// over the tile (softmax_fold_tile, the CUDA split kernel's rule), then the V
// rows added to the accumulators with their weights, each V row loaded once
// for the group. Vectorized for the best target the CPU has (Google Highway,
// runtime dispatch: AVX2+FMA+F16C, AVX-512, and NEON / SVE on Arm from the
// same source); fp16 and bf16 rows are converted with vector instructions,
// q8_0 rows (Config::kv_storage) block by block: q widened, the block's scale
// applied to the K row and folded into V's weights.
// fold_page_scalar is the same rule, one slot at a time: the reference every
// target is tested against.
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "sparsekv/attention/attention_partial.hpp"
#include "sparsekv/memory/page_layout.hpp"

namespace sparsekv {

struct PageFold {
  PageLayout layout;
  std::uint32_t group = 0;         // q heads of the kv head
  float scale = 1.0f;              // scores are q.k * scale
  const float* q = nullptr;        // [group][head_dim]
  SoftmaxState* states = nullptr;  // [group]
  float* acc = nullptr;            // [group][head_dim], unnormalised
  float* weights = nullptr;        // scratch, page_fold_scratch_floats(layout.page_tokens)
  float* scores = nullptr;         // null, or [pages][page_tokens][group]: each slot's score, -inf when unused or dead
};

// One page of a tile: its slots [0, tokens) that `live` marks (tokens <= page_tokens).
struct FoldPageRef {
  const std::byte* data = nullptr;
  std::uint32_t tokens = 0;
  SlotMask live = ~SlotMask{0};
};

// Slots a tile of several pages holds at most (a page longer than this is a
// tile alone): enough to pay the tile's fixed costs once for several small
// pages, few enough that its scores and the V rows fetched for them while it
// is scored (kFoldTileVBytes) stay in L1 until they are added.
inline constexpr std::uint32_t kFoldTileTokens = 64;
inline constexpr std::size_t kFoldTileVBytes = 8192;
constexpr std::uint32_t fold_tile_tokens(const PageLayout& layout) {
  const std::size_t by_bytes = kFoldTileVBytes / layout.row_bytes();
  return by_bytes >= kFoldTileTokens ? kFoldTileTokens : by_bytes == 0 ? 1 : static_cast<std::uint32_t>(by_bytes);
}

// The fold's scratch: a tile row of up to kPageFoldRowFloats per slot (a
// block of up to 8 q heads, padded to a power of two) for the larger of a page
// and kFoldTileTokens, and padding to whole vectors of any target.
inline constexpr std::size_t kPageFoldRowFloats = 8;
inline constexpr std::size_t kPageFoldPadFloats = 64;
constexpr std::size_t page_fold_scratch_floats(std::uint32_t page_tokens) {
  const std::size_t slots = page_tokens > kFoldTileTokens ? page_tokens : kFoldTileTokens;
  return slots * kPageFoldRowFloats + kPageFoldPadFloats;
}

// Folds the live slots of `pages`, in order, as one tile into f.states and
// f.acc: their tokens together at most fold_tile_tokens(f.layout), or one page;
// f.scores (if any) gets each page's scores in turn. `next` (or null) is the
// page folded after the last, fetched ahead. Reads the pages and q, writes
// only f's arrays.
void fold_pages(const PageFold& f, std::span<const FoldPageRef> pages, const std::byte* next);
// fold_pages of one page.
void fold_page(const PageFold& f, const std::byte* page, std::uint32_t tokens, SlotMask live, const std::byte* next);
// The same rule one slot at a time in scalar code (the reference).
void fold_page_scalar(const PageFold& f, const std::byte* page, std::uint32_t tokens, SlotMask live);

// The targets fold_page was compiled for, best first, each with whether this
// CPU can run it; and a way to make fold_page use one of them (0: the best the
// CPU has again). Highway's choice is global: every kernel of the library it
// dispatches (policy/select_scoring.hpp, core/convert.hpp too) follows it.
// For tests and benchmarks.
struct FoldTarget {
  std::string name;
  std::int64_t bits = 0;
  bool supported = false;
};
std::vector<FoldTarget> fold_page_targets();
void use_fold_page_target(std::int64_t bits);
// The target fold_page dispatches to now.
std::string fold_page_target();

}  // namespace sparsekv
