// The facade on the CUDA backend against the host backend: the same requests
// arriving and finishing at random steps, every built-in policy. Metadata
// (hits, misses, pages moved, GPU page ids) must be identical; attention
// outputs within 2e-3 relative (bf16 pages, fp32 accumulation in both).
// Also the address-list gather the backend's loads use.
#include <catch2/catch.hpp>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <random>
#include <vector>

#include "gpu_support.hpp"
#include "sparsekv/core/numeric.hpp"
#include "sparsekv/facade/cuda_backend.hpp"
#include "sparsekv/sparsekv.hpp"
#include "sparsekv/transfer/page_gather_cuda.hpp"

using namespace sparsekv;
using namespace sparsekv::gpu_test;

namespace {

constexpr ModelShape kShape{2, 8, 2, 64, DType::bf16};
constexpr std::uint32_t kRow = kShape.kv_heads * kShape.head_dim;

Config backend_config() {
  Config c;
  c.page_tokens = 16;
  c.max_requests = 12;
  c.max_context_tokens = 2048;
  c.min_buffer_ratio = 1.0;
  const std::size_t page = c.page_bytes(kShape);
  const std::size_t heads = std::size_t{12} * kShape.layers * kShape.kv_heads;
  c.cpu_tier_bytes = heads * 140 * page;
  c.gpu_tier_bytes = heads * 100 * page;
  c.host_chunk_bytes = 64 * page;
  return c;
}

std::vector<std::uint16_t> random_bf16(std::mt19937& rng, std::size_t n) {
  std::normal_distribution<float> normal;
  std::vector<std::uint16_t> v(n);
  for (auto& x : v) x = float_to_bf16(normal(rng));
  return v;
}

// Drives both managers with identical calls; compares after every decode.
void lockstep(RuntimeManager& host, RuntimeManager& cuda, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::map<RequestId, std::uint32_t> left;
  RequestId next = 1;
  double worst = 0;
  const auto arrive = [&] {
    const RequestId id = next++;
    const std::uint32_t prompt = 17 + rng() % 900, decode = 8 + rng() % 40;
    host.add_request(id, prompt + decode);
    cuda.add_request(id, prompt + decode);
    for (std::uint32_t l = 0; l < kShape.layers; ++l) {
      const auto k = random_bf16(rng, std::size_t{prompt} * kRow), v = random_bf16(rng, std::size_t{prompt} * kRow);
      host.prefill(id, l, k.data(), v.data(), prompt);
      cuda.prefill(id, l, k.data(), v.data(), prompt);
    }
    left[id] = decode;
  };
  for (int i = 0; i < 8; ++i) arrive();
  for (int step = 0; !left.empty(); ++step) {
    if (step < 20 && rng() % 4 == 0) arrive();
    std::vector<RequestId> batch;
    for (const auto& [id, n] : left) batch.push_back(id);
    for (std::uint32_t l = 0; l < kShape.layers; ++l) {
      const auto q = random_bf16(rng, batch.size() * kShape.q_heads * kShape.head_dim);
      const auto k = random_bf16(rng, batch.size() * kRow), v = random_bf16(rng, batch.size() * kRow);
      std::vector<float> want(q.size()), got(q.size());
      host.decode(batch, l, q.data(), k.data(), v.data(), want.data());
      cuda.decode(batch, l, q.data(), k.data(), v.data(), got.data());
      for (std::size_t b = 0; b < batch.size(); ++b) {
        REQUIRE(cuda.retrieval(b).plan.gpu_pages == host.retrieval(b).plan.gpu_pages);
        REQUIRE(cuda.retrieval(b).stats.miss_pages == host.retrieval(b).stats.miss_pages);
      }
      for (std::size_t i = 0; i < want.size(); i += kShape.head_dim) {
        double num = 0, den = 0;
        for (std::uint32_t d = 0; d < kShape.head_dim; ++d) {
          num += std::pow(double(got[i + d]) - want[i + d], 2);
          den += double(want[i + d]) * want[i + d];
        }
        worst = std::max(worst, std::sqrt(num / std::max(den, 1e-30)));
      }
    }
    for (RequestId id : batch) {
      if (--left[id] == 0) {
        host.finish(id);
        cuda.finish(id);
        left.erase(id);
      }
    }
  }
  INFO("worst relative error per head " << worst);
  REQUIRE(worst < 2e-3);
  REQUIRE(cuda.stats().cache.hit_pages == host.stats().cache.hit_pages);
  REQUIRE(cuda.stats().pages_moved == host.stats().pages_moved);
  REQUIRE(cuda.buffer().gpu_pool().used() == 0);
  REQUIRE(cuda.buffer().cpu_pool().used() == 0);
}

}  // namespace

TEST_CASE("CudaBackend: the facade on device memory matches the host backend", "[gpu][backend]") {
  for (const std::string& name : policy_names()) {
    INFO(name);
    RuntimeManager host(kShape, backend_config(), make_policy(name, 128));
    RuntimeManager cuda(kShape, backend_config(), make_policy(name, 128), std::make_unique<cuda::CudaBackend>());
    REQUIRE(cuda.backend().name() == "cuda");
    REQUIRE(cuda.buffer().gpu_pool().memory_kind() == MemoryKind::device);
    lockstep(host, cuda, 11);
  }
}

TEST_CASE("gather_page_addresses copies each listed page", "[gpu][gather]") {
  constexpr std::size_t kPage = 4096;
  constexpr std::uint32_t kPages = 300;
  std::mt19937 rng(5);
  PinnedBytes host(kPages * kPage);
  DeviceBytes device(2 * kPages * kPage);
  PinnedBytes src_list(kPages * sizeof(void*)), dst_list(kPages * sizeof(void*));
  fill_random(host.data, kPages * kPage, rng);
  const auto* bytes = host.as<const std::uint8_t>();
  check(cudaMemset(device.data, 0, 2 * kPages * kPage));
  std::vector<std::uint32_t> order(kPages);
  for (std::uint32_t i = 0; i < kPages; ++i) order[i] = i;
  std::shuffle(order.begin(), order.end(), rng);
  auto** src = src_list.as<const std::byte*>();
  auto** dst = dst_list.as<std::byte*>();
  for (std::uint32_t i = 0; i < kPages; ++i) {
    src[i] = host.data + std::size_t{order[i]} * kPage;
    dst[i] = device.data + std::size_t{2 * i + 1} * kPage;  // every other page
  }
  cuda::gather_page_addresses(src, dst, kPages, kPage, {}, nullptr);
  check(cudaDeviceSynchronize());
  std::vector<std::uint8_t> back(2 * kPages * kPage);
  check(cudaMemcpy(back.data(), device.data, back.size(), cudaMemcpyDeviceToHost));
  for (std::uint32_t i = 0; i < kPages; ++i) {
    REQUIRE(std::equal(back.begin() + std::size_t{2 * i + 1} * kPage, back.begin() + std::size_t{2 * i + 2} * kPage,
                       bytes + std::size_t{order[i]} * kPage));
    REQUIRE(std::all_of(back.begin() + std::size_t{2 * i} * kPage, back.begin() + std::size_t{2 * i + 1} * kPage,
                        [](std::uint8_t x) { return x == 0; }));
  }
}
