// The engine-facing facade: many concurrent requests of mixed lengths arriving
// and finishing at random steps, every built-in policy, checked against dense
// attention computed directly on the full K/V.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "attention_test_data.hpp"
#include "sparsekv/core/numeric.hpp"
#include "sparsekv/facade/manager_inspection.hpp"
#include "sparsekv/policy/retroinfer.hpp"
#include "deferred_backend.hpp"
#include "sparsekv/sparsekv.hpp"
#include "test_support.hpp"

using namespace sparsekv;
using sparsekv::test::DeferredBackend;

namespace {

// Three layers: Quest keeps its first two dense (its paper's default), the third is sparse.
constexpr ModelShape kShape{3, 8, 2, 16, DType::bf16};
constexpr std::uint32_t kD = kShape.head_dim;
constexpr std::uint32_t kRow = kShape.kv_heads * kD;

Config facade_config() {
  Config c;
  c.page_tokens = 8;
  c.max_requests = 24;
  c.max_context_tokens = 1024;
  c.min_buffer_ratio = 1.0;
  const std::size_t page = c.page_bytes(kShape);
  const std::size_t heads = std::size_t{24} * kShape.layers * kShape.kv_heads;
  c.cpu_tier_bytes = heads * 200 * page;
  c.gpu_tier_bytes = heads * 260 * page;
  c.host_chunk_bytes = 256 * page;
  return c;
}

// A request's tokens as bf16 (what the engine hands over) and as the floats they round to.
struct Tokens {
  std::vector<std::uint16_t> k, v;  // [token][kv_head][d]
  void add(std::mt19937& rng, std::uint32_t n) {
    std::normal_distribution<float> normal;
    for (std::uint32_t i = 0; i < n * kRow; ++i) {
      k.push_back(float_to_bf16(normal(rng)));
      v.push_back(float_to_bf16(normal(rng)));
    }
  }
  std::uint32_t count() const { return static_cast<std::uint32_t>(k.size() / kRow); }
};

// Dense attention of one q head (bf16 query) over every token, in fp64.
std::vector<double> dense(const std::uint16_t* q, const Tokens& t, std::uint32_t kv_head) {
  std::vector<double> scores(t.count());
  double max = -1e300;
  for (std::uint32_t i = 0; i < t.count(); ++i) {
    double s = 0;
    for (std::uint32_t d = 0; d < kD; ++d)
      s += double(bf16_to_float(q[d])) * bf16_to_float(t.k[(i * kShape.kv_heads + kv_head) * kD + d]);
    scores[i] = s / std::sqrt(double(kD));
    max = std::max(max, scores[i]);
  }
  std::vector<double> out(kD, 0.0);
  double sum = 0;
  for (std::uint32_t i = 0; i < t.count(); ++i) {
    const double p = std::exp(scores[i] - max);
    sum += p;
    for (std::uint32_t d = 0; d < kD; ++d) out[d] += p * bf16_to_float(t.v[(i * kShape.kv_heads + kv_head) * kD + d]);
  }
  for (double& x : out) x /= sum;
  return out;
}

struct RunResult {
  double worst_error = 0;
  std::uint64_t selected_pages = 0;
  std::size_t peak_concurrent = 0;
  std::size_t finished = 0;
};

// 16 requests from the start, more arriving, each decoding a random number of
// steps; every step of every layer is compared with dense attention.
RunResult run(RuntimeManager& manager, std::uint32_t seed, std::vector<float>* outputs = nullptr) {
  std::mt19937 rng(seed);
  std::map<RequestId, std::vector<Tokens>> live;  // per layer
  std::map<RequestId, std::uint32_t> steps_left;
  RunResult result;
  RequestId next = 100;
  const auto arrive = [&] {
    const RequestId id = next++;
    const std::uint32_t prompt = 9 + rng() % 300;
    const std::uint32_t decode = 5 + rng() % 40;
    REQUIRE(manager.can_admit(prompt, prompt + decode).admit);
    manager.add_request(id, prompt + decode);
    auto& layers = live[id];
    layers.resize(kShape.layers);
    for (std::uint32_t l = 0; l < kShape.layers; ++l) {
      layers[l].add(rng, prompt);
      manager.prefill(id, l, layers[l].k.data(), layers[l].v.data(), prompt);
    }
    steps_left[id] = decode;
  };
  for (int i = 0; i < 16; ++i) arrive();
  for (int step = 0; !live.empty(); ++step) {
    if (step < 30 && rng() % 3 == 0) arrive();
    result.peak_concurrent = std::max(result.peak_concurrent, live.size());
    std::vector<RequestId> batch;
    for (const auto& [id, layers] : live) batch.push_back(id);
    for (std::uint32_t l = 0; l < kShape.layers; ++l) {
      std::vector<std::uint16_t> q(batch.size() * kShape.q_heads * kD), k_new, v_new;
      std::normal_distribution<float> normal;
      for (auto& x : q) x = float_to_bf16(normal(rng));
      for (RequestId id : batch) {
        Tokens& t = live[id][l];
        t.add(rng, 1);
        k_new.insert(k_new.end(), t.k.end() - kRow, t.k.end());
        v_new.insert(v_new.end(), t.v.end() - kRow, t.v.end());
      }
      std::vector<float> out(q.size());
      manager.decode(batch, l, q.data(), k_new.data(), v_new.data(), out.data());
      if (outputs != nullptr) outputs->insert(outputs->end(), out.begin(), out.end());
      for (std::size_t b = 0; b < batch.size(); ++b) {
        const Retrieval& r = manager.retrieval(b);
        result.selected_pages += r.pages.gpu_pages.size();
        for (std::uint32_t h = 0; h < kShape.q_heads; ++h) {
          const auto want = dense(q.data() + (b * kShape.q_heads + h) * kD, live[batch[b]][l], h / kShape.group_size());
          double num = 0, den = 0;
          for (std::uint32_t d = 0; d < kD; ++d) {
            num += std::pow(out[(b * kShape.q_heads + h) * kD + d] - want[d], 2);
            den += want[d] * want[d];
          }
          result.worst_error = std::max(result.worst_error, std::sqrt(num / den));
        }
      }
    }
    for (RequestId id : batch) {
      if (--steps_left[id] == 0) {
        manager.finish(id);
        live.erase(id);
        steps_left.erase(id);
        ++result.finished;
      }
    }
  }
  return result;
}

}  // namespace

TEST_CASE("Manager: a backend that defers every copy gives the host backend's outputs bit for bit", "[facade]") {
  // Every built-in policy, plus RetroInfer re-clustering every 16 decode
  // tokens so that regroups read CPU pages saved in the same step.
  RetroInferPolicy::Options o;
  o.budget_tokens = 64;
  o.segment_tokens = 32;
  o.tokens_per_cluster = 8;
  o.window_tokens = 8;
  o.update_tokens = 16;
  std::vector<std::pair<std::string, std::function<AnyPolicy()>>> policies;
  for (const std::string& name : policy_names()) policies.emplace_back(name, [name] { return make_policy(name, 64); });
  policies.emplace_back("retroinfer, frequent regroups", [o] { return AnyPolicy(RetroInferPolicy(o)); });
  for (const auto& [name, make] : policies) {
    INFO(name);
    RuntimeManager host(kShape, facade_config(), make());
    auto backend = std::make_unique<DeferredBackend>();
    DeferredBackend& deferred = *backend;
    RuntimeManager async(kShape, facade_config(), make(), std::move(backend));
    REQUIRE(async.backend().name() == "deferred");
    std::vector<float> want, got;
    run(host, 8, &want);
    run(async, 8, &got);
    REQUIRE(got.size() == want.size());
    REQUIRE(std::memcmp(got.data(), want.data(), got.size() * sizeof(float)) == 0);
    REQUIRE(async.stats().pages_moved == host.stats().pages_moved);
    REQUIRE(deferred.transfer_.synchronizations > 0);
    REQUIRE(inspect_buffer(async).tiers().cpu_pool.used() == 0);
    REQUIRE(inspect_buffer(async).tiers().gpu_pool.used() == 0);
  }
}

TEST_CASE("Manager: a moved Manager decodes on as if it had not moved", "[facade]") {
  // Its steps are rebound to it: the same outputs, selections and hits as
  // a Manager that never moved, and its requests finish cleanly.
  for (const std::string& name : {std::string("quest"), std::string("h2o")}) {
    INFO(name);
    RuntimeManager still(kShape, facade_config(), make_policy(name, 64));
    auto first = std::make_unique<RuntimeManager>(kShape, facade_config(), make_policy(name, 64));
    std::mt19937 rng(3);
    const std::vector<RequestId> batch{4, 9};
    for (const RequestId id : batch) {
      Tokens t;
      t.add(rng, 90 + 20 * static_cast<std::uint32_t>(id));
      for (RuntimeManager* m : {&still, first.get()}) {
        m->add_request(id, 400);
        for (std::uint32_t l = 0; l < kShape.layers; ++l) m->prefill(id, l, t.k.data(), t.v.data(), t.count());
      }
    }
    std::optional<RuntimeManager> moved;
    for (int step = 0; step < 24; ++step) {
      if (step == 9) moved.emplace(std::move(*first));  // mid-run, tails part-filled
      RuntimeManager& m = step < 9 ? *first : *moved;
      Tokens t;
      t.add(rng, static_cast<std::uint32_t>(batch.size()));
      std::vector<std::uint16_t> q(batch.size() * kShape.q_heads * kD);
      std::normal_distribution<float> normal;
      for (auto& x : q) x = float_to_bf16(normal(rng));
      for (std::uint32_t l = 0; l < kShape.layers; ++l) {
        std::vector<float> want(q.size()), got(q.size());
        still.decode(batch, l, q.data(), t.k.data(), t.v.data(), want.data());
        m.decode(batch, l, q.data(), t.k.data(), t.v.data(), got.data());
        REQUIRE(std::memcmp(got.data(), want.data(), got.size() * sizeof(float)) == 0);
        for (std::size_t b = 0; b < batch.size(); ++b)
          REQUIRE(m.retrieval(b).partitions == still.retrieval(b).partitions);
      }
    }
    REQUIRE(moved->stats().cache.hit_partitions == still.stats().cache.hit_partitions);
    for (const RequestId id : batch) {
      moved->finish(id);
      still.finish(id);
    }
    REQUIRE(inspect_buffer(*moved).tiers().cpu_pool.used() == 0);
    REQUIRE(inspect_buffer(*moved).tiers().gpu_pool.used() == 0);
  }
}

// A typed stream handle, as cudaStream_t (CUstream_st*) is, without CUDA.
struct FakeStream;
static_assert(std::is_convertible_v<FakeStream*, DeviceStream>);
static_assert(std::is_convertible_v<void*, DeviceStream>);
static_assert(!std::is_convertible_v<std::nullptr_t, DeviceStream>);
static_assert(!std::is_convertible_v<float, DeviceStream>);

TEST_CASE("Manager: a bare nullptr or {} as the last argument picks the host call, never the device one", "[facade]") {
  // Host tensors through a Manager on the host backend: the device overloads
  // refuse them (no device runtime; host tensors latched by the first
  // prefill), so each call below reaching the host call and matching the
  // plain one is what is checked.
  RuntimeManager plain(kShape, facade_config(), make_policy("quest", 64));
  RuntimeManager spelled(kShape, facade_config(), make_policy("quest", 64));
  std::mt19937 rng(5);
  Tokens t;
  t.add(rng, 120);
  const std::vector<RequestId> batch{1};
  for (RuntimeManager* m : {&plain, &spelled}) m->add_request(1, 400);
  for (std::uint32_t l = 0; l < kShape.layers; ++l) {
    plain.prefill(1, l, t.k.data(), t.v.data(), t.count());
    spelled.prefill(1, l, t.k.data(), t.v.data(), t.count(), {});
  }
  for (int step = 0; step < 4; ++step) {
    Tokens next;
    next.add(rng, 1);
    std::vector<std::uint16_t> q(std::size_t{kShape.q_heads} * kD);
    std::normal_distribution<float> normal;
    for (auto& x : q) x = float_to_bf16(normal(rng));
    for (std::uint32_t l = 0; l < kShape.layers; ++l) {
      std::vector<float> want(q.size()), got(q.size());
      plain.decode(batch, l, q.data(), next.k.data(), next.v.data(), want.data());
      if (step % 2 == 0) {
        spelled.decode(batch, l, q.data(), next.k.data(), next.v.data(), got.data(), nullptr);
      } else {
        spelled.decode(batch, l, q.data(), next.k.data(), next.v.data(), got.data(), {});
      }
      REQUIRE(std::memcmp(got.data(), want.data(), got.size() * sizeof(float)) == 0);
    }
  }
  // A typed stream does pick the device call, which the host backend refuses.
  FakeStream* const stream = nullptr;
  std::vector<float> out(std::size_t{kShape.q_heads} * kD);
  std::vector<std::uint16_t> q(out.size()), k(kRow), v(kRow);
  REQUIRE_SPARSEKV_ERROR(spelled.decode(batch, 0, q.data(), k.data(), v.data(), out.data(), stream),
                         ErrorCode::failed_precondition);
}

TEST_CASE("Manager: a shape the backend's Attend cannot run is refused before the step changes anything",
          "[facade][errors]") {
  auto backend = std::make_unique<DeferredBackend>();
  backend->refused_head_dim = kD;
  RuntimeManager manager(kShape, facade_config(), make_policy("quest", 64), std::move(backend));
  std::mt19937 rng(4);
  Tokens t;
  t.add(rng, 41);
  manager.add_request(1, 64);
  for (std::uint32_t l = 0; l < kShape.layers; ++l) manager.prefill(1, l, t.k.data(), t.v.data(), 40);
  std::vector<std::uint16_t> q(kShape.q_heads * kD, float_to_bf16(0.25f));
  std::vector<float> out(q.size());
  const std::vector<RequestId> one{1};
  const std::uint16_t* k_new = t.k.data() + 40 * kRow;
  const std::uint16_t* v_new = t.v.data() + 40 * kRow;
  REQUIRE_SPARSEKV_ERROR(manager.decode(one, 0, q.data(), k_new, v_new, out.data()), ErrorCode::invalid_argument);
  REQUIRE(inspect_buffer(manager).admission().sequence_length(1, 0) == 40);
  REQUIRE(manager.stats().decode_steps == 0);
  manager.plan(one, 0, q.data(), k_new, v_new);  // the engine's own kernel serves any shape
  REQUIRE(inspect_buffer(manager).admission().sequence_length(1, 0) == 41);
}

TEST_CASE("Manager: a null backend is refused", "[facade][errors]") {
  REQUIRE_SPARSEKV_ERROR(RuntimeManager(kShape, facade_config(), make_policy("dense", 64), nullptr),
                         ErrorCode::invalid_argument);
}

TEST_CASE("Manager: concurrent requests, every policy, against dense attention", "[facade]") {
  for (const std::string& name : policy_names()) {
    INFO(name);
    // A budget covering every request's context: each policy equals Dense.
    RuntimeManager full(kShape, facade_config(), make_policy(name, 1024));
    const RunResult exact = run(full, 7);
    REQUIRE(exact.peak_concurrent >= 16);
    REQUIRE(exact.worst_error < 1e-5);
    REQUIRE(full.stats().cache.hit_pages + full.stats().cache.miss_pages == exact.selected_pages);
    REQUIRE(inspect_buffer(full).tiers().cpu_pool.used() == 0);  // nothing leaks
    REQUIRE(inspect_buffer(full).tiers().gpu_pool.used() == 0);
    // A sparse budget: no crash, no leak, consistent stats, approximate outputs.
    RuntimeManager sparse(kShape, facade_config(), make_policy(name, 64));
    const RunResult approx = run(sparse, 8);
    REQUIRE(approx.finished >= 16);
    REQUIRE(sparse.stats().cache.hit_pages + sparse.stats().cache.miss_pages == approx.selected_pages);
    REQUIRE(sparse.stats().pages_moved == sparse.stats().cache.miss_pages);
    REQUIRE(inspect_buffer(sparse).tiers().cpu_pool.used() == 0);
    REQUIRE(inspect_buffer(sparse).tiers().gpu_pool.used() == 0);
    inspect_buffer(sparse).validate();
    if (name != "dense") REQUIRE(approx.worst_error > 1e-4);  // sparse budgets really are sparse
  }
}

TEST_CASE("Manager: AttendPlan runs are FlashInfer-shaped and cover exactly the retrieved pages", "[facade]") {
  Manager<DensePolicy> manager(kShape, facade_config(), DensePolicy{});
  std::mt19937 rng(3);
  Tokens t;
  t.add(rng, 21);  // two full pages and a partial one
  manager.add_request(1, 64);
  for (std::uint32_t l = 0; l < kShape.layers; ++l) manager.prefill(1, l, t.k.data(), t.v.data(), 21);
  std::vector<std::uint16_t> q(kShape.q_heads * kD, float_to_bf16(0.5f));
  const std::vector<RequestId> batch{1};
  const std::uint16_t* k_new = t.k.data();
  const AttendPlan& plan = manager.plan(batch, 0, q.data(), k_new, t.v.data());
  // Per kv head: [p0 p1 p2(5 tokens)] then the tail (1 token): two runs.
  REQUIRE(plan.head_entries == std::vector<std::int64_t>{0, 2, 4});
  REQUIRE(plan.entries() == 4);
  REQUIRE(plan.last_page_len == std::vector<std::int32_t>{5, 1, 5, 1});
  REQUIRE(plan.indptr == std::vector<std::int64_t>{0, 3, 4, 7, 8});
  REQUIRE(plan.gpu_tier_base != nullptr);
  const Retrieval& r = manager.retrieval(0);
  REQUIRE(plan.indices[0] == r.pages.gpu_pages[0]);
  REQUIRE(plan.indices[3] == r.tail_pages[0]);
  REQUIRE(plan.gpu_tier_base + plan.indices[1] * plan.page_bytes ==
          inspect_buffer(manager).tiers().gpu_pool.data(r.pages.gpu_pages[1]));
}

TEST_CASE("Device-backend Attend: the kernel's walk over a plan's runs equals the host backend's Attend", "[facade]") {
  // The CUDA backend hands the plan to one launch as is (row_entries =
  // head_entries, extra as DecodeAttentionExtra); the host emulation of that
  // launch (attention_test_data.hpp) stands in for the kernel.
  bool several_runs = false, extra_terms = false;
  for (const std::string& name : policy_names()) {
    INFO(name);
    RuntimeManager manager(kShape, facade_config(), make_policy(name, 64));
    std::mt19937 rng(21);
    std::vector<RequestId> batch;
    std::vector<Tokens> tokens(3);
    for (RequestId id = 1; id <= 3; ++id) {
      const std::uint32_t prompt = 37 + 90 * static_cast<std::uint32_t>(id);
      manager.add_request(id, prompt + 8);
      tokens[id - 1].add(rng, prompt + 1);
      for (std::uint32_t l = 0; l < kShape.layers; ++l) {
        manager.prefill(id, l, tokens[id - 1].k.data(), tokens[id - 1].v.data(), prompt);
      }
      batch.push_back(id);
    }
    const std::uint32_t layer = kShape.layers - 1;  // sparse in every policy
    std::vector<std::uint16_t> q(batch.size() * kShape.q_heads * kD), k_new, v_new;
    std::normal_distribution<float> normal;
    for (auto& x : q) x = float_to_bf16(normal(rng));
    for (const Tokens& t : tokens) {
      k_new.insert(k_new.end(), t.k.end() - kRow, t.k.end());
      v_new.insert(v_new.end(), t.v.end() - kRow, t.v.end());
    }
    const AttendPlan& plan = manager.plan(batch, layer, q.data(), k_new.data(), v_new.data());
    std::vector<float> qf(q.size());
    for (std::size_t i = 0; i < q.size(); ++i) qf[i] = bf16_to_float(q[i]);
    AttendCall call;
    call.plan = &plan;
    call.layout = inspect_buffer(manager).tiers().gpu_pool.layout();
    call.batch = static_cast<std::uint32_t>(batch.size());
    call.q_heads = kShape.q_heads;
    call.kv_heads = kShape.kv_heads;
    call.scale = 1.0f / std::sqrt(float(kD));
    call.q = qf.data();
    std::vector<float> want(q.size()), got(q.size(), -1.0f);
    call.out = want.data();
    HostBackend().attend(call);

    // The GPU tier up to the last page the plan reads, and the plan's arrays as they are.
    test::AttentionBatch b;
    b.batch = call.batch;
    b.q_heads = call.q_heads;
    b.kv_heads = call.kv_heads;
    b.layout = call.layout;
    b.stride = plan.page_bytes;
    b.scale = call.scale;
    const std::int64_t pages =
        plan.indices.empty() ? 0 : *std::max_element(plan.indices.begin(), plan.indices.end()) + 1;
    b.pool.assign(plan.gpu_tier_base, plan.gpu_tier_base + pages * plan.page_bytes);
    b.indptr = plan.indptr;
    b.indices = plan.indices;
    b.last_page_len = plan.last_page_len;
    b.row_entries = plan.head_entries;
    b.q = qf;
    b.extra = plan.extra;
    for (std::size_t r = 0; r + 1 < plan.head_entries.size(); ++r) {
      const auto row_pages = plan.indptr[plan.head_entries[r + 1]] - plan.indptr[plan.head_entries[r]];
      b.max_pages = std::max(b.max_pages, static_cast<std::uint32_t>(row_pages));
    }
    for (const std::uint32_t chunk_pages : {0u, 1u, 3u}) {
      const cuda::DecodeAttentionShape shape{b.batch, b.q_heads, b.kv_heads, b.layout, b.max_pages, chunk_pages};
      std::vector<float> got_lse;
      test::emulate_split_k(b, cuda::split_decode_attention(shape, 4096), got, got_lse);
      INFO("chunk_pages " << chunk_pages);
      for (std::size_t i = 0; i < want.size(); ++i)
        REQUIRE(std::abs(got[i] - want[i]) <= 1e-5f * (1.0f + std::abs(want[i])));
    }
    for (std::size_t h = 0; h + 1 < plan.head_entries.size(); ++h) {
      several_runs |= plan.head_entries[h + 1] - plan.head_entries[h] > 1;
    }
    extra_terms |= !plan.extra.empty();
  }
  REQUIRE(several_runs);  // heads with a partial page mid-selection or a separate tail run
  REQUIRE(extra_terms);   // RetroInfer's estimation zone
}

TEST_CASE("Manager: a request is booked once, in the buffer, and leaves with its pages", "[facade]") {
  Manager<DensePolicy> manager(kShape, facade_config(), DensePolicy{});
  std::mt19937 rng(5);
  Tokens t;
  t.add(rng, 20);
  const BufferAdmission& admission = inspect_buffer(manager).admission();
  manager.add_request(1, 100);
  manager.add_request(2, 100);
  REQUIRE(admission.request_ids() == std::vector<RequestId>{1, 2});
  REQUIRE(admission.attachment(1) != nullptr);  // the step layer's books ride in the buffer's entry
  REQUIRE_SPARSEKV_ERROR(manager.add_request(2, 100), ErrorCode::already_exists);
  REQUIRE_SPARSEKV_ERROR(manager.add_request(3, facade_config().max_context_tokens + 1), ErrorCode::invalid_argument);
  REQUIRE(admission.request_ids() == std::vector<RequestId>{1, 2});
  manager.prefill(2, 0, t.k.data(), t.v.data(), 20);
  REQUIRE(manager.held_tokens(2, 0) == 20);
  const std::uint32_t used = manager.tier_usage().cpu.used;
  REQUIRE(used > 0);
  manager.finish(2);
  REQUIRE_FALSE(manager.has_request(2));
  REQUIRE(admission.request_ids() == std::vector<RequestId>{1});
  REQUIRE(manager.tier_usage().cpu.used == 0);
  REQUIRE_SPARSEKV_ERROR(manager.held_tokens(2, 0), ErrorCode::not_found);
  REQUIRE_SPARSEKV_ERROR(manager.finish(2), ErrorCode::not_found);
  inspect_buffer(manager).validate();
}

TEST_CASE("Manager: bad input is refused and changes nothing", "[facade][errors]") {
  Manager<DensePolicy> manager(kShape, facade_config(), DensePolicy{});
  std::mt19937 rng(4);
  Tokens t;
  t.add(rng, 40);
  std::vector<std::uint16_t> q(2 * kShape.q_heads * kD, 0);
  std::vector<float> out(q.size());
  manager.add_request(1, 100);
  manager.add_request(2, 100);
  const std::vector<RequestId> one{1}, both{1, 2}, twice{1, 1}, unknown{1, 9};
  // Decode before prefill.
  REQUIRE_SPARSEKV_ERROR(manager.decode(one, 0, q.data(), t.k.data(), t.v.data(), out.data()),
                         ErrorCode::failed_precondition);
  for (std::uint32_t l = 0; l < kShape.layers; ++l) manager.prefill(1, l, t.k.data(), t.v.data(), 40);
  manager.prefill(2, 0, t.k.data(), t.v.data(), 40);
  REQUIRE_SPARSEKV_ERROR(manager.prefill(1, 0, t.k.data(), t.v.data(), 40), ErrorCode::failed_precondition);
  REQUIRE_SPARSEKV_ERROR(manager.prefill(2, 1, t.k.data(), t.v.data(), 0), ErrorCode::invalid_argument);
  REQUIRE_SPARSEKV_ERROR(manager.prefill(2, 1, nullptr, t.v.data(), 4), ErrorCode::invalid_argument);
  REQUIRE_SPARSEKV_ERROR(manager.prefill(2, kShape.layers, t.k.data(), t.v.data(), 4), ErrorCode::out_of_range);
  REQUIRE_SPARSEKV_ERROR(manager.prefill(2, 1, t.k.data(), t.v.data(), 101), ErrorCode::resource_exhausted);
  const std::uint32_t seq = inspect_buffer(manager).admission().sequence_length(1, 1);
  // Layer 1 of request 2 is not prefilled: the whole batch is refused, request 1 untouched.
  REQUIRE_SPARSEKV_ERROR(manager.decode(both, 1, q.data(), t.k.data(), t.v.data(), out.data()),
                         ErrorCode::failed_precondition);
  REQUIRE(inspect_buffer(manager).admission().sequence_length(1, 1) == seq);
  REQUIRE_SPARSEKV_ERROR(manager.decode(twice, 0, q.data(), t.k.data(), t.v.data(), out.data()),
                         ErrorCode::invalid_argument);
  REQUIRE_SPARSEKV_ERROR(manager.decode(unknown, 0, q.data(), t.k.data(), t.v.data(), out.data()),
                         ErrorCode::not_found);
  REQUIRE_SPARSEKV_ERROR(manager.decode(one, 0, nullptr, t.k.data(), t.v.data(), out.data()),
                         ErrorCode::invalid_argument);
  REQUIRE_SPARSEKV_ERROR(manager.decode(one, 0, q.data(), t.k.data(), t.v.data(), nullptr),
                         ErrorCode::invalid_argument);
  REQUIRE_SPARSEKV_ERROR(manager.decode({}, 0, q.data(), t.k.data(), t.v.data(), out.data()),
                         ErrorCode::invalid_argument);
  q[3] = float_to_bf16(std::nanf(""));
  REQUIRE_SPARSEKV_ERROR(manager.decode(one, 0, q.data(), t.k.data(), t.v.data(), out.data()),
                         ErrorCode::invalid_argument);
  q[3] = 0;
  REQUIRE(inspect_buffer(manager).admission().sequence_length(1, 0) == 40);
  manager.decode(one, 0, q.data(), t.k.data(), t.v.data(), out.data());
  REQUIRE(inspect_buffer(manager).admission().sequence_length(1, 0) == 41);
  // A finished request is gone.
  manager.finish(1);
  REQUIRE_SPARSEKV_ERROR(manager.decode(one, 0, q.data(), t.k.data(), t.v.data(), out.data()), ErrorCode::not_found);
  REQUIRE_SPARSEKV_ERROR(manager.finish(1), ErrorCode::not_found);
  REQUIRE_SPARSEKV_ERROR(manager.working_set(1), ErrorCode::not_found);
  REQUIRE_SPARSEKV_ERROR(manager.add_request(3, 0), ErrorCode::invalid_argument);
  REQUIRE_SPARSEKV_ERROR(make_policy("nope", 64), ErrorCode::invalid_argument);
  REQUIRE_SPARSEKV_ERROR(make_policy("quest", 0), ErrorCode::invalid_argument);
  // RetroInferPolicy takes 0 as no budget (its fraction rule); the registry always asks for one.
  REQUIRE_SPARSEKV_ERROR(make_policy("retroinfer", 0), ErrorCode::invalid_argument);
}

TEST_CASE("Manager: a regroup that cannot fit refuses the whole step and the request recovers", "[facade][errors]") {
  // RetroInfer re-clusters every 32 decode tokens here, so regroups are frequent.
  constexpr ModelShape shape{1, 1, 1, 16, DType::f32};
  RetroInferPolicy::Options o;
  o.budget_tokens = 4096;
  o.segment_tokens = 64;
  o.tokens_per_cluster = 16;
  o.window_tokens = 16;
  o.update_tokens = 32;
  o.estimation = false;
  bool refused = false;
  for (std::uint32_t cpu_pages = 20; cpu_pages < 60 && !refused; ++cpu_pages) {
    Config c;
    c.page_tokens = 8;
    c.max_requests = 2;
    c.max_context_tokens = 1024;
    c.min_buffer_ratio = 1.0;
    const std::size_t page = c.page_bytes(shape);
    c.cpu_tier_bytes = cpu_pages * page;
    c.gpu_tier_bytes = 4000 * page;
    c.host_chunk_bytes = 8 * page;
    Manager<RetroInferPolicy> m(shape, c, RetroInferPolicy(o));
    std::mt19937 rng(1);
    std::normal_distribution<float> normal;
    std::vector<float> k(64 * 16), v(64 * 16), q(16), kn(16), vn(16), out(16);
    for (auto& x : k) x = normal(rng);
    for (auto& x : v) x = normal(rng);
    m.add_request(1, 1000);
    m.prefill(1, 0, k.data(), v.data(), 64);
    const std::vector<RequestId> batch{1};
    for (int step = 0; step < 300; ++step) {
      for (auto* t : {&q, &kn, &vn})
        for (auto& x : *t) x = normal(rng);
      const std::uint32_t seq = inspect_buffer(m).admission().sequence_length(1, 0);
      const std::uint32_t used = inspect_buffer(m).tiers().cpu_pool.used();
      try {
        m.decode(batch, 0, q.data(), kn.data(), vn.data(), out.data());
      } catch (const Error& e) {
        REQUIRE(e.code() == ErrorCode::resource_exhausted);
        REQUIRE(inspect_buffer(m).admission().sequence_length(1, 0) == seq);  // nothing appended
        REQUIRE(inspect_buffer(m).tiers().cpu_pool.used() == used);
        inspect_buffer(m).validate();
        refused = true;
        break;
      }
      inspect_buffer(m).validate();
    }
  }
  REQUIRE(refused);  // the walk did reach a refused regroup
}

TEST_CASE("Regrouper::repartition checks everything before it drops a run", "[buffer][errors]") {
  constexpr ModelShape shape{1, 1, 1, 16, DType::f32};
  Config c;
  c.page_tokens = 1;
  c.max_requests = 1;
  c.max_context_tokens = 131072;
  c.min_buffer_ratio = 1.0;
  const std::size_t page = c.page_bytes(shape);
  c.cpu_tier_bytes = (65537 + 100) * page;  // room for the run, not for a second copy of it
  c.gpu_tier_bytes = 64 * page;
  c.host_chunk_bytes = 4096 * page;
  HostMemoryResource cpu(false), gpu(false);
  TieredKVBuffer b(shape, c, cpu, gpu);
  b.admission().add_request(1, RequestPages{4, 0});
  const std::uint32_t n = 65537;  // one partition of these would span more than 2^16 pages
  std::vector<float> k(std::size_t{n} * 16, 1.0f), v(std::size_t{n} * 16, 2.0f);
  const PartitionSpec spec = PartitionSpec::uniform(n, 1);
  b.offloader().offload(1, 0, KvChunk{k.data(), v.data(), n, DType::f32}, std::span(&spec, 1));
  std::vector<std::uint32_t> ids(n);
  std::iota(ids.begin(), ids.end(), 0u);
  const PartitionSpec one = PartitionSpec::variable(n, {0, n}, ids);
  const PartitionId first = 0;
  REQUIRE_SPARSEKV_ERROR(b.regrouper().repartition(1, 0, std::span(&first, 1), std::span(&one, 1)),
                         ErrorCode::invalid_argument);
  REQUIRE(b.tiers().table.partition_count(1, 0, 0) == n);
  REQUIRE(b.tiers().cpu_pool.used() == n);
  b.validate();
  // A regroup needing more pages than are free is fine when the run frees them.
  const PartitionSpec halves = PartitionSpec::uniform(n, n / 2 + 1);  // 2 partitions, the same n pages
  REQUIRE(b.tiers().cpu_pool.available() < n);
  b.regrouper().repartition(1, 0, std::span(&first, 1), std::span(&halves, 1));
  REQUIRE(b.tiers().table.partition_count(1, 0, 0) == 2);
  b.validate();
  // Budgets too large to hold are refused, not wrapped around.
  REQUIRE(b.admission().min_slots_per_head(RequestPages{0x80000000u, 0}) == 0xffffffffu);
  REQUIRE_SPARSEKV_ERROR(b.admission().add_request(2, RequestPages{0x80000000u, 0}), ErrorCode::resource_exhausted);
}
