#pragma once
// PromptOffloader: Offload (Spin §4.1). A request's prefill K/V of one layer,
// in the engine's layout (buffer_tiers.hpp), becomes head-wise CPU pages
// grouped by the policy's PartitionSpec; tokens of a variable-size partition
// are packed into contiguous pages. A layer takes prompt chunks in order until
// its first decode append. Every call that throws changes nothing.
#include <cstdint>
#include <span>
#include <vector>

#include "sparsekv/buffer/buffer_request.hpp"
#include "sparsekv/buffer/buffer_tiers.hpp"
#include "sparsekv/partition/partition_spec.hpp"

namespace sparsekv {

class PromptOffloader {
 public:
  PromptOffloader(BufferTiers& tiers, BufferRequests& requests) : tiers_(tiers), requests_(requests) {}

  // `specs`: one shared by every kv head, or one per kv head.
  void offload(RequestId request, std::uint32_t layer, const KvChunk& kv, std::span<const PartitionSpec> specs);
  // The device prefill's Offload (docs/device-decode.md): the checks and
  // mapping of offload() with no byte moved; placements[t * kv_heads + h]
  // ([tokens][kv_heads], the engine layout's row order) is where token t of
  // kv head h goes, for the caller to write (DeviceRuntime::offload_prompt,
  // through the FlashD2H save path) before anything reads those pages. Throws
  // what offload() throws, changing nothing.
  void offload_on_device(RequestId request, std::uint32_t layer, std::uint32_t tokens,
                         std::span<const PartitionSpec> specs, std::vector<TokenPlacement>& placements);
  // offload()'s checks of the request's state and the specs, without the
  // pools: what a fork that shares some pages checks before its own sizing.
  void check_specs(RequestId request, std::uint32_t layer, std::uint32_t tokens,
                   std::span<const PartitionSpec> specs) const;

 private:
  void check_offload(RequestId request, std::uint32_t layer, std::uint32_t tokens,
                     std::span<const PartitionSpec> specs) const;

  BufferTiers& tiers_;
  BufferRequests& requests_;
};

}  // namespace sparsekv
