// A randomized test of the engine-facing facade: random shapes (f32 / f16 /
// bf16, page_tokens 1-32, GQA), every built-in policy with budgets below two
// pages, around the context and above it, requests arriving and finishing,
// and RetroInfer through its re-index boundaries near max_context_tokens with
// tight tiers. After every decode of every request and layer, what the step
// attended is read back from the GPU tier and checked against a reference
// copy of every token's K/V:
//  - each attended row is the K and V bytes of one token of that request,
//    layer and kv head, and no token is attended twice (nothing lost or
//    corrupted, whatever the policy moved, saved or regrouped);
//  - the token being decoded is among them, whatever the budget;
//  - with a budget covering the context they are every token (Dense);
//  - the output is attention over exactly those tokens (fp64 reference) for
//    policies without their own attention term.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <unordered_map>
#include <vector>

#include "sparsekv/core/numeric.hpp"
#include "sparsekv/facade/manager_inspection.hpp"
#include "sparsekv/memory/page_layout.hpp"
#include "sparsekv/policy/retroinfer.hpp"
#include "sparsekv/sparsekv.hpp"
#include "test_support.hpp"

using namespace sparsekv;

namespace {

struct Scenario {
  ModelShape shape;
  Config config;
  std::uint32_t max_prompt = 0, max_decode = 0, requests = 0;
  bool covering = false;  // the budget covers every request's whole context
};

// Every token's K and V rows of one request and layer, in the engine's dtype,
// and which token each K row is (rows of random normals are distinct).
struct LayerReference {
  std::vector<std::byte> k, v;                                           // [token][kv_head][head_dim]
  std::vector<std::unordered_map<std::string, std::uint32_t>> token_of;  // per kv head: K row bytes -> token
};

class Checker {
 public:
  Checker(const Scenario& s, bool own_attend) : s_(s), own_attend_(own_attend) {}

  std::vector<std::byte> random_rows(std::mt19937& rng, std::uint32_t rows, std::uint32_t heads) const {
    std::normal_distribution<float> normal;
    const std::size_t n = std::size_t{rows} * heads * s_.shape.head_dim;
    std::vector<std::byte> bytes(n * dtype_size(s_.shape.dtype));
    for (std::size_t i = 0; i < n; ++i)
      store_element(bytes.data(), static_cast<std::uint32_t>(i), s_.shape.dtype, normal(rng));
    return bytes;
  }

  void add(LayerReference& ref, const std::byte* k, const std::byte* v, std::uint32_t tokens) const {
    const std::size_t row = row_bytes();
    const std::uint32_t first = token_count(ref);
    ref.token_of.resize(s_.shape.kv_heads);
    ref.k.insert(ref.k.end(), k, k + std::size_t{tokens} * s_.shape.kv_heads * row);
    ref.v.insert(ref.v.end(), v, v + std::size_t{tokens} * s_.shape.kv_heads * row);
    for (std::uint32_t t = 0; t < tokens; ++t) {
      for (std::uint32_t h = 0; h < s_.shape.kv_heads; ++h) {
        const std::byte* key = ref.k.data() + (std::size_t{first + t} * s_.shape.kv_heads + h) * row;
        REQUIRE(ref.token_of[h].emplace(std::string(reinterpret_cast<const char*>(key), row), first + t).second);
      }
    }
  }

  // Checks what decode attended for batch entry b (request `ref`) and its output.
  void check(const RuntimeManager& m, std::size_t b, const LayerReference& ref, const std::byte* q,
             const float* out) const {
    const ModelShape& shape = s_.shape;
    const PageLayout layout{s_.config.page_tokens, shape.head_dim, shape.dtype};
    const std::size_t row = row_bytes();
    const std::uint32_t tokens = token_count(ref);
    for (std::uint32_t h = 0; h < shape.kv_heads; ++h) {
      std::vector<std::uint32_t> attended;
      m.retrieval(b).for_each_page(h, s_.config.page_tokens, [&](PageId page, std::uint32_t n) {
        const std::byte* data = inspect_buffer(m).tiers().gpu_pool.data(page);
        for (std::uint32_t slot = 0; slot < n; ++slot) {
          const auto it =
              ref.token_of[h].find(std::string(reinterpret_cast<const char*>(data + layout.k_offset(slot)), row));
          INFO("kv head " << h << " page " << page << " slot " << slot);
          REQUIRE(it != ref.token_of[h].end());  // a K row no token of this head has: corrupted or foreign
          const std::byte* v = ref.v.data() + (std::size_t{it->second} * shape.kv_heads + h) * row;
          REQUIRE(std::memcmp(data + layout.v_offset(slot), v, row) == 0);
          attended.push_back(it->second);
        }
      });
      std::sort(attended.begin(), attended.end());
      INFO("kv head " << h << ", " << attended.size() << " of " << tokens << " tokens attended");
      REQUIRE(std::adjacent_find(attended.begin(), attended.end()) == attended.end());
      REQUIRE(std::binary_search(attended.begin(), attended.end(), tokens - 1));  // the decode token
      if (s_.covering) REQUIRE(attended.size() == tokens);
      if (!own_attend_) {
        for (std::uint32_t g = 0; g < shape.group_size(); ++g) {
          const std::uint32_t qh = h * shape.group_size() + g;
          check_output(ref, h, attended, q + (b * shape.q_heads + qh) * row,
                       out + (b * shape.q_heads + qh) * shape.head_dim);
        }
      }
    }
  }

  std::size_t row_bytes() const { return std::size_t{s_.shape.head_dim} * dtype_size(s_.shape.dtype); }
  std::uint32_t token_count(const LayerReference& ref) const {
    return static_cast<std::uint32_t>(ref.k.size() / (s_.shape.kv_heads * row_bytes()));
  }

 private:
  // out == softmax(q . k / sqrt(d)) v over `attended`, in fp64, to 1e-4 relative.
  void check_output(const LayerReference& ref, std::uint32_t h, const std::vector<std::uint32_t>& attended,
                    const std::byte* q, const float* out) const {
    const std::uint32_t d = s_.shape.head_dim;
    const DType t = s_.shape.dtype;
    const auto element = [&](const std::vector<std::byte>& rows, std::uint32_t token, std::uint32_t i) {
      return double(load_element(rows.data() + (std::size_t{token} * s_.shape.kv_heads + h) * row_bytes(), i, t));
    };
    std::vector<double> score(attended.size());
    double max = -1e300;
    for (std::size_t j = 0; j < attended.size(); ++j) {
      double s = 0;
      for (std::uint32_t i = 0; i < d; ++i) s += double(load_element(q, i, t)) * element(ref.k, attended[j], i);
      score[j] = s / std::sqrt(double(d));
      max = std::max(max, score[j]);
    }
    std::vector<double> want(d, 0.0);
    double sum = 0;
    for (std::size_t j = 0; j < attended.size(); ++j) {
      const double p = std::exp(score[j] - max);
      sum += p;
      for (std::uint32_t i = 0; i < d; ++i) want[i] += p * element(ref.v, attended[j], i);
    }
    double num = 0, den = 0;
    for (std::uint32_t i = 0; i < d; ++i) {
      num += std::pow(out[i] - want[i] / sum, 2);
      den += std::pow(want[i] / sum, 2);
    }
    REQUIRE(std::sqrt(num / std::max(den, 1e-30)) < 1e-4);
  }

  const Scenario& s_;
  bool own_attend_;
};

struct RunCounts {
  std::uint64_t decodes = 0, requests = 0;
};

// Requests arriving and finishing at random; every decode checked. Every call
// must succeed: the tiers are sized for the scenario.
RunCounts run(RuntimeManager& m, const Scenario& s, std::uint32_t seed) {
  const ModelShape& shape = s.shape;
  const Checker checker(s, m.policy().has_custom_attend());
  std::mt19937 rng(seed);
  std::map<RequestId, std::vector<LayerReference>> refs;
  std::map<RequestId, std::uint32_t> left;
  RequestId next = 1;
  RunCounts counts;
  const auto arrive = [&] {
    const RequestId id = next++;
    const std::uint32_t prompt = 1 + rng() % s.max_prompt, decode = 1 + rng() % s.max_decode;
    INFO("request " << id << ": prompt " << prompt << ", max_tokens " << prompt + decode);
    REQUIRE(m.can_admit(prompt, prompt + decode).admit);
    m.add_request(id, prompt + decode);
    auto& layers = refs[id];
    layers.resize(shape.layers);
    for (std::uint32_t l = 0; l < shape.layers; ++l) {
      const auto k = checker.random_rows(rng, prompt, shape.kv_heads),
                 v = checker.random_rows(rng, prompt, shape.kv_heads);
      m.prefill(id, l, k.data(), v.data(), prompt);
      checker.add(layers[l], k.data(), v.data(), prompt);
    }
    left[id] = decode;
    ++counts.requests;
  };
  for (std::uint32_t i = 0; i < s.requests; ++i) arrive();
  for (int step = 0; !left.empty(); ++step) {
    if (counts.requests < 2 * s.requests && rng() % 5 == 0) arrive();
    std::vector<RequestId> batch;
    for (const auto& [id, n] : left) batch.push_back(id);
    for (std::uint32_t l = 0; l < shape.layers; ++l) {
      const auto q = checker.random_rows(rng, static_cast<std::uint32_t>(batch.size()), shape.q_heads);
      const auto k = checker.random_rows(rng, static_cast<std::uint32_t>(batch.size()), shape.kv_heads);
      const auto v = checker.random_rows(rng, static_cast<std::uint32_t>(batch.size()), shape.kv_heads);
      std::vector<float> out(std::size_t{batch.size()} * shape.q_heads * shape.head_dim);
      m.decode(batch, l, q.data(), k.data(), v.data(), out.data());
      const std::size_t kv_row = shape.kv_heads * checker.row_bytes();
      for (std::size_t b = 0; b < batch.size(); ++b) {
        LayerReference& ref = refs[batch[b]][l];
        checker.add(ref, k.data() + b * kv_row, v.data() + b * kv_row, 1);
        INFO("step " << step << " layer " << l << " request " << batch[b] << " at " << checker.token_count(ref)
                     << " tokens");
        checker.check(m, b, ref, q.data(), out.data());
        ++counts.decodes;
      }
    }
    for (RequestId id : batch) {
      if (--left[id] == 0) {
        m.finish(id);
        left.erase(id);
        refs.erase(id);
      }
    }
  }
  REQUIRE(inspect_buffer(m).tiers().gpu_pool.used() == 0);
  REQUIRE(inspect_buffer(m).tiers().cpu_pool.used() == 0);
  return counts;
}

Scenario random_scenario(std::mt19937& rng) {
  const DType dtypes[] = {DType::f32, DType::f16, DType::bf16};
  const std::uint32_t groups[] = {1, 2, 4};
  Scenario s;
  const std::uint32_t kv_heads = 1 + rng() % 2;
  s.shape = ModelShape{3, kv_heads * groups[rng() % 3], kv_heads, 8u << (rng() % 2), dtypes[rng() % 3]};
  s.config.page_tokens = 1u << (rng() % 6);  // 1 .. 32
  s.config.max_context_tokens = 512;
  s.config.max_requests = 16;
  s.config.min_buffer_ratio = 1.0;
  s.max_prompt = 1 + rng() % 200;
  s.max_decode = 1 + rng() % 3 * s.config.page_tokens + rng() % 40;  // tails fill and save
  s.requests = 1 + rng() % 4;
  const std::size_t heads = std::size_t{s.config.max_requests} * s.shape.layers * s.shape.kv_heads;
  const std::size_t page = s.config.page_bytes(s.shape);
  s.config.cpu_tier_bytes = s.config.gpu_tier_bytes = heads * 2 * s.config.max_pages_per_head() * page;
  s.config.host_chunk_bytes = 64 * page;
  return s;
}

}  // namespace

TEST_CASE("Facade, randomized: every policy and budget attends intact K/V, always the decode token",
          "[facade][random]") {
  RunCounts total;
  for (std::uint32_t seed = 1; seed <= 6; ++seed) {
    std::mt19937 rng(seed);
    Scenario s = random_scenario(rng);
    const std::uint32_t p = s.config.page_tokens, context = s.max_prompt + s.max_decode;
    // Budgets below two pages, around the context and above it.
    const std::uint32_t budgets[] = {1, std::max(1u, p - 1), 2 * p - 1, context, context + 1 + p};
    for (const std::string& name : policy_names()) {
      for (const std::uint32_t budget : budgets) {
        CAPTURE(seed, name, budget, p, to_string(s.shape.dtype), s.shape.q_heads, s.shape.kv_heads, s.shape.head_dim);
        std::optional<AnyPolicy> policy;
        try {
          policy = make_policy(name, budget);
        } catch (const Error& e) {  // a budget the policy cannot serve is refused at construction
          REQUIRE(e.code() == ErrorCode::invalid_argument);
          continue;
        }
        s.covering = budget >= context;
        RuntimeManager m(s.shape, s.config, std::move(*policy));
        const RunCounts c = run(m, s, seed * 1000 + budget);
        total.decodes += c.decodes;
        total.requests += c.requests;
      }
    }
  }
  CHECK(total.decodes > 10000);
}

TEST_CASE("Facade, randomized: RetroInfer through re-index boundaries near max_context_tokens, tight tiers",
          "[facade][random]") {
  for (std::uint32_t seed = 1; seed <= 4; ++seed) {
    std::mt19937 rng(seed);
    Scenario s;
    s.shape = ModelShape{1, 4, 1, 16, seed % 2 ? DType::f32 : DType::bf16};
    s.config.page_tokens = 8u << (seed % 2);
    s.config.max_context_tokens = 600 + rng() % 100;
    s.config.max_requests = 2;
    s.config.min_buffer_ratio = 1.0;
    s.requests = 1;
    s.max_prompt = 60;
    // One request decoding up to max_context_tokens: re-index every 64 decode
    // tokens (the paper's 1024 is crossed by the Manager tests at its scale).
    RetroInferPolicy::Options o;
    o.budget_tokens = 64 + rng() % 128;
    o.segment_tokens = 256;
    o.update_tokens = 64;
    o.estimation = seed % 2 == 0;
    CAPTURE(seed, s.config.page_tokens, s.config.max_context_tokens, o.budget_tokens, o.estimation);
    const std::size_t page = s.config.page_bytes(s.shape);
    // Tight: the CPU tier holds what the page-table geometry allows one request; the GPU tier what it asks.
    s.config.cpu_tier_bytes = std::size_t{2} * s.config.max_pages_per_head() * page;
    s.config.gpu_tier_bytes = s.config.cpu_tier_bytes;
    s.config.host_chunk_bytes = 16 * page;
    const std::uint32_t max_tokens = s.config.max_context_tokens;
    {
      RuntimeManager probe(s.shape, s.config, AnyPolicy(RetroInferPolicy(o)));
      s.config.gpu_tier_bytes = probe.can_admit(s.max_prompt, max_tokens).gpu_pages_needed * page;
    }
    RuntimeManager m(s.shape, s.config, AnyPolicy(RetroInferPolicy(o)));
    const Checker checker(s, m.policy().has_custom_attend());
    std::vector<LayerReference> ref(1);
    REQUIRE(m.can_admit(s.max_prompt, max_tokens).admit);
    m.add_request(7, max_tokens);
    const auto k = checker.random_rows(rng, s.max_prompt, 1), v = checker.random_rows(rng, s.max_prompt, 1);
    m.prefill(7, 0, k.data(), v.data(), s.max_prompt);
    checker.add(ref[0], k.data(), v.data(), s.max_prompt);
    const std::vector<RequestId> batch{7};
    for (std::uint32_t t = s.max_prompt; t < max_tokens; ++t) {
      const auto q = checker.random_rows(rng, 1, s.shape.q_heads);
      const auto kn = checker.random_rows(rng, 1, 1), vn = checker.random_rows(rng, 1, 1);
      std::vector<float> out(std::size_t{s.shape.q_heads} * s.shape.head_dim);
      INFO("decoding token " << t);
      m.decode(batch, 0, q.data(), kn.data(), vn.data(), out.data());
      checker.add(ref[0], kn.data(), vn.data(), 1);
      checker.check(m, 0, ref[0], q.data(), out.data());
    }
    std::vector<float> out(std::size_t{s.shape.q_heads} * s.shape.head_dim);
    const auto q = checker.random_rows(rng, 1, s.shape.q_heads);
    REQUIRE_SPARSEKV_ERROR(m.decode(batch, 0, q.data(), k.data(), v.data(), out.data()), ErrorCode::resource_exhausted);
    m.finish(7);
    REQUIRE(inspect_buffer(m).tiers().cpu_pool.used() == 0);
  }
}
