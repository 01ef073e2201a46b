// TokenEvictor (token_evictor.hpp; the rules in docs/buffer.md, "Token
// eviction"), and the eviction books the offload reaches (eviction_books.hpp).
#include "sparsekv/buffer/token_evictor.hpp"

#include <algorithm>
#include <bit>
#include <cstring>
#include <map>
#include <set>

#include "sparsekv/core/error.hpp"
#include "eviction_books.hpp"
#include "tier_access.hpp"

namespace sparsekv {

const BufferRequest& TokenEvictor::evicting(RequestId request, std::uint32_t layer) const {
  const BufferRequest& s = requests_.at(request);
  check_index("layer", layer, tiers_.shape.layers);
  if (!s.pages.evicts) {
    fail(ErrorCode::failed_precondition, "request {} does not evict tokens (RequestPages::evicts is false)", request);
  }
  return s;
}

bool TokenEvictor::shared(RequestId request, std::uint32_t layer, std::uint32_t head, PartitionId partition) const {
  const std::uint32_t index = tiers_.table.first_page_index(request, layer, head, partition);
  const PageId page = *tiers_.table.cpu_page_view().find(tiers_.table.instance(request, layer, head), index);
  return page != kInvalidPage && tiers_.cpu_pool.ref_count(page) > 1;
}

std::vector<TokenEvictor::HeadEviction> TokenEvictor::plan_evict(
    RequestId request, std::uint32_t layer, std::span<const std::vector<std::uint32_t>> positions) const {
  const BufferRequest& s = evicting(request, layer);
  if (positions.size() != tiers_.shape.kv_heads) {
    fail(ErrorCode::invalid_argument, "evict: {} position lists given for {} kv heads", positions.size(),
         tiers_.shape.kv_heads);
  }
  const std::uint32_t pt = tiers_.config.page_tokens;
  const EvictionStrategy strategy = tiers_.config.eviction_strategy;
  std::vector<HeadEviction> plans(tiers_.shape.kv_heads);
  for (std::uint32_t h = 0; h < tiers_.shape.kv_heads; ++h) {
    const EvictionHead& e = eviction_head(tiers_, s, layer, h);
    std::map<PartitionId, SlotMask> dying;  // partition -> its slots that die
    for (const std::uint32_t position : positions[h]) {
      const auto it = e.live.find(position);
      if (it == e.live.end()) {
        fail(ErrorCode::invalid_argument, "evict: request {} layer {} kv head {}: position {} is not live ({})",
             request, layer, h, position,
             position >= s.tokens[layer] ? fmt::format("the sequence has {} positions", s.tokens[layer])
                                         : std::string("evicted already"));
      }
      SlotMask& slots = dying[it->second / pt];
      const SlotMask bit = SlotMask{1} << (it->second % pt);
      if ((slots & bit) != 0) {
        fail(ErrorCode::invalid_argument, "evict: request {} layer {} kv head {}: position {} is listed twice", request,
             layer, h, position);
      }
      slots |= bit;
    }
    HeadEviction& plan = plans[h];
    std::map<PartitionId, SlotMask> after;
    for (const auto& [partition, slots] : dying) {
      // Copy-on-evict: a fork's shared page is copied for this request, which then masks its copy.
      if (shared(request, layer, h, partition)) plan.copied.push_back(partition);
      const SlotMask mask =
          tiers_.table.slot_mask(request, layer, h, tiers_.table.first_page_index(request, layer, h, partition));
      plan.cleared.emplace_back(partition, slots);
      after[partition] = mask & ~slots;
      const bool frees = strategy == EvictionStrategy::free_block || strategy == EvictionStrategy::slot_reuse;
      if (frees && after[partition] == 0) plan.released.push_back(partition);
    }
    if (strategy != EvictionStrategy::sparse_copy || dying.empty()) continue;
    // The run starts at the first page with a dead slot once evicted, among the
    // trailing pages no other request shares once the copies are made (a shared prefix leads).
    const std::uint32_t count = tiers_.table.partition_count(request, layer, h);
    PartitionId unshared = count;
    while (unshared > 0 && (!shared(request, layer, h, unshared - 1) || dying.contains(unshared - 1))) --unshared;
    for (PartitionId p = unshared; p < count; ++p) {
      const std::uint32_t tokens = tiers_.table.meta(request, layer, h, p).token_count();
      const SlotMask mask =
          after.contains(p)
              ? after[p]
              : tiers_.table.slot_mask(request, layer, h, tiers_.table.first_page_index(request, layer, h, p));
      const bool freed = tiers_.table.partition_freed(request, layer, h, p);
      if (!plan.run && (freed || dead_slots(mask, tokens) > 0)) plan.run = p;
      if (!plan.run) continue;
      plan.run_live += static_cast<std::uint32_t>(std::popcount(mask));
      plan.run_pages += freed ? 0 : 1;
    }
  }
  // A compaction frees its run before it takes pages, so only segments can run short.
  SegmentDemand segments;
  for (std::uint32_t h = 0; h < tiers_.shape.kv_heads; ++h) {
    if (!plans[h].run) continue;
    const std::uint32_t pages = pages_for_tokens(plans[h].run_live, pt);
    segments += tiers_.table.replace_demand(request, layer, h, *plans[h].run, pages, pages);
  }
  tiers_.table.check_segments(segments);
  return plans;
}

void TokenEvictor::check_evict(RequestId request, std::uint32_t layer,
                               std::span<const std::vector<std::uint32_t>> positions) const {
  plan_evict(request, layer, positions);
}

std::optional<std::uint32_t> TokenEvictor::place_target(RequestId request, std::uint32_t layer,
                                                        std::uint32_t head) const {
  const EvictionHead& e = eviction_head(tiers_, requests_.at(request), layer, head);
  const std::uint32_t pt = tiers_.config.page_tokens;
  if (tiers_.config.eviction_strategy == EvictionStrategy::slot_reuse) {
    // The fullest page with a dead slot: fewest dead, then lowest partition id.
    for (const auto& [dead, partition] : e.reusable) {
      if (shared(request, layer, head, partition)) continue;
      const SlotMask mask =
          tiers_.table.slot_mask(request, layer, head, tiers_.table.first_page_index(request, layer, head, partition));
      const std::uint32_t tokens = tiers_.table.meta(request, layer, head, partition).token_count();
      return partition * pt + static_cast<std::uint32_t>(std::countr_zero(~mask & full_slot_mask(tokens)));
    }
  }
  if (e.open == kInvalidPartition) return std::nullopt;
  const std::uint32_t tokens = tiers_.table.meta(request, layer, head, e.open).token_count();
  if (tokens < pt && !tiers_.table.partition_freed(request, layer, head, e.open) &&
      !shared(request, layer, head, e.open)) {
    return e.open * pt + tokens;
  }
  return std::nullopt;
}

EvictionDemand TokenEvictor::append_demand_evicting(RequestId request, std::uint32_t layer,
                                                    std::span<const std::vector<std::uint32_t>> positions) const {
  const std::vector<HeadEviction> plans = plan_evict(request, layer, positions);
  const std::uint32_t pt = tiers_.config.page_tokens;
  EvictionDemand d;
  d.live_partitions.resize(tiers_.shape.kv_heads);
  for (std::uint32_t h = 0; h < tiers_.shape.kv_heads; ++h) {
    const HeadEviction& plan = plans[h];
    const EvictionHead& e = eviction_head(tiers_, requests_.at(request), layer, h);
    const std::uint32_t count = tiers_.table.partition_count(request, layer, h);
    std::map<PartitionId, SlotMask> cleared(plan.cleared.begin(), plan.cleared.end());
    const auto released = [&](PartitionId p) {
      return std::binary_search(plan.released.begin(), plan.released.end(), p) || (plan.run && p >= *plan.run);
    };
    const auto live_after = [&](PartitionId p) -> SlotMask {
      if (tiers_.table.partition_freed(request, layer, h, p) || released(p)) return 0;
      const SlotMask mask =
          tiers_.table.slot_mask(request, layer, h, tiers_.table.first_page_index(request, layer, h, p));
      const auto it = cleared.find(p);
      return it == cleared.end() ? mask : mask & ~it->second;
    };
    d.copied_pages += plan.copied.size();
    d.freed_pages += plan.released.size();
    const std::uint32_t run_new = plan.run ? pages_for_tokens(plan.run_live, pt) : 0;
    if (plan.run) d.freed_pages += plan.run_pages - run_new;
    // Where the token goes once the eviction is applied (place_target's rule).
    bool new_page = true;
    bool target_was_dead = false;
    if (tiers_.config.eviction_strategy == EvictionStrategy::slot_reuse) {
      std::optional<std::pair<std::uint32_t, PartitionId>> fullest;
      const auto consider = [&](PartitionId p) {
        const std::pair candidate{dead_slots(live_after(p), tiers_.table.meta(request, layer, h, p).token_count()), p};
        if (!fullest || candidate < *fullest) fullest = candidate;
      };
      for (const auto& [dead, p] : e.reusable) {
        if (!released(p) && !cleared.contains(p) && !shared(request, layer, h, p)) consider(p);
      }
      for (const auto& [p, slots] : plan.cleared) {
        if (!released(p)) consider(p);
      }
      if (fullest) {
        new_page = false;
        target_was_dead = live_after(fullest->second) == 0;
      }
    }
    if (new_page && plan.run && plan.run_live % pt != 0) {
      new_page = false;  // the compaction's last page is open
    } else if (new_page) {
      // The open page once evicted; a compaction that keeps no row leaves the page before its run open.
      PartitionId open = e.open;
      if (plan.run && plan.run_live == 0) open = *plan.run > 0 ? *plan.run - 1 : kInvalidPartition;
      if (open != kInvalidPartition && tiers_.table.meta(request, layer, h, open).token_count() < pt &&
          !tiers_.table.partition_freed(request, layer, h, open) && !released(open) &&
          !shared(request, layer, h, open)) {
        new_page = false;
        target_was_dead = live_after(open) == 0;
      }
    }
    d.placed_pages += new_page ? 1 : 0;
    // A new page takes a tombstone's id when the head has one (this step's included), else a new partition.
    const bool appends = new_page && e.freed.empty() && plan.released.empty();
    const PartitionId keep = plan.run ? *plan.run : count;
    d.segments +=
        tiers_.table.replace_demand(request, layer, h, keep, run_new + (appends ? 1 : 0), run_new + (appends ? 1 : 0));
    std::uint32_t live = run_new + (new_page || target_was_dead ? 1 : 0);
    for (PartitionId p = 0; p < keep; ++p) live += live_after(p) != 0 ? 1 : 0;
    d.live_partitions[h] = live;
  }
  return d;
}

void TokenEvictor::compact(RequestId request, BufferRequest& s, std::uint32_t layer, std::uint32_t head,
                           PartitionId first) {
  // Sparse copy (SpvLLM §1, strawman 2): the run's live rows, in (partition, slot)
  // order, into fresh full pages; the run's pages go back first.
  EvictionHead& e = eviction_head(tiers_, s, layer, head);
  const std::uint32_t pt = tiers_.config.page_tokens;
  const std::size_t row = tiers_.layout.row_bytes();
  std::vector<std::byte> rows;
  collect_run(tiers_, request, layer, head, first, true, rows);
  std::vector<std::uint32_t> positions;
  std::uint32_t run_pages = 0;
  for (PartitionId p = first; p < tiers_.table.partition_count(request, layer, head); ++p) {
    run_pages += tiers_.table.partition_freed(request, layer, head, p) ? 0 : 1;
  }
  for (std::size_t flat = std::size_t{first} * pt; flat < e.slot_position.size(); ++flat) {
    if (e.slot_position[flat] != kNoPosition) positions.push_back(e.slot_position[flat]);
  }
  tiers_.partitions.truncate(request, layer, head, first);
  s.windows[std::size_t{layer} * tiers_.shape.kv_heads + head].forget_from(first);
  e.slot_position.resize(std::size_t{first} * pt);
  std::erase_if(e.reusable, [first](const auto& entry) { return entry.second >= first; });
  e.held_pages -= run_pages;
  e.open = first > 0 ? first - 1 : kInvalidPartition;
  if (positions.empty()) return;
  const auto count = static_cast<std::uint32_t>(positions.size());
  const MappedPartitions mapped = tiers_.partitions.map(request, layer, head, PartitionSpec::uniform(count, pt));
  e.slot_position.resize((std::size_t{first} + pages_for_tokens(count, pt)) * pt, kNoPosition);
  for (std::uint32_t t = 0; t < count; ++t) {
    std::byte* page = tiers_.cpu_pool.data(mapped.placements[t].cpu_page);
    std::memcpy(page + tiers_.layout.k_offset(mapped.placements[t].slot), rows.data() + 2 * t * row, row);
    std::memcpy(page + tiers_.layout.v_offset(mapped.placements[t].slot), rows.data() + (2 * t + 1) * row, row);
    const std::uint32_t flat = first * pt + t;
    e.slot_position[flat] = positions[t];
    e.live[positions[t]] = flat;
  }
  e.held_pages += pages_for_tokens(count, pt);
  e.open = tiers_.table.partition_count(request, layer, head) - 1;
  tiers_.stats.pages_copied += pages_for_tokens(count, pt);
  tiers_.stats.slots_copied += count;
}

void TokenEvictor::evict(RequestId request, std::uint32_t layer,
                         std::span<const std::vector<std::uint32_t>> positions) {
  const std::vector<HeadEviction> plans = plan_evict(request, layer, positions);  // every check
  const bool copies = std::any_of(plans.begin(), plans.end(),
                                  [](const HeadEviction& p) { return p.run.has_value() || !p.copied.empty(); });
  std::uint64_t copied = 0;
  for (const HeadEviction& plan : plans) copied += plan.copied.size();
  if (copied > tiers_.cpu_pool.available()) {
    fail(ErrorCode::resource_exhausted,
         "request {} layer {}: copying the shared pages it evicts from needs {} CPU "
         "pages, {} free",
         request, layer, copied, tiers_.cpu_pool.available());
  }
  BufferRequest& s = requests_.at(request);
  const std::uint32_t pt = tiers_.config.page_tokens;
  if (copies) tiers_.transfer.synchronize();  // the rows may still be in flight to their CPU pages
  for (std::uint32_t h = 0; h < tiers_.shape.kv_heads; ++h) {
    for (const PartitionId partition : plans[h].copied) tiers_.partitions.unshare_page(request, layer, h, partition);
    tiers_.stats.pages_unshared += plans[h].copied.size();
  }
  for (std::uint32_t h = 0; h < tiers_.shape.kv_heads; ++h) {
    EvictionHead& e = eviction_head(tiers_, s, layer, h);
    for (const auto& [partition, slots] : plans[h].cleared) {
      const std::uint32_t tokens = tiers_.table.meta(request, layer, h, partition).token_count();
      const SlotMask before =
          tiers_.table.slot_mask(request, layer, h, tiers_.table.first_page_index(request, layer, h, partition));
      const SlotMask left = tiers_.partitions.evict_slots(request, layer, h, partition, slots);
      for (SlotMask bits = slots; bits != 0; bits &= bits - 1) {
        const std::uint32_t flat = partition * pt + static_cast<std::uint32_t>(std::countr_zero(bits));
        e.live.erase(e.slot_position[flat]);
        e.slot_position[flat] = kNoPosition;
      }
      e.reusable.erase({dead_slots(before, tokens), partition});
      const auto& released = plans[h].released;
      if (!std::binary_search(released.begin(), released.end(), partition)) {
        e.reusable.emplace(dead_slots(left, tokens), partition);
      }
    }
    for (const PartitionId partition : plans[h].released) {
      if (tiers_.table.meta(request, layer, h, partition).resident()) uncache(tiers_, request, layer, h, partition);
      if (tiers_.partitions.release_page(request, layer, h, partition)) ++tiers_.stats.pages_freed;
      --e.held_pages;
      e.freed.insert(partition);
    }
    if (plans[h].run) compact(request, s, layer, h, *plans[h].run);
  }
}

void TokenEvictor::place_token(RequestId request, std::uint32_t layer, const KvChunk& token) {
  evicting(request, layer);
  check_chunk(tiers_, token, layer);
  if (token.tokens != 1) fail(ErrorCode::invalid_argument, "place_token takes one token, got {}", token.tokens);
  std::vector<std::optional<std::uint32_t>> targets(tiers_.shape.kv_heads);
  std::uint64_t new_pages = 0;
  SegmentDemand segments;
  for (std::uint32_t h = 0; h < tiers_.shape.kv_heads; ++h) {
    targets[h] = place_target(request, layer, h);
    if (targets[h]) continue;
    ++new_pages;
    if (eviction_head(tiers_, requests_.at(request), layer, h).freed.empty())
      segments += tiers_.table.append_demand(request, layer, h, 1, 1);
  }
  if (new_pages > tiers_.cpu_pool.available()) {
    fail(ErrorCode::resource_exhausted, "request {} layer {}: placing a token needs {} CPU pages, {} free", request,
         layer, new_pages, tiers_.cpu_pool.available());
  }
  tiers_.table.check_segments(segments);

  BufferRequest& s = requests_.at(request);
  const std::uint32_t pt = tiers_.config.page_tokens;
  const std::uint32_t position = s.tokens[layer];
  const std::size_t row = tiers_.layout.row_bytes();
  const auto [token_k, token_v] = stored_token(tiers_, token, token_rows_);
  moves_.clear();
  for (std::uint32_t h = 0; h < tiers_.shape.kv_heads; ++h) {
    EvictionHead& e = eviction_head(tiers_, s, layer, h);
    PartitionId partition;
    std::uint32_t slot;
    if (targets[h]) {
      partition = *targets[h] / pt;
      slot = *targets[h] % pt;
      const std::uint32_t tokens = tiers_.table.meta(request, layer, h, partition).token_count();
      const std::uint32_t index = tiers_.table.first_page_index(request, layer, h, partition);
      const SlotMask before = tiers_.table.slot_mask(request, layer, h, index);
      e.reusable.erase({dead_slots(before, tokens), partition});
      // The open page's next slot, or a dead one below the count.
      if (slot == tokens) tiers_.table.set_token_count(request, layer, h, partition, tokens + 1);
      const SlotMask after = before | (SlotMask{1} << slot);
      tiers_.table.set_slot_mask(request, layer, h, index, after);
      const std::uint32_t dead = dead_slots(after, std::max(tokens, slot + 1));
      if (dead > 0) e.reusable.emplace(dead, partition);
    } else if (!e.freed.empty()) {  // the lowest tombstone's id, slot 0 live
      partition = *e.freed.begin();
      tiers_.partitions.reuse_freed(request, layer, h, partition);
      e.freed.erase(e.freed.begin());
      slot = 0;
      ++e.held_pages;
      e.open = partition;
    } else {
      partition =
          tiers_.partitions.map(request, layer, h, PartitionSpec::uniform(1, pt)).first_partition;  // slot 0 live
      slot = 0;
      e.slot_position.resize((std::size_t{partition} + 1) * pt, kNoPosition);
      ++e.held_pages;
      e.open = partition;
    }
    const std::uint32_t index = tiers_.table.first_page_index(request, layer, h, partition);
    e.live[position] = partition * pt + slot;
    e.slot_position[std::size_t{partition} * pt + slot] = position;

    // Write-through: the CPU page is the source of truth; a resident GPU copy
    // of the page gets the same rows, stream-ordered with the gathers.
    const std::byte* k = token_k + std::size_t{h} * row;
    const std::byte* v = token_v + std::size_t{h} * row;
    std::byte* cpu =
        tiers_.cpu_pool.data(*tiers_.table.cpu_page_view().find(tiers_.table.instance(request, layer, h), index));
    moves_.push_back({k, cpu + tiers_.layout.k_offset(slot)});
    moves_.push_back({v, cpu + tiers_.layout.v_offset(slot)});
    if (!tiers_.table.meta(request, layer, h, partition).resident()) continue;
    for (std::uint32_t g = 0; g < tiers_.table.gpu_slots(request, layer, h); ++g) {
      const GpuPageEntry entry = tiers_.table.gpu_entry(request, layer, h, g);
      if (entry.partition != partition || entry.page_in_partition != 0) continue;
      std::byte* gpu = tiers_.gpu_pool.data(entry.gpu_page);
      moves_.push_back({k, gpu + tiers_.layout.k_offset(slot)});
      moves_.push_back({v, gpu + tiers_.layout.v_offset(slot)});
    }
  }
  tiers_.transfer.write(moves_, row);
  s.tokens[layer] = position + 1;
}

void TokenEvictor::live_partitions(RequestId request, std::uint32_t layer, std::uint32_t head,
                                   std::vector<PartitionId>& out) const {
  evicting(request, layer);
  check_index("kv head", head, tiers_.shape.kv_heads);
  out.clear();
  const TwoLevelView<SlotMask> masks = tiers_.table.slot_mask_view();
  const std::size_t inst = tiers_.table.instance(request, layer, head);
  // One page per partition: page index == partition id.
  masks.for_each(inst, [&](SlotMask mask, std::uint32_t partition) {
    if (mask != 0) out.push_back(partition);
  });
}

std::uint32_t TokenEvictor::live_tokens(RequestId request, std::uint32_t layer, std::uint32_t head) const {
  const BufferRequest& s = evicting(request, layer);
  check_index("kv head", head, tiers_.shape.kv_heads);
  return static_cast<std::uint32_t>(eviction_head(tiers_, s, layer, head).live.size());
}

std::optional<std::uint32_t> TokenEvictor::position_slot(RequestId request, std::uint32_t layer, std::uint32_t head,
                                                         std::uint32_t position) const {
  const BufferRequest& s = evicting(request, layer);
  check_index("kv head", head, tiers_.shape.kv_heads);
  const EvictionHead& e = eviction_head(tiers_, s, layer, head);
  const auto it = e.live.find(position);
  if (it == e.live.end()) return std::nullopt;
  return it->second;
}

std::uint64_t TokenEvictor::held_pages(RequestId request) const {
  const BufferRequest& s = evicting(request, 0);
  std::uint64_t pages = 0;
  for (const EvictionHead& e : s.eviction) pages += e.held_pages;
  return pages;
}

std::uint64_t TokenEvictor::live_slots(RequestId request) const {
  const BufferRequest& s = evicting(request, 0);
  std::uint64_t slots = 0;
  for (const EvictionHead& e : s.eviction) slots += e.live.size();
  return slots;
}

void TokenEvictor::share_prefix(RequestId request, RequestId source, std::uint32_t layer, std::uint32_t partitions) {
  evicting(request, layer);
  const BufferRequest& from = evicting(source, layer);
  if (request == source) fail(ErrorCode::invalid_argument, "request {} cannot share a prefix with itself", request);
  SegmentDemand segments;
  for (std::uint32_t h = 0; h < tiers_.shape.kv_heads; ++h) {
    if (tiers_.table.partition_count(request, layer, h) != 0) {
      fail(ErrorCode::failed_precondition, "share_prefix: request {} layer {} already holds tokens", request, layer);
    }
    const std::uint32_t available = tiers_.table.partition_count(source, layer, h);
    if (partitions > available) {
      fail(ErrorCode::out_of_range,
           "share_prefix: request {} kv head {} has {} partitions in layer {}; cannot share {}", source, h, available,
           layer, partitions);
    }
    for (PartitionId p = 0; p < partitions; ++p) {
      if (tiers_.table.partition_freed(source, layer, h, p)) {
        fail(ErrorCode::failed_precondition, "share_prefix: partition {} of request {} kv head {} is freed", p, source,
             h);
      }
    }
    segments += tiers_.table.append_demand(request, layer, h, partitions, partitions);
  }
  tiers_.table.check_segments(segments);

  BufferRequest& s = requests_.at(request);
  const std::uint32_t pt = tiers_.config.page_tokens;
  std::uint32_t length = 0;
  for (std::uint32_t h = 0; h < tiers_.shape.kv_heads; ++h) {
    tiers_.partitions.map_shared_prefix(request, source, layer, h, partitions);
    const EvictionHead& src = eviction_head(tiers_, from, layer, h);
    EvictionHead& e = eviction_head(tiers_, s, layer, h);
    e.slot_position.assign(src.slot_position.begin(), src.slot_position.begin() + std::size_t{partitions} * pt);
    for (std::uint32_t flat = 0; flat < e.slot_position.size(); ++flat) {
      if (e.slot_position[flat] == kNoPosition) continue;
      e.live[e.slot_position[flat]] = flat;
      length = std::max(length, e.slot_position[flat] + 1);
    }
    for (const auto& [dead, p] : src.reusable) {
      if (p < partitions) e.reusable.emplace(dead, p);
    }
    e.held_pages = partitions;
    e.open = partitions > 0 ? partitions - 1 : kInvalidPartition;
  }
  s.tokens[layer] = length;
}

void TokenEvictor::validate_head(RequestId request, std::uint32_t layer, std::uint32_t head) const {
  const BufferRequest& s = requests_.at(request);
  const auto broken = [&](const std::string& what) {
    fail(ErrorCode::failed_precondition, "buffer invariant broken: request {} head ({}, {}): {}", request, layer, head,
         what);
  };
  const EvictionHead& e = eviction_head(tiers_, s, layer, head);
  const std::uint32_t pt = tiers_.config.page_tokens;
  const std::uint32_t count = tiers_.table.partition_count(request, layer, head);
  if (e.slot_position.size() != std::size_t{count} * pt) broken("slot positions do not cover the partitions");
  const bool frees = tiers_.config.eviction_strategy != EvictionStrategy::no_op;
  std::uint32_t held = 0;
  std::size_t live = 0;
  std::set<std::pair<std::uint32_t, PartitionId>> reusable;
  std::set<PartitionId> freed_partitions;
  if (e.open != kInvalidPartition && e.open >= count)
    broken(fmt::format("the open page {} is not a partition", e.open));
  for (PartitionId p = 0; p < count; ++p) {
    const std::uint32_t tokens = tiers_.table.meta(request, layer, head, p).token_count();
    if (tokens > pt) broken(fmt::format("partition {} spans more than one page", p));
    const SlotMask mask =
        tiers_.table.slot_mask(request, layer, head, tiers_.table.first_page_index(request, layer, head, p));
    const bool freed = tiers_.table.partition_freed(request, layer, head, p);
    held += freed ? 0 : 1;
    if (freed) freed_partitions.insert(p);
    if (!freed && dead_slots(mask, tokens) > 0) reusable.emplace(dead_slots(mask, tokens), p);
    if (!freed && mask == 0 && frees) broken(fmt::format("partition {} holds no live slot but is not freed", p));
    for (std::uint32_t t = 0; t < pt; ++t) {
      const std::uint32_t position = e.slot_position[std::size_t{p} * pt + t];
      if (!slot_live(mask, t)) {
        if (position != kNoPosition)
          broken(fmt::format("dead slot {} of partition {} names position {}", t, p, position));
        continue;
      }
      ++live;
      const auto it = e.live.find(position);
      if (position >= s.tokens[layer] || it == e.live.end() || it->second != p * pt + t) {
        broken(fmt::format("live slot {} of partition {} and position {} disagree", t, p, position));
      }
    }
  }
  if (live != e.live.size()) broken(fmt::format("{} live slots, {} live positions", live, e.live.size()));
  if (held != e.held_pages) broken(fmt::format("{} pages held, {} recorded", held, e.held_pages));
  if (reusable != e.reusable) broken("the pages with a dead slot are recorded wrong");
  if (freed_partitions != e.freed) broken("the freed partitions are recorded wrong");
}

void record_offload(const BufferTiers& tiers, BufferRequest& s, std::uint32_t layer, std::uint32_t head,
                    PartitionId first, const PartitionSpec& spec, std::uint32_t first_position) {
  EvictionHead& e = eviction_head(tiers, s, layer, head);
  const std::uint32_t pt = tiers.config.page_tokens;
  e.slot_position.resize((std::size_t{first} + spec.partition_count()) * pt, kNoPosition);
  for (std::uint32_t p = 0; p < spec.partition_count(); ++p) {
    for (std::uint32_t i = 0; i < spec.size(p); ++i) {
      const std::uint32_t flat = (first + p) * pt + i;
      e.slot_position[flat] = first_position + spec.token(p, i);
      e.live[first_position + spec.token(p, i)] = flat;
    }
  }
  e.held_pages += spec.partition_count();
  e.open = first + spec.partition_count() - 1;
}

}  // namespace sparsekv
