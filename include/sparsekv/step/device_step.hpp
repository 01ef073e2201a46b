#pragma once
// DeviceStep: prefill and decode steps on device tensors for a policy with a
// device Select (docs/device-decode.md). The host's part of each call --
// checks, the StepPlan against the pools, the buffer's bookkeeping of tails
// and saves, the new table entries -- runs here without reading device data;
// the DeviceRuntime (device_runtime.hpp) enqueues everything else on the
// engine's stream.
//
// A policy whose device Select reads its host state (RetroInfer: its
// clustering stays on the host) learns of its decode pages only at its index
// updates: a step whose page reaches one first waits for the device, feeds
// the state the pages saved since the last update and this one, and sizes the
// regroup against the pools; once the step is enqueued it applies the regroup
// to the tables and the summary store (docs/device-decode.md, "RetroInfer").
#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <utility>
#include <vector>

#include "sparsekv/core/error.hpp"
#include "sparsekv/policy/device_select.hpp"
#include "sparsekv/step/device_runtime.hpp"
#include "sparsekv/step/layer_state.hpp"
#include "sparsekv/step/prefill.hpp"
#include "sparsekv/step/step_plan.hpp"
#include "sparsekv/step/step_scope.hpp"

namespace sparsekv {

// Whether every layer's policy selects on the device (policy/device_select.hpp).
template <class Policy>
bool selects_on_device_in_every_layer(const StepScope<Policy>& scope) {
  for (std::uint32_t l = 0; l < scope.shape->layers; ++l) {
    if (!device_select(*scope.policy, scope.context(l, scope.config->max_context_tokens)).on_device()) {
      return false;
    }
  }
  return true;
}

// The fixed capacities of a device runtime for `scope`: a batch names distinct
// requests (at most max_requests), every head holds at most
// `max_partitions_per_head` partitions and a selection covers at most
// `max_pages_per_head` pages, and the selection arrays hold the largest
// selection of any layer. Throws invalid_argument naming a layer whose policy
// has no device Select.
template <class Policy>
DeviceRuntimeSetup device_runtime_setup(const StepScope<Policy>& scope, std::uint32_t max_partitions_per_head,
                                        std::uint32_t max_pages_per_head) {
  const Config& config = *scope.config;
  DeviceRuntimeSetup setup;
  setup.shape = *scope.shape;
  setup.page_tokens = config.page_tokens;
  setup.max_batch = config.max_requests;
  setup.max_requests = config.max_requests;
  setup.max_partitions_per_head = max_partitions_per_head;
  setup.max_pages_per_head = max_pages_per_head;
  setup.timestamp_buckets = config.timestamp_buckets;
  setup.scale = scope.scale();
  for (std::uint32_t l = 0; l < scope.shape->layers; ++l) {
    const DeviceSelect select = device_select(*scope.policy, scope.context(l, config.max_context_tokens));
    if (!select.on_device()) {
      fail(ErrorCode::invalid_argument,
           "policy {} has no device Select in layer {} (policy/device_select.hpp); use the host-tensor API",
           policy_name(*scope.policy), l);
    }
    setup.select = select;
    setup.max_selected_per_head =
        std::max(setup.max_selected_per_head, select.capacity(max_partitions_per_head, config.page_tokens));
  }
  return setup;
}

template <class Policy>
class DeviceStep {
 public:
  using State = typename Policy::LayerState;
  // One batch entry: the request, its step state in the layer, and its table
  // slot (the row of its device tables and summaries).
  struct Entry {
    RequestId request = 0;
    LayerStepState<State>* state = nullptr;
    std::uint32_t slot = 0;
  };

  DeviceStep(const StepScope<Policy>& scope, DeviceRuntime& runtime) : scope_(scope), runtime_(runtime) {}

  // Index on the device (the policy's summaries, written where the device
  // Select reads them) and Offload through the staged D2H path
  // (DeviceRuntime::offload_prompt; SparseServe §3.2.2 FlashD2H, §3.4
  // layer-segmented prefill): the layer's K/V leave HBM once, into pinned
  // staging, and host workers scatter them into the CPU pages; no copy of the
  // layer stays on the GPU and none is made in pageable host memory. The
  // partitions are one page each, known from the token count; the host
  // policy state is not indexed, since with device tensors no call reads it.
  // A policy that clusters on the host instead has the prompt copied down
  // once, indexed and offloaded as on the host path, and its summaries
  // uploaded. Non-finite K/V is refused first, changing nothing.
  void prefill(const Entry& e, std::uint32_t layer, const void* k, const void* v, std::uint32_t tokens, void* stream) {
    using Clock = std::chrono::steady_clock;
    const std::uint64_t row = scope_.kv_row();
    const std::uint32_t head_dim = scope_.shape->head_dim;
    for (const auto& [what, data] : {std::pair{"prefill k", k}, std::pair{"prefill v", v}}) {
      const std::uint64_t bad = runtime_.first_non_finite(data, tokens * row, stream);
      if (bad != DeviceRuntime::kNoNonFinite) {
        fail(ErrorCode::invalid_argument, "{} of request {}: token {} kv head {} (dim {}) is not finite", what,
             e.request, bad / row, bad % row / head_dim, bad % head_dim);
      }
    }
    if (device_select(*scope_.policy, scope_.context(layer, tokens)).reads_host_state()) {
      const std::size_t bytes = tokens * row * dtype_size(scope_.shape->dtype);
      prompt_k_.resize(bytes);
      prompt_v_.resize(bytes);
      scope_.backend->copy_to_host(prompt_k_.data(), k, bytes, stream);
      scope_.backend->copy_to_host(prompt_v_.data(), v, bytes, stream);
      scope_.to_float(prompt_k_.data(), tokens * row, keys_);
      scope_.to_float(prompt_v_.data(), tokens * row, values_);
      index_and_offload(scope_, e.request, layer, *e.state, prompt_k_.data(), prompt_v_.data(), keys_, values_, tokens);
      upload_summary_rows(e, layer, stream);
      runtime_.upload_tables(e.request);
      return;
    }
    const PartitionSpec spec = PartitionSpec::uniform(tokens, scope_.config->page_tokens);
    const auto t0 = Clock::now();
    scope_.buffer->offloader().offload_on_device(e.request, layer, tokens, std::span(&spec, 1), placements_);
    runtime_.offload_prompt(k, v, placements_, stream);
    const auto t1 = Clock::now();
    runtime_.index_prompt(e.slot, layer, k, tokens, stream);
    runtime_.upload_tables(e.request);
    scope_.stats->offload_s += std::chrono::duration<double>(t1 - t0).count();
    scope_.stats->index_s += std::chrono::duration<double>(Clock::now() - t1).count();
    e.state->prefilled = true;
  }

  // One layer's step of checked entries on device tensors: q [batch][q_heads][head_dim]
  // and k_new / v_new [batch][kv_heads][head_dim] in the model dtype, out
  // [batch][q_heads][head_dim] fp32 (null: the step stops at the plan,
  // DeviceRuntime::plan()). Everything is checked before anything changes;
  // returns once the step is enqueued on `stream`.
  void decode(std::span<const Entry> batch, std::uint32_t layer, const void* q, const void* k_new, const void* v_new,
              float* out, void* stream);

 private:
  using Clock = std::chrono::steady_clock;
  static double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }
  void prepare(std::span<const Entry> batch, std::uint32_t layer, const DeviceSelect& select, const void* k_new,
               const void* v_new, void* stream);
  void feed_pages(std::span<const Entry> batch, std::size_t b, std::uint32_t layer, const void* k_new,
                  const void* v_new, void* stream);
  // The host state's summaries of every kv head of (request, layer) into the device store.
  void upload_summary_rows(const Entry& e, std::uint32_t layer, void* stream) {
    for (std::uint32_t h = 0; h < scope_.shape->kv_heads; ++h) {
      host_summary_rows(*scope_.policy, e.state->policy, h, summary_rows_);
      runtime_.write_summary_rows(e.slot, layer, h, summary_rows_, stream);
    }
  }

  StepScope<Policy> scope_;
  DeviceRuntime& runtime_;
  StepPlan<State> step_plan_;
  // The host's part of a step, [batch] or [rows] (DeviceStepInput).
  std::vector<std::uint32_t> request_slots_, tail_slots_, tail_tokens_, candidates_;
  std::vector<PageId> tail_pages_, save_pages_;
  std::vector<std::size_t> instances_;
  std::vector<HostStateRow> host_state_rows_;
  std::vector<TokenPlacement> placements_;      // a device prompt's rows in the CPU tier
  std::vector<std::byte> prompt_k_, prompt_v_;  // a prompt or step's K / V, come down
  std::vector<float> keys_, values_;
  std::vector<std::byte> page_bytes_;  // one page of an index update
  std::vector<PageId> cpu_pages_;
  HostSummaryRows summary_rows_;
};

// The plan: each entry whose tail fills saves it (the saves run with the
// step), and a host-state policy whose update is due is fed first and sized
// for its regroup (applied once the step is enqueued, in batch order).
template <class Policy>
void DeviceStep<Policy>::prepare(std::span<const Entry> batch, std::uint32_t layer, const DeviceSelect& select,
                                 const void* k_new, const void* v_new, void* stream) {
  const TieredKVBuffer& buffer = *scope_.buffer;
  const std::uint32_t page_tokens = scope_.config->page_tokens;
  step_plan_.begin(batch.size());
  bool synced = false;
  for (std::size_t b = 0; b < batch.size(); ++b) {
    const Entry& e = batch[b];
    PlannedEntry<State>& next = step_plan_.entry(b);
    next.saves = buffer.tails().tail_tokens(e.request, layer) + 1 == page_tokens;
    if (!next.saves) continue;
    const LayerStepState<State>& ls = *e.state;
    SaveDemand demand;
    if (select.reads_host_state() &&
        host_index_update_due(*scope_.policy, ls.policy, (ls.unfed_pages + 1) * page_tokens)) {
      if (runtime_.capturing(stream)) {
        fail(ErrorCode::failed_precondition,
             "decode: request {} layer {} reaches its policy's index update, which waits for the device: "
             "this step cannot be captured into a CUDA graph",
             e.request, layer);
      }
      if (!std::exchange(synced, true)) runtime_.synchronize();  // the unfed pages' saves and the tail
      feed_pages(batch, b, layer, k_new, v_new, stream);
      demand = next.regroup
                   ? buffer.tails().save_demand(e.request, layer, next.regroup->first_partitions, next.regroup->specs)
                   : buffer.tails().save_demand(e.request, layer);
    } else {
      demand = buffer.tails().save_demand(e.request, layer);
    }
    step_plan_.add_save(e.request, demand, next.regroup.has_value());
  }
  // Every save precedes the regroups, applied once the step is enqueued.
  step_plan_.check(buffer, CommitOrder::saves_first);
}

template <class Policy>
void DeviceStep<Policy>::decode(std::span<const Entry> batch, std::uint32_t layer, const void* q, const void* k_new,
                                const void* v_new, float* out, void* stream) {
  runtime_.check_values(stream);
  const DeviceSelect select = device_select(*scope_.policy, scope_.context(layer, scope_.config->max_context_tokens));
  prepare(batch, layer, select, k_new, v_new, stream);

  TieredKVBuffer& buffer = *scope_.buffer;
  const std::uint32_t kv_heads = scope_.shape->kv_heads;
  const bool host_state = select.reads_host_state();
  const auto t0 = Clock::now();
  const std::size_t rows = batch.size() * kv_heads;
  request_slots_.resize(batch.size());
  tail_slots_.resize(batch.size());
  tail_tokens_.resize(rows);
  candidates_.resize(rows);
  tail_pages_.resize(rows);
  save_pages_.assign(rows, kInvalidPage);
  instances_.resize(rows);
  host_state_rows_.assign(host_state ? rows : 0, HostStateRow{});
  for (std::size_t b = 0; b < batch.size(); ++b) {
    const Entry& e = batch[b];
    request_slots_[b] = e.slot;
    for (std::uint32_t h = 0; h < kv_heads; ++h) {
      const std::size_t r = b * kv_heads + h;
      candidates_[r] =
          buffer.tiers().table.partition_count(e.request, layer, h);  // Select sees the state before the save
      instances_[r] = buffer.tiers().table.instance(e.request, layer, h);
      tail_pages_[r] = buffer.tails().tail_page(e.request, layer, h);
      if (host_state) host_state_rows_[r] = host_state_row(*scope_.policy, e.state->policy, h, e.state->unfed_pages);
    }
    const auto slot = buffer.tails().append_on_device(e.request, layer,
                                                      std::span<PageId>(save_pages_).subspan(b * kv_heads, kv_heads));
    tail_slots_[b] = slot.tail_slot;
    // A filled page is saved but still whole in the tail page: this step's tail.
    std::fill_n(tail_tokens_.begin() + b * kv_heads, kv_heads, slot.tail_slot + 1);
    if (slot.fills_tail) scope_.stats->pages_saved += kv_heads;
  }
  DeviceStepInput step;
  step.layer = layer;
  step.batch = static_cast<std::uint32_t>(batch.size());
  step.q = q;
  step.k_new = k_new;
  step.v_new = v_new;
  step.out = out;
  step.stream = stream;
  step.select = select;
  step.request_slots = request_slots_;
  step.tail_slots = tail_slots_;
  step.tail_pages = tail_pages_;
  step.tail_tokens = tail_tokens_;
  step.candidates = candidates_;
  step.save_pages = save_pages_;
  step.instances = instances_;
  step.host_state_rows = host_state_rows_;
  runtime_.step(step);
  // The host state after the step: fed (and regrouped), or one page behind.
  for (std::size_t b = 0; b < batch.size() && host_state; ++b) {
    PlannedEntry<State>& next = step_plan_.entry(b);
    LayerStepState<State>& ls = *batch[b].state;
    if (!next.saves) continue;
    if (!next.feeds) {
      ++ls.unfed_pages;
      continue;
    }
    ls.policy = std::move(next.state);
    ls.unfed_pages = 0;
    if (next.regroup) {
      runtime_.download_tables(batch[b].request);  // waits for the step
      buffer.regrouper().repartition(batch[b].request, layer, next.regroup->first_partitions, next.regroup->specs);
      runtime_.upload_tables(batch[b].request);
      upload_summary_rows(batch[b], layer, stream);
    }
  }
  scope_.stats->decode_steps += batch.size();
  scope_.stats->append_s += seconds(Clock::now() - t0);  // host time to plan and enqueue the whole step
}

// Feeds batch entry b's state copy (the plan's) the decode pages saved since
// its last index update, read from the CPU tier, then the page this step
// fills: the device tail page's tokens and k_new / v_new of the entry. The
// device must be idle (the saves and the tail complete). The last page's
// append returns the policy's regroup, checked as the host step checks it;
// an earlier page asking for one is a policy bug.
template <class Policy>
void DeviceStep<Policy>::feed_pages(std::span<const Entry> batch, std::size_t b, std::uint32_t layer, const void* k_new,
                                    const void* v_new, void* stream) {
  const Policy& policy = *scope_.policy;
  const TieredKVBuffer& buffer = *scope_.buffer;
  const ModelShape& shape = *scope_.shape;
  const RequestId id = batch[b].request;
  const LayerStepState<State>& ls = *batch[b].state;
  PlannedEntry<State>& next = step_plan_.entry(b);
  next.feeds = true;
  next.state = ls.policy;
  const PageLayout layout = scope_.layout();
  const std::uint32_t page = scope_.config->page_tokens;
  const std::size_t row = scope_.kv_row();
  const std::size_t elem = dtype_size(shape.dtype);
  std::vector<std::byte>& bytes = page_bytes_;
  next.page_k.resize(page * row);
  next.page_v.resize(page * row);
  // Head h's rows of one page (its bytes in `bytes`), tokens [0, n), into the page's floats.
  const auto unpack = [&](std::uint32_t h, std::uint32_t n) {
    for (std::uint32_t t = 0; t < n; ++t) {
      for (std::uint32_t i = 0; i < shape.head_dim; ++i) {
        const std::size_t at = t * row + std::size_t{h} * shape.head_dim + i;
        next.page_k[at] = load_element(bytes.data() + layout.k_offset(t), i, shape.dtype);
        next.page_v[at] = load_element(bytes.data() + layout.v_offset(t), i, shape.dtype);
      }
    }
  };
  const std::uint32_t saved = buffer.admission().sequence_length(id, layer) - buffer.tails().tail_tokens(id, layer);
  AppendedPage appended;
  appended.partitions.resize(shape.kv_heads);
  for (std::uint32_t u = 0; u <= ls.unfed_pages; ++u) {
    const bool last = u == ls.unfed_pages;
    for (std::uint32_t h = 0; h < shape.kv_heads; ++h) {
      const PartitionId p = buffer.tiers().table.partition_count(id, layer, h) - ls.unfed_pages + u;
      appended.partitions[h] = p;
      bytes.resize(layout.page_bytes());
      if (!last) {
        cpu_pages_.clear();
        buffer.tiers().table.cpu_pages(id, layer, h, p, cpu_pages_);  // a decode page: one-page partition
        std::memcpy(bytes.data(), buffer.tiers().cpu_pool.data(cpu_pages_.at(0)), layout.page_bytes());
        unpack(h, page);
      } else {
        const std::byte* tail = buffer.tiers().gpu_pool.base() + std::size_t{buffer.tails().tail_page(id, layer, h)} *
                                                                     buffer.tiers().gpu_pool.page_bytes();
        scope_.backend->copy_to_host(bytes.data(), tail, layout.page_bytes(), stream);
        unpack(h, page - 1);
      }
    }
    if (last) {  // the token this step appends: row b of k_new / v_new
      bytes.resize(2 * row * elem);
      scope_.backend->copy_to_host(bytes.data(), static_cast<const std::byte*>(k_new) + b * row * elem, row * elem,
                                   stream);
      scope_.backend->copy_to_host(bytes.data() + row * elem, static_cast<const std::byte*>(v_new) + b * row * elem,
                                   row * elem, stream);
      for (std::size_t i = 0; i < row; ++i) {
        next.page_k[(page - 1) * row + i] = load_element(bytes.data(), static_cast<std::uint32_t>(i), shape.dtype);
        next.page_v[(page - 1) * row + i] =
            load_element(bytes.data() + row * elem, static_cast<std::uint32_t>(i), shape.dtype);
      }
      scope_.check_finite("decode k_new", id, std::span(next.page_k).subspan((page - 1) * row, row), saved + page - 1);
      scope_.check_finite("decode v_new", id, std::span(next.page_v).subspan((page - 1) * row, row), saved + page - 1);
    }
    const std::uint32_t tokens = saved - (ls.unfed_pages - u) * page + page;
    appended.page = KvView{next.page_k, next.page_v, page, shape.kv_heads, shape.head_dim, tokens - page};
    next.regroup = policy.append(scope_.context(layer, tokens), appended, next.state);
    if (next.regroup && !last) {
      fail(ErrorCode::failed_precondition, "policy {}: request {} layer {} regroups before its update was due",
           policy_name(policy), id, layer);
    }
  }
  if (next.regroup) {
    for (std::uint32_t h = 0; h < shape.kv_heads; ++h) {
      check_regroup(policy_name(policy), buffer.tiers().table, id, layer, h, shape.kv_heads, page, *next.regroup,
                    appended.partitions[h]);
    }
  }
}

}  // namespace sparsekv
