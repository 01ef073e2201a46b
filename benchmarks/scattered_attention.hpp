#pragma once
// The attention work of the CUDA benchmarks: B requests x kv heads rows of
// `row_pages` full pages each, scattered over a device page pool, with
// disjoint rotation sets of those pages so that the 50 MiB L2 cannot serve a
// launch from the previous one's reads (sparsekv-bench-attention-cuda, and
// the attention beside the gather in sparsekv-bench-gather-cuda).
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "cuda_bench_support.hpp"
#include "sparsekv/attention/sparse_decode_attention_cuda.hpp"

namespace sparsekv::bench {

struct ScatteredAttention {
  cuda::DecodeAttentionShape shape;
  cuda::DecodeAttentionSplit split;
  cuda::DecodeAttentionArgs args;     // everything but q, out, lse and indices
  std::int64_t* page_sets = nullptr;  // set_count sets of set_pages page ids, back to back
  std::size_t set_pages = 0, set_count = 0, next_set = 0;

  // Points args.indices at the next rotation set.
  void rotate() {
    args.indices = page_sets + next_set * set_pages;
    next_set = (next_set + 1) % set_count;
  }
  void release() {
    cudaFree(page_sets);
    cudaFree(const_cast<std::int64_t*>(args.indptr));
    cudaFree(const_cast<std::int32_t*>(args.last_page_len));
    cudaFree(args.workspace);
  }
};

// Rows of `row_pages` pages of `layout` from pool (pool_bytes of pages), as
// many disjoint sets as cover rotation_bytes and fit the pool (at least
// one: the caller checks that one launch's pages fit), pages shuffled by
// `seed`; the workspace planned for the current device.
inline ScatteredAttention make_scattered_attention(std::uint32_t batch, std::uint32_t q_heads, std::uint32_t kv_heads,
                                                   const PageLayout& layout, std::uint32_t row_pages, std::byte* pool,
                                                   std::size_t pool_bytes, std::size_t rotation_bytes,
                                                   std::uint32_t seed) {
  ScatteredAttention a;
  const std::uint32_t rows = batch * kv_heads;
  a.shape = {batch, q_heads, kv_heads, layout, row_pages, 0};
  a.split = cuda::plan_sparse_decode_attention(a.shape);
  a.set_pages = std::size_t{rows} * row_pages;
  const std::size_t pool_pages = pool_bytes / layout.page_bytes();
  const std::size_t set_bytes = a.set_pages * layout.page_bytes();
  a.set_count =
      std::max<std::size_t>(1, std::min((rotation_bytes + set_bytes - 1) / set_bytes, pool_pages / a.set_pages));
  std::vector<std::int64_t> pages(pool_pages);
  std::iota(pages.begin(), pages.end(), 0);
  std::shuffle(pages.begin(), pages.end(), std::mt19937(seed));
  a.page_sets = device_copy(pages.data(), a.set_count * a.set_pages);
  std::vector<std::int64_t> indptr(rows + 1);
  for (std::uint32_t r = 0; r <= rows; ++r) indptr[r] = std::int64_t{r} * row_pages;
  const std::vector<std::int32_t> last_page_len(rows, static_cast<std::int32_t>(layout.page_tokens));
  a.args.page_base = pool;
  a.args.page_stride = layout.page_bytes();
  a.args.indptr = device_copy(indptr.data(), indptr.size());
  a.args.last_page_len = device_copy(last_page_len.data(), last_page_len.size());
  a.args.scale = 1.0f / std::sqrt(float(layout.head_dim));
  a.args.workspace = device_alloc<std::byte>(a.split.workspace_bytes);
  a.args.workspace_bytes = a.split.workspace_bytes;
  a.rotate();
  // A pageable cudaMemcpy may return before its DMA lands, and the launches
  // run on non-blocking streams that do not wait for the legacy stream.
  check(cudaDeviceSynchronize(), "setup");
  return a;
}

}  // namespace sparsekv::bench
