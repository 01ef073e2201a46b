#pragma once
// PartitionSpec: how Index groups a chunk of tokens into partitions (Spin
// §4.1, §5.2). A partition is the unit of selection and retrieval; it spans
// one or more whole pages and never shares a page with another partition.
//  - uniform: consecutive runs of `partition_tokens` tokens (the last may be
//    short); with partition_tokens == page_tokens every partition is one page.
//  - variable: explicit token lists (e.g. RetroInfer clusters), stored as CSR.
// Token indices are relative to the chunk being offloaded. A spec must cover
// every token of the chunk exactly once: the CPU tier is the source of truth,
// so no token may be left out of it.
#include <cstdint>
#include <span>
#include <vector>

namespace sparsekv {

class PartitionSpec {
 public:
  static PartitionSpec uniform(std::uint32_t tokens, std::uint32_t partition_tokens);
  // `offsets` has partitions + 1 entries; partition p holds tokens[offsets[p] .. offsets[p+1]).
  static PartitionSpec variable(std::uint32_t tokens, std::vector<std::uint32_t> offsets,
                                std::vector<std::uint32_t> token_ids);
  static PartitionSpec variable(std::uint32_t tokens, const std::vector<std::vector<std::uint32_t>>& partitions);

  bool is_uniform() const noexcept { return partition_tokens_ != 0; }
  // Tokens per partition of a uniform spec (the last may hold fewer); 0 for a variable one.
  std::uint32_t partition_tokens() const noexcept { return partition_tokens_; }
  std::uint32_t token_count() const noexcept { return tokens_; }
  std::uint32_t partition_count() const noexcept { return partitions_; }
  // Tokens in partition p.
  std::uint32_t size(std::uint32_t partition) const;
  // The i-th token of partition p, in the order it is laid out in the pages.
  std::uint32_t token(std::uint32_t partition, std::uint32_t i) const;

 private:
  PartitionSpec() = default;

  std::uint32_t tokens_ = 0;
  std::uint32_t partitions_ = 0;
  std::uint32_t partition_tokens_ = 0;  // uniform only
  std::vector<std::uint32_t> offsets_;  // variable only
  std::vector<std::uint32_t> token_ids_;
};

}  // namespace sparsekv
