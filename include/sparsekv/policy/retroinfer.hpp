#pragma once
// RetroInfer's wave index (Chen et al. 2025, §4.2), as a SparseAttention
// policy with its own Attend term.
//
// Index: per (layer, kv head), segmented spherical k-means on the mean-centred
// post-RoPE keys (segments of `segment_tokens`, one cluster per
// `tokens_per_cluster` tokens, `kmeans_iterations` Lloyd rounds, k-means++
// seeding from `seed`). The meta index keeps, per cluster, the centroid (the
// mean of the cluster's raw keys, eq. 3), the value sum VS and the size.
// Each cluster is one variable-size partition.
//
// Tripartite attention, per kv head and step:
//  - steady zone: the newest tokens (`window_tokens`) and the first
//    `sink_tokens` tokens, exact, selected within the budget: the newest
//    window pages first, the sinks only if they fit;
//  - retrieval zone: clusters ranked for the whole GQA group by the sum over
//    its q heads of softmax(q.C / sqrt(d)), exact (selected partitions), in
//    rank order: with `budget_tokens` > 0, while they fit in the budget the
//    steady zone leaves (a caller's budget is spent at any context length);
//    with 0 (no budget given), the top `retrieval_fraction` of them, the
//    paper's 1.8% (§5), with no token cap;
//  - estimation zone: the `estimation_fraction` of the clusters ranked right
//    after the retrieved ones: attend() adds, per q head, each one's centroid
//    score with weight = size and value = VS (eqs. 2-4) to an AttentionPartial
//    that the library merges by log-sum-exp with the exact attention;
//  - everything ranked below is dropped.
// A budget that covers a head's whole context selects every partition
// (exactly Dense, no estimation).
//
// Decode: each appended page is a one-page exact partition; the newest ones
// form the steady window, older ones that wait for the next update are ranked
// like clusters (their summary is their page's mean key and value sum). Every
// `update_tokens` generated tokens the waiting tokens are clustered (the new
// segment) and a Repartition regroups them into the new clusters, keeping the
// window's pages as they are. See docs/policies/retroinfer.md.
#include <cstdint>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include "sparsekv/core/ids.hpp"
#include "sparsekv/policy/device_select.hpp"
#include "sparsekv/policy/sparse_attention.hpp"
#include "sparsekv/policy/host_state_feed.hpp"

namespace sparsekv {

// Spherical k-means on mean-centred vectors (RetroInfer §4.2): the `n` rows of
// `vectors` ([n][dim]) minus their mean, normalised to unit length, k-means++
// seeding (deterministic in `seed`), then `iterations` passes assigning each
// row to its most similar centroid, each centroid becoming its members'
// renormalised mean between passes; stops early once no assignment changes.
// Returns each row's cluster in [0, c), where c <= k is the number of
// non-empty clusters, numbered in order of their first row. Throws
// invalid_argument when n, dim or k is 0, k > n, or `vectors` has the wrong
// size.
std::vector<std::uint32_t> spherical_kmeans(std::span<const float> vectors, std::uint32_t n, std::uint32_t dim,
                                            std::uint32_t k, std::uint32_t iterations, std::uint64_t seed);

// The two Lloyd steps of spherical_kmeans, host backend (the CUDA backend is
// sparsekv::cuda::kmeans_assign / kmeans_update in index_cuda.hpp; both follow
// the rules of summary_rules.hpp and agree bit for bit). `rows` is [n][dim]
// and `centroids` [k][dim], fp32.
//
// kmeans_assign: labels[t] = the centroid most similar to row t (ties to the
// lowest index, NaN never wins); returns how many labels changed.
// kmeans_update: each centroid with members becomes the renormalised sum of
// its rows (summed in row order); an empty cluster, or one summing to zero,
// keeps its centroid.
// Both throw invalid_argument, changing nothing, when n, dim or k is 0, a
// span has the wrong size, or (update) a label is >= k.
std::uint32_t kmeans_assign(std::span<const float> rows, std::uint32_t n, std::uint32_t dim,
                            std::span<const float> centroids, std::uint32_t k, std::span<std::uint32_t> labels);
void kmeans_update(std::span<const float> rows, std::uint32_t n, std::uint32_t dim,
                   std::span<const std::uint32_t> labels, std::uint32_t k, std::span<float> centroids);

class RetroInferPolicy {
 public:
  struct Options {
    std::uint32_t budget_tokens = 0;        // tokens per kv head for steady + retrieval; 0: none given
    std::uint32_t segment_tokens = 8192;    // segmented clustering: tokens per k-means segment
    std::uint32_t tokens_per_cluster = 16;  // 1/16 of the tokens become centroids
    std::uint32_t kmeans_iterations = 10;
    std::uint32_t sink_tokens = 4;       // steady zone: 4 initial tokens ...
    std::uint32_t window_tokens = 64;    // ... and the 64 newest
    float retrieval_fraction = 0.018f;   // of the clusters, exact (budget_tokens 0 only)
    float estimation_fraction = 0.232f;  // of the clusters, estimated from centroids
    std::uint32_t update_tokens = 1024;  // decode tokens between incremental index updates
    bool estimation = true;              // false: retroinfer_no_estimation (retrieval only)
    std::uint64_t seed = 0x5eedULL;      // k-means++ seeding
  };

  // An exact partition: its id and token count.
  struct Group {
    PartitionId id = kInvalidPartition;
    std::uint32_t tokens = 0;
  };
  // One kv head's wave index.
  struct HeadState {
    Group sink;                     // the sink tokens (tokens == 0: none)
    std::vector<Group> clusters;    // meta index, in id order
    std::vector<float> centroids;   // [cluster][head_dim]: mean post-RoPE key (eq. 3)
    std::vector<float> value_sums;  // [cluster][head_dim]: VS (eq. 4)
    // Partitions not clustered yet (the prefill's window, decode pages), oldest
    // first, each at most one page; summarised like clusters.
    std::vector<Group> recent;
    std::vector<float> recent_centroids;   // [recent][head_dim]
    std::vector<float> recent_value_sums;  // [recent][head_dim]
    std::vector<float> recent_keys;        // [token][head_dim]: kept for the next update
    std::vector<float> recent_values;      // [token][head_dim]
    std::uint32_t partitions = 0;          // ids in use: [0, partitions)
    std::uint32_t tokens = 0;              // tokens in partitions
  };
  struct LayerState {
    std::vector<HeadState> heads;  // per kv head; empty before index()
    std::uint32_t head_dim = 0;
    std::uint32_t window = 0;     // steady window in tokens (a short prefill's whole tail until the first update)
    std::uint32_t generated = 0;  // tokens appended since the last index update
  };

  static constexpr std::string_view kName = "retroinfer";
  static constexpr RopeStage kRope = RopeStage::post_rope;

  // Throws invalid_argument for a zero segment, cluster size, update interval
  // or iteration count, a cluster larger than a segment, or fractions outside
  // [0, 1] / summing above 1.
  RetroInferPolicy() : RetroInferPolicy(Options{}) {}
  explicit RetroInferPolicy(const Options& options);

  const Options& options() const noexcept { return options_; }

  std::vector<PartitionSpec> index(const LayerContext& ctx, const KvView& kv, LayerState& state) const;
  std::optional<Repartition> append(const LayerContext& ctx, const AppendedPage& page, LayerState& state) const;
  void select(const LayerContext& ctx, const DecodeQuery& q, const LayerState& state, Selection& out) const;
  void select_head(const LayerContext& ctx, const DecodeQuery& q, const LayerState& state, std::uint32_t head,
                   std::vector<PartitionId>& ids) const;
  // extra: one partial per q head; each is reset, then gets the estimation
  // zone of its kv head (nothing without `estimation` or with a full budget).
  void attend(const LayerContext& ctx, const DecodeQuery& q, const LayerState& state, const Selection& selection,
              std::span<AttentionPartial> extra) const;
  // attend() for kv head `head` alone: extra holds its group_size q heads,
  // `selected` its selection.
  void attend_head(const LayerContext& ctx, const DecodeQuery& q, const LayerState& state, std::uint32_t head,
                   std::span<const PartitionId> selected, std::span<AttentionPartial> extra) const;
  // The most pages one select() returns per kv head while the request holds at
  // most ctx.tokens tokens, never more than head_capacity's pages. Without a
  // budget the fraction counts clusters, not tokens: only the context bounds
  // their tokens.
  std::uint32_t mandatory_pages(const LayerContext& ctx) const;
  // The most partitions and CPU pages one kv head holds with at most
  // ctx.tokens tokens: clusters average tokens_per_cluster tokens and pad
  // their last page, so with clusters smaller than a page a head holds more
  // partitions than pages, and up to about (1 + page_tokens /
  // tokens_per_cluster) times the context's pages.
  HeadCapacity head_capacity(const LayerContext& ctx) const;

  // FeedsHostState (policy/host_state_feed.hpp): the device Select ranks the
  // centroids on the device; its rows read the sink and steady zone here,
  // the store takes the clusters then the recent partitions, and the next
  // index update comes every update_tokens decode tokens.
  HostStateRow host_state_row(const LayerState& state, std::uint32_t head, std::uint32_t unfed_pages) const {
    const HeadState& h = state.heads.at(head);
    return {h.sink.id, h.sink.tokens, static_cast<std::uint32_t>(h.recent.size()) + unfed_pages, state.window};
  }
  void host_summary_rows(const LayerState& state, std::uint32_t head, HostSummaryRows& out) const {
    const HeadState& h = state.heads.at(head);
    out.centroids = h.centroids;
    out.centroids.insert(out.centroids.end(), h.recent_centroids.begin(), h.recent_centroids.end());
    out.value_sums = h.value_sums;
    out.value_sums.insert(out.value_sums.end(), h.recent_value_sums.begin(), h.recent_value_sums.end());
    out.tokens.clear();
    for (const auto& g : h.clusters) out.tokens.push_back(g.tokens);
    for (const auto& g : h.recent) out.tokens.push_back(g.tokens);
  }
  bool host_index_update_due(const LayerState& state, std::uint32_t pending_tokens) const {
    return std::uint64_t{state.generated} + pending_tokens >= options_.update_tokens;
  }

 private:
  Options options_;
};

// RetroInfer's device Select (policy/device_select.hpp): ranks the centroids
// kept on the device and hands its estimation zone to the attention kernel.
// Its clustering stays on the host: its rows also read the host state
// (FeedsHostState, policy/host_state_feed.hpp), which the step keeps --
// indexed at prefill, fed the saved decode pages at each index update
// (docs/device-decode.md, "RetroInfer").
struct RetroInferDeviceSelect {
  using Policy = RetroInferPolicy;
  static constexpr cuda::AppendSummary summary = cuda::AppendSummary::retroinfer;
  static constexpr bool reads_host_state = true;
  static constexpr bool estimates = true;
  std::uint32_t budget_tokens = 0;
  // The zones' fractions (retrieval_fraction applies with budget_tokens 0, no
  // budget), and whether the estimation zone is attended.
  float retrieval_fraction = 0.0f;
  float estimation_fraction = 0.0f;
  bool estimation = false;
  // The partition id of a head's first candidate: its sink is partition 0 and
  // no candidate (it joins a selection by the steady zone).
  std::uint32_t first_partition = 0;

  // The sink besides the candidates; no budget (0): the whole row.
  std::uint32_t capacity(std::uint32_t max_partitions, std::uint32_t) const {
    return cuda::select_capacity(max_partitions, budget_tokens, budget_tokens == 0, 1);
  }
};
inline RetroInferDeviceSelect device_select_spec(const RetroInferPolicy& p, const LayerContext&) {
  const RetroInferPolicy::Options& o = p.options();
  return {o.budget_tokens, o.retrieval_fraction, o.estimation_fraction, o.estimation, o.sink_tokens > 0 ? 1u : 0u};
}

}  // namespace sparsekv
