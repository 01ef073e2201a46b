#pragma once
// TransferReplicaCopy: a table replica's copies (metadata/table_replica.hpp)
// through a PageTransfer -- memcpy on the host backend, the device transfer's
// own stream on the CUDA backend. The buffer owns the transfer, so this is the
// lowest layer that sees both the tables and the transfer.
#include <cstddef>
#include <span>
#include <vector>

#include "sparsekv/metadata/table_replica.hpp"
#include "sparsekv/transfer/page_transfer.hpp"

namespace sparsekv {

class TransferReplicaCopy final : public ReplicaCopy {
 public:
  explicit TransferReplicaCopy(PageTransfer& transfer) : transfer_(transfer) {}

  void to_replica(std::span<const ReplicaMove> moves, std::size_t bytes) override {
    transfer_.write(page_moves(moves), bytes);
  }
  void to_master(std::span<const ReplicaMove> moves, std::size_t bytes) override {
    transfer_.save(page_moves(moves), bytes);
  }
  void wait() override { transfer_.synchronize(); }

 private:
  std::span<const PageMove> page_moves(std::span<const ReplicaMove> moves) {
    moves_.resize(moves.size());
    for (std::size_t i = 0; i < moves.size(); ++i) moves_[i] = PageMove{moves[i].src, moves[i].dst};
    return moves_;
  }

  PageTransfer& transfer_;
  std::vector<PageMove> moves_;  // scratch
};

}  // namespace sparsekv
