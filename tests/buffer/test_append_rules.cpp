// Appends on the device (buffer/append_cuda.hpp,
// step/append_summaries_cuda.hpp) without a GPU: a host emulation of the
// kernel's decomposition -- blocks striding over (b, kv head) items, threads
// over dimensions and 16-byte vectors, the warp / block / atomicMin reduction
// of the error word -- built from the per-thread steps the kernel calls,
// against the host path: TailAppender::append (tail rows, the saved page),
// QuestPolicy / ShadowKVPolicy / RetroInferPolicy::append (the page's
// summaries and token count) and the facade's finiteness check (the first bad value it names). Planted mutations
// of the emulation must be caught.
#include <algorithm>
#include <array>
#include <catch2/catch.hpp>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "append_test_data.hpp"
#include "index_test_data.hpp"
#include "sparsekv/buffer/append_cuda.hpp"
#include "sparsekv/buffer/tiered_kv_buffer.hpp"
#include "sparsekv/core/numeric.hpp"
#include "sparsekv/policy/any_policy.hpp"
#include "sparsekv/step/append_summaries_cuda.hpp"
#include "sparsekv/policy/quest.hpp"
#include "sparsekv/policy/retroinfer.hpp"
#include "sparsekv/policy/shadowkv.hpp"
#include "sparsekv/sparsekv.hpp"
#include "test_support.hpp"

using namespace sparsekv;
using namespace sparsekv::cuda;
using namespace sparsekv::test;
using sparsekv::test::same_bits;

namespace {

// The facade's host check order, written out: every q value of the batch in
// order, then per entry its k_new then its v_new values.
std::uint64_t facade_first_bad(const DeviceAppend& a) {
  const std::uint32_t dim = a.layout.head_dim;
  for (std::uint32_t b = 0; b < a.batch; ++b)
    for (std::uint32_t g = 0; g < a.q_heads; ++g)
      for (std::uint32_t d = 0; d < dim; ++d)
        if (!is_finite(load_at(a.q, (std::size_t{b} * a.q_heads + g) * dim + d, a.layout.dtype)))
          return append_error_key(b, AppendTensor::q, g, d);
  for (std::uint32_t b = 0; b < a.batch; ++b)
    for (const auto& [source, tensor] : {std::pair{a.k_new, AppendTensor::k}, std::pair{a.v_new, AppendTensor::v}})
      for (std::uint32_t h = 0; h < a.kv_heads; ++h)
        for (std::uint32_t d = 0; d < dim; ++d)
          if (!is_finite(load_at(source, (std::size_t{b} * a.kv_heads + h) * dim + d, a.layout.dtype)))
            return append_error_key(b, tensor, h, d);
  return kNoAppendError;
}

struct Trial {
  DType dtype;
  std::uint32_t batch, kv_heads, group, dim, page_tokens;
  AppendSummary kind;
  std::uint32_t bad_values;  // non-finite values planted in q / k_new / v_new
};

// One random step: the host path against the emulation. Returns true when
// everything matched; with Mutation::none it REQUIREs it.
bool run_trial(const Trial& tr, std::mt19937& rng, Mutation mutation) {
  const std::uint32_t q_heads = tr.kv_heads * tr.group;
  const ModelShape shape{1, q_heads, tr.kv_heads, tr.dim, tr.dtype};
  const PageLayout layout{tr.page_tokens, tr.dim, tr.dtype};
  Config config;
  config.page_tokens = tr.page_tokens;
  config.max_requests = tr.batch;
  config.max_context_tokens = 2 * tr.page_tokens;
  config.min_buffer_ratio = 1.0;
  config.cpu_tier_bytes = std::size_t{tr.batch} * tr.kv_heads * 4 * layout.page_bytes();
  config.gpu_tier_bytes = std::size_t{tr.batch} * tr.kv_heads * 8 * layout.page_bytes();
  config.host_chunk_bytes = config.cpu_tier_bytes;
  HostMemoryResource cpu(false), gpu(false);
  TieredKVBuffer buffer(shape, config, cpu, gpu);
  const std::size_t row = std::size_t{tr.kv_heads} * tr.dim;

  // Each entry's tail filled at random (often one short of full); its fp32 keys kept for the policies.
  std::vector<std::uint32_t> slots(tr.batch);
  std::vector<std::vector<float>> tail_keys(tr.batch), tail_values(tr.batch);
  for (std::uint32_t b = 0; b < tr.batch; ++b) {
    buffer.admission().add_request(b, RequestPages{1, 0});
    slots[b] = rng() % 2 ? tr.page_tokens - 1 : rng() % tr.page_tokens;
    for (std::uint32_t t = 0; t < slots[b]; ++t) {
      const auto k = encode(test::random_values(row, rng), tr.dtype),
                 v = encode(test::random_values(row, rng), tr.dtype);
      buffer.tails().append(b, 0, KvChunk{k.data(), v.data(), 1, tr.dtype});
      const auto kf = decode(k.data(), row, tr.dtype), vf = decode(v.data(), row, tr.dtype);
      tail_keys[b].insert(tail_keys[b].end(), kf.begin(), kf.end());
      tail_values[b].insert(tail_values[b].end(), vf.begin(), vf.end());
    }
  }

  // The step's tensors, with bad values planted.
  std::vector<float> qf = test::random_values(std::size_t{tr.batch} * q_heads * tr.dim, rng);
  std::vector<float> kf = test::random_values(tr.batch * row, rng), vf = test::random_values(tr.batch * row, rng);
  const float specials[] = {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity()};
  for (std::uint32_t i = 0; i < tr.bad_values; ++i) {
    std::vector<float>& x = rng() % 3 == 0 ? qf : rng() % 2 ? kf : vf;
    x[rng() % x.size()] = specials[rng() % 3];
  }
  const auto q = encode(qf, tr.dtype), k = encode(kf, tr.dtype), v = encode(vf, tr.dtype);

  // The emulated device: its own GPU tier (tail page of (b, h) = page b * kv_heads + h, a copy of
  // the buffer's tail page), CPU pages and summary rows filled with a sentinel.
  const std::uint32_t items = tr.batch * tr.kv_heads;
  const std::size_t page_bytes = layout.page_bytes();
  std::vector<AppendVector> tier(items * page_bytes / sizeof(AppendVector)), saved(tier.size());
  std::memset(saved.data(), 0xA5, saved.size() * sizeof(AppendVector));
  auto* tier_bytes = reinterpret_cast<std::byte*>(tier.data());
  std::vector<PageId> tail_pages(items);
  std::vector<std::byte*> cpu_pages(items);
  std::vector<std::uint32_t> rows(items);
  for (std::uint32_t i = 0; i < items; ++i) {
    tail_pages[i] = i;
    cpu_pages[i] = reinterpret_cast<std::byte*>(saved.data()) + std::size_t{i} * page_bytes;
    rows[i] = items - 1 - i;  // any permutation: rows are the caller's
    std::memcpy(tier_bytes + i * page_bytes,
                buffer.tiers().gpu_pool.data(buffer.tails().tail_page(i / tr.kv_heads, 0, i % tr.kv_heads)),
                page_bytes);
  }
  const std::vector<AppendVector> before = tier;
  std::vector<float> q_out(qf.size(), -1.0f);
  const float sentinel = -7.0f;
  std::vector<float> first(std::size_t{items} * tr.dim, sentinel), second = first, score(items, sentinel);
  const std::uint32_t no_tokens = 0xdeadu;
  std::vector<std::uint32_t> tokens(items, no_tokens);
  std::uint64_t error = kNoAppendError;
  DeviceAppend a;
  a.batch = tr.batch;
  a.q_heads = q_heads;
  a.kv_heads = tr.kv_heads;
  a.layout = layout;
  a.q = q.data();
  a.k_new = k.data();
  a.v_new = v.data();
  a.q_out = q_out.data();
  a.gpu_tier = tier_bytes;
  a.page_stride = page_bytes;
  a.tail_pages = tail_pages.data();
  a.tail_slots = slots.data();
  a.cpu_pages = cpu_pages.data();
  a.error = &error;
  AppendSummaries s;
  s.kind = tr.kind;
  s.rows = rows.data();
  s.min = s.mean = s.centroid = first.data();
  s.max = s.value_sum = second.data();
  s.outlier_score = score.data();
  s.tokens = rng() % 4 != 0 ? tokens.data() : nullptr;  // optional: mostly kept
  emulate(a, s, 1 + rng() % (items + 2), mutation);

  bool ok = true;
  const auto expect = [&](bool condition, const char* what) {
    if (mutation == Mutation::none) {
      INFO(what);
      REQUIRE(condition);
    }
    ok = ok && condition;
  };
  expect(error == facade_first_bad(a), "error word = the facade's first bad value");
  expect(same_bits(q_out, decode(q.data(), qf.size(), tr.dtype)), "q converted to fp32");

  // The host path: the buffer appends each entry (bad rows replaced, their heads compared to the
  // untouched emulated page instead); the policies summarise each full page.
  for (std::uint32_t b = 0; b < tr.batch; ++b) {
    std::vector<float> kb(kf.begin() + b * row, kf.begin() + (b + 1) * row),
        vb(vf.begin() + b * row, vf.begin() + (b + 1) * row);
    std::vector<bool> clean(tr.kv_heads, true);
    for (std::size_t i = 0; i < row; ++i) {
      if (!is_finite(kb[i]) || !is_finite(vb[i])) clean[i / tr.dim] = false;
      if (!is_finite(kb[i])) kb[i] = 0.0f;
      if (!is_finite(vb[i])) vb[i] = 0.0f;
    }
    const auto kbytes = encode(kb, tr.dtype), vbytes = encode(vb, tr.dtype);
    kb = decode(kbytes.data(), row, tr.dtype);  // what the policies see: the stored values
    vb = decode(vbytes.data(), row, tr.dtype);
    const bool fills = slots[b] + 1 == tr.page_tokens;
    std::vector<const std::byte*> tails(tr.kv_heads);
    for (std::uint32_t h = 0; h < tr.kv_heads; ++h)
      tails[h] = buffer.tiers().gpu_pool.data(buffer.tails().tail_page(b, 0, h));
    buffer.tails().append(b, 0, KvChunk{kbytes.data(), vbytes.data(), 1, tr.dtype});
    tail_keys[b].insert(tail_keys[b].end(), kb.begin(), kb.end());
    tail_values[b].insert(tail_values[b].end(), vb.begin(), vb.end());
    // The policies' append of the full page, on a state indexed with one page.
    const LayerContext first_ctx{0, 1, q_heads, tr.kv_heads, tr.dim, tr.page_tokens, tr.page_tokens};
    const LayerContext ctx{0, 1, q_heads, tr.kv_heads, tr.dim, tr.page_tokens, 2 * tr.page_tokens};
    const KvView indexed{tail_keys[b], tail_values[b], tr.page_tokens, tr.kv_heads, tr.dim, 0};
    const KvView page{tail_keys[b], tail_values[b], tr.page_tokens, tr.kv_heads, tr.dim, tr.page_tokens};
    AppendedPage appended{page, std::vector<PartitionId>(tr.kv_heads, 1)};
    QuestPolicy::Options quest_options;
    quest_options.page_tokens_per_partition = tr.page_tokens;
    const QuestPolicy quest(quest_options);
    QuestPolicy::LayerState quest_state;
    ShadowKVPolicy::LayerState shadow_state;
    RetroInferPolicy::LayerState retro_state;
    if (fills && tr.kind == AppendSummary::quest) {
      quest.index(first_ctx, indexed, quest_state);
      quest.append(ctx, appended, quest_state);
    } else if (fills && tr.kind == AppendSummary::shadowkv) {
      ShadowKVPolicy().index(first_ctx, indexed, shadow_state);
      ShadowKVPolicy().append(ctx, appended, shadow_state);
    } else if (fills && tr.kind == AppendSummary::retroinfer) {
      // The prompt is the sink and one recent page (or the sink alone): the page takes the next id.
      RetroInferPolicy().index(first_ctx, indexed, retro_state);
      const AppendedPage next{page, std::vector<PartitionId>(tr.kv_heads, retro_state.heads[0].partitions)};
      RetroInferPolicy().append(ctx, next, retro_state);
    }
    for (std::uint32_t h = 0; h < tr.kv_heads; ++h) {
      const std::uint32_t i = b * tr.kv_heads + h;
      const std::byte* emulated = tier_bytes + i * page_bytes;
      const std::byte* emulated_cpu = cpu_pages[i];
      const std::byte* untouched = reinterpret_cast<const std::byte*>(before.data()) + i * page_bytes;
      const std::vector<std::byte> fill(page_bytes, std::byte{0xA5});
      if (!clean[h]) {
        expect(std::memcmp(emulated, untouched, page_bytes) == 0, "a bad row is not written");
        expect(std::memcmp(emulated_cpu, fill.data(), page_bytes) == 0, "a bad row's page is not saved");
        expect(first[rows[i] * tr.dim] == sentinel && score[rows[i]] == sentinel && tokens[rows[i]] == no_tokens,
               "a bad row's page is not summarised");
        continue;
      }
      // The host tail page: the rows up to the new one (later rows are unspecified; both kept the old bytes).
      expect(std::memcmp(emulated, tails[h], page_bytes) == 0, "tail page bytes");
      if (!fills) {
        expect(std::memcmp(emulated_cpu, fill.data(), page_bytes) == 0, "no save before the tail fills");
        expect(tokens[rows[i]] == no_tokens, "no token count before the tail fills");
        continue;
      }
      std::vector<PageId> cpu_page;
      buffer.tiers().table.cpu_pages(b, 0, h, buffer.tiers().table.partition_count(b, 0, h) - 1, cpu_page);
      expect(std::memcmp(emulated_cpu, buffer.tiers().cpu_pool.data(cpu_page.at(0)), page_bytes) == 0,
             "saved page bytes");
      const auto summary_row = [&](const std::vector<float>& v, std::size_t r, std::size_t n) {
        return std::vector<float>(v.begin() + r * n, v.begin() + (r + 1) * n);
      };
      if (tr.kind == AppendSummary::quest) {
        expect(same_bits(summary_row(first, rows[i], tr.dim), summary_row(quest_state.min[h].widened(), 1, tr.dim)),
               "quest min");
        expect(same_bits(summary_row(second, rows[i], tr.dim), summary_row(quest_state.max[h].widened(), 1, tr.dim)),
               "quest max");
      } else if (tr.kind == AppendSummary::shadowkv) {
        expect(same_bits(summary_row(first, rows[i], tr.dim), summary_row(shadow_state.landmarks[h], 1, tr.dim)),
               "shadowkv landmark");
        expect(same_bits(score[rows[i]], shadow_state.outlier_score[h][1]), "shadowkv outlier score");
      } else if (tr.kind == AppendSummary::retroinfer) {
        const RetroInferPolicy::HeadState& head = retro_state.heads[h];
        const std::size_t last = head.recent.size() - 1;
        expect(same_bits(summary_row(first, rows[i], tr.dim), summary_row(head.recent_centroids, last, tr.dim)),
               "retroinfer centroid");
        expect(same_bits(summary_row(second, rows[i], tr.dim), summary_row(head.recent_value_sums, last, tr.dim)),
               "retroinfer value sum");
      }
      // The page's token count, as the policy's state records it.
      std::uint32_t want_tokens = no_tokens;
      if (tr.kind == AppendSummary::quest) want_tokens = quest_state.tokens.at(1);
      if (tr.kind == AppendSummary::shadowkv) want_tokens = shadow_state.tokens.at(1);
      if (tr.kind == AppendSummary::retroinfer) want_tokens = retro_state.heads[h].recent.back().tokens;
      expect(tokens[rows[i]] == (s.tokens == nullptr ? no_tokens : want_tokens), "page token count");
    }
  }
  return ok;
}

Trial random_trial(std::mt19937& rng, bool with_errors) {
  const DType dtypes[] = {DType::f32, DType::f16, DType::bf16};
  const AppendSummary kinds[] = {AppendSummary::none, AppendSummary::quest, AppendSummary::shadowkv,
                                 AppendSummary::retroinfer};
  return Trial{dtypes[rng() % 3],      1 + static_cast<std::uint32_t>(rng() % 5),
               1u << (rng() % 3),      1 + static_cast<std::uint32_t>(rng() % 2),
               rng() % 2 ? 64u : 128u,
               1u << (rng() % 6),  // Config takes powers of two up to 32 here
               kinds[rng() % 4],       with_errors ? 1 + static_cast<std::uint32_t>(rng() % 4) : 0};
}

}  // namespace

// The append kernel's pages hold a power of two of tokens (Config), where
// sum * float(1 / n) and sum / n agree; the step itself takes any count.
TEST_CASE("RetroInfer's page summary step equals RetroInferPolicy::append at any page size", "[append-rules]") {
  std::mt19937 rng(16);
  const std::uint32_t kv_heads = 2, dim = 24;
  for (const DType dtype : {DType::f32, DType::f16, DType::bf16}) {
    for (const std::uint32_t page_tokens : {1u, 3u, 5u, 7u, 12u, 31u}) {
      CAPTURE(to_string(dtype), page_tokens);
      const std::size_t n = std::size_t{page_tokens} * kv_heads * dim;
      // [token][kv head][dim], as stored: what the policy sees.
      const auto keys_stored = encode(test::random_values(n, rng), dtype);
      const auto values_stored = encode(test::random_values(n, rng, 4.0f), dtype);
      const std::vector<float> keys = decode(keys_stored.data(), n, dtype);
      const std::vector<float> values = decode(values_stored.data(), n, dtype);
      const LayerContext first_ctx{0, 1, kv_heads, kv_heads, dim, page_tokens, page_tokens};
      const LayerContext ctx{0, 1, kv_heads, kv_heads, dim, page_tokens, 2 * page_tokens};
      RetroInferPolicy::LayerState state;
      RetroInferPolicy().index(first_ctx, KvView{keys, values, page_tokens, kv_heads, dim, 0}, state);
      const AppendedPage page{KvView{keys, values, page_tokens, kv_heads, dim, page_tokens},
                              std::vector<PartitionId>(kv_heads, state.heads[0].partitions)};
      RetroInferPolicy().append(ctx, page, state);
      const PageLayout layout{page_tokens, dim, dtype};
      std::vector<std::byte> bytes(layout.page_bytes());
      for (std::uint32_t h = 0; h < kv_heads; ++h) {
        for (std::uint32_t t = 0; t < page_tokens; ++t) {
          for (std::uint32_t d = 0; d < dim; ++d) {
            const std::size_t at = (std::size_t{t} * kv_heads + h) * dim + d;
            store_element(bytes.data() + layout.k_offset(t), d, dtype, keys[at]);
            store_element(bytes.data() + layout.v_offset(t), d, dtype, values[at]);
          }
        }
        std::vector<float> centroid(dim), value_sum(dim);
        for (std::uint32_t d = 0; d < dim; ++d) {
          page_key_mean_value_sum_channel(PageKeyRows{bytes.data(), layout}, PageValueRows{bytes.data(), layout},
                                          page_tokens, d, dtype, centroid[d], value_sum[d]);
        }
        const RetroInferPolicy::HeadState& head = state.heads[h];
        const auto last = static_cast<std::ptrdiff_t>((head.recent.size() - 1) * dim);
        CHECK(same_bits(centroid, std::vector<float>(head.recent_centroids.begin() + last,
                                                     head.recent_centroids.begin() + last + dim)));
        CHECK(same_bits(value_sum, std::vector<float>(head.recent_value_sums.begin() + last,
                                                      head.recent_value_sums.begin() + last + dim)));
      }
    }
  }
}

TEST_CASE("error word: keys order as the facade scans and decode back", "[append-rules]") {
  const auto q = append_error_key(3, AppendTensor::q, 5, 7);
  CHECK(q < append_error_key(0, AppendTensor::k, 0, 0));  // every q value first
  CHECK(append_error_key(0, AppendTensor::v, 9, 9) < append_error_key(1, AppendTensor::k, 0, 0));
  CHECK(append_error_key(2, AppendTensor::k, 9, 9) < append_error_key(2, AppendTensor::v, 0, 0));
  CHECK(append_error_key(kMaxAppendBatch - 1, AppendTensor::v, kMaxAppendHeads - 1, kMaxAppendDim - 1) <
        kNoAppendError);
  const AppendError e = decode_append_error(append_error_key(kMaxAppendBatch - 1, AppendTensor::v, 65535, 65535));
  CHECK((e.any && e.entry == kMaxAppendBatch - 1 && e.tensor == AppendTensor::v && e.head == 65535 && e.dim == 65535));
  CHECK(!decode_append_error(kNoAppendError).any);
  const AppendError eq = decode_append_error(q);
  CHECK((eq.entry == 3 && eq.tensor == AppendTensor::q && eq.head == 5 && eq.dim == 7));
  CHECK(is_finite(0.0f));
  CHECK(is_finite(-std::numeric_limits<float>::max()));
  CHECK(is_finite(std::numeric_limits<float>::denorm_min()));
  CHECK(!is_finite(std::numeric_limits<float>::infinity()));
  CHECK(!is_finite(std::numeric_limits<float>::quiet_NaN()));
}

TEST_CASE("emulated append kernel equals the host path bit for bit", "[append-rules]") {
  std::mt19937 rng(13);
  for (int trial = 0; trial < 300; ++trial) {
    const Trial tr = random_trial(rng, trial % 3 == 0);
    CAPTURE(trial, to_string(tr.dtype), tr.batch, tr.kv_heads, tr.group, tr.dim, tr.page_tokens,
            static_cast<int>(tr.kind), tr.bad_values);
    run_trial(tr, rng, Mutation::none);
  }
}

TEST_CASE("the error word names the value the facade's check refuses", "[append-rules]") {
  std::mt19937 rng(14);
  for (int trial = 0; trial < 60; ++trial) {
    const DType dtype = std::array{DType::f32, DType::f16, DType::bf16}[trial % 3];
    const std::uint32_t kv_heads = 1 + rng() % 3, group = 1 + rng() % 2, dim = 8, batch = 1 + rng() % 4;
    const ModelShape shape{1, kv_heads * group, kv_heads, dim, dtype};
    Config config;
    config.page_tokens = 4;
    config.max_requests = batch;
    config.max_context_tokens = 64;
    config.min_buffer_ratio = 1.0;
    config.cpu_tier_bytes = std::size_t{batch} * kv_heads * 64 * config.page_bytes(shape);
    config.gpu_tier_bytes = config.cpu_tier_bytes;
    config.host_chunk_bytes = config.cpu_tier_bytes;
    RuntimeManager manager(shape, config, make_policy("dense", 64));
    const std::size_t row = std::size_t{kv_heads} * dim, qd = std::size_t{shape.q_heads} * dim;
    std::vector<RequestId> ids;
    for (std::uint32_t b = 0; b < batch; ++b) {
      ids.push_back(10 + b);
      manager.add_request(ids.back(), 64);
      const auto k = encode(test::random_values(row, rng), dtype);
      manager.prefill(ids.back(), 0, k.data(), k.data(), 1);
    }
    std::vector<float> qf = test::random_values(batch * qd, rng), kf = test::random_values(batch * row, rng),
                       vf = test::random_values(batch * row, rng);
    for (std::uint32_t i = 0, n = 1 + rng() % 3; i < n; ++i) {
      std::vector<float>& x = rng() % 4 == 0 ? qf : rng() % 2 ? kf : vf;
      x[rng() % x.size()] = std::numeric_limits<float>::infinity();
    }
    const auto q = encode(qf, dtype), k = encode(kf, dtype), v = encode(vf, dtype);
    std::vector<float> q_out(qf.size());
    std::vector<AppendVector> tier(std::size_t{batch} * kv_heads * PageLayout{4, dim, dtype}.page_bytes() / 16);
    std::vector<PageId> pages(std::size_t{batch} * kv_heads);
    for (std::size_t i = 0; i < pages.size(); ++i) pages[i] = static_cast<PageId>(i);
    std::vector<std::uint32_t> slots(batch, 0);
    std::vector<std::byte*> cpu_pages(pages.size());
    std::uint64_t error = kNoAppendError;
    const DeviceAppend a{batch,
                         shape.q_heads,
                         kv_heads,
                         PageLayout{4, dim, dtype},
                         q.data(),
                         k.data(),
                         v.data(),
                         q_out.data(),
                         reinterpret_cast<std::byte*>(tier.data()),
                         PageLayout{4, dim, dtype}.page_bytes(),
                         pages.data(),
                         slots.data(),
                         cpu_pages.data(),
                         &error};
    emulate(a, AppendSummaries{}, 2, Mutation::none);
    const AppendError e = decode_append_error(error);
    REQUIRE(e.any);
    std::vector<float> out(batch * qd);
    std::string what;
    try {
      manager.decode(ids, 0, q.data(), k.data(), v.data(), out.data());
    } catch (const Error& err) {
      what = err.what();
    }
    CAPTURE(trial, what, e.entry, static_cast<int>(e.tensor), e.head, e.dim);
    const std::string request = "request " + std::to_string(ids[e.entry]);
    REQUIRE(what.find(request) != std::string::npos);
    if (e.tensor == AppendTensor::q) {
      CHECK(what.find("q value " + std::to_string(e.head * dim + e.dim) + " of " + request) != std::string::npos);
    } else {
      CHECK(what.find(e.tensor == AppendTensor::k ? "decode k_new" : "decode v_new") != std::string::npos);
      CHECK(what.find("kv head " + std::to_string(e.head) + " (dim " + std::to_string(e.dim) + ")") !=
            std::string::npos);
    }
  }
}

TEST_CASE("planted mutations of the append kernel are caught", "[append-rules]") {
  for (const Mutation mutation :
       {Mutation::last_bad_wins, Mutation::store_not_min, Mutation::write_bad_row, Mutation::save_before_write}) {
    CAPTURE(static_cast<int>(mutation));
    std::mt19937 rng(15);
    bool caught = false;
    for (int trial = 0; trial < 200 && !caught; ++trial) {
      Trial tr = random_trial(rng, mutation != Mutation::save_before_write);
      if (mutation == Mutation::last_bad_wins || mutation == Mutation::store_not_min) tr.bad_values += 3;
      caught = !run_trial(tr, rng, mutation);
    }
    CHECK(caught);
  }
}
