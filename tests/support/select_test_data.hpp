#pragma once
// Random Select inputs shared by the Select rules tests (test_select_rules.cpp)
// and the select kernels' GPU tests (gpu/test_select_cuda.cpp): policy layer
// states with planted ties, and their rows as the kernels address them
// (policy/select_cuda.hpp: first / count into per-candidate arrays), laid
// end to end or scattered over an arena, built from the same states the host
// policies see;
// RetroInfer's estimation terms as the host policy's attend() gives them;
// StreamingWindow and Dense requests in a token-counts-only summary store.
#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "index_test_data.hpp"
#include "sparsekv/policy/dense.hpp"
#include "sparsekv/policy/summary_store_cuda.hpp"
#include "sparsekv/policy/quest.hpp"
#include "sparsekv/policy/retroinfer.hpp"
#include "sparsekv/policy/shadowkv.hpp"
#include "sparsekv/policy/streaming_window.hpp"

namespace sparsekv::test {

// One request of a batch: its query and layer state.
template <class State>
struct SelectRequest {
  std::vector<float> q;  // [q_heads][head_dim]
  State state;
};

// Partition sizes: `full` tokens, some shorter ones (a partial last prefill
// page, decode pages) planted at random.
inline std::vector<std::uint32_t> random_sizes(std::uint32_t n, std::uint32_t full, std::mt19937& rng) {
  std::vector<std::uint32_t> sizes(n, full);
  std::uniform_int_distribution<std::uint32_t> size(1, full);
  for (auto& s : sizes) {
    if (rng() % 4 == 0) s = size(rng);
  }
  return sizes;
}

// Copies `dim` floats of summary a onto b for a few random pairs: equal scores, tied ranks.
inline void plant_ties(std::vector<float>& rows, std::uint32_t n, std::uint32_t dim, std::mt19937& rng) {
  if (n < 2) return;
  for (std::uint32_t t = 0; t < n / 8 + 1; ++t) {
    const std::uint32_t a = rng() % n, b = rng() % n;
    std::copy_n(rows.begin() + std::size_t{a} * dim, dim, rows.begin() + std::size_t{b} * dim);
  }
}

// Ascending partition ids with random gaps (ids need not be dense).
inline std::vector<PartitionId> ascending_ids(std::uint32_t n, std::mt19937& rng) {
  std::vector<PartitionId> ids(n);
  PartitionId next = rng() % 3;
  for (auto& id : ids) {
    id = next;
    next += 1 + (rng() % 5 == 0 ? 1 : 0);
  }
  return ids;
}

inline SelectRequest<QuestPolicy::LayerState> quest_request(const LayerContext& ctx, std::uint32_t n,
                                                            std::uint32_t partition_tokens, std::mt19937& rng) {
  SelectRequest<QuestPolicy::LayerState> r;
  r.q = random_values(std::size_t{ctx.q_heads} * ctx.head_dim, rng);
  auto& s = r.state;
  s.head_dim = ctx.head_dim;
  s.tokens = random_sizes(n, partition_tokens, rng);
  for (std::uint32_t h = 0; h < ctx.kv_heads; ++h) {
    s.ids.push_back(ascending_ids(n, rng));
    std::vector<float> lo = random_values(std::size_t{n} * ctx.head_dim, rng);
    std::vector<float> hi = lo;
    for (float& x : hi) x += std::abs(random_values(1, rng)[0]);
    // Tie the min / max pairs together: copy both from the same source rows.
    for (std::uint32_t t = 0; t < n / 8 + 1 && n > 1; ++t) {
      const std::uint32_t a = rng() % n, b = rng() % n;
      std::copy_n(lo.begin() + std::size_t{a} * ctx.head_dim, ctx.head_dim, lo.begin() + std::size_t{b} * ctx.head_dim);
      std::copy_n(hi.begin() + std::size_t{a} * ctx.head_dim, ctx.head_dim, hi.begin() + std::size_t{b} * ctx.head_dim);
    }
    s.min.emplace_back(DType::f32, ctx.head_dim, lo, BoxSide::lower);
    s.max.emplace_back(DType::f32, ctx.head_dim, hi, BoxSide::upper);
  }
  return r;
}

inline SelectRequest<ShadowKVPolicy::LayerState> shadowkv_request(const LayerContext& ctx, std::uint32_t n,
                                                                  std::mt19937& rng) {
  SelectRequest<ShadowKVPolicy::LayerState> r;
  r.q = random_values(std::size_t{ctx.q_heads} * ctx.head_dim, rng);
  auto& s = r.state;
  s.head_dim = ctx.head_dim;
  s.tokens.assign(n, ctx.page_tokens);
  if (rng() % 2 == 0 && n > 0) s.tokens[rng() % n] = 1 + rng() % ctx.page_tokens;  // a partial page
  std::uniform_real_distribution<float> cosine(-1.0f, 1.0f);
  for (std::uint32_t h = 0; h < ctx.kv_heads; ++h) {
    s.ids.push_back(ascending_ids(n, rng));
    std::vector<float> landmarks = random_values(std::size_t{n} * ctx.head_dim, rng, 0.5f);
    plant_ties(landmarks, n, ctx.head_dim, rng);
    s.landmarks.push_back(std::move(landmarks));
    std::vector<float> outliers(n);
    for (float& x : outliers) x = cosine(rng);
    plant_ties(outliers, n, 1, rng);
    s.outlier_score.push_back(std::move(outliers));
  }
  return r;
}

// A wave index per kv head: an optional sink (id 0), `clusters` clusters of
// 1..40 tokens, `recent` one-page recent partitions; ids 0.. in that order;
// random value sums.
inline SelectRequest<RetroInferPolicy::LayerState> retroinfer_request(const LayerContext& ctx, std::uint32_t clusters,
                                                                      std::uint32_t recent, std::uint32_t window,
                                                                      std::mt19937& rng) {
  SelectRequest<RetroInferPolicy::LayerState> r;
  r.q = random_values(std::size_t{ctx.q_heads} * ctx.head_dim, rng);
  auto& s = r.state;
  s.head_dim = ctx.head_dim;
  s.window = window;
  std::uniform_int_distribution<std::uint32_t> size(1, 40);
  for (std::uint32_t h = 0; h < ctx.kv_heads; ++h) {
    RetroInferPolicy::HeadState head;
    PartitionId id = 0;
    const bool sink = rng() % 4 != 0;
    if (sink) head.sink = {id++, 4};
    for (std::uint32_t c = 0; c < clusters; ++c) head.clusters.push_back({id++, size(rng)});
    head.centroids = random_values(std::size_t{clusters} * ctx.head_dim, rng, 0.5f);
    plant_ties(head.centroids, clusters, ctx.head_dim, rng);
    for (std::uint32_t i = 0; i < recent; ++i)
      head.recent.push_back({id++, static_cast<std::uint32_t>(1 + rng() % ctx.page_tokens)});
    head.recent_centroids = random_values(std::size_t{recent} * ctx.head_dim, rng, 0.5f);
    head.value_sums = random_values(std::size_t{clusters} * ctx.head_dim, rng, 8.0f);
    head.recent_value_sums = random_values(std::size_t{recent} * ctx.head_dim, rng, 8.0f);
    head.partitions = id;
    head.tokens = head.sink.tokens;
    for (const auto& g : head.clusters) head.tokens += g.tokens;
    for (const auto& g : head.recent) head.tokens += g.tokens;
    s.heads.push_back(std::move(head));
  }
  return r;
}

// The rows of a batch as the kernels read them (policy/select_cuda.hpp):
// row r = [first[r], first[r] + count[r]) of the per-candidate arrays, per
// candidate its tokens, id and summaries (`a`: Quest min, ShadowKV landmark,
// RetroInfer centroid; `b`: Quest max, ShadowKV outlier score, RetroInfer
// value sum). The builders below lay the rows end to end in row order, from
// the same states the host policies see; in_arena scatters them.
struct HostRows {
  std::uint32_t kv_heads = 0, group = 0, head_dim = 0, max_row = 0;
  std::uint32_t b_width = 0;  // floats of `b` per candidate
  std::vector<std::uint32_t> first, count, tokens;
  std::vector<PartitionId> partitions;
  std::vector<float> q, a, b;
  std::vector<PartitionId> sink_partitions;  // RetroInfer, per row
  std::vector<std::uint32_t> sink_tokens, recent;
  std::vector<std::uint32_t> windows;  // RetroInfer, per row: its request's LayerState::window

  std::uint32_t rows() const { return static_cast<std::uint32_t>(first.size()); }
  std::uint32_t candidates() const { return static_cast<std::uint32_t>(tokens.size()); }
  // The candidates appended since the previous row closed become a row.
  void close_row() {
    const std::uint32_t start = first.empty() ? 0 : first.back() + count.back();
    first.push_back(start);
    count.push_back(candidates() - start);
    max_row = std::max(max_row, count.back());
  }
  void append(std::vector<float>& to, const std::vector<float>& from, std::size_t from_first, std::size_t n) {
    to.insert(to.end(), from.begin() + from_first, from.begin() + from_first + n);
  }
};

// The same rows as the decode step's summary store keeps them
// (policy/summary_store_cuda.hpp): each row in a region of max_row + slack
// candidates, the regions in a random order unrelated to the row order,
// `spare` whole regions between them that belong to no row, and garbage
// (random tokens, ids far from the real ones, large summaries) in every
// candidate no row holds; max_row becomes the region capacity, above the
// real counts, as a captured graph passes it.
inline HostRows in_arena(const HostRows& rows, std::uint32_t slack, std::uint32_t spare, std::mt19937& rng) {
  const std::uint32_t capacity = rows.max_row + slack;
  const std::uint32_t regions = rows.rows() + spare;
  const std::size_t a_width = rows.head_dim;
  const std::size_t b_width = rows.b_width;
  const std::size_t extent = std::size_t{regions} * capacity;
  HostRows out = rows;
  out.max_row = capacity;
  out.tokens.resize(extent);
  out.partitions.resize(extent);
  // Garbage in [-64, 64) from a splitmix64 stream: arenas are large, and
  // normal draws would dominate the sweeps' time.
  const auto garbage = [&rng](std::size_t n) {
    std::vector<float> v(n);
    std::uint64_t state = rng();
    for (float& x : v) {
      std::uint64_t z = (state += 0x9e3779b97f4a7c15ULL);
      z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
      z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
      x = static_cast<float>(static_cast<std::int32_t>(z >> 32)) * 0x1p-25f;
    }
    return v;
  };
  out.a = garbage(extent * a_width);
  out.b = garbage(extent * b_width);
  for (std::size_t c = 0; c < extent; ++c) {
    out.tokens[c] = 1 + static_cast<std::uint32_t>(rng() % 1000);
    out.partitions[c] = 1000000u + static_cast<PartitionId>(rng() % 1000);
  }
  std::vector<std::uint32_t> order(regions);
  std::iota(order.begin(), order.end(), 0u);
  std::shuffle(order.begin(), order.end(), rng);
  for (std::uint32_t r = 0; r < rows.rows(); ++r) {
    const std::size_t from = rows.first[r], n = rows.count[r], to = std::size_t{order[r]} * capacity;
    out.first[r] = static_cast<std::uint32_t>(to);
    std::copy_n(rows.tokens.begin() + from, n, out.tokens.begin() + to);
    std::copy_n(rows.partitions.begin() + from, n, out.partitions.begin() + to);
    std::copy_n(rows.a.begin() + from * a_width, n * a_width, out.a.begin() + to * a_width);
    std::copy_n(rows.b.begin() + from * b_width, n * b_width, out.b.begin() + to * b_width);
  }
  return out;
}

inline HostRows begin_rows(const LayerContext& ctx) {
  HostRows rows;
  rows.kv_heads = ctx.kv_heads;
  rows.group = ctx.group_size();
  rows.head_dim = ctx.head_dim;
  return rows;
}

inline HostRows quest_rows(const LayerContext& ctx, const std::vector<SelectRequest<QuestPolicy::LayerState>>& batch) {
  HostRows rows = begin_rows(ctx);
  rows.b_width = ctx.head_dim;
  for (const auto& req : batch) {
    rows.q.insert(rows.q.end(), req.q.begin(), req.q.end());
    const auto n = static_cast<std::uint32_t>(req.state.tokens.size());
    for (std::uint32_t h = 0; h < ctx.kv_heads; ++h) {
      rows.tokens.insert(rows.tokens.end(), req.state.tokens.begin(), req.state.tokens.end());
      rows.partitions.insert(rows.partitions.end(), req.state.ids[h].begin(), req.state.ids[h].end());
      rows.append(rows.a, req.state.min[h].widened(), 0, std::size_t{n} * ctx.head_dim);
      rows.append(rows.b, req.state.max[h].widened(), 0, std::size_t{n} * ctx.head_dim);
      rows.close_row();
    }
  }
  return rows;
}

inline HostRows shadowkv_rows(const LayerContext& ctx,
                              const std::vector<SelectRequest<ShadowKVPolicy::LayerState>>& batch) {
  HostRows rows = begin_rows(ctx);
  rows.b_width = 1;
  for (const auto& req : batch) {
    rows.q.insert(rows.q.end(), req.q.begin(), req.q.end());
    const auto n = static_cast<std::uint32_t>(req.state.tokens.size());
    for (std::uint32_t h = 0; h < ctx.kv_heads; ++h) {
      rows.tokens.insert(rows.tokens.end(), req.state.tokens.begin(), req.state.tokens.end());
      rows.partitions.insert(rows.partitions.end(), req.state.ids[h].begin(), req.state.ids[h].end());
      rows.append(rows.a, req.state.landmarks[h], 0, std::size_t{n} * ctx.head_dim);
      rows.append(rows.b, req.state.outlier_score[h], 0, n);
      rows.close_row();
    }
  }
  return rows;
}

inline HostRows retroinfer_rows(const LayerContext& ctx,
                                const std::vector<SelectRequest<RetroInferPolicy::LayerState>>& batch) {
  HostRows rows = begin_rows(ctx);
  rows.b_width = ctx.head_dim;
  for (const auto& req : batch) {
    rows.q.insert(rows.q.end(), req.q.begin(), req.q.end());
    for (const auto& head : req.state.heads) {
      for (const auto& g : head.clusters) {
        rows.tokens.push_back(g.tokens);
        rows.partitions.push_back(g.id);
      }
      for (const auto& g : head.recent) {
        rows.tokens.push_back(g.tokens);
        rows.partitions.push_back(g.id);
      }
      rows.a.insert(rows.a.end(), head.centroids.begin(), head.centroids.end());
      rows.a.insert(rows.a.end(), head.recent_centroids.begin(), head.recent_centroids.end());
      rows.b.insert(rows.b.end(), head.value_sums.begin(), head.value_sums.end());
      rows.b.insert(rows.b.end(), head.recent_value_sums.begin(), head.recent_value_sums.end());
      rows.sink_partitions.push_back(head.sink.id);
      rows.sink_tokens.push_back(head.sink.tokens);
      rows.recent.push_back(static_cast<std::uint32_t>(head.recent.size()));
      rows.windows.push_back(req.state.window);
      rows.close_row();
    }
  }
  return rows;
}

// The host policy's selections of a batch, row by row.
template <class Policy, class State>
std::vector<std::vector<PartitionId>> host_select(const Policy& policy, const LayerContext& ctx,
                                                  const std::vector<SelectRequest<State>>& batch) {
  std::vector<std::vector<PartitionId>> out;
  for (const auto& req : batch) {
    Selection s;
    policy.select(ctx, DecodeQuery{req.q, 0}, req.state, s);
    out.insert(out.end(), s.partitions.begin(), s.partitions.end());
  }
  return out;
}

// RetroInferPolicy::attend's terms of a batch on its own selections, one per
// q head of each request: [request][q head] = row * group + j.
inline std::vector<AttentionPartial> host_estimate(
    const RetroInferPolicy& policy, const LayerContext& ctx,
    const std::vector<SelectRequest<RetroInferPolicy::LayerState>>& batch) {
  std::vector<AttentionPartial> out;
  for (const auto& req : batch) {
    Selection s;
    policy.select(ctx, DecodeQuery{req.q, 0}, req.state, s);
    std::vector<AttentionPartial> extra(ctx.q_heads);
    policy.attend(ctx, DecodeQuery{req.q, 0}, req.state, s, extra);
    out.insert(out.end(), extra.begin(), extra.end());
  }
  return out;
}

// ---- StreamingWindow and Dense over the summary store ----------------------------

// A request of a positional policy (StreamingWindow, Dense) as the decode
// step's store keeps it: its slot, a prompt of `prompt` tokens (the last
// page may be short) indexed by the host policy, then `appended` full decode
// pages appended to it. The policies read no key, so the keys are zeros.
template <class Policy>
struct PositionalRequest {
  std::uint32_t slot = 0, prompt = 0, appended = 0;
  typename Policy::LayerState state;
};

template <class Policy>
PositionalRequest<Policy> positional_request(const Policy& policy, const LayerContext& base, std::uint32_t slot,
                                             std::uint32_t prompt, std::uint32_t appended) {
  PositionalRequest<Policy> r;
  r.slot = slot;
  r.prompt = prompt;
  r.appended = appended;
  LayerContext ctx = base;
  ctx.tokens = prompt;
  const std::vector<float> keys(std::size_t{prompt} * ctx.kv_heads * ctx.head_dim, 0.0f);
  policy.index(ctx, key_view(keys, prompt, ctx), r.state);
  const std::vector<float> page(std::size_t{ctx.page_tokens} * ctx.kv_heads * ctx.head_dim, 0.0f);
  const std::uint32_t prompt_pages = cuda::page_count(prompt, ctx.page_tokens);
  for (std::uint32_t p = 0; p < appended; ++p) {
    ctx.tokens += ctx.page_tokens;
    const AppendedPage a{key_view(page, ctx.page_tokens, ctx),
                         std::vector<PartitionId>(ctx.kv_heads, prompt_pages + p)};
    policy.append(ctx, a, r.state);
  }
  return r;
}

// One layer of a summary store (policy/summary_store_cuda.hpp) on the host as
// construction leaves it, before any request: random token counts in every
// candidate and the identity ids, max_row = the region capacity.
inline HostRows store_layer(const cuda::SummaryShape& shape, const LayerContext& ctx, std::mt19937& rng) {
  HostRows rows = begin_rows(ctx);
  const std::size_t extent = shape.candidates();
  rows.max_row = shape.capacity;
  rows.tokens.resize(extent);
  rows.partitions.resize(extent);
  for (std::size_t c = 0; c < extent; ++c) {
    rows.tokens[c] = 1 + static_cast<std::uint32_t>(rng() % 1000);
    rows.partitions[c] = static_cast<PartitionId>(c % shape.capacity);
  }
  return rows;
}

// One layer of a tokens-kind store (policy/summary_store_cuda.hpp) on the host:
// random token counts everywhere and the identity ids of construction, then
// what the device writes into each request's region(slot, h): its prompt
// pages' prefill_page_tokens (write_prefill) and page_tokens for every
// appended page (the append kernel). Rows (b, h) in batch order, first = the
// region, count = the request's pages, max_row = the capacity: the batch's
// rows scattered over the arena with garbage between, as the runtime passes them.
template <class Policy>
HostRows positional_rows(const cuda::SummaryShape& shape, const LayerContext& ctx,
                         const std::vector<PositionalRequest<Policy>>& batch, std::mt19937& rng) {
  HostRows rows = store_layer(shape, ctx, rng);
  for (const auto& r : batch) {
    const std::vector<float> q = random_values(std::size_t{ctx.q_heads} * ctx.head_dim, rng);
    rows.q.insert(rows.q.end(), q.begin(), q.end());
    const std::uint32_t prompt_pages = cuda::page_count(r.prompt, ctx.page_tokens);
    const std::uint32_t n = prompt_pages + r.appended;
    for (std::uint32_t h = 0; h < ctx.kv_heads; ++h) {
      const std::uint32_t first = shape.region(r.slot, h);
      for (std::uint32_t p = 0; p < n; ++p) {
        rows.tokens[first + p] =
            p < prompt_pages ? cuda::prefill_page_tokens(p, r.prompt, ctx.page_tokens) : ctx.page_tokens;
      }
      rows.first.push_back(first);
      rows.count.push_back(n);
    }
  }
  return rows;
}

// The host policy's selections of a positional batch, row by row.
template <class Policy>
std::vector<std::vector<PartitionId>> host_select(const Policy& policy, const LayerContext& ctx,
                                                  const std::vector<PositionalRequest<Policy>>& batch) {
  std::vector<std::vector<PartitionId>> out;
  for (const auto& req : batch) {
    Selection s;
    policy.select(ctx, DecodeQuery{}, req.state, s);
    out.insert(out.end(), s.partitions.begin(), s.partitions.end());
  }
  return out;
}

}  // namespace sparsekv::test
