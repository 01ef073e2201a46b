#pragma once
// AnyPolicy: a SparseAttention policy chosen at run time (the facade's edge;
// inside, everything is templated on the policy type). make_policy() builds
// the built-in ones by name with their papers' defaults and a token budget.
#include <any>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "sparsekv/policy/device_select.hpp"
#include "sparsekv/policy/sparse_attention.hpp"
#include "sparsekv/policy/token_eviction.hpp"

namespace sparsekv {

class AnyPolicy {
 public:
  template <SparseAttention P>
  explicit AnyPolicy(P policy) : impl_(std::make_shared<Model<P>>(std::move(policy))) {}

  std::string_view name() const { return impl_->name(); }
  RopeStage rope() const { return impl_->rope(); }
  bool has_attend() const { return impl_->has_attend(); }
  // A fresh per-(request, layer) state.
  std::any make_state() const { return impl_->make_state(); }

  std::vector<PartitionSpec> index(const LayerContext& ctx, const KvView& kv, std::any& state) const {
    return impl_->index(ctx, kv, state);
  }
  std::optional<Repartition> append(const LayerContext& ctx, const AppendedPage& page, std::any& state) const {
    return impl_->append(ctx, page, state);
  }
  void select(const LayerContext& ctx, const DecodeQuery& q, const std::any& state, Selection& out) const {
    impl_->select(ctx, q, state, out);
  }
  // For policies without CustomAttend, leaves `extra` untouched.
  void attend(const LayerContext& ctx, const DecodeQuery& q, const std::any& state, const Selection& s,
              std::span<AttentionPartial> extra) const {
    impl_->attend(ctx, q, state, s, extra);
  }
  std::uint32_t mandatory_pages(const LayerContext& ctx) const { return impl_->mandatory_pages(ctx); }
  // The policy's HeadCapacity; nullopt when it declares none.
  std::optional<HeadCapacity> head_capacity(const LayerContext& ctx) const { return impl_->head_capacity(ctx); }
  // The wrapped policy's device Select (policy/device_select.hpp).
  DeviceSelectSpec device_select(const LayerContext& ctx) const { return impl_->device_select(ctx); }
  DeviceSelectRow device_select_row(const std::any& state, std::uint32_t head, std::uint32_t unfed_pages) const {
    return impl_->device_select_row(state, head, unfed_pages);
  }
  bool device_index_update_due(const std::any& state, std::uint32_t pending_tokens) const {
    return impl_->device_index_update_due(state, pending_tokens);
  }
  void device_summary_rows(const std::any& state, std::uint32_t head, DeviceSummaryRows& out) const {
    impl_->device_summary_rows(state, head, out);
  }
  // Token eviction (token_eviction.hpp). For policies that evict nothing:
  // false, no weights, an empty list per kv head, and no-ops.
  bool evicts() const { return impl_->evicts(); }
  bool needs_weights() const { return impl_->needs_weights(); }
  void evict(const LayerContext& ctx, const EvictionContext& e, std::any& state, Eviction& out) const {
    impl_->evict(ctx, e, state, out);
  }
  void placed(const LayerContext& ctx, std::uint32_t position, std::any& state) const {
    impl_->placed(ctx, position, state);
  }
  void observe(const LayerContext& ctx, const TokenWeights& w, std::any& state) const {
    impl_->observe(ctx, w, state);
  }
  // RewritesSummaries; a no-op for the policies without it.
  bool rewrites() const { return impl_->rewrites(); }
  void rewrite(const LayerContext& ctx, const RewrittenPage& page, std::any& state) const {
    impl_->rewrite(ctx, page, state);
  }

 private:
  struct Concept {
    virtual ~Concept() = default;
    virtual std::string_view name() const = 0;
    virtual RopeStage rope() const = 0;
    virtual bool has_attend() const = 0;
    virtual std::any make_state() const = 0;
    virtual std::vector<PartitionSpec> index(const LayerContext&, const KvView&, std::any&) const = 0;
    virtual std::optional<Repartition> append(const LayerContext&, const AppendedPage&, std::any&) const = 0;
    virtual void select(const LayerContext&, const DecodeQuery&, const std::any&, Selection&) const = 0;
    virtual void attend(const LayerContext&, const DecodeQuery&, const std::any&, const Selection&,
                        std::span<AttentionPartial>) const = 0;
    virtual std::uint32_t mandatory_pages(const LayerContext&) const = 0;
    virtual std::optional<HeadCapacity> head_capacity(const LayerContext&) const = 0;
    virtual DeviceSelectSpec device_select(const LayerContext&) const = 0;
    virtual DeviceSelectRow device_select_row(const std::any&, std::uint32_t, std::uint32_t) const = 0;
    virtual bool device_index_update_due(const std::any&, std::uint32_t) const = 0;
    virtual void device_summary_rows(const std::any&, std::uint32_t, DeviceSummaryRows&) const = 0;
    virtual bool evicts() const = 0;
    virtual bool needs_weights() const = 0;
    virtual void evict(const LayerContext&, const EvictionContext&, std::any&, Eviction&) const = 0;
    virtual void placed(const LayerContext&, std::uint32_t, std::any&) const = 0;
    virtual void observe(const LayerContext&, const TokenWeights&, std::any&) const = 0;
    virtual bool rewrites() const = 0;
    virtual void rewrite(const LayerContext&, const RewrittenPage&, std::any&) const = 0;
  };

  template <class P>
  struct Model final : Concept {
    using State = typename P::LayerState;
    explicit Model(P p) : policy(std::move(p)) {}
    std::string_view name() const override { return P::kName; }
    RopeStage rope() const override { return P::kRope; }
    bool has_attend() const override { return CustomAttend<P>; }
    std::any make_state() const override { return State{}; }
    std::vector<PartitionSpec> index(const LayerContext& c, const KvView& kv, std::any& s) const override {
      return policy.index(c, kv, std::any_cast<State&>(s));
    }
    std::optional<Repartition> append(const LayerContext& c, const AppendedPage& p, std::any& s) const override {
      return policy.append(c, p, std::any_cast<State&>(s));
    }
    void select(const LayerContext& c, const DecodeQuery& q, const std::any& s, Selection& out) const override {
      policy.select(c, q, std::any_cast<const State&>(s), out);
    }
    void attend(const LayerContext& c, const DecodeQuery& q, const std::any& s, const Selection& sel,
                std::span<AttentionPartial> extra) const override {
      if constexpr (CustomAttend<P>) policy.attend(c, q, std::any_cast<const State&>(s), sel, extra);
    }
    std::uint32_t mandatory_pages(const LayerContext& c) const override { return policy.mandatory_pages(c); }
    std::optional<HeadCapacity> head_capacity(const LayerContext& c) const override {
      if constexpr (DeclaresHeadCapacity<P>) {
        return policy.head_capacity(c);
      } else {
        return std::nullopt;
      }
    }
    DeviceSelectSpec device_select(const LayerContext& c) const override {
      return sparsekv::device_select(policy, c);
    }
    DeviceSelectRow device_select_row(const std::any& s, std::uint32_t head, std::uint32_t unfed) const override {
      return sparsekv::device_select_row(policy, std::any_cast<const State&>(s), head, unfed);
    }
    bool device_index_update_due(const std::any& s, std::uint32_t pending_tokens) const override {
      return sparsekv::device_index_update_due(policy, std::any_cast<const State&>(s), pending_tokens);
    }
    void device_summary_rows(const std::any& s, std::uint32_t head, DeviceSummaryRows& out) const override {
      sparsekv::device_summary_rows(policy, std::any_cast<const State&>(s), head, out);
    }
    bool evicts() const override { return TokenEviction<P>; }
    bool needs_weights() const override { return needs_token_weights(policy); }
    void evict(const LayerContext& c, const EvictionContext& e, std::any& s, Eviction& out) const override {
      evict_tokens(policy, c, e, std::any_cast<State&>(s), out);
    }
    void placed(const LayerContext& c, std::uint32_t position, std::any& s) const override {
      token_placed(policy, c, position, std::any_cast<State&>(s));
    }
    void observe(const LayerContext& c, const TokenWeights& w, std::any& s) const override {
      observe_weights(policy, c, w, std::any_cast<State&>(s));
    }
    bool rewrites() const override { return RewritesSummaries<P>; }
    void rewrite(const LayerContext& c, const RewrittenPage& page, std::any& s) const override {
      rewrite_summary(policy, c, page, std::any_cast<State&>(s));
    }
    P policy;
  };

  std::shared_ptr<const Concept> impl_;
};

// Built-in policies by name: dense, streaming, quest, shadowkv, retroinfer,
// retroinfer_no_estimation (RetroInfer without its estimation zone) and
// oracle (the best selection of the budget's size, for evaluation), and the
// token-evicting h2o and streaming_evict, whose budget is the live tokens per
// kv head (H2O's recent window is half of it). Every other knob keeps its
// paper default. Throws invalid_argument for an unknown name, a budget of 0
// (dense ignores the budget) or a budget below an eviction policy's
// protected window.
AnyPolicy make_policy(std::string_view name, std::uint32_t budget_tokens);
// The selection policies make_policy accepts (the tools' default lists).
std::vector<std::string> policy_names();
// The token-evicting policies make_policy accepts, kept apart from
// policy_names() so the tools' default lists stay selection-only.
std::vector<std::string> eviction_policy_names();

}  // namespace sparsekv

namespace sparsekv {
inline DeviceSelectSpec device_select(const AnyPolicy& p, const LayerContext& ctx) { return p.device_select(ctx); }
}  // namespace sparsekv
