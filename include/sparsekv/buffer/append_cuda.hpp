#pragma once
// Appends on the device (the Append stage of the device decode step,
// docs/device-decode.md): one launch per layer step appends the whole batch's decode token.
// For every (batch entry b, kv head h) it
//  1. writes b's k_new / v_new row of head h, bytes unchanged, into slot
//     tail_slots[b] of the GPU tail page tail_pages[b][h];
//  2. converts b's q rows of h's GQA group to fp32 into q_out;
//  3. tests every q / k / v value it reads with is_finite in that same pass;
//     a bad value lowers the error word (below), and a (b, h) whose K or V
//     row holds one writes nothing: the row never reaches the tail page, so
//     never the CPU tier;
//  4. when the token fills the tail (tail_slots[b] == page_tokens - 1),
//     copies the whole page (K and V blocks) to the CPU page reserved for it,
//     cpu_pages[b][h] (mapped pinned host memory written through UVA with
//     16-byte stores), so the save takes no host round trip; the policy-layer
//     entry point (step/append_summaries_cuda.hpp) also summarises it there.
//
// Error word: one uint64 in device memory, set to kNoAppendError by the
// caller; every bad value lowers it with atomicMin to its append_error_key,
// so after the launch it holds the smallest key of the step -- the value the
// facade's host check reports first -- however blocks were scheduled. The
// word is sticky across launches until the caller resets it. Device memory,
// not mapped host memory: device atomics on host memory over PCIe are not
// guaranteed atomic. The caller enqueues an 8-byte cudaMemcpyAsync of the
// word into pinned memory after the step and reads that copy at its next
// call, once the stream has passed it: no host sync on the step.
//
// TensorRT-LLM style: plain structs, caller-owned memory, work enqueued on
// `stream` (a cudaStream_t; nullptr = the default stream), no allocation and
// no synchronisation. Host-side argument checks throw
// ErrorCode::invalid_argument before anything is enqueued; a failed launch
// throws ErrorCode::cuda_error. fmt-free and free of CUDA headers: kernel
// translation units and the host emulation in the tests include it.
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "sparsekv/core/dtype.hpp"
#include "sparsekv/core/host_device.hpp"
#include "sparsekv/core/ids.hpp"
#include "sparsekv/core/numeric.hpp"
#include "sparsekv/memory/page_layout.hpp"

namespace sparsekv::cuda {

// ---- the error word ---------------------------------------------------------
// Key of a bad value, ordered as the facade's host check scans (Manager::step):
// every q value before any k / v value; then batch entry; then k before v;
// then head; then dimension. Packed low to high: dim 16 bits, head 16 bits,
// k / v 1 bit, entry 24 bits, q / kv 1 bit; the top 6 bits stay 0, so every
// key is below kNoAppendError.
enum class AppendTensor : std::uint8_t { q, k, v };

inline constexpr std::uint64_t kNoAppendError = ~std::uint64_t{0};
inline constexpr std::uint32_t kMaxAppendBatch = 1u << 24;
inline constexpr std::uint32_t kMaxAppendHeads = 1u << 16;  // q heads and kv heads
inline constexpr std::uint32_t kMaxAppendDim = 1u << 16;

SPARSEKV_HOST_DEVICE constexpr std::uint64_t append_error_key(std::uint32_t entry, AppendTensor tensor,
                                                              std::uint32_t head, std::uint32_t dim) {
  return (std::uint64_t{tensor != AppendTensor::q} << 57) | (std::uint64_t{entry} << 33) |
         (std::uint64_t{tensor == AppendTensor::v} << 32) | (std::uint64_t{head} << 16) | dim;
}

struct AppendError {
  bool any = false;
  std::uint32_t entry = 0;
  AppendTensor tensor = AppendTensor::q;
  std::uint32_t head = 0;  // a q head for q, a kv head for k / v
  std::uint32_t dim = 0;
};

constexpr AppendError decode_append_error(std::uint64_t word) {
  if (word == kNoAppendError) return {};
  const bool kv = (word >> 57) & 1u;
  const AppendTensor tensor = !kv ? AppendTensor::q : ((word >> 32) & 1u) ? AppendTensor::v : AppendTensor::k;
  return {true, static_cast<std::uint32_t>((word >> 33) & (kMaxAppendBatch - 1)), tensor,
          static_cast<std::uint32_t>((word >> 16) & 0xffffu), static_cast<std::uint32_t>(word & 0xffffu)};
}

// ---- the launch's arguments --------------------------------------------------

struct DeviceAppend {
  std::uint32_t batch = 0;
  std::uint32_t q_heads = 0;  // a multiple of kv_heads (GQA)
  std::uint32_t kv_heads = 0;
  PageLayout layout;            // page_tokens, head_dim and the model dtype of q, k_new, v_new and pages
  const void* q = nullptr;      // [batch][q_heads][head_dim]
  const void* k_new = nullptr;  // [batch][kv_heads][head_dim]
  const void* v_new = nullptr;  // [batch][kv_heads][head_dim]
  float* q_out = nullptr;       // [batch][q_heads][head_dim] fp32, what the attention kernel reads
  // GPU tier: page p at gpu_tier + p * page_stride (16-byte aligned base and stride).
  std::byte* gpu_tier = nullptr;
  std::size_t page_stride = 0;
  const PageId* tail_pages = nullptr;         // [batch][kv_heads]
  const std::uint32_t* tail_slots = nullptr;  // [batch]: tokens in b's tail before this one (< page_tokens)
  // [batch][kv_heads]: the CPU page reserved for (b, h)'s tail, 16-byte
  // aligned and device-accessible; read only for entries whose tail fills.
  std::byte* const* cpu_pages = nullptr;
  std::uint64_t* error = nullptr;  // the error word, device memory
};

// ---- per-thread steps, shared by the kernel and the host emulation ------------
// One block per (b, h) item, blocks striding over the batch's items; the
// block's threads split the dimensions (steps 1-3) and then the page's
// 16-byte vectors (step 4). Each function is one thread's part for one
// dimension or one vector.

SPARSEKV_HOST_DEVICE inline float load_at(const void* base, std::size_t i, DType dtype) {
  return load_element(static_cast<const std::byte*>(base) + i * dtype_size(dtype), 0, dtype);
}

SPARSEKV_HOST_DEVICE inline void lower_error(std::uint64_t& word, std::uint64_t key) {
  if (key < word) word = key;
}

// Converts dimension d of (b, h)'s q rows (its GQA group) into q_out and
// tests them and its K and V values, lowering `first_bad` to each bad value's
// key. Returns true when the K or V value is bad.
SPARSEKV_HOST_DEVICE inline bool append_scan_dim(const DeviceAppend& a, std::uint32_t b, std::uint32_t h,
                                                 std::uint32_t d, std::uint64_t& first_bad) {
  const std::uint32_t dim = a.layout.head_dim;
  const DType dtype = a.layout.dtype;
  const std::uint32_t group = a.q_heads / a.kv_heads;
  for (std::uint32_t g = h * group; g < (h + 1) * group; ++g) {
    const std::size_t i = (std::size_t{b} * a.q_heads + g) * dim + d;
    const float x = load_at(a.q, i, dtype);
    a.q_out[i] = x;
    if (!is_finite(x)) lower_error(first_bad, append_error_key(b, AppendTensor::q, g, d));
  }
  const std::size_t i = (std::size_t{b} * a.kv_heads + h) * dim + d;
  const bool k_bad = !is_finite(load_at(a.k_new, i, dtype));
  const bool v_bad = !is_finite(load_at(a.v_new, i, dtype));
  if (k_bad) lower_error(first_bad, append_error_key(b, AppendTensor::k, h, d));
  if (v_bad) lower_error(first_bad, append_error_key(b, AppendTensor::v, h, d));
  return k_bad || v_bad;
}

SPARSEKV_HOST_DEVICE inline std::byte* append_tail_page(const DeviceAppend& a, std::uint32_t b, std::uint32_t h) {
  return a.gpu_tier + std::size_t{a.tail_pages[std::size_t{b} * a.kv_heads + h]} * a.page_stride;
}

// Copies dimension d of (b, h)'s K and V rows into its tail slot, bytes unchanged.
SPARSEKV_HOST_DEVICE inline void append_write_dim(const DeviceAppend& a, std::uint32_t b, std::uint32_t h,
                                                  std::uint32_t d) {
  const std::size_t size = dtype_size(a.layout.dtype);
  const std::size_t from = ((std::size_t{b} * a.kv_heads + h) * a.layout.head_dim + d) * size;
  std::byte* page = append_tail_page(a, b, h);
  const std::uint32_t slot = a.tail_slots[b];
  if (slot >= a.layout.page_tokens) return;  // device data the host cannot check: never write past the page
  const auto copy = [size](std::byte* to, const void* base, std::size_t offset) {
    const std::byte* source = static_cast<const std::byte*>(base) + offset;
    if (size == 4) {
      std::memcpy(to, source, 4);  // fixed sizes: one 4- or 2-byte access each on the device
    } else {
      std::memcpy(to, source, 2);
    }
  };
  copy(page + a.layout.k_offset(slot) + d * size, a.k_new, from);
  copy(page + a.layout.v_offset(slot) + d * size, a.v_new, from);
}

SPARSEKV_HOST_DEVICE inline bool append_fills_tail(const DeviceAppend& a, std::uint32_t b) {
  return a.tail_slots[b] + 1 == a.layout.page_tokens;
}

// The save's unit: 16 bytes, one load and one store on the device.
struct alignas(16) AppendVector {
  std::uint32_t word[4];
};
SPARSEKV_HOST_DEVICE inline std::size_t append_page_vectors(const PageLayout& layout) {
  return layout.page_bytes() / sizeof(AppendVector);
}

// Copies vector v of (b, h)'s full tail page to its reserved CPU page.
SPARSEKV_HOST_DEVICE inline void append_save_vector(const DeviceAppend& a, std::uint32_t b, std::uint32_t h,
                                                    std::size_t v) {
  const auto* from = reinterpret_cast<const AppendVector*>(append_tail_page(a, b, h));
  auto* to = reinterpret_cast<AppendVector*>(a.cpu_pages[std::size_t{b} * a.kv_heads + h]);
  to[v] = from[v];
}

// Threads per block of the append kernel.
inline constexpr std::uint32_t kAppendThreads = 128;

// Enqueues the append of one decode token per batch entry (steps 1-4 above,
// no summaries). batch == 0 enqueues nothing. Throws invalid_argument for
// q_heads, kv_heads, head_dim or page_tokens of 0, q_heads not a multiple of
// kv_heads, batch / heads / head_dim beyond the error word's fields, an
// unknown dtype, a page or page stride that is not a multiple of 16 bytes, a
// gpu_tier not 16-byte aligned, or a null pointer while batch > 0.
void append_tokens(const DeviceAppend& args, void* stream);

}  // namespace sparsekv::cuda
