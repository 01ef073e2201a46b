// The bucketed-LRU rules (Spin §5.3) shared by the host step and the CUDA
// kernel, and a host emulation of the kernel's data-parallel decomposition
// (sorted selection + binary search, exclusive scans, per-slot rules in an
// arbitrary order, tiled admission scan) against BucketedLru::step: tables,
// plans and stats must be identical. This is CI's coverage of the kernel logic
// (the emulation itself: lru_step_emulation.hpp).
#include <algorithm>
#include <map>
#include <numeric>
#include <random>
#include <vector>

#include "bucketed_lru_test_data.hpp"
#include "sparsekv/cache/bucketed_lru.hpp"
#include "deferred_backend.hpp"
#include "lru_step_emulation.hpp"
#include "sparsekv/buffer/transfer_replica_copy.hpp"
#include "sparsekv/cache/bucketed_lru_rules.hpp"
#include "sparsekv/metadata/gpu_tables_replica.hpp"
#include "test_support.hpp"

using namespace sparsekv;
using namespace sparsekv::test;

namespace {

GpuPageEntry entry(PartitionId p, std::uint8_t timestamp) { return {p, 7, 2, timestamp, 0}; }

}  // namespace

TEST_CASE("lru rules: top, demotion and the per-slot touch", "[lru-rules]") {
  REQUIRE(lru_top(2) == 1);
  REQUIRE(lru_top(64) == 63);
  REQUIRE(lru_top(256) == 255);
  REQUIRE(lru_demote(0) == 0);
  REQUIRE(lru_demote(1) == 0);
  REQUIRE(lru_demote(255) == 254);

  GpuPageEntry free_slot = entry(kInvalidPartition, 9);
  REQUIRE(lru_touch(free_slot, kNotSelected, 63) == LruTouch::free);
  REQUIRE(free_slot.timestamp == 9);  // an empty slot is left alone

  GpuPageEntry hit = entry(4, 10);
  REQUIRE(lru_touch(hit, 0, 63) == LruTouch::hit);
  REQUIRE(hit.timestamp == 63);
  REQUIRE(hit.partition == 4);

  GpuPageEntry aged = entry(4, 10);
  REQUIRE(lru_touch(aged, kNotSelected, 63) == LruTouch::aged);
  REQUIRE(aged.timestamp == 9);
  GpuPageEntry floor = entry(4, 0);
  REQUIRE(lru_touch(floor, kNotSelected, 63) == LruTouch::aged);
  REQUIRE(floor.timestamp == 0);
}

TEST_CASE("lru rules: threshold from the histogram and the shortfall", "[lru-rules]") {
  const std::uint32_t histogram[4] = {2, 0, 3, 1};
  REQUIRE(lru_threshold(histogram, 4, 0, 0) == -1);  // nothing to admit
  REQUIRE(lru_threshold(histogram, 4, 5, 5) == -1);  // free slots cover the demand
  REQUIRE(lru_threshold(histogram, 4, 6, 5) == 0);   // shortfall 1: bucket 0 has 2
  REQUIRE(lru_threshold(histogram, 4, 2, 0) == 0);
  REQUIRE(lru_threshold(histogram, 4, 3, 0) == 2);  // 2 + 0 < 3 <= 2 + 0 + 3: empty bucket 1 skipped
  REQUIRE(lru_threshold(histogram, 4, 5, 0) == 2);
  // Never past T-2: unselected pages were demoted below the top.
  REQUIRE(lru_threshold(histogram, 4, 9, 0) == 2);
  const std::uint32_t two[2] = {0, 5};
  REQUIRE(lru_threshold(two, 2, 3, 0) == 0);
}

TEST_CASE("lru rules: eviction predicate, eviction, admission, residency", "[lru-rules]") {
  REQUIRE(lru_may_evict(entry(3, 2), 2));
  REQUIRE_FALSE(lru_may_evict(entry(3, 3), 2));
  REQUIRE_FALSE(lru_may_evict(entry(kInvalidPartition, 0), 2));
  REQUIRE_FALSE(lru_may_evict(entry(3, 0), -1));
  REQUIRE(lru_evicts(entry(3, 1), kNotSelected, 2));
  REQUIRE_FALSE(lru_evicts(entry(3, 1), 5, 2));  // selected pages stay
  REQUIRE_FALSE(lru_evicts(entry(3, 3), kNotSelected, 2));

  GpuPageEntry e = entry(3, 1);
  MetaPartitionEntry m = MetaPartitionEntry::make(37, true);
  lru_evict(e, m);
  REQUIRE_FALSE(e.occupied());
  REQUIRE(e.gpu_page == 7);  // the slot keeps its GPU page
  REQUIRE_FALSE(m.resident());
  REQUIRE(m.token_count() == 37);

  lru_admit(e, 11, 300, 63);
  REQUIRE(e.partition == 11);
  REQUIRE(e.page_in_partition == 300);
  REQUIRE(e.timestamp == 63);
  REQUIRE(e.gpu_page == 7);
  lru_set_resident(m);
  REQUIRE(m.resident());
  REQUIRE(m.token_count() == 37);
}

TEST_CASE("lru rules: the k-th free slot maps to the host's admission cursor", "[lru-rules]") {
  const std::uint32_t starts[4] = {0, 3, 4, 9};  // misses of 3, 1, 5 and 2 pages
  const std::pair<std::uint32_t, LruAdmission> expected[] = {{0, {0, 0}}, {2, {0, 2}}, {3, {1, 0}}, {4, {2, 0}},
                                                             {8, {2, 4}}, {9, {3, 0}}, {10, {3, 1}}};
  for (const auto& [k, want] : expected) {
    const LruAdmission got = lru_admission(k, starts, 4);
    REQUIRE(got.miss == want.miss);
    REQUIRE(got.page == want.page);
  }
  std::mt19937 rng(17);
  for (int round = 0; round < 200; ++round) {
    std::vector<std::uint32_t> pages(1 + rng() % 40);
    for (auto& p : pages) p = 1 + rng() % 6;
    std::vector<std::uint32_t> miss_starts(pages.size());
    std::exclusive_scan(pages.begin(), pages.end(), miss_starts.begin(), 0u);
    // The host's sequential cursor.
    std::uint32_t k = 0;
    for (std::uint32_t j = 0; j < pages.size(); ++j) {
      for (std::uint32_t q = 0; q < pages[j]; ++q, ++k) {
        const LruAdmission a = lru_admission(k, miss_starts.data(), static_cast<std::uint32_t>(pages.size()));
        REQUIRE(a.miss == j);
        REQUIRE(a.page == q);
      }
    }
  }
}

TEST_CASE("lru rules: selection lookup in a sorted selection", "[lru-rules]") {
  std::mt19937 rng(5);
  for (int round = 0; round < 200; ++round) {
    const std::uint32_t universe = 1 + rng() % 300;
    std::vector<PartitionId> selection(universe);
    std::iota(selection.begin(), selection.end(), PartitionId{0});
    std::shuffle(selection.begin(), selection.end(), rng);
    selection.resize(rng() % (universe + 1));
    const auto [sorted, indices] = sort_selection(selection.data(), static_cast<std::uint32_t>(selection.size()));
    std::map<PartitionId, std::uint32_t> expected;
    for (std::uint32_t i = 0; i < selection.size(); ++i) expected[selection[i]] = i;
    for (PartitionId p = 0; p <= universe; ++p) {
      const auto it = expected.find(p);
      const std::uint32_t got =
          lru_find_selection(sorted.data(), indices.data(), static_cast<std::uint32_t>(sorted.size()), p);
      REQUIRE(got == (it == expected.end() ? kNotSelected : it->second));
    }
    REQUIRE(lru_find_selection(sorted.data(), indices.data(), static_cast<std::uint32_t>(sorted.size()),
                               kInvalidPartition) == kNotSelected);
  }
}

// The kernel pads a selection with kInvalidPartition and radix-sorts it over
// the low lru_sort_bits(max id) bits only: a stable sort by those bits must
// give the full sort, padding last.
TEST_CASE("lru rules: a sort over lru_sort_bits orders the selection before its padding", "[lru-rules]") {
  REQUIRE(lru_sort_bits(0) == 1);
  REQUIRE(lru_sort_bits(1) == 2);
  REQUIRE(lru_sort_bits(2) == 2);
  REQUIRE(lru_sort_bits(3) == 3);
  REQUIRE(lru_sort_bits(1023) == 11);
  REQUIRE(lru_sort_bits(kInvalidPartition - 1) == 32);
  std::mt19937 rng(11);
  for (int round = 0; round < 300; ++round) {
    const PartitionId universe = round % 3 == 0   ? 1 + rng() % 64
                                 : round % 3 == 1 ? 1 + rng() % 5000
                                                  : 1 + rng() % 0xfffffffeu;
    std::vector<PartitionId> keys;
    for (std::uint32_t i = 0, n = 1 + rng() % 40; i < n; ++i) keys.push_back(rng() % universe);
    std::sort(keys.begin(), keys.end());
    keys.erase(std::unique(keys.begin(), keys.end()), keys.end());
    std::vector<PartitionId> want = keys;
    std::shuffle(keys.begin(), keys.end(), rng);
    const int bits = lru_sort_bits(want.back());
    const std::uint64_t mask = (std::uint64_t{1} << bits) - 1;
    keys.resize(keys.size() + 1 + rng() % 8, kInvalidPartition);
    std::stable_sort(keys.begin(), keys.end(),
                     [mask](PartitionId a, PartitionId b) { return (a & mask) < (b & mask); });
    want.resize(keys.size(), kInvalidPartition);
    CAPTURE(round, universe, bits);
    REQUIRE(keys == want);
  }
}

namespace {

void require_same_tables(const HierarchicalPageTable& a, const HierarchicalPageTable& b,
                         const std::vector<Head>& heads) {
  for (const Head& h : heads) {
    REQUIRE(b.gpu_slots(h.request, h.layer, h.head) == a.gpu_slots(h.request, h.layer, h.head));
    require_same_head(a, b, h);
  }
}

}  // namespace

TEST_CASE("lru emulation: the kernel's decomposition reproduces BucketedLru::step", "[lru-rules]") {
  const std::uint32_t bucket_choices[] = {2, 3, 4, 8, 64, 256};
  const std::uint32_t tile_choices[] = {1, 7, 32, 256};
  LruTotals totals;
  for (std::uint32_t seed = 1; seed <= 24; ++seed) {
    HostMemoryResource memory(false);
    HierarchicalPageTable host_table(emulation_geometry(), memory, memory);
    HierarchicalPageTable emu_table(emulation_geometry(), memory, memory);
    build_emulation_table(host_table, seed);
    build_emulation_table(emu_table, seed);
    std::mt19937 rng(seed * 7919);
    const std::uint32_t buckets = bucket_choices[seed % 6];
    BucketedLru lru(buckets);
    std::vector<Head> all;
    const PageTableGeometry& g = host_table.geometry();
    for (RequestId r = 0; r < g.max_requests; ++r) {
      for (std::uint32_t l = 0; l < g.layers; ++l) {
        for (std::uint32_t h = 0; h < g.kv_heads; ++h) all.push_back({r * 10 + 3, l, h});
      }
    }
    for (int step = 0; step < 40; ++step) {
      // A random subset of the heads, in random order, one launch.
      std::vector<Head> heads = all;
      std::shuffle(heads.begin(), heads.end(), rng);
      heads.resize(1 + rng() % heads.size());
      const double hit_share = std::uniform_real_distribution<double>(0.2, 0.95)(rng);
      HostStepBatch batch;
      for (const Head& h : heads) {
        batch.add(lru, host_table, emu_table, h, random_selection(host_table, h, rng, hit_share));
      }
      LaunchOutput out;
      emulate_lru_step(emu_table.gpu_page_view(), emu_table.lookup(), buckets, batch.instances, batch.selection_offsets,
                       batch.selected_all, batch.page_offsets, tile_choices[rng() % 4], rng, out);

      INFO("seed " << seed << " step " << step << " buckets " << buckets);
      require_same_launch(out, batch, totals);
      require_same_tables(host_table, emu_table, all);
      emu_table.validate();
    }
  }
  // The random steps exercised every branch: hits, misses and evictions.
  REQUIRE(totals.evicted > 1000);
  REQUIRE(totals.hits > 1000);
  REQUIRE(totals.misses > 1000);
}

TEST_CASE("lru emulation on a GpuTablesReplica: replicated tables stand in for the host's and come back intact",
          "[lru-rules]") {
  const std::uint32_t bucket_choices[] = {2, 8, 64, 256};
  LruTotals totals;
  std::uint64_t uploads_after_growth = 0;
  for (std::uint32_t seed = 1; seed <= 8; ++seed) {
    HostMemoryResource memory(false), replica_memory(false);
    HierarchicalPageTable host_table(emulation_geometry(), memory, memory);
    HierarchicalPageTable master(emulation_geometry(), memory, memory);
    build_emulation_table(host_table, seed);
    build_emulation_table(master, seed);
    // Copies land only at synchronize(), as on a stream: the replica is read
    // before its uploads complete only if the code forgets to order them.
    test::DeferredTransfer transfer;
    TransferReplicaCopy copy(transfer);
    GpuTablesReplica replica(master, replica_memory, copy);
    const PageTableGeometry& g = master.geometry();
    std::vector<Head> all;
    std::vector<RequestId> requests;
    for (RequestId r = 0; r < g.max_requests; ++r) {
      requests.push_back(r * 10 + 3);
      replica.upload(master, r * 10 + 3, copy);
      for (std::uint32_t l = 0; l < g.layers; ++l) {
        for (std::uint32_t h = 0; h < g.kv_heads; ++h) all.push_back({r * 10 + 3, l, h});
      }
    }
    std::mt19937 rng(seed * 104729);
    const std::uint32_t buckets = bucket_choices[seed % 4];
    BucketedLru lru(buckets);
    PageId fresh = 1u << 24;  // GPU page ids no table uses yet
    for (int step = 0; step < 30; ++step) {
      std::vector<Head> heads = all;
      std::shuffle(heads.begin(), heads.end(), rng);
      heads.resize(1 + rng() % heads.size());
      HostStepBatch batch;
      for (const Head& h : heads) batch.add(lru, host_table, master, h, random_selection(host_table, h, rng, 0.6));
      transfer.synchronize();  // the launch runs after the uploads on the same stream
      LaunchOutput out;
      emulate_lru_step(replica.gpu_page_view(), replica.lookup(master), buckets, batch.instances,
                       batch.selection_offsets, batch.selected_all, batch.page_offsets, 1 + rng() % 64, rng, out);
      INFO("seed " << seed << " step " << step);
      require_same_launch(out, batch, totals);
      if (step % 5 != 4) continue;
      // Host bookkeeping: bring the kernel's writes back, compare, then grow a
      // head's buffer on the master (new slots, new segments) and upload it.
      const RequestId grown = requests[rng() % requests.size()];
      replica.download(master, grown, copy);
      for (const Head& h : all) {
        if (h.request == grown) require_same_head(host_table, master, h);
      }
      const Head h{grown, static_cast<std::uint32_t>(rng() % g.layers), static_cast<std::uint32_t>(rng() % g.kv_heads)};
      const std::uint32_t slots = host_table.gpu_slots(h.request, h.layer, h.head);
      const std::uint32_t more = std::min(1 + static_cast<std::uint32_t>(rng() % 40), g.max_gpu_pages_per_head - slots);
      for (HierarchicalPageTable* t : {&host_table, &master}) {
        t->resize_gpu_slots(h.request, h.layer, h.head, slots + more);
        for (std::uint32_t s = slots; s < slots + more; ++s) {
          t->set_gpu_entry(h.request, h.layer, h.head, s, {kInvalidPartition, fresh + s, 0, 0, 0});
        }
      }
      fresh += 1u << 12;
      replica.upload(master, grown, copy);
      uploads_after_growth += more > 0;
    }
    for (RequestId r : requests) replica.download(master, r, copy);
    require_same_tables(host_table, master, all);
    master.validate();
  }
  REQUIRE(totals.hits > 500);
  REQUIRE(totals.misses > 500);
  REQUIRE(totals.evicted > 100);
  REQUIRE(uploads_after_growth > 20);
}
