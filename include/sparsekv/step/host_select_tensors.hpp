#pragma once
// HostSelectTensors: a device-tensor call served on the host -- a policy with only
// a host Select on the device-tensor API (docs/integration.md, "Device
// tensors") -- has its tensors copied into host memory through the backend,
// runs as a host step, and has its output copied back. Every copy waits: a
// slower path, off the device step's.
#include <array>
#include <cstddef>
#include <vector>

#include "sparsekv/step/backend.hpp"

namespace sparsekv {

class HostSelectTensors {
 public:
  // Tensor slot i (q, k, v: 0, 1, 2) as a host copy of `bytes` of device memory.
  const std::byte* copy_in(Backend& backend, std::size_t i, const void* device, std::size_t bytes, void* stream) {
    host_[i].resize(bytes);
    backend.copy_to_host(host_[i].data(), device, bytes, stream);
    return host_[i].data();
  }
  // The host output of `values` floats, then copied to `device`.
  float* output(std::size_t values) {
    out_.resize(values);
    return out_.data();
  }
  void write_output(Backend& backend, float* device, void* stream) {
    backend.copy_to_device(device, out_.data(), out_.size() * sizeof(float), stream);
  }

 private:
  std::array<std::vector<std::byte>, 3> host_;
  std::vector<float> out_;
};

}  // namespace sparsekv
