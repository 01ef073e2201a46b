// "Nothing lost": random interleavings of every TieredKVBuffer operation
// against a plain dense reference store of every token's K/V rows.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <numeric>
#include <random>
#include <vector>

#include "sparsekv/buffer/prompt_check_cuda.hpp"
#include "sparsekv/buffer/tiered_kv_buffer.hpp"
#include "sparsekv/step/prompt_offload.hpp"
#include "test_support.hpp"

using namespace sparsekv;

namespace {

constexpr ModelShape kShape{2, 4, 2, 8, DType::f32};
constexpr std::uint32_t kPageTokens = 4;

Config small_config(double min_buffer_ratio) {
  Config c;
  c.page_tokens = kPageTokens;
  const std::size_t page = c.page_bytes(kShape);  // 256 bytes
  c.cpu_tier_bytes = 700 * page;
  c.gpu_tier_bytes = 160 * page;
  c.host_chunk_bytes = 64 * page;
  c.max_requests = 4;
  c.max_context_tokens = 1024;
  c.min_buffer_ratio = min_buffer_ratio;
  c.metadata_segment_entries = 32;
  return c;
}

float value(RequestId r, std::uint32_t layer, std::uint32_t head, std::uint32_t token, std::uint32_t d, bool is_v) {
  const std::uint64_t x = ((((r * 131 + layer) * 17 + head) * 100003 + token) * 64 + d) * 2 + (is_v ? 1 : 0);
  return static_cast<float>(x % 1000003) * 0.5f;
}

// Reference of one (request, layer, kv head): its tokens' partitions in page order.
struct HeadRef {
  std::vector<std::vector<std::uint32_t>> partitions;  // token ids, in the order laid out in pages
};
struct RequestRef {
  RequestPages budget;
  std::vector<std::uint32_t> tokens = std::vector<std::uint32_t>(kShape.layers, 0);
  std::vector<HeadRef> heads = std::vector<HeadRef>(kShape.layers * kShape.kv_heads);
  std::vector<std::vector<PartitionId>> last = std::vector<std::vector<PartitionId>>(kShape.layers * kShape.kv_heads);
};

// Token `token`'s K and V rows sit in row `slot` of `page`.
bool row_matches(const std::byte* page, std::uint32_t slot, RequestId r, std::uint32_t l, std::uint32_t h,
                 std::uint32_t token) {
  return test::fp32_row_matches(page, PageLayout{kPageTokens, kShape.head_dim, kShape.dtype}, slot,
                                [&](std::uint32_t d, bool is_v) { return value(r, l, h, token, d, is_v); });
}

struct Observed {
  std::uint32_t cpu_used, gpu_used;
  std::size_t requests;
  std::vector<std::uint32_t> slots;
  bool operator==(const Observed&) const = default;
};

Observed observe(const TieredKVBuffer& b, const std::map<RequestId, RequestRef>& ref) {
  Observed o{b.tiers().cpu_pool.used(), b.tiers().gpu_pool.used(), ref.size(), {}};
  for (const auto& [id, r] : ref) {
    o.slots.push_back(b.admission().slots_per_head(id));
    for (std::uint32_t l = 0; l < kShape.layers; ++l) o.slots.push_back(b.admission().sequence_length(id, l));
  }
  return o;
}

// Every CPU page holds exactly its tokens' bytes; every cached GPU page equals its CPU page's rows.
void check_all_bytes(const TieredKVBuffer& b, const std::map<RequestId, RequestRef>& ref) {
  for (const auto& [id, r] : ref) {
    for (std::uint32_t l = 0; l < kShape.layers; ++l) {
      for (std::uint32_t h = 0; h < kShape.kv_heads; ++h) {
        const HeadRef& head = r.heads[l * kShape.kv_heads + h];
        REQUIRE(b.tiers().table.partition_count(id, l, h) == head.partitions.size());
        for (PartitionId p = 0; p < head.partitions.size(); ++p) {
          const auto pages = b.tiers().partitions.pages(id, l, h, p);
          REQUIRE(b.tiers().partitions.token_count(id, l, h, p) == head.partitions[p].size());
          for (std::uint32_t i = 0; i < head.partitions[p].size(); ++i) {
            REQUIRE(row_matches(b.tiers().cpu_pool.data(pages[i / kPageTokens]), i % kPageTokens, id, l, h,
                                head.partitions[p][i]));
          }
        }
        for (std::uint32_t slot = 0; slot < b.tiers().table.gpu_slots(id, l, h); ++slot) {
          const GpuPageEntry e = b.tiers().table.gpu_entry(id, l, h, slot);
          if (!e.occupied()) continue;
          const auto& tokens = head.partitions[e.partition];
          for (std::uint32_t i = e.page_in_partition * kPageTokens;
               i < std::min<std::size_t>(tokens.size(), (e.page_in_partition + 1) * kPageTokens); ++i) {
            REQUIRE(row_matches(b.tiers().gpu_pool.data(e.gpu_page), i % kPageTokens, id, l, h, tokens[i]));
          }
        }
        // The tail holds the newest tokens not yet saved.
        const std::uint32_t tail = b.tails().tail_tokens(id, l);
        for (std::uint32_t s = 0; s < tail; ++s) {
          REQUIRE(
              row_matches(b.tiers().gpu_pool.data(b.tails().tail_page(id, l, h)), s, id, l, h, r.tokens[l] - tail + s));
        }
      }
    }
  }
}

}  // namespace

TEST_CASE("TieredKVBuffer loses nothing under random interleavings", "[buffer][random]") {
  for (const auto& [seed, ratio] :
       {std::pair{21u, 1.0}, std::pair{22u, 2.0}, std::pair{23u, 5.0}, std::pair{24u, 1.0}}) {
    HostMemoryResource cpu(false), gpu(false);
    TieredKVBuffer buffer(kShape, small_config(ratio), cpu, gpu);
    std::mt19937 rng(seed);
    const auto pick = [&](std::size_t n) { return std::uniform_int_distribution<std::size_t>(0, n - 1)(rng); };
    std::map<RequestId, RequestRef> ref;
    RequestId next_id = 1;
    std::map<std::string, int> done;  // successful operations by kind
    Retrieval out;

    for (int op = 0; op < 25000; ++op) {
      const Observed before = observe(buffer, ref);
      bool must_be_unchanged = false;
      const int kind = static_cast<int>(pick(100));
      const auto any_request = [&] {
        auto it = ref.begin();
        std::advance(it, pick(ref.size()));
        return it->first;
      };
      if (kind < 4 || ref.empty()) {
        RequestPages budget{static_cast<std::uint32_t>(1 + pick(4)), 0};
        if (pick(3) == 0)
          budget.buffer_pages = buffer.admission().min_slots_per_head(budget) + static_cast<std::uint32_t>(pick(6));
        const AdmissionAdvice advice = buffer.admission().can_admit(0, budget);
        const RequestId id = next_id++;
        try {
          buffer.admission().add_request(id, budget);
          REQUIRE(advice.admit);
          ref[id].budget = budget;
          ++done["add"];
        } catch (const Error& e) {
          REQUIRE(e.code() == ErrorCode::resource_exhausted);
          REQUIRE_FALSE(advice.admit);
          must_be_unchanged = true;
        }
      } else if (kind < 7) {
        const RequestId id = any_request();
        buffer.admission().finish(id);
        ref.erase(id);
        ++done["finish"];
      } else if (kind < 20) {
        const RequestId id = any_request();
        RequestRef& r = ref[id];
        const auto layer = static_cast<std::uint32_t>(pick(kShape.layers));
        const auto tokens = static_cast<std::uint32_t>(1 + pick(40));
        const std::uint32_t first = r.tokens[layer];
        std::vector<float> k(tokens * kShape.kv_heads * kShape.head_dim), v(k.size());
        for (std::uint32_t t = 0; t < tokens; ++t)
          for (std::uint32_t h = 0; h < kShape.kv_heads; ++h)
            for (std::uint32_t d = 0; d < kShape.head_dim; ++d) {
              k[(t * kShape.kv_heads + h) * kShape.head_dim + d] = value(id, layer, h, first + t, d, false);
              v[(t * kShape.kv_heads + h) * kShape.head_dim + d] = value(id, layer, h, first + t, d, true);
            }
        std::vector<PartitionSpec> specs;
        const bool shared = pick(2) == 0;
        for (std::uint32_t h = 0; h < (shared ? 1 : kShape.kv_heads); ++h) {
          if (pick(2) == 0) {
            specs.push_back(PartitionSpec::uniform(tokens, static_cast<std::uint32_t>(1 + pick(10))));
          } else {  // clusters: a random partition of the shuffled tokens
            std::vector<std::uint32_t> order(tokens);
            std::iota(order.begin(), order.end(), 0u);
            std::shuffle(order.begin(), order.end(), rng);
            std::vector<std::vector<std::uint32_t>> clusters;
            for (std::size_t i = 0; i < order.size();) {
              const std::size_t n = std::min<std::size_t>(1 + pick(9), order.size() - i);
              clusters.emplace_back(order.begin() + i, order.begin() + i + n);
              i += n;
            }
            specs.push_back(PartitionSpec::variable(tokens, clusters));
          }
        }
        try {
          buffer.offloader().offload(id, layer, KvChunk{k.data(), v.data(), tokens, DType::f32}, specs);
          for (std::uint32_t h = 0; h < kShape.kv_heads; ++h) {
            const PartitionSpec& spec = specs[shared ? 0 : h];
            for (std::uint32_t p = 0; p < spec.partition_count(); ++p) {
              std::vector<std::uint32_t> ids;
              for (std::uint32_t i = 0; i < spec.size(p); ++i) ids.push_back(first + spec.token(p, i));
              r.heads[layer * kShape.kv_heads + h].partitions.push_back(ids);
            }
          }
          r.tokens[layer] += tokens;
          ++done["offload"];
        } catch (const Error& e) {
          REQUIRE((e.code() == ErrorCode::resource_exhausted || e.code() == ErrorCode::failed_precondition));
          if (e.code() == ErrorCode::failed_precondition) REQUIRE(buffer.tails().tail_tokens(id, layer) != 0);
          must_be_unchanged = true;
        }
      } else if (kind < 45) {
        const RequestId id = any_request();
        RequestRef& r = ref[id];
        const auto layer = static_cast<std::uint32_t>(pick(kShape.layers));
        const std::uint32_t t = r.tokens[layer];
        std::vector<float> k(kShape.kv_heads * kShape.head_dim), v(k.size());
        for (std::uint32_t h = 0; h < kShape.kv_heads; ++h)
          for (std::uint32_t d = 0; d < kShape.head_dim; ++d) {
            k[h * kShape.head_dim + d] = value(id, layer, h, t, d, false);
            v[h * kShape.head_dim + d] = value(id, layer, h, t, d, true);
          }
        const bool saves = buffer.tails().tail_tokens(id, layer) + 1 == kPageTokens;
        try {
          buffer.tails().append(id, layer, KvChunk{k.data(), v.data(), 1, DType::f32});
          r.tokens[layer] += 1;
          if (saves) {
            for (std::uint32_t h = 0; h < kShape.kv_heads; ++h) {
              std::vector<std::uint32_t> ids(kPageTokens);
              std::iota(ids.begin(), ids.end(), t + 1 - kPageTokens);
              r.heads[layer * kShape.kv_heads + h].partitions.push_back(ids);
            }
          }
          ++done["append"];
        } catch (const Error& e) {
          REQUIRE(e.code() == ErrorCode::resource_exhausted);
          REQUIRE(saves);
          must_be_unchanged = true;
        }
      } else if (kind < 80) {
        const RequestId id = any_request();
        RequestRef& r = ref[id];
        const auto layer = static_cast<std::uint32_t>(pick(kShape.layers));
        std::vector<std::vector<PartitionId>> selections(kShape.kv_heads);
        for (std::uint32_t h = 0; h < kShape.kv_heads; ++h) {
          const HeadRef& head = r.heads[layer * kShape.kv_heads + h];
          std::vector<PartitionId>& sel = selections[h];
          std::uint32_t pages = 0;
          for (int attempt = 0; attempt < 12 && !head.partitions.empty(); ++attempt) {
            const auto& last = r.last[layer * kShape.kv_heads + h];
            // Temporal locality: mostly re-pick what the head chose last time.
            const PartitionId p = !last.empty() && pick(10) < 5
                                      ? last[pick(last.size())]
                                      : static_cast<PartitionId>(pick(head.partitions.size()));
            const auto n = static_cast<std::uint32_t>((head.partitions[p].size() + kPageTokens - 1) / kPageTokens);
            if (std::find(sel.begin(), sel.end(), p) == sel.end() && pages + n <= r.budget.mandatory_pages) {
              sel.push_back(p);
              pages += n;
            }
          }
        }
        buffer.retriever().retrieve(id, layer, selections, out);
        REQUIRE(out.head_offsets.size() == kShape.kv_heads + 1);
        std::uint64_t copied = 0;
        for (std::uint32_t h = 0; h < kShape.kv_heads; ++h) {
          const HeadRef& head = r.heads[layer * kShape.kv_heads + h];
          for (std::uint32_t i = out.head_offsets[h]; i < out.head_offsets[h + 1]; ++i) {
            const auto& tokens = head.partitions[out.partitions[i]];
            REQUIRE(out.token_counts[i] == tokens.size());
            REQUIRE(out.pages.partition_offsets[i + 1] - out.pages.partition_offsets[i] ==
                    (tokens.size() + kPageTokens - 1) / kPageTokens);
            for (std::uint32_t t = 0; t < tokens.size(); ++t) {
              const PageId page = out.pages.gpu_pages[out.pages.partition_offsets[i] + t / kPageTokens];
              REQUIRE(row_matches(buffer.tiers().gpu_pool.data(page), t % kPageTokens, id, layer, h, tokens[t]));
            }
            REQUIRE(buffer.tiers().table.meta(id, layer, h, out.partitions[i]).resident());
          }
          r.last[layer * kShape.kv_heads + h] = selections[h];
          REQUIRE(out.tail_tokens[h] == buffer.tails().tail_tokens(id, layer));
        }
        copied = out.pages.copies.size();
        REQUIRE(copied == out.stats.miss_pages);
        ++done["retrieve"];
        if (out.stats.hit_pages > 0) ++done["retrieve-hit"];
        if (out.stats.evicted_pages > 0) ++done["retrieve-evict"];
      } else if (kind < 88) {
        const RequestId id = any_request();
        const std::uint32_t min = buffer.admission().min_slots_per_head(ref[id].budget);
        const auto slots = static_cast<std::uint32_t>(min + pick(12));
        try {
          buffer.admission().resize(id, slots);
          ++done["resize"];
        } catch (const Error& e) {
          REQUIRE(e.code() == ErrorCode::resource_exhausted);
          must_be_unchanged = true;
        }
      } else if (kind < 90) {
        const std::uint64_t freed = buffer.admission().reclaim(1 + pick(40));
        if (freed > 0) ++done["reclaim"];
      } else if (kind < 92) {  // regroup the newest partitions of every head (a policy re-indexing)
        const RequestId id = any_request();
        RequestRef& r = ref[id];
        const auto layer = static_cast<std::uint32_t>(pick(kShape.layers));
        std::vector<PartitionId> first(kShape.kv_heads);
        std::vector<PartitionSpec> specs;
        std::vector<std::vector<std::vector<std::uint32_t>>> regrouped(kShape.kv_heads);
        for (std::uint32_t h = 0; h < kShape.kv_heads; ++h) {
          auto& parts = r.heads[layer * kShape.kv_heads + h].partitions;
          first[h] = parts.empty()
                         ? 0
                         : static_cast<PartitionId>(parts.size() - 1 - pick(std::min<std::size_t>(parts.size(), 6)));
          std::vector<std::uint32_t> run;  // the run's tokens in page order
          for (std::size_t p = first[h]; p < parts.size(); ++p) run.insert(run.end(), parts[p].begin(), parts[p].end());
          if (run.empty()) break;  // the walk regroups only when every head has tokens
          std::vector<std::uint32_t> order(run.size());
          std::iota(order.begin(), order.end(), 0u);
          std::shuffle(order.begin(), order.end(), rng);
          std::vector<std::vector<std::uint32_t>> clusters;
          for (std::size_t i = 0; i < order.size();) {
            const std::size_t n = std::min<std::size_t>(1 + pick(7), order.size() - i);
            clusters.emplace_back(order.begin() + i, order.begin() + i + n);
            i += n;
          }
          specs.push_back(PartitionSpec::variable(static_cast<std::uint32_t>(run.size()), clusters));
          for (const auto& c : clusters) {
            regrouped[h].emplace_back();
            for (std::uint32_t i : c) regrouped[h].back().push_back(run[i]);
          }
        }
        if (specs.size() == kShape.kv_heads) try {
            buffer.regrouper().repartition(id, layer, first, specs);
            for (std::uint32_t h = 0; h < kShape.kv_heads; ++h) {
              auto& parts = r.heads[layer * kShape.kv_heads + h].partitions;
              parts.resize(first[h]);
              parts.insert(parts.end(), regrouped[h].begin(), regrouped[h].end());
              auto& last = r.last[layer * kShape.kv_heads + h];
              std::erase_if(last, [&](PartitionId p) { return p >= first[h]; });
            }
            ++done["repartition"];
          } catch (const Error& e) {
            REQUIRE(e.code() == ErrorCode::resource_exhausted);
            must_be_unchanged = true;
          }
      } else {  // bad input: a clear error, nothing changes
        must_be_unchanged = true;
        const RequestId id = any_request();
        const RequestRef& r = ref[id];
        std::vector<float> row(kShape.kv_heads * kShape.head_dim);
        std::vector<std::vector<PartitionId>> sel(kShape.kv_heads);
        switch (pick(8)) {
          case 0:
            REQUIRE_SPARSEKV_ERROR(buffer.retriever().retrieve(999999, 0, sel, out), ErrorCode::not_found);
            break;
          case 1:
            REQUIRE_SPARSEKV_ERROR(buffer.retriever().retrieve(id, kShape.layers, sel, out), ErrorCode::out_of_range);
            break;
          case 2:
            sel[1] = {static_cast<PartitionId>(r.heads[1].partitions.size())};
            REQUIRE_SPARSEKV_ERROR(buffer.retriever().retrieve(id, 0, sel, out), ErrorCode::out_of_range);
            break;
          case 3:
            if (r.heads[0].partitions.empty()) break;
            sel[0] = {0, 0};
            REQUIRE_SPARSEKV_ERROR(buffer.retriever().retrieve(id, 0, sel, out), ErrorCode::invalid_argument);
            break;
          case 4: {  // over the mandatory budget
            std::uint32_t pages = 0;
            for (PartitionId p = 0; p < r.heads[0].partitions.size(); ++p) {
              sel[0].push_back(p);
              pages += static_cast<std::uint32_t>((r.heads[0].partitions[p].size() + kPageTokens - 1) / kPageTokens);
            }
            if (pages > r.budget.mandatory_pages) {
              REQUIRE_SPARSEKV_ERROR(buffer.retriever().retrieve(id, 0, sel, out), ErrorCode::resource_exhausted);
            }
            break;
          }
          case 5:
            REQUIRE_SPARSEKV_ERROR(buffer.tails().append(id, 0, KvChunk{row.data(), row.data(), 1, DType::bf16}),
                                   ErrorCode::invalid_argument);
            break;
          case 6: {
            const std::vector<PartitionSpec> spec{PartitionSpec::uniform(3, 2)};
            REQUIRE_SPARSEKV_ERROR(
                buffer.offloader().offload(id, 0, KvChunk{row.data(), row.data(), 1, DType::f32}, spec),
                ErrorCode::invalid_argument);
            break;
          }
          default:
            REQUIRE_SPARSEKV_ERROR(buffer.admission().resize(id, buffer.admission().min_slots_per_head(r.budget) - 1),
                                   ErrorCode::invalid_argument);
        }
      }
      REQUIRE_NOTHROW(buffer.validate());
      if (must_be_unchanged) REQUIRE(observe(buffer, ref) == before);
      if (op % 250 == 0 || must_be_unchanged) check_all_bytes(buffer, ref);
    }
    check_all_bytes(buffer, ref);
    // Every kind of operation happened, including the hard paths.
    for (const char* kind : {"add", "finish", "offload", "append", "retrieve", "retrieve-hit", "retrieve-evict",
                             "resize", "reclaim", "repartition"}) {
      INFO(kind);
      REQUIRE(done[kind] > 10);
    }
    while (!ref.empty()) {
      buffer.admission().finish(ref.begin()->first);
      ref.erase(ref.begin());
    }
    buffer.validate();
    REQUIRE(buffer.tiers().cpu_pool.used() == 0);
    REQUIRE(buffer.tiers().gpu_pool.used() == 0);
  }
}

TEST_CASE("append_on_device keeps the host append's bookkeeping, refusing alike", "[buffer]") {
  HostMemoryResource memory(false);
  TieredKVBuffer host(kShape, small_config(1.0), memory, memory);
  TieredKVBuffer device(kShape, small_config(1.0), memory, memory);
  const RequestPages budget{2, 0};
  for (TieredKVBuffer* b : {&host, &device}) b->admission().add_request(3, budget);
  const std::size_t row = std::size_t{kShape.kv_heads} * kShape.head_dim;
  std::vector<float> prompt(5 * row, 0.5f);
  const std::vector<PartitionSpec> specs(kShape.kv_heads, PartitionSpec::uniform(5, kPageTokens));
  for (TieredKVBuffer* b : {&host, &device})
    b->offloader().offload(3, 1, KvChunk{prompt.data(), prompt.data(), 5, DType::f32}, specs);
  std::vector<float> token(row, 1.0f);
  std::vector<PageId> saved(kShape.kv_heads, kInvalidPage);
  std::uint32_t fills = 0;
  for (std::uint32_t t = 0; t < 3 * kPageTokens + 1; ++t) {
    INFO("token " << t);
    const std::uint32_t tail = host.tails().tail_tokens(3, 1);
    host.tails().append(3, 1, KvChunk{token.data(), token.data(), 1, DType::f32});
    std::fill(saved.begin(), saved.end(), kInvalidPage);
    const auto slot = device.tails().append_on_device(3, 1, saved);
    REQUIRE(slot.tail_slot == tail);
    REQUIRE(slot.fills_tail == (tail + 1 == kPageTokens));
    REQUIRE(device.admission().sequence_length(3, 1) == host.admission().sequence_length(3, 1));
    REQUIRE(device.tails().tail_tokens(3, 1) == host.tails().tail_tokens(3, 1));
    for (std::uint32_t h = 0; h < kShape.kv_heads; ++h) {
      const std::uint32_t n = host.tiers().table.partition_count(3, 1, h);
      REQUIRE(device.tiers().table.partition_count(3, 1, h) == n);
      REQUIRE(device.tiers().table.meta(3, 1, h, n - 1).bits == host.tiers().table.meta(3, 1, h, n - 1).bits);
      std::vector<PageId> want, got;
      host.tiers().table.cpu_pages(3, 1, h, n - 1, want);
      device.tiers().table.cpu_pages(3, 1, h, n - 1, got);
      REQUIRE(got == want);
      // The reserved page is the new partition's: where the device saves the tail.
      if (slot.fills_tail) REQUIRE(saved[h] == got[0]);
      if (!slot.fills_tail) REQUIRE(saved[h] == kInvalidPage);
    }
    fills += slot.fills_tail;
  }
  REQUIRE(fills == 3);
  REQUIRE(device.tiers().stats.pages_saved == host.tiers().stats.pages_saved);
  device.validate();
  std::vector<PageId> one(1);
  REQUIRE_SPARSEKV_ERROR(device.tails().append_on_device(3, 1, one), ErrorCode::invalid_argument);
  REQUIRE_SPARSEKV_ERROR(device.tails().append_on_device(4, 1, saved), ErrorCode::not_found);
  REQUIRE(device.admission().sequence_length(3, 1) == host.admission().sequence_length(3, 1));
}

// The device prefill's Offload (Manager::prefill with device tensors) on the
// host path of the same code: offload_on_device's placements turned into
// FlashD2HSaver targets (step/prompt_offload.hpp) and scattered by its
// workers write the bytes, page ids and table entries offload() writes, for
// one-page and multi-page partitions, across chunk boundaries of the pool.
TEST_CASE("offload_on_device + staged save equals offload", "[buffer][flash-d2h-save]") {
  HostMemoryResource memory(false);
  const std::size_t row = std::size_t{kShape.kv_heads} * kShape.head_dim;
  for (const std::uint32_t partition_tokens : {kPageTokens, 3 * kPageTokens}) {
    INFO("partition tokens " << partition_tokens);
    TieredKVBuffer host(kShape, small_config(1.0), memory, memory);
    TieredKVBuffer device(kShape, small_config(1.0), memory, memory);
    FlashD2HSaver saver(FlashD2HSaverConfig{3, 2, 0, std::size_t{1} << 20});
    std::vector<TokenPlacement> placements;
    std::vector<RowTarget> targets;
    for (const RequestId id : {RequestId{3}, RequestId{5}}) {
      for (TieredKVBuffer* b : {&host, &device}) b->admission().add_request(id, RequestPages{2, 0});
      for (std::uint32_t l = 0; l < kShape.layers; ++l) {
        const std::uint32_t tokens = 150 + 37 * l + static_cast<std::uint32_t>(id);  // pages span the 64-page chunks
        std::vector<float> k(tokens * row), v(tokens * row);
        for (std::uint32_t t = 0; t < tokens; ++t) {
          for (std::uint32_t h = 0; h < kShape.kv_heads; ++h) {
            for (std::uint32_t d = 0; d < kShape.head_dim; ++d) {
              k[(t * kShape.kv_heads + h) * kShape.head_dim + d] = value(id, l, h, t, d, false);
              v[(t * kShape.kv_heads + h) * kShape.head_dim + d] = value(id, l, h, t, d, true);
            }
          }
        }
        const std::vector<PartitionSpec> specs{PartitionSpec::uniform(tokens, partition_tokens)};
        host.offloader().offload(id, l, KvChunk{k.data(), v.data(), tokens, DType::f32}, specs);
        device.offloader().offload_on_device(id, l, tokens, specs, placements);
        REQUIRE(placements.size() == std::size_t{tokens} * kShape.kv_heads);
        saver.set_destination(cpu_tier_destination(device.tiers().cpu_pool));
        prompt_row_targets(placements, KvBlock::k, targets);
        saver.save(reinterpret_cast<const std::byte*>(k.data()), k.size() * 4, targets, nullptr);
        prompt_row_targets(placements, KvBlock::v, targets);
        saver.save(reinterpret_cast<const std::byte*>(v.data()), v.size() * 4, targets, nullptr);
        saver.wait();
        REQUIRE(device.admission().sequence_length(id, l) == host.admission().sequence_length(id, l));
        for (std::uint32_t h = 0; h < kShape.kv_heads; ++h) {
          const std::uint32_t n = host.tiers().table.partition_count(id, l, h);
          REQUIRE(device.tiers().table.partition_count(id, l, h) == n);
          for (PartitionId p = 0; p < n; ++p) {
            REQUIRE(device.tiers().table.meta(id, l, h, p).bits == host.tiers().table.meta(id, l, h, p).bits);
            std::vector<PageId> want, got;
            host.tiers().table.cpu_pages(id, l, h, p, want);
            device.tiers().table.cpu_pages(id, l, h, p, got);
            REQUIRE(got == want);
          }
          for (std::uint32_t t = 0; t < tokens; ++t) {
            const TokenPlacement where = placements[std::size_t{t} * kShape.kv_heads + h];
            REQUIRE(row_matches(device.tiers().cpu_pool.data(where.cpu_page), where.slot, id, l, h, t));
            REQUIRE(row_matches(host.tiers().cpu_pool.data(where.cpu_page), where.slot, id, l, h, t));
          }
        }
      }
    }
    REQUIRE(device.tiers().cpu_pool.used() == host.tiers().cpu_pool.used());
    REQUIRE(device.tiers().stats.bytes_offloaded == host.tiers().stats.bytes_offloaded);
    device.validate();
    // Refusals change nothing.
    const std::uint32_t used = device.tiers().cpu_pool.used();
    REQUIRE_SPARSEKV_ERROR(
        device.offloader().offload_on_device(9, 0, 4, std::vector{PartitionSpec::uniform(4, kPageTokens)}, placements),
        ErrorCode::not_found);
    REQUIRE_SPARSEKV_ERROR(
        device.offloader().offload_on_device(3, 0, 5, std::vector{PartitionSpec::uniform(4, kPageTokens)}, placements),
        ErrorCode::invalid_argument);
    REQUIRE_SPARSEKV_ERROR(
        device.offloader().offload_on_device(3, 0, 0, std::vector{PartitionSpec::uniform(4, kPageTokens)}, placements),
        ErrorCode::invalid_argument);
    REQUIRE_SPARSEKV_ERROR(
        device.offloader().offload_on_device(3, 7, 4, std::vector{PartitionSpec::uniform(4, kPageTokens)}, placements),
        ErrorCode::out_of_range);
    REQUIRE(device.tiers().cpu_pool.used() == used);
  }
}

// The device prefill's per-element finiteness rule (buffer/prompt_check_cuda.hpp)
// agrees with the host prefill's check (std::isfinite of the fp32 value) on
// every dtype, over random bit patterns and the edge encodings.
TEST_CASE("element_is_finite matches the host prefill's check", "[buffer]") {
  std::mt19937 rng(5);
  for (const DType dtype : {DType::f32, DType::f16, DType::bf16}) {
    std::vector<std::uint32_t> words(4096);
    for (auto& w : words) w = static_cast<std::uint32_t>(rng());
    // Infinities, NaNs, the largest finite and zero in each encoding.
    for (const std::uint32_t w : {0x7f800000u, 0xff800000u, 0x7fc00001u, 0x7f7fffffu, 0u, 0x7c00u, 0xfc00u, 0x7e01u,
                                  0x7bffu, 0x7f80u, 0xff80u, 0x7fc1u, 0x7f7fu}) {
      words.push_back(w);
    }
    std::vector<std::byte> data(words.size() * dtype_size(dtype));
    for (std::size_t i = 0; i < words.size(); ++i)
      std::memcpy(&data[i * dtype_size(dtype)], &words[i], dtype_size(dtype));
    std::size_t bad = 0;
    for (std::size_t i = 0; i < words.size(); ++i) {
      const bool want = std::isfinite(load_element(data.data(), static_cast<std::uint32_t>(i), dtype));
      REQUIRE(cuda::element_is_finite(data.data(), i, dtype) == want);
      bad += !want;
    }
    REQUIRE(bad > 0);  // the sweep did reach non-finite values
  }
}
