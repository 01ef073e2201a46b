// Token-evicting policies through the Manager (SpvLLM §4: H2O and StreamingLLM
// eviction over slot masks, the four strategies of §2.2): end to end against
// an independent reference, the strategies agreeing, the plan() rule, and bad
// input changing nothing.
//
// The reference keeps, per (request, layer, kv head), the list of live tokens
// (position, K, V, cumulative score), attends them by naive dense softmax in
// double and applies the eviction rules as the papers state them:
//  - H2O (Zhang et al. 2023): after a step's attention, a token's score grows
//    by the probability it got, summed over its kv head's GQA group; once
//    live + 1 > budget, the max(1, live + 1 - budget) lowest-scoring tokens
//    (ties: the older) among those out of the recent window (p + budget / 2 <=
//    newest + 1) leave. No sinks.
//  - StreamingLLM (Xiao et al. 2023): 4 sinks; once live + 1 > budget, the
//    oldest tokens after the sinks leave, and a prompt over the budget is cut
//    down at prefill (no attention needed to choose).
// The decisions of a step apply before the next token is placed, so the
// manager's live set after a step equals the set the reference attended.
#include <algorithm>
#include <cmath>
#include <optional>
#include <utility>
#include <vector>

#include "eviction_stream.hpp"
#include "sparsekv/facade/manager_inspection.hpp"
#include "sparsekv/memory/page_layout.hpp"
#include "sparsekv/policy/h2o.hpp"
#include "sparsekv/policy/streaming_eviction.hpp"
#include "sparsekv/sparsekv.hpp"
#include "test_support.hpp"

using namespace sparsekv;
using test::EvictionStream;
using test::live_positions;

namespace {

constexpr std::uint32_t kBudget = 48;
constexpr std::uint32_t kSteps = 200;
constexpr EvictionStrategy kStrategies[] = {EvictionStrategy::no_op, EvictionStrategy::free_block,
                                            EvictionStrategy::sparse_copy, EvictionStrategy::slot_reuse};

enum class Rule { h2o, streaming };

const char* policy_name(Rule rule) { return rule == Rule::h2o ? "h2o" : "streaming_evict"; }

// One prompt below the budget, one above it (H2O's catch-up eviction, the
// StreamingLLM cut at prefill).
EvictionStream stream_of(std::uint32_t seed) { return EvictionStream({30, 70 + seed}, kSteps, seed); }

class Reference {
 public:
  Reference(const EvictionStream& s, Rule rule, std::uint32_t budget)
      : s_(s),
        rule_(rule),
        budget_(budget),
        recent_(rule == Rule::h2o ? budget / 2 : 0),
        sinks_(rule == Rule::h2o ? 0 : 4) {
    const ModelShape& shape = s.shape;
    heads_.resize(s.batch_size() * shape.layers * shape.kv_heads);
    for (std::size_t b = 0; b < s.batch_size(); ++b) {
      for (std::uint32_t l = 0; l < shape.layers; ++l) {
        for (std::uint32_t h = 0; h < shape.kv_heads; ++h) {
          std::vector<Token>& live = head(b, l, h);
          for (std::uint32_t t = 0; t < s.prompts[b]; ++t) {
            const std::size_t at = (std::size_t{t} * shape.kv_heads + h) * shape.head_dim;
            live.push_back({t, &s.prompt_k[b][l][at], &s.prompt_v[b][l][at], 0.0});
          }
          if (rule_ == Rule::streaming) evict(live, s.prompts[b] - 1);
        }
      }
    }
  }

  // Step `step` of `layer`: out [batch][q_heads][head_dim], and the positions
  // each (batch entry, kv head) attended, attended[b * kv_heads + h].
  void decode(std::uint32_t step, std::uint32_t layer, std::vector<double>& out,
              std::vector<std::vector<std::uint32_t>>& attended) {
    const ModelShape& shape = s_.shape;
    const std::uint32_t d = shape.head_dim, group = shape.q_heads / shape.kv_heads;
    const double scale = 1.0f / std::sqrt(static_cast<float>(d));  // the Manager's scale, a float
    out.assign(s_.out_size(), 0.0);
    attended.assign(s_.batch_size() * shape.kv_heads, {});
    for (std::size_t b = 0; b < s_.batch_size(); ++b) {
      const std::uint32_t newest = s_.prompts[b] + step;
      for (std::uint32_t h = 0; h < shape.kv_heads; ++h) {
        std::vector<Token>& live = head(b, layer, h);
        const std::size_t at = (b * shape.kv_heads + h) * d;
        live.push_back({newest, &s_.k[step][layer][at], &s_.v[step][layer][at], 0.0});
        std::vector<double> weight(live.size(), 0.0);
        for (std::uint32_t j = h * group; j < (h + 1) * group; ++j) {
          const float* q = &s_.q[step][layer][(b * shape.q_heads + j) * d];
          std::vector<double> p(live.size());
          for (std::size_t i = 0; i < live.size(); ++i) {
            double dot = 0;
            for (std::uint32_t c = 0; c < d; ++c) dot += double{q[c]} * live[i].k[c];
            p[i] = dot * scale;
          }
          const double top = *std::max_element(p.begin(), p.end());
          double sum = 0;
          for (double& x : p) sum += (x = std::exp(x - top));
          double* o = &out[(b * shape.q_heads + j) * d];
          for (std::size_t i = 0; i < live.size(); ++i) {
            p[i] /= sum;
            weight[i] += p[i];
            for (std::uint32_t c = 0; c < d; ++c) o[c] += p[i] * live[i].v[c];
          }
        }
        // The policy is handed fp32 weights and adds them up in double.
        for (std::size_t i = 0; i < live.size(); ++i) live[i].score += static_cast<float>(weight[i]);
        for (const Token& t : live) attended[b * shape.kv_heads + h].push_back(t.position);
        evict(live, newest);
      }
    }
  }

 private:
  struct Token {
    std::uint32_t position;
    const float* k;
    const float* v;
    double score;
  };

  std::vector<Token>& head(std::size_t b, std::uint32_t layer, std::uint32_t h) {
    return heads_[(b * s_.shape.layers + layer) * s_.shape.kv_heads + h];
  }

  // Drops what the rule drops once token `newest` is live, so that the next
  // token keeps the head within the budget.
  void evict(std::vector<Token>& live, std::uint32_t newest) const {
    if (live.size() + 1 <= budget_) return;
    std::vector<std::size_t> candidates;
    for (std::size_t i = 0; i < live.size(); ++i) {
      if (live[i].position >= sinks_ && live[i].position + recent_ <= newest + 1) candidates.push_back(i);
    }
    const std::size_t count = std::min(std::max<std::size_t>(1, live.size() + 1 - budget_), candidates.size());
    if (rule_ == Rule::h2o) {
      std::stable_sort(candidates.begin(), candidates.end(),
                       [&](std::size_t a, std::size_t b) { return live[a].score < live[b].score; });
    }
    candidates.resize(count);
    std::sort(candidates.begin(), candidates.end());
    for (auto i = candidates.rbegin(); i != candidates.rend(); ++i) live.erase(live.begin() + *i);
  }

  const EvictionStream& s_;
  Rule rule_;
  std::uint32_t budget_, recent_, sinks_;
  std::vector<std::vector<Token>> heads_;  // [batch][layer][kv head]
};

RuntimeManager runtime_manager(const EvictionStream& s, Rule rule, EvictionStrategy strategy) {
  return RuntimeManager(s.shape, s.config(strategy), make_policy(policy_name(rule), kBudget));
}

// Every live set of the manager, [batch][layer][kv head].
template <class M>
std::vector<std::vector<std::uint32_t>> live_sets(const M& m, const EvictionStream& s) {
  std::vector<std::vector<std::uint32_t>> sets;
  for (const RequestId id : s.batch()) {
    for (std::uint32_t l = 0; l < s.shape.layers; ++l) {
      for (std::uint32_t h = 0; h < s.shape.kv_heads; ++h) sets.push_back(live_positions(m, id, l, h));
    }
  }
  return sets;
}

// Runs the whole stream on `m` against the reference.
template <class M>
void run_against_reference(M& m, const EvictionStream& s, Rule rule) {
  Reference ref(s, rule, kBudget);
  s.add_and_prefill(m);
  std::vector<float> out;
  std::vector<double> want;
  std::vector<std::vector<std::uint32_t>> attended;
  std::uint32_t evicted = 0;
  for (std::uint32_t t = 0; t < s.steps; ++t) {
    for (std::uint32_t l = 0; l < s.shape.layers; ++l) {
      CAPTURE(t, l);
      s.decode(m, t, l, out);
      ref.decode(t, l, want, attended);
      for (std::size_t i = 0; i < out.size(); ++i) REQUIRE(std::abs(out[i] - want[i]) <= 1e-5);
      for (std::size_t b = 0; b < s.batch_size(); ++b) {
        for (std::uint32_t h = 0; h < s.shape.kv_heads; ++h) {
          CAPTURE(b, h);
          const std::vector<std::uint32_t>& live = attended[b * s.shape.kv_heads + h];
          REQUIRE(live_positions(m, b + 1, l, h) == live);
          // Only H2O's catch-up step attends a prompt over the budget.
          if (t > 0 || rule == Rule::streaming) REQUIRE(live.size() <= kBudget);
          evicted += s.prompts[b] + t + 1 - static_cast<std::uint32_t>(live.size());
        }
      }
    }
  }
  CHECK(evicted > 0);
  inspect_buffer(m).validate();
}

// The attention an engine's kernel computes from a host-tensor plan: every
// entry of batch entry b's kv heads, slots below the page's token count and
// live in its mask, merged into one softmax per q head (fp32 pages).
std::vector<double> attend_plan(const AttendPlan& plan, const EvictionStream& s, const float* q,
                                std::uint32_t page_tokens, std::uint64_t& dead_slots) {
  const ModelShape& shape = s.shape;
  const std::uint32_t d = shape.head_dim, group = shape.q_heads / shape.kv_heads;
  const PageLayout layout{page_tokens, d, shape.dtype};
  const double scale = 1.0f / std::sqrt(static_cast<float>(d));
  std::vector<double> out(s.out_size(), 0.0);
  for (std::size_t b = 0; b < s.batch_size(); ++b) {
    for (std::uint32_t h = 0; h < shape.kv_heads; ++h) {
      std::vector<const float*> keys, values;
      const std::size_t row = b * shape.kv_heads + h;
      for (std::int64_t e = plan.head_entries[row]; e < plan.head_entries[row + 1]; ++e) {
        for (std::int64_t i = plan.indptr[e]; i < plan.indptr[e + 1]; ++i) {
          const std::uint32_t tokens =
              i + 1 == plan.indptr[e + 1] ? static_cast<std::uint32_t>(plan.last_page_len[e]) : page_tokens;
          const std::byte* page = plan.gpu_tier_base + plan.indices[i] * plan.page_bytes;
          for (std::uint32_t t = 0; t < tokens; ++t) {
            if (!plan.live_masks.empty() && !slot_live(plan.live_masks[i], t)) {
              ++dead_slots;
              continue;
            }
            keys.push_back(reinterpret_cast<const float*>(page + layout.k_offset(t)));
            values.push_back(reinterpret_cast<const float*>(page + layout.v_offset(t)));
          }
        }
      }
      for (std::uint32_t j = h * group; j < (h + 1) * group; ++j) {
        const float* qj = q + (b * shape.q_heads + j) * d;
        std::vector<double> p(keys.size());
        for (std::size_t i = 0; i < keys.size(); ++i) {
          double dot = 0;
          for (std::uint32_t c = 0; c < d; ++c) dot += double{qj[c]} * keys[i][c];
          p[i] = dot * scale;
        }
        const double top = *std::max_element(p.begin(), p.end());
        double sum = 0;
        for (double& x : p) sum += (x = std::exp(x - top));
        for (std::size_t i = 0; i < keys.size(); ++i) {
          for (std::uint32_t c = 0; c < d; ++c) out[(b * shape.q_heads + j) * d + c] += p[i] / sum * values[i][c];
        }
      }
    }
  }
  return out;
}

}  // namespace

TEST_CASE("facade eviction: h2o and streaming_evict end to end against an independent reference",
          "[facade][eviction]") {
  for (const std::uint32_t seed : {1u, 2u, 3u}) {
    const EvictionStream s = stream_of(seed);
    for (const Rule rule : {Rule::h2o, Rule::streaming}) {
      for (const EvictionStrategy strategy : kStrategies) {
        CAPTURE(seed, policy_name(rule), to_string(strategy));
        RuntimeManager m = runtime_manager(s, rule, strategy);
        run_against_reference(m, s, rule);
      }
    }
    {  // the static policy path
      CAPTURE(seed);
      H2OPolicy::Options h2o;
      h2o.budget_tokens = kBudget;
      Manager<H2OPolicy> m(s.shape, s.config(EvictionStrategy::slot_reuse), H2OPolicy(h2o));
      run_against_reference(m, s, Rule::h2o);
      StreamingEvictionPolicy::Options streaming;
      streaming.budget_tokens = kBudget;
      Manager<StreamingEvictionPolicy> ms(s.shape, s.config(EvictionStrategy::free_block),
                                          StreamingEvictionPolicy(streaming));
      run_against_reference(ms, s, Rule::streaming);
    }
  }
}

TEST_CASE("facade eviction: the four strategies give the same outputs; no_op holds the most pages",
          "[facade][eviction]") {
  for (const std::uint32_t seed : {1u, 2u, 3u}) {
    const EvictionStream s = stream_of(seed);
    for (const Rule rule : {Rule::h2o, Rule::streaming}) {
      CAPTURE(seed, policy_name(rule));
      std::vector<RuntimeManager> managers;
      for (const EvictionStrategy strategy : kStrategies) {
        managers.push_back(runtime_manager(s, rule, strategy));
        s.add_and_prefill(managers.back());
      }
      std::vector<float> want, got;
      for (std::uint32_t t = 0; t < s.steps; ++t) {
        for (std::uint32_t l = 0; l < s.shape.layers; ++l) {
          s.decode(managers.back(), t, l, want);
          for (std::size_t i = 0; i + 1 < managers.size(); ++i) {
            CAPTURE(t, l, to_string(kStrategies[i]));
            s.decode(managers[i], t, l, got);
            for (std::size_t j = 0; j < got.size(); ++j) REQUIRE(std::abs(got[j] - want[j]) <= 1e-5f);
            REQUIRE(live_sets(managers[i], s) == live_sets(managers.back(), s));
          }
        }
      }
      std::vector<std::uint64_t> held;
      for (const RuntimeManager& m : managers) {
        std::uint64_t pages = 0;
        for (const RequestId id : s.batch()) pages += inspect_buffer(m).evictor().held_pages(id);
        held.push_back(pages);
        inspect_buffer(m).validate();
      }
      INFO("held pages no_op / free_block / sparse_copy / slot_reuse: " << held[0] << " / " << held[1] << " / "
                                                                        << held[2] << " / " << held[3]);
      CHECK(held[0] >= held[1]);
      CHECK(held[1] >= held[3]);
      // Permanent eviction leaves no_op with every page ever opened, slot_reuse with about the budget.
      CHECK(held[0] > held[3]);
      CHECK(inspect_buffer(managers[2]).tiers().stats.pages_copied > 0);
      CHECK(inspect_buffer(managers[0]).tiers().stats.pages_freed == 0);
    }
  }
}

TEST_CASE("facade eviction: plan() is refused for h2o, changing nothing", "[facade][eviction]") {
  const EvictionStream s = stream_of(4);
  const auto check = [&](auto& m, auto& twin) {
    s.add_and_prefill(m);
    s.add_and_prefill(twin);
    std::vector<float> out, want;
    const std::vector<RequestId> batch = s.batch();
    for (std::uint32_t t = 0; t < 60; ++t) {
      for (std::uint32_t l = 0; l < s.shape.layers; ++l) {
        if (t % 20 == 10) {
          const std::uint64_t held =
              inspect_buffer(m).evictor().held_pages(1) + inspect_buffer(m).evictor().held_pages(2);
          const std::uint32_t length = inspect_buffer(m).admission().sequence_length(1, l);
          REQUIRE_SPARSEKV_ERROR(m.plan(batch, l, s.q[t][l].data(), s.k[t][l].data(), s.v[t][l].data()),
                                 ErrorCode::invalid_argument);
          REQUIRE(inspect_buffer(m).evictor().held_pages(1) + inspect_buffer(m).evictor().held_pages(2) == held);
          REQUIRE(inspect_buffer(m).admission().sequence_length(1, l) == length);
        }
        CAPTURE(t, l);
        s.decode(m, t, l, out);
        s.decode(twin, t, l, want);
        REQUIRE(out == want);
        REQUIRE(live_sets(m, s) == live_sets(twin, s));
      }
    }
  };
  SECTION("RuntimeManager") {
    RuntimeManager m = runtime_manager(s, Rule::h2o, EvictionStrategy::slot_reuse);
    RuntimeManager twin = runtime_manager(s, Rule::h2o, EvictionStrategy::slot_reuse);
    check(m, twin);
  }
  SECTION("Manager<H2OPolicy>") {
    H2OPolicy::Options o;
    o.budget_tokens = kBudget;
    const Config c = s.config(EvictionStrategy::slot_reuse);
    Manager<H2OPolicy> m(s.shape, c, H2OPolicy(o)), twin(s.shape, c, H2OPolicy(o));
    check(m, twin);
  }
}

TEST_CASE("facade eviction: streaming_evict's plan() carries live masks an engine's kernel can attend",
          "[facade][eviction]") {
  for (const EvictionStrategy strategy : kStrategies) {
    CAPTURE(to_string(strategy));
    const EvictionStream s = stream_of(5);
    RuntimeManager m = runtime_manager(s, Rule::streaming, strategy);
    RuntimeManager twin = runtime_manager(s, Rule::streaming, strategy);
    s.add_and_prefill(m);
    s.add_and_prefill(twin);
    const std::vector<RequestId> batch = s.batch();
    std::vector<float> want;
    std::uint64_t dead_slots = 0;
    for (std::uint32_t t = 0; t < s.steps; ++t) {
      for (std::uint32_t l = 0; l < s.shape.layers; ++l) {
        CAPTURE(t, l);
        const AttendPlan& plan = m.plan(batch, l, s.q[t][l].data(), s.k[t][l].data(), s.v[t][l].data());
        REQUIRE(plan.live_masks.size() == plan.indices.size());
        REQUIRE(plan.extra.empty());
        const std::vector<double> got = attend_plan(plan, s, s.q[t][l].data(), 8, dead_slots);
        s.decode(twin, t, l, want);
        for (std::size_t i = 0; i < want.size(); ++i) REQUIRE(std::abs(got[i] - want[i]) <= 1e-5);
        REQUIRE(live_sets(m, s) == live_sets(twin, s));
      }
    }
    // Masks mattered: the plans listed dead slots below their pages' token
    // counts (sparse_copy compacts at every eviction: it leaves none).
    CHECK((dead_slots > 0) == (strategy != EvictionStrategy::sparse_copy));
  }
}

TEST_CASE("facade eviction: bad input is refused", "[facade][eviction]") {
  const EvictionStream s = stream_of(6);
  SECTION("page_tokens above one 64-bit slot mask") {
    Config c = s.config(EvictionStrategy::slot_reuse);
    c.page_tokens = 128;
    for (const Rule rule : {Rule::h2o, Rule::streaming}) {
      REQUIRE_SPARSEKV_ERROR(RuntimeManager(s.shape, c, make_policy(policy_name(rule), kBudget)),
                             ErrorCode::invalid_argument);
    }
    H2OPolicy::Options o;
    o.budget_tokens = kBudget;
    REQUIRE_SPARSEKV_ERROR(Manager<H2OPolicy>(s.shape, c, H2OPolicy(o)), ErrorCode::invalid_argument);
    // The limit is the masks': a policy that keeps every token takes such pages.
    RuntimeManager dense(s.shape, c, make_policy("dense", kBudget));
    CHECK(inspect_buffer(dense).tiers().config.page_tokens == 128);
  }
  SECTION("budgets below the protected window") {
    REQUIRE_SPARSEKV_ERROR(make_policy("streaming_evict", 4), ErrorCode::invalid_argument);
    REQUIRE_SPARSEKV_ERROR(make_policy("h2o", 0), ErrorCode::invalid_argument);
    H2OPolicy::Options o;
    o.budget_tokens = 8;
    o.sink_tokens = 4;
    o.recent_tokens = 5;
    REQUIRE_SPARSEKV_ERROR(H2OPolicy{o}, ErrorCode::invalid_argument);
  }
}

TEST_CASE("facade eviction: a refused decode changes nothing; the step goes on as if never tried",
          "[facade][eviction]") {
  for (const Rule rule : {Rule::h2o, Rule::streaming}) {
    CAPTURE(policy_name(rule));
    const EvictionStream s = stream_of(7);
    RuntimeManager m = runtime_manager(s, rule, EvictionStrategy::slot_reuse);
    RuntimeManager twin = runtime_manager(s, rule, EvictionStrategy::slot_reuse);
    s.add_and_prefill(m);
    s.add_and_prefill(twin);
    const std::vector<RequestId> batch = s.batch();
    std::vector<float> out, want;
    std::vector<float> bad_k;
    for (std::uint32_t t = 0; t < 80; ++t) {
      for (std::uint32_t l = 0; l < s.shape.layers; ++l) {
        CAPTURE(t, l);
        if (t % 10 == 5) {
          // A non-finite key for the second request: checked before the first request's eviction applies.
          bad_k = s.k[t][l];
          bad_k.back() = NAN;
          out.assign(s.out_size(), 0.0f);
          REQUIRE_SPARSEKV_ERROR(m.decode(batch, l, s.q[t][l].data(), bad_k.data(), s.v[t][l].data(), out.data()),
                                 ErrorCode::invalid_argument);
          // The same request twice.
          const std::vector<RequestId> twice{1, 1};
          REQUIRE_SPARSEKV_ERROR(m.decode(twice, l, s.q[t][l].data(), s.k[t][l].data(), s.v[t][l].data(), out.data()),
                                 ErrorCode::invalid_argument);
        }
        s.decode(m, t, l, out);
        s.decode(twin, t, l, want);
        REQUIRE(out == want);
        REQUIRE(live_sets(m, s) == live_sets(twin, s));
      }
    }
  }
}

TEST_CASE("facade eviction: a step the CPU tier cannot hold is refused; it runs once room is freed",
          "[facade][eviction]") {
  // Requests 1 and 2 decode in one batch; request 3 only fills the CPU tier
  // until it finishes.
  const EvictionStream a({8, 8}, 120, 8);
  Config c = a.config(EvictionStrategy::slot_reuse);
  const std::size_t page = c.page_bytes(a.shape);
  c.cpu_tier_bytes = 66 * page;
  c.host_chunk_bytes = 2 * page;
  const auto make = [&] { return RuntimeManager(a.shape, c, make_policy("h2o", kBudget)); };
  // Request 3's prompt leaves 14 CPU pages once the batch's prompts (a page
  // per head, 8 heads) are in: step 0 opens a page in each of the 8 heads,
  // step 8 one in each of the 4 heads of layer 0, and layer 1 of step 8 is
  // refused (after layer 0 of the same step has committed): there is room
  // for request 1's 2 pages, not for request 2's.
  const std::uint64_t heads = std::uint64_t{a.shape.layers} * a.shape.kv_heads;  // per request
  const std::uint64_t pool = inspect_buffer(make()).tiers().cpu_pool.available();
  const std::uint64_t taken = 2 * heads + 2 * heads + 2 * a.shape.kv_heads + a.shape.kv_heads;
  REQUIRE(pool > taken);
  REQUIRE((pool - taken) % heads == 0);
  const EvictionStream filler({static_cast<std::uint32_t>(8 * ((pool - taken) / heads))}, 0, 9, 3);

  // (step, layer) of the refusal, then the same stream on a twin that
  // finishes request 3 there without trying.
  std::optional<std::pair<std::uint32_t, std::uint32_t>> refused;
  std::vector<std::vector<float>> outputs;
  {
    RuntimeManager m = make();
    a.add_and_prefill(m);
    filler.add_and_prefill(m);
    std::vector<float> out;
    for (std::uint32_t t = 0; t < a.steps; ++t) {
      for (std::uint32_t l = 0; l < a.shape.layers; ++l) {
        if (!refused) {
          const std::uint64_t available = inspect_buffer(m).tiers().cpu_pool.available();
          const std::uint64_t held =
              inspect_buffer(m).evictor().held_pages(1) + inspect_buffer(m).evictor().held_pages(2);
          const std::vector<std::vector<std::uint32_t>> live = live_sets(m, a);
          const std::uint32_t length =
              inspect_buffer(m).admission().sequence_length(1, l) + inspect_buffer(m).admission().sequence_length(2, l);
          try {
            a.decode(m, t, l, out);
          } catch (const Error& e) {
            INFO(e.what());
            REQUIRE(e.code() == ErrorCode::resource_exhausted);
            refused = {t, l};
            REQUIRE(inspect_buffer(m).tiers().cpu_pool.available() == available);
            REQUIRE(inspect_buffer(m).evictor().held_pages(1) + inspect_buffer(m).evictor().held_pages(2) == held);
            REQUIRE(live_sets(m, a) == live);
            REQUIRE(inspect_buffer(m).admission().sequence_length(1, l) +
                        inspect_buffer(m).admission().sequence_length(2, l) ==
                    length);
            inspect_buffer(m).validate();
            m.finish(3);
          }
          if (!refused) {
            outputs.push_back(out);
            continue;
          }
        }
        a.decode(m, t, l, out);
        outputs.push_back(out);
      }
    }
    REQUIRE(refused == std::pair{8u, 1u});
  }
  RuntimeManager twin = make();
  a.add_and_prefill(twin);
  filler.add_and_prefill(twin);
  std::vector<float> out;
  std::size_t i = 0;
  for (std::uint32_t t = 0; t < a.steps; ++t) {
    for (std::uint32_t l = 0; l < a.shape.layers; ++l, ++i) {
      if (std::pair{t, l} == *refused) twin.finish(3);
      CAPTURE(t, l);
      a.decode(twin, t, l, out);
      REQUIRE(out == outputs[i]);
    }
  }
}
