#pragma once
// Q/K/V traces: the per-layer queries, keys and values of one request --
// prompt plus decode -- on which sparsekv-accuracy compares the policies with
// dense attention (docs/accuracy.md). A model writes one with QkvTraceWriter
// (one layer at a time, no need to hold the whole dump); the synthetic
// generator makes structured ones without a model.
//
// Format v1: a directory holding
//
//   manifest.txt         text, written last (a dump without it is incomplete)
//   layer_000_k.f32      K of every token, [tokens][kv_heads][head_dim]
//   layer_000_v.f32      V of every token, same shape
//   layer_000_q.f32      Q of every decode step, [decode_steps][q_heads][head_dim]
//   layer_001_k.f32 ...  (the layer number has at least 3 digits)
//
// The binary files are raw little-endian IEEE fp32, row-major, no header:
// tokens = prompt_tokens + decode_steps. Token t < prompt_tokens is a prompt
// token (offloaded at prefill); token prompt_tokens + s is the token decode
// step s feeds through the model: its K/V are appended to the cache, then Q
// row s -- that token's query, at position prompt_tokens + s -- attends to
// tokens 0 .. prompt_tokens + s (itself included). Every value must be finite.
//
// manifest.txt: one `key value` per line, `#` starts a comment, blank lines
// are ignored, keys in any order, each once:
//
//   sparsekv-qkv-trace 1        # magic and version: the first line
//   layers 2
//   q_heads 8                   # a multiple of kv_heads
//   kv_heads 2
//   head_dim 64                 # a positive multiple of 8
//   prompt_tokens 4096          # > 0
//   decode_steps 32             # > 0
//   dtype f32                   # v1: f32 only
//   rope post_rope              # optional (default post_rope): where q/k were taken
//   model Llama-3.1-8B ...      # optional free text, rest of the line
//
// Unknown keys are errors (a newer writer bumps the version). Errors:
// not_found for a missing directory or file, invalid_argument for a malformed
// manifest or a file of the wrong size or with a non-finite value; messages
// name the path (and the manifest line).
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "sparsekv/core/model_shape.hpp"
#include "sparsekv/policy/sparse_attention.hpp"

namespace sparsekv {

inline constexpr std::uint32_t kQkvTraceVersion = 1;

struct QkvTraceHeader {
  std::uint32_t layers = 0;
  std::uint32_t q_heads = 0;
  std::uint32_t kv_heads = 0;
  std::uint32_t head_dim = 0;
  std::uint32_t prompt_tokens = 0;
  std::uint32_t decode_steps = 0;
  RopeStage rope = RopeStage::post_rope;
  std::string model;  // free text, one line; may be empty

  std::uint32_t tokens() const noexcept { return prompt_tokens + decode_steps; }
  ModelShape shape() const noexcept { return {layers, q_heads, kv_heads, head_dim, DType::f32}; }
  // Floats in one layer's K (or V) file and Q file.
  std::size_t kv_floats() const noexcept { return std::size_t{tokens()} * kv_heads * head_dim; }
  std::size_t q_floats() const noexcept { return std::size_t{decode_steps} * q_heads * head_dim; }
  // Throws invalid_argument naming the first bad field.
  void validate() const;
};

struct QkvLayer {
  std::vector<float> keys;     // [tokens][kv_heads][head_dim]
  std::vector<float> values;   // [tokens][kv_heads][head_dim]
  std::vector<float> queries;  // [decode_steps][q_heads][head_dim]
};

struct QkvTrace {
  QkvTraceHeader header;
  std::vector<QkvLayer> layers;

  // The prompt's K/V of a layer, as Index sees it.
  KvView prompt(std::uint32_t layer) const;
  // K / V rows of one token, [kv_heads][head_dim].
  const float* key(std::uint32_t layer, std::uint32_t token) const;
  const float* value(std::uint32_t layer, std::uint32_t token) const;
  // The query of decode step `step`, at position prompt_tokens + step.
  DecodeQuery query(std::uint32_t layer, std::uint32_t step) const;
  // Header, layer count and every array's size; throws invalid_argument.
  void validate() const;
};

// Exact attention of decode step `step` in `layer` over tokens 0 ..
// prompt_tokens + step, accumulated in fp64, scale 1/sqrt(head_dim): the
// dense reference. out: [q_heads][head_dim]; lse (optional): [q_heads], the
// log-sum-exp of each q head's scores.
void reference_attention(const QkvTrace& trace, std::uint32_t layer, std::uint32_t step, float* out,
                         double* lse = nullptr);

// ---- reading ----------------------------------------------------------------
std::filesystem::path qkv_trace_file(const std::filesystem::path& dir, std::uint32_t layer, char what);  // 'k' 'v' 'q'
QkvTraceHeader read_qkv_trace_header(const std::filesystem::path& dir);
QkvLayer read_qkv_trace_layer(const std::filesystem::path& dir, const QkvTraceHeader& header, std::uint32_t layer);
QkvTrace read_qkv_trace(const std::filesystem::path& dir);

// ---- writing ----------------------------------------------------------------
// Streams a dump to `dir` (created if missing; existing files are replaced):
// per layer first the prompt's K/V, then one decode() per step, in any layer
// order; finish() checks that every layer got everything and writes the
// manifest. Without finish() (an exception, a crash) there is no manifest and
// readers reject the directory.
class QkvTraceWriter {
 public:
  QkvTraceWriter(std::filesystem::path dir, QkvTraceHeader header);
  ~QkvTraceWriter();
  QkvTraceWriter(const QkvTraceWriter&) = delete;
  QkvTraceWriter& operator=(const QkvTraceWriter&) = delete;

  // keys / values: [prompt_tokens][kv_heads][head_dim].
  void prompt(std::uint32_t layer, std::span<const float> keys, std::span<const float> values);
  // One decode step of a layer: q [q_heads][head_dim], k / v [kv_heads][head_dim].
  void decode(std::uint32_t layer, std::span<const float> q, std::span<const float> k, std::span<const float> v);
  void finish();

  const QkvTraceHeader& header() const noexcept { return header_; }

 private:
  struct Layer;
  std::filesystem::path dir_;
  QkvTraceHeader header_;
  std::vector<std::unique_ptr<Layer>> layers_;
  bool finished_ = false;
};

// Writes a whole trace (validated first) through QkvTraceWriter.
void write_qkv_trace(const std::filesystem::path& dir, const QkvTrace& trace);

// ---- synthetic traces -------------------------------------------------------
// Structured, post-RoPE-like Q/K/V. Per (layer, kv head), in logit units
// (q.k / sqrt(head_dim)); q = d^(1/4) q', k = d^(1/4) k' with q'.k' the logit:
//  - Topics: `topics` orthonormal cluster centres in the content subspace
//    (head_dim minus the position dims). The prompt is cut into segments of
//    `segment_tokens`; each segment draws `segment_topics` of the topics and
//    is written in runs of consecutive tokens of one topic (run length
//    geometric, mean `run_tokens`). A key is its topic's centre plus noise of
//    relative size `key_noise`, normalised. Which token has which topic is
//    shared by all layers and heads (one document); the centres are per head.
//  - Queries: the decode has a current topic (shared, like the document);
//    every step it moves on with probability 1 / topic_dwell to another topic
//    present in the prompt, blending from the old one to the new over
//    `blend_steps` steps, so consecutive steps attend to similar places.
//    Content part: topic_logit * normalise(topic mix + query_noise * per-step
//    noise + head_noise * a fixed per-q-head offset), so a key of the query's
//    topic scores about 0.9 topic_logit and other topics about 0.
//  - Heavy hitters: `heavy_hitters` prompt tokens per (layer, kv head) at
//    random positions (synthetic_heavy_hitters) whose keys lie (with
//    key_noise) on a direction every query of that kv head carries with
//    weight heavy_logit.
//  - Attention sinks: the first `sink_tokens` tokens, keyed exactly on another
//    direction every query carries with weight sink_logit, without a position
//    part (they score sink_logit at any distance); values 10x smaller.
//  - Recency: head_dim / 8 RoPE-like rotation pairs (the last head_dim / 4
//    dims), theta_j = 0.3 * 1.3^j / recency_tokens: adds recency_logit *
//    mean_j cos(theta_j (position - t)), about recency_logit for the last
//    ~recency_tokens / 2 tokens, half at ~recency_tokens, then a ripple of
//    about +-0.25 recency_logit.
//  - Values: sqrt(value_topic) * the topic's value centre + sqrt(1 -
//    value_topic) * noise, elementwise unit variance; heavy hitters get their
//    own random values. Decode tokens belong to the query's current topic.
// Each (layer, kv head) draws from its own std::mt19937_64 stream (seeded
// from `seed`, the layer and the head) with hand-written uniform / normal
// transforms: a seed gives the same trace with any standard library.
struct SyntheticQkvOptions {
  std::uint64_t seed = 1;
  // Geometry.
  std::uint32_t layers = 4;  // Quest keeps layers 0-1 dense: 4 leaves it two sparse ones
  std::uint32_t q_heads = 8;
  std::uint32_t kv_heads = 2;
  std::uint32_t head_dim = 64;
  std::uint32_t prompt_tokens = 4096;
  std::uint32_t decode_steps = 32;
  // Topical locality.
  std::uint32_t topics = 16;           // cluster centres per (layer, kv head)
  std::uint32_t segment_tokens = 512;  // prompt segment length
  std::uint32_t segment_topics = 3;    // topics per segment (<= topics)
  double run_tokens = 16;              // mean run of one topic inside a segment (>= 1)
  double key_noise = 0.5;              // key spread around its centre (relative)
  double topic_logit = 6;              // logit of an on-topic key at the centre
  double topic_dwell = 8;              // mean decode steps on one topic (>= 1)
  std::uint32_t blend_steps = 4;       // steps to blend into the next topic (>= 1)
  double query_noise = 0.3;            // per-step query noise (relative)
  double head_noise = 0.3;             // fixed per-q-head offset within a GQA group (relative)
  // Heavy hitters and attention sinks.
  std::uint32_t heavy_hitters = 8;  // per (layer, kv head), in the prompt after the sinks
  double heavy_logit = 8;
  std::uint32_t sink_tokens = 4;
  double sink_logit = 5;
  // Recency bias.
  double recency_logit = 2;
  double recency_tokens = 64;
  // Values.
  double value_topic = 0.5;  // share of a value's variance from its topic, in [0, 1]
};

// Throws invalid_argument naming a knob out of range.
void validate(const SyntheticQkvOptions& options);
// Generator; throws like validate().
QkvTrace synthetic_qkv_trace(const SyntheticQkvOptions& options);
// The planted heavy-hitter positions of one (layer, kv head), ascending.
std::vector<std::uint32_t> synthetic_heavy_hitters(const SyntheticQkvOptions& options, std::uint32_t layer,
                                                   std::uint32_t kv_head);

}  // namespace sparsekv
