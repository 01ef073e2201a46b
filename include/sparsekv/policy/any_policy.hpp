#pragma once
// AnyPolicy: a SparseAttention policy chosen at run time (the facade's edge;
// inside, everything is templated on the policy type). make_policy()
// (policy_registry.hpp) builds one by name.
#include <any>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "sparsekv/policy/device_select.hpp"
#include "sparsekv/policy/host_state_feed.hpp"
#include "sparsekv/policy/sparse_attention.hpp"
#include "sparsekv/policy/token_eviction.hpp"

namespace sparsekv {

class AnyPolicy {
 public:
  using LayerState = std::any;  // the wrapped policy's LayerState

  template <SparseAttention P>
  explicit AnyPolicy(P policy) : impl_(std::make_shared<Model<P>>(std::move(policy))) {}

  std::string_view name() const { return impl_->name(); }
  RopeStage rope() const { return impl_->rope(); }
  bool has_custom_attend() const { return impl_->has_custom_attend(); }
  bool may_regroup() const { return impl_->may_regroup(); }
  bool index_reads_values() const { return impl_->index_reads_values(); }
  // A fresh per-(request, layer) state.
  std::any make_state() const { return impl_->make_state(); }

  std::vector<PartitionSpec> index(const LayerContext& ctx, const KvView& kv, std::any& state) const {
    return impl_->index(ctx, kv, state);
  }
  // ForksIndex of the wrapped policy: 0 reused tokens and index() for a policy without it.
  bool forks_index() const { return impl_->forks_index(); }
  std::uint32_t reused_tokens(const LayerContext& ctx, const std::any& source) const {
    return impl_->reused_tokens(ctx, source);
  }
  std::vector<PartitionSpec> fork_index(const LayerContext& ctx, const std::any& source, const KvView& kv,
                                        std::any& state) const {
    return impl_->fork_index(ctx, source, kv, state);
  }
  std::optional<Repartition> append(const LayerContext& ctx, const AppendedPage& page, std::any& state) const {
    return impl_->append(ctx, page, state);
  }
  void select(const LayerContext& ctx, const DecodeQuery& q, const std::any& state, Selection& out) const {
    impl_->select(ctx, q, state, out);
  }
  // SelectsByHead / AttendsByHead of the wrapped policy; the calls write
  // nothing for a policy without them.
  bool selects_by_head() const { return impl_->selects_by_head(); }
  void select_head(const LayerContext& ctx, const DecodeQuery& q, const std::any& state, std::uint32_t head,
                   std::vector<PartitionId>& ids) const {
    impl_->select_head(ctx, q, state, head, ids);
  }
  bool attends_by_head() const { return impl_->attends_by_head(); }
  void attend_head(const LayerContext& ctx, const DecodeQuery& q, const std::any& state, std::uint32_t head,
                   std::span<const PartitionId> selected, std::span<AttentionPartial> extra) const {
    impl_->attend_head(ctx, q, state, head, selected, extra);
  }
  // For policies without CustomAttend, leaves `extra` untouched.
  void attend(const LayerContext& ctx, const DecodeQuery& q, const std::any& state, const Selection& s,
              std::span<AttentionPartial> extra) const {
    impl_->attend(ctx, q, state, s, extra);
  }
  std::uint32_t mandatory_pages(const LayerContext& ctx) const { return impl_->mandatory_pages(ctx); }
  // The policy's HeadCapacity; nullopt when it declares none.
  std::optional<HeadCapacity> head_capacity(const LayerContext& ctx) const { return impl_->head_capacity(ctx); }
  // The wrapped policy's device Select and the host state it reads (policy/device_select.hpp).
  DeviceSelect device_select(const LayerContext& ctx) const { return impl_->device_select(ctx); }
  HostStateRow host_state_row(const std::any& state, std::uint32_t head, std::uint32_t unfed_pages) const {
    return impl_->host_state_row(state, head, unfed_pages);
  }
  bool host_index_update_due(const std::any& state, std::uint32_t pending_tokens) const {
    return impl_->host_index_update_due(state, pending_tokens);
  }
  void host_summary_rows(const std::any& state, std::uint32_t head, HostSummaryRows& out) const {
    impl_->host_summary_rows(state, head, out);
  }
  // Token eviction (token_eviction.hpp). For policies that evict nothing:
  // false, no weights, an empty list per kv head, and no-ops.
  bool evicts_tokens() const { return impl_->evicts_tokens(); }
  bool needs_token_weights() const { return impl_->needs_token_weights(); }
  void evict(const LayerContext& ctx, const EvictionContext& e, std::any& state, Eviction& out) const {
    impl_->evict(ctx, e, state, out);
  }
  void placed(const LayerContext& ctx, std::uint32_t position, std::any& state) const {
    impl_->placed(ctx, position, state);
  }
  void observe(const LayerContext& ctx, const TokenWeights& w, std::any& state) const { impl_->observe(ctx, w, state); }
  // RewritesSummaries; a no-op for the policies without it.
  bool rewrites_summaries() const { return impl_->rewrites_summaries(); }
  void rewrite(const LayerContext& ctx, const RewrittenPage& page, std::any& state) const {
    impl_->rewrite(ctx, page, state);
  }

 private:
  struct Concept {
    virtual ~Concept() = default;
    virtual std::string_view name() const = 0;
    virtual RopeStage rope() const = 0;
    virtual bool has_custom_attend() const = 0;
    virtual bool may_regroup() const = 0;
    virtual bool index_reads_values() const = 0;
    virtual std::any make_state() const = 0;
    virtual std::vector<PartitionSpec> index(const LayerContext&, const KvView&, std::any&) const = 0;
    virtual bool forks_index() const = 0;
    virtual std::uint32_t reused_tokens(const LayerContext&, const std::any&) const = 0;
    virtual std::vector<PartitionSpec> fork_index(const LayerContext&, const std::any&, const KvView&,
                                                  std::any&) const = 0;
    virtual std::optional<Repartition> append(const LayerContext&, const AppendedPage&, std::any&) const = 0;
    virtual void select(const LayerContext&, const DecodeQuery&, const std::any&, Selection&) const = 0;
    virtual bool selects_by_head() const = 0;
    virtual void select_head(const LayerContext&, const DecodeQuery&, const std::any&, std::uint32_t,
                             std::vector<PartitionId>&) const = 0;
    virtual bool attends_by_head() const = 0;
    virtual void attend_head(const LayerContext&, const DecodeQuery&, const std::any&, std::uint32_t,
                             std::span<const PartitionId>, std::span<AttentionPartial>) const = 0;
    virtual void attend(const LayerContext&, const DecodeQuery&, const std::any&, const Selection&,
                        std::span<AttentionPartial>) const = 0;
    virtual std::uint32_t mandatory_pages(const LayerContext&) const = 0;
    virtual std::optional<HeadCapacity> head_capacity(const LayerContext&) const = 0;
    virtual DeviceSelect device_select(const LayerContext&) const = 0;
    virtual HostStateRow host_state_row(const std::any&, std::uint32_t, std::uint32_t) const = 0;
    virtual bool host_index_update_due(const std::any&, std::uint32_t) const = 0;
    virtual void host_summary_rows(const std::any&, std::uint32_t, HostSummaryRows&) const = 0;
    virtual bool evicts_tokens() const = 0;
    virtual bool needs_token_weights() const = 0;
    virtual void evict(const LayerContext&, const EvictionContext&, std::any&, Eviction&) const = 0;
    virtual void placed(const LayerContext&, std::uint32_t, std::any&) const = 0;
    virtual void observe(const LayerContext&, const TokenWeights&, std::any&) const = 0;
    virtual bool rewrites_summaries() const = 0;
    virtual void rewrite(const LayerContext&, const RewrittenPage&, std::any&) const = 0;
  };

  template <class P>
  struct Model final : Concept {
    using State = typename P::LayerState;
    explicit Model(P p) : policy(std::move(p)) {}
    std::string_view name() const override { return P::kName; }
    RopeStage rope() const override { return P::kRope; }
    bool has_custom_attend() const override { return CustomAttend<P>; }
    bool may_regroup() const override { return sparsekv::may_regroup(policy); }
    bool index_reads_values() const override { return sparsekv::index_reads_values(policy); }
    std::any make_state() const override { return State{}; }
    std::vector<PartitionSpec> index(const LayerContext& c, const KvView& kv, std::any& s) const override {
      return policy.index(c, kv, std::any_cast<State&>(s));
    }
    bool forks_index() const override { return ForksIndex<P>; }
    std::uint32_t reused_tokens(const LayerContext& c, const std::any& source) const override {
      return sparsekv::reused_tokens(policy, c, std::any_cast<const State&>(source));
    }
    std::vector<PartitionSpec> fork_index(const LayerContext& c, const std::any& source, const KvView& kv,
                                          std::any& s) const override {
      return sparsekv::fork_index(policy, c, std::any_cast<const State&>(source), kv, std::any_cast<State&>(s));
    }
    std::optional<Repartition> append(const LayerContext& c, const AppendedPage& p, std::any& s) const override {
      return policy.append(c, p, std::any_cast<State&>(s));
    }
    void select(const LayerContext& c, const DecodeQuery& q, const std::any& s, Selection& out) const override {
      policy.select(c, q, std::any_cast<const State&>(s), out);
    }
    bool selects_by_head() const override { return SelectsByHead<P>; }
    void select_head(const LayerContext& c, const DecodeQuery& q, const std::any& s, std::uint32_t head,
                     std::vector<PartitionId>& ids) const override {
      select_one_head(policy, c, q, std::any_cast<const State&>(s), head, ids);
    }
    bool attends_by_head() const override { return AttendsByHead<P>; }
    void attend_head(const LayerContext& c, const DecodeQuery& q, const std::any& s, std::uint32_t head,
                     std::span<const PartitionId> selected, std::span<AttentionPartial> extra) const override {
      attend_one_head(policy, c, q, std::any_cast<const State&>(s), head, selected, extra);
    }
    void attend(const LayerContext& c, const DecodeQuery& q, const std::any& s, const Selection& sel,
                std::span<AttentionPartial> extra) const override {
      if constexpr (CustomAttend<P>) policy.attend(c, q, std::any_cast<const State&>(s), sel, extra);
    }
    std::uint32_t mandatory_pages(const LayerContext& c) const override { return policy.mandatory_pages(c); }
    std::optional<HeadCapacity> head_capacity(const LayerContext& c) const override {
      return declared_head_capacity(policy, c);
    }
    DeviceSelect device_select(const LayerContext& c) const override { return sparsekv::device_select(policy, c); }
    HostStateRow host_state_row(const std::any& s, std::uint32_t head, std::uint32_t unfed) const override {
      return sparsekv::host_state_row(policy, std::any_cast<const State&>(s), head, unfed);
    }
    bool host_index_update_due(const std::any& s, std::uint32_t pending_tokens) const override {
      return sparsekv::host_index_update_due(policy, std::any_cast<const State&>(s), pending_tokens);
    }
    void host_summary_rows(const std::any& s, std::uint32_t head, HostSummaryRows& out) const override {
      sparsekv::host_summary_rows(policy, std::any_cast<const State&>(s), head, out);
    }
    bool evicts_tokens() const override { return EvictsTokens<P>; }
    bool needs_token_weights() const override { return sparsekv::needs_token_weights(policy); }
    void evict(const LayerContext& c, const EvictionContext& e, std::any& s, Eviction& out) const override {
      evict_tokens(policy, c, e, std::any_cast<State&>(s), out);
    }
    void placed(const LayerContext& c, std::uint32_t position, std::any& s) const override {
      token_placed(policy, c, position, std::any_cast<State&>(s));
    }
    void observe(const LayerContext& c, const TokenWeights& w, std::any& s) const override {
      observe_weights(policy, c, w, std::any_cast<State&>(s));
    }
    bool rewrites_summaries() const override { return RewritesSummaries<P>; }
    void rewrite(const LayerContext& c, const RewrittenPage& page, std::any& s) const override {
      rewrite_summary(policy, c, page, std::any_cast<State&>(s));
    }
    P policy;
  };

  std::shared_ptr<const Concept> impl_;
};

// The step's calls (sparse_attention.hpp, token_eviction.hpp, device_select.hpp)
// on a policy chosen at run time: one virtual call each.
inline std::any make_layer_state(const AnyPolicy& p) { return p.make_state(); }
inline std::string_view policy_name(const AnyPolicy& p) { return p.name(); }
inline bool forks_index(const AnyPolicy& p) { return p.forks_index(); }
inline std::uint32_t reused_tokens(const AnyPolicy& p, const LayerContext& ctx, const std::any& source) {
  return p.reused_tokens(ctx, source);
}
inline std::vector<PartitionSpec> fork_index(const AnyPolicy& p, const LayerContext& ctx, const std::any& source,
                                             const KvView& kv, std::any& state) {
  return p.fork_index(ctx, source, kv, state);
}
inline bool has_custom_attend(const AnyPolicy& p) { return p.has_custom_attend(); }
inline bool may_regroup(const AnyPolicy& p) { return p.may_regroup(); }
inline bool index_reads_values(const AnyPolicy& p) { return p.index_reads_values(); }
inline void custom_attend(const AnyPolicy& p, const LayerContext& ctx, const DecodeQuery& q, const std::any& state,
                          const Selection& selection, std::span<AttentionPartial> extra) {
  p.attend(ctx, q, state, selection, extra);
}
inline bool selects_by_head(const AnyPolicy& p) { return p.selects_by_head(); }
inline void select_one_head(const AnyPolicy& p, const LayerContext& ctx, const DecodeQuery& q, const std::any& state,
                            std::uint32_t head, std::vector<PartitionId>& ids) {
  p.select_head(ctx, q, state, head, ids);
}
inline bool attends_by_head(const AnyPolicy& p) { return p.attends_by_head(); }
inline void attend_one_head(const AnyPolicy& p, const LayerContext& ctx, const DecodeQuery& q, const std::any& state,
                            std::uint32_t head, std::span<const PartitionId> selected,
                            std::span<AttentionPartial> extra) {
  p.attend_head(ctx, q, state, head, selected, extra);
}
inline std::optional<HeadCapacity> declared_head_capacity(const AnyPolicy& p, const LayerContext& ctx) {
  return p.head_capacity(ctx);
}
inline bool evicts_tokens(const AnyPolicy& p) { return p.evicts_tokens(); }
inline bool needs_token_weights(const AnyPolicy& p) { return p.needs_token_weights(); }
inline void token_placed(const AnyPolicy& p, const LayerContext& ctx, std::uint32_t position, std::any& state) {
  p.placed(ctx, position, state);
}
inline void observe_weights(const AnyPolicy& p, const LayerContext& ctx, const TokenWeights& w, std::any& state) {
  p.observe(ctx, w, state);
}
inline void evict_tokens(const AnyPolicy& p, const LayerContext& ctx, const EvictionContext& e, std::any& state,
                         Eviction& out) {
  p.evict(ctx, e, state, out);
}
inline DeviceSelect device_select(const AnyPolicy& p, const LayerContext& ctx) { return p.device_select(ctx); }
inline HostStateRow host_state_row(const AnyPolicy& p, const std::any& state, std::uint32_t head,
                                   std::uint32_t unfed_pages) {
  return p.host_state_row(state, head, unfed_pages);
}
inline bool host_index_update_due(const AnyPolicy& p, const std::any& state, std::uint32_t pending_tokens) {
  return p.host_index_update_due(state, pending_tokens);
}
inline void host_summary_rows(const AnyPolicy& p, const std::any& state, std::uint32_t head, HostSummaryRows& out) {
  p.host_summary_rows(state, head, out);
}

}  // namespace sparsekv
