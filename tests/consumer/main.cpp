// Maps one request's prefill into the CPU tier and reads a token back.
#include <cstdio>
#include <cstring>
#include <vector>

#include "sparsekv/core/config.hpp"
#include "sparsekv/partition/partition_map.hpp"

int main() {
  const sparsekv::ModelShape shape{2, 4, 2, 64, sparsekv::DType::f32};
  sparsekv::Config config;
  config.max_requests = 2;
  config.max_context_tokens = 1024;
  config.cpu_tier_bytes = 1 << 22;
  config.gpu_tier_bytes = 1 << 20;
  config.validate(shape);
  sparsekv::HostMemoryResource host;
  sparsekv::HierarchicalPageTable table(sparsekv::PageTableGeometry::for_config(config, shape), host, host);
  const sparsekv::PageLayout layout{config.page_tokens, shape.head_dim, shape.dtype};
  sparsekv::PagePool cpu_tier(layout, static_cast<std::uint32_t>(config.cpu_tier_bytes / layout.page_bytes()), host);
  sparsekv::PartitionMap map(table, cpu_tier);
  table.add_request(42);
  const auto mapped = map.map(42, 1, 0, sparsekv::PartitionSpec::uniform(100, config.page_tokens));
  const float key = 3.5f;
  const sparsekv::TokenPlacement where = mapped.placements[77];
  std::memcpy(cpu_tier.data(where.cpu_page) + layout.k_offset(where.slot), &key, sizeof key);
  float back = 0;
  std::memcpy(&back, cpu_tier.data(map.pages(42, 1, 0, 77 / config.page_tokens)[0]) + layout.k_offset(77 % 8),
              sizeof back);
  try {
    table.add_request(42);
    return 1;
  } catch (const sparsekv::Error& e) {
    std::printf("consumer: expected error: %s\n", e.what());
  }
  map.unmap(42);
  table.remove_request(42);
  std::printf("consumer: token 77 key %.1f, pages in use %u\n", back, cpu_tier.used());
  return back == key && cpu_tier.used() == 0 ? 0 : 1;
}
