// The CUDA DeviceRuntime (step/device_runtime.hpp; docs/device-decode.md):
// one layer's decode step enqueued on the engine's stream as a fixed chain of
// launches over fixed-capacity device arrays -- append, Select, Retrieve (LRU
// and gather), plan, Attend -- with the host's part of the step handed over in
// one block of arguments from a ring of pinned slots (argument_ring.hpp),
// timed per stage on request (stage_timer.hpp).
#include "sparsekv/step/device_runtime_cuda.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <memory>
#include <vector>

#include "argument_ring.hpp"
#include "device_memory.hpp"
#include "stage_timer.hpp"
#include "sparsekv/attention/attend_plan_cuda.hpp"
#include "sparsekv/attention/sparse_decode_attention_cuda.hpp"
#include "sparsekv/buffer/prompt_check_cuda.hpp"
#include "sparsekv/buffer/tiered_kv_buffer.hpp"
#include "sparsekv/buffer/transfer_replica_copy.hpp"
#include "sparsekv/cache/bucketed_lru_cuda.hpp"
#include "sparsekv/cache/lru_batch_cuda.hpp"
#include "sparsekv/core/error.hpp"
#include "sparsekv/metadata/gpu_tables_replica.hpp"
#include "sparsekv/metadata/replica_writes_cuda.hpp"
#include "sparsekv/policy/device_select_launch.hpp"
#include "sparsekv/policy/index_cuda.hpp"
#include "sparsekv/policy/select_cuda.hpp"
#include "sparsekv/policy/summary_store_cuda.hpp"
#include "sparsekv/step/append_summaries_cuda.hpp"
#include "sparsekv/step/launch_arguments.hpp"
#include "sparsekv/step/prompt_offload.hpp"
#include "sparsekv/transfer/page_gather_cuda.hpp"

namespace sparsekv::cuda {
namespace {

// Bytes of one staged D2H save of a prompt: pieces bound the pinned staging
// (two slots) and let the copy of one piece overlap the scatter of the last.
constexpr std::size_t kPromptPieceBytes = std::size_t{32} << 20;

// The registered launch of a layer's device Select (policy/device_select_launch.hpp);
// invalid_argument, before anything is enqueued, for a spec that has none.
DeviceSelectLauncher launcher_of(const DeviceSelect& select) {
  register_builtin_device_select_launchers();
  const DeviceSelectLauncher launcher = find_device_select_launcher(select);
  if (launcher == nullptr) {
    fail(ErrorCode::invalid_argument, "DeviceRuntime: no launcher is registered for the device Select {}",
         select.type().name());
  }
  return launcher;
}

class CudaDeviceRuntime final : public DeviceRuntime {
 public:
  CudaDeviceRuntime(const DeviceRuntimeSetup& setup, TieredKVBuffer& buffer, DeviceMemoryResource& device_memory)
      : setup_(setup),
        buffer_(buffer),
        layout_{setup.page_tokens, setup.shape.head_dim, setup.shape.dtype},
        rows_(setup.max_batch * setup.shape.kv_heads),
        ring_(setup.max_batch, rows_, setup.shape.layers),
        replica_copy_(buffer.tiers().transfer),
        replica_(buffer.tiers().table, device_memory, replica_copy_),
        summaries_(store_summary_kind(setup.select), setup.shape.layers, setup.max_requests, setup.shape.kv_heads,
                   setup.shape.head_dim, setup.max_partitions_per_head, setup.select.first_partition()) {
    buffer_.tiers().transfer.synchronize();  // the replica's directory copy
    const ModelShape& s = setup.shape;
    const std::size_t max_selected = std::size_t{rows_} * setup.max_selected_per_head;
    const std::size_t max_pages = std::size_t{rows_} * setup.max_pages_per_head;
    launcher_ = launcher_of(setup.select);
    q_ = DeviceBytes(sizeof(float) * setup.max_batch * s.q_heads * s.head_dim);
    selected_ = DeviceBytes(sizeof(PartitionId) * max_selected);
    selected_count_ = DeviceBytes(sizeof(std::uint32_t) * rows_);
    select_rows_ = rows_template(rows_);
    select_workspace_ = DeviceBytes(select_workspace_bytes(select_rows_));
    if (setup.select.estimates()) {
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
    check_runtime(cudaMemset(totals_.as<void>(), 0, sizeof(CacheStepStats)), "cudaMemset");
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
    check_runtime(cudaMemset(error_.as<void>(), 0xff, sizeof(std::uint64_t)), "cudaMemset");
    // Every CPU-tier chunk the pool may ever reserve, device-readable.
    const PagePool& cpu = buffer.tiers().cpu_pool;
    const std::size_t max_chunks = (std::size_t{cpu.capacity()} + cpu.pages_per_chunk() - 1) / cpu.pages_per_chunk();
    chunk_bases_ = PinnedBytes(sizeof(std::byte*) * max_chunks);
    if (setup.shape.head_dim == 64 || setup.shape.head_dim == 128) {
      DecodeAttentionShape shape = attention_shape(setup.max_batch);
      attention_workspace_ = DeviceBytes(sparse_decode_attention_workspace_capacity(shape));
    }
  }

  ~CudaDeviceRuntime() override {
    cudaDeviceSynchronize();  // a destructor cannot report; the memory goes either way
  }

  // ---- Tables, prompts and summaries (off the step's path) -----------------

  void upload_tables(RequestId request) override {
    synchronize();
    replica_.upload(buffer_.tiers().table, request, replica_copy_);
    buffer_.tiers().transfer.synchronize();
  }
  void download_tables(RequestId request) override {
    synchronize();
    replica_.download(buffer_.tiers().table, request, replica_copy_);
  }

  std::uint64_t first_non_finite(const void* data, std::uint64_t count, void* stream) override {
    const auto s = static_cast<cudaStream_t>(stream);
    if (!finite_word_.bytes()) finite_word_ = DeviceBytes(sizeof(std::uint64_t));
    cuda::first_non_finite(data, count, setup_.shape.dtype, finite_word_.as<std::uint64_t>(), stream);
    std::uint64_t first = kAllFinite;
    check_runtime(cudaMemcpyAsync(&first, finite_word_.as<void>(), sizeof first, cudaMemcpyDeviceToHost, s),
                  "cudaMemcpyAsync D2H");
    check_runtime(cudaStreamSynchronize(s), "cudaStreamSynchronize");
    return first == kAllFinite ? kNoNonFinite : first;
  }

  void offload_prompt(const void* k, const void* v, std::span<const TokenPlacement> placements, void* stream) override {
    if (!saver_) saver_ = std::make_unique<FlashD2HSaver>();
    save_prompt(*saver_, buffer_.tiers().cpu_pool, k, v, placements, kPromptPieceBytes, stream, k_targets_, v_targets_);
  }

  void index_prompt(std::uint32_t slot, std::uint32_t layer, const void* keys, std::uint32_t tokens,
                    void* stream) override {
    const KeyBlock block{keys, setup_.shape.dtype, tokens, setup_.shape.kv_heads, setup_.shape.head_dim};
    const std::size_t bytes = summaries_.prefill_workspace_bytes(tokens, setup_.page_tokens);
    if (index_workspace_.bytes() < bytes) {
      check_runtime(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)), "cudaStreamSynchronize");
      index_workspace_ = DeviceBytes(bytes);
    }
    summaries_.write_prefill(slot, layer, block, setup_.page_tokens, index_workspace_.as<void>(),
                             index_workspace_.bytes(), stream);
  }

  bool capturing(void* stream) const override { return stream_capturing(static_cast<cudaStream_t>(stream)); }

  void write_summary_rows(std::uint32_t slot, std::uint32_t layer, std::uint32_t head, const HostSummaryRows& rows,
                          void* stream) override {
    summaries_.write_rows(slot, layer, head, rows.centroids, rows.value_sums, rows.tokens, stream);
  }

  // ---- The step -------------------------------------------------------------

  void step(const DeviceStepInput& step) override {
    if (step.batch == 0 || step.batch > setup_.max_batch) {
      fail(ErrorCode::invalid_argument, "decode: batch of {} outside [1, {}]", step.batch, setup_.max_batch);
    }
    if (store_summary_kind(step.select) != summaries_.shape().kind) {
      fail(ErrorCode::invalid_argument, "decode: layer {}'s Select reads other summaries than the runtime keeps",
           step.layer);
    }
    if (step.select.estimates() && !setup_.select.estimates()) {
      fail(ErrorCode::invalid_argument, "decode: layer {}'s Select estimates, the runtime's has no room for it",
           step.layer);
    }
    // Every layer's spec is the setup's type for the built-ins: no table lookup on the step's path.
    const DeviceSelectLauncher launcher =
        step.select.type() == setup_.select.type() ? launcher_ : launcher_of(step.select);
    const auto stream = static_cast<cudaStream_t>(step.stream);
    const std::uint32_t rows = step.batch * setup_.shape.kv_heads;
    // 0. The step's arguments, written into a ring slot no launch still reads.
    const auto entered = StageTimer::Clock::now();
    const ArgumentRing::Slot slot = ring_.acquire(stream_capturing(stream), past_);
    timer_.begin(slot, entered);
    timer_.mark(StageTimer::start, stream);
    fill_arguments(step, slot.args);
    refresh_chunks();
    std::byte* args = ring_.device_block();
    const ArgsLayout& layout = ring_.layout();
    check_runtime(cudaMemcpyAsync(args, slot.args, layout.bytes, cudaMemcpyHostToDevice, stream),
                  "cudaMemcpyAsync H2D");
    // 1. The meta entries of last steps' saved pages into the device tables.
    apply_replica_writes(at<ReplicaWordWrite>(args, layout.writes), at<std::uint32_t>(args, layout.write_count),
                         layout.max_writes, stream);
    append(step, args, stream);
    timer_.mark(StageTimer::append, stream);
    const SelectOutput selected = select(step, launcher, rows, args, stream);
    timer_.mark(StageTimer::select, stream);
    retrieve(rows, selected, args, stream);
    plan(rows, args, stream);
    if (step.out != nullptr) attend(step, stream);
    timer_.mark(StageTimer::attend, stream);
    // The append's error word, read by check_values() once the step is past.
    check_runtime(
        cudaMemcpyAsync(slot.error_word, error_.as<void>(), sizeof(std::uint64_t), cudaMemcpyDeviceToHost, stream),
        "cudaMemcpyAsync D2H");
    check_runtime(cudaMemsetAsync(error_.as<void>(), 0xff, sizeof(std::uint64_t), stream), "cudaMemsetAsync");
    ring_.enqueued(slot, stream);
    timer_.end();
  }

  DeviceAttendPlan plan() const override {
    DeviceAttendPlan p;
    p.head_entries = head_entries_.as<std::int64_t>();
    p.indptr = indptr_.as<std::int64_t>();
    p.indices = indices_.as<std::int64_t>();
    p.last_page_len = last_page_len_.as<std::int32_t>();
    p.gpu_tier_base = buffer_.tiers().gpu_pool.base();
    p.page_bytes = buffer_.tiers().gpu_pool.page_bytes();
    p.rows = plan_rows_;
    if (estimated_) {
      p.extra_max = extra_max_.as<float>();
      p.extra_sum = extra_sum_.as<float>();
      p.extra_acc = extra_acc_.as<float>();
    }
    return p;
  }

  CacheStepStats cache_stats() override {
    synchronize();
    CacheStepStats total;
    check_runtime(cudaMemcpy(&total, totals_.as<void>(), sizeof total, cudaMemcpyDeviceToHost), "cudaMemcpy D2H");
    return total;
  }

  void check_values(void* stream) override {
    if (stream_capturing(static_cast<cudaStream_t>(stream))) {
      ring_.check_capture();  // here, before the step changes the buffer, rather than in acquire()
      return;
    }
    ring_.collect_past(past_);
    if (!bad_) return;
    const AppendError e = decode_append_error(std::exchange(bad_word_, kNoAppendError));
    bad_ = false;
    const char* tensor = e.tensor == AppendTensor::q ? "q" : e.tensor == AppendTensor::k ? "k_new" : "v_new";
    fail(ErrorCode::invalid_argument,
         "an earlier decode step's {} of batch entry {} (head {}, dim {}) was not finite; that row was not appended",
         tensor, e.entry, e.head, e.dim);
  }

  void synchronize() override {
    check_runtime(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    ring_.collect_all(past_);
  }

  void time_stages(bool on) override { timer_.enable(on); }

  DeviceStageTimes stage_times() override {
    synchronize();
    return timer_.totals();
  }

 private:
  // 2. Append (+ summaries and save of full tails).
  void append(const DeviceStepInput& step, std::byte* args, cudaStream_t stream) {
    const ArgsLayout& layout = ring_.layout();
    DeviceAppend append;
    append.batch = step.batch;
    append.q_heads = setup_.shape.q_heads;
    append.kv_heads = setup_.shape.kv_heads;
    append.layout = layout_;
    append.q = step.q;
    append.k_new = step.k_new;
    append.v_new = step.v_new;
    append.q_out = q_.as<float>();
    append.gpu_tier = const_cast<std::byte*>(buffer_.tiers().gpu_pool.base());
    append.page_stride = buffer_.tiers().gpu_pool.page_bytes();
    append.tail_pages = at<PageId>(args, layout.tail_pages);
    append.tail_slots = at<std::uint32_t>(args, layout.tail_slots);
    append.cpu_pages = at<std::byte* const>(args, layout.cpu_pages);
    append.error = error_.as<std::uint64_t>();
    append_tokens(append, summaries_.append_summaries(step.layer, at<std::uint32_t>(args, layout.summary_rows)),
                  stream);
  }

  // 3. Select over the summaries, on the state before this step's save:
  //    the launch registered for the layer's device Select.
  SelectOutput select(const DeviceStepInput& step, DeviceSelectLauncher launcher, std::uint32_t rows, std::byte* args,
                      cudaStream_t stream) {
    const ArgsLayout& layout = ring_.layout();
    DeviceSelectCall call;
    call.rows = select_rows_;
    call.rows.rows = rows;
    call.rows.first = at<std::uint32_t>(args, layout.first);
    call.rows.count = at<std::uint32_t>(args, layout.count);
    call.rows.tokens = summaries_.tokens(step.layer);
    call.rows.partitions = summaries_.partitions();
    call.rows.q = q_.as<float>();
    call.out =
        SelectOutput{setup_.max_selected_per_head, selected_.as<PartitionId>(), selected_count_.as<std::uint32_t>()};
    call.summaries = &summaries_;
    call.layer = step.layer;
    call.page_tokens = setup_.page_tokens;
    call.sink_partitions = at<PartitionId>(args, layout.sink_partitions);
    call.sink_tokens = at<std::uint32_t>(args, layout.sink_tokens);
    call.recent = at<std::uint32_t>(args, layout.recent);
    call.windows = at<std::uint32_t>(args, layout.windows);
    if (setup_.select.estimates()) {
      call.estimate = EstimateOutput{extra_max_.as<float>(), extra_sum_.as<float>(), extra_acc_.as<float>()};
    }
    call.workspace = select_workspace_.as<void>();
    call.workspace_bytes = select_workspace_.bytes();
    call.stream = stream;
    estimated_ = launcher(step.select, call);
    return call.out;
  }

  // 4. Retrieve: the selection as the LRU batch, the LRU step on the device
  //    tables, the gather of its misses straight from its output.
  void retrieve(std::uint32_t rows, const SelectOutput& selected, std::byte* args, cudaStream_t stream) {
    const PartitionLookup lookup = replica_.lookup(buffer_.tiers().table);
    const LruBatchInput lru_in{rows, selected.max_selected, selected.selected, selected.selected_count,
                               at<std::size_t>(args, ring_.layout().instances)};
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
    timer_.mark(StageTimer::lru, stream);
    DeviceMissList misses;
    misses.heads = rows;
    misses.max_entries = rows * setup_.max_pages_per_head;
    misses.page_offsets = lru_csr.page_offsets;
    misses.counts = &lru_out.stats->miss_pages;
    misses.count_stride = sizeof(CacheStepStats) / sizeof(std::uint64_t);
    misses.cpu_pages = copy_cpu_.as<PageId>();
    misses.gpu_pages = copy_gpu_.as<PageId>();
    const PagePool& cpu = buffer_.tiers().cpu_pool;
    const ChunkedPages cpu_tier{chunk_bases_.as<const std::byte* const>(), cpu.pages_per_chunk(), cpu.page_bytes()};
    gather_miss_list(misses, cpu_tier, const_cast<std::byte*>(buffer_.tiers().gpu_pool.base()),
                     buffer_.tiers().gpu_pool.page_bytes(), buffer_.tiers().gpu_pool.page_bytes(), GatherConfig{},
                     stream);
    accumulate_step_stats(lru_out.stats, rows, totals_.as<CacheStepStats>(), stream);
    timer_.mark(StageTimer::gather, stream);
  }

  // 5. Plan: FlashInfer's CSR over the runs, in device memory.
  void plan(std::uint32_t rows, std::byte* args, cudaStream_t stream) {
    DevicePlanInput in;
    in.rows = rows;
    in.selection_offsets = selection_offsets_.as<std::uint32_t>();
    in.partition_offsets = partition_offsets_.as<std::uint32_t>();
    in.gpu_pages = gpu_pages_.as<PageId>();
    in.partition_tokens = partition_tokens_.as<std::uint32_t>();
    in.tail_pages = at<PageId>(args, ring_.layout().tail_pages);
    in.tail_tokens = at<std::uint32_t>(args, ring_.layout().tail_tokens);
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
  }

  // 6. Attend over the plan.
  void attend(const DeviceStepInput& step, cudaStream_t stream) {
    const DecodeAttentionShape shape = attention_shape(step.batch);
    DecodeAttentionArgs a;
    a.q = q_.as<float>();
    a.page_base = buffer_.tiers().gpu_pool.base();
    a.page_stride = buffer_.tiers().gpu_pool.page_bytes();
    a.row_entries = head_entries_.as<std::int64_t>();
    a.indptr = indptr_.as<std::int64_t>();
    a.indices = indices_.as<std::int64_t>();
    a.last_page_len = last_page_len_.as<std::int32_t>();
    a.scale = setup_.scale;
    if (estimated_) a.extra = {extra_max_.as<float>(), extra_sum_.as<float>(), extra_acc_.as<float>()};
    a.out = step.out;
    a.workspace = attention_workspace_.as<void>();
    a.workspace_bytes = attention_workspace_.bytes();
    sparse_decode_attention(shape, a, stream);
  }

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

  // A step found past: its stage times, and its error word kept (the lowest)
  // until check_values() reports it.
  void note_past(std::size_t slot, std::uint64_t word) {
    timer_.past(slot);
    if (word != kNoAppendError && (!bad_ || word < bad_word_)) {
      bad_ = true;
      bad_word_ = word;
    }
  }

  void refresh_chunks() {
    const auto chunks = buffer_.tiers().cpu_pool.chunks();
    std::copy(chunks.begin(), chunks.end(), chunk_bases_.as<std::byte*>());
  }

  // The step's arguments into a slot, laid out as the ring says.
  void fill_arguments(const DeviceStepInput& step, std::byte* slot) {
    const ArgsLayout& layout = ring_.layout();
    const std::uint32_t batch = setup_.max_batch;
    LaunchArguments a;
    a.tail_slots = {at<std::uint32_t>(slot, layout.tail_slots), batch};
    a.tail_pages = {at<PageId>(slot, layout.tail_pages), rows_};
    a.tail_tokens = {at<std::uint32_t>(slot, layout.tail_tokens), rows_};
    a.first = {at<std::uint32_t>(slot, layout.first), rows_};
    a.count = {at<std::uint32_t>(slot, layout.count), rows_};
    a.summary_rows = {at<std::uint32_t>(slot, layout.summary_rows), rows_};
    a.instances = {at<std::size_t>(slot, layout.instances), rows_};
    a.cpu_pages = {at<std::byte*>(slot, layout.cpu_pages), rows_};
    a.sink_partitions = {at<PartitionId>(slot, layout.sink_partitions), rows_};
    a.sink_tokens = {at<std::uint32_t>(slot, layout.sink_tokens), rows_};
    a.recent = {at<std::uint32_t>(slot, layout.recent), rows_};
    a.windows = {at<std::uint32_t>(slot, layout.windows), rows_};
    a.writes = {at<ReplicaWordWrite>(slot, layout.writes), layout.max_writes};
    a.write_count = at<std::uint32_t>(slot, layout.write_count);
    fill_launch_arguments(step, setup_.shape.kv_heads, summaries_.shape(), buffer_.tiers().cpu_pool, replica_,
                          buffer_.tiers().table, writes_, a);
  }

  DeviceRuntimeSetup setup_;
  TieredKVBuffer& buffer_;
  PageLayout layout_;
  std::uint32_t rows_;
  ArgumentRing ring_;
  StageTimer timer_;
  ArgumentRing::Past past_ = [this](std::size_t slot, std::uint64_t word) { note_past(slot, word); };
  TransferReplicaCopy replica_copy_;
  GpuTablesReplica replica_;
  DeviceSummaries summaries_;
  // The device prefill: its finiteness word and staged D2H saver, made on first use.
  DeviceBytes finite_word_;
  std::unique_ptr<FlashD2HSaver> saver_;
  std::vector<RowTarget> k_targets_, v_targets_;
  DeviceBytes q_, selected_, selected_count_, select_workspace_;
  // RetroInfer's estimation terms (DecodeAttentionExtra), and whether the last step wrote them.
  DeviceBytes extra_max_, extra_sum_, extra_acc_;
  bool estimated_ = false;
  DeviceSelectLauncher launcher_ = nullptr;  // setup.select's
  SelectRows select_rows_;
  DeviceBytes selection_offsets_, page_offsets_, compact_, partition_tokens_, lru_batch_workspace_;
  DeviceBytes partition_offsets_, gpu_pages_, copy_cpu_, copy_gpu_, stats_, totals_, lru_scratch_;
  std::uint32_t plan_row_pages_ = 0;
  std::uint32_t plan_rows_ = 0;
  DeviceBytes indptr_, indices_, last_page_len_, head_entries_, overflow_, plan_workspace_;
  DeviceBytes attention_workspace_, index_workspace_;
  DeviceBytes error_;
  PinnedBytes chunk_bases_;
  bool bad_ = false;
  std::uint64_t bad_word_ = kNoAppendError;
  std::vector<ReplicaWordWrite> writes_;
};

}  // namespace

std::unique_ptr<DeviceRuntime> make_cuda_device_runtime(const DeviceRuntimeSetup& setup, TieredKVBuffer& buffer,
                                                        DeviceMemoryResource& device_memory) {
  return std::make_unique<CudaDeviceRuntime>(setup, buffer, device_memory);
}

}  // namespace sparsekv::cuda
