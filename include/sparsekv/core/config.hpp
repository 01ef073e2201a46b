#pragma once
// Library-wide settings. Defaults follow the papers (docs/configuration.md):
//  - page_tokens = 8: Spin Table 3 (ShadowKV and RetroInfer page size).
//  - timestamp_buckets = 64: Spin §5.3 bucketed LRU timestamp range.
//  - min_buffer_ratio = 5: Spin §5.3, minimum buffering pages per mandatory page.
//  - working_set_window = 12: SparseServe §3.3, steps in the working-set estimate.
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

#include "sparsekv/core/model_shape.hpp"

namespace sparsekv {

// The most partitions and CPU pages one (request, layer, kv head) holds: what
// the page table's per-head directories are sized for. A policy whose
// partitions can outnumber or outweigh the default (Config::head_capacity)
// declares its own (policy/sparse_attention.hpp).
struct HeadCapacity {
  std::uint32_t partitions = 0;
  std::uint32_t cpu_pages = 0;
  // Requests may evict tokens for good: the page table keeps a slot mask per CPU page.
  bool slot_masks = false;
};

// What the buffer does with the slots of tokens a policy evicts for good
// (SpvLLM §1, §2). Only requests that evict are affected.
//  - no_op: slots are masked; pages are never released.
//  - free_block: a page is released once none of its slots is live.
//  - sparse_copy: the live rows from the first page with a dead slot onwards
//    are copied into fresh full pages at once.
//  - slot_reuse: as free_block, and a new token fills a dead slot first (SpvLLM).
enum class EvictionStrategy : std::uint8_t { no_op, free_block, sparse_copy, slot_reuse };

std::string_view to_string(EvictionStrategy strategy) noexcept;
// Accepts the names to_string gives, with '-' for '_' too; throws invalid_argument otherwise.
EvictionStrategy parse_eviction_strategy(std::string_view name);

struct Config {
  // Tokens per head-wise page. A power of two so that token -> page is a shift.
  std::uint32_t page_tokens = 8;
  // Capacity of the CPU tier (the source of truth) and of the GPU working set.
  std::size_t cpu_tier_bytes = std::size_t{16} << 30;
  std::size_t gpu_tier_bytes = std::size_t{4} << 30;
  // Upper bounds the static metadata directories are sized for.
  std::uint32_t max_requests = 64;
  std::uint32_t max_context_tokens = 128 * 1024;
  // Bucketed LRU (Spin §5.3): timestamps live in [0, timestamp_buckets).
  std::uint32_t timestamp_buckets = 64;
  // Buffering pages a request keeps at least, as a multiple of its mandatory pages.
  double min_buffer_ratio = 5.0;
  // Decode steps whose selections form the working-set estimate.
  std::uint32_t working_set_window = 12;
  // Entries per second-level metadata segment (Spin §5.4). A power of two.
  std::uint32_t metadata_segment_entries = 256;
  // Host memory of the CPU tier is reserved (and pinned) in chunks of this size.
  std::size_t host_chunk_bytes = std::size_t{64} << 20;
  // Slot handling for requests whose policy evicts tokens.
  EvictionStrategy eviction_strategy = EvictionStrategy::slot_reuse;
  // The scale of q.k in the softmax; 0 means 1/sqrt(head_dim). A model that
  // scales q itself passes what its attention applies (Gemma 3: 1.0). The
  // host step folds it into its fp32 copy of q, so every policy's Select and
  // Attend see the model's logits; device tensors take the default only.
  float attention_scale = 0.0f;

  // Throws ErrorCode::invalid_argument naming the first bad field; checks the
  // shape too, and that each tier holds at least one page of that shape.
  void validate(const ModelShape& shape) const;

  // How the CPU tier and the working set store K/V: empty for the model's
  // dtype as handed over, or DType::q8_0 (host backends only: quantized as a
  // row is written, each page read block by block without widening it).
  std::optional<DType> kv_storage;
  DType storage_dtype(const ModelShape& shape) const noexcept { return kv_storage.value_or(shape.dtype); }
  std::size_t page_bytes(const ModelShape& shape) const noexcept {
    return std::size_t{page_tokens} * 2 * dtype_row_bytes(storage_dtype(shape), shape.head_dim);
  }
  // attention_scale, or 1/sqrt(head_dim) for 0.
  float softmax_scale(const ModelShape& shape) const noexcept;
  std::uint32_t max_pages_per_head() const noexcept {
    return static_cast<std::uint32_t>((std::uint64_t{max_context_tokens} + page_tokens - 1) / page_tokens);
  }
  // Without a policy's own bound: a partition starts on a page boundary, so a
  // head has at most one partition per page; variable-size partitions pad
  // their last page, which at most doubles the pages while partitions average
  // at least a page of tokens.
  HeadCapacity head_capacity() const noexcept { return {max_pages_per_head(), 2 * max_pages_per_head()}; }
};

}  // namespace sparsekv
