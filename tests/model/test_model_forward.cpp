// The SmolLM2-135M forward pass (examples/model/llama.hpp) against reference
// logits from an independent numpy float64 implementation
// (scripts/reference_logits.py -> tests/data/smollm2_reference.txt), and
// sparsekv's policies against the model's own dense cache when their budget
// covers the whole context. Needs the real model file: tagged [model-file]
// (hidden), run by the `model-forward-tests` ctest entry, which exits 77
// (skipped) without the file.
//
// Tolerances. Both implementations dequantise the same Q4_1/Q8_0 blocks to
// the same fp32 weights; the difference is arithmetic: fp32 here (sums of
// 576-1536 products in a vectorised order, 30 residual layers, a ~2 ulp exp)
// against fp64 there. fp32 rounding (6e-8 relative per operation, growing
// ~sqrt(n) over n-term sums and through the layers) leaves ~1e-5 relative on
// the logits; measured: 6e-6 at worst. We allow |diff| <= 2e-4 * (1 + |ref|)
// (~0.005 at logits of ~25): 30x the measured error, yet tight enough to catch
// a wrong RMSNorm epsilon, RoPE base or rotation style, which move logits by
// 1e-2..1e1. The vocabulary-wide mean, std and L2 get the same bound.
// Policies whose budget covers the context select every page, so their
// attention differs from the dense cache only in summation order (~1e-7
// relative): logits within 1e-4.
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "model/gguf.hpp"
#include "model/llama.hpp"
#include "sparsekv/core/numeric.hpp"
#include "sparsekv/facade/manager_inspection.hpp"
#include "sparsekv/policy/policy_registry.hpp"

namespace {

using namespace sparsekv::model;

std::filesystem::path model_path() {
  const char* dir = std::getenv("SPARSEKV_MODEL_DIR");
  const char* home = std::getenv("HOME");
  const std::filesystem::path base =
      dir ? std::filesystem::path(dir) : std::filesystem::path(home ? home : ".") / ".cache/sparsekv/models";
  return base / "SmolLM2-135M-Instruct.Q4_1.gguf";
}

struct Reference {
  std::vector<std::int32_t> prompt, greedy;
  struct Position {
    double mean = 0, std = 0, l2 = 0;
    std::vector<std::pair<std::int32_t, double>> top5;
  };
  std::vector<Position> positions;
  std::vector<double> last_logits;
};

Reference read_reference() {
  const std::filesystem::path path = std::filesystem::path(SPARSEKV_SOURCE_DIR) / "tests/data/smollm2_reference.txt";
  std::ifstream in(path);
  REQUIRE(in.good());
  Reference ref;
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream s(line);
    std::string key;
    s >> key;
    if (key == "prompt_ids" || key == "greedy_ids") {
      std::size_t n = 0;
      s >> n;
      auto& ids = key == "prompt_ids" ? ref.prompt : ref.greedy;
      ids.resize(n);
      for (auto& id : ids) s >> id;
    } else if (key == "pos") {
      std::size_t p = 0;
      std::string word;
      Reference::Position pos;
      s >> p >> word >> pos.mean >> word >> pos.std >> word >> pos.l2 >> word;
      for (int i = 0; i < 5; ++i) {
        std::string item;
        s >> item;
        const auto colon = item.find(':');
        pos.top5.emplace_back(std::stoi(item.substr(0, colon)), std::stod(item.substr(colon + 1)));
      }
      REQUIRE(p == ref.positions.size());
      ref.positions.push_back(pos);
    } else if (key == "last_logits") {
      std::size_t n = 0;
      s >> n;
      ref.last_logits.resize(n);
      for (auto& x : ref.last_logits) in >> x;
    }
  }
  REQUIRE(!ref.prompt.empty());
  REQUIRE(ref.positions.size() == ref.prompt.size());
  return ref;
}

const LlamaModel& model() {
  static const LlamaModel m(GgufFile::open(model_path()));
  return m;
}

bool close(double got, double want, double rel) { return std::abs(got - want) <= rel * (1 + std::abs(want)); }

}  // namespace

TEST_CASE("dense forward matches the numpy reference logits", "[.][model-file]") {
  const Reference ref = read_reference();
  const LlamaModel& m = model();
  const LlamaConfig& c = m.config();
  CHECK(c.layers == 30);
  CHECK(c.q_heads == 9);
  CHECK(c.kv_heads == 3);
  CHECK(c.head_dim == 64);
  CHECK(c.hidden == 576);
  REQUIRE(ref.last_logits.size() == c.vocab);

  const std::size_t T = ref.prompt.size(), V = c.vocab;
  std::vector<float> logits(T * V);
  m.prefill(ref.prompt, {}, logits.data(), true);
  constexpr double kRel = 2e-4;
  double worst = 0;
  for (std::size_t p = 0; p < T; ++p) {
    const float* row = logits.data() + p * V;
    double sum = 0, sq = 0;
    for (std::size_t i = 0; i < V; ++i) {
      sum += row[i];
      sq += double(row[i]) * row[i];
    }
    const double mean = sum / V, std = std::sqrt(sq / V - mean * mean), l2 = std::sqrt(sq);
    INFO("position " << p);
    CHECK(close(mean, ref.positions[p].mean, kRel));
    CHECK(close(std, ref.positions[p].std, kRel));
    CHECK(close(l2, ref.positions[p].l2, kRel));
    for (const auto& [id, want] : ref.positions[p].top5) {
      CHECK(close(row[id], want, kRel));
      worst = std::max(worst, std::abs(row[id] - want) / (1 + std::abs(want)));
    }
    CHECK(argmax(std::span(row, V)) == static_cast<std::uint32_t>(ref.positions[p].top5[0].first));
  }
  const float* last = logits.data() + (T - 1) * V;
  for (std::size_t i = 0; i < V; ++i) {
    if (!close(last[i], ref.last_logits[i], kRel))
      FAIL_CHECK("last logit " << i << ": " << last[i] << " vs " << ref.last_logits[i]);
    worst = std::max(worst, std::abs(last[i] - ref.last_logits[i]) / (1 + std::abs(ref.last_logits[i])));
  }
  WARN("worst relative logit difference vs the fp64 reference: " << worst);

  // Greedy continuation through the dense cache's decode path.
  DenseCache cache(c);
  AttentionBackend* rows[] = {&cache};
  std::vector<float> step(V);
  m.prefill(ref.prompt, rows, step.data());
  std::vector<std::int32_t> greedy;
  for (std::size_t s = 0; s < ref.greedy.size(); ++s) {
    greedy.push_back(static_cast<std::int32_t>(argmax(step)));
    if (s + 1 < ref.greedy.size()) {
      const std::int32_t token = greedy.back();
      m.decode(std::span(&token, 1), static_cast<std::uint32_t>(T + s), rows, step.data());
    }
  }
  CHECK(greedy == ref.greedy);
}

TEST_CASE("every policy with a budget covering the context equals Dense", "[.][model-file]") {
  const Reference ref = read_reference();
  const LlamaModel& m = model();
  const LlamaConfig& c = m.config();
  const std::size_t V = c.vocab;
  constexpr std::uint32_t kSteps = 24;  // crosses page boundaries: policies see appended pages
  const std::uint32_t max_tokens = static_cast<std::uint32_t>(ref.prompt.size()) + kSteps;

  std::vector<std::string> names = sparsekv::policy_names();
  std::vector<std::unique_ptr<sparsekv::RuntimeManager>> managers;
  std::vector<std::unique_ptr<AttentionBackend>> backends;
  backends.push_back(std::make_unique<DenseCache>(c));
  for (const std::string& name : names) {
    managers.push_back(make_manager(c, sparsekv::make_policy(name, 4096), max_tokens));
    managers.back()->add_request(1, max_tokens);
    backends.push_back(std::make_unique<SparseSession>(*managers.back(), 1));
  }
  std::vector<AttentionBackend*> rows;
  for (auto& b : backends) rows.push_back(b.get());
  std::vector<float> logits(rows.size() * V), first(V);
  m.prefill(ref.prompt, rows, first.data());
  std::int32_t token = static_cast<std::int32_t>(argmax(first));
  double overall = 0;
  for (std::uint32_t s = 0; s < kSteps; ++s) {
    const std::vector<std::int32_t> tokens(rows.size(), token);
    m.decode(tokens, static_cast<std::uint32_t>(ref.prompt.size() + s), rows, logits.data());
    for (std::size_t r = 1; r < rows.size(); ++r) {
      double worst = 0;
      for (std::size_t i = 0; i < V; ++i) worst = std::max(worst, double(std::abs(logits[r * V + i] - logits[i])));
      INFO("policy " << names[r - 1] << " step " << s);
      CHECK(worst <= 1e-4);
      overall = std::max(overall, worst);
    }
    token = static_cast<std::int32_t>(argmax(std::span(logits.data(), V)));  // the dense row's choice
  }
  WARN("largest logit difference of a covering-budget policy from Dense: " << overall);
}

// make_manager sizes the tiers from what a row needs (no model file: the
// SmolLM2-135M shape by hand). A policy making the whole context mandatory
// (Quest's dense layers, the dense policy) gets a GPU buffer of the context,
// not min_buffer_ratio (5) times more; every policy and budget is admitted.
TEST_CASE("make_manager sizes tiers from the policy's needs", "[model]") {
  LlamaConfig c;
  c.layers = 30;
  c.hidden = 576;
  c.ffn = 1536;
  c.q_heads = 9;
  c.kv_heads = 3;
  c.head_dim = 64;
  c.vocab = 49152;
  constexpr std::uint32_t kMaxTokens = 1000;
  const std::size_t heads = std::size_t{c.layers} * c.kv_heads;
  const std::size_t context_pages = (kMaxTokens + 7) / 8;
  for (const std::string& name : sparsekv::policy_names()) {
    for (const std::uint32_t budget : {64u, 256u, 4096u}) {
      INFO("policy " << name << " budget " << budget);
      const auto manager = make_manager(c, sparsekv::make_policy(name, budget), kMaxTokens);
      manager->add_request(1, kMaxTokens);
      const std::size_t gpu = inspect_buffer(*manager).tiers().gpu_pool.capacity(),
                        cpu = inspect_buffer(*manager).tiers().cpu_pool.capacity();
      CHECK(cpu >= heads * context_pages);
      if (name == "quest" || name == "dense") {
        CHECK(gpu <= heads * (context_pages + 2));
      }
      if (name == "streaming" && budget == 64) {
        CHECK(gpu == heads * (6 * (64 / 8) + 1));  // the 5x buffer and the tail: min_buffer_ratio untouched
      }
    }
  }
}

// SparseSession rounds the model's fp32 q, K and V to the manager's dtype: an
// f16 session's output is bit for bit that of a manager handed the rounded
// values, and within f16's rounding of the fp32 dense cache.
TEST_CASE("SparseSession stores K/V in the config's kv_dtype", "[model]") {
  for (const sparsekv::DType dtype : {sparsekv::DType::f16, sparsekv::DType::bf16}) {
    INFO("kv_dtype " << to_string(dtype));
    LlamaConfig c;
    c.layers = 2;
    c.q_heads = 4;
    c.kv_heads = 2;
    c.head_dim = 16;
    c.kv_dtype = dtype;
    constexpr std::uint32_t kPrompt = 37, kSteps = 3, kMaxTokens = kPrompt + kSteps;
    const std::size_t kvd = std::size_t{c.kv_heads} * c.head_dim, qd = std::size_t{c.q_heads} * c.head_dim;
    std::uint32_t seed = 7;
    const auto draw = [&](std::size_t n) {
      std::vector<float> x(n);
      for (float& e : x) {
        seed = seed * 1664525u + 1013904223u;
        e = static_cast<float>(seed >> 8) / float(1u << 24) * 2.0f - 1.0f;
      }
      return x;
    };
    const auto rounded = [&](const std::vector<float>& x) {
      std::vector<std::uint16_t> r(x.size());
      for (std::size_t i = 0; i < x.size(); ++i)
        sparsekv::store_element(r.data(), static_cast<std::uint32_t>(i), dtype, x[i]);
      return r;
    };
    const auto session_manager = make_manager(c, sparsekv::make_policy("dense", kMaxTokens), kMaxTokens);
    const auto direct = make_manager(c, sparsekv::make_policy("dense", kMaxTokens), kMaxTokens);
    session_manager->add_request(1, kMaxTokens);
    direct->add_request(1, kMaxTokens);
    SparseSession session(*session_manager, 1);
    DenseCache dense(c);
    for (std::uint32_t layer = 0; layer < c.layers; ++layer) {
      const std::vector<float> k = draw(kPrompt * kvd), v = draw(kPrompt * kvd);
      session.prefill(layer, k.data(), v.data(), kPrompt);
      dense.prefill(layer, k.data(), v.data(), kPrompt);
      direct->prefill(1, layer, rounded(k).data(), rounded(v).data(), kPrompt);
    }
    for (std::uint32_t step = 0; step < kSteps; ++step) {
      for (std::uint32_t layer = 0; layer < c.layers; ++layer) {
        const std::vector<float> q = draw(qd), k = draw(kvd), v = draw(kvd);
        std::vector<float> out(qd), want(qd), exact(qd);
        session.decode(layer, q.data(), k.data(), v.data(), out.data());
        dense.decode(layer, q.data(), k.data(), v.data(), exact.data());
        const sparsekv::RequestId id = 1;
        direct->decode(std::span(&id, 1), layer, rounded(q).data(), rounded(k).data(), rounded(v).data(), want.data());
        INFO("step " << step << " layer " << layer);
        CHECK(std::memcmp(out.data(), want.data(), qd * sizeof(float)) == 0);
        for (std::size_t i = 0; i < qd; ++i)
          CHECK(std::abs(out[i] - exact[i]) <= (dtype == sparsekv::DType::f16 ? 5e-3 : 4e-2));
      }
    }
  }
}
