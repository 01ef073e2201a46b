#include "argument_ring.hpp"

#include <algorithm>

#include "sparsekv/buffer/append_cuda.hpp"

namespace sparsekv::cuda {
namespace {

constexpr std::size_t align16(std::size_t n) { return (n + 15) / 16 * 16; }

}  // namespace

ArgsLayout::ArgsLayout(std::uint32_t batch, std::uint32_t rows) {
  max_writes = launch_max_writes(rows);
  std::size_t next = 0;
  const auto take = [&](std::size_t size) {
    const std::size_t here = next;
    next += align16(size);
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
  bytes = next;
}

ArgumentRing::ArgumentRing(std::uint32_t max_batch, std::uint32_t rows, std::uint32_t captured_blocks)
    : layout_(max_batch, rows),
      device_(layout_.bytes),
      errors_(sizeof(std::uint64_t) * kSlots),
      captured_blocks_(std::max(captured_blocks, 1u)) {
  for (auto& slot : slots_) slot = PinnedBytes(layout_.bytes);
  refill_spares();
  for (auto& e : events_) check_runtime(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate");
  std::fill_n(errors_.as<std::uint64_t>(), kSlots, kNoAppendError);
}

ArgumentRing::~ArgumentRing() {
  for (auto& e : events_) cudaEventDestroy(e);
}

ArgumentRing::Slot ArgumentRing::acquire(bool captured, const Past& past) {
  Slot slot;
  slot.captured = captured;
  if (captured) {
    check_capture();
    captured_.push_back(std::move(spares_.back()));
    spares_.pop_back();
    slot.index = kSlots;
    slot.args = captured_.back().as<std::byte>();
    slot.error_word = at<std::uint64_t>(slot.args, layout_.bytes);
  } else {
    refill_spares();
    slot.index = next_++ % kSlots;
    if (in_flight_[slot.index]) {
      check_runtime(cudaEventSynchronize(events_[slot.index]), "cudaEventSynchronize");  // kSlots steps in flight
      report(slot.index, past);
    }
    slot.args = slots_[slot.index].as<std::byte>();
    slot.error_word = errors_.as<std::uint64_t>() + slot.index;
  }
  *slot.error_word = kNoAppendError;
  return slot;
}

void ArgumentRing::refill_spares() {
  while (spares_.size() < captured_blocks_) spares_.emplace_back(layout_.bytes + sizeof(std::uint64_t));
}

void ArgumentRing::check_capture() const {
  if (spares_.empty()) {
    fail(ErrorCode::failed_precondition,
         "decode: this capture already holds {} steps, as many as a capture can take (one a layer); "
         "an eager step between captures makes room again",
         captured_blocks_);
  }
}

void ArgumentRing::enqueued(const Slot& slot, cudaStream_t stream) {
  if (slot.captured) return;
  check_runtime(cudaEventRecord(events_[slot.index], stream), "cudaEventRecord");
  in_flight_[slot.index] = true;
}

void ArgumentRing::collect_past(const Past& past) {
  for (std::size_t k = 0; k < kSlots; ++k) {
    if (in_flight_[k] && cudaEventQuery(events_[k]) == cudaSuccess) report(k, past);
  }
}

void ArgumentRing::collect_all(const Past& past) {
  for (std::size_t k = 0; k < kSlots; ++k) {
    if (in_flight_[k]) report(k, past);
  }
  for (const PinnedBytes& captured : captured_) {
    past(kSlots, std::exchange(*at<std::uint64_t>(captured.as<std::byte>(), layout_.bytes), kNoAppendError));
  }
}

void ArgumentRing::report(std::size_t k, const Past& past) {
  in_flight_[k] = false;
  past(k, std::exchange(errors_.as<std::uint64_t>()[k], kNoAppendError));
}

}  // namespace sparsekv::cuda
