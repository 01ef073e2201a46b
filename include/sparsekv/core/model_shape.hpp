#pragma once
#include <cstddef>
#include <cstdint>

#include "sparsekv/core/dtype.hpp"

namespace sparsekv {

// The attention geometry of a decoder-only model, as the KV cache sees it.
struct ModelShape {
  std::uint32_t layers = 0;
  std::uint32_t q_heads = 0;
  std::uint32_t kv_heads = 0;
  std::uint32_t head_dim = 0;
  DType dtype = DType::bf16;

  // Query heads sharing one KV head (grouped-query attention).
  std::uint32_t group_size() const noexcept { return kv_heads == 0 ? 0 : q_heads / kv_heads; }
  // K and V bytes of one token for one (layer, kv head).
  std::size_t head_token_bytes() const noexcept { return 2 * std::size_t{head_dim} * dtype_size(dtype); }
  // K and V bytes of one token over all layers and kv heads.
  std::size_t token_bytes() const noexcept { return head_token_bytes() * layers * kv_heads; }

  // Throws ErrorCode::invalid_argument naming the first bad field.
  void validate() const;
};

}  // namespace sparsekv
