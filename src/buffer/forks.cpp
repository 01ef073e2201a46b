// TieredKVBuffer's forks: a request started from the first tokens of another
// (an engine's prefix cache, llama.cpp's seq_cp). The fork's policy reads
// the rows it indexes back from the source's CPU pages; the full pages that
// its partitions would write identically are shared by reference count
// instead (PagedAttention+FlexAttention, Alg. 1), never written again.
#include <algorithm>
#include <cstring>
#include <vector>

#include "sparsekv/buffer/tiered_kv_buffer.hpp"
#include "sparsekv/core/convert.hpp"
#include "sparsekv/core/error.hpp"

namespace sparsekv {

std::uint32_t TieredKVBuffer::prompt_readable(const RequestState& s, std::uint32_t layer) const {
  std::uint32_t scattered = s.tokens[layer];
  for (std::uint32_t h = 0; h < shape_.kv_heads; ++h) {
    const auto& prompt = s.scattered[std::size_t{layer} * shape_.kv_heads + h].placements;
    scattered = std::min(scattered, static_cast<std::uint32_t>(prompt.size()));
  }
  return std::max(s.ordered_tokens[layer], scattered);
}

std::uint32_t TieredKVBuffer::saved_tokens(RequestId request, std::uint32_t layer) const {
  const RequestState& s = state(request);
  check_index("layer", layer, shape_.layers);
  if (!s.budget.evicts) {
    // The prompt's layout, then the saved decode pages that go on from it.
    const std::uint32_t prompt = prompt_readable(s, layer);
    std::uint32_t tail = s.tokens[layer];
    for (std::uint32_t h = 0; h < shape_.kv_heads; ++h) {
      const RequestState::SavedTail& run = s.saved_tail[std::size_t{layer} * shape_.kv_heads + h];
      tail = std::min(tail, run.first_position == prompt ? run.tokens : 0);
    }
    return prompt + tail;
  }
  std::uint32_t tokens = s.tokens[layer];
  for (std::uint32_t h = 0; h < shape_.kv_heads; ++h) {
    const EvictionHead& e = eviction_head(s, layer, h);
    std::uint32_t live = 0;
    while (live < tokens && e.live.contains(live)) ++live;
    tokens = live;
  }
  return tokens;
}

std::uint32_t TieredKVBuffer::readable_tokens(RequestId request, std::uint32_t layer) const {
  const std::uint32_t saved = saved_tokens(request, layer);
  const RequestState& s = state(request);
  const std::uint32_t tail = s.tail_pages.empty() ? 0 : s.tail_tokens[layer];
  const bool in_place = site_ == AttendSite::cpu_tier && !s.budget.evicts;
  return in_place && tail > 0 && saved + tail == s.tokens[layer] ? s.tokens[layer] : saved;
}

void TieredKVBuffer::read_prefix(RequestId request, std::uint32_t layer, std::uint32_t first, std::uint32_t end,
                                 void* k, void* v, DType as) const {
  const RequestState& s = state(request);
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
  if (as != shape_.dtype && as != layout_.dtype) {
    fail(ErrorCode::invalid_argument, "read_prefix: rows in {}; expected the model's {} or the stored {}",
         to_string(as), to_string(shape_.dtype), to_string(layout_.dtype));
  }
  transfer_->synchronize();  // the last saved page may still be on its way to the CPU tier
  const std::uint32_t pt = config_.page_tokens;
  const std::size_t out_row = dtype_row_bytes(as, shape_.head_dim);
  const std::uint32_t prompt = s.budget.evicts ? saved : prompt_readable(s, layer);
  const bool ordered = s.budget.evicts || prompt <= s.ordered_tokens[layer];
  std::vector<PageId> pages;
  const auto page_slot = [&](std::uint32_t h, PartitionId partition, std::uint32_t slot) {
    pages.clear();
    table_.cpu_pages(request, layer, h, partition, pages);
    return TokenPlacement{pages[0], slot};
  };
  for (std::uint32_t h = 0; h < shape_.kv_heads; ++h) {
    const RequestState::SavedTail& run = s.saved_tail[std::size_t{layer} * shape_.kv_heads + h];
    for (std::uint32_t t = first; t < end; ++t) {
      // In page order, position t is slot t % pt of partition t / pt (one page each); with eviction, where
      // the position map says; in a scattered prompt, where its placement says; past the prompt, in the
      // saved-tail run.
      TokenPlacement at;
      if (t >= saved) {  // the unsaved decode page, a CPU-tier page in place
        at = TokenPlacement{s.tail_pages[std::size_t{layer} * shape_.kv_heads + h], t - saved};
      } else if (t >= prompt) {
        at = page_slot(h, run.first_partition + (t - prompt) / pt, (t - prompt) % pt);
      } else if (ordered) {
        const std::uint32_t flat = s.budget.evicts ? eviction_head(s, layer, h).live.at(t) : t;
        at = page_slot(h, flat / pt, flat % pt);
      } else {
        at = s.scattered[std::size_t{layer} * shape_.kv_heads + h].placements[t];
      }
      const std::byte* from = cpu_pool_.data(at.cpu_page);
      const std::size_t to = (std::size_t{t - first} * shape_.kv_heads + h) * out_row;
      convert_rows(from + layout_.k_offset(at.slot), layout_.dtype, static_cast<std::byte*>(k) + to, as, 1,
                   shape_.head_dim);
      convert_rows(from + layout_.v_offset(at.slot), layout_.dtype, static_cast<std::byte*>(v) + to, as, 1,
                   shape_.head_dim);
    }
  }
}

std::uint32_t TieredKVBuffer::fork_shared_pages(RequestId source, std::uint32_t layer, std::uint32_t tokens,
                                                std::span<const PartitionSpec> specs) const {
  const RequestState& from = state(source);
  const std::uint32_t pt = config_.page_tokens;
  // The full pages both layouts hold alike: page-sized uniform partitions from
  // position 0; from a source that evicts, its leading pages that still hold
  // positions p * pt .. in order, every slot live (the other rows copied).
  bool uniform = true;
  for (const PartitionSpec& spec : specs) uniform = uniform && spec.partition_tokens() == pt;
  std::uint32_t shared = uniform ? tokens / pt : 0;
  if (!from.budget.evicts) shared = std::min(shared, from.ordered_tokens[layer] / pt);  // not a scattered prompt
  for (std::uint32_t h = 0; from.budget.evicts && h < shape_.kv_heads; ++h) {
    const EvictionHead& e = eviction_head(from, layer, h);
    for (std::uint32_t p = 0; p < shared; ++p) {
      for (std::uint32_t i = 0; i < pt; ++i) {
        if (e.slot_position[std::size_t{p} * pt + i] != p * pt + i) shared = p;
      }
    }
  }
  return shared;
}

std::uint64_t TieredKVBuffer::fork_pages(RequestId source, std::uint32_t layer, std::uint32_t tokens,
                                         std::span<const PartitionSpec> specs) const {
  check_index("layer", layer, shape_.layers);
  if (specs.size() != 1 && specs.size() != shape_.kv_heads) {
    fail(ErrorCode::invalid_argument, "{} partition specs given; expected 1 (shared) or {} (one per kv head)",
         specs.size(), shape_.kv_heads);
  }
  const std::uint32_t shared = fork_shared_pages(source, layer, tokens, specs);
  if (shared > 0)
    return std::uint64_t{pages_for_tokens(tokens - shared * config_.page_tokens, config_.page_tokens)} *
           shape_.kv_heads;
  std::uint64_t pages = 0;
  for (std::uint32_t h = 0; h < shape_.kv_heads; ++h) {
    const PartitionSpec& spec = specs[specs.size() == 1 ? 0 : h];
    for (std::uint32_t p = 0; p < spec.partition_count(); ++p)
      pages += pages_for_tokens(spec.size(p), config_.page_tokens);
  }
  return pages;
}

void TieredKVBuffer::offload_shared(RequestId request, RequestId source, std::uint32_t layer, std::uint32_t tokens,
                                    std::span<const PartitionSpec> specs) {
  state(source);
  RequestState& s = state(request);
  check_index("layer", layer, shape_.layers);
  if (request == source) fail(ErrorCode::invalid_argument, "request {} cannot fork itself", request);
  if (tokens == 0) fail(ErrorCode::invalid_argument, "a fork needs at least one token");
  if (s.tokens[layer] != 0) {
    fail(ErrorCode::failed_precondition, "offload_shared: request {} layer {} already holds tokens", request, layer);
  }
  if (const std::uint32_t readable = readable_tokens(source, layer); tokens > readable) {
    fail(ErrorCode::out_of_range, "offload_shared: request {} layer {} has {} tokens in order; cannot share {}", source,
         layer, readable, tokens);
  }
  const std::uint32_t pt = config_.page_tokens;
  const std::size_t row = layout_.row_bytes();
  const std::uint32_t shared = fork_shared_pages(source, layer, tokens, specs);
  const std::uint32_t rest = tokens - shared * pt;
  std::vector<std::byte> k(std::size_t{rest} * shape_.kv_heads * row), v(k.size());
  if (shared == 0) {
    read_prefix(source, layer, 0, tokens, k.data(), v.data(), layout_.dtype);
    offload(request, layer, KvChunk{k.data(), v.data(), tokens, layout_.dtype}, specs);
    return;
  }
  check_offload_specs(request, layer, tokens, specs);
  const std::uint32_t rest_pages = pages_for_tokens(rest, pt);
  SegmentDemand segments;
  for (std::uint32_t h = 0; h < shape_.kv_heads; ++h) {
    segments += table_.append_demand(request, layer, h, shared + rest_pages, shared + rest_pages);
  }
  const std::uint64_t written = std::uint64_t{rest_pages} * shape_.kv_heads;
  if (written > cpu_pool_.available()) {
    fail(ErrorCode::resource_exhausted, "request {} layer {}: offload needs {} CPU pages, {} free", request, layer,
         written, cpu_pool_.available());
  }
  table_.check_segments(segments);

  read_prefix(source, layer, shared * pt, tokens, k.data(), v.data(), layout_.dtype);
  if (s.budget.evicts) {
    share_prefix(request, source, layer, shared);  // with the positions, masks and open page
  } else {
    for (std::uint32_t h = 0; h < shape_.kv_heads; ++h)
      partitions_.map_shared_prefix(request, source, layer, h, shared);
    s.tokens[layer] = s.ordered_tokens[layer] = shared * pt;
  }
  stats_.pages_shared += std::uint64_t{shared} * shape_.kv_heads;
  // The rest as a prefill continuing at position shared * pt.
  if (rest > 0) {
    offload(request, layer, KvChunk{k.data(), v.data(), rest, layout_.dtype},
            std::vector{PartitionSpec::uniform(rest, pt)});
  }
}

}  // namespace sparsekv
