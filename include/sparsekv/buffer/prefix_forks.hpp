#pragma once
// PrefixForks: a request started from the first tokens of another (an
// engine's prefix cache, llama.cpp's seq_cp). The fork's policy reads the rows
// it indexes back from the source's CPU pages; the full pages that its
// partitions would write identically are shared by reference count instead
// (PagedAttention+FlexAttention, Alg. 1), never written again. Which of a
// layer's first tokens can be read back is the request's prefix order
// (BufferRequest), which the parts that lay tokens out keep. Every call that
// throws changes nothing.
#include <cstdint>
#include <span>

#include "sparsekv/buffer/buffer_request.hpp"
#include "sparsekv/buffer/buffer_tiers.hpp"
#include "sparsekv/buffer/prompt_offloader.hpp"
#include "sparsekv/buffer/token_evictor.hpp"
#include "sparsekv/partition/partition_spec.hpp"

namespace sparsekv {

class PrefixForks {
 public:
  PrefixForks(BufferTiers& tiers, BufferRequests& requests, PromptOffloader& offloader, TokenEvictor& evictor)
      : tiers_(tiers), requests_(requests), offloader_(offloader), evictor_(evictor) {}

  // How many of the layer's first tokens `request` holds saved in its CPU
  // pages: positions 0 .. n-1 in every kv head. Without eviction, the
  // prompt's tokens in page order from partition 0 or in its scattered
  // placements, then the decode pages saved after them (none once a policy
  // regroups them); with eviction, the leading positions all still live.
  std::uint32_t saved_tokens(RequestId request, std::uint32_t layer) const;
  // How many of the layer's first tokens read_prefix can read, and so a fork
  // can take: the saved ones, and in place (AttendSite::cpu_tier, where the
  // unsaved decode page is a CPU-tier page too) that page's tokens when they
  // go on from them.
  std::uint32_t readable_tokens(RequestId request, std::uint32_t layer) const;
  // Copies the K/V rows of positions [first, end) of the layer into k and v
  // ([end - first][kv_heads][head_dim]) in dtype `as`: the model's (what a
  // fork's policy indexes; q8_0 storage comes back dequantized) or the
  // storage dtype (the stored bytes). Refuses (out_of_range) `end` beyond
  // readable_tokens(), (invalid_argument) any other dtype.
  void read_prefix(RequestId request, std::uint32_t layer, std::uint32_t first, std::uint32_t end, void* k, void* v,
                   DType as) const;
  // PromptOffloader::offload() of `source`'s first `tokens` tokens into
  // `request`'s empty layer, laid out by `specs`: where the specs' partitions
  // are the same full pages (a uniform spec of page-sized partitions) the
  // pages are `source`'s, shared by reference count, and only the partial
  // last page is written; any other spec, or a request that evicts, has every
  // row copied (the partitions differ, or masks must stay the request's own).
  // The rows come from `source`'s CPU pages. Same checks as offload(),
  // changing nothing on failure.
  void offload_shared(RequestId request, RequestId source, std::uint32_t layer, std::uint32_t tokens,
                      std::span<const PartitionSpec> specs);
  // The CPU pages offload_shared(·, source, layer, tokens, specs) takes, over
  // every kv head: what it writes, its shared pages counted once (the
  // source's). Throws what offload_shared throws for bad arguments.
  std::uint64_t fork_pages(RequestId source, std::uint32_t layer, std::uint32_t tokens,
                           std::span<const PartitionSpec> specs) const;

 private:
  // The leading pages of `source`'s layer a fork of `tokens` tokens laid out
  // by `specs` shares (the same in every kv head).
  std::uint32_t shared_pages(RequestId source, std::uint32_t layer, std::uint32_t tokens,
                             std::span<const PartitionSpec> specs) const;

  BufferTiers& tiers_;
  BufferRequests& requests_;
  PromptOffloader& offloader_;
  TokenEvictor& evictor_;
};

}  // namespace sparsekv
