#include "tier_access.hpp"

#include "sparsekv/core/convert.hpp"
#include "sparsekv/core/error.hpp"

namespace sparsekv {

void check_chunk(const BufferTiers& tiers, const KvChunk& kv, std::uint32_t layer) {
  check_index("layer", layer, tiers.shape.layers);
  if (kv.k == nullptr || kv.v == nullptr) fail(ErrorCode::invalid_argument, "K/V pointers must not be null");
  if (kv.tokens == 0) fail(ErrorCode::invalid_argument, "a K/V chunk needs at least one token");
  if (kv.dtype != tiers.shape.dtype && kv.dtype != tiers.layout.dtype) {
    fail(ErrorCode::invalid_argument, "K/V dtype {} does not match the model's {}", to_string(kv.dtype),
         to_string(tiers.shape.dtype));
  }
}

void check_device_rows(const BufferTiers& tiers, const char* call) {
  if (tiers.layout.dtype != tiers.shape.dtype) {
    fail(ErrorCode::failed_precondition, "{}: the device writes rows in the model's {}; this buffer stores {}", call,
         to_string(tiers.shape.dtype), to_string(tiers.layout.dtype));
  }
}

void check_has_tail(RequestId request, const BufferRequest& s) {
  if (s.pages.evicts) {
    fail(ErrorCode::failed_precondition,
         "request {} evicts tokens and has no GPU tail; decode tokens go through "
         "place_token",
         request);
  }
}

std::pair<const std::byte*, const std::byte*> stored_token(const BufferTiers& tiers, const KvChunk& token,
                                                           std::vector<std::byte>& scratch) {
  const auto* k = static_cast<const std::byte*>(token.k);
  const auto* v = static_cast<const std::byte*>(token.v);
  if (token.dtype == tiers.layout.dtype) return {k, v};
  const std::size_t bytes = tiers.shape.kv_heads * tiers.layout.row_bytes();
  scratch.resize(2 * bytes);
  convert_rows(k, token.dtype, scratch.data(), tiers.layout.dtype, tiers.shape.kv_heads, tiers.shape.head_dim);
  convert_rows(v, token.dtype, scratch.data() + bytes, tiers.layout.dtype, tiers.shape.kv_heads, tiers.shape.head_dim);
  return {scratch.data(), scratch.data() + bytes};
}

void uncache(BufferTiers& tiers, RequestId request, std::uint32_t layer, std::uint32_t head, PartitionId partition) {
  for (std::uint32_t slot = 0; slot < tiers.table.gpu_slots(request, layer, head); ++slot) {
    GpuPageEntry e = tiers.table.gpu_entry(request, layer, head, slot);
    if (e.partition == partition) {
      e.partition = kInvalidPartition;
      tiers.table.set_gpu_entry(request, layer, head, slot, e);
    }
  }
  tiers.table.set_resident(request, layer, head, partition, false);
}

void collect_run(BufferTiers& tiers, RequestId request, std::uint32_t layer, std::uint32_t head, PartitionId first,
                 bool live_only, std::vector<std::byte>& rows) {
  const std::size_t row = tiers.layout.row_bytes();
  const std::uint32_t pt = tiers.config.page_tokens;
  std::vector<PageId> pages;
  for (PartitionId p = first; p < tiers.table.partition_count(request, layer, head); ++p) {
    if (tiers.table.partition_freed(request, layer, head, p)) continue;
    if (tiers.table.meta(request, layer, head, p).resident()) uncache(tiers, request, layer, head, p);
    pages.clear();
    tiers.table.cpu_pages(request, layer, head, p, pages);
    const std::uint32_t first_page = tiers.table.first_page_index(request, layer, head, p);
    for (std::uint32_t i = 0; i < tiers.table.meta(request, layer, head, p).token_count(); ++i) {
      if (live_only && !slot_live(tiers.table.slot_mask(request, layer, head, first_page + i / pt), i % pt)) continue;
      const std::byte* page = tiers.cpu_pool.data(pages[i / pt]);
      rows.insert(rows.end(), page + tiers.layout.k_offset(i % pt), page + tiers.layout.k_offset(i % pt) + row);
      rows.insert(rows.end(), page + tiers.layout.v_offset(i % pt), page + tiers.layout.v_offset(i % pt) + row);
    }
  }
}

}  // namespace sparsekv
