#include "sparsekv/buffer/prompt_offloader.hpp"

#include <cstring>

#include "sparsekv/core/convert.hpp"
#include "sparsekv/core/error.hpp"
#include "eviction_books.hpp"
#include "prefix_order.hpp"
#include "tier_access.hpp"

namespace sparsekv {

void PromptOffloader::offload(RequestId request, std::uint32_t layer, const KvChunk& kv,
                              std::span<const PartitionSpec> specs) {
  requests_.at(request);
  check_chunk(tiers_, kv, layer);
  check_offload(request, layer, kv.tokens, specs);
  const std::size_t row = tiers_.layout.row_bytes(), source_row = dtype_row_bytes(kv.dtype, tiers_.shape.head_dim);
  const auto* k = static_cast<const std::byte*>(kv.k);
  const auto* v = static_cast<const std::byte*>(kv.v);
  tiers_.transfer.synchronize();  // a page freed by finish() may still be a save's target
  BufferRequest& s = requests_.at(request);
  // In page order while page-sized partitions continue it (a fork's partial last page too); else a
  // first offload's layout is kept as scattered.
  const bool in_order = !s.pages.evicts && record_prompt_order(tiers_, s, layer, specs, kv.tokens);
  const bool scatters = s.tokens[layer] == 0 && !s.pages.evicts && !in_order;
  for (std::uint32_t h = 0; h < tiers_.shape.kv_heads; ++h) {
    const PartitionSpec& spec = specs[specs.size() == 1 ? 0 : h];
    const MappedPartitions mapped = tiers_.partitions.map(request, layer, h, spec);
    if (s.pages.evicts) record_offload(tiers_, s, layer, h, mapped.first_partition, spec, s.tokens[layer]);
    if (scatters) {
      s.scattered[std::size_t{layer} * tiers_.shape.kv_heads + h] = {mapped.placements,
                                                                     mapped.first_partition + spec.partition_count()};
    }
    for (std::uint32_t t = 0; t < kv.tokens; ++t) {
      const TokenPlacement where = mapped.placements[t];
      std::byte* page = tiers_.cpu_pool.data(where.cpu_page);
      const std::size_t source = (std::size_t{t} * tiers_.shape.kv_heads + h) * source_row;
      if (kv.dtype == tiers_.layout.dtype) {
        std::memcpy(page + tiers_.layout.k_offset(where.slot), k + source, row);
        std::memcpy(page + tiers_.layout.v_offset(where.slot), v + source, row);
      } else {
        convert_rows(k + source, kv.dtype, page + tiers_.layout.k_offset(where.slot), tiers_.layout.dtype, 1,
                     tiers_.shape.head_dim);
        convert_rows(v + source, kv.dtype, page + tiers_.layout.v_offset(where.slot), tiers_.layout.dtype, 1,
                     tiers_.shape.head_dim);
      }
    }
  }
  s.tokens[layer] += kv.tokens;
  tiers_.stats.bytes_offloaded += 2 * std::uint64_t{kv.tokens} * tiers_.shape.kv_heads * row;
}

void PromptOffloader::offload_on_device(RequestId request, std::uint32_t layer, std::uint32_t tokens,
                                        std::span<const PartitionSpec> specs, std::vector<TokenPlacement>& placements) {
  requests_.at(request);
  check_index("layer", layer, tiers_.shape.layers);
  check_device_rows(tiers_, "offload_on_device");
  if (tokens == 0) fail(ErrorCode::invalid_argument, "a K/V chunk needs at least one token");
  check_offload(request, layer, tokens, specs);
  placements.resize(std::size_t{tokens} * tiers_.shape.kv_heads);
  tiers_.transfer.synchronize();  // a page freed by finish() may still be a save's target
  BufferRequest& s = requests_.at(request);
  record_prompt_order(tiers_, s, layer, specs, tokens);
  for (std::uint32_t h = 0; h < tiers_.shape.kv_heads; ++h) {
    const PartitionSpec& spec = specs[specs.size() == 1 ? 0 : h];
    const MappedPartitions mapped = tiers_.partitions.map(request, layer, h, spec);
    if (s.pages.evicts) record_offload(tiers_, s, layer, h, mapped.first_partition, spec, s.tokens[layer]);
    for (std::uint32_t t = 0; t < tokens; ++t)
      placements[std::size_t{t} * tiers_.shape.kv_heads + h] = mapped.placements[t];
  }
  s.tokens[layer] += tokens;
  tiers_.stats.bytes_offloaded += 2 * std::uint64_t{tokens} * tiers_.shape.kv_heads * tiers_.layout.row_bytes();
}

void PromptOffloader::check_specs(RequestId request, std::uint32_t layer, std::uint32_t tokens,
                                  std::span<const PartitionSpec> specs) const {
  const BufferRequest& s = requests_.at(request);
  if (specs.size() != 1 && specs.size() != tiers_.shape.kv_heads) {
    fail(ErrorCode::invalid_argument, "{} partition specs given; expected 1 (shared) or {} (one per kv head)",
         specs.size(), tiers_.shape.kv_heads);
  }
  // Arguments first, then state, then resources.
  for (std::uint32_t h = 0; h < tiers_.shape.kv_heads; ++h) {
    const PartitionSpec& spec = specs[specs.size() == 1 ? 0 : h];
    if (spec.token_count() != tokens) {
      fail(ErrorCode::invalid_argument, "the spec of kv head {} covers {} tokens, the chunk has {}", h,
           spec.token_count(), tokens);
    }
    for (std::uint32_t p = 0; s.pages.evicts && p < spec.partition_count(); ++p) {
      if (spec.size(p) > tiers_.config.page_tokens) {
        fail(ErrorCode::invalid_argument,
             "request {} evicts tokens: partition {} of kv head {} holds {} tokens, more "
             "than one page ({})",
             request, p, h, spec.size(p), tiers_.config.page_tokens);
      }
    }
  }
  if (s.tail_tokens[layer] != 0) {
    fail(ErrorCode::failed_precondition, "request {} layer {}: offload after decode appends began", request, layer);
  }
}

void PromptOffloader::check_offload(RequestId request, std::uint32_t layer, std::uint32_t tokens,
                                    std::span<const PartitionSpec> specs) const {
  check_specs(request, layer, tokens, specs);
  std::uint64_t pages = 0;
  SegmentDemand demand;
  for (std::uint32_t h = 0; h < tiers_.shape.kv_heads; ++h) {
    const PartitionSpec& spec = specs[specs.size() == 1 ? 0 : h];
    std::uint64_t head_pages = 0;
    for (std::uint32_t p = 0; p < spec.partition_count(); ++p) {
      if (pages_for_tokens(spec.size(p), tiers_.config.page_tokens) > kMaxPagesPerPartition) {
        fail(ErrorCode::invalid_argument, "partition {} of kv head {} spans more than {} pages", p, h,
             kMaxPagesPerPartition);
      }
      head_pages += pages_for_tokens(spec.size(p), tiers_.config.page_tokens);
    }
    demand += tiers_.table.append_demand(request, layer, h, spec.partition_count(), head_pages);
    pages += head_pages;
  }
  if (pages > tiers_.cpu_pool.available()) {
    fail(ErrorCode::resource_exhausted, "request {} layer {}: offload needs {} CPU pages, {} free", request, layer,
         pages, tiers_.cpu_pool.available());
  }
  tiers_.table.check_segments(demand);
}

}  // namespace sparsekv
