// engine_integration: the shape of an inference engine's decode loop using
// sparsekv -- the file to copy from. The engine keeps its scheduler: requests
// arrive and finish at different times with different prompt lengths; each
// step it asks can_admit() before admitting, prefills new requests layer by
// layer, and runs one decode step per layer for the whole batch. Model code is
// faked with random tensors; sparsekv does the KV cache and attention.
//
// Two integrations (docs/integration.md), picked by --backend:
//   cuda  device_loop(): the device-tensor API, the one an engine on a GPU
//         uses. q / k / v / out live in the engine's device buffers and every
//         call is enqueued on the engine's stream; the last layer shows plan():
//         the engine runs its own paged kernel over the DeviceAttendPlan.
//   host  host_loop(): the host-tensor API on the host backend.
// Default: cuda when sparsekv::cuda is linked and a GPU is present.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <deque>
#include <exception>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "backend_choice.hpp"
#include "command_line.hpp"
#include "sparsekv/core/numeric.hpp"
#include "sparsekv/sparsekv.hpp"
#if SPARSEKV_EXAMPLE_CUDA
#include "engine_device.hpp"
#include "sparsekv/attention/sparse_decode_attention_cuda.hpp"
#endif

namespace {

constexpr sparsekv::ModelShape kModel{4, 16, 4, 64, sparsekv::DType::bf16};  // layers, q heads, kv heads, head dim
constexpr std::uint32_t kBudget = 512;                                       // tokens per kv head per step
const std::size_t kQWidth = std::size_t{kModel.q_heads} * kModel.head_dim;
const std::size_t kKvWidth = std::size_t{kModel.kv_heads} * kModel.head_dim;

// Stand-in for the model: bf16 activations of `rows` x `width`.
std::vector<std::uint16_t> fake(std::mt19937& rng, std::size_t rows, std::size_t width) {
  std::normal_distribution<float> normal;
  std::vector<std::uint16_t> t(rows * width);
  for (auto& x : t) x = sparsekv::float_to_bf16(normal(rng));
  return t;
}

// The engine's scheduler, the same for both integrations: its own queue
// (sparsekv never queues), admission on sparsekv's advice, finish.
class Scheduler {
 public:
  explicit Scheduler(std::mt19937& rng) {
    for (sparsekv::RequestId id = 1; id <= 12; ++id) {
      queue_.push_back({id, 200 + std::uint32_t(rng() % 3000), 16 + std::uint32_t(rng() % 48)});
    }
  }
  bool done() const { return queue_.empty() && running_.empty(); }

  // 1. Admission: the engine decides, sparsekv advises. `prefill(id, tokens)`
  //    runs the prompt through the model, handing sparsekv each layer's K/V.
  template <class Prefill>
  void admit(sparsekv::RuntimeManager& kv, Prefill&& prefill) {
    while (!queue_.empty()) {
      const Pending& p = queue_.front();
      if (!kv.can_admit(p.prompt, p.prompt + p.new_tokens).admit) break;
      kv.add_request(p.id, p.prompt + p.new_tokens);
      prefill(p.id, p.prompt);
      running_[p.id] = p.new_tokens;
      queue_.pop_front();
    }
  }
  std::vector<sparsekv::RequestId> batch() const {
    std::vector<sparsekv::RequestId> ids;
    for (const auto& [id, left] : running_) ids.push_back(id);
    return ids;
  }
  // 3. Finished requests leave; their pages go back to the pools.
  void retire(sparsekv::RuntimeManager& kv, int step, const std::vector<sparsekv::RequestId>& batch) {
    for (sparsekv::RequestId id : batch) {
      if (--running_[id] == 0) {
        running_.erase(id);
        kv.finish(id);
        std::printf("step %3d: request %llu finished\n", step, static_cast<unsigned long long>(id));
      }
    }
  }

 private:
  struct Pending {
    sparsekv::RequestId id;
    std::uint32_t prompt, new_tokens;
  };
  std::deque<Pending> queue_;
  std::map<sparsekv::RequestId, std::uint32_t> running_;  // id -> tokens still to generate
};

// The last step's attention output must be finite and not all zero (the tail
// is always attended): an all-zero output means no kernel wrote it.
bool output_ok(const std::vector<float>& out) {
  bool any = false;
  for (float x : out) {
    if (!std::isfinite(x)) {
      std::fprintf(stderr, "engine_integration: a non-finite attention output\n");
      return false;
    }
    any = any || x != 0.0f;
  }
  if (!any) std::fprintf(stderr, "engine_integration: the last attention output is all zero\n");
  return any;
}

// The host-tensor API: every tensor is host memory; each call is done when it returns.
bool host_loop(sparsekv::RuntimeManager& kv, std::mt19937& rng) {
  Scheduler scheduler(rng);
  std::vector<float> attn;
  for (int step = 0; !scheduler.done(); ++step) {
    scheduler.admit(kv, [&](sparsekv::RequestId id, std::uint32_t prompt) {
      for (std::uint32_t layer = 0; layer < kModel.layers; ++layer) {  // prefill: the model's K/V per layer
        const auto k = fake(rng, prompt, kKvWidth), v = fake(rng, prompt, kKvWidth);
        kv.prefill(id, layer, k.data(), v.data(), prompt);
      }
    });
    // 2. One decode step for the batch, layer by layer.
    const std::vector<sparsekv::RequestId> batch = scheduler.batch();
    attn.assign(batch.size() * kQWidth, 0.0f);
    for (std::uint32_t layer = 0; layer < kModel.layers; ++layer) {
      const auto q = fake(rng, batch.size(), kQWidth);  // this layer's q / k / v projections (post-RoPE)
      const auto k_new = fake(rng, batch.size(), kKvWidth), v_new = fake(rng, batch.size(), kKvWidth);
      kv.decode(batch, layer, q.data(), k_new.data(), v_new.data(), attn.data());
      // ... the engine feeds `attn` into its output projection and MLP here.
    }
    scheduler.retire(kv, step, batch);
  }
  return output_ok(attn);
}

#if SPARSEKV_EXAMPLE_CUDA
// The device-tensor API: q / k / v / out are the engine's device buffers and
// every call is enqueued on the engine's stream; the host waits only in
// synchronize() at the end of a step (where an engine samples) and in the
// calls off the step's path (add_request, prefill, finish).
bool device_loop(sparsekv::RuntimeManager& kv, const sparsekv::Config& config, std::mt19937& rng) {
  using sparsekv::tools::DeviceArray;
  using sparsekv::tools::PinnedArray;
  const sparsekv::tools::EngineStream stream;  // the engine's stream
  const std::size_t max_batch = config.max_requests;
  // Prefill holds one layer's K/V on the device at a time (layer-segmented
  // prefill, SparseServe §3.4): the model writes layer l's K/V, sparsekv
  // takes it (prefill returns done with it), layer l + 1 reuses the buffers.
  DeviceArray<std::uint16_t> layer_k(config.max_context_tokens * kKvWidth),
      layer_v(config.max_context_tokens * kKvWidth);
  // Decode: this layer's projections and attention's output, for the largest batch.
  DeviceArray<std::uint16_t> q(max_batch * kQWidth), k_new(max_batch * kKvWidth), v_new(max_batch * kKvWidth);
  DeviceArray<float> attn(max_batch * kQWidth);
  // Host-made stand-ins of the step's activations, all layers, in pinned
  // memory: uploading them is the "model" writing q / k / v on the stream.
  PinnedArray<std::uint16_t> step_q(kModel.layers * max_batch * kQWidth), step_k(kModel.layers * max_batch * kKvWidth),
      step_v(kModel.layers * max_batch * kKvWidth);
  PinnedArray<float> step_q32(max_batch * kQWidth);

  // The engine's own paged attention kernel for plan(): here the project's
  // split-K kernel stands in for FlashInfer's; it reads the plan as is (runs
  // form: head_entries) with q in fp32. Its workspace is sized once, for the
  // largest batch, as an engine sizes its own.
  DeviceArray<float> q32(max_batch * kQWidth);
  sparsekv::cuda::DecodeAttentionShape own;
  own.q_heads = kModel.q_heads;
  own.kv_heads = kModel.kv_heads;
  own.layout = sparsekv::PageLayout{config.page_tokens, kModel.head_dim, kModel.dtype};
  own.max_pages = kBudget / config.page_tokens + 1;  // selection + tail: sizes the split only
  own.batch = max_batch;
  DeviceArray<std::byte> workspace(sparsekv::cuda::sparse_decode_attention_workspace_capacity(own));

  Scheduler scheduler(rng);
  std::size_t last_batch = 0;
  for (int step = 0; !scheduler.done(); ++step) {
    scheduler.admit(kv, [&](sparsekv::RequestId id, std::uint32_t prompt) {
      for (std::uint32_t layer = 0; layer < kModel.layers; ++layer) {
        const auto k = fake(rng, prompt, kKvWidth), v = fake(rng, prompt, kKvWidth);
        layer_k.upload(k.data(), k.size(), stream.get());  // the model's layer-l K/V, on the stream
        layer_v.upload(v.data(), v.size(), stream.get());
        kv.prefill(id, layer, layer_k.data(), layer_v.data(), prompt, stream.handle());
      }
    });
    // 2. One decode step for the batch, layer by layer, enqueued on the stream.
    const std::vector<sparsekv::RequestId> batch = scheduler.batch();
    const std::size_t qn = batch.size() * kQWidth, kvn = batch.size() * kKvWidth;
    // The last step's synchronize() is past: the pinned staging is free to refill.
    for (std::uint32_t layer = 0; layer < kModel.layers; ++layer) {
      const auto fq = fake(rng, batch.size(), kQWidth), fk = fake(rng, batch.size(), kKvWidth),
                 fv = fake(rng, batch.size(), kKvWidth);
      std::copy(fq.begin(), fq.end(), step_q.data() + layer * qn);
      std::copy(fk.begin(), fk.end(), step_k.data() + layer * kvn);
      std::copy(fv.begin(), fv.end(), step_v.data() + layer * kvn);
    }
    for (std::uint32_t layer = 0; layer < kModel.layers; ++layer) {
      // This layer's q / k / v projections (post-RoPE), written on the stream.
      q.upload(step_q.data() + layer * qn, qn, stream.get());
      k_new.upload(step_k.data() + layer * kvn, kvn, stream.get());
      v_new.upload(step_v.data() + layer * kvn, kvn, stream.get());
      if (layer + 1 < kModel.layers) {
        // Built-in attention: `attn` is complete in stream order.
        kv.decode(batch, layer, q.data(), k_new.data(), v_new.data(), attn.data(), stream.handle());
      } else {
        // plan(): sparsekv appends, selects and moves pages; the engine
        // attends with its own kernel over the DeviceAttendPlan, enqueued on
        // the same stream before the next sparsekv call (which reuses the plan's arrays).
        const sparsekv::DeviceAttendPlan plan =
            kv.plan(batch, layer, q.data(), k_new.data(), v_new.data(), stream.handle());
        for (std::size_t i = 0; i < qn; ++i) step_q32[i] = sparsekv::bf16_to_float(step_q[layer * qn + i]);
        q32.upload(step_q32.data(), qn, stream.get());
        own.batch = static_cast<std::uint32_t>(batch.size());
        sparsekv::cuda::DecodeAttentionArgs a;
        a.q = q32.data();
        a.page_base = plan.gpu_tier_base;  // page p at + p * page_bytes: K block, then V block
        a.page_stride = plan.page_bytes;
        a.row_entries = plan.head_entries;  // row b * kv_heads + h: its entries (runs)
        a.indptr = plan.indptr;             // FlashInfer's paged_kv_t CSR
        a.indices = plan.indices;
        a.last_page_len = plan.last_page_len;
        a.scale = 1.0f / std::sqrt(static_cast<float>(kModel.head_dim));
        a.out = attn.data();
        a.workspace = workspace.data();
        a.workspace_bytes = workspace.size();
        sparsekv::cuda::sparse_decode_attention(own, a, stream.handle());
      }
      // ... the engine's output projection and MLP read `attn` here, on the same stream.
    }
    kv.synchronize();  // end of the step: the engine samples its tokens
    last_batch = batch.size();
    scheduler.retire(kv, step, batch);
  }
  return output_ok(attn.download(last_batch * kQWidth, stream.get()));
}
#endif

}  // namespace

int run(int argc, char** argv) {
  const sparsekv::tools::CommandLine args(argc, argv, {"--backend"}, {});
  sparsekv::Config config;  // paper defaults: 64 LRU buckets, 5x buffering
  // 16-token pages: Quest's page (Tang et al. 2024), one KV page per Quest
  // page (its default), as its device Select needs (policy/device_select.hpp).
  config.page_tokens = 16;
  config.max_requests = 8;
  config.max_context_tokens = 8192;
  config.cpu_tier_bytes = std::size_t{512} << 20;
  config.gpu_tier_bytes = std::size_t{96} << 20;
  // One policy for the engine; RuntimeManager picks it by name (Manager<QuestPolicy> would fix it at compile time).
  sparsekv::AnyPolicy policy = sparsekv::make_policy("quest", kBudget);
  // The one runtime choice at the facade edge: --backend host|cuda, which
  // also picks the tensor API (tools/backend_choice.hpp).
  sparsekv::tools::BackendChoice choice =
      sparsekv::tools::choose_backend(args.text("--backend", ""), policy, kModel, config);
  if (!choice.note.empty()) std::fprintf(stderr, "engine_integration: %s\n", choice.note.c_str());
  const bool device = choice.device_tensors;
  sparsekv::RuntimeManager kv(kModel, config, std::move(policy), std::move(choice.backend));
  std::printf("backend: %.*s, %s tensors\n", static_cast<int>(kv.backend().name().size()), kv.backend().name().data(),
              device ? "device" : "host");

  std::mt19937 rng(7);
  bool ok = false;
#if SPARSEKV_EXAMPLE_CUDA
  ok = device ? device_loop(kv, config, rng) : host_loop(kv, rng);
#else
  ok = host_loop(kv, rng);
#endif
  const sparsekv::StepStats& st = kv.stats();
  // The device path gathers exactly its miss pages; the host path counts its copies.
  const std::uint64_t moved = device ? st.cache.miss_pages : st.pages_moved;
  std::printf("done: %llu decode steps, hit ratio %.1f%%, %llu pages moved, GPU pages in use %u\n",
              static_cast<unsigned long long>(st.decode_steps), 100 * st.hit_ratio(),
              static_cast<unsigned long long>(moved), kv.tier_usage().gpu.used);
  const sparsekv::TierUsage usage = kv.tier_usage();
  const bool leak = usage.gpu.used != 0 || usage.cpu.used != 0;
  if (leak) std::fprintf(stderr, "engine_integration: pages leaked\n");
  return ok && !leak ? 0 : 1;
}

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "engine_integration: %s\n", e.what());
    return 2;
  }
}
