#pragma once
// The built-in Attend of a device backend over an AttendPlan, as three steps
// (the CUDA backend runs the middle one as the split-K kernel; a host test
// runs it with decode_attention, so the two steps around it are covered in
// CI):
//   1. gather_run_queries: each run of the plan becomes one kernel row -- a
//      one-kv-head "request" carrying the q heads of its GQA group;
//   2. attention of every row: out [runs][group][head_dim], lse [runs][group];
//   3. merge_run_outputs: the rows of one (request, kv head) and the policy's
//      extra term merge by log-sum-exp into call.out (a row's (o, lse) is the
//      partial max = lse, sum = 1, acc = o).
#include <cstdint>
#include <span>
#include <vector>

#include "sparsekv/facade/backend.hpp"

namespace sparsekv {

struct RunQueries {
  std::vector<float> q;         // [runs][group][head_dim]
  std::uint32_t group = 1;      // q heads per row
  std::uint32_t max_pages = 0;  // the longest run, in pages
};

void gather_run_queries(const AttendCall& call, RunQueries& out);
void merge_run_outputs(const AttendCall& call, std::span<const float> run_out, std::span<const float> run_lse);

}  // namespace sparsekv
