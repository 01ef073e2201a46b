// The device-tensor API (step/device_runtime.hpp, docs/device-decode.md)
// proven in CI: a Manager on device tensors with the host emulation of the
// CUDA runtime (device_runtime_emulation.hpp: every launch replaced by its
// kernel's host emulation, in cuda/step/device_runtime.cpp's order) against
// a Manager on host tensors with HostBackend, same requests arriving and
// finishing at random over several layers, batches of varying size, tails
// filling across page boundaries. Every step: Select's partitions, hits /
// misses, the plan (LRU page ids, runs) identical; outputs within 2e-3; the
// device tables (the replica the LRU kernel owns) equal the host's; the saved
// CPU pages byte-equal. Planted mutations are caught. And bad input is
// refused with a clear sparsekv::Error before anything changes.
#include <catch2/catch.hpp>

#include <cmath>
#include <limits>
#include <cstring>
#include <map>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "device_decode_test_data.hpp"
#include "device_runtime_emulation.hpp"
#include "sparsekv/core/numeric.hpp"
#include "sparsekv/facade/manager.hpp"
#include "sparsekv/facade/manager_inspection.hpp"
#include "sparsekv/policy/dense.hpp"
#include "sparsekv/policy/quest.hpp"
#include "sparsekv/policy/retroinfer.hpp"
#include "sparsekv/policy/shadowkv.hpp"
#include "sparsekv/policy/streaming_window.hpp"
#include "test_support.hpp"

using namespace sparsekv;
using namespace sparsekv::test;

namespace {

// The emulated runtime's stream: a typed null, as the legacy default stream
// is (a bare nullptr would pick the host-tensor call).
const DeviceStream kStream{static_cast<void*>(nullptr)};

// Small tiers, so the LRU evicts and the GPU tier refuses late arrivals.
Config device_config() {
  Config c;
  c.page_tokens = 16;
  c.cpu_tier_bytes = std::size_t{16} << 20;
  c.gpu_tier_bytes = std::size_t{3} << 20;
  c.min_buffer_ratio = 1.5;
  c.max_requests = 6;
  c.max_context_tokens = 1024;
  c.host_chunk_bytes = std::size_t{1} << 20;
  return c;
}

// The host plan of a step's retrievals (HostStep::build_plan).
AttendPlan host_plan(const std::vector<const Retrieval*>& retrievals, std::uint32_t kv_heads,
                     std::uint32_t page_tokens) {
  AttendPlan plan;
  std::vector<PageId> pages;
  std::vector<std::uint32_t> tokens;
  for (const Retrieval* r : retrievals) {
    for (std::uint32_t h = 0; h < kv_heads; ++h) {
      plan.head_entries.push_back(plan.head_entries.back() + append_head_runs(plan, *r, h, page_tokens, pages, tokens));
    }
  }
  return plan;
}

// The first difference between the device step and the host step, or "".
template <class Policy>
std::string step_difference(const Manager<Policy>& host, const EmulatedDeviceRuntime& runtime, std::size_t batch,
                            std::uint32_t kv_heads, std::uint32_t page_tokens) {
  std::ostringstream why;
  std::vector<const Retrieval*> retrievals;
  for (std::size_t b = 0; b < batch; ++b) {
    const Retrieval& r = host.retrieval(b);
    retrievals.push_back(&r);
    CacheStepStats device;
    for (std::uint32_t h = 0; h < kv_heads; ++h) {
      const std::size_t row = b * kv_heads + h;
      const std::vector<PartitionId> want(r.partitions.begin() + r.head_offsets[h],
                                          r.partitions.begin() + r.head_offsets[h + 1]);
      if (runtime.selections()[row] != want) {
        why << "row " << row << ": Select chose " << runtime.selections()[row].size() << " partitions, the host "
            << want.size();
        return why.str();
      }
      device += runtime.row_stats()[row];
    }
    if (device.hit_partitions != r.stats.hit_partitions || device.miss_partitions != r.stats.miss_partitions ||
        device.hit_pages != r.stats.hit_pages || device.miss_pages != r.stats.miss_pages ||
        device.evicted_pages != r.stats.evicted_pages) {
      why << "entry " << b << ": hits / misses differ (device miss pages " << device.miss_pages << ", host "
          << r.stats.miss_pages << ")";
      return why.str();
    }
  }
  const AttendPlan want = host_plan(retrievals, kv_heads, page_tokens);
  const DeviceAttendPlan got = runtime.plan();
  if (runtime.plan_overflow_rows() != 0) return "the device plan overflowed a row";
  if (got.rows != batch * kv_heads) return "the device plan has another row count";
  const std::int64_t entries = got.head_entries[got.rows];
  if (!std::equal(want.head_entries.begin(), want.head_entries.end(), got.head_entries) ||
      entries != static_cast<std::int64_t>(want.entries()) ||
      !std::equal(want.indptr.begin(), want.indptr.end(), got.indptr) ||
      !std::equal(want.last_page_len.begin(), want.last_page_len.end(), got.last_page_len) ||
      !std::equal(want.indices.begin(), want.indices.end(), got.indices)) {
    return "the plans differ (GPU page ids or runs)";
  }
  return {};
}

// The device tables (the replica) equal the host manager's tables for every head of `id`.
template <class Policy>
std::string table_difference(const Manager<Policy>& host, const Manager<Policy>& device,
                             const EmulatedDeviceRuntime& runtime, RequestId id, const ModelShape& shape) {
  const PartitionLookup want = inspect_buffer(host).tiers().table.lookup();
  const PartitionLookup got = runtime.replica().lookup(inspect_buffer(device).tiers().table);
  const TwoLevelView<GpuPageEntry> want_slots = inspect_buffer(host).tiers().table.gpu_page_view();
  const TwoLevelView<GpuPageEntry> got_slots = runtime.replica().gpu_page_view();
  for (std::uint32_t l = 0; l < shape.layers; ++l) {
    for (std::uint32_t h = 0; h < shape.kv_heads; ++h) {
      const std::size_t inst = inspect_buffer(host).tiers().table.instance(id, l, h);
      if (inspect_buffer(device).tiers().table.instance(id, l, h) != inst)
        return "the requests' table instances differ";
      if (want.meta.length(inst) != got.meta.length(inst)) return "meta-partition table lengths differ";
      for (std::uint32_t p = 0; p < want.meta.length(inst); ++p) {
        if (want.meta.find(inst, p)->bits != got.meta.find(inst, p)->bits) {
          return "meta entry " + std::to_string(p) + " of layer " + std::to_string(l) + " head " + std::to_string(h) +
                 " differs";
        }
      }
      if (want_slots.length(inst) != got_slots.length(inst)) return "GPU page table lengths differ";
      for (std::uint32_t s = 0; s < want_slots.length(inst); ++s) {
        const GpuPageEntry& a = *want_slots.find(inst, s);
        const GpuPageEntry& b = *got_slots.find(inst, s);
        if (a.partition != b.partition || a.gpu_page != b.gpu_page || a.page_in_partition != b.page_in_partition ||
            a.timestamp != b.timestamp) {
          return "GPU page slot " + std::to_string(s) + " of layer " + std::to_string(l) + " differs";
        }
      }
    }
  }
  return {};
}

// Every token's K and V rows in the CPU pages of `id` (prompt and saved
// decode pages) byte-equal in both managers. The rows past a partition's last
// token are not compared: what a reused page held before is not K/V, and the
// device path may take its CPU pages in another order than the host path (a
// step's saves all precede its regroups there).
template <class Policy>
std::string cpu_page_difference(const Manager<Policy>& host, const Manager<Policy>& device, RequestId id,
                                const ModelShape& shape) {
  const PartitionLookup want = inspect_buffer(host).tiers().table.lookup();
  const PartitionLookup got = inspect_buffer(device).tiers().table.lookup();
  const PageLayout& layout = inspect_buffer(host).tiers().cpu_pool.layout();
  for (std::uint32_t l = 0; l < shape.layers; ++l) {
    for (std::uint32_t h = 0; h < shape.kv_heads; ++h) {
      const std::size_t inst = inspect_buffer(host).tiers().table.instance(id, l, h);
      for (std::uint32_t p = 0; p < want.meta.length(inst); ++p) {
        std::uint32_t left = want.meta.find(inst, p)->token_count();
        for (std::uint32_t k = 0; k < want.page_count(inst, p); ++k) {
          const PageId a = *want.cpu_pages.find(inst, *want.offsets.find(inst, p) + k);
          const PageId b = *got.cpu_pages.find(inst, *got.offsets.find(inst, p) + k);
          const std::uint32_t rows = std::min(left, layout.page_tokens);
          left -= rows;
          const std::byte* x = inspect_buffer(host).tiers().cpu_pool.data(a);
          const std::byte* y = inspect_buffer(device).tiers().cpu_pool.data(b);
          const std::size_t n = rows * layout.row_bytes();
          if (std::memcmp(x + layout.k_offset(0), y + layout.k_offset(0), n) != 0 ||
              std::memcmp(x + layout.v_offset(0), y + layout.v_offset(0), n) != 0) {
            return "CPU page " + std::to_string(k) + " of partition " + std::to_string(p) + " differs";
          }
        }
      }
    }
  }
  return {};
}

struct LockstepReport {
  std::string difference;  // the first, with its step; empty: none
  std::uint64_t steps = 0, plan_steps = 0, fills = 0, admitted = 0, finished = 0, refused = 0;
  std::uint64_t hit_pages = 0, miss_pages = 0, evicted_pages = 0;
  std::size_t largest_batch = 0;
  double worst_error = 0;
  std::uint64_t index_updates = 0;  // host-state policies: (request, layer) regroups, their regions rewritten
};

// Both managers through the same calls; stops at the first difference.
// short_prompts: half the prompts short enough that a policy may keep a
// window of its own until its first index update (RetroInfer).
template <class Policy>
LockstepReport device_lockstep(const Policy& policy, std::uint32_t seed, const RuntimeEmulation& emulation, int steps,
                               const Config& config = device_config(), bool short_prompts = false) {
  const ModelShape shape = device_shape();
  EmulatedDeviceMemory memory;
  auto owned = std::make_unique<EmulatedBackend>(memory, emulation);
  EmulatedBackend& backend = *owned;
  Manager<Policy> host(shape, config, policy);
  Manager<Policy> device(shape, config, policy, std::move(owned));
  std::mt19937 rng(seed);
  const std::size_t kv_row = std::size_t{shape.kv_heads} * shape.head_dim;
  const std::size_t q_row = std::size_t{shape.q_heads} * shape.head_dim;
  std::vector<RequestId> live;
  std::map<RequestId, std::uint32_t> left;  // decode tokens each live request has left
  RequestId next = 1;
  LockstepReport report;
  const auto differ = [&](int step, std::uint32_t layer, const std::string& what) {
    if (what.empty()) return false;
    report.difference = "step " + std::to_string(step) + " layer " + std::to_string(layer) + ": " + what;
    return true;
  };
  const auto finish = [&](std::size_t i, int step) {
    const RequestId id = live[i];
    device.synchronize();
    if (differ(step, 0, cpu_page_difference(host, device, id, shape))) return false;
    host.finish(id);
    device.finish(id);
    live.erase(live.begin() + static_cast<std::ptrdiff_t>(i));
    left.erase(id);
    ++report.finished;
    return true;
  };
  for (int step = 0; step < steps; ++step) {
    if (live.size() < config.max_requests && (live.size() < 2 || rng() % 2 == 0)) {
      // short_prompts: every other prompt within 20..59 tokens.
      const std::uint32_t prompt = short_prompts && rng() % 2 == 0 ? 20 + rng() % 40 : 20 + rng() % 300;
      const std::uint32_t decode = 30 + rng() % 90;
      const std::uint32_t max_tokens = prompt + decode;
      const RequestId id = next++;
      const bool admit = host.can_admit(prompt, max_tokens).admit;
      REQUIRE(device.can_admit(prompt, max_tokens).admit == admit);
      if (admit) {
        host.add_request(id, max_tokens);
        device.add_request(id, max_tokens);
        for (std::uint32_t l = 0; l < shape.layers; ++l) {
          const auto k = random_bf16(prompt * kv_row, rng);
          const auto v = random_bf16(prompt * kv_row, rng);
          host.prefill(id, l, k.data(), v.data(), prompt);
          const EmulatedArray<std::uint16_t> dk(memory, k), dv(memory, v);
          device.prefill(id, l, dk.data, dv.data, prompt, kStream);
        }
        live.push_back(id);
        left[id] = decode;
        ++report.admitted;
      } else {
        ++report.refused;
      }
    }
    // Now and then a request finishes early; the others when their tokens run out (below).
    if (!live.empty() && rng() % 29 == 0) {
      if (!finish(rng() % live.size(), step)) return report;
    }
    if (live.empty()) continue;
    std::vector<RequestId> batch = live;
    std::shuffle(batch.begin(), batch.end(), rng);
    batch.resize(1 + rng() % batch.size());
    report.largest_batch = std::max(report.largest_batch, batch.size());
    for (std::uint32_t l = 0; l < shape.layers; ++l) {
      const auto q = random_bf16(batch.size() * q_row, rng);
      const auto k = random_bf16(batch.size() * kv_row, rng);
      const auto v = random_bf16(batch.size() * kv_row, rng);
      const EmulatedArray<std::uint16_t> dq(memory, q), dk(memory, k), dv(memory, v);
      for (RequestId id : batch)
        report.fills += inspect_buffer(host).tails().tail_tokens(id, l) + 1 == config.page_tokens ? 1 : 0;
      bool refused_host = false, refused_device = false;
      std::optional<ErrorCode> host_code, device_code;
      std::vector<float> want(batch.size() * q_row);
      EmulatedArray<float> out(memory, want.size());
      const bool plan_only = rng() % 3 == 0;
      try {
        if (plan_only) {
          host.plan(batch, l, q.data(), k.data(), v.data());
        } else {
          host.decode(batch, l, q.data(), k.data(), v.data(), want.data());
        }
      } catch (const Error& e) {
        refused_host = true;
        host_code = e.code();
      }
      try {
        if (plan_only) {
          device.plan(batch, l, dq.data, dk.data, dv.data, kStream);
        } else {
          device.decode(batch, l, dq.data, dk.data, dv.data, out.data, kStream);
        }
      } catch (const Error& e) {
        refused_device = true;
        device_code = e.code();
        if (!refused_host) {
          report.difference = "step " + std::to_string(step) + ": the device refused: " + e.what();
          return report;
        }
      }
      if (refused_host != refused_device || host_code != device_code) {
        report.difference = "step " + std::to_string(step) + ": only the host refused";
        return report;
      }
      if (refused_host) {
        ++report.refused;
        continue;
      }
      ++report.steps;
      report.plan_steps += plan_only ? 1 : 0;
      if (differ(step, l,
                 step_difference(host, *backend.runtime(), batch.size(), shape.kv_heads, config.page_tokens))) {
        return report;
      }
      for (RequestId id : batch) {
        if (differ(step, l, table_difference(host, device, *backend.runtime(), id, shape))) return report;
      }
      if (!plan_only) {
        const std::vector<float> got = out.download();
        for (std::size_t i = 0; i < want.size(); ++i) {
          report.worst_error = std::max(report.worst_error, double(std::abs(got[i] - want[i])));
        }
        if (report.worst_error > 2e-3) {
          report.difference =
              "step " + std::to_string(step) + ": outputs differ by " + std::to_string(report.worst_error);
          return report;
        }
      }
    }
    for (RequestId id : batch) {
      if (--left[id] > 0) continue;
      left.erase(id);
      if (!finish(static_cast<std::size_t>(std::find(live.begin(), live.end(), id) - live.begin()), step)) {
        return report;
      }
    }
  }
  while (!live.empty()) {
    if (!finish(live.size() - 1, steps)) return report;
  }
  device.synchronize();
  // Beyond the prefills' one write per (request, layer, kv head): the regroups'.
  report.index_updates =
      (backend.runtime()->summary_row_writes() - report.admitted * shape.layers * shape.kv_heads) / shape.kv_heads;
  report.hit_pages = device.stats().cache.hit_pages;
  report.miss_pages = device.stats().cache.miss_pages;
  report.evicted_pages = device.stats().cache.evicted_pages;
  CacheStepStats host_total = host.stats().cache;
  if (host_total.hit_pages != report.hit_pages || host_total.miss_pages != report.miss_pages ||
      host_total.evicted_pages != report.evicted_pages) {
    report.difference = "the device's hit / miss totals differ from the host's";
  }
  if (device.stats().pages_saved != host.stats().pages_saved) report.difference = "pages saved differ";
  if (inspect_buffer(device).tiers().gpu_pool.used() != 0 || inspect_buffer(device).tiers().cpu_pool.used() != 0) {
    report.difference = "pages left in the pools after every finish";
  }
  return report;
}

QuestPolicy quest_policy(std::uint32_t dense_layers) {
  QuestPolicy::Options o;
  o.budget_tokens = 96;
  o.page_tokens_per_partition = 16;
  o.dense_layers = dense_layers;
  return QuestPolicy(o);
}

ShadowKVPolicy shadowkv_policy() {
  ShadowKVPolicy::Options o;
  o.budget_tokens = 96;
  return ShadowKVPolicy(o);
}

// A window smaller than most contexts, sinks reaching into a second page:
// selections with a gap between the sinks and the window.
StreamingWindowPolicy streaming_policy() {
  StreamingWindowPolicy::Options o;
  o.budget_tokens = 96;
  o.sink_tokens = 20;
  return StreamingWindowPolicy(o);
}

// A budget of 64 tokens makes the short prompts' own windows count before
// their first index update (per-row windows).
RetroInferPolicy retroinfer_policy(bool estimation) {
  return RetroInferPolicy(frequent_update_retroinfer(64, estimation));
}

void require_clean(const LockstepReport& r, bool evicts = true) {
  INFO(r.difference);
  REQUIRE(r.difference.empty());
  INFO("steps " << r.steps << ", plan steps " << r.plan_steps << ", fills " << r.fills << ", admitted " << r.admitted
                << ", finished " << r.finished << ", largest batch " << r.largest_batch
                << ", hit / miss / evicted pages " << r.hit_pages << " / " << r.miss_pages << " / " << r.evicted_pages
                << ", worst error " << r.worst_error);
  // The run covered what it claims: many steps of both kinds, tails filling,
  // requests arriving and finishing, batches of several, misses and evictions.
  CHECK(r.steps > 150);
  CHECK(r.plan_steps > 30);
  CHECK(r.fills > 50);
  CHECK(r.finished > 4);
  CHECK(r.largest_batch >= 3);
  CHECK(r.miss_pages > 0);
  CHECK(r.hit_pages > 0);
  if (evicts) CHECK(r.evicted_pages > 0);
}

}  // namespace

TEST_CASE("device decode emulation equals the host backend: Quest", "[device-decode-rules]") {
  for (std::uint32_t seed : {1u, 2u}) {
    INFO("seed " << seed);
    require_clean(device_lockstep(quest_policy(0), seed, {}, 160));
  }
}

TEST_CASE("device decode emulation equals the host backend: Quest with dense layers", "[device-decode-rules]") {
  require_clean(device_lockstep(quest_policy(1), 3, {}, 160), false);  // a dense layer's heads hold their context
}

TEST_CASE("device decode emulation equals the host backend: ShadowKV", "[device-decode-rules]") {
  for (std::uint32_t seed : {4u, 5u}) {
    INFO("seed " << seed);
    require_clean(device_lockstep(shadowkv_policy(), seed, {}, 160));
  }
}

TEST_CASE("device decode emulation equals the host backend: StreamingWindow", "[device-decode-rules]") {
  for (std::uint32_t seed : {6u, 7u}) {
    INFO("seed " << seed);
    // The heads' windows fit their GPU buffers: the LRU never evicts here
    // (the Quest and ShadowKV cases cover eviction).
    require_clean(device_lockstep(streaming_policy(), seed, {}, 160), false);
  }
}

TEST_CASE("device decode emulation equals the host backend: RetroInfer", "[device-decode-rules]") {
  // Index updates on the host between steps, regrouped tables and summaries
  // uploaded; the estimation zone merged by the attention.
  for (const bool estimation : {true, false}) {
    INFO("estimation " << estimation);
    // Clusters pad their last page, so a RetroInfer head holds more pages than
    // its tokens fill: a larger CPU tier admits as many requests as above.
    Config config = device_config();
    config.cpu_tier_bytes = std::size_t{64} << 20;
    config.gpu_tier_bytes = std::size_t{4} << 20;
    const LockstepReport r = device_lockstep(retroinfer_policy(estimation), estimation ? 9 : 10, {}, 240, config, true);
    // Its mandatory pages (clusters of any size within the budget) cover
    // these contexts' GPU buffers: no eviction (Quest and ShadowKV cover it).
    require_clean(r, false);
    CHECK(r.index_updates > 10);
  }
}

TEST_CASE("device decode emulation equals the host backend: Dense", "[device-decode-rules]") {
  // No eviction, as for StreamingWindow; 200 steps, as 160 fill too few tails
  // (fewer requests are admitted at once).
  require_clean(device_lockstep(DensePolicy(), 8, {}, 200), false);
}

// ---- bad input ---------------------------------------------------------------

namespace {

// Everything a refused call must leave as it was: the buffer's bookkeeping,
// the pools, the host tables, the device tables (the replica), the runtime's
// launches and totals.
struct Snapshot {
  std::vector<std::uint32_t> lengths, tails, partitions;
  std::uint64_t cpu_used = 0, gpu_used = 0, calls = 0, hit_pages = 0, miss_pages = 0, decode_steps = 0;
  std::vector<std::uint32_t> meta_bits, replica_bits;
  std::vector<PageId> slots, replica_slots;

  bool operator==(const Snapshot&) const = default;
};

template <class Policy>
Snapshot snapshot(Manager<Policy>& m, const EmulatedBackend& backend, const std::vector<RequestId>& ids) {
  Snapshot s;
  const ModelShape& shape = inspect_buffer(m).tiers().shape;
  const HierarchicalPageTable& table = inspect_buffer(m).tiers().table;
  for (RequestId id : ids) {
    for (std::uint32_t l = 0; l < shape.layers; ++l) {
      s.lengths.push_back(inspect_buffer(m).admission().sequence_length(id, l));
      s.tails.push_back(inspect_buffer(m).tails().tail_tokens(id, l));
      for (std::uint32_t h = 0; h < shape.kv_heads; ++h) {
        s.partitions.push_back(table.partition_count(id, l, h));
        const std::size_t inst = table.instance(id, l, h);
        const PartitionLookup host = table.lookup();
        for (std::uint32_t p = 0; p < host.meta.length(inst); ++p) s.meta_bits.push_back(host.meta.find(inst, p)->bits);
        const TwoLevelView<GpuPageEntry> slots = table.gpu_page_view();
        for (std::uint32_t i = 0; i < slots.length(inst); ++i) s.slots.push_back(slots.find(inst, i)->gpu_page);
        if (const EmulatedDeviceRuntime* d = backend.runtime()) {
          const PartitionLookup replica = d->replica().lookup(table);
          for (std::uint32_t p = 0; p < replica.meta.length(inst); ++p) {
            s.replica_bits.push_back(replica.meta.find(inst, p)->bits);
          }
          const TwoLevelView<GpuPageEntry> r = d->replica().gpu_page_view();
          for (std::uint32_t i = 0; i < r.length(inst); ++i) s.replica_slots.push_back(r.find(inst, i)->gpu_page);
        }
      }
    }
  }
  s.cpu_used = inspect_buffer(m).tiers().cpu_pool.used();
  s.gpu_used = inspect_buffer(m).tiers().gpu_pool.used();
  if (EmulatedDeviceRuntime* d = backend.runtime()) {
    s.calls = d->calls();
    s.hit_pages = d->cache_stats().hit_pages;
    s.miss_pages = d->cache_stats().miss_pages;
  }
  s.decode_steps = m.stats().decode_steps;
  return s;
}

// The code `call` throws (a sparsekv::Error naming what is wrong), or nullopt.
template <class Call>
std::optional<ErrorCode> refusal(Call&& call) {
  try {
    call();
  } catch (const Error& e) {
    UNSCOPED_INFO("refused: " << e.what());
    return e.code();
  }
  return std::nullopt;
}

// A policy with only a host Select: QuestPolicy's rules under another type,
// which device_select() does not know (policy/device_select.hpp).
struct HostOnlyQuest : QuestPolicy {
  using QuestPolicy::QuestPolicy;
};

}  // namespace

TEST_CASE("device-tensor API: bad input is refused before anything changes or is enqueued", "[device-decode-rules]") {
  const ModelShape shape = device_shape();
  const Config config = device_config();
  EmulatedDeviceMemory memory;
  auto owned = std::make_unique<EmulatedBackend>(memory);
  EmulatedBackend& backend = *owned;
  Manager<QuestPolicy> m(shape, config, quest_policy(0), std::move(owned));
  std::mt19937 rng(11);
  const std::size_t kv_row = std::size_t{shape.kv_heads} * shape.head_dim;
  const std::size_t q_row = std::size_t{shape.q_heads} * shape.head_dim;
  const std::uint32_t prompt = 47;
  m.add_request(1, 200);
  m.add_request(2, 200);
  const std::vector<std::uint16_t> host_k = random_bf16(prompt * kv_row, rng),
                                   host_v = random_bf16(prompt * kv_row, rng);
  const EmulatedArray<std::uint16_t> k(memory, host_k), v(memory, host_v);

  // Prefill: host or null pointers where device ones are required.
  std::vector<RequestId> ids = {1, 2};
  // The first device call makes the runtime (with both requests' tables), then refuses.
  REQUIRE(refusal([&] { m.prefill(1, 0, host_k.data(), v.data, prompt, kStream); }) == ErrorCode::invalid_argument);
  REQUIRE(backend.runtime() != nullptr);
  Snapshot before = snapshot(m, backend, ids);
  REQUIRE(before.replica_slots == before.slots);
  REQUIRE(refusal([&] { m.prefill(1, 0, k.data, host_v.data(), prompt, kStream); }) == ErrorCode::invalid_argument);
  REQUIRE(refusal([&] { m.prefill(1, 0, nullptr, v.data, prompt, kStream); }) == ErrorCode::invalid_argument);
  REQUIRE(refusal([&] { m.prefill(1, 0, k.data, v.data, 0, kStream); }) == ErrorCode::invalid_argument);
  REQUIRE(refusal([&] { m.prefill(9, 0, k.data, v.data, prompt, kStream); }) == ErrorCode::not_found);
  REQUIRE(refusal([&] { m.prefill(1, shape.layers, k.data, v.data, prompt, kStream); }) == ErrorCode::out_of_range);
  REQUIRE(snapshot(m, backend, ids) == before);

  for (std::uint32_t l = 0; l < shape.layers; ++l) m.prefill(1, l, k.data, v.data, prompt, kStream);
  // Request 2 is prefilled in layer 0 only.
  m.prefill(2, 0, k.data, v.data, prompt, kStream);
  REQUIRE(refusal([&] { m.prefill(1, 0, k.data, v.data, prompt, kStream); }) == ErrorCode::failed_precondition);

  const std::vector<std::uint16_t> host_q = random_bf16(2 * q_row, rng), host_new = random_bf16(2 * kv_row, rng);
  const EmulatedArray<std::uint16_t> q(memory, host_q), kn(memory, host_new), vn(memory, host_new);
  EmulatedArray<float> out(memory, 2 * q_row);
  std::vector<float> host_out(2 * q_row);
  const std::vector<RequestId> one = {1}, both = {1, 2}, twice = {1, 1}, unknown = {1, 3}, none = {};
  // A step that succeeds first, so the replica and totals hold something.
  m.decode(one, 0, q.data, kn.data, vn.data, out.data, kStream);
  before = snapshot(m, backend, ids);
  REQUIRE(before.calls > 0);

  // Host pointers where device ones are required, and null pointers.
  REQUIRE(refusal([&] { m.decode(one, 0, host_q.data(), kn.data, vn.data, out.data, kStream); }) ==
          ErrorCode::invalid_argument);
  REQUIRE(refusal([&] { m.decode(one, 0, q.data, host_new.data(), vn.data, out.data, kStream); }) ==
          ErrorCode::invalid_argument);
  REQUIRE(refusal([&] { m.decode(one, 0, q.data, kn.data, host_new.data(), out.data, kStream); }) ==
          ErrorCode::invalid_argument);
  REQUIRE(refusal([&] { m.decode(one, 0, q.data, kn.data, vn.data, host_out.data(), kStream); }) ==
          ErrorCode::invalid_argument);
  REQUIRE(refusal([&] { m.decode(one, 0, nullptr, kn.data, vn.data, out.data, kStream); }) ==
          ErrorCode::invalid_argument);
  REQUIRE(refusal([&] { m.decode(one, 0, q.data, kn.data, vn.data, nullptr, kStream); }) ==
          ErrorCode::invalid_argument);
  REQUIRE(refusal([&] { m.plan(one, 0, q.data, nullptr, vn.data, kStream); }) == ErrorCode::invalid_argument);
  REQUIRE(refusal([&] { m.plan(one, 0, q.data, kn.data, host_new.data(), kStream); }) == ErrorCode::invalid_argument);
  // Batches: empty, a request twice, an unknown request, a layer out of range.
  REQUIRE(refusal([&] { m.decode(none, 0, q.data, kn.data, vn.data, out.data, kStream); }) ==
          ErrorCode::invalid_argument);
  REQUIRE(refusal([&] { m.decode(twice, 0, q.data, kn.data, vn.data, out.data, kStream); }) ==
          ErrorCode::invalid_argument);
  REQUIRE(refusal([&] { m.decode(unknown, 0, q.data, kn.data, vn.data, out.data, kStream); }) == ErrorCode::not_found);
  REQUIRE(refusal([&] { m.decode(one, shape.layers, q.data, kn.data, vn.data, out.data, kStream); }) ==
          ErrorCode::out_of_range);
  // Decode before prefill (request 2 in layer 1), after request 1's layer 1 is fine.
  REQUIRE(refusal([&] { m.decode(both, 1, q.data, kn.data, vn.data, out.data, kStream); }) ==
          ErrorCode::failed_precondition);
  // Mixing the APIs: this Manager serves device tensors.
  REQUIRE(refusal([&] { m.decode(one, 0, host_q.data(), host_new.data(), host_new.data(), host_out.data()); }) ==
          ErrorCode::failed_precondition);
  REQUIRE(refusal([&] { m.plan(one, 0, host_q.data(), host_new.data(), host_new.data()); }) ==
          ErrorCode::failed_precondition);
  REQUIRE(refusal([&] { m.prefill(2, 1, host_k.data(), host_v.data(), prompt); }) == ErrorCode::failed_precondition);
  REQUIRE(snapshot(m, backend, ids) == before);

  // Batch over capacity: a batch names distinct known requests, so the
  // Manager cannot pass more than max_requests entries; the runtime's own
  // check (the CUDA runtime's) refuses a larger step before enqueuing.
  DeviceStepInput too_big;
  too_big.batch = config.max_requests + 1;
  REQUIRE(refusal([&] { backend.runtime()->step(too_big); }) == ErrorCode::invalid_argument);
  too_big.batch = 0;
  REQUIRE(refusal([&] { backend.runtime()->step(too_big); }) == ErrorCode::invalid_argument);

  // A non-finite value a step met is reported at the next call, before that
  // call changes anything; its row was not appended.
  std::vector<std::uint16_t> bad_new = host_new;
  bad_new[3] = float_to_bf16(std::numeric_limits<float>::quiet_NaN());
  const EmulatedArray<std::uint16_t> bad(memory, bad_new);
  const std::uint32_t tail = inspect_buffer(m).tails().tail_tokens(1, 0);
  m.decode(one, 0, q.data, bad.data, vn.data, out.data, kStream);
  REQUIRE(inspect_buffer(m).tails().tail_tokens(1, 0) ==
          tail + 1);  // the host's bookkeeping ran: the error is the device's
  before = snapshot(m, backend, ids);
  REQUIRE(refusal([&] { m.decode(one, 0, q.data, kn.data, vn.data, out.data, kStream); }) ==
          ErrorCode::invalid_argument);
  REQUIRE(snapshot(m, backend, ids) == before);
  m.decode(one, 0, q.data, kn.data, vn.data, out.data, kStream);  // reported once
}

TEST_CASE("device-tensor API: a backend without device memory is refused, changing nothing", "[device-decode-rules]") {
  const ModelShape shape = device_shape();
  const Config config = device_config();
  std::mt19937 rng(12);
  const std::size_t kv_row = std::size_t{shape.kv_heads} * shape.head_dim;
  const std::vector<std::uint16_t> host_k = random_bf16(40 * kv_row, rng);
  EmulatedDeviceMemory memory;
  const EmulatedArray<std::uint16_t> k(memory, host_k);
  // HostBackend: unavailable, for a policy with a device Select and one
  // without; the host API still serves both.
  const auto unavailable = [&](auto policy) {
    Manager<decltype(policy)> plain(shape, config, policy);
    plain.add_request(1, 100);
    REQUIRE(refusal([&] { plain.prefill(1, 0, k.data, k.data, 40, kStream); }) == ErrorCode::unavailable);
    REQUIRE(inspect_buffer(plain).admission().sequence_length(1, 0) == 0);
    plain.prefill(1, 0, host_k.data(), host_k.data(), 40);
    REQUIRE(inspect_buffer(plain).admission().sequence_length(1, 0) == 40);
  };
  QuestPolicy::Options o;
  o.page_tokens_per_partition = 16;
  unavailable(quest_policy(0));
  unavailable(HostOnlyQuest(o));
}

TEST_CASE("device-tensor API: a policy with only a host Select takes the slower host-Select path",
          "[device-decode-rules]") {
  // HostOnlyQuest, and Quest with two-page partitions (no device Select at
  // that shape): every call copies its tensors down, runs the host-tensor
  // call and copies out up. Outputs equal the host manager's exactly (the
  // same host code on the same bytes); no runtime is made; plan() is refused.
  const ModelShape shape = device_shape();
  const Config config = device_config();
  const std::size_t kv_row = std::size_t{shape.kv_heads} * shape.head_dim;
  const std::size_t q_row = std::size_t{shape.q_heads} * shape.head_dim;
  const auto slower_path = [&](auto policy, std::uint32_t seed) {
    std::mt19937 rng(seed);
    EmulatedDeviceMemory memory;
    auto owned = std::make_unique<EmulatedBackend>(memory);
    EmulatedBackend& backend = *owned;
    Manager<decltype(policy)> host(shape, config, policy);
    Manager<decltype(policy)> device(shape, config, policy, std::move(owned));
    const std::vector<RequestId> batch{1, 2, 3};
    for (RequestId id : batch) {
      const std::uint32_t prompt = 40 + 40 * static_cast<std::uint32_t>(id);
      host.add_request(id, prompt + 64);
      device.add_request(id, prompt + 64);
      for (std::uint32_t l = 0; l < shape.layers; ++l) {
        const auto k = random_bf16(prompt * kv_row, rng), v = random_bf16(prompt * kv_row, rng);
        host.prefill(id, l, k.data(), v.data(), prompt);
        const EmulatedArray<std::uint16_t> dk(memory, k), dv(memory, v);
        device.prefill(id, l, dk.data, dv.data, prompt, kStream);
      }
    }
    for (int step = 0; step < 40; ++step) {
      for (std::uint32_t l = 0; l < shape.layers; ++l) {
        const auto q = random_bf16(batch.size() * q_row, rng);
        const auto k = random_bf16(batch.size() * kv_row, rng), v = random_bf16(batch.size() * kv_row, rng);
        const EmulatedArray<std::uint16_t> dq(memory, q), dk(memory, k), dv(memory, v);
        std::vector<float> want(batch.size() * q_row);
        EmulatedArray<float> out(memory, want.size());
        host.decode(batch, l, q.data(), k.data(), v.data(), want.data());
        device.decode(batch, l, dq.data, dk.data, dv.data, out.data, kStream);
        REQUIRE(out.download() == want);
        if (step == 0 && l == 0) {
          // plan() needs a device Select; a host pointer is refused; neither changes anything.
          const std::uint32_t length = inspect_buffer(device).admission().sequence_length(1, 0);
          REQUIRE(refusal([&] { device.plan(batch, 0, dq.data, dk.data, dv.data, kStream); }) ==
                  ErrorCode::invalid_argument);
          REQUIRE(refusal([&] { device.decode(batch, 0, q.data(), dk.data, dv.data, out.data, kStream); }) ==
                  ErrorCode::invalid_argument);
          REQUIRE(inspect_buffer(device).admission().sequence_length(1, 0) == length);
        }
      }
    }
    REQUIRE(backend.runtime() == nullptr);
    REQUIRE(device.stats().cache.miss_pages == host.stats().cache.miss_pages);
    REQUIRE(device.stats().cache.miss_pages > 0);
    // The Manager serves device tensors now: host tensors are refused.
    REQUIRE(refusal([&] { device.decode(batch, 0, nullptr, nullptr, nullptr, nullptr); }) ==
            ErrorCode::failed_precondition);
  };
  QuestPolicy::Options o;
  o.budget_tokens = 96;
  o.page_tokens_per_partition = 16;
  slower_path(HostOnlyQuest(o), 13);
  o.page_tokens_per_partition = 32;
  slower_path(QuestPolicy(o), 14);
}

TEST_CASE("device decode emulation: the lockstep catches planted mutations", "[device-decode-rules]") {
  RuntimeEmulation save_first;
  save_first.append = Mutation::save_before_write;  // a full page summarised and saved without its last token
  RuntimeEmulation newest;
  newest.summary_row_of_newest = true;  // a full page's summary lands on the previous partition's row
  for (const auto& [name, emulation] :
       {std::pair{"save_before_write", save_first}, std::pair{"summary_row_of_newest", newest}}) {
    INFO(name);
    const LockstepReport quest = device_lockstep(quest_policy(0), 1, emulation, 160);
    const LockstepReport shadow = device_lockstep(shadowkv_policy(), 4, emulation, 160);
    UNSCOPED_INFO(name << ": Quest " << quest.difference << "; ShadowKV " << shadow.difference);
    CHECK_FALSE(quest.difference.empty());
    CHECK_FALSE(shadow.difference.empty());
  }
}
