#pragma once
// A random decode-attention batch over a paged pool (one entry per row, or
// several runs per row as an AttendPlan has them), the host decode_attention
// reference, and a host emulation of the split-K kernel's decomposition
// (live-slot masks and slot weights included);
// shared by the kernel's rules (test_attention_rules.cpp), the Manager's
// plans (test_manager.cpp), the backends' attend() over a plan
// (test_attention.cpp, gpu/test_cuda_backend.cpp) and the kernel's GPU test
// (gpu/test_attention_cuda.cpp). The generators take the caller's normal
// distribution so that one batch draws from a single sequence.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "sparsekv/attention/attention_partial.hpp"
#include "sparsekv/attention/decode_attention.hpp"
#include "sparsekv/attention/sparse_decode_attention_cuda.hpp"
#include "sparsekv/core/numeric.hpp"
#include "sparsekv/facade/host_backend.hpp"

namespace sparsekv::test {

// Entries (CSR) of pages in a host pool of `stride`-byte pages over rows
// r = b * kv_heads + h: entry r is row r when row_entries is empty, else row r
// holds entries row_entries[r] .. row_entries[r + 1] (AttendPlan::head_entries).
struct AttentionBatch {
  std::uint32_t batch = 0, q_heads = 0, kv_heads = 0;
  PageLayout layout;
  std::size_t stride = 0;  // page_bytes, or wider
  float scale = 0;
  std::vector<std::byte> pool;
  const std::byte* base = nullptr;  // non-null: the pages are an outside pool's (a GPU tier), not `pool`
  std::vector<std::int64_t> indptr{0}, indices;
  std::vector<std::int32_t> last_page_len;
  std::vector<std::int64_t> row_entries;  // empty, or [batch * kv_heads + 1]
  std::vector<float> q;
  std::vector<AttentionPartial> extra;  // empty or [batch * q_heads]
  std::vector<SlotMask> live_masks;     // empty, or [indices.size()] (AttendPlan::live_masks)
  std::uint32_t max_pages = 0;          // pages of the longest row, over all its entries

  const std::byte* page(std::int64_t id) const { return (base != nullptr ? base : pool.data()) + id * stride; }
  std::uint32_t group() const { return q_heads / kv_heads; }
  const SlotMask* masks() const { return live_masks.empty() ? nullptr : live_masks.data(); }
  std::uint32_t row_first_entry(std::uint32_t row) const {
    return row_entries.empty() ? row : static_cast<std::uint32_t>(row_entries[row]);
  }
  // The kernel's view of the entries (host pointers).
  cuda::DecodeAttentionPages pages() const {
    return {indptr.data(), last_page_len.data(), row_entries.empty() ? nullptr : row_entries.data(),
            layout.page_tokens};
  }
};

// Random K and V rows in the first `pool_pages` pages (the pool already sized).
inline void fill_pages(AttentionBatch& b, std::uint32_t pool_pages, std::normal_distribution<float>& normal,
                       std::mt19937& rng) {
  const PageLayout& layout = b.layout;
  for (std::uint32_t p = 0; p < pool_pages; ++p)
    for (std::uint32_t row = 0; row < 2 * layout.page_tokens; ++row)
      for (std::uint32_t i = 0; i < layout.head_dim; ++i)
        store_element(b.pool.data() + p * b.stride + row * layout.row_bytes(), i, layout.dtype, normal(rng));
}

// Row r gets counts[r] distinct random pool pages and a random last-page
// length; with `poison`, the slots past it are NaN (they are never read).
inline void random_rows(AttentionBatch& b, const std::vector<std::uint32_t>& counts, std::uint32_t pool_pages,
                        std::mt19937& rng, bool poison) {
  const PageLayout& layout = b.layout;
  std::vector<std::int64_t> ids(pool_pages);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  std::size_t next = 0;
  for (std::size_t r = 0; r < counts.size(); ++r) {
    for (std::uint32_t p = 0; p < counts[r]; ++p) b.indices.push_back(ids[next++]);
    b.indptr.push_back(static_cast<std::int64_t>(b.indices.size()));
    const std::uint32_t len = 1 + std::uint32_t(rng() % layout.page_tokens);
    b.last_page_len.push_back(static_cast<std::int32_t>(len));
    if (poison && counts[r] > 0) {
      std::byte* last = b.pool.data() + b.indices.back() * b.stride;
      for (std::uint32_t slot = len; slot < layout.page_tokens; ++slot) {
        std::memset(last + layout.k_offset(slot), 0xff, layout.row_bytes());
        std::memset(last + layout.v_offset(slot), 0xff, layout.row_bytes());
      }
    }
    b.max_pages = std::max(b.max_pages, counts[r]);
  }
}

// Pages of each entry of each row: row r % 6 == 1 has no entries, == 2 only
// a tail (one entry of one page), == 3 an empty entry between two runs; the
// others 1..max_runs runs of 1..max_run_pages pages, so partial pages fall
// mid-row wherever random_runs gives a run a short last page.
inline std::vector<std::vector<std::uint32_t>> random_run_shapes(std::mt19937& rng, std::uint32_t rows,
                                                                 std::uint32_t max_runs, std::uint32_t max_run_pages) {
  std::vector<std::vector<std::uint32_t>> shapes(rows);
  const auto run_pages = [&] { return 1 + std::uint32_t(rng() % max_run_pages); };
  for (std::uint32_t r = 0; r < rows; ++r) {
    switch (r % 6) {
      case 1:
        break;
      case 2:
        shapes[r] = {1};
        break;
      case 3:
        shapes[r] = {run_pages(), 0, run_pages()};
        break;
      default:
        for (std::uint32_t e = 1 + std::uint32_t(rng() % max_runs); e > 0; --e) shapes[r].push_back(run_pages());
    }
  }
  return shapes;
}

inline std::uint32_t total_pages(const std::vector<std::vector<std::uint32_t>>& shapes) {
  std::uint32_t n = 0;
  for (const auto& row : shapes) n = std::accumulate(row.begin(), row.end(), n);
  return n;
}

// The runs form: entry e of row r gets shapes[r][e] distinct random pool
// pages and a random last-page length (a third of them full); with `poison`,
// the slots past it are NaN (they are never read).
inline void random_runs(AttentionBatch& b, const std::vector<std::vector<std::uint32_t>>& shapes,
                        std::uint32_t pool_pages, std::mt19937& rng, bool poison) {
  const PageLayout& layout = b.layout;
  std::vector<std::int64_t> ids(pool_pages);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  std::size_t next = 0;
  b.row_entries.assign(1, 0);
  for (const auto& row : shapes) {
    std::uint32_t row_pages = 0;
    for (const std::uint32_t pages : row) {
      for (std::uint32_t p = 0; p < pages; ++p) b.indices.push_back(ids[next++]);
      b.indptr.push_back(static_cast<std::int64_t>(b.indices.size()));
      const std::uint32_t len = rng() % 3 == 0 ? layout.page_tokens : 1 + std::uint32_t(rng() % layout.page_tokens);
      b.last_page_len.push_back(static_cast<std::int32_t>(len));
      if (poison && pages > 0) {
        std::byte* last = b.pool.data() + b.indices.back() * b.stride;
        for (std::uint32_t slot = len; slot < layout.page_tokens; ++slot) {
          std::memset(last + layout.k_offset(slot), 0xff, layout.row_bytes());
          std::memset(last + layout.v_offset(slot), 0xff, layout.row_bytes());
        }
      }
      row_pages += pages;
    }
    b.row_entries.push_back(static_cast<std::int64_t>(b.last_page_len.size()));
    b.max_pages = std::max(b.max_pages, row_pages);
  }
}

inline void random_queries(AttentionBatch& b, std::normal_distribution<float>& normal, std::mt19937& rng) {
  b.q.resize(std::size_t{b.batch} * b.q_heads * b.layout.head_dim);
  for (float& x : b.q) x = normal(rng);
}

// An extra term of three random (score, weight 1..max_weight, value) entries
// for every q head h but those with h % skip_every == skip_at.
inline void random_extra(AttentionBatch& b, std::normal_distribution<float>& normal, std::mt19937& rng,
                         std::size_t skip_every, std::size_t skip_at, std::uint32_t max_weight) {
  const std::uint32_t d = b.layout.head_dim;
  b.extra.assign(std::size_t{b.batch} * b.q_heads, AttentionPartial(d));
  std::vector<float> v(d);
  for (std::size_t h = 0; h < b.extra.size(); ++h) {
    if (h % skip_every == skip_at) continue;
    for (int c = 0; c < 3; ++c) {
      for (float& x : v) x = normal(rng);
      b.extra[h].add(2.0f * normal(rng), float(1 + rng() % max_weight), v.data());
    }
  }
}

// A live mask for every page: a quarter fully live, an eighth with every
// slot dead, the rest random bits (a page_tokens-bit mask may still come out
// full or empty).
inline void random_masks(AttentionBatch& b, std::mt19937& rng) {
  b.live_masks.clear();
  for (std::size_t i = 0; i < b.indices.size(); ++i) {
    const std::uint32_t kind = rng() % 8;
    const SlotMask bits = (SlotMask{rng()} << 32) | rng();
    b.live_masks.push_back(kind < 2 ? ~SlotMask{0} : kind == 2 ? SlotMask{0} : bits);
  }
}

// A batch with no pages yet: pages strided by page_bytes, a scale of
// 1/sqrt(head_dim), or 4 times that (peaky rows) for half of the draws.
inline AttentionBatch batch_shape(std::mt19937& rng, std::uint32_t batch, std::uint32_t kv_heads, std::uint32_t group,
                                  PageLayout layout) {
  AttentionBatch b;
  b.batch = batch;
  b.kv_heads = kv_heads;
  b.q_heads = kv_heads * group;
  b.layout = layout;
  b.stride = layout.page_bytes();
  b.scale = (rng() % 2 ? 4.0f : 1.0f) / std::sqrt(float(layout.head_dim));
  return b;
}

// A random batch in the runs form: rows of up to 4 runs of 1..5 pages
// (random_run_shapes), some rows peaky; with_extra: terms for two heads in
// three.
inline AttentionBatch random_runs_batch(std::mt19937& rng, std::uint32_t batch, std::uint32_t kv_heads,
                                        std::uint32_t group, PageLayout layout, bool with_extra) {
  std::normal_distribution<float> normal;
  AttentionBatch b = batch_shape(rng, batch, kv_heads, group, layout);
  const auto shapes = random_run_shapes(rng, batch * kv_heads, 4, 5);
  const std::uint32_t pool_pages = total_pages(shapes) + 3;
  b.pool.resize(std::size_t{pool_pages} * layout.page_bytes());
  fill_pages(b, pool_pages, normal, rng);
  random_runs(b, shapes, pool_pages, rng, false);
  random_queries(b, normal, rng);
  if (with_extra) random_extra(b, normal, rng, 3, 1, 8);  // no term for heads 1, 4, 7, ...
  return b;
}

// b as an AttendPlan whose pages start at `base` (b's pool, or a copy of it
// in device memory), and the call that attends it (no out, no weights yet).
inline AttendPlan attend_plan_of(const AttentionBatch& b, const std::byte* base) {
  AttendPlan plan;
  plan.indptr = b.indptr;
  plan.indices = b.indices;
  plan.last_page_len = b.last_page_len;
  plan.head_entries = b.row_entries;
  plan.extra = b.extra;
  plan.live_masks = b.live_masks;
  plan.gpu_tier_base = base;
  plan.page_bytes = b.stride;
  return plan;
}

inline AttendCall attend_call_of(const AttentionBatch& b, const AttendPlan& plan) {
  AttendCall call;
  call.plan = &plan;
  call.layout = b.layout;
  call.batch = b.batch;
  call.q_heads = b.q_heads;
  call.kv_heads = b.kv_heads;
  call.scale = b.scale;
  call.q = b.q.data();
  return call;
}

// Host decode_attention per request: the reference; with `weights`, its
// slot weights for every page position ([indices.size()][page_tokens], 0 for
// pages no row reaches).
inline void reference_attention(const AttentionBatch& b, std::vector<float>& out, std::vector<float>& lse,
                                std::vector<float>* weights = nullptr) {
  const std::uint32_t d = b.layout.head_dim;
  const std::uint32_t pt = b.layout.page_tokens;
  out.assign(std::size_t{b.batch} * b.q_heads * d, 0.0f);
  lse.assign(std::size_t{b.batch} * b.q_heads, 0.0f);
  if (weights != nullptr) weights->assign(b.indices.size() * pt, 0.0f);
  std::vector<HeadKv> kv(b.kv_heads);
  for (std::uint32_t r = 0; r < b.batch; ++r) {
    for (std::uint32_t h = 0; h < b.kv_heads; ++h) {
      const std::uint32_t row = r * b.kv_heads + h;
      const std::int64_t first = b.row_entries.empty() ? row : b.row_entries[row];
      const std::int64_t end = b.row_entries.empty() ? row + 1 : b.row_entries[row + 1];
      kv[h].clear();
      for (std::int64_t e = first; e < end; ++e) {
        for (std::int64_t i = b.indptr[e]; i < b.indptr[e + 1]; ++i)
          kv[h].add(b.page(b.indices[i]),
                    i + 1 == b.indptr[e + 1] ? std::uint32_t(b.last_page_len[e]) : b.layout.page_tokens,
                    b.live_masks.empty() ? ~SlotMask{0} : b.live_masks[std::size_t(i)]);
      }
    }
    const std::span<const AttentionPartial> extra =
        b.extra.empty() ? std::span<const AttentionPartial>{}
                        : std::span<const AttentionPartial>(b.extra).subspan(std::size_t{r} * b.q_heads, b.q_heads);
    // The request's rows hold page positions [first, end) in order.
    std::span<float> slice;
    if (weights != nullptr) {
      const auto first = std::size_t(b.indptr[b.row_first_entry(r * b.kv_heads)]);
      const auto end = std::size_t(b.indptr[b.row_first_entry((r + 1) * b.kv_heads)]);
      slice = std::span<float>(*weights).subspan(first * pt, (end - first) * pt);
    }
    decode_attention(b.layout, b.q_heads, b.scale, b.q.data() + std::size_t{r} * b.q_heads * d, kv, extra,
                     out.data() + std::size_t{r} * b.q_heads * d, lse.data() + std::size_t{r} * b.q_heads, slice);
  }
}

// One head's state with its accumulator, folded and merged only through the shared functions.
struct SoftmaxHead {
  SoftmaxState state;
  std::vector<float> acc;
  explicit SoftmaxHead(std::uint32_t d) : acc(d, 0.0f) {}

  void fold(float score, float weight, const float* value) {
    const RescaleStep step = softmax_fold(state, score, weight);
    for (std::size_t i = 0; i < acc.size(); ++i) acc[i] = softmax_rescale_add(acc[i], step, value[i]);
  }
  void merge(const SoftmaxHead& other) {
    const RescaleStep step = softmax_merge(state, other.state);
    for (std::size_t i = 0; i < acc.size(); ++i) acc[i] = softmax_rescale_add(acc[i], step, other.acc[i]);
  }
  std::vector<float> output() const {
    std::vector<float> out(acc.size());
    for (std::size_t i = 0; i < acc.size(); ++i) out[i] = softmax_output(acc[i], state);
    return out;
  }
};

// The kernel's decomposition in plain C++, through the header's page walk:
// CTA (row, chunk, slice) deals the chunk's token slots round-robin to its
// copy rows (decode_attention_rows), each with its own entry cursor (a
// kernel thread's), which skip the slots past a run's last token and dead
// slots (decode_attention_slot_live), a tile of kSplitTileTokens slots at a
// time; each q head folds a tile's slots round-robin into
// decode_attention_token_groups online-softmax states, each state
// decode_attention_fold_batch slots at once (softmax_fold_tile), and merges
// the states in order; it keeps each live slot's
// score (decode_attention_score_index) when `weights` is set, and writes
// partial [chunk][q head] to the workspace; the merge phase folds the chunks
// in order, then the extra term; the weights phase (with `weights`: [max_indices][page_tokens],
// NaN where not written) runs `weight_threads` threads per row, each with its
// own cursor, over the row's (page, slot) pairs (decode_attention_slot_weight).
inline void emulate_split_k(const AttentionBatch& b, const cuda::DecodeAttentionSplit& split, std::vector<float>& out,
                            std::vector<float>& lse, std::vector<float>* weights = nullptr,
                            std::uint32_t max_indices = 0, std::uint32_t weight_threads = 128) {
  const std::uint32_t d = b.layout.head_dim;
  const std::uint32_t group = b.group();
  const std::uint32_t page_tokens = b.layout.page_tokens;
  const std::uint32_t copy_rows = cuda::decode_attention_rows(d, b.layout.dtype);
  const std::uint32_t token_groups = cuda::decode_attention_token_groups(d, b.layout.dtype, group);
  const std::uint32_t fold_batch = cuda::decode_attention_fold_batch(d, b.layout.dtype, group);
  if (d * dtype_size(b.layout.dtype) < 16 || fold_batch == 0)
    throw std::invalid_argument("emulate_split_k: head_dim " + std::to_string(d) +
                                " gives no split CTA geometry (more token groups than a tile's tokens)");
  const cuda::DecodeAttentionPages pages = b.pages();
  const std::size_t batch_q = std::size_t{b.batch} * b.q_heads;
  std::vector<float> ws_acc(split.chunks * batch_q * d, std::nanf("")), ws_max(split.chunks * batch_q),
      ws_sum(split.chunks * batch_q);
  // Scores the split phase never writes (dead and unused slots) stay NaN: the weights phase must not read them.
  std::vector<float> ws_scores(weights != nullptr ? std::size_t{max_indices} * page_tokens * group : 0, std::nanf(""));
  std::vector<float> k(d), v(d);
  for (std::uint32_t row = 0; row < b.batch * b.kv_heads; ++row) {
    const cuda::DecodeAttentionRow rp = cuda::decode_attention_row(pages, row);
    for (std::uint32_t chunk = 0; chunk < split.chunks; ++chunk) {
      const cuda::DecodeAttentionChunk range =
          cuda::decode_attention_chunk(rp.pages(), chunk, split.chunk_pages, split.chunks);
      const std::uint64_t tokens = cuda::decode_attention_chunk_slots(pages, rp, range);
      std::vector<cuda::DecodeAttentionCursor> cursors;
      if (tokens > 0) {
        cursors.assign(copy_rows, cuda::DecodeAttentionCursor(pages, rp, rp.begin + std::int64_t(range.first)));
      }
      for (std::uint32_t g = 0; g < group; ++g) {
        const std::size_t q_head = std::size_t{row} * group + g;
        const float* qg = b.q.data() + q_head * d;
        std::vector<SoftmaxHead> sub(token_groups, SoftmaxHead(d));
        std::vector<cuda::DecodeAttentionCursor> walk = cursors;
        for (std::uint64_t base = 0; base < tokens; base += cuda::kSplitTileTokens) {
          // Copy phase: each slot of the tile through its copy row's cursor, in order.
          std::vector<float> tile_scores(cuda::kSplitTileTokens, kNegativeInfinity);
          std::vector<std::vector<float>> tile_values(cuda::kSplitTileTokens);
          for (std::uint32_t o = 0; o < cuda::kSplitTileTokens && base + o < tokens; ++o) {
            const std::uint64_t t = base + o;
            const std::int64_t pos = rp.begin + std::int64_t(range.first + t / page_tokens);
            const std::uint32_t slot = std::uint32_t(t % page_tokens);
            if (slot >= walk[t % copy_rows].tokens_at(pages, pos)) continue;
            if (!cuda::decode_attention_slot_live(b.masks(), pos, slot)) continue;
            const std::byte* p = b.page(b.indices[pos]);
            for (std::uint32_t i = 0; i < d; ++i) k[i] = load_element(p + b.layout.k_offset(slot), i, b.layout.dtype);
            for (std::uint32_t i = 0; i < d; ++i) v[i] = load_element(p + b.layout.v_offset(slot), i, b.layout.dtype);
            float dot = 0;
            for (std::uint32_t i = 0; i < d; ++i) dot += qg[i] * k[i];
            tile_scores[o] = dot * b.scale;
            tile_values[o] = v;
            if (weights != nullptr && pos < std::int64_t(max_indices))
              ws_scores[cuda::decode_attention_score_index(pos, slot, page_tokens, group) + g] = dot * b.scale;
          }
          // Fold phase: token group w folds slots w, w + groups, ... in batches of fold_batch.
          for (std::uint32_t w = 0; w < token_groups; ++w) {
            SoftmaxHead& head = sub[w];
            for (std::uint32_t j0 = 0; j0 < cuda::kSplitTileTokens / token_groups; j0 += fold_batch) {
              std::vector<float> batch_weights(fold_batch);
              for (std::uint32_t j = 0; j < fold_batch; ++j)
                batch_weights[j] = tile_scores[w + (j0 + j) * token_groups];
              const float scale = softmax_fold_tile(head.state, batch_weights.data(), fold_batch, batch_weights.data());
              for (float& a : head.acc) a = softmax_rescale_tile(a, scale);
              for (std::uint32_t j = 0; j < fold_batch; ++j) {
                const std::vector<float>& value = tile_values[w + (j0 + j) * token_groups];
                if (value.empty() || batch_weights[j] == 0.0f) continue;  // invalid slot, or no weight
                for (std::uint32_t i = 0; i < d; ++i) head.acc[i] += batch_weights[j] * value[i];
              }
            }
          }
        }
        SoftmaxHead cta(d);
        for (const SoftmaxHead& s : sub) cta.merge(s);
        const std::size_t slot = chunk * batch_q + q_head;
        std::copy(cta.acc.begin(), cta.acc.end(), ws_acc.begin() + slot * d);
        ws_max[slot] = cta.state.max;
        ws_sum[slot] = cta.state.sum;
      }
    }
  }
  out.assign(batch_q * d, 0.0f);
  lse.assign(batch_q, 0.0f);
  for (std::size_t h = 0; h < batch_q; ++h) {
    SoftmaxHead total(d);
    for (std::uint32_t c = 0; c < split.chunks; ++c) {
      SoftmaxHead part(d);
      const std::size_t slot = c * batch_q + h;
      part.state = SoftmaxState{ws_max[slot], ws_sum[slot]};
      std::copy(ws_acc.begin() + slot * d, ws_acc.begin() + (slot + 1) * d, part.acc.begin());
      total.merge(part);
    }
    if (!b.extra.empty()) {
      SoftmaxHead extra(d);
      extra.state = b.extra[h].state();
      if (!b.extra[h].acc.empty()) extra.acc = b.extra[h].acc;
      total.merge(extra);
    }
    const std::vector<float> o = total.output();
    std::copy(o.begin(), o.end(), out.begin() + h * d);
    lse[h] = softmax_lse(total.state);
  }
  if (weights == nullptr) return;
  weights->assign(std::size_t{max_indices} * page_tokens, std::nanf(""));
  for (std::uint32_t row = 0; row < b.batch * b.kv_heads; ++row) {
    const cuda::DecodeAttentionRow rp = cuda::decode_attention_row(pages, row);
    const std::uint64_t slots = rp.pages() * page_tokens;
    for (std::uint32_t thread = 0; thread < weight_threads && thread < slots; ++thread) {
      cuda::DecodeAttentionCursor cursor(pages, rp, rp.begin);
      for (std::uint64_t idx = thread; idx < slots; idx += weight_threads) {
        const std::int64_t pos = rp.begin + std::int64_t(idx / page_tokens);
        if (pos >= std::int64_t(max_indices)) break;
        const auto slot = std::uint32_t(idx % page_tokens);
        (*weights)[std::size_t(pos) * page_tokens + slot] = cuda::decode_attention_slot_weight(
            ws_scores.data(), lse.data(), b.masks(), row, pos, slot, cursor.tokens_at(pages, pos), page_tokens, group);
      }
    }
  }
}

}  // namespace sparsekv::test
