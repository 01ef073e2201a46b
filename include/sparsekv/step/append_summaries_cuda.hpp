#pragma once
// Appends on the device with the Index summaries of each full tail page: the
// launch of buffer/append_cuda.hpp (write, convert q, test for non-finite
// values, save full pages) that also computes, for every (b, h) whose tail
// fills and whose row is clean, the page's Quest min / max or ShadowKV
// landmark and outlier score or RetroInfer mean key and value sum, and
// optionally its token count (or only the token count) -- the rules and order
// of QuestPolicy / ShadowKVPolicy / RetroInferPolicy::append
// (policy/summary_rules.hpp), so the results equal theirs bit for bit.
//
// Why in the step layer: the kernel belongs to the buffer (templated on the
// summary, cuda/buffer/append_kernel.cuh) and the summary rules and outputs to
// the policies (policy/summary_store_cuda.hpp); the decode step is the first
// layer that sees both, and fuses them so the step stays one launch. Same
// conventions as the buffer header: plain structs, caller-owned memory,
// host-side checks before anything is enqueued.
#include "sparsekv/buffer/append_cuda.hpp"
#include "sparsekv/policy/summary_store_cuda.hpp"

namespace sparsekv::cuda {

// append_tokens(args, stream) plus the summaries of `summaries.kind`. Throws
// what that throws, and invalid_argument for an unknown kind, null rows or
// outputs of the kind (tokens for AppendSummary::tokens) while batch > 0, and (shadowkv) head_dim >
// kMaxIndexDim or page_tokens > kMaxIndexPageTokens (policy/index_cuda.hpp).
void append_tokens(const DeviceAppend& args, const AppendSummaries& summaries, void* stream);

}  // namespace sparsekv::cuda
