// engine_integration: the shape of an inference engine's decode loop using
// sparsekv -- the file to copy from. The engine keeps its scheduler: requests
// arrive and finish at different times with different prompt lengths; each
// step it asks can_admit() before admitting, prefills new requests layer by
// layer, and runs one decode step per layer for the whole batch. Model code is
// faked with random tensors; sparsekv does the KV cache and attention.
#include <cstdio>
#include <deque>
#include <exception>
#include <map>
#include <memory>
#include <random>
#include <vector>

#include "backend_choice.hpp"
#include "command_line.hpp"
#include "sparsekv/core/numeric.hpp"
#include "sparsekv/sparsekv.hpp"

namespace {

constexpr sparsekv::ModelShape kModel{4, 16, 4, 64, sparsekv::DType::bf16};  // layers, q heads, kv heads, head dim

struct Pending {
  sparsekv::RequestId id;
  std::uint32_t prompt, new_tokens;
};

// Stand-in for the model: bf16 activations of `rows` x `width`.
std::vector<std::uint16_t> fake(std::mt19937& rng, std::size_t rows, std::size_t width) {
  std::normal_distribution<float> normal;
  std::vector<std::uint16_t> t(rows * width);
  for (auto& x : t) x = sparsekv::float_to_bf16(normal(rng));
  return t;
}

}  // namespace

int run(int argc, char** argv) {
  // The one runtime choice at the facade edge: --backend host|cuda (default:
  // cuda when sparsekv::cuda is linked and a GPU is present, else host).
  const sparsekv::tools::CommandLine args(argc, argv, {"--backend"}, {});
  sparsekv::Config config;          // paper defaults: 8-token pages, 64 LRU buckets, 5x buffering
  config.max_requests = 8;
  config.max_context_tokens = 8192;
  config.cpu_tier_bytes = std::size_t{512} << 20;
  config.gpu_tier_bytes = std::size_t{96} << 20;
  // One policy for the engine; RuntimeManager picks it by name (Manager<QuestPolicy> would fix it at compile time).
  sparsekv::RuntimeManager kv(kModel, config, sparsekv::make_policy("quest", 512),
                             sparsekv::tools::make_backend(args.text("--backend", "")));
  std::printf("backend: %.*s\n", static_cast<int>(kv.backend().name().size()), kv.backend().name().data());

  std::mt19937 rng(7);
  std::deque<Pending> queue;  // the engine's own queue: sparsekv never queues
  for (sparsekv::RequestId id = 1; id <= 12; ++id) queue.push_back({id, 200 + std::uint32_t(rng() % 3000), 16 + std::uint32_t(rng() % 48)});
  std::map<sparsekv::RequestId, std::uint32_t> running;  // id -> tokens still to generate
  const std::size_t q_width = std::size_t{kModel.q_heads} * kModel.head_dim;
  const std::size_t kv_width = std::size_t{kModel.kv_heads} * kModel.head_dim;

  for (int step = 0; !queue.empty() || !running.empty(); ++step) {
    // 1. Admission: the engine decides, sparsekv advises.
    while (!queue.empty()) {
      const Pending& p = queue.front();
      if (!kv.can_admit(p.prompt, p.prompt + p.new_tokens).admit) break;
      kv.add_request(p.id, p.prompt + p.new_tokens);
      for (std::uint32_t layer = 0; layer < kModel.layers; ++layer) {  // prefill: the model's K/V per layer
        const auto k = fake(rng, p.prompt, kv_width), v = fake(rng, p.prompt, kv_width);
        kv.prefill(p.id, layer, k.data(), v.data(), p.prompt);
      }
      running[p.id] = p.new_tokens;
      queue.pop_front();
    }
    // 2. One decode step for the batch, layer by layer.
    std::vector<sparsekv::RequestId> batch;
    for (const auto& [id, left] : running) batch.push_back(id);
    std::vector<float> attn(batch.size() * q_width);
    for (std::uint32_t layer = 0; layer < kModel.layers; ++layer) {
      const auto q = fake(rng, batch.size(), q_width);  // this layer's q / k / v projections (post-RoPE)
      const auto k_new = fake(rng, batch.size(), kv_width), v_new = fake(rng, batch.size(), kv_width);
      kv.decode(batch, layer, q.data(), k_new.data(), v_new.data(), attn.data());
      // ... the engine feeds `attn` into its output projection and MLP here.
    }
    // 3. Finished requests leave; their pages go back to the pools.
    for (sparsekv::RequestId id : batch) {
      if (--running[id] == 0) {
        running.erase(id);
        kv.finish(id);
        std::printf("step %3d: request %llu finished\n", step, static_cast<unsigned long long>(id));
      }
    }
  }
  const sparsekv::ManagerStats& st = kv.stats();
  std::printf("done: %llu decode steps, hit ratio %.1f%%, %llu pages moved, GPU pages in use %u\n",
              static_cast<unsigned long long>(st.decode_steps), 100 * st.hit_ratio(),
              static_cast<unsigned long long>(st.pages_moved), kv.buffer().gpu_pool().used());
  return kv.buffer().gpu_pool().used() == 0 && kv.buffer().cpu_pool().used() == 0 ? 0 : 1;
}

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "engine_integration: %s\n", e.what());
    return 2;
  }
}
