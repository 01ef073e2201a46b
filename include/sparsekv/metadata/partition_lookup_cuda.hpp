#pragma once
// CUDA backend of PartitionLookup (sparsekv::cuda). Resolves a batch of
// partitions of one (request, layer, kv head) to CPU page ids on the GPU.
#include <cstddef>
#include <cstdint>

#include "sparsekv/metadata/partition_lookup.hpp"

namespace sparsekv::cuda {

// One thread per partition: partition partitions[i] writes its pages to
// out + out_offsets[i]. `partitions`, `out_offsets` and `out` are
// device-accessible (device or mapped pinned memory); the tables behind
// `lookup` are those of a HierarchicalPageTable built on pinned host memory
// (HostMemoryResource with a device present), read through UVA. Enqueued on `stream` (a cudaStream_t; nullptr = default
// stream); throws ErrorCode::cuda_error if the launch fails.
void resolve_partition_pages(const PartitionLookup& lookup, std::size_t instance, const PartitionId* partitions,
                             const std::uint32_t* out_offsets, std::uint32_t count, PageId* out, void* stream);

}  // namespace sparsekv::cuda
