#pragma once
// TableReplica: a copy of a TwoLevelTable (Spin §5.4) in another memory, for
// kernels that cannot reach the master: Spin §5.2 keeps the meta-partition
// and GPU page tables in device memory, while the host keeps its own copy for
// its bookkeeping. The replica has the master's geometry and segment
// numbering, so directories are copied verbatim and a view of the replica
// resolves every index to the replica's copy of the master's entry. Bytes
// move through a ReplicaCopy that the layer owning the memory supplies
// (buffer/transfer_replica_copy.hpp: the buffer's PageTransfer, memcpy on the
// host backend and the backend's stream on the device), so CI runs the same
// code the device path does and this layer needs no transfer of its own.
//
// Who writes what: kernels write entries only, never directories or lengths.
// The host changes the master (resize, new entries) and uploads the instance
// before a launch reads it; it downloads an instance's entries before it
// reads or changes what a kernel wrote there.
//
// Ordering is the caller's: the copies run in the ReplicaCopy's order (the
// device transfer's own stream). Before a launch reads the replica, complete
// the uploads or order the launch's stream after the copies (the
// constructor's directory copy included); enqueue a download only once the
// kernels that wrote the entries are complete.
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

#include "sparsekv/memory/memory_resource.hpp"
#include "sparsekv/metadata/replica_word_write.hpp"
#include "sparsekv/metadata/two_level_table.hpp"

namespace sparsekv {

// One block a replica copy moves: `bytes` (ReplicaCopy's argument) from src to dst.
struct ReplicaMove {
  const std::byte* src = nullptr;
  std::byte* dst = nullptr;
};

// How a replica's bytes move between the master (host memory) and the
// replica's memory. Copies may complete later, in the order they were asked
// for; wait() returns once every copy asked for so far has landed.
class ReplicaCopy {
 public:
  virtual ~ReplicaCopy() = default;
  virtual void to_replica(std::span<const ReplicaMove> moves, std::size_t bytes) = 0;
  virtual void to_master(std::span<const ReplicaMove> moves, std::size_t bytes) = 0;
  virtual void wait() = 0;
};

template <class Entry>
class TableReplica {
 public:
  // Allocates the replica in `memory` and copies the master's whole
  // directory (every instance's row and length) through `copy`.
  TableReplica(const TwoLevelTable<Entry>& master, MemoryResource& memory, ReplicaCopy& copy)
      : memory_(&memory),
        instances_(instance_count(master)),
        directory_length_(master.directory_length()),
        directory_bytes_(master.directory_bytes()),
        pool_bytes_(master.pool_bytes()),
        segment_bytes_(master.pool().segment_bytes()) {
    directory_ = static_cast<std::uint32_t*>(memory.allocate(directory_bytes_));
    try {
      segments_ = static_cast<Entry*>(memory.allocate(pool_bytes_));
    } catch (...) {
      memory.deallocate(directory_, directory_bytes_);
      throw;
    }
    const TwoLevelView<Entry> m = master.view();
    const ReplicaMove whole{reinterpret_cast<const std::byte*>(m.directory), reinterpret_cast<std::byte*>(directory_)};
    copy.to_replica({&whole, 1}, directory_bytes_);
  }
  ~TableReplica() {
    memory_->deallocate(segments_, pool_bytes_);
    memory_->deallocate(directory_, directory_bytes_);
  }
  TableReplica(const TableReplica&) = delete;
  TableReplica& operator=(const TableReplica&) = delete;

  // The view kernels index through: the master's layout in the replica's memory.
  TwoLevelView<Entry> view() const noexcept {
    return {directory_, lengths(), segments_, directory_length_, segment_shift()};
  }

  // Makes the replica's `instance` equal to the master's: directory row,
  // length and every entry of its segments. Enqueued on `copy`.
  void upload(const TwoLevelTable<Entry>& master, std::size_t instance, ReplicaCopy& copy) {
    const TwoLevelView<Entry> m = master.view();
    const ReplicaMove row{reinterpret_cast<const std::byte*>(m.directory + instance * directory_length_),
                          reinterpret_cast<std::byte*>(directory_ + instance * directory_length_)};
    copy.to_replica({&row, 1}, std::size_t{directory_length_} * sizeof(std::uint32_t));
    const ReplicaMove length{reinterpret_cast<const std::byte*>(m.lengths + instance),
                             reinterpret_cast<std::byte*>(lengths() + instance)};
    copy.to_replica({&length, 1}, sizeof(std::uint32_t));
    segment_moves(master, instance, true);
    copy.to_replica(moves_, segment_bytes_);
  }

  // The writes that make entries [first, first + count) of `instance`, its
  // length and the directory slots of their segments equal the master's,
  // appended to `out`: for entries the host appended while kernels own the
  // instance's other entries. Entry is a whole number of 32-bit words.
  void entry_writes(const TwoLevelTable<Entry>& master, std::size_t instance, std::uint32_t first, std::uint32_t count,
                    std::vector<ReplicaWordWrite>& out) const {
    static_assert(sizeof(Entry) % sizeof(std::uint32_t) == 0);
    if (count == 0) return;
    const TwoLevelView<Entry> m = master.view();
    const TwoLevelView<Entry> r = view();
    const auto words = [&](const Entry& from, Entry* to) {
      constexpr std::size_t n = sizeof(Entry) / sizeof(std::uint32_t);
      std::uint32_t value[n];
      std::memcpy(value, &from, sizeof(Entry));
      auto* target = reinterpret_cast<std::uint32_t*>(to);
      for (std::size_t w = 0; w < n; ++w) out.push_back({target + w, value[w]});
    };
    const std::uint32_t shift = segment_shift();
    for (std::uint32_t slot = first >> shift; slot <= (first + count - 1) >> shift; ++slot) {
      const std::size_t at = instance * directory_length_ + slot;
      out.push_back({directory_ + at, m.directory[at]});
    }
    out.push_back({lengths() + instance, m.lengths[instance]});
    for (std::uint32_t i = first; i < first + count; ++i) {
      const std::uint32_t segment = m.directory[instance * directory_length_ + (i >> shift)];
      const std::size_t offset = (static_cast<std::size_t>(segment) << shift) + (i & ((1u << shift) - 1u));
      words(m.segments[offset], r.segments + offset);
    }
  }

  // Copies the replica's entries of `instance` into the master, whose
  // directory and length it mirrors. Enqueued on `copy`: the master holds
  // them once copy.wait() returns (a sync on the device path, for the host's
  // bookkeeping, off the step's path).
  void download(const TwoLevelTable<Entry>& master, std::size_t instance, ReplicaCopy& copy) {
    segment_moves(master, instance, false);
    copy.to_master(moves_, segment_bytes_);
  }

 private:
  static std::size_t instance_count(const TwoLevelTable<Entry>& master) {
    return master.directory_bytes() / sizeof(std::uint32_t) / (std::size_t{master.directory_length()} + 1);
  }
  // Lengths follow the directory rows, as in the master.
  std::uint32_t* lengths() const noexcept { return directory_ + instances_ * directory_length_; }
  std::uint32_t segment_shift() const noexcept {
    return static_cast<std::uint32_t>(std::countr_zero(segment_bytes_ / sizeof(Entry)));
  }
  // One move per segment the instance maps: master -> replica (`up`) or back.
  // Segment numbers come from the master's directory (the host can read it;
  // the replica's may be device memory): both tables number them alike.
  void segment_moves(const TwoLevelTable<Entry>& master, std::size_t instance, bool up) {
    auto* master_base = reinterpret_cast<std::byte*>(master.view().segments);
    auto* replica_base = reinterpret_cast<std::byte*>(segments_);
    moves_.clear();
    const std::uint32_t used = master.segments_for(master.length(instance));
    for (std::uint32_t s = 0; s < used; ++s) {
      const std::size_t offset = std::size_t{master.directory_segment(instance, s)} * segment_bytes_;
      std::byte* in_master = master_base + offset;
      if (up) {
        moves_.push_back({in_master, replica_base + offset});
      } else {
        moves_.push_back({replica_base + offset, in_master});
      }
    }
  }

  MemoryResource* memory_;
  std::size_t instances_;
  std::uint32_t directory_length_;
  std::size_t directory_bytes_;
  std::size_t pool_bytes_;
  std::size_t segment_bytes_;
  std::uint32_t* directory_ = nullptr;
  Entry* segments_ = nullptr;
  std::vector<ReplicaMove> moves_;  // scratch
};

}  // namespace sparsekv
