#pragma once
// One metadata table with two-level indexing (Spin §5.4, Figure 6).
//
// The table holds one logical array per *instance* (a (request slot, layer,
// kv head) triple). A small static directory, `directory_length` entries per
// instance, maps each run of `segment_entries` logical entries to a segment of
// a shared SegmentPool; segments are taken only when an instance grows over
// them and given back when it shrinks, so memory follows the mapped entries,
// not the worst-case logical capacity.
#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string_view>

#include "sparsekv/core/error.hpp"
#include "sparsekv/memory/memory_resource.hpp"
#include "sparsekv/metadata/segment_pool.hpp"
#include "sparsekv/metadata/two_level_view.hpp"

namespace sparsekv {

template <class Entry>
class TwoLevelTable {
 public:
  // `empty` is the value new entries start with.
  TwoLevelTable(std::string_view name, std::size_t instances, std::uint32_t max_entries_per_instance,
                std::uint32_t segment_entries, std::uint32_t pool_segments, MemoryResource& memory,
                Entry empty = Entry{})
      : name_(name),
        instances_(instances),
        max_entries_(max_entries_per_instance),
        segment_entries_(segment_entries),
        segment_shift_(static_cast<std::uint32_t>(std::countr_zero(checked_segment_entries(name, segment_entries)))),
        directory_length_(static_cast<std::uint32_t>((std::uint64_t{max_entries_per_instance} + segment_entries - 1) >>
                                                     segment_shift_)),
        memory_(&memory),
        pool_(sizeof(Entry) * segment_entries, pool_segments, memory),
        empty_(empty) {
    if (!memory.host_accessible()) {
      fail(ErrorCode::invalid_argument, "{}: the host backend needs host-accessible memory", name_);
    }
    directory_ = static_cast<std::uint32_t*>(memory.allocate(directory_bytes_exact()));
    lengths_ = directory_ + instances_ * directory_length_;
    std::fill_n(directory_, instances_ * directory_length_, kNoSegment);
  }
  ~TwoLevelTable() { memory_->deallocate(directory_, directory_bytes_exact()); }
  TwoLevelTable(const TwoLevelTable&) = delete;
  TwoLevelTable& operator=(const TwoLevelTable&) = delete;

  std::uint32_t length(std::size_t instance) const noexcept { return lengths_[instance]; }
  std::uint32_t max_entries() const noexcept { return max_entries_; }

  // Segments an instance of `entries` logical entries holds.
  std::uint32_t segments_for(std::uint32_t entries) const noexcept {
    return (entries + segment_entries_ - 1) >> segment_shift_;
  }
  // Extra segments growing `instance` to `entries` would take (0 when shrinking).
  std::uint32_t segments_to_grow(std::size_t instance, std::uint32_t entries) const noexcept {
    const std::uint32_t have = segments_for(lengths_[instance]);
    const std::uint32_t need = segments_for(entries);
    return need > have ? need - have : 0;
  }

  // Throws (changing nothing) if `entries` exceeds the per-instance maximum or
  // the pool lacks the segments growth needs.
  void check_resize(std::size_t instance, std::uint32_t entries) const {
    if (entries > max_entries_) {
      fail(ErrorCode::resource_exhausted, "{}: {} entries exceed the per-head maximum of {}", name_, entries,
           max_entries_);
    }
    const std::uint32_t extra = segments_to_grow(instance, entries);
    if (extra > pool_.available()) {
      fail(ErrorCode::resource_exhausted, "{}: {} more segments needed, {} of {} free", name_, extra, pool_.available(),
           pool_.capacity());
    }
  }

  // Grows (new entries = `empty`) or shrinks an instance, taking or returning segments.
  void resize(std::size_t instance, std::uint32_t entries) {
    check_resize(instance, entries);
    std::uint32_t* dir = directory_ + instance * directory_length_;
    const std::uint32_t old_length = lengths_[instance];
    const std::uint32_t have = segments_for(old_length);
    const std::uint32_t need = segments_for(entries);
    for (std::uint32_t s = have; s < need; ++s) dir[s] = pool_.allocate();
    for (std::uint32_t s = need; s < have; ++s) {
      pool_.free(dir[s]);
      dir[s] = kNoSegment;
    }
    lengths_[instance] = entries;
    for (std::uint32_t i = old_length; i < entries; ++i) at(instance, i) = empty_;
  }

  Entry& at(std::size_t instance, std::uint32_t index) noexcept { return *view().find(instance, index); }
  const Entry& at(std::size_t instance, std::uint32_t index) const noexcept { return *view().find(instance, index); }

  TwoLevelView<Entry> view() const noexcept {
    return {directory_, lengths_, reinterpret_cast<Entry*>(const_cast<SegmentPool&>(pool_).base()), directory_length_,
            segment_shift_};
  }

  // Directory (plus per-instance lengths) and the whole pre-allocated pool.
  std::size_t directory_bytes() const noexcept { return directory_bytes_exact(); }
  std::size_t pool_bytes() const noexcept { return pool_.reserved_bytes(); }
  std::size_t used_segment_bytes() const noexcept { return std::size_t{pool_.used()} * pool_.segment_bytes(); }
  const SegmentPool& pool() const noexcept { return pool_; }
  std::uint32_t directory_length() const noexcept { return directory_length_; }
  std::uint32_t directory_segment(std::size_t instance, std::uint32_t slot) const noexcept {
    return directory_[instance * directory_length_ + slot];
  }

 private:
  static std::uint32_t checked_segment_entries(std::string_view name, std::uint32_t segment_entries) {
    if (!std::has_single_bit(segment_entries)) {
      fail(ErrorCode::invalid_argument, "{}: segment_entries ({}) must be a power of two", name, segment_entries);
    }
    return segment_entries;
  }

  std::size_t directory_bytes_exact() const noexcept {
    return sizeof(std::uint32_t) * instances_ * (std::size_t{directory_length_} + 1);
  }

  std::string_view name_;
  std::size_t instances_;
  std::uint32_t max_entries_;
  std::uint32_t segment_entries_;
  std::uint32_t segment_shift_;
  std::uint32_t directory_length_;
  MemoryResource* memory_;
  SegmentPool pool_;
  Entry empty_;
  std::uint32_t* directory_ = nullptr;
  std::uint32_t* lengths_ = nullptr;
};

}  // namespace sparsekv
