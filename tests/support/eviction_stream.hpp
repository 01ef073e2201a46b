#pragma once
// A fixed decode stream for the facade tests of token-evicting policies
// (tests/facade/test_facade_eviction.cpp, and the CUDA lockstep in
// tests/gpu/test_cuda_backend.cpp): fp32 K/V and queries of a batch of
// requests with different prompt lengths, drawn once from a seed so that
// twin managers see the same bytes.
#include <catch2/catch.hpp>

#include <cstdint>
#include <random>
#include <utility>
#include <vector>

#include "sparsekv/facade/manager_inspection.hpp"
#include "sparsekv/sparsekv.hpp"

namespace sparsekv::test {

struct EvictionStream {
  ModelShape shape{2, 4, 2, 16, DType::f32};  // 2 layers, GQA group of 2
  std::vector<std::uint32_t> prompts;         // request first_id + b has prompts[b] tokens
  std::uint32_t steps = 0;
  RequestId first_id = 1;
  // prompt_k[b][layer], [tokens][kv_heads][head_dim]; q[step][layer], [batch][q_heads][head_dim]; k / v likewise.
  std::vector<std::vector<std::vector<float>>> prompt_k, prompt_v;
  std::vector<std::vector<std::vector<float>>> q, k, v;

  // head_dim: 16 keeps the host tests small; the CUDA kernel takes 64 or 128.
  EvictionStream(std::vector<std::uint32_t> prompt_tokens, std::uint32_t decode_steps, std::uint32_t seed,
                 RequestId first = 1, std::uint32_t head_dim = 16)
      : prompts(std::move(prompt_tokens)), steps(decode_steps), first_id(first) {
    shape.head_dim = head_dim;
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal;
    const auto draw = [&](std::size_t n) {
      std::vector<float> x(n);
      for (float& e : x) e = normal(rng);
      return x;
    };
    const std::size_t kv_row = std::size_t{shape.kv_heads} * shape.head_dim;
    for (const std::uint32_t tokens : prompts) {
      prompt_k.emplace_back();
      prompt_v.emplace_back();
      for (std::uint32_t l = 0; l < shape.layers; ++l) {
        prompt_k.back().push_back(draw(tokens * kv_row));
        prompt_v.back().push_back(draw(tokens * kv_row));
      }
    }
    for (std::uint32_t t = 0; t < steps; ++t) {
      q.emplace_back();
      k.emplace_back();
      v.emplace_back();
      for (std::uint32_t l = 0; l < shape.layers; ++l) {
        q.back().push_back(draw(batch_size() * shape.q_heads * shape.head_dim));
        k.back().push_back(draw(batch_size() * kv_row));
        v.back().push_back(draw(batch_size() * kv_row));
      }
    }
  }

  std::size_t batch_size() const { return prompts.size(); }
  std::vector<RequestId> batch() const {
    std::vector<RequestId> ids;
    for (std::size_t b = 0; b < prompts.size(); ++b) ids.push_back(first_id + b);
    return ids;
  }
  std::size_t out_size() const { return batch_size() * shape.q_heads * shape.head_dim; }

  // Tiers and sizes for `steps` decode steps after the longest prompt,
  // ample for every strategy.
  Config config(EvictionStrategy strategy) const {
    Config c;
    c.page_tokens = 8;
    c.max_requests = 4;
    c.max_context_tokens = 512;
    c.min_buffer_ratio = 1.0;
    c.metadata_segment_entries = 32;
    const std::size_t page = c.page_bytes(shape);
    c.host_chunk_bytes = 64 * page;
    c.cpu_tier_bytes = c.gpu_tier_bytes = 4096 * page;
    c.eviction_strategy = strategy;
    return c;
  }

  template <class M>
  void add_and_prefill(M& m) const {
    for (std::size_t b = 0; b < prompts.size(); ++b) {
      m.add_request(first_id + b, prompts[b] + steps);
      for (std::uint32_t l = 0; l < shape.layers; ++l) {
        m.prefill(first_id + b, l, prompt_k[b][l].data(), prompt_v[b][l].data(), prompts[b]);
      }
    }
  }
  template <class M>
  void decode(M& m, std::uint32_t step, std::uint32_t layer, std::vector<float>& out) const {
    out.assign(out_size(), 0.0f);
    const std::vector<RequestId> ids = batch();
    m.decode(ids, layer, q[step][layer].data(), k[step][layer].data(), v[step][layer].data(), out.data());
  }
};

// The live positions of one (request, layer, kv head) of a manager, ascending.
template <class M>
std::vector<std::uint32_t> live_positions(const M& m, RequestId request, std::uint32_t layer, std::uint32_t head) {
  std::vector<std::uint32_t> live;
  const TieredKVBuffer& buffer = inspect_buffer(m);
  for (std::uint32_t p = 0; p < buffer.admission().sequence_length(request, layer); ++p) {
    if (buffer.evictor().position_slot(request, layer, head, p)) live.push_back(p);
  }
  REQUIRE(live.size() == buffer.evictor().live_tokens(request, layer, head));
  return live;
}

}  // namespace sparsekv::test
