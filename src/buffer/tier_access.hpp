#pragma once
// What more than one part of a TieredKVBuffer does to the tiers: the checks
// of a K/V chunk, a token's rows in the storage dtype, dropping a partition's
// cached copy, reading a run of rows back.
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "sparsekv/buffer/buffer_request.hpp"
#include "sparsekv/buffer/buffer_tiers.hpp"

namespace sparsekv {

// A chunk of the layer's rows: pointers set, tokens > 0, the model's or the storage dtype.
void check_chunk(const BufferTiers& tiers, const KvChunk& kv, std::uint32_t layer);
// The device writes rows as the engine holds them: refused when the storage dtype differs.
void check_device_rows(const BufferTiers& tiers, const char* call);
// Refuses (failed_precondition) a request that evicts: it has no tail.
void check_has_tail(RequestId request, const BufferRequest& s);
// A token's rows (kv_heads of K, then of V) in the storage dtype: `token`'s
// own when it is already, else converted into `scratch`.
std::pair<const std::byte*, const std::byte*> stored_token(const BufferTiers& tiers, const KvChunk& token,
                                                           std::vector<std::byte>& scratch);
// Drops the partition's GPU-tier copy: its slots become free, it is no longer resident.
void uncache(BufferTiers& tiers, RequestId request, std::uint32_t layer, std::uint32_t head, PartitionId partition);
// The rows of partitions [first, end) of one head in page order, [token][K row, V row]
// (only live slots when `live_only`; freed partitions hold none), their cached copies dropped first.
void collect_run(BufferTiers& tiers, RequestId request, std::uint32_t layer, std::uint32_t head, PartitionId first,
                 bool live_only, std::vector<std::byte>& rows);

}  // namespace sparsekv
