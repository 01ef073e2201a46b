#include "sparsekv/policy/retroinfer.hpp"
#include "sparsekv/policy/select_scoring.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <utility>

#include "sparsekv/core/error.hpp"
#include "sparsekv/metadata/page_table_entries.hpp"
#include "sparsekv/policy/summary_rules.hpp"
#include "sparsekv/policy/select_rules.hpp"

namespace sparsekv {
namespace {

using Group = RetroInferPolicy::Group;
using HeadState = RetroInferPolicy::HeadState;
using LayerState = RetroInferPolicy::LayerState;

// ---- deterministic randomness (portable: no std distributions) -----------
std::uint64_t splitmix64(std::uint64_t& state) {
  std::uint64_t z = (state += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}
std::uint64_t mix(std::uint64_t a, std::uint64_t b) {
  std::uint64_t s = a ^ (b * 0xd1b54a32d192ed03ULL);
  return splitmix64(s);
}
double uniform01(std::uint64_t& state) { return static_cast<double>(splitmix64(state) >> 11) * 0x1.0p-53; }

// Four-float SIMD lanes through the GCC / Clang vector extension (SSE, NEON,
// ...); plain loops elsewhere. The auto-vectoriser alone is fragile here: the
// tiles below ran 3x slower when head_dim was only known at run time.
#if defined(__GNUC__) || defined(__clang__)
#define SPARSEKV_RETRO_SIMD 1
typedef float Lanes __attribute__((vector_size(16)));
inline Lanes load_lanes(const float* p) {
  Lanes v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline float lanes_total(Lanes v) { return (v[0] + v[2]) + (v[1] + v[3]); }
#endif

float dot(const float* a, const float* b, std::uint32_t d) {
  std::uint32_t i = 0;
  float sum = 0.0f;
#ifdef SPARSEKV_RETRO_SIMD
  Lanes l0 = {}, l1 = {};
  for (; i + 8 <= d; i += 8) {
    l0 += load_lanes(a + i) * load_lanes(b + i);
    l1 += load_lanes(a + i + 4) * load_lanes(b + i + 4);
  }
  sum = lanes_total(l0 + l1);
#endif
  for (; i < d; ++i) sum += a[i] * b[i];
  return sum;
}

// Assigns each of the n rows of x ([n rounded up to 4][d], unit or zero rows)
// to the centroid with the largest inner product; ct is the centroids
// transposed, [d][kpad], kpad a multiple of 8 with zero padding. A register
// tile of 4 rows x 8 centroids; each lane accumulates its dot product in
// dimension order, one rounding per multiply and per add, so it equals
// dot_in_order, and the choice is consider_centroid's (summary_rules.hpp):
// the same bits as cuda::kmeans_assign. Returns how many labels changed.
std::uint32_t assign(const float* x, std::uint32_t n, std::uint32_t d, const float* ct, std::uint32_t k,
                     std::uint32_t kpad, std::uint32_t* labels) {
  constexpr std::uint32_t kRows = 4, kCols = 8;
  std::uint32_t changed = 0;
  for (std::uint32_t t0 = 0; t0 < n; t0 += kRows) {
    CentroidChoice best[kRows];
    for (std::uint32_t j0 = 0; j0 < kpad; j0 += kCols) {
      float out[kRows][kCols];
#ifdef SPARSEKV_RETRO_SIMD
      Lanes acc[kRows][2] = {};
      for (std::uint32_t i = 0; i < d; ++i) {
        const float* c = ct + std::size_t{i} * kpad + j0;
        const Lanes c0 = load_lanes(c);
        const Lanes c1 = load_lanes(c + 4);
        for (std::uint32_t b = 0; b < kRows; ++b) {
          const float s = x[std::size_t{t0 + b} * d + i];
          const Lanes v = {s, s, s, s};
          acc[b][0] += v * c0;
          acc[b][1] += v * c1;
        }
      }
      std::memcpy(out, acc, sizeof out);
#else
      for (auto& row : out) std::fill(row, row + kCols, 0.0f);
      for (std::uint32_t i = 0; i < d; ++i) {
        const float* c = ct + std::size_t{i} * kpad + j0;
        for (std::uint32_t b = 0; b < kRows; ++b) {
          const float v = x[std::size_t{t0 + b} * d + i];
          for (std::uint32_t j = 0; j < kCols; ++j) out[b][j] += v * c[j];
        }
      }
#endif
      const std::uint32_t valid = std::min(kCols, k - j0);
      for (std::uint32_t b = 0; b < kRows; ++b) {
        for (std::uint32_t j = 0; j < valid; ++j) consider_centroid(best[b], out[b][j], j0 + j);
      }
    }
    for (std::uint32_t b = 0; b < kRows && t0 + b < n; ++b) {
      const std::uint32_t label = chosen_label(best[b]);
      if (labels[t0 + b] != label) {
        labels[t0 + b] = label;
        ++changed;
      }
    }
  }
  return changed;
}

// Transposes k centroids [k][d] into ct [d][kpad] (zero padding past k).
void transpose_centroids(const float* centroids, std::uint32_t k, std::uint32_t d, std::uint32_t kpad, float* ct) {
  for (std::uint32_t c = 0; c < k; ++c) {
    for (std::uint32_t i = 0; i < d; ++i) ct[std::size_t{i} * kpad + c] = centroids[std::size_t{c} * d + i];
  }
}

// The update step (summary_rules.hpp rules, as cuda::kmeans_update): sums in
// row order, renormalise; empty or zero-sum clusters keep their centroid.
// `sums` and `counts` are scratch of k * d and k elements.
void update_centroids(const float* x, std::uint32_t n, std::uint32_t d, const std::uint32_t* labels, std::uint32_t k,
                      float* centroids, float* sums, std::uint32_t* counts) {
  std::fill(sums, sums + std::size_t{k} * d, 0.0f);
  std::fill(counts, counts + k, 0u);
  for (std::uint32_t t = 0; t < n; ++t) {
    float* s = sums + std::size_t{labels[t]} * d;
    const float* row = x + std::size_t{t} * d;
    for (std::uint32_t i = 0; i < d; ++i) s[i] = add_rn(s[i], row[i]);
    ++counts[labels[t]];
  }
  for (std::uint32_t c = 0; c < k; ++c) {
    const float* s = sums + std::size_t{c} * d;
    double norm = 0.0;
    for (std::uint32_t i = 0; i < d; ++i) norm = norm_sq_step(norm, s[i]);
    float inv = 0.0f;
    if (!centroid_inverse_norm(norm, counts[c], inv)) continue;
    for (std::uint32_t i = 0; i < d; ++i) centroids[std::size_t{c} * d + i] = mul_rn(s[i], inv);
  }
}

// Balanced segments over `len` tokens: ceil(len / segment_tokens) of them, but
// none shorter than one cluster (unless the whole run is).
std::vector<std::pair<std::uint32_t, std::uint32_t>> segments(std::uint32_t len, std::uint32_t segment_tokens,
                                                              std::uint32_t tokens_per_cluster) {
  std::vector<std::pair<std::uint32_t, std::uint32_t>> out;  // (begin, length)
  if (len == 0) return out;
  std::uint32_t s = (len + segment_tokens - 1) / segment_tokens;
  s = std::max(1u, std::min(s, len / tokens_per_cluster));
  for (std::uint32_t i = 0; i < s; ++i) {
    const auto b = static_cast<std::uint32_t>(std::uint64_t{len} * i / s);
    const auto e = static_cast<std::uint32_t>(std::uint64_t{len} * (i + 1) / s);
    out.emplace_back(b, e - b);
  }
  return out;
}

// Appends a summary (mean key, value sum) of `count` rows to the meta arrays.
template <class KeyAt, class ValueAt>
void add_summary(std::vector<float>& centroids, std::vector<float>& value_sums, std::uint32_t d, std::uint32_t count,
                 KeyAt key_at, ValueAt value_at) {
  const std::size_t base = centroids.size();
  centroids.resize(base + d, 0.0f);
  value_sums.resize(base + d, 0.0f);
  float* c = centroids.data() + base;
  float* vs = value_sums.data() + base;
  for (std::uint32_t i = 0; i < count; ++i) {
    const float* k = key_at(i);
    const float* v = value_at(i);
    for (std::uint32_t j = 0; j < d; ++j) {
      c[j] += k[j];
      vs[j] += v[j];
    }
  }
  const float inv = 1.0f / static_cast<float>(count);
  for (std::uint32_t j = 0; j < d; ++j) c[j] *= inv;
}

// What clustering adds to a head: clusters, their summaries, and the spec's
// partitions (token lists in CSR form).
struct Clustered {
  std::vector<Group> clusters;
  std::vector<float> centroids, value_sums;
  std::vector<std::uint32_t> offsets{0}, ids;

  void add_partition(std::span<const std::uint32_t> tokens) {
    ids.insert(ids.end(), tokens.begin(), tokens.end());
    offsets.push_back(static_cast<std::uint32_t>(ids.size()));
  }
};

// Clusters tokens [begin, begin + len) of one head (spherical k-means on
// their keys, one cluster per `tokens_per_cluster`), numbering the clusters
// from `id`. key_at(t) / value_at(t) give token t's rows; tokens are listed
// in order inside each cluster.
template <class KeyAt, class ValueAt>
void cluster_segment(const RetroInferPolicy::Options& options, std::uint32_t begin, std::uint32_t len, std::uint32_t d,
                     std::uint64_t seed, KeyAt key_at, ValueAt value_at, PartitionId& id, Clustered& out) {
  std::vector<float> keys(std::size_t{len} * d);
  for (std::uint32_t t = 0; t < len; ++t) std::copy_n(key_at(begin + t), d, keys.data() + std::size_t{t} * d);
  const std::uint32_t k = std::max(1u, len / options.tokens_per_cluster);
  const auto labels = spherical_kmeans(keys, len, d, k, options.kmeans_iterations, seed);
  const std::uint32_t c = *std::max_element(labels.begin(), labels.end()) + 1;
  // Members of each cluster in token order (counting sort).
  std::vector<std::uint32_t> offsets(c + 1, 0);
  for (std::uint32_t label : labels) ++offsets[label + 1];
  std::partial_sum(offsets.begin(), offsets.end(), offsets.begin());
  std::vector<std::uint32_t> members(len);
  std::vector<std::uint32_t> fill(offsets.begin(), offsets.end() - 1);
  for (std::uint32_t t = 0; t < len; ++t) members[fill[labels[t]]++] = begin + t;
  for (std::uint32_t j = 0; j < c; ++j) {
    const std::span<const std::uint32_t> m(members.data() + offsets[j], offsets[j + 1] - offsets[j]);
    out.clusters.push_back(Group{id++, static_cast<std::uint32_t>(m.size())});
    add_summary(
        out.centroids, out.value_sums, d, static_cast<std::uint32_t>(m.size()),
        [&](std::uint32_t i) { return key_at(m[i]); }, [&](std::uint32_t i) { return value_at(m[i]); });
    out.add_partition(m);
  }
}

void check_kv(const LayerContext& ctx, const KvView& kv) {
  check_kv_view("retroinfer", ctx, kv, true);  // value sums need the values
  if (kv.tokens == 0) fail(ErrorCode::invalid_argument, "retroinfer: no tokens to index");
}

void check_state(const LayerContext& ctx, const LayerState& state) {
  check_layer_context("retroinfer", ctx);
  if (state.heads.empty()) {
    fail(ErrorCode::failed_precondition, "retroinfer: the layer has no index yet (index() first)");
  }
  if (state.heads.size() != ctx.kv_heads || state.head_dim != ctx.head_dim) {
    fail(ErrorCode::invalid_argument, "retroinfer: index built for {} kv heads x {} dims, context has {} x {}",
         state.heads.size(), state.head_dim, ctx.kv_heads, ctx.head_dim);
  }
}

// The steady zone of one head (select_rules.hpp; docs/policies/retroinfer.md).
SteadyZone head_steady_zone(const HeadState& head, std::uint32_t window, std::uint32_t budget) {
  return steady_zone(
      static_cast<std::uint32_t>(head.recent.size()), [&](std::uint32_t i) { return head.recent[i].tokens; },
      head.sink.tokens, window, budget);
}

// What a head ranks: its clusters, then its recent partitions outside the
// steady window (recent[0, older)).
struct Candidates {
  const HeadState* head;
  std::uint32_t clusters;
  std::uint32_t older;

  std::uint32_t size() const { return clusters + older; }
  const Group& group(std::uint32_t i) const { return i < clusters ? head->clusters[i] : head->recent[i - clusters]; }
  const float* centroid(std::uint32_t i, std::uint32_t d) const {
    return i < clusters ? head->centroids.data() + std::size_t{i} * d
                        : head->recent_centroids.data() + std::size_t{i - clusters} * d;
  }
  const float* value_sum(std::uint32_t i, std::uint32_t d) const {
    return i < clusters ? head->value_sums.data() + std::size_t{i} * d
                        : head->recent_value_sums.data() + std::size_t{i - clusters} * d;
  }
};

// scores[g * m + i] = q_g . C_i / sqrt(d) for the group's q heads g; rank[i] =
// the group sum of softmax_i(scores[g]) (RetroInfer's GQA ranking), by the
// rules cuda::retroinfer_select shares (select_rules.hpp).
void score(const LayerContext& ctx, const DecodeQuery& q, std::uint32_t kv_head, const Candidates& c,
           std::vector<float>& scores, std::vector<float>& rank) {
  const std::uint32_t m = c.size();
  const std::uint32_t group = ctx.group_size();
  const std::uint32_t d = ctx.head_dim;
  const float scale = logit_scale(d);
  scores.assign(std::size_t{group} * m, 0.0f);
  rank.assign(m, 0.0f);
  for (std::uint32_t g = 0; g < group; ++g) {
    const float* qh = q.head(kv_head * group + g, d);
    float* s = scores.data() + std::size_t{g} * m;
    for (std::uint32_t i = 0; i < m; ++i) s[i] = retroinfer_logit(qh, c.centroid(i, d), d, scale);
    softmax_rank_add_simd(m, s, rank.data());
  }
}

// The candidates [0, m) with eligible(i) in rank order (top_k's order through
// the ranking key).
template <class Filler, class Eligible, class Take>
void rank_fill(const std::vector<float>& rank, const Candidates& c, Filler& fill, Eligible&& eligible, Take&& take) {
  ranked_fill(
      c.size(), fill, [&](std::uint32_t i) { return rank[i]; }, eligible,
      [&](std::uint32_t i) { return c.group(i).tokens; }, take);
}

// Eqs. 2-4: `size` keys that share the centroid's score, their values summing
// to VS: mass size * e^score, accumulator e^score * VS, by the rules
// cuda::retroinfer_estimate shares (select_rules.hpp).
void add_cluster(AttentionPartial& partial, float score, std::uint32_t size, const float* value_sum) {
  SoftmaxState s = partial.state();
  const RescaleStep step = estimation_fold(s, score, static_cast<float>(size));
  partial.max = s.max;
  partial.sum = s.sum;
  for (std::size_t d = 0; d < partial.acc.size(); ++d) {
    partial.acc[d] = estimation_rescale_add(partial.acc[d], step, value_sum[d]);
  }
}

}  // namespace

// ---- spherical k-means ------------------------------------------------------

std::vector<std::uint32_t> spherical_kmeans(std::span<const float> vectors, std::uint32_t n, std::uint32_t dim,
                                            std::uint32_t k, std::uint32_t iterations, std::uint64_t seed) {
  if (n == 0 || dim == 0 || k == 0 || k > n || vectors.size() != std::size_t{n} * dim) {
    fail(ErrorCode::invalid_argument, "spherical_kmeans: {} clusters of {} vectors x {} dims ({} values)", k, n, dim,
         vectors.size());
  }
  // Centre on the mean, normalise (zero rows stay zero); rows padded to a multiple of 4.
  const std::uint32_t rows = (n + 3) / 4 * 4;
  std::vector<float> x(std::size_t{rows} * dim, 0.0f);
  std::vector<double> mean(dim, 0.0);
  for (std::uint32_t t = 0; t < n; ++t) {
    for (std::uint32_t i = 0; i < dim; ++i) mean[i] += vectors[std::size_t{t} * dim + i];
  }
  for (double& v : mean) v /= n;
  for (std::uint32_t t = 0; t < n; ++t) {
    float* row = x.data() + std::size_t{t} * dim;
    double norm = 0.0;
    for (std::uint32_t i = 0; i < dim; ++i) {
      row[i] = static_cast<float>(vectors[std::size_t{t} * dim + i] - mean[i]);
      norm += double{row[i]} * row[i];
    }
    if (norm > 0.0) {
      const auto inv = static_cast<float>(1.0 / std::sqrt(norm));
      for (std::uint32_t i = 0; i < dim; ++i) row[i] *= inv;
    }
  }

  // k-means++ seeding on the cosine distance 1 - x.c (proportional to the
  // squared Euclidean distance between unit vectors).
  std::vector<float> centroids(std::size_t{k} * dim);
  std::vector<float> dist(n, std::numeric_limits<float>::infinity());
  std::vector<bool> chosen(n, false);
  std::uint64_t rng = seed;
  for (std::uint32_t c = 0; c < k; ++c) {
    std::uint32_t pick = 0;
    if (c == 0) {
      pick = std::min(n - 1, static_cast<std::uint32_t>(uniform01(rng) * n));
    } else {
      double total = 0.0;
      for (std::uint32_t t = 0; t < n; ++t) total += dist[t];
      if (total > 0.0) {
        const double r = uniform01(rng) * total;
        double acc = 0.0;
        pick = n;
        std::uint32_t last_positive = 0;
        for (std::uint32_t t = 0; t < n; ++t) {
          if (dist[t] <= 0.0f) continue;
          last_positive = t;
          acc += dist[t];
          if (acc > r) {
            pick = t;
            break;
          }
        }
        if (pick == n) pick = last_positive;
      } else {  // every row coincides with a centroid: duplicates end up empty
        pick = static_cast<std::uint32_t>(std::find(chosen.begin(), chosen.end(), false) - chosen.begin());
        if (pick == n) pick = 0;
      }
    }
    chosen[pick] = true;
    std::copy_n(x.data() + std::size_t{pick} * dim, dim, centroids.data() + std::size_t{c} * dim);
    const float* cen = centroids.data() + std::size_t{c} * dim;
    for (std::uint32_t t = 0; t < n; ++t) {
      dist[t] = std::min(dist[t], std::max(0.0f, 1.0f - dot(x.data() + std::size_t{t} * dim, cen, dim)));
    }
  }

  // Lloyd rounds: assign, then each centroid = its members' normalised sum.
  const std::uint32_t kpad = (k + 7) / 8 * 8;
  std::vector<float> ct(std::size_t{dim} * kpad, 0.0f);
  std::vector<std::uint32_t> labels(n, std::numeric_limits<std::uint32_t>::max());
  std::vector<float> sums(std::size_t{k} * dim);
  std::vector<std::uint32_t> counts(k);
  const std::uint32_t rounds = std::max(1u, iterations);
  for (std::uint32_t round = 0; round < rounds; ++round) {
    transpose_centroids(centroids.data(), k, dim, kpad, ct.data());
    if (assign(x.data(), n, dim, ct.data(), k, kpad, labels.data()) == 0) break;
    if (round + 1 == rounds) break;
    update_centroids(x.data(), n, dim, labels.data(), k, centroids.data(), sums.data(), counts.data());
  }

  // Compact: non-empty clusters numbered by their first row.
  std::vector<std::uint32_t> rename(k, std::numeric_limits<std::uint32_t>::max());
  std::uint32_t next = 0;
  for (std::uint32_t& label : labels) {
    if (rename[label] == std::numeric_limits<std::uint32_t>::max()) rename[label] = next++;
    label = rename[label];
  }
  return labels;
}

std::uint32_t kmeans_assign(std::span<const float> rows, std::uint32_t n, std::uint32_t dim,
                            std::span<const float> centroids, std::uint32_t k, std::span<std::uint32_t> labels) {
  if (n == 0 || dim == 0 || k == 0 || rows.size() != std::size_t{n} * dim || centroids.size() != std::size_t{k} * dim ||
      labels.size() != n) {
    fail(ErrorCode::invalid_argument,
         "kmeans_assign: {} rows x {} dims ({} values), {} centroids ({} values), {} labels", n, dim, rows.size(), k,
         centroids.size(), labels.size());
  }
  // The tile reads rows in fours and centroids in eights: padded copies.
  std::vector<float> x(std::size_t{(n + 3) / 4 * 4} * dim, 0.0f);
  std::copy(rows.begin(), rows.end(), x.begin());
  const std::uint32_t kpad = (k + 7) / 8 * 8;
  std::vector<float> ct(std::size_t{dim} * kpad, 0.0f);
  transpose_centroids(centroids.data(), k, dim, kpad, ct.data());
  return assign(x.data(), n, dim, ct.data(), k, kpad, labels.data());
}

void kmeans_update(std::span<const float> rows, std::uint32_t n, std::uint32_t dim,
                   std::span<const std::uint32_t> labels, std::uint32_t k, std::span<float> centroids) {
  if (n == 0 || dim == 0 || k == 0 || rows.size() != std::size_t{n} * dim || centroids.size() != std::size_t{k} * dim ||
      labels.size() != n) {
    fail(ErrorCode::invalid_argument,
         "kmeans_update: {} rows x {} dims ({} values), {} centroids ({} values), {} labels", n, dim, rows.size(), k,
         centroids.size(), labels.size());
  }
  const auto bad = std::find_if(labels.begin(), labels.end(), [k](std::uint32_t label) { return label >= k; });
  if (bad != labels.end()) {
    fail(ErrorCode::invalid_argument, "kmeans_update: row {} has label {}, not below {} centroids",
         bad - labels.begin(), *bad, k);
  }
  std::vector<float> sums(std::size_t{k} * dim);
  std::vector<std::uint32_t> counts(k);
  update_centroids(rows.data(), n, dim, labels.data(), k, centroids.data(), sums.data(), counts.data());
}

// ---- the policy -------------------------------------------------------------

RetroInferPolicy::RetroInferPolicy(const Options& options) : options_(options) {
  const Options& o = options;
  if (o.segment_tokens == 0 || o.tokens_per_cluster == 0 || o.kmeans_iterations == 0 || o.update_tokens == 0) {
    fail(ErrorCode::invalid_argument,
         "retroinfer: segment_tokens ({}), tokens_per_cluster ({}), kmeans_iterations ({}) and update_tokens ({}) "
         "must be > 0",
         o.segment_tokens, o.tokens_per_cluster, o.kmeans_iterations, o.update_tokens);
  }
  if (o.tokens_per_cluster > o.segment_tokens) {
    fail(ErrorCode::invalid_argument, "retroinfer: a cluster of {} tokens does not fit a segment of {}",
         o.tokens_per_cluster, o.segment_tokens);
  }
  const bool fractions_ok = o.retrieval_fraction >= 0.0f && o.estimation_fraction >= 0.0f &&
                            double{o.retrieval_fraction} + o.estimation_fraction <= 1.0 + 1e-6;
  if (!fractions_ok) {
    fail(ErrorCode::invalid_argument,
         "retroinfer: retrieval_fraction {} and estimation_fraction {} must be >= 0 and sum to at most 1",
         o.retrieval_fraction, o.estimation_fraction);
  }
}

std::vector<PartitionSpec> RetroInferPolicy::index(const LayerContext& ctx, const KvView& kv, LayerState& state) const {
  check_kv(ctx, kv);
  const std::uint32_t n = kv.tokens;
  const std::uint32_t d = ctx.head_dim;
  const std::uint32_t page = ctx.page_tokens;
  const std::uint32_t sinks = std::min(options_.sink_tokens, n);
  const std::uint32_t rest = n - sinks;
  // Fewer than window + one cluster tokens after the sinks: all steady.
  const std::uint32_t middle =
      std::uint64_t{rest} >= std::uint64_t{options_.window_tokens} + options_.tokens_per_cluster
          ? rest - options_.window_tokens
          : 0;
  const std::uint32_t tail = rest - middle;
  const auto segs = segments(middle, options_.segment_tokens, options_.tokens_per_cluster);

  LayerState next;  // built aside: a failure leaves `state` as it was
  next.head_dim = d;
  next.window = std::max(options_.window_tokens, tail);
  next.heads.resize(ctx.kv_heads);
  std::vector<PartitionSpec> specs;
  specs.reserve(ctx.kv_heads);
  for (std::uint32_t h = 0; h < ctx.kv_heads; ++h) {
    HeadState& head = next.heads[h];
    Clustered parts;  // the spec, in id order: sink, clusters, window pages
    parts.ids.reserve(n);
    PartitionId id = 0;
    if (sinks > 0) {
      head.sink = Group{id++, sinks};
      std::vector<std::uint32_t> sink_tokens(sinks);
      std::iota(sink_tokens.begin(), sink_tokens.end(), 0u);
      parts.add_partition(sink_tokens);
    }
    for (const auto& [seg_begin, len] : segs) {
      const std::uint32_t begin = sinks + seg_begin;
      const std::uint64_t seed = mix(mix(mix(options_.seed, ctx.layer), h), std::uint64_t{kv.first_position} + begin);
      cluster_segment(
          options_, begin, len, d, seed, [&](std::uint32_t t) { return kv.key(t, h); },
          [&](std::uint32_t t) { return kv.value(t, h); }, id, parts);
    }
    head.clusters = std::move(parts.clusters);
    head.centroids = std::move(parts.centroids);
    head.value_sums = std::move(parts.value_sums);
    std::vector<std::uint32_t> page_tokens;
    for (std::uint32_t t = sinks + middle; t < n; t += page) {
      const std::uint32_t size = std::min(page, n - t);
      head.recent.push_back(Group{id++, size});
      add_summary(
          head.recent_centroids, head.recent_value_sums, d, size, [&](std::uint32_t i) { return kv.key(t + i, h); },
          [&](std::uint32_t i) { return kv.value(t + i, h); });
      page_tokens.clear();
      for (std::uint32_t i = 0; i < size; ++i) {
        head.recent_keys.insert(head.recent_keys.end(), kv.key(t + i, h), kv.key(t + i, h) + d);
        head.recent_values.insert(head.recent_values.end(), kv.value(t + i, h), kv.value(t + i, h) + d);
        page_tokens.push_back(t + i);
      }
      parts.add_partition(page_tokens);
    }
    head.partitions = id;
    head.tokens = n;
    specs.push_back(PartitionSpec::variable(n, std::move(parts.offsets), std::move(parts.ids)));
  }
  state = std::move(next);
  return specs;
}

std::optional<Repartition> RetroInferPolicy::append(const LayerContext& ctx, const AppendedPage& page,
                                                    LayerState& state) const {
  check_state(ctx, state);
  check_appended_page("retroinfer", ctx, page, true);  // value sums need the values
  const std::uint32_t d = ctx.head_dim;
  const std::uint32_t tokens = page.page.tokens;
  for (std::uint32_t h = 0; h < ctx.kv_heads; ++h) {
    if (page.partitions[h] != state.heads[h].partitions) {
      fail(ErrorCode::invalid_argument, "retroinfer: kv head {} appends partition {}, expected the next id {}", h,
           page.partitions[h], state.heads[h].partitions);
    }
  }

  // Room first, so that adding the page cannot fail half-way.
  for (HeadState& head : state.heads) {
    head.recent.reserve(head.recent.size() + 1);
    head.recent_centroids.reserve(head.recent_centroids.size() + d);
    head.recent_value_sums.reserve(head.recent_value_sums.size() + d);
    head.recent_keys.reserve(head.recent_keys.size() + std::size_t{tokens} * d);
    head.recent_values.reserve(head.recent_values.size() + std::size_t{tokens} * d);
  }
  for (std::uint32_t h = 0; h < ctx.kv_heads; ++h) {
    HeadState& head = state.heads[h];
    head.recent.push_back(Group{page.partitions[h], tokens});
    add_summary(
        head.recent_centroids, head.recent_value_sums, d, tokens, [&](std::uint32_t i) { return page.page.key(i, h); },
        [&](std::uint32_t i) { return page.page.value(i, h); });
    for (std::uint32_t i = 0; i < tokens; ++i) {
      head.recent_keys.insert(head.recent_keys.end(), page.page.key(i, h), page.page.key(i, h) + d);
      head.recent_values.insert(head.recent_values.end(), page.page.value(i, h), page.page.value(i, h) + d);
    }
    ++head.partitions;
    head.tokens += tokens;
  }
  state.generated += tokens;
  if (state.generated < options_.update_tokens) return std::nullopt;

  // Incremental index update (§4.2): cluster the recent tokens that left the
  // steady window -- the new segment -- and keep the window's pages as they
  // are. Recent partitions have the same sizes in every kv head.
  const HeadState& first_head = state.heads.front();
  std::uint32_t keep = 0;
  std::uint32_t kept_tokens = 0;
  while (keep < first_head.recent.size() && kept_tokens < options_.window_tokens) {
    kept_tokens += first_head.recent[first_head.recent.size() - 1 - keep].tokens;
    ++keep;
  }
  const auto older = static_cast<std::uint32_t>(first_head.recent.size()) - keep;
  std::uint32_t segment = 0;
  for (std::uint32_t i = 0; i < older; ++i) segment += first_head.recent[i].tokens;
  if (segment == 0) {  // the window holds everything: nothing to cluster yet
    state.generated = 0;
    return std::nullopt;
  }
  const std::uint32_t run = segment + kept_tokens;

  std::vector<Clustered> updates(ctx.kv_heads);
  Repartition out;
  try {  // clustering allocates: on failure, forget the page again
    out.first_partitions.resize(ctx.kv_heads);
    out.specs.reserve(ctx.kv_heads);
    for (std::uint32_t h = 0; h < ctx.kv_heads; ++h) {
      HeadState& head = state.heads[h];
      Clustered& up = updates[h];
      out.first_partitions[h] = head.recent.front().id;
      PartitionId id = head.recent.front().id;
      for (const auto& [begin, len] : segments(segment, options_.segment_tokens, options_.tokens_per_cluster)) {
        const std::uint64_t seed = mix(mix(mix(options_.seed, ctx.layer), h), std::uint64_t{head.tokens} - run + begin);
        cluster_segment(
            options_, begin, len, d, seed,
            [&](std::uint32_t t) { return head.recent_keys.data() + std::size_t{t} * d; },
            [&](std::uint32_t t) { return head.recent_values.data() + std::size_t{t} * d; }, id, up);
      }
      std::uint32_t t = segment;  // the window's partitions, as they are
      for (std::uint32_t i = older; i < head.recent.size(); ++i) {
        for (std::uint32_t j = 0; j < head.recent[i].tokens; ++j) up.ids.push_back(t++);
        up.offsets.push_back(static_cast<std::uint32_t>(up.ids.size()));
      }
      out.specs.push_back(PartitionSpec::variable(run, up.offsets, up.ids));
      head.clusters.reserve(head.clusters.size() + up.clusters.size());
      head.centroids.reserve(head.centroids.size() + up.centroids.size());
      head.value_sums.reserve(head.value_sums.size() + up.value_sums.size());
    }
  } catch (...) {
    for (HeadState& head : state.heads) {
      head.recent.pop_back();
      head.recent_centroids.resize(head.recent_centroids.size() - d);
      head.recent_value_sums.resize(head.recent_value_sums.size() - d);
      head.recent_keys.resize(head.recent_keys.size() - std::size_t{tokens} * d);
      head.recent_values.resize(head.recent_values.size() - std::size_t{tokens} * d);
      --head.partitions;
      head.tokens -= tokens;
    }
    state.generated -= tokens;
    throw;
  }

  // Commit: within reserved capacity, nothing here allocates.
  for (std::uint32_t h = 0; h < ctx.kv_heads; ++h) {
    HeadState& head = state.heads[h];
    const Clustered& up = updates[h];
    PartitionId id = up.clusters.back().id + 1;
    head.clusters.insert(head.clusters.end(), up.clusters.begin(), up.clusters.end());
    head.centroids.insert(head.centroids.end(), up.centroids.begin(), up.centroids.end());
    head.value_sums.insert(head.value_sums.end(), up.value_sums.begin(), up.value_sums.end());
    head.recent.erase(head.recent.begin(), head.recent.begin() + older);
    for (Group& g : head.recent) g.id = id++;
    head.recent_centroids.erase(head.recent_centroids.begin(), head.recent_centroids.begin() + std::size_t{older} * d);
    head.recent_value_sums.erase(head.recent_value_sums.begin(),
                                 head.recent_value_sums.begin() + std::size_t{older} * d);
    head.recent_keys.erase(head.recent_keys.begin(), head.recent_keys.begin() + std::size_t{segment} * d);
    head.recent_values.erase(head.recent_values.begin(), head.recent_values.begin() + std::size_t{segment} * d);
    head.partitions = id;
  }
  state.window = options_.window_tokens;
  state.generated = 0;
  return out;
}

void RetroInferPolicy::select(const LayerContext& ctx, const DecodeQuery& q, const LayerState& state,
                              Selection& out) const {
  select_each_head(*this, ctx, q, state, out);
}

void RetroInferPolicy::select_head(const LayerContext& ctx, const DecodeQuery& q, const LayerState& state,
                                   std::uint32_t h, std::vector<PartitionId>& ids) const {
  check_state(ctx, state);
  check_decode_query("retroinfer", ctx, q);
  check_head("retroinfer", ctx, h);
  ids.clear();
  const std::uint32_t budget = options_.budget_tokens;
  const HeadState& head = state.heads[h];
  if (retroinfer_covers(budget, head.tokens)) {  // the budget covers the whole context: Dense
    ids.resize(head.partitions);
    std::iota(ids.begin(), ids.end(), PartitionId{0});
    return;
  }
  std::vector<float> scores, rank;
  const SteadyZone steady = head_steady_zone(head, state.window, retroinfer_token_cap(budget));
  if (steady.sink) ids.push_back(head.sink.id);
  const Candidates c{&head, static_cast<std::uint32_t>(head.clusters.size()),
                     static_cast<std::uint32_t>(head.recent.size()) - steady.window_parts};
  for (std::uint32_t i = c.older; i < head.recent.size(); ++i) ids.push_back(head.recent[i].id);
  if (c.size() > 0) {
    score(ctx, q, h, c, scores, rank);
    // In rank order: the first cluster that does not fit and every lower-ranked
    // one are left to the estimation zone.
    BreakFill fill = retroinfer_retrieval_fill(steady.tokens, budget, options_.retrieval_fraction, c.size());
    rank_fill(
        rank, c, fill, [](std::uint32_t) { return true; }, [&](std::uint32_t i) { ids.push_back(c.group(i).id); });
  }
  std::sort(ids.begin(), ids.end());
}

void RetroInferPolicy::attend(const LayerContext& ctx, const DecodeQuery& q, const LayerState& state,
                              const Selection& selection, std::span<AttentionPartial> extra) const {
  if (extra.size() != ctx.q_heads || selection.partitions.size() != ctx.kv_heads) {
    fail(ErrorCode::invalid_argument, "retroinfer: attend needs {} partials and {} selections, got {} and {}",
         ctx.q_heads, ctx.kv_heads, extra.size(), selection.partitions.size());
  }
  const std::uint32_t group = ctx.group_size();
  for (std::uint32_t h = 0; h < ctx.kv_heads; ++h) {
    attend_head(ctx, q, state, h, selection.partitions[h], extra.subspan(std::size_t{h} * group, group));
  }
}

void RetroInferPolicy::attend_head(const LayerContext& ctx, const DecodeQuery& q, const LayerState& state,
                                   std::uint32_t h, std::span<const PartitionId> selection,
                                   std::span<AttentionPartial> extra) const {
  check_state(ctx, state);
  check_decode_query("retroinfer", ctx, q);
  check_head("retroinfer", ctx, h);
  const std::uint32_t group = ctx.group_size();
  if (extra.size() != group) {
    fail(ErrorCode::invalid_argument, "retroinfer: attend of a kv head needs {} partials, got {}", group, extra.size());
  }
  const std::uint32_t d = ctx.head_dim;
  for (AttentionPartial& partial : extra) partial = AttentionPartial(d);
  if (!options_.estimation) return;
  const std::uint32_t budget = options_.budget_tokens;
  const HeadState& head = state.heads[h];
  if (retroinfer_covers(budget, head.tokens)) return;  // everything is exact
  const SteadyZone steady = head_steady_zone(head, state.window, retroinfer_token_cap(budget));
  const Candidates c{&head, static_cast<std::uint32_t>(head.clusters.size()),
                     static_cast<std::uint32_t>(head.recent.size()) - steady.window_parts};
  const std::uint32_t m = c.size();
  if (m == 0) return;
  std::vector<float> scores, rank;
  score(ctx, q, h, c, scores, rank);
  std::vector<PartitionId> selected(selection.begin(), selection.end());
  std::sort(selected.begin(), selected.end());
  // The best-ranked partitions the selection does not hold (retrieved ones are exact).
  BreakFill zone = retroinfer_estimation_fill(options_.estimation_fraction, m);
  const auto unselected = [&](std::uint32_t i) {
    return !std::binary_search(selected.begin(), selected.end(), c.group(i).id);
  };
  rank_fill(rank, c, zone, unselected, [&](std::uint32_t i) {
    const Group& g = c.group(i);
    const float* vs = c.value_sum(i, d);
    for (std::uint32_t j = 0; j < group; ++j) add_cluster(extra[j], scores[std::size_t{j} * m + i], g.tokens, vs);
  });
}

namespace {

// What one kv head holds with at most x tokens in partitions, the state
// between a page save and the re-index it triggers included:
//  - the sink: one partition of at most sink_tokens tokens;
//  - clusters: a clustered run is cut into segments of at least
//    tokens_per_cluster tokens, each giving at most length / tokens_per_cluster
//    clusters. A re-index run shorter than that is whole recent partitions
//    made one cluster: no more partitions or pages than they were;
//  - recent partitions (window and decode pages): one page each, all full but
//    the prompt's last.
// So clusters and recent partitions number at most x / min(tokens_per_cluster,
// page) + 1. A cluster pads its last page, so its tokens cost more pages than
// a full recent page's: pages are largest when every token is clustered.
struct HeadBound {
  std::uint64_t partitions = 0;
  std::uint64_t pages = 0;
};

HeadBound head_bound(const RetroInferPolicy::Options& o, std::uint64_t page, std::uint64_t x) {
  const std::uint64_t sink = o.sink_tokens > 0 ? 1 : 0;
  const std::uint64_t clusters = x / o.tokens_per_cluster;
  HeadBound b;
  b.partitions = sink + x / std::min<std::uint64_t>(o.tokens_per_cluster, page) + 1;
  b.pages = (o.sink_tokens + page - 1) / page + (x + clusters * (page - 1)) / page + 1;
  return b;
}

std::uint32_t saturate(std::uint64_t x) {
  return static_cast<std::uint32_t>(std::min<std::uint64_t>(x, std::numeric_limits<std::uint32_t>::max()));
}

}  // namespace

HeadCapacity RetroInferPolicy::head_capacity(const LayerContext& ctx) const {
  if (ctx.page_tokens == 0) fail(ErrorCode::invalid_argument, "retroinfer: page_tokens must be > 0");
  // A cluster may gather a whole segment; its pages must fit one partition's
  // page run, or a prefill (or a decode re-index, for good) would be refused.
  const std::uint64_t cluster_tokens = std::min<std::uint64_t>(options_.segment_tokens, ctx.tokens);
  if ((cluster_tokens + ctx.page_tokens - 1) / ctx.page_tokens > kMaxPagesPerPartition) {
    fail(ErrorCode::invalid_argument,
         "retroinfer: a cluster may hold a whole {}-token segment, more than the {} pages of {} tokens a partition "
         "can span; lower segment_tokens or raise page_tokens",
         cluster_tokens, kMaxPagesPerPartition, ctx.page_tokens);
  }
  const HeadBound b = head_bound(options_, ctx.page_tokens, ctx.tokens);
  return {saturate(b.partitions), saturate(b.pages)};
}

std::uint32_t RetroInferPolicy::mandatory_pages(const LayerContext& ctx) const {
  if (ctx.page_tokens == 0) fail(ErrorCode::invalid_argument, "retroinfer: page_tokens must be > 0");
  const std::uint64_t page = ctx.page_tokens;
  const std::uint64_t budget = options_.budget_tokens;
  const std::uint64_t tokens = ctx.tokens;
  const HeadBound whole = head_bound(options_, page, tokens);
  std::uint64_t bound = 0;
  if (budget == 0) {
    // No budget: the sink, the steady window and the top retrieval_fraction of
    // the ranked partitions. The window takes the newest recent partitions
    // (one page each) while they cover fewer than its tokens (at most window +
    // one cluster - 1 after a short prompt). The fraction counts partitions,
    // not tokens: a ranked one is a cluster of up to a whole segment or a
    // recent page, so only the context bounds their tokens.
    const std::uint64_t window = std::uint64_t{options_.window_tokens} + options_.tokens_per_cluster - 1;
    const std::uint64_t window_parts = (window + page - 1) / page + 1;
    const std::uint64_t retrieval = fraction_count(options_.retrieval_fraction, whole.partitions);
    const std::uint64_t cluster_pages = (std::min<std::uint64_t>(options_.segment_tokens, tokens) + page - 1) / page;
    const std::uint64_t selected = 1 + window_parts + retrieval;
    bound = std::min((options_.sink_tokens + page - 1) / page + window_parts + retrieval * cluster_pages,
                     (tokens + selected * (page - 1)) / page);
  } else {
    // Every partition is selected while the head holds at most `budget` tokens.
    bound = head_bound(options_, page, std::min(budget, tokens)).pages;
    if (budget < tokens) {
      // Beyond, at most `budget` tokens in the sink, the steady window and the
      // retrieval zone, each partition padding its last page. The retrieval
      // zone takes as many partitions as fit, each at least one token.
      const std::uint64_t selected = std::min(budget, whole.partitions);
      bound = std::max(bound, (budget + selected * (page - 1)) / page);
    }
  }
  return static_cast<std::uint32_t>(
      std::clamp<std::uint64_t>(std::min(bound, whole.pages), 1, std::numeric_limits<std::uint32_t>::max()));
}

}  // namespace sparsekv
