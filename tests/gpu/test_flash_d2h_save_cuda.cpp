// Save D2H (SparseServe §3.2.2 FlashD2H) on a device: rows produced on a
// compute stream in device memory, one D2H copy on the saver's stream into
// pinned staging, host workers scatter into a pinned, chunked CPU tier. The
// bytes must equal a sequential host scatter of the same rows in save order.
// A host function sleeping on the compute stream delays the producer, so a
// copy that did not wait on the compute stream would read stale rows.
#include <catch2/catch.hpp>
#include <cuda_runtime.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "gpu_support.hpp"
#include "sparsekv/transfer/flash_d2h_save.hpp"

using namespace sparsekv;
using namespace sparsekv::gpu_test;

namespace {

constexpr unsigned int kPinnedFlags = cudaHostAllocMapped | cudaHostAllocPortable;

// Blocks the stream it is enqueued on for a while, on the host.
void delay_stream(cudaStream_t stream, std::intptr_t milliseconds) {
  check(cudaLaunchHostFunc(
      stream,
      [](void* ms) { std::this_thread::sleep_for(std::chrono::milliseconds(reinterpret_cast<std::intptr_t>(ms))); },
      reinterpret_cast<void*>(milliseconds)));
}

constexpr std::uint32_t kPageTokens = 16;
constexpr std::size_t kRowBytes = 128 * 2;  // head_dim 128, fp16
constexpr std::size_t kBlock = kPageTokens * kRowBytes;
constexpr std::size_t kPageStride = 2 * kBlock;
constexpr std::uint32_t kPagesPerChunk = 64;
constexpr std::uint32_t kPages = 3 * kPagesPerChunk - 5;  // last chunk partly unused

// A pinned CPU tier of three chunks and the host reference beside it.
struct Tier {
  explicit Tier(std::mt19937& rng) {
    for (auto& chunk : chunks) {
      chunk = std::make_unique<PinnedBytes>(kPagesPerChunk * kPageStride, kPinnedFlags);
      fill_random(chunk->data, kPagesPerChunk * kPageStride, rng);
      pointers.push_back(chunk->data);
      reference.emplace_back(chunk->data, chunk->data + kPagesPerChunk * kPageStride);
    }
  }
  SaveDestination destination() const {
    return SaveDestination{pointers, kPagesPerChunk, kPages, kPageStride, kPageTokens, kRowBytes, 0, kBlock};
  }
  void scatter(const std::vector<std::byte>& source, const std::vector<RowTarget>& targets) {
    for (std::size_t i = 0; i < targets.size(); ++i) {
      const RowTarget& t = targets[i];
      std::byte* row = reference[t.page / kPagesPerChunk].data() + (t.page % kPagesPerChunk) * kPageStride +
                       (t.block == KvBlock::k ? 0 : kBlock) + t.slot * kRowBytes;
      std::memcpy(row, source.data() + i * kRowBytes, kRowBytes);
    }
  }
  bool matches() const {
    for (std::size_t c = 0; c < reference.size(); ++c) {
      if (std::memcmp(chunks[c]->data, reference[c].data(), reference[c].size()) != 0) return false;
    }
    return true;
  }
  std::unique_ptr<PinnedBytes> chunks[3];
  std::vector<std::byte*> pointers;
  std::vector<std::vector<std::byte>> reference;
};

// A step of `tokens` tokens x `heads` kv heads, K rows then V rows; each head
// owns a run of pages from `first_page` on, token t at slot t % kPageTokens.
std::vector<RowTarget> step_targets(std::uint32_t tokens, std::uint32_t heads, std::uint32_t first_page,
                                    std::uint32_t first_slot) {
  const std::uint32_t pages_per_head = (first_slot + tokens + kPageTokens - 1) / kPageTokens;
  std::vector<RowTarget> targets;
  for (const KvBlock block : {KvBlock::k, KvBlock::v}) {
    for (std::uint32_t t = 0; t < tokens; ++t) {
      for (std::uint32_t h = 0; h < heads; ++h) {
        const std::uint32_t position = first_slot + t;
        const PageId page = (first_page + h * pages_per_head + position / kPageTokens) % kPages;
        targets.push_back({page, position % kPageTokens, block});
      }
    }
  }
  return targets;
}

}  // namespace

TEST_CASE("FlashD2HSaver saves device rows behind the compute stream", "[gpu][save]") {
  std::mt19937 rng(17);
  for (const std::uint32_t workers : {1u, 2u, 4u}) {
    CAPTURE(workers);
    Tier tier(rng);
    FlashD2HSaver saver(FlashD2HSaverConfig{workers});
    REQUIRE(saver.uses_device());
    saver.set_destination(tier.destination());
    Stream compute;
    // Two device source buffers used in turn: step t overwrites the buffer of
    // step t - 2, ordered behind that save's copy by wait_copy.
    constexpr std::size_t kMaxBytes = std::size_t{2} * 512 * 8 * kRowBytes;
    DeviceBytes device_source[2] = {DeviceBytes(kMaxBytes), DeviceBytes(kMaxBytes)};
    std::vector<std::unique_ptr<PinnedBytes>> uploads;  // each step's host rows, alive until the end
    std::vector<SaveTicket> tickets;
    // Decode steps (1 token), a prefill chunk (512 tokens), a few in between.
    const std::uint32_t step_tokens[] = {1, 1, 512, 3, 1, 64, 1, 200, 1, 1};
    std::uint32_t step = 0;
    for (const std::uint32_t tokens : step_tokens) {
      CAPTURE(step, tokens);
      const std::uint32_t heads = 8;
      const std::vector<RowTarget> targets =
          step_targets(tokens, heads, static_cast<std::uint32_t>(rng() % kPages), rng() % kPageTokens);
      const std::vector<std::byte> rows = random_bytes(targets.size() * kRowBytes, rng);
      REQUIRE(rows.size() <= kMaxBytes);
      tier.scatter(rows, targets);
      uploads.push_back(std::make_unique<PinnedBytes>(rows.size(), kPinnedFlags));
      std::memcpy(uploads.back()->data, rows.data(), rows.size());

      std::byte* source = device_source[step % 2].data;
      if (step >= 2) saver.wait_copy(tickets[step - 2], compute.stream);
      // The "model" produces this step's K/V late on the compute stream.
      delay_stream(compute.stream, 5);
      check(cudaMemcpyAsync(source, uploads.back()->data, rows.size(), cudaMemcpyHostToDevice, compute.stream));
      tickets.push_back(saver.save(source, rows.size(), targets, compute.stream));
      ++step;
    }
    // A host source on a device machine takes the memcpy path, in order with the rest.
    const std::vector<RowTarget> host_targets = step_targets(5, 4, 3, 7);
    const std::vector<std::byte> host_rows = random_bytes(host_targets.size() * kRowBytes, rng);
    tier.scatter(host_rows, host_targets);
    tickets.push_back(saver.save(host_rows.data(), host_rows.size(), host_targets, compute.stream));

    saver.wait();
    for (const SaveTicket t : tickets) REQUIRE(saver.finished(t));
    check(cudaStreamSynchronize(compute.stream));
    REQUIRE(tier.matches());
  }
}

TEST_CASE("FlashD2HSaver copies before the compute stream overwrites its source", "[gpu][save]") {
  std::mt19937 rng(23);
  Tier tier(rng);
  FlashD2HSaver saver(FlashD2HSaverConfig{3});
  saver.set_destination(tier.destination());
  Stream compute;
  const std::vector<RowTarget> targets = step_targets(32, 8, 10, 0);
  const std::vector<std::byte> rows = random_bytes(targets.size() * kRowBytes, rng);
  tier.scatter(rows, targets);
  PinnedBytes upload(rows.size(), kPinnedFlags);
  std::memcpy(upload.data, rows.data(), rows.size());
  DeviceBytes source(rows.size());
  check(cudaMemset(source.data, 0x5A, rows.size()));  // stale bytes a premature copy would see
  check(cudaDeviceSynchronize());

  delay_stream(compute.stream, 100);
  check(cudaMemcpyAsync(source.data, upload.data, rows.size(), cudaMemcpyHostToDevice, compute.stream));
  const SaveTicket ticket = saver.save(source.data, rows.size(), targets, compute.stream);
  // The next layer reuses the buffer at once: only wait_copy keeps it from clobbering the rows.
  saver.wait_copy(ticket, compute.stream);
  check(cudaMemsetAsync(source.data, 0xA5, rows.size(), compute.stream));
  saver.wait(ticket);
  check(cudaStreamSynchronize(compute.stream));
  REQUIRE(tier.matches());
}
