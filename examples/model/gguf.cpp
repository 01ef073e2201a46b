#include "model/gguf.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <bit>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>

#include "sparsekv/core/error.hpp"

namespace sparsekv::model {

// ---- types and dequantisation ----------------------------------------------

std::string type_name(GgmlType type) {
  switch (type) {
    case GgmlType::f32:
      return "f32";
    case GgmlType::f16:
      return "f16";
    case GgmlType::q4_0:
      return "q4_0";
    case GgmlType::q4_1:
      return "q4_1";
    case GgmlType::q5_0:
      return "q5_0";
    case GgmlType::q5_1:
      return "q5_1";
    case GgmlType::q8_0:
      return "q8_0";
    case GgmlType::q8_1:
      return "q8_1";
    case GgmlType::q2_k:
      return "q2_k";
    case GgmlType::q3_k:
      return "q3_k";
    case GgmlType::q4_k:
      return "q4_k";
    case GgmlType::q5_k:
      return "q5_k";
    case GgmlType::q6_k:
      return "q6_k";
    case GgmlType::q8_k:
      return "q8_k";
    case GgmlType::i8:
      return "i8";
    case GgmlType::i16:
      return "i16";
    case GgmlType::i32:
      return "i32";
    case GgmlType::i64:
      return "i64";
    case GgmlType::f64:
      return "f64";
    case GgmlType::bf16:
      return "bf16";
  }
  return "type " + std::to_string(static_cast<std::uint32_t>(type));
}

std::size_t block_elements(GgmlType type) {
  switch (type) {
    case GgmlType::f32:
    case GgmlType::f16:
    case GgmlType::bf16:
      return 1;
    case GgmlType::q4_0:
    case GgmlType::q4_1:
    case GgmlType::q5_0:
    case GgmlType::q5_1:
    case GgmlType::q8_0:
    case GgmlType::q8_1:
      return 32;
    default:
      return 0;
  }
}

std::size_t block_bytes(GgmlType type) {
  switch (type) {
    case GgmlType::f32:
      return 4;
    case GgmlType::f16:
    case GgmlType::bf16:
      return 2;
    case GgmlType::q4_0:
      return 2 + 16;  // d, 32 nibbles
    case GgmlType::q4_1:
      return 2 + 2 + 16;  // d, m, 32 nibbles
    case GgmlType::q5_0:
      return 2 + 4 + 16;  // d, high bits, nibbles
    case GgmlType::q5_1:
      return 2 + 2 + 4 + 16;  // d, m, high bits, nibbles
    case GgmlType::q8_0:
      return 2 + 32;  // d, 32 int8
    case GgmlType::q8_1:
      return 2 + 2 + 32;  // d, s (sum, unused here), 32 int8
    default:
      return 0;
  }
}

bool is_supported(GgmlType type) { return block_elements(type) != 0; }

float half_to_float(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exponent = (h >> 10) & 0x1fu;
  std::uint32_t mantissa = h & 0x3ffu;
  std::uint32_t bits;
  if (exponent == 0x1f) {  // inf / NaN
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else if (exponent != 0) {  // normal
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {  // zero
    bits = sign;
  } else {  // subnormal: value = mantissa * 2^-24
    const float value = static_cast<float>(mantissa) * 0x1p-24f;
    return sign ? -value : value;
  }
  return std::bit_cast<float>(bits);
}

float bf16_to_float(std::uint16_t bits) { return std::bit_cast<float>(static_cast<std::uint32_t>(bits) << 16); }

namespace {

std::uint16_t load_u16(const std::byte* p) {
  std::uint16_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

std::uint32_t load_u32(const std::byte* p) {
  std::uint32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

float load_half(const std::byte* p) { return half_to_float(load_u16(p)); }

std::uint8_t byte_at(const std::byte* p, std::size_t i) { return std::to_integer<std::uint8_t>(p[i]); }

}  // namespace

void dequantize_into(GgmlType type, const std::byte* src, std::size_t count, float* dst) {
  const std::size_t per_block = block_elements(type);
  if (per_block == 0) {
    fail(ErrorCode::invalid_argument,
         "cannot dequantize tensor type {}: not supported (supported: f32, f16, "
         "bf16, q4_0, q4_1, q5_0, q5_1, q8_0, q8_1)",
         type_name(type));
  }
  if (count % per_block != 0) {
    fail(ErrorCode::invalid_argument, "cannot dequantize {} elements of type {}: not a multiple of the block size {}",
         count, type_name(type), per_block);
  }
  const std::size_t blocks = count / per_block;
  const std::size_t stride = block_bytes(type);
  switch (type) {
    case GgmlType::f32:
      std::memcpy(dst, src, count * sizeof(float));
      return;
    case GgmlType::f16:
      for (std::size_t i = 0; i < count; ++i) dst[i] = load_half(src + 2 * i);
      return;
    case GgmlType::bf16:
      for (std::size_t i = 0; i < count; ++i) dst[i] = bf16_to_float(load_u16(src + 2 * i));
      return;
    case GgmlType::q4_0:
      for (std::size_t b = 0; b < blocks; ++b, src += stride, dst += 32) {
        const float d = load_half(src);
        const std::byte* qs = src + 2;
        for (int j = 0; j < 16; ++j) {
          const std::uint8_t q = byte_at(qs, j);
          dst[j] = static_cast<float>(static_cast<int>(q & 0x0f) - 8) * d;
          dst[j + 16] = static_cast<float>(static_cast<int>(q >> 4) - 8) * d;
        }
      }
      return;
    case GgmlType::q4_1:
      for (std::size_t b = 0; b < blocks; ++b, src += stride, dst += 32) {
        const float d = load_half(src);
        const float m = load_half(src + 2);
        const std::byte* qs = src + 4;
        for (int j = 0; j < 16; ++j) {
          const std::uint8_t q = byte_at(qs, j);
          dst[j] = static_cast<float>(q & 0x0f) * d + m;
          dst[j + 16] = static_cast<float>(q >> 4) * d + m;
        }
      }
      return;
    case GgmlType::q5_0:
    case GgmlType::q5_1: {
      const bool has_min = type == GgmlType::q5_1;
      for (std::size_t b = 0; b < blocks; ++b, src += stride, dst += 32) {
        const float d = load_half(src);
        const float m = has_min ? load_half(src + 2) : 0.0f;
        const std::byte* rest = src + (has_min ? 4 : 2);
        const std::uint32_t high = load_u32(rest);  // bit j: 5th bit of weight j
        const std::byte* qs = rest + 4;
        const int offset = has_min ? 0 : 16;
        for (int j = 0; j < 16; ++j) {
          const std::uint8_t q = byte_at(qs, j);
          const int lo = static_cast<int>((q & 0x0f) | (((high >> j) & 1u) << 4)) - offset;
          const int hi = static_cast<int>((q >> 4) | (((high >> (j + 16)) & 1u) << 4)) - offset;
          dst[j] = static_cast<float>(lo) * d + m;
          dst[j + 16] = static_cast<float>(hi) * d + m;
        }
      }
      return;
    }
    case GgmlType::q8_0:
    case GgmlType::q8_1: {
      const std::size_t header = type == GgmlType::q8_0 ? 2 : 4;
      for (std::size_t b = 0; b < blocks; ++b, src += stride, dst += 32) {
        const float d = load_half(src);
        for (int j = 0; j < 32; ++j) {
          dst[j] = static_cast<float>(static_cast<std::int8_t>(byte_at(src + header, j))) * d;
        }
      }
      return;
    }
    default:
      break;
  }
  fail(ErrorCode::invalid_argument, "cannot dequantize tensor type {}", type_name(type));
}

std::uint64_t GgufTensor::elements() const {
  std::uint64_t n = 1;
  for (std::uint64_t d : dims) n *= d;
  return n;
}

std::uint64_t GgufTensor::rows() const {
  std::uint64_t n = 1;
  for (std::size_t i = 1; i < dims.size(); ++i) n *= dims[i];
  return n;
}

// ---- file mapping and metadata -------------------------------------------------

struct GgufFile::Mapping {
  const std::byte* data = nullptr;
  std::size_t size = 0;
  Mapping() = default;
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping() {
    if (data != nullptr && size != 0) munmap(const_cast<std::byte*>(data), size);
  }
};

struct GgufFile::Value {
  GgufValueType type = GgufValueType::u8;
  GgufValueType element = GgufValueType::u8;  // for arrays
  // Scalars: integers in i (signed types, bool) or u (unsigned types); floats in f.
  std::int64_t i = 0;
  std::uint64_t u = 0;
  double f = 0;
  std::string s;
  // Arrays: one of these, by element type.
  std::vector<std::string> strs;
  std::vector<double> reals;
  std::vector<std::int64_t> ints;
  std::vector<std::uint64_t> uints;
  std::size_t length = 0;
};

namespace {

std::string_view value_type_name(GgufValueType t) {
  switch (t) {
    case GgufValueType::u8:
      return "u8";
    case GgufValueType::i8:
      return "i8";
    case GgufValueType::u16:
      return "u16";
    case GgufValueType::i16:
      return "i16";
    case GgufValueType::u32:
      return "u32";
    case GgufValueType::i32:
      return "i32";
    case GgufValueType::f32:
      return "f32";
    case GgufValueType::boolean:
      return "bool";
    case GgufValueType::string:
      return "string";
    case GgufValueType::array:
      return "array";
    case GgufValueType::u64:
      return "u64";
    case GgufValueType::i64:
      return "i64";
    case GgufValueType::f64:
      return "f64";
  }
  return "unknown";
}

bool is_unsigned_type(GgufValueType t) {
  return t == GgufValueType::u8 || t == GgufValueType::u16 || t == GgufValueType::u32 || t == GgufValueType::u64;
}
bool is_signed_type(GgufValueType t) {
  return t == GgufValueType::i8 || t == GgufValueType::i16 || t == GgufValueType::i32 || t == GgufValueType::i64;
}
bool is_float_type(GgufValueType t) { return t == GgufValueType::f32 || t == GgufValueType::f64; }

[[noreturn]] void wrong_type(const std::filesystem::path& path, std::string_view key, GgufValueType type,
                             std::string_view expected) {
  fail(ErrorCode::invalid_argument, "{}: key {} is a {}, expected {}", path.string(), key, value_type_name(type),
       expected);
}

// Bounds-checked little-endian cursor over the mapped file.
class Reader {
 public:
  Reader(const std::filesystem::path& path, const std::byte* data, std::size_t size)
      : path_(path), data_(data), size_(size) {}

  std::size_t position() const { return pos_; }
  std::size_t remaining() const { return size_ - pos_; }

  [[noreturn]] void bad(std::string_view what) const {
    fail(ErrorCode::invalid_argument, "{}: not a valid GGUF file: {} (at byte {} of {})", path_.string(), what, pos_,
         size_);
  }

  const std::byte* take(std::size_t n, std::string_view what) {
    if (n > size_ - pos_) bad(fmt::format("{} runs past the end of the file", what));
    const std::byte* p = data_ + pos_;
    pos_ += n;
    return p;
  }

  template <class T>
  T read(std::string_view what) {
    T v;
    std::memcpy(&v, take(sizeof(T), what), sizeof(T));
    return v;
  }

  std::string read_string(std::string_view what) {
    const auto n = read<std::uint64_t>(what);
    if (n > size_ - pos_) bad(fmt::format("{} has length {}, past the end of the file", what, n));
    const std::byte* p = take(static_cast<std::size_t>(n), what);
    return std::string(reinterpret_cast<const char*>(p), static_cast<std::size_t>(n));
  }

 private:
  const std::filesystem::path& path_;
  const std::byte* data_;
  std::size_t size_;
  std::size_t pos_ = 0;
};

std::size_t scalar_size(GgufValueType t) {
  switch (t) {
    case GgufValueType::u8:
    case GgufValueType::i8:
    case GgufValueType::boolean:
      return 1;
    case GgufValueType::u16:
    case GgufValueType::i16:
      return 2;
    case GgufValueType::u32:
    case GgufValueType::i32:
    case GgufValueType::f32:
      return 4;
    case GgufValueType::u64:
    case GgufValueType::i64:
    case GgufValueType::f64:
      return 8;
    default:
      return 0;
  }
}

// Reads one scalar of type t into v (i / u / f / s).
void read_scalar(Reader& in, GgufValueType t, GgufFile::Value& v, std::string_view what) {
  switch (t) {
    case GgufValueType::u8:
      v.u = in.read<std::uint8_t>(what);
      return;
    case GgufValueType::i8:
      v.i = in.read<std::int8_t>(what);
      return;
    case GgufValueType::u16:
      v.u = in.read<std::uint16_t>(what);
      return;
    case GgufValueType::i16:
      v.i = in.read<std::int16_t>(what);
      return;
    case GgufValueType::u32:
      v.u = in.read<std::uint32_t>(what);
      return;
    case GgufValueType::i32:
      v.i = in.read<std::int32_t>(what);
      return;
    case GgufValueType::u64:
      v.u = in.read<std::uint64_t>(what);
      return;
    case GgufValueType::i64:
      v.i = in.read<std::int64_t>(what);
      return;
    case GgufValueType::f32:
      v.f = in.read<float>(what);
      return;
    case GgufValueType::f64:
      v.f = in.read<double>(what);
      return;
    case GgufValueType::boolean: {
      const auto b = in.read<std::uint8_t>(what);
      if (b > 1) in.bad(fmt::format("{}: bool value {}", what, b));
      v.i = b;
      return;
    }
    case GgufValueType::string:
      v.s = in.read_string(what);
      return;
    default:
      break;
  }
  in.bad(fmt::format("{}: unknown value type {}", what, static_cast<std::uint32_t>(t)));
}

GgufFile::Value read_value(Reader& in, GgufValueType t, const std::string& key) {
  GgufFile::Value v;
  v.type = t;
  if (t != GgufValueType::array) {
    read_scalar(in, t, v, key);
    return v;
  }
  v.element = static_cast<GgufValueType>(in.read<std::uint32_t>(key));
  const auto n = in.read<std::uint64_t>(key);
  if (v.element == GgufValueType::array) in.bad(fmt::format("key {}: nested arrays are not supported", key));
  // Every element takes at least one byte (strings at least eight): reject
  // lengths the rest of the file cannot hold before reserving memory.
  const std::size_t least = v.element == GgufValueType::string ? 8 : scalar_size(v.element);
  if (least == 0) {
    in.bad(fmt::format("key {}: unknown array element type {}", key, static_cast<std::uint32_t>(v.element)));
  }
  if (n > in.remaining() / least) {
    in.bad(fmt::format("key {}: array of {} elements cannot fit in the rest of the file", key, n));
  }
  v.length = static_cast<std::size_t>(n);
  GgufFile::Value element;
  if (v.element == GgufValueType::string) {
    v.strs.reserve(v.length);
    for (std::size_t k = 0; k < v.length; ++k) v.strs.push_back(in.read_string(key));
  } else if (is_float_type(v.element)) {
    v.reals.reserve(v.length);
    for (std::size_t k = 0; k < v.length; ++k) {
      read_scalar(in, v.element, element, key);
      v.reals.push_back(element.f);
    }
  } else if (is_unsigned_type(v.element)) {
    v.uints.reserve(v.length);
    for (std::size_t k = 0; k < v.length; ++k) {
      read_scalar(in, v.element, element, key);
      v.uints.push_back(element.u);
    }
  } else {  // signed integers and bools
    v.ints.reserve(v.length);
    for (std::size_t k = 0; k < v.length; ++k) {
      read_scalar(in, v.element, element, key);
      v.ints.push_back(element.i);
    }
  }
  return v;
}

std::shared_ptr<GgufFile::Mapping> map_file(const std::filesystem::path& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    fail(err == ENOENT ? ErrorCode::not_found : ErrorCode::invalid_argument, "cannot open GGUF file {}: {}",
         path.string(), std::strerror(err));
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    fail(ErrorCode::invalid_argument, "cannot read GGUF file {}: not a regular file", path.string());
  }
  auto mapping = std::make_shared<GgufFile::Mapping>();
  mapping->size = static_cast<std::size_t>(st.st_size);
  if (mapping->size != 0) {
    void* p = ::mmap(nullptr, mapping->size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      const int err = errno;
      ::close(fd);
      mapping->size = 0;
      fail(ErrorCode::invalid_argument, "cannot map GGUF file {}: {}", path.string(), std::strerror(err));
    }
    mapping->data = static_cast<const std::byte*>(p);
  }
  ::close(fd);
  return mapping;
}

}  // namespace

GgufFile GgufFile::open(const std::filesystem::path& path) {
  GgufFile file;
  file.path_ = path;
  auto mapping = map_file(path);
  Reader in(file.path_, mapping->data, mapping->size);

  if (mapping->size < 4 || std::memcmp(mapping->data, "GGUF", 4) != 0) in.bad("the magic is not \"GGUF\"");
  in.take(4, "magic");
  file.version_ = in.read<std::uint32_t>("version");
  if (file.version_ != 2 && file.version_ != 3) {
    in.bad(fmt::format("version {} is not supported (2 and 3 are)", file.version_));
  }
  const auto tensor_count = in.read<std::uint64_t>("tensor count");
  const auto kv_count = in.read<std::uint64_t>("key/value count");
  // A key/value takes at least 13 bytes, a tensor entry at least 32: bound the
  // counts by the file size before reserving anything.
  if (tensor_count > mapping->size / 32 || kv_count > mapping->size / 13) {
    in.bad(fmt::format("{} tensors and {} keys cannot fit in the file", tensor_count, kv_count));
  }

  auto metadata = std::make_shared<std::map<std::string, Value, std::less<>>>();
  for (std::uint64_t k = 0; k < kv_count; ++k) {
    std::string key = in.read_string("metadata key");
    const auto type = static_cast<GgufValueType>(in.read<std::uint32_t>("metadata value type"));
    Value value = read_value(in, type, key);
    if (!metadata->emplace(key, std::move(value)).second) in.bad(fmt::format("duplicate key {}", key));
  }
  if (auto it = metadata->find("general.alignment"); it != metadata->end()) {
    const Value& a = it->second;
    const std::uint64_t alignment = is_unsigned_type(a.type) ? a.u : is_signed_type(a.type) && a.i > 0 ? a.i : 0;
    if (alignment == 0 || (alignment & (alignment - 1)) != 0) in.bad("general.alignment is not a power of two");
    file.alignment_ = alignment;
  }

  file.tensors_.reserve(static_cast<std::size_t>(tensor_count));
  for (std::uint64_t k = 0; k < tensor_count; ++k) {
    GgufTensor t;
    t.name = in.read_string("tensor name");
    const auto n_dims = in.read<std::uint32_t>("tensor dimension count");
    if (n_dims == 0 || n_dims > 4) in.bad(fmt::format("tensor {} has {} dimensions (1 to 4 allowed)", t.name, n_dims));
    std::uint64_t elements = 1;
    for (std::uint32_t d = 0; d < n_dims; ++d) {
      const auto dim = in.read<std::uint64_t>("tensor dimension");
      if (dim == 0 || elements > (std::uint64_t{1} << 48) / dim) {
        in.bad(fmt::format("tensor {} has dimension {} = {}", t.name, d, dim));
      }
      elements *= dim;
      t.dims.push_back(dim);
    }
    t.type = static_cast<GgmlType>(in.read<std::uint32_t>("tensor type"));
    t.offset = in.read<std::uint64_t>("tensor offset");
    if (!file.tensor_index_.emplace(t.name, file.tensors_.size()).second) {
      in.bad(fmt::format("duplicate tensor {}", t.name));
    }
    file.tensors_.push_back(std::move(t));
  }

  const std::uint64_t data_start = (in.position() + file.alignment_ - 1) / file.alignment_ * file.alignment_;
  for (GgufTensor& t : file.tensors_) {
    const std::size_t per_block = block_elements(t.type);
    if (per_block != 0) {
      if (t.dims[0] % per_block != 0) {
        in.bad(fmt::format("tensor {}: row length {} is not a multiple of the {} block size {}", t.name, t.dims[0],
                           type_name(t.type), per_block));
      }
      t.bytes = static_cast<std::size_t>(t.elements() / per_block * block_bytes(t.type));
    }  // unsupported types: size unknown here; data points at the start, bytes stays 0
    if (t.offset % file.alignment_ != 0) in.bad(fmt::format("tensor {}: offset {} is not aligned", t.name, t.offset));
    if (t.offset > mapping->size || data_start > mapping->size - t.offset ||
        t.bytes > mapping->size - data_start - t.offset) {
      in.bad(fmt::format("tensor {}: data [{}, +{}) lies past the end of the file", t.name, data_start + t.offset,
                         t.bytes));
    }
    t.data = mapping->data + data_start + t.offset;
    t.offset += data_start;
  }

  file.mapping_ = std::move(mapping);
  file.metadata_ = std::move(metadata);
  return file;
}

bool GgufFile::has(std::string_view key) const { return metadata_->find(key) != metadata_->end(); }

std::vector<std::string> GgufFile::keys() const {
  std::vector<std::string> out;
  out.reserve(metadata_->size());
  for (const auto& [k, v] : *metadata_) out.push_back(k);
  return out;
}

const GgufFile::Value& GgufFile::value(std::string_view key) const {
  auto it = metadata_->find(key);
  if (it == metadata_->end()) fail(ErrorCode::not_found, "{}: no metadata key {}", path_.string(), key);
  return it->second;
}

GgufValueType GgufFile::type_of(std::string_view key) const { return value(key).type; }

std::uint64_t GgufFile::uint(std::string_view key) const {
  const Value& v = value(key);
  if (is_unsigned_type(v.type)) return v.u;
  if (is_signed_type(v.type)) {
    if (v.i < 0) {
      fail(ErrorCode::invalid_argument, "{}: key {} is {}, expected a non-negative integer", path_.string(), key, v.i);
    }
    return static_cast<std::uint64_t>(v.i);
  }
  wrong_type(path_, key, v.type, "an integer");
}

std::int64_t GgufFile::integer(std::string_view key) const {
  const Value& v = value(key);
  if (is_signed_type(v.type)) return v.i;
  if (is_unsigned_type(v.type)) {
    if (v.u > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) {
      fail(ErrorCode::invalid_argument, "{}: key {} = {} does not fit in int64", path_.string(), key, v.u);
    }
    return static_cast<std::int64_t>(v.u);
  }
  wrong_type(path_, key, v.type, "an integer");
}

double GgufFile::real(std::string_view key) const {
  const Value& v = value(key);
  if (is_float_type(v.type)) return v.f;
  if (is_unsigned_type(v.type)) return static_cast<double>(v.u);
  if (is_signed_type(v.type)) return static_cast<double>(v.i);
  wrong_type(path_, key, v.type, "a number");
}

bool GgufFile::boolean(std::string_view key) const {
  const Value& v = value(key);
  if (v.type != GgufValueType::boolean) {
    wrong_type(path_, key, v.type, "a bool");
  }
  return v.i != 0;
}

std::string GgufFile::string(std::string_view key) const {
  const Value& v = value(key);
  if (v.type != GgufValueType::string) {
    wrong_type(path_, key, v.type, "a string");
  }
  return v.s;
}

std::vector<std::string> GgufFile::strings(std::string_view key) const {
  const Value& v = value(key);
  if (v.type != GgufValueType::array || v.element != GgufValueType::string) {
    fail(ErrorCode::invalid_argument, "{}: key {} is not an array of strings", path_.string(), key);
  }
  return v.strs;
}

std::vector<float> GgufFile::reals(std::string_view key) const {
  const Value& v = value(key);
  if (v.type != GgufValueType::array || !is_float_type(v.element)) {
    fail(ErrorCode::invalid_argument, "{}: key {} is not an array of f32", path_.string(), key);
  }
  return std::vector<float>(v.reals.begin(), v.reals.end());
}

std::vector<std::int64_t> GgufFile::ints(std::string_view key) const {
  const Value& v = value(key);
  if (v.type != GgufValueType::array ||
      !(is_signed_type(v.element) || is_unsigned_type(v.element) || v.element == GgufValueType::boolean)) {
    fail(ErrorCode::invalid_argument, "{}: key {} is not an array of integers", path_.string(), key);
  }
  if (!is_unsigned_type(v.element)) return v.ints;
  std::vector<std::int64_t> out;
  out.reserve(v.uints.size());
  for (std::uint64_t u : v.uints) {
    if (u > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) {
      fail(ErrorCode::invalid_argument, "{}: key {} holds {}, which does not fit in int64", path_.string(), key, u);
    }
    out.push_back(static_cast<std::int64_t>(u));
  }
  return out;
}

bool GgufFile::has_tensor(std::string_view name) const { return tensor_index_.find(name) != tensor_index_.end(); }

const GgufTensor& GgufFile::tensor(std::string_view name) const {
  auto it = tensor_index_.find(name);
  if (it == tensor_index_.end()) fail(ErrorCode::not_found, "{}: no tensor named {}", path_.string(), name);
  return tensors_[it->second];
}

std::vector<float> GgufFile::dequantize(const GgufTensor& t) const {
  if (!is_supported(t.type)) {
    fail(ErrorCode::invalid_argument, "{}: tensor {} has type {}, which is not supported", path_.string(), t.name,
         type_name(t.type));
  }
  std::vector<float> out(static_cast<std::size_t>(t.elements()));
  dequantize_into(t.type, t.data, out.size(), out.data());
  return out;
}

void GgufFile::dequantize_rows(const GgufTensor& t, std::uint64_t first, std::uint64_t count, float* dst) const {
  if (!is_supported(t.type)) {
    fail(ErrorCode::invalid_argument, "{}: tensor {} has type {}, which is not supported", path_.string(), t.name,
         type_name(t.type));
  }
  const std::uint64_t rows = t.rows();
  if (first > rows || count > rows - first) {
    fail(ErrorCode::out_of_range, "{}: rows [{}, {}) of tensor {} out of range [0, {})", path_.string(), first,
         first + count, t.name, rows);
  }
  const std::size_t row_bytes = static_cast<std::size_t>(t.cols() / block_elements(t.type) * block_bytes(t.type));
  dequantize_into(t.type, t.data + first * row_bytes, static_cast<std::size_t>(count * t.cols()), dst);
}

}  // namespace sparsekv::model
