#pragma once
// SmolLM2 / Llama forward pass on the CPU, fp32, attention through sparsekv.
//
// LlamaModel dequantises every weight of a llama.cpp GGUF checkpoint to fp32
// once (SmolLM2-135M: ~540 MB) and runs the decoder: RMSNorm, RoPE (llama.cpp's
// NORM style, see apply_rope in llama.cpp), grouped-query attention, SwiGLU,
// tied or separate output head. Matrix products use every hardware thread
// (rows split between them); inner loops are vectorised per CPU at run time.
//
// Attention is pluggable per sequence (AttentionBackend):
//  - the prompt (prefill) is always computed densely, causally, by the model
//    itself; its post-RoPE K/V of each layer are handed to every backend
//    (sparsekv's Index + Offload for SparseSession);
//  - each decode token's attention is the backend's: DenseCache (the model's
//    own KV cache, exact: the "Dense" reference, no sparsekv) or SparseSession
//    (sparsekv::RuntimeManager::decode with any built-in policy).
// Several sequences can be decoded in lockstep (one row each): the weights are
// read once per step for all of them.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "model/gguf.hpp"
#include "sparsekv/sparsekv.hpp"

namespace sparsekv::model {

struct LlamaConfig {
  std::uint32_t layers = 0;
  std::uint32_t hidden = 0;
  std::uint32_t ffn = 0;
  std::uint32_t q_heads = 0;
  std::uint32_t kv_heads = 0;
  std::uint32_t head_dim = 0;
  std::uint32_t vocab = 0;
  std::uint32_t context = 0;  // training context (llama.context_length)
  float rms_eps = 1e-5f;
  float rope_base = 10000.0f;
  // What sparsekv stores K/V (and takes q) in. The model computes in fp32;
  // f16 or bf16 halves the bytes a decode step reads (llama.cpp's default
  // KV cache is f16). Not a GGUF field: the caller's choice.
  DType kv_dtype = DType::f32;

  ModelShape shape() const { return {layers, q_heads, kv_heads, head_dim, kv_dtype}; }
};

// One sequence's attention from the model's point of view. Row-major fp32,
// post-RoPE.
class AttentionBackend {
 public:
  virtual ~AttentionBackend() = default;
  // The prompt's K/V of `layer`: [tokens][kv_heads][head_dim].
  virtual void prefill(std::uint32_t layer, const float* k, const float* v, std::uint32_t tokens) = 0;
  // One decode token of `layer`: q [q_heads][head_dim]; k, v [kv_heads][head_dim]
  // (the token's own, attended to as well); out [q_heads][head_dim].
  virtual void decode(std::uint32_t layer, const float* q, const float* k, const float* v, float* out) = 0;
};

// The model's own exact KV cache: the Dense reference, no sparsekv involved;
// fp32 K/V whatever config.kv_dtype says.
class DenseCache final : public AttentionBackend {
 public:
  explicit DenseCache(const LlamaConfig& config);
  void prefill(std::uint32_t layer, const float* k, const float* v, std::uint32_t tokens) override;
  void decode(std::uint32_t layer, const float* q, const float* k, const float* v, float* out) override;
  std::uint32_t tokens(std::uint32_t layer) const;

 private:
  LlamaConfig config_;
  std::vector<std::vector<float>> keys_, values_;  // [layer][token][kv_heads][head_dim]
  std::vector<float> scores_;
};

// The model's thread pool as a decode step's executor: the engine lends
// sparsekv the threads it computes with (run from inside a pool task, the
// work stays on the calling thread).
StepExecutor engine_executor();

// Attention through sparsekv: request `id` of `manager` (added by the caller
// with enough max_tokens). Prefill = Index + Offload; decode = append,
// Select, Retrieve, Attend, the step's Select and Attend on the model's
// threads (engine_executor). The model's fp32 q, K and V are rounded to the
// manager's dtype (LlamaConfig::kv_dtype) on the way in, as an engine with
// an f16 cache stores them.
class SparseSession : public AttentionBackend {
 public:
  SparseSession(RuntimeManager& manager, RequestId id);
  void prefill(std::uint32_t layer, const float* k, const float* v, std::uint32_t tokens) override;
  void decode(std::uint32_t layer, const float* q, const float* k, const float* v, float* out) override;
  RuntimeManager& manager() { return manager_; }
  RequestId id() const { return id_; }

 private:
  // `values` fp32 values in the manager's dtype: `values` itself for f32,
  // else a copy in `scratch`.
  const void* stored(const float* values, std::size_t n, std::vector<std::byte>& scratch) const;

  RuntimeManager& manager_;
  RequestId id_;
  StepExecutor executor_;
  DType dtype_;
  std::vector<std::byte> q_, k_, v_;
};

// A RuntimeManager sized for `requests` requests of up to `max_tokens` tokens
// each of `config`'s shape (K/V in its kv_dtype, host backend), tiers sized
// from what the policy needs: the CPU tier every page a head can hold (the policy's
// head_capacity, else the context's pages) plus a small margin; the GPU tier
// each request's bucketed-LRU buffer (mandatory pages x (1 + min_buffer_ratio),
// Spin's 5x) and its tail pages, but never more slots than a head can hold
// (Quest's dense layers make the whole context mandatory). `base` gives the
// settings the sizing leaves as they are (page_tokens, eviction_strategy, ...).
// `backend`: HostBackend when null; an InPlaceBackend uses no GPU tier.
std::unique_ptr<RuntimeManager> make_manager(const LlamaConfig& config, AnyPolicy policy, std::uint32_t max_tokens,
                                             std::uint32_t requests = 1, const Config& base = {},
                                             std::unique_ptr<Backend> backend = nullptr);

class LlamaModel {
 public:
  // Reads the hyper-parameters (architecture must be "llama") and dequantises
  // every weight. Throws sparsekv::Error naming what is missing or wrong.
  explicit LlamaModel(const GgufFile& file);
  ~LlamaModel();
  LlamaModel(LlamaModel&&) noexcept;
  LlamaModel& operator=(LlamaModel&&) noexcept;

  const LlamaConfig& config() const { return config_; }
  unsigned threads() const;

  // x[t] = embedding of tokens[t]: [tokens][hidden]. Throws on an id out of range.
  void embed(std::span<const std::int32_t> tokens, float* x) const;

  // Runs the prompt (positions 0 .. T-1) through every layer with dense causal
  // attention and gives each layer's post-RoPE K/V to every sink. logits:
  // [vocab] for the last position, or [T][vocab] with all_positions.
  void prefill(std::span<const std::int32_t> tokens, std::span<AttentionBackend* const> sinks, float* logits,
               bool all_positions = false) const;

  // One decode step of rows.size() sequences in lockstep: row r feeds
  // tokens[r] at `position` (every row holds `position` tokens before it) and
  // attends through rows[r]. logits: [rows][vocab].
  void decode(std::span<const std::int32_t> tokens, std::uint32_t position, std::span<AttentionBackend* const> rows,
              float* logits) const;

  struct Weights;

 private:
  LlamaConfig config_;
  std::unique_ptr<Weights> w_;
};

// Index of the largest element (the first of ties).
std::uint32_t argmax(std::span<const float> logits);
// log softmax(logits)[target], in fp64.
double log_prob(std::span<const float> logits, std::uint32_t target);

}  // namespace sparsekv::model
