#include <algorithm>
#include <map>
#include <random>
#include <tuple>
#include <vector>

#include "sparsekv/metadata/hierarchical_page_table.hpp"
#include "sparsekv/metadata/replica_writes_cuda.hpp"
#include "sparsekv/metadata/table_replica.hpp"
#include "sparsekv/buffer/transfer_replica_copy.hpp"
#include "sparsekv/transfer/page_transfer.hpp"
#include "test_support.hpp"

using namespace sparsekv;

namespace {

PageTableGeometry small_geometry() {
  PageTableGeometry g;
  g.max_requests = 4;
  g.layers = 2;
  g.kv_heads = 2;
  g.page_tokens = 4;
  g.max_partitions_per_head = 200;
  g.max_cpu_pages_per_head = 400;
  g.max_gpu_pages_per_head = 96;
  g.segment_entries = 32;
  // Small pools, so that exhaustion happens during the random walk.
  g.meta_segments = 16;
  g.offset_segments = 16;
  g.cpu_page_segments = 28;
  g.gpu_page_segments = 10;
  return g;
}

struct PartitionRef {
  std::uint32_t tokens;
  bool resident;
  std::vector<PageId> pages;
};
struct HeadRef {
  std::vector<PartitionRef> partitions;
  std::vector<GpuPageEntry> slots;
};
using Key = std::tuple<RequestId, std::uint32_t, std::uint32_t>;

// The whole observable state of a table, for "changes nothing" checks.
struct Snapshot {
  std::map<Key, HeadRef> heads;
  MetadataBytes bytes;
  bool operator==(const Snapshot& o) const {
    if (heads.size() != o.heads.size()) return false;
    for (const auto& [key, head] : heads) {
      const auto it = o.heads.find(key);
      if (it == o.heads.end() || it->second.partitions.size() != head.partitions.size() ||
          it->second.slots.size() != head.slots.size()) {
        return false;
      }
      for (std::size_t p = 0; p < head.partitions.size(); ++p) {
        const auto& a = head.partitions[p];
        const auto& b = it->second.partitions[p];
        if (a.tokens != b.tokens || a.resident != b.resident || a.pages != b.pages) return false;
      }
      for (std::size_t s = 0; s < head.slots.size(); ++s) {
        const auto& a = head.slots[s];
        const auto& b = it->second.slots[s];
        if (a.partition != b.partition || a.gpu_page != b.gpu_page || a.page_in_partition != b.page_in_partition ||
            a.timestamp != b.timestamp) {
          return false;
        }
      }
    }
    return bytes.gpu_mapped == o.bytes.gpu_mapped && bytes.cpu_mapped == o.bytes.cpu_mapped;
  }
};

Snapshot snapshot(const HierarchicalPageTable& table, const std::vector<RequestId>& requests) {
  Snapshot s;
  const auto& g = table.geometry();
  for (RequestId r : requests) {
    for (std::uint32_t l = 0; l < g.layers; ++l) {
      for (std::uint32_t h = 0; h < g.kv_heads; ++h) {
        HeadRef& head = s.heads[{r, l, h}];
        for (PartitionId p = 0; p < table.partition_count(r, l, h); ++p) {
          PartitionRef part{table.meta(r, l, h, p).token_count(), table.meta(r, l, h, p).resident(), {}};
          table.cpu_pages(r, l, h, p, part.pages);
          head.partitions.push_back(part);
        }
        for (std::uint32_t slot = 0; slot < table.gpu_slots(r, l, h); ++slot) {
          head.slots.push_back(table.gpu_entry(r, l, h, slot));
        }
      }
    }
  }
  s.bytes = table.bytes();
  return s;
}

}  // namespace

TEST_CASE("HierarchicalPageTable random map/unmap matches a std::map reference", "[metadata][random]") {
  for (const std::uint32_t seed : {7u, 8u, 9u}) {
    HostMemoryResource memory(false);
    const PageTableGeometry g = small_geometry();
    HierarchicalPageTable table(g, memory, memory);
    std::mt19937 rng(seed);
    std::map<Key, HeadRef> ref;
    std::vector<RequestId> requests;
    PageId next_page = 0;
    PageId next_gpu_page = 0;
    std::uint64_t exhausted = 0, admitted = 0;
    const auto pick = [&](std::size_t n) { return std::uniform_int_distribution<std::size_t>(0, n - 1)(rng); };
    // What a finishing request does before it leaves the table: evict, shrink, unmap.
    const auto drain = [&](RequestId r) {
      for (std::uint32_t l = 0; l < g.layers; ++l) {
        for (std::uint32_t h = 0; h < g.kv_heads; ++h) {
          HeadRef& head = ref[{r, l, h}];
          for (std::uint32_t s = 0; s < head.slots.size(); ++s) table.set_gpu_entry(r, l, h, s, GpuPageEntry{});
          for (PartitionId p = 0; p < head.partitions.size(); ++p) table.set_resident(r, l, h, p, false);
          table.resize_gpu_slots(r, l, h, 0);
          table.clear_partitions(r, l, h);
        }
      }
    };
    const auto page_count = [&](std::uint32_t tokens) { return (tokens + g.page_tokens - 1) / g.page_tokens; };

    for (int op = 0; op < 30000; ++op) {
      const int kind = std::uniform_int_distribution<int>(0, 19)(rng);
      const Snapshot before = snapshot(table, requests);
      bool must_be_unchanged = false;
      if (kind == 0 || requests.empty()) {
        const RequestId id = 100 + pick(8);
        if (std::find(requests.begin(), requests.end(), id) != requests.end()) {
          REQUIRE_SPARSEKV_ERROR(table.add_request(id), ErrorCode::already_exists);
          must_be_unchanged = true;
        } else if (requests.size() == g.max_requests) {
          REQUIRE_SPARSEKV_ERROR(table.add_request(id), ErrorCode::resource_exhausted);
          must_be_unchanged = true;
        } else {
          table.add_request(id);
          requests.push_back(id);
          for (std::uint32_t l = 0; l < g.layers; ++l)
            for (std::uint32_t h = 0; h < g.kv_heads; ++h) ref[{id, l, h}] = {};
        }
      } else if (kind == 1 && pick(4) == 0) {
        const std::size_t i = pick(requests.size());
        const bool mapped = std::any_of(ref.begin(), ref.end(), [&](const auto& kv) {
          return std::get<0>(kv.first) == requests[i] && (!kv.second.partitions.empty() || !kv.second.slots.empty());
        });
        if (mapped) {  // refused while pages are mapped; nothing changes
          REQUIRE_SPARSEKV_ERROR(table.remove_request(requests[i]), ErrorCode::failed_precondition);
          REQUIRE(snapshot(table, requests) == before);
          drain(requests[i]);
        }
        table.remove_request(requests[i]);
        for (std::uint32_t l = 0; l < g.layers; ++l)
          for (std::uint32_t h = 0; h < g.kv_heads; ++h) ref.erase({requests[i], l, h});
        requests.erase(requests.begin() + static_cast<std::ptrdiff_t>(i));
      } else {
        const RequestId r = requests[pick(requests.size())];
        const std::uint32_t l = static_cast<std::uint32_t>(pick(g.layers));
        const std::uint32_t h = static_cast<std::uint32_t>(pick(g.kv_heads));
        HeadRef& head = ref[{r, l, h}];
        if (kind <= 6) {  // map: append partitions
          std::vector<std::uint32_t> tokens(1 + pick(12));
          std::vector<PageId> pages;
          for (auto& t : tokens) {
            t = 1 + static_cast<std::uint32_t>(pick(3 * g.page_tokens));
            for (std::uint32_t i = 0; i < page_count(t); ++i) pages.push_back(next_page++);
          }
          try {
            table.append_partitions(r, l, h, tokens, pages);
            std::size_t k = 0;
            for (auto t : tokens) {
              PartitionRef part{t, false, {}};
              for (std::uint32_t i = 0; i < page_count(t); ++i) part.pages.push_back(pages[k++]);
              head.partitions.push_back(part);
            }
          } catch (const Error& e) {
            REQUIRE(e.code() == ErrorCode::resource_exhausted);
            ++exhausted;
            must_be_unchanged = true;
          }
        } else if (kind == 7) {  // unmap one head
          const bool any_resident = std::any_of(head.partitions.begin(), head.partitions.end(),
                                                [](const PartitionRef& p) { return p.resident; });
          const bool any_cached =
              std::any_of(head.slots.begin(), head.slots.end(), [](const GpuPageEntry& e) { return e.occupied(); });
          REQUIRE(any_cached == any_resident);
          if (any_cached) {
            REQUIRE_SPARSEKV_ERROR(table.clear_partitions(r, l, h), ErrorCode::failed_precondition);
            must_be_unchanged = true;
          } else {
            table.clear_partitions(r, l, h);
            head.partitions.clear();
          }
        } else if (kind <= 9) {  // resize the GPU buffer
          const auto slots = static_cast<std::uint32_t>(pick(g.max_gpu_pages_per_head + 1));
          bool tail_occupied = false;
          for (std::size_t s = slots; s < head.slots.size(); ++s) tail_occupied |= head.slots[s].occupied();
          try {
            table.resize_gpu_slots(r, l, h, slots);
            REQUIRE_FALSE(tail_occupied);
            head.slots.resize(slots);
          } catch (const Error& e) {
            REQUIRE((tail_occupied ? e.code() == ErrorCode::failed_precondition
                                   : e.code() == ErrorCode::resource_exhausted));
            must_be_unchanged = true;
          }
        } else if (kind <= 12 && !head.partitions.empty()) {  // admit a partition into free slots
          const auto p = static_cast<PartitionId>(pick(head.partitions.size()));
          std::vector<std::uint32_t> free_slots;
          for (std::uint32_t s = 0; s < head.slots.size(); ++s)
            if (!head.slots[s].occupied()) free_slots.push_back(s);
          if (!head.partitions[p].resident && free_slots.size() >= head.partitions[p].pages.size()) {
            for (std::uint16_t i = 0; i < head.partitions[p].pages.size(); ++i) {
              GpuPageEntry e{p, next_gpu_page++, i, static_cast<std::uint8_t>(pick(64)), 0};
              table.set_gpu_entry(r, l, h, free_slots[i], e);
              head.slots[free_slots[i]] = e;
            }
            table.set_resident(r, l, h, p, true);
            head.partitions[p].resident = true;
            ++admitted;
          }
        } else if (kind <= 14 && !head.partitions.empty()) {  // evict a partition
          const auto p = static_cast<PartitionId>(pick(head.partitions.size()));
          if (head.partitions[p].resident) {
            for (std::uint32_t s = 0; s < head.slots.size(); ++s) {
              if (head.slots[s].partition == p) {
                table.set_gpu_entry(r, l, h, s, GpuPageEntry{});
                head.slots[s] = GpuPageEntry{};
              }
            }
            table.set_resident(r, l, h, p, false);
            head.partitions[p].resident = false;
          }
        } else if (kind <= 17) {  // bad input: changes nothing
          must_be_unchanged = true;
          switch (pick(6)) {
            case 0:
              REQUIRE_SPARSEKV_ERROR(table.partition_count(9999, l, h), ErrorCode::not_found);
              break;
            case 1:
              REQUIRE_SPARSEKV_ERROR(table.partition_count(r, g.layers, h), ErrorCode::out_of_range);
              break;
            case 2: {
              std::vector<PageId> out;
              REQUIRE_SPARSEKV_ERROR(table.cpu_pages(r, l, g.kv_heads + 1, 0, out), ErrorCode::out_of_range);
              REQUIRE_SPARSEKV_ERROR(table.cpu_pages(r, l, h, static_cast<PartitionId>(head.partitions.size()), out),
                                     ErrorCode::out_of_range);
              REQUIRE(out.empty());
              break;
            }
            case 3: {
              const std::vector<std::uint32_t> tokens{5, 0};  // an empty partition
              const std::vector<PageId> pages{1, 2};
              REQUIRE_SPARSEKV_ERROR(table.append_partitions(r, l, h, tokens, pages), ErrorCode::invalid_argument);
              break;
            }
            case 4: {
              const std::vector<std::uint32_t> tokens{2 * g.page_tokens};  // needs two pages, one given
              const std::vector<PageId> pages{1};
              REQUIRE_SPARSEKV_ERROR(table.append_partitions(r, l, h, tokens, pages), ErrorCode::invalid_argument);
              break;
            }
            default: {
              GpuPageEntry e{static_cast<PartitionId>(head.partitions.size()), 1, 0, 0, 0};
              if (!head.slots.empty()) {
                REQUIRE_SPARSEKV_ERROR(table.set_gpu_entry(r, l, h, 0, e), ErrorCode::out_of_range);
              }
              REQUIRE_SPARSEKV_ERROR(table.set_gpu_entry(r, l, h, static_cast<std::uint32_t>(head.slots.size()), e),
                                     ErrorCode::out_of_range);
            }
          }
        } else {  // lookups of random partitions against the reference
          for (int i = 0; i < 4 && !head.partitions.empty(); ++i) {
            const auto p = static_cast<PartitionId>(pick(head.partitions.size()));
            std::vector<PageId> pages;
            table.cpu_pages(r, l, h, p, pages);
            REQUIRE(pages == head.partitions[p].pages);
            REQUIRE(table.page_count(r, l, h, p) == head.partitions[p].pages.size());
            REQUIRE(table.meta(r, l, h, p).token_count() == head.partitions[p].tokens);
          }
        }
      }
      REQUIRE_NOTHROW(table.validate());
      const Snapshot after = snapshot(table, requests);
      if (must_be_unchanged) REQUIRE(after == before);
      if (op % 500 == 0 || must_be_unchanged) {
        Snapshot expected;
        expected.heads = ref;
        expected.bytes = after.bytes;
        REQUIRE(after == expected);
      }
    }
    // The walk must have exercised exhaustion and admission, or it proved little.
    REQUIRE(exhausted > 0);
    REQUIRE(admitted > 100);
    for (RequestId r : requests) {
      drain(r);
      table.remove_request(r);
    }
    table.validate();
    const MetadataBytes empty = table.bytes();
    REQUIRE(empty.gpu_mapped < empty.gpu_reserved);
    // Only directories remain mapped once every request is gone.
    HierarchicalPageTable fresh(g, memory, memory);
    REQUIRE(empty.gpu_mapped == fresh.bytes().gpu_mapped);
    REQUIRE(empty.cpu_mapped == fresh.bytes().cpu_mapped);
  }
}

TEST_CASE("HierarchicalPageTable segments follow the mapped entries", "[metadata]") {
  HostMemoryResource memory(false);
  PageTableGeometry g = small_geometry();
  HierarchicalPageTable table(g, memory, memory);
  const MetadataBytes empty = table.bytes();
  table.add_request(1);
  std::vector<std::uint32_t> tokens(33, g.page_tokens);  // 33 one-page partitions: two segments each
  std::vector<PageId> pages(33);
  for (PageId i = 0; i < 33; ++i) pages[i] = i;
  table.append_partitions(1, 1, 0, tokens, pages);
  const MetadataBytes mapped = table.bytes();
  const std::size_t seg = g.segment_entries;
  REQUIRE(mapped.gpu_mapped - empty.gpu_mapped == 2 * seg * sizeof(MetaPartitionEntry));
  REQUIRE(mapped.cpu_mapped - empty.cpu_mapped == 2 * seg * (sizeof(PartitionOffset) + sizeof(CpuPageEntry)));
  REQUIRE(mapped.gpu_reserved == empty.gpu_reserved);  // pools are pre-allocated
  table.resize_gpu_slots(1, 1, 0, 40);
  REQUIRE(table.bytes().gpu_mapped - mapped.gpu_mapped == 2 * seg * sizeof(GpuPageEntry));
  table.resize_gpu_slots(1, 1, 0, 10);
  REQUIRE(table.bytes().gpu_mapped - mapped.gpu_mapped == seg * sizeof(GpuPageEntry));
  // A slot that owns a GPU page is never dropped silently.
  table.set_gpu_entry(1, 1, 0, 9, GpuPageEntry{kInvalidPartition, 5, 0, 0, 0});
  REQUIRE_SPARSEKV_ERROR(table.resize_gpu_slots(1, 1, 0, 9), ErrorCode::failed_precondition);
  REQUIRE(table.gpu_slots(1, 1, 0) == 10);
  REQUIRE_SPARSEKV_ERROR(table.remove_request(1), ErrorCode::failed_precondition);
  table.set_gpu_entry(1, 1, 0, 9, GpuPageEntry{});
  table.resize_gpu_slots(1, 1, 0, 0);
  // An occupied slot keeps its head's partitions from being cleared.
  table.resize_gpu_slots(1, 1, 0, 1);
  table.set_gpu_entry(1, 1, 0, 0, GpuPageEntry{3, 8, 0, 0, 0});
  REQUIRE_SPARSEKV_ERROR(table.clear_partitions(1, 1, 0), ErrorCode::failed_precondition);
  REQUIRE(table.partition_count(1, 1, 0) == 33);
  table.set_gpu_entry(1, 1, 0, 0, GpuPageEntry{});
  table.resize_gpu_slots(1, 1, 0, 0);
  table.clear_partitions(1, 1, 0);
  table.remove_request(1);
  REQUIRE(table.bytes().gpu_mapped == empty.gpu_mapped);
  REQUIRE(table.bytes().cpu_mapped == empty.cpu_mapped);
}

TEST_CASE("HierarchicalPageTable request slots and bad input", "[metadata][errors]") {
  HostMemoryResource memory(false);
  HierarchicalPageTable table(small_geometry(), memory, memory);
  for (RequestId r = 1; r <= 4; ++r) table.add_request(r);
  REQUIRE_SPARSEKV_ERROR(table.add_request(5), ErrorCode::resource_exhausted);
  REQUIRE_SPARSEKV_ERROR(table.add_request(2), ErrorCode::already_exists);
  REQUIRE_SPARSEKV_ERROR(table.remove_request(42), ErrorCode::not_found);
  table.remove_request(3);
  table.add_request(5);  // the freed slot is reused
  REQUIRE(table.request_count() == 4);
  // A partition larger than 2^16 pages cannot be numbered in GpuPageEntry.
  const std::vector<std::uint32_t> huge{(1u << 16) * 4 + 1};
  REQUIRE_SPARSEKV_ERROR(table.append_partitions(1, 0, 0, huge, {}), ErrorCode::invalid_argument);
  // Per-head maximum of partitions.
  const std::vector<std::uint32_t> many(201, 1);
  const std::vector<PageId> pages(201, 0);
  REQUIRE_SPARSEKV_ERROR(table.append_partitions(1, 0, 0, many, pages), ErrorCode::resource_exhausted);
  REQUIRE(table.partition_count(1, 0, 0) == 0);
  PageTableGeometry bad = small_geometry();
  bad.segment_entries = 48;
  REQUIRE_SPARSEKV_ERROR(HierarchicalPageTable(bad, memory, memory), ErrorCode::invalid_argument);
  bad = small_geometry();
  bad.meta_segments = 0;
  REQUIRE_SPARSEKV_ERROR(HierarchicalPageTable(bad, memory, memory), ErrorCode::invalid_argument);
}

TEST_CASE("PageTableGeometry from Config sizes pools by tier capacity", "[metadata]") {
  Config config;
  config.cpu_tier_bytes = std::size_t{1} << 30;
  config.gpu_tier_bytes = std::size_t{1} << 28;
  config.max_requests = 8;
  const ModelShape shape{4, 8, 2, 128, DType::bf16};
  const auto g = PageTableGeometry::for_config(config, shape);
  const std::size_t page = config.page_bytes(shape);
  const std::size_t heads = std::size_t{8} * 4 * 2;
  REQUIRE(g.cpu_page_segments == (config.cpu_tier_bytes / page + 255) / 256 + heads);
  REQUIRE(g.gpu_page_segments == (config.gpu_tier_bytes / page + 255) / 256 + heads);
  REQUIRE(g.max_partitions_per_head == config.max_pages_per_head());
  HostMemoryResource memory(false);
  HierarchicalPageTable table(g, memory, memory);  // constructible as sized
  REQUIRE(table.bytes().gpu_reserved > 0);
  config.page_tokens = 3;
  REQUIRE_SPARSEKV_ERROR(PageTableGeometry::for_config(config, shape), ErrorCode::invalid_argument);
}

TEST_CASE("TableReplica entry writes: appended entries reach the replica, kernel-owned words stay", "[metadata]") {
  HostMemoryResource memory(false), replica_memory(false);
  HostPageTransfer transfer;
  HierarchicalPageTable master(small_geometry(), memory, memory);
  master.add_request(7);
  master.add_request(9);
  std::mt19937 rng(5);
  PageId next_page = 0;
  const auto append = [&](RequestId r, std::uint32_t layer, std::uint32_t head, std::uint32_t n) {
    std::vector<std::uint32_t> tokens(n);
    std::vector<PageId> pages;
    for (auto& t : tokens) {
      t = 1 + rng() % 9;
      for (std::uint32_t p = 0; p < (t + 3) / 4; ++p) pages.push_back(next_page++);
    }
    master.append_partitions(r, layer, head, tokens, pages);
  };
  append(7, 1, 0, 30);
  append(9, 0, 1, 5);
  TransferReplicaCopy copy(transfer);
  TableReplica<MetaPartitionEntry> replica(master.meta_table(), replica_memory, copy);
  replica.upload(master.meta_table(), master.instance(7, 1, 0), copy);
  replica.upload(master.meta_table(), master.instance(9, 0, 1), copy);
  const TwoLevelView<MetaPartitionEntry> view = replica.view();
  const std::size_t a = master.instance(7, 1, 0);
  // What a kernel owns in the replica: residency bits the master does not know.
  for (std::uint32_t p = 0; p < 30; p += 3) view.find(a, p)->bits |= MetaPartitionEntry::kResidentBit;
  std::vector<MetaPartitionEntry> kernel_state;
  for (std::uint32_t p = 0; p < 30; ++p) kernel_state.push_back(*view.find(a, p));

  // The host appends across a segment boundary (segment_entries 32) and in a
  // head that had none; the writes are snapshots applied later.
  append(7, 1, 0, 40);
  append(9, 1, 1, 3);
  std::vector<ReplicaWordWrite> writes;
  replica.entry_writes(master.meta_table(), a, 30, 40, writes);
  replica.entry_writes(master.meta_table(), master.instance(9, 1, 1), 0, 3, writes);
  REQUIRE(view.length(a) == 30);  // nothing lands before the writes are applied
  for (std::uint32_t i = 0; i < writes.size(); ++i) {
    cuda::apply_replica_write(writes.data(), static_cast<std::uint32_t>(writes.size()), 1u << 20, i);
  }
  REQUIRE(view.length(a) == 70);
  for (std::uint32_t p = 0; p < 70; ++p) {
    INFO("partition " << p);
    const MetaPartitionEntry want = p < 30 ? kernel_state[p] : master.meta(7, 1, 0, p);
    REQUIRE(view.find(a, p)->bits == want.bits);
  }
  const std::size_t b = master.instance(9, 1, 1);
  REQUIRE(view.length(b) == 3);
  for (std::uint32_t p = 0; p < 3; ++p) REQUIRE(view.find(b, p)->bits == master.meta(9, 1, 1, p).bits);
  // Writes past the count or the capacity are not applied.
  const std::uint32_t before = view.length(b);
  std::uint32_t word = before + 100;
  const ReplicaWordWrite extra{&word, 1};
  cuda::apply_replica_write(&extra, 0, 1, 0);
  cuda::apply_replica_write(&extra, 1, 0, 0);
  REQUIRE(word == before + 100);
  cuda::apply_replica_write(&extra, 1, 1, 0);
  REQUIRE(word == 1);
}
