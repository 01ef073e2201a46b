#pragma once
// ThreadPool: the threads an engine lends a decode step, as a CPU engine
// keeps them (llama.cpp's pool runs every graph node on all its threads):
// `threads - 1` workers that live as long as the pool, the caller taking
// part as the last one. parallel_for has the shape of sparsekv::StepExecutor.
// Between calls the workers, and the caller waiting for them, poll before
// they sleep (spin_wait.hpp): a step's phases are short.
// The library itself starts no threads; the examples, tools and tests that
// play an engine use this one.
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "sparsekv/step/step_executor.hpp"
#include "spin_wait.hpp"

namespace sparsekv::tools {

class ThreadPool {
 public:
  explicit ThreadPool(unsigned threads) {
    for (unsigned i = 1; i < threads; ++i) workers_.emplace_back([this] { work(); });
  }
  ~ThreadPool() {
    {
      const std::lock_guard lock(mutex_);
      stop_.store(true);
    }
    wake_.notify_all();
    for (std::thread& t : workers_) t.join();
  }
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  unsigned threads() const noexcept { return static_cast<unsigned>(workers_.size()) + 1; }

  // body(i) for every i in [0, n), spread over the workers and the caller;
  // returns once every call has returned. One call at a time.
  void parallel_for(std::size_t n, const std::function<void(std::size_t)>& body) {
    if (workers_.empty() || n <= 1) {
      for (std::size_t i = 0; i < n; ++i) body(i);
      return;
    }
    {
      const std::lock_guard lock(mutex_);
      body_ = &body;
      n_ = n;
      next_.store(0, std::memory_order_relaxed);
      busy_.store(workers_.size(), std::memory_order_relaxed);
      generation_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
    run();
    spin_until([this] { return busy_.load(std::memory_order_acquire) == 0; });
    std::unique_lock lock(mutex_);
    done_.wait(lock, [this] { return busy_.load(std::memory_order_acquire) == 0; });
    body_ = nullptr;
  }

  // parallel_for as the executor a Manager's decode() takes.
  StepExecutor executor() {
    return [this](std::size_t n, const std::function<void(std::size_t)>& body) { parallel_for(n, body); };
  }

 private:
  void run() {
    for (std::size_t i = next_.fetch_add(1, std::memory_order_relaxed); i < n_;
         i = next_.fetch_add(1, std::memory_order_relaxed)) {
      (*body_)(i);
    }
  }
  void work() {
    std::uint64_t seen = 0;
    for (;;) {
      spin_until([&] { return generation_.load(std::memory_order_acquire) != seen || stop_.load(); });
      {
        std::unique_lock lock(mutex_);
        wake_.wait(lock, [&] { return stop_.load() || generation_.load() != seen; });
        if (stop_.load()) return;
        seen = generation_.load();
      }
      run();
      if (busy_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
        const std::lock_guard lock(mutex_);
        done_.notify_one();
      }
    }
  }

  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable wake_, done_;
  std::atomic<bool> stop_{false};
  std::atomic<std::uint64_t> generation_{0};
  std::atomic<std::size_t> busy_{0};
  const std::function<void(std::size_t)>* body_ = nullptr;
  std::size_t n_ = 0;
  std::atomic<std::size_t> next_{0};
};

}  // namespace sparsekv::tools
