#pragma once
// TieredKVBuffer: the library-owned operations Offload and Retrieve (Spin
// §4.1) over a CPU tier that is the source of truth and a GPU tier that caches
// what recent steps selected (Spin §5.3). It owns the tiers (BufferTiers) and
// the requests' books (BufferRequests), and hands out the parts that work on
// them, one per seam:
//
//   admission()  requests coming and going, their GPU pages, reclaim, advice
//   offloader()  a prompt's K/V into CPU pages (Offload)
//   tails()      decode tokens into tail pages, saved when full
//   retriever()  the selected partitions' pages for Attend (Retrieve)
//   regrouper()  a policy regrouping tokens already held
//   evictor()    token eviction (SpvLLM), for requests that evict
//   forks()      a request started from another's first tokens
//
// Bytes move through a PageTransfer (transfer/page_transfer.hpp): the host
// backend keeps the GPU tier in host memory standing in for HBM and copies
// with memcpy; the CUDA backend keeps GPU-tier pages in device memory and
// moves them with the gather kernel and asynchronous copies, leaving them in
// flight on its stream. The metadata (all four tables) stays host-accessible
// in both: the bucketed-LRU step runs on the host, the GPU-side tables living
// in mapped pinned memory that kernels read through UVA.
//
// Attending in place (AttendSite::cpu_tier, a CPU engine's backend): on a CPU
// both tiers are host memory, so nothing is cached: a request has no GPU
// slots, its tails are CPU pages, and retrieve() returns the selected
// partitions' CPU pages themselves, with no copy and no LRU step.
// Not thread-safe; every call that throws changes nothing.
#include <optional>

#include "sparsekv/buffer/buffer_admission.hpp"
#include "sparsekv/buffer/buffer_request.hpp"
#include "sparsekv/buffer/buffer_tiers.hpp"
#include "sparsekv/buffer/page_retriever.hpp"
#include "sparsekv/buffer/prefix_forks.hpp"
#include "sparsekv/buffer/prompt_offloader.hpp"
#include "sparsekv/buffer/regrouper.hpp"
#include "sparsekv/buffer/tail_appender.hpp"
#include "sparsekv/buffer/token_evictor.hpp"

namespace sparsekv {

class TieredKVBuffer {
 public:
  // `cpu_tier` backs the CPU pages and CPU-side tables, `gpu_tier` the GPU
  // pages and GPU-side tables; the host backend needs both host-accessible.
  TieredKVBuffer(const ModelShape& shape, const Config& config, MemoryResource& cpu_tier, MemoryResource& gpu_tier);
  // A backend of its own: GPU-tier pages from `gpu_pages` (device memory when
  // `transfer` reaches it), the meta-partition and GPU page tables in
  // host-accessible `gpu_tables`, bytes moved by `transfer`. All three must
  // outlive the buffer. `capacity`: the most partitions and CPU pages a head
  // can hold (the policy's; by default Config::head_capacity()); the page
  // table is sized for it. `site`: AttendSite::cpu_tier attends the CPU tier
  // in place (host memory only; gpu_pages then holds nothing).
  TieredKVBuffer(const ModelShape& shape, const Config& config, MemoryResource& cpu_tier, MemoryResource& gpu_pages,
                 MemoryResource& gpu_tables, PageTransfer& transfer,
                 const std::optional<HeadCapacity>& capacity = std::nullopt, AttendSite site = AttendSite::gpu_tier);
  // The parts hold references into the buffer.
  TieredKVBuffer(const TieredKVBuffer&) = delete;
  TieredKVBuffer& operator=(const TieredKVBuffer&) = delete;

  BufferAdmission& admission() noexcept { return admission_; }
  const BufferAdmission& admission() const noexcept { return admission_; }
  PromptOffloader& offloader() noexcept { return offloader_; }
  TailAppender& tails() noexcept { return tails_; }
  const TailAppender& tails() const noexcept { return tails_; }
  PageRetriever& retriever() noexcept { return retriever_; }
  Regrouper& regrouper() noexcept { return regrouper_; }
  TokenEvictor& evictor() noexcept { return evictor_; }
  const TokenEvictor& evictor() const noexcept { return evictor_; }
  PrefixForks& forks() noexcept { return forks_; }
  const PrefixForks& forks() const noexcept { return forks_; }
  // The tiers, tables and counters, to read.
  const BufferTiers& tiers() const noexcept { return tiers_; }

  // Checks the page table and every part's books against it; throws
  // failed_precondition naming the first violation.
  void validate() const;

 private:
  HostPageTransfer host_transfer_;  // used when no transfer is given
  BufferTiers tiers_;
  BufferRequests requests_;
  BufferAdmission admission_{tiers_, requests_};
  PromptOffloader offloader_{tiers_, requests_};
  Regrouper regrouper_{tiers_, requests_};
  TailAppender tails_{tiers_, requests_, regrouper_};
  PageRetriever retriever_{tiers_, requests_};
  TokenEvictor evictor_{tiers_, requests_};
  PrefixForks forks_{tiers_, requests_, offloader_, evictor_};
};

}  // namespace sparsekv
