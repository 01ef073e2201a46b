#include <algorithm>
#include <cstring>
#include <span>

#include "sparsekv/core/error.hpp"
#include "sparsekv/partition/partition_map.hpp"
#include "sparsekv/partition/partition_spec.hpp"

namespace sparsekv {

PartitionSpec PartitionSpec::uniform(std::uint32_t tokens, std::uint32_t partition_tokens) {
  if (tokens == 0) fail(ErrorCode::invalid_argument, "PartitionSpec: a spec needs at least one token");
  if (partition_tokens == 0) fail(ErrorCode::invalid_argument, "PartitionSpec: partition_tokens must be > 0");
  PartitionSpec spec;
  spec.tokens_ = tokens;
  spec.partition_tokens_ = partition_tokens;
  spec.partitions_ = static_cast<std::uint32_t>((std::uint64_t{tokens} + partition_tokens - 1) / partition_tokens);
  return spec;
}

PartitionSpec PartitionSpec::variable(std::uint32_t tokens, std::vector<std::uint32_t> offsets,
                                      std::vector<std::uint32_t> token_ids) {
  if (tokens == 0) fail(ErrorCode::invalid_argument, "PartitionSpec: a spec needs at least one token");
  if (offsets.size() < 2 || offsets.front() != 0 || offsets.back() != token_ids.size()) {
    fail(ErrorCode::invalid_argument,
         "PartitionSpec: offsets must start at 0, end at the token list size ({}) and name at least one partition",
         token_ids.size());
  }
  if (token_ids.size() != tokens) {
    fail(ErrorCode::invalid_argument, "PartitionSpec: {} token ids listed for {} tokens; each token exactly once",
         token_ids.size(), tokens);
  }
  for (std::size_t p = 0; p + 1 < offsets.size(); ++p) {
    if (offsets[p + 1] <= offsets[p]) fail(ErrorCode::invalid_argument, "PartitionSpec: partition {} is empty", p);
  }
  std::vector<bool> seen(tokens, false);
  for (std::uint32_t t : token_ids) {
    if (t >= tokens) fail(ErrorCode::invalid_argument, "PartitionSpec: token id {} is not below {}", t, tokens);
    if (seen[t]) fail(ErrorCode::invalid_argument, "PartitionSpec: token {} is in two partitions", t);
    seen[t] = true;
  }
  PartitionSpec spec;
  spec.tokens_ = tokens;
  spec.partitions_ = static_cast<std::uint32_t>(offsets.size() - 1);
  spec.offsets_ = std::move(offsets);
  spec.token_ids_ = std::move(token_ids);
  return spec;
}

PartitionSpec PartitionSpec::variable(std::uint32_t tokens, const std::vector<std::vector<std::uint32_t>>& partitions) {
  std::vector<std::uint32_t> offsets{0};
  std::vector<std::uint32_t> ids;
  for (const auto& p : partitions) {
    ids.insert(ids.end(), p.begin(), p.end());
    offsets.push_back(static_cast<std::uint32_t>(ids.size()));
  }
  return variable(tokens, std::move(offsets), std::move(ids));
}

std::uint32_t PartitionSpec::size(std::uint32_t partition) const {
  check_index("PartitionSpec: partition", partition, partitions_);
  if (is_uniform()) return std::min(partition_tokens_, tokens_ - partition * partition_tokens_);
  return offsets_[partition + 1] - offsets_[partition];
}

std::uint32_t PartitionSpec::token(std::uint32_t partition, std::uint32_t i) const {
  check_index("PartitionSpec: token of partition", i, size(partition));
  if (is_uniform()) return partition * partition_tokens_ + i;
  return token_ids_[offsets_[partition] + i];
}

PartitionMap::PartitionMap(HierarchicalPageTable& table, PagePool& cpu_pool) : table_(&table), cpu_pool_(&cpu_pool) {
  if (cpu_pool.layout().page_tokens != table.geometry().page_tokens) {
    fail(ErrorCode::invalid_argument, "PartitionMap: CPU pool pages hold {} tokens, the page table expects {}",
         cpu_pool.layout().page_tokens, table.geometry().page_tokens);
  }
}

MappedPartitions PartitionMap::map(RequestId request, std::uint32_t layer, std::uint32_t head,
                                   const PartitionSpec& spec) {
  const std::uint32_t page_tokens = table_->geometry().page_tokens;
  MappedPartitions out;
  out.first_partition = table_->partition_count(request, layer, head);  // also checks request, layer, head
  std::vector<std::uint32_t> token_counts(spec.partition_count());
  std::size_t pages = 0;
  for (std::uint32_t p = 0; p < spec.partition_count(); ++p) {
    token_counts[p] = spec.size(p);
    pages += pages_for_tokens(token_counts[p], page_tokens);
  }
  out.placements.resize(spec.token_count());  // before any state changes
  std::vector<PageId> cpu_pages(pages);
  cpu_pool_->allocate(cpu_pages);
  try {
    table_->append_partitions(request, layer, head, token_counts, cpu_pages);
  } catch (...) {
    cpu_pool_->release(cpu_pages);
    throw;
  }
  std::size_t first_page = 0;
  for (std::uint32_t p = 0; p < spec.partition_count(); ++p) {
    for (std::uint32_t i = 0; i < token_counts[p]; ++i) {
      out.placements[spec.token(p, i)] = {cpu_pages[first_page + i / page_tokens], i % page_tokens};
    }
    first_page += pages_for_tokens(token_counts[p], page_tokens);
  }
  return out;
}

void PartitionMap::map_shared_prefix(RequestId request, RequestId source, std::uint32_t layer, std::uint32_t head,
                                     std::uint32_t partitions) {
  const std::uint32_t available = table_->partition_count(source, layer, head);
  if (partitions > available) {
    fail(ErrorCode::out_of_range, "request {} has {} partitions in head ({}, {}); cannot share {}", source, available,
         layer, head, partitions);
  }
  table_->partition_count(request, layer, head);  // checks that the target exists
  if (request == source) fail(ErrorCode::invalid_argument, "request {} cannot share a prefix with itself", request);
  std::vector<std::uint32_t> token_counts(partitions);
  std::vector<PageId> pages;
  for (std::uint32_t p = 0; p < partitions; ++p) {
    if (table_->partition_freed(source, layer, head, p)) {
      fail(ErrorCode::failed_precondition, "request {}: partition {} of head ({}, {}) is freed and cannot be shared",
           source, p, layer, head);
    }
    token_counts[p] = table_->meta(source, layer, head, p).token_count();
    table_->cpu_pages(source, layer, head, p, pages);
  }
  const std::uint32_t first_page = table_->cpu_page_count(request, layer, head);
  std::size_t shared = 0;
  try {
    for (; shared < pages.size(); ++shared) cpu_pool_->share(pages[shared]);
    table_->append_partitions(request, layer, head, token_counts, pages);
  } catch (...) {
    for (std::size_t i = 0; i < shared; ++i) cpu_pool_->release(pages[i]);
    throw;
  }
  // Same pages, same token counts: the source's masks are valid here too.
  for (std::uint32_t i = 0; table_->has_slot_masks() && i < pages.size(); ++i) {
    table_->set_slot_mask(request, layer, head, first_page + i, table_->slot_mask(source, layer, head, i));
  }
}

void PartitionMap::truncate(RequestId request, std::uint32_t layer, std::uint32_t head, std::uint32_t partitions) {
  const std::uint32_t count = table_->partition_count(request, layer, head);
  if (partitions > count) {
    fail(ErrorCode::out_of_range, "head ({}, {}) of request {} has {} partitions; cannot keep {}", layer, head, request,
         count, partitions);
  }
  std::vector<PageId> dropped;
  for (PartitionId p = partitions; p < count; ++p) table_->cpu_pages(request, layer, head, p, dropped);
  std::erase(dropped, kInvalidPage);                              // freed partitions
  table_->truncate_partitions(request, layer, head, partitions);  // checks the GPU slots first
  cpu_pool_->release(dropped);
}

void PartitionMap::unmap(RequestId request) {
  const auto& g = table_->geometry();
  std::vector<PageId> pages;
  for (std::uint32_t layer = 0; layer < g.layers; ++layer) {
    for (std::uint32_t head = 0; head < g.kv_heads; ++head) {
      for (std::uint32_t s = 0; s < table_->gpu_slots(request, layer, head); ++s) {
        if (table_->gpu_entry(request, layer, head, s).occupied()) {
          fail(ErrorCode::failed_precondition, "request {}: GPU slot {} of head ({}, {}) still caches a partition",
               request, s, layer, head);
        }
      }
      table_->all_cpu_pages(request, layer, head, pages);
    }
  }
  std::erase(pages, kInvalidPage);  // freed partitions
  cpu_pool_->release(pages);
  for (std::uint32_t layer = 0; layer < g.layers; ++layer) {
    for (std::uint32_t head = 0; head < g.kv_heads; ++head) table_->clear_partitions(request, layer, head);
  }
}

namespace {

// The page of a one-page partition that may change its mask: held, single, and
// mapped by no other request.
PageId open_page(const HierarchicalPageTable& table, RequestId request, std::uint32_t layer, std::uint32_t head,
                 PartitionId partition, const char* call) {
  if (table.page_count(request, layer, head, partition) != 1) {
    fail(ErrorCode::invalid_argument, "{}: partition {} of head ({}, {}) of request {} spans several pages", call,
         partition, layer, head, request);
  }
  if (table.partition_freed(request, layer, head, partition)) {
    fail(ErrorCode::failed_precondition, "{}: partition {} of head ({}, {}) of request {} is freed", call, partition,
         layer, head, request);
  }
  std::vector<PageId> page;
  table.cpu_pages(request, layer, head, partition, page);
  return page[0];
}

}  // namespace

SlotMask PartitionMap::evict_slots(RequestId request, std::uint32_t layer, std::uint32_t head, PartitionId partition,
                                   SlotMask slots) {
  const PageId page = open_page(*table_, request, layer, head, partition, "evict_slots");
  const std::uint32_t index = table_->first_page_index(request, layer, head, partition);
  const SlotMask live = table_->slot_mask(request, layer, head, index);
  if ((slots & ~live) != 0) {
    fail(ErrorCode::invalid_argument,
         "evict_slots: slots {:#x} of partition {} of head ({}, {}) of request {} are not "
         "all live (live {:#x})",
         slots, partition, layer, head, request, live);
  }
  if (cpu_pool_->ref_count(page) > 1) {
    fail(ErrorCode::failed_precondition,
         "evict_slots: partition {} of head ({}, {}) of request {} lies in a page shared "
         "with another request; shared prefix pages cannot be masked",
         partition, layer, head, request);
  }
  table_->set_slot_mask(request, layer, head, index, live & ~slots);
  return live & ~slots;
}

bool PartitionMap::release_page(RequestId request, std::uint32_t layer, std::uint32_t head, PartitionId partition) {
  open_page(*table_, request, layer, head, partition, "release_page");
  const std::uint32_t index = table_->first_page_index(request, layer, head, partition);
  if (table_->slot_mask(request, layer, head, index) != 0) {
    fail(ErrorCode::failed_precondition, "release_page: partition {} of head ({}, {}) of request {} has live slots",
         partition, layer, head, request);
  }
  const PageId page = table_->free_page(request, layer, head, partition);  // refuses a resident partition
  return cpu_pool_->release(page);
}

PageId PartitionMap::reuse_freed(RequestId request, std::uint32_t layer, std::uint32_t head, PartitionId partition) {
  if (!table_->partition_freed(request, layer, head, partition)) {
    fail(ErrorCode::failed_precondition, "reuse_freed: partition {} of head ({}, {}) of request {} is not freed",
         partition, layer, head, request);
  }
  PageId page = kInvalidPage;
  cpu_pool_->allocate(std::span<PageId>(&page, 1));
  try {
    table_->reuse_freed(request, layer, head, partition, page);
  } catch (...) {
    cpu_pool_->release(page);
    throw;
  }
  return page;
}

void PartitionMap::unshare_page(RequestId request, std::uint32_t layer, std::uint32_t head, PartitionId partition) {
  const PageId shared = open_page(*table_, request, layer, head, partition, "unshare_page");
  if (cpu_pool_->ref_count(shared) < 2) {
    fail(ErrorCode::failed_precondition, "unshare_page: partition {} of head ({}, {}) of request {} is not shared",
         partition, layer, head, request);
  }
  PageId copy = kInvalidPage;
  cpu_pool_->allocate(std::span<PageId>(&copy, 1));
  std::memcpy(cpu_pool_->data(copy), cpu_pool_->data(shared), cpu_pool_->page_bytes());
  table_->replace_page(request, layer, head, partition, copy);
  cpu_pool_->release(shared);
}

std::vector<PageId> PartitionMap::pages(RequestId request, std::uint32_t layer, std::uint32_t head,
                                        PartitionId partition) const {
  std::vector<PageId> out;
  table_->cpu_pages(request, layer, head, partition, out);
  return out;
}

}  // namespace sparsekv
