// The CUDA DeviceDecoder (facade/device_decoder.hpp; docs/device-decode.md):
// one layer's decode step enqueued on the engine's stream as a fixed chain of
// launches over fixed-capacity device arrays, with the host's part of the step
// handed over in one block of arguments copied from a ring of pinned slots.
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <memory>
#include <vector>

#include "sparsekv/attention/sparse_decode_attention_cuda.hpp"
#include "sparsekv/buffer/prompt_check_cuda.hpp"
#include "sparsekv/buffer/tiered_kv_buffer.hpp"
#include "sparsekv/cache/bucketed_lru_cuda.hpp"
#include "sparsekv/cache/lru_batch_cuda.hpp"
#include "sparsekv/core/error.hpp"
#include "sparsekv/facade/attend_plan_cuda.hpp"
#include "sparsekv/facade/cuda_backend.hpp"
#include "sparsekv/facade/device_step_arguments.hpp"
#include "sparsekv/metadata/gpu_tables_replica.hpp"
#include "sparsekv/metadata/replica_writes_cuda.hpp"
#include "sparsekv/policy/append_summaries_cuda.hpp"
#include "sparsekv/policy/device_summaries.hpp"
#include "sparsekv/policy/index_cuda.hpp"
#include "sparsekv/policy/select_cuda.hpp"
#include "sparsekv/transfer/page_gather_cuda.hpp"
#include "sparsekv/transfer/prompt_offload.hpp"
#include "sparsekv/transfer/staged_save.hpp"

namespace sparsekv::cuda {
namespace {

void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) fail(ErrorCode::cuda_error, "DeviceDecoder: {} failed: {}", what, cudaGetErrorString(status));
}

// Device memory of a fixed size, freed with the decoder.
class DeviceBytes {
 public:
  DeviceBytes() = default;
  explicit DeviceBytes(std::size_t bytes) : bytes_(std::max<std::size_t>(bytes, 16)) {
    check(cudaMalloc(&data_, bytes_), "cudaMalloc");
  }
  ~DeviceBytes() { cudaFree(data_); }
  DeviceBytes(DeviceBytes&& o) noexcept : data_(std::exchange(o.data_, nullptr)), bytes_(o.bytes_) {}
  DeviceBytes& operator=(DeviceBytes&& o) noexcept {
    std::swap(data_, o.data_);
    std::swap(bytes_, o.bytes_);
    return *this;
  }
  template <class T>
  T* as() const noexcept {
    return static_cast<T*>(data_);
  }
  std::size_t bytes() const noexcept { return bytes_; }

 private:
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
};

// Pinned host memory (device-accessible through UVA).
class PinnedBytes {
 public:
  PinnedBytes() = default;
  explicit PinnedBytes(std::size_t bytes) { check(cudaHostAlloc(&data_, std::max<std::size_t>(bytes, 16), cudaHostAllocMapped | cudaHostAllocPortable), "cudaHostAlloc"); }
  ~PinnedBytes() { cudaFreeHost(data_); }
  PinnedBytes(PinnedBytes&& o) noexcept : data_(std::exchange(o.data_, nullptr)) {}
  PinnedBytes& operator=(PinnedBytes&& o) noexcept {
    std::swap(data_, o.data_);
    return *this;
  }
  template <class T>
  T* as() const noexcept {
    return static_cast<T*>(data_);
  }

 private:
  void* data_ = nullptr;
};

constexpr std::size_t align16(std::size_t n) { return (n + 15) / 16 * 16; }

// Where each array of the step's argument block sits (the same offsets in the
// pinned ring slots and in the device copy).
struct ArgsLayout {
  std::size_t write_count, tail_slots, tail_pages, tail_tokens, first, count, summary_rows, instances, cpu_pages,
      sink_partitions, sink_tokens, recent, windows, writes, bytes;
  std::uint32_t max_writes;
  ArgsLayout(std::uint32_t batch, std::uint32_t rows) {
    max_writes = device_step_max_writes(rows);
    std::size_t at = 0;
    const auto take = [&](std::size_t bytes) {
      const std::size_t here = at;
      at += align16(bytes);
      return here;
    };
    write_count = take(sizeof(std::uint32_t));
    tail_slots = take(sizeof(std::uint32_t) * batch);
    tail_pages = take(sizeof(PageId) * rows);
    tail_tokens = take(sizeof(std::uint32_t) * rows);
    first = take(sizeof(std::uint32_t) * rows);
    count = take(sizeof(std::uint32_t) * rows);
    summary_rows = take(sizeof(std::uint32_t) * rows);
    instances = take(sizeof(std::size_t) * rows);
    cpu_pages = take(sizeof(std::byte*) * rows);
    sink_partitions = take(sizeof(PartitionId) * rows);
    sink_tokens = take(sizeof(std::uint32_t) * rows);
    recent = take(sizeof(std::uint32_t) * rows);
    windows = take(sizeof(std::uint32_t) * rows);
    writes = take(sizeof(ReplicaWordWrite) * max_writes);
    bytes = at;
  }
};

template <class T>
T* at(std::byte* base, std::size_t offset) {
  return reinterpret_cast<T*>(base + offset);
}

constexpr std::size_t kRing = 4;  // step argument slots in flight
// Stage timing marks: the step's start, then the end of append, select, lru,
// gather and attend (DeviceStageTimes).
constexpr std::size_t kStageMarks = 6;
// Bytes of one staged D2H save of a prompt: pieces bound the pinned staging
// (two slots) and let the copy of one piece overlap the scatter of the last.
constexpr std::size_t kPromptPieceBytes = std::size_t{32} << 20;

class CudaDeviceDecoder final : public DeviceDecoder {
 public:
  CudaDeviceDecoder(const DeviceDecoderSetup& setup, TieredKVBuffer& buffer, DeviceMemoryResource& device_memory)
      : setup_(setup),
        buffer_(buffer),
        layout_{setup.page_tokens, setup.shape.head_dim, setup.shape.dtype},
        rows_(setup.max_batch * setup.shape.kv_heads),
        args_(setup.max_batch, rows_),
        replica_(buffer.table(), device_memory, buffer.transfer()),
        summaries_(device_summary_kind(setup.select), setup.shape.layers, setup.max_requests, setup.shape.kv_heads, setup.shape.head_dim,
                   setup.max_partitions_per_head, setup.first_partition) {
    buffer_.transfer().synchronize();  // the replica's directory copy
    const ModelShape& s = setup.shape;
    const std::size_t max_selected = std::size_t{rows_} * setup.max_selected_per_head;
    const std::size_t max_pages = std::size_t{rows_} * setup.max_pages_per_head;
    args_device_ = DeviceBytes(args_.bytes);
    for (auto& slot : ring_) slot = PinnedBytes(args_.bytes);
    for (auto& e : events_) check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate");
    q_ = DeviceBytes(sizeof(float) * setup.max_batch * s.q_heads * s.head_dim);
    selected_ = DeviceBytes(sizeof(PartitionId) * max_selected);
    selected_count_ = DeviceBytes(sizeof(std::uint32_t) * rows_);
    select_rows_ = rows_template(rows_);
    select_workspace_ = DeviceBytes(setup.select == DeviceSelectSpec::Kind::retroinfer
                                        ? std::max(select_workspace_bytes(select_rows_),
                                                   estimate_workspace_bytes(select_rows_))
                                        : select_workspace_bytes(select_rows_));
    if (setup.select == DeviceSelectSpec::Kind::retroinfer) {
      const std::size_t terms = std::size_t{setup.max_batch} * s.q_heads;
      extra_max_ = DeviceBytes(sizeof(float) * terms);
      extra_sum_ = DeviceBytes(sizeof(float) * terms);
      extra_acc_ = DeviceBytes(sizeof(float) * terms * s.head_dim);
    }
    selection_offsets_ = DeviceBytes(sizeof(std::uint32_t) * (rows_ + 1));
    page_offsets_ = DeviceBytes(sizeof(std::uint32_t) * (rows_ + 1));
    compact_ = DeviceBytes(sizeof(PartitionId) * max_selected);
    partition_tokens_ = DeviceBytes(sizeof(std::uint32_t) * max_selected);
    lru_batch_workspace_ = DeviceBytes(lru_batch_workspace_bytes(rows_));
    partition_offsets_ = DeviceBytes(sizeof(std::uint32_t) * (max_selected + 1));
    gpu_pages_ = DeviceBytes(sizeof(PageId) * max_pages);
    copy_cpu_ = DeviceBytes(sizeof(PageId) * max_pages);
    copy_gpu_ = DeviceBytes(sizeof(PageId) * max_pages);
    stats_ = DeviceBytes(sizeof(CacheStepStats) * rows_);
    totals_ = DeviceBytes(sizeof(CacheStepStats));
    check(cudaMemset(totals_.as<void>(), 0, sizeof(CacheStepStats)), "cudaMemset");
    if (setup.max_selected_per_head > kLruSharedSelection) {
      lru_scratch_ = DeviceBytes(sizeof(std::uint32_t) * 4 * max_selected);
    }
    // The plan: a row attends its selection's pages and the tail, each page a run at worst.
    plan_row_pages_ = setup.max_pages_per_head + 1;
    indptr_ = DeviceBytes(sizeof(std::int64_t) * (std::size_t{rows_} * plan_row_pages_ + 1));
    indices_ = DeviceBytes(sizeof(std::int64_t) * rows_ * plan_row_pages_);
    last_page_len_ = DeviceBytes(sizeof(std::int32_t) * rows_ * plan_row_pages_);
    head_entries_ = DeviceBytes(sizeof(std::int64_t) * (rows_ + 1));
    overflow_ = DeviceBytes(sizeof(std::uint32_t));
    plan_workspace_ = DeviceBytes(device_plan_workspace_bytes(rows_));
    error_ = DeviceBytes(sizeof(std::uint64_t));
    check(cudaMemset(error_.as<void>(), 0xff, sizeof(std::uint64_t)), "cudaMemset");
    errors_ = PinnedBytes(sizeof(std::uint64_t) * kRing);
    std::fill_n(errors_.as<std::uint64_t>(), kRing, kNoAppendError);
    // Every CPU-tier chunk the pool may ever reserve, device-readable.
    const PagePool& cpu = buffer.cpu_pool();
    const std::size_t max_chunks = (std::size_t{cpu.capacity()} + cpu.pages_per_chunk() - 1) / cpu.pages_per_chunk();
    chunk_bases_ = PinnedBytes(sizeof(std::byte*) * max_chunks);
    if (setup.shape.head_dim == 64 || setup.shape.head_dim == 128) {
      DecodeAttentionShape shape = attention_shape(setup.max_batch);
      attention_workspace_ = DeviceBytes(sparse_decode_attention_workspace_capacity(shape));
    }
  }

  ~CudaDeviceDecoder() override {
    cudaDeviceSynchronize();  // a destructor cannot report; the memory goes either way
    for (auto& e : events_) cudaEventDestroy(e);
    for (auto& marks : stage_events_) {
      for (auto& e : marks) {
        if (e != nullptr) cudaEventDestroy(e);
      }
    }
  }

  void upload_tables(RequestId request) override {
    synchronize();
    replica_.upload(buffer_.table(), request, buffer_.transfer());
    buffer_.transfer().synchronize();
  }
  void download_tables(RequestId request) override {
    synchronize();
    replica_.download(buffer_.table(), request, buffer_.transfer());
  }

  std::uint64_t first_non_finite(const void* data, std::uint64_t count, void* stream) override {
    const auto s = static_cast<cudaStream_t>(stream);
    if (!finite_word_.bytes()) finite_word_ = DeviceBytes(sizeof(std::uint64_t));
    cuda::first_non_finite(data, count, setup_.shape.dtype, finite_word_.as<std::uint64_t>(), stream);
    std::uint64_t first = kAllFinite;
    check(cudaMemcpyAsync(&first, finite_word_.as<void>(), sizeof first, cudaMemcpyDeviceToHost, s),
          "cudaMemcpyAsync D2H");
    check(cudaStreamSynchronize(s), "cudaStreamSynchronize");
    return first == kAllFinite ? kNoNonFinite : first;
  }

  void offload_prompt(const void* k, const void* v, std::span<const TokenPlacement> placements,
                      void* stream) override {
    if (!saver_) saver_ = std::make_unique<StagedSaver>();
    save_prompt(*saver_, buffer_.cpu_pool(), k, v, placements, kPromptPieceBytes, stream, k_targets_, v_targets_);
  }

  void index_prompt(std::uint32_t slot, std::uint32_t layer, const void* keys, std::uint32_t tokens,
                    const DeviceSelectSpec& select, void* stream) override {
    const KeyBlock block{keys, setup_.shape.dtype, tokens, setup_.shape.kv_heads, setup_.shape.head_dim};
    const std::size_t bytes = summaries_.prefill_workspace_bytes(tokens, select.partition_tokens);
    if (index_workspace_.bytes() < bytes) {
      check(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)), "cudaStreamSynchronize");
      index_workspace_ = DeviceBytes(bytes);
    }
    summaries_.write_prefill(slot, layer, block, select.partition_tokens, index_workspace_.as<void>(),
                             index_workspace_.bytes(), stream);
  }

  void step(const DeviceStep& step) override {
    const ModelShape& s = setup_.shape;
    const std::uint32_t rows = step.batch * s.kv_heads;
    if (step.batch == 0 || step.batch > setup_.max_batch) {
      fail(ErrorCode::invalid_argument, "decode: batch of {} outside [1, {}]", step.batch, setup_.max_batch);
    }
    if (device_summary_kind(step.select.kind) != summaries_.shape().kind) {
      fail(ErrorCode::invalid_argument, "decode: layer {}'s Select reads other summaries than the decoder keeps",
           step.layer);
    }
    const auto stream = static_cast<cudaStream_t>(step.stream);
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    check(cudaStreamIsCapturing(stream, &capture), "cudaStreamIsCapturing");
    const bool capturing = capture != cudaStreamCaptureStatusNone;

    // 0. The step's arguments, written into a ring slot no launch still reads.
    //    A captured step gets a slot of its own, kept for the decoder's life:
    //    its graph copies from it at every replay, long after the ring has
    //    moved on, and reports its error word there (read by synchronize()).
    std::size_t k = 0;
    std::byte* slot = nullptr;
    std::uint64_t* error_word = nullptr;
    if (capturing) {
      captured_.emplace_back(args_.bytes + sizeof(std::uint64_t));
      slot = captured_.back().as<std::byte>();
      error_word = at<std::uint64_t>(slot, args_.bytes);
      *error_word = kNoAppendError;
    } else {
      k = next_++ % kRing;
      if (pending_[k]) {
        check(cudaEventSynchronize(events_[k]), "cudaEventSynchronize");  // only when kRing steps are in flight
        harvest(k);
      }
      slot = ring_[k].as<std::byte>();
      error_word = errors_.as<std::uint64_t>() + k;
    }
    const bool timed = time_stages_ && !capturing;
    const auto mark = [&](std::size_t i) {
      if (timed) check(cudaEventRecord(stage_events_[k][i], stream), "cudaEventRecord");
    };
    mark(0);
    fill_arguments(step, slot);
    refresh_chunks();
    std::byte* args = args_device_.as<std::byte>();
    check(cudaMemcpyAsync(args, slot, args_.bytes, cudaMemcpyHostToDevice, stream), "cudaMemcpyAsync H2D");

    // 1. The meta entries of last steps' saved pages into the device tables.
    apply_replica_writes(at<ReplicaWordWrite>(args, args_.writes), at<std::uint32_t>(args, args_.write_count),
                         args_.max_writes, stream);

    // 2. Append (+ summaries and save of full tails).
    DeviceAppend append;
    append.batch = step.batch;
    append.q_heads = s.q_heads;
    append.kv_heads = s.kv_heads;
    append.layout = layout_;
    append.q = step.q;
    append.k_new = step.k_new;
    append.v_new = step.v_new;
    append.q_out = q_.as<float>();
    append.gpu_tier = const_cast<std::byte*>(buffer_.gpu_pool().base());
    append.page_stride = buffer_.gpu_pool().page_bytes();
    append.tail_pages = at<PageId>(args, args_.tail_pages);
    append.tail_slots = at<std::uint32_t>(args, args_.tail_slots);
    append.cpu_pages = at<std::byte* const>(args, args_.cpu_pages);
    append.error = error_.as<std::uint64_t>();
    append_tokens(append, summaries_.append_summaries(step.layer, at<std::uint32_t>(args, args_.summary_rows)),
                  stream);
    mark(1);

    // 3. Select over the summaries, on the state before this step's save.
    SelectRows select = select_rows_;
    select.rows = rows;
    select.first = at<std::uint32_t>(args, args_.first);
    select.count = at<std::uint32_t>(args, args_.count);
    select.tokens = summaries_.tokens(step.layer);
    select.partitions = summaries_.partitions();
    select.q = q_.as<float>();
    const SelectOutput selected{setup_.max_selected_per_head, selected_.as<PartitionId>(),
                                selected_count_.as<std::uint32_t>()};
    switch (step.select.kind) {
      case DeviceSelectSpec::Kind::quest: {
        const QuestSelect quest{summaries_.min(step.layer),  summaries_.max(step.layer), step.select.budget_tokens,
                                step.select.dense_layer,    step.select.sink_tokens,    step.select.window_tokens,
                                step.select.spread};
        quest_select(select, quest, selected, select_workspace_.as<void>(), select_workspace_.bytes(), stream);
        break;
      }
      case DeviceSelectSpec::Kind::shadowkv: {
        const ShadowKVSelect shadow{summaries_.landmarks(step.layer), summaries_.outlier_scores(step.layer),
                                    step.select.budget_tokens, step.select.recent_tokens, step.select.outlier_pages};
        shadowkv_select(select, shadow, selected, select_workspace_.as<void>(), select_workspace_.bytes(), stream);
        break;
      }
      case DeviceSelectSpec::Kind::streaming: {
        const StreamingSelect streaming{step.select.budget_tokens, step.select.sink_pages, setup_.page_tokens};
        streaming_select(select, streaming, selected, stream);
        break;
      }
      case DeviceSelectSpec::Kind::dense:
        dense_select(select, selected, stream);
        break;
      case DeviceSelectSpec::Kind::retroinfer: {
        RetroInferSelect retro;
        retro.centroids = summaries_.centroids(step.layer);
        retro.sink_partitions = at<PartitionId>(args, args_.sink_partitions);
        retro.sink_tokens = at<std::uint32_t>(args, args_.sink_tokens);
        retro.recent = at<std::uint32_t>(args, args_.recent);
        retro.windows = at<std::uint32_t>(args, args_.windows);
        retro.budget_tokens = step.select.budget_tokens;
        retro.retrieval_fraction = step.select.retrieval_fraction;
        retroinfer_select(select, retro, selected, select_workspace_.as<void>(), select_workspace_.bytes(), stream);
        // The estimation zone's terms, for the attention (or the engine's kernel) to merge.
        estimated_ = step.select.estimation;
        if (estimated_) {
          RetroInferEstimate estimate;
          estimate.value_sums = summaries_.value_sums(step.layer);
          estimate.selected = selected.selected;
          estimate.selected_count = selected.selected_count;
          estimate.max_selected = selected.max_selected;
          estimate.estimation_fraction = step.select.estimation_fraction;
          const EstimateOutput terms{extra_max_.as<float>(), extra_sum_.as<float>(), extra_acc_.as<float>()};
          retroinfer_estimate(select, retro, estimate, terms, select_workspace_.as<void>(), select_workspace_.bytes(),
                              stream);
        }
        break;
      }
      case DeviceSelectSpec::Kind::none:
        break;  // refused before anything was enqueued
    }
    mark(2);

    // 4. Retrieve: the selection as the LRU batch, the LRU step on the device
    //    tables, the gather of its misses straight from its output.
    const PartitionLookup lookup = replica_.lookup(buffer_.table());
    const LruBatchInput lru_in{rows, selected.max_selected, selected.selected, selected.selected_count,
                               at<std::size_t>(args, args_.instances)};
    const LruBatchOutput lru_csr{selection_offsets_.as<std::uint32_t>(), compact_.as<PartitionId>(),
                                 page_offsets_.as<std::uint32_t>(), partition_tokens_.as<std::uint32_t>()};
    build_lru_batch(lookup, lru_in, lru_csr, lru_batch_workspace_.as<void>(), lru_batch_workspace_.bytes(), stream);
    const LruStepBatch lru = lru_step_batch(lru_in, lru_csr, lru_scratch_.as<std::uint32_t>());
    LruStepOutput lru_out;
    lru_out.partition_offsets = partition_offsets_.as<std::uint32_t>();
    lru_out.gpu_pages = gpu_pages_.as<PageId>();
    lru_out.copy_cpu_pages = copy_cpu_.as<PageId>();
    lru_out.copy_gpu_pages = copy_gpu_.as<PageId>();
    lru_out.stats = stats_.as<CacheStepStats>();
    bucketed_lru_step(replica_.gpu_page_view(), lookup, lru, lru_out, setup_.timestamp_buckets, stream);
    mark(3);
    DeviceMissList misses;
    misses.heads = rows;
    misses.max_entries = rows * setup_.max_pages_per_head;
    misses.page_offsets = lru_csr.page_offsets;
    misses.counts = &lru_out.stats->miss_pages;
    misses.count_stride = sizeof(CacheStepStats) / sizeof(std::uint64_t);
    misses.cpu_pages = copy_cpu_.as<PageId>();
    misses.gpu_pages = copy_gpu_.as<PageId>();
    const PagePool& cpu = buffer_.cpu_pool();
    const ChunkedPages cpu_tier{chunk_bases_.as<const std::byte* const>(), cpu.pages_per_chunk(), cpu.page_bytes()};
    gather_miss_list(misses, cpu_tier, const_cast<std::byte*>(buffer_.gpu_pool().base()),
                     buffer_.gpu_pool().page_bytes(), buffer_.gpu_pool().page_bytes(), GatherConfig{}, stream);
    accumulate_step_stats(lru_out.stats, rows, totals_.as<CacheStepStats>(), stream);
    mark(4);

    // 5. Plan: FlashInfer's CSR over the runs, in device memory.
    DevicePlanInput in;
    in.rows = rows;
    in.selection_offsets = lru_csr.selection_offsets;
    in.partition_offsets = lru_out.partition_offsets;
    in.gpu_pages = lru_out.gpu_pages;
    in.partition_tokens = lru_csr.partition_tokens;
    in.tail_pages = at<PageId>(args, args_.tail_pages);
    in.tail_tokens = at<std::uint32_t>(args, args_.tail_tokens);
    in.page_tokens = setup_.page_tokens;
    in.max_pages_per_row = plan_row_pages_;
    in.max_entries_per_row = plan_row_pages_;
    DevicePlanOutput out;
    out.indptr = indptr_.as<std::int64_t>();
    out.indices = indices_.as<std::int64_t>();
    out.last_page_len = last_page_len_.as<std::int32_t>();
    out.head_entries = head_entries_.as<std::int64_t>();
    out.overflow_rows = overflow_.as<std::uint32_t>();
    build_device_plan(in, out, plan_workspace_.as<void>(), plan_workspace_.bytes(), stream);
    plan_rows_ = rows;

    // 6. Attend.
    if (step.out != nullptr) {
      const DecodeAttentionShape shape = attention_shape(step.batch);
      DecodeAttentionArgs a;
      a.q = q_.as<float>();
      a.page_base = buffer_.gpu_pool().base();
      a.page_stride = buffer_.gpu_pool().page_bytes();
      a.row_entries = out.head_entries;
      a.indptr = out.indptr;
      a.indices = out.indices;
      a.last_page_len = out.last_page_len;
      a.scale = setup_.scale;
      if (estimated_) a.extra = {extra_max_.as<float>(), extra_sum_.as<float>(), extra_acc_.as<float>()};
      a.out = step.out;
      a.workspace = attention_workspace_.as<void>();
      a.workspace_bytes = attention_workspace_.bytes();
      sparse_decode_attention(shape, a, stream);
    }
    mark(5);

    // 7. The append's error word, read by check_values() once the step is past.
    check(cudaMemcpyAsync(error_word, error_.as<void>(), sizeof(std::uint64_t), cudaMemcpyDeviceToHost, stream),
          "cudaMemcpyAsync D2H");
    check(cudaMemsetAsync(error_.as<void>(), 0xff, sizeof(std::uint64_t), stream), "cudaMemsetAsync");
    if (!capturing) {
      check(cudaEventRecord(events_[k], stream), "cudaEventRecord");
      pending_[k] = true;
      timed_[k] = timed;
    }
    last_stream_ = stream;
  }

  DeviceAttendPlan plan() const override {
    DeviceAttendPlan p;
    p.head_entries = head_entries_.as<std::int64_t>();
    p.indptr = indptr_.as<std::int64_t>();
    p.indices = indices_.as<std::int64_t>();
    p.last_page_len = last_page_len_.as<std::int32_t>();
    p.gpu_tier_base = buffer_.gpu_pool().base();
    p.page_bytes = buffer_.gpu_pool().page_bytes();
    p.rows = plan_rows_;
    if (estimated_) {
      p.extra_max = extra_max_.as<float>();
      p.extra_sum = extra_sum_.as<float>();
      p.extra_acc = extra_acc_.as<float>();
    }
    return p;
  }

  bool capturing(void* stream) const override {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    check(cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &capture), "cudaStreamIsCapturing");
    return capture != cudaStreamCaptureStatusNone;
  }

  void write_summary_rows(std::uint32_t slot, std::uint32_t layer, std::uint32_t head, const DeviceSummaryRows& rows,
                          void* stream) override {
    summaries_.write_rows(slot, layer, head, rows.centroids, rows.value_sums, rows.tokens, stream);
  }

  CacheStepStats cache_stats() override {
    synchronize();
    CacheStepStats total;
    check(cudaMemcpy(&total, totals_.as<void>(), sizeof total, cudaMemcpyDeviceToHost), "cudaMemcpy D2H");
    return total;
  }

  void check_values(void* stream) override {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    check(cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &capture), "cudaStreamIsCapturing");
    if (capture != cudaStreamCaptureStatusNone) return;
    for (std::size_t k = 0; k < kRing; ++k) {
      if (pending_[k] && cudaEventQuery(events_[k]) == cudaSuccess) harvest(k);
    }
    if (!bad_) return;
    const AppendError e = decode_append_error(std::exchange(bad_word_, kNoAppendError));
    bad_ = false;
    const char* tensor = e.tensor == AppendTensor::q ? "q" : e.tensor == AppendTensor::k ? "k_new" : "v_new";
    fail(ErrorCode::invalid_argument,
         "an earlier decode step's {} of batch entry {} (head {}, dim {}) was not finite; that row was not appended",
         tensor, e.entry, e.head, e.dim);
  }

  void synchronize() override {
    check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    for (std::size_t k = 0; k < kRing; ++k) {
      if (pending_[k]) harvest(k);
    }
    for (const PinnedBytes& captured : captured_) {
      note_error(std::exchange(*at<std::uint64_t>(captured.as<std::byte>(), args_.bytes), kNoAppendError));
    }
  }

  void time_stages(bool on) override {
    if (on && stage_events_[0][0] == nullptr) {
      for (auto& marks : stage_events_) {
        for (auto& e : marks) check(cudaEventCreate(&e), "cudaEventCreate");
      }
    }
    time_stages_ = on;
  }

  DeviceStageTimes stage_times() override {
    synchronize();
    return stage_totals_;
  }

 private:
  DecodeAttentionShape attention_shape(std::uint32_t batch) const {
    DecodeAttentionShape shape;
    shape.batch = batch;
    shape.q_heads = setup_.shape.q_heads;
    shape.kv_heads = setup_.shape.kv_heads;
    shape.layout = layout_;
    shape.max_pages = plan_row_pages_;
    return shape;
  }

  SelectRows rows_template(std::uint32_t rows) const {
    SelectRows r;
    r.rows = rows;
    r.kv_heads = setup_.shape.kv_heads;
    r.group = setup_.shape.q_heads / setup_.shape.kv_heads;
    r.head_dim = setup_.shape.head_dim;
    r.candidates = summaries_.candidates();
    r.max_row_candidates = setup_.max_partitions_per_head;
    return r;
  }

  // A completed step's error word, kept until check_values() reports it, and
  // its stage times (its marks precede events_[k] on its stream: complete).
  void harvest(std::size_t k) {
    pending_[k] = false;
    if (std::exchange(timed_[k], false)) {
      std::array<float, kStageMarks - 1> ms{};
      for (std::size_t i = 0; i + 1 < kStageMarks; ++i) {
        check(cudaEventElapsedTime(&ms[i], stage_events_[k][i], stage_events_[k][i + 1]), "cudaEventElapsedTime");
      }
      stage_totals_.append_ms += ms[0];
      stage_totals_.select_ms += ms[1];
      stage_totals_.lru_ms += ms[2];
      stage_totals_.gather_ms += ms[3];
      stage_totals_.attend_ms += ms[4];
      ++stage_totals_.steps;
    }
    note_error(std::exchange(errors_.as<std::uint64_t>()[k], kNoAppendError));
  }

  // Keeps the first (lowest) error word until check_values() reports it.
  void note_error(std::uint64_t word) {
    if (word != kNoAppendError && (!bad_ || word < bad_word_)) {
      bad_ = true;
      bad_word_ = word;
    }
  }

  void refresh_chunks() {
    const auto chunks = buffer_.cpu_pool().chunks();
    std::copy(chunks.begin(), chunks.end(), chunk_bases_.as<std::byte*>());
  }

  // The step's arguments into a slot, laid out as args_ says.
  void fill_arguments(const DeviceStep& step, std::byte* slot) {
    const std::uint32_t batch = setup_.max_batch;
    DeviceStepArguments a;
    a.tail_slots = {at<std::uint32_t>(slot, args_.tail_slots), batch};
    a.tail_pages = {at<PageId>(slot, args_.tail_pages), rows_};
    a.tail_tokens = {at<std::uint32_t>(slot, args_.tail_tokens), rows_};
    a.first = {at<std::uint32_t>(slot, args_.first), rows_};
    a.count = {at<std::uint32_t>(slot, args_.count), rows_};
    a.summary_rows = {at<std::uint32_t>(slot, args_.summary_rows), rows_};
    a.instances = {at<std::size_t>(slot, args_.instances), rows_};
    a.cpu_pages = {at<std::byte*>(slot, args_.cpu_pages), rows_};
    a.sink_partitions = {at<PartitionId>(slot, args_.sink_partitions), rows_};
    a.sink_tokens = {at<std::uint32_t>(slot, args_.sink_tokens), rows_};
    a.recent = {at<std::uint32_t>(slot, args_.recent), rows_};
    a.windows = {at<std::uint32_t>(slot, args_.windows), rows_};
    a.writes = {at<ReplicaWordWrite>(slot, args_.writes), args_.max_writes};
    a.write_count = at<std::uint32_t>(slot, args_.write_count);
    fill_device_step_arguments(step, setup_.shape.kv_heads, summaries_.shape(), buffer_.cpu_pool(), replica_,
                               buffer_.table(), writes_, a);
  }

  DeviceDecoderSetup setup_;
  TieredKVBuffer& buffer_;
  PageLayout layout_;
  std::uint32_t rows_;
  ArgsLayout args_;
  GpuTablesReplica replica_;
  DeviceSummaries summaries_;
  DeviceBytes args_device_;
  std::array<PinnedBytes, kRing> ring_;
  std::array<cudaEvent_t, kRing> events_{};
  std::array<bool, kRing> pending_{};
  // Stage timing (time_stages): marks per ring slot, made on first use.
  bool time_stages_ = false;
  std::array<std::array<cudaEvent_t, kStageMarks>, kRing> stage_events_{};
  std::array<bool, kRing> timed_{};
  DeviceStageTimes stage_totals_;
  // The device prefill: its finiteness word and staged D2H saver, made on first use.
  DeviceBytes finite_word_;
  std::unique_ptr<StagedSaver> saver_;
  std::vector<RowTarget> k_targets_, v_targets_;
  std::size_t next_ = 0;
  std::vector<PinnedBytes> captured_;  // the argument slots of captured steps
  DeviceBytes q_, selected_, selected_count_, select_workspace_;
  // RetroInfer's estimation terms (DecodeAttentionExtra), and whether the last step wrote them.
  DeviceBytes extra_max_, extra_sum_, extra_acc_;
  bool estimated_ = false;
  SelectRows select_rows_;
  DeviceBytes selection_offsets_, page_offsets_, compact_, partition_tokens_, lru_batch_workspace_;
  DeviceBytes partition_offsets_, gpu_pages_, copy_cpu_, copy_gpu_, stats_, totals_, lru_scratch_;
  std::uint32_t plan_row_pages_ = 0;
  std::uint32_t plan_rows_ = 0;
  DeviceBytes indptr_, indices_, last_page_len_, head_entries_, overflow_, plan_workspace_;
  DeviceBytes attention_workspace_, index_workspace_;
  DeviceBytes error_;
  PinnedBytes errors_, chunk_bases_;
  bool bad_ = false;
  std::uint64_t bad_word_ = kNoAppendError;
  std::vector<ReplicaWordWrite> writes_;
  cudaStream_t last_stream_ = nullptr;
};

}  // namespace

std::unique_ptr<DeviceDecoder> CudaBackend::make_device_decoder(const DeviceDecoderSetup& setup,
                                                               TieredKVBuffer& buffer) {
  return std::make_unique<CudaDeviceDecoder>(setup, buffer, device_);
}

}  // namespace sparsekv::cuda
