#pragma once
// Minimal `--flag value` parsing shared by the command-line tools: unknown
// flags and malformed numbers are errors, never silently ignored.
#include <algorithm>
#include <charconv>
#include <cstdint>
#include <map>
#include <set>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

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

  // A comma-separated value ("a,b,c"); an empty entry is an error.
  std::vector<std::string> list(const std::string& name, const std::string& fallback) const {
    const std::string text = this->text(name, fallback);
    std::vector<std::string> out;
    for (std::size_t start = 0;;) {
      const std::size_t end = text.find(',', start);
      out.push_back(text.substr(start, end == std::string::npos ? std::string::npos : end - start));
      if (out.back().empty()) throw std::invalid_argument(fmt::format("{}: empty entry in '{}'", name, text));
      if (end == std::string::npos) return out;
      start = end + 1;
    }
  }

  // A comma-separated list of 32-bit numbers >= minimum, duplicates dropped, order kept.
  std::vector<std::uint32_t> number_list(const std::string& name, const std::string& fallback,
                                         std::uint32_t minimum = 0) const {
    std::vector<std::uint32_t> out;
    for (const std::string& item : list(name, fallback)) {
      std::uint32_t value = 0;
      const auto [end, ec] = std::from_chars(item.data(), item.data() + item.size(), value);
      if (ec != std::errc{} || end != item.data() + item.size() || value < minimum) {
        throw std::invalid_argument(fmt::format("{} expects numbers >= {}, got '{}'", name, minimum, item));
      }
      if (std::find(out.begin(), out.end(), value) == out.end()) out.push_back(value);
    }
    return out;
  }

 private:
  std::map<std::string, std::string> values_;
  std::set<std::string> switches_;
};

// The command line of a program whose bad flags are the user's to fix:
// CommandLine's error rethrown as Error (one line, with a pointer to --help).
template <class Error>
CommandLine parse_command_line(int argc, char** argv, std::set<std::string> flags, std::set<std::string> switches) {
  try {
    return CommandLine(argc, argv, std::move(flags), std::move(switches));
  } catch (const std::invalid_argument& e) {
    throw Error(fmt::format("{} (--help for usage)", e.what()));
  }
}

}  // namespace sparsekv::tools
