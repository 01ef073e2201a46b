#pragma once
// A random decode-attention batch over a paged pool and the host
// decode_attention reference, shared by the host emulation of the split-K
// kernel (test_attention_rules.cpp) and the kernel's GPU test
// (gpu/test_attention_cuda.cpp). The generators take the caller's normal
// distribution so that one batch draws from a single sequence.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <span>
#include <vector>

#include "sparsekv/attention/attention_partial.hpp"
#include "sparsekv/attention/decode_attention.hpp"
#include "sparsekv/core/numeric.hpp"

namespace sparsekv::test {

// CSR rows over (request, kv head) of pages in a host pool of `stride`-byte pages.
struct AttentionBatch {
  std::uint32_t batch = 0, q_heads = 0, kv_heads = 0;
  PageLayout layout;
  std::size_t stride = 0;  // page_bytes, or wider
  float scale = 0;
  std::vector<std::byte> pool;
  std::vector<std::int64_t> indptr{0}, indices;
  std::vector<std::int32_t> last_page_len;
  std::vector<float> q;
  std::vector<AttentionPartial> extra;  // empty or [batch * q_heads]
  std::uint32_t max_pages = 0;

  const std::byte* page(std::int64_t id) const { return pool.data() + id * stride; }
  std::uint32_t group() const { return q_heads / kv_heads; }
};

// Random K and V rows in the first `pool_pages` pages (the pool already sized).
inline void fill_pages(AttentionBatch& b, std::uint32_t pool_pages, std::normal_distribution<float>& normal,
                       std::mt19937& rng) {
  const PageLayout& layout = b.layout;
  for (std::uint32_t p = 0; p < pool_pages; ++p)
    for (std::uint32_t row = 0; row < 2 * layout.page_tokens; ++row)
      for (std::uint32_t i = 0; i < layout.head_dim; ++i)
        store_element(b.pool.data() + p * b.stride + row * layout.row_bytes(), i, layout.dtype, normal(rng));
}

// Row r gets counts[r] distinct random pool pages and a random last-page
// length; with `poison`, the slots past it are NaN (they are never read).
inline void random_rows(AttentionBatch& b, const std::vector<std::uint32_t>& counts, std::uint32_t pool_pages,
                        std::mt19937& rng, bool poison) {
  const PageLayout& layout = b.layout;
  std::vector<std::int64_t> ids(pool_pages);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  std::size_t next = 0;
  for (std::size_t r = 0; r < counts.size(); ++r) {
    for (std::uint32_t p = 0; p < counts[r]; ++p) b.indices.push_back(ids[next++]);
    b.indptr.push_back(static_cast<std::int64_t>(b.indices.size()));
    const std::uint32_t len = 1 + std::uint32_t(rng() % layout.page_tokens);
    b.last_page_len.push_back(static_cast<std::int32_t>(len));
    if (poison && counts[r] > 0) {
      std::byte* last = b.pool.data() + b.indices.back() * b.stride;
      for (std::uint32_t slot = len; slot < layout.page_tokens; ++slot) {
        std::memset(last + layout.k_offset(slot), 0xff, layout.row_bytes());
        std::memset(last + layout.v_offset(slot), 0xff, layout.row_bytes());
      }
    }
    b.max_pages = std::max(b.max_pages, counts[r]);
  }
}

inline void random_queries(AttentionBatch& b, std::normal_distribution<float>& normal, std::mt19937& rng) {
  b.q.resize(std::size_t{b.batch} * b.q_heads * b.layout.head_dim);
  for (float& x : b.q) x = normal(rng);
}

// An extra term of three random (score, weight 1..max_weight, value) entries
// for every q head h but those with h % skip_every == skip_at.
inline void random_extra(AttentionBatch& b, std::normal_distribution<float>& normal, std::mt19937& rng,
                         std::size_t skip_every, std::size_t skip_at, std::uint32_t max_weight) {
  const std::uint32_t d = b.layout.head_dim;
  b.extra.assign(std::size_t{b.batch} * b.q_heads, AttentionPartial(d));
  std::vector<float> v(d);
  for (std::size_t h = 0; h < b.extra.size(); ++h) {
    if (h % skip_every == skip_at) continue;
    for (int c = 0; c < 3; ++c) {
      for (float& x : v) x = normal(rng);
      b.extra[h].add(2.0f * normal(rng), float(1 + rng() % max_weight), v.data());
    }
  }
}

// Host decode_attention per request: the reference.
inline void reference_attention(const AttentionBatch& b, std::vector<float>& out, std::vector<float>& lse) {
  const std::uint32_t d = b.layout.head_dim;
  out.assign(std::size_t{b.batch} * b.q_heads * d, 0.0f);
  lse.assign(std::size_t{b.batch} * b.q_heads, 0.0f);
  std::vector<HeadKv> kv(b.kv_heads);
  for (std::uint32_t r = 0; r < b.batch; ++r) {
    for (std::uint32_t h = 0; h < b.kv_heads; ++h) {
      const std::uint32_t row = r * b.kv_heads + h;
      kv[h].clear();
      for (std::int64_t i = b.indptr[row]; i < b.indptr[row + 1]; ++i)
        kv[h].add(b.page(b.indices[i]), i + 1 == b.indptr[row + 1] ? std::uint32_t(b.last_page_len[row])
                                                                    : b.layout.page_tokens);
    }
    const std::span<const AttentionPartial> extra =
        b.extra.empty() ? std::span<const AttentionPartial>{}
                        : std::span<const AttentionPartial>(b.extra).subspan(std::size_t{r} * b.q_heads, b.q_heads);
    decode_attention(b.layout, b.q_heads, b.scale, b.q.data() + std::size_t{r} * b.q_heads * d, kv, extra,
                     out.data() + std::size_t{r} * b.q_heads * d, lse.data() + std::size_t{r} * b.q_heads);
  }
}

}  // namespace sparsekv::test
