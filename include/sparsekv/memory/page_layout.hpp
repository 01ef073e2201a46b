#pragma once
// Byte layout of one head-wise page (Spin §5.2): `page_tokens` tokens of one
// (layer, kv head). The K block comes first, then the V block; each block is
// row-major [page_tokens][head_dim] in the storage dtype (the model's, or
// q8_0 blocks: Config::kv_storage), so token `s` of a
// page has its K row at k_offset(s) and its V row at v_offset(s). Rows past a
// partially filled page's token count are unspecified (a reused page keeps old
// bytes) and never read: the partition's token count bounds every reader.
#include <cstddef>
#include <cstdint>

#include "sparsekv/core/dtype.hpp"
#include "sparsekv/core/host_device.hpp"

namespace sparsekv {

struct PageLayout {
  std::uint32_t page_tokens = 8;
  std::uint32_t head_dim = 128;
  DType dtype = DType::bf16;

  SPARSEKV_HOST_DEVICE constexpr std::size_t row_bytes() const noexcept { return dtype_row_bytes(dtype, head_dim); }
  SPARSEKV_HOST_DEVICE constexpr std::size_t block_bytes() const noexcept {
    return std::size_t{page_tokens} * row_bytes();
  }
  SPARSEKV_HOST_DEVICE constexpr std::size_t page_bytes() const noexcept { return 2 * block_bytes(); }
  SPARSEKV_HOST_DEVICE constexpr std::size_t k_offset(std::uint32_t slot) const noexcept {
    return std::size_t{slot} * row_bytes();
  }
  SPARSEKV_HOST_DEVICE constexpr std::size_t v_offset(std::uint32_t slot) const noexcept {
    return block_bytes() + std::size_t{slot} * row_bytes();
  }
};

// Live-slot mask of one page (SpvLLM §2): bit t set means slot t holds a live
// token. Policies that evict tokens for good clear bits instead of moving rows,
// and a reader treats a cleared slot as absent (score -inf). One 64-bit word per
// page, so pages of requests that evict hold at most kMaxMaskedPageTokens.
using SlotMask = std::uint64_t;
inline constexpr std::uint32_t kMaxMaskedPageTokens = 64;

SPARSEKV_HOST_DEVICE constexpr bool slot_live(SlotMask mask, std::uint32_t slot) noexcept {
  return ((mask >> slot) & 1u) != 0;
}
// Mask of a page whose first `tokens` slots are live.
SPARSEKV_HOST_DEVICE constexpr SlotMask full_slot_mask(std::uint32_t tokens) noexcept {
  return tokens >= kMaxMaskedPageTokens ? ~SlotMask{0} : (SlotMask{1} << tokens) - 1;
}

}  // namespace sparsekv
