// decode_loop: a standalone decode loop over synthetic K/V through the
// sparsekv facade. Prints tokens/s, hit ratio, pages and bytes moved and the
// time per operation.
//
//   --backend host   HostBackend, host tensors; --threads N lends each step
//                    N threads (the loop's own pool, as a CPU engine keeps
//                    one: tools/thread_pool.hpp) through decode()'s executor.
//   --backend in-place  InPlaceBackend: as host, with no GPU tier (the CPU
//                    pages attended where they are: a CPU engine's backend).
//   --backend cuda   CudaBackend with the device-tensor API: the loop plays the
//                    engine, holding q / k / v / out in its own device buffers
//                    on its own stream (tools/backend_choice.hpp).
//
// Timing: each step's activations are made on the host and (cuda) uploaded
// before the clock starts; the clock covers the step's Manager calls for
// every layer and, on cuda, the synchronize() that ends the step -- what an
// engine waits for before it samples the token.
//
// The reference configuration (docs/device-decode.md), both policies in one run:
//   decode_loop --backend cuda --policy quest,shadowkv --context 16384 --batch 8 --budget 2048 --steps 16
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <exception>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "backend_choice.hpp"
#include "command_line.hpp"
#include "research/research_policies.hpp"
#include "sparsekv/core/numeric.hpp"
#include "sparsekv/sparsekv.hpp"
#include "thread_pool.hpp"
#if SPARSEKV_EXAMPLE_CUDA
#include "engine_device.hpp"
#endif

namespace {

void usage() {
  std::fputs(
      "usage: decode_loop [--context 8192] [--batch 4] [--policy shadowkv] [--budget 2048] [--steps 64] [--json]\n"
      "                   [--layers 4] [--q-heads 32] [--kv-heads 8] [--head-dim 128] [--seed 1]\n"
      "                   [--page-tokens N]   (default: 16 for quest -- the paper's Quest page, one KV page\n"
      "                                        per Quest page -- else 8)\n"
      "                   [--backend host|in-place|cuda]   (default: cuda -- device tensors on a stream -- when built "
      "with\n"
      "                                            it, a GPU is present and the policy has a device Select)\n"
      "                   [--threads 1]   host tensors: the threads each step's Select and Attend run on\n"
      "  --policy takes a comma-separated list (quest,shadowkv): one run per policy.\n"
      "  policies: dense, streaming, quest, shadowkv, retroinfer, retroinfer_no_estimation\n",
      stderr);
}

// bf16 noise from a fast generator: synthetic K/V need volume, not quality.
void fill(std::uint16_t* out, std::size_t n, std::mt19937_64& rng) {
  for (std::size_t i = 0; i < n; ++i) {
    const double u = (double(rng() >> 11) + 0.5) * 0x1p-53;
    out[i] = sparsekv::float_to_bf16(static_cast<float>((u - 0.5) * 3.4641));  // unit variance
  }
}

struct Run {
  std::uint32_t context, batch, steps, budget, page_tokens, threads;
  sparsekv::ModelShape shape;
  std::uint64_t seed;
  std::string backend;
  bool json;
};

// The last step's output must be finite and not all zero: attention always
// covers at least the tail, so an all-zero `out` means nothing ran. Returns
// what is wrong, or nothing.
std::string output_fault(const std::vector<float>& out) {
  if (const auto bad = std::find_if(out.begin(), out.end(), [](float x) { return !std::isfinite(x); });
      bad != out.end()) {
    return fmt::format("output value {} of the last step is not finite", bad - out.begin());
  }
  if (std::all_of(out.begin(), out.end(), [](float x) { return x == 0.0f; })) {
    return "the last step's output is all zero: attention did not run";
  }
  return {};
}

// One policy's run; false when its output is wrong.
bool run_policy(const Run& r, const std::string& policy_name) {
  const sparsekv::ModelShape& shape = r.shape;
  sparsekv::AnyPolicy policy = sparsekv::make_policy(policy_name, r.budget);
  sparsekv::Config config;
  config.page_tokens = r.page_tokens;
  config.max_requests = r.batch;
  config.max_context_tokens = r.context + r.steps;
  const std::size_t page = config.page_bytes(shape);
  const std::size_t heads = std::size_t{shape.layers} * shape.kv_heads * r.batch;
  // CPU tier: the whole context (clusters pad their pages: 2x); GPU tier:
  // each request's mandatory pages, the 5x minimum buffer and its tails.
  config.cpu_tier_bytes = heads * (2 * std::size_t{r.context + r.steps} / config.page_tokens + 64) * page;
  std::uint32_t need = 1;
  for (std::uint32_t l = 0; l < shape.layers; ++l) {
    need = std::max(need, policy.mandatory_pages({l, shape.layers, shape.q_heads, shape.kv_heads, shape.head_dim,
                                                  config.page_tokens, r.context + r.steps}));
  }
  config.gpu_tier_bytes = heads * (std::size_t{need} * 6 + 2) * page;
  sparsekv::tools::BackendChoice choice = sparsekv::tools::choose_backend(r.backend, policy, shape, config);
  if (!choice.note.empty()) std::fprintf(stderr, "decode_loop: %s\n", choice.note.c_str());
  const bool device = choice.device_tensors;
  if (device && r.threads > 1) std::fprintf(stderr, "decode_loop: --threads applies to host tensors; ignored\n");
  const std::size_t prompt_n = std::size_t{r.context} * shape.kv_heads * shape.head_dim;
  const std::size_t qn = std::size_t{r.batch} * shape.q_heads * shape.head_dim;
  const std::size_t kvn = std::size_t{r.batch} * shape.kv_heads * shape.head_dim;
#if SPARSEKV_EXAMPLE_CUDA
  // The engine's device side, declared before the Manager so that it outlives
  // every step the Manager enqueues: its stream, one layer's prompt K/V, and per
  // layer the step's q / k_new / v_new (uploaded together before the clock
  // starts); one `out`, consumed by the next op in stream order.
  std::optional<sparsekv::tools::EngineStream> stream;
  sparsekv::tools::DeviceArray<std::uint16_t> d_prompt_k, d_prompt_v, d_q, d_k, d_v;
  sparsekv::tools::DeviceArray<float> d_out;
  if (device) {
    stream.emplace();
    d_prompt_k = sparsekv::tools::DeviceArray<std::uint16_t>(prompt_n);
    d_prompt_v = sparsekv::tools::DeviceArray<std::uint16_t>(prompt_n);
    d_q = sparsekv::tools::DeviceArray<std::uint16_t>(shape.layers * qn);
    d_k = sparsekv::tools::DeviceArray<std::uint16_t>(shape.layers * kvn);
    d_v = sparsekv::tools::DeviceArray<std::uint16_t>(shape.layers * kvn);
    d_out = sparsekv::tools::DeviceArray<float>(qn);
  }
#endif
  sparsekv::RuntimeManager manager(shape, config, policy, std::move(choice.backend));
  const std::string backend(manager.backend().name());

  std::mt19937_64 rng(r.seed);
  std::vector<sparsekv::RequestId> batch;
  std::vector<std::uint16_t> k(prompt_n), v(prompt_n);
  const auto prefill_start = std::chrono::steady_clock::now();
  for (std::uint32_t b = 0; b < r.batch; ++b) {
    const sparsekv::RequestId id = b + 1;
    manager.add_request(id, r.context + r.steps);
    for (std::uint32_t l = 0; l < shape.layers; ++l) {
      fill(k.data(), k.size(), rng);
      fill(v.data(), v.size(), rng);
      if (!device) {
        manager.prefill(id, l, k.data(), v.data(), r.context);
        continue;
      }
#if SPARSEKV_EXAMPLE_CUDA
      // One layer's prompt K/V on the device at a time; prefill returns done with it.
      d_prompt_k.upload(k.data(), prompt_n, stream->get());
      d_prompt_v.upload(v.data(), prompt_n, stream->get());
      manager.prefill(id, l, d_prompt_k.data(), d_prompt_v.data(), r.context, stream->handle());
#endif
    }
    batch.push_back(id);
  }
  const double prefill_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - prefill_start).count();

  // Queries drift slowly, as consecutive decode steps do, so selections overlap step to step.
  std::vector<float> drift(qn);
  std::normal_distribution<float> normal;
  for (auto& x : drift) x = normal(rng);
  std::vector<std::uint16_t> q(shape.layers * qn), k_new(shape.layers * kvn), v_new(shape.layers * kvn);
  std::vector<float> out(qn);
  sparsekv::tools::ThreadPool pool(device ? 1 : r.threads);
  const sparsekv::StepExecutor executor = pool.executor();
  double seconds = 0;
  std::vector<double> step_seconds;  // a stall shows as the worst step, which the mean hides
  for (std::uint32_t s = 0; s < r.steps; ++s) {
    for (std::uint32_t l = 0; l < shape.layers; ++l) {
      for (std::size_t i = 0; i < qn; ++i) {
        drift[i] = 0.95f * drift[i] + 0.31f * normal(rng);
        q[l * qn + i] = sparsekv::float_to_bf16(drift[i]);
      }
    }
    fill(k_new.data(), k_new.size(), rng);
    fill(v_new.data(), v_new.size(), rng);
#if SPARSEKV_EXAMPLE_CUDA
    if (device) {
      d_q.upload(q.data(), q.size(), stream->get());
      d_k.upload(k_new.data(), k_new.size(), stream->get());
      d_v.upload(v_new.data(), v_new.size(), stream->get());
      stream->wait();  // the uploads stay out of the timed step
    }
#endif
    const auto start = std::chrono::steady_clock::now();
    for (std::uint32_t l = 0; l < shape.layers; ++l) {
      if (!device) {
        manager.decode(batch, l, q.data() + l * qn, k_new.data() + l * kvn, v_new.data() + l * kvn, out.data(),
                       executor);
        continue;
      }
#if SPARSEKV_EXAMPLE_CUDA
      manager.decode(batch, l, d_q.data() + l * qn, d_k.data() + l * kvn, d_v.data() + l * kvn, d_out.data(),
                     stream->handle());
#endif
    }
    if (device) manager.synchronize();  // the step is done: an engine would sample here
    step_seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    seconds += step_seconds.back();
  }
#if SPARSEKV_EXAMPLE_CUDA
  if (device) out = d_out.download(qn, stream->get());
#endif
  if (const std::string fault = output_fault(out); !fault.empty()) {
    std::fprintf(stderr, "decode_loop: policy %s: %s\n", policy_name.c_str(), fault.c_str());
    return false;
  }

  const sparsekv::StepStats& st = manager.stats();
  const double tokens_per_s = double(r.steps) * r.batch / seconds;
  const auto worst = std::max_element(step_seconds.begin(), step_seconds.end());
  const auto worst_step = static_cast<std::size_t>(worst - step_seconds.begin());
  const double worst_s = *worst;
  std::nth_element(step_seconds.begin(), step_seconds.begin() + step_seconds.size() / 2, step_seconds.end());
  const double median_s = step_seconds[step_seconds.size() / 2];
  // The device path gathers exactly its miss pages; the host path counts its copies.
  const std::uint64_t pages_moved = device ? st.cache.miss_pages : st.pages_moved;
  const std::uint64_t bytes_moved = device ? st.cache.miss_pages * page : st.bytes_moved;
  const std::string_view api = device ? "device" : "host";
  if (r.json) {
    fmt::print(
        "{{\"backend\": \"{}\", \"api\": \"{}\", \"policy\": \"{}\", \"context\": {}, \"batch\": {}, \"budget\": {}, "
        "\"page_tokens\": {}, \"steps\": {}, \"threads\": {}, \"tokens_per_s\": {:.3f}, \"hit_ratio\": {:.4f}, "
        "\"pages_moved\": {}, "
        "\"bytes_moved\": {}, \"append_s\": {:.4f}, \"select_s\": {:.4f}, \"retrieve_s\": {:.4f}, \"attend_s\": "
        "{:.4f}, "
        "\"step_median_s\": {:.6f}, \"step_worst_s\": {:.6f}, \"prefill_s\": {:.3f}, \"cpu_tier_reserved_bytes\": "
        "{}}}\n",
        backend, api, policy_name, r.context, r.batch, r.budget, config.page_tokens, r.steps, pool.threads(),
        tokens_per_s, st.hit_ratio(), pages_moved, bytes_moved, st.append_s, st.select_s, st.retrieve_s, st.attend_s,
        median_s, worst_s, prefill_s, manager.tier_usage().cpu_reserved_bytes);
    return true;
  }
  fmt::print(
      "decode_loop: {} x {}-token context, policy {} (budget {} tokens, {}-token pages), {} steps, {} layers, "
      "{} backend, {} tensors, {} thread(s)\n",
      r.batch, r.context, policy_name, r.budget, config.page_tokens, r.steps, shape.layers, backend, api,
      pool.threads());
  fmt::print("  tokens/s        {:.2f}\n", tokens_per_s);
  fmt::print("  step time       median {:.2f} ms, worst {:.2f} ms (step {})\n", 1e3 * median_s, 1e3 * worst_s,
             worst_step);
  if (manager.tier_usage().site == sparsekv::AttendSite::cpu_tier) {
    fmt::print("  in place        the selected CPU pages attended where they are: no GPU tier, nothing moved\n");
  } else {
    fmt::print("  hit ratio       {:.2f}%\n  pages moved     {}\n  bytes moved     {:.1f} MiB\n", 100 * st.hit_ratio(),
               pages_moved, bytes_moved / double(1 << 20));
  }
  if (device) {
    // Select, Retrieve and Attend run on the device, inside the step's time:
    // sparsekv-bench-decode splits them. What the host spends per step:
    fmt::print("  host time to check, plan and enqueue a (request, layer) step: {:.1f} us\n",
               1e6 * st.append_s / st.decode_steps);
  } else {
    fmt::print(
        "  time per (request, layer) step: append {:.1f} us, select {:.1f} us, retrieve {:.1f} us, attend {:.1f} us\n",
        1e6 * st.append_s / st.decode_steps, 1e6 * st.select_s / st.decode_steps, 1e6 * st.retrieve_s / st.decode_steps,
        1e6 * st.attend_s / st.decode_steps);
  }
  fmt::print(
      "  prefill {:.2f} s with the synthetic K/V (index {:.2f} s, offload {:.2f} s); CPU tier reserved {:.1f} MiB\n",
      prefill_s, st.index_s, st.offload_s, manager.tier_usage().cpu_reserved_bytes / double(1 << 20));
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  sparsekv::register_research_policies();  // --policy oracle, for comparison
  try {
    const sparsekv::tools::CommandLine args(
        argc, argv,
        {"--context", "--batch", "--policy", "--budget", "--steps", "--layers", "--q-heads", "--kv-heads", "--head-dim",
         "--seed", "--backend", "--page-tokens", "--threads"},
        {"--json", "--help"});
    if (args.has("--help")) {
      usage();
      return 0;
    }
    Run r;
    r.context = args.number<std::uint32_t>("--context", 8192);
    r.batch = args.number<std::uint32_t>("--batch", 4);
    r.steps = args.number<std::uint32_t>("--steps", 64);
    r.budget = args.number<std::uint32_t>("--budget", 2048);
    r.shape =
        sparsekv::ModelShape{args.number<std::uint32_t>("--layers", 4), args.number<std::uint32_t>("--q-heads", 32),
                             args.number<std::uint32_t>("--kv-heads", 8), args.number<std::uint32_t>("--head-dim", 128),
                             sparsekv::DType::bf16};
    r.shape.validate();
    r.seed = args.number<std::uint64_t>("--seed", 1);
    r.backend = args.text("--backend", "");
    r.json = args.has("--json");
    r.threads = args.number<std::uint32_t>("--threads", 1);
    if (r.context == 0 || r.batch == 0 || r.steps == 0 || r.threads == 0) {
      throw std::invalid_argument("context, batch, steps and threads must be > 0");
    }
    bool ok = true;
    for (const std::string& name : args.list("--policy", "shadowkv")) {
      r.page_tokens =
          args.number<std::uint32_t>("--page-tokens", name == "quest" ? 16 : sparsekv::Config{}.page_tokens);
      ok = run_policy(r, name) && ok;
    }
    return ok ? 0 : 1;
  } catch (const std::invalid_argument& e) {  // the command line
    std::fprintf(stderr, "decode_loop: %s\n", e.what());
    usage();
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "decode_loop: %s\n", e.what());
    return 2;
  }
}
