// Appends on the device without summaries (buffer/append_cuda.hpp).
#include "buffer/append_kernel.cuh"

namespace sparsekv::cuda {

void append_tokens(const DeviceAppend& args, void* stream) {
  detail::check_device_append("append_tokens", args);
  detail::launch_append("append_tokens", args, detail::NoPageSummary{}, stream);
}

}  // namespace sparsekv::cuda
