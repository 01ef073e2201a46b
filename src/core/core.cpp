#include <algorithm>
#include <bit>
#include <cmath>

#include "sparsekv/core/config.hpp"
#include "sparsekv/core/dtype.hpp"
#include "sparsekv/core/error.hpp"
#include "sparsekv/core/model_shape.hpp"

namespace sparsekv {

std::string_view to_string(ErrorCode code) noexcept {
  switch (code) {
    case ErrorCode::invalid_argument:
      return "invalid_argument";
    case ErrorCode::not_found:
      return "not_found";
    case ErrorCode::out_of_range:
      return "out_of_range";
    case ErrorCode::already_exists:
      return "already_exists";
    case ErrorCode::resource_exhausted:
      return "resource_exhausted";
    case ErrorCode::failed_precondition:
      return "failed_precondition";
    case ErrorCode::unavailable:
      return "unavailable";
    case ErrorCode::cuda_error:
      return "cuda_error";
    case ErrorCode::internal:
      return "internal";
  }
  return "unknown";
}

Error::Error(ErrorCode code, const std::string& message)
    : std::runtime_error(fmt::format("sparsekv {}: {}", to_string(code), message)), code_(code) {}

DType parse_dtype(std::string_view name) {
  if (name == "f32" || name == "fp32" || name == "float32") return DType::f32;
  if (name == "f16" || name == "fp16" || name == "float16") return DType::f16;
  if (name == "bf16" || name == "bfloat16") return DType::bf16;
  if (name == "q8_0") return DType::q8_0;
  fail(ErrorCode::invalid_argument, "unknown dtype '{}' (expected f32, f16, bf16 or q8_0)", name);
}

std::string_view to_string(EvictionStrategy strategy) noexcept {
  switch (strategy) {
    case EvictionStrategy::no_op:
      return "no_op";
    case EvictionStrategy::free_block:
      return "free_block";
    case EvictionStrategy::sparse_copy:
      return "sparse_copy";
    case EvictionStrategy::slot_reuse:
      return "slot_reuse";
  }
  return "unknown";
}

EvictionStrategy parse_eviction_strategy(std::string_view name) {
  for (EvictionStrategy s : {EvictionStrategy::no_op, EvictionStrategy::free_block, EvictionStrategy::sparse_copy,
                             EvictionStrategy::slot_reuse}) {
    const std::string_view canonical = to_string(s);
    if (name.size() == canonical.size() && std::equal(name.begin(), name.end(), canonical.begin(), [](char a, char b) {
          return a == b || (a == '-' && b == '_');
        })) {
      return s;
    }
  }
  fail(ErrorCode::invalid_argument,
       "unknown eviction strategy '{}' (expected no_op, free_block, sparse_copy or slot_reuse)", name);
}

void ModelShape::validate() const {
  if (layers == 0) fail(ErrorCode::invalid_argument, "ModelShape.layers must be > 0");
  if (q_heads == 0) fail(ErrorCode::invalid_argument, "ModelShape.q_heads must be > 0");
  if (kv_heads == 0) fail(ErrorCode::invalid_argument, "ModelShape.kv_heads must be > 0");
  if (q_heads % kv_heads != 0) {
    fail(ErrorCode::invalid_argument, "ModelShape.q_heads ({}) must be a multiple of kv_heads ({})", q_heads, kv_heads);
  }
  if (head_dim == 0 || head_dim % 8 != 0) {
    // 16-byte vector copies of one token row need head_dim * 2 bytes % 16 == 0.
    fail(ErrorCode::invalid_argument, "ModelShape.head_dim ({}) must be a positive multiple of 8", head_dim);
  }
  if (dtype == DType::q8_0) {
    fail(ErrorCode::invalid_argument,
         "ModelShape.dtype q8_0 is a storage type: engines hand over f32, f16 or bf16 (Config.kv_storage stores q8_0)");
  }
  if (dtype != DType::f32 && dtype != DType::f16 && dtype != DType::bf16) {
    fail(ErrorCode::invalid_argument, "ModelShape.dtype has an unknown value");
  }
}

float Config::softmax_scale(const ModelShape& shape) const noexcept {
  return attention_scale > 0.0f ? attention_scale : 1.0f / std::sqrt(static_cast<float>(shape.head_dim));
}

void Config::validate(const ModelShape& shape) const {
  shape.validate();
  if (page_tokens == 0 || page_tokens > 1024 || !std::has_single_bit(page_tokens)) {
    fail(ErrorCode::invalid_argument, "Config.page_tokens ({}) must be a power of two in [1, 1024]", page_tokens);
  }
  if (max_requests == 0) fail(ErrorCode::invalid_argument, "Config.max_requests must be > 0");
  if (max_context_tokens == 0 || max_context_tokens > (1u << 30)) {
    // Per-head page counts are doubled for padding and must stay 32-bit.
    fail(ErrorCode::invalid_argument, "Config.max_context_tokens ({}) must be in [1, 2^30]", max_context_tokens);
  }
  if (timestamp_buckets < 2 || timestamp_buckets > 256) {
    // Timestamps are stored in one byte and histogrammed in shared memory.
    fail(ErrorCode::invalid_argument, "Config.timestamp_buckets ({}) must be in [2, 256]", timestamp_buckets);
  }
  if (!(min_buffer_ratio >= 0.0) || min_buffer_ratio > 1024.0) {
    fail(ErrorCode::invalid_argument, "Config.min_buffer_ratio ({}) must be in [0, 1024]", min_buffer_ratio);
  }
  if (eviction_strategy > EvictionStrategy::slot_reuse) {
    fail(ErrorCode::invalid_argument, "Config.eviction_strategy has an unknown value");
  }
  if (!(attention_scale >= 0.0f) || !std::isfinite(attention_scale)) {
    fail(ErrorCode::invalid_argument, "Config.attention_scale ({}) must be finite and >= 0 (0: 1/sqrt(head_dim))",
         attention_scale);
  }
  if (working_set_window == 0) {
    fail(ErrorCode::invalid_argument, "Config.working_set_window must be > 0");
  }
  if (metadata_segment_entries < 32 || !std::has_single_bit(metadata_segment_entries)) {
    fail(ErrorCode::invalid_argument, "Config.metadata_segment_entries ({}) must be a power of two >= 32",
         metadata_segment_entries);
  }
  if (kv_storage && *kv_storage != shape.dtype && *kv_storage != DType::q8_0) {
    fail(ErrorCode::invalid_argument, "Config.kv_storage {} must be the model's dtype ({}) or q8_0",
         to_string(*kv_storage), to_string(shape.dtype));
  }
  if (kv_storage == DType::q8_0 && shape.head_dim % kQ8BlockValues != 0) {
    fail(ErrorCode::invalid_argument, "Config.kv_storage q8_0 needs head_dim ({}) a multiple of {}", shape.head_dim,
         kQ8BlockValues);
  }
  const std::size_t page = page_bytes(shape);
  if (cpu_tier_bytes < page) {
    fail(ErrorCode::invalid_argument, "Config.cpu_tier_bytes ({}) is smaller than one page ({} B)", cpu_tier_bytes,
         page);
  }
  if (gpu_tier_bytes < page) {
    fail(ErrorCode::invalid_argument, "Config.gpu_tier_bytes ({}) is smaller than one page ({} B)", gpu_tier_bytes,
         page);
  }
  if (cpu_tier_bytes / page >= 0xffffffffull || gpu_tier_bytes / page >= 0xffffffffull) {
    fail(ErrorCode::invalid_argument, "Config: a tier of {} / {} bytes holds more than 2^32 - 2 pages of {} B",
         cpu_tier_bytes, gpu_tier_bytes, page);
  }
  if (host_chunk_bytes < page) {
    fail(ErrorCode::invalid_argument, "Config.host_chunk_bytes ({}) is smaller than one page ({} B)", host_chunk_bytes,
         page);
  }
}

}  // namespace sparsekv
