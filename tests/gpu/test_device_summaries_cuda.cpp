// DeviceSummaries (policy/summary_store_cuda.hpp) on the device, end to end:
// prompts of three requests written by write_prefill into scattered slots of
// two layers (another request's prompt in the slot between them), decode
// pages appended by the append kernel into the store (append_summaries: the
// rows are region + page index), then quest_select / shadowkv_select over the
// requests' regions -- SelectRows first = region(slot, h), count = the pages
// so far, max_row_candidates = the capacity -- against QuestPolicy /
// ShadowKVPolicy fed the same keys: every summary, token count and selection
// bit for bit. RetroInfer's store: the host index's rows (write_rows) and an
// appended page's summaries against RetroInferPolicy, bit for bit. Bad
// arguments are refused before anything is enqueued.
#include <catch2/catch.hpp>
#include <cuda_runtime.h>

#include <algorithm>
#include <random>
#include <span>
#include <tuple>
#include <vector>

#include "append_test_data.hpp"
#include "index_test_data.hpp"
#include "gpu_support.hpp"
#include "sparsekv/policy/summary_store_cuda.hpp"
#include "sparsekv/policy/quest.hpp"
#include "sparsekv/policy/retroinfer.hpp"
#include "sparsekv/policy/select_cuda.hpp"
#include "sparsekv/policy/shadowkv.hpp"

using namespace sparsekv;
using namespace sparsekv::cuda;
using namespace sparsekv::gpu_test;
using namespace sparsekv::test;

namespace {

constexpr std::uint32_t kLayers = 2, kSlots = 4, kKvHeads = 2, kGroup = 2, kDim = 64, kPageTokens = 8;
constexpr std::uint32_t kCapacity = 40, kAppendedPages = 3;

// A request's slot and, per layer, the host policy's state of the same keys.
struct Request {
  std::uint32_t slot = 0, prompt = 0;
  std::vector<QuestPolicy::LayerState> quest;
  std::vector<ShadowKVPolicy::LayerState> shadowkv;
  std::uint32_t pages(std::uint32_t layer) const {
    return static_cast<std::uint32_t>(quest.empty() ? shadowkv[layer].tokens.size() : quest[layer].tokens.size());
  }
};

LayerContext context(std::uint32_t tokens) {
  LayerContext ctx = layer_context(kKvHeads, kDim, kPageTokens, kGroup);
  ctx.layer = 5;  // past Quest's dense layers
  ctx.layers = 8;
  ctx.tokens = tokens;
  return ctx;
}

QuestPolicy quest_policy(std::uint32_t budget) {
  QuestPolicy::Options o;
  o.budget_tokens = budget;
  o.page_tokens_per_partition = kPageTokens;  // one page per partition, as the store keeps them
  return QuestPolicy(o);
}

// Random keys [tokens][kv_heads][dim] in `dtype` on the device, and the fp32 values the policies see.
struct Keys {
  Keys(DType dtype, std::uint32_t tokens, std::mt19937& rng)
      : bytes(encode(random_values(std::size_t{tokens} * kKvHeads * kDim, rng), dtype)),
        fp32(decode(bytes.data(), std::size_t{tokens} * kKvHeads * kDim, dtype)),
        device(bytes),
        block{device.data, dtype, tokens, kKvHeads, kDim} {}
  std::vector<std::byte> bytes;
  std::vector<float> fp32;
  DeviceArray<std::byte> device;
  KeyBlock block;
};

template <class T>
std::vector<T> download(const T* device, std::size_t n) {
  std::vector<T> out(n);
  check(cudaMemcpy(out.data(), device, n * sizeof(T), cudaMemcpyDeviceToHost));
  return out;
}

// Rows [0, n) of region (slot, h) of a layer's device array with `width` floats per candidate.
std::vector<float> region_rows(const float* device, const DeviceSummaries& ds, std::uint32_t slot, std::uint32_t h,
                               std::uint32_t n, std::uint32_t width) {
  return download(device + std::size_t{ds.region(slot, h)} * width, std::size_t{n} * width);
}

void run_store(AppendSummary kind, DType dtype, std::mt19937& rng) {
  DeviceSummaries ds(kind, kLayers, kSlots, kKvHeads, kDim, kCapacity);
  Stream stream;
  // Slots out of row order; slot 1 holds a request outside the batch.
  std::vector<Request> batch(3);
  const std::uint32_t slots[] = {2, 0, 3}, prompts[] = {170, 64, 9};
  for (std::uint32_t b = 0; b < batch.size(); ++b) {
    batch[b].slot = slots[b];
    batch[b].prompt = prompts[b];
  }
  DeviceArray<std::byte> workspace(ds.prefill_workspace_bytes(kCapacity * kPageTokens, kPageTokens));
  for (std::uint32_t layer = 0; layer < kLayers; ++layer) {
    const Keys other(dtype, 123, rng);
    ds.write_prefill(1, layer, other.block, kPageTokens, workspace.data, workspace.size, stream.stream);
    for (Request& r : batch) {
      const Keys keys(dtype, r.prompt, rng);
      ds.write_prefill(r.slot, layer, keys.block, kPageTokens, workspace.data, workspace.size, stream.stream);
      check(cudaStreamSynchronize(stream.stream));  // the workspace and the keys are reused
      const KvView kv = key_view(keys.fp32, r.prompt, context(r.prompt));
      if (kind == AppendSummary::quest) {
        quest_policy(2048).index(context(r.prompt), kv, r.quest.emplace_back());
      } else {
        ShadowKVPolicy().index(context(r.prompt), kv, r.shadowkv.emplace_back());
      }
    }
  }

  // Decode: kAppendedPages pages per request and layer, one token per step; the filled page's rows are
  // region(slot, h) + its index. Each layer its own tail pages; the saved pages are not checked here.
  const auto items = static_cast<std::uint32_t>(batch.size() * kKvHeads);
  const PageLayout layout{kPageTokens, kDim, dtype};
  const std::uint32_t q_heads = kKvHeads * kGroup;
  PinnedBytes cpu(items * layout.page_bytes());
  std::vector<std::byte*> cpu_pages(items);
  std::vector<PageId> tails(items);
  for (std::uint32_t i = 0; i < items; ++i) {
    cpu_pages[i] = cpu.data + std::size_t{i} * layout.page_bytes();
    tails[i] = i;
  }
  DeviceArray<std::byte*> dcpu(cpu_pages);
  DeviceArray<PageId> dtails(tails);
  DeviceArray<std::uint64_t> error(std::vector<std::uint64_t>{kNoAppendError});
  DeviceArray<float> q_out(std::size_t{batch.size()} * q_heads * kDim);
  std::vector<DeviceArray<std::byte>> tiers(kLayers);
  for (auto& tier : tiers) tier.reserve(items * layout.page_bytes());
  for (std::uint32_t page = 0; page < kAppendedPages; ++page) {
    // Per layer, request and token: the page's keys (fp32, [token][kv head][dim]) for the host policies.
    std::vector<std::vector<std::vector<float>>> page_keys(kLayers, std::vector<std::vector<float>>(batch.size()));
    std::vector<std::uint32_t> rows(items);
    for (std::uint32_t b = 0; b < batch.size(); ++b) {
      for (std::uint32_t h = 0; h < kKvHeads; ++h) {
        rows[b * kKvHeads + h] = ds.region(batch[b].slot, h) + batch[b].pages(0);  // every layer alike
      }
    }
    const DeviceArray<std::uint32_t> drows(rows);
    for (std::uint32_t t = 0; t < kPageTokens; ++t) {
      const DeviceArray<std::uint32_t> tail_slots(std::vector<std::uint32_t>(batch.size(), t));
      for (std::uint32_t layer = 0; layer < kLayers; ++layer) {
        const auto q = encode(random_values(std::size_t{batch.size()} * q_heads * kDim, rng), dtype);
        const auto k = encode(random_values(std::size_t{items} * kDim, rng), dtype);
        const auto v = encode(random_values(std::size_t{items} * kDim, rng), dtype);
        const DeviceArray<std::byte> dq(q), dk(k), dv(v);
        const DeviceAppend a{static_cast<std::uint32_t>(batch.size()),
                             q_heads,
                             kKvHeads,
                             layout,
                             dq.data,
                             dk.data,
                             dv.data,
                             q_out.data,
                             tiers[layer].data,
                             layout.page_bytes(),
                             dtails.data,
                             tail_slots.data,
                             dcpu.data,
                             error.data};
        append_tokens(a, ds.append_summaries(layer, drows.data), stream.stream);
        check(cudaStreamSynchronize(stream.stream));
        const auto kf = decode(k.data(), std::size_t{items} * kDim, dtype);
        for (std::uint32_t b = 0; b < batch.size(); ++b) {
          auto& keys = page_keys[layer][b];
          keys.insert(keys.end(), kf.begin() + std::size_t{b} * kKvHeads * kDim,
                      kf.begin() + std::size_t{b + 1} * kKvHeads * kDim);
        }
      }
    }
    for (std::uint32_t layer = 0; layer < kLayers; ++layer) {
      for (std::uint32_t b = 0; b < batch.size(); ++b) {
        Request& r = batch[b];
        const std::uint32_t id = r.pages(layer);
        const LayerContext ctx = context(r.prompt + (page + 1) * kPageTokens);
        const AppendedPage appended{key_view(page_keys[layer][b], kPageTokens, ctx),
                                    std::vector<PartitionId>(kKvHeads, id)};
        if (kind == AppendSummary::quest) {
          quest_policy(2048).append(ctx, appended, r.quest[layer]);
        } else {
          ShadowKVPolicy().append(ctx, appended, r.shadowkv[layer]);
        }
      }
    }
  }
  REQUIRE(error.download()[0] == kNoAppendError);

  // The store's regions hold the policies' states.
  for (std::uint32_t layer = 0; layer < kLayers; ++layer) {
    const std::vector<std::uint32_t> tokens = download(ds.tokens(layer), ds.candidates());
    for (const Request& r : batch) {
      const std::uint32_t n = r.pages(layer);
      for (std::uint32_t h = 0; h < kKvHeads; ++h) {
        CAPTURE(layer, r.slot, h, n);
        const std::uint32_t first = ds.region(r.slot, h);
        const std::vector<std::uint32_t> got(tokens.begin() + first, tokens.begin() + first + n);
        if (kind == AppendSummary::quest) {
          CHECK(got == r.quest[layer].tokens);
          CHECK(same_bits(region_rows(ds.min(layer), ds, r.slot, h, n, kDim), r.quest[layer].min[h].widened()));
          CHECK(same_bits(region_rows(ds.max(layer), ds, r.slot, h, n, kDim), r.quest[layer].max[h].widened()));
        } else {
          CHECK(got == r.shadowkv[layer].tokens);
          CHECK(same_bits(region_rows(ds.landmarks(layer), ds, r.slot, h, n, kDim), r.shadowkv[layer].landmarks[h]));
          CHECK(same_bits(region_rows(ds.outlier_scores(layer), ds, r.slot, h, n, 1),
                          r.shadowkv[layer].outlier_score[h]));
        }
      }
    }
  }

  // Select over the regions: rows (b, h) in batch order, first = region, count = pages so far.
  std::vector<std::uint32_t> first, count;
  for (const Request& r : batch) {
    for (std::uint32_t h = 0; h < kKvHeads; ++h) {
      first.push_back(ds.region(r.slot, h));
      count.push_back(r.pages(0));
    }
  }
  const DeviceArray<std::uint32_t> dfirst(first), dcount(count);
  const std::vector<float> q = random_values(std::size_t{batch.size()} * q_heads * kDim, rng);
  const DeviceArray<float> dq(q);
  for (std::uint32_t layer = 0; layer < kLayers; ++layer) {
    SelectRows rows;
    rows.rows = items;
    rows.kv_heads = kKvHeads;
    rows.group = kGroup;
    rows.head_dim = kDim;
    rows.candidates = ds.candidates();
    rows.max_row_candidates = kCapacity;  // a capacity, above every count
    rows.first = dfirst.data;
    rows.count = dcount.data;
    rows.tokens = ds.tokens(layer);
    rows.partitions = ds.partitions();
    rows.q = dq.data;
    DeviceArray<std::byte> select_workspace(select_workspace_bytes(rows));
    for (const std::uint32_t budget : {8u, 40u, 100u, 100000u}) {
      CAPTURE(layer, budget);
      std::vector<std::vector<PartitionId>> want;
      for (std::uint32_t b = 0; b < batch.size(); ++b) {
        const DecodeQuery query{
            std::span<const float>(q).subspan(std::size_t{b} * q_heads * kDim, std::size_t{q_heads} * kDim), 0};
        Selection s;
        const LayerContext ctx = context(batch[b].prompt + kAppendedPages * kPageTokens);
        if (kind == AppendSummary::quest) {
          quest_policy(budget).select(ctx, query, batch[b].quest[layer], s);
        } else {
          ShadowKVPolicy::Options o;
          o.budget_tokens = budget;
          ShadowKVPolicy(o).select(ctx, query, batch[b].shadowkv[layer], s);
        }
        want.insert(want.end(), s.partitions.begin(), s.partitions.end());
      }
      const QuestSelect quest{ds.min(layer),
                              ds.max(layer),
                              budget,
                              false,
                              quest_policy(budget).options().sink_tokens,
                              quest_policy(budget).window_tokens(),
                              quest_policy(budget).options().spread};
      ShadowKVPolicy::Options o;
      o.budget_tokens = budget;
      const ShadowKVSelect shadowkv{ds.landmarks(layer), ds.outlier_scores(layer), budget, o.recent_tokens,
                                    ShadowKVPolicy(o).outlier_count()};
      const std::uint32_t capacity =
          kind == AppendSummary::quest ? quest_select_capacity(rows, quest) : shadowkv_select_capacity(rows, shadowkv);
      DeviceArray<PartitionId> selected(std::size_t{items} * capacity);
      DeviceArray<std::uint32_t> selected_count(items);
      const SelectOutput out{capacity, selected.data, selected_count.data};
      if (kind == AppendSummary::quest) {
        quest_select(rows, quest, out, select_workspace.data, select_workspace.size, stream.stream);
      } else {
        shadowkv_select(rows, shadowkv, out, select_workspace.data, select_workspace.size, stream.stream);
      }
      check(cudaStreamSynchronize(stream.stream));
      const auto counts = selected_count.download();
      std::vector<PartitionId> ids(std::size_t{items} * capacity, kInvalidPartition);
      for (std::uint32_t r = 0; r < items; ++r) {
        REQUIRE(counts[r] <= capacity);
        selected.download_into(ids, std::size_t{r} * capacity, counts[r]);
        const std::vector<PartitionId> got(ids.begin() + std::size_t{r} * capacity,
                                           ids.begin() + std::size_t{r} * capacity + counts[r]);
        CAPTURE(r);
        REQUIRE(got == want[r]);
      }
    }
  }
}

// One decode page filled for every kv head of a request through the append
// kernel, a token at a time: the page's summary row of head h is rows[h].
struct DecodePage {
  explicit DecodePage(const std::vector<std::uint32_t>& rows) : rows(rows) {
    const std::vector<std::byte*> pages{cpu.data, cpu.data + layout.page_bytes()};
    dcpu.upload(pages);
  }
  // Token t of the page: k / v [kv_heads][dim], a random q.
  void append(std::uint32_t t, const std::vector<float>& k, const std::vector<float>& v,
              const AppendSummaries& summaries, std::mt19937& rng, cudaStream_t stream) {
    const DeviceArray<std::uint32_t> tail_slots(std::vector<std::uint32_t>{t});
    const DeviceArray<float> dq(random_values(std::size_t{q_heads} * kDim, rng)), dk(k), dv(v);
    append_tokens(device_append(dq.data, dk.data, dv.data, tail_slots.data), summaries, stream);
  }
  DeviceAppend device_append(const float* q, const float* k, const float* v, const std::uint32_t* tail_slots) {
    return DeviceAppend{1,          q_heads,    kKvHeads,   layout,    q,
                        k,          v,          q_out.data, tier.data, layout.page_bytes(),
                        tails.data, tail_slots, dcpu.data,  error.data};
  }

  const PageLayout layout{kPageTokens, kDim, DType::f32};
  const std::uint32_t q_heads = kKvHeads * kGroup;
  PinnedBytes cpu{kKvHeads * layout.page_bytes()};
  DeviceArray<std::byte*> dcpu;
  const DeviceArray<PageId> tails{std::vector<PageId>{0, 1}};
  DeviceArray<std::uint64_t> error{std::vector<std::uint64_t>{kNoAppendError}};
  DeviceArray<float> q_out{std::size_t{kKvHeads * kGroup} * kDim};
  DeviceArray<std::byte> tier{kKvHeads * layout.page_bytes()};
  const DeviceArray<std::uint32_t> rows;
};

}  // namespace

TEST_CASE("DeviceSummaries: prefill and appends select as the host policies", "[gpu][device-summaries]") {
  std::mt19937 rng(51);
  for (const AppendSummary kind : {AppendSummary::quest, AppendSummary::shadowkv}) {
    for (const DType dtype : {DType::bf16, DType::f32}) {
      CAPTURE(static_cast<int>(kind), to_string(dtype));
      run_store(kind, dtype, rng);
    }
  }
}

TEST_CASE("DeviceSummaries of token counts alone: prefill and appends write the pages' tokens",
          "[gpu][device-summaries]") {
  std::mt19937 rng(52);
  DeviceSummaries ds(AppendSummary::tokens, kLayers, kSlots, kKvHeads, kDim, kCapacity);
  for (std::uint32_t layer = 0; layer < kLayers; ++layer) {
    CHECK(ds.min(layer) == nullptr);
    CHECK(ds.landmarks(layer) == nullptr);
    CHECK(ds.outlier_scores(layer) == nullptr);
    CHECK(ds.tokens(layer) != nullptr);
  }
  CHECK(ds.prefill_workspace_bytes(170, kPageTokens) == 0);
  Stream stream;
  const std::uint32_t slot = 2, prompt = 171;  // 22 pages, the last of 3 tokens
  const std::uint32_t pages = page_count(prompt, kPageTokens);
  const Keys keys(DType::f32, prompt, rng);
  ds.write_prefill(slot, 1, keys.block, kPageTokens, nullptr, 0, stream.stream);  // no Index kernel: no workspace
  // One decode page filled for every kv head of the request: its row is the region's next page.
  DecodePage page({ds.region(slot, 0) + pages, ds.region(slot, 1) + pages});
  for (std::uint32_t t = 0; t < kPageTokens; ++t) {
    page.append(t, random_values(std::size_t{kKvHeads} * kDim, rng), random_values(std::size_t{kKvHeads} * kDim, rng),
                ds.append_summaries(1, page.rows.data), rng, stream.stream);
  }
  check(cudaStreamSynchronize(stream.stream));
  REQUIRE(page.error.download()[0] == kNoAppendError);
  const std::vector<std::uint32_t> tokens = download(ds.tokens(1), ds.candidates());
  for (std::uint32_t h = 0; h < kKvHeads; ++h) {
    for (std::uint32_t p = 0; p <= pages; ++p) {
      CAPTURE(h, p);
      CHECK(tokens[ds.region(slot, h) + p] == (p < pages ? prefill_page_tokens(p, prompt, kPageTokens) : kPageTokens));
    }
  }
  CHECK(tokens[ds.region(slot, 0) + pages - 1] == 3);
  // The append refuses a tokens kind without its array.
  AppendSummaries no_tokens = ds.append_summaries(1, page.rows.data);
  no_tokens.tokens = nullptr;
  const DeviceArray<std::uint32_t> tail0(std::vector<std::uint32_t>{0});
  const DeviceArray<float> d(random_values(std::size_t{page.q_heads} * kDim, rng));
  const DeviceAppend a = page.device_append(d.data, d.data, d.data, tail0.data);
  CHECK(code_of([&] { append_tokens(a, no_tokens, stream.stream); }) == ErrorCode::invalid_argument);
}

TEST_CASE("DeviceSummaries of RetroInfer: the host index's rows, then decode pages summarised by the append",
          "[gpu][device-summaries]") {
  std::mt19937 rng(53);
  DeviceSummaries ds(AppendSummary::retroinfer, kLayers, kSlots, kKvHeads, kDim, kCapacity, 1);
  CHECK(ds.min(0) == nullptr);
  CHECK(ds.landmarks(0) == nullptr);
  CHECK(ds.centroids(1) != nullptr);
  CHECK(ds.value_sums(1) != nullptr);
  CHECK(ds.prefill_workspace_bytes(170, kPageTokens) == 0);
  // Candidate i of every region is partition i + 1: the sink, 0, is no candidate.
  const std::vector<PartitionId> ids = download(ds.partitions(), ds.candidates());
  for (std::uint32_t c = 0; c < ds.candidates(); ++c) REQUIRE(ids[c] == c % kCapacity + 1);
  Stream stream;
  const std::uint32_t slot = 1, layer = 1, prompt = 171;
  const Keys keys(DType::f32, prompt, rng);
  CHECK(code_of([&] { ds.write_prefill(slot, layer, keys.block, kPageTokens, nullptr, 0, stream.stream); }) ==
        ErrorCode::invalid_argument);  // RetroInfer's prompt summaries come from its host index

  // The host index, its rows per kv head (clusters, then recent partitions) written into the store.
  const std::vector<float> values = random_values(keys.fp32.size(), rng);
  const RetroInferPolicy policy;
  LayerContext ctx = context(prompt);
  RetroInferPolicy::LayerState state;
  policy.index(ctx, KvView{keys.fp32, values, prompt, kKvHeads, kDim, 0}, state);
  const auto head_rows = [&](const RetroInferPolicy::HeadState& head) {
    std::vector<float> centroids = head.centroids, value_sums = head.value_sums;
    centroids.insert(centroids.end(), head.recent_centroids.begin(), head.recent_centroids.end());
    value_sums.insert(value_sums.end(), head.recent_value_sums.begin(), head.recent_value_sums.end());
    std::vector<std::uint32_t> tokens;
    for (const auto& g : head.clusters) tokens.push_back(g.tokens);
    for (const auto& g : head.recent) tokens.push_back(g.tokens);
    return std::tuple{centroids, value_sums, tokens};
  };
  for (std::uint32_t h = 0; h < kKvHeads; ++h) {
    const auto [centroids, value_sums, tokens] = head_rows(state.heads[h]);
    ds.write_rows(slot, layer, h, centroids, value_sums, tokens, stream.stream);
  }

  // One decode page filled for every kv head: its row is the region's next candidate.
  const auto stored = static_cast<std::uint32_t>(state.heads[0].clusters.size() + state.heads[0].recent.size());
  DecodePage page({ds.region(slot, 0) + stored, ds.region(slot, 1) + stored});
  std::vector<float> page_keys, page_values;  // [token][kv head][dim]
  for (std::uint32_t t = 0; t < kPageTokens; ++t) {
    const std::vector<float> k = random_values(std::size_t{kKvHeads} * kDim, rng);
    const std::vector<float> v = random_values(std::size_t{kKvHeads} * kDim, rng);
    page_keys.insert(page_keys.end(), k.begin(), k.end());
    page_values.insert(page_values.end(), v.begin(), v.end());
    page.append(t, k, v, ds.append_summaries(layer, page.rows.data), rng, stream.stream);
  }
  check(cudaStreamSynchronize(stream.stream));
  REQUIRE(page.error.download()[0] == kNoAppendError);
  ctx.tokens += kPageTokens;
  policy.append(ctx,
                AppendedPage{KvView{page_keys, page_values, kPageTokens, kKvHeads, kDim, prompt},
                             std::vector<PartitionId>(kKvHeads, state.heads[0].partitions)},
                state);

  // The store holds the policy's rows, the appended page's included, bit for bit.
  const std::vector<float> centroids = download(ds.centroids(layer), std::size_t{ds.candidates()} * kDim);
  const std::vector<float> value_sums = download(ds.value_sums(layer), std::size_t{ds.candidates()} * kDim);
  const std::vector<std::uint32_t> tokens = download(ds.tokens(layer), ds.candidates());
  for (std::uint32_t h = 0; h < kKvHeads; ++h) {
    CAPTURE(h);
    const auto [want_centroids, want_value_sums, want_tokens] = head_rows(state.heads[h]);
    REQUIRE(want_tokens.size() == stored + 1);
    const std::size_t first = ds.region(slot, h);
    const auto floats = [&](const std::vector<float>& v) {
      return std::vector<float>(v.begin() + first * kDim, v.begin() + (first + stored + 1) * kDim);
    };
    CHECK(same_bits(floats(centroids), want_centroids));
    CHECK(same_bits(floats(value_sums), want_value_sums));
    CHECK(std::vector<std::uint32_t>(tokens.begin() + first, tokens.begin() + first + stored + 1) == want_tokens);
  }
  CHECK(std::all_of(tokens.begin() + ds.region(slot + 1, 0), tokens.end(), [](std::uint32_t t) { return t == 0; }));

  // write_rows refuses bad rows, enqueuing nothing.
  const std::vector<float> row(kDim, 1.0f);
  const std::vector<std::uint32_t> one{8};
  CHECK(code_of([&] { ds.write_rows(kSlots, 0, 0, row, row, one, nullptr); }) == ErrorCode::invalid_argument);
  CHECK(code_of([&] { ds.write_rows(0, 0, kKvHeads, row, row, one, nullptr); }) == ErrorCode::invalid_argument);
  CHECK(code_of([&] { ds.write_rows(0, 0, 0, row, std::span<const float>(row).first(kDim - 1), one, nullptr); }) ==
        ErrorCode::invalid_argument);
  DeviceSummaries quest(AppendSummary::quest, 1, 1, kKvHeads, kDim, 4);
  CHECK(code_of([&] { quest.write_rows(0, 0, 0, row, row, one, nullptr); }) == ErrorCode::invalid_argument);
  CHECK(quest.centroids(0) == nullptr);
  CHECK(quest.value_sums(0) == nullptr);
  check(cudaDeviceSynchronize());
  CHECK(download(ds.tokens(0), ds.candidates()) == std::vector<std::uint32_t>(ds.candidates(), 0));
}

TEST_CASE("DeviceSummaries refuses bad arguments before enqueuing anything", "[gpu][device-summaries]") {
  CHECK(code_of([] { DeviceSummaries(AppendSummary::none, 1, 1, 1, 8, 4); }) == ErrorCode::invalid_argument);
  CHECK(code_of([] { DeviceSummaries(AppendSummary::quest, 1, 0, 1, 8, 4); }) == ErrorCode::invalid_argument);
  CHECK(code_of([] { DeviceSummaries(AppendSummary::quest, 1, 65536, 256, 8, 256); }) ==
        ErrorCode::invalid_argument);  // 2^32 candidates
  DeviceSummaries ds(AppendSummary::shadowkv, 2, 3, kKvHeads, kDim, 4);
  CHECK(ds.min(0) == nullptr);
  CHECK(ds.landmarks(1) != nullptr);
  CHECK(code_of([&] { (void)ds.tokens(2); }) == ErrorCode::invalid_argument);
  std::mt19937 rng(52);
  const Keys keys(DType::f32, 33, rng);  // 5 pages of 8: above the capacity of 4
  const KeyBlock block = keys.block;
  const std::size_t bytes = ds.prefill_workspace_bytes(33, 8);
  DeviceArray<std::byte> workspace(bytes);
  const auto refused = [&](std::uint32_t slot, std::uint32_t layer, const KeyBlock& k, std::uint32_t page_tokens,
                           std::size_t ws) {
    CHECK(code_of([&] { ds.write_prefill(slot, layer, k, page_tokens, workspace.data, ws, nullptr); }) ==
          ErrorCode::invalid_argument);
  };
  KeyBlock fits = block;
  fits.tokens = 32;
  const std::size_t fits_bytes = ds.prefill_workspace_bytes(32, 8);
  refused(0, 0, block, 8, bytes);          // 5 pages > capacity 4
  refused(3, 0, fits, 8, fits_bytes);      // slot out of range
  refused(0, 2, fits, 8, fits_bytes);      // layer out of range
  refused(0, 0, fits, 0, fits_bytes);      // page_tokens 0
  refused(0, 0, fits, 8, fits_bytes - 1);  // small workspace
  KeyBlock wrong = fits;
  wrong.kv_heads = 1;
  refused(0, 0, wrong, 8, fits_bytes);  // the store's shape
  // Nothing was enqueued: the tokens are still the zeros of construction.
  check(cudaDeviceSynchronize());
  const auto tokens = download(ds.tokens(0), ds.candidates());
  CHECK(std::all_of(tokens.begin(), tokens.end(), [](std::uint32_t t) { return t == 0; }));
}
