// The "sort everything" peer of bench_select_cuda.cpp:
// cub::DeviceSegmentedRadixSort::SortPairsDescending of one float score and
// one uint32 index per candidate, segments = the select rows' CSR offsets.
// Its own translation unit: the benchmark includes the host policies, whose
// fmt format strings nvcc does not compile.
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cub/device/device_segmented_radix_sort.cuh>

namespace sparsekv::bench {

// temp == nullptr: sets temp_bytes to the storage needed, sorts nothing.
cudaError_t segmented_sort_descending(void* temp, std::size_t& temp_bytes, const float* keys_in, float* keys_out,
                                      const std::uint32_t* values_in, std::uint32_t* values_out, std::int64_t items,
                                      std::int64_t segments, const std::uint32_t* offsets, cudaStream_t stream) {
  return cub::DeviceSegmentedRadixSort::SortPairsDescending(temp, temp_bytes, keys_in, keys_out, values_in, values_out,
                                                            items, segments, offsets, offsets + 1, 0,
                                                            int(sizeof(float) * 8), stream);
}

}  // namespace sparsekv::bench
