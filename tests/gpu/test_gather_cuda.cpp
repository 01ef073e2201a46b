// Gather H2D / D2D kernel against a host memcpy reference on random scattered
// page lists: bytes identical for pages of 2 to 32 KB, every grid shape.
#include <catch2/catch.hpp>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "gpu_support.hpp"
#include "sparsekv/transfer/page_gather_cuda.hpp"

using namespace sparsekv;
using namespace sparsekv::gpu_test;

TEST_CASE("gather_pages copies scattered pages byte for byte", "[gpu][transfer]") {
  std::mt19937 rng(11);
  constexpr std::uint32_t kSrcPages = 512;
  constexpr std::uint32_t kDstPages = 384;
  const std::size_t page_sizes[] = {2048, 4096, 8192, 16384, 32768};
  const cuda::GatherConfig configs[] = {{0, 8}, {1, 1}, {2, 4}, {0, 32}, {3, 3}};
  for (const std::size_t page_bytes : page_sizes) {
    // Strides wider than a page (padding 16 or 0 bytes) exercise stride != page_bytes.
    const std::size_t src_stride = page_bytes + 16 * (rng() % 2);
    const std::size_t dst_stride = page_bytes + 16 * (rng() % 2);
    PinnedBytes src(kSrcPages * src_stride);
    fill_random(src.data, kSrcPages * src_stride, rng);
    DeviceBytes dev_src(kSrcPages * src_stride);  // the same pool in device memory (D2D)
    check(cudaMemcpy(dev_src.data, src.data, kSrcPages * src_stride, cudaMemcpyHostToDevice));
    DeviceBytes dst(kDstPages * dst_stride);
    DeviceBytes contiguous(kDstPages * page_bytes);
    std::vector<std::byte> expected(kDstPages * dst_stride);
    std::vector<std::byte> got(kDstPages * dst_stride);

    for (const cuda::GatherConfig& config : configs) {
      for (const std::uint32_t count : {1u, 7u, 100u, kDstPages}) {
        CAPTURE(page_bytes, src_stride, dst_stride, config.max_sms, config.warps_per_block, count);
        // Random source pages (repeats allowed), distinct random destination pages.
        std::vector<PageId> src_pages(count), dst_pages(kDstPages);
        for (auto& p : src_pages) p = static_cast<PageId>(rng() % kSrcPages);
        std::iota(dst_pages.begin(), dst_pages.end(), PageId{0});
        std::shuffle(dst_pages.begin(), dst_pages.end(), rng);
        dst_pages.resize(count);
        const DeviceArray<PageId> d_src_pages(src_pages), d_dst_pages(dst_pages);
        const PageId* d_src = d_src_pages.data;
        const PageId* d_dst = d_dst_pages.data;

        // Reference: host memcpy page by page onto a pattern, the device buffer holds the same pattern.
        const std::byte fill = static_cast<std::byte>(rng());
        std::fill(expected.begin(), expected.end(), fill);
        for (std::uint32_t i = 0; i < count; ++i)
          std::memcpy(expected.data() + dst_pages[i] * dst_stride, src.data + src_pages[i] * src_stride, page_bytes);

        // H2D: pinned host pool -> scattered device pages.
        check(cudaMemset(dst.data, static_cast<int>(fill), expected.size()));
        cuda::gather_pages(d_src, d_dst, count, src.data, src_stride, dst.data, dst_stride, page_bytes, config,
                           nullptr);
        check(cudaDeviceSynchronize());
        check(cudaMemcpy(got.data(), dst.data, got.size(), cudaMemcpyDeviceToHost));
        REQUIRE(std::memcmp(got.data(), expected.data(), got.size()) == 0);

        // D2D: device pool -> contiguous execution buffer (dst_pages == nullptr).
        check(cudaMemset(contiguous.data, static_cast<int>(fill), kDstPages * page_bytes));
        cuda::gather_pages(d_src, nullptr, count, dev_src.data, src_stride, contiguous.data, page_bytes, page_bytes,
                           config, nullptr);
        check(cudaDeviceSynchronize());
        std::vector<std::byte> got_contiguous(kDstPages * page_bytes);
        check(cudaMemcpy(got_contiguous.data(), contiguous.data, got_contiguous.size(), cudaMemcpyDeviceToHost));
        std::vector<std::byte> expected_contiguous(kDstPages * page_bytes, fill);
        for (std::uint32_t i = 0; i < count; ++i)
          std::memcpy(expected_contiguous.data() + i * page_bytes, src.data + src_pages[i] * src_stride, page_bytes);
        REQUIRE(got_contiguous == expected_contiguous);
      }
    }
  }
}

TEST_CASE("gather_pages handles odd page sizes and many pages per warp", "[gpu][transfer]") {
  std::mt19937 rng(5);
  // 16 B .. 1 KB + 16: tails shorter than one unrolled chunk; 4096 pages on a 1-SM grid loop many times.
  for (const std::size_t page_bytes : {16u, 48u, 528u, 1040u, 2064u}) {
    constexpr std::uint32_t kPages = 4096;
    CAPTURE(page_bytes);
    PinnedBytes src(kPages * page_bytes);
    fill_random(src.data, kPages * page_bytes, rng);
    std::vector<PageId> src_pages(kPages);
    for (auto& p : src_pages) p = static_cast<PageId>(rng() % kPages);
    const DeviceArray<PageId> d_src_pages(src_pages);
    const PageId* d_src = d_src_pages.data;
    DeviceBytes dst(kPages * page_bytes);
    cuda::gather_pages(d_src, nullptr, kPages, src.data, page_bytes, dst.data, page_bytes, page_bytes,
                       cuda::GatherConfig{1, 2}, nullptr);
    check(cudaDeviceSynchronize());
    std::vector<std::byte> got(kPages * page_bytes), expected(kPages * page_bytes);
    for (std::uint32_t i = 0; i < kPages; ++i)
      std::memcpy(expected.data() + i * page_bytes, src.data + src_pages[i] * page_bytes, page_bytes);
    check(cudaMemcpy(got.data(), dst.data, got.size(), cudaMemcpyDeviceToHost));
    REQUIRE(got == expected);
  }
}

TEST_CASE("gather_pages rejects bad arguments before launching", "[gpu][transfer]") {
  DeviceBytes src(1 << 16), dst(1 << 16), pages(64);
  const auto* ids = reinterpret_cast<const PageId*>(pages.data);
  const cuda::GatherConfig ok{};
  auto gather = [&](const PageId* s, std::uint32_t count, const std::byte* src_base, std::size_t src_stride,
                    std::byte* dst_base, std::size_t dst_stride, std::size_t page_bytes, cuda::GatherConfig c) {
    return code_of(
        [&] { cuda::gather_pages(s, s, count, src_base, src_stride, dst_base, dst_stride, page_bytes, c, nullptr); });
  };
  CHECK(gather(ids, 1, src.data, 4096, dst.data, 4096, 4096 + 8, ok) == ErrorCode::invalid_argument);  // not x16
  CHECK(gather(ids, 1, src.data, 4096, dst.data, 4096, 0, ok) == ErrorCode::invalid_argument);
  CHECK(gather(ids, 1, src.data + 8, 4096, dst.data, 4096, 4096, ok) == ErrorCode::invalid_argument);  // misaligned
  CHECK(gather(ids, 1, src.data, 4096, dst.data + 4, 4096, 4096, ok) == ErrorCode::invalid_argument);
  CHECK(gather(ids, 1, src.data, 4104, dst.data, 4096, 4096, ok) == ErrorCode::invalid_argument);  // stride not x16
  CHECK(gather(ids, 1, src.data, 2048, dst.data, 4096, 4096, ok) == ErrorCode::invalid_argument);  // stride < page
  CHECK(gather(ids, 1, src.data, 4096, dst.data, 2048, 4096, ok) == ErrorCode::invalid_argument);
  CHECK(gather(ids, 1, src.data, 4096, dst.data, 4096, 4096, cuda::GatherConfig{0, 0}) == ErrorCode::invalid_argument);
  CHECK(gather(ids, 1, src.data, 4096, dst.data, 4096, 4096, cuda::GatherConfig{0, 33}) == ErrorCode::invalid_argument);
  CHECK(gather(nullptr, 1, src.data, 4096, dst.data, 4096, 4096, ok) == ErrorCode::invalid_argument);
  CHECK(gather(ids, 1, nullptr, 4096, dst.data, 4096, 4096, ok) == ErrorCode::invalid_argument);
  // count == 0 launches nothing and succeeds.
  cuda::gather_pages(nullptr, nullptr, 0, src.data, 4096, dst.data, 4096, 4096, ok, nullptr);
  check(cudaDeviceSynchronize());
}
