#include "sparsekv/facade/cuda_backend.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>

#include "sparsekv/attention/sparse_decode_attention_cuda.hpp"
#include "sparsekv/core/device.hpp"
#include "sparsekv/core/error.hpp"

namespace sparsekv::cuda {
namespace {

void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) fail(ErrorCode::cuda_error, "CudaBackend: {} failed: {}", what, cudaGetErrorString(status));
}

}  // namespace

CudaBackend::CudaBackend() : transfer_(std::make_unique<DevicePageTransfer>()) {}

CudaBackend::~CudaBackend() {
  transfer_->synchronize();
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

void CudaBackend::attend(const AttendCall& call) {
  const AttendPlan& plan = *call.plan;
  const std::uint32_t dim = call.layout.head_dim;
  const std::uint32_t group = call.q_heads / call.kv_heads;
  const std::size_t runs = plan.entries();
  const auto stream = static_cast<cudaStream_t>(transfer_->stream());

  // Kernel rows are the plan's runs, each a one-kv-head "request" carrying
  // the q heads of its GQA group.
  run_q_.resize(runs * group * dim);
  std::uint32_t max_pages = 0;
  for (std::uint32_t b = 0; b < call.batch; ++b) {
    for (std::uint32_t h = 0; h < call.kv_heads; ++h) {
      const std::size_t head = std::size_t{b} * call.kv_heads + h;
      const float* q = call.q + (std::size_t{b} * call.q_heads + std::size_t{h} * group) * dim;
      for (auto e = plan.head_entries[head]; e < plan.head_entries[head + 1]; ++e) {
        std::copy(q, q + std::size_t{group} * dim, run_q_.begin() + e * group * dim);
        max_pages = std::max(max_pages, static_cast<std::uint32_t>(plan.indptr[e + 1] - plan.indptr[e]));
      }
    }
  }
  run_out_.assign(runs * group * dim, 0.0f);
  run_lse_.assign(runs * group, kNegativeInfinity);
  if (runs > 0) {
    DecodeAttentionShape shape;
    shape.batch = static_cast<std::uint32_t>(runs);
    shape.q_heads = group;
    shape.kv_heads = 1;
    shape.layout = call.layout;
    shape.max_pages = max_pages;
    const DecodeAttentionSplit split = plan_sparse_decode_attention(shape);
    DecodeAttentionArgs args;
    const auto upload = [&](DeviceBuffer& buffer, const void* data, std::size_t bytes) {
      void* d = device_bytes(buffer, bytes);
      check(cudaMemcpyAsync(d, data, bytes, cudaMemcpyHostToDevice, stream), "cudaMemcpyAsync H2D");
      return d;
    };
    args.q = static_cast<const float*>(upload(q_, run_q_.data(), run_q_.size() * sizeof(float)));
    args.indptr = static_cast<const std::int64_t*>(upload(indptr_, plan.indptr.data(), plan.indptr.size() * 8));
    args.indices = static_cast<const std::int64_t*>(
        upload(indices_, plan.indices.data(), std::max<std::size_t>(plan.indices.size(), 1) * 8));
    args.last_page_len =
        static_cast<const std::int32_t*>(upload(last_page_len_, plan.last_page_len.data(), runs * 4));
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

  // Runs of one (request, kv head) and the extra term merge by log-sum-exp:
  // a run's (o, lse) is the partial (max = lse, sum = 1, acc = o).
  AttentionPartial merged(dim), run(dim);
  for (std::uint32_t b = 0; b < call.batch; ++b) {
    for (std::uint32_t j = 0; j < call.q_heads; ++j) {
      const std::size_t head = std::size_t{b} * call.kv_heads + j / group;
      merged = AttentionPartial(dim);
      for (auto e = plan.head_entries[head]; e < plan.head_entries[head + 1]; ++e) {
        const std::size_t row = static_cast<std::size_t>(e) * group + j % group;
        if (!std::isfinite(run_lse_[row])) continue;
        run.max = run_lse_[row];
        run.sum = 1.0f;
        std::copy_n(run_out_.begin() + row * dim, dim, run.acc.begin());
        merged.merge(run);
      }
      if (!plan.extra.empty()) merged.merge(plan.extra[std::size_t{b} * call.q_heads + j]);
      merged.write_output(call.out + (std::size_t{b} * call.q_heads + j) * dim);
    }
  }
}

std::unique_ptr<Backend> make_best_backend() {
  if (cuda_device_count() > 0) return std::make_unique<CudaBackend>();
  return std::make_unique<HostBackend>();
}

}  // namespace sparsekv::cuda
