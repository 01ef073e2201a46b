#pragma once
// Save D2H (SparseServe §3.2.2 FlashD2H, CPU-assisted saving): the step's new
// K/V rows leave the GPU in ONE contiguous copy into a pinned staging buffer,
// on the saver's own stream, after the compute stream's work that produced
// them; host worker threads then scatter the staged rows into the head-wise
// CPU pages (Spin §5.2 layout: K block, then V block, [page_tokens][row]),
// overlapped with the next layers' compute. The GPU spends no SMs on it.
//
// Source layout: the source is `targets.size()` rows of `row_bytes` each, row
// i going to targets[i]. For an engine chunk [tokens][kv_heads][head_dim] with
// K and V in one buffer (K first), row t * kv_heads + h is K of (token t, head
// h) and tokens * kv_heads + t * kv_heads + h its V; the (page, slot) of each
// comes from the partition map's TokenPlacement.
//
// Backends: with a CUDA device and a device (or managed) source, the copy is a
// cudaMemcpyAsync D2H on a non-blocking stream that first waits on an event
// recorded on `compute_stream`; workers block on an event recorded after the
// copy. Otherwise (no device, a build without CUDA, or a host source) save()
// copies the source into staging with memcpy before returning; the scatter,
// threading and error paths are the same code in both cases.
//
// Staging is double-buffered (`staging_slots`, default 2): save t + 1 copies
// into the other slot while save t is scattered. A save whose slot is still
// busy blocks until that slot's earlier save has finished.
//
// Ordering: each worker owns the destination pages with page % workers == its
// index and handles saves in ticket order, so a row named by several targets
// (in one save or across saves) ends with the bytes of the last one, exactly
// as a sequential scatter in ticket order would leave it.
//
// Thread-safety: the public members are for one thread (or callers that
// serialise); the workers are internal. An on_complete callback runs on a
// worker thread, possibly concurrently with another save's callback, and
// must not call back into the saver. The destination pages
// of an unfinished save must not be read or written by anyone else (wait()
// first, e.g. before a gather reads them back to the GPU).
//
// fmt-free and CUDA-free: host code and tests include it without nvcc.
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <stop_token>
#include <thread>
#include <vector>

#include "sparsekv/core/ids.hpp"

namespace sparsekv {

enum class KvBlock : std::uint8_t { k, v };

// Where one source row goes: row `slot` of the K or V block of CPU page `page`.
struct RowTarget {
  PageId page = kInvalidPage;
  std::uint32_t slot = 0;
  KvBlock block = KvBlock::k;
};

// The CPU tier as the saver addresses it, mirroring PagePool's chunking: page
// p lives at chunks[p / pages_per_chunk] + (p % pages_per_chunk) * page_stride.
// A single-chunk pool is chunks = {PagePool::base()}, pages_per_chunk = capacity.
// A null chunk is not reserved yet; targets inside it are refused.
struct SaveDestination {
  std::span<std::byte* const> chunks;
  std::uint32_t pages_per_chunk = 0;
  std::uint32_t page_count = 0;    // pages are [0, page_count)
  std::size_t page_stride = 0;     // bytes between consecutive pages of a chunk
  std::uint32_t page_tokens = 0;   // rows per block: slots are [0, page_tokens)
  std::size_t row_bytes = 0;       // one (token, head) row: head_dim * dtype size
  std::size_t k_block_offset = 0;  // PageLayout::k_offset(0)
  std::size_t v_block_offset = 0;  // PageLayout::v_offset(0)
};

struct FlashD2HSaverConfig {
  std::uint32_t workers = 4;                             // host scatter threads, 1..64
  std::uint32_t staging_slots = 2;                       // staging buffers in flight, 1..16
  std::size_t staging_bytes = 0;                         // initial bytes per slot (grows on demand)
  std::size_t max_staging_bytes = std::size_t{1} << 30;  // per slot; larger saves are refused
};

// 1, 2, ... in save order; 0 = a save with no rows (nothing enqueued).
using SaveTicket = std::uint64_t;

class FlashD2HSaver {
 public:
  // Throws invalid_argument for a config out of range; resource_exhausted or
  // cuda_error if staging, stream or events cannot be created.
  explicit FlashD2HSaver(const FlashD2HSaverConfig& config = {});
  // Waits for every save (errors not yet observed are dropped), then joins.
  ~FlashD2HSaver();
  FlashD2HSaver(const FlashD2HSaver&) = delete;
  FlashD2HSaver& operator=(const FlashD2HSaver&) = delete;

  // Replaces the destination for later saves (the chunk list is copied);
  // saves already enqueued keep theirs. invalid_argument when the geometry is
  // inconsistent (no chunks, zero sizes, a block past page_stride, K and V
  // blocks overlapping, page_count above chunks x pages_per_chunk).
  void set_destination(const SaveDestination& destination);

  // Enqueues one save and returns its ticket. Validates everything first and
  // changes nothing on error: failed_precondition (no destination; a target
  // in an unreserved chunk), invalid_argument (bytes != targets.size() x
  // row_bytes, null source, bad block), out_of_range (page >= page_count,
  // slot >= page_tokens), resource_exhausted (bytes > max_staging_bytes or
  // staging cannot grow), cuda_error (enqueueing failed).
  // Device source: `source` must hold the rows once the work enqueued so far
  // on `compute_stream` (a cudaStream_t; nullptr = legacy default stream)
  // completes, and must not be overwritten before the copy has read it:
  // order later writers with wait_copy(). Host source: read before save()
  // returns; `compute_stream` is ignored.
  // `on_complete` (optional) runs on a worker after every row is written;
  // an exception it throws surfaces on wait().
  SaveTicket save(const std::byte* source, std::size_t bytes, std::span<const RowTarget> targets, void* compute_stream,
                  std::function<void()> on_complete = {});

  // Makes `stream` (a cudaStream_t) wait, on the device and without blocking
  // the host, until save `ticket` has read its source. No-op for host-path
  // saves and finished ones. invalid_argument for a ticket never issued.
  void wait_copy(SaveTicket ticket, void* stream);

  // Blocks until every save up to `ticket` has written its rows, then
  // rethrows the earliest error of those saves not yet rethrown (a failed
  // copy: cuda_error, its rows unspecified; or what an on_complete threw, its
  // rows written). Each error surfaces once; later saves are unaffected.
  // invalid_argument for a ticket never issued; 0 returns at once.
  void wait(SaveTicket ticket);
  // wait() on the last ticket issued.
  void wait();

  // Whether save `ticket` (and every earlier one) has finished; never blocks.
  bool finished(SaveTicket ticket) const;

  std::uint32_t workers() const noexcept { return static_cast<std::uint32_t>(workers_.size()); }
  std::uint32_t staging_slots() const noexcept { return static_cast<std::uint32_t>(slots_.size()); }
  // Bytes of staging currently allocated, over all slots.
  std::size_t staging_bytes() const;
  // Whether saves from device memory take the CUDA path (a device was found).
  bool uses_device() const noexcept { return use_device_; }
  SaveTicket last_ticket() const;

 private:
  struct Destination;
  struct Slot;

  void worker_loop(std::stop_token stop, std::uint32_t index);
  void scatter(const Slot& slot, std::uint32_t index) const;
  void finish_save(Slot& slot);
  void check_ticket(SaveTicket ticket) const;
  void release_resources() noexcept;

  FlashD2HSaverConfig config_;
  bool use_device_ = false;
  int device_ = 0;
  void* copy_stream_ = nullptr;  // cudaStream_t
  void* input_event_ = nullptr;  // cudaEvent_t recorded on the compute stream
  std::shared_ptr<const Destination> destination_;

  mutable std::mutex mutex_;
  std::condition_variable_any work_cv_;  // workers: a new save was enqueued
  std::condition_variable done_cv_;      // callers: a save finished
  std::vector<std::unique_ptr<Slot>> slots_;
  std::deque<Slot*> in_flight_;                      // unfinished saves in ticket order
  std::map<SaveTicket, std::exception_ptr> errors_;  // finished with an error, not yet rethrown
  SaveTicket issued_ = 0;                            // last ticket handed out
  SaveTicket finished_ = 0;                          // every ticket <= it has finished
  std::vector<std::jthread> workers_;                // last: joined before the rest goes
};

}  // namespace sparsekv
