#pragma once
// fmt-free and free of the table classes: kernel translation units include it.
#include <cstdint>

namespace sparsekv {

// One 32-bit word of a replica set to `value`: how the device decode step
// hands the replica the entries the host appended, inside the step's own
// arguments (docs/device-decode.md). The values are snapshots taken when the
// step is planned, so the host may change the master again before the copy
// runs; and only the words the host wrote are touched, never the residency
// bits or timestamps the LRU kernel keeps in the replica's other entries.
struct ReplicaWordWrite {
  std::uint32_t* word = nullptr;  // in the replica (device memory on the device path)
  std::uint32_t value = 0;
};

}  // namespace sparsekv
