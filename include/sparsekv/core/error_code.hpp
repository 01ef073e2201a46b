#pragma once
// The one error-reporting scheme of sparsekv (docs/errors.md).
//
// Every public call that can fail throws sparsekv::Error with an ErrorCode and
// a message naming the offending value. A call that throws leaves the object it
// was called on exactly as it was (strong guarantee): validation happens before
// any state changes. No other layer defines its own error type.
//
// This header is free of fmt so CUDA translation units can include it;
// error.hpp adds the formatting helpers host code uses.
#include <stdexcept>
#include <string>
#include <string_view>

namespace sparsekv {

enum class ErrorCode {
  invalid_argument,     // malformed input: bad config, shape, dtype, spec
  not_found,            // unknown request or other handle
  out_of_range,         // an index (layer, head, partition, page) beyond its bound
  already_exists,       // a handle registered twice
  resource_exhausted,   // a pool, budget or slot table is full
  failed_precondition,  // the call is valid in general but not in this state
  unavailable,          // no CUDA device / driver for a device-only operation
  cuda_error,           // the CUDA runtime reported a failure
  internal,             // an exception that was not a sparsekv::Error (ErrorSlot)
};

std::string_view to_string(ErrorCode code) noexcept;

class Error : public std::runtime_error {
 public:
  // what() reads "sparsekv <code>: <message>".
  Error(ErrorCode code, const std::string& message);
  ErrorCode code() const noexcept { return code_; }

 private:
  ErrorCode code_;
};

// Why a call would be refused, found before it changes anything: the code it
// would throw and the message. An advice call (can_admit, can_fork) and the
// call it advises on share one, so that the two agree.
struct Refusal {
  ErrorCode code;
  std::string message;
};

}  // namespace sparsekv
