#pragma once
// Whitespace tokenising shared by the text trace readers (selection
// traces, Q/K/V trace manifests).
#include <algorithm>
#include <string_view>
#include <vector>

namespace sparsekv::detail {

inline constexpr std::string_view kBlank = " \t\r\v\f";

inline std::vector<std::string_view> split_fields(std::string_view text) {
  std::vector<std::string_view> fields;
  for (std::size_t pos = text.find_first_not_of(kBlank); pos != std::string_view::npos;) {
    const std::size_t end = std::min(text.find_first_of(kBlank, pos), text.size());
    fields.push_back(text.substr(pos, end - pos));
    pos = text.find_first_not_of(kBlank, end);
  }
  return fields;
}

inline std::string_view trim_blank(std::string_view s) {
  const std::size_t a = s.find_first_not_of(kBlank);
  if (a == std::string_view::npos) return {};
  return s.substr(a, s.find_last_not_of(kBlank) - a + 1);
}

}  // namespace sparsekv::detail
