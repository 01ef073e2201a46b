// PrefixForks (prefix_forks.hpp), and the prefix order the parts keep for it
// (prefix_order.hpp).
#include "sparsekv/buffer/prefix_forks.hpp"

#include <algorithm>
#include <cstring>
#include <vector>

#include "sparsekv/core/convert.hpp"
#include "sparsekv/core/error.hpp"
#include "eviction_books.hpp"
#include "prefix_order.hpp"

namespace sparsekv {

std::uint32_t PrefixForks::saved_tokens(RequestId request, std::uint32_t layer) const {
  const BufferRequest& s = requests_.at(request);
  check_index("layer", layer, tiers_.shape.layers);
  if (!s.pages.evicts) {
    // The prompt's layout, then the saved decode pages that go on from it.
    const std::uint32_t prompt = prompt_readable(tiers_, s, layer);
    std::uint32_t tail = s.tokens[layer];
    for (std::uint32_t h = 0; h < tiers_.shape.kv_heads; ++h) {
      const BufferRequest::SavedTail& run = s.saved_tail[std::size_t{layer} * tiers_.shape.kv_heads + h];
      tail = std::min(tail, run.first_position == prompt ? run.tokens : 0);
    }
    return prompt + tail;
  }
  std::uint32_t tokens = s.tokens[layer];
  for (std::uint32_t h = 0; h < tiers_.shape.kv_heads; ++h) {
    const EvictionHead& e = eviction_head(tiers_, s, layer, h);
    std::uint32_t live = 0;
    while (live < tokens && e.live.contains(live)) ++live;
    tokens = live;
  }
  return tokens;
}

std::uint32_t PrefixForks::readable_tokens(RequestId request, std::uint32_t layer) const {
  const std::uint32_t saved = saved_tokens(request, layer);
  const BufferRequest& s = requests_.at(request);
  const std::uint32_t tail = s.tail_pages.empty() ? 0 : s.tail_tokens[layer];
  const bool in_place = tiers_.site == AttendSite::cpu_tier && !s.pages.evicts;
  return in_place && tail > 0 && saved + tail == s.tokens[layer] ? s.tokens[layer] : saved;
}

void PrefixForks::read_prefix(RequestId request, std::uint32_t layer, std::uint32_t first, std::uint32_t end, void* k,
                              void* v, DType as) const {
  const BufferRequest& s = requests_.at(request);
  const std::uint32_t saved = saved_tokens(request, layer);
  const std::uint32_t readable = readable_tokens(request, layer);
  if (first > end || end > readable) {
    fail(ErrorCode::out_of_range,
         "request {} layer {} holds its first {} tokens in order where they can be read (the rest are in the unsaved "
         "decode tail on the GPU tier, regrouped or evicted); cannot read tokens {} .. {}",
         request, layer, readable, first, end);
  }
  if (first < end && (k == nullptr || v == nullptr)) {
    fail(ErrorCode::invalid_argument, "read_prefix: K/V pointers must not be null");
  }
  if (as != tiers_.shape.dtype && as != tiers_.layout.dtype) {
    fail(ErrorCode::invalid_argument, "read_prefix: rows in {}; expected the model's {} or the stored {}",
         to_string(as), to_string(tiers_.shape.dtype), to_string(tiers_.layout.dtype));
  }
  tiers_.transfer.synchronize();  // the last saved page may still be on its way to the CPU tier
  const std::uint32_t pt = tiers_.config.page_tokens;
  const std::size_t out_row = dtype_row_bytes(as, tiers_.shape.head_dim);
  const std::uint32_t prompt = s.pages.evicts ? saved : prompt_readable(tiers_, s, layer);
  const bool ordered = s.pages.evicts || prompt <= s.ordered_tokens[layer];
  std::vector<PageId> pages;
  const auto page_slot = [&](std::uint32_t h, PartitionId partition, std::uint32_t slot) {
    pages.clear();
    tiers_.table.cpu_pages(request, layer, h, partition, pages);
    return TokenPlacement{pages[0], slot};
  };
  for (std::uint32_t h = 0; h < tiers_.shape.kv_heads; ++h) {
    const BufferRequest::SavedTail& run = s.saved_tail[std::size_t{layer} * tiers_.shape.kv_heads + h];
    for (std::uint32_t t = first; t < end; ++t) {
      // In page order, position t is slot t % pt of partition t / pt (one page each); with eviction, where
      // the position map says; in a scattered prompt, where its placement says; past the prompt, in the
      // saved-tail run.
      TokenPlacement at;
      if (t >= saved) {  // the unsaved decode page, a CPU-tier page in place
        at = TokenPlacement{s.tail_pages[std::size_t{layer} * tiers_.shape.kv_heads + h], t - saved};
      } else if (t >= prompt) {
        at = page_slot(h, run.first_partition + (t - prompt) / pt, (t - prompt) % pt);
      } else if (ordered) {
        const std::uint32_t flat = s.pages.evicts ? eviction_head(tiers_, s, layer, h).live.at(t) : t;
        at = page_slot(h, flat / pt, flat % pt);
      } else {
        at = s.scattered[std::size_t{layer} * tiers_.shape.kv_heads + h].placements[t];
      }
      const std::byte* from = tiers_.cpu_pool.data(at.cpu_page);
      const std::size_t to = (std::size_t{t - first} * tiers_.shape.kv_heads + h) * out_row;
      convert_rows(from + tiers_.layout.k_offset(at.slot), tiers_.layout.dtype, static_cast<std::byte*>(k) + to, as, 1,
                   tiers_.shape.head_dim);
      convert_rows(from + tiers_.layout.v_offset(at.slot), tiers_.layout.dtype, static_cast<std::byte*>(v) + to, as, 1,
                   tiers_.shape.head_dim);
    }
  }
}

std::uint32_t PrefixForks::shared_pages(RequestId source, std::uint32_t layer, std::uint32_t tokens,
                                        std::span<const PartitionSpec> specs) const {
  const BufferRequest& from = requests_.at(source);
  const std::uint32_t pt = tiers_.config.page_tokens;
  // The full pages both layouts hold alike: page-sized uniform partitions from
  // position 0; from a source that evicts, its leading pages that still hold
  // positions p * pt .. in order, every slot live (the other rows copied).
  bool uniform = true;
  for (const PartitionSpec& spec : specs) uniform = uniform && spec.partition_tokens() == pt;
  std::uint32_t shared = uniform ? tokens / pt : 0;
  if (!from.pages.evicts) shared = std::min(shared, from.ordered_tokens[layer] / pt);  // not a scattered prompt
  for (std::uint32_t h = 0; from.pages.evicts && h < tiers_.shape.kv_heads; ++h) {
    const EvictionHead& e = eviction_head(tiers_, from, layer, h);
    for (std::uint32_t p = 0; p < shared; ++p) {
      for (std::uint32_t i = 0; i < pt; ++i) {
        if (e.slot_position[std::size_t{p} * pt + i] != p * pt + i) shared = p;
      }
    }
  }
  return shared;
}

std::uint64_t PrefixForks::fork_pages(RequestId source, std::uint32_t layer, std::uint32_t tokens,
                                      std::span<const PartitionSpec> specs) const {
  check_index("layer", layer, tiers_.shape.layers);
  if (specs.size() != 1 && specs.size() != tiers_.shape.kv_heads) {
    fail(ErrorCode::invalid_argument, "{} partition specs given; expected 1 (shared) or {} (one per kv head)",
         specs.size(), tiers_.shape.kv_heads);
  }
  const std::uint32_t shared = shared_pages(source, layer, tokens, specs);
  if (shared > 0)
    return std::uint64_t{pages_for_tokens(tokens - shared * tiers_.config.page_tokens, tiers_.config.page_tokens)} *
           tiers_.shape.kv_heads;
  std::uint64_t pages = 0;
  for (std::uint32_t h = 0; h < tiers_.shape.kv_heads; ++h) {
    const PartitionSpec& spec = specs[specs.size() == 1 ? 0 : h];
    for (std::uint32_t p = 0; p < spec.partition_count(); ++p)
      pages += pages_for_tokens(spec.size(p), tiers_.config.page_tokens);
  }
  return pages;
}

void PrefixForks::offload_shared(RequestId request, RequestId source, std::uint32_t layer, std::uint32_t tokens,
                                 std::span<const PartitionSpec> specs) {
  requests_.at(source);
  BufferRequest& s = requests_.at(request);
  check_index("layer", layer, tiers_.shape.layers);
  if (request == source) fail(ErrorCode::invalid_argument, "request {} cannot fork itself", request);
  if (tokens == 0) fail(ErrorCode::invalid_argument, "a fork needs at least one token");
  if (s.tokens[layer] != 0) {
    fail(ErrorCode::failed_precondition, "offload_shared: request {} layer {} already holds tokens", request, layer);
  }
  if (const std::uint32_t readable = readable_tokens(source, layer); tokens > readable) {
    fail(ErrorCode::out_of_range, "offload_shared: request {} layer {} has {} tokens in order; cannot share {}", source,
         layer, readable, tokens);
  }
  const std::uint32_t pt = tiers_.config.page_tokens;
  const std::size_t row = tiers_.layout.row_bytes();
  const std::uint32_t shared = shared_pages(source, layer, tokens, specs);
  const std::uint32_t rest = tokens - shared * pt;
  std::vector<std::byte> k(std::size_t{rest} * tiers_.shape.kv_heads * row), v(k.size());
  if (shared == 0) {
    read_prefix(source, layer, 0, tokens, k.data(), v.data(), tiers_.layout.dtype);
    offloader_.offload(request, layer, KvChunk{k.data(), v.data(), tokens, tiers_.layout.dtype}, specs);
    return;
  }
  offloader_.check_specs(request, layer, tokens, specs);
  const std::uint32_t rest_pages = pages_for_tokens(rest, pt);
  SegmentDemand segments;
  for (std::uint32_t h = 0; h < tiers_.shape.kv_heads; ++h) {
    segments += tiers_.table.append_demand(request, layer, h, shared + rest_pages, shared + rest_pages);
  }
  const std::uint64_t written = std::uint64_t{rest_pages} * tiers_.shape.kv_heads;
  if (written > tiers_.cpu_pool.available()) {
    fail(ErrorCode::resource_exhausted, "request {} layer {}: offload needs {} CPU pages, {} free", request, layer,
         written, tiers_.cpu_pool.available());
  }
  tiers_.table.check_segments(segments);

  read_prefix(source, layer, shared * pt, tokens, k.data(), v.data(), tiers_.layout.dtype);
  if (s.pages.evicts) {
    evictor_.share_prefix(request, source, layer, shared);  // with the positions, masks and open page
  } else {
    for (std::uint32_t h = 0; h < tiers_.shape.kv_heads; ++h)
      tiers_.partitions.map_shared_prefix(request, source, layer, h, shared);
    s.tokens[layer] = s.ordered_tokens[layer] = shared * pt;
  }
  tiers_.stats.pages_shared += std::uint64_t{shared} * tiers_.shape.kv_heads;
  // The rest as a prefill continuing at position shared * pt.
  if (rest > 0) {
    offloader_.offload(request, layer, KvChunk{k.data(), v.data(), rest, tiers_.layout.dtype},
                       std::vector{PartitionSpec::uniform(rest, pt)});
  }
}

std::uint32_t prompt_readable(const BufferTiers& tiers, const BufferRequest& s, std::uint32_t layer) {
  std::uint32_t scattered = s.tokens[layer];
  for (std::uint32_t h = 0; h < tiers.shape.kv_heads; ++h) {
    const auto& prompt = s.scattered[std::size_t{layer} * tiers.shape.kv_heads + h].placements;
    scattered = std::min(scattered, static_cast<std::uint32_t>(prompt.size()));
  }
  return std::max(s.ordered_tokens[layer], scattered);
}

bool record_prompt_order(const BufferTiers& tiers, BufferRequest& s, std::uint32_t layer,
                         std::span<const PartitionSpec> specs, std::uint32_t tokens) {
  if (s.ordered_tokens[layer] != s.tokens[layer] || s.tokens[layer] % tiers.config.page_tokens != 0) return false;
  for (const PartitionSpec& spec : specs) {
    if (spec.partition_tokens() != tiers.config.page_tokens) return false;
  }
  s.ordered_tokens[layer] += tokens;
  return true;
}

void record_save_order(const BufferTiers& tiers, BufferRequest& s, std::uint32_t layer,
                       std::span<const PartitionId> saved) {
  const std::uint32_t pt = tiers.config.page_tokens;
  const std::uint32_t first = s.tokens[layer] - pt;
  if (s.ordered_tokens[layer] == first && first % pt == 0) {
    s.ordered_tokens[layer] = s.tokens[layer];
    return;
  }
  BufferRequest::SavedTail* run = &s.saved_tail[std::size_t{layer} * tiers.shape.kv_heads];
  bool extends = true;
  for (std::uint32_t h = 0; h < tiers.shape.kv_heads; ++h) {
    extends = extends && run[h].tokens != 0 && run[h].first_position + run[h].tokens == first &&
              run[h].first_partition + run[h].tokens / pt == saved[h];
  }
  const bool starts = !extends && prompt_readable(tiers, s, layer) == first;
  for (std::uint32_t h = 0; h < tiers.shape.kv_heads; ++h) {
    if (extends) run[h].tokens += pt;
    if (starts) run[h] = {first, saved[h], pt};
  }
}

void cut_prefix_order(const BufferTiers& tiers, BufferRequest& s, std::uint32_t layer, std::uint32_t head,
                      PartitionId first) {
  const std::uint32_t pt = tiers.config.page_tokens;
  s.ordered_tokens[layer] = std::min(s.ordered_tokens[layer], first * pt);
  BufferRequest::ScatteredPrompt& prompt = s.scattered[std::size_t{layer} * tiers.shape.kv_heads + head];
  if (first < prompt.end) prompt = {};
  BufferRequest::SavedTail& run = s.saved_tail[std::size_t{layer} * tiers.shape.kv_heads + head];
  run.tokens = first <= run.first_partition ? 0 : std::min(run.tokens, (first - run.first_partition) * pt);
}

}  // namespace sparsekv
