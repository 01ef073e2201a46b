// sparsekv inside llama.cpp (integrations/llama.cpp), on SmolLM2-135M at a 1K
// context: Dense through the hook decodes as llama.cpp alone does, a sparse
// policy runs, two sequences decode at once, four sequences finishing and
// starting lose nothing (the library's CPU tier against llama.cpp's own
// cache), a saved sequence loads back exactly, and what the library cannot
// follow is refused with its error -- never a silent desynchronisation.
// [model-file]: skipped (ctest, exit 77) without the model scripts/setup fetches.
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "ggml-backend.h"
#include "ggml.h"
#include "llama.h"
#include "llama_eval.hpp"
#include "sparsekv/core/error.hpp"
#include "sparsekv_llama.hpp"

using namespace sparsekv;
using namespace sparsekv::llama_cpp;

namespace {

std::string model_path() {
  const char* dir = std::getenv("SPARSEKV_MODEL_DIR");
  const std::filesystem::path base =
      dir != nullptr ? std::filesystem::path(dir) : std::filesystem::path(std::getenv("HOME")) / ".cache/sparsekv/models";
  return (base / "SmolLM2-135M-Instruct.Q4_1.gguf").string();
}

struct Model {
  llama_model* model = nullptr;
  Model() {
    llama_log_set([](ggml_log_level level, const char* text, void*) {
      if (level >= GGML_LOG_LEVEL_ERROR) std::fputs(text, stderr);
    }, nullptr);
    llama_backend_init();
    model = llama_model_load_from_file(model_path().c_str(), llama_model_default_params());
    REQUIRE(model != nullptr);
  }
  ~Model() { llama_model_free(model); }
};
Model& model() {
  static Model m;
  return m;
}

// The GPL's text (Debian's base-files, as smollm-demo reads): 8K tokens of prose.
std::vector<llama_token> text() {
  std::ifstream in("/usr/share/common-licenses/GPL-3");
  REQUIRE(in.good());
  std::ostringstream s;
  s << in.rdbuf();
  return tokenize(model().model, s.str());
}

EvalSetup setup(std::uint32_t parallel) {
  EvalSetup s;
  s.model = model().model;
  s.text = text();
  s.prefill = 900;
  s.tokens = 24;
  s.parallel = parallel;
  s.threads = 2;
  REQUIRE(s.text.size() >= eval_text_tokens(s));
  return s;
}

// `sequences` sequences of `tokens` tokens each, 2 threads, 512-token batches.
llama_context_params context_params(std::uint32_t sequences, std::uint32_t tokens) {
  llama_context_params p = llama_context_default_params();
  p.n_ctx = tokens * sequences;
  p.n_batch = p.n_ubatch = 512;
  p.n_seq_max = sequences;
  p.n_threads = p.n_threads_batch = 2;
  return p;
}

HookOptions options_for(const char* policy, std::uint32_t budget) {
  HookOptions options;
  options.policy = policy;
  options.budget_tokens = budget;
  return options;
}

struct Context {
  llama_context* ctx = nullptr;
  explicit Context(std::uint32_t sequences) {
    llama_context_params p = context_params(sequences, 1024);
    p.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_ENABLED;
    ctx = llama_init_from_model(model().model, p);
    REQUIRE(ctx != nullptr);
  }
  ~Context() { llama_free(ctx); }
  // Decodes tokens [from, to) of `t` into sequence `seq` at positions first..; returns llama_decode's code.
  std::int32_t decode(const std::vector<llama_token>& t, std::size_t from, std::size_t to, llama_pos first,
                      llama_seq_id seq = 0) {
    llama_batch b = llama_batch_init(std::int32_t(to - from), 0, 1);
    for (std::size_t i = from; i < to; ++i) {
      b.token[b.n_tokens] = t[i];
      b.pos[b.n_tokens] = first + llama_pos(i - from);
      b.n_seq_id[b.n_tokens] = 1;
      b.seq_id[b.n_tokens][0] = seq;
      b.logits[b.n_tokens] = i + 1 == to;
      ++b.n_tokens;
    }
    const std::int32_t rc = llama_decode(ctx, b);
    llama_batch_free(b);
    return rc;
  }
};

}  // namespace

// Each decode step's q/K/V and attention output of every layer, by the names
// llama.cpp's graph gives them (the hook's output is attn_hook_out-<il>).
struct Capture {
  int step = -1;
  std::map<std::string, std::vector<float>> tensors;  // "step:name-il"
};
bool capture(ggml_tensor* t, bool ask, void* user) {
  auto& c = *static_cast<Capture*>(user);
  std::string name = t->name;
  const bool wanted = c.step >= 0 && t->type == GGML_TYPE_F32 &&
                      (name.starts_with("Qcur-") || name.starts_with("Kcur-") || name.starts_with("Vcur-") ||
                       name.starts_with("kqv_out-") || name.starts_with("attn_hook_out-"));
  if (ask || !wanted) return wanted || ask ? wanted : true;
  if (name.starts_with("attn_hook_out-")) name = "kqv_out-" + name.substr(14);
  std::vector<float> data(std::size_t(ggml_nelements(t)));
  ggml_backend_tensor_get(t, data.data(), 0, data.size() * sizeof(float));
  c.tensors[std::to_string(c.step) + ":" + name] = std::move(data);
  return true;
}

TEST_CASE("llama.cpp hook: Dense through the hook computes llama.cpp's attention, layer by layer",
          "[model-file][llama-hook]") {
  // f32 K/V in llama.cpp's cache and in the library, llama.cpp's attention
  // without flash attention: the two differ by summation order alone. SmolLM2's
  // Q4_1 matrix products round their input rows to 8 bits, so a last-bit
  // difference now and then moves a row to the next step and the runs part
  // after a few layers; wherever a layer's q/K/V history is still the same in
  // both runs, its attention must agree.
  const std::vector<llama_token> t = text();
  for (const std::uint32_t sequences : {1u, 2u}) {
    CAPTURE(sequences);
    Capture runs[2];
    for (int hooked = 0; hooked < 2; ++hooked) {
      llama_context_params p = context_params(sequences, 512);
      p.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
      p.type_k = p.type_v = GGML_TYPE_F32;
      p.cb_eval = capture;
      p.cb_eval_user_data = &runs[hooked];
      llama_context* ctx = llama_init_from_model(model().model, p);
      REQUIRE(ctx != nullptr);
      std::optional<Hook> hook;
      HookOptions options;
      options.policy = "dense";
      options.dtype = DType::f32;
      if (hooked == 1) hook.emplace(ctx, options);
      llama_batch b = llama_batch_init(512, 0, 1);
      for (std::uint32_t s = 0; s < sequences; ++s) {
        b.n_tokens = 0;
        for (std::int32_t i = 0; i < 300; ++i) {
          b.token[i] = t[s * 40 + std::size_t(i)];
          b.pos[i] = i;
          b.n_seq_id[i] = 1;
          b.seq_id[i][0] = llama_seq_id(s);
          b.logits[i] = i == 299;
          ++b.n_tokens;
        }
        REQUIRE(llama_decode(ctx, b) == 0);
      }
      for (int step = 0; step < 8; ++step) {
        runs[hooked].step = step;
        b.n_tokens = 0;
        for (std::uint32_t s = 0; s < sequences; ++s) {
          b.token[s] = t[s * 40 + 300 + std::size_t(step)];
          b.pos[s] = 300 + step;
          b.n_seq_id[s] = 1;
          b.seq_id[s][0] = llama_seq_id(s);
          b.logits[s] = true;
          ++b.n_tokens;
        }
        REQUIRE(llama_decode(ctx, b) == 0);
      }
      llama_batch_free(b);
      if (hook) REQUIRE(hook->decode_rows() == 8 * sequences * 30);
      hook.reset();
      llama_free(ctx);
    }
    std::uint32_t compared = 0;
    double worst = 0;
    for (int il = 0; il < 30; ++il) {
      for (int step = 0; step < 8; ++step) {
        const auto key = [&](const char* name) { return std::to_string(step) + ":" + name + "-" + std::to_string(il); };
        bool same_inputs = true;
        for (const char* name : {"Qcur", "Kcur", "Vcur"}) {
          REQUIRE(runs[0].tensors.contains(key(name)));
          same_inputs = same_inputs && runs[0].tensors[key(name)] == runs[1].tensors[key(name)];
        }
        if (!same_inputs) break;  // this layer's K/V history differs from here on
        const std::vector<float>& own = runs[0].tensors[key("kqv_out")];
        const std::vector<float>& hooked = runs[1].tensors[key("kqv_out")];
        REQUIRE(own.size() == hooked.size());
        float scale = 0;
        for (const float x : own) scale = std::max(scale, std::abs(x));
        for (std::size_t i = 0; i < own.size(); ++i) worst = std::max(worst, double(std::abs(own[i] - hooked[i]) / scale));
        ++compared;
      }
    }
    WARN(sequences << " sequences: " << compared << " of 240 (layer, step) attentions had the same inputs; worst "
                   << "relative difference " << worst);
    CHECK(compared >= 30);  // a decode step's worth of layers at least
    CHECK(worst <= 1e-5);
  }
}

TEST_CASE("llama.cpp hook: Dense through the hook is as close to llama.cpp as its flash attention is",
          "[model-file][llama-hook]") {
  for (const std::uint32_t parallel : {1u, 2u}) {
    CAPTURE(parallel);
    // llama.cpp's defaults: f16 cache, flash attention. Its own attention
    // without flash attention is the yardstick: an exact attention that
    // rounds differently.
    const EvalSetup usual = setup(parallel);
    const SavedPrompts prompts = prefill_prompts(usual);  // one prefill for the variants of this setup
    Distributions reference;
    const EvalResult own = eval_variant(usual, &prompts, {"llama", 0}, nullptr, &reference);
    EvalSetup no_flash = usual;
    no_flash.flash_attn = false;
    const EvalResult llama_no_flash = eval_variant(no_flash, nullptr, {"llama", 0}, &reference, nullptr);
    const EvalResult dense = eval_variant(usual, &prompts, {"dense", 1024}, &reference, nullptr);
    CHECK(dense.hook_rows == std::uint64_t{usual.tokens} * parallel * 30);  // every row of every layer
    CHECK(dense.kld_mean <= 2 * llama_no_flash.kld_mean + 1e-4);
    CHECK(dense.top1_agreement >= llama_no_flash.top1_agreement - 0.05);
    CHECK(dense.perplexity == Approx(own.perplexity).epsilon(0.02));
    // A sparse policy at a quarter of the context runs and stays close.
    const EvalResult quest = eval_variant(usual, &prompts, {"quest", 256}, &reference, nullptr);
    CHECK(quest.hook_rows == dense.hook_rows);
    CHECK(std::isfinite(quest.perplexity));
    CHECK(quest.kld_mean < 0.5);
    WARN("parallel " << parallel << ": llama without flash attention kld " << llama_no_flash.kld_mean << " top1 "
                     << llama_no_flash.top1_agreement << "; dense kld " << dense.kld_mean << " top1 "
                     << dense.top1_agreement << "; quest@256 kld " << quest.kld_mean << " top1 "
                     << quest.top1_agreement);
  }
}

TEST_CASE("llama.cpp hook: what the library cannot follow is refused with its error", "[model-file][llama-hook]") {
  const std::vector<llama_token> t = text();
  Context c(1);
  Hook hook(c.ctx, options_for("quest", 256));
  REQUIRE(c.decode(t, 0, 300, 0) == 0);
  REQUIRE(c.decode(t, 300, 301, 300) == 0);
  REQUIRE(hook.tokens(0) == 301);
  llama_memory_t memory = llama_get_memory(c.ctx);

  // A context shift: refused by the hook, llama.cpp's memory untouched.
  REQUIRE_FALSE(hook.seq_add(0, 10, -1, -5));
  REQUIRE(hook.failure()->code == ErrorCode::failed_precondition);
  REQUIRE(hook.failure()->message.find("seq_add") != std::string::npos);
  REQUIRE(llama_memory_seq_pos_max(memory, 0) == 300);
  hook.clear_failure();
  // A middle range, a division of positions (self-extend): refused.
  REQUIRE_FALSE(hook.seq_rm(0, 10, 20));
  REQUIRE(llama_memory_seq_pos_max(memory, 0) == 300);
  hook.clear_failure();
  REQUIRE_FALSE(hook.seq_div(0, 0, -1, 2));
  REQUIRE(hook.failure()->message.find("seq_div") != std::string::npos);
  REQUIRE(llama_memory_seq_pos_max(memory, 0) == 300);
  hook.clear_failure();

  // A removal behind the hook's back: the next row's position is caught, llama_decode stops.
  REQUIRE(llama_memory_seq_rm(memory, 0, 290, -1));
  REQUIRE(c.decode(t, 290, 291, 290) == 2);
  REQUIRE(hook.failure()->code == ErrorCode::failed_precondition);
  REQUIRE(hook.failure()->message.find("position 290") != std::string::npos);
  hook.clear_failure();
  // The sequence stays refused until it restarts from position 0.
  REQUIRE(hook.seq_rm(0, -1, -1));
  REQUIRE(hook.tokens(0) == 0);
  REQUIRE(c.decode(t, 0, 200, 0) == 0);
  REQUIRE(c.decode(t, 200, 201, 200) == 0);
  REQUIRE_FALSE(hook.failure().has_value());
  REQUIRE(hook.tokens(0) == 201);
}

TEST_CASE("llama.cpp hook: a sequence cut back to its prompt's first tokens decodes as one prefilled with them",
          "[model-file][llama-hook]") {
  const std::vector<llama_token> t = text();
  const auto logits_after = [&](bool cut) {
    Context c(1);
    Hook hook(c.ctx, options_for("dense", 1024));
    if (cut) {
      REQUIRE(c.decode(t, 0, 400, 0) == 0);  // the prompt, then keep its first 320 tokens
      const bool cut_ok = hook.seq_rm(0, 320, -1);
      INFO((hook.failure() ? hook.failure()->message : std::string()));
      REQUIRE(cut_ok);
      REQUIRE(hook.tokens(0) == 320);
    } else {
      REQUIRE(c.decode(t, 0, 320, 0) == 0);
    }
    std::vector<float> out;
    for (llama_pos p = 320; p < 330; ++p) {
      REQUIRE(c.decode(t, std::size_t(p), std::size_t(p) + 1, p) == 0);
      const float* l = llama_get_logits_ith(c.ctx, -1);
      out.insert(out.end(), l, l + 64);
    }
    REQUIRE(hook.decode_rows() == 10 * 30);
    return out;
  };
  const std::vector<float> cut = logits_after(true), whole = logits_after(false);
  for (std::size_t i = 0; i < cut.size(); ++i) REQUIRE(cut[i] == Approx(whole[i]).margin(1e-3));
}

TEST_CASE("llama.cpp hook: a token in several sequences is refused", "[model-file][llama-hook]") {
  const std::vector<llama_token> t = text();
  llama_context_params p = context_params(2, 512);
  p.kv_unified = true;  // llama.cpp's own batches keep a token in several sequences only here
  llama_context* ctx = llama_init_from_model(model().model, p);
  REQUIRE(ctx != nullptr);
  {
    Hook hook(ctx, HookOptions{});
    llama_batch b = llama_batch_init(8, 0, 2);
    for (std::int32_t i = 0; i < 8; ++i) {
      b.token[i] = t[std::size_t(i)];
      b.pos[i] = i;
      b.n_seq_id[i] = 2;
      b.seq_id[i][0] = 0;
      b.seq_id[i][1] = 1;
      b.logits[i] = i == 7;
    }
    b.n_tokens = 8;
    REQUIRE(llama_decode(ctx, b) == 2);
    REQUIRE(hook.failure()->code == ErrorCode::invalid_argument);
    REQUIRE(hook.failure()->message.find("several sequences") != std::string::npos);
    llama_batch_free(b);
  }
  llama_free(ctx);
}

namespace {

// One sequence of llama.cpp's own KV cache, read from llama_state_seq_get_data
// (llama_context::state_seq_get_data and llama_kv_cache::state_write in the
// pinned llama.cpp): a magic number and the sequence id, then per stream a
// cell count, each cell's position and sequences, then every layer's K rows
// and every layer's V rows (flash attention on: V not transposed).
struct CachedSequence {
  std::vector<llama_pos> positions;          // per cell
  std::vector<std::vector<std::byte>> k, v;  // [layer][cell][row bytes]
  std::size_t row_bytes = 0;
};
CachedSequence cached_sequence(llama_context* ctx, llama_seq_id seq) {
  std::vector<std::uint8_t> bytes(llama_state_seq_get_size(ctx, seq));
  REQUIRE(llama_state_seq_get_data(ctx, bytes.data(), bytes.size(), seq) == bytes.size());
  std::size_t at = 0;
  const auto take = [&](void* to, std::size_t n) {
    REQUIRE(at + n <= bytes.size());
    std::memcpy(to, bytes.data() + at, n);
    at += n;
  };
  const auto get = [&]<typename T>(T) {
    T x;
    take(&x, sizeof(T));
    return x;
  };
  CachedSequence c;
  REQUIRE(get(std::uint32_t{}) == 0xaf143cd8u);
  REQUIRE(get(llama_seq_id{}) == seq);
  const auto streams = get(std::uint32_t{});
  for (std::uint32_t s = 0; s < streams; ++s) {
    const auto cells = get(std::uint32_t{});
    if (cells == 0) continue;
    REQUIRE(c.positions.empty());  // one stream holds the sequence
    for (std::uint32_t i = 0; i < cells; ++i) {
      c.positions.push_back(get(llama_pos{}));
      at += get(std::uint32_t{}) * sizeof(llama_seq_id);
    }
    REQUIRE(get(std::uint32_t{}) == 0);  // V not transposed
    const auto layers = get(std::uint32_t{});
    for (auto* rows : {&c.k, &c.v}) {
      for (std::uint32_t l = 0; l < layers; ++l) {
        REQUIRE(get(std::int32_t{}) == GGML_TYPE_F16);
        c.row_bytes = get(std::uint64_t{});
        rows->emplace_back(c.row_bytes * cells);
        take(rows->back().data(), rows->back().size());
      }
    }
  }
  REQUIRE(at == bytes.size());
  return c;
}

// The library's copy of `seq` in the CPU tier against llama.cpp's cache: the
// same positions, and every readable position's K and V rows equal, byte for
// byte (both are llama.cpp's f32 rows rounded to f16 by ggml). Readable are
// all but the tokens decoded into a page not yet full (16-token pages).
// Returns the positions compared.
std::uint32_t check_against_llama(const Hook& hook, llama_context* ctx, llama_seq_id seq) {
  const CachedSequence cache = cached_sequence(ctx, seq);
  const std::uint32_t held = hook.tokens(seq);
  REQUIRE(cache.positions.size() == held);
  const std::uint32_t readable = hook.readable_tokens(seq);
  REQUIRE(readable + 16 > held);  // all but the decode tail's unfilled page
  const SequenceSnapshot lib = hook.save_sequence(seq, readable);
  REQUIRE(lib.layers.size() == cache.k.size());
  REQUIRE(std::size_t{lib.kv_heads} * lib.head_dim * 2 == cache.row_bytes);
  std::vector<bool> seen(held);
  for (std::size_t cell = 0; cell < cache.positions.size(); ++cell) {
    const auto p = std::uint32_t(cache.positions[cell]);
    REQUIRE(p < held);
    REQUIRE_FALSE(seen[p]);
    seen[p] = true;
    if (p >= readable) continue;
    for (std::size_t l = 0; l < lib.layers.size(); ++l) {
      INFO("sequence " << seq << " position " << p << " layer " << l);
      REQUIRE(std::memcmp(lib.k[l].data() + p * cache.row_bytes, cache.k[l].data() + cell * cache.row_bytes,
                          cache.row_bytes) == 0);
      REQUIRE(std::memcmp(lib.v[l].data() + p * cache.row_bytes, cache.v[l].data() + cell * cache.row_bytes,
                          cache.row_bytes) == 0);
    }
  }
  return readable;
}

}  // namespace

TEST_CASE("llama.cpp hook: four sequences finishing and starting lose nothing of llama.cpp's K/V",
          "[model-file][llama-hook][parallel]") {
  // generate at --parallel 4: four slots, ten requests of different prompt and
  // answer lengths. A slot whose request ends is checked, removed through the
  // hook and given the next request, whose prompt goes into the same
  // llama_decode as the other slots' next tokens (a ubatch llama.cpp attends
  // itself: the live sequences grow by extend, the new one is staged).
  const std::vector<llama_token> t = text();
  Context c(4);
  Hook hook(c.ctx, options_for("quest", 128));
  struct Slot {
    int request = -1;
    std::uint32_t prompt = 0, answer = 0, pos = 0;
    llama_token next = 0;
  };
  std::vector<Slot> slots(4);
  int started = 0, finished = 0;
  std::uint32_t compared = 0, checks = 0;
  const llama_vocab* vocab = llama_model_get_vocab(model().model);
  const auto n_vocab = llama_vocab_n_tokens(vocab);
  llama_batch b = llama_batch_init(512, 0, 1);
  while (finished < 10) {
    b.n_tokens = 0;
    std::vector<std::pair<std::size_t, std::int32_t>> outputs;  // slot, batch row
    for (std::size_t s = 0; s < slots.size(); ++s) {
      Slot& slot = slots[s];
      const auto seq = llama_seq_id(s);
      if (slot.request >= 0 && slot.pos == slot.prompt + slot.answer) {
        compared += check_against_llama(hook, c.ctx, seq);
        ++checks;
        REQUIRE(hook.seq_rm(seq, -1, -1));
        REQUIRE(hook.tokens(seq) == 0);
        slot.request = -1;
        ++finished;
      }
      if (slot.request < 0 && started < 10) {
        slot = Slot{started, 60 + 37 * std::uint32_t(started % 5), 8 + 13 * std::uint32_t(started % 4), 0, 0};
        ++started;
        for (std::uint32_t i = 0; i < slot.prompt; ++i) {
          const std::int32_t r = b.n_tokens++;
          b.token[r] = t[std::size_t(slot.request) * 50 + i];
          b.pos[r] = llama_pos(i);
          b.n_seq_id[r] = 1;
          b.seq_id[r][0] = seq;
          b.logits[r] = i + 1 == slot.prompt;
        }
        slot.pos = slot.prompt;
        outputs.emplace_back(s, b.n_tokens - 1);
        continue;
      }
      if (slot.request < 0) continue;
      const std::int32_t r = b.n_tokens++;
      b.token[r] = slot.next;
      b.pos[r] = llama_pos(slot.pos++);
      b.n_seq_id[r] = 1;
      b.seq_id[r][0] = seq;
      b.logits[r] = true;
      outputs.emplace_back(s, r);
    }
    if (b.n_tokens == 0) continue;
    const std::int32_t rc = llama_decode(c.ctx, b);
    INFO((hook.failure() ? hook.failure()->message : std::string()));
    REQUIRE(rc == 0);
    for (const auto& [s, r] : outputs) {  // greedy
      const float* logits = llama_get_logits_ith(c.ctx, r);
      slots[s].next = llama_token(std::max_element(logits, logits + n_vocab) - logits);
    }
  }
  llama_batch_free(b);
  REQUIRE(checks == 10);
  REQUIRE(hook.decode_rows() > 0);
  REQUIRE_FALSE(hook.failure().has_value());
  WARN("10 requests over 4 slots: " << compared << " positions of the CPU tier equal llama.cpp's cache, "
                                    << hook.decode_rows() << " decode rows through the hook");
  REQUIRE(compared >= 10 * 60);
}

TEST_CASE("llama.cpp hook: a saved sequence loads back exactly; a state load behind the hook's back is refused",
          "[model-file][llama-hook][state]") {
  // Through the eval: the prompt prefilled once and loaded into each
  // variant's context decodes bit for bit as one prefilled there.
  EvalSetup s = setup(1);
  s.prefill = 600;
  s.tokens = 12;
  const SavedPrompts saved = prefill_prompts(s);
  REQUIRE(saved.library.size() == 1);
  REQUIRE(saved.library[0].tokens == 600);
  for (const char* policy : {"llama", "dense", "quest"}) {
    CAPTURE(policy);
    Distributions own, loaded;
    eval_variant(s, nullptr, {policy, 256}, nullptr, &own);
    eval_variant(s, &saved, {policy, 256}, nullptr, &loaded);
    REQUIRE(own.log_probs == loaded.log_probs);
  }

  // By hand, and the refusals.
  const std::vector<llama_token> t = text();
  std::vector<std::uint8_t> state;
  SequenceSnapshot snapshot;
  {
    Context c(2);
    Hook hook(c.ctx, HookOptions{});
    REQUIRE(c.decode(t, 0, 300, 0) == 0);
    state.resize(llama_state_seq_get_size(c.ctx, 0));
    REQUIRE(llama_state_seq_get_data(c.ctx, state.data(), state.size(), 0) == state.size());
    REQUIRE_THROWS_MATCHES(hook.save_sequence(1), Error, Catch::Predicate<Error>([](const Error& e) {
                             return e.code() == ErrorCode::not_found;
                           }));
    REQUIRE_THROWS_MATCHES(hook.save_sequence(0, 301), Error, Catch::Predicate<Error>([](const Error& e) {
                             return e.code() == ErrorCode::out_of_range;
                           }));
    snapshot = hook.save_sequence(0);
    REQUIRE(snapshot.tokens == 300);
  }
  Context c(2);
  Hook hook(c.ctx, HookOptions{});
  // llama.cpp's state alone: the hook never saw the sequence, the next decode is refused.
  REQUIRE(llama_state_seq_set_data(c.ctx, state.data(), state.size(), 0) == state.size());
  REQUIRE(c.decode(t, 300, 301, 300) == 2);
  REQUIRE(hook.failure()->code == ErrorCode::failed_precondition);
  REQUIRE(hook.failure()->message.find("never saw the sequence start") != std::string::npos);
  hook.clear_failure();
  // Loads refused, changing nothing: into a sequence llama.cpp does not hold
  // at that length, with another dtype, or with other layers.
  REQUIRE_FALSE(hook.load_sequence(1, snapshot));
  REQUIRE(hook.failure()->code == ErrorCode::failed_precondition);
  hook.clear_failure();
  SequenceSnapshot f32 = snapshot;
  f32.dtype = DType::f32;
  REQUIRE_FALSE(hook.load_sequence(0, f32));
  REQUIRE(hook.failure()->code == ErrorCode::invalid_argument);
  hook.clear_failure();
  SequenceSnapshot fewer = snapshot;
  fewer.layers.pop_back();
  fewer.k.pop_back();
  fewer.v.pop_back();
  REQUIRE_FALSE(hook.load_sequence(0, fewer));
  REQUIRE(hook.failure()->code == ErrorCode::invalid_argument);
  hook.clear_failure();
  REQUIRE(hook.tokens(0) == 0);
  // The load that matches: decoding goes on, the second load of it is refused.
  REQUIRE(hook.load_sequence(0, snapshot));
  REQUIRE(hook.tokens(0) == 300);
  REQUIRE_FALSE(hook.load_sequence(0, snapshot));
  REQUIRE(hook.failure()->message.find("remove it") != std::string::npos);
  hook.clear_failure();
  REQUIRE(c.decode(t, 300, 301, 300) == 0);
  REQUIRE(hook.tokens(0) == 301);
  REQUIRE(check_against_llama(hook, c.ctx, 0) >= 300);
}
