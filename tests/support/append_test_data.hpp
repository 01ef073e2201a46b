#pragma once
// The host emulation of the append kernel (cuda/buffer/append_kernel.cuh),
// shared by its rules test (test_append_rules.cpp: emulation = host path)
// and its GPU test (gpu/test_append_cuda.cpp: kernel = emulation).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "sparsekv/buffer/append_cuda.hpp"
#include "sparsekv/core/numeric.hpp"
#include "sparsekv/step/append_summaries_cuda.hpp"
#include "sparsekv/policy/summary_rules.hpp"

namespace sparsekv::test {

using cuda::AppendSummaries;
using cuda::AppendSummary;
using cuda::DeviceAppend;
using cuda::kAppendThreads;
using cuda::kNoAppendError;

enum class Mutation {
  none,
  last_bad_wins,      // the error word keeps the largest key (atomicMax)
  store_not_min,      // each block stores its key instead of atomicMin: the last block scheduled wins
  write_bad_row,      // a row holding a non-finite value is written (and its full page saved)
  save_before_write,  // the full page is summarised and saved before the new row is in it
};

inline constexpr std::uint32_t kWarp = 32;

// The kernel (cuda/buffer/append_kernel.cuh) step by step on the host; `grid`
// blocks stride over the items.
inline void emulate(const DeviceAppend& a, const AppendSummaries& s, std::uint32_t grid, Mutation mutation) {
  const std::uint64_t items = std::uint64_t{a.batch} * a.kv_heads;
  const std::uint32_t dim = a.layout.head_dim;
  const PageLayout& l = a.layout;
  for (std::uint32_t block = 0; block < grid; ++block) {
    for (std::uint64_t item = block; item < items; item += grid) {
      const auto b = static_cast<std::uint32_t>(item / a.kv_heads);
      const auto h = static_cast<std::uint32_t>(item % a.kv_heads);
      std::vector<std::uint64_t> bad(kAppendThreads, kNoAppendError);
      std::vector<std::uint64_t> worst(kAppendThreads, 0);  // last_bad_wins' reduction
      bool kv_bad = false;
      for (std::uint32_t t = 0; t < kAppendThreads; ++t) {
        for (std::uint32_t d = t; d < dim; d += kAppendThreads) {
          std::uint64_t mine = kNoAppendError;
          kv_bad = cuda::append_scan_dim(a, b, h, d, mine) || kv_bad;
          bad[t] = std::min(bad[t], mine);
          if (mine != kNoAppendError) worst[t] = std::max(worst[t], mine);
        }
      }
      // Warp shuffles, then thread 0 over the warps: a min over all threads.
      std::uint64_t block_bad = kNoAppendError;
      for (std::uint32_t w = 0; w < kAppendThreads / kWarp; ++w) {
        std::uint64_t warp = kNoAppendError;
        for (std::uint32_t lane = 0; lane < kWarp; ++lane) warp = std::min(warp, bad[w * kWarp + lane]);
        block_bad = std::min(block_bad, warp);
      }
      if (mutation == Mutation::last_bad_wins) {
        const std::uint64_t last = *std::max_element(worst.begin(), worst.end());
        if (block_bad != kNoAppendError) *a.error = *a.error == kNoAppendError ? last : std::max(*a.error, last);
      } else if (mutation == Mutation::store_not_min) {
        if (block_bad != kNoAppendError) *a.error = block_bad;
      } else {
        cuda::lower_error(*a.error, block_bad);
      }
      const bool row_bad = kv_bad && mutation != Mutation::write_bad_row;
      if (row_bad) continue;
      const auto save = [&] {
        const cuda::PageKeyRows key{cuda::append_tail_page(a, b, h), l};
        const std::size_t row = s.kind == AppendSummary::none ? 0 : s.rows[item];
        if (s.kind != AppendSummary::none && s.tokens != nullptr) s.tokens[row] = l.page_tokens;  // thread 0
        if (s.kind == AppendSummary::quest) {
          for (std::uint32_t t = 0; t < kAppendThreads; ++t) {
            for (std::uint32_t d = t; d < dim; d += kAppendThreads) {
              page_min_max_channel(key, l.page_tokens, d, l.dtype, s.min[row * dim + d], s.max[row * dim + d]);
            }
          }
        } else if (s.kind == AppendSummary::shadowkv) {
          std::vector<float> landmark(dim), cosine(l.page_tokens);
          for (std::uint32_t t = 0; t < kAppendThreads; ++t) {
            for (std::uint32_t d = t; d < dim; d += kAppendThreads) {
              landmark[d] = s.mean[row * dim + d] = page_mean_channel(key, l.page_tokens, d, l.dtype);
            }
          }
          const float norm = sqrt_rn(dot_in_order(landmark.data(), landmark.data(), dim));
          for (std::uint32_t t = 0; t < kAppendThreads; ++t) {
            for (std::uint32_t i = t; i < l.page_tokens; i += kAppendThreads) {
              cosine[i] = page_key_cosine(key, i, landmark.data(), norm, dim, l.dtype);
            }
          }
          float lowest = kOutlierScoreStart;
          for (float c : cosine) lowest = fold_min(lowest, c);
          s.outlier_score[row] = lowest;
        } else if (s.kind == AppendSummary::retroinfer) {
          const cuda::PageValueRows value{cuda::append_tail_page(a, b, h), l};
          for (std::uint32_t t = 0; t < kAppendThreads; ++t) {
            for (std::uint32_t d = t; d < dim; d += kAppendThreads) {
              page_key_mean_value_sum_channel(key, value, l.page_tokens, d, l.dtype, s.centroid[row * dim + d],
                                              s.value_sum[row * dim + d]);
            }
          }
        }
        for (std::uint32_t t = 0; t < kAppendThreads; ++t) {
          for (std::size_t v = t; v < cuda::append_page_vectors(l); v += kAppendThreads)
            cuda::append_save_vector(a, b, h, v);
        }
      };
      const bool fills = cuda::append_fills_tail(a, b);
      if (fills && mutation == Mutation::save_before_write) save();
      for (std::uint32_t t = 0; t < kAppendThreads; ++t) {
        for (std::uint32_t d = t; d < dim; d += kAppendThreads) cuda::append_write_dim(a, b, h, d);
      }
      if (fills && mutation != Mutation::save_before_write) save();
    }
  }
}

inline std::vector<std::byte> encode(const std::vector<float>& x, DType dtype) {
  std::vector<std::byte> out(x.size() * dtype_size(dtype));
  for (std::size_t i = 0; i < x.size(); ++i) store_element(out.data(), static_cast<std::uint32_t>(i), dtype, x[i]);
  return out;
}
inline std::vector<float> decode(const std::byte* bytes, std::size_t n, DType dtype) {
  std::vector<float> out(n);
  for (std::size_t i = 0; i < n; ++i) out[i] = cuda::load_at(bytes, i, dtype);
  return out;
}

}  // namespace sparsekv::test
