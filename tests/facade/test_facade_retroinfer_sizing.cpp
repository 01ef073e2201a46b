// A RetroInfer request is sized honestly by the facade -- a decode
// re-index is a replacement of its run (partitions and CPU pages), and the page
// table holds whatever RetroInfer can build -- so a request that was admitted
// never gets stuck mid-decode.
#include <algorithm>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "sparsekv/facade/manager_inspection.hpp"
#include "sparsekv/policy/retroinfer.hpp"
#include "sparsekv/sparsekv.hpp"
#include "test_support.hpp"

using namespace sparsekv;

namespace {

constexpr ModelShape kShape{1, 4, 1, 16, DType::f32};
constexpr std::size_t kRow = std::size_t{kShape.kv_heads} * kShape.head_dim;

Config sizing_config(std::uint32_t page_tokens, std::uint32_t max_context, std::size_t cpu_bytes = 64ull << 20) {
  Config c;
  c.page_tokens = page_tokens;
  c.max_context_tokens = max_context;
  c.cpu_tier_bytes = cpu_bytes;
  c.gpu_tier_bytes = 64ull << 20;
  return c;
}

// One request's K/V, [token][kv_head][dim] f32, generated up front so that
// runs with different tiers see the same tokens.
struct Stream {
  std::vector<float> k, v, q;  // q: [token][q_heads][dim]

  Stream(std::uint32_t tokens, std::uint32_t seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal;
    for (std::size_t i = 0; i < tokens * kRow; ++i) {
      k.push_back(normal(rng));
      v.push_back(normal(rng));
    }
    for (std::size_t i = 0; i < std::size_t{tokens} * kShape.q_heads * kShape.head_dim; ++i) q.push_back(normal(rng));
  }
  const float* k_at(std::uint32_t t) const { return k.data() + t * kRow; }
  const float* v_at(std::uint32_t t) const { return v.data() + t * kRow; }
  const float* q_at(std::uint32_t t) const { return q.data() + std::size_t{t} * kShape.q_heads * kShape.head_dim; }
};

// Decodes token `t` of request 1 (its sequence holds t tokens).
void decode(RuntimeManager& kv, const Stream& s, std::uint32_t t) {
  const std::vector<RequestId> batch{1};
  std::vector<float> out(std::size_t{kShape.q_heads} * kShape.head_dim);
  kv.decode(batch, 0, s.q_at(t), s.k_at(t), s.v_at(t), out.data());
}

// Every token's K and V rows are in the CPU tier (partitions) or the tail,
// exactly once: the regroups moved bytes, they lost or corrupted none.
void check_bytes(const RuntimeManager& kv, const Stream& s) {
  const TieredKVBuffer& b = inspect_buffer(kv);
  const PageLayout layout{inspect_buffer(kv).tiers().config.page_tokens, kShape.head_dim, kShape.dtype};
  const std::size_t row = layout.row_bytes();
  const std::uint32_t tokens = b.admission().sequence_length(1, 0);
  std::vector<std::vector<float>> held, expected;
  const auto add = [&](const std::byte* page, std::uint32_t slot) {
    std::vector<float> r(2 * kShape.head_dim);
    std::memcpy(r.data(), page + layout.k_offset(slot), row);
    std::memcpy(r.data() + kShape.head_dim, page + layout.v_offset(slot), row);
    held.push_back(std::move(r));
  };
  std::vector<PageId> pages;
  for (PartitionId p = 0; p < b.tiers().table.partition_count(1, 0, 0); ++p) {
    pages.clear();
    b.tiers().table.cpu_pages(1, 0, 0, p, pages);
    for (std::uint32_t i = 0; i < b.tiers().table.meta(1, 0, 0, p).token_count(); ++i) {
      add(b.tiers().cpu_pool.data(pages[i / layout.page_tokens]), i % layout.page_tokens);
    }
  }
  for (std::uint32_t i = 0; i < b.tails().tail_tokens(1, 0); ++i)
    add(b.tiers().gpu_pool.data(b.tails().tail_page(1, 0, 0)), i);
  for (std::uint32_t t = 0; t < tokens; ++t) {
    std::vector<float> r(s.k_at(t), s.k_at(t) + kShape.head_dim);
    r.insert(r.end(), s.v_at(t), s.v_at(t) + kShape.head_dim);
    expected.push_back(std::move(r));
  }
  std::sort(held.begin(), held.end());
  std::sort(expected.begin(), expected.end());
  REQUIRE(held == expected);
}

// A refused decode changed nothing: same sequence, same pages, consistent tables.
void check_refused(RuntimeManager& kv, const Stream& s, std::uint32_t t) {
  const std::uint32_t used = inspect_buffer(kv).tiers().cpu_pool.used();
  const std::uint32_t partitions = inspect_buffer(kv).tiers().table.partition_count(1, 0, 0);
  REQUIRE_SPARSEKV_ERROR(decode(kv, s, t), ErrorCode::resource_exhausted);
  REQUIRE(inspect_buffer(kv).admission().sequence_length(1, 0) == t);
  REQUIRE(inspect_buffer(kv).tiers().cpu_pool.used() == used);
  REQUIRE(inspect_buffer(kv).tiers().table.partition_count(1, 0, 0) == partitions);
  inspect_buffer(kv).validate();
}

constexpr std::uint32_t kPrompt = 60;
constexpr std::uint32_t kTokens = 1100;
// RetroInfer re-indexes after 1024 generated tokens: the decode that takes the
// sequence from 1083 to 1084 tokens saves the page that triggers it.
constexpr std::uint32_t kReindexToken = kPrompt + 1023;

}  // namespace

TEST_CASE("Manager: a RetroInfer re-index near the partition maximum is sized as a replacement", "[facade][errors]") {
  // 138 pages per head: before the re-index the head holds 136 partitions; the
  // regroup replaces 135 of them by ~72. Counted on top of the run (1 + 136 +
  // 72 > 138) the step was refused forever.
  const Stream s(kTokens, 1);
  RuntimeManager kv(kShape, sizing_config(8, kTokens), make_policy("retroinfer_no_estimation", 256));
  REQUIRE(kv.can_admit(kPrompt, kTokens).admit);
  kv.add_request(1, kTokens);
  kv.prefill(1, 0, s.k.data(), s.v.data(), kPrompt);
  for (std::uint32_t t = kPrompt; t < kTokens; ++t) {
    INFO("decode of token " << t);
    const std::uint32_t partitions = inspect_buffer(kv).tiers().table.partition_count(1, 0, 0);
    decode(kv, s, t);
    if (t == kReindexToken)
      REQUIRE(inspect_buffer(kv).tiers().table.partition_count(1, 0, 0) < partitions);  // it re-indexed
  }
  REQUIRE(inspect_buffer(kv).admission().sequence_length(1, 0) == kTokens);
  inspect_buffer(kv).validate();
  check_bytes(kv, s);
}

TEST_CASE("Manager: a RetroInfer re-index counts the CPU pages its run frees, exactly", "[facade][errors]") {
  const Stream s(kTokens, 2);
  const auto manager = [&](std::uint32_t cpu_pages) {
    const Config probe = sizing_config(8, 4096);
    auto kv = std::make_unique<RuntimeManager>(kShape, sizing_config(8, 4096, cpu_pages * probe.page_bytes(kShape)),
                                               make_policy("retroinfer_no_estimation", 256));
    kv->add_request(1, kTokens);
    kv->prefill(1, 0, s.k.data(), s.v.data(), kPrompt);
    return kv;
  };
  // The tier of the bug: 235 pages, 135 in use before the re-index, whose new run
  // (165 pages) fits once the old run's 135 are counted as freed.
  {
    auto kv = manager(235);
    for (std::uint32_t t = kPrompt; t < kTokens; ++t) {
      INFO("decode of token " << t);
      decode(*kv, s, t);
    }
    inspect_buffer(*kv).validate();
    check_bytes(*kv, s);
  }
  // Exactly: a tier holding precisely the pages the re-index leaves in use
  // runs it; one page less refuses it up front, every time, changing nothing
  // (never half-way through the step).
  std::uint32_t after = 0;
  {
    auto kv = manager(4096);
    for (std::uint32_t t = kPrompt; t <= kReindexToken; ++t) decode(*kv, s, t);
    after = inspect_buffer(*kv).tiers().cpu_pool.used();
  }
  {
    auto kv = manager(after);
    for (std::uint32_t t = kPrompt; t <= kReindexToken; ++t) decode(*kv, s, t);
    REQUIRE(inspect_buffer(*kv).tiers().cpu_pool.available() == 0);
    inspect_buffer(*kv).validate();
    check_bytes(*kv, s);
  }
  {
    auto kv = manager(after - 1);
    for (std::uint32_t t = kPrompt; t < kReindexToken; ++t) decode(*kv, s, t);
    check_refused(*kv, s, kReindexToken);
    check_refused(*kv, s, kReindexToken);
    check_bytes(*kv, s);
  }
}

TEST_CASE("Manager: RetroInfer requests fit the page table they are admitted into", "[facade][errors]") {
  const auto run = [](std::uint32_t page_tokens, std::uint32_t max_context, std::uint32_t budget,
                      std::uint32_t prompt) {
    CAPTURE(page_tokens, max_context, budget, prompt);
    const Stream s(max_context, page_tokens + budget);
    RuntimeManager kv(kShape, sizing_config(page_tokens, max_context), make_policy("retroinfer", budget));
    // Admitted up front (the old bound asked for more pages than a head can hold) ...
    REQUIRE(kv.can_admit(prompt, max_context).admit);
    kv.add_request(1, max_context);
    REQUIRE(kv.request_pages(max_context).mandatory_pages <=
            inspect_buffer(kv).tiers().table.geometry().max_cpu_pages_per_head);
    // ... and never refused for the page table's sake while it runs.
    kv.prefill(1, 0, s.k.data(), s.v.data(), prompt);
    for (std::uint32_t t = prompt; t < max_context; ++t) {
      INFO("decode of token " << t);
      decode(kv, s, t);
    }
    inspect_buffer(kv).validate();
    check_bytes(kv, s);
  };
  SECTION("a budget covering the context, 8-token pages") { run(8, 1100, 100000, 60); }
  SECTION("32-token pages, longer than RetroInfer's 16-token clusters") { run(32, 512, 64, 200); }
  SECTION("a prompt of 1200 tokens in 32-token pages: more clusters than pages") { run(32, 2048, 64, 1200); }
}

TEST_CASE("Manager: RetroInfer never outgrows the page table, whatever its page and cluster sizes", "[facade]") {
  // Frequent re-indexes of short segments, clusters smaller and larger than a
  // page, budgets that cover the context or not: run to max_context_tokens.
  constexpr std::uint32_t kMax = 700;
  for (std::uint32_t page_tokens : {8u, 16u, 32u, 64u}) {
    for (std::uint32_t cluster : {4u, 16u, 40u}) {
      for (std::uint32_t budget : {48u, 100000u}) {
        CAPTURE(page_tokens, cluster, budget);
        RetroInferPolicy::Options o;
        o.tokens_per_cluster = cluster;
        o.segment_tokens = 128;
        o.window_tokens = 16;
        o.update_tokens = 64;
        o.budget_tokens = budget;
        const Stream s(kMax, page_tokens * cluster);
        RuntimeManager kv(kShape, sizing_config(page_tokens, kMax), AnyPolicy(RetroInferPolicy(o)));
        REQUIRE(kv.can_admit(300, kMax).admit);
        kv.add_request(1, kMax);
        kv.prefill(1, 0, s.k.data(), s.v.data(), 300);
        for (std::uint32_t t = 300; t < kMax; ++t) {
          INFO("decode of token " << t);
          decode(kv, s, t);
        }
        inspect_buffer(kv).validate();
        check_bytes(kv, s);
      }
    }
  }
}
