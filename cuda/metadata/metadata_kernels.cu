// CUDA kernels of the metadata layer (Spin §5.2 Retrieve lookup path).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "core/launch_support.cuh"
#include "sparsekv/core/error_code.hpp"
#include "sparsekv/metadata/partition_lookup_cuda.hpp"
#include "sparsekv/metadata/replica_writes_cuda.hpp"

namespace sparsekv::cuda {
namespace {

__global__ void resolve_partition_pages_kernel(PartitionLookup lookup, std::size_t instance,
                                               const PartitionId* partitions, const std::uint32_t* out_offsets,
                                               std::uint32_t count, PageId* out) {
  // 64-bit index: i + stride must not wrap past 2^32 back below count.
  for (std::uint64_t i = std::uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < count;
       i += std::uint64_t{gridDim.x} * blockDim.x) {
    lookup.copy_pages(instance, partitions[i], out + out_offsets[i]);
  }
}

__global__ void apply_replica_writes_kernel(const ReplicaWordWrite* writes, const std::uint32_t* count,
                                            std::uint32_t capacity) {
  const std::uint32_t n = *count;
  for (std::uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < capacity; i += gridDim.x * blockDim.x) {
    apply_replica_write(writes, n, capacity, i);
  }
}

}  // namespace

void apply_replica_writes(const ReplicaWordWrite* writes, const std::uint32_t* count, std::uint32_t capacity,
                          void* stream) {
  if (capacity == 0) return;
  if (writes == nullptr || count == nullptr) {
    detail::throw_invalid("apply_replica_writes", "null writes or count");
  }
  constexpr std::uint32_t kThreads = 256;
  const std::uint32_t blocks = std::min<std::uint32_t>((capacity + kThreads - 1) / kThreads, 1024);
  apply_replica_writes_kernel<<<blocks, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(writes, count, capacity);
  detail::check_launch("apply_replica_writes");
}

void resolve_partition_pages(const PartitionLookup& lookup, std::size_t instance, const PartitionId* partitions,
                             const std::uint32_t* out_offsets, std::uint32_t count, PageId* out, void* stream) {
  if (count == 0) return;
  constexpr std::uint32_t kThreads = 256;
  const std::uint32_t blocks = (count + kThreads - 1) / kThreads;
  resolve_partition_pages_kernel<<<blocks, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      lookup, instance, partitions, out_offsets, count, out);
  detail::check_launch("resolve_partition_pages");
}

}  // namespace sparsekv::cuda
