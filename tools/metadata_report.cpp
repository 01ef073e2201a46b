// sparsekv-metadata-report: metadata bytes of the flat worst-case layout, the
// two-level layout (Spin §5.4) and its GPU share after the tier split (Spin
// §5.2), for the models of Spin §6.4 at 128K context and batch 32. With
// --slot-masks, also the slot mask table of requests that evict tokens
// (SpvLLM §2, block masks): a SlotMask per CPU page, in the CPU tier.
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "command_line.hpp"
#include "sparsekv/core/config.hpp"
#include "sparsekv/core/error.hpp"
#include "sparsekv/metadata/metadata_footprint.hpp"

namespace {

struct Model {
  const char* name;
  sparsekv::ModelShape shape;
};

// Layer / head counts from the models' published configs.
const std::vector<Model> kModels = {
    {"Qwen3-14B", {40, 40, 8, 128, sparsekv::DType::bf16}},
    {"Qwen3-32B", {64, 64, 8, 128, sparsekv::DType::bf16}},
    {"Llama-3.1-70B", {80, 64, 8, 128, sparsekv::DType::bf16}},
};

double gib(std::size_t bytes) { return double(bytes) / double(1ull << 30); }

void usage() {
  std::fputs(
      "usage: sparsekv-metadata-report [--json] [--context TOKENS] [--used-context TOKENS] [--batch N]\n"
      "                                [--page-tokens N] [--gpu-fraction F] [--segment-entries N] [--slot-masks]\n"
      "  --context        per-request capacity the flat layout is sized for (default 131072)\n"
      "  --used-context   tokens each live request holds in the working set (default: --context)\n"
      "  --batch          requests (default 32); --page-tokens (default 8)\n"
      "  --gpu-fraction   GPU buffer per head as a fraction of its pages (default 0.1)\n"
      "  --segment-entries entries per second-level metadata segment (default 256)\n"
      "  --slot-masks     add the slot mask table (8 B per CPU page; pages of at most 64 tokens)\n",
      stderr);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const sparsekv::tools::CommandLine args(
        argc, argv, {"--context", "--used-context", "--batch", "--page-tokens", "--gpu-fraction", "--segment-entries"},
        {"--json", "--help", "--slot-masks"});
    if (args.has("--help")) {
      usage();
      return 0;
    }
    sparsekv::Config config;
    config.max_context_tokens = args.number<std::uint32_t>("--context", 128 * 1024);
    config.max_requests = args.number<std::uint32_t>("--batch", 32);
    config.page_tokens = args.number<std::uint32_t>("--page-tokens", 8);
    config.metadata_segment_entries = args.number<std::uint32_t>("--segment-entries", 256);
    sparsekv::MetadataWorkingSet ws;
    ws.requests = config.max_requests;
    ws.context_tokens = args.number<std::uint32_t>("--used-context", config.max_context_tokens);
    ws.partition_tokens = config.page_tokens;  // uniform partitions, one page each
    ws.gpu_fraction = args.number<double>("--gpu-fraction", 0.1);
    const bool json = args.has("--json");
    const bool masks = args.has("--slot-masks");
    sparsekv::HeadCapacity capacity = config.head_capacity();
    capacity.slot_masks = masks;

    std::string out = json ? "[\n" : "";
    if (!json) {
      out += fmt::format(
          "Metadata of the four Spin §5.2 tables{}: batch {}, context {} (live {}), page {} tokens, GPU buffer "
          "{:.0f}% of pages, {}-entry segments.\nflat: worst case, one-page partitions; flat/tok: worst case, "
          "one-token partitions (Spin §4.1); x: flat / two-level, x GPU: flat / two-level GPU share after the tier "
          "split\n",
          masks ? " and the slot mask table (SpvLLM §2)" : "", ws.requests, config.max_context_tokens,
          ws.context_tokens, config.page_tokens, 100 * ws.gpu_fraction, config.metadata_segment_entries);
      if (masks) {
        out += fmt::format(
            "masks: the two-level slot mask table, in the CPU tier and counted in 2-lvl (the flat layouts count "
            "{0} B more per page entry); a mask is {0} B per CPU page, mask/page: that share of one page's K and "
            "V bytes\n",
            sizeof(sparsekv::SlotMask));
      }
      out += "\n";
      out += fmt::format("{:<14} {:>9} {:>12} {:>10} {:>9} {:>10} {:>10} {:>10} {:>8}", "model", "flat GiB",
                         "flat/tok GiB", "2-lvl GiB", "GPU GiB", "x 2-lvl", "x GPU", "x GPU/tok", "KV TiB");
      out += masks ? fmt::format(" {:>10} {:>10}\n", "masks GiB", "mask/page") : "\n";
    }
    for (std::size_t i = 0; i < kModels.size(); ++i) {
      const Model& m = kModels[i];
      const auto geometry = sparsekv::PageTableGeometry::for_config(config, m.shape, capacity);
      const auto f = sparsekv::estimate_metadata_footprint(geometry, config.max_context_tokens, ws);
      const double kv_bytes = double(m.shape.token_bytes()) * ws.context_tokens * ws.requests;
      const std::size_t page_bytes = config.page_bytes(m.shape);
      if (json) {
        const std::string mask_fields =
            masks ? fmt::format(", \"slot_mask_bytes\": {}, \"slot_mask_bytes_per_page\": {}, \"page_bytes\": {}",
                                f.slot_mask_bytes, sizeof(sparsekv::SlotMask), page_bytes)
                  : "";
        out += fmt::format(
            "  {{\"model\": \"{}\", \"flat_bytes\": {}, \"two_level_bytes\": {}, \"two_level_gpu_bytes\": {}, "
            "\"two_level_reduction\": {:.3f}, \"gpu_reduction\": {:.3f}, \"flat_token_granular_bytes\": {}, "
            "\"kv_bytes\": {:.0f}{}}}{}\n",
            m.name, f.flat_bytes, f.two_level_bytes, f.two_level_gpu_bytes, f.two_level_reduction(), f.gpu_reduction(),
            f.flat_token_granular_bytes, kv_bytes, mask_fields, i + 1 < kModels.size() ? "," : "");
      } else {
        out += fmt::format("{:<14} {:>9.2f} {:>12.2f} {:>10.2f} {:>9.2f} {:>10.2f} {:>10.2f} {:>10.1f} {:>8.2f}",
                           m.name, gib(f.flat_bytes), gib(f.flat_token_granular_bytes), gib(f.two_level_bytes),
                           gib(f.two_level_gpu_bytes), f.two_level_reduction(), f.gpu_reduction(),
                           double(f.flat_token_granular_bytes) / double(f.two_level_gpu_bytes),
                           kv_bytes / double(1ull << 40));
        out += masks ? fmt::format(" {:>10.3f} {:>9.2f}%\n", gib(f.slot_mask_bytes),
                                   100.0 * double(sizeof(sparsekv::SlotMask)) / double(page_bytes))
                     : "\n";
      }
    }
    out += json ? "]\n" : "";
    std::fputs(out.c_str(), stdout);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "sparsekv-metadata-report: %s\n", e.what());
    usage();
    return 2;
  }
}
