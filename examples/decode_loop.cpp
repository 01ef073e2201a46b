// decode_loop: a standalone decode loop over synthetic K/V through the
// sparsekv facade (host or CUDA backend). Prints tokens/s, hit ratio, pages and
// bytes moved and the time per operation.
//
//   decode_loop --context N --batch B --policy NAME --budget TOKENS --steps S [--json]
//               [--layers L --q-heads H --kv-heads K --head-dim D --seed S] [--backend host|cuda]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <exception>
#include <random>
#include <vector>

#include <fmt/format.h>

#include "backend_choice.hpp"
#include "command_line.hpp"
#include "sparsekv/core/numeric.hpp"
#include "sparsekv/sparsekv.hpp"

namespace {

void usage() {
  std::fputs(
      "usage: decode_loop [--context 8192] [--batch 4] [--policy shadowkv] [--budget 2048] [--steps 64] [--json]\n"
      "                   [--layers 4] [--q-heads 32] [--kv-heads 8] [--head-dim 128] [--seed 1]\n"
      "                   [--backend host|cuda]   (default: cuda when built with it and a GPU is present)\n"
      "  policies: dense, streaming, quest, shadowkv, retroinfer, retroinfer_no_estimation\n",
      stderr);
}

// bf16 noise from a fast generator: synthetic K/V need volume, not quality.
void fill(std::vector<std::uint16_t>& out, std::size_t n, std::mt19937_64& rng) {
  out.resize(n);
  for (auto& x : out) {
    const double u = (double(rng() >> 11) + 0.5) * 0x1p-53;
    x = sparsekv::float_to_bf16(static_cast<float>((u - 0.5) * 3.4641));  // unit variance
  }
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const sparsekv::tools::CommandLine args(
        argc, argv,
        {"--context", "--batch", "--policy", "--budget", "--steps", "--layers", "--q-heads", "--kv-heads", "--head-dim",
         "--seed", "--backend"},
        {"--json", "--help"});
    if (args.has("--help")) {
      usage();
      return 0;
    }
    const auto context = args.number<std::uint32_t>("--context", 8192);
    const auto batch_size = args.number<std::uint32_t>("--batch", 4);
    const auto steps = args.number<std::uint32_t>("--steps", 64);
    const auto budget = args.number<std::uint32_t>("--budget", 2048);
    const std::string policy_name = args.text("--policy", "shadowkv");
    const sparsekv::ModelShape shape{args.number<std::uint32_t>("--layers", 4), args.number<std::uint32_t>("--q-heads", 32),
                                     args.number<std::uint32_t>("--kv-heads", 8),
                                     args.number<std::uint32_t>("--head-dim", 128), sparsekv::DType::bf16};
    shape.validate();
    if (context == 0 || batch_size == 0 || steps == 0) throw std::invalid_argument("context, batch and steps must be > 0");

    sparsekv::AnyPolicy policy = sparsekv::make_policy(policy_name, budget);
    sparsekv::Config config;
    config.max_requests = batch_size;
    config.max_context_tokens = context + steps;
    const std::size_t page = config.page_bytes(shape);
    const std::size_t heads = std::size_t{shape.layers} * shape.kv_heads * batch_size;
    // CPU tier: the whole context (clusters pad their pages: 2x); GPU tier:
    // each request's mandatory pages, the 5x minimum buffer and its tails.
    config.cpu_tier_bytes = heads * (2 * std::size_t{context + steps} / config.page_tokens + 64) * page;
    std::uint32_t need = 1;
    for (std::uint32_t l = 0; l < shape.layers; ++l) {
      need = std::max(need, policy.mandatory_pages({l, shape.layers, shape.q_heads, shape.kv_heads, shape.head_dim,
                                                    config.page_tokens, context + steps}));
    }
    config.gpu_tier_bytes = heads * (std::size_t{need} * 6 + 2) * page;
    sparsekv::RuntimeManager manager(shape, config, policy, sparsekv::tools::make_backend(args.text("--backend", "")));
    const std::string backend(manager.backend().name());

    std::mt19937_64 rng(args.number<std::uint64_t>("--seed", 1));
    std::vector<sparsekv::RequestId> batch;
    std::vector<std::uint16_t> k, v;
    for (std::uint32_t b = 0; b < batch_size; ++b) {
      const sparsekv::RequestId id = b + 1;
      manager.add_request(id, context + steps);
      for (std::uint32_t l = 0; l < shape.layers; ++l) {
        fill(k, std::size_t{context} * shape.kv_heads * shape.head_dim, rng);
        fill(v, k.size(), rng);
        manager.prefill(id, l, k.data(), v.data(), context);
      }
      batch.push_back(id);
    }
    // Queries drift slowly, as consecutive decode steps do, so selections overlap step to step.
    const std::size_t qn = std::size_t{batch_size} * shape.q_heads * shape.head_dim;
    std::vector<float> drift(qn);
    std::normal_distribution<float> normal;
    for (auto& x : drift) x = normal(rng);
    std::vector<std::uint16_t> q(qn), k_new, v_new;
    std::vector<float> out(qn);
    const auto start = std::chrono::steady_clock::now();
    for (std::uint32_t s = 0; s < steps; ++s) {
      for (std::uint32_t l = 0; l < shape.layers; ++l) {
        for (std::size_t i = 0; i < qn; ++i) {
          drift[i] = 0.95f * drift[i] + 0.31f * normal(rng);
          q[i] = sparsekv::float_to_bf16(drift[i]);
        }
        fill(k_new, std::size_t{batch_size} * shape.kv_heads * shape.head_dim, rng);
        fill(v_new, k_new.size(), rng);
        manager.decode(batch, l, q.data(), k_new.data(), v_new.data(), out.data());
      }
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const sparsekv::ManagerStats& st = manager.stats();
    const double tokens_per_s = double(steps) * batch_size / seconds;
    if (args.has("--json")) {
      fmt::print(
          "{{\"backend\": \"{}\", \"policy\": \"{}\", \"context\": {}, \"batch\": {}, \"budget\": {}, \"steps\": {}, \"tokens_per_s\": {:.3f}, "
          "\"hit_ratio\": {:.4f}, \"pages_moved\": {}, \"bytes_moved\": {}, \"select_s\": {:.4f}, \"retrieve_s\": {:.4f}, "
          "\"attend_s\": {:.4f}, \"cpu_tier_reserved_bytes\": {}}}\n",
          backend, policy_name, context, batch_size, budget, steps, tokens_per_s, st.hit_ratio(), st.pages_moved, st.bytes_moved,
          st.select_s, st.retrieve_s, st.attend_s, manager.cpu_tier_reserved_bytes());
    } else {
      fmt::print("decode_loop: {} x {}-token context, policy {} (budget {} tokens), {} steps, {} layers, {} backend\n",
                 batch_size, context, policy_name, budget, steps, shape.layers, backend);
      fmt::print("  tokens/s        {:.2f}\n  hit ratio       {:.2f}%\n  pages moved     {}\n  bytes moved     {:.1f} MiB\n",
                 tokens_per_s, 100 * st.hit_ratio(), st.pages_moved, st.bytes_moved / double(1 << 20));
      fmt::print("  time per (request, layer) step: append {:.1f} us, select {:.1f} us, retrieve {:.1f} us, attend {:.1f} us\n",
                 1e6 * st.append_s / st.decode_steps, 1e6 * st.select_s / st.decode_steps,
                 1e6 * st.retrieve_s / st.decode_steps, 1e6 * st.attend_s / st.decode_steps);
      fmt::print("  prefill: index {:.2f} s, offload {:.2f} s; CPU tier reserved {:.1f} MiB\n", st.index_s, st.offload_s,
                 manager.cpu_tier_reserved_bytes() / double(1 << 20));
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "decode_loop: %s\n", e.what());
    usage();
    return 2;
  }
}
