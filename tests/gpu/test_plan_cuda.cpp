// The device Plan step and the miss-list gather against the host: plans
// equal to build_plan's bit for bit, the gather's bytes equal to host copies;
// both captured once in a CUDA graph and replayed while the device-side counts
// change; bad arguments refused before anything is enqueued.
#include <catch2/catch.hpp>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <vector>

#include "gpu_support.hpp"
#include "plan_test_data.hpp"
#include "sparsekv/cache/cache_step.hpp"
#include "sparsekv/attention/attend_plan_cuda.hpp"
#include "sparsekv/transfer/page_gather_cuda.hpp"

using namespace sparsekv;
using namespace sparsekv::gpu_test;
using namespace sparsekv::test;

namespace {

constexpr std::int64_t kSentinel = -7;

// Device buffers of one plan, sized for `rows` rows of the given capacities.
struct DevicePlan {
  DevicePlan(std::uint32_t rows, std::uint32_t selections, std::uint32_t pages, std::uint32_t max_pages,
             std::uint32_t max_entries)
      : rows(rows),
        max_pages(max_pages),
        max_entries(max_entries),
        selection_offsets(rows + 1),
        partition_offsets(selections + 1),
        partition_tokens(selections),
        tail_tokens(rows),
        gpu_pages(pages),
        tail_pages(rows),
        indptr(std::size_t{rows} * max_entries + 1),
        indices(std::size_t{rows} * max_pages),
        head_entries(rows + 1),
        last_page_len(std::size_t{rows} * max_entries),
        overflow(1),
        workspace(cuda::device_plan_workspace_bytes(rows)) {}

  // Uploads a case's inputs and sentinel-filled outputs (no reallocation: a captured graph keeps the pointers).
  void load(const PlanCase& c) {
    REQUIRE(c.rows == rows);
    copy(selection_offsets, c.selection_offsets);
    copy(partition_offsets, c.partition_offsets);
    copy(partition_tokens, c.partition_tokens);
    copy(tail_tokens, c.tail_tokens);
    copy(gpu_pages, c.gpu_pages);
    copy(tail_pages, c.tail_pages);
    copy(indptr, std::vector<std::int64_t>(indptr.size, kSentinel));
    copy(indices, std::vector<std::int64_t>(indices.size, kSentinel));
    copy(head_entries, std::vector<std::int64_t>(head_entries.size, kSentinel));
    copy(last_page_len, std::vector<std::int32_t>(last_page_len.size, static_cast<std::int32_t>(kSentinel)));
    check(cudaDeviceSynchronize());  // pageable copies may still be landing; the kernels run on another stream
  }
  template <class T>
  static void copy(DeviceArray<T>& to, const std::vector<T>& from) {
    REQUIRE(from.size() <= to.capacity);
    if (!from.empty()) check(cudaMemcpy(to.data, from.data(), from.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  cuda::DevicePlanInput input(std::uint32_t page_tokens) const {
    return {rows,
            selection_offsets.data,
            partition_offsets.data,
            gpu_pages.data,
            partition_tokens.data,
            tail_pages.data,
            tail_tokens.data,
            page_tokens,
            max_pages,
            max_entries};
  }
  cuda::DevicePlanOutput output() const {
    return {indptr.data, indices.data, last_page_len.data, head_entries.data, overflow.data};
  }
  void build(std::uint32_t page_tokens, cudaStream_t stream) const {
    cuda::build_device_plan(input(page_tokens), output(), workspace.data, workspace.size, stream);
  }
  PlanArrays download() const {
    PlanArrays a{indptr.download(), indices.download(), head_entries.download(), last_page_len.download(), 0};
    a.overflow_rows = overflow.download()[0];
    return a;
  }

  std::uint32_t rows, max_pages, max_entries;
  DeviceArray<std::uint32_t> selection_offsets, partition_offsets, partition_tokens, tail_tokens;
  DeviceArray<PageId> gpu_pages, tail_pages;
  DeviceArray<std::int64_t> indptr, indices, head_entries;
  DeviceArray<std::int32_t> last_page_len;
  DeviceArray<std::uint32_t> overflow;
  DeviceArray<std::byte> workspace;
};

}  // namespace

TEST_CASE("build_device_plan equals build_plan bit for bit", "[gpu][plan]") {
  std::mt19937 rng(31);
  Stream stream;
  for (int trial = 0; trial < 200; ++trial) {
    const PlanCase c = random_plan_case(rng);
    INFO("trial " << trial << " rows " << c.rows << " page_tokens " << c.page_tokens);
    DevicePlan d(c.rows, static_cast<std::uint32_t>(c.partition_tokens.size()),
                 static_cast<std::uint32_t>(c.gpu_pages.size()), c.max_row_pages + 1, c.max_row_runs + 1);
    d.load(c);
    d.build(c.page_tokens, stream.stream);
    check(cudaStreamSynchronize(stream.stream));
    require_same_plan(d.download(), c.host, c.rows, kSentinel);
  }
}

TEST_CASE("build_device_plan captured once replays new retrievals", "[gpu][plan]") {
  std::mt19937 rng(32);
  constexpr std::uint32_t kKvHeads = 4, kRequests = 5, kPageTokens = 4;
  // Capacities past any random case's (100 selections of <= 4 pages + a tail per row).
  DevicePlan d(kKvHeads * kRequests, kKvHeads * kRequests * 100, kKvHeads * kRequests * 400, 401, 401);
  Stream stream;
  {
    PlanCase warm;
    do warm = random_plan_case(rng, kKvHeads, kRequests);
    while (warm.page_tokens != kPageTokens);
    d.load(warm);  // the warm-up reads what a real step would: never uninitialised device memory
  }
  d.build(kPageTokens, stream.stream);  // warms the memoised device queries outside the capture
  check(cudaStreamSynchronize(stream.stream));
  cudaGraph_t graph = nullptr;
  check(cudaStreamBeginCapture(stream.stream, cudaStreamCaptureModeThreadLocal));
  d.build(kPageTokens, stream.stream);
  check(cudaStreamEndCapture(stream.stream, &graph));
  cudaGraphExec_t exec = nullptr;
  check(cudaGraphInstantiate(&exec, graph, 0));
  for (int replay = 0; replay < 40; ++replay) {
    PlanCase c;
    do c = random_plan_case(rng, kKvHeads, kRequests);
    while (c.page_tokens != kPageTokens);
    INFO("replay " << replay);
    d.load(c);
    check(cudaGraphLaunch(exec, stream.stream));
    check(cudaStreamSynchronize(stream.stream));
    require_same_plan(d.download(), c.host, c.rows, kSentinel);
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

TEST_CASE("gather_miss_list captured once copies each replay's misses", "[gpu][transfer]") {
  std::mt19937 rng(41);
  constexpr std::uint32_t kHeads = 70, kRegion = 12, kCpuPages = 500, kPagesPerChunk = 37, kGpuPages = kHeads * kRegion;
  constexpr std::uint32_t kEntries = kHeads * kRegion;
  for (const std::size_t page_bytes : {16u, 528u, 4096u}) {
    CAPTURE(page_bytes);
    // The CPU tier in pinned chunks (the last one short), addressed through a device table.
    std::vector<std::unique_ptr<PinnedBytes>> chunks;
    std::vector<const std::byte*> bases;
    for (std::uint32_t first = 0; first < kCpuPages; first += kPagesPerChunk) {
      const std::size_t bytes = std::min(kPagesPerChunk, kCpuPages - first) * page_bytes;
      chunks.push_back(std::make_unique<PinnedBytes>(bytes));
      fill_random(chunks.back()->data, bytes, rng);
      bases.push_back(chunks.back()->data);
    }
    const DeviceArray<const std::byte*> chunk_bases(bases);
    const ChunkedPages cpu_tier{chunk_bases.data, kPagesPerChunk, page_bytes};
    const std::size_t gpu_stride = page_bytes + 16;
    DeviceBytes gpu_tier(kGpuPages * gpu_stride);
    std::vector<std::uint32_t> offsets(kHeads);
    for (std::uint32_t h = 0; h < kHeads; ++h) offsets[h] = h * kRegion;
    const DeviceArray<std::uint32_t> d_offsets(offsets);
    DeviceArray<CacheStepStats> d_stats(kHeads);
    DeviceArray<PageId> d_cpu(kEntries), d_gpu(kEntries);
    const DeviceMissList misses{kHeads,
                                kEntries,
                                d_offsets.data,
                                &d_stats.data->miss_pages,
                                sizeof(CacheStepStats) / sizeof(std::uint64_t),
                                d_cpu.data,
                                d_gpu.data};
    const cuda::GatherConfig config{2, 4};
    Stream stream;
    d_stats.upload(std::vector<CacheStepStats>(kHeads));  // the warm-up copies nothing: zero misses everywhere
    cuda::gather_miss_list(misses, cpu_tier, gpu_tier.data, gpu_stride, page_bytes, config, stream.stream);  // warm-up
    check(cudaStreamSynchronize(stream.stream));
    cudaGraph_t graph = nullptr;
    check(cudaStreamBeginCapture(stream.stream, cudaStreamCaptureModeThreadLocal));
    cuda::gather_miss_list(misses, cpu_tier, gpu_tier.data, gpu_stride, page_bytes, config, stream.stream);
    check(cudaStreamEndCapture(stream.stream, &graph));
    cudaGraphExec_t exec = nullptr;
    check(cudaGraphInstantiate(&exec, graph, 0));
    std::vector<std::byte> expected(kGpuPages * gpu_stride), got(expected.size());
    for (int replay = 0; replay < 12; ++replay) {
      // New counts (zero misses, full regions, in between) and copies; GPU pages distinct.
      std::vector<CacheStepStats> stats(kHeads);
      std::vector<PageId> cpu(kEntries), gpu(kEntries);
      for (auto& p : cpu) p = static_cast<PageId>(rng() % kCpuPages);
      std::iota(gpu.begin(), gpu.end(), PageId{0});
      std::shuffle(gpu.begin(), gpu.end(), rng);
      for (auto& s : stats) s.miss_pages = replay == 0 ? 0 : rng() % 3 == 0 ? kRegion : rng() % (kRegion + 1);
      d_stats.upload(stats);
      d_cpu.upload(cpu);
      d_gpu.upload(gpu);
      const std::byte fill = static_cast<std::byte>(rng());
      std::fill(expected.begin(), expected.end(), fill);
      for (std::uint32_t h = 0; h < kHeads; ++h) {
        for (std::uint64_t c = 0; c < stats[h].miss_pages; ++c) {
          const std::size_t e = offsets[h] + c;
          std::memcpy(expected.data() + gpu[e] * gpu_stride,
                      bases[cpu[e] / kPagesPerChunk] + (cpu[e] % kPagesPerChunk) * page_bytes, page_bytes);
        }
      }
      check(cudaMemsetAsync(gpu_tier.data, static_cast<int>(fill), expected.size(), stream.stream));
      check(cudaGraphLaunch(exec, stream.stream));
      check(cudaStreamSynchronize(stream.stream));
      check(cudaMemcpy(got.data(), gpu_tier.data, got.size(), cudaMemcpyDeviceToHost));
      INFO("replay " << replay);
      REQUIRE(got == expected);
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  }
}

TEST_CASE("gather_miss_list and build_device_plan refuse bad arguments before launching", "[gpu][plan]") {
  DeviceBytes gpu(1 << 16), words(1 << 12);
  const auto* u32 = reinterpret_cast<const std::uint32_t*>(words.data);
  const auto* u64 = reinterpret_cast<const std::uint64_t*>(words.data);
  const auto* bases = reinterpret_cast<const std::byte* const*>(words.data);
  const DeviceMissList ok{4, 16, u32, u64, 1, u32, u32};
  const ChunkedPages tier{bases, 8, 4096};
  auto gather = [&](DeviceMissList m, ChunkedPages t, std::byte* base, std::size_t stride, std::size_t page_bytes) {
    return code_of([&] { cuda::gather_miss_list(m, t, base, stride, page_bytes, {}, nullptr); });
  };
  CHECK(gather(ok, tier, gpu.data, 4096, 4104) == ErrorCode::invalid_argument);      // not x16
  CHECK(gather(ok, tier, gpu.data + 8, 4096, 4096) == ErrorCode::invalid_argument);  // misaligned
  CHECK(gather(ok, tier, gpu.data, 2048, 4096) == ErrorCode::invalid_argument);      // stride < page
  CHECK(gather(ok, {bases, 8, 2048}, gpu.data, 4096, 4096) == ErrorCode::invalid_argument);
  CHECK(gather(ok, {bases, 0, 4096}, gpu.data, 4096, 4096) == ErrorCode::invalid_argument);
  CHECK(gather({4, 16, u32, u64, 0, u32, u32}, tier, gpu.data, 4096, 4096) == ErrorCode::invalid_argument);
  CHECK(gather({4, 16, nullptr, u64, 1, u32, u32}, tier, gpu.data, 4096, 4096) == ErrorCode::invalid_argument);
  CHECK(gather({4, 16, u32, nullptr, 1, u32, u32}, tier, gpu.data, 4096, 4096) == ErrorCode::invalid_argument);
  CHECK(gather(ok, {nullptr, 8, 4096}, gpu.data, 4096, 4096) == ErrorCode::invalid_argument);
  CHECK(code_of([&] {
          cuda::gather_miss_list(ok, tier, gpu.data, 4096, 4096, {0, 0}, nullptr);
        }) == ErrorCode::invalid_argument);
  // Empty lists enqueue nothing, null arrays or not.
  cuda::gather_miss_list({0, 16, nullptr, nullptr, 1, nullptr, nullptr}, tier, gpu.data, 4096, 4096, {}, nullptr);
  cuda::gather_miss_list({4, 0, nullptr, nullptr, 1, nullptr, nullptr}, tier, gpu.data, 4096, 4096, {}, nullptr);

  std::mt19937 rng(3);
  const PlanCase c = random_plan_case(rng, 2, 2);
  DevicePlan d(c.rows, 400, 1600, 64, 64);
  const auto plan = [&](cuda::DevicePlanInput in, cuda::DevicePlanOutput out, std::size_t workspace_bytes) {
    return code_of([&] { cuda::build_device_plan(in, out, d.workspace.data, workspace_bytes, nullptr); });
  };
  cuda::DevicePlanInput in = d.input(4);
  const cuda::DevicePlanOutput out = d.output();
  CHECK(plan(d.input(0), out, d.workspace.size) == ErrorCode::invalid_argument);
  CHECK(plan(in, out, d.workspace.size - 1) == ErrorCode::invalid_argument);
  in.partition_offsets = nullptr;
  CHECK(plan(in, out, d.workspace.size) == ErrorCode::invalid_argument);
  cuda::DevicePlanOutput no_overflow = out;
  no_overflow.overflow_rows = nullptr;
  CHECK(plan(d.input(4), no_overflow, d.workspace.size) == ErrorCode::invalid_argument);
  check(cudaDeviceSynchronize());
}
