#pragma once
// SplitPlanAttention: the built-in Attend of an AttendCall (attend_plan.hpp)
// on the host, split into chunks that any of the caller's threads may run
// (split-K, as FlashDecoding and the CUDA kernel split a row's tokens). A row
// -- one (request, kv head) -- is cut into chunks of whole plan pages holding
// kChunkTokens slots (at least one page; a row longer than kMaxRowChunks such
// chunks is cut into kMaxRowChunks longer ones, which bounds the partial
// states the chunks keep); a chunk folds the row's GQA group of q heads over
// its live tokens into partial softmax states, a tile of whole pages of up to
// fold_tile_tokens slots at a time (fold_pages: vectorized, each K/V row
// loaded once for the group). Whichever thread runs a row's last chunk then
// merges the row's chunks by log-sum-exp in chunk order, then the policy's
// extra term, into this object's output buffer, and writes the row's slot
// weights: the merge runs on the threads too, not serially after them;
// finish() copies the outputs out. Chunk and tile boundaries and the
// merge order depend on the plan alone, never on how many threads run the
// chunks or in which order, so the result is bit for bit the same for any
// split (step/host_step.hpp runs it on an engine's threads; HostBackend runs
// it on one).
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "sparsekv/attention/attend_plan.hpp"
#include "sparsekv/attention/attention_partial.hpp"

namespace sparsekv {

class SplitPlanAttention {
 public:
  // Slots per chunk (whole pages; at least one page), and chunks per row at most.
  static constexpr std::uint32_t kChunkTokens = 256;
  static constexpr std::uint32_t kMaxRowChunks = 64;

  // Serial: checks the call (live masks, token counts, extra terms, shapes)
  // and lays out its chunks; then clears the slot weights. Throws
  // invalid_argument before anything is written. The call's plan, q, out and
  // slot_weights must outlive finish().
  void prepare(const AttendCall& call);
  std::size_t chunks() const noexcept { return chunks_.size(); }
  // Chunks [first, end): any thread, concurrently with other threads running
  // disjoint ranges. Reads the plan's pages and q; writes this object's
  // per-chunk state and, for each row whose last chunk it runs, the row's
  // merged outputs and slot weights. Throws nothing.
  void run(std::size_t first, std::size_t end) noexcept;
  // Whether every chunk has run since prepare().
  bool all_ran() const noexcept;
  // Serial, once every chunk has run: writes the outputs (rows without
  // chunks merged here); out is not written before.
  void finish();
  // prepare(), every chunk, finish(): the whole Attend on this thread.
  void attend(const AttendCall& call);

 private:
  struct Chunk {
    std::uint32_t row = 0;                     // b * kv_heads + h
    std::size_t first_page = 0, end_page = 0;  // plan page indices [first, end)
  };
  void run_chunk(std::size_t c) noexcept;
  void merge_row(std::size_t r) noexcept;

  AttendCall call_;
  std::uint32_t group_ = 0;
  std::vector<Chunk> chunks_;
  std::vector<std::size_t> row_chunks_;     // [rows + 1] into chunks_
  std::vector<std::uint32_t> page_tokens_;  // valid slots of plan page i
  std::vector<SoftmaxState> states_;        // [chunk][group]
  std::vector<float> acc_;                  // [chunk][group][head_dim]
  std::vector<float> weights_;              // [chunk][page_fold_scratch_floats]: the fold's scratch
  std::vector<float> scores_;               // with slot weights: [plan page][page_tokens][group], -inf unused
  std::vector<char> ran_;                   // [chunk]: it ran
  std::vector<float> merged_;               // [row][group][head_dim]: the outputs
  std::vector<float> lse_;                  // [row][group]: for the slot weights
  // [row]: chunks not yet run; the thread that runs the last merges the row.
  std::unique_ptr<std::atomic<std::uint32_t>[]> chunks_left_;
  std::size_t chunks_left_capacity_ = 0;
};

}  // namespace sparsekv
