#pragma once
// BufferAdmission: a TieredKVBuffer's requests coming and going, and the GPU
// pages they hold (Spin §5.3 elasticity).
//
//  - Each request owns `slots` GPU pages per (layer, kv head): its mandatory
//    pages (the most one step selects) plus buffering pages, at least
//    min_buffer_ratio x mandatory (Spin's 5x). resize() changes it; reclaim()
//    takes buffering pages back from the tail of every request's GPU page
//    table in proportion to its sequence length, never below its minimum.
//  - Admission advice (the engine queues, never the library): can_admit()
//    and the SparseServe §3.3 working set.
//  - Attending in place (AttendSite::cpu_tier) a request has no GPU slots and
//    its tails are CPU pages.
// Every call that throws changes nothing.
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "sparsekv/buffer/buffer_request.hpp"
#include "sparsekv/buffer/buffer_tiers.hpp"
#include "sparsekv/core/error_code.hpp"

namespace sparsekv {

// admit is true exactly when add_request(pages) would succeed now and the
// prompt fits the CPU tier; otherwise `reason` says why (the first check that fails).
struct AdmissionAdvice {
  bool admit = false;
  std::string reason;
  bool request_slot_free = false;
  std::uint64_t gpu_pages_needed = 0;  // slots + one tail page per (layer, kv head)
  std::uint64_t gpu_pages_free = 0;
  std::uint64_t gpu_pages_reclaimable = 0;  // buffering pages above the other requests' minimum
  std::uint64_t cpu_pages_needed = 0;       // the prompt's CPU pages over all (layer, kv head)
  std::uint64_t cpu_pages_free = 0;
};

class BufferAdmission {
 public:
  BufferAdmission(BufferTiers& tiers, BufferRequests& requests) : tiers_(tiers), requests_(requests) {}

  // Registers a request and gives it its GPU pages, reclaiming buffering
  // pages from other requests when the GPU tier is short. `attachment`: what
  // the layer above keeps for the request, held until finish().
  void add_request(RequestId request, const RequestPages& pages,
                   std::unique_ptr<RequestAttachment> attachment = nullptr);
  // Releases every page of the request and forgets it.
  void finish(RequestId request);
  void resize(RequestId request, std::uint32_t slots_per_head);
  // Frees at least `gpu_pages` GPU pages if the requests' buffering allows;
  // returns how many it freed (a multiple of layers x kv_heads).
  std::uint64_t reclaim(std::uint64_t gpu_pages);

  // `prompt_pages_per_head`: the most CPU pages one (layer, kv head) of the
  // prompt takes (a policy whose partitions pad their last page knows it);
  // by default the prompt in one-page partitions.
  AdmissionAdvice can_admit(std::uint32_t prompt_tokens, const RequestPages& pages,
                            std::optional<std::uint32_t> prompt_pages_per_head = std::nullopt) const;
  // The same for a prompt whose CPU pages over every (layer, kv head) are
  // `prompt_pages` in all (a fork's: PrefixForks::fork_pages summed over the layers).
  AdmissionAdvice can_admit_pages(std::uint32_t prompt_tokens, const RequestPages& pages,
                                  std::uint64_t prompt_pages) const;
  // Pages of the partitions selected over the last working_set_window steps, summed over heads.
  std::uint64_t working_set_pages(RequestId request) const;

  bool has_request(RequestId request) const noexcept { return requests_.contains(request); }
  // The request's attachment, null if it was added without one; throws
  // not_found for a request the buffer does not hold.
  RequestAttachment* attachment(RequestId request) { return requests_.at(request).attachment.get(); }
  const RequestAttachment* attachment(RequestId request) const { return requests_.at(request).attachment.get(); }
  // The requests held, by id.
  std::vector<RequestId> request_ids() const;
  std::uint32_t sequence_length(RequestId request, std::uint32_t layer) const;
  std::uint32_t slots_per_head(RequestId request) const;
  std::uint32_t min_slots_per_head(const RequestPages& pages) const;

 private:
  // Why add_request(pages) would be refused now, or nothing: can_admit and add_request share it.
  std::optional<Refusal> refusal(const RequestPages& pages) const;
  std::uint64_t reclaimable_slots(const BufferRequest& s) const;
  void grow_slots(RequestId request, BufferRequest& s, std::uint32_t slots);
  void shrink_slots(RequestId request, BufferRequest& s, std::uint32_t slots);

  BufferTiers& tiers_;
  BufferRequests& requests_;
};

}  // namespace sparsekv
