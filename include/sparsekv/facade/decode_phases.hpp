#pragma once
// DecodePhases: one host-tensor decode step split into the phases an engine's
// threads share (Manager::begin_decode; docs/integration.md, "Threads"):
// select(ith, nth) on every thread, then commit() on one, attend(ith, nth) on
// every thread, finish() on one, with a barrier between. A view of the
// Manager's step, valid until the next call on that Manager.
#include <cstddef>

#include "sparsekv/step/host_step.hpp"

namespace sparsekv {

template <class Policy>
class DecodePhases {
 public:
  explicit DecodePhases(HostStep<Policy>& step) noexcept : step_(&step) {}

  // Select units of the step (0 once it is committed or over): what
  // select(ith, nth) divides among nth threads.
  std::size_t select_units() const noexcept { return step_->select_units(); }
  void select(std::size_t ith, std::size_t nth) noexcept { step_->select(ith, nth); }
  // Throws failed_precondition when a select() slice did not run, then what
  // a Select unit threw (the first in unit order) or a bad selection's
  // invalid_argument, changing nothing; the step is then over.
  void commit() { step_->commit(); }
  // Attend units of a committed step that splits its attention, else 0.
  std::size_t attend_units() const noexcept { return step_->attend_units(); }
  void attend(std::size_t ith, std::size_t nth) noexcept { step_->attend(ith, nth); }
  void finish() { step_->finish(); }

 private:
  HostStep<Policy>* step_;
};

}  // namespace sparsekv
