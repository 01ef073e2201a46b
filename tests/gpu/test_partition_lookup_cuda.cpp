// The resolve kernel against the host backend on random tables: page ids bit-exact.
#include <catch2/catch.hpp>
#include <cuda_runtime.h>

#include <random>
#include <vector>

#include "gpu_support.hpp"
#include "sparsekv/metadata/hierarchical_page_table.hpp"
#include "sparsekv/metadata/partition_lookup_cuda.hpp"

using namespace sparsekv;
using namespace sparsekv::gpu_test;

TEST_CASE("resolve_partition_pages matches the host lookup", "[gpu][metadata]") {
  PageTableGeometry g;
  g.max_requests = 2;
  g.layers = 2;
  g.kv_heads = 4;
  g.page_tokens = 8;
  g.max_partitions_per_head = 4096;
  g.max_cpu_pages_per_head = 8192;
  g.max_gpu_pages_per_head = 64;
  g.segment_entries = 64;
  g.meta_segments = g.offset_segments = 2048;
  g.cpu_page_segments = 4096;
  g.gpu_page_segments = 64;
  HostMemoryResource pinned;  // pinned: the kernel reads the tables through UVA
  REQUIRE(pinned.kind() == MemoryKind::pinned_host);
  HierarchicalPageTable table(g, pinned, pinned);
  std::mt19937 rng(3);
  PageId next = 0;
  for (RequestId r = 0; r < 2; ++r) {
    table.add_request(r);
    for (std::uint32_t l = 0; l < 2; ++l) {
      for (std::uint32_t h = 0; h < 4; ++h) {
        std::vector<std::uint32_t> tokens(1 + rng() % 2000);
        std::vector<PageId> pages;
        for (auto& t : tokens) {
          t = 1 + rng() % 40;
          for (std::uint32_t i = 0; i < (t + 7) / 8; ++i) pages.push_back(next++ * 7919u % 1000003u);
        }
        table.append_partitions(r, l, h, tokens, pages);
      }
    }
  }
  for (RequestId r = 0; r < 2; ++r) {
    for (std::uint32_t l = 0; l < 2; ++l) {
      for (std::uint32_t h = 0; h < 4; ++h) {
        const std::uint32_t count = table.partition_count(r, l, h);
        std::vector<PartitionId> selected;
        std::vector<std::uint32_t> offsets;
        std::vector<PageId> expected;
        for (std::uint32_t i = 0; i < 300; ++i) {
          selected.push_back(static_cast<PartitionId>(rng() % count));
          offsets.push_back(static_cast<std::uint32_t>(expected.size()));
          table.cpu_pages(r, l, h, selected.back(), expected);
        }
        const DeviceArray<PartitionId> d_selected(selected);
        const DeviceArray<std::uint32_t> d_offsets(offsets);
        const DeviceArray<PageId> d_out(expected.size());
        cuda::resolve_partition_pages(table.lookup(), table.instance(r, l, h), d_selected.data, d_offsets.data,
                                      static_cast<std::uint32_t>(selected.size()), d_out.data, nullptr);
        REQUIRE(d_out.download() == expected);
      }
    }
  }
}
