// A tiny engine built against the installed sparsekv package: one request
// through the facade (prefill, a few decode steps, finish), checked against
// attention computed by hand over the same tokens.
#include <cmath>
#include <cstdio>
#include <vector>

#include <sparsekv/sparsekv.hpp>

int main() {
  const sparsekv::ModelShape shape{2, 4, 2, 8, sparsekv::DType::f32};
  sparsekv::Config config;
  config.max_requests = 2;
  config.max_context_tokens = 256;
  config.cpu_tier_bytes = 1 << 20;
  config.gpu_tier_bytes = 1 << 20;
  sparsekv::RuntimeManager kv(shape, config, sparsekv::make_policy("dense", 0));
  const std::uint32_t prompt = 20, d = shape.head_dim, row = shape.kv_heads * d;
  std::vector<float> k, v;
  for (std::uint32_t i = 0; i < (prompt + 3) * row; ++i) {
    k.push_back(std::sin(0.37f * i));
    v.push_back(std::cos(0.11f * i));
  }
  kv.add_request(42, prompt + 3);
  for (std::uint32_t layer = 0; layer < shape.layers; ++layer) kv.prefill(42, layer, k.data(), v.data(), prompt);
  std::vector<float> q(shape.q_heads * d, 0.25f), out(q.size());
  const std::vector<sparsekv::RequestId> batch{42};
  for (std::uint32_t t = prompt; t < prompt + 3; ++t) {
    for (std::uint32_t layer = 0; layer < shape.layers; ++layer) {
      kv.decode(batch, layer, q.data(), k.data() + t * row, v.data() + t * row, out.data());
    }
  }
  // q head 0 reads kv head 0 over all 23 tokens.
  double sum = 0, acc = 0;
  for (std::uint32_t t = 0; t < prompt + 3; ++t) {
    double s = 0;
    for (std::uint32_t i = 0; i < d; ++i) s += 0.25 * k[t * row + i];
    const double p = std::exp(s / std::sqrt(double(d)));
    sum += p;
    acc += p * v[t * row];
  }
  const double error = std::abs(out[0] - acc / sum);
  try {
    kv.add_request(42, 10);
    return 1;
  } catch (const sparsekv::Error& e) {
    std::printf("consumer: expected error: %s\n", e.what());
  }
  kv.finish(42);
  std::printf("consumer: attention error %.2e, hit ratio %.2f, pages in use %u\n", error, kv.stats().hit_ratio(),
              kv.tier_usage().cpu.used);
  return error < 1e-5 && kv.tier_usage().cpu.used == 0 ? 0 : 1;
}
