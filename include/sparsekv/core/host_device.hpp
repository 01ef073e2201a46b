#pragma once
// Marks functions that both backends call: the host backend compiles them with
// the host compiler, the CUDA kernels with nvcc. CI (no GPU) tests the host side.
#if defined(__CUDACC__)
#define SPARSEKV_HOST_DEVICE __host__ __device__
#else
#define SPARSEKV_HOST_DEVICE
#endif
