#include "sparsekv/facade/cuda_backend.hpp"

#include <cuda_runtime.h>

#include <algorithm>

#include "sparsekv/attention/sparse_decode_attention_cuda.hpp"
#include "sparsekv/core/device.hpp"
#include "sparsekv/core/error.hpp"
#include "sparsekv/step/device_runtime_cuda.hpp"

namespace sparsekv::cuda {
namespace {

void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess)
    fail(ErrorCode::cuda_error, "CudaBackend: {} failed: {}", what, cudaGetErrorString(status));
}

}  // namespace

CudaBackend::CudaBackend() : transfer_(std::make_unique<DevicePageTransfer>()) {}

CudaBackend::~CudaBackend() {
  // A destructor cannot report a failed synchronisation; the buffers go either way.
  cudaStreamSynchronize(static_cast<cudaStream_t>(transfer_->stream()));
  for (DeviceBuffer* b : {&q_, &indptr_, &indices_, &last_page_len_, &head_entries_, &extra_, &out_, &workspace_,
                          &live_masks_, &slot_weights_})
    cudaFree(b->data);
}

void* CudaBackend::device_bytes(DeviceBuffer& buffer, std::size_t bytes) {
  if (bytes <= buffer.bytes) return buffer.data;
  transfer_->synchronize();  // the buffer may still be read by the last launch
  cudaFree(buffer.data);
  buffer = {};
  check(cudaMalloc(&buffer.data, bytes), "cudaMalloc");
  buffer.bytes = bytes;
  return buffer.data;
}

bool CudaBackend::is_device_pointer(const void* p) const {
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    cudaGetLastError();  // an unregistered host pointer is not an error to keep
    return false;
  }
  return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged;
}

void CudaBackend::copy_to_host(void* host, const void* device, std::size_t bytes, void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  check(cudaMemcpyAsync(host, device, bytes, cudaMemcpyDeviceToHost, s), "cudaMemcpyAsync D2H");
  check(cudaStreamSynchronize(s), "cudaStreamSynchronize");
}

void CudaBackend::copy_to_device(void* device, const void* host, std::size_t bytes, void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  check(cudaMemcpyAsync(device, host, bytes, cudaMemcpyHostToDevice, s), "cudaMemcpyAsync H2D");
  check(cudaStreamSynchronize(s), "cudaStreamSynchronize");
}

void CudaBackend::check_attend(const PageLayout& layout, std::uint32_t q_heads, std::uint32_t kv_heads) const {
  if (layout.dtype == DType::q8_0) {
    fail(ErrorCode::invalid_argument,
         "q8_0 storage is attended by the host backends; the CUDA kernels read f32, f16 "
         "or bf16 pages");
  }
  DecodeAttentionShape shape;
  shape.batch = 1;
  shape.q_heads = q_heads / kv_heads;
  shape.kv_heads = 1;
  shape.layout = layout;
  plan_sparse_decode_attention(shape);  // throws invalid_argument on a shape the kernel lacks
}

void CudaBackend::attend(const AttendCall& call) {
  check_attend_masks(call);
  const AttendPlan& plan = *call.plan;
  const std::size_t weight_count = plan.indices.size() * call.layout.page_tokens;
  // Pages no row reaches get no weight; the kernel writes every slot of the others. Zeroed only once
  // the launch has passed its checks, so that a refused call writes nothing.
  const auto zero_weights = [&] {
    if (call.slot_weights != nullptr) std::fill_n(call.slot_weights, weight_count, 0.0f);
  };
  if (call.batch == 0) {
    zero_weights();
    transfer_->synchronize();  // nothing to attend, but the stream is drained on return as after any step
    return;
  }
  const auto stream = static_cast<cudaStream_t>(transfer_->stream());
  const std::uint32_t dim = call.layout.head_dim;
  const std::size_t heads = std::size_t{call.batch} * call.q_heads;
  DecodeAttentionShape shape;
  shape.batch = call.batch;
  shape.q_heads = call.q_heads;
  shape.kv_heads = call.kv_heads;
  shape.layout = call.layout;
  // A plan without pages has no slot to weigh.
  const bool weights = call.slot_weights != nullptr && weight_count > 0;
  if (weights) shape.max_indices = static_cast<std::uint32_t>(plan.indices.size());
  // The plan is on the host here, so its longest row sizes the split (the
  // device step passes a capacity instead).
  for (std::size_t r = 0; r + 1 < plan.head_entries.size(); ++r) {
    const std::int64_t pages = plan.indptr[plan.head_entries[r + 1]] - plan.indptr[plan.head_entries[r]];
    shape.max_pages = std::max(shape.max_pages, static_cast<std::uint32_t>(pages));
  }
  const DecodeAttentionSplit split = plan_sparse_decode_attention(shape);
  // At least 16 bytes each, so that an empty array (a plan with no pages) is still a valid pointer.
  const auto upload = [&](DeviceBuffer& buffer, const void* data, std::size_t bytes) {
    void* d = device_bytes(buffer, std::max<std::size_t>(bytes, 16));
    if (bytes > 0) check(cudaMemcpyAsync(d, data, bytes, cudaMemcpyHostToDevice, stream), "cudaMemcpyAsync H2D");
    return d;
  };
  const auto bytes_of = [](const auto& v) { return v.size() * sizeof(v[0]); };
  DecodeAttentionArgs args;
  args.q = static_cast<const float*>(upload(q_, call.q, heads * dim * sizeof(float)));
  args.page_base = plan.gpu_tier_base;
  args.page_stride = plan.page_bytes;
  args.indptr = static_cast<const std::int64_t*>(upload(indptr_, plan.indptr.data(), bytes_of(plan.indptr)));
  args.indices = static_cast<const std::int64_t*>(upload(indices_, plan.indices.data(), bytes_of(plan.indices)));
  args.last_page_len =
      static_cast<const std::int32_t*>(upload(last_page_len_, plan.last_page_len.data(), bytes_of(plan.last_page_len)));
  args.row_entries =
      static_cast<const std::int64_t*>(upload(head_entries_, plan.head_entries.data(), bytes_of(plan.head_entries)));
  if (!plan.live_masks.empty())
    args.live_masks =
        static_cast<const SlotMask*>(upload(live_masks_, plan.live_masks.data(), bytes_of(plan.live_masks)));
  args.scale = call.scale;
  if (!plan.extra.empty()) {
    // An empty term (sum 0) may have no accumulator: its zeros are never read.
    extra_host_.assign(heads * (std::size_t{dim} + 2), 0.0f);
    for (std::size_t h = 0; h < heads; ++h) {
      const AttentionPartial& e = plan.extra[h];
      extra_host_[h] = e.max;
      extra_host_[heads + h] = e.sum;
      std::copy_n(e.acc.begin(), std::min<std::size_t>(e.acc.size(), dim),
                  extra_host_.begin() + static_cast<std::ptrdiff_t>(2 * heads + h * dim));
    }
    const auto* extra = static_cast<const float*>(upload(extra_, extra_host_.data(), bytes_of(extra_host_)));
    args.extra = {extra, extra + heads, extra + 2 * heads};
  }
  args.out = static_cast<float*>(device_bytes(out_, heads * dim * sizeof(float)));
  args.workspace = device_bytes(workspace_, std::max<std::size_t>(split.workspace_bytes, 16));
  args.workspace_bytes = workspace_.bytes;
  if (weights) args.slot_weights = static_cast<float*>(device_bytes(slot_weights_, weight_count * sizeof(float)));
  sparse_decode_attention(shape, args, stream);
  zero_weights();
  check(cudaMemcpyAsync(call.out, args.out, heads * dim * sizeof(float), cudaMemcpyDeviceToHost, stream),
        "cudaMemcpyAsync D2H");
  if (weights) {
    // Only the span of the rows' pages comes back: the kernel writes no other.
    const auto first = static_cast<std::size_t>(plan.indptr[plan.head_entries.front()]);
    const auto end = static_cast<std::size_t>(plan.indptr[plan.head_entries[std::size_t{call.batch} * call.kv_heads]]);
    const std::size_t pt = call.layout.page_tokens;
    if (end > first)
      check(cudaMemcpyAsync(call.slot_weights + first * pt, args.slot_weights + first * pt,
                            (end - first) * pt * sizeof(float), cudaMemcpyDeviceToHost, stream),
            "cudaMemcpyAsync D2H");
  }
  transfer_->synchronize();
}

std::unique_ptr<Backend> make_best_backend() {
  if (cuda_device_count() > 0) return std::make_unique<CudaBackend>();
  return std::make_unique<HostBackend>();
}

std::unique_ptr<DeviceRuntime> CudaBackend::make_device_runtime(const DeviceRuntimeSetup& setup,
                                                                TieredKVBuffer& buffer) {
  return make_cuda_device_runtime(setup, buffer, device_);
}

}  // namespace sparsekv::cuda
