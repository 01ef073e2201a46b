// make_policy(): policies by name, the built-ins at their papers' defaults,
// then what a program registered.
#include "sparsekv/policy/policy_registry.hpp"

#include <algorithm>
#include <mutex>
#include <string>
#include <vector>

#include "sparsekv/core/error.hpp"
#include "sparsekv/policy/dense.hpp"
#include "sparsekv/policy/h2o.hpp"
#include "sparsekv/policy/quest.hpp"
#include "sparsekv/policy/retroinfer.hpp"
#include "sparsekv/policy/shadowkv.hpp"
#include "sparsekv/policy/streaming_eviction.hpp"
#include "sparsekv/policy/streaming_window.hpp"

namespace sparsekv {
namespace {

// A built-in policy's factory: its Options at their defaults but the budget.
template <class P>
PolicyFactory budgeted() {
  return [](std::uint32_t budget_tokens) {
    typename P::Options o;
    o.budget_tokens = budget_tokens;
    return AnyPolicy(P(o));
  };
}

struct Entry {
  std::string name;
  bool evicts = false;
  PolicyFactory make;
};

class Registry {
 public:
  Registry() {
    add("dense", false, [](std::uint32_t) { return AnyPolicy(DensePolicy{}); });
    add("streaming", false, budgeted<StreamingWindowPolicy>());
    add("quest", false, budgeted<QuestPolicy>());
    add("shadowkv", false, budgeted<ShadowKVPolicy>());
    for (const bool estimation : {true, false}) {
      add(estimation ? "retroinfer" : "retroinfer_no_estimation", false, [estimation](std::uint32_t budget_tokens) {
        RetroInferPolicy::Options o;
        o.budget_tokens = budget_tokens;
        o.estimation = estimation;
        return AnyPolicy(RetroInferPolicy(o));
      });
    }
    add("h2o", true, budgeted<H2OPolicy>());
    add("streaming_evict", true, budgeted<StreamingEvictionPolicy>());
  }

  void add(std::string name, bool evicts, PolicyFactory make) {
    if (name.empty()) fail(ErrorCode::invalid_argument, "register_policy: the name must not be empty");
    if (!make) fail(ErrorCode::invalid_argument, "register_policy '{}': the factory must not be empty", name);
    const std::lock_guard lock(mutex_);
    if (find(name) != nullptr) fail(ErrorCode::already_exists, "register_policy: '{}' is already a policy", name);
    entries_.push_back(Entry{std::move(name), evicts, std::move(make)});
  }

  // The factory of `name`, copied out of the lock (a factory may itself register).
  PolicyFactory factory(std::string_view name) const {
    const std::lock_guard lock(mutex_);
    if (const Entry* e = find(name)) return e->make;
    std::string known;
    for (const Entry& e : entries_) known += (known.empty() ? "" : ", ") + e.name;
    fail(ErrorCode::invalid_argument, "unknown policy '{}' (known: {})", name, known);
  }

  std::vector<std::string> names(bool evicts) const {
    const std::lock_guard lock(mutex_);
    std::vector<std::string> out;
    for (const Entry& e : entries_) {
      if (e.evicts == evicts) out.push_back(e.name);
    }
    return out;
  }

 private:
  const Entry* find(std::string_view name) const {
    const auto it = std::find_if(entries_.begin(), entries_.end(), [&](const Entry& e) { return e.name == name; });
    return it == entries_.end() ? nullptr : &*it;
  }

  mutable std::mutex mutex_;
  std::vector<Entry> entries_;
};

Registry& registry() {
  static Registry r;
  return r;
}

}  // namespace

AnyPolicy make_policy(std::string_view name, std::uint32_t budget_tokens) {
  const PolicyFactory make = registry().factory(name);
  if (name == "dense") return make(budget_tokens);  // dense ignores the budget
  if (budget_tokens == 0) fail(ErrorCode::invalid_argument, "policy '{}': budget_tokens must be > 0", name);
  return make(budget_tokens);
}

std::vector<std::string> policy_names() { return registry().names(false); }
std::vector<std::string> eviction_policy_names() { return registry().names(true); }

void register_policy(std::string name, PolicyFactory make) { registry().add(std::move(name), false, std::move(make)); }

}  // namespace sparsekv
