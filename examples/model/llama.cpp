#include "llama.hpp"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <limits>
#include <mutex>
#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "sparsekv/core/error.hpp"
#include "sparsekv/core/numeric.hpp"
#include "sparsekv/facade/serving_config.hpp"
#include "spin_wait.hpp"

// Hot loops are compiled per instruction set and picked at load time (GCC
// function multi-versioning): AVX-512 / AVX2+FMA where the CPU has them,
// baseline x86-64 otherwise. Elsewhere one portable version.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define SKV_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define SKV_CLONES
#endif
#define SKV_INLINE inline __attribute__((always_inline))

namespace sparsekv::model {
namespace {

// ---- thread pool ------------------------------------------------------------
// run(fn) calls fn(i) for i in [0, size()) on size() threads (the caller is
// thread 0) and returns when all are done. A run from inside a run executes
// serially on the calling thread. A decode step hands the pool many short
// jobs (each layer's matmuls, sparsekv's select and attend phases), so a
// worker waiting for the next job, and the caller waiting for the workers,
// poll before they sleep (tools/spin_wait.hpp).
class Pool {
 public:
  explicit Pool(unsigned threads) {
    for (unsigned i = 1; i < threads; ++i) workers_.emplace_back([this, i] { work(i); });
  }
  ~Pool() {
    {
      std::lock_guard lock(m_);
      stop_.store(true);
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
  }
  unsigned size() const { return static_cast<unsigned>(workers_.size()) + 1; }

  void run(const std::function<void(unsigned)>& fn) {
    if (workers_.empty() || inside_) {
      for (unsigned i = 0; i < size(); ++i) fn(i);
      return;
    }
    {
      std::lock_guard lock(m_);
      job_ = &fn;
      error_ = nullptr;
      pending_.store(static_cast<unsigned>(workers_.size()));
      generation_.fetch_add(1, std::memory_order_release);
    }
    cv_.notify_all();
    std::exception_ptr mine;
    inside_ = true;
    try {
      fn(0);
    } catch (...) {
      mine = std::current_exception();
    }
    inside_ = false;
    tools::spin_until([&] { return pending_.load(std::memory_order_acquire) == 0; });
    {
      std::unique_lock lock(m_);
      done_.wait(lock, [&] { return pending_.load(std::memory_order_acquire) == 0; });
      job_ = nullptr;
    }
    if (mine) std::rethrow_exception(mine);
    if (error_) std::rethrow_exception(error_);
  }

 private:
  void work(unsigned index) {
    std::uint64_t seen = 0;
    while (true) {
      tools::spin_until([&] { return generation_.load(std::memory_order_acquire) != seen || stop_.load(); });
      const std::function<void(unsigned)>* job = nullptr;
      {
        std::unique_lock lock(m_);
        cv_.wait(lock, [&] { return stop_.load() || generation_.load() != seen; });
        if (stop_.load()) return;
        seen = generation_.load();
        job = job_;
      }
      inside_ = true;
      try {
        (*job)(index);
      } catch (...) {
        std::lock_guard lock(m_);
        if (!error_) error_ = std::current_exception();
      }
      inside_ = false;
      if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
        std::lock_guard lock(m_);
        done_.notify_one();
      }
    }
  }

  std::vector<std::thread> workers_;
  std::mutex m_;
  std::condition_variable cv_, done_;
  const std::function<void(unsigned)>* job_ = nullptr;
  std::atomic<std::uint64_t> generation_{0};
  std::atomic<unsigned> pending_{0};
  std::atomic<bool> stop_{false};
  std::exception_ptr error_;
  static thread_local bool inside_;
};
thread_local bool Pool::inside_ = false;

Pool& pool() {
  static Pool p([] {
    if (const char* env = std::getenv("SPARSEKV_THREADS")) {
      const int n = std::atoi(env);
      if (n > 0) return static_cast<unsigned>(n);
    }
    return std::max(1u, std::thread::hardware_concurrency());
  }());
  return p;
}

// Splits [0, n) into pool().size() contiguous parts aligned to `align`.
template <class F>
void parallel_rows(std::size_t n, std::size_t align, F&& f) {
  Pool& p = pool();
  const unsigned parts = p.size();
  if (parts == 1 || n <= align) {
    f(std::size_t{0}, n);
    return;
  }
  p.run([&](unsigned i) {
    const auto cut = [&](unsigned j) { return std::min(n, (n * j / parts + align - 1) / align * align); };
    const std::size_t b = cut(i), e = i + 1 == parts ? n : cut(i + 1);
    if (b < e) f(b, e);
  });
}

// Work units [0, n) handed out dynamically to the pool's threads.
template <class F>
void parallel_units(std::size_t n, F&& f) {
  std::atomic<std::size_t> next{0};
  pool().run([&](unsigned) {
    for (std::size_t u; (u = next.fetch_add(1)) < n;) f(u);
  });
}

// ---- vector kernels -----------------------------------------------------------
typedef float v8 __attribute__((vector_size(32)));
typedef std::int32_t v8i __attribute__((vector_size(32)));

SKV_INLINE v8 load8(const float* p) {
  v8 r;
  __builtin_memcpy(&r, p, sizeof r);
  return r;
}
SKV_INLINE void store8(float* p, v8 x) { __builtin_memcpy(p, &x, sizeof x); }
SKV_INLINE v8 splat(float x) { return v8{x, x, x, x, x, x, x, x}; }
SKV_INLINE float hsum(v8 v) { return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7])); }
SKV_INLINE float hmax(v8 v) {
  float m = v[0];
  for (int i = 1; i < 8; ++i) m = std::max(m, v[i]);
  return m;
}

// exp(x) for x <= 0-ish softmax inputs and SiLU: Cephes expf polynomial after
// range reduction, ~2 ulp; inputs clamped to [-87.3, 88.3].
SKV_INLINE v8 vexp(v8 x) {
  x = x < splat(-87.3f) ? splat(-87.3f) : x;
  x = x > splat(88.3f) ? splat(88.3f) : x;
  const v8 magic = splat(12582912.0f);  // 1.5 * 2^23: round to nearest
  v8 n = (x * splat(1.44269504088896341f) + magic) - magic;
  v8 r = x - n * splat(0.693359375f);
  r = r - n * splat(-2.12194440e-4f);
  v8 p = splat(1.9875691500e-4f);
  p = p * r + splat(1.3981999507e-3f);
  p = p * r + splat(8.3334519073e-3f);
  p = p * r + splat(4.1665795894e-2f);
  p = p * r + splat(1.6666665459e-1f);
  p = p * r + splat(5.0000001201e-1f);
  p = p * r * r + r + splat(1.0f);
  const v8i e = (__builtin_convertvector(n, v8i) + 127) << 23;
  v8 scale;
  __builtin_memcpy(&scale, &e, sizeof scale);
  return p * scale;
}
SKV_INLINE float sexp(float x) {
  v8 v = splat(x);
  return vexp(v)[0];
}

// C[t][o] = sum_k A[t][k] * B[o][k] for a TM x ON tile.
template <int TM, int ON>
SKV_INLINE void tile(const float* A, std::size_t lda, const float* B, std::size_t ldb, float* C, std::size_t ldc,
                     std::size_t K) {
  v8 acc[TM][ON] = {};
  const std::size_t K8 = K & ~std::size_t{7};
  for (std::size_t k = 0; k < K8; k += 8) {
    v8 b[ON];
    for (int o = 0; o < ON; ++o) b[o] = load8(B + o * ldb + k);
    for (int t = 0; t < TM; ++t) {
      const v8 a = load8(A + t * lda + k);
      for (int o = 0; o < ON; ++o) acc[t][o] += a * b[o];
    }
  }
  for (int t = 0; t < TM; ++t) {
    for (int o = 0; o < ON; ++o) {
      float s = hsum(acc[t][o]);
      for (std::size_t k = K8; k < K; ++k) s += A[t * lda + k] * B[o * ldb + k];
      C[t * ldc + o] = s;
    }
  }
}

template <int TM>
SKV_INLINE void tile_row(const float* A, std::size_t lda, const float* B, std::size_t ldb, float* C, std::size_t ldc,
                         std::size_t o0, std::size_t o1, std::size_t K) {
  std::size_t o = o0;
  for (; o + 4 <= o1; o += 4) tile<TM, 4>(A, lda, B + o * ldb, ldb, C + o, ldc, K);
  for (; o < o1; ++o) tile<TM, 1>(A, lda, B + o * ldb, ldb, C + o, ldc, K);
}

// C[t * ldc + o] = sum_k A[t * lda + k] * B[o * ldb + k] for t < T, o in [o0, o1).
SKV_CLONES void gemm_nt(const float* A, std::size_t lda, const float* B, std::size_t ldb, float* C, std::size_t ldc,
                        std::size_t T, std::size_t o0, std::size_t o1, std::size_t K) {
  constexpr std::size_t kBlock = 64;  // rows of B kept hot while all of A streams by
  for (std::size_t b0 = o0; b0 < o1; b0 += kBlock) {
    const std::size_t b1 = std::min(o1, b0 + kBlock);
    std::size_t t = 0;
    for (; t + 4 <= T; t += 4) tile_row<4>(A + t * lda, lda, B, ldb, C + t * ldc, ldc, b0, b1, K);
    switch (T - t) {
      case 3:
        tile_row<3>(A + t * lda, lda, B, ldb, C + t * ldc, ldc, b0, b1, K);
        break;
      case 2:
        tile_row<2>(A + t * lda, lda, B, ldb, C + t * ldc, ldc, b0, b1, K);
        break;
      case 1:
        tile_row<1>(A + t * lda, lda, B, ldb, C + t * ldc, ldc, b0, b1, K);
        break;
      default:
        break;
    }
  }
}

// Y [T][M] = X [T][K] W^T, W [M][K]; output rows split over the threads.
void matmul(const float* X, std::size_t T, const float* W, std::size_t M, std::size_t K, float* Y) {
  parallel_rows(M, 16, [&](std::size_t b, std::size_t e) { gemm_nt(X, K, W, K, Y, M, T, b, e, K); });
}

// Softmax of s[0, n) * scale in place; s[n, zero_to) = 0.
SKV_CLONES void softmax_row(float* s, std::size_t n, std::size_t zero_to, float scale) {
  const std::size_t n8 = n & ~std::size_t{7};
  float m = -std::numeric_limits<float>::infinity();
  if (n8 > 0) {
    v8 mv = load8(s);
    for (std::size_t j = 8; j < n8; j += 8) {
      const v8 x = load8(s + j);
      mv = x > mv ? x : mv;
    }
    m = hmax(mv);
  }
  for (std::size_t j = n8; j < n; ++j) m = std::max(m, s[j]);
  const v8 mv = splat(m), sv = splat(scale);
  v8 sum = {};
  for (std::size_t j = 0; j < n8; j += 8) {
    const v8 e = vexp((load8(s + j) - mv) * sv);
    store8(s + j, e);
    sum += e;
  }
  float total = hsum(sum);
  for (std::size_t j = n8; j < n; ++j) {
    s[j] = sexp((s[j] - m) * scale);
    total += s[j];
  }
  const float inv = 1.0f / total;
  const v8 iv = splat(inv);
  for (std::size_t j = 0; j < n8; j += 8) store8(s + j, load8(s + j) * iv);
  for (std::size_t j = n8; j < n; ++j) s[j] *= inv;
  for (std::size_t j = n; j < zero_to; ++j) s[j] = 0.0f;
}

// h[i] = silu(g[i]) * u[i] for rows of gu = [gate (ffn) | up (ffn)].
SKV_CLONES void swiglu_rows(const float* gu, std::size_t rows, std::size_t ffn, float* h) {
  for (std::size_t r = 0; r < rows; ++r) {
    const float* g = gu + r * 2 * ffn;
    const float* u = g + ffn;
    float* o = h + r * ffn;
    std::size_t i = 0;
    for (; i + 8 <= ffn; i += 8) {
      const v8 x = load8(g + i);
      store8(o + i, x / (splat(1.0f) + vexp(-x)) * load8(u + i));
    }
    for (; i < ffn; ++i) o[i] = g[i] / (1.0f + sexp(-g[i])) * u[i];
  }
}

// out [head_dim] = softmax(q . k_j * scale) . v_j over j < n; k_j at k + j * stride.
SKV_CLONES void attend_head(const float* q, const float* k, const float* v, std::size_t stride, std::size_t n,
                            std::size_t head_dim, float scale, float* scores, float* out) {
  for (std::size_t j = 0; j < n; ++j) {
    const float* kj = k + j * stride;
    v8 acc = {};
    std::size_t d = 0;
    for (; d + 8 <= head_dim; d += 8) acc += load8(q + d) * load8(kj + d);
    float s = hsum(acc);
    for (; d < head_dim; ++d) s += q[d] * kj[d];
    scores[j] = s;
  }
  softmax_row(scores, n, n, scale);
  std::fill(out, out + head_dim, 0.0f);
  for (std::size_t j = 0; j < n; ++j) {
    const float p = scores[j];
    const float* vj = v + j * stride;
    std::size_t d = 0;
    for (; d + 8 <= head_dim; d += 8) store8(out + d, load8(out + d) + splat(p) * load8(vj + d));
    for (; d < head_dim; ++d) out[d] += p * vj[d];
  }
}

// x[t] = rmsnorm(x[t]) * w for t < rows.
void rmsnorm(const float* x, std::size_t rows, std::size_t n, const float* w, float eps, float* y) {
  for (std::size_t r = 0; r < rows; ++r) {
    const float* xr = x + r * n;
    double ss = 0;
    for (std::size_t i = 0; i < n; ++i) ss += double(xr[i]) * xr[i];
    const float inv = static_cast<float>(1.0 / std::sqrt(ss / double(n) + eps));
    for (std::size_t i = 0; i < n; ++i) y[r * n + i] = xr[i] * inv * w[i];
  }
}

// ============================================================================
// RoPE -- the ONE place that decides the rotation style.
// llama.cpp's converter permutes Llama's q/k projection rows so that its NORM
// rope applies: rotate adjacent pairs (x[2i], x[2i+1]) by pos * base^(-2i/d).
// (HF's rotate_half / NEOX style would pair x[i] with x[i + d/2] instead.)
// ============================================================================
void apply_rope(float* x, std::uint32_t heads, std::uint32_t head_dim, std::uint32_t position,
                const std::vector<float>& inv_freq) {
  for (std::uint32_t i = 0; i < head_dim / 2; ++i) {
    const double angle = double(position) * inv_freq[i];
    const float c = static_cast<float>(std::cos(angle)), s = static_cast<float>(std::sin(angle));
    for (std::uint32_t h = 0; h < heads; ++h) {
      float* p = x + std::size_t{h} * head_dim + 2 * i;
      const float a = p[0], b = p[1];
      p[0] = a * c - b * s;
      p[1] = a * s + b * c;
    }
  }
}

}  // namespace

// ---- weights ------------------------------------------------------------------
struct LlamaModel::Weights {
  struct Layer {
    std::vector<float> attn_norm, ffn_norm;
    std::vector<float> qkv;      // [q_heads*hd + 2*kv_heads*hd][hidden]: attn_q, attn_k, attn_v
    std::vector<float> out;      // [hidden][q_heads*hd]
    std::vector<float> gate_up;  // [2*ffn][hidden]: ffn_gate, ffn_up
    std::vector<float> down;     // [hidden][ffn]
  };
  std::vector<float> embedding;  // [vocab][hidden]
  std::vector<float> output;     // [vocab][hidden]; empty = tied to embedding
  std::vector<float> output_norm;
  std::vector<Layer> layers;
  std::vector<float> inv_freq;  // [head_dim / 2]

  const float* head() const { return output.empty() ? embedding.data() : output.data(); }
};

namespace {

std::vector<float> load(const GgufFile& file, const std::string& name, std::vector<std::uint64_t> dims) {
  if (!file.has_tensor(name)) fail(ErrorCode::not_found, "{}: tensor '{}' is missing", file.path().string(), name);
  const GgufTensor& t = file.tensor(name);
  if (t.dims != dims) {
    fail(ErrorCode::invalid_argument, "{}: tensor '{}' has dims [{}], expected [{}]", file.path().string(), name,
         fmt::join(t.dims, ", "), fmt::join(dims, ", "));
  }
  return file.dequantize(t);
}

void append(std::vector<float>& to, std::vector<float>&& from) { to.insert(to.end(), from.begin(), from.end()); }

}  // namespace

LlamaModel::LlamaModel(const GgufFile& file) : w_(std::make_unique<Weights>()) {
  const std::string arch = file.has("general.architecture") ? file.string("general.architecture") : "";
  if (arch != "llama") {
    fail(ErrorCode::invalid_argument, "{}: architecture '{}' is not supported (only llama)", file.path().string(),
         arch);
  }
  auto u32 = [&](std::string_view key) { return static_cast<std::uint32_t>(file.uint(key)); };
  LlamaConfig& c = config_;
  c.layers = u32("llama.block_count");
  c.hidden = u32("llama.embedding_length");
  c.ffn = u32("llama.feed_forward_length");
  c.q_heads = u32("llama.attention.head_count");
  c.kv_heads = file.has("llama.attention.head_count_kv") ? u32("llama.attention.head_count_kv") : c.q_heads;
  c.head_dim = file.has("llama.attention.key_length") ? u32("llama.attention.key_length")
                                                      : (c.q_heads ? c.hidden / c.q_heads : 0);
  c.context = file.has("llama.context_length") ? u32("llama.context_length") : 0;
  c.rms_eps = static_cast<float>(file.real("llama.attention.layer_norm_rms_epsilon"));
  c.rope_base = file.has("llama.rope.freq_base") ? static_cast<float>(file.real("llama.rope.freq_base")) : 10000.0f;
  if (c.layers == 0 || c.hidden == 0 || c.q_heads == 0 || c.kv_heads == 0 || c.q_heads % c.kv_heads != 0 ||
      c.head_dim == 0 || c.head_dim % 2 != 0 || c.ffn == 0) {
    fail(ErrorCode::invalid_argument,
         "{}: unsupported llama hyper-parameters (layers {}, hidden {}, heads {}/{}, head_dim {})",
         file.path().string(), c.layers, c.hidden, c.q_heads, c.kv_heads, c.head_dim);
  }
  if (file.has("llama.rope.dimension_count") && u32("llama.rope.dimension_count") != c.head_dim) {
    fail(ErrorCode::invalid_argument, "{}: partial rotary embeddings are not supported", file.path().string());
  }
  if (!file.has_tensor("token_embd.weight"))
    fail(ErrorCode::not_found, "{}: no token_embd.weight", file.path().string());
  c.vocab = static_cast<std::uint32_t>(file.tensor("token_embd.weight").rows());

  const std::uint64_t H = c.hidden, F = c.ffn, QD = std::uint64_t{c.q_heads} * c.head_dim,
                      KD = std::uint64_t{c.kv_heads} * c.head_dim;
  Weights& w = *w_;
  w.embedding = load(file, "token_embd.weight", {H, c.vocab});
  if (file.has_tensor("output.weight")) w.output = load(file, "output.weight", {H, c.vocab});
  w.output_norm = load(file, "output_norm.weight", {H});
  w.layers.resize(c.layers);
  for (std::uint32_t l = 0; l < c.layers; ++l) {
    const std::string p = fmt::format("blk.{}.", l);
    Weights::Layer& L = w.layers[l];
    L.attn_norm = load(file, p + "attn_norm.weight", {H});
    L.ffn_norm = load(file, p + "ffn_norm.weight", {H});
    L.qkv = load(file, p + "attn_q.weight", {H, QD});
    append(L.qkv, load(file, p + "attn_k.weight", {H, KD}));
    append(L.qkv, load(file, p + "attn_v.weight", {H, KD}));
    L.out = load(file, p + "attn_output.weight", {QD, H});
    L.gate_up = load(file, p + "ffn_gate.weight", {H, F});
    append(L.gate_up, load(file, p + "ffn_up.weight", {H, F}));
    L.down = load(file, p + "ffn_down.weight", {F, H});
  }
  w.inv_freq.resize(c.head_dim / 2);
  for (std::uint32_t i = 0; i < c.head_dim / 2; ++i) {
    w.inv_freq[i] = static_cast<float>(std::pow(double(c.rope_base), -2.0 * i / double(c.head_dim)));
  }
}

LlamaModel::~LlamaModel() = default;
LlamaModel::LlamaModel(LlamaModel&&) noexcept = default;
LlamaModel& LlamaModel::operator=(LlamaModel&&) noexcept = default;

unsigned LlamaModel::threads() const { return pool().size(); }

void LlamaModel::embed(std::span<const std::int32_t> tokens, float* x) const {
  for (std::size_t t = 0; t < tokens.size(); ++t) {
    if (tokens[t] < 0 || static_cast<std::uint32_t>(tokens[t]) >= config_.vocab) {
      fail(ErrorCode::out_of_range, "token id {} out of range [0, {})", tokens[t], config_.vocab);
    }
    std::memcpy(x + t * config_.hidden, w_->embedding.data() + std::size_t(tokens[t]) * config_.hidden,
                config_.hidden * sizeof(float));
  }
}

void LlamaModel::prefill(std::span<const std::int32_t> tokens, std::span<AttentionBackend* const> sinks, float* logits,
                         bool all_positions) const {
  const LlamaConfig& c = config_;
  const std::size_t T = tokens.size();
  if (T == 0) fail(ErrorCode::invalid_argument, "prefill of an empty prompt");
  const std::size_t H = c.hidden, QD = std::size_t{c.q_heads} * c.head_dim, KD = std::size_t{c.kv_heads} * c.head_dim,
                    QKV = QD + 2 * KD, F = c.ffn, hd = c.head_dim, group = c.q_heads / c.kv_heads;
  std::vector<float> x(T * H), xn(T * H), qkv(T * QKV), k(T * KD), v(T * KD), att(T * QD), tmp(T * H), gu(T * 2 * F),
      h(T * F);
  std::vector<float> vt(KD * T);  // [kv_head][d][token]: V transposed for P.V as a gemm
  embed(tokens, x.data());
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  constexpr std::size_t kTile = 64;  // query rows per attention work unit
  const std::size_t tiles = (T + kTile - 1) / kTile;

  for (std::uint32_t l = 0; l < c.layers; ++l) {
    const Weights::Layer& L = w_->layers[l];
    rmsnorm(x.data(), T, H, L.attn_norm.data(), c.rms_eps, xn.data());
    matmul(xn.data(), T, L.qkv.data(), QKV, H, qkv.data());
    parallel_rows(T, 1, [&](std::size_t b, std::size_t e) {
      for (std::size_t t = b; t < e; ++t) {
        float* row = qkv.data() + t * QKV;
        apply_rope(row, c.q_heads, c.head_dim, static_cast<std::uint32_t>(t), w_->inv_freq);
        apply_rope(row + QD, c.kv_heads, c.head_dim, static_cast<std::uint32_t>(t), w_->inv_freq);
        std::memcpy(k.data() + t * KD, row + QD, KD * sizeof(float));
        std::memcpy(v.data() + t * KD, row + QD + KD, KD * sizeof(float));
      }
    });
    for (std::size_t t = 0; t < T; ++t) {
      for (std::size_t j = 0; j < KD; ++j) vt[j * T + t] = v[t * KD + j];
    }
    for (AttentionBackend* s : sinks) s->prefill(l, k.data(), v.data(), static_cast<std::uint32_t>(T));

    // Causal attention: unit = (q head, tile of kTile queries).
    parallel_units(std::size_t{c.q_heads} * tiles, [&](std::size_t u) {
      const std::size_t head = u % c.q_heads, tile_index = tiles - 1 - u / c.q_heads;  // big tiles first
      const std::size_t g = head / group, i0 = tile_index * kTile, i1 = std::min(T, i0 + kTile), n = i1;
      thread_local std::vector<float> S;
      S.resize(kTile * n);
      // S[i - i0][j] = q_i . k_j
      gemm_nt(qkv.data() + i0 * QKV + head * hd, QKV, qkv.data() + QD + g * hd, QKV, S.data(), n, i1 - i0, 0, n, hd);
      for (std::size_t i = i0; i < i1; ++i) softmax_row(S.data() + (i - i0) * n, i + 1, n, scale);
      // att[i][head] = P V: rows of V^T for kv head g.
      gemm_nt(S.data(), n, vt.data() + g * hd * T, T, att.data() + i0 * QD + head * hd, QD, i1 - i0, 0, hd, n);
    });

    matmul(att.data(), T, L.out.data(), H, QD, tmp.data());
    for (std::size_t i = 0; i < T * H; ++i) x[i] += tmp[i];
    rmsnorm(x.data(), T, H, L.ffn_norm.data(), c.rms_eps, xn.data());
    matmul(xn.data(), T, L.gate_up.data(), 2 * F, H, gu.data());
    parallel_rows(
        T, 1, [&](std::size_t b, std::size_t e) { swiglu_rows(gu.data() + b * 2 * F, e - b, F, h.data() + b * F); });
    matmul(h.data(), T, L.down.data(), H, F, tmp.data());
    for (std::size_t i = 0; i < T * H; ++i) x[i] += tmp[i];
  }
  if (logits == nullptr) return;
  if (all_positions) {
    rmsnorm(x.data(), T, H, w_->output_norm.data(), c.rms_eps, xn.data());
    matmul(xn.data(), T, w_->head(), c.vocab, H, logits);
  } else {
    rmsnorm(x.data() + (T - 1) * H, 1, H, w_->output_norm.data(), c.rms_eps, xn.data());
    matmul(xn.data(), 1, w_->head(), c.vocab, H, logits);
  }
}

void LlamaModel::decode(std::span<const std::int32_t> tokens, std::uint32_t position,
                        std::span<AttentionBackend* const> rows, float* logits) const {
  const LlamaConfig& c = config_;
  const std::size_t R = rows.size();
  if (R == 0 || tokens.size() != R)
    fail(ErrorCode::invalid_argument, "decode: {} tokens for {} rows", tokens.size(), R);
  const std::size_t H = c.hidden, QD = std::size_t{c.q_heads} * c.head_dim, KD = std::size_t{c.kv_heads} * c.head_dim,
                    QKV = QD + 2 * KD, F = c.ffn;
  std::vector<float> x(R * H), xn(R * H), qkv(R * QKV), att(R * QD), tmp(R * H), gu(R * 2 * F), h(R * F);
  embed(tokens, x.data());
  for (std::uint32_t l = 0; l < c.layers; ++l) {
    const Weights::Layer& L = w_->layers[l];
    rmsnorm(x.data(), R, H, L.attn_norm.data(), c.rms_eps, xn.data());
    matmul(xn.data(), R, L.qkv.data(), QKV, H, qkv.data());
    for (std::size_t r = 0; r < R; ++r) {
      apply_rope(qkv.data() + r * QKV, c.q_heads, c.head_dim, position, w_->inv_freq);
      apply_rope(qkv.data() + r * QKV + QD, c.kv_heads, c.head_dim, position, w_->inv_freq);
    }
    // Rows are independent sequences (separate managers or caches): in parallel.
    const auto attend = [&](std::size_t r) {
      const float* row = qkv.data() + r * QKV;
      rows[r]->decode(l, row, row + QD, row + QD + KD, att.data() + r * QD);
    };
    if (R == 1) {
      attend(0);
    } else {
      parallel_units(R, attend);
    }
    matmul(att.data(), R, L.out.data(), H, QD, tmp.data());
    for (std::size_t i = 0; i < R * H; ++i) x[i] += tmp[i];
    rmsnorm(x.data(), R, H, L.ffn_norm.data(), c.rms_eps, xn.data());
    matmul(xn.data(), R, L.gate_up.data(), 2 * F, H, gu.data());
    swiglu_rows(gu.data(), R, F, h.data());
    matmul(h.data(), R, L.down.data(), H, F, tmp.data());
    for (std::size_t i = 0; i < R * H; ++i) x[i] += tmp[i];
  }
  rmsnorm(x.data(), R, H, w_->output_norm.data(), c.rms_eps, xn.data());
  matmul(xn.data(), R, w_->head(), c.vocab, H, logits);
}

// ---- DenseCache -------------------------------------------------------------------
DenseCache::DenseCache(const LlamaConfig& config) : config_(config), keys_(config.layers), values_(config.layers) {}

void DenseCache::prefill(std::uint32_t layer, const float* k, const float* v, std::uint32_t tokens) {
  check_index("layer", layer, config_.layers);
  const std::size_t n = std::size_t{tokens} * config_.kv_heads * config_.head_dim;
  keys_[layer].assign(k, k + n);
  values_[layer].assign(v, v + n);
}

void DenseCache::decode(std::uint32_t layer, const float* q, const float* k, const float* v, float* out) {
  check_index("layer", layer, config_.layers);
  const std::size_t KD = std::size_t{config_.kv_heads} * config_.head_dim, hd = config_.head_dim;
  keys_[layer].insert(keys_[layer].end(), k, k + KD);
  values_[layer].insert(values_[layer].end(), v, v + KD);
  const std::size_t n = keys_[layer].size() / KD, group = config_.q_heads / config_.kv_heads;
  scores_.resize(n);
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  for (std::size_t head = 0; head < config_.q_heads; ++head) {
    const std::size_t g = head / group;
    attend_head(q + head * hd, keys_[layer].data() + g * hd, values_[layer].data() + g * hd, KD, n, hd, scale,
                scores_.data(), out + head * hd);
  }
}

std::uint32_t DenseCache::tokens(std::uint32_t layer) const {
  check_index("layer", layer, config_.layers);
  return static_cast<std::uint32_t>(keys_[layer].size() / (std::size_t{config_.kv_heads} * config_.head_dim));
}

SparseSession::SparseSession(RuntimeManager& manager, RequestId id)
    : manager_(manager), id_(id), executor_(engine_executor()), dtype_(manager.shape().dtype) {}

const void* SparseSession::stored(const float* values, std::size_t n, std::vector<std::byte>& scratch) const {
  if (dtype_ == DType::f32) return values;
  const std::size_t size = dtype_size(dtype_);
  scratch.resize(n * size);
  for (std::size_t i = 0; i < n; ++i) store_element(scratch.data() + i * size, 0, dtype_, values[i]);
  return scratch.data();
}

void SparseSession::prefill(std::uint32_t layer, const float* k, const float* v, std::uint32_t tokens) {
  const ModelShape& shape = manager_.shape();
  const std::size_t n = std::size_t{tokens} * shape.kv_heads * shape.head_dim;
  manager_.prefill(id_, layer, stored(k, n, k_), stored(v, n, v_), tokens);
}

void SparseSession::decode(std::uint32_t layer, const float* q, const float* k, const float* v, float* out) {
  const ModelShape& shape = manager_.shape();
  const std::size_t nq = std::size_t{shape.q_heads} * shape.head_dim,
                    nkv = std::size_t{shape.kv_heads} * shape.head_dim;
  manager_.decode(std::span<const RequestId>(&id_, 1), layer, stored(q, nq, q_), stored(k, nkv, k_), stored(v, nkv, v_),
                  out, executor_);
}

// ---- helpers ----------------------------------------------------------------------
StepExecutor engine_executor() {
  return [](std::size_t n, const std::function<void(std::size_t)>& body) { parallel_units(n, body); };
}

std::unique_ptr<RuntimeManager> make_manager(const LlamaConfig& c, AnyPolicy policy, std::uint32_t max_tokens,
                                             std::uint32_t requests, const Config& base,
                                             std::unique_ptr<Backend> backend) {
  const Config config = serving_config(c.shape(), policy, max_tokens, requests, base);
  if (!backend) backend = std::make_unique<HostBackend>();
  return std::make_unique<RuntimeManager>(c.shape(), config, std::move(policy), std::move(backend));
}

std::uint32_t argmax(std::span<const float> logits) {
  return static_cast<std::uint32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
}

double log_prob(std::span<const float> logits, std::uint32_t target) {
  check_index("target token", target, logits.size());
  const double m = *std::max_element(logits.begin(), logits.end());
  double sum = 0;
  for (float x : logits) sum += std::exp(double(x) - m);
  return double(logits[target]) - m - std::log(sum);
}

}  // namespace sparsekv::model
