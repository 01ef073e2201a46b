// Manager::fork: a request started from the first tokens of a live one
// decodes exactly as if it had been prefilled with those tokens unshared.
//
// Two managers see the same stream: in one, new requests fork a random live
// request at a random point; in its twin, the same request is added and
// prefilled with the same K/V. Requests arrive, fork and finish at random;
// after every decode step both give the same outputs and selections, bit for
// bit, and a fork's K/V stays intact when its source finishes first. Policies
// whose partitions are full pages (all but RetroInfer) share the prompt's
// full pages: their reference count is 2 or more and the CPU tier holds
// fewer pages than the twin's; H2O and StreamingLLM copy a shared page
// before they mask it (copy-on-evict), so their evictions stay the unshared
// run's.
#include <algorithm>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "sparsekv/facade/manager_inspection.hpp"
#include "sparsekv/sparsekv.hpp"
#include "test_support.hpp"

using namespace sparsekv;

namespace {

constexpr ModelShape kShape{2, 4, 2, 8, DType::f32};
constexpr std::uint32_t kPageTokens = 4;
constexpr std::uint32_t kMaxTokens = 160;
constexpr std::size_t kRow = std::size_t{kShape.kv_heads} * kShape.head_dim;  // one token's K or V

Config config() { return test::small_config(kShape, kPageTokens, 8, kMaxTokens, 4096); }

// RetroInfer's clusters of a prefix are not the prompt's: its forks copy.
bool shares_pages(const std::string& policy) { return policy != "retroinfer" && policy != "retroinfer_no_estimation"; }
bool evicts(const std::string& policy) { return policy == "h2o" || policy == "streaming_evict"; }

// A request's K and V so far, per layer: [position][kv_heads][head_dim].
struct History {
  std::vector<std::vector<float>> k, v;
  // Its first tokens in page order: all of them after a prompt (or fork) of
  // whole pages, else the prompt alone (the decode pages after it start off
  // a page boundary: readable, never shared).
  std::uint32_t page_order = kMaxTokens;
  std::uint32_t tokens() const { return static_cast<std::uint32_t>(k[0].size() / kRow); }
};

class Twins {
 public:
  Twins(const std::string& policy, std::uint32_t seed)
      : forked_(kShape, config(), make_policy(policy, 24)),
        plain_(kShape, config(), make_policy(policy, 24)),
        rng_(seed) {}

  void add(RequestId id, std::uint32_t prompt) {
    History h;
    for (std::uint32_t l = 0; l < kShape.layers; ++l) {
      h.k.push_back(draw(prompt * kRow));
      h.v.push_back(draw(prompt * kRow));
    }
    for (RuntimeManager* m : {&forked_, &plain_}) {
      m->add_request(id, kMaxTokens);
      for (std::uint32_t l = 0; l < kShape.layers; ++l) m->prefill(id, l, h.k[l].data(), h.v[l].data(), prompt);
    }
    if (prompt % kPageTokens != 0) h.page_order = prompt;
    history_[id] = std::move(h);
  }

  // Forks `source` at `tokens` in one manager, prefills the same rows in the other.
  void fork(RequestId id, RequestId source, std::uint32_t tokens) {
    const std::uint64_t shared_before = inspect_buffer(forked_).tiers().stats.pages_shared;
    const std::uint64_t forked_used = inspect_buffer(forked_).tiers().cpu_pool.used(),
                        plain_used = inspect_buffer(plain_).tiers().cpu_pool.used();
    REQUIRE(forked_.can_fork(source, tokens, kMaxTokens).admit);
    forked_.fork(id, source, tokens, kMaxTokens);
    History h;
    for (std::uint32_t l = 0; l < kShape.layers; ++l) {
      h.k.emplace_back(history_[source].k[l].begin(), history_[source].k[l].begin() + tokens * kRow);
      h.v.emplace_back(history_[source].v[l].begin(), history_[source].v[l].begin() + tokens * kRow);
    }
    plain_.add_request(id, kMaxTokens);
    for (std::uint32_t l = 0; l < kShape.layers; ++l) plain_.prefill(id, l, h.k[l].data(), h.v[l].data(), tokens);
    if (tokens % kPageTokens != 0) h.page_order = tokens;
    const std::uint32_t in_order = std::min(tokens, history_[source].page_order);
    history_[id] = std::move(h);
    const std::uint64_t shared = inspect_buffer(forked_).tiers().stats.pages_shared - shared_before;
    const std::string policy(policy_name(forked_.policy()));
    const std::uint64_t full = std::uint64_t{in_order / kPageTokens} * kShape.layers * kShape.kv_heads;
    if (!shares_pages(policy)) {
      REQUIRE(shared == 0);
    } else if (evicts(policy)) {  // no decode tail: the source's leading pages still in order, every slot live
      REQUIRE(shared <= std::uint64_t{tokens / kPageTokens} * kShape.layers * kShape.kv_heads);
    } else {
      REQUIRE(shared == full);  // every full page in page order, in every (layer, kv head)
    }
    // The shared pages are stored once: the fork took exactly that many fewer pages than its twin's prefill.
    REQUIRE((inspect_buffer(plain_).tiers().cpu_pool.used() - plain_used) -
                (inspect_buffer(forked_).tiers().cpu_pool.used() - forked_used) ==
            shared);
    if (shared > 0) {
      std::vector<PageId> page;
      inspect_buffer(forked_).tiers().table.cpu_pages(id, 0, 0, 0, page);
      REQUIRE(inspect_buffer(forked_).tiers().cpu_pool.ref_count(page[0]) >= 2);  // more when the source is a fork too
    }
    check_bytes(id);
  }

  void finish(RequestId id) {
    forked_.finish(id);
    plain_.finish(id);
    history_.erase(id);
  }

  // One decode step of every live request, each layer compared bit for bit.
  void step() {
    std::vector<RequestId> batch;
    for (const auto& [id, h] : history_) batch.push_back(id);
    if (batch.empty()) return;
    for (std::uint32_t l = 0; l < kShape.layers; ++l) {
      const std::vector<float> q = draw(batch.size() * kShape.q_heads * kShape.head_dim);
      const std::vector<float> k = draw(batch.size() * kRow), v = draw(batch.size() * kRow);
      std::vector<float> a(batch.size() * kShape.q_heads * kShape.head_dim), b(a.size());
      forked_.decode(batch, l, q.data(), k.data(), v.data(), a.data());
      plain_.decode(batch, l, q.data(), k.data(), v.data(), b.data());
      REQUIRE(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
      for (std::size_t i = 0; i < batch.size(); ++i) {
        CAPTURE(l, batch[i]);
        REQUIRE(forked_.retrieval(i).partitions == plain_.retrieval(i).partitions);
        REQUIRE(forked_.retrieval(i).token_counts == plain_.retrieval(i).token_counts);
        REQUIRE(forked_.retrieval(i).tail_tokens == plain_.retrieval(i).tail_tokens);
        History& h = history_[batch[i]];
        h.k[l].insert(h.k[l].end(), k.begin() + i * kRow, k.begin() + (i + 1) * kRow);
        h.v[l].insert(h.v[l].end(), v.begin() + i * kRow, v.begin() + (i + 1) * kRow);
      }
    }
  }

  // The rows the forked manager holds in order in its CPU tier are the request's own.
  void check_bytes(RequestId id) {
    for (std::uint32_t l = 0; l < kShape.layers; ++l) {
      const std::uint32_t n = inspect_buffer(forked_).forks().saved_tokens(id, l);
      std::vector<float> k(n * kRow), v(n * kRow);
      inspect_buffer(forked_).forks().read_prefix(id, l, 0, n, k.data(), v.data(), kShape.dtype);
      REQUIRE(std::equal(k.begin(), k.end(), history_[id].k[l].begin()));
      REQUIRE(std::equal(v.begin(), v.end(), history_[id].v[l].begin()));
    }
  }

  std::uint32_t forkable(RequestId id) const {
    std::uint32_t n = kMaxTokens;
    for (std::uint32_t l = 0; l < kShape.layers; ++l)
      n = std::min(n, inspect_buffer(forked_).forks().saved_tokens(id, l));
    return n;
  }
  std::uint32_t tokens(RequestId id) const { return history_.at(id).tokens(); }
  std::vector<RequestId> live() const {
    std::vector<RequestId> ids;
    for (const auto& [id, h] : history_) ids.push_back(id);
    return ids;
  }
  std::mt19937& rng() { return rng_; }
  const RuntimeManager& forked() const { return forked_; }
  const RuntimeManager& plain() const { return plain_; }

 private:
  std::vector<float> draw(std::size_t n) {
    std::normal_distribution<float> normal;
    std::vector<float> x(n);
    for (float& e : x) e = normal(rng_);
    return x;
  }

  RuntimeManager forked_, plain_;
  std::map<RequestId, History> history_;
  std::mt19937 rng_;
};

}  // namespace

TEST_CASE("shared prefix: a fork decodes as the same request prefilled unshared, bit for bit, for every policy",
          "[facade][shared-prefix]") {
  std::vector<std::string> policies = policy_names();
  for (const std::string& p : eviction_policy_names()) policies.push_back(p);
  for (const std::string& policy : policies) {
    for (const std::uint32_t seed : {1u, 2u}) {
      CAPTURE(policy, seed);
      Twins t(policy, seed);
      std::uniform_int_distribution<std::uint32_t> percent(0, 99);
      RequestId next = 1;
      std::uint32_t forks = 0;
      for (std::uint32_t step = 0; step < 80; ++step) {
        CAPTURE(step);
        std::vector<RequestId> live = t.live();
        if (live.size() < 2 || (live.size() < 6 && percent(t.rng()) < 15)) {
          t.add(next++, std::uniform_int_distribution<std::uint32_t>(1, 40)(t.rng()));
        }
        live = t.live();
        const RequestId source = live[std::uniform_int_distribution<std::size_t>(0, live.size() - 1)(t.rng())];
        if (live.size() < 6 && percent(t.rng()) < 25 && t.forkable(source) > 0) {
          const std::uint32_t tokens = std::uniform_int_distribution<std::uint32_t>(1, t.forkable(source))(t.rng());
          t.fork(next++, source, tokens);
          ++forks;
        }
        live = t.live();
        for (const RequestId id : live) {
          // The source often goes first: its fork must keep every byte it shares.
          if (t.tokens(id) + 1 >= kMaxTokens || (live.size() > 2 && percent(t.rng()) < 6)) {
            t.finish(id);
            live = t.live();
            for (const RequestId other : live) t.check_bytes(other);
            break;
          }
        }
        t.step();
      }
      CHECK(forks > 0);
      inspect_buffer(t.forked()).validate();
      inspect_buffer(t.plain()).validate();
      if (shares_pages(policy)) CHECK(inspect_buffer(t.forked()).tiers().stats.pages_shared > 0);
    }
  }
}

TEST_CASE("shared prefix: a fork past what the source holds in order, or of itself, is refused and changes nothing",
          "[facade][shared-prefix][errors]") {
  RuntimeManager m(kShape, config(), make_policy("quest", 24));
  std::vector<float> k(10 * kRow, 1.0f), v(10 * kRow, 2.0f), q(kShape.q_heads * kShape.head_dim, 0.5f);
  m.add_request(1, kMaxTokens);
  for (std::uint32_t l = 0; l < kShape.layers; ++l) m.prefill(1, l, k.data(), v.data(), 10);
  // 10 tokens: the prompt's pages hold 4, 4 and 2; the first decode tokens go to the tail.
  REQUIRE(inspect_buffer(m).forks().saved_tokens(1, 0) == 10);
  const RequestId one[] = {1};
  std::vector<float> out(q.size());
  for (std::uint32_t l = 0; l < kShape.layers; ++l) m.decode(one, l, q.data(), k.data(), v.data(), out.data());
  const std::uint64_t used = inspect_buffer(m).tiers().cpu_pool.used();
  REQUIRE_SPARSEKV_ERROR(m.fork(2, 1, 11, kMaxTokens), ErrorCode::out_of_range);
  REQUIRE_SPARSEKV_ERROR(m.fork(1, 1, 4, kMaxTokens), ErrorCode::invalid_argument);
  REQUIRE_SPARSEKV_ERROR(m.fork(2, 1, 0, kMaxTokens), ErrorCode::invalid_argument);
  REQUIRE_SPARSEKV_ERROR(m.fork(2, 7, 4, kMaxTokens), ErrorCode::not_found);
  REQUIRE_SPARSEKV_ERROR(m.fork(2, 1, 8, 4), ErrorCode::resource_exhausted);  // past its own max_tokens
  REQUIRE_FALSE(m.has_request(2));
  REQUIRE(inspect_buffer(m).tiers().cpu_pool.used() == used);
  m.fork(2, 1, 10, kMaxTokens);
  REQUIRE(m.has_request(2));
  inspect_buffer(m).validate();
}

TEST_CASE("shared prefix: a fork off a page boundary stays in order through its saved decode pages",
          "[facade][shared-prefix]") {
  // 10 prompt tokens in pages of 4; a fork of 6 shares one page and writes
  // a page of 2; its decode pages are saved from position 6 on. All of it
  // stays forkable and readable in order.
  RuntimeManager m(kShape, config(), make_policy("quest", 24));
  std::vector<float> k(10 * kRow), v(10 * kRow), q(kShape.q_heads * kShape.head_dim, 0.5f);
  for (std::size_t i = 0; i < k.size(); ++i) {
    k[i] = float(i % 97) / 97.0f;
    v[i] = float(i % 89) / 89.0f;
  }
  m.add_request(1, kMaxTokens);
  for (std::uint32_t l = 0; l < kShape.layers; ++l) m.prefill(1, l, k.data(), v.data(), 10);
  m.fork(2, 1, 6, kMaxTokens);
  REQUIRE(inspect_buffer(m).forks().saved_tokens(2, 0) == 6);
  const RequestId two[] = {2};
  std::vector<float> out(q.size());
  for (std::uint32_t step = 0; step < 8; ++step) {
    for (std::uint32_t l = 0; l < kShape.layers; ++l) {
      m.decode(two, l, q.data(), k.data() + step * kRow, v.data() + step * kRow, out.data());
    }
  }
  for (std::uint32_t l = 0; l < kShape.layers; ++l) {
    CAPTURE(l);
    REQUIRE(inspect_buffer(m).forks().saved_tokens(2, l) == 14);  // 6, then two saved pages of 4
    std::vector<float> rk(14 * kRow), rv(14 * kRow);
    m.read_kv(2, l, 0, 14, rk.data(), rv.data(), DType::f32);
    REQUIRE(std::equal(rk.begin(), rk.begin() + 6 * kRow, k.begin()));
    REQUIRE(std::equal(rk.begin() + 6 * kRow, rk.end(), k.begin()));
    REQUIRE(std::equal(rv.begin() + 6 * kRow, rv.end(), v.begin()));
  }
  inspect_buffer(m).validate();
}

TEST_CASE("shared prefix: a Manager on a static policy forks too, reusing its summaries", "[facade][shared-prefix]") {
  QuestPolicy::Options options;
  options.budget_tokens = 8;
  Manager<QuestPolicy> forked(kShape, config(), QuestPolicy(options)), plain(kShape, config(), QuestPolicy(options));
  std::mt19937 rng(9);
  std::normal_distribution<float> normal;
  const auto draw = [&](std::size_t n) {
    std::vector<float> x(n);
    for (float& e : x) e = normal(rng);
    return x;
  };
  const std::vector<float> k = draw(30 * kRow), v = draw(30 * kRow);
  for (auto* m : {&forked, &plain}) {
    m->add_request(1, kMaxTokens);
    for (std::uint32_t l = 0; l < kShape.layers; ++l) m->prefill(1, l, k.data(), v.data(), 30);
  }
  forked.fork(2, 1, 27, kMaxTokens);
  plain.add_request(2, kMaxTokens);
  for (std::uint32_t l = 0; l < kShape.layers; ++l) plain.prefill(2, l, k.data(), v.data(), 27);
  // 6 full pages reused and shared per (layer, kv head); the 3-token page written.
  REQUIRE(inspect_buffer(forked).tiers().stats.pages_shared == 6u * kShape.layers * kShape.kv_heads);
  const RequestId batch[] = {2, 1};
  for (std::uint32_t step = 0; step < 12; ++step) {
    for (std::uint32_t l = 0; l < kShape.layers; ++l) {
      const std::vector<float> q = draw(2 * kShape.q_heads * kShape.head_dim), kn = draw(2 * kRow), vn = draw(2 * kRow);
      std::vector<float> a(q.size()), b(q.size());
      forked.decode(batch, l, q.data(), kn.data(), vn.data(), a.data());
      plain.decode(batch, l, q.data(), kn.data(), vn.data(), b.data());
      REQUIRE(a == b);
      REQUIRE(forked.retrieval(0).partitions == plain.retrieval(0).partitions);
    }
  }
}

TEST_CASE("shared prefix: an evicting request copies a shared page before it masks it (copy-on-evict)",
          "[facade][shared-prefix][eviction]") {
  for (const std::string policy : {"h2o", "streaming_evict"}) {
    CAPTURE(policy);
    Twins t(policy, 3);
    t.add(1, 40);
    t.fork(2, 1, 40);  // 10 full pages per (layer, kv head), shared
    const std::uint64_t shared = inspect_buffer(t.forked()).tiers().stats.pages_shared;
    REQUIRE(shared == 10u * kShape.layers * kShape.kv_heads);
    for (std::uint32_t step = 0; step < 30; ++step) t.step();  // both evict down to the budget of 24
    // Each request masks its own copies; the pages neither has evicted from stay shared.
    const std::uint64_t unshared = inspect_buffer(t.forked()).tiers().stats.pages_unshared;
    CHECK(unshared > 0);
    CHECK(unshared <= 2 * shared);
    t.check_bytes(1);
    t.check_bytes(2);
    inspect_buffer(t.forked()).validate();
    t.finish(1);
    t.check_bytes(2);
    for (std::uint32_t step = 0; step < 10; ++step) t.step();
  }
}

TEST_CASE("shared prefix: can_fork counts the shared pages once and agrees with fork", "[facade][shared-prefix]") {
  for (const std::string policy : {"quest", "shadowkv", "h2o", "streaming_evict", "dense"}) {
    CAPTURE(policy);
    Config c = config();
    const std::size_t page = c.page_bytes(kShape);
    c.host_chunk_bytes = page;
    c.cpu_tier_bytes = 48 * page;  // the source's 40 pages and two forks' partial pages
    RuntimeManager m(kShape, c, make_policy(policy, 24));
    std::mt19937 rng(4);
    std::normal_distribution<float> normal;
    std::vector<float> k(40 * kRow), v(40 * kRow);
    for (float& x : k) x = normal(rng);
    for (float& x : v) x = normal(rng);
    m.add_request(1, kMaxTokens);
    for (std::uint32_t l = 0; l < kShape.layers; ++l) m.prefill(1, l, k.data(), v.data(), 40);
    REQUIRE(inspect_buffer(m).tiers().cpu_pool.used() == 40);
    // Unshared, 38 tokens need 10 pages in each of the 4 (layer, kv head); forked, only the 2-token page.
    REQUIRE_FALSE(m.can_admit(38, kMaxTokens).admit);
    for (const RequestId id : {2u, 3u}) {
      const AdmissionAdvice advice = m.can_fork(1, 38, kMaxTokens);
      INFO(advice.reason);
      REQUIRE(advice.admit);
      REQUIRE(advice.cpu_pages_needed == 4);
      m.fork(id, 1, 38, kMaxTokens);
    }
    REQUIRE(inspect_buffer(m).tiers().cpu_pool.used() == 48);
    const AdmissionAdvice full = m.can_fork(1, 38, kMaxTokens);
    REQUIRE_FALSE(full.admit);
    REQUIRE(full.cpu_pages_needed == 4);
    REQUIRE_SPARSEKV_ERROR(m.fork(4, 1, 38, kMaxTokens), ErrorCode::resource_exhausted);
    REQUIRE_FALSE(m.has_request(4));
    REQUIRE(inspect_buffer(m).tiers().cpu_pool.used() == 48);
    // A fork of whole pages writes none.
    REQUIRE(m.can_fork(1, 36, kMaxTokens).admit);
    REQUIRE(m.can_fork(1, 36, kMaxTokens).cpu_pages_needed == 0);
    m.fork(4, 1, 36, kMaxTokens);
    // Arguments the fork refuses, advised against with a reason.
    REQUIRE_FALSE(m.can_fork(9, 4, kMaxTokens).admit);
    REQUIRE_FALSE(m.can_fork(1, 41, kMaxTokens).admit);
    REQUIRE_FALSE(m.can_fork(1, 0, kMaxTokens).admit);
    REQUIRE_FALSE(m.can_fork(1, 8, 4).admit);
    inspect_buffer(m).validate();
  }
}
