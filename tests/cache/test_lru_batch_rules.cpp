// The glue from the Select kernels' fixed-stride output to the bucketed-LRU
// launch's batch (lru_batch_cuda.hpp) and the stats accumulation, in plain
// C++: host emulations of the kernels' decompositions (count blocks with a
// strided per-thread sum and a block reduction, two inclusive scans, fill
// blocks in any order; one block reducing the stats) against the host:
// BucketedLru::check's page counts, PageRetriever::check_selection and
// Retrieval::token_counts, and, chained into the LRU kernel's emulation,
// BucketedLru::step. This is CI's coverage of the glue kernels in
// cache_kernels.cu.
#include <algorithm>
#include <cstddef>
#include <numeric>
#include <random>
#include <vector>

#include "bucketed_lru_test_data.hpp"
#include "lru_batch_test_data.hpp"
#include "lru_step_emulation.hpp"
#include "sparsekv/buffer/tiered_kv_buffer.hpp"
#include "test_support.hpp"

using namespace sparsekv;
using namespace sparsekv::test;

TEST_CASE("lru batch rules: counts cut at the row, tokens and pages from the meta table", "[lru-batch-rules]") {
  HostMemoryResource memory(false);
  HierarchicalPageTable table(emulation_geometry(), memory, memory);
  build_emulation_table(table, 3);
  const PartitionLookup lookup = table.lookup();
  const std::size_t inst = table.instance(13, 1, 2);
  const std::uint32_t partitions = table.partition_count(13, 1, 2);
  // Row 0: every partition of the head, then two past its end; row 1: a corrupt count.
  std::vector<PartitionId> selected(2 * std::size_t{partitions + 2});
  std::iota(selected.begin(), selected.end() - (partitions + 2), PartitionId{0});
  std::iota(selected.end() - (partitions + 2), selected.end(), PartitionId{0});
  const std::uint32_t counts[] = {partitions + 2, 0xffffffffu};
  const std::size_t instances[] = {inst, inst};
  const cuda::LruBatchInput in{2, partitions + 2, selected.data(), counts, instances};
  REQUIRE(cuda::lru_batch_count(in, 0) == partitions + 2);
  REQUIRE(cuda::lru_batch_count(in, 1) == partitions + 2);
  for (std::uint32_t i = 0; i < partitions + 2; ++i) {
    const cuda::LruBatchSelection s = cuda::lru_batch_selection(lookup, in, 1, i);
    REQUIRE(s.partition == i);
    REQUIRE(s.pages == lookup.page_count(inst, i));
    REQUIRE(s.tokens == (i < partitions ? table.meta(13, 1, 2, i).token_count() : 0u));  // past the head: nothing
  }
  // Residency is not part of the token count.
  const MetaPartitionEntry before = table.meta(13, 1, 2, 0);
  table.set_resident(13, 1, 2, 0, true);
  REQUIRE(table.meta(13, 1, 2, 0).bits != before.bits);
  REQUIRE(cuda::lru_batch_selection(lookup, in, 0, 0).tokens == before.token_count());

  const CacheStepStats a{1, 2, 3, 4, 5};
  const CacheStepStats b{10, 20, 30, 40, 1ull << 40};
  CacheStepStats want = a;
  want += b;
  require_same_stats(cuda::step_stats_sum(a, b), want);
}

TEST_CASE("lru batch emulation: the CSR equals the host's and, chained, the LRU step equals BucketedLru::step",
          "[lru-batch-rules]") {
  const std::uint32_t bucket_choices[] = {2, 4, 64, 256};
  const std::uint32_t thread_choices[] = {1, 3, 32, cuda::kLruBatchThreads};
  LruTotals totals;
  std::uint64_t corrupt_counts = 0, empty_rows = 0;
  for (std::uint32_t seed = 1; seed <= 12; ++seed) {
    HostMemoryResource memory(false);
    HierarchicalPageTable host_table(emulation_geometry(), memory, memory);
    HierarchicalPageTable emu_table(emulation_geometry(), memory, memory);
    build_emulation_table(host_table, seed);
    build_emulation_table(emu_table, seed);
    std::mt19937 rng(seed * 6151);
    const std::uint32_t buckets = bucket_choices[seed % 4];
    BucketedLru lru(buckets);
    const PageTableGeometry& g = host_table.geometry();
    std::vector<Head> all;
    for (RequestId r = 0; r < g.max_requests; ++r)
      for (std::uint32_t l = 0; l < g.layers; ++l)
        for (std::uint32_t h = 0; h < g.kv_heads; ++h) all.push_back({r * 10 + 3, l, h});
    CacheStepStats host_total, device_total;
    for (int step = 0; step < 40; ++step) {
      std::vector<Head> heads = all;
      std::shuffle(heads.begin(), heads.end(), rng);
      heads.resize(1 + rng() % heads.size());
      const double hit_share = std::uniform_real_distribution<double>(0.2, 0.95)(rng);
      // The host path: check (the page counts), step, token counts.
      HostStepBatch batch;
      std::vector<std::vector<PartitionId>> rows;
      std::vector<std::uint32_t> tokens;
      for (const Head& h : heads) {
        rows.push_back(random_selection(host_table, h, rng, hit_share));
        for (PartitionId p : rows.back()) {
          tokens.push_back(host_table.meta(h.request, h.layer, h.head, p).token_count());
        }
        batch.add(lru, host_table, emu_table, h, rows.back());
        empty_rows += rows.back().empty() ? 1 : 0;
      }
      const std::uint32_t spare = rng() % 2 == 0 ? 0 : 1 + rng() % 4;
      const FixedStride select = fixed_stride(rows, batch.instances, longest_row(rows) + spare, rng);
      for (std::size_t r = 0; r < rows.size(); ++r) corrupt_counts += select.counts[r] != rows[r].size() ? 1 : 0;

      INFO("seed " << seed << " step " << step << " rows " << heads.size() << " max_selected " << select.max_selected);
      const LruBatchArrays glue = emulate_lru_batch(emu_table.lookup(), select.input(), thread_choices[rng() % 4], rng);
      require_same_csr(glue, batch.selection_offsets, batch.selected_all, batch.page_offsets, tokens);

      // Chained: the LRU kernel's emulation reads the glue's arrays as they are.
      LaunchOutput out;
      emulate_lru_step(emu_table.gpu_page_view(), emu_table.lookup(), buckets, select.instances, glue.selection_offsets,
                       glue.selected, glue.page_offsets, 1 + rng() % 64, rng, out);
      require_same_launch(out, batch, totals);
      for (const Head& h : all) require_same_head(host_table, emu_table, h);

      for (const CacheStepStats& s : batch.host_stats) host_total += s;
      emulate_accumulate(out.stats, device_total, rng);
      require_same_stats(device_total, host_total);
    }
    emu_table.validate();
  }
  REQUIRE(totals.hits > 1000);
  REQUIRE(totals.misses > 1000);
  REQUIRE(totals.evicted > 500);
  REQUIRE(corrupt_counts > 20);
  REQUIRE(empty_rows > 20);
}

TEST_CASE("lru batch emulation over a TieredKVBuffer: check_selection, page layout and token counts match retrieve",
          "[lru-batch-rules]") {
  constexpr ModelShape kShape{2, 4, 2, 8, DType::f32};
  constexpr std::uint32_t kPageTokens = 4;
  Config config;
  config.page_tokens = kPageTokens;
  config.cpu_tier_bytes = 4000 * config.page_bytes(kShape);
  config.gpu_tier_bytes = 2000 * config.page_bytes(kShape);
  config.host_chunk_bytes = 256 * config.page_bytes(kShape);
  config.max_requests = 4;
  config.max_context_tokens = 1024;
  config.min_buffer_ratio = 2.0;
  config.metadata_segment_entries = 32;
  std::size_t selections = 0;
  for (std::uint32_t seed = 1; seed <= 4; ++seed) {
    HostMemoryResource cpu(false), gpu(false);
    TieredKVBuffer buffer(kShape, config, cpu, gpu);
    std::mt19937 rng(seed * 811);
    // Requests whose prompts are uniform or clustered partitions of 1 .. 3 pages.
    std::vector<RequestId> requests;
    std::vector<std::uint32_t> budgets;
    for (RequestId id = 1; id <= 3; ++id) {
      const std::uint32_t mandatory = 4 + static_cast<std::uint32_t>(rng() % 40);
      buffer.admission().add_request(id, {mandatory, 0});
      requests.push_back(id);
      budgets.push_back(mandatory);
      for (std::uint32_t layer = 0; layer < kShape.layers; ++layer) {
        const auto tokens = static_cast<std::uint32_t>(40 + rng() % 200);
        std::vector<float> k(std::size_t{tokens} * kShape.kv_heads * kShape.head_dim, 1.0f), v(k.size(), 2.0f);
        std::vector<PartitionSpec> specs;
        for (std::uint32_t h = 0; h < kShape.kv_heads; ++h) {
          if (rng() % 2 == 0) {
            specs.push_back(PartitionSpec::uniform(tokens, 1 + static_cast<std::uint32_t>(rng() % (3 * kPageTokens))));
            continue;
          }
          std::vector<std::uint32_t> order(tokens);
          std::iota(order.begin(), order.end(), 0u);
          std::shuffle(order.begin(), order.end(), rng);
          std::vector<std::vector<std::uint32_t>> clusters;
          for (std::size_t i = 0; i < order.size();) {
            const std::size_t n = std::min<std::size_t>(1 + rng() % (3 * kPageTokens), order.size() - i);
            clusters.emplace_back(order.begin() + static_cast<std::ptrdiff_t>(i),
                                  order.begin() + static_cast<std::ptrdiff_t>(i + n));
            i += n;
          }
          specs.push_back(PartitionSpec::variable(tokens, clusters));
        }
        buffer.offloader().offload(id, layer, KvChunk{k.data(), v.data(), tokens, DType::f32}, specs);
      }
    }
    for (int step = 0; step < 30; ++step) {
      const auto layer = static_cast<std::uint32_t>(rng() % kShape.layers);
      // Rows r = b * kv_heads + h over the requests in batch order.
      std::vector<std::vector<PartitionId>> rows;
      std::vector<std::size_t> instances;
      for (std::size_t b = 0; b < requests.size(); ++b) {
        for (std::uint32_t h = 0; h < kShape.kv_heads; ++h) {
          const Head head{requests[b], layer, h};
          const Candidates c = shuffled_candidates(buffer.tiers().table, head, rng);
          rows.push_back(pick_selection(buffer.tiers().table, head, c,
                                        static_cast<std::uint32_t>(rng() % (budgets[b] + 1)), 400, rng, 0.5));
          instances.push_back(buffer.tiers().table.instance(requests[b], layer, h));
        }
      }
      const auto spare = static_cast<std::uint32_t>(rng() % 3);
      const FixedStride select = fixed_stride(rows, instances, longest_row(rows) + spare, rng);
      INFO("seed " << seed << " step " << step);
      const LruBatchArrays glue =
          emulate_lru_batch(buffer.tiers().table.lookup(), select.input(), cuda::kLruBatchThreads, rng);

      // The host path: check_selection, then retrieve, request by request.
      std::vector<std::uint32_t> selection_offsets{0}, page_offsets{0}, tokens;
      std::vector<PartitionId> selected;
      Retrieval retrieval;
      for (std::size_t b = 0; b < requests.size(); ++b) {
        const auto first_row = rows.begin() + static_cast<std::ptrdiff_t>(b * kShape.kv_heads);
        const std::vector<std::vector<PartitionId>> per_head(first_row, first_row + kShape.kv_heads);
        buffer.retriever().check_selection(requests[b], layer, per_head);
        buffer.retriever().retrieve(requests[b], layer, per_head, retrieval);
        for (std::uint32_t h = 0; h < kShape.kv_heads; ++h) {
          const std::uint32_t first = retrieval.head_offsets[h], last = retrieval.head_offsets[h + 1];
          selection_offsets.push_back(selection_offsets.back() + last - first);
          page_offsets.push_back(page_offsets.back() + retrieval.pages.partition_offsets[last] -
                                 retrieval.pages.partition_offsets[first]);
        }
        selected.insert(selected.end(), retrieval.partitions.begin(), retrieval.partitions.end());
        tokens.insert(tokens.end(), retrieval.token_counts.begin(), retrieval.token_counts.end());
      }
      require_same_csr(glue, selection_offsets, selected, page_offsets, tokens);
      selections += selected.size();
    }
    buffer.validate();
  }
  REQUIRE(selections > 2000);
}

TEST_CASE("step stats accumulation: the block reduction equals the host's +=", "[lru-batch-rules]") {
  std::mt19937 rng(61);
  for (int trial = 0; trial < 100; ++trial) {
    const std::uint32_t heads = trial % 10 == 0 ? 0 : static_cast<std::uint32_t>(rng() % 2000);
    std::vector<CacheStepStats> stats(heads);
    for (auto& s : stats) {
      s = {rng() % 1000, rng() % 1000, rng() % 100000, rng() % 100000, (std::uint64_t{rng()} << 20) + rng()};
    }
    CacheStepStats want{rng(), rng(), rng(), rng(), rng()};
    CacheStepStats got = want;
    for (const CacheStepStats& s : stats) want += s;
    emulate_accumulate(stats, got, rng);
    INFO("trial " << trial << " heads " << heads);
    require_same_stats(got, want);
  }
}
