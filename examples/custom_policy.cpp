// custom_policy: a new algorithm in one file -- a SeerAttention-R style learned
// block gate. A block is one page; per kv head, score(block) = (W q) . mean key
// of the block, W a user-supplied [d][d] matrix, q the GQA group's mean query;
// the top blocks within the budget are attended. Run: build/bin/custom_policy
#include <cmath>
#include <cstdio>
#include <random>

#include "research/qkv_trace.hpp"
#include "sparse_pipeline.hpp"

using namespace sparsekv;

class LearnedGatePolicy {
 public:
  struct Options {
    std::uint32_t budget_tokens = 256;
    std::shared_ptr<const std::vector<float>> weights;  // W: [layer][kv head][d][d]
  };
  struct LayerState {
    std::vector<std::vector<float>> pooled;
  };  // [kv head][block * d + i]
  static constexpr std::string_view kName = "learned_gate";
  static constexpr RopeStage kRope = RopeStage::pre_rope;  // SeerAttention-R gates before RoPE
  explicit LearnedGatePolicy(Options o) : o_(std::move(o)) {}
  std::vector<PartitionSpec> index(const LayerContext& c, const KvView& kv, LayerState& s) const {
    s.pooled.assign(c.kv_heads, {});
    const std::uint32_t blocks = c.reserved_partitions((kv.tokens + c.page_tokens - 1) / c.page_tokens);
    for (auto& p : s.pooled) p.reserve(std::size_t{blocks} * c.head_dim);  // no decode step reallocates it
    for (std::uint32_t t = 0; t < kv.tokens; t += c.page_tokens) pool(kv, t, std::min(c.page_tokens, kv.tokens - t), s);
    return {PartitionSpec::uniform(kv.tokens, c.page_tokens)};  // partition b = block b
  }
  std::optional<Repartition> append(const LayerContext&, const AppendedPage& p, LayerState& s) const {
    pool(p.page, 0, p.page.tokens, s);  // the new page is the next block in every kv head
    return std::nullopt;
  }
  void select(const LayerContext& c, const DecodeQuery& q, const LayerState& s, Selection& out) const {
    out.reset(c.kv_heads);
    const std::uint32_t d = c.head_dim, g = c.group_size();
    for (std::uint32_t h = 0; h < c.kv_heads; ++h) {
      std::vector<float> mean(d), wq(d), scores(s.pooled[h].size() / d);
      for (std::uint32_t i = 0; i < g * d; ++i) mean[i % d] += q.head(h * g, d)[i] / float(g);
      const float* w = o_.weights->data() + (std::size_t{c.layer} * c.kv_heads + h) * d * d;
      for (std::uint32_t r = 0; r < d * d; ++r) wq[r / d] += w[r] * mean[r % d];
      for (std::size_t b = 0; b < scores.size(); ++b)
        for (std::uint32_t i = 0; i < d; ++i) scores[b] += wq[i] * s.pooled[h][b * d + i];
      for (std::uint32_t b : top_k(scores, mandatory_pages(c))) out.partitions[h].push_back(b);
    }
  }
  std::uint32_t mandatory_pages(const LayerContext& c) const {
    return std::max(1u, std::min(o_.budget_tokens / c.page_tokens, (c.tokens + c.page_tokens - 1) / c.page_tokens + 1));
  }

 private:
  static void pool(const KvView& kv, std::uint32_t first, std::uint32_t n, LayerState& s) {
    for (std::uint32_t h = 0; h < kv.kv_heads; ++h) {
      auto& p = s.pooled[h];
      p.resize(p.size() + kv.head_dim);
      for (std::uint32_t t = first; t < first + n; ++t)
        for (std::uint32_t i = 0; i < kv.head_dim; ++i) p[p.size() - kv.head_dim + i] += kv.key(t, h)[i] / float(n);
    }
  }
  Options o_;
};

int main() {
  SyntheticQkvOptions o;
  o.layers = 2, o.prompt_tokens = 2048, o.decode_steps = 8;
  const QkvTrace trace = synthetic_qkv_trace(o);  // stands in for the engine's pre-RoPE q/k
  const auto& h = trace.header;
  auto weights = std::make_shared<std::vector<float>>(std::size_t{h.layers} * h.kv_heads * h.head_dim * h.head_dim);
  std::mt19937 rng(7);  // made-up "trained" gate: identity plus noise
  for (std::size_t i = 0; i < weights->size(); ++i)
    (*weights)[i] = (i / h.head_dim % h.head_dim == i % h.head_dim) + 0.05f * float(int(rng() % 21) - 10) / 10.f;
  tools::SparsePipeline pipeline(h.shape(), AnyPolicy(LearnedGatePolicy({256, weights})), h.tokens());
  for (std::uint32_t l = 0; l < h.layers; ++l) pipeline.prefill(l, trace.prompt(l));
  std::vector<float> out(h.q_heads * h.head_dim), dense(out.size());
  for (std::uint32_t s = 0; s < h.decode_steps; ++s) {
    double err = 0, norm = 0;  // over layers and q heads
    for (std::uint32_t l = 0; l < h.layers; ++l) {
      pipeline.append(l, trace.key(l, h.prompt_tokens + s), trace.value(l, h.prompt_tokens + s));
      pipeline.attend(l, trace.query(l, s), out.data());
      reference_attention(trace, l, s, dense.data());
      for (std::size_t i = 0; i < out.size(); ++i) err += std::pow(out[i] - dense[i], 2), norm += std::pow(dense[i], 2);
    }
    const auto& b = pipeline.selection().partitions[0];  // last layer, kv head 0: best blocks first
    std::printf("step %u: %zu blocks: %u %u %u ...; rel error %.4f\n", s, b.size(), b[0], b[1], b[2],
                std::sqrt(err / norm));
  }
}
