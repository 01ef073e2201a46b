#pragma once
// Applies a list of ReplicaWordWrite (replica_word_write.hpp; TableReplica::entry_writes makes them) on the device: the
// entries, lengths and directory slots the host appended to a replicated
// table, handed over inside a decode step's arguments (docs/device-decode.md).
// The count is read on the device and the grid sized from the capacity, so
// the launch can be captured in a CUDA graph and replayed with other lists.
//
// fmt-free: kernel translation units and their callers can include it.
#include <cstdint>

#include "sparsekv/core/host_device.hpp"
#include "sparsekv/metadata/replica_word_write.hpp"

namespace sparsekv::cuda {

// Write i of a list of `count` (cut at `capacity`): the rule the kernel's
// thread i and the host emulation apply.
SPARSEKV_HOST_DEVICE inline void apply_replica_write(const ReplicaWordWrite* writes, std::uint32_t count,
                                                     std::uint32_t capacity, std::uint32_t i) {
  if (i < count && i < capacity) *writes[i].word = writes[i].value;
}

// Enqueues writes[0 .. min(*count, capacity)) on `stream` (a cudaStream_t;
// nullptr = default stream). `writes` and `count` are device-accessible; the
// words are distinct. capacity == 0 enqueues nothing. Throws
// ErrorCode::invalid_argument for null writes or count with capacity > 0,
// ErrorCode::cuda_error if the launch fails.
void apply_replica_writes(const ReplicaWordWrite* writes, const std::uint32_t* count, std::uint32_t capacity,
                          void* stream);

}  // namespace sparsekv::cuda
