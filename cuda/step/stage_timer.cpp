#include "stage_timer.hpp"

#include <utility>

namespace sparsekv::cuda {

StageTimer::~StageTimer() {
  for (auto& marks : events_) {
    for (auto& e : marks) {
      if (e != nullptr) cudaEventDestroy(e);
    }
  }
}

void StageTimer::enable(bool on) {
  if (on && events_[0][0] == nullptr) {
    for (auto& marks : events_) {
      for (auto& e : marks) check_runtime(cudaEventCreate(&e), "cudaEventCreate");
    }
  }
  enabled_ = on;
}

namespace {

double ms_between(StageTimer::Clock::time_point a, StageTimer::Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

}  // namespace

void StageTimer::begin(const ArgumentRing::Slot& slot, Clock::time_point entered) {
  timing_ = enabled_ && !slot.captured;
  slot_ = slot.index;
  if (!slot.captured) timed_[slot.index] = timing_;
  entered_ = last_ = entered;
}

void StageTimer::mark(Mark mark, cudaStream_t stream) {
  if (!timing_) return;
  check_runtime(cudaEventRecord(events_[slot_][mark], stream), "cudaEventRecord");
  if (mark == start) return;  // the slot, the arguments and their copy count as append's
  const Clock::time_point now = Clock::now();
  double* const host[kMarks] = {nullptr,
                                &totals_.host_append_ms,
                                &totals_.host_select_ms,
                                &totals_.host_lru_ms,
                                &totals_.host_gather_ms,
                                &totals_.host_attend_ms};
  *host[mark] += ms_between(last_, now);
  last_ = now;
}

void StageTimer::end() {
  if (timing_) totals_.host_step_ms += ms_between(entered_, Clock::now());
}

void StageTimer::past(std::size_t slot) {
  if (slot >= ArgumentRing::kSlots || !std::exchange(timed_[slot], false)) return;
  std::array<float, kMarks - 1> ms{};
  for (std::size_t i = 0; i + 1 < kMarks; ++i) {
    check_runtime(cudaEventElapsedTime(&ms[i], events_[slot][i], events_[slot][i + 1]), "cudaEventElapsedTime");
  }
  totals_.append_ms += ms[0];
  totals_.select_ms += ms[1];
  totals_.lru_ms += ms[2];
  totals_.gather_ms += ms[3];
  totals_.attend_ms += ms[4];
  ++totals_.steps;
}

}  // namespace sparsekv::cuda
