// transfer: Save D2H (SparseServe §3.2.2 FlashD2H), see flash_d2h_save.hpp.
#include "sparsekv/transfer/flash_d2h_save.hpp"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "sparsekv/core/device.hpp"
#include "sparsekv/core/error.hpp"

#if SPARSEKV_WITH_CUDA_RUNTIME
#include <cuda_runtime_api.h>
#endif

namespace sparsekv {

struct FlashD2HSaver::Destination {
  std::vector<std::byte*> chunks;
  std::uint32_t pages_per_chunk = 0;
  std::uint32_t page_count = 0;
  std::size_t page_stride = 0;
  std::uint32_t page_tokens = 0;
  std::size_t row_bytes = 0;
  std::size_t k_block_offset = 0;
  std::size_t v_block_offset = 0;

  std::byte* row(const RowTarget& target) const noexcept {
    return chunks[target.page / pages_per_chunk] + std::size_t{target.page % pages_per_chunk} * page_stride +
           (target.block == KvBlock::k ? k_block_offset : v_block_offset) + std::size_t{target.slot} * row_bytes;
  }
};

// One staging buffer and the save that occupies it. Written by save() only
// while free (ticket == 0); the mutex hand-over publishes it to the workers.
struct FlashD2HSaver::Slot {
  std::byte* staging = nullptr;
  std::size_t capacity = 0;
  void* copied_event = nullptr;  // cudaEvent_t recorded after the D2H copy

  SaveTicket ticket = 0;  // 0 = free
  bool device_copy = false;
  std::size_t bytes = 0;
  std::shared_ptr<const Destination> destination;
  std::vector<RowTarget> targets;
  std::function<void()> on_complete;
  // Guarded by the saver's mutex.
  std::uint32_t remaining = 0;  // workers that have not finished their share
  bool done = false;
  std::exception_ptr error;
};

namespace {

constexpr std::uint32_t kMaxWorkers = 64;
constexpr std::uint32_t kMaxSlots = 16;
constexpr std::size_t kAlignment = 256;

#if SPARSEKV_WITH_CUDA_RUNTIME
[[noreturn]] void fail_cuda(const char* what, cudaError_t status) {
  cudaGetLastError();  // clear a non-sticky error so later calls start clean
  fail(ErrorCode::cuda_error, "FlashD2HSaver: {} failed: {}", what, cudaGetErrorString(status));
}

void check_cuda(const char* what, cudaError_t status) {
  if (status != cudaSuccess) fail_cuda(what, status);
}

bool is_device_pointer(const void* pointer) {
  cudaPointerAttributes attributes{};
  if (cudaPointerGetAttributes(&attributes, pointer) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return attributes.type == cudaMemoryTypeDevice || attributes.type == cudaMemoryTypeManaged;
}
#endif

// Pinned when a device is used (cudaMemcpyAsync D2H is asynchronous and runs
// at full PCIe speed only into page-locked memory), aligned host memory otherwise.
std::byte* allocate_staging(std::size_t bytes, bool pinned) {
  if (bytes == 0) return nullptr;
#if SPARSEKV_WITH_CUDA_RUNTIME
  if (pinned) {
    void* pointer = nullptr;
    const cudaError_t status = cudaHostAlloc(&pointer, bytes, cudaHostAllocPortable);
    if (status != cudaSuccess) {
      cudaGetLastError();
      fail(ErrorCode::resource_exhausted, "FlashD2HSaver: cudaHostAlloc of {} staging bytes failed: {}", bytes,
           cudaGetErrorString(status));
    }
    return static_cast<std::byte*>(pointer);
  }
#else
  (void)pinned;
#endif
  void* pointer = std::aligned_alloc(kAlignment, (bytes + kAlignment - 1) / kAlignment * kAlignment);
  if (pointer == nullptr) fail(ErrorCode::resource_exhausted, "FlashD2HSaver: {} staging bytes unavailable", bytes);
  return static_cast<std::byte*>(pointer);
}

void free_staging(std::byte* pointer, bool pinned) noexcept {
  if (pointer == nullptr) return;
#if SPARSEKV_WITH_CUDA_RUNTIME
  if (pinned) {
    cudaFreeHost(pointer);
    return;
  }
#else
  (void)pinned;
#endif
  std::free(pointer);
}

}  // namespace

FlashD2HSaver::FlashD2HSaver(const FlashD2HSaverConfig& config) : config_(config) {
  if (config.workers == 0 || config.workers > kMaxWorkers) {
    fail(ErrorCode::invalid_argument, "FlashD2HSaver: workers {} not in 1..{}", config.workers, kMaxWorkers);
  }
  if (config.staging_slots == 0 || config.staging_slots > kMaxSlots) {
    fail(ErrorCode::invalid_argument, "FlashD2HSaver: staging_slots {} not in 1..{}", config.staging_slots, kMaxSlots);
  }
  if (config.staging_bytes > config.max_staging_bytes) {
    fail(ErrorCode::invalid_argument, "FlashD2HSaver: staging_bytes {} above max_staging_bytes {}",
         config.staging_bytes, config.max_staging_bytes);
  }
  use_device_ = cuda_device_count() > 0;
  try {
    for (std::uint32_t s = 0; s < config.staging_slots; ++s) slots_.push_back(std::make_unique<Slot>());
#if SPARSEKV_WITH_CUDA_RUNTIME
    if (use_device_) {
      check_cuda("cudaGetDevice", cudaGetDevice(&device_));
      cudaStream_t stream = nullptr;
      // Non-blocking: the copy never serialises with the legacy default stream.
      check_cuda("cudaStreamCreateWithFlags", cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
      copy_stream_ = stream;
      cudaEvent_t event = nullptr;
      check_cuda("cudaEventCreateWithFlags", cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
      input_event_ = event;
      for (auto& slot : slots_) {
        // BlockingSync: waiting workers sleep instead of spinning on host cores.
        check_cuda("cudaEventCreateWithFlags",
                   cudaEventCreateWithFlags(&event, cudaEventDisableTiming | cudaEventBlockingSync));
        slot->copied_event = event;
      }
    }
#endif
    for (auto& slot : slots_) {
      slot->staging = allocate_staging(config.staging_bytes, use_device_);
      slot->capacity = config.staging_bytes;
    }
    workers_.reserve(config.workers);
    for (std::uint32_t w = 0; w < config.workers; ++w) {
      workers_.emplace_back([this, w](std::stop_token stop) { worker_loop(stop, w); });
    }
  } catch (...) {
    workers_.clear();
    release_resources();
    throw;
  }
}

FlashD2HSaver::~FlashD2HSaver() {
  {
    std::unique_lock lock(mutex_);
    done_cv_.wait(lock, [&] { return finished_ == issued_; });
  }
  workers_.clear();  // requests stop and joins; the condition variable wakes them
  release_resources();
}

void FlashD2HSaver::release_resources() noexcept {
  for (auto& slot : slots_) {
    free_staging(slot->staging, use_device_);
    slot->staging = nullptr;
#if SPARSEKV_WITH_CUDA_RUNTIME
    if (slot->copied_event != nullptr) cudaEventDestroy(static_cast<cudaEvent_t>(slot->copied_event));
#endif
    slot->copied_event = nullptr;
  }
#if SPARSEKV_WITH_CUDA_RUNTIME
  if (input_event_ != nullptr) cudaEventDestroy(static_cast<cudaEvent_t>(input_event_));
  if (copy_stream_ != nullptr) cudaStreamDestroy(static_cast<cudaStream_t>(copy_stream_));
#endif
  input_event_ = nullptr;
  copy_stream_ = nullptr;
}

void FlashD2HSaver::set_destination(const SaveDestination& d) {
  if (d.chunks.empty() || d.pages_per_chunk == 0 || d.page_count == 0) {
    fail(ErrorCode::invalid_argument,
         "FlashD2HSaver: destination needs chunks ({}), pages_per_chunk ({}) and "
         "page_count ({}) above 0",
         d.chunks.size(), d.pages_per_chunk, d.page_count);
  }
  if (d.page_count > d.chunks.size() * std::uint64_t{d.pages_per_chunk}) {
    fail(ErrorCode::invalid_argument, "FlashD2HSaver: page_count {} above {} chunks x {} pages", d.page_count,
         d.chunks.size(), d.pages_per_chunk);
  }
  if (d.row_bytes == 0 || d.page_tokens == 0) {
    fail(ErrorCode::invalid_argument, "FlashD2HSaver: row_bytes {} and page_tokens {} must be above 0", d.row_bytes,
         d.page_tokens);
  }
  const std::size_t block = std::size_t{d.page_tokens} * d.row_bytes;
  if (d.k_block_offset + block > d.page_stride || d.v_block_offset + block > d.page_stride) {
    fail(ErrorCode::invalid_argument,
         "FlashD2HSaver: K block at {} or V block at {} ({} bytes each) ends past "
         "page_stride {}",
         d.k_block_offset, d.v_block_offset, block, d.page_stride);
  }
  const std::size_t gap =
      d.k_block_offset > d.v_block_offset ? d.k_block_offset - d.v_block_offset : d.v_block_offset - d.k_block_offset;
  if (gap < block) {
    fail(ErrorCode::invalid_argument, "FlashD2HSaver: K block at {} and V block at {} overlap ({} bytes each)",
         d.k_block_offset, d.v_block_offset, block);
  }
  auto destination = std::make_shared<Destination>();
  destination->chunks.assign(d.chunks.begin(), d.chunks.end());
  destination->pages_per_chunk = d.pages_per_chunk;
  destination->page_count = d.page_count;
  destination->page_stride = d.page_stride;
  destination->page_tokens = d.page_tokens;
  destination->row_bytes = d.row_bytes;
  destination->k_block_offset = d.k_block_offset;
  destination->v_block_offset = d.v_block_offset;
  destination_ = std::move(destination);
}

SaveTicket FlashD2HSaver::save(const std::byte* source, std::size_t bytes, std::span<const RowTarget> targets,
                               void* compute_stream, std::function<void()> on_complete) {
  // Arguments first: nothing is enqueued or written when one is wrong.
  if (!destination_) fail(ErrorCode::failed_precondition, "FlashD2HSaver: save before set_destination");
  const Destination& d = *destination_;
  if (bytes != targets.size() * d.row_bytes) {
    fail(ErrorCode::invalid_argument, "FlashD2HSaver: {} source bytes for {} targets of {} bytes", bytes,
         targets.size(), d.row_bytes);
  }
  if (targets.empty()) return 0;
  if (source == nullptr) fail(ErrorCode::invalid_argument, "FlashD2HSaver: null source for {} bytes", bytes);
  if (bytes > config_.max_staging_bytes) {
    fail(ErrorCode::resource_exhausted, "FlashD2HSaver: save of {} bytes above max_staging_bytes {}", bytes,
         config_.max_staging_bytes);
  }
  for (std::size_t i = 0; i < targets.size(); ++i) {
    const RowTarget& t = targets[i];
    if (t.page >= d.page_count) {
      fail(ErrorCode::out_of_range, "FlashD2HSaver: target {} page {} out of range [0, {})", i, t.page, d.page_count);
    }
    if (t.slot >= d.page_tokens) {
      fail(ErrorCode::out_of_range, "FlashD2HSaver: target {} slot {} out of range [0, {})", i, t.slot, d.page_tokens);
    }
    if (t.block != KvBlock::k && t.block != KvBlock::v) {
      fail(ErrorCode::invalid_argument, "FlashD2HSaver: target {} block {} is neither K nor V", i,
           static_cast<unsigned>(t.block));
    }
    if (d.chunks[t.page / d.pages_per_chunk] == nullptr) {
      fail(ErrorCode::failed_precondition, "FlashD2HSaver: target {} page {} lies in unreserved chunk {}", i, t.page,
           t.page / d.pages_per_chunk);
    }
  }
#if SPARSEKV_WITH_CUDA_RUNTIME
  const bool device_copy = use_device_ && is_device_pointer(source);
#else
  const bool device_copy = false;
  (void)compute_stream;
#endif

  const SaveTicket ticket = issued_ + 1;
  Slot& slot = *slots_[(ticket - 1) % slots_.size()];
  {
    // Back-pressure: the slot's previous save must be scattered before reuse.
    std::unique_lock lock(mutex_);
    done_cv_.wait(lock, [&] { return slot.ticket == 0; });
  }
  if (bytes > slot.capacity) {
    // Geometric growth bounded by the cap, so a slowly growing batch reallocates rarely.
    const std::size_t grown = std::min(config_.max_staging_bytes, std::max(bytes, 2 * slot.capacity));
    std::byte* staging = allocate_staging(grown, use_device_);
    free_staging(slot.staging, use_device_);
    slot.staging = staging;
    slot.capacity = grown;
  }
  // The free slot is ours: copy the targets (may throw bad_alloc) before a
  // device copy into its staging is in flight.
  slot.targets.assign(targets.begin(), targets.end());
  if (device_copy) {
#if SPARSEKV_WITH_CUDA_RUNTIME
    const auto copy_stream = static_cast<cudaStream_t>(copy_stream_);
    const auto input = static_cast<cudaEvent_t>(input_event_);
    // Each wait captures the event as recorded now, so one input event serves every save.
    check_cuda("cudaEventRecord(compute stream)", cudaEventRecord(input, static_cast<cudaStream_t>(compute_stream)));
    check_cuda("cudaStreamWaitEvent", cudaStreamWaitEvent(copy_stream, input, 0));
    // cudaMemcpyDefault: the source may be managed as well as device memory.
    check_cuda("cudaMemcpyAsync D2H", cudaMemcpyAsync(slot.staging, source, bytes, cudaMemcpyDefault, copy_stream));
    if (const cudaError_t status = cudaEventRecord(static_cast<cudaEvent_t>(slot.copied_event), copy_stream);
        status != cudaSuccess) {
      // The copy is in flight into a slot that stays free: let it land before
      // a later save reuses (or regrows) the staging.
      cudaStreamSynchronize(copy_stream);
      fail_cuda("cudaEventRecord(copy stream)", status);
    }
#endif
  } else {
    std::memcpy(slot.staging, source, bytes);
  }
  // Nothing below throws before the hand-over.
  slot.device_copy = device_copy;
  slot.bytes = bytes;
  slot.destination = destination_;
  slot.on_complete = std::move(on_complete);
  {
    std::lock_guard lock(mutex_);
    slot.ticket = ticket;
    slot.remaining = static_cast<std::uint32_t>(workers_.size());
    slot.done = false;
    slot.error = nullptr;
    in_flight_.push_back(&slot);
    issued_ = ticket;
  }
  work_cv_.notify_all();
  return ticket;
}

void FlashD2HSaver::worker_loop(std::stop_token stop, std::uint32_t index) {
#if SPARSEKV_WITH_CUDA_RUNTIME
  // The runtime's current device is per thread: bind it to the saver's once.
  const bool device_bound = !use_device_ || cudaSetDevice(device_) == cudaSuccess;
#endif
  for (SaveTicket next = 1;; ++next) {
    Slot* slot = nullptr;
    {
      std::unique_lock lock(mutex_);
      if (!work_cv_.wait(lock, stop, [&] { return issued_ >= next; })) return;
      slot = slots_[(next - 1) % slots_.size()].get();
    }
    std::exception_ptr error;
    try {
      if (slot->device_copy) {
#if SPARSEKV_WITH_CUDA_RUNTIME
        if (!device_bound) fail(ErrorCode::cuda_error, "FlashD2HSaver: cudaSetDevice({}) failed in a worker", device_);
        check_cuda("cudaEventSynchronize(copy)", cudaEventSynchronize(static_cast<cudaEvent_t>(slot->copied_event)));
#endif
      }
      scatter(*slot, index);
    } catch (...) {
      error = std::current_exception();
    }
    bool last = false;
    {
      std::lock_guard lock(mutex_);
      if (error && !slot->error) slot->error = error;
      last = --slot->remaining == 0;
    }
    if (last) finish_save(*slot);
  }
}

void FlashD2HSaver::scatter(const Slot& slot, std::uint32_t index) const {
  const Destination& d = *slot.destination;
  const auto workers = static_cast<std::uint32_t>(workers_.size());
  const std::byte* row = slot.staging;
  // Page ownership (not target ranges) splits the work: no two workers write one page.
  for (const RowTarget& target : slot.targets) {
    if (target.page % workers == index) std::memcpy(d.row(target), row, d.row_bytes);
    row += d.row_bytes;
  }
}

void FlashD2HSaver::finish_save(Slot& slot) {
  // The last worker of a save runs its callback once every row is in place.
  std::exception_ptr callback_error;
  bool failed = false;
  {
    std::lock_guard lock(mutex_);
    failed = slot.error != nullptr;
  }
  if (!failed && slot.on_complete) {
    try {
      slot.on_complete();
    } catch (...) {
      callback_error = std::current_exception();
    }
  }
  {
    std::lock_guard lock(mutex_);
    if (callback_error) slot.error = callback_error;
    if (slot.error) errors_.emplace(slot.ticket, slot.error);
    slot.done = true;
    // Saves finish out of order only between callbacks; retire them in ticket order.
    while (!in_flight_.empty() && in_flight_.front()->done) {
      Slot& front = *in_flight_.front();
      finished_ = front.ticket;
      front.ticket = 0;
      front.on_complete = nullptr;
      front.destination.reset();
      front.error = nullptr;
      in_flight_.pop_front();
    }
  }
  done_cv_.notify_all();
}

void FlashD2HSaver::check_ticket(SaveTicket ticket) const {
  if (ticket > issued_) {
    fail(ErrorCode::invalid_argument, "FlashD2HSaver: ticket {} was never issued (last is {})", ticket, issued_);
  }
}

void FlashD2HSaver::wait_copy(SaveTicket ticket, void* stream) {
  std::lock_guard lock(mutex_);
  check_ticket(ticket);
  if (ticket <= finished_) return;
  const Slot& slot = *slots_[(ticket - 1) % slots_.size()];
  if (!slot.device_copy) return;
#if SPARSEKV_WITH_CUDA_RUNTIME
  // The slot still holds this ticket: it is recycled only after the save finishes.
  check_cuda("cudaStreamWaitEvent",
             cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), static_cast<cudaEvent_t>(slot.copied_event), 0));
#else
  (void)stream;
#endif
}

void FlashD2HSaver::wait(SaveTicket ticket) {
  std::exception_ptr error;
  {
    std::unique_lock lock(mutex_);
    check_ticket(ticket);
    done_cv_.wait(lock, [&] { return finished_ >= ticket; });
    const auto it = errors_.begin();
    if (it != errors_.end() && it->first <= ticket) {
      error = it->second;
      errors_.erase(it);
    }
  }
  if (error) std::rethrow_exception(error);
}

void FlashD2HSaver::wait() {
  SaveTicket last = 0;
  {
    std::lock_guard lock(mutex_);
    last = issued_;
  }
  wait(last);
}

bool FlashD2HSaver::finished(SaveTicket ticket) const {
  std::lock_guard lock(mutex_);
  return ticket <= finished_;
}

std::size_t FlashD2HSaver::staging_bytes() const {
  std::lock_guard lock(mutex_);
  std::size_t total = 0;
  for (const auto& slot : slots_) total += slot->capacity;
  return total;
}

SaveTicket FlashD2HSaver::last_ticket() const {
  std::lock_guard lock(mutex_);
  return issued_;
}

}  // namespace sparsekv
