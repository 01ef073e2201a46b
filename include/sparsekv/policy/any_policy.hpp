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
    P policy;
  };

  std::shared_ptr<const Concept> impl_;
};

// Built-in policies by name: dense, streaming, quest, shadowkv, retroinfer,
// retroinfer_no_estimation (RetroInfer without its estimation zone) and
// oracle (the best selection of the budget's size, for evaluation). Every
// other knob keeps its paper default. Throws invalid_argument for an unknown
// name or a budget of 0 (dense ignores the budget).
AnyPolicy make_policy(std::string_view name, std::uint32_t budget_tokens);
// The names make_policy accepts.
std::vector<std::string> policy_names();

}  // namespace sparsekv

namespace sparsekv {
inline DeviceSelectSpec device_select(const AnyPolicy& p, const LayerContext& ctx) { return p.device_select(ctx); }
}  // namespace sparsekv
