#include "research/qkv_trace.hpp"

#include <algorithm>
#include <bit>
#include <charconv>
#include <cmath>
#include <cstring>
#include <map>
#include <random>
#include <string_view>
#include <system_error>

#include <fmt/format.h>

#include "research/portable_random.hpp"
#include "research/text_fields.hpp"
#include "sparsekv/core/error.hpp"

namespace sparsekv {

namespace fs = std::filesystem;

namespace {

constexpr std::string_view kMagic = "sparsekv-qkv-trace";
constexpr std::string_view kManifest = "manifest.txt";
constexpr std::uint32_t kMaxDim = 1u << 16;

std::string_view rope_name(RopeStage rope) { return rope == RopeStage::pre_rope ? "pre_rope" : "post_rope"; }

// ---- little-endian fp32 ------------------------------------------------------

void to_little_endian([[maybe_unused]] std::span<float> data) {
  if constexpr (std::endian::native == std::endian::big) {
    for (float& x : data) {
      const auto u = std::bit_cast<std::uint32_t>(x);
      x = std::bit_cast<float>((u >> 24) | ((u >> 8) & 0xff00u) | ((u << 8) & 0xff0000u) | (u << 24));
    }
  }
}

void write_floats(std::ofstream& out, std::span<const float> data, const fs::path& path) {
  if constexpr (std::endian::native == std::endian::little) {
    out.write(reinterpret_cast<const char*>(data.data()), std::streamsize(data.size() * sizeof(float)));
  } else {
    std::vector<float> copy(data.begin(), data.end());
    to_little_endian(copy);
    out.write(reinterpret_cast<const char*>(copy.data()), std::streamsize(copy.size() * sizeof(float)));
  }
  if (!out) fail(ErrorCode::invalid_argument, "qkv trace: cannot write '{}'", path.string());
}

std::vector<float> read_floats(const fs::path& path, std::size_t floats) {
  std::error_code ec;
  if (!fs::is_regular_file(path, ec)) fail(ErrorCode::not_found, "qkv trace: missing file '{}'", path.string());
  const std::uintmax_t bytes = fs::file_size(path, ec);
  if (ec) fail(ErrorCode::not_found, "qkv trace: cannot stat '{}': {}", path.string(), ec.message());
  if (bytes != floats * sizeof(float)) {
    fail(ErrorCode::invalid_argument, "qkv trace: '{}' has {} bytes, the manifest implies {} ({} fp32 values)",
         path.string(), bytes, floats * sizeof(float), floats);
  }
  std::vector<float> data(floats);
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(ErrorCode::not_found, "qkv trace: cannot open '{}'", path.string());
  in.read(reinterpret_cast<char*>(data.data()), std::streamsize(bytes));
  if (!in) fail(ErrorCode::invalid_argument, "qkv trace: short read of '{}'", path.string());
  to_little_endian(data);  // the same swap converts back
  for (std::size_t i = 0; i < data.size(); ++i) {
    if (!std::isfinite(data[i])) {
      fail(ErrorCode::invalid_argument, "qkv trace: '{}' value {} (byte offset {}) is not finite", path.string(), i,
           i * sizeof(float));
    }
  }
  return data;
}

// ---- manifest ----------------------------------------------------------------

// ---- generator ---------------------------------------------------------------

std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

enum Stream : std::uint64_t { kDocument = 1, kHead = 2, kHeavy = 3 };

std::uint64_t stream_seed(std::uint64_t seed, Stream stream, std::uint32_t layer, std::uint32_t head) {
  return splitmix64(seed ^ splitmix64((std::uint64_t{stream} << 56) ^ (std::uint64_t{layer} << 24) ^ head));
}

using Vec = std::vector<double>;

void normalize(Vec& v) {
  double n = 0;
  for (double x : v) n += x * x;
  n = std::sqrt(n);
  if (n > 0)
    for (double& x : v) x /= n;
}

Vec gaussian(detail::PortableRandom& rng, std::size_t n, double scale = 1.0) {
  Vec v(n);
  for (double& x : v) x = rng.normal() * scale;
  return v;
}

// `count` unit vectors of dimension n, orthonormal as far as n allows.
std::vector<Vec> directions(detail::PortableRandom& rng, std::size_t count, std::size_t n) {
  std::vector<Vec> out;
  for (std::size_t i = 0; i < count; ++i) {
    Vec v = gaussian(rng, n);
    if (i < n) {
      for (const Vec& u : out) {
        double dot = 0;
        for (std::size_t j = 0; j < n; ++j) dot += v[j] * u[j];
        for (std::size_t j = 0; j < n; ++j) v[j] -= dot * u[j];
      }
    }
    normalize(v);
    out.push_back(std::move(v));
  }
  return out;
}

// Token -> topic of the prompt and the decode steps, and the query's topic
// trajectory: shared by every layer and head (one document).
struct Document {
  std::vector<std::uint32_t> topic;  // per token
  std::vector<std::uint32_t> current, previous;
  std::vector<double> blend;  // weight of `current`, per step
};

Document make_document(const SyntheticQkvOptions& o) {
  detail::PortableRandom rng(stream_seed(o.seed, kDocument, 0, 0));
  Document doc;
  doc.topic.resize(std::size_t{o.prompt_tokens} + o.decode_steps);
  std::vector<bool> present(o.topics, false);
  for (std::uint32_t start = 0; start < o.prompt_tokens; start += o.segment_tokens) {
    // segment_topics distinct topics (partial Fisher-Yates).
    std::vector<std::uint32_t> pool(o.topics);
    for (std::uint32_t i = 0; i < o.topics; ++i) pool[i] = i;
    for (std::uint32_t i = 0; i < o.segment_topics; ++i) std::swap(pool[i], pool[i + rng.below(o.topics - i)]);
    const std::uint32_t end = std::min(o.prompt_tokens, start + o.segment_tokens);
    for (std::uint32_t t = start; t < end;) {
      const std::uint32_t topic = pool[rng.below(o.segment_topics)];
      present[topic] = true;
      const std::uint32_t run_end = std::min<std::uint64_t>(end, std::uint64_t{t} + rng.geometric(o.run_tokens));
      for (; t < run_end; ++t) doc.topic[t] = topic;
    }
  }
  std::vector<std::uint32_t> topics;
  for (std::uint32_t c = 0; c < o.topics; ++c)
    if (present[c]) topics.push_back(c);
  std::uint32_t current = topics[rng.below(topics.size())], previous = current, since = o.blend_steps;
  for (std::uint32_t s = 0; s < o.decode_steps; ++s) {
    if (s > 0 && topics.size() > 1 && rng.unit() * o.topic_dwell < 1.0) {
      previous = current;
      do current = topics[rng.below(topics.size())];
      while (current == previous);
      since = 0;
    }
    ++since;
    doc.current.push_back(current);
    doc.previous.push_back(previous);
    doc.blend.push_back(std::min(1.0, double(since) / o.blend_steps));
    doc.topic[std::size_t{o.prompt_tokens} + s] = current;
  }
  return doc;
}

void generate_head(const SyntheticQkvOptions& o, const Document& doc, std::uint32_t layer, std::uint32_t head,
                   QkvLayer& out) {
  detail::PortableRandom rng(stream_seed(o.seed, kHead, layer, head));
  const std::uint32_t d = o.head_dim, pairs = std::max(1u, d / 8), dc = d - 2 * pairs;
  const std::uint32_t kvh = o.kv_heads, group = o.q_heads / o.kv_heads;
  const std::uint32_t tokens = o.prompt_tokens + o.decode_steps;
  const double scale = std::pow(double(d), 0.25);  // q.k / sqrt(d) = q'.k'
  constexpr double kKeyPosition = 0.5;             // norm of a key's position part

  // Content directions: sink, heavy hitter, then the topic centres.
  const std::vector<Vec> dirs = directions(rng, 2 + std::size_t{o.topics}, dc);
  const Vec& sink = dirs[0];
  const Vec& heavy = dirs[1];
  const auto centre = [&](std::uint32_t c) -> const Vec& { return dirs[2 + c]; };
  std::vector<Vec> value_centres;
  for (std::uint32_t c = 0; c < o.topics; ++c) value_centres.push_back(gaussian(rng, d));
  std::vector<Vec> head_offsets;
  for (std::uint32_t g = 0; g < group; ++g) head_offsets.push_back(gaussian(rng, dc, 1.0 / std::sqrt(double(dc))));
  std::vector<double> theta(pairs);
  for (std::uint32_t j = 0; j < pairs; ++j) theta[j] = 0.3 * std::pow(1.3, double(j)) / o.recency_tokens;

  const std::vector<std::uint32_t> hitters = synthetic_heavy_hitters(o, layer, head);
  std::vector<std::uint8_t> kind(tokens, 0);  // 0 topic, 1 sink, 2 heavy hitter
  for (std::uint32_t t = 0; t < std::min(o.sink_tokens, o.prompt_tokens); ++t) kind[t] = 1;
  for (std::uint32_t t : hitters) kind[t] = 2;

  const double vt = std::sqrt(o.value_topic), vn = std::sqrt(1.0 - o.value_topic);
  for (std::uint32_t t = 0; t < tokens; ++t) {
    const std::uint32_t topic = doc.topic[t];
    // Sinks sit exactly on their direction (like a BOS token, the same every
    // time); heavy hitters and topic keys scatter around theirs.
    Vec key = kind[t] == 1 ? sink : kind[t] == 2 ? heavy : centre(topic);
    const Vec noise = gaussian(rng, dc, o.key_noise / std::sqrt(double(dc)));
    if (kind[t] != 1) {
      for (std::uint32_t i = 0; i < dc; ++i) key[i] += noise[i];
      normalize(key);
    }
    float* k = out.keys.data() + (std::size_t{t} * kvh + head) * d;
    float* v = out.values.data() + (std::size_t{t} * kvh + head) * d;
    for (std::uint32_t i = 0; i < dc; ++i) k[i] = float(scale * key[i]);
    for (std::uint32_t j = 0; j < pairs; ++j) {  // sinks: none, they score sink_logit at any distance
      const double r = kind[t] == 1 ? 0.0 : scale * kKeyPosition / std::sqrt(double(pairs));
      k[dc + 2 * j] = float(r * std::cos(theta[j] * t));
      k[dc + 2 * j + 1] = float(r * std::sin(theta[j] * t));
    }
    const double value_scale = kind[t] == 1 ? 0.1 : 1.0;
    for (std::uint32_t i = 0; i < d; ++i) {
      const double x = kind[t] == 2 ? rng.normal() : vt * value_centres[topic][i] + vn * rng.normal();
      v[i] = float(value_scale * x);
    }
  }

  for (std::uint32_t s = 0; s < o.decode_steps; ++s) {
    const double position = double(o.prompt_tokens) + s;
    Vec mix(dc);
    for (std::uint32_t i = 0; i < dc; ++i) {
      mix[i] = doc.blend[s] * centre(doc.current[s])[i] + (1.0 - doc.blend[s]) * centre(doc.previous[s])[i];
    }
    normalize(mix);
    for (std::uint32_t g = 0; g < group; ++g) {
      const std::uint32_t qh = head * group + g;
      Vec content = mix;
      const Vec noise = gaussian(rng, dc, o.query_noise / std::sqrt(double(dc)));
      for (std::uint32_t i = 0; i < dc; ++i) content[i] += noise[i] + o.head_noise * head_offsets[g][i];
      normalize(content);
      float* q = out.queries.data() + (std::size_t{s} * o.q_heads + qh) * d;
      for (std::uint32_t i = 0; i < dc; ++i) {
        q[i] = float(scale * (o.topic_logit * content[i] + o.heavy_logit * heavy[i] + o.sink_logit * sink[i]));
      }
      for (std::uint32_t j = 0; j < pairs; ++j) {
        const double r = scale * o.recency_logit / kKeyPosition / std::sqrt(double(pairs));
        q[dc + 2 * j] = float(r * std::cos(theta[j] * position));
        q[dc + 2 * j + 1] = float(r * std::sin(theta[j] * position));
      }
    }
  }
}

}  // namespace

// ---- header / trace ------------------------------------------------------------

void QkvTraceHeader::validate() const {
  const auto check = [](std::string_view field, std::uint32_t value, std::uint32_t lo, std::uint32_t hi) {
    if (value < lo || value > hi) {
      fail(ErrorCode::invalid_argument, "qkv trace: {} = {} must be in [{}, {}]", field, value, lo, hi);
    }
  };
  check("layers", layers, 1, kMaxDim);
  check("q_heads", q_heads, 1, kMaxDim);
  check("kv_heads", kv_heads, 1, kMaxDim);
  check("head_dim", head_dim, 8, kMaxDim);
  check("prompt_tokens", prompt_tokens, 1, 1u << 30);
  check("decode_steps", decode_steps, 1, 1u << 30);
  if (q_heads % kv_heads != 0) {
    fail(ErrorCode::invalid_argument, "qkv trace: q_heads ({}) must be a multiple of kv_heads ({})", q_heads, kv_heads);
  }
  if (head_dim % 8 != 0)
    fail(ErrorCode::invalid_argument, "qkv trace: head_dim ({}) must be a multiple of 8", head_dim);
  if (std::uint64_t{prompt_tokens} + decode_steps > (1u << 30)) {
    fail(ErrorCode::invalid_argument, "qkv trace: prompt_tokens + decode_steps must be at most 2^30");
  }
  if (model.find_first_of("\r\n") != std::string::npos) {
    fail(ErrorCode::invalid_argument, "qkv trace: model name must be one line");
  }
}

void QkvTrace::validate() const {
  header.validate();
  if (layers.size() != header.layers) {
    fail(ErrorCode::invalid_argument, "qkv trace: {} layers of data, header says {}", layers.size(), header.layers);
  }
  for (std::size_t l = 0; l < layers.size(); ++l) {
    const QkvLayer& layer = layers[l];
    if (layer.keys.size() != header.kv_floats() || layer.values.size() != header.kv_floats() ||
        layer.queries.size() != header.q_floats()) {
      fail(ErrorCode::invalid_argument, "qkv trace: layer {} has {} / {} / {} K / V / Q floats, expected {} / {} / {}",
           l, layer.keys.size(), layer.values.size(), layer.queries.size(), header.kv_floats(), header.kv_floats(),
           header.q_floats());
    }
  }
}

KvView QkvTrace::prompt(std::uint32_t layer) const {
  check_index("qkv trace: layer", layer, layers.size());
  const std::size_t n = std::size_t{header.prompt_tokens} * header.kv_heads * header.head_dim;
  return KvView{std::span<const float>(layers[layer].keys).first(n),
                std::span<const float>(layers[layer].values).first(n),
                header.prompt_tokens,
                header.kv_heads,
                header.head_dim,
                0};
}

const float* QkvTrace::key(std::uint32_t layer, std::uint32_t token) const {
  check_index("qkv trace: layer", layer, layers.size());
  check_index("qkv trace: token", token, header.tokens());
  return layers[layer].keys.data() + std::size_t{token} * header.kv_heads * header.head_dim;
}

const float* QkvTrace::value(std::uint32_t layer, std::uint32_t token) const {
  check_index("qkv trace: layer", layer, layers.size());
  check_index("qkv trace: token", token, header.tokens());
  return layers[layer].values.data() + std::size_t{token} * header.kv_heads * header.head_dim;
}

DecodeQuery QkvTrace::query(std::uint32_t layer, std::uint32_t step) const {
  check_index("qkv trace: layer", layer, layers.size());
  check_index("qkv trace: decode step", step, header.decode_steps);
  const std::size_t row = std::size_t{header.q_heads} * header.head_dim;
  return DecodeQuery{std::span<const float>(layers[layer].queries).subspan(step * row, row),
                     header.prompt_tokens + step};
}

void reference_attention(const QkvTrace& trace, std::uint32_t layer, std::uint32_t step, float* out, double* lse) {
  const QkvTraceHeader& h = trace.header;
  const DecodeQuery q = trace.query(layer, step);
  const std::uint32_t d = h.head_dim, tokens = h.prompt_tokens + step + 1, group = h.q_heads / h.kv_heads;
  const double scale = 1.0 / std::sqrt(double(d));
  const float* keys = trace.layers[layer].keys.data();
  const float* values = trace.layers[layer].values.data();
  std::vector<double> scores(tokens), acc(d);
  for (std::uint32_t qh = 0; qh < h.q_heads; ++qh) {
    const float* qv = q.head(qh, d);
    const std::uint32_t kv = qh / group;
    double max = -INFINITY;
    for (std::uint32_t t = 0; t < tokens; ++t) {
      const float* k = keys + (std::size_t{t} * h.kv_heads + kv) * d;
      double s = 0;
      for (std::uint32_t i = 0; i < d; ++i) s += double(qv[i]) * k[i];
      scores[t] = s * scale;
      max = std::max(max, scores[t]);
    }
    std::fill(acc.begin(), acc.end(), 0.0);
    double sum = 0;
    for (std::uint32_t t = 0; t < tokens; ++t) {
      const double p = std::exp(scores[t] - max);
      sum += p;
      const float* v = values + (std::size_t{t} * h.kv_heads + kv) * d;
      for (std::uint32_t i = 0; i < d; ++i) acc[i] += p * v[i];
    }
    for (std::uint32_t i = 0; i < d; ++i) out[std::size_t{qh} * d + i] = float(acc[i] / sum);
    if (lse) lse[qh] = max + std::log(sum);
  }
}

// ---- reading -------------------------------------------------------------------

fs::path qkv_trace_file(const fs::path& dir, std::uint32_t layer, char what) {
  return dir / fmt::format("layer_{:03}_{}.f32", layer, what);
}

QkvTraceHeader read_qkv_trace_header(const fs::path& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) fail(ErrorCode::not_found, "qkv trace: no directory '{}'", dir.string());
  const fs::path path = dir / kManifest;
  std::ifstream in(path);
  if (!in) fail(ErrorCode::not_found, "qkv trace: no manifest '{}' (incomplete dump?)", path.string());
  const auto bad = [&](std::size_t line, const std::string& what) {
    fail(ErrorCode::invalid_argument, "qkv trace manifest '{}' line {}: {}", path.string(), line, what);
  };
  QkvTraceHeader header;
  std::map<std::string, std::uint32_t*> numbers = {{"layers", &header.layers},
                                                   {"q_heads", &header.q_heads},
                                                   {"kv_heads", &header.kv_heads},
                                                   {"head_dim", &header.head_dim},
                                                   {"prompt_tokens", &header.prompt_tokens},
                                                   {"decode_steps", &header.decode_steps}};
  std::map<std::string, std::size_t> seen;
  bool magic = false;
  std::string text;
  std::size_t line = 0;
  while (std::getline(in, text)) {
    ++line;
    std::string_view content = text;
    content = detail::trim_blank(content.substr(0, content.find('#')));
    if (content.empty()) continue;
    const std::vector<std::string_view> tokens = detail::split_fields(content);
    const std::string key(tokens[0]);
    if (!magic) {
      if (key != kMagic) bad(line, fmt::format("expected '{} {}' first, got '{}'", kMagic, kQkvTraceVersion, content));
      if (tokens.size() != 2 || tokens[1] != fmt::format("{}", kQkvTraceVersion)) {
        bad(line, fmt::format("unsupported version '{}' (this reader knows {})",
                              tokens.size() > 1 ? tokens[1] : std::string_view{}, kQkvTraceVersion));
      }
      magic = true;
      continue;
    }
    if (seen.contains(key)) bad(line, fmt::format("'{}' given twice (first on line {})", key, seen[key]));
    seen[key] = line;
    if (key == "model") {
      header.model = std::string(detail::trim_blank(content.substr(tokens[0].size())));
      continue;
    }
    if (tokens.size() != 2) bad(line, fmt::format("expected '{} <value>', got '{}'", key, content));
    if (const auto it = numbers.find(key); it != numbers.end()) {
      std::uint32_t value = 0;
      const auto [end, err] = std::from_chars(tokens[1].data(), tokens[1].data() + tokens[1].size(), value);
      if (err != std::errc{} || end != tokens[1].data() + tokens[1].size()) {
        bad(line, fmt::format("{} must be an unsigned 32-bit number, got '{}'", key, tokens[1]));
      }
      *it->second = value;
    } else if (key == "dtype") {
      if (tokens[1] != "f32") bad(line, fmt::format("dtype '{}' unsupported (version 1 is f32 only)", tokens[1]));
    } else if (key == "rope") {
      if (tokens[1] == "post_rope")
        header.rope = RopeStage::post_rope;
      else if (tokens[1] == "pre_rope")
        header.rope = RopeStage::pre_rope;
      else
        bad(line, fmt::format("rope must be pre_rope or post_rope, got '{}'", tokens[1]));
    } else {
      bad(line, fmt::format("unknown key '{}'", key));
    }
  }
  if (!magic) fail(ErrorCode::invalid_argument, "qkv trace manifest '{}' is empty", path.string());
  for (const char* key : {"layers", "q_heads", "kv_heads", "head_dim", "prompt_tokens", "decode_steps", "dtype"}) {
    if (!seen.contains(key))
      fail(ErrorCode::invalid_argument, "qkv trace manifest '{}': missing '{}'", path.string(), key);
  }
  try {
    header.validate();
  } catch (const Error& e) {
    fail(ErrorCode::invalid_argument, "qkv trace manifest '{}': {}", path.string(), e.what());
  }
  return header;
}

QkvLayer read_qkv_trace_layer(const fs::path& dir, const QkvTraceHeader& header, std::uint32_t layer) {
  header.validate();
  check_index("qkv trace: layer", layer, header.layers);
  QkvLayer out;
  out.keys = read_floats(qkv_trace_file(dir, layer, 'k'), header.kv_floats());
  out.values = read_floats(qkv_trace_file(dir, layer, 'v'), header.kv_floats());
  out.queries = read_floats(qkv_trace_file(dir, layer, 'q'), header.q_floats());
  return out;
}

QkvTrace read_qkv_trace(const fs::path& dir) {
  QkvTrace trace;
  trace.header = read_qkv_trace_header(dir);
  for (std::uint32_t l = 0; l < trace.header.layers; ++l)
    trace.layers.push_back(read_qkv_trace_layer(dir, trace.header, l));
  return trace;
}

// ---- writing -------------------------------------------------------------------

struct QkvTraceWriter::Layer {
  std::ofstream k, v, q;
  bool prompt = false;
  std::uint32_t steps = 0;
};

QkvTraceWriter::QkvTraceWriter(fs::path dir, QkvTraceHeader header) : dir_(std::move(dir)), header_(std::move(header)) {
  header_.validate();
  std::error_code ec;
  fs::create_directories(dir_, ec);
  if (ec || !fs::is_directory(dir_)) {
    fail(ErrorCode::invalid_argument, "qkv trace: cannot create directory '{}': {}", dir_.string(), ec.message());
  }
  fs::remove(dir_ / kManifest, ec);  // an old manifest must not describe the new files
  for (std::uint32_t l = 0; l < header_.layers; ++l) {
    auto layer = std::make_unique<Layer>();
    const auto open = [&](std::ofstream& f, char what) {
      const fs::path path = qkv_trace_file(dir_, l, what);
      f.open(path, std::ios::binary | std::ios::trunc);
      if (!f) fail(ErrorCode::invalid_argument, "qkv trace: cannot create '{}'", path.string());
    };
    open(layer->k, 'k');
    open(layer->v, 'v');
    open(layer->q, 'q');
    layers_.push_back(std::move(layer));
  }
}

QkvTraceWriter::~QkvTraceWriter() = default;

void QkvTraceWriter::prompt(std::uint32_t layer, std::span<const float> keys, std::span<const float> values) {
  check_index("qkv trace writer: layer", layer, header_.layers);
  Layer& l = *layers_[layer];
  if (finished_ || l.prompt)
    fail(ErrorCode::failed_precondition, "qkv trace writer: layer {} prompt written twice", layer);
  const std::size_t n = std::size_t{header_.prompt_tokens} * header_.kv_heads * header_.head_dim;
  if (keys.size() != n || values.size() != n) {
    fail(ErrorCode::invalid_argument, "qkv trace writer: layer {} prompt has {} / {} K / V floats, expected {}", layer,
         keys.size(), values.size(), n);
  }
  write_floats(l.k, keys, qkv_trace_file(dir_, layer, 'k'));
  write_floats(l.v, values, qkv_trace_file(dir_, layer, 'v'));
  l.prompt = true;
}

void QkvTraceWriter::decode(std::uint32_t layer, std::span<const float> q, std::span<const float> k,
                            std::span<const float> v) {
  check_index("qkv trace writer: layer", layer, header_.layers);
  Layer& l = *layers_[layer];
  if (finished_ || !l.prompt || l.steps == header_.decode_steps) {
    fail(ErrorCode::failed_precondition, "qkv trace writer: layer {} decode step {} {}", layer, l.steps,
         finished_   ? "after finish()"
         : !l.prompt ? "before its prompt"
                     : "beyond decode_steps");
  }
  const std::size_t kv = std::size_t{header_.kv_heads} * header_.head_dim;
  const std::size_t qn = std::size_t{header_.q_heads} * header_.head_dim;
  if (q.size() != qn || k.size() != kv || v.size() != kv) {
    fail(ErrorCode::invalid_argument,
         "qkv trace writer: layer {} step has {} / {} / {} Q / K / V floats, expected {} / {} / {}", layer, q.size(),
         k.size(), v.size(), qn, kv, kv);
  }
  write_floats(l.k, k, qkv_trace_file(dir_, layer, 'k'));
  write_floats(l.v, v, qkv_trace_file(dir_, layer, 'v'));
  write_floats(l.q, q, qkv_trace_file(dir_, layer, 'q'));
  ++l.steps;
}

void QkvTraceWriter::finish() {
  if (finished_) return;
  for (std::uint32_t l = 0; l < header_.layers; ++l) {
    Layer& layer = *layers_[l];
    if (!layer.prompt || layer.steps != header_.decode_steps) {
      fail(ErrorCode::failed_precondition, "qkv trace writer: layer {} has {} prompt and {} of {} decode steps", l,
           layer.prompt ? "its" : "no", layer.steps, header_.decode_steps);
    }
    for (std::ofstream* f : {&layer.k, &layer.v, &layer.q}) {
      f->close();
      if (!*f) fail(ErrorCode::invalid_argument, "qkv trace: cannot finish layer {} files in '{}'", l, dir_.string());
    }
  }
  const fs::path path = dir_ / kManifest;
  std::ofstream out(path);
  out << fmt::format(
      "{} {}\n# sparsekv Q/K/V trace (docs/accuracy.md): per layer layer_NNN_{{k,v,q}}.f32, little-endian fp32,\n"
      "# K/V [prompt_tokens + decode_steps][kv_heads][head_dim], Q [decode_steps][q_heads][head_dim]\n"
      "layers {}\nq_heads {}\nkv_heads {}\nhead_dim {}\nprompt_tokens {}\ndecode_steps {}\ndtype f32\nrope {}\n",
      kMagic, kQkvTraceVersion, header_.layers, header_.q_heads, header_.kv_heads, header_.head_dim,
      header_.prompt_tokens, header_.decode_steps, rope_name(header_.rope));
  if (!header_.model.empty()) out << "model " << header_.model << "\n";
  out.close();
  if (!out) fail(ErrorCode::invalid_argument, "qkv trace: cannot write '{}'", path.string());
  finished_ = true;
}

void write_qkv_trace(const fs::path& dir, const QkvTrace& trace) {
  trace.validate();
  const QkvTraceHeader& h = trace.header;
  QkvTraceWriter writer(dir, h);
  const std::size_t kv = std::size_t{h.kv_heads} * h.head_dim, q = std::size_t{h.q_heads} * h.head_dim;
  for (std::uint32_t l = 0; l < h.layers; ++l) {
    const KvView prompt = trace.prompt(l);
    writer.prompt(l, prompt.keys, prompt.values);
    for (std::uint32_t s = 0; s < h.decode_steps; ++s) {
      const std::size_t t = std::size_t{h.prompt_tokens} + s;
      writer.decode(l, std::span<const float>(trace.layers[l].queries).subspan(s * q, q),
                    std::span<const float>(trace.layers[l].keys).subspan(t * kv, kv),
                    std::span<const float>(trace.layers[l].values).subspan(t * kv, kv));
    }
  }
  writer.finish();
}

// ---- synthetic -------------------------------------------------------------------

void validate(const SyntheticQkvOptions& o) {
  const auto bad = [](std::string_view knob, auto value, std::string_view rule) {
    fail(ErrorCode::invalid_argument, "synthetic qkv trace: {} = {}: {}", knob, value, rule);
  };
  QkvTraceHeader{o.layers, o.q_heads, o.kv_heads, o.head_dim, o.prompt_tokens, o.decode_steps, RopeStage::post_rope, {}}
      .validate();
  if (o.head_dim < 16) bad("head_dim", o.head_dim, "must be >= 16");
  if (o.topics == 0 || o.topics > 65536) bad("topics", o.topics, "must be in [1, 65536]");
  if (o.segment_tokens == 0) bad("segment_tokens", o.segment_tokens, "must be > 0");
  if (o.segment_topics == 0 || o.segment_topics > o.topics)
    bad("segment_topics", o.segment_topics, "must be in [1, topics]");
  if (!(o.run_tokens >= 1.0 && o.run_tokens <= 1e9)) bad("run_tokens", o.run_tokens, "must be in [1, 1e9]");
  if (!(o.topic_dwell >= 1.0 && o.topic_dwell <= 1e9)) bad("topic_dwell", o.topic_dwell, "must be in [1, 1e9]");
  if (o.blend_steps == 0) bad("blend_steps", o.blend_steps, "must be > 0");
  if (o.sink_tokens + std::uint64_t{o.heavy_hitters} > o.prompt_tokens) {
    bad("heavy_hitters", o.heavy_hitters, "sink_tokens + heavy_hitters must fit in prompt_tokens");
  }
  if (!(o.recency_tokens > 0.0 && o.recency_tokens <= 1e9))
    bad("recency_tokens", o.recency_tokens, "must be in (0, 1e9]");
  if (!(o.value_topic >= 0.0 && o.value_topic <= 1.0)) bad("value_topic", o.value_topic, "must be in [0, 1]");
  const std::pair<std::string_view, double> bounded[] = {
      {"key_noise", o.key_noise},        {"query_noise", o.query_noise}, {"head_noise", o.head_noise},
      {"topic_logit", o.topic_logit},    {"heavy_logit", o.heavy_logit}, {"sink_logit", o.sink_logit},
      {"recency_logit", o.recency_logit}};
  for (const auto& [knob, value] : bounded) {
    if (!(value >= 0.0 && value <= 100.0)) bad(knob, value, "must be in [0, 100]");
  }
}

std::vector<std::uint32_t> synthetic_heavy_hitters(const SyntheticQkvOptions& o, std::uint32_t layer,
                                                   std::uint32_t kv_head) {
  validate(o);
  check_index("synthetic qkv trace: layer", layer, o.layers);
  check_index("synthetic qkv trace: kv head", kv_head, o.kv_heads);
  detail::PortableRandom rng(stream_seed(o.seed, kHeavy, layer, kv_head));
  const std::uint32_t first = std::min(o.sink_tokens, o.prompt_tokens), span = o.prompt_tokens - first;
  std::vector<std::uint32_t> out;
  std::vector<bool> taken(span, false);
  while (out.size() < o.heavy_hitters) {
    const auto t = std::uint32_t(rng.below(span));
    if (taken[t]) continue;
    taken[t] = true;
    out.push_back(first + t);
  }
  std::sort(out.begin(), out.end());
  return out;
}

QkvTrace synthetic_qkv_trace(const SyntheticQkvOptions& o) {
  validate(o);
  QkvTrace trace;
  trace.header = {o.layers,        o.q_heads,      o.kv_heads,           o.head_dim,
                  o.prompt_tokens, o.decode_steps, RopeStage::post_rope, fmt::format("synthetic seed={}", o.seed)};
  const Document doc = make_document(o);
  trace.layers.resize(o.layers);
  for (std::uint32_t l = 0; l < o.layers; ++l) {
    QkvLayer& layer = trace.layers[l];
    layer.keys.resize(trace.header.kv_floats());
    layer.values.resize(trace.header.kv_floats());
    layer.queries.resize(trace.header.q_floats());
    for (std::uint32_t h = 0; h < o.kv_heads; ++h) generate_head(o, doc, l, h, layer);
  }
  return trace;
}

}  // namespace sparsekv
