#pragma once
// Where the SmolLM2 file and the evaluation texts come from, shared by
// smollm-demo, sparsekv-eval-model and sparsekv-passkey. Failures the user can fix throw
// UserError: the programs print its message on one line and exit 2.
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>

#include <fmt/format.h>

namespace sparsekv::model {

struct UserError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// ${SPARSEKV_MODEL_DIR:-$HOME/.cache/sparsekv/models}/SmolLM2-135M-Instruct.Q4_1.gguf, where scripts/setup puts it.
inline std::filesystem::path default_model_path() {
  const char* dir = std::getenv("SPARSEKV_MODEL_DIR");
  const char* home = std::getenv("HOME");
  const std::filesystem::path base =
      dir && *dir ? std::filesystem::path(dir) : std::filesystem::path(home ? home : ".") / ".cache/sparsekv/models";
  return base / "SmolLM2-135M-Instruct.Q4_1.gguf";
}

// `path` if it names a regular file; else UserError saying how to get the model.
inline std::string existing_model_path(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) {
    throw UserError(
        fmt::format("model file '{}' not found (run scripts/setup, set SPARSEKV_MODEL_DIR, or pass --model)", path));
  }
  return path;
}

// The whole file; refuses directories, unreadable files and blank text.
inline std::string read_text_file(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    throw UserError(fmt::format("cannot read text file '{}': it is a directory", path));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) throw UserError(fmt::format("cannot read text file '{}'", path));
  std::ostringstream s;
  s << in.rdbuf();
  if (in.bad()) throw UserError(fmt::format("cannot read text file '{}'", path));
  std::string text = s.str();
  if (text.find_first_not_of(" \t\r\n") == std::string::npos) {
    throw UserError(fmt::format("text file '{}' is empty", path));
  }
  return text;
}

}  // namespace sparsekv::model
