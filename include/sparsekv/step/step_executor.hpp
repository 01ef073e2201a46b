#pragma once
// StepExecutor: how an engine lends a step its threads. The library starts no
// thread of its own; a CPU engine (llama.cpp runs each graph node on its own
// pool) hands decode() its parallel_for, or drives the step's phases itself
// with (ith, nth) from its own threads (host_step.hpp, docs/integration.md,
// "Threads").
#include <cstddef>
#include <functional>

namespace sparsekv {

// Calls body(i) once for every i in [0, n), on any of the engine's threads and
// in any order, and returns once every call has returned. body never throws.
using StepExecutor = std::function<void(std::size_t n, const std::function<void(std::size_t)>& body)>;

}  // namespace sparsekv
