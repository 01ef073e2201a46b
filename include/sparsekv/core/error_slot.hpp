#pragma once
// ErrorSlot: where a call that must not throw -- a graph operator running on
// an engine's threads, a callback behind a C interface -- leaves the first
// error it met, for the engine's caller to read once the engine returns
// (docs/errors.md, "Across a C boundary"). Any thread may capture; the first
// capture wins and later ones are dropped (they are usually its echoes on
// other threads). ErrorCode values are stable integers for a C caller.
#include <atomic>
#include <exception>
#include <mutex>
#include <new>
#include <optional>
#include <string>

#include "sparsekv/core/error_code.hpp"

namespace sparsekv {

struct ErrorRecord {
  ErrorCode code = ErrorCode::internal;
  std::string message;  // what(): "sparsekv <code>: ..." for a sparsekv::Error
};

class ErrorSlot {
 public:
  // Records the exception being handled (call it inside a catch block):
  // sparsekv::Error keeps its code, std::bad_alloc is resource_exhausted,
  // anything else internal. Returns whether this capture was the first.
  bool capture() noexcept {
    ErrorRecord r;
    try {
      throw;
    } catch (const Error& e) {
      r = make(e.code(), e.what());
    } catch (const std::bad_alloc&) {
      r = make(ErrorCode::resource_exhausted, "out of host memory");
    } catch (const std::exception& e) {
      r = make(ErrorCode::internal, e.what());
    } catch (...) {
      r = make(ErrorCode::internal, "an exception of unknown type");
    }
    return set(std::move(r));
  }
  // Records `code` and `message` the same way, outside any catch block.
  bool set(ErrorCode code, const char* message) noexcept { return set(make(code, message)); }

  // Whether an error is held: cheap, for the threads that must stop.
  bool failed() const noexcept { return failed_.load(std::memory_order_acquire); }
  std::optional<ErrorRecord> error() const {
    std::lock_guard lock(mutex_);
    return error_;
  }
  void clear() noexcept {
    std::lock_guard lock(mutex_);
    error_.reset();
    failed_.store(false, std::memory_order_release);
  }

 private:
  static ErrorRecord make(ErrorCode code, const char* message) noexcept {
    ErrorRecord r;
    r.code = code;
    try {
      r.message = message;
    } catch (...) {  // no memory for the text: the code alone
    }
    return r;
  }
  bool set(ErrorRecord r) noexcept {
    std::lock_guard lock(mutex_);
    if (error_) return false;
    error_.emplace(std::move(r));
    failed_.store(true, std::memory_order_release);
    return true;
  }

  mutable std::mutex mutex_;
  std::optional<ErrorRecord> error_;
  std::atomic<bool> failed_{false};
};

}  // namespace sparsekv
