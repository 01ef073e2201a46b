// Gather H2D (Spin §5.5, SparseServe §3.2.1 FlashH2D), alone and beside the
// sparse decode attention. Without a CUDA device it prints "SKIPPED: no CUDA
// device" and exits 0. Every ratio is to a reference measured in the same
// process with cudaEvents; the PCIe reference (pcie_GBps: one contiguous
// 256 MiB H2D copy, measured once per process, cuda_bench_support.hpp) is
// printed at startup.
//
// BM_GatherH2D: N = 4096 scattered pages of 2/4/8/16/32 KB from a pinned host
// pool (256 MiB) into scattered device pages, with all SMs and with an 8-SM
// cap. Each run prints the kernel's GB/s and
//   over_pcie     - GBps / pcie_GBps: the fraction of the link the gather
//                   reaches, against the same figure for every page size
//   over_per_page - against one cudaMemcpyAsync per page, on the same pages
//   over_batch    - against one cudaMemcpyBatchAsync over the same pages (CUDA 12.8+; -1 without)
//
// BM_GatherOverlap: in the device pipeline one layer's
// gather runs beside another layer's attention. Each run takes an attention
// batch (8 or 32 requests; the shape of bench_attention_cuda.cpp: 8 kv heads,
// 32 q heads, head_dim 128, bf16 pages of 16 tokens, 2048 selected tokens per
// (request, kv head), scattered over a 512 MiB device pool, launches rotating
// over >= 128 MiB of page sets) and a gather strategy (the `strategy` index
// into kStrategies, named by the label):
//   kernel[_smsN]              gather_pages, GatherConfig::max_sms = N (all
//                              SMs without), 8 warps per block
//   kernel_smsN_fat_blocks     the same warps in 1024-thread blocks: the
//                              cap bounds warps, not placement, so fewer
//                              blocks touch fewer of attention's SMs
//   kernel[_smsN]_low_priority the gather on a lowest-priority stream, the
//                              attention on a highest-priority one
//   copy_engine_pages          the copy engine (no SMs): one
//                              cudaMemcpyBatchAsync over the 8 KB pages (CUDA
//                              12.8+; else one cudaMemcpyAsync per page, the
//                              label says which)
//   copy_engine_256KB_runs     the same over runs of 32 contiguous pages
// The gather moves distinct random pages (or runs) of a 2 GiB pinned pool to
// a random permutation of device pages, as many as make it last, alone, as
// long as 40 attention launches alone (scaled from a 128 MiB calibration
// gather of the same strategy). Every iteration times, with cudaEvents, the
// 40 launches alone, the gather alone, and both at once on two non-blocking
// streams: the gather stream waits for a start event recorded on the
// attention stream, and each stream's span runs from that event to its own
// stop event. Before every start event, 256 MiB device copies hold the stream
// for twice the host's time to enqueue both (at most 256 copies, ~47 ms; they
// also flush the L2), so that the streams start together and launch latency
// is not timed. Manual time: the overlapped wall time (the longer span).
// Counters:
//   attn_slowdown     - attention span beside the gather / alone (target <= 1.05)
//   gather_GBps       - gather bytes / gather span beside the attention
//   over_pcie         - gather_GBps / pcie_GBps (target >= 0.9)
//   alone_gather_GBps - gather bytes / gather span alone
//   pcie_GBps         - the PCIe reference
//   attn_alone_us     - one attention launch alone
//   gather_MiB        - the gather's size
//   late_starts       - fraction of iterations whose start event fired before
//                       the host had enqueued both (then the streams did not
//                       start together; 0 for a valid row)
#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <iterator>
#include <map>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "cuda_bench_support.hpp"
#include "scattered_attention.hpp"
#include "sparsekv/attention/sparse_decode_attention_cuda.hpp"
#include "sparsekv/transfer/page_gather_cuda.hpp"

namespace {

using namespace sparsekv::bench;
using sparsekv::PageId;

constexpr std::uint32_t kPages = 4096;
constexpr std::size_t kPoolBytes = std::size_t{256} << 20;
constexpr std::size_t kMaxPageBytes = 32 << 10;

// Buffers shared by every run, allocated on first use.
struct Buffers {
  std::byte* pool = nullptr;  // pinned, mapped host pool (the CPU tier)
  std::byte* dst = nullptr;   // device pages (the GPU tier)
  PageId* d_src_pages = nullptr;
  PageId* d_dst_pages = nullptr;
  cudaStream_t stream = nullptr;  // non-blocking: cudaMemcpyBatchAsync rejects the legacy stream
  Events events;

  Buffers() {
    void* p = nullptr;
    check(cudaHostAlloc(&p, kPoolBytes, cudaHostAllocMapped), "cudaHostAlloc");
    pool = static_cast<std::byte*>(p);
    std::memset(pool, 0x5a, kPoolBytes);
    dst = device_alloc<std::byte>(kPages * kMaxPageBytes);
    d_src_pages = device_alloc<PageId>(kPages);
    d_dst_pages = device_alloc<PageId>(kPages);
    stream = non_blocking_stream();
  }
};

Buffers& buffers() {
  static Buffers b;
  return b;
}

// The page lists of one page size: distinct random pool pages -> a random permutation of device pages.
struct Lists {
  std::vector<PageId> src, dst;
};

const Lists& lists(std::size_t page_bytes) {
  static std::map<std::size_t, Lists> cache;
  auto it = cache.find(page_bytes);
  if (it != cache.end()) return it->second;
  std::mt19937 rng(static_cast<unsigned>(page_bytes));
  std::vector<PageId> all(kPoolBytes / page_bytes);
  std::iota(all.begin(), all.end(), PageId{0});
  std::shuffle(all.begin(), all.end(), rng);
  Lists l;
  l.src.assign(all.begin(), all.begin() + kPages);
  l.dst.resize(kPages);
  std::iota(l.dst.begin(), l.dst.end(), PageId{0});
  std::shuffle(l.dst.begin(), l.dst.end(), rng);
  return cache.emplace(page_bytes, std::move(l)).first->second;
}

// On the benchmark stream, then waited for: a cudaMemcpy from pageable memory
// may return before its DMA lands, and the non-blocking stream the kernel runs
// on would not wait for the legacy stream.
void upload(const Lists& l) {
  Buffers& b = buffers();
  check(cudaMemcpyAsync(b.d_src_pages, l.src.data(), kPages * sizeof(PageId), cudaMemcpyHostToDevice, b.stream),
        "cudaMemcpyAsync");
  check(cudaMemcpyAsync(b.d_dst_pages, l.dst.data(), kPages * sizeof(PageId), cudaMemcpyHostToDevice, b.stream),
        "cudaMemcpyAsync");
  check(cudaStreamSynchronize(b.stream), "cudaStreamSynchronize");
}

// Mean ms of `enqueue` on the benchmark stream over `reps` back-to-back runs, after one warm-up.
template <class Enqueue>
double mean_ms(int reps, Enqueue&& enqueue) {
  Buffers& b = buffers();
  enqueue();
  check(cudaStreamSynchronize(b.stream), "warm-up");
  const float ms = elapsed_ms(b.events, b.stream, [&] {
    for (int r = 0; r < reps; ++r) enqueue();
  });
  return double(ms) / reps;
}

const CopyReferences& references(std::size_t page_bytes) {
  static std::map<std::size_t, CopyReferences> cache;
  auto it = cache.find(page_bytes);
  if (it != cache.end()) return it->second;
  Buffers& b = buffers();
  const Lists& l = lists(page_bytes);
  CopyReferences r;
  r.per_page_ms = mean_ms(5, [&] {
    for (std::uint32_t i = 0; i < kPages; ++i)
      check(cudaMemcpyAsync(b.dst + l.dst[i] * page_bytes, b.pool + l.src[i] * page_bytes, page_bytes,
                            cudaMemcpyHostToDevice, b.stream),
            "memcpy");
  });
  std::vector<void*> dsts(kPages);
  std::vector<const void*> srcs(kPages);
  std::vector<std::size_t> sizes(kPages, page_bytes);
  for (std::uint32_t i = 0; i < kPages; ++i) {
    dsts[i] = b.dst + l.dst[i] * page_bytes;
    srcs[i] = b.pool + l.src[i] * page_bytes;
  }
  constexpr cudaMemcpyKind kH2D = cudaMemcpyHostToDevice;
  r.batch_ms = -1;
  if (memcpy_batch_works(dsts, srcs, sizes, kH2D, b.stream)) {
    r.batch_ms = mean_ms(20, [&] { check(memcpy_batch(dsts, srcs, sizes, kH2D, b.stream), "cudaMemcpyBatchAsync"); });
  }
  return cache.emplace(page_bytes, r).first->second;
}

// range(0): page KB; range(1): max_sms (0 = all).
void BM_GatherH2D(benchmark::State& state) {
  const std::size_t page_bytes = static_cast<std::size_t>(state.range(0)) << 10;
  sparsekv::cuda::GatherConfig config;
  config.max_sms = static_cast<std::uint32_t>(state.range(1));
  Buffers& b = buffers();
  const Lists& l = lists(page_bytes);
  const CopyReferences& ref = references(page_bytes);
  upload(l);
  auto enqueue = [&] {
    sparsekv::cuda::gather_pages(b.d_src_pages, b.d_dst_pages, kPages, b.pool, page_bytes, b.dst, page_bytes,
                                 page_bytes, config, b.stream);
  };
  enqueue();
  check(cudaStreamSynchronize(b.stream), "warm-up");
  double total_ms = 0;
  for (auto _ : state) {
    const float ms = elapsed_ms(b.events, b.stream, enqueue);
    state.SetIterationTime(ms * 1e-3);
    total_ms += ms;
  }
  const double bytes = double(kPages) * double(page_bytes);
  const double ms = total_ms / double(state.iterations());
  set_copy_counters(state, bytes, ms, ref, pcie_reference().h2d_gbps);
}

BENCHMARK(BM_GatherH2D)
    ->ArgsProduct({{2, 4, 8, 16, 32}, {0, 8}})
    ->ArgNames({"page_kb", "max_sms"})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);

namespace overlap {

// The attention of bench_attention_cuda.cpp and ../shared/gpu/overlap.cu: 8 KB
// pages (the gather's too), 2048 selected tokens per (request, kv head).
constexpr sparsekv::PageLayout kLayout{16, 128, sparsekv::DType::bf16};
constexpr std::size_t kPageBytes = kLayout.page_bytes();
constexpr std::uint32_t kKvHeads = 8, kQHeads = 32;
constexpr std::uint32_t kRowPages = 2048 / kLayout.page_tokens;
constexpr std::uint32_t kMaxBatch = 32;
constexpr std::size_t kAttentionPoolBytes = std::size_t{512} << 20;
// Launches rotate over disjoint page sets this large together, so that the
// 50 MiB L2 does not serve a launch from the one before.
constexpr std::size_t kRotationBytes = std::size_t{128} << 20;
constexpr int kLaunches = 40;
// The gather draws distinct pages from a pool twice its largest size.
constexpr std::size_t kHostPoolBytes = std::size_t{2} << 30;
constexpr std::uint32_t kMaxGatherPages = std::uint32_t{1} << 17;    // 1 GiB, ~20 ms at 55 GB/s
constexpr std::uint32_t kCalibrationPages = std::uint32_t{1} << 14;  // 128 MiB
constexpr std::size_t kPadBytes = std::size_t{256} << 20;
// ~47 ms of padding: enough for one cudaMemcpyBatchAsync over the pages, not
// always for one cudaMemcpyAsync per page (late_starts then says so).
constexpr int kMaxPadCopies = 256;

enum class Engine { kernel, copy_engine };

struct Strategy {
  const char* name;
  Engine engine;
  std::uint32_t max_sms;          // kernel: GatherConfig::max_sms (0: all SMs)
  std::uint32_t warps_per_block;  // kernel: GatherConfig::warps_per_block
  bool prioritized;               // attention on the highest-priority stream, the gather on the lowest
  std::uint32_t run_pages;        // contiguous pages per copy
};

constexpr Strategy kStrategies[] = {
    {"kernel", Engine::kernel, 0, 8, false, 1},
    {"kernel_sms16", Engine::kernel, 16, 8, false, 1},
    {"kernel_sms8", Engine::kernel, 8, 8, false, 1},
    {"kernel_sms4", Engine::kernel, 4, 8, false, 1},
    {"kernel_sms8_fat_blocks", Engine::kernel, 8, 32, false, 1},
    {"kernel_sms2_fat_blocks", Engine::kernel, 2, 32, false, 1},
    {"kernel_low_priority", Engine::kernel, 0, 8, true, 1},
    {"kernel_sms8_low_priority", Engine::kernel, 8, 8, true, 1},
    {"copy_engine_pages", Engine::copy_engine, 0, 0, false, 1},
    {"copy_engine_256KB_runs", Engine::copy_engine, 0, 0, false, 32},
};

// Buffers and streams shared by every run.
struct Buffers {
  std::byte* attention_pool = nullptr;  // device K/V pages the attention reads
  std::byte* pad_dst = nullptr;         // destination of the pad copies
  std::byte* host_pool = nullptr;       // pinned, mapped host pool (the CPU tier)
  std::byte* gather_dst = nullptr;      // device pages the gather fills
  PageId* d_src_pages = nullptr;
  PageId* d_dst_pages = nullptr;
  float* q = nullptr;
  float* out = nullptr;
  float* lse = nullptr;
  cudaStream_t attention_stream = nullptr, gather_stream = nullptr;  // default priority
  cudaStream_t attention_high = nullptr, gather_low = nullptr;       // highest and lowest priority
  Events events;                                                     // start, and stop: the attention's end
  cudaEvent_t gather_stop = nullptr;
  double pad_copy_ms = 0;
  bool batch_copies = false;  // cudaMemcpyBatchAsync works with this toolkit and driver

  Buffers() {
    attention_pool = device_alloc<std::byte>(kAttentionPoolBytes);
    check(cudaMemset(attention_pool, 0x3c, kAttentionPoolBytes), "cudaMemset");  // bf16 0x3c3c: small finite values
    pad_dst = device_alloc<std::byte>(kPadBytes);
    void* p = nullptr;
    check(cudaHostAlloc(&p, kHostPoolBytes, cudaHostAllocMapped), "cudaHostAlloc");
    host_pool = static_cast<std::byte*>(p);
    std::memset(host_pool, 0x5a, kHostPoolBytes);
    gather_dst = device_alloc<std::byte>(std::size_t{kMaxGatherPages} * kPageBytes);
    d_src_pages = device_alloc<PageId>(kMaxGatherPages);
    d_dst_pages = device_alloc<PageId>(kMaxGatherPages);
    const std::vector<float> host_q(std::size_t{kMaxBatch} * kQHeads * kLayout.head_dim, 0.1f);
    q = device_copy(host_q.data(), host_q.size());
    out = device_alloc<float>(host_q.size());
    lse = device_alloc<float>(std::size_t{kMaxBatch} * kQHeads);
    attention_stream = non_blocking_stream();
    gather_stream = non_blocking_stream();
    int least = 0, greatest = 0;
    check(cudaDeviceGetStreamPriorityRange(&least, &greatest), "cudaDeviceGetStreamPriorityRange");
    check(cudaStreamCreateWithPriority(&attention_high, cudaStreamNonBlocking, greatest), "cudaStreamCreate");
    check(cudaStreamCreateWithPriority(&gather_low, cudaStreamNonBlocking, least), "cudaStreamCreate");
    check(cudaEventCreate(&gather_stop), "cudaEventCreate");
    // The fill and the upload ran on the legacy default stream, which the
    // non-blocking streams do not wait for.
    check(cudaDeviceSynchronize(), "setup");
    pad(1, attention_stream);  // warm-up
    pad_copy_ms = elapsed_ms(events, attention_stream, [&] { pad(1, attention_stream); });
    std::vector<void*> dsts{gather_dst};
    std::vector<const void*> srcs{host_pool};
    std::vector<std::size_t> sizes{kPageBytes};
    batch_copies = memcpy_batch_works(dsts, srcs, sizes, cudaMemcpyHostToDevice, gather_stream);
  }

  void pad(int copies, cudaStream_t stream) const {
    for (int c = 0; c < copies; ++c) pad_copy(pad_dst, attention_pool, kPadBytes, stream);
  }

  // Milliseconds of what `enqueue` puts on `stream`, behind `pad_copies` pad copies.
  template <class Enqueue>
  double padded_ms(int pad_copies, cudaStream_t stream, Enqueue&& enqueue) {
    pad(pad_copies, stream);
    return elapsed_ms(events, stream, enqueue);
  }
};

// One batch size's attention (scattered_attention.hpp): kLaunches launches
// rotating over disjoint scattered page sets.
struct Attention {
  ScatteredAttention work;

  void enqueue(cudaStream_t stream) {
    for (int l = 0; l < kLaunches; ++l) {
      sparsekv::cuda::sparse_decode_attention(work.shape, work.args, stream);
      work.rotate();
    }
  }
};

Attention& attention(const Buffers& b, std::uint32_t batch) {
  static std::map<std::uint32_t, Attention> cache;
  const auto [it, made] = cache.try_emplace(batch);
  Attention& a = it->second;
  if (!made) return a;
  // The pool holds at least two sets of the largest batch.
  static_assert(kAttentionPoolBytes >= 2 * std::size_t{kMaxBatch} * kKvHeads * kRowPages * kPageBytes);
  a.work = make_scattered_attention(batch, kQHeads, kKvHeads, kLayout, kRowPages, b.attention_pool, kAttentionPoolBytes,
                                    kRotationBytes, batch);
  a.work.args.q = b.q;
  a.work.args.out = b.out;
  a.work.args.lse = b.lse;
  return a;
}

// One strategy's gather: `units` copies of run_pages contiguous pages each,
// distinct random runs of the pinned pool to a random permutation of the
// first `units` runs of the device buffer.
struct Gather {
  const Strategy* strategy = nullptr;
  std::size_t unit_bytes = 0;
  std::uint32_t units = 0;
  std::vector<void*> dsts;  // the copy engine's copies
  std::vector<const void*> srcs;
  std::vector<std::size_t> sizes;

  double bytes() const { return double(units) * double(unit_bytes); }

  void enqueue(const Buffers& b, cudaStream_t stream) {
    if (strategy->engine == Engine::kernel) {
      sparsekv::cuda::GatherConfig config;
      config.max_sms = strategy->max_sms;
      config.warps_per_block = strategy->warps_per_block;
      sparsekv::cuda::gather_pages(b.d_src_pages, b.d_dst_pages, units, b.host_pool, unit_bytes, b.gather_dst,
                                   unit_bytes, unit_bytes, config, stream);
    } else if (b.batch_copies) {
      check(memcpy_batch(dsts, srcs, sizes, cudaMemcpyHostToDevice, stream), "cudaMemcpyBatchAsync");
    } else {
      for (std::uint32_t i = 0; i < units; ++i)
        check(cudaMemcpyAsync(dsts[i], srcs[i], sizes[i], cudaMemcpyHostToDevice, stream), "cudaMemcpyAsync");
    }
  }
};

// `pages` is at most kMaxGatherPages, so the copies fit the device buffer.
Gather make_gather(const Buffers& b, const Strategy& strategy, std::uint32_t pages) {
  Gather g;
  g.strategy = &strategy;
  g.unit_bytes = strategy.run_pages * kPageBytes;
  g.units = std::max<std::uint32_t>(1, pages / strategy.run_pages);
  std::mt19937 rng(strategy.run_pages);
  std::vector<PageId> src(kHostPoolBytes / g.unit_bytes);
  std::iota(src.begin(), src.end(), PageId{0});
  std::shuffle(src.begin(), src.end(), rng);
  src.resize(g.units);
  std::vector<PageId> dst(g.units);
  std::iota(dst.begin(), dst.end(), PageId{0});
  std::shuffle(dst.begin(), dst.end(), rng);
  if (strategy.engine == Engine::kernel) {
    check(cudaMemcpy(b.d_src_pages, src.data(), g.units * sizeof(PageId), cudaMemcpyHostToDevice), "cudaMemcpy");
    check(cudaMemcpy(b.d_dst_pages, dst.data(), g.units * sizeof(PageId), cudaMemcpyHostToDevice), "cudaMemcpy");
    check(cudaDeviceSynchronize(), "upload");  // as in attention(): the legacy stream is not waited for
  } else {
    for (std::uint32_t i = 0; i < g.units; ++i) {
      g.dsts.push_back(b.gather_dst + dst[i] * g.unit_bytes);
      g.srcs.push_back(b.host_pool + src[i] * g.unit_bytes);
      g.sizes.push_back(g.unit_bytes);
    }
  }
  return g;
}

// The two streams of a run and what each runs.
struct Pair {
  Attention& attention;
  Gather& gather;
  cudaStream_t attention_stream, gather_stream;

  void enqueue_both(const Buffers& b) {
    gather.enqueue(b, gather_stream);
    attention.enqueue(attention_stream);
  }
};

// Pad copies covering twice the host's time to enqueue both (measured on one
// untimed run of both, waited for, which is also the warm-up).
int pad_copies(const Buffers& b, Pair& pair) {
  const auto begin = std::chrono::steady_clock::now();
  pair.enqueue_both(b);
  const std::chrono::duration<double, std::milli> enqueue = std::chrono::steady_clock::now() - begin;
  check(cudaStreamSynchronize(pair.gather_stream), "warm-up");
  check(cudaStreamSynchronize(pair.attention_stream), "warm-up");
  return static_cast<int>(std::clamp(std::ceil(2 * enqueue.count() / b.pad_copy_ms), 1.0, double(kMaxPadCopies)));
}

struct Spans {
  double attention_ms = 0, gather_ms = 0;
  bool late = false;  // the start event fired before the host had enqueued both
};

Spans overlapped(Buffers& b, Pair& pair, int pads) {
  b.pad(pads, pair.attention_stream);
  check(cudaEventRecord(b.events.start, pair.attention_stream), "cudaEventRecord");
  check(cudaStreamWaitEvent(pair.gather_stream, b.events.start, 0), "cudaStreamWaitEvent");
  pair.gather.enqueue(b, pair.gather_stream);
  check(cudaEventRecord(b.gather_stop, pair.gather_stream), "cudaEventRecord");
  pair.attention.enqueue(pair.attention_stream);
  check(cudaEventRecord(b.events.stop, pair.attention_stream), "cudaEventRecord");
  Spans s;
  const cudaError_t started = cudaEventQuery(b.events.start);
  if (started == cudaErrorNotReady) {
    // Not an error; cleared in case the runtime keeps it as the last error,
    // which the next launch's check would read (PyTorch's CUDAEvent::query does the same).
    cudaGetLastError();
  } else {
    check(started, "cudaEventQuery");
    s.late = true;
  }
  check(cudaEventSynchronize(b.events.stop), "cudaEventSynchronize");
  check(cudaEventSynchronize(b.gather_stop), "cudaEventSynchronize");
  float attention_ms = 0, gather_ms = 0;
  check(cudaEventElapsedTime(&attention_ms, b.events.start, b.events.stop), "cudaEventElapsedTime");
  check(cudaEventElapsedTime(&gather_ms, b.events.start, b.gather_stop), "cudaEventElapsedTime");
  s.attention_ms = attention_ms;
  s.gather_ms = gather_ms;
  return s;
}

}  // namespace overlap

// range(0): attention batch; range(1): index into overlap::kStrategies.
void BM_GatherOverlap(benchmark::State& state) {
  using namespace overlap;
  const auto batch = static_cast<std::uint32_t>(state.range(0));
  const Strategy& strategy = kStrategies[state.range(1)];
  static overlap::Buffers b;  // allocated on first use, kept for the process
  Gather gather = make_gather(b, strategy, kCalibrationPages);
  Pair pair{attention(b, batch), gather, strategy.prioritized ? b.attention_high : b.attention_stream,
            strategy.prioritized ? b.gather_low : b.gather_stream};
  auto attention_alone = [&](int pads) {
    return b.padded_ms(pads, pair.attention_stream, [&] { pair.attention.enqueue(pair.attention_stream); });
  };
  auto gather_alone = [&](int pads) {
    return b.padded_ms(pads, pair.gather_stream, [&] { pair.gather.enqueue(b, pair.gather_stream); });
  };
  // Size the gather so that alone it lasts as long as the launches alone.
  int pads = pad_copies(b, pair);
  const double attention_ms = attention_alone(pads);
  const double pages = kCalibrationPages * attention_ms / gather_alone(pads);
  gather = make_gather(b, strategy, static_cast<std::uint32_t>(std::min(pages, double(kMaxGatherPages))));
  pads = pad_copies(b, pair);
  double attention_alone_ms = 0, gather_alone_ms = 0, attention_with_ms = 0, gather_with_ms = 0;
  int late_starts = 0;
  for (auto _ : state) {
    attention_alone_ms += attention_alone(pads);
    gather_alone_ms += gather_alone(pads);
    const Spans s = overlapped(b, pair, pads);
    attention_with_ms += s.attention_ms;
    gather_with_ms += s.gather_ms;
    late_starts += s.late ? 1 : 0;
    state.SetIterationTime(std::max(s.attention_ms, s.gather_ms) * 1e-3);
  }
  const double iterations = double(state.iterations());
  const double pcie_gbps = pcie_reference().h2d_gbps;
  const auto gather_gbps = [&](double total_ms) { return gather.bytes() * iterations / (total_ms * 1e-3) / 1e9; };
  state.counters["attn_slowdown"] = attention_with_ms / attention_alone_ms;
  state.counters["gather_GBps"] = gather_gbps(gather_with_ms);
  state.counters["over_pcie"] = gather_gbps(gather_with_ms) / pcie_gbps;
  state.counters["alone_gather_GBps"] = gather_gbps(gather_alone_ms);
  state.counters["pcie_GBps"] = pcie_gbps;
  state.counters["attn_alone_us"] = 1e3 * attention_alone_ms / iterations / kLaunches;
  state.counters["gather_MiB"] = gather.bytes() / double(1 << 20);
  state.counters["late_starts"] = late_starts / iterations;
  std::string label = strategy.name;
  if (strategy.engine == Engine::copy_engine)
    label += b.batch_copies ? " (cudaMemcpyBatchAsync)" : " (cudaMemcpyAsync per copy)";
  state.SetLabel(label);
}

BENCHMARK(BM_GatherOverlap)
    ->ArgsProduct({{8, overlap::kMaxBatch},
                   benchmark::CreateDenseRange(0, static_cast<int64_t>(std::size(overlap::kStrategies)) - 1, 1)})
    ->ArgNames({"batch", "strategy"})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);

}  // namespace

int main(int argc, char** argv) { return sparsekv::bench::run_benchmarks(argc, argv, report_pcie_reference); }
