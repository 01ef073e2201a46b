#pragma once
// The device step's arguments: the host's part of a step (launch_arguments.hpp)
// in one block, written into a pinned slot that no launch still reads and
// copied to the device once per step. Eager steps cycle through kSlots slots,
// an event per slot marking when its step is past, so the host waits only
// when kSlots steps are in flight. A step captured into a CUDA graph gets a
// slot of its own, kept for the ring's life: its graph copies from it at every
// replay, long after the ring has moved on. Those blocks are allocated ahead,
// one a layer, and refilled by the next eager step: a capture may not allocate
// pinned memory (cudaHostAlloc failed inside a global-mode capture on an
// H100), so a capture that takes every layer's step, a whole forward pass,
// still finds a block for each. Each slot also carries the step's
// append error word (buffer/append_cuda.hpp), read back once the step is past.
// Private to cuda/step/.
#include <cuda_runtime.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include "device_memory.hpp"
#include "sparsekv/step/launch_arguments.hpp"

namespace sparsekv::cuda {

// Where each array of the argument block sits (the same offsets in the pinned
// slots and in the device copy).
struct ArgsLayout {
  std::size_t write_count, tail_slots, tail_pages, tail_tokens, first, count, summary_rows, instances, cpu_pages,
      sink_partitions, sink_tokens, recent, windows, writes, bytes;
  std::uint32_t max_writes;
  ArgsLayout(std::uint32_t batch, std::uint32_t rows);
};

template <class T>
T* at(std::byte* base, std::size_t offset) {
  return reinterpret_cast<T*>(base + offset);
}

class ArgumentRing {
 public:
  static constexpr std::size_t kSlots = 4;

  struct Slot {
    std::size_t index = 0;  // eager: [0, kSlots); captured: kSlots
    std::byte* args = nullptr;
    std::uint64_t* error_word = nullptr;
    bool captured = false;
  };
  // Called for each step found past: its slot index (kSlots for a captured
  // step) and the error word it left.
  using Past = std::function<void(std::size_t slot, std::uint64_t error_word)>;

  // captured_blocks: the captured steps one capture may hold (>= 1).
  ArgumentRing(std::uint32_t max_batch, std::uint32_t rows, std::uint32_t captured_blocks);
  ~ArgumentRing();
  ArgumentRing(const ArgumentRing&) = delete;
  ArgumentRing& operator=(const ArgumentRing&) = delete;

  const ArgsLayout& layout() const noexcept { return layout_; }
  // The block the launches read, in device memory.
  std::byte* device_block() const noexcept { return device_.as<std::byte>(); }
  // Refuses a captured step that would find no block allocated ahead
  // (failed_precondition).
  void check_capture() const;
  // A slot for the next step, its error word reset; an eager slot still in
  // use is waited for and reported past first, and the blocks captured steps
  // took are allocated again. A captured step without a block is refused
  // (failed_precondition).
  Slot acquire(bool captured, const Past& past);
  // After the step's last launch: an eager slot is in flight until its event.
  void enqueued(const Slot& slot, cudaStream_t stream);
  // Reports the eager steps already past, without waiting.
  void collect_past(const Past& past);
  // After the device is idle: reports every eager step in flight, and the
  // error word each captured step's last replay left (cleared).
  void collect_all(const Past& past);

 private:
  void report(std::size_t k, const Past& past);
  // Allocates blocks for captured steps up to captured_blocks_ (never inside a capture).
  void refill_spares();

  ArgsLayout layout_;
  DeviceBytes device_;
  std::array<PinnedBytes, kSlots> slots_;
  std::array<cudaEvent_t, kSlots> events_{};
  std::array<bool, kSlots> in_flight_{};
  PinnedBytes errors_;                 // [kSlots] error words of the eager slots
  std::vector<PinnedBytes> captured_;  // a captured step's block, its error word after it
  std::vector<PinnedBytes> spares_;    // blocks for the next captured steps, allocated ahead
  std::uint32_t captured_blocks_;
  std::size_t next_ = 0;
};

}  // namespace sparsekv::cuda
