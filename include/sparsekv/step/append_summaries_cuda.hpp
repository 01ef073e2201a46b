#pragma once
// Appends on the device with the Index summaries of each full tail page: the
// launch of buffer/device_append_cuda.hpp (write, convert q, test for
// non-finite values, save full pages) that also computes, for every (b, h)
// whose tail fills and whose row is clean, the page's Quest min / max or
// ShadowKV landmark and outlier score or RetroInfer mean key and value sum,
// and optionally its token count (or only the token count) -- the rules and
// order of QuestPolicy / ShadowKVPolicy / RetroInferPolicy::append
// (page_summaries.hpp), so the results equal theirs bit for bit.
//
// Why here and not in the buffer layer: the summary rules belong to the
// policies, and the buffer sits below the policy layer. The kernel lives in
// the buffer layer, templated on the summary (cuda/buffer/append_kernel.cuh);
// this layer instantiates it with its rules, so the step stays one launch.
// Same conventions as the buffer header: plain structs, caller-owned memory,
// host-side checks before anything is enqueued.
#include <cstddef>
#include <cstdint>

#include "sparsekv/buffer/device_append_cuda.hpp"
#include "sparsekv/core/host_device.hpp"
#include "sparsekv/memory/page_layout.hpp"

namespace sparsekv::cuda {

// tokens: no key summary, only the full page's token count (the positional
// policies, StreamingWindow and Dense, select from token counts alone).
enum class AppendSummary : std::uint8_t { none, quest, shadowkv, tokens, retroinfer };

struct AppendSummaries {
  AppendSummary kind = AppendSummary::none;
  // [batch][kv_heads]: the summary row (b, h)'s full page takes; read only
  // for entries whose tail fills.
  const std::uint32_t* rows = nullptr;
  float* min = nullptr;            // quest: [row][head_dim]
  float* max = nullptr;            // quest: [row][head_dim]
  float* mean = nullptr;           // shadowkv: [row][head_dim], the landmark
  float* outlier_score = nullptr;  // shadowkv: [row]
  // quest, shadowkv and retroinfer, optional: [row], set to page_tokens (the
  // full page's token count, what the policies' append records), so that
  // Select reads a decode partition's size from the same store as its
  // summaries (device_summaries.hpp); nullptr: not written. tokens: required.
  std::uint32_t* tokens = nullptr;
  // Last, so that the kinds above keep their positional initialisers.
  float* centroid = nullptr;   // retroinfer: [row][head_dim], the page's mean key
  float* value_sum = nullptr;  // retroinfer: [row][head_dim], the page's summed values
};

// Key / value row t of a page: what the per-thread summary steps of page_summaries.hpp read.
struct PageKeyRows {
  const std::byte* page;
  PageLayout layout;
  SPARSEKV_HOST_DEVICE const std::byte* operator()(std::uint32_t t) const { return page + layout.k_offset(t); }
};
struct PageValueRows {
  const std::byte* page;
  PageLayout layout;
  SPARSEKV_HOST_DEVICE const std::byte* operator()(std::uint32_t t) const { return page + layout.v_offset(t); }
};

// append_tokens(args, stream) plus the summaries of `summaries.kind`. Throws
// what that throws, and invalid_argument for an unknown kind, null rows or
// outputs of the kind (tokens for AppendSummary::tokens) while batch > 0, and (shadowkv) head_dim >
// kMaxIndexDim or page_tokens > kMaxIndexPageTokens (policy/index_cuda.hpp).
void append_tokens(const DeviceAppend& args, const AppendSummaries& summaries, void* stream);

}  // namespace sparsekv::cuda
