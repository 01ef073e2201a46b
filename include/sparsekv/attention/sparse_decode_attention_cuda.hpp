#pragma once
// CUDA backend of Attend: sparse paged decode attention for a batch (Spin
// §4.1 Attend over the GPU working set, §5.2 head-wise pages; split-K as in
// FlashDecoding, log-sum-exp merge as in SparseServe §3 / FlashInfer
// merge_states; RetroInfer §4.2 estimation term merged by log-sum-exp).
//
// One query token per request. q head j of request b reads kv head
// j / group (group = q_heads / kv_heads). The pages of each (request, kv
// head) row -- one entry, or several entries (runs) in AttendPlan's form --
// are walked as one list and split into chunks of `chunk_pages` pages; one
// CTA per (chunk, row, head slice) copies each K/V row once from HBM into
// shared memory (16-byte cp.async, a few tiles ahead, as FlashInfer's decode
// kernel stages K/V), where the q heads of its slice (up to kMaxGroupPerCta:
// the whole GQA group when group <= 8) read it: each head has its own rows
// of threads (decode_attention_token_groups), so a thread keeps one head's
// q and accumulator, and folds in fp32 with the online-softmax rules of
// attention_partial.hpp. A run's partial last page mid-row only masks its
// unused slots, so a row's runs need no merge of their own. Chunk partials
// go to a caller-allocated workspace; a second
// kernel merges them per q head with the optional extra term and writes o
// and lse. The host backend is decode_attention (decode_attention.hpp); both
// call the same softmax_* functions.
//
// Live-slot masks (SpvLLM §2, tokens evicted for good) are tested in the
// split kernel's walk next to the token count: a dead slot is skipped as an
// unused one is. Slot weights (each slot's softmax probability summed over
// its GQA group, H2O's scores) come from the same pass: the split kernel
// stores the scaled score of every live slot in the workspace, the merge
// kernel the final lse, and a third kernel normalises the scores; K/V rows
// are read once, by the split kernel.
//
// The grid is sized from capacities only (batch, max_pages): no count is
// read on the host, so a launch can be captured in a CUDA graph and replayed
// while the device-side plan changes.
//
// fmt-free: kernel translation units and their callers can include it. The
// split planning and the page walk below are plain inline C++ so host tests
// can emulate them.
#include <cstddef>
#include <cstdint>

#include "sparsekv/attention/attention_partial.hpp"
#include "sparsekv/core/host_device.hpp"
#include "sparsekv/memory/page_layout.hpp"

namespace sparsekv::cuda {

// q heads one CTA serves; a larger GQA group is split into head slices, each
// reading the row's K/V once.
inline constexpr std::uint32_t kMaxGroupPerCta = 8;
// Smallest chunk (tokens) worth a CTA and a workspace partial.
inline constexpr std::uint32_t kMinChunkTokens = 64;
// Threads of a split-K CTA; tokens of a tile, the unit the CTA stages in
// shared memory; and the most tokens a token group folds at once
// (softmax_fold_tile: one rescale of the accumulator per batch, the batch's
// scores held in registers).
inline constexpr std::uint32_t kSplitThreads = 128;
inline constexpr std::uint32_t kSplitTileTokens = 16;
inline constexpr std::uint32_t kSplitFoldTokens = 8;

// The q heads one split CTA's kernel is built for: the group (or a head
// slice of it) rounded up to 1, 2, 4 or 8.
SPARSEKV_HOST_DEVICE constexpr std::uint32_t decode_attention_group_width(std::uint32_t group) {
  return group <= 1 ? 1 : group <= 2 ? 2 : group <= 4 ? 4 : kMaxGroupPerCta;
}

// The rows of a split CTA: head_dim / (16 / element size) threads each, a
// thread one 16-byte vector of a K/V row. Row r copies tokens r, r + rows,
// ... of every tile of a chunk (its entry cursor walks them).
SPARSEKV_HOST_DEVICE constexpr std::uint32_t decode_attention_rows(std::uint32_t head_dim, DType dtype) {
  return kSplitThreads / (head_dim / (16 / static_cast<std::uint32_t>(dtype_size(dtype))));
}

// How many token groups fold a chunk for each q head: the rows are dealt out
// over the q heads first (one head per row, or two when there are fewer rows
// than heads), and the rows left for each head split the tokens: token t of
// a chunk is folded by group t % groups.
SPARSEKV_HOST_DEVICE constexpr std::uint32_t decode_attention_token_groups(std::uint32_t head_dim, DType dtype,
                                                                           std::uint32_t group) {
  const std::uint32_t rows = decode_attention_rows(head_dim, dtype);
  const std::uint32_t width = decode_attention_group_width(group);
  return rows / (width < rows ? width : rows);
}

struct DecodeAttentionShape {
  std::uint32_t batch = 0;     // requests
  std::uint32_t q_heads = 0;   // per request
  std::uint32_t kv_heads = 0;  // per request; q_heads % kv_heads == 0
  PageLayout layout;           // page_tokens >= 1, head_dim 64 or 128, f32 / f16 / bf16
  // The most pages any row holds over all its entries, or a capacity of
  // it: sizes the split only. A row with more pages is still attended in
  // full; its last chunk covers the excess.
  std::uint32_t max_pages = 0;
  // Pages per split-K chunk; 0 = chosen from the row count and the device's
  // resident CTAs so the grid fills the GPU.
  std::uint32_t chunk_pages = 0;
  // Slot weights: the capacity of indices (sizes the scores the workspace
  // keeps; a page at a position at or past it gets no weight). 0: no slot
  // weights, and the workspace keeps no scores.
  std::uint32_t max_indices = 0;
};

struct DecodeAttentionSplit {
  std::uint32_t chunk_pages = 1;  // pages per chunk
  std::uint32_t chunks = 1;       // chunks per row (grid x)
  std::uint32_t head_slices = 1;  // ceil(group / kMaxGroupPerCta) (grid z)
  std::size_t workspace_bytes = 0;
};

// Workspace of `chunks` partials per q head: fp32 acc [chunks][batch * q_heads][head_dim]
// followed by fp32 max and sum [chunks][batch * q_heads] each.
inline std::size_t decode_attention_workspace_bytes(std::uint32_t chunks, std::uint32_t batch, std::uint32_t q_heads,
                                                    std::uint32_t head_dim) {
  return std::size_t{chunks} * batch * q_heads * (std::size_t{head_dim} + 2) * sizeof(float);
}

// What slot weights add after the partials: fp32 scaled scores
// [max_indices * page_tokens][group] (decode_attention_score_index), then the
// fp32 lse of every q head [batch * q_heads].
inline std::size_t decode_attention_weights_workspace_bytes(std::uint32_t max_indices, std::uint32_t page_tokens,
                                                            std::uint32_t batch, std::uint32_t q_heads,
                                                            std::uint32_t kv_heads) {
  const std::uint32_t group = kv_heads == 0 ? 0 : q_heads / kv_heads;
  return (std::size_t{max_indices} * page_tokens * group + std::size_t{batch} * q_heads) * sizeof(float);
}

// Chunk counts of up to this many waves are weighed: past it the chunks'
// fixed costs outweigh what a finer tail saves.
inline constexpr std::uint64_t kSplitWaves = 8;
// A chunk's fixed cost in tokens of walk: its prologue's dependent loads
// (the row's entries, its last page, the cursor), filling the copy pipeline,
// and writing and merging its partial. Estimated as two 16-token pages (one
// page of bf16 head_dim 128 takes a CTA about as long as a dependent load
// when the SM's bandwidth is shared by its resident CTAs); it keeps the split
// from taking 2-5x the chunks for a few percent of modelled tail.
inline constexpr std::uint64_t kChunkOverheadTokens = 32;

// Pages per chunk when a row of max_pages is cut into `chunks` (>= 1), no
// chunk under min_pages.
inline std::uint32_t decode_attention_chunk_pages(std::uint32_t max_pages, std::uint32_t chunks,
                                                  std::uint32_t min_pages) {
  const auto pages = static_cast<std::uint32_t>((std::uint64_t{max_pages} + chunks - 1) / chunks);
  return pages > min_pages ? pages : min_pages;
}

// Chunks of chunk_pages (>= 1) covering max_pages.
inline std::uint32_t decode_attention_chunks(std::uint32_t max_pages, std::uint32_t chunk_pages) {
  return static_cast<std::uint32_t>((std::uint64_t{max_pages} + chunk_pages - 1) / chunk_pages);
}

// Waves x (a chunk's tokens + its fixed cost): the modelled time of a split
// into chunks of chunk_pages (split_decode_attention's rule).
inline std::uint64_t decode_attention_split_cost(std::uint64_t ctas_per_chunk, std::uint64_t wave,
                                                 std::uint32_t max_pages, std::uint32_t chunk_pages,
                                                 std::uint32_t page_tokens) {
  const std::uint64_t waves = (ctas_per_chunk * decode_attention_chunks(max_pages, chunk_pages) + wave - 1) / wave;
  return (waves == 0 ? 1 : waves) * (std::uint64_t{chunk_pages} * page_tokens + kChunkOverheadTokens);
}

// The tokens of a tile one token group folds in one batch: its share of the
// tile (kSplitTileTokens / token groups, in order), at most kSplitFoldTokens.
SPARSEKV_HOST_DEVICE constexpr std::uint32_t decode_attention_fold_batch(std::uint32_t head_dim, DType dtype,
                                                                         std::uint32_t group) {
  const std::uint32_t share = kSplitTileTokens / decode_attention_token_groups(head_dim, dtype, group);
  return share < kSplitFoldTokens ? share : kSplitFoldTokens;
}

// The split for `target_ctas` CTAs in flight (resident CTAs per SM x SMs,
// one wave): no chunk smaller than kMinChunkTokens (or one page), every page
// in some chunk, and the chunk count whose waves cost least. CTAs of a launch
// run in waves of target_ctas, and a wave costs one chunk's walk however few
// CTAs it holds, so the cost of c chunks is ceil(rows x head slices x c /
// target) x (chunk tokens(c) + kChunkOverheadTokens): a split that overshoots
// a wave by a little pays a whole extra wave (on an H100, 3 chunks of 256
// rows made 1.45 waves of 528 CTAs where 2 chunks make 0.97). Within a wave
// count more chunks are never worse, so the candidates are the largest chunk
// count of 1..kSplitWaves waves; ties go to fewer chunks (fewer partials to
// merge). An empty batch gets one chunk.
// Shapes are assumed valid (sparse_decode_attention checks them).
inline DecodeAttentionSplit split_decode_attention(const DecodeAttentionShape& shape, std::uint32_t target_ctas) {
  DecodeAttentionSplit split;
  const std::uint32_t group = shape.kv_heads == 0 ? 1 : shape.q_heads / shape.kv_heads;
  split.head_slices = group == 0 ? 1 : (group + kMaxGroupPerCta - 1) / kMaxGroupPerCta;
  const std::uint32_t max_pages = shape.max_pages == 0 ? 1 : shape.max_pages;
  if (shape.chunk_pages != 0) {
    split.chunk_pages = shape.chunk_pages;
  } else {
    const std::uint64_t ctas_per_chunk = std::uint64_t{shape.batch} * shape.kv_heads * split.head_slices;
    const std::uint64_t wave = target_ctas == 0 ? 1 : target_ctas;
    const std::uint32_t tokens = shape.layout.page_tokens == 0 ? 1 : shape.layout.page_tokens;
    const std::uint32_t min_pages = (kMinChunkTokens + tokens - 1) / tokens;
    std::uint64_t best_cost = ~std::uint64_t{0};
    split.chunk_pages = max_pages;
    for (std::uint64_t waves = 1; waves <= kSplitWaves && ctas_per_chunk > 0; ++waves) {
      const std::uint64_t fit = waves * wave / ctas_per_chunk;
      const std::uint32_t chunks = fit < 1 ? 1 : fit < max_pages ? static_cast<std::uint32_t>(fit) : max_pages;
      const std::uint32_t pages = decode_attention_chunk_pages(max_pages, chunks, min_pages);
      const std::uint64_t cost = decode_attention_split_cost(ctas_per_chunk, wave, max_pages, pages, tokens);
      if (cost < best_cost) {
        best_cost = cost;
        split.chunk_pages = pages;
      }
    }
  }
  split.chunks = decode_attention_chunks(max_pages, split.chunk_pages);
  split.workspace_bytes =
      decode_attention_workspace_bytes(split.chunks, shape.batch, shape.q_heads, shape.layout.head_dim);
  if (shape.max_indices > 0) {
    split.workspace_bytes += decode_attention_weights_workspace_bytes(shape.max_indices, shape.layout.page_tokens,
                                                                      shape.batch, shape.q_heads, shape.kv_heads);
  }
  return split;
}

// The largest workspace split_decode_attention asks for over batches 1 to
// shape.batch (sparse_decode_attention_workspace_capacity's rule).
inline std::size_t decode_attention_workspace_capacity(const DecodeAttentionShape& shape, std::uint32_t target_ctas) {
  std::size_t bytes = 0;
  DecodeAttentionShape each = shape;
  for (std::uint32_t batch = 1; batch <= shape.batch; ++batch) {
    each.batch = batch;
    const std::size_t need = split_decode_attention(each, target_ctas).workspace_bytes;
    bytes = need > bytes ? need : bytes;
  }
  return bytes;
}

// Optional per-(request, q head) term merged by log-sum-exp (an
// AttentionPartial in device arrays): max, sum [batch * q_heads] and acc
// [batch * q_heads][head_dim] (unnormalised, as AttentionPartial::acc). A head
// with sum == 0 has no term. All three null = no extra term.
struct DecodeAttentionExtra {
  const float* max = nullptr;
  const float* sum = nullptr;
  const float* acc = nullptr;
};

// Device pointers of one launch.
struct DecodeAttentionArgs {
  // [batch][q_heads][head_dim] fp32 (engines keep the query in fp32; K/V pages stay in layout.dtype).
  const float* q = nullptr;
  // Page p of the pool starts at page_base + p * page_stride; its K block
  // then V block follow PageLayout (k_offset / v_offset).
  const std::byte* page_base = nullptr;
  std::size_t page_stride = 0;
  // Entries, FlashInfer / AttendPlan style: entry e is the pages
  // indices[indptr[e] .. indptr[e + 1]), every one full except the last,
  // which holds last_page_len[e] tokens (1..page_tokens). An entry may be
  // empty.
  const std::int64_t* indptr = nullptr;
  const std::int64_t* indices = nullptr;
  const std::int32_t* last_page_len = nullptr;
  // Rows r = b * kv_heads + h. Null: entry r is row r (indptr
  // [batch * kv_heads + 1], last_page_len [batch * kv_heads]). Set
  // ([batch * kv_heads + 1], AttendPlan::head_entries, non-decreasing): row r
  // attends entries row_entries[r] .. row_entries[r + 1], in order, as one
  // key set -- the runs a (request, kv head) splits into where a page mid-row
  // is partial. A row with no entries or no pages attends to nothing.
  const std::int64_t* row_entries = nullptr;
  // Null: every slot below its page's token count is live. Else parallel to
  // indices (AttendPlan::live_masks): slot t of page indices[i] attends only
  // when slot_live(live_masks[i], t). Needs page_tokens <= kMaxMaskedPageTokens.
  const SlotMask* live_masks = nullptr;
  float scale = 1.0f;  // scores = q . k * scale
  DecodeAttentionExtra extra;
  float* out = nullptr;  // [batch][q_heads][head_dim] fp32; 0 for a head that attended to nothing
  float* lse = nullptr;  // [batch][q_heads] fp32 log-sum-exp of the scores (-inf when empty); may be null
  // Null, or [max_indices][page_tokens] fp32 (needs shape.max_indices > 0):
  // slot t of the page at position i gets its softmax probability summed
  // over the q heads of its row (decode_attention_slot_weight), 0 for a dead
  // or unused slot. Positions no row reaches, or at or past max_indices, are
  // not written.
  float* slot_weights = nullptr;
  void* workspace = nullptr;  // device memory, 16-byte aligned, plan's workspace_bytes
  std::size_t workspace_bytes = 0;
};

// The page walk of one launch, shared by the kernel and its host emulation.
// Positions are indices into `indices`.
struct DecodeAttentionPages {
  const std::int64_t* indptr = nullptr;
  const std::int32_t* last_page_len = nullptr;
  const std::int64_t* row_entries = nullptr;  // null: entry r is row r
  std::uint32_t page_tokens = 1;
};

// Row r's entries [first_entry, end_entry) and page positions [begin, end).
struct DecodeAttentionRow {
  std::int64_t first_entry = 0, end_entry = 0;
  std::int64_t begin = 0, end = 0;
  SPARSEKV_HOST_DEVICE std::uint64_t pages() const { return end > begin ? static_cast<std::uint64_t>(end - begin) : 0; }
};

SPARSEKV_HOST_DEVICE inline DecodeAttentionRow decode_attention_row(const DecodeAttentionPages& p, std::uint32_t row) {
  DecodeAttentionRow r;
  r.first_entry = p.row_entries == nullptr ? std::int64_t{row} : p.row_entries[row];
  r.end_entry = p.row_entries == nullptr ? std::int64_t{row} + 1 : p.row_entries[row + 1];
  r.begin = p.indptr[r.first_entry];
  r.end = r.end_entry > r.first_entry ? p.indptr[r.end_entry] : r.begin;
  return r;
}

// Pages [first, last) of a row of `row_pages` pages that chunk `chunk` of
// `chunks` covers; the last chunk runs to the row's end so that no page is
// dropped whatever max_pages the split assumed.
struct DecodeAttentionChunk {
  std::uint64_t first = 0, last = 0;
};

SPARSEKV_HOST_DEVICE inline DecodeAttentionChunk decode_attention_chunk(std::uint64_t row_pages, std::uint32_t chunk,
                                                                        std::uint32_t chunk_pages,
                                                                        std::uint32_t chunks) {
  DecodeAttentionChunk c;
  c.first = std::uint64_t{chunk} * chunk_pages;
  c.last = c.first + chunk_pages;
  if (chunk + 1 == chunks || c.last > row_pages) c.last = row_pages;
  if (c.first > c.last) c.first = c.last;
  return c;
}

// A last_page_len clamped into 1..page_tokens, so that reads stay inside the
// page whatever the device data says.
SPARSEKV_HOST_DEVICE inline std::uint32_t decode_attention_last_tokens(std::int32_t len, std::uint32_t page_tokens) {
  const std::uint32_t n = len < 1 ? 1u : static_cast<std::uint32_t>(len);
  return n < page_tokens ? n : page_tokens;
}

// The entry of `row` holding position pos (row.begin <= pos < row.end): the
// last one starting at or before it, so that empty entries, which share
// their start with the next, are passed over.
SPARSEKV_HOST_DEVICE inline std::int64_t decode_attention_entry_of(const DecodeAttentionPages& p,
                                                                   const DecodeAttentionRow& row, std::int64_t pos) {
  std::int64_t lo = row.first_entry, hi = row.end_entry;  // indptr[lo] <= pos < indptr[hi]
  while (hi - lo > 1) {
    const std::int64_t mid = lo + (hi - lo) / 2;
    if (p.indptr[mid] <= pos) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// Tokens of the page at position pos of entry `entry`.
SPARSEKV_HOST_DEVICE inline std::uint32_t decode_attention_page_tokens(const DecodeAttentionPages& p,
                                                                       std::int64_t entry, std::int64_t pos) {
  return pos + 1 == p.indptr[entry + 1] ? decode_attention_last_tokens(p.last_page_len[entry], p.page_tokens)
                                        : p.page_tokens;
}

// Token slots chunk c of a row walks: its pages x page_tokens, less the
// unused slots of its last page, so the walk ends at the last token. The
// unused slots of a partial page mid-chunk (a run's last page) are walked
// and masked.
SPARSEKV_HOST_DEVICE inline std::uint64_t decode_attention_chunk_slots(const DecodeAttentionPages& p,
                                                                       const DecodeAttentionRow& row,
                                                                       const DecodeAttentionChunk& c) {
  if (c.first >= c.last) return 0;
  const std::int64_t last_pos = row.begin + static_cast<std::int64_t>(c.last) - 1;
  const std::int64_t last_entry = decode_attention_entry_of(p, row, last_pos);
  const std::uint32_t last_tokens = decode_attention_page_tokens(p, last_entry, last_pos);
  return (c.last - c.first) * p.page_tokens - (p.page_tokens - last_tokens);
}

// One thread's walk over the pages of a row in increasing positions (its
// tokens of a chunk, in order): the entry holding the current page is found
// by binary search once, then advanced past entry ends, so a token costs a
// compare and an entry one load of its end and its last page's length.
struct DecodeAttentionCursor {
  std::int64_t entry = 0;
  std::int64_t entry_end = 0;     // indptr[entry + 1]
  std::uint32_t last_tokens = 0;  // tokens of the entry's last page

  DecodeAttentionCursor() = default;  // a chunk with no pages walks nothing
  // Starts at position pos of a row holding it.
  SPARSEKV_HOST_DEVICE DecodeAttentionCursor(const DecodeAttentionPages& p, const DecodeAttentionRow& row,
                                             std::int64_t pos)
      : entry(decode_attention_entry_of(p, row, pos)),
        entry_end(p.indptr[entry + 1]),
        last_tokens(decode_attention_last_tokens(p.last_page_len[entry], p.page_tokens)) {}

  // Tokens of the page at pos (no smaller than the last pos asked, inside the row).
  SPARSEKV_HOST_DEVICE std::uint32_t tokens_at(const DecodeAttentionPages& p, std::int64_t pos) {
    if (pos >= entry_end) {
      do {
        ++entry;
        entry_end = p.indptr[entry + 1];
      } while (pos >= entry_end);
      last_tokens = decode_attention_last_tokens(p.last_page_len[entry], p.page_tokens);
    }
    return pos + 1 == entry_end ? last_tokens : p.page_tokens;
  }
};

// Whether slot `slot` of the page at position pos is live (null masks: all are).
SPARSEKV_HOST_DEVICE inline bool decode_attention_slot_live(const SlotMask* live_masks, std::int64_t pos,
                                                            std::uint32_t slot) {
  return live_masks == nullptr || slot_live(live_masks[pos], slot);
}

// Where the split kernel keeps the scaled score of q head 0 of a row's group
// for slot `slot` of the page at position pos; head j's follows at + j.
SPARSEKV_HOST_DEVICE inline std::size_t decode_attention_score_index(std::int64_t pos, std::uint32_t slot,
                                                                     std::uint32_t page_tokens, std::uint32_t group) {
  return (static_cast<std::size_t>(pos) * page_tokens + slot) * group;
}

// The weights kernel's value for slot `slot` of the page at position pos of
// row `row`, a page holding `tokens` tokens: the softmax probability summed
// over the row's q heads (softmax_group_weight of the stored scores against
// each head's lse, lse being [batch * q_heads]); 0 for an unused or dead slot,
// whose score was never stored.
SPARSEKV_HOST_DEVICE inline float decode_attention_slot_weight(const float* scores, const float* lse,
                                                               const SlotMask* live_masks, std::uint32_t row,
                                                               std::int64_t pos, std::uint32_t slot,
                                                               std::uint32_t tokens, std::uint32_t page_tokens,
                                                               std::uint32_t group) {
  if (slot >= tokens || !decode_attention_slot_live(live_masks, pos, slot)) return 0.0f;
  return softmax_group_weight(scores + decode_attention_score_index(pos, slot, page_tokens, group),
                              lse + std::size_t{row} * group, group);
}

// The split sparse_decode_attention will use on the current device for
// `shape` (its workspace_bytes is what the caller allocates). Throws
// invalid_argument on a bad shape, cuda_error if a device query fails.
DecodeAttentionSplit plan_sparse_decode_attention(const DecodeAttentionShape& shape);

// Workspace bytes that serve every batch from 1 to shape.batch, the other
// fields as given, on the current device: what an engine allocates once for
// its largest batch. The chunk count follows the batch, and chunks x batch
// is not monotone in it (a smaller batch may fill more waves), so the
// largest batch's plan alone can fall short. Throws as plan_sparse_decode_attention.
std::size_t sparse_decode_attention_workspace_capacity(const DecodeAttentionShape& shape);

// Enqueues the attention on `stream` (a cudaStream_t; nullptr = default
// stream). Checked on the host before launching (ErrorCode::invalid_argument):
// the shape (kv_heads >= 1, q_heads a multiple of kv_heads, head_dim 64 or
// 128, page_tokens >= 1); page_base and page_stride 16-byte aligned, stride
// >= page_bytes; q, out, indptr, indices, last_page_len and workspace
// non-null when batch > 0, workspace 16-byte aligned with workspace_bytes >=
// the plan's; extra pointers all null or all set; the plan's chunks <= 65535
// (a forced chunk_pages too small for max_pages is rejected). Device data
// (row_entries and indptr non-decreasing, page ids inside the pool) is not
// checked; a last_page_len outside 1..page_tokens is clamped into it so reads
// stay inside the page. batch == 0 enqueues nothing (only the shape is
// checked). live_masks needs page_tokens <= kMaxMaskedPageTokens, and
// slot_weights shape.max_indices > 0 (the workspace then holds the scores).
// Throws ErrorCode::cuda_error if a device query or a launch fails.
void sparse_decode_attention(const DecodeAttentionShape& shape, const DecodeAttentionArgs& args, void* stream);

}  // namespace sparsekv::cuda
