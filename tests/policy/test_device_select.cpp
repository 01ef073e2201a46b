// DeviceSelect holds any spec that states its rules, and launches are found
// by the spec's type: a program's own spec beside the built-ins.
#include "sparsekv/policy/device_select.hpp"
#include "sparsekv/policy/device_select_launch.hpp"
#include "sparsekv/policy/quest.hpp"
#include "test_support.hpp"

using namespace sparsekv;

namespace {

struct WindowPolicy {
  std::uint32_t budget_tokens = 0;
};

// A positional Select of a program's own policy: its candidates' counts only.
struct WindowDeviceSelect {
  using Policy = WindowPolicy;
  static constexpr cuda::AppendSummary summary = cuda::AppendSummary::tokens;
  static constexpr bool estimates = true;
  std::uint32_t budget_tokens = 0;
  std::uint32_t first_partition = 0;

  std::uint32_t capacity(std::uint32_t max_partitions, std::uint32_t page_tokens) const {
    return cuda::select_capacity(max_partitions, (budget_tokens + page_tokens - 1) / page_tokens, false, 0);
  }
};
WindowDeviceSelect device_select_spec(const WindowPolicy& p, const LayerContext& ctx) {
  return {p.budget_tokens, ctx.layer};
}

// Derived from a policy with a spec: selects differently, so has none.
struct NarrowWindowPolicy : WindowPolicy {};

struct UnlaunchedDeviceSelect {
  using Policy = WindowPolicy;
  static constexpr cuda::AppendSummary summary = cuda::AppendSummary::quest;
  std::uint32_t capacity(std::uint32_t, std::uint32_t) const { return 1; }
};

bool launch_window(const DeviceSelect&, const DeviceSelectCall&) { return false; }
bool launch_window_again(const DeviceSelect&, const DeviceSelectCall&) { return true; }

}  // namespace

TEST_CASE("DeviceSelect: a program's spec with its rules beside the built-ins, launchers found by the spec's type",
          "[policy]") {
  LayerContext ctx;
  ctx.layer = 3;
  ctx.page_tokens = 16;

  const DeviceSelect none;
  CHECK_FALSE(none.on_device());
  CHECK(none.type() == typeid(void));
  CHECK(none.summary() == cuda::AppendSummary::none);
  CHECK(none.capacity(50, 16) == 0);
  CHECK(none.first_partition() == 0);
  CHECK(find_device_select_launcher(none) == nullptr);

  const DeviceSelect window = device_select(WindowPolicy{100}, ctx);
  REQUIRE(window.holds<WindowDeviceSelect>());
  CHECK_FALSE(window.holds<QuestDeviceSelect>());
  CHECK(window.get_if<QuestDeviceSelect>() == nullptr);
  REQUIRE_SPARSEKV_ERROR(window.get<QuestDeviceSelect>(), ErrorCode::invalid_argument);
  CHECK(window.get<WindowDeviceSelect>().budget_tokens == 100);
  CHECK(window.summary() == cuda::AppendSummary::tokens);
  CHECK(window.capacity(50, 16) == 7);  // ceil(100 / 16) pages
  CHECK(window.capacity(5, 16) == 5);   // at most the row
  CHECK(window.first_partition() == 3);
  CHECK(window.estimates());
  CHECK_FALSE(window.reads_host_state());
  CHECK_FALSE(device_select(NarrowWindowPolicy{{100}}, ctx).on_device());

  // A copy holds its own spec.
  DeviceSelect copy = window;
  copy = DeviceSelect{WindowDeviceSelect{32, 1}};
  CHECK(window.get<WindowDeviceSelect>().budget_tokens == 100);
  CHECK(copy.get<WindowDeviceSelect>().budget_tokens == 32);

  // Registration: a null refused, the first launcher kept against a second.
  CHECK(find_device_select_launcher(window) == nullptr);
  REQUIRE_SPARSEKV_ERROR(register_device_select_launcher<WindowDeviceSelect>(nullptr), ErrorCode::invalid_argument);
  CHECK(find_device_select_launcher(window) == nullptr);
  register_device_select_launcher<WindowDeviceSelect>(launch_window);
  REQUIRE_SPARSEKV_ERROR(register_device_select_launcher<WindowDeviceSelect>(launch_window_again),
                         ErrorCode::already_exists);
  CHECK(find_device_select_launcher(window) == &launch_window);
  CHECK(find_device_select_launcher(copy) == &launch_window);
  CHECK(find_device_select_launcher(DeviceSelect{UnlaunchedDeviceSelect{}}) == nullptr);
}
