#pragma once
// HostStep: one decode step of (batch, layer) on host tensors, as phases an
// engine's threads can share (docs/design.md, "The way of a decode step";
// docs/integration.md, "Threads"):
//
//   begin(...)        serial   checks and converts the tensors, plans the step
//                              against the pools (StepPlan: each filling tail's
//                              save and the policy's regroup, on a copy of its
//                              state); changes nothing
//   select(ith, nth)  any      Select (and a policy's own Attend term) for the
//                              units [ith * n / nth, (ith + 1) * n / nth): one
//                              unit per (request, kv head) for a policy that
//                              selects by head, else per request
//   commit()          serial   reports the first failed Select unit, checks the
//                              selections, then commits: append, Retrieve, the
//                              policy's page and regroup, and the attend plan
//   attend(ith, nth)  any      Attend chunks [ith * n / nth, ...) of a backend
//                              that attends on the host (SplitPlanAttention);
//                              a row's last chunk to run merges the row's
//                              chunks by log-sum-exp in a fixed order
//   finish()          serial   writes the outputs (or runs the backend's
//                              Attend), then an evicting policy's decisions
//                              (evicting_step.hpp)
//
// Units and chunks depend on the batch and the plan, never on nth or the order
// the slices run in, so every output, selection and table is bit-identical to
// the serial call (run() without an executor). select() and attend() read
// only what begin() and commit() left and each writes only its own units'
// results; they throw nothing (a Select error waits for commit()). Between
// phases the caller's threads must be synchronised (a barrier): the phases
// happen-before each other. Until finish() returns, no other call may be made
// on the Manager that began the step.
#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <span>
#include <utility>
#include <vector>

#include "sparsekv/attention/attend_plan.hpp"
#include "sparsekv/attention/split_plan_attention.hpp"
#include "sparsekv/core/error.hpp"
#include "sparsekv/step/evicting_step.hpp"
#include "sparsekv/step/layer_state.hpp"
#include "sparsekv/step/step_executor.hpp"
#include "sparsekv/step/step_plan.hpp"
#include "sparsekv/step/step_scope.hpp"

namespace sparsekv {

// Appends the runs of kv head `head` of a retrieval (its pages as
// Retrieval::for_each_page lists them; `pages` and `tokens` are scratch) to
// the plan and returns how many: the host plan rule, the reference of the
// device one (attention/attend_plan_cuda.hpp).
inline std::int64_t append_head_runs(AttendPlan& plan, const Retrieval& r, std::uint32_t head,
                                     std::uint32_t page_tokens, std::vector<PageId>& pages,
                                     std::vector<std::uint32_t>& tokens) {
  pages.clear();
  tokens.clear();
  r.for_each_page(head, page_tokens, [&](PageId page, std::uint32_t n) {
    pages.push_back(page);
    tokens.push_back(n);
  });
  return append_runs(plan, pages, tokens, page_tokens);
}

template <class Policy>
class HostStep {
 public:
  using State = typename Policy::LayerState;
  using Entry = HostStepEntry<State>;

  explicit HostStep(const StepScope<Policy>& scope) : scope_(scope), evicting_(scope) {}

  // ---- The phases ----------------------------------------------------------
  // q [batch][q_heads][head_dim], k_new / v_new [batch][kv_heads][head_dim] in
  // the model dtype, out [batch][q_heads][head_dim] fp32 or null (the step
  // stops at the plan: plan()). The entries are valid, distinct requests
  // (the Manager checked them); the tensors stay the caller's until finish().
  // Throws, changing nothing: invalid_argument (a non-finite value),
  // resource_exhausted (the pools), failed_precondition (a malformed regroup),
  // or what the policy's append throws.
  void begin(std::span<const Entry> batch, std::uint32_t layer, const void* q, const void* k_new, const void* v_new,
             float* out);
  std::size_t select_units() const noexcept { return phase_ == Phase::begun ? select_units_ : 0; }
  void select(std::size_t ith, std::size_t nth) noexcept;
  // Throws failed_precondition when a select() slice did not run, then what
  // a Select unit threw (the first in unit order) or a bad selection's
  // invalid_argument, changing nothing; the step is then over.
  void commit();
  std::size_t attend_units() const noexcept { return phase_ == Phase::committed && split_ ? attention_.chunks() : 0; }
  void attend(std::size_t ith, std::size_t nth) noexcept;
  void finish();

  // After begin(): the rest of the step, its parallel phases through
  // `executor` when given (else on this thread).
  void run(const StepExecutor* executor);

  // After commit(), until the next commit(): the attend plan and what each
  // entry of the batch retrieved.
  const AttendPlan& plan() const noexcept { return plan_; }
  std::span<const Retrieval> retrievals() const noexcept { return retrievals_; }

 private:
  using Clock = std::chrono::steady_clock;
  enum class Phase : std::uint8_t { idle, begun, committed };
  static double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }
  void require(Phase phase, const char* call) const {
    if (phase_ != phase) fail(ErrorCode::failed_precondition, "decode step: {} out of its phase order", call);
  }
  void prepare_saves();
  // The page entry `next` saves as the policy sees it, `tokens` in the
  // sequence once it is saved.
  AppendedPage appended_page(const PlannedEntry<State>& next, std::uint32_t tokens) const {
    const ModelShape& shape = *scope_.shape;
    const std::uint32_t pt = scope_.config->page_tokens;
    return {KvView{next.page_k, next.page_v, pt, shape.kv_heads, shape.head_dim, tokens - pt}, next.partitions};
  }
  void select_unit(std::size_t unit);
  void commit_selections();
  void build_plan();
  static std::pair<std::size_t, std::size_t> slice(std::size_t n, std::size_t ith, std::size_t nth) noexcept {
    return {n * ith / nth, n * (ith + 1) / nth};
  }
  std::span<const float> new_k(std::size_t b) const {
    return std::span(keys_).subspan(b * scope_.kv_row(), scope_.kv_row());
  }
  std::span<const float> new_v(std::size_t b) const {
    return std::span(values_).subspan(b * scope_.kv_row(), scope_.kv_row());
  }

  StepScope<Policy> scope_;
  EvictingStep<Policy> evicting_;
  Phase phase_ = Phase::idle;
  // The step as begun.
  std::vector<Entry> entries_;
  std::uint32_t layer_ = 0;
  const void* k_new_ = nullptr;
  const void* v_new_ = nullptr;
  float* out_ = nullptr;
  bool evicts_ = false;
  std::vector<float> queries_, keys_, values_;  // the step's tensors in fp32
  StepPlan<State> step_plan_;
  // Select.
  bool by_head_ = false;
  std::size_t select_units_ = 0;
  std::vector<LayerContext> contexts_;  // per entry, as Select sees it
  std::vector<std::uint32_t> positions_;
  std::vector<Selection> selections_;
  std::vector<AttentionPartial> extra_;     // a policy's own Attend terms, [batch][q_heads]
  std::vector<std::exception_ptr> errors_;  // per Select unit
  std::vector<char> selected_;              // per Select unit: it ran
  // Commit and Attend.
  std::vector<Retrieval> retrievals_;
  AttendPlan plan_;
  std::vector<PageId> plan_pages_;  // one row's pages while building plan_
  std::vector<std::uint32_t> plan_tokens_;
  AttendCall call_;
  bool split_ = false;  // Attend in chunks on the caller's threads (Backend::attends_on_host)
  SplitPlanAttention attention_;
  std::vector<float> slot_weights_;  // the Attend weights of a policy that reads them
  // Phase timing (StepStats).
  double planned_s_ = 0;
  Clock::time_point begun_at_, committed_at_;
};

template <class Policy>
void HostStep<Policy>::begin(std::span<const Entry> batch, std::uint32_t layer, const void* q, const void* k_new,
                             const void* v_new, float* out) {
  phase_ = Phase::idle;  // a step left unfinished by an error is over
  const Policy& policy = *scope_.policy;
  TieredKVBuffer& buffer = *scope_.buffer;
  const std::size_t qd = scope_.q_row();
  if (!scope_.to_float(q, batch.size() * qd, queries_)) {
    const auto i = static_cast<std::size_t>(
        std::find_if(queries_.begin(), queries_.end(), [](float x) { return !is_finite(x); }) - queries_.begin());
    fail(ErrorCode::invalid_argument, "decode: q value {} of request {} is not finite", i % qd, batch[i / qd].request);
  }
  scope_.rescale_queries(queries_);
  const bool k_finite = scope_.to_float(k_new, batch.size() * scope_.kv_row(), keys_);
  const bool v_finite = scope_.to_float(v_new, batch.size() * scope_.kv_row(), values_);
  for (std::size_t b = 0; !(k_finite && v_finite) && b < batch.size(); ++b) {  // finds the first, and throws
    const std::uint32_t position = buffer.admission().sequence_length(batch[b].request, layer);
    scope_.check_finite("decode k_new", batch[b].request, new_k(b), position);
    scope_.check_finite("decode v_new", batch[b].request, new_v(b), position);
  }
  scope_.as_stored(keys_);  // the policy sees the token as its page will hold it
  scope_.as_stored(values_);
  const auto t0 = Clock::now();
  entries_.assign(batch.begin(), batch.end());
  layer_ = layer;
  k_new_ = k_new;
  v_new_ = v_new;
  out_ = out;
  evicts_ = evicts_tokens(policy);
  step_plan_.begin(batch.size());
  select_units_ = 0;
  errors_.clear();
  selected_.clear();
  extra_.clear();
  if (evicts_) {
    evicting_.prepare(entries_, layer, step_plan_);
  } else {
    prepare_saves();
    // Select (and a custom Attend) on each request's state as it stands, before
    // this token's page joins it: the token is in the tail, which is always
    // attended, so whatever the policy and its budget select, the token takes
    // part.
    const std::uint32_t kv_heads = scope_.shape->kv_heads;
    const bool custom = has_custom_attend(policy);
    by_head_ = selects_by_head(policy) && (!custom || attends_by_head(policy));
    selections_.resize(batch.size());
    contexts_.resize(batch.size());
    positions_.resize(batch.size());
    for (std::size_t b = 0; b < batch.size(); ++b) {
      const RequestId id = batch[b].request;
      selections_[b].reset(kv_heads);
      positions_[b] = buffer.admission().sequence_length(id, layer);
      contexts_[b] = scope_.context(layer, positions_[b] - buffer.tails().tail_tokens(id, layer));
    }
    if (custom) extra_.assign(batch.size() * scope_.shape->q_heads, AttentionPartial(scope_.shape->head_dim));
    select_units_ = by_head_ ? batch.size() * kv_heads : batch.size();
    errors_.assign(select_units_, nullptr);
    selected_.assign(select_units_, 0);
  }
  // Counted only for a step that commits.
  planned_s_ = seconds(Clock::now() - t0);
  begun_at_ = Clock::now();
  phase_ = Phase::begun;
}

// A request whose tail this token fills shows the full page to a policy that
// may regroup on a copy of its state; the page save plus any regroup the
// policy asks for are planned against the pools. A policy that never regroups
// (kRegroups) sees the page at commit, on its own state: no copy of every
// summary per page.
template <class Policy>
void HostStep<Policy>::prepare_saves() {
  const Policy& policy = *scope_.policy;
  const TieredKVBuffer& buffer = *scope_.buffer;
  const ModelShape& shape = *scope_.shape;
  const std::uint32_t page_tokens = scope_.config->page_tokens;
  for (std::size_t b = 0; b < entries_.size(); ++b) {
    const RequestId id = entries_[b].request;
    const LayerStepState<State>& ls = *entries_[b].state;
    PlannedEntry<State>& next = step_plan_.entry(b);
    next.saves = buffer.tails().tail_tokens(id, layer_) + 1 == page_tokens;
    if (!next.saves) continue;
    next.page_k = ls.recent_k;
    next.page_v = ls.recent_v;
    next.page_k.insert(next.page_k.end(), new_k(b).begin(), new_k(b).end());
    next.page_v.insert(next.page_v.end(), new_v(b).begin(), new_v(b).end());
    next.partitions.resize(shape.kv_heads);
    for (std::uint32_t h = 0; h < shape.kv_heads; ++h) {
      next.partitions[h] = buffer.tiers().table.partition_count(id, layer_, h);
    }
    if (!may_regroup(policy)) {
      // Nothing to size but the save: the policy sees the page at commit.
      next.appends_at_commit = true;
      step_plan_.add_save(id, buffer.tails().save_demand(id, layer_), false);
      continue;
    }
    const std::uint32_t tokens = buffer.admission().sequence_length(id, layer_) + 1;
    next.state = ls.policy;  // the policy commits to the page only if the step does
    next.regroup = policy.append(scope_.context(layer_, tokens), appended_page(next, tokens), next.state);
    SaveDemand demand;
    if (next.regroup) {
      for (std::uint32_t h = 0; h < shape.kv_heads; ++h) {
        check_regroup(policy_name(policy), buffer.tiers().table, id, layer_, h, shape.kv_heads, page_tokens,
                      *next.regroup, next.partitions[h]);
      }
      demand = buffer.tails().save_demand(id, layer_, next.regroup->first_partitions, next.regroup->specs);
    } else {
      demand = buffer.tails().save_demand(id, layer_);
    }
    step_plan_.add_save(id, demand, next.regroup.has_value());
  }
  // Commits run in batch order: a save takes its pages, then a regroup frees
  // its run's pages before it takes its own.
  step_plan_.check(buffer, CommitOrder::entry_by_entry);
}

template <class Policy>
void HostStep<Policy>::select(std::size_t ith, std::size_t nth) noexcept {
  if (phase_ != Phase::begun || nth == 0 || ith >= nth) return;
  const auto [first, end] = slice(select_units_, ith, nth);
  for (std::size_t u = first; u < end; ++u) {
    try {
      select_unit(u);
    } catch (...) {
      errors_[u] = std::current_exception();
    }
    selected_[u] = 1;
  }
}

template <class Policy>
void HostStep<Policy>::select_unit(std::size_t unit) {
  const Policy& policy = *scope_.policy;
  const std::uint32_t kv_heads = scope_.shape->kv_heads;
  const std::uint32_t q_heads = scope_.shape->q_heads;
  const std::size_t b = by_head_ ? unit / kv_heads : unit;
  const State& state = entries_[b].state->policy;
  const DecodeQuery query{std::span<const float>(queries_).subspan(b * scope_.q_row(), scope_.q_row()), positions_[b]};
  const std::span<AttentionPartial> extra =
      extra_.empty() ? std::span<AttentionPartial>{} : std::span(extra_).subspan(b * q_heads, q_heads);
  if (!by_head_) {
    policy.select(contexts_[b], query, state, selections_[b]);
    if (!extra.empty()) custom_attend(policy, contexts_[b], query, state, selections_[b], extra);
    return;
  }
  const auto h = static_cast<std::uint32_t>(unit % kv_heads);
  std::vector<PartitionId>& ids = selections_[b].partitions[h];
  select_one_head(policy, contexts_[b], query, state, h, ids);
  if (!extra.empty()) {
    const std::uint32_t group = q_heads / kv_heads;
    attend_one_head(policy, contexts_[b], query, state, h, ids, extra.subspan(std::size_t{h} * group, group));
  }
}

template <class Policy>
void HostStep<Policy>::commit() {
  require(Phase::begun, "commit()");
  phase_ = Phase::idle;  // whatever happens below, the step cannot be committed twice
  const auto t0 = Clock::now();
  if (std::find(selected_.begin(), selected_.end(), 0) != selected_.end()) {
    fail(ErrorCode::failed_precondition,
         "decode step: commit() before every select(ith, nth) slice ran (each ith in [0, nth) once)");
  }
  for (const std::exception_ptr& error : errors_) {
    if (error) std::rethrow_exception(error);
  }
  TieredKVBuffer& buffer = *scope_.buffer;
  if (!evicts_) {
    for (std::size_t b = 0; b < entries_.size(); ++b) {
      buffer.retriever().check_selection(entries_[b].request, layer_, selections_[b].partitions);
    }
  }
  // Nothing below refuses: the planning and Select time count only for a step that commits.
  StepStats& stats = *scope_.stats;
  stats.append_s += planned_s_;
  stats.select_s += seconds(t0 - begun_at_);
  retrievals_.resize(entries_.size());
  if (evicts_) {
    selections_.resize(entries_.size());
    evicting_.commit(entries_, layer_, k_new_, v_new_, step_plan_, selections_, retrievals_);
  } else {
    commit_selections();
  }
  for (std::size_t b = 0; b < entries_.size(); ++b) {
    stats.cache += retrievals_[b].stats;
    stats.pages_selected += retrievals_[b].pages.gpu_pages.size();
    for (const std::uint32_t n : retrievals_[b].token_counts) stats.tokens_selected += n;
    stats.pages_moved += retrievals_[b].pages.copies.size();
    stats.bytes_moved += retrievals_[b].pages.copies.size() * buffer.tiers().cpu_pool.page_bytes();
    ++stats.decode_steps;
  }
  const auto t1 = Clock::now();
  build_plan();
  split_ = false;
  if (out_ != nullptr) {
    call_ = AttendCall{};
    call_.plan = &plan_;
    call_.layout = scope_.layout();
    call_.batch = static_cast<std::uint32_t>(entries_.size());
    call_.q_heads = scope_.shape->q_heads;
    call_.kv_heads = scope_.shape->kv_heads;
    call_.scale = scope_.scale();
    call_.q = queries_.data();
    call_.out = out_;
    if (evicts_ && needs_token_weights(*scope_.policy)) {
      slot_weights_.resize(plan_.indices.size() * scope_.config->page_tokens);
      call_.slot_weights = slot_weights_.data();
    }
    split_ = scope_.backend->attends_on_host();
    if (split_) attention_.prepare(call_);
  }
  stats.attend_s += seconds(Clock::now() - t1);
  committed_at_ = Clock::now();
  phase_ = Phase::committed;
}

// Append, Retrieve, then (a full tail) the policy's page and regroup.
template <class Policy>
void HostStep<Policy>::commit_selections() {
  TieredKVBuffer& buffer = *scope_.buffer;
  StepStats& stats = *scope_.stats;
  const ModelShape& shape = *scope_.shape;
  const std::size_t row_bytes = scope_.kv_row() * dtype_size(shape.dtype);
  for (std::size_t b = 0; b < entries_.size(); ++b) {
    const RequestId id = entries_[b].request;
    LayerStepState<State>& ls = *entries_[b].state;
    PlannedEntry<State>& next = step_plan_.entry(b);
    const auto a0 = Clock::now();
    buffer.tails().append(id, layer_,
                          KvChunk{static_cast<const std::byte*>(k_new_) + b * row_bytes,
                                  static_cast<const std::byte*>(v_new_) + b * row_bytes, 1, shape.dtype});
    const auto r0 = Clock::now();
    buffer.retriever().retrieve(id, layer_, selections_[b].partitions, retrievals_[b]);
    const auto r1 = Clock::now();
    if (next.saves) {
      // The filled page is saved but still whole in the GPU tail page: it is
      // this step's tail, attended on top of the selection (which predates
      // it), at no GPU slot or copy. The next append starts the tail afresh.
      retrievals_[b].tail_tokens.assign(shape.kv_heads, scope_.config->page_tokens);
      if (next.regroup) buffer.regrouper().repartition(id, layer_, next.regroup->first_partitions, next.regroup->specs);
      if (next.appends_at_commit) {
        const std::uint32_t tokens = buffer.admission().sequence_length(id, layer_);
        scope_.policy->append(scope_.context(layer_, tokens), appended_page(next, tokens), ls.policy);
      } else {
        ls.policy = std::move(next.state);
      }
      ls.recent_k.clear();
      ls.recent_v.clear();
      stats.pages_saved += shape.kv_heads;  // one page per kv head, as BufferStats counts
    } else {
      ls.recent_k.insert(ls.recent_k.end(), new_k(b).begin(), new_k(b).end());
      ls.recent_v.insert(ls.recent_v.end(), new_v(b).begin(), new_v(b).end());
    }
    stats.append_s += seconds(r0 - a0) + seconds(Clock::now() - r1);
    stats.retrieve_s += seconds(r1 - r0);
  }
}

// The attend plan of the step's retrievals: per (entry, kv head) its pages
// cut into runs (append_runs), and the live masks of an evicting request's.
template <class Policy>
void HostStep<Policy>::build_plan() {
  const TieredKVBuffer& buffer = *scope_.buffer;
  const std::uint32_t page_tokens = scope_.config->page_tokens;
  plan_.clear();
  plan_.gpu_tier_base = buffer.tiers().gpu_pool.base();
  plan_.page_bytes = buffer.tiers().gpu_pool.page_bytes();
  for (std::size_t b = 0; b < entries_.size(); ++b) {
    const Retrieval& r = retrievals_[b];
    for (std::uint32_t h = 0; h < scope_.shape->kv_heads; ++h) {
      plan_.head_entries.push_back(plan_.head_entries.back() +
                                   append_head_runs(plan_, r, h, page_tokens, plan_pages_, plan_tokens_));
      if (!r.page_masks.empty()) {
        r.for_each_page_masked(h, page_tokens,
                               [&](PageId, std::uint32_t, SlotMask mask) { plan_.live_masks.push_back(mask); });
      }
    }
  }
  if (buffer.tiers().site == AttendSite::cpu_tier) {
    plan_.gpu_tier_base = nullptr;
    plan_.page_bytes = buffer.tiers().cpu_pool.page_bytes();
    plan_.page_data.reserve(plan_.indices.size());
    for (const std::int64_t page : plan_.indices) {
      plan_.page_data.push_back(buffer.tiers().cpu_pool.data(static_cast<PageId>(page)));
    }
  }
  plan_.extra = std::move(extra_);
  extra_.clear();
}

template <class Policy>
void HostStep<Policy>::attend(std::size_t ith, std::size_t nth) noexcept {
  if (phase_ != Phase::committed || !split_ || nth == 0 || ith >= nth) return;
  const auto [first, end] = slice(attention_.chunks(), ith, nth);
  attention_.run(first, end);
}

template <class Policy>
void HostStep<Policy>::finish() {
  require(Phase::committed, "finish()");
  phase_ = Phase::idle;
  if (out_ != nullptr) {
    if (split_) {
      if (!attention_.all_ran()) {
        fail(ErrorCode::failed_precondition,
             "decode step: finish() before every attend(ith, nth) slice ran (each ith in [0, nth) once); out is "
             "not written");
      }
      attention_.finish();
    } else {
      scope_.backend->attend(call_);
    }
  }
  if (evicts_) {
    const bool weighed = out_ != nullptr && call_.slot_weights != nullptr;
    evicting_.decide(entries_, layer_, retrievals_,
                     weighed ? std::span<const float>(slot_weights_) : std::span<const float>{});
  }
  scope_.stats->attend_s += seconds(Clock::now() - committed_at_);
}

template <class Policy>
void HostStep<Policy>::run(const StepExecutor* executor) {
  const auto phase = [&](std::size_t units, auto&& slice_fn) {
    if (units == 0) return;
    if (executor == nullptr || !*executor || units == 1) {
      slice_fn(0, 1);
    } else {
      (*executor)(units, [&](std::size_t i) { slice_fn(i, units); });
    }
  };
  phase(select_units(), [&](std::size_t i, std::size_t n) { select(i, n); });
  commit();
  phase(attend_units(), [&](std::size_t i, std::size_t n) { attend(i, n); });
  finish();
}

}  // namespace sparsekv
