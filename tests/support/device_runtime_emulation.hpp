#pragma once
// A host emulation of the CUDA DeviceRuntime (cuda/step/device_runtime.cpp),
// so CI runs the device-tensor API (step/device_runtime.hpp,
// docs/device-decode.md) end to end without a device: the same step, in the
// same order, each launch replaced by the host emulation of its kernel that
// the kernel's own rules test checks:
//   0. the step's arguments (first / count / summary rows per row, the save
//      pages' addresses, the replica writes of the saved pages' meta entries),
//      by the CUDA runtime's own fill_launch_arguments;
//   1. apply_replica_write on a GpuTablesReplica kept in host memory;
//   2. the append kernel with its summaries (append_test_data.hpp) into a
//      DeviceSummaries-shaped store (one HostRows per layer: SummaryShape's
//      regions, identity partition ids);
//   3. the Select kernels (select_emulation.hpp) over the rows' regions, and
//      RetroInfer's estimate kernel;
//   4. the Select -> LRU glue (lru_batch_test_data.hpp), the bucketed-LRU step
//      on the replica (lru_step_emulation.hpp), the miss-list gather and the
//      device plan (plan_test_data.hpp), the stats accumulation;
//   5. the split-K attention over the plan's runs (attention_test_data.hpp),
//      merging RetroInfer's estimation terms.
// Prompt summaries follow the Index kernels' per-thread rules
// (summary_rules.hpp), as DeviceSummaries::write_prefill launches them.
//
// "Device memory" is host memory that EmulatedDeviceMemory hands out and
// remembers: EmulatedBackend::is_device_pointer answers from that registry,
// so any other pointer (a plain host vector) is refused as a host pointer
// would be by CudaBackend. EmulatedBackend hands a Manager this runtime.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string_view>
#include <typeindex>
#include <vector>

#include "append_test_data.hpp"
#include "attention_test_data.hpp"
#include "lru_batch_test_data.hpp"
#include "lru_step_emulation.hpp"
#include "sparsekv/buffer/prompt_check_cuda.hpp"
#include "sparsekv/step/prompt_offload.hpp"
#include "plan_test_data.hpp"
#include "select_emulation.hpp"
#include "sparsekv/buffer/tiered_kv_buffer.hpp"
#include "sparsekv/core/error.hpp"
#include "sparsekv/facade/host_backend.hpp"
#include "sparsekv/step/device_runtime.hpp"
#include "sparsekv/step/launch_arguments.hpp"
#include "sparsekv/buffer/transfer_replica_copy.hpp"
#include "sparsekv/metadata/gpu_tables_replica.hpp"
#include "sparsekv/metadata/replica_writes_cuda.hpp"
#include "sparsekv/policy/dense.hpp"
#include "sparsekv/policy/quest.hpp"
#include "sparsekv/policy/retroinfer.hpp"
#include "sparsekv/policy/shadowkv.hpp"
#include "sparsekv/policy/streaming_window.hpp"
#include "sparsekv/policy/summary_store_cuda.hpp"
#include "sparsekv/policy/summary_rules.hpp"

namespace sparsekv::test {

// Host allocations standing in for device memory: only what allocate() gave
// and release() has not taken back counts as device memory.
class EmulatedDeviceMemory {
 public:
  void* allocate(std::size_t bytes) {
    auto block = std::make_unique<std::byte[]>(std::max<std::size_t>(bytes, 1));
    std::byte* p = block.get();
    blocks_[p] = Block{std::move(block), bytes};
    return p;
  }
  void release(const void* p) { blocks_.erase(static_cast<const std::byte*>(p)); }
  bool contains(const void* p) const {
    const auto* b = static_cast<const std::byte*>(p);
    auto it = blocks_.upper_bound(b);
    if (it == blocks_.begin()) return false;
    --it;
    return b < it->first + std::max<std::size_t>(it->second.bytes, 1);
  }

 private:
  struct Block {
    std::unique_ptr<std::byte[]> data;
    std::size_t bytes = 0;
  };
  std::map<const std::byte*, Block> blocks_;
};

// An array in emulated device memory, freed with the object.
template <class T>
class EmulatedArray {
 public:
  EmulatedArray(EmulatedDeviceMemory& memory, std::size_t n)
      : memory_(&memory), data(static_cast<T*>(memory.allocate(n * sizeof(T)))), size(n) {
    std::fill_n(data, n, T{});
  }
  EmulatedArray(EmulatedDeviceMemory& memory, const std::vector<T>& host) : EmulatedArray(memory, host.size()) {
    std::copy(host.begin(), host.end(), data);
  }
  ~EmulatedArray() { memory_->release(data); }
  EmulatedArray(const EmulatedArray&) = delete;
  EmulatedArray& operator=(const EmulatedArray&) = delete;
  std::vector<T> download() const { return {data, data + size}; }

 private:
  EmulatedDeviceMemory* memory_;

 public:
  T* data;
  std::size_t size;
};

// How the emulated launches run, and the mutations the tests plant.
struct RuntimeEmulation {
  Emulation select;                    // the select kernels (and their mutations)
  Mutation append = Mutation::none;    // the append kernel's mutations
  bool summary_row_of_newest = false;  // mutation: a full page's summary overwrites the newest partition's
  std::uint32_t seed = 1;              // block / thread orders, tiles and warps
};

// Prompt key row t of page `page` of kv head `head`: keys are [tokens][kv_heads][head_dim].
struct PromptKeyRows {
  const std::byte* keys;
  std::size_t token_bytes;  // kv_heads * head_dim * element size
  std::size_t first;        // byte offset of the page's first key of the head
  const std::byte* operator()(std::uint32_t t) const { return keys + first + std::size_t{t} * token_bytes; }
};

// The built-in device Selects' kernels, emulated, found by the spec's type as
// the CUDA runtime finds their launchers (cuda/policy/device_select_launchers.cpp).
struct EmulatedSelectCall {
  const Emulation& emulation;
  const HostRows& store;  // the layer's summaries and, per row, the host state
  std::uint32_t page_tokens;
  const std::uint32_t* windows;  // per row: RetroInfer's steady window
};
struct EmulatedSelect {
  std::vector<PartitionId> (*select_row)(const DeviceSelect&, const EmulatedSelectCall&, std::uint32_t row);
  // An estimating Select's terms for one row after its selection (null: none).
  bool (*estimates)(const DeviceSelect&) = nullptr;
  std::vector<AttentionPartial> (*estimate)(const DeviceSelect&, const EmulatedSelectCall&, std::uint32_t row,
                                            const std::vector<PartitionId>& selection) = nullptr;
};

inline cuda::RetroInferSelect emulated_retroinfer(const DeviceSelect& spec, const EmulatedSelectCall& c) {
  const auto& r = spec.get<RetroInferDeviceSelect>();
  cuda::RetroInferSelect retro;
  retro.sink_partitions = c.store.sink_partitions.data();
  retro.sink_tokens = c.store.sink_tokens.data();
  retro.recent = c.store.recent.data();
  retro.windows = c.windows;
  retro.budget_tokens = r.budget_tokens;
  retro.retrieval_fraction = r.retrieval_fraction;
  return retro;
}

inline const EmulatedSelect& emulated_select(const DeviceSelect& spec) {
  static const std::map<std::type_index, EmulatedSelect> table{
      {typeid(QuestDeviceSelect), {[](const DeviceSelect& spec, const EmulatedSelectCall& c, std::uint32_t row) {
         const auto& q = spec.get<QuestDeviceSelect>();
         return emulate_quest(c.emulation, c.store, row,
                              cuda::QuestSelect{nullptr, nullptr, q.budget_tokens, q.dense_layer, q.sink_tokens,
                                                q.window_tokens, q.spread});
       }}},
      {typeid(ShadowKVDeviceSelect), {[](const DeviceSelect& spec, const EmulatedSelectCall& c, std::uint32_t row) {
         const auto& k = spec.get<ShadowKVDeviceSelect>();
         return emulate_shadowkv(
             c.emulation, c.store, row,
             cuda::ShadowKVSelect{nullptr, nullptr, k.budget_tokens, k.recent_tokens, k.outlier_pages});
       }}},
      {typeid(StreamingDeviceSelect), {[](const DeviceSelect& spec, const EmulatedSelectCall& c, std::uint32_t row) {
         const auto& w = spec.get<StreamingDeviceSelect>();
         const cuda::StreamingSelect streaming{w.budget_tokens, w.sink_pages, c.page_tokens};
         return emulate_positional(c.emulation, c.store, row, &streaming);
       }}},
      {typeid(DenseDeviceSelect), {[](const DeviceSelect&, const EmulatedSelectCall& c, std::uint32_t row) {
         return emulate_positional(c.emulation, c.store, row, nullptr);
       }}},
      {typeid(RetroInferDeviceSelect),
       {[](const DeviceSelect& spec, const EmulatedSelectCall& c, std::uint32_t row) {
          return emulate_retroinfer(c.emulation, c.store, row, emulated_retroinfer(spec, c));
        },
        [](const DeviceSelect& spec) { return spec.get<RetroInferDeviceSelect>().estimation; },
        [](const DeviceSelect& spec, const EmulatedSelectCall& c, std::uint32_t row,
           const std::vector<PartitionId>& selection) {
          cuda::RetroInferEstimate estimate;
          estimate.estimation_fraction = spec.get<RetroInferDeviceSelect>().estimation_fraction;
          return emulate_estimate(c.emulation, c.store, row, emulated_retroinfer(spec, c), estimate, selection);
        }}},
  };
  const auto it = table.find(std::type_index(spec.type()));
  if (it == table.end()) {
    fail(ErrorCode::invalid_argument, "DeviceRuntime: no launcher is registered for the device Select {}",
         spec.type().name());
  }
  return it->second;
}

class EmulatedDeviceRuntime final : public DeviceRuntime {
 public:
  EmulatedDeviceRuntime(const DeviceRuntimeSetup& setup, TieredKVBuffer& buffer, EmulatedDeviceMemory& memory,
                        const RuntimeEmulation& emulation)
      : setup_(setup),
        buffer_(buffer),
        memory_(memory),
        emulation_(emulation),
        rng_(emulation.seed),
        layout_{setup.page_tokens, setup.shape.head_dim, setup.shape.dtype},
        replica_copy_(buffer.tiers().transfer),
        replica_(buffer.tiers().table, table_memory_, replica_copy_),
        shape_{store_summary_kind(setup.select),
               setup.shape.layers,
               setup.max_requests,
               setup.shape.kv_heads,
               setup.shape.head_dim,
               setup.max_partitions_per_head,
               setup.select.first_partition()} {
    cuda::check_summary_shape("DeviceSummaries", shape_);
    buffer_.tiers().transfer.synchronize();
    const ModelShape& s = setup.shape;
    const std::size_t candidates = shape_.candidates();
    // The tokens kind keeps token counts alone (no summary arrays).
    const bool summarized = shape_.kind != cuda::AppendSummary::tokens;
    // Quest's max and RetroInfer's value sums are vectors, ShadowKV's outlier score one value.
    const std::size_t b_width =
        shape_.kind == cuda::AppendSummary::quest || shape_.kind == cuda::AppendSummary::retroinfer ? s.head_dim : 1;
    for (std::uint32_t l = 0; l < s.layers; ++l) {
      HostRows store;
      store.kv_heads = s.kv_heads;
      store.group = s.q_heads / s.kv_heads;
      store.head_dim = s.head_dim;
      store.b_width = static_cast<std::uint32_t>(b_width);
      store.max_row = setup.max_partitions_per_head;
      if (summarized) {
        store.a.assign(candidates * s.head_dim, 0.0f);
        store.b.assign(candidates * b_width, 0.0f);
      }
      store.tokens.assign(candidates, 0);
      store.partitions.resize(candidates);
      for (std::size_t c = 0; c < candidates; ++c) {
        store.partitions[c] = static_cast<PartitionId>(c % shape_.capacity + shape_.first_partition);
      }
      stores_.push_back(std::move(store));
    }
    q_.assign(std::size_t{setup.max_batch} * s.q_heads * s.head_dim, 0.0f);
    if (setup.select.estimates()) {
      extra_max_.assign(std::size_t{setup.max_batch} * s.q_heads, 0.0f);
      extra_sum_.assign(extra_max_.size(), 0.0f);
      extra_acc_.assign(extra_max_.size() * s.head_dim, 0.0f);
    }
    plan_row_pages_ = setup.max_pages_per_head + 1;
  }

  void upload_tables(RequestId request) override {
    replica_.upload(buffer_.tiers().table, request, replica_copy_);
    buffer_.tiers().transfer.synchronize();
  }
  void download_tables(RequestId request) override { replica_.download(buffer_.tiers().table, request, replica_copy_); }

  // first_non_finite's kernel: the smallest index element_is_finite refuses.
  std::uint64_t first_non_finite(const void* data, std::uint64_t count, void* /*stream*/) override {
    for (std::uint64_t i = 0; i < count; ++i) {
      if (!cuda::element_is_finite(data, i, setup_.shape.dtype)) return i;
    }
    return kNoNonFinite;
  }

  // The CUDA runtime's offload: the same save_prompt, on FlashD2HSaver's host path.
  void offload_prompt(const void* k, const void* v, std::span<const TokenPlacement> placements, void* stream) override {
    FlashD2HSaver saver;
    std::vector<RowTarget> k_targets, v_targets;
    // Small pieces, so a prompt crosses several of them as a long one does on the device.
    save_prompt(saver, buffer_.tiers().cpu_pool, k, v, placements, 3 * buffer_.tiers().cpu_pool.layout().row_bytes(),
                stream, k_targets, v_targets);
  }

  // Stage timing needs device events: the emulation times nothing.
  void time_stages(bool /*on*/) override {}
  DeviceStageTimes stage_times() override { return {}; }

  // DeviceSummaries::write_prefill: the Index kernels' per-thread rules for
  // every (kv head, page), then the copy into the slot's regions.
  void index_prompt(std::uint32_t slot, std::uint32_t layer, const void* keys, std::uint32_t tokens,
                    void* /*stream*/) override {
    ++calls_;
    const std::uint32_t page_tokens = setup_.page_tokens;
    const std::uint32_t pages =
        cuda::prefill_pages("DeviceSummaries::write_prefill", shape_, slot, layer, tokens, page_tokens);
    const ModelShape& s = setup_.shape;
    const std::uint32_t dim = s.head_dim;
    const std::size_t element = dtype_size(s.dtype);
    const std::size_t token_bytes = std::size_t{s.kv_heads} * dim * element;
    HostRows& store = stores_[layer];
    std::vector<float> landmark(dim);
    for (std::uint32_t h = 0; h < s.kv_heads; ++h) {
      for (std::uint32_t p = 0; p < pages; ++p) {
        const std::size_t c = shape_.region(slot, h) + p;
        const std::uint32_t count = cuda::prefill_page_tokens(p, tokens, page_tokens);
        const PromptKeyRows key{static_cast<const std::byte*>(keys), token_bytes,
                                std::size_t{p} * page_tokens * token_bytes + std::size_t{h} * dim * element};
        if (shape_.kind == cuda::AppendSummary::quest) {
          for (std::uint32_t d = 0; d < dim; ++d) {
            page_min_max_channel(key, count, d, s.dtype, store.a[c * dim + d], store.b[c * dim + d]);
          }
        } else if (shape_.kind == cuda::AppendSummary::shadowkv) {
          for (std::uint32_t d = 0; d < dim; ++d)
            landmark[d] = store.a[c * dim + d] = page_mean_channel(key, count, d, s.dtype);
          const float norm = sqrt_rn(dot_in_order(landmark.data(), landmark.data(), dim));
          float lowest = kOutlierScoreStart;
          for (std::uint32_t t = 0; t < count; ++t) {
            lowest = fold_min(lowest, page_key_cosine(key, t, landmark.data(), norm, dim, s.dtype));
          }
          store.b[c] = lowest;
        }
        store.tokens[c] = count;
      }
    }
  }

  void step(const DeviceStepInput& step) override {
    ++calls_;
    const ModelShape& s = setup_.shape;
    if (step.batch == 0 || step.batch > setup_.max_batch) {
      fail(ErrorCode::invalid_argument, "decode: batch of {} outside [1, {}]", step.batch, setup_.max_batch);
    }
    if (store_summary_kind(step.select) != shape_.kind) {
      fail(ErrorCode::invalid_argument, "decode: layer {}'s Select reads other summaries than the runtime keeps",
           step.layer);
    }
    const std::uint32_t rows = step.batch * s.kv_heads;
    const std::uint32_t max_writes = launch_max_writes(setup_.max_batch * s.kv_heads);

    // 0. The step's arguments: the CUDA runtime's own fill_launch_arguments.
    std::vector<std::uint32_t> tail_slots(step.batch), tail_tokens(rows), first(rows), count(rows), summary_rows(rows);
    std::vector<PageId> tail_pages(rows);
    std::vector<std::size_t> instances(rows);
    std::vector<std::byte*> cpu_pages(rows, nullptr);
    std::vector<PartitionId> sink_partitions(rows);
    std::vector<std::uint32_t> sink_tokens(rows), recent(rows), windows(rows);
    std::vector<ReplicaWordWrite> writes(max_writes);
    std::uint32_t write_count = 0;
    fill_launch_arguments(
        step, s.kv_heads, shape_, buffer_.tiers().cpu_pool, replica_, buffer_.tiers().table, writes_,
        LaunchArguments{tail_slots, tail_pages, tail_tokens, first, count, summary_rows, instances, cpu_pages,
                        sink_partitions, sink_tokens, recent, windows, writes, &write_count});
    if (emulation_.summary_row_of_newest) {
      for (std::uint32_t r = 0; r < rows; ++r) --summary_rows[r];
    }
    HostRows& store = stores_[step.layer];
    const DeviceSelect& spec = step.select;
    const std::uint32_t max_selected = setup_.max_selected_per_head;
    // The select entry points' host check (select_kernels.cu: capacity()).
    const std::uint32_t needed = spec.capacity(store.max_row, setup_.page_tokens);
    const EmulatedSelect& emulated = emulated_select(spec);
    if (max_selected < needed) {
      fail(ErrorCode::invalid_argument, "select: max_selected {} below the {} a selection may hold", max_selected,
           needed);
    }

    // 1. The meta entries of the saved pages into the replica.
    for (std::uint32_t i = 0; i < max_writes; ++i) cuda::apply_replica_write(writes.data(), write_count, max_writes, i);

    // 2. Append (+ summaries and save of full tails).
    cuda::DeviceAppend append;
    append.batch = step.batch;
    append.q_heads = s.q_heads;
    append.kv_heads = s.kv_heads;
    append.layout = layout_;
    append.q = step.q;
    append.k_new = step.k_new;
    append.v_new = step.v_new;
    append.q_out = q_.data();
    append.gpu_tier = const_cast<std::byte*>(buffer_.tiers().gpu_pool.base());
    append.page_stride = buffer_.tiers().gpu_pool.page_bytes();
    append.tail_pages = tail_pages.data();
    append.tail_slots = tail_slots.data();
    append.cpu_pages = cpu_pages.data();
    std::uint64_t error = kNoAppendError;
    append.error = &error;
    cuda::AppendSummaries summaries;
    summaries.kind = shape_.kind;
    summaries.rows = summary_rows.data();
    summaries.tokens = store.tokens.data();
    if (shape_.kind == cuda::AppendSummary::quest) {
      summaries.min = store.a.data();
      summaries.max = store.b.data();
    } else if (shape_.kind == cuda::AppendSummary::shadowkv) {
      summaries.mean = store.a.data();
      summaries.outlier_score = store.b.data();
    } else if (shape_.kind == cuda::AppendSummary::retroinfer) {
      summaries.centroid = store.a.data();
      summaries.value_sum = store.b.data();
    }
    emulate(append, summaries, 1 + static_cast<std::uint32_t>(rng_() % 7), emulation_.append);
    if (error != kNoAppendError && (!bad_ || error < bad_word_)) {
      bad_ = true;
      bad_word_ = error;
    }

    // 3. Select over the summaries, on the state before this step's save.
    store.first = first;
    store.count = count;
    store.sink_partitions = sink_partitions;
    store.sink_tokens = sink_tokens;
    store.recent = recent;
    const EmulatedSelectCall call{emulation_.select, store, setup_.page_tokens, windows.data()};
    estimated_ = emulated.estimate != nullptr && emulated.estimates(spec);
    std::vector<AttentionPartial> extra;
    if (estimated_) extra.assign(std::size_t{step.batch} * s.q_heads, AttentionPartial(s.head_dim));
    store.q.assign(q_.begin(), q_.begin() + std::ptrdiff_t{step.batch} * s.q_heads * s.head_dim);
    std::vector<PartitionId> selected(std::size_t{rows} * max_selected, kInvalidPartition);
    std::vector<std::uint32_t> selected_count(rows);
    selections_.assign(rows, {});
    for (std::uint32_t r = 0; r < rows; ++r) {
      // The kernel of the layer's device Select, found once as the runtime finds its launcher.
      std::vector<PartitionId> chosen = emulated.select_row(spec, call, r);
      // A kernel writes at most max_selected (its capacity check above guarantees the room).
      if (chosen.size() > max_selected) chosen.resize(max_selected);
      std::copy(chosen.begin(), chosen.end(), selected.begin() + std::ptrdiff_t{r} * max_selected);
      selected_count[r] = static_cast<std::uint32_t>(chosen.size());
      selections_[r] = std::move(chosen);
    }
    // The estimation zone's terms, each row after its selection.
    if (estimated_) {
      const std::uint32_t group = s.q_heads / s.kv_heads;
      for (std::uint32_t r = 0; r < rows; ++r) {
        const auto terms = emulated.estimate(spec, call, r, selections_[r]);
        for (std::uint32_t j = 0; j < group; ++j) {
          const std::size_t t = std::size_t{r} * group + j;
          extra[t] = terms[j];
          extra_max_[t] = terms[j].max;
          extra_sum_[t] = terms[j].sum;
          std::copy(terms[j].acc.begin(), terms[j].acc.end(), extra_acc_.begin() + std::ptrdiff_t(t * s.head_dim));
        }
      }
    }

    // 4. Retrieve: the LRU batch, the LRU step on the replica, the gather of its misses.
    const PartitionLookup lookup = replica_.lookup(buffer_.tiers().table);
    const cuda::LruBatchInput lru_in{rows, max_selected, selected.data(), selected_count.data(), instances.data()};
    const LruBatchArrays glue = emulate_lru_batch(lookup, lru_in, 1 + static_cast<std::uint32_t>(rng_() % 128), rng_);
    LaunchOutput lru;
    emulate_lru_step(replica_.gpu_page_view(), lookup, setup_.timestamp_buckets, instances, glue.selection_offsets,
                     glue.selected, glue.page_offsets, 1 + static_cast<std::uint32_t>(rng_() % 256), rng_, lru);
    DeviceMissList misses;
    misses.heads = rows;
    misses.max_entries = rows * setup_.max_pages_per_head;
    misses.page_offsets = glue.page_offsets.data();
    misses.counts = &lru.stats.data()->miss_pages;
    misses.count_stride = sizeof(CacheStepStats) / sizeof(std::uint64_t);
    misses.cpu_pages = lru.copy_cpu_pages.data();
    misses.gpu_pages = lru.copy_gpu_pages.data();
    const PagePool& cpu = buffer_.tiers().cpu_pool;
    const ChunkedPages cpu_tier{cpu.chunks().data(), cpu.pages_per_chunk(), cpu.page_bytes()};
    const std::size_t page_bytes = buffer_.tiers().gpu_pool.page_bytes();
    auto* gpu_base = const_cast<std::byte*>(buffer_.tiers().gpu_pool.base());
    for (const Copy& c : emulate_gather(misses, 1 + static_cast<std::uint32_t>(rng_() % 200))) {
      std::memcpy(gpu_base + std::size_t{c.gpu} * page_bytes, cpu_tier.address(c.cpu), page_bytes);
    }
    emulate_accumulate(lru.stats, totals_, rng_);
    row_stats_ = lru.stats;

    // 5. Plan: FlashInfer's CSR over the runs.
    cuda::DevicePlanInput in;
    in.rows = rows;
    in.selection_offsets = glue.selection_offsets.data();
    in.partition_offsets = lru.partition_offsets.data();
    in.gpu_pages = lru.gpu_pages.data();
    in.partition_tokens = glue.partition_tokens.data();
    in.tail_pages = tail_pages.data();
    in.tail_tokens = tail_tokens.data();
    in.page_tokens = setup_.page_tokens;
    in.max_pages_per_row = plan_row_pages_;
    in.max_entries_per_row = plan_row_pages_;
    plan_ = emulate_plan(in, cuda::kPlanFillThreads, rng_, kPlanSentinel);
    plan_rows_ = rows;

    // 6. Attend.
    if (step.out != nullptr) {
      AttentionBatch batch;
      batch.batch = step.batch;
      batch.q_heads = s.q_heads;
      batch.kv_heads = s.kv_heads;
      batch.layout = layout_;
      batch.stride = page_bytes;
      batch.scale = setup_.scale;
      batch.base = gpu_base;
      batch.indptr = plan_.indptr;
      batch.indices = plan_.indices;
      batch.last_page_len = plan_.last_page_len;
      batch.row_entries = plan_.head_entries;
      batch.q = store.q;
      batch.extra = std::move(extra);
      batch.max_pages = plan_row_pages_;
      cuda::DecodeAttentionShape shape;
      shape.batch = step.batch;
      shape.q_heads = s.q_heads;
      shape.kv_heads = s.kv_heads;
      shape.layout = layout_;
      shape.max_pages = plan_row_pages_;
      std::vector<float> out, lse;
      emulate_split_k(batch, cuda::split_decode_attention(shape, 528), out, lse);
      std::copy(out.begin(), out.end(), step.out);
    }
  }

  DeviceAttendPlan plan() const override {
    DeviceAttendPlan p;
    p.head_entries = plan_.head_entries.data();
    p.indptr = plan_.indptr.data();
    p.indices = plan_.indices.data();
    p.last_page_len = plan_.last_page_len.data();
    p.gpu_tier_base = buffer_.tiers().gpu_pool.base();
    p.page_bytes = buffer_.tiers().gpu_pool.page_bytes();
    p.rows = plan_rows_;
    if (estimated_) {
      p.extra_max = extra_max_.data();
      p.extra_sum = extra_sum_.data();
      p.extra_acc = extra_acc_.data();
    }
    return p;
  }

  bool capturing(void* /*stream*/) const override { return false; }

  // DeviceSummaries::write_rows: the host rows into the region's first candidates.
  void write_summary_rows(std::uint32_t slot, std::uint32_t layer, std::uint32_t head, const HostSummaryRows& rows,
                          void* /*stream*/) override {
    ++calls_;
    ++summary_row_writes_;
    const std::uint32_t dim = setup_.shape.head_dim;
    const std::size_t n = rows.tokens.size();
    if (shape_.kind != cuda::AppendSummary::retroinfer || slot >= shape_.slots || layer >= shape_.layers ||
        head >= shape_.kv_heads || n > shape_.capacity || rows.centroids.size() != n * dim ||
        rows.value_sums.size() != n * dim) {
      fail(ErrorCode::invalid_argument, "DeviceSummaries::write_rows: {} rows for slot {} layer {} head {}", n, slot,
           layer, head);
    }
    HostRows& store = stores_[layer];
    const std::size_t c = shape_.region(slot, head);
    std::copy(rows.centroids.begin(), rows.centroids.end(), store.a.begin() + std::ptrdiff_t(c * dim));
    std::copy(rows.value_sums.begin(), rows.value_sums.end(), store.b.begin() + std::ptrdiff_t(c * dim));
    std::copy(rows.tokens.begin(), rows.tokens.end(), store.tokens.begin() + std::ptrdiff_t(c));
  }

  CacheStepStats cache_stats() override { return totals_; }

  void check_values(void* /*stream*/) override {
    if (!bad_) return;
    const cuda::AppendError e = cuda::decode_append_error(std::exchange(bad_word_, kNoAppendError));
    bad_ = false;
    const char* tensor = e.tensor == cuda::AppendTensor::q   ? "q"
                         : e.tensor == cuda::AppendTensor::k ? "k_new"
                                                             : "v_new";
    fail(ErrorCode::invalid_argument,
         "an earlier decode step's {} of batch entry {} (head {}, dim {}) was not finite; that row was not appended",
         tensor, e.entry, e.head, e.dim);
  }

  void synchronize() override {}

  // What the last step did, row r = b * kv_heads + h: Select's partitions and the LRU step's stats.
  const std::vector<std::vector<PartitionId>>& selections() const noexcept { return selections_; }
  const std::vector<CacheStepStats>& row_stats() const noexcept { return row_stats_; }
  std::uint32_t plan_overflow_rows() const noexcept { return plan_.overflow_rows; }
  // step() and index_prompt() calls so far: what the CUDA runtime would have enqueued.
  std::uint64_t calls() const noexcept { return calls_; }
  // write_summary_rows() calls so far (a host-state policy's prefills and regroups, per kv head).
  std::uint64_t summary_row_writes() const noexcept { return summary_row_writes_; }
  // The replica of the device tables (what the LRU kernel owns between downloads).
  const GpuTablesReplica& replica() const noexcept { return replica_; }

  static constexpr std::int64_t kPlanSentinel = -7;

 private:
  DeviceRuntimeSetup setup_;
  TieredKVBuffer& buffer_;
  EmulatedDeviceMemory& memory_;
  RuntimeEmulation emulation_;
  std::mt19937 rng_;
  PageLayout layout_;
  HostMemoryResource table_memory_{false};  // the "device" tables
  TransferReplicaCopy replica_copy_;
  GpuTablesReplica replica_;
  cuda::SummaryShape shape_;
  std::vector<HostRows> stores_;  // per layer: the summary store's arrays, rows set per step
  std::vector<float> q_;
  // RetroInfer's estimation terms as the CUDA runtime keeps them, and whether the last step wrote them.
  std::vector<float> extra_max_, extra_sum_, extra_acc_;
  bool estimated_ = false;
  std::uint32_t plan_row_pages_ = 0;
  std::uint32_t plan_rows_ = 0;
  PlanArrays plan_;
  std::vector<ReplicaWordWrite> writes_;
  std::vector<std::vector<PartitionId>> selections_;
  std::vector<CacheStepStats> row_stats_;
  CacheStepStats totals_;
  bool bad_ = false;
  std::uint64_t bad_word_ = kNoAppendError;
  std::uint64_t calls_ = 0;
  std::uint64_t summary_row_writes_ = 0;
};

// HostBackend's tiers and Attend with the emulated runtime for device tensors.
class EmulatedBackend final : public Backend {
 public:
  explicit EmulatedBackend(EmulatedDeviceMemory& memory, RuntimeEmulation emulation = {})
      : memory_(memory), emulation_(emulation) {}
  std::string_view name() const noexcept override { return "emulated-device"; }
  MemoryResource& cpu_tier() override { return host_.cpu_tier(); }
  MemoryResource& gpu_pages() override { return host_.gpu_pages(); }
  MemoryResource& gpu_tables() override { return host_.gpu_tables(); }
  PageTransfer& transfer() override { return host_.transfer(); }
  void attend(const AttendCall& call) override { host_.attend(call); }
  bool has_device_memory() const noexcept override { return true; }
  bool is_device_pointer(const void* p) const override { return memory_.contains(p); }
  void copy_to_host(void* host, const void* device, std::size_t bytes, void* /*stream*/) override {
    std::memcpy(host, device, bytes);
  }
  void copy_to_device(void* device, const void* host, std::size_t bytes, void* /*stream*/) override {
    std::memcpy(device, host, bytes);
  }
  std::unique_ptr<DeviceRuntime> make_device_runtime(const DeviceRuntimeSetup& setup, TieredKVBuffer& buffer) override {
    auto runtime = std::make_unique<EmulatedDeviceRuntime>(setup, buffer, memory_, emulation_);
    runtime_ = runtime.get();
    setup_ = setup;
    return runtime;
  }
  // The runtime the Manager made (null before its first device-tensor call).
  EmulatedDeviceRuntime* runtime() const noexcept { return runtime_; }
  const DeviceRuntimeSetup& setup() const noexcept { return setup_; }

 private:
  HostBackend host_;
  EmulatedDeviceMemory& memory_;
  RuntimeEmulation emulation_;
  EmulatedDeviceRuntime* runtime_ = nullptr;
  DeviceRuntimeSetup setup_;
};

}  // namespace sparsekv::test
