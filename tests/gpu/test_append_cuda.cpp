// The append kernel (buffer/append_cuda.hpp and
// step/append_summaries_cuda.hpp) against its host emulation
// (append_test_data.hpp), which test_append_rules.cpp checks against the host
// path: tail pages, saved CPU pages (mapped pinned memory), fp32 q, summaries,
// their token counts and the error word, bit for bit, for every dtype and summary kind; and bad
// arguments refused before anything is enqueued.
#include <catch2/catch.hpp>
#include <cuda_runtime.h>

#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "append_test_data.hpp"
#include "index_test_data.hpp"
#include "gpu_support.hpp"
#include "sparsekv/step/append_summaries_cuda.hpp"

using namespace sparsekv;
using namespace sparsekv::cuda;
using namespace sparsekv::gpu_test;
using namespace sparsekv::test;

namespace {

template <class T>
std::vector<T> bytes_as(const std::byte* data, std::size_t n) {
  std::vector<T> out(n);
  std::memcpy(out.data(), data, n * sizeof(T));
  return out;
}

}  // namespace

TEST_CASE("append kernel equals its host emulation bit for bit", "[append][cuda]") {
  std::mt19937 rng(21);
  Stream stream;
  const DType dtypes[] = {DType::f32, DType::f16, DType::bf16};
  const AppendSummary kinds[] = {AppendSummary::none, AppendSummary::quest, AppendSummary::shadowkv,
                                 AppendSummary::retroinfer};
  for (int trial = 0; trial < 120; ++trial) {
    const DType dtype = dtypes[trial % 3];
    const AppendSummary kind = kinds[(trial / 3) % 4];
    const std::uint32_t batch = 1 + rng() % 9, kv_heads = 1u << (rng() % 3), group = 1 + rng() % 4;
    const std::uint32_t dim = rng() % 2 ? 64 : 128, page_tokens = 1 + rng() % 32, q_heads = kv_heads * group;
    CAPTURE(trial, to_string(dtype), static_cast<int>(kind), batch, kv_heads, group, dim, page_tokens);
    const PageLayout layout{page_tokens, dim, dtype};
    const std::size_t page = layout.page_bytes(), items = std::size_t{batch} * kv_heads;
    const std::size_t row = std::size_t{kv_heads} * dim, qn = std::size_t{batch} * q_heads * dim;
    std::vector<float> qf = random_values(qn, rng), kf = random_values(batch * row, rng),
                       vf = random_values(batch * row, rng);
    if (trial % 2) {
      for (int i = 0; i < 3; ++i) {
        std::vector<float>& x = rng() % 3 == 0 ? qf : rng() % 2 ? kf : vf;
        x[rng() % x.size()] = i == 0 ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
      }
    }
    const auto q = encode(qf, dtype), k = encode(kf, dtype), v = encode(vf, dtype);
    std::vector<std::uint32_t> slots(batch), rows(items);
    for (auto& s : slots) s = rng() % 2 ? page_tokens - 1 : rng() % page_tokens;
    std::vector<PageId> tails(items);
    for (std::size_t i = 0; i < items; ++i) {
      tails[i] = static_cast<PageId>(2 * i + 1);  // scattered in a tier of 2 x items pages
      rows[i] = static_cast<std::uint32_t>(items - 1 - i);
    }
    const std::vector<std::byte> tier_init = random_bytes(2 * items * page, rng);

    // Host emulation.
    std::vector<AppendVector> tier(tier_init.size() / 16), saved(items * page / 16);
    std::memcpy(tier.data(), tier_init.data(), tier_init.size());
    std::memset(saved.data(), 0x5A, saved.size() * 16);
    std::vector<std::byte*> cpu_host(items);
    for (std::size_t i = 0; i < items; ++i) cpu_host[i] = reinterpret_cast<std::byte*>(saved.data()) + i * page;
    std::vector<float> q_out(qn), first(items * dim, -3.0f), second = first, score(items, -3.0f);
    std::vector<std::uint32_t> tokens(items, 0xdeadu);
    std::uint64_t error = kNoAppendError;
    DeviceAppend a{batch,
                   q_heads,
                   kv_heads,
                   layout,
                   q.data(),
                   k.data(),
                   v.data(),
                   q_out.data(),
                   reinterpret_cast<std::byte*>(tier.data()),
                   page,
                   tails.data(),
                   slots.data(),
                   cpu_host.data(),
                   &error};
    AppendSummaries s{kind, rows.data(), first.data(), second.data(), first.data(), score.data(), tokens.data()};
    s.centroid = first.data();
    s.value_sum = second.data();
    emulate(a, s, 7, Mutation::none);

    // The kernel: inputs and the error word in device memory, CPU pages in mapped pinned memory.
    DeviceArray<std::byte> dq(q), dk(k), dv(v), dtier(tier_init);
    DeviceArray<float> dq_out(qn), dfirst(first), dsecond(second), dscore(std::vector<float>(items, -3.0f));
    DeviceArray<std::uint32_t> dtokens(std::vector<std::uint32_t>(items, 0xdeadu));
    check(cudaMemset(dq_out.data, 0, qn * sizeof(float)));
    DeviceArray<PageId> dtails(tails);
    DeviceArray<std::uint32_t> dslots(slots), drows(rows);
    PinnedBytes cpu(items * page);
    std::memset(cpu.data, 0x5A, items * page);
    DeviceArray<std::uint64_t> word(std::vector<std::uint64_t>{kNoAppendError});
    std::vector<std::byte*> cpu_device(items);
    for (std::size_t i = 0; i < items; ++i) cpu_device[i] = cpu.data + i * page;
    DeviceArray<std::byte*> dcpu(cpu_device);
    DeviceAppend d{batch,       q_heads,    kv_heads, layout,      dq.data,     dk.data,   dv.data,
                   dq_out.data, dtier.data, page,     dtails.data, dslots.data, dcpu.data, word.data};
    AppendSummaries ds{kind, drows.data, dfirst.data, dsecond.data, dfirst.data, dscore.data, dtokens.data};
    ds.centroid = dfirst.data;
    ds.value_sum = dsecond.data;
    if (kind == AppendSummary::none && trial % 2 == 0) {
      append_tokens(d, stream.stream);  // the buffer layer's entry point
    } else {
      append_tokens(d, ds, stream.stream);
    }
    check(cudaStreamSynchronize(stream.stream));

    CHECK(word.download()[0] == error);
    CHECK(same_bits(dq_out.download(), q_out));
    CHECK(std::memcmp(dtier.download().data(), tier.data(), tier_init.size()) == 0);
    CHECK(std::memcmp(cpu.data, saved.data(), items * page) == 0);
    CHECK(same_bits(dfirst.download(), first));
    CHECK(same_bits(dsecond.download(), second));
    CHECK(same_bits(dscore.download(), score));
    CHECK(dtokens.download() == tokens);
  }
}

TEST_CASE("append_tokens refuses bad arguments before enqueuing anything", "[append][cuda]") {
  const PageLayout layout{4, 64, DType::bf16};
  DeviceArray<std::byte> q(4 * 64 * 2), kv(2 * 64 * 2), tier(4 * layout.page_bytes());
  DeviceArray<float> q_out(4 * 64);
  DeviceArray<PageId> tails(std::vector<PageId>{0, 1});
  DeviceArray<std::uint32_t> slots(std::vector<std::uint32_t>{3}), rows(std::vector<std::uint32_t>{0, 1});
  PinnedBytes cpu(2 * layout.page_bytes());
  DeviceArray<std::uint64_t> word(std::vector<std::uint64_t>{12345});  // a launch would only lower it
  DeviceArray<std::byte*> cpu_pages(std::vector<std::byte*>{cpu.data, cpu.data + layout.page_bytes()});
  DeviceArray<float> out(2 * 64);
  const DeviceAppend good{1,
                          4,
                          2,
                          layout,
                          q.data,
                          kv.data,
                          kv.data,
                          q_out.data,
                          tier.data,
                          layout.page_bytes(),
                          tails.data,
                          slots.data,
                          cpu_pages.data,
                          word.data};
  const auto refused = [&](DeviceAppend a, AppendSummaries s = {}) {
    CHECK(code_of([&] { append_tokens(a, s, nullptr); }) == ErrorCode::invalid_argument);
    if (s.kind == AppendSummary::none)
      CHECK(code_of([&] { append_tokens(a, nullptr); }) == ErrorCode::invalid_argument);
  };
  DeviceAppend a = good;
  a.kv_heads = 0;
  refused(a);
  a = good;
  a.q_heads = 3;
  refused(a);
  a = good;
  a.layout.head_dim = 3;  // a 12-byte page: not a multiple of 16
  a.layout.page_tokens = 1;
  refused(a);
  a = good;
  a.page_stride = layout.page_bytes() + 8;
  refused(a);
  a = good;
  a.gpu_tier = tier.data + 8;
  refused(a);
  a = good;
  a.layout.dtype = static_cast<DType>(7);
  refused(a);
  a = good;
  a.error = nullptr;
  refused(a);
  a = good;
  a.cpu_pages = nullptr;
  refused(a);
  refused(good, AppendSummaries{AppendSummary::quest, rows.data, out.data, nullptr, nullptr, nullptr});
  refused(good, AppendSummaries{AppendSummary::shadowkv, nullptr, nullptr, nullptr, out.data, out.data});
  AppendSummaries retro{AppendSummary::retroinfer, rows.data};
  retro.centroid = retro.value_sum = out.data;
  AppendSummaries bad = retro;
  bad.rows = nullptr;
  refused(good, bad);
  bad = retro;
  bad.centroid = nullptr;
  refused(good, bad);
  bad = retro;
  bad.value_sum = nullptr;
  refused(good, bad);
  refused(good, AppendSummaries{static_cast<AppendSummary>(9), rows.data, out.data, out.data, out.data, out.data});
  a = good;
  a.layout.head_dim = 1024;
  refused(a, AppendSummaries{AppendSummary::shadowkv, rows.data, nullptr, nullptr, out.data, out.data});
  check(cudaDeviceSynchronize());
  CHECK(word.download()[0] == 12345);
  // batch 0 enqueues nothing, even with null tensors (the tier's geometry is still checked).
  DeviceAppend empty;
  empty.q_heads = empty.kv_heads = 1;
  empty.page_stride = empty.layout.page_bytes();
  append_tokens(empty, nullptr);
}
