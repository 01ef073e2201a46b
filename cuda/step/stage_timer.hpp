#pragma once
// Opt-in timing of the device step's stages (DeviceRuntime::time_stages,
// DeviceStageTimes): cudaEvents recorded on the step's stream at the stage
// boundaries, one set per argument-ring slot, read when the ring reports the
// slot's step past -- no host sync added to a step -- and the host's wall
// time to enqueue each stage, read from a steady clock at the same marks.
// Steps captured into a CUDA graph are not timed. Private to cuda/step/.
#include <cuda_runtime.h>

#include <array>
#include <chrono>
#include <cstddef>

#include "argument_ring.hpp"
#include "sparsekv/step/device_runtime.hpp"

namespace sparsekv::cuda {

class StageTimer {
 public:
  // The step's start, then the end of append, select, lru, gather and attend.
  enum Mark : std::size_t { start, append, select, lru, gather, attend, kMarks };

  StageTimer() = default;
  ~StageTimer();
  StageTimer(const StageTimer&) = delete;
  StageTimer& operator=(const StageTimer&) = delete;

  // Later eager steps are timed (on) or not; the events are made at the first `on`.
  void enable(bool on);
  using Clock = std::chrono::steady_clock;
  // The step about to be enqueued in `slot`, entered at `entered`: timed when
  // enabled and eager.
  void begin(const ArgumentRing::Slot& slot, Clock::time_point entered);
  void mark(Mark mark, cudaStream_t stream);
  // The step is enqueued: its host time joins the totals.
  void end();
  // The step of ring slot `slot` is past: its stage times join the totals.
  void past(std::size_t slot);
  const DeviceStageTimes& totals() const noexcept { return totals_; }

 private:
  bool enabled_ = false;
  bool timing_ = false;  // the step being enqueued
  std::size_t slot_ = 0;
  Clock::time_point entered_, last_;  // the step's entry, its last mark
  std::array<std::array<cudaEvent_t, kMarks>, ArgumentRing::kSlots> events_{};
  std::array<bool, ArgumentRing::kSlots> timed_{};
  DeviceStageTimes totals_;
};

}  // namespace sparsekv::cuda
