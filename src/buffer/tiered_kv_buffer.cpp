#include "sparsekv/buffer/tiered_kv_buffer.hpp"

#include <algorithm>
#include <string>
#include <unordered_set>
#include <vector>

#include "sparsekv/core/error.hpp"

namespace sparsekv {

std::vector<PartitionId> WorkingSetWindow::partitions() const {
  std::vector<PartitionId> all;
  for (const auto& step : steps_) all.insert(all.end(), step.begin(), step.end());
  std::sort(all.begin(), all.end());
  all.erase(std::unique(all.begin(), all.end()), all.end());
  return all;
}

BufferRequest& BufferRequests::at(RequestId request) {
  const auto it = requests_.find(request);
  if (it == requests_.end()) fail(ErrorCode::not_found, "unknown request {}", request);
  return it->second;
}

const BufferRequest& BufferRequests::at(RequestId request) const {
  return const_cast<BufferRequests*>(this)->at(request);
}

namespace {

const Config& validated(const Config& config, const ModelShape& shape) {
  config.validate(shape);
  return config;
}

std::uint32_t tier_pages(std::size_t bytes, std::size_t page_bytes) {
  return static_cast<std::uint32_t>(bytes / page_bytes);
}

}  // namespace

BufferTiers::BufferTiers(const ModelShape& shape, const Config& config, MemoryResource& cpu_tier,
                         MemoryResource& gpu_pages, MemoryResource& gpu_tables, PageTransfer& transfer,
                         const HeadCapacity& capacity, AttendSite site)
    : shape(shape),
      config(validated(config, shape)),
      layout{config.page_tokens, shape.head_dim, config.storage_dtype(shape)},
      site(site),
      transfer(transfer),
      cpu_pool(layout, tier_pages(config.cpu_tier_bytes, layout.page_bytes()), cpu_tier,
               tier_pages(config.host_chunk_bytes, layout.page_bytes())),
      gpu_pool(layout, tier_pages(config.gpu_tier_bytes, layout.page_bytes()), gpu_pages),
      table(PageTableGeometry::for_config(config, shape, capacity), gpu_tables, cpu_tier),
      partitions(table, cpu_pool),
      lru(config.timestamp_buckets) {
  if (!cpu_tier.host_accessible() || !gpu_tables.host_accessible()) {
    fail(ErrorCode::invalid_argument,
         "TieredKVBuffer: the CPU tier and the page tables must be host-accessible (got {} and {})",
         to_string(cpu_tier.kind()), to_string(gpu_tables.kind()));
  }
  if (site == AttendSite::cpu_tier && !gpu_pages.host_accessible()) {
    fail(ErrorCode::invalid_argument, "TieredKVBuffer: attending the CPU tier in place needs host memory");
  }
  if (layout.dtype == DType::q8_0 && !gpu_pages.host_accessible()) {
    fail(ErrorCode::invalid_argument,
         "TieredKVBuffer: q8_0 storage is served by the host backends; the CUDA kernels read f32, f16 or bf16 pages");
  }
  if (!gpu_pages.host_accessible() && !transfer.reaches_device_memory()) {
    fail(ErrorCode::invalid_argument, "TieredKVBuffer: GPU-tier pages in device memory need a device transfer backend");
  }
}

TieredKVBuffer::TieredKVBuffer(const ModelShape& shape, const Config& config, MemoryResource& cpu_tier,
                               MemoryResource& gpu_tier)
    : TieredKVBuffer(shape, config, cpu_tier, gpu_tier, gpu_tier, host_transfer_) {}

TieredKVBuffer::TieredKVBuffer(const ModelShape& shape, const Config& config, MemoryResource& cpu_tier,
                               MemoryResource& gpu_pages, MemoryResource& gpu_tables, PageTransfer& transfer,
                               const std::optional<HeadCapacity>& capacity, AttendSite site)
    : tiers_(shape, config, cpu_tier, gpu_pages, gpu_tables, transfer, capacity.value_or(config.head_capacity()),
             site) {}

void TieredKVBuffer::validate() const {
  tiers_.table.validate();
  const auto broken = [](const std::string& what) {
    fail(ErrorCode::failed_precondition, "buffer invariant broken: {}", what);
  };
  std::uint64_t gpu_pages = 0;
  std::unordered_set<PageId> owned, cpu_pages, tails;  // tails: in the CPU tier, attending in place
  std::vector<PageId> mapped;
  for (const auto& [id, s] : requests_) {
    if (s.slots < admission_.min_slots_per_head(s.pages))
      broken(fmt::format("request {} is below its minimum buffer", id));
    if (tiers_.site == AttendSite::cpu_tier && s.slots != 0)
      broken(fmt::format("request {} caches pages in place", id));
    for (std::uint32_t l = 0; l < tiers_.shape.layers; ++l) {
      if (s.tail_tokens[l] >= tiers_.config.page_tokens)
        broken(fmt::format("request {} layer {} tail overflows", id, l));
      if (s.pages.evicts && s.tail_tokens[l] != 0) broken(fmt::format("request {} evicts but has a tail", id));
      for (std::uint32_t h = 0; h < tiers_.shape.kv_heads; ++h) {
        if (tiers_.table.gpu_slots(id, l, h) != s.slots)
          broken(fmt::format("request {} head ({}, {}) has the wrong slot count", id, l, h));
        for (std::uint32_t slot = 0; slot < s.slots; ++slot) {
          const PageId page = tiers_.table.gpu_entry(id, l, h, slot).gpu_page;
          if (!tiers_.gpu_pool.is_allocated(page) || !owned.insert(page).second) {
            broken(
                fmt::format("GPU slot {} of request {} head ({}, {}) does not own a page of its own", slot, id, l, h));
          }
        }
        mapped.clear();
        tiers_.table.all_cpu_pages(id, l, h, mapped);
        for (const PageId page : mapped) {
          if (page != kInvalidPage) cpu_pages.insert(page);
        }
        if (s.pages.evicts) {
          evictor_.validate_head(id, l, h);
          continue;
        }
        const PageId tail = s.tail_pages[std::size_t{l} * tiers_.shape.kv_heads + h];
        if (!tiers_.tail_pool().is_allocated(tail) ||
            !(tiers_.site == AttendSite::cpu_tier ? tails : owned).insert(tail).second) {
          broken("a tail page is shared or free");
        }
        std::uint64_t tokens = 0;
        for (PartitionId p = 0; p < tiers_.table.partition_count(id, l, h); ++p)
          tokens += tiers_.table.meta(id, l, h, p).token_count();
        if (tokens + s.tail_tokens[l] != s.tokens[l]) {
          broken(fmt::format("request {} head ({}, {}): {} tokens mapped + {} in the tail != {}", id, l, h, tokens,
                             s.tail_tokens[l], s.tokens[l]));
        }
      }
    }
    gpu_pages += tiers_.heads() * s.slots;
    if (tiers_.site == AttendSite::gpu_tier) gpu_pages += tiers_.heads() * tail_pages_per_head(s.pages);
  }
  for (const PageId tail : tails) {
    if (cpu_pages.contains(tail)) broken(fmt::format("tail page {} is also a mapped CPU page", tail));
  }
  if (gpu_pages != tiers_.gpu_pool.used())
    broken(fmt::format("{} GPU pages owned, the pool has {} in use", gpu_pages, tiers_.gpu_pool.used()));
  if (cpu_pages.size() + tails.size() != tiers_.cpu_pool.used()) {
    broken(fmt::format("{} CPU pages mapped and {} tails, the pool has {} in use", cpu_pages.size(), tails.size(),
                       tiers_.cpu_pool.used()));
  }
}

}  // namespace sparsekv
