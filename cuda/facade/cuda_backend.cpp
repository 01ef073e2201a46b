#include "sparsekv/facade/cuda_backend.hpp"

#include <cuda_runtime.h>

#include <algorithm>

#include "sparsekv/attention/sparse_decode_attention_cuda.hpp"
#include "sparsekv/core/device.hpp"
#include "sparsekv/core/error.hpp"
#include "sparsekv/facade/attend_runs.hpp"

namespace sparsekv::cuda {
namespace {

void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) fail(ErrorCode::cuda_error, "CudaBackend: {} failed: {}", what, cudaGetErrorString(status));
}

}  // namespace

CudaBackend::CudaBackend() : transfer_(std::make_unique<DevicePageTransfer>()) {}

CudaBackend::~CudaBackend() {
  // A destructor cannot report a failed synchronisation; the buffers go either way.
  cudaStreamSynchronize(static_cast<cudaStream_t>(transfer_->stream()));
  for (DeviceBuffer* b : {&q_, &indptr_, &indices_, &last_page_len_, &out_, &lse_, &workspace_}) cudaFree(b->data);
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

void CudaBackend::check_attend(const PageLayout& layout, std::uint32_t q_heads, std::uint32_t kv_heads) const {
  DecodeAttentionShape shape;
  shape.batch = 1;
  shape.q_heads = q_heads / kv_heads;
  shape.kv_heads = 1;
  shape.layout = layout;
  plan_sparse_decode_attention(shape);  // throws invalid_argument on a shape the kernel lacks
}

void CudaBackend::attend(const AttendCall& call) {
  const AttendPlan& plan = *call.plan;
  const std::size_t runs = plan.entries();
  const auto stream = static_cast<cudaStream_t>(transfer_->stream());
  gather_run_queries(call, runs_);
  run_out_.assign(runs_.q.size(), 0.0f);
  run_lse_.assign(runs * runs_.group, kNegativeInfinity);
  if (runs > 0) {
    DecodeAttentionShape shape;
    shape.batch = static_cast<std::uint32_t>(runs);
    shape.q_heads = runs_.group;
    shape.kv_heads = 1;
    shape.layout = call.layout;
    shape.max_pages = runs_.max_pages;
    const DecodeAttentionSplit split = plan_sparse_decode_attention(shape);
    const auto upload = [&](DeviceBuffer& buffer, const void* data, std::size_t bytes) {
      void* d = device_bytes(buffer, bytes);
      check(cudaMemcpyAsync(d, data, bytes, cudaMemcpyHostToDevice, stream), "cudaMemcpyAsync H2D");
      return d;
    };
    DecodeAttentionArgs args;
    args.q = static_cast<const float*>(upload(q_, runs_.q.data(), runs_.q.size() * sizeof(float)));
    args.indptr = static_cast<const std::int64_t*>(
        upload(indptr_, plan.indptr.data(), plan.indptr.size() * sizeof(std::int64_t)));
    args.indices = static_cast<const std::int64_t*>(
        upload(indices_, plan.indices.data(), plan.indices.size() * sizeof(std::int64_t)));
    args.last_page_len = static_cast<const std::int32_t*>(
        upload(last_page_len_, plan.last_page_len.data(), runs * sizeof(std::int32_t)));
    args.page_base = plan.gpu_tier_base;
    args.page_stride = plan.page_bytes;
    args.scale = call.scale;
    args.out = static_cast<float*>(device_bytes(out_, run_out_.size() * sizeof(float)));
    args.lse = static_cast<float*>(device_bytes(lse_, run_lse_.size() * sizeof(float)));
    args.workspace = device_bytes(workspace_, std::max<std::size_t>(split.workspace_bytes, 16));
    args.workspace_bytes = workspace_.bytes;
    sparse_decode_attention(shape, args, stream);
    check(cudaMemcpyAsync(run_out_.data(), args.out, run_out_.size() * sizeof(float), cudaMemcpyDeviceToHost, stream),
          "cudaMemcpyAsync D2H");
    check(cudaMemcpyAsync(run_lse_.data(), args.lse, run_lse_.size() * sizeof(float), cudaMemcpyDeviceToHost, stream),
          "cudaMemcpyAsync D2H");
  }
  transfer_->synchronize();
  merge_run_outputs(call, run_out_, run_lse_);
}

std::unique_ptr<Backend> make_best_backend() {
  if (cuda_device_count() > 0) return std::make_unique<CudaBackend>();
  return std::make_unique<HostBackend>();
}

}  // namespace sparsekv::cuda
