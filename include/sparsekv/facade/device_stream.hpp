#pragma once
// The stream a device-tensor call of the facade enqueues its work on.
//
// The host and device overloads of Manager::prefill / decode / plan differ
// only in their last argument. A bare `nullptr` or `{}` must never pick the
// device path (a host engine meaning "no executor" would get a device step
// over host pointers), so a DeviceStream is made only from a typed stream
// handle: a cudaStream_t (CUstream_st*), or a void* an engine keeps one in,
// null included (the legacy default stream). Neither `nullptr` nor `{}`
// converts to it.
#include <type_traits>

namespace sparsekv {

struct DeviceStream {
  // Implicit: an engine's stream passes as it is.
  template <class Handle>
  requires(!std::is_const_v<Handle>) DeviceStream(Handle* stream)
  noexcept : handle(stream) {}

  void* handle;
};

}  // namespace sparsekv
