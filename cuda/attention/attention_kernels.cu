// CUDA kernels of Attend: split-K sparse paged decode attention over
// head-wise pages (Spin §4.1 Attend, §5.2 page layout), GQA, log-sum-exp
// merge of the chunk partials and of a policy's extra term (RetroInfer §4.2),
// live-slot masks (SpvLLM §2) and per-slot softmax weights from the same
// pass (H2O's scores).
// The online-softmax fold and merge are the softmax_* functions of
// attention_partial.hpp, shared with the host backend; the walk over a row's
// pages and runs is the decode_attention_* functions of the header, shared
// with the host emulation in CI.
#include <cuda_fp16.h>
#include <cuda_pipeline.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "sparsekv/attention/attention_partial.hpp"
#include "sparsekv/attention/sparse_decode_attention_cuda.hpp"
#include "sparsekv/core/error_code.hpp"
#include "core/launch_support.cuh"

namespace sparsekv::cuda {
namespace {

using namespace detail;  // core/launch_support.cuh

constexpr std::uint32_t kWarp = 32;
constexpr std::uint32_t kThreads = kSplitThreads;
// The bytes of tiles (kSplitTileTokens tokens) a CTA keeps in flight (2 to 4 stages): decode attention is
// bandwidth-bound, throughput follows the bytes in flight, and at 24 KB (3 stages of bf16 head_dim 128) seven CTAs fit
// an SM's shared memory.
constexpr std::size_t kStageBudget = 24 << 10;
constexpr std::uint32_t kMergeThreads = 256;
constexpr std::uint32_t kMergePrefetch = 8;
constexpr std::uint32_t kWeightsThreads = 128;
constexpr std::size_t kNoScore = ~std::size_t{0};
constexpr std::size_t kVec = sizeof(uint4);  // 16 bytes
constexpr unsigned kFullMask = 0xffffffffu;
constexpr std::uint32_t kMaxGridYZ = 65535;

// Unpacks one 16-byte vector of page elements to fp32 (exact for every dtype,
// as the host's load_element).
template <DType T>
struct Elements;

template <>
struct Elements<DType::f32> {
  static constexpr std::uint32_t kPerVec = 4;
  __device__ static void unpack(const uint4& r, float* out) {
    out[0] = __uint_as_float(r.x);
    out[1] = __uint_as_float(r.y);
    out[2] = __uint_as_float(r.z);
    out[3] = __uint_as_float(r.w);
  }
};

template <>
struct Elements<DType::f16> {
  static constexpr std::uint32_t kPerVec = 8;
  __device__ static void unpack(const uint4& r, float* out) {
    const unsigned words[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      out[2 * w] = __half2float(__ushort_as_half(static_cast<unsigned short>(words[w] & 0xffffu)));
      out[2 * w + 1] = __half2float(__ushort_as_half(static_cast<unsigned short>(words[w] >> 16)));
    }
  }
};

template <>
struct Elements<DType::bf16> {
  static constexpr std::uint32_t kPerVec = 8;
  __device__ static void unpack(const uint4& r, float* out) {
    const unsigned words[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      out[2 * w] = __uint_as_float(words[w] << 16);
      out[2 * w + 1] = __uint_as_float(words[w] & 0xffff0000u);
    }
  }
};

struct SplitParams {
  const float* q;
  const std::byte* page_base;
  std::size_t page_stride;
  DecodeAttentionPages pages;  // indptr, last_page_len, row_entries, page_tokens
  const std::int64_t* indices;
  const SlotMask* live_masks;  // null: all live
  float scale;
  std::uint32_t group;  // q heads per kv head
  std::uint32_t chunk_pages;
  std::uint32_t chunks;
  std::uint32_t batch_q;  // batch * q_heads: partials per chunk
  float* ws_acc;          // [chunks][batch_q][D]
  float* ws_max;          // [chunks][batch_q]
  float* ws_sum;          // [chunks][batch_q]
  float* scores;          // null, or [max_indices * page_tokens][group]: every live slot's scaled score
  std::uint32_t max_indices;
};

// The split kernel's shape for head_dim D, page dtype T and G q heads: rows
// of kLanes threads, each thread one 16-byte vector of a K/V row; rows dealt
// out over the heads (decode_attention_token_groups), tiles of kTile tokens
// staged kStages deep in shared memory.
template <std::uint32_t D, DType T, std::uint32_t G>
struct SplitGeometry {
  using E = Elements<T>;
  static constexpr std::uint32_t kPerVec = E::kPerVec;
  static constexpr std::uint32_t kLanes = D / kPerVec;
  static_assert(D % kPerVec == 0 && kLanes <= kWarp && kWarp % kLanes == 0);
  static constexpr std::uint32_t kRows = kThreads / kLanes;
  static_assert(kRows == decode_attention_rows(D, T));
  static constexpr std::uint32_t kHeadRows = G < kRows ? G : kRows;  // rows per token group
  static constexpr std::uint32_t kHeadsPerThread = G / kHeadRows;
  static constexpr std::uint32_t kTokenGroups = kRows / kHeadRows;
  static_assert(kTokenGroups == decode_attention_token_groups(D, T, G));
  static constexpr std::uint32_t kTile = kSplitTileTokens;
  static_assert(kTile % kRows == 0 && kTile % kTokenGroups == 0);
  static constexpr std::uint32_t kLoadsPerThread = kTile / kRows;
  static constexpr std::uint32_t kFoldsPerThread = kTile / kTokenGroups;  // tokens of a tile a thread folds
  static constexpr std::uint32_t kFoldBatch = decode_attention_fold_batch(D, T, G);
  static_assert(kFoldsPerThread % kFoldBatch == 0);
  static constexpr std::size_t kElemBytes = kVec / kPerVec;
  static constexpr std::size_t kRowBytes = D * kElemBytes;
  static constexpr std::size_t kStageBytes = 2 * kTile * kRowBytes;  // K and V rows of a tile
  static constexpr std::uint32_t kStages = kStageBudget / kStageBytes < 2   ? 2
                                           : kStageBudget / kStageBytes > 4 ? 4
                                                                            : kStageBudget / kStageBytes;
};

// Phase 1: CTA (row, chunk, head slice) folds the chunk's tokens for up to G
// q heads. Every thread copies its vectors of the next tiles' K/V rows into
// shared memory (cp.async, kStages - 1 tiles ahead of the fold), so a K/V row
// is read from HBM once and the copies in flight cost no registers. A
// thread folds one q head (two when the CTA has fewer rows than heads) over
// the tokens of its token group with its own online softmax, kFoldBatch
// tokens at once (one rescale of the accumulator and one exponential a
// token, where a fold per token takes two and a rescale each): the q and the
// accumulator of a head stay in the registers of its rows only. Token groups
// merge through shared memory; the CTA writes one partial per q head, and
// (slot weights) each live slot's scaled scores.
template <std::uint32_t D, DType T, std::uint32_t G>
__global__ void __launch_bounds__(kThreads) decode_split_kernel(const SplitParams p) {
  using Geo = SplitGeometry<D, T, G>;
  using E = typename Geo::E;
  constexpr std::uint32_t kPerVec = Geo::kPerVec;
  constexpr std::uint32_t kLanes = Geo::kLanes;
  constexpr std::uint32_t kTile = Geo::kTile;
  constexpr std::uint32_t kStages = Geo::kStages;
  constexpr std::uint32_t kTokenGroups = Geo::kTokenGroups;
  constexpr std::uint32_t kHeadRows = Geo::kHeadRows;
  constexpr std::uint32_t kHeads = Geo::kHeadsPerThread;
  constexpr std::uint32_t kFolds = Geo::kFoldsPerThread;
  constexpr std::uint32_t kFoldBatch = Geo::kFoldBatch;
  constexpr std::size_t kRowBytes = Geo::kRowBytes;

  __shared__ uint4 s_kv[kStages][2][kTile][kLanes];
  __shared__ bool s_valid[kStages][kTile];
  __shared__ std::size_t s_score_at[kStages][kTile];
  __shared__ float s_acc[kTokenGroups][G][D];
  __shared__ float s_max[kTokenGroups][G];
  __shared__ float s_sum[kTokenGroups][G];

  const std::uint32_t lane = threadIdx.x % kLanes;
  const std::uint32_t thread_row = threadIdx.x / kLanes;
  const std::uint32_t head_row = thread_row % kHeadRows;
  const std::uint32_t token_group = thread_row / kHeadRows;
  const std::uint32_t dim0 = lane * kPerVec;
  const std::uint32_t row = blockIdx.x;
  const std::uint32_t chunk = blockIdx.y;
  const std::uint32_t head0 = blockIdx.z * G;
  const std::uint32_t heads = p.group - head0 < G ? p.group - head0 : G;
  const std::size_t q_head0 = std::size_t{row} * p.group + head0;  // first q head in [0, batch_q)

  // The chunk's pages of the row (all its entries, walked as one list) and
  // this thread's entry cursor for the tokens it copies, started at the
  // chunk's first page.
  const std::uint32_t page_tokens = p.pages.page_tokens;
  const DecodeAttentionRow row_span = decode_attention_row(p.pages, row);
  const DecodeAttentionChunk range = decode_attention_chunk(row_span.pages(), chunk, p.chunk_pages, p.chunks);
  const std::uint64_t tokens = decode_attention_chunk_slots(p.pages, row_span, range);
  const std::int64_t first_pos = row_span.begin + static_cast<std::int64_t>(range.first);
  DecodeAttentionCursor cursor;
  if (tokens > 0) cursor = DecodeAttentionCursor(p.pages, row_span, first_pos);

  // Head k of this thread is head_row + k * kHeadRows of the slice. A chunk
  // without tokens never uses q: it is not read (an engine's rows past its
  // live batch may hold anything; initcheck flagged the read on an H100).
  float q[kHeads][kPerVec];
  float acc[kHeads][kPerVec];
  SoftmaxState state[kHeads];
#pragma unroll
  for (std::uint32_t k = 0; k < kHeads; ++k) {
    const std::uint32_t h = head_row + k * kHeadRows;
#pragma unroll
    for (std::uint32_t i = 0; i < kPerVec; ++i) {
      q[k][i] = h < heads && tokens > 0 ? p.q[(q_head0 + h) * D + dim0 + i] : 0.0f;
      acc[k][i] = 0.0f;
    }
  }

  // The copy of tile `loaded` into stage loaded % kStages: this thread's
  // vector of kLoadsPerThread token rows (offsets thread_row + j * kRows, so
  // its tokens only move forward and its cursor with them). A dead or
  // unused slot is zero-filled and marked invalid. Token base of the tile =
  // load_page * page_tokens + load_slot, advanced without 64-bit division.
  const std::uint64_t tiles = (tokens + kTile - 1) / kTile;
  const std::size_t block_bytes = std::size_t{page_tokens} * kRowBytes;
  std::uint64_t loaded = 0;
  std::uint64_t load_page = 0;
  std::uint32_t load_slot = 0;
  const auto copy_next_tile = [&] {
    if (loaded < tiles) {
      const std::uint32_t stage = static_cast<std::uint32_t>(loaded % kStages);
      const std::uint64_t base = loaded * kTile;
#pragma unroll
      for (std::uint32_t j = 0; j < Geo::kLoadsPerThread; ++j) {
        const std::uint32_t offset = thread_row + j * Geo::kRows;
        bool valid = base + offset < tokens;
        std::size_t score_at = kNoScore;
        if (valid) {
          const std::uint32_t in_page = load_slot + offset;
          const std::int64_t pos = first_pos + static_cast<std::int64_t>(load_page + in_page / page_tokens);
          const std::uint32_t slot = in_page % page_tokens;
          // False past a run's last token mid-chunk, and for a slot whose token was evicted.
          valid = slot < cursor.tokens_at(p.pages, pos) && decode_attention_slot_live(p.live_masks, pos, slot);
          if (valid) {
            if (p.scores != nullptr && pos < static_cast<std::int64_t>(p.max_indices))
              score_at = decode_attention_score_index(pos, slot, page_tokens, p.group) + head0;
            const std::byte* k_row = p.page_base + static_cast<std::size_t>(__ldg(p.indices + pos)) * p.page_stride +
                                     slot * kRowBytes + dim0 * Geo::kElemBytes;
            __pipeline_memcpy_async(&s_kv[stage][0][offset][lane], k_row, kVec);
            __pipeline_memcpy_async(&s_kv[stage][1][offset][lane], k_row + block_bytes, kVec);
          }
        }
        if (!valid) {
          s_kv[stage][0][offset][lane] = make_uint4(0, 0, 0, 0);
          s_kv[stage][1][offset][lane] = make_uint4(0, 0, 0, 0);
        }
        if (lane == 0) {
          s_valid[stage][offset] = valid;
          s_score_at[stage][offset] = score_at;
        }
      }
      const std::uint32_t advanced = load_slot + kTile;
      load_page += advanced / page_tokens;
      load_slot = advanced % page_tokens;
      ++loaded;
    }
    // Committed even when empty: the wait below counts groups.
    __pipeline_commit();
  };

#pragma unroll
  for (std::uint32_t s = 0; s + 1 < kStages; ++s) copy_next_tile();
  for (std::uint64_t tile = 0; tile < tiles; ++tile) {
    // Tile `tile` has landed for this thread; the barrier makes every
    // thread's copies visible and frees the stage folded last iteration.
    __pipeline_wait_prior(kStages - 2);
    __syncthreads();
    copy_next_tile();
    const std::uint32_t stage = static_cast<std::uint32_t>(tile % kStages);
    // This thread's tokens of the tile, kFoldBatch at a time: their scaled
    // scores (-inf where the slot is invalid or the head past the slice),
    // one fold of them all (one rescale of the accumulator), then their values.
#pragma unroll
    for (std::uint32_t j0 = 0; j0 < kFolds; j0 += kFoldBatch) {
      float score[kHeads][kFoldBatch];
#pragma unroll
      for (std::uint32_t j = 0; j < kFoldBatch; ++j) {
        const std::uint32_t t = token_group + (j0 + j) * kTokenGroups;
        float k[kPerVec];
        E::unpack(s_kv[stage][0][t][lane], k);
        float dot[kHeads];
#pragma unroll
        for (std::uint32_t h = 0; h < kHeads; ++h) {
          dot[h] = 0.0f;
#pragma unroll
          for (std::uint32_t i = 0; i < kPerVec; ++i) dot[h] += q[h][i] * k[i];
        }
        // Every lane takes part in the shuffles (the trip count is the same for all).
#pragma unroll
        for (std::uint32_t off = kLanes / 2; off > 0; off /= 2) {
#pragma unroll
          for (std::uint32_t h = 0; h < kHeads; ++h) dot[h] += __shfl_xor_sync(kFullMask, dot[h], off);
        }
        const bool valid = s_valid[stage][t];
        const std::size_t score_at = s_score_at[stage][t];
#pragma unroll
        for (std::uint32_t h = 0; h < kHeads; ++h) {
          const std::uint32_t head = head_row + h * kHeadRows;
          score[h][j] = valid && head < heads ? dot[h] * p.scale : kNegativeInfinity;
          if (valid && head < heads && score_at != kNoScore && lane == 0) p.scores[score_at + head] = score[h][j];
        }
      }
#pragma unroll
      for (std::uint32_t h = 0; h < kHeads; ++h) {
        const float scale = softmax_fold_tile(state[h], score[h], kFoldBatch, score[h]);
#pragma unroll
        for (std::uint32_t i = 0; i < kPerVec; ++i) acc[h][i] = softmax_rescale_tile(acc[h][i], scale);
      }
#pragma unroll
      for (std::uint32_t j = 0; j < kFoldBatch; ++j) {
        const std::uint32_t t = token_group + (j0 + j) * kTokenGroups;
        if (s_valid[stage][t]) {
          float v[kPerVec];
          E::unpack(s_kv[stage][1][t][lane], v);
#pragma unroll
          for (std::uint32_t h = 0; h < kHeads; ++h) {
            // A weight that underflowed to 0 adds nothing, even to an inf value (as softmax_rescale_add).
            if (score[h][j] != 0.0f) {
#pragma unroll
              for (std::uint32_t i = 0; i < kPerVec; ++i) acc[h][i] += score[h][j] * v[i];
            }
          }
        }
      }
    }
  }

#pragma unroll
  for (std::uint32_t h = 0; h < kHeads; ++h) {
    const std::uint32_t head = head_row + h * kHeadRows;
#pragma unroll
    for (std::uint32_t i = 0; i < kPerVec; ++i) s_acc[token_group][head][dim0 + i] = acc[h][i];
    if (lane == 0) {
      s_max[token_group][head] = state[h].max;
      s_sum[token_group][head] = state[h].sum;
    }
  }
  __syncthreads();

  // Merge the token groups in order; one thread per (head, dim) writes the chunk's partial.
  for (std::uint32_t idx = threadIdx.x; idx < heads * D; idx += kThreads) {
    const std::uint32_t g = idx / D;
    const std::uint32_t d = idx % D;
    SoftmaxState s;
    float a = 0.0f;
#pragma unroll
    for (std::uint32_t w = 0; w < kTokenGroups; ++w) {
      const RescaleStep step = softmax_merge(s, SoftmaxState{s_max[w][g], s_sum[w][g]});
      a = softmax_rescale_add(a, step, s_acc[w][g][d]);
    }
    const std::size_t slot = std::size_t{chunk} * p.batch_q + q_head0 + g;
    p.ws_acc[slot * D + d] = a;
    if (d == 0) {
      p.ws_max[slot] = s.max;
      p.ws_sum[slot] = s.sum;
    }
  }
}

struct MergeParams {
  const float* ws_acc;
  const float* ws_max;
  const float* ws_sum;
  DecodeAttentionExtra extra;
  float* out;
  float* lse;
  float* ws_lse;  // null, or [batch_q]: the lse again, for the weights kernel
  std::uint32_t chunks;
  std::uint32_t batch_q;
  std::uint32_t head_dim;
};

// Phase 2: one thread per (q head, dim) merges the head's chunk partials in
// chunk order, then the extra term, and writes o (and lse, to the caller
// and to the workspace when slot weights are asked for).
__global__ void __launch_bounds__(kMergeThreads) decode_merge_kernel(const MergeParams p) {
  const std::uint64_t idx = std::uint64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (idx >= std::uint64_t{p.batch_q} * p.head_dim) return;
  const std::uint32_t head = static_cast<std::uint32_t>(idx / p.head_dim);
  const std::uint32_t d = static_cast<std::uint32_t>(idx % p.head_dim);
  SoftmaxState s;
  float a = 0.0f;
  // The partials of kMergePrefetch chunks are loaded before the first is
  // folded: the fold is a serial chain, and at small batch (32 chunks a head)
  // one load latency per chunk was most of the kernel. Folding stays in chunk order.
  for (std::uint32_t c0 = 0; c0 < p.chunks; c0 += kMergePrefetch) {
    float part_max[kMergePrefetch], part_sum[kMergePrefetch], part_acc[kMergePrefetch];
#pragma unroll
    for (std::uint32_t u = 0; u < kMergePrefetch; ++u) {
      if (c0 + u < p.chunks) {
        const std::size_t slot = std::size_t{c0 + u} * p.batch_q + head;
        part_max[u] = __ldg(p.ws_max + slot);
        part_sum[u] = __ldg(p.ws_sum + slot);
        part_acc[u] = __ldg(p.ws_acc + slot * p.head_dim + d);
      }
    }
#pragma unroll
    for (std::uint32_t u = 0; u < kMergePrefetch; ++u) {
      if (c0 + u < p.chunks) {
        const RescaleStep step = softmax_merge(s, SoftmaxState{part_max[u], part_sum[u]});
        a = softmax_rescale_add(a, step, part_acc[u]);
      }
    }
  }
  if (p.extra.sum != nullptr) {
    const RescaleStep step = softmax_merge(s, SoftmaxState{p.extra.max[head], p.extra.sum[head]});
    a = softmax_rescale_add(a, step, step.value_weight == 0.0f ? 0.0f : p.extra.acc[idx]);
  }
  p.out[idx] = softmax_output(a, s);
  if (d == 0) {
    if (p.lse != nullptr) p.lse[head] = softmax_lse(s);
    if (p.ws_lse != nullptr) p.ws_lse[head] = softmax_lse(s);
  }
}

struct WeightsParams {
  DecodeAttentionPages pages;
  const SlotMask* live_masks;
  const float* scores;  // [max_indices * page_tokens][group]
  const float* lse;     // [batch_q]
  float* slot_weights;  // [max_indices][page_tokens]
  std::uint32_t group;
  std::uint32_t max_indices;
};

// Phase 3: block `row` writes the weight of every slot of the row's pages,
// a thread per (page position, slot), in increasing positions so that each
// thread's entry cursor only moves forward. Reads scores and lse only.
__global__ void __launch_bounds__(kWeightsThreads) decode_weights_kernel(const WeightsParams p) {
  const std::uint32_t row = blockIdx.x;
  const std::uint32_t page_tokens = p.pages.page_tokens;
  const DecodeAttentionRow span = decode_attention_row(p.pages, row);
  const std::uint64_t slots = span.pages() * page_tokens;
  if (slots == 0) return;
  DecodeAttentionCursor cursor(p.pages, span, span.begin);
  for (std::uint64_t idx = threadIdx.x; idx < slots; idx += kWeightsThreads) {
    const std::int64_t pos = span.begin + static_cast<std::int64_t>(idx / page_tokens);
    if (pos >= static_cast<std::int64_t>(p.max_indices)) return;
    const std::uint32_t slot = static_cast<std::uint32_t>(idx % page_tokens);
    const std::uint32_t tokens = cursor.tokens_at(p.pages, pos);
    p.slot_weights[static_cast<std::size_t>(pos) * page_tokens + slot] =
        decode_attention_slot_weight(p.scores, p.lse, p.live_masks, row, pos, slot, tokens, page_tokens, p.group);
  }
}

constexpr const char* kFunction = "sparse_decode_attention";

bool aligned(const void* p, std::size_t alignment) { return reinterpret_cast<std::uintptr_t>(p) % alignment == 0; }

using SplitKernel = void (*)(SplitParams);

// Kernel instantiations: head_dim {64, 128} x dtype {f32, f16, bf16} x group
// width {1, 2, 4, 8} (decode_attention_group_width).
template <std::uint32_t D, DType T>
SplitKernel pick_group(std::uint32_t width) {
  switch (width) {
    case 1:
      return decode_split_kernel<D, T, 1>;
    case 2:
      return decode_split_kernel<D, T, 2>;
    case 4:
      return decode_split_kernel<D, T, 4>;
    default:
      return decode_split_kernel<D, T, kMaxGroupPerCta>;
  }
}

template <std::uint32_t D>
SplitKernel pick_dtype(DType dtype, std::uint32_t width) {
  switch (dtype) {
    case DType::f32:
      return pick_group<D, DType::f32>(width);
    case DType::f16:
      return pick_group<D, DType::f16>(width);
    case DType::bf16:
      return pick_group<D, DType::bf16>(width);
  }
  return pick_group<D, DType::bf16>(width);
}

SplitKernel select_kernel(const DecodeAttentionShape& shape) {
  const std::uint32_t width = decode_attention_group_width(shape.q_heads / shape.kv_heads);
  return shape.layout.head_dim == 64 ? pick_dtype<64>(shape.layout.dtype, width)
                                     : pick_dtype<128>(shape.layout.dtype, width);
}

void check_shape(const DecodeAttentionShape& shape) {
  if (shape.kv_heads == 0 || shape.q_heads == 0 || shape.q_heads % shape.kv_heads != 0)
    throw_invalid(kFunction, std::to_string(shape.q_heads) + " q heads cannot be grouped onto " +
                                 std::to_string(shape.kv_heads) + " kv heads");
  if (shape.layout.head_dim != 64 && shape.layout.head_dim != 128)
    throw_invalid(kFunction, "head_dim " + std::to_string(shape.layout.head_dim) + " is not 64 or 128");
  if (shape.layout.page_tokens == 0) throw_invalid(kFunction, "page_tokens is 0");
  if (shape.layout.dtype != DType::f32 && shape.layout.dtype != DType::f16 && shape.layout.dtype != DType::bf16)
    throw_invalid(kFunction, "unknown page dtype");
  const std::uint64_t rows = std::uint64_t{shape.batch} * shape.kv_heads;
  if (rows > 0x7fffffffu) throw_invalid(kFunction, std::to_string(rows) + " (request, kv head) rows exceed the grid");
  if (std::uint64_t{shape.batch} * shape.q_heads * shape.layout.head_dim > 0xffffffffu)
    throw_invalid(kFunction, "batch * q_heads * head_dim exceeds 2^32 elements");
}

// CTAs of `kernel` resident on the current device at once: the split's wave.
std::uint32_t wave_ctas(SplitKernel kernel) {
  const int device = current_device(kFunction);
  const std::uint64_t target =
      std::uint64_t(multiprocessor_count(device, kFunction)) *
      std::uint64_t(resident_blocks_per_sm(kernel, device, static_cast<int>(kThreads), 0, kFunction));
  return target > 0xffffffffu ? 0xffffffffu : static_cast<std::uint32_t>(target);
}

// The split for a wave of `wave` CTAs, refused where the grid cannot hold it.
DecodeAttentionSplit plan(const DecodeAttentionShape& shape, std::uint32_t wave) {
  const DecodeAttentionSplit split = split_decode_attention(shape, wave);
  if (split.chunks > kMaxGridYZ)
    throw_invalid(kFunction, "chunk_pages " + std::to_string(split.chunk_pages) + " splits " +
                                 std::to_string(shape.max_pages) + " pages into " + std::to_string(split.chunks) +
                                 " chunks, at most 65535");
  if (split.head_slices > kMaxGridYZ) throw_invalid(kFunction, "GQA group too large");
  return split;
}

}  // namespace

DecodeAttentionSplit plan_sparse_decode_attention(const DecodeAttentionShape& shape) {
  check_shape(shape);
  return plan(shape, wave_ctas(select_kernel(shape)));
}

std::size_t sparse_decode_attention_workspace_capacity(const DecodeAttentionShape& shape) {
  check_shape(shape);
  const std::uint32_t wave = wave_ctas(select_kernel(shape));
  plan(shape, wave);  // the largest batch's grid limits
  return decode_attention_workspace_capacity(shape, wave);
}

void sparse_decode_attention(const DecodeAttentionShape& shape, const DecodeAttentionArgs& args, void* stream) {
  // Validation first: nothing is enqueued when an argument is wrong.
  check_shape(shape);
  if (shape.batch == 0) return;
  const std::size_t page_bytes = shape.layout.page_bytes();
  if (args.page_stride % kVec != 0 || args.page_stride < page_bytes)
    throw_invalid(kFunction, "page_stride " + std::to_string(args.page_stride) +
                                 " is not a multiple of 16 >= page_bytes " + std::to_string(page_bytes));
  if (!aligned(args.page_base, kVec)) throw_invalid(kFunction, "page_base is not 16-byte aligned");
  const bool any_extra = args.extra.max != nullptr || args.extra.sum != nullptr || args.extra.acc != nullptr;
  const bool all_extra = args.extra.max != nullptr && args.extra.sum != nullptr && args.extra.acc != nullptr;
  if (any_extra && !all_extra) throw_invalid(kFunction, "extra term needs max, sum and acc (or none of them)");
  if (args.q == nullptr || args.out == nullptr || args.page_base == nullptr)
    throw_invalid(kFunction, "null q, out or page_base");
  if (args.indptr == nullptr || args.indices == nullptr || args.last_page_len == nullptr)
    throw_invalid(kFunction, "null indptr, indices or last_page_len");
  if (args.workspace == nullptr || !aligned(args.workspace, kVec))
    throw_invalid(kFunction, "workspace is null or not 16-byte aligned");
  if (args.live_masks != nullptr && shape.layout.page_tokens > kMaxMaskedPageTokens)
    throw_invalid(kFunction, "live masks cover " + std::to_string(kMaxMaskedPageTokens) + " slots, pages hold " +
                                 std::to_string(shape.layout.page_tokens));
  if (args.slot_weights != nullptr && shape.max_indices == 0)
    throw_invalid(kFunction, "slot_weights needs shape.max_indices (the scores' room in the workspace)");
  const SplitKernel kernel = select_kernel(shape);
  const DecodeAttentionSplit split = plan(shape, wave_ctas(kernel));
  if (args.workspace_bytes < split.workspace_bytes)
    throw_invalid(kFunction, "workspace_bytes " + std::to_string(args.workspace_bytes) + " < " +
                                 std::to_string(split.workspace_bytes) + " needed");

  const std::uint32_t batch_q = shape.batch * shape.q_heads;
  float* ws_acc = static_cast<float*>(args.workspace);
  float* ws_max = ws_acc + std::size_t{split.chunks} * batch_q * shape.layout.head_dim;
  float* ws_sum = ws_max + std::size_t{split.chunks} * batch_q;
  const std::uint32_t group = shape.q_heads / shape.kv_heads;
  const bool weights = args.slot_weights != nullptr;
  float* ws_scores = weights ? ws_sum + std::size_t{split.chunks} * batch_q : nullptr;
  float* ws_lse = weights ? ws_scores + std::size_t{shape.max_indices} * shape.layout.page_tokens * group : nullptr;
  const DecodeAttentionPages pages{args.indptr, args.last_page_len, args.row_entries, shape.layout.page_tokens};
  const SplitParams sp{
      args.q,    args.page_base,    args.page_stride, pages,   args.indices, args.live_masks, args.scale,
      group,     split.chunk_pages, split.chunks,     batch_q, ws_acc,       ws_max,          ws_sum,
      ws_scores, shape.max_indices};
  const dim3 grid(shape.batch * shape.kv_heads, split.chunks, split.head_slices);
  const auto s = static_cast<cudaStream_t>(stream);
  kernel<<<grid, kThreads, 0, s>>>(sp);
  check_launch(kFunction);

  const MergeParams mp{ws_acc,   ws_max, ws_sum,       args.extra, args.out,
                       args.lse, ws_lse, split.chunks, batch_q,    shape.layout.head_dim};
  const std::uint64_t elements = std::uint64_t{batch_q} * shape.layout.head_dim;
  const auto merge_blocks = static_cast<unsigned>((elements + kMergeThreads - 1) / kMergeThreads);
  decode_merge_kernel<<<merge_blocks, kMergeThreads, 0, s>>>(mp);
  check_launch(kFunction);

  if (weights) {
    const WeightsParams wp{pages, args.live_masks, ws_scores, ws_lse, args.slot_weights, group, shape.max_indices};
    decode_weights_kernel<<<shape.batch * shape.kv_heads, kWeightsThreads, 0, s>>>(wp);
    check_launch(kFunction);
  }
}

}  // namespace sparsekv::cuda
