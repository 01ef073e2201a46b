#pragma once
// One request through the host pipeline of Spin §4.1 -- Index (policy),
// Offload (TieredKVBuffer), Select (policy), Retrieve (buffer), Attend
// (decode_attention plus the policy's own term) -- for the accuracy tool and
// the policy tests. fp32 K/V. The engine-facing facade does the same
// for batches of requests.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <vector>

#include "sparsekv/attention/decode_attention.hpp"
#include "sparsekv/buffer/tiered_kv_buffer.hpp"
#include "sparsekv/policy/any_policy.hpp"

namespace sparsekv::tools {

class SparsePipeline {
 public:
  // `max_tokens`: the most tokens the request will hold (sizes budgets and tiers).
  SparsePipeline(const ModelShape& shape, AnyPolicy policy, std::uint32_t max_tokens, std::uint32_t page_tokens = 8)
      : shape_(shape), policy_(std::move(policy)), max_tokens_(max_tokens) {
    if (shape.dtype != DType::f32) fail(ErrorCode::invalid_argument, "SparsePipeline works on f32 K/V");
    config_.page_tokens = page_tokens;
    config_.max_requests = 1;
    config_.max_context_tokens = 2 * max_tokens + 2 * page_tokens;
    config_.min_buffer_ratio = 1.0;  // accuracy runs: buffering only affects hit ratios
    std::uint32_t mandatory = 1;
    for (std::uint32_t l = 0; l < shape.layers; ++l)
      mandatory = std::max(mandatory, policy_.mandatory_pages(context(l, max_tokens)));
    const std::size_t page = config_.page_bytes(shape);
    const std::size_t heads = std::size_t{shape.layers} * shape.kv_heads;
    config_.cpu_tier_bytes = heads * (2 * std::size_t{max_tokens} / page_tokens + 16) * page;
    config_.gpu_tier_bytes = heads * (2 * std::size_t{mandatory} + 2) * page;
    config_.host_chunk_bytes = std::min<std::size_t>(config_.cpu_tier_bytes, std::size_t{64} << 20);
    buffer_ = std::make_unique<TieredKVBuffer>(shape, config_, cpu_, gpu_);
    buffer_->admission().add_request(kRequest, RequestPages{mandatory, 0});
    for (std::uint32_t l = 0; l < shape.layers; ++l) states_.push_back(policy_.make_state());
    recent_.resize(shape.layers);
  }

  LayerContext context(std::uint32_t layer, std::uint32_t tokens) const {
    return {layer, shape_.layers, shape_.q_heads, shape_.kv_heads, shape_.head_dim, config_.page_tokens, tokens};
  }
  std::uint32_t partition_tokens(std::uint32_t layer) const {
    return buffer_->admission().sequence_length(kRequest, layer) - buffer_->tails().tail_tokens(kRequest, layer);
  }

  // Index + Offload of a layer's prompt.
  void prefill(std::uint32_t layer, const KvView& kv) {
    const std::vector<PartitionSpec> specs = policy_.index(context(layer, kv.tokens), kv, states_[layer]);
    buffer_->offloader().offload(kRequest, layer, KvChunk{kv.keys.data(), kv.values.data(), kv.tokens, DType::f32},
                                 specs);
  }

  // One decode token of a layer, k and v [kv_heads][head_dim]. When the tail
  // page fills and is saved, the policy sees the page (and may regroup) after
  // the next attend(), as in the facade: that step attends the page as the tail.
  void append(std::uint32_t layer, const float* k, const float* v) {
    commit_page(layer);
    const std::size_t row = std::size_t{shape_.kv_heads} * shape_.head_dim;
    auto& recent = recent_[layer];
    recent.k.insert(recent.k.end(), k, k + row);
    recent.v.insert(recent.v.end(), v, v + row);
    buffer_->tails().append(kRequest, layer, KvChunk{k, v, 1, DType::f32});
    recent.full = buffer_->tails().tail_tokens(kRequest, layer) == 0;
  }

  // Select + Retrieve + Attend for one layer's query; out: [q_heads][head_dim].
  void attend(std::uint32_t layer, const DecodeQuery& q, float* out) {
    const bool full = recent_[layer].full;
    const LayerContext ctx = context(layer, partition_tokens(layer) - (full ? config_.page_tokens : 0));
    policy_.select(ctx, q, states_[layer], selection_);
    buffer_->retriever().retrieve(kRequest, layer, selection_.partitions, retrieval_);
    if (full) retrieval_.tail_tokens.assign(shape_.kv_heads, config_.page_tokens);
    kv_.assign(shape_.kv_heads, HeadKv{});
    const PagePool& gpu = buffer_->tiers().gpu_pool;
    for (std::uint32_t h = 0; h < shape_.kv_heads; ++h) {
      retrieval_.for_each_page(h, config_.page_tokens,
                               [&](PageId page, std::uint32_t tokens) { kv_[h].add(gpu.data(page), tokens); });
    }
    extra_.clear();
    if (policy_.has_custom_attend()) {
      extra_.assign(shape_.q_heads, AttentionPartial(shape_.head_dim));
      policy_.attend(ctx, q, states_[layer], selection_, extra_);
    }
    const PageLayout layout{config_.page_tokens, shape_.head_dim, DType::f32};
    decode_attention(layout, shape_.q_heads, 1.0f / std::sqrt(float(shape_.head_dim)), q.q.data(), kv_, extra_, out);
    commit_page(layer);
  }

  const Selection& selection() const { return selection_; }
  const Retrieval& retrieval() const { return retrieval_; }
  const TieredKVBuffer& buffer() const { return *buffer_; }
  const AnyPolicy& policy() const { return policy_; }

 private:
  static constexpr RequestId kRequest = 1;
  struct Recent {
    std::vector<float> k, v;
    bool full = false;  // a saved page the policy has not seen yet
  };

  // Shows the policy the layer's saved page, if one waits (and applies its regroup).
  void commit_page(std::uint32_t layer) {
    Recent& recent = recent_[layer];
    if (!recent.full) return;
    AppendedPage page;
    page.page = KvView{
        recent.k,        recent.v,        config_.page_tokens,
        shape_.kv_heads, shape_.head_dim, buffer_->admission().sequence_length(kRequest, layer) - config_.page_tokens};
    for (std::uint32_t h = 0; h < shape_.kv_heads; ++h) {
      page.partitions.push_back(buffer_->tiers().table.partition_count(kRequest, layer, h) - 1);
    }
    const auto regroup = policy_.append(context(layer, partition_tokens(layer)), page, states_[layer]);
    if (regroup) buffer_->regrouper().repartition(kRequest, layer, regroup->first_partitions, regroup->specs);
    recent.k.clear();
    recent.v.clear();
    recent.full = false;
  }

  ModelShape shape_;
  AnyPolicy policy_;
  std::uint32_t max_tokens_;
  Config config_;
  HostMemoryResource cpu_{false}, gpu_{false, Residency::at_allocation};
  std::unique_ptr<TieredKVBuffer> buffer_;
  std::vector<std::any> states_;
  std::vector<Recent> recent_;
  Selection selection_;
  Retrieval retrieval_;
  std::vector<HeadKv> kv_;
  std::vector<AttentionPartial> extra_;
};

}  // namespace sparsekv::tools
