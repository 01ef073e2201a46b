// Buffer elasticity and admission advice (Spin §5.3, SparseServe §3.3).
#include <cstring>
#include <memory>
#include <numeric>
#include <vector>

#include "sparsekv/buffer/tiered_kv_buffer.hpp"
#include "test_support.hpp"

using namespace sparsekv;

namespace {

constexpr ModelShape kShape{1, 2, 1, 8, DType::f32};  // one (layer, kv head): pages per head = pages

Config config(std::uint32_t gpu_pages, double ratio = 5.0) {
  Config c;
  c.page_tokens = 4;
  const std::size_t page = c.page_bytes(kShape);
  c.cpu_tier_bytes = 4096 * page;
  c.gpu_tier_bytes = gpu_pages * page;
  c.host_chunk_bytes = 256 * page;
  c.max_requests = 8;
  c.max_context_tokens = 8192;
  c.min_buffer_ratio = ratio;
  c.metadata_segment_entries = 32;
  return c;
}

void prefill(TieredKVBuffer& b, RequestId r, std::uint32_t tokens) {
  std::vector<float> kv(std::size_t{tokens} * kShape.head_dim, 1.0f);
  const std::vector<PartitionSpec> spec{PartitionSpec::uniform(tokens, 4)};
  b.offloader().offload(r, 0, KvChunk{kv.data(), kv.data(), tokens, DType::f32}, spec);
}

}  // namespace

TEST_CASE("The minimum buffer is mandatory x (1 + min_buffer_ratio)", "[buffer]") {
  HostMemoryResource memory(false);
  TieredKVBuffer b(kShape, config(200), memory, memory);
  REQUIRE(b.admission().min_slots_per_head({4, 0}) == 24);  // Spin's 5x buffering
  b.admission().add_request(1, {4, 0});
  REQUIRE(b.admission().slots_per_head(1) == 24);
  REQUIRE(b.tiers().gpu_pool.used() == 25);                                                    // + the tail page
  REQUIRE_SPARSEKV_ERROR(b.admission().add_request(2, {4, 10}), ErrorCode::invalid_argument);  // below the minimum
  REQUIRE_SPARSEKV_ERROR(b.admission().add_request(2, {0, 0}), ErrorCode::invalid_argument);
  REQUIRE_SPARSEKV_ERROR(b.admission().add_request(1, {4, 0}), ErrorCode::already_exists);
  REQUIRE_SPARSEKV_ERROR(b.admission().resize(1, 23), ErrorCode::invalid_argument);
  REQUIRE_SPARSEKV_ERROR(b.admission().resize(7, 30), ErrorCode::not_found);
  REQUIRE_SPARSEKV_ERROR(b.admission().resize(1, 500), ErrorCode::resource_exhausted);
  REQUIRE(b.admission().slots_per_head(1) == 24);
  b.admission().resize(1, 40);
  REQUIRE(b.tiers().gpu_pool.used() == 41);
  b.validate();
}

namespace {
// Counts itself, so a test sees when the buffer destroys an attachment.
struct CountedAttachment : RequestAttachment {
  explicit CountedAttachment(int& live) : live(live) { ++live; }
  ~CountedAttachment() override { --live; }
  int& live;
};
}  // namespace

TEST_CASE("A request's attachment comes and goes with the request, and a refused add takes none", "[buffer]") {
  HostMemoryResource memory(false);
  TieredKVBuffer b(kShape, config(60), memory, memory);
  int live = 0;
  auto first = std::make_unique<CountedAttachment>(live);
  const RequestAttachment* given = first.get();
  b.admission().add_request(1, {2, 0}, std::move(first));
  b.admission().add_request(2, {2, 0});
  REQUIRE(live == 1);
  REQUIRE(b.admission().attachment(1) == given);
  REQUIRE(b.admission().attachment(2) == nullptr);
  REQUIRE(b.admission().request_ids() == std::vector<RequestId>{1, 2});
  REQUIRE_SPARSEKV_ERROR(b.admission().attachment(3), ErrorCode::not_found);

  // Refused (already registered; then short of GPU pages): the new attachment
  // is destroyed, the held one kept, and the books are as they were.
  REQUIRE_SPARSEKV_ERROR(b.admission().add_request(1, {2, 0}, std::make_unique<CountedAttachment>(live)),
                         ErrorCode::already_exists);
  REQUIRE_SPARSEKV_ERROR(b.admission().add_request(3, {20, 0}, std::make_unique<CountedAttachment>(live)),
                         ErrorCode::resource_exhausted);
  REQUIRE(live == 1);
  REQUIRE(b.admission().attachment(1) == given);
  REQUIRE(b.admission().request_ids() == std::vector<RequestId>{1, 2});

  b.admission().finish(1);
  REQUIRE(live == 0);
  REQUIRE_FALSE(b.admission().has_request(1));
  REQUIRE(b.admission().request_ids() == std::vector<RequestId>{2});
  b.validate();
}

TEST_CASE("Reclaim takes buffering pages in proportion to sequence length", "[buffer]") {
  HostMemoryResource memory(false);
  TieredKVBuffer b(kShape, config(400, 1.0), memory, memory);
  b.admission().add_request(1, {10, 100});  // minimum 20: 80 reclaimable
  b.admission().add_request(2, {10, 100});
  b.admission().add_request(3, {10, 30});  // 10 reclaimable
  prefill(b, 1, 300);
  prefill(b, 2, 100);
  prefill(b, 3, 4000);
  REQUIRE(b.tiers().gpu_pool.available() == 400 - 3 - 230);
  // 40 pages wanted; lengths 300 : 100 : 4000. Request 3 (longest) is capped
  // at its 10 reclaimable; the other 30 go 3 : 1 to requests 1 and 2 (23 : 7
  // after rounding down in the first round: 2 + 21 and 0 + 7).
  REQUIRE(b.admission().reclaim(40) == 40);
  REQUIRE(b.admission().slots_per_head(3) == 20);
  REQUIRE(b.admission().slots_per_head(1) == 100 - 23);
  REQUIRE(b.admission().slots_per_head(2) == 100 - 7);
  b.validate();
  // Never below anyone's minimum, however much is asked.
  REQUIRE(b.admission().reclaim(10000) == 57 + 73);
  for (RequestId r : {1, 2, 3}) REQUIRE(b.admission().slots_per_head(r) == 20);
  REQUIRE(b.admission().reclaim(1) == 0);
  b.validate();
}

TEST_CASE("Admission reclaims buffering pages, or refuses and changes nothing", "[buffer]") {
  HostMemoryResource memory(false);
  TieredKVBuffer b(kShape, config(100, 1.0), memory, memory);
  b.admission().add_request(1, {10, 60});  // 61 pages, 40 reclaimable
  const AdmissionAdvice fits = b.admission().can_admit(64, {10, 0});
  REQUIRE(fits.admit);
  REQUIRE(fits.gpu_pages_needed == 21);
  REQUIRE(fits.gpu_pages_free == 39);
  REQUIRE(fits.gpu_pages_reclaimable == 40);
  REQUIRE(fits.cpu_pages_needed == 16);
  const AdmissionAdvice squeeze = b.admission().can_admit(0, {20, 0});  // 41 > 39 free: needs reclaim
  REQUIRE(squeeze.admit);
  b.admission().add_request(2, {20, 0});
  REQUIRE(b.admission().slots_per_head(1) == 58);  // gave back 2 slots
  b.validate();
  const AdmissionAdvice too_big = b.admission().can_admit(0, {30, 0});
  REQUIRE_FALSE(too_big.admit);
  const std::uint32_t used = b.tiers().gpu_pool.used();
  REQUIRE_SPARSEKV_ERROR(b.admission().add_request(3, {30, 0}), ErrorCode::resource_exhausted);
  REQUIRE(b.tiers().gpu_pool.used() == used);
  REQUIRE(b.admission().slots_per_head(1) == 58);
  REQUIRE_FALSE(b.admission().has_request(3));
  REQUIRE_FALSE(b.admission().can_admit(1u << 20, {1, 0}).admit);  // the prompt does not fit the CPU tier
  b.validate();
}

TEST_CASE("Working set is the union of the last w selections (SparseServe §3.3)", "[buffer]") {
  HostMemoryResource memory(false);
  Config c = config(200, 1.0);
  c.working_set_window = 3;
  TieredKVBuffer b(kShape, c, memory, memory);
  b.admission().add_request(1, {8, 0});
  std::vector<float> kv(16 * 8, 0.5f);
  // 16 tokens: partitions of 4, 4, 8 tokens -> 1, 1, 2 pages.
  const std::vector<PartitionSpec> spec{PartitionSpec::variable(16, {0, 4, 8, 16}, [] {
    std::vector<std::uint32_t> ids(16);
    std::iota(ids.begin(), ids.end(), 0u);
    return ids;
  }())};
  b.offloader().offload(1, 0, KvChunk{kv.data(), kv.data(), 16, DType::f32}, spec);
  Retrieval out;
  const auto step = [&](std::vector<PartitionId> sel) {
    const std::vector<std::vector<PartitionId>> selections{sel};
    b.retriever().retrieve(1, 0, selections, out);
  };
  REQUIRE(b.admission().working_set_pages(1) == 0);
  step({0});
  REQUIRE(b.admission().working_set_pages(1) == 1);
  step({2});
  REQUIRE(b.admission().working_set_pages(1) == 3);
  step({0, 2});
  REQUIRE(b.admission().working_set_pages(1) == 3);
  step({1});  // the window drops step 1 ({0}) but step 3 still has 0
  REQUIRE(b.admission().working_set_pages(1) == 4);
  step({1});
  step({1});  // only {1} is left in the window
  REQUIRE(b.admission().working_set_pages(1) == 1);
  REQUIRE(b.tiers().stats.cache.hit_pages + b.tiers().stats.cache.miss_pages == 1 + 2 + 3 + 1 + 1 + 1);
}

TEST_CASE("Decode appends fill a GPU tail page that is saved whole to the CPU tier", "[buffer]") {
  HostMemoryResource memory(false);
  TieredKVBuffer b(kShape, config(200, 1.0), memory, memory);
  b.admission().add_request(1, {4, 0});
  prefill(b, 1, 6);  // partitions of 4 and 2 tokens
  REQUIRE_SPARSEKV_ERROR(b.tails().append(1, 0, KvChunk{nullptr, nullptr, 1, DType::f32}), ErrorCode::invalid_argument);
  std::vector<float> row(kShape.head_dim);
  for (int t = 0; t < 4; ++t) {
    std::fill(row.begin(), row.end(), float(100 + t));
    b.tails().append(1, 0, KvChunk{row.data(), row.data(), 1, DType::f32});
    if (t < 3) {
      REQUIRE(b.tails().tail_tokens(1, 0) == t + 1);
      REQUIRE(b.tiers().table.partition_count(1, 0, 0) == 2);
      const std::vector<PartitionSpec> spec{PartitionSpec::uniform(1, 1)};
      REQUIRE_SPARSEKV_ERROR(b.offloader().offload(1, 0, KvChunk{row.data(), row.data(), 1, DType::f32}, spec),
                             ErrorCode::failed_precondition);
    }
  }
  REQUIRE(b.tails().tail_tokens(1, 0) == 0);
  REQUIRE(b.tiers().table.partition_count(1, 0, 0) == 3);
  REQUIRE(b.tiers().partitions.token_count(1, 0, 0, 2) == 4);
  REQUIRE(b.admission().sequence_length(1, 0) == 10);
  REQUIRE(b.tiers().stats.pages_saved == 1);
  const PageId saved = b.tiers().partitions.pages(1, 0, 0, 2)[0];
  float k = 0;
  std::memcpy(&k, b.tiers().cpu_pool.data(saved) + PageLayout{4, 8, DType::f32}.k_offset(3), 4);
  REQUIRE(k == 103.0f);
  b.admission().finish(1);
  REQUIRE(b.tiers().cpu_pool.used() == 0);
  REQUIRE(b.tiers().gpu_pool.used() == 0);
  REQUIRE_SPARSEKV_ERROR(b.admission().finish(1), ErrorCode::not_found);
}
