// The table of device Select launchers, by spec type.
#include "sparsekv/policy/device_select_launch.hpp"

#include <mutex>
#include <typeindex>
#include <unordered_map>

#include "sparsekv/core/error.hpp"

namespace sparsekv {
namespace {

struct LauncherTable {
  std::mutex mutex;
  std::unordered_map<std::type_index, DeviceSelectLauncher> launchers;
};

LauncherTable& table() {
  static LauncherTable t;
  return t;
}

}  // namespace

void register_device_select_launcher(const std::type_info& spec, DeviceSelectLauncher launcher) {
  if (launcher == nullptr) {
    fail(ErrorCode::invalid_argument, "register_device_select_launcher: the launcher of {} must not be null",
         spec.name());
  }
  LauncherTable& t = table();
  const std::lock_guard lock(t.mutex);
  if (!t.launchers.emplace(std::type_index(spec), launcher).second) {
    fail(ErrorCode::already_exists, "register_device_select_launcher: {} has a launcher", spec.name());
  }
}

DeviceSelectLauncher find_device_select_launcher(const DeviceSelect& select) {
  if (!select.on_device()) return nullptr;
  LauncherTable& t = table();
  const std::lock_guard lock(t.mutex);
  const auto it = t.launchers.find(std::type_index(select.type()));
  return it != t.launchers.end() ? it->second : nullptr;
}

}  // namespace sparsekv
