#pragma once
// Reader for GGUF model files (versions 2 and 3, little-endian): the key/value
// metadata, the tensor directory, and dequantisation of the tensor types a
// llama.cpp-style checkpoint uses to fp32.
//
// The file is memory-mapped read-only; GgufTensor::data points into the
// mapping, which stays alive as long as any copy of the GgufFile does (copies
// and moves share it).
//
// Supported tensor types: f32, f16, bf16, q4_0, q4_1, q5_0, q5_1, q8_0, q8_1.
// The SmolLM2-135M-Instruct.Q4_1 file uses f32, q4_1 and q8_0. Any other type
// (the K-quants, the i-quants) is listed in the directory but dequantize()
// throws invalid_argument naming it.
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace sparsekv::model {

enum class GgmlType : std::uint32_t {
  f32 = 0,
  f16 = 1,
  q4_0 = 2,
  q4_1 = 3,
  q5_0 = 6,
  q5_1 = 7,
  q8_0 = 8,
  q8_1 = 9,
  q2_k = 10,
  q3_k = 11,
  q4_k = 12,
  q5_k = 13,
  q6_k = 14,
  q8_k = 15,
  i8 = 24,
  i16 = 25,
  i32 = 26,
  i64 = 27,
  f64 = 28,
  bf16 = 30,
};

// "q4_1", "f32", ...; "type 17" for a value without a name here.
std::string type_name(GgmlType type);
// Whether dequantize() handles the type.
bool is_supported(GgmlType type);
// Elements per block (1 for the float types, 32 for q4_0..q8_1) and bytes per
// block; both 0 for an unsupported type.
std::size_t block_elements(GgmlType type);
std::size_t block_bytes(GgmlType type);

// Dequantises `count` consecutive elements (a multiple of the block size)
// stored at `src` in `type` into dst[0, count). Throws invalid_argument for an
// unsupported type or a count that is not a whole number of blocks.
void dequantize_into(GgmlType type, const std::byte* src, std::size_t count, float* dst);

// IEEE half and bfloat16 to float (exact; subnormals, inf and NaN kept).
float half_to_float(std::uint16_t bits);
float bf16_to_float(std::uint16_t bits);

struct GgufTensor {
  std::string name;
  GgmlType type;
  std::vector<std::uint64_t> dims;  // ggml order: dims[0] is the fastest-varying (row length)
  const std::byte* data = nullptr;  // into the file mapping
  std::size_t bytes = 0;            // size of the data
  std::uint64_t offset = 0;         // of the data from the file's start
  std::uint64_t elements() const;
  // dims[0], and the product of the other dims (1 for a vector).
  std::uint64_t cols() const { return dims.empty() ? 1 : dims[0]; }
  std::uint64_t rows() const;
};

// GGUF metadata value types (the file's own numbering).
enum class GgufValueType : std::uint32_t {
  u8 = 0,
  i8 = 1,
  u16 = 2,
  i16 = 3,
  u32 = 4,
  i32 = 5,
  f32 = 6,
  boolean = 7,
  string = 8,
  array = 9,
  u64 = 10,
  i64 = 11,
  f64 = 12,
};

class GgufFile {
 public:
  // Throws sparsekv::Error: not_found when the file cannot be opened,
  // invalid_argument (naming the path and the problem) when it is not a
  // well-formed GGUF v2/v3 file.
  static GgufFile open(const std::filesystem::path& path);

  const std::filesystem::path& path() const { return path_; }
  std::uint32_t version() const { return version_; }
  std::uint64_t alignment() const { return alignment_; }

  // Metadata. Each accessor throws not_found for a missing key and
  // invalid_argument for a value of the wrong type.
  bool has(std::string_view key) const;
  std::vector<std::string> keys() const;
  GgufValueType type_of(std::string_view key) const;  // array for arrays
  std::uint64_t uint(std::string_view key) const;     // any integer type, range-checked (>= 0)
  std::int64_t integer(std::string_view key) const;   // any integer type, range-checked
  double real(std::string_view key) const;            // f32/f64 (integers are converted too)
  bool boolean(std::string_view key) const;
  std::string string(std::string_view key) const;
  std::vector<std::string> strings(std::string_view key) const;  // array of strings
  std::vector<float> reals(std::string_view key) const;          // array of f32/f64
  std::vector<std::int64_t> ints(std::string_view key) const;    // array of integers (or bools)

  // Tensors.
  bool has_tensor(std::string_view name) const;
  const GgufTensor& tensor(std::string_view name) const;  // throws not_found
  const std::vector<GgufTensor>& tensors() const { return tensors_; }
  // Row-major fp32 copy: element (r, c) of a 2-D tensor with dims {cols, rows}
  // at r * cols + c (ggml's storage order, so also right for 1-D and 3-D).
  std::vector<float> dequantize(const GgufTensor& t) const;
  // Rows [first, first + count) of t (rows of dims[0] elements) into dst,
  // which holds count * t.cols() floats. For gathering embedding rows or
  // dequantising a matrix a slab at a time. Throws out_of_range.
  void dequantize_rows(const GgufTensor& t, std::uint64_t first, std::uint64_t count, float* dst) const;

  struct Value;  // defined in gguf.cpp
  struct Mapping;

 private:
  GgufFile() = default;
  const Value& value(std::string_view key) const;

  std::filesystem::path path_;
  std::uint32_t version_ = 0;
  std::uint64_t alignment_ = 32;
  std::shared_ptr<const Mapping> mapping_;
  std::shared_ptr<const std::map<std::string, Value, std::less<>>> metadata_;
  std::vector<GgufTensor> tensors_;
  std::map<std::string, std::size_t, std::less<>> tensor_index_;
};

}  // namespace sparsekv::model
