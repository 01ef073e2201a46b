// smollm-demo: a real model end to end through sparsekv on the CPU.
// SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised to fp32) reads a long text
// -- by default the GPL-3 every Debian system ships, cut to a few thousand
// tokens -- and a question about it, then generates greedily with its decode
// attention going through sparsekv's facade with the chosen policy and token
// budget: on InPlaceBackend, what a CPU engine uses (the selected CPU pages
// attended where they are), or with --backend host on HostBackend (a host
// GPU tier caching the selections: hit ratio and pages moved). The prompt is prefilled densely once; its K/V go
// both to sparsekv and to a plain dense KV cache, which afterwards replays
// the generated tokens (teacher-forced) to measure how often Dense would have
// picked the same next token. sparsekv keeps K/V in f16 by default, as
// llama.cpp's cache does (--kv-type); the dense reference keeps them in fp32.
//
//   smollm-demo [--model PATH] [--text FILE] [--prompt-tokens N] [--new-tokens N]
//               [--policy NAME] [--budget TOKENS] [--backend in-place|host]
//               [--kv-type f16|bf16|f32]
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "command_line.hpp"
#include "model/bpe_tokenizer.hpp"
#include "model/gguf.hpp"
#include "model/llama.hpp"
#include "model/model_files.hpp"
#include "sparsekv/sparsekv.hpp"

namespace {

using namespace sparsekv::model;
using Clock = std::chrono::steady_clock;

constexpr const char* kProgram = "smollm-demo";

void usage() {
  std::fputs(
      "usage: smollm-demo [--model PATH] [--text FILE] [--prompt-tokens 4096] [--new-tokens 32]\n"
      "                   [--policy shadowkv] [--budget 512] [--backend in-place] [--kv-type f16]\n"
      "  --model PATH         default: "
      "${SPARSEKV_MODEL_DIR:-$HOME/.cache/sparsekv/models}/SmolLM2-135M-Instruct.Q4_1.gguf\n"
      "  --text FILE          the document to read (default /usr/share/common-licenses/GPL-3)\n"
      "  --prompt-tokens N    tokens of the document kept (its start); a question is appended\n"
      "  --new-tokens N       tokens to generate (greedy; stops early at end of turn)\n"
      "  --policy NAME        dense, streaming, quest, shadowkv, retroinfer, retroinfer_no_estimation\n"
      "  --budget TOKENS      tokens one decode step may select per kv head\n"
      "  --backend NAME       in-place (a CPU engine's: no GPU tier) or host (a host GPU tier caching the\n"
      "                       selections, as a GPU would: prints its hit ratio and pages moved)\n"
      "  --kv-type NAME       f16, bf16 or f32: what sparsekv stores K/V (and takes q) in; the model computes\n"
      "                       in fp32 and the dense reference keeps fp32 K/V\n",
      stderr);
}

double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

}  // namespace

int main(int argc, char** argv) {
  try {
    const auto args = sparsekv::tools::parse_command_line<sparsekv::model::UserError>(
        argc, argv,
        std::set<std::string>{"--model", "--text", "--prompt-tokens", "--new-tokens", "--policy", "--budget",
                              "--backend", "--kv-type"},
        std::set<std::string>{"--help"});
    if (args.has("--help")) {
      usage();
      return 0;
    }
    const auto prompt_tokens = args.number<std::uint32_t>("--prompt-tokens", 4096);
    const auto new_tokens = args.number<std::uint32_t>("--new-tokens", 32);
    const auto budget = args.number<std::uint32_t>("--budget", 512);
    if (prompt_tokens == 0 || new_tokens == 0 || budget == 0) {
      throw sparsekv::model::UserError("--prompt-tokens, --new-tokens and --budget must be > 0");
    }
    const std::string policy_name = args.text("--policy", "shadowkv");
    const std::string text_path = args.text("--text", "/usr/share/common-licenses/GPL-3");
    const std::string backend_name = args.text("--backend", "in-place");
    if (backend_name != "in-place" && backend_name != "host") {
      throw sparsekv::model::UserError(fmt::format("--backend must be in-place or host, not '{}'", backend_name));
    }
    const bool in_place = backend_name == "in-place";
    const std::string kv_type = args.text("--kv-type", "f16");
    const sparsekv::DType kv_dtype = [&] {
      try {
        return sparsekv::parse_dtype(kv_type);
      } catch (const sparsekv::Error&) {
        throw sparsekv::model::UserError(fmt::format("--kv-type must be f16, bf16 or f32, not '{}'", kv_type));
      }
    }();

    // Everything the user can get wrong is checked before the model loads.
    sparsekv::AnyPolicy policy = sparsekv::make_policy(policy_name, budget);
    const std::string model_path =
        sparsekv::model::existing_model_path(args.text("--model", sparsekv::model::default_model_path().string()));
    const std::string text = sparsekv::model::read_text_file(text_path);

    const auto t_load = Clock::now();
    GgufFile file = [&] {
      try {
        return GgufFile::open(model_path);
      } catch (const std::exception& e) {
        throw sparsekv::model::UserError(fmt::format("cannot load model: {}", e.what()));
      }
    }();
    const BpeTokenizer tokenizer(file);
    const LlamaModel model(file);
    LlamaConfig c = model.config();
    c.kv_dtype = kv_dtype;
    const double load_s = since(t_load);

    // Prompt: chat template around the document's first tokens and a question.
    std::vector<std::int32_t> doc = tokenizer.encode(text, /*parse_special=*/false);
    const std::size_t doc_total = doc.size();
    if (doc.size() > prompt_tokens) doc.resize(prompt_tokens);
    std::vector<std::int32_t> prompt = tokenizer.encode(
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\n");
    prompt.insert(prompt.end(), doc.begin(), doc.end());
    const std::vector<std::int32_t> question = tokenizer.encode(
        "\n\nWhat is the name of the document above, and who published it?<|im_end|>\n<|im_start|>assistant\n");
    prompt.insert(prompt.end(), question.begin(), question.end());
    const auto T = static_cast<std::uint32_t>(prompt.size());
    if (c.context != 0 && T + new_tokens > c.context) {
      throw sparsekv::model::UserError(
          fmt::format("{} prompt + {} new tokens exceed the model's {}-token context", T, new_tokens, c.context));
    }
    const std::int32_t im_end = tokenizer.token_id("<|im_end|>"), eot = tokenizer.token_id("<|endoftext|>");
    const auto stops = [&](std::int32_t t) { return t == tokenizer.eos() || t == im_end || t == eot; };

    fmt::print("{}: SmolLM2-135M-Instruct ({} layers, {} q / {} kv heads, head dim {}), fp32 on {} CPU threads\n",
               kProgram, c.layers, c.q_heads, c.kv_heads, c.head_dim, model.threads());
    fmt::print("  model {} loaded in {:.1f} s\n", model_path, load_s);
    fmt::print("  prompt {} tokens: the first {} of {}'s {} tokens, a question, the chat template\n", T, doc.size(),
               text_path, doc_total);
    fmt::print("  decode attention: sparsekv {} with a budget of {} tokens per kv head ({} backend, {} K/V)\n",
               policy_name, budget, backend_name, kv_type);
    std::fflush(stdout);

    const std::uint32_t max_tokens = T + new_tokens + 1;
    auto manager = in_place ? make_manager(c, policy, max_tokens, 1, {}, std::make_unique<sparsekv::InPlaceBackend>())
                            : make_manager(c, policy, max_tokens);
    const sparsekv::RequestId request = 1;
    manager->add_request(request, max_tokens);
    SparseSession sparse(*manager, request);
    DenseCache dense(c);

    // Prefill once (dense, causal); K/V to sparsekv (Index + Offload) and to the dense cache.
    std::vector<float> logits(c.vocab);
    const auto t_prefill = Clock::now();
    {
      AttentionBackend* sinks[] = {&sparse, &dense};
      model.prefill(prompt, sinks, logits.data());
    }
    const double prefill_s = since(t_prefill);

    // Generate through sparsekv.
    std::vector<std::int32_t> generated{static_cast<std::int32_t>(argmax(logits))};
    const auto t_decode = Clock::now();
    {
      AttentionBackend* rows[] = {&sparse};
      while (generated.size() < new_tokens && !stops(generated.back())) {
        const std::int32_t token = generated.back();
        model.decode(std::span(&token, 1), T + static_cast<std::uint32_t>(generated.size()) - 1, rows, logits.data());
        generated.push_back(static_cast<std::int32_t>(argmax(logits)));
      }
    }
    const double decode_s = since(t_decode);
    const std::size_t decode_steps = generated.size() - 1;  // the first token came from the prefill

    // Dense replays the same tokens: would it have picked the same next token?
    std::size_t agree = 0;
    const auto t_dense = Clock::now();
    {
      AttentionBackend* rows[] = {&dense};
      for (std::size_t s = 0; s < decode_steps; ++s) {
        model.decode(std::span(&generated[s], 1), T + static_cast<std::uint32_t>(s), rows, logits.data());
        if (static_cast<std::int32_t>(argmax(logits)) == generated[s + 1]) ++agree;
      }
    }
    const double dense_s = since(t_dense);

    std::vector<std::int32_t> shown = generated;
    if (!shown.empty() && stops(shown.back())) shown.pop_back();
    fmt::print("\n--- generated ({} tokens) ---\n{}\n-----------------------------\n", generated.size(),
               tokenizer.decode(shown));
    const sparsekv::StepStats& st = manager->stats();
    fmt::print(
        "  prefill    {} tokens in {:.2f} s: {:.1f} tokens/s (dense causal attention; of which sparsekv index {:.2f} "
        "s, "
        "offload {:.2f} s)\n",
        T, prefill_s, T / prefill_s, st.index_s, st.offload_s);
    if (decode_steps > 0) {
      fmt::print("  decode     {} tokens in {:.2f} s: {:.1f} tokens/s through sparsekv {}\n", decode_steps, decode_s,
                 decode_steps / decode_s, policy_name);
      fmt::print("  dense      {} tokens in {:.2f} s: {:.1f} tokens/s (reference replay, no sparsekv)\n", decode_steps,
                 dense_s, decode_steps / dense_s);
      if (in_place) {
        fmt::print("  in place   the selected CPU pages attended where they are: nothing moved, {} tail pages saved\n",
                   st.pages_saved);
      } else {
        fmt::print("  hit ratio  {:.2f}% of {} selected pages resident in the GPU working set\n", 100 * st.hit_ratio(),
                   st.cache.hit_pages + st.cache.miss_pages);
        fmt::print("  pages moved {} CPU -> GPU ({:.1f} MiB), {} tail pages saved\n", st.pages_moved,
                   st.bytes_moved / double(1 << 20), st.pages_saved);
      }
      fmt::print("  agreement with Dense: {}/{} decode steps ({:.1f}%) pick the same greedy next token\n", agree,
                 decode_steps, 100.0 * agree / decode_steps);
      fmt::print(
          "  sparsekv time per (layer, step): append {:.1f} us, select {:.1f} us, retrieve {:.1f} us, attend {:.1f} "
          "us\n",
          1e6 * st.append_s / st.decode_steps, 1e6 * st.select_s / st.decode_steps,
          1e6 * st.retrieve_s / st.decode_steps, 1e6 * st.attend_s / st.decode_steps);
    } else {
      fmt::print("  the model ended its answer at once: no decode step ran\n");
    }
    return 0;
  } catch (const std::exception& e) {  // every failure is the user's to fix: one line, exit 2
    std::fprintf(stderr, "%s: %s\n", kProgram, e.what());
    return 2;
  }
}
