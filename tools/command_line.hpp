#pragma once
// Minimal `--flag value` parsing shared by the command-line tools: unknown
// flags and malformed numbers are errors, never silently ignored.
#include <charconv>
#include <cstdint>
#include <map>
#include <set>
#include <stdexcept>
#include <string>
#include <string_view>

#include <fmt/format.h>

namespace sparsekv::tools {

class CommandLine {
 public:
  // `flags` take a value; `switches` do not.
  CommandLine(int argc, char** argv, std::set<std::string> flags, std::set<std::string> switches) {
    for (int i = 1; i < argc; ++i) {
      const std::string arg = argv[i];
      if (switches.contains(arg)) {
        switches_.insert(arg);
      } else if (flags.contains(arg)) {
        if (i + 1 >= argc) throw std::invalid_argument(fmt::format("{} needs a value", arg));
        values_[arg] = argv[++i];
      } else {
        throw std::invalid_argument(fmt::format("unknown argument '{}'", arg));
      }
    }
  }

  bool has(const std::string& name) const { return switches_.contains(name) || values_.contains(name); }

  std::string text(const std::string& name, std::string fallback) const {
    const auto it = values_.find(name);
    return it == values_.end() ? fallback : it->second;
  }

  template <class T>
  T number(const std::string& name, T fallback) const {
    const auto it = values_.find(name);
    if (it == values_.end()) return fallback;
    T value{};
    const std::string& s = it->second;
    const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), value);
    if (ec != std::errc{} || end != s.data() + s.size()) {
      throw std::invalid_argument(fmt::format("{} expects a number, got '{}'", name, s));
    }
    return value;
  }

 private:
  std::map<std::string, std::string> values_;
  std::set<std::string> switches_;
};

}  // namespace sparsekv::tools
