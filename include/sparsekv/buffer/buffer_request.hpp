#pragma once
// BufferRequest: what a TieredKVBuffer keeps per request beside the page
// tables, and BufferRequests, the books of every request the buffer holds.
// Each field has one part that writes it (named below); the others read.
#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "sparsekv/buffer/eviction_head.hpp"
#include "sparsekv/buffer/working_set_window.hpp"
#include "sparsekv/core/ids.hpp"
#include "sparsekv/partition/partition_map.hpp"

namespace sparsekv {

// What a request reserves in the GPU tier, in pages per (layer, kv head) (a
// policy's budget is in tokens), and whether it evicts tokens.
struct RequestPages {
  // Most pages one step selects in any (layer, kv head): the policy's budget in pages.
  std::uint32_t mandatory_pages = 0;
  // GPU pages per (layer, kv head); 0 = the minimum, mandatory x (1 + min_buffer_ratio).
  std::uint32_t buffer_pages = 0;
  // The policy evicts tokens for good: no GPU tail page, decode tokens go
  // through TokenEvictor::place_token, and evict() applies Config::eviction_strategy.
  bool evicts = false;
};

// Tail pages per (layer, kv head): none for a request that evicts.
constexpr std::uint32_t tail_pages_per_head(const RequestPages& pages) noexcept { return pages.evicts ? 0 : 1; }

// What the layer above keeps per request (the step layer's books: max_tokens,
// the policy's state per layer), held in the request's BufferRequest so that a
// request is booked in one place: added with its pages, forgotten with them.
struct RequestAttachment {
  RequestAttachment() = default;
  RequestAttachment(const RequestAttachment&) = delete;
  RequestAttachment& operator=(const RequestAttachment&) = delete;
  virtual ~RequestAttachment() = default;
};

struct BufferRequest {
  RequestPages pages;
  std::unique_ptr<RequestAttachment> attachment;  // BufferAdmission: given at add_request, null if none
  std::uint32_t slots = 0;                        // GPU slots per (layer, kv head): BufferAdmission
  std::vector<std::uint32_t> tokens;              // per layer: every part that adds or regroups tokens
  std::vector<std::uint32_t> tail_tokens;         // per layer: TailAppender
  std::vector<PageId> tail_pages;  // per (layer, kv head): BufferAdmission takes them, TailAppender fills them
  // Per (layer, kv head): PageRetriever records each step's selection; a
  // regroup or a compaction forgets the partition ids it replaces.
  std::vector<WorkingSetWindow> windows;
  // Per (layer, kv head), empty unless pages.evicts: TokenEvictor, and
  // PromptOffloader for a prompt's positions (eviction_books.hpp).
  std::vector<EvictionHead> eviction;
  // Per layer: its first tokens that lie in page order from partition 0
  // (positions p * page_tokens .. in partition p), in every kv head. The
  // prefix order below is PrefixForks' to read; the parts that lay tokens out
  // keep it through prefix_order.hpp.
  std::vector<std::uint32_t> ordered_tokens;
  // Per (layer, kv head): the decode tail's saved pages that go on from the
  // layer's prompt where its order ended off a page boundary (or the prompt
  // was scattered): positions first_position .. + tokens, a page each in
  // partitions first_partition ... What a fork or read_prefix reads past
  // the prompt; cut where a regroup reaches its partitions.
  struct SavedTail {
    std::uint32_t first_position = 0;
    PartitionId first_partition = 0;
    std::uint32_t tokens = 0;
  };
  std::vector<SavedTail> saved_tail;
  // Per (layer, kv head): where each prompt token went when the prompt was
  // laid out off page order (a clustering policy), while no regroup has
  // reached its partitions [0, end); empty otherwise. What a fork reads.
  struct ScatteredPrompt {
    std::vector<TokenPlacement> placements;  // by position
    PartitionId end = 0;
  };
  std::vector<ScatteredPrompt> scattered;
};

// Ordered by id: reclaim walks the requests deterministically.
class BufferRequests {
 public:
  bool contains(RequestId request) const noexcept { return requests_.contains(request); }
  // The request's books; throws not_found for a request the buffer does not hold.
  BufferRequest& at(RequestId request);
  const BufferRequest& at(RequestId request) const;
  BufferRequest& add(RequestId request, BufferRequest&& state) {
    return requests_.emplace(request, std::move(state)).first->second;
  }
  void erase(RequestId request) { requests_.erase(request); }
  auto begin() const noexcept { return requests_.begin(); }
  auto end() const noexcept { return requests_.end(); }

 private:
  std::map<RequestId, BufferRequest> requests_;
};

}  // namespace sparsekv
