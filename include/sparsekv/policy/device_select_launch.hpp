#pragma once
// The launches of device Selects, found by their spec's type
// (policy/device_select.hpp): a table a program adds to with
// register_device_select_launcher. The CUDA runtime adds the built-in specs'
// launchers (cuda/policy/device_select_launchers.cpp) before its first
// lookup; a layer whose spec has none is refused when the runtime is made or
// the step is entered, before anything is enqueued.
#include <cstddef>
#include <cstdint>
#include <typeinfo>

#include "sparsekv/core/ids.hpp"
#include "sparsekv/policy/device_select.hpp"
#include "sparsekv/policy/select_cuda.hpp"
#include "sparsekv/policy/summary_store_cuda.hpp"

namespace sparsekv {

// What a launcher gets for one layer's Select over a batch's rows, all on the
// device and on `stream` (a cudaStream_t).
struct DeviceSelectCall {
  cuda::SelectRows rows;                             // the candidates: counts, tokens, partitions, the query
  cuda::SelectOutput out;                            // where the selection goes
  const cuda::DeviceSummaries* summaries = nullptr;  // the store, of the spec's summary kind
  std::uint32_t layer = 0;
  std::uint32_t page_tokens = 0;
  // Per row, the host state a Select that reads it sees (reads_host_state):
  // the sink's partition and tokens, the recent partitions, the steady window.
  const PartitionId* sink_partitions = nullptr;
  const std::uint32_t* sink_tokens = nullptr;
  const std::uint32_t* recent = nullptr;
  const std::uint32_t* windows = nullptr;
  // An estimating Select's terms (estimates(): sized by the runtime; null otherwise).
  cuda::EstimateOutput estimate;
  void* workspace = nullptr;
  std::size_t workspace_bytes = 0;
  void* stream = nullptr;
};

// Enqueues the Select of `select` (holding the launcher's spec type); returns
// whether it also wrote estimation terms to call.estimate.
using DeviceSelectLauncher = bool (*)(const DeviceSelect& select, const DeviceSelectCall& call);

// Adds the launcher of spec type `spec`. Refuses (changing nothing) a null
// launcher (invalid_argument) and a type that has one (already_exists).
void register_device_select_launcher(const std::type_info& spec, DeviceSelectLauncher launcher);
template <DeviceSelectSpec S>
void register_device_select_launcher(DeviceSelectLauncher launcher) {
  register_device_select_launcher(typeid(S), launcher);
}

// The launcher of `select`'s spec, or null: none registered, or no device Select.
DeviceSelectLauncher find_device_select_launcher(const DeviceSelect& select);

namespace cuda {
// Adds the built-in specs' launchers, once (library sparsekv::cuda; the CUDA
// runtime calls it when it is made).
void register_builtin_device_select_launchers();
}  // namespace cuda

}  // namespace sparsekv
