// Token eviction in TieredKVBuffer (SpvLLM §1 strategies, §2 slot reuse):
// no live token lost, pages freed exactly when all their slots are dead, the
// four strategies giving the same attention (uniform and variable prompts,
// shared prefixes), bad input and a short metadata pool changing nothing, the
// dry run's segment demand exact, and the shared-prefix rule. The reference
// is, per (request, layer, kv head), the set of live positions; a position's
// K/V rows are a function of it.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <set>
#include <tuple>
#include <vector>

#include "sparsekv/buffer/tiered_kv_buffer.hpp"
#include "test_support.hpp"

using namespace sparsekv;

namespace {

constexpr ModelShape kShape{2, 2, 2, 8, DType::f32};
constexpr std::uint32_t kPageTokens = 4;
constexpr std::uint32_t kMandatory = 48;
constexpr std::uint32_t kMaxLive = 40;  // per head, so that live partitions fit the mandatory pages
constexpr EvictionStrategy kStrategies[] = {EvictionStrategy::no_op, EvictionStrategy::free_block,
                                            EvictionStrategy::sparse_copy, EvictionStrategy::slot_reuse};

Config eviction_config(EvictionStrategy strategy) {
  Config c;
  c.page_tokens = kPageTokens;
  const std::size_t page = c.page_bytes(kShape);  // 256 bytes
  c.cpu_tier_bytes = 4000 * page;
  c.gpu_tier_bytes = 1600 * page;
  c.host_chunk_bytes = 256 * page;
  c.max_requests = 4;
  c.max_context_tokens = 8192;
  c.min_buffer_ratio = 1.0;
  c.metadata_segment_entries = 32;
  c.eviction_strategy = strategy;
  return c;
}

HeadCapacity masked_capacity(const Config& c) {
  HeadCapacity capacity = c.head_capacity();
  capacity.slot_masks = true;
  return capacity;
}

// A buffer of the host backend whose page table keeps slot masks.
struct Rig {
  HostMemoryResource cpu{false}, gpu{false};
  HostPageTransfer transfer;
  Config config;
  TieredKVBuffer buffer;
  explicit Rig(const Config& c) : config(c), buffer(kShape, config, cpu, gpu, gpu, transfer, masked_capacity(config)) {}
  explicit Rig(EvictionStrategy strategy) : Rig(eviction_config(strategy)) {}
};

// Requests r and r + kSharer have the same rows: a shared prefix's bytes are common.
constexpr RequestId kSharer = 100;

float value(RequestId r, std::uint32_t l, std::uint32_t h, std::uint32_t position, std::uint32_t d, bool is_v) {
  std::uint64_t x = (((((r % kSharer) * 131 + l) * 17 + h) * 100003 + position) * 64 + d) * 2 + (is_v ? 1 : 0);
  x ^= x >> 17;
  x *= 0x9E3779B97F4A7C15ull;
  x ^= x >> 29;
  return static_cast<float>(static_cast<int>(x % 2001) - 1000) / 1000.0f;
}

// K and V rows of positions [first, first + tokens) in the engine layout.
struct Rows {
  std::vector<float> k, v;
  Rows(RequestId r, std::uint32_t l, std::uint32_t first, std::uint32_t tokens) {
    for (std::uint32_t t = 0; t < tokens; ++t) {
      for (std::uint32_t h = 0; h < kShape.kv_heads; ++h) {
        for (std::uint32_t d = 0; d < kShape.head_dim; ++d) {
          k.push_back(value(r, l, h, first + t, d, false));
          v.push_back(value(r, l, h, first + t, d, true));
        }
      }
    }
  }
  KvChunk chunk() const {
    return {k.data(), v.data(), static_cast<std::uint32_t>(k.size() / (kShape.kv_heads * kShape.head_dim)), DType::f32};
  }
};

bool row_matches(const std::byte* page, std::uint32_t slot, RequestId r, std::uint32_t l, std::uint32_t h,
                 std::uint32_t position) {
  return test::fp32_row_matches(page, PageLayout{kPageTokens, kShape.head_dim, kShape.dtype}, slot,
                                [&](std::uint32_t d, bool is_v) { return value(r, l, h, position, d, is_v); });
}

using HeadKey = std::tuple<RequestId, std::uint32_t, std::uint32_t>;
using Live = std::map<HeadKey, std::set<std::uint32_t>>;  // the reference: live positions per head

// A request that evicts, its `prompt` tokens offloaded with `specs[layer]` (one spec, or one per kv head).
void add_request(TieredKVBuffer& b, RequestId r, std::uint32_t prompt,
                 const std::vector<std::vector<PartitionSpec>>& specs) {
  b.admission().add_request(r, RequestPages{kMandatory, 0, true});
  for (std::uint32_t l = 0; l < kShape.layers; ++l)
    b.offloader().offload(r, l, Rows(r, l, 0, prompt).chunk(), specs[l]);
}

// A request that evicts, its `prompt` tokens offloaded in one-page partitions in every layer.
void add_request(TieredKVBuffer& b, RequestId r, std::uint32_t prompt) {
  add_request(b, r, prompt,
              std::vector<std::vector<PartitionSpec>>(kShape.layers, {PartitionSpec::uniform(prompt, kPageTokens)}));
}

// Per kv head, the prompt's positions in a random order cut into partitions of
// 1 .. page_tokens tokens: partly filled pages before the last one.
std::vector<PartitionSpec> random_variable_specs(std::mt19937& rng, std::uint32_t prompt) {
  std::vector<PartitionSpec> specs;
  for (std::uint32_t h = 0; h < kShape.kv_heads; ++h) {
    std::vector<std::uint32_t> order(prompt);
    std::iota(order.begin(), order.end(), 0u);
    std::shuffle(order.begin(), order.end(), rng);
    std::vector<std::vector<std::uint32_t>> partitions;
    for (std::uint32_t i = 0; i < prompt;) {
      const std::uint32_t size = std::min(prompt - i, 1 + static_cast<std::uint32_t>(rng() % kPageTokens));
      partitions.emplace_back(order.begin() + i, order.begin() + i + size);
      i += size;
    }
    specs.push_back(PartitionSpec::variable(prompt, partitions));
  }
  return specs;
}

void add_live(Live& live, RequestId r, std::uint32_t prompt) {
  for (std::uint32_t l = 0; l < kShape.layers; ++l) {
    for (std::uint32_t h = 0; h < kShape.kv_heads; ++h) {
      for (std::uint32_t p = 0; p < prompt; ++p) live[{r, l, h}].insert(p);
    }
  }
}

// Every live row is in its CPU page and in the page's resident GPU copy; counts and invariants hold.
// `partial`: a shared page or a variable prompt may leave a partly filled page before the last one.
void check_rows(const TieredKVBuffer& b, const Live& live, EvictionStrategy strategy, bool partial = false) {
  INFO("strategy " << to_string(strategy));
  REQUIRE_NOTHROW(b.validate());
  std::map<RequestId, std::uint64_t> full_pages;
  for (const auto& [key, positions] : live) {
    const auto [r, l, h] = key;
    REQUIRE(b.evictor().live_tokens(r, l, h) == positions.size());
    full_pages[r] += (positions.size() + kPageTokens - 1) / kPageTokens;
    for (const std::uint32_t position : positions) {
      const std::optional<std::uint32_t> flat = b.evictor().position_slot(r, l, h, position);
      REQUIRE(flat.has_value());
      const PartitionId p = *flat / kPageTokens;
      const std::uint32_t slot = *flat % kPageTokens;
      REQUIRE(row_matches(b.tiers().cpu_pool.data(b.tiers().partitions.pages(r, l, h, p)[0]), slot, r, l, h, position));
      if (!b.tiers().table.meta(r, l, h, p).resident()) continue;
      for (std::uint32_t g = 0; g < b.tiers().table.gpu_slots(r, l, h); ++g) {
        const GpuPageEntry e = b.tiers().table.gpu_entry(r, l, h, g);
        if (e.partition == p) REQUIRE(row_matches(b.tiers().gpu_pool.data(e.gpu_page), slot, r, l, h, position));
      }
    }
  }
  // sparse_copy keeps every page full but the last: as few pages as the live tokens need.
  for (const auto& [r, pages] : full_pages) {
    if (strategy == EvictionStrategy::sparse_copy && !partial) REQUIRE(b.evictor().held_pages(r) == pages);
    if (strategy != EvictionStrategy::no_op) REQUIRE(b.evictor().held_pages(r) <= b.evictor().live_slots(r));
  }
}

// Appends the softmax(scores)-weighted average of the rows of `values` ([rows][head_dim]) to `out`.
void softmax_average(const std::vector<float>& scores, const std::vector<float>& values, std::vector<float>& out) {
  const float top = *std::max_element(scores.begin(), scores.end());
  double sum = 0;
  std::vector<double> acc(kShape.head_dim, 0.0);
  for (std::size_t i = 0; i < scores.size(); ++i) {
    const double w = std::exp(double(scores[i]) - top);
    sum += w;
    for (std::uint32_t d = 0; d < kShape.head_dim; ++d) acc[d] += w * values[i * kShape.head_dim + d];
  }
  for (std::uint32_t d = 0; d < kShape.head_dim; ++d) out.push_back(static_cast<float>(acc[d] / sum));
}

// Attention of one query per kv head over the retrieval's pages and masks.
std::vector<float> masked_attention(const TieredKVBuffer& b, const Retrieval& out, RequestId r, std::uint32_t l,
                                    const std::vector<float>& q) {
  const PageLayout layout{kPageTokens, kShape.head_dim, kShape.dtype};
  std::vector<float> result;
  for (std::uint32_t h = 0; h < kShape.kv_heads; ++h) {
    std::vector<float> scores, values;
    std::size_t page_index = out.pages.partition_offsets[out.head_offsets[h]];
    out.for_each_page_masked(h, kPageTokens, [&](PageId page, std::uint32_t tokens, SlotMask mask) {
      const std::byte* data = b.tiers().gpu_pool.data(page);
      for (std::uint32_t t = 0; t < tokens; ++t) {
        // The retrieval's positions name exactly the live slots.
        REQUIRE(slot_live(mask, t) == (out.slot_positions[page_index * kPageTokens + t] != kNoPosition));
        if (!slot_live(mask, t)) continue;
        REQUIRE(row_matches(data, t, r, l, h, out.slot_positions[page_index * kPageTokens + t]));
        float dot = 0;
        for (std::uint32_t d = 0; d < kShape.head_dim; ++d) {
          float k, v;
          std::memcpy(&k, data + layout.k_offset(t) + d * 4, 4);
          std::memcpy(&v, data + layout.v_offset(t) + d * 4, 4);
          dot += q[h * kShape.head_dim + d] * k;
          values.push_back(v);
        }
        scores.push_back(dot / std::sqrt(float(kShape.head_dim)));
      }
      ++page_index;
    });
    softmax_average(scores, values, result);
  }
  return result;
}

// Dense attention over the reference's live positions, in position order.
std::vector<float> dense_attention(const Live& live, RequestId r, std::uint32_t l, const std::vector<float>& q) {
  std::vector<float> result;
  for (std::uint32_t h = 0; h < kShape.kv_heads; ++h) {
    std::vector<float> scores, values;
    for (const std::uint32_t p : live.at({r, l, h})) {
      float dot = 0;
      for (std::uint32_t d = 0; d < kShape.head_dim; ++d) {
        dot += q[h * kShape.head_dim + d] * value(r, l, h, p, d, false);
        values.push_back(value(r, l, h, p, d, true));
      }
      scores.push_back(dot / std::sqrt(float(kShape.head_dim)));
    }
    softmax_average(scores, values, result);
  }
  return result;
}

// The buffer's observable state, for "changes nothing".
struct Snapshot {
  std::uint32_t cpu_used, gpu_used;
  MetadataBytes bytes;
  std::vector<std::uint64_t> words;  // lengths, live partitions, masks, positions' slots
  bool operator==(const Snapshot& o) const {
    return cpu_used == o.cpu_used && gpu_used == o.gpu_used && bytes.cpu_mapped == o.bytes.cpu_mapped &&
           bytes.gpu_mapped == o.bytes.gpu_mapped && words == o.words;
  }
};

Snapshot snapshot(const TieredKVBuffer& b, const Live& live) {
  Snapshot s{b.tiers().cpu_pool.used(), b.tiers().gpu_pool.used(), b.tiers().table.bytes(), {}};
  std::vector<PartitionId> partitions;
  for (const auto& [key, positions] : live) {
    const auto [r, l, h] = key;
    s.words.push_back(b.admission().sequence_length(r, l));
    s.words.push_back(b.evictor().live_tokens(r, l, h));
    b.evictor().live_partitions(r, l, h, partitions);
    for (const PartitionId p : partitions) {
      s.words.push_back(p);
      s.words.push_back(b.tiers().table.slot_mask(r, l, h, b.tiers().table.first_page_index(r, l, h, p)));
      s.words.push_back(b.tiers().table.meta(r, l, h, p).bits);
    }
    for (const std::uint32_t position : positions)
      s.words.push_back(b.evictor().position_slot(r, l, h, position).value());
  }
  return s;
}

// CPU pages whose every live slot is in `positions` (per head), found through the buffer's own slot map.
std::uint64_t pages_killed(const TieredKVBuffer& b, const Live& live, RequestId r, std::uint32_t l,
                           const std::vector<std::vector<std::uint32_t>>& positions) {
  std::uint64_t killed = 0;
  for (std::uint32_t h = 0; h < kShape.kv_heads; ++h) {
    std::map<PartitionId, int> left;
    for (const std::uint32_t p : live.at({r, l, h})) ++left[*b.evictor().position_slot(r, l, h, p) / kPageTokens];
    for (const std::uint32_t p : positions[h]) {
      if (--left[*b.evictor().position_slot(r, l, h, p) / kPageTokens] == 0) ++killed;
    }
  }
  return killed;
}

// Free segments of every pool of the table, found through segment_shortfall.
SegmentDemand free_segments(const HierarchicalPageTable& table) {
  SegmentDemand free;
  for (std::uint64_t SegmentDemand::*pool : {&SegmentDemand::meta, &SegmentDemand::gpu_pages, &SegmentDemand::offsets,
                                             &SegmentDemand::cpu_pages, &SegmentDemand::masks}) {
    const auto fits = [&](std::uint64_t n) {
      SegmentDemand d;
      d.*pool = n;
      return table.segment_shortfall(d).empty();
    };
    std::uint64_t low = 0, high = 1;  // fits(low) holds; the search ends with !fits(high)
    while (fits(high)) {
      low = high;
      high *= 2;
    }
    while (high - low > 1) {
      const std::uint64_t middle = low + (high - low) / 2;
      if (fits(middle)) {
        low = middle;
      } else {
        high = middle;
      }
    }
    free.*pool = low;
  }
  return free;
}

// What a random run draws its prompts from: uniform one-page partitions only,
// or also per-head variable specs, and requests sharing another's first
// partitions (share_prefix, right after the source's prompt, so that every
// strategy shares the same positions).
struct RandomMix {
  bool variable_prompts = false;
  bool sharers = false;
};

void random_eviction(std::uint32_t seed, const RandomMix& mix) {
  INFO("seed " << seed);
  std::vector<std::unique_ptr<Rig>> rigs;
  for (const EvictionStrategy s : kStrategies) rigs.push_back(std::make_unique<Rig>(s));
  std::mt19937 rng(seed);
  const auto pick = [&](std::size_t n) { return std::uniform_int_distribution<std::size_t>(0, n - 1)(rng); };
  Live live;
  Live pinned;  // positions in pages shared with another request: never evicted while both live
  std::map<RequestId, RequestId> partner;
  std::set<RequestId> requests;
  RequestId next = 1;
  RequestId sharers = 0;
  const bool partial = mix.variable_prompts || mix.sharers;
  std::map<std::string, int> done;
  // A new request with a prompt of 1 .. 14 tokens; with mix.sharers and a free
  // request slot, maybe a second one sharing its first partitions.
  const auto start = [&](bool share) {
    const auto tokens = static_cast<std::uint32_t>(1 + pick(14));
    std::vector<std::vector<PartitionSpec>> specs;
    for (std::uint32_t l = 0; l < kShape.layers; ++l) {
      if (mix.variable_prompts && pick(2) == 0) {
        specs.push_back(random_variable_specs(rng, tokens));
        ++done["variable prompt"];
      } else {
        specs.push_back({PartitionSpec::uniform(tokens, kPageTokens)});
      }
    }
    for (auto& rig : rigs) add_request(rig->buffer, next, tokens, specs);
    add_live(live, next, tokens);
    requests.insert(next);
    if (share && mix.sharers && requests.size() < rigs[0]->config.max_requests) {
      const RequestId sharer = next + kSharer * ++sharers;  // the same rows as `next`
      for (auto& rig : rigs) rig->buffer.admission().add_request(sharer, RequestPages{kMandatory, 0, true});
      for (std::uint32_t l = 0; l < kShape.layers; ++l) {
        std::uint32_t fewest = std::numeric_limits<std::uint32_t>::max();
        for (const PartitionSpec& spec : specs[l]) fewest = std::min(fewest, spec.partition_count());
        const auto shared = static_cast<std::uint32_t>(1 + pick(fewest));
        for (auto& rig : rigs) rig->buffer.evictor().share_prefix(sharer, next, l, shared);
        for (std::uint32_t h = 0; h < kShape.kv_heads; ++h) {
          const PartitionSpec& spec = specs[l][specs[l].size() == 1 ? 0 : h];
          auto& positions = live[{sharer, l, h}];
          for (PartitionId p = 0; p < shared; ++p) {
            for (std::uint32_t i = 0; i < spec.size(p); ++i) positions.insert(spec.token(p, i));
          }
          pinned[{next, l, h}] = positions;
          pinned[{sharer, l, h}] = positions;
        }
      }
      ++done["sharer"];
      partner[next] = sharer;
      partner[sharer] = next;
      requests.insert(sharer);
    }
    ++next;
  };
  // A request ends; a partner sharing its pages holds them alone from now on.
  const auto end = [&](RequestId gone) {
    for (auto& rig : rigs) rig->buffer.admission().finish(gone);
    std::erase_if(live, [gone](const auto& entry) { return std::get<0>(entry.first) == gone; });
    requests.erase(gone);
    if (!partner.contains(gone)) return;
    const RequestId other = partner.at(gone);
    std::erase_if(pinned, [&](const auto& entry) {
      return std::get<0>(entry.first) == gone || std::get<0>(entry.first) == other;
    });
    partner.erase(gone);
    partner.erase(other);
  };
  start(true);
  start(false);
  std::vector<Retrieval> outs(rigs.size());
  std::vector<std::vector<std::uint32_t>> lists(kShape.kv_heads);

  for (int op = 0; op < 700; ++op) {
    const RequestId r = *std::next(requests.begin(), static_cast<long>(pick(requests.size())));
    const auto l = static_cast<std::uint32_t>(pick(kShape.layers));
    const std::uint32_t length = rigs[0]->buffer.admission().sequence_length(r, l);
    const std::size_t kind = pick(100);
    // Eviction lists: the oldest evictable positions (a streaming window) or random ones; one stays live.
    for (std::uint32_t h = 0; h < kShape.kv_heads; ++h) {
      const auto& positions = live.at({r, l, h});
      std::vector<std::uint32_t> all;
      for (const std::uint32_t p : positions) {
        if (!pinned.contains({r, l, h}) || !pinned.at({r, l, h}).contains(p)) all.push_back(p);
      }
      const std::size_t over = positions.size() > kMaxLive - 4 ? positions.size() - (kMaxLive - 4) : 0;
      const std::size_t n = std::min({all.size(), positions.size() - 1, over + pick(4)});
      lists[h].clear();
      if (pick(2) == 0) {
        lists[h].assign(all.begin(), all.begin() + static_cast<long>(n));
      } else {
        std::shuffle(all.begin(), all.end(), rng);
        lists[h].assign(all.begin(), all.begin() + static_cast<long>(n));
      }
    }
    if (kind < 45) {  // one decode step: evict (maybe nothing), then place, checked against the dry run
      const bool place = live.at({r, l, 0}).size() + 1 - lists[0].size() <= kMaxLive &&
                         live.at({r, l, 1}).size() + 1 - lists[1].size() <= kMaxLive;
      for (auto& rig : rigs) {
        TieredKVBuffer& b = rig->buffer;
        const EvictionStrategy strategy = rig->config.eviction_strategy;
        const EvictionDemand demand = b.evictor().append_demand_evicting(r, l, lists);
        const std::uint64_t killed = pages_killed(b, live, r, l, lists);
        const std::uint32_t before = b.tiers().cpu_pool.used();
        b.evictor().evict(r, l, lists);
        const std::uint32_t freed = before - b.tiers().cpu_pool.used();
        REQUIRE(freed == demand.freed_pages);
        if (strategy == EvictionStrategy::no_op) REQUIRE(freed == 0);
        if (strategy == EvictionStrategy::free_block || strategy == EvictionStrategy::slot_reuse) {
          REQUIRE(freed == killed);  // released at the op that kills the last slot, not later
        }
        if (!place) continue;
        const std::uint32_t middle = b.tiers().cpu_pool.used();
        b.evictor().place_token(r, l, Rows(r, l, length, 1).chunk());
        REQUIRE(b.tiers().cpu_pool.used() - middle == demand.placed_pages);
        std::vector<PartitionId> partitions;
        for (std::uint32_t h = 0; h < kShape.kv_heads; ++h) {
          b.evictor().live_partitions(r, l, h, partitions);
          REQUIRE(partitions.size() == demand.live_partitions[h]);
        }
      }
      for (std::uint32_t h = 0; h < kShape.kv_heads; ++h) {
        for (const std::uint32_t p : lists[h]) live[{r, l, h}].erase(p);
        if (place) live[{r, l, h}].insert(length);
      }
      ++done["step"];
    } else if (kind < 65) {  // place only
      if (live.at({r, l, 0}).size() >= kMaxLive || live.at({r, l, 1}).size() >= kMaxLive) continue;
      for (auto& rig : rigs) rig->buffer.evictor().place_token(r, l, Rows(r, l, length, 1).chunk());
      for (std::uint32_t h = 0; h < kShape.kv_heads; ++h) live[{r, l, h}].insert(length);
      ++done["place"];
    } else if (kind < 83) {  // retrieve the live partitions; masked attention == dense over the live list
      std::vector<float> q(kShape.kv_heads * kShape.head_dim);
      for (float& x : q) x = std::uniform_real_distribution<float>(-2, 2)(rng);
      const std::vector<float> dense = dense_attention(live, r, l, q);
      std::vector<float> first;
      for (std::size_t i = 0; i < rigs.size(); ++i) {
        TieredKVBuffer& b = rigs[i]->buffer;
        std::vector<std::vector<PartitionId>> selection(kShape.kv_heads);
        for (std::uint32_t h = 0; h < kShape.kv_heads; ++h) b.evictor().live_partitions(r, l, h, selection[h]);
        b.retriever().retrieve(r, l, selection, outs[i]);
        REQUIRE(outs[i].page_masks.size() == outs[i].pages.gpu_pages.size());
        REQUIRE(outs[i].slot_positions.size() == outs[i].pages.gpu_pages.size() * kPageTokens);
        const std::vector<float> got = masked_attention(b, outs[i], r, l, q);
        if (i == 0) first = got;
        for (std::size_t d = 0; d < got.size(); ++d) {
          REQUIRE(std::abs(got[d] - dense[d]) <= 1e-6f);
          REQUIRE(std::abs(got[d] - first[d]) <= 1e-6f);  // the four strategies agree
        }
      }
      ++done["retrieve"];
    } else if (kind < 97) {  // bad input: nothing changes, in any strategy
      const std::size_t bad = pick(6);
      for (auto& rig : rigs) {
        TieredKVBuffer& b = rig->buffer;
        const Snapshot before = snapshot(b, live);
        std::vector<std::vector<std::uint32_t>> wrong = lists;  // valid lists made wrong in one head
        const std::uint32_t h = static_cast<std::uint32_t>(bad % kShape.kv_heads);
        switch (bad) {
          case 0:  // a position never appended
            wrong[h].push_back(length + static_cast<std::uint32_t>(pick(3)));
            REQUIRE_SPARSEKV_ERROR(b.evictor().evict(r, l, wrong), ErrorCode::invalid_argument);
            break;
          case 1: {  // a position evicted already (or, with none, listed twice)
            std::uint32_t gone = length;
            for (std::uint32_t p = 0; p < length && gone == length; ++p) {
              if (!live.at({r, l, h}).contains(p)) gone = p;
            }
            wrong[h].push_back(gone == length ? *live.at({r, l, h}).begin() : gone);
            if (gone == length) wrong[h].push_back(*live.at({r, l, h}).begin());
            REQUIRE_SPARSEKV_ERROR(b.evictor().evict(r, l, wrong), ErrorCode::invalid_argument);
            REQUIRE_SPARSEKV_ERROR(b.evictor().check_evict(r, l, wrong), ErrorCode::invalid_argument);
            break;
          }
          case 2:  // listed twice
            wrong[h].push_back(*live.at({r, l, h}).rbegin());
            wrong[h].push_back(*live.at({r, l, h}).rbegin());
            REQUIRE_SPARSEKV_ERROR(b.evictor().evict(r, l, wrong), ErrorCode::invalid_argument);
            REQUIRE_SPARSEKV_ERROR(b.evictor().append_demand_evicting(r, l, wrong), ErrorCode::invalid_argument);
            break;
          case 3:  // one list short
            wrong.pop_back();
            REQUIRE_SPARSEKV_ERROR(b.evictor().evict(r, l, wrong), ErrorCode::invalid_argument);
            break;
          case 4: {  // two tokens at once, and the tail path
            const Rows two(r, l, length, 2);
            REQUIRE_SPARSEKV_ERROR(b.evictor().place_token(r, l, two.chunk()), ErrorCode::invalid_argument);
            REQUIRE_SPARSEKV_ERROR(b.tails().append(r, l, Rows(r, l, length, 1).chunk()),
                                   ErrorCode::failed_precondition);
            break;
          }
          case 5: {  // selecting a freed partition (free_block and slot_reuse leave tombstones)
            std::vector<std::vector<PartitionId>> selection(kShape.kv_heads);
            for (std::uint32_t k = 0; k < kShape.kv_heads; ++k) b.evictor().live_partitions(r, l, k, selection[k]);
            for (PartitionId p = 0; p < b.tiers().table.partition_count(r, l, h); ++p) {
              if (!b.tiers().table.partition_freed(r, l, h, p)) continue;
              selection[h].push_back(p);
              REQUIRE_SPARSEKV_ERROR(b.retriever().retrieve(r, l, selection, outs[0]), ErrorCode::invalid_argument);
              break;
            }
            break;
          }
        }
        REQUIRE(snapshot(b, live) == before);
      }
      ++done["bad input"];
    } else {  // a request ends (with mix.sharers, another too if a pair would not fit); a new one starts
      end(r);
      if (mix.sharers && requests.size() + 2 > rigs[0]->config.max_requests) {
        end(*std::next(requests.begin(), static_cast<long>(pick(requests.size()))));
      }
      start(true);
      ++done["restart"];
    }
    for (auto& rig : rigs) check_rows(rig->buffer, live, rig->config.eviction_strategy, partial);
  }
  INFO("steps " << done["step"] << ", places " << done["place"] << ", retrievals " << done["retrieve"]);
  REQUIRE(done["step"] > 200);
  REQUIRE(done["retrieve"] > 80);
  REQUIRE(done["bad input"] > 50);
  if (mix.variable_prompts) REQUIRE(done["variable prompt"] > 10);
  if (mix.sharers) REQUIRE(done["sharer"] > 8);
  // The strategies differ only in pages: no_op holds the most, sparse_copy the fewest.
  for (const RequestId r : requests) {
    REQUIRE(rigs[0]->buffer.evictor().held_pages(r) >= rigs[1]->buffer.evictor().held_pages(r));
    REQUIRE(rigs[1]->buffer.evictor().held_pages(r) >= rigs[2]->buffer.evictor().held_pages(r));
    REQUIRE(rigs[3]->buffer.evictor().held_pages(r) >= rigs[2]->buffer.evictor().held_pages(r));
  }
  REQUIRE(rigs[2]->buffer.tiers().stats.pages_copied > 0);
  REQUIRE(rigs[2]->buffer.tiers().stats.slots_copied >= rigs[2]->buffer.tiers().stats.pages_copied);
  REQUIRE(rigs[0]->buffer.tiers().stats.pages_copied + rigs[1]->buffer.tiers().stats.pages_copied +
              rigs[3]->buffer.tiers().stats.pages_copied ==
          0);
  REQUIRE(rigs[1]->buffer.tiers().stats.pages_freed > 0);
  REQUIRE(rigs[0]->buffer.tiers().stats.pages_freed == 0);
}

}  // namespace

TEST_CASE("EvictionStrategy names parse and round-trip", "[buffer][eviction]") {
  REQUIRE(Config{}.eviction_strategy == EvictionStrategy::slot_reuse);
  for (const EvictionStrategy s : kStrategies) REQUIRE(parse_eviction_strategy(to_string(s)) == s);
  REQUIRE(parse_eviction_strategy("slot-reuse") == EvictionStrategy::slot_reuse);
  REQUIRE(parse_eviction_strategy("sparse-copy") == EvictionStrategy::sparse_copy);
  REQUIRE_SPARSEKV_ERROR(parse_eviction_strategy("slotreuse"), ErrorCode::invalid_argument);
  REQUIRE_SPARSEKV_ERROR(parse_eviction_strategy("free_block_"), ErrorCode::invalid_argument);
  Config bad = eviction_config(EvictionStrategy::no_op);
  bad.eviction_strategy = static_cast<EvictionStrategy>(9);
  REQUIRE_SPARSEKV_ERROR(bad.validate(kShape), ErrorCode::invalid_argument);
}

TEST_CASE("Eviction: no live token lost, pages freed exactly when all dead, four strategies agree",
          "[buffer][eviction][random]") {
  for (const std::uint32_t seed : {1u, 2u, 3u, 4u}) random_eviction(seed, RandomMix{});
}

TEST_CASE("Eviction: variable prompts and shared prefixes under random evict and place, four strategies agree",
          "[buffer][eviction][random]") {
  for (const std::uint32_t seed : {11u, 12u, 13u}) random_eviction(seed, RandomMix{true, true});
}

TEST_CASE("Eviction: shared prefix pages are copied before they are masked, never reused or compacted",
          "[buffer][eviction][errors]") {
  for (const EvictionStrategy strategy : kStrategies) {
    INFO("strategy " << to_string(strategy));
    Rig rig(strategy);
    TieredKVBuffer& b = rig.buffer;
    const RequestId kB = kSharer + 1;  // shares request 1's prefix
    add_request(b, 1, 10);             // partitions of 4, 4 and 2 tokens
    b.admission().add_request(kB, RequestPages{kMandatory, 0, true});
    // A evicts a token outside the prefix first (partition 2); B shares partitions 0 .. 2, A's open page included.
    const std::vector<std::vector<std::uint32_t>> outside{{9}, {8}};
    for (std::uint32_t l = 0; l < kShape.layers; ++l) b.evictor().evict(1, l, outside);
    for (std::uint32_t l = 0; l < kShape.layers; ++l) b.evictor().share_prefix(kB, 1, l, 3);
    Live live;
    add_live(live, 1, 10);
    for (std::uint32_t l = 0; l < kShape.layers; ++l) {
      live[{1, l, 0}].erase(9);
      live[{1, l, 1}].erase(8);
      live[{kB, l, 0}] = live[{1, l, 0}];
      live[{kB, l, 1}] = live[{1, l, 1}];
      REQUIRE(b.admission().sequence_length(kB, l) == 10);  // one past the newest position it shares (9, in kv head 0)
    }
    check_rows(b, live, strategy, true);
    REQUIRE_SPARSEKV_ERROR(b.evictor().share_prefix(kB, 1, 0, 1),
                           ErrorCode::failed_precondition);  // B's layer is not empty
    REQUIRE_SPARSEKV_ERROR(b.evictor().share_prefix(1, 1, 0, 1), ErrorCode::invalid_argument);
    b.admission().add_request(3, RequestPages{kMandatory, 0, true});
    REQUIRE_SPARSEKV_ERROR(b.evictor().share_prefix(3, 1, 0, 4), ErrorCode::out_of_range);

    // Either request evicting a shared token copies its page first (copy-on-evict): the dry runs count the
    // copy and change nothing.
    const Snapshot before = snapshot(b, live);
    REQUIRE(b.evictor().append_demand_evicting(kB, 0, std::vector<std::vector<std::uint32_t>>{{}, {3}}).copied_pages ==
            1);
    REQUIRE(b.evictor().append_demand_evicting(1, 1, std::vector<std::vector<std::uint32_t>>{{0}, {4}}).copied_pages ==
            2);
    REQUIRE_NOTHROW(b.evictor().check_evict(1, 1, std::vector<std::vector<std::uint32_t>>{{0}, {}}));
    REQUIRE(snapshot(b, live) == before);

    // New tokens of either request go to pages of its own, never into a shared page's free or dead slot.
    const std::uint32_t shared_pages = b.tiers().cpu_pool.used();
    for (RequestId r : {RequestId{1}, kB}) {
      for (std::uint32_t l = 0; l < kShape.layers; ++l) {
        const std::uint32_t position = b.admission().sequence_length(r, l);
        b.evictor().place_token(r, l, Rows(r, l, position, 1).chunk());
        for (std::uint32_t h = 0; h < kShape.kv_heads; ++h) {
          live[{r, l, h}].insert(position);
          REQUIRE(*b.evictor().position_slot(r, l, h, position) == 3 * kPageTokens);  // slot 0 of a new partition 3
        }
      }
    }
    REQUIRE(b.tiers().cpu_pool.used() == shared_pages + 2 * 2 * 2);
    // B evicts and refills its own page; A's view of the shared pages is untouched.
    for (std::uint32_t l = 0; l < kShape.layers; ++l) {
      b.evictor().evict(kB, l, std::vector<std::vector<std::uint32_t>>{{10}, {10}});
      const std::uint32_t position = b.admission().sequence_length(kB, l);
      b.evictor().place_token(kB, l, Rows(kB, l, position, 1).chunk());
      for (std::uint32_t h = 0; h < kShape.kv_heads; ++h) {
        live[{kB, l, h}].erase(10);
        live[{kB, l, h}].insert(position);
      }
    }
    check_rows(b, live, strategy, true);
    const std::vector<float> q(kShape.kv_heads * kShape.head_dim, 0.5f);
    Retrieval out;
    std::vector<std::vector<PartitionId>> selection(kShape.kv_heads);
    for (std::uint32_t h = 0; h < kShape.kv_heads; ++h) b.evictor().live_partitions(1, 0, h, selection[h]);
    b.retriever().retrieve(1, 0, selection, out);
    const std::vector<float> got = masked_attention(b, out, 1, 0, q);
    const std::vector<float> want = dense_attention(live, 1, 0, q);
    for (std::size_t d = 0; d < got.size(); ++d) REQUIRE(std::abs(got[d] - want[d]) <= 1e-6f);

    // B evicting a shared token masks a private copy of its page; A's page and view are untouched.
    const std::uint64_t used = b.tiers().cpu_pool.used();
    b.evictor().evict(kB, 1, std::vector<std::vector<std::uint32_t>>{{}, {6}});
    live[{kB, 1, 1}].erase(6);
    REQUIRE(b.tiers().cpu_pool.used() == used + 1);
    REQUIRE(b.tiers().stats.pages_unshared == 1);
    check_rows(b, live, strategy, true);

    // Once A is gone, the pages are B's alone and may be masked.
    b.admission().finish(1);
    b.admission().finish(3);
    std::erase_if(live, [](const auto& entry) { return std::get<0>(entry.first) == 1; });
    for (std::uint32_t l = 0; l < kShape.layers; ++l) {
      b.evictor().evict(kB, l, std::vector<std::vector<std::uint32_t>>{{0, 1, 2, 3}, {4}});
      for (const std::uint32_t p : {0u, 1u, 2u, 3u}) live[{kB, l, 0}].erase(p);
      live[{kB, l, 1}].erase(4);
    }
    check_rows(b, live, strategy, true);
    b.admission().finish(kB);
    REQUIRE(b.tiers().cpu_pool.used() == 0);
    REQUIRE_NOTHROW(b.validate());
  }
}

TEST_CASE("Eviction: requests that evict have no tail and refuse the tail's calls", "[buffer][eviction][errors]") {
  Rig rig(EvictionStrategy::slot_reuse);
  TieredKVBuffer& b = rig.buffer;
  const RequestPages evicting{kMandatory, 0, true};
  const std::uint64_t heads = kShape.layers * kShape.kv_heads;
  const std::uint64_t slots = b.admission().min_slots_per_head(evicting);
  REQUIRE(b.admission().can_admit(8, evicting).gpu_pages_needed == heads * slots);
  REQUIRE(b.admission().can_admit(8, RequestPages{kMandatory, 0, false}).gpu_pages_needed == heads * (slots + 1));
  b.admission().add_request(1, evicting);
  REQUIRE(b.tiers().gpu_pool.used() == heads * slots);
  // Prompt partitions of more than one page are refused; nothing is mapped.
  const Rows prompt(1, 0, 0, 8);
  REQUIRE_SPARSEKV_ERROR(b.offloader().offload(1, 0, prompt.chunk(), std::vector{PartitionSpec::uniform(8, 8)}),
                         ErrorCode::invalid_argument);
  REQUIRE(b.tiers().cpu_pool.used() == 0);
  b.offloader().offload(1, 0, prompt.chunk(), std::vector{PartitionSpec::uniform(8, kPageTokens)});
  REQUIRE_SPARSEKV_ERROR(b.tails().tail_page(1, 0, 0), ErrorCode::failed_precondition);
  REQUIRE(b.tails().tail_tokens(1, 0) == 0);
  REQUIRE_SPARSEKV_ERROR(b.tails().save_demand(1, 0), ErrorCode::failed_precondition);
  const std::vector<PartitionId> firsts{0, 0};
  const std::vector specs{PartitionSpec::uniform(8, 8), PartitionSpec::uniform(8, 8)};
  REQUIRE_SPARSEKV_ERROR(b.regrouper().repartition(1, 0, firsts, specs), ErrorCode::failed_precondition);
  std::vector<PageId> pages(kShape.kv_heads);
  REQUIRE_SPARSEKV_ERROR(b.tails().append_on_device(1, 0, pages), ErrorCode::failed_precondition);
  REQUIRE_NOTHROW(b.validate());

  // A request that does not evict refuses the eviction calls.
  b.admission().add_request(2, RequestPages{kMandatory, 0, false});
  const std::vector<std::vector<std::uint32_t>> none(kShape.kv_heads);
  REQUIRE_SPARSEKV_ERROR(b.evictor().evict(2, 0, none), ErrorCode::failed_precondition);
  REQUIRE_SPARSEKV_ERROR(b.evictor().place_token(2, 0, Rows(2, 0, 0, 1).chunk()), ErrorCode::failed_precondition);
  std::vector<PartitionId> live;
  REQUIRE_SPARSEKV_ERROR(b.evictor().live_partitions(2, 0, 0, live), ErrorCode::failed_precondition);
  REQUIRE_SPARSEKV_ERROR(b.evictor().share_prefix(1, 2, 1, 0), ErrorCode::failed_precondition);

  // A buffer whose page table keeps no masks refuses requests that evict.
  HostMemoryResource memory(false);
  TieredKVBuffer plain(kShape, rig.config, memory, memory);
  REQUIRE_SPARSEKV_ERROR(plain.admission().add_request(1, evicting), ErrorCode::failed_precondition);
  REQUIRE_FALSE(plain.admission().can_admit(8, evicting).admit);
  REQUIRE(plain.tiers().gpu_pool.used() == 0);

  // The CPU tier running short: place_token changes nothing.
  Config tight = eviction_config(EvictionStrategy::free_block);
  tight.cpu_tier_bytes = 9 * tight.page_bytes(kShape);
  HostPageTransfer transfer;
  TieredKVBuffer small(kShape, tight, memory, memory, memory, transfer, masked_capacity(tight));
  add_request(small, 1, 8);  // 2 pages in each of 4 heads
  const std::uint32_t used = small.tiers().cpu_pool.used();
  REQUIRE_SPARSEKV_ERROR(small.evictor().place_token(1, 0, Rows(1, 0, 8, 1).chunk()), ErrorCode::resource_exhausted);
  REQUIRE(small.tiers().cpu_pool.used() == used);
  REQUIRE(small.admission().sequence_length(1, 0) == 8);
  REQUIRE(small.evictor().live_tokens(1, 0, 0) == 8);
  // Evicting a whole page frees it: the same token fits.
  small.evictor().evict(1, 0, std::vector<std::vector<std::uint32_t>>{{4, 5, 6, 7}, {0, 1, 2, 3}});
  REQUIRE(small.tiers().cpu_pool.used() == used - 2);
  small.evictor().place_token(1, 0, Rows(1, 0, 8, 1).chunk());
  REQUIRE_NOTHROW(small.validate());
}

TEST_CASE("Eviction: slot_reuse refills the fullest page's lowest dead slot", "[buffer][eviction]") {
  Rig rig(EvictionStrategy::slot_reuse);
  TieredKVBuffer& b = rig.buffer;
  add_request(b, 1, 14);  // partitions 0 .. 3 of 4, 4, 4 and 2 tokens
  // Head 0: partition 0 loses two slots, partition 1 slot 2, partition 2 slots 1 and 3.
  // Head 1: partitions 1 and 2 lose one slot each (a tie on dead slots).
  b.evictor().evict(1, 0, std::vector<std::vector<std::uint32_t>>{{0, 1, 6, 9, 11}, {10, 5}});
  const auto place = [&](std::uint32_t head) {
    const std::uint32_t position = b.admission().sequence_length(1, 0);
    b.evictor().place_token(1, 0, Rows(1, 0, position, 1).chunk());
    return *b.evictor().position_slot(1, 0, head, position);
  };
  const std::uint32_t pt = kPageTokens;
  REQUIRE(place(0) == 1 * pt + 2);                                // fewest dead: partition 1 (one dead slot)
  REQUIRE(b.evictor().position_slot(1, 0, 1, 14) == 1 * pt + 1);  // tie between 1 and 2: the lower id
  REQUIRE(place(0) == 0 * pt + 0);  // then partitions 0 and 2 tie with two dead: 0, its lowest dead slot
  REQUIRE(b.evictor().position_slot(1, 0, 1, 15) == 2 * pt + 2);
  REQUIRE(place(0) == 0 * pt + 1);  // partition 0 has one dead left: fewer than partition 2's two
  REQUIRE(place(0) == 2 * pt + 1);
  REQUIRE(place(0) == 2 * pt + 3);
  REQUIRE(place(0) == 3 * pt + 2);  // no dead slot left: the open page's next slot
  REQUIRE(place(0) == 3 * pt + 3);
  REQUIRE(place(0) == 4 * pt + 0);  // then a new page
  REQUIRE_NOTHROW(b.validate());
  // free_block and no_op never refill a dead slot.
  for (const EvictionStrategy strategy : {EvictionStrategy::free_block, EvictionStrategy::no_op}) {
    Rig other(strategy);
    add_request(other.buffer, 1, 14);
    other.buffer.evictor().evict(1, 0, std::vector<std::vector<std::uint32_t>>{{0, 1, 6, 9, 11}, {10, 5}});
    other.buffer.evictor().place_token(1, 0, Rows(1, 0, 14, 1).chunk());
    REQUIRE(other.buffer.evictor().position_slot(1, 0, 0, 14) == 3 * pt + 2);
  }
}

TEST_CASE("Eviction: a step's segment demand is what evict and place_token map, and exactly enough",
          "[buffer][eviction][errors]") {
  // The pools hold ceil(pages / 32) segments plus one per head (PageTableGeometry::for_config), so a table
  // can only run down to a step's demand through tombstones, which keep their entries but not their pages:
  // free_block and slot_reuse. 96 pages: 7 segments per pool, one short; 128 pages: 8, exactly enough.
  for (const EvictionStrategy strategy : {EvictionStrategy::free_block, EvictionStrategy::slot_reuse}) {
    for (const bool enough : {true, false}) {
      INFO("strategy " << to_string(strategy) << ", enough " << enough);
      Config config = eviction_config(strategy);
      config.max_requests = 1;
      config.cpu_tier_bytes = (enough ? 128 : 96) * config.page_bytes(kShape);
      config.host_chunk_bytes = 32 * config.page_bytes(kShape);
      Rig rig(config);
      TieredKVBuffer& b = rig.buffer;
      b.admission().add_request(1, RequestPages{kMandatory, 0, true});
      // Layer 1: 33 one-page partitions per head (two segments each), the first 32 then freed.
      b.offloader().offload(1, 1, Rows(1, 1, 0, 132).chunk(), std::vector{PartitionSpec::uniform(132, kPageTokens)});
      std::vector<std::uint32_t> first(128);
      std::iota(first.begin(), first.end(), 0u);
      b.evictor().evict(1, 1, std::vector{first, first});
      // Layer 0: 32 full one-page partitions per head (one segment each); a new page starts a second one.
      b.offloader().offload(1, 0, Rows(1, 0, 0, 128).chunk(), std::vector{PartitionSpec::uniform(128, kPageTokens)});
      Live live;
      add_live(live, 1, 128);
      for (std::uint32_t h = 0; h < kShape.kv_heads; ++h) live[{1, 1, h}] = {128, 129, 130, 131};
      const std::uint64_t free = enough ? 2 : 1;
      const SegmentDemand before = free_segments(b.tiers().table);
      REQUIRE((before.meta == free && before.offsets == free && before.cpu_pages == free && before.masks == free));

      // Every page full and nothing evicted: a token placed opens a new partition per head.
      const std::vector<std::vector<std::uint32_t>> none(kShape.kv_heads);
      const EvictionDemand demand = b.evictor().append_demand_evicting(1, 0, none);
      REQUIRE(demand.freed_pages == 0);
      REQUIRE(demand.placed_pages == 2);
      const SegmentDemand& d = demand.segments;
      REQUIRE((d.meta == 2 && d.offsets == 2 && d.cpu_pages == 2 && d.masks == 2 && d.gpu_pages == 0));
      const Rows token(1, 0, 128, 1);
      if (enough) {
        b.evictor().place_token(1, 0, token.chunk());
        for (std::uint32_t h = 0; h < kShape.kv_heads; ++h) live[{1, 0, h}].insert(128);
        const SegmentDemand after = free_segments(b.tiers().table);
        REQUIRE((after.meta == 0 && after.offsets == 0 && after.cpu_pages == 0 && after.masks == 0));
      } else {
        const Snapshot unchanged = snapshot(b, live);
        REQUIRE_SPARSEKV_ERROR(b.evictor().place_token(1, 0, token.chunk()), ErrorCode::resource_exhausted);
        REQUIRE(snapshot(b, live) == unchanged);
      }
      // Whole pages evicted in each head (the open one too) leave tombstones; the next page takes the
      // lowest one's id, with no segment.
      const std::uint32_t next = enough ? 129 : 128;
      const std::uint32_t partitions = b.tiers().table.partition_count(1, 0, 0);
      std::vector<std::vector<std::uint32_t>> page{{0, 1, 2, 3}, {4, 5, 6, 7}};
      if (enough) {
        for (auto& positions : page) positions.push_back(128);
      }
      const EvictionDemand reuse = b.evictor().append_demand_evicting(1, 0, page);
      REQUIRE(reuse.freed_pages == (enough ? 4 : 2));
      REQUIRE(reuse.placed_pages == 2);
      REQUIRE((reuse.segments.meta == 0 && reuse.segments.offsets == 0 && reuse.segments.cpu_pages == 0 &&
               reuse.segments.masks == 0));
      b.evictor().evict(1, 0, page);
      for (std::uint32_t h = 0; h < kShape.kv_heads; ++h) {
        for (const std::uint32_t p : page[h]) live[{1, 0, h}].erase(p);
      }
      b.evictor().place_token(1, 0, Rows(1, 0, next, 1).chunk());
      for (std::uint32_t h = 0; h < kShape.kv_heads; ++h) {
        live[{1, 0, h}].insert(next);
        REQUIRE(b.tiers().table.partition_count(1, 0, h) == partitions);
        REQUIRE(b.evictor().position_slot(1, 0, h, next) == std::optional<std::uint32_t>(h * kPageTokens));
      }
      check_rows(b, live, strategy);
    }
  }
}
