#pragma once
// spin_until: the short wait of a thread pool handing out many short jobs.
// Waking a thread asleep on a condition variable costs tens of microseconds
// on a VM -- as much as one sparse attend phase of a small model -- so a
// pool's workers, and its caller waiting for them, poll first and sleep only
// when nothing came within kSpinPolls polls (about 100 us); llama.cpp's
// thread pool polls the same way.
#include <thread>

namespace sparsekv::tools {

inline constexpr unsigned kSpinPolls = 1u << 16;

// Polls `done` up to `polls` times, pausing between; whether it held.
template <class Done>
bool spin_until(Done&& done, unsigned polls = kSpinPolls) {
  for (unsigned i = 0; i < polls; ++i) {
    if (done()) return true;
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#else
    std::this_thread::yield();
#endif
  }
  return done();
}

}  // namespace sparsekv::tools
