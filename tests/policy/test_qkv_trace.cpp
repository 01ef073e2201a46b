// Q/K/V traces (qkv_trace.hpp): the directory format round trip, reader
// errors, the streaming writer, the synthetic generator's determinism and
// planted structure, and the dense reference against the pipeline.
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>

#include "research/qkv_trace.hpp"
#include "sparse_pipeline.hpp"
#include "sparsekv/policy/dense.hpp"
#include "test_support.hpp"

using namespace sparsekv;
namespace fs = std::filesystem;

namespace {

struct TempDir {
  fs::path path;
  TempDir() {
    std::random_device rd;
    path = fs::temp_directory_path() / ("sparsekv-qkv-test-" + std::to_string(rd()) + std::to_string(rd()));
    fs::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

SyntheticQkvOptions small() {
  SyntheticQkvOptions o;
  o.layers = 2;
  o.q_heads = 4;
  o.kv_heads = 2;
  o.head_dim = 16;
  o.prompt_tokens = 100;
  o.decode_steps = 5;
  o.segment_tokens = 32;
  o.heavy_hitters = 3;
  return o;
}

void write_text(const fs::path& path, const std::string& text) {
  std::ofstream out(path);
  out << text;
}

const std::string kManifest =
    "sparsekv-qkv-trace 1\nlayers 1\nq_heads 2\nkv_heads 1\nhead_dim 8\nprompt_tokens 3\ndecode_steps 1\ndtype f32\n";

// Thrown error's message, for checking that it names the path.
template <class F>
std::string error_of(F&& f, ErrorCode code) {
  try {
    f();
  } catch (const Error& e) {
    INFO(e.what());
    REQUIRE(e.code() == code);
    return e.what();
  }
  FAIL("no sparsekv::Error thrown");
  return {};
}

}  // namespace

TEST_CASE("qkv trace: write then read returns the same trace bit for bit", "[qkv_trace]") {
  TempDir dir;
  const QkvTrace trace = synthetic_qkv_trace(small());
  write_qkv_trace(dir.path / "t", trace);
  REQUIRE(fs::exists(dir.path / "t" / "manifest.txt"));
  REQUIRE(fs::file_size(qkv_trace_file(dir.path / "t", 1, 'k')) == 105 * 2 * 16 * 4);
  REQUIRE(fs::file_size(qkv_trace_file(dir.path / "t", 1, 'q')) == 5 * 4 * 16 * 4);
  // Little-endian fp32 on disk.
  {
    std::ifstream in(qkv_trace_file(dir.path / "t", 0, 'v'), std::ios::binary);
    unsigned char b[4];
    in.read(reinterpret_cast<char*>(b), 4);
    std::uint32_t bits = 0;
    std::memcpy(&bits, &trace.layers[0].values[0], 4);
    REQUIRE(b[0] == (bits & 0xff));
    REQUIRE(b[3] == (bits >> 24));
  }
  const QkvTrace back = read_qkv_trace(dir.path / "t");
  REQUIRE(back.header.layers == 2);
  REQUIRE(back.header.q_heads == 4);
  REQUIRE(back.header.kv_heads == 2);
  REQUIRE(back.header.head_dim == 16);
  REQUIRE(back.header.prompt_tokens == 100);
  REQUIRE(back.header.decode_steps == 5);
  REQUIRE(back.header.rope == RopeStage::post_rope);
  REQUIRE(back.header.model == trace.header.model);
  for (std::uint32_t l = 0; l < 2; ++l) {
    REQUIRE(back.layers[l].keys == trace.layers[l].keys);
    REQUIRE(back.layers[l].values == trace.layers[l].values);
    REQUIRE(back.layers[l].queries == trace.layers[l].queries);
  }
  // Accessors: the prompt view, token rows and the step's query position.
  REQUIRE(back.prompt(1).tokens == 100);
  REQUIRE(back.key(1, 104) == back.layers[1].keys.data() + 104 * 2 * 16);
  REQUIRE(back.query(0, 3).position == 103);
  REQUIRE_SPARSEKV_ERROR(back.query(0, 5), ErrorCode::out_of_range);
  REQUIRE_SPARSEKV_ERROR(back.key(2, 0), ErrorCode::out_of_range);
}

TEST_CASE("qkv trace: the streaming writer checks its input and writes the manifest last", "[qkv_trace]") {
  TempDir dir;
  QkvTraceHeader h{1, 2, 1, 8, 3, 2, RopeStage::pre_rope, "toy model"};
  std::vector<float> prompt(3 * 8, 1.0f), q(2 * 8, 2.0f), kv(8, 3.0f);
  {
    QkvTraceWriter w(dir.path / "w", h);
    REQUIRE_SPARSEKV_ERROR(w.decode(0, q, kv, kv), ErrorCode::failed_precondition);  // before the prompt
    REQUIRE_SPARSEKV_ERROR(w.prompt(0, prompt, std::span<const float>(prompt).first(8)), ErrorCode::invalid_argument);
    w.prompt(0, prompt, prompt);
    REQUIRE_SPARSEKV_ERROR(w.prompt(0, prompt, prompt), ErrorCode::failed_precondition);
    REQUIRE_SPARSEKV_ERROR(w.prompt(1, prompt, prompt), ErrorCode::out_of_range);
    w.decode(0, q, kv, kv);
    REQUIRE_SPARSEKV_ERROR(w.finish(), ErrorCode::failed_precondition);            // one step missing
    REQUIRE_SPARSEKV_ERROR(read_qkv_trace(dir.path / "w"), ErrorCode::not_found);  // no manifest yet
    w.decode(0, q, kv, kv);
    REQUIRE_SPARSEKV_ERROR(w.decode(0, q, kv, kv), ErrorCode::failed_precondition);  // beyond decode_steps
    w.finish();
  }
  const QkvTrace t = read_qkv_trace(dir.path / "w");
  REQUIRE(t.header.rope == RopeStage::pre_rope);
  REQUIRE(t.header.model == "toy model");
  REQUIRE(t.layers[0].keys.size() == 5 * 8);
  REQUIRE(t.layers[0].keys[3 * 8] == 3.0f);
  REQUIRE(t.layers[0].queries[8] == 2.0f);
  REQUIRE_SPARSEKV_ERROR(QkvTraceWriter(dir.path / "x", QkvTraceHeader{1, 3, 2, 8, 3, 1, RopeStage::post_rope, ""}),
                         ErrorCode::invalid_argument);
}

TEST_CASE("qkv trace: reader errors name the path", "[qkv_trace][errors]") {
  TempDir dir;
  const fs::path d = dir.path / "r";
  std::string msg = error_of([&] { read_qkv_trace(dir.path / "missing"); }, ErrorCode::not_found);
  REQUIRE(msg.find("missing") != std::string::npos);
  fs::create_directories(d);
  msg = error_of([&] { read_qkv_trace(d); }, ErrorCode::not_found);
  REQUIRE(msg.find("manifest.txt") != std::string::npos);

  const auto manifest_error = [&](const std::string& text, const std::string& needle) {
    write_text(d / "manifest.txt", text);
    const std::string m = error_of([&] { read_qkv_trace_header(d); }, ErrorCode::invalid_argument);
    INFO(m);
    REQUIRE(m.find("manifest.txt") != std::string::npos);
    REQUIRE(m.find(needle) != std::string::npos);
  };
  manifest_error("", "empty");
  manifest_error("hello 1\n", "expected 'sparsekv-qkv-trace 1'");
  manifest_error("sparsekv-qkv-trace 2\n", "unsupported version");
  manifest_error(kManifest + "colour blue\n", "unknown key 'colour'");
  manifest_error(kManifest + "layers 1\n", "given twice");
  manifest_error("sparsekv-qkv-trace 1\nlayers 1\n", "missing 'q_heads'");
  manifest_error("sparsekv-qkv-trace 1\nlayers x\n", "line 2");
  manifest_error(kManifest + "rope sideways\n", "rope must be");
  manifest_error(
      "sparsekv-qkv-trace 1\nlayers 1\nq_heads 3\nkv_heads 2\nhead_dim 8\nprompt_tokens 3\n"
      "decode_steps 1\ndtype f32\n",
      "multiple of kv_heads");
  manifest_error(
      "sparsekv-qkv-trace 1\nlayers 1\nq_heads 2\nkv_heads 1\nhead_dim 8\nprompt_tokens 3\n"
      "decode_steps 1\ndtype bf16\n",
      "dtype 'bf16' unsupported");

  // Comments and blank lines are fine; then the binary files are checked.
  write_text(d / "manifest.txt", "# a dump\n\n" + kManifest + "model  some model # trailing comment\n");
  const QkvTraceHeader h = read_qkv_trace_header(d);
  REQUIRE(h.model == "some model");
  msg = error_of([&] { read_qkv_trace(d); }, ErrorCode::not_found);
  REQUIRE(msg.find("layer_000_k.f32") != std::string::npos);
  std::vector<float> kv(4 * 8, 0.5f), q(2 * 8, 0.25f);
  const auto write_floats = [](const fs::path& p, const std::vector<float>& v) {
    std::ofstream out(p, std::ios::binary);
    out.write(reinterpret_cast<const char*>(v.data()), std::streamsize(v.size() * 4));
  };
  write_floats(d / "layer_000_k.f32", kv);
  write_floats(d / "layer_000_v.f32", std::vector<float>(3 * 8, 0.5f));  // one token short
  write_floats(d / "layer_000_q.f32", q);
  msg = error_of([&] { read_qkv_trace(d); }, ErrorCode::invalid_argument);
  REQUIRE(msg.find("layer_000_v.f32") != std::string::npos);
  REQUIRE(msg.find("96 bytes") != std::string::npos);
  write_floats(d / "layer_000_v.f32", kv);
  REQUIRE(read_qkv_trace(d).layers[0].queries[15] == 0.25f);
  kv[9] = std::nanf("");
  write_floats(d / "layer_000_k.f32", kv);
  msg = error_of([&] { read_qkv_trace(d); }, ErrorCode::invalid_argument);
  REQUIRE(msg.find("not finite") != std::string::npos);
}

TEST_CASE("synthetic qkv trace: deterministic per seed, knobs checked", "[qkv_trace][synthetic]") {
  const QkvTrace a = synthetic_qkv_trace(small());
  const QkvTrace b = synthetic_qkv_trace(small());
  REQUIRE_NOTHROW(a.validate());
  for (std::uint32_t l = 0; l < 2; ++l) {
    REQUIRE(a.layers[l].keys == b.layers[l].keys);
    REQUIRE(a.layers[l].values == b.layers[l].values);
    REQUIRE(a.layers[l].queries == b.layers[l].queries);
  }
  SyntheticQkvOptions o = small();
  o.seed = 2;
  const QkvTrace c = synthetic_qkv_trace(o);
  REQUIRE(c.layers[0].keys != a.layers[0].keys);
  REQUIRE(c.layers[1].queries != a.layers[1].queries);
  // Layers and heads draw from their own streams.
  REQUIRE(a.layers[0].keys != a.layers[1].keys);
  REQUIRE(synthetic_heavy_hitters(small(), 0, 0) == synthetic_heavy_hitters(small(), 0, 0));
  REQUIRE(synthetic_heavy_hitters(small(), 0, 0).size() == 3);
  REQUIRE(synthetic_heavy_hitters(small(), 0, 0).front() >= small().sink_tokens);

  const auto bad = [](auto&& change) {
    SyntheticQkvOptions x = small();
    change(x);
    REQUIRE_SPARSEKV_ERROR(synthetic_qkv_trace(x), ErrorCode::invalid_argument);
  };
  bad([](auto& x) { x.segment_topics = x.topics + 1; });
  bad([](auto& x) { x.value_topic = 1.5; });
  bad([](auto& x) { x.heavy_hitters = x.prompt_tokens; });
  bad([](auto& x) { x.q_heads = 3; });
  bad([](auto& x) { x.head_dim = 8; });
  bad([](auto& x) { x.run_tokens = 0.5; });
  bad([](auto& x) { x.decode_steps = 0; });
  bad([](auto& x) { x.topic_logit = -1; });
}

TEST_CASE("synthetic qkv trace: planted heavy hitters and sinks carry large dense attention mass",
          "[qkv_trace][synthetic]") {
  SyntheticQkvOptions o;  // default structure, smaller geometry
  o.layers = 1;
  o.prompt_tokens = 2048;
  o.decode_steps = 8;
  const QkvTrace t = synthetic_qkv_trace(o);
  const std::uint32_t d = o.head_dim, group = o.q_heads / o.kv_heads;
  double heavy_mass = 0, sink_mass = 0, heads = 0;
  for (std::uint32_t kv = 0; kv < o.kv_heads; ++kv) {
    const auto hitters = synthetic_heavy_hitters(o, 0, kv);
    for (std::uint32_t s = 0; s < o.decode_steps; ++s) {
      std::vector<float> out(o.q_heads * d);
      std::vector<double> lse(o.q_heads);
      reference_attention(t, 0, s, out.data(), lse.data());
      for (std::uint32_t qh = kv * group; qh < (kv + 1) * group; ++qh) {
        const float* q = t.query(0, s).head(qh, d);
        const auto p = [&](std::uint32_t token) {
          const float* k = t.key(0, token) + kv * d;
          double dot = 0;
          for (std::uint32_t i = 0; i < d; ++i) dot += double(q[i]) * k[i];
          return std::exp(dot / std::sqrt(double(d)) - lse[qh]);
        };
        for (std::uint32_t token : hitters) heavy_mass += p(token);
        for (std::uint32_t token = 0; token < o.sink_tokens; ++token) sink_mass += p(token);
        heads += 1;
      }
    }
  }
  const double uniform = 1.0 / (o.prompt_tokens + o.decode_steps);
  INFO("heavy hitters " << heavy_mass / heads << ", sinks " << sink_mass / heads);
  // 8 of ~2000 tokens (0.4%) hold over 5% of the mass: > 10x their share.
  REQUIRE(heavy_mass / heads > 0.05);
  REQUIRE(heavy_mass / heads / o.heavy_hitters > 10 * uniform);
  // Sinks score sink_logit (5) against heavy_logit (8): less, still several times their share.
  REQUIRE(sink_mass / heads / o.sink_tokens > 3 * uniform);
}

TEST_CASE("reference_attention equals Dense through the pipeline on a synthetic trace", "[qkv_trace][attention]") {
  const QkvTrace t = synthetic_qkv_trace(small());
  const auto& h = t.header;
  tools::SparsePipeline pipeline(h.shape(), AnyPolicy(DensePolicy{}), h.tokens());
  for (std::uint32_t l = 0; l < h.layers; ++l) pipeline.prefill(l, t.prompt(l));
  std::vector<float> got(h.q_heads * h.head_dim), want(got.size());
  for (std::uint32_t s = 0; s < h.decode_steps; ++s) {
    for (std::uint32_t l = 0; l < h.layers; ++l) {
      pipeline.append(l, t.key(l, h.prompt_tokens + s), t.value(l, h.prompt_tokens + s));
      pipeline.attend(l, t.query(l, s), got.data());
      reference_attention(t, l, s, want.data());
      float worst = 0, scale = 0;
      for (std::size_t i = 0; i < got.size(); ++i) {
        worst = std::max(worst, std::abs(got[i] - want[i]));
        scale = std::max(scale, std::abs(want[i]));
      }
      REQUIRE(worst <= 1e-5f * scale);
    }
  }
}
