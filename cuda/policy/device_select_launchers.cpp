// The built-in device Selects' launchers (policy/device_select_launch.hpp):
// each spec's parameters into its kernel entry point (policy/select_cuda.hpp).
#include <mutex>

#include "sparsekv/policy/dense.hpp"
#include "sparsekv/policy/device_select_launch.hpp"
#include "sparsekv/policy/quest.hpp"
#include "sparsekv/policy/retroinfer.hpp"
#include "sparsekv/policy/shadowkv.hpp"
#include "sparsekv/policy/streaming_window.hpp"

namespace sparsekv::cuda {
namespace {

bool launch_quest(const DeviceSelect& select, const DeviceSelectCall& c) {
  const auto& q = select.get<QuestDeviceSelect>();
  const QuestSelect quest{c.summaries->min(c.layer),
                          c.summaries->max(c.layer),
                          q.budget_tokens,
                          q.dense_layer,
                          q.sink_tokens,
                          q.window_tokens,
                          q.spread};
  quest_select(c.rows, quest, c.out, c.workspace, c.workspace_bytes, c.stream);
  return false;
}

bool launch_shadowkv(const DeviceSelect& select, const DeviceSelectCall& c) {
  const auto& k = select.get<ShadowKVDeviceSelect>();
  const ShadowKVSelect shadow{c.summaries->landmarks(c.layer), c.summaries->outlier_scores(c.layer), k.budget_tokens,
                              k.recent_tokens, k.outlier_pages};
  shadowkv_select(c.rows, shadow, c.out, c.workspace, c.workspace_bytes, c.stream);
  return false;
}

bool launch_streaming(const DeviceSelect& select, const DeviceSelectCall& c) {
  const auto& w = select.get<StreamingDeviceSelect>();
  streaming_select(c.rows, StreamingSelect{w.budget_tokens, w.sink_pages, c.page_tokens}, c.out, c.stream);
  return false;
}

bool launch_dense(const DeviceSelect&, const DeviceSelectCall& c) {
  dense_select(c.rows, c.out, c.stream);
  return false;
}

// Ranks, then (with estimation) the estimation zone's terms, for the
// attention (or the engine's kernel) to merge.
bool launch_retroinfer(const DeviceSelect& select, const DeviceSelectCall& c) {
  const auto& r = select.get<RetroInferDeviceSelect>();
  const RetroInferSelect retro{.centroids = c.summaries->centroids(c.layer),
                               .sink_partitions = c.sink_partitions,
                               .sink_tokens = c.sink_tokens,
                               .recent = c.recent,
                               .budget_tokens = r.budget_tokens,
                               .retrieval_fraction = r.retrieval_fraction,
                               .windows = c.windows};
  retroinfer_select(c.rows, retro, c.out, c.workspace, c.workspace_bytes, c.stream);
  if (!r.estimation) return false;
  const RetroInferEstimate estimate{.value_sums = c.summaries->value_sums(c.layer),
                                    .selected = c.out.selected,
                                    .selected_count = c.out.selected_count,
                                    .max_selected = c.out.max_selected,
                                    .estimation_fraction = r.estimation_fraction};
  retroinfer_estimate(c.rows, retro, estimate, c.estimate, c.workspace, c.workspace_bytes, c.stream);
  return true;
}

}  // namespace

void register_builtin_device_select_launchers() {
  static std::once_flag once;
  std::call_once(once, [] {
    register_device_select_launcher<QuestDeviceSelect>(launch_quest);
    register_device_select_launcher<ShadowKVDeviceSelect>(launch_shadowkv);
    register_device_select_launcher<StreamingDeviceSelect>(launch_streaming);
    register_device_select_launcher<DenseDeviceSelect>(launch_dense);
    register_device_select_launcher<RetroInferDeviceSelect>(launch_retroinfer);
  });
}

}  // namespace sparsekv::cuda
