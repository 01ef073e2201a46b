#include "sparsekv/facade/serving_config.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>

namespace sparsekv {

Config serving_config(const ModelShape& shape, const AnyPolicy& policy, std::uint32_t max_tokens,
                      std::uint32_t requests, Config config) {
  config.max_requests = requests;
  config.validate(shape);
  const std::size_t page = config.page_bytes(shape);
  const std::size_t heads = std::size_t{shape.layers} * shape.kv_heads * requests;
  const auto context = [&](std::uint32_t layer) {
    return LayerContext{layer,          shape.layers,       shape.q_heads, shape.kv_heads,
                        shape.head_dim, config.page_tokens, max_tokens};
  };
  // Per (layer, kv head), over all layers: the pages one select may return
  // (`need`) and the most CPU pages a head of max_tokens tokens can hold (`held`).
  const std::uint32_t context_pages = (max_tokens + config.page_tokens - 1) / config.page_tokens;
  std::uint32_t need = 1, held = context_pages;
  for (std::uint32_t l = 0; l < shape.layers; ++l) {
    need = std::max(need, policy.mandatory_pages(context(l)));
    if (const auto capacity = policy.head_capacity(context(l))) held = std::max(held, capacity->cpu_pages);
  }
  config.max_context_tokens = std::max(max_tokens, need * config.page_tokens) + config.page_tokens;
  constexpr std::uint32_t kCpuMarginPages = 64;
  config.cpu_tier_bytes = heads * (std::size_t{held} + kCpuMarginPages) * page;
  const auto slots = [&] {
    return std::uint64_t{need} + static_cast<std::uint64_t>(std::ceil(config.min_buffer_ratio * need));
  };
  if (slots() > held) config.min_buffer_ratio = held > need ? double(held - need) / need : 0.0;
  config.gpu_tier_bytes = heads * (slots() + 1) * page;
  config.host_chunk_bytes = std::min<std::size_t>(config.cpu_tier_bytes, std::size_t{64} << 20);
  config.validate(shape);
  return config;
}

}  // namespace sparsekv
