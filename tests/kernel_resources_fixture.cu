// Fixture of the kernel-resources ctest (check_kernel_resources.cmake): two
// kernels whose resources are known in kind. scale_kernel is small, uses 1 KB
// of static shared memory and one barrier, and calls a non-inlined device
// function (ptxas reports that function's properties after the kernel's, and
// they must not overwrite them). pressure_kernel keeps 40 loaded values live
// under __launch_bounds__(256, 8), which caps it at 32 registers, so it spills.
// kScale is the TU's 64 bytes of __constant__.
namespace fixture {
namespace {
__constant__ float kScale[16];

__device__ __noinline__ float pick_from_tile(const float* tile, int at, int tile_size) {
  float local[8];
  for (int k = 0; k < 8; ++k) local[k] = tile[(at + k) % tile_size];
  return local[at & 7];
}

template <int kTile>
__global__ void __launch_bounds__(128) scale_kernel(const float* x, float* y, int n) {
  __shared__ float tile[kTile];
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  tile[threadIdx.x % kTile] = i < n ? x[i] : 0.0f;
  __syncthreads();
  if (i < n) y[i] = pick_from_tile(tile, threadIdx.x + 1, kTile) * kScale[i & 15];
}

__global__ void __launch_bounds__(256, 8) pressure_kernel(const float* x, float* y, int n) {
  float v[40];
#pragma unroll
  for (int k = 0; k < 40; ++k) v[k] = x[(k * 977 + threadIdx.x) % n];
  float acc = 0.0f;
#pragma unroll
  for (int k = 0; k < 40; ++k) acc += v[k] * v[39 - k] * v[(k * 7) % 40];
  y[threadIdx.x] = acc;
}
}  // namespace

void launch(const float* x, float* y, int n) {
  scale_kernel<256><<<1, 128>>>(x, y, n);
  pressure_kernel<<<1, 256>>>(x, y, n);
}
}  // namespace fixture
