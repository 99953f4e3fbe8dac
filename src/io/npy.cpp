#include "io/npy.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <limits>
#include <fstream>
#include <sstream>

#include "mok/error.h"
#include "numerics/numerics.h"

namespace mok::npy {
namespace {

const char* descr_of(DType dtype) {
  switch (dtype) {
    case DType::bf16: return "<u2";
    case DType::f32: return "<f4";
    case DType::i32: return "<i4";
    case DType::i64: return "<i8";
    case DType::e4m3: case DType::e8m0: return "|u1";
  }
  return "?";
}

std::string shape_string(const std::vector<std::int64_t>& shape) {
  std::ostringstream s;
  s << "(";
  for (std::size_t i = 0; i < shape.size(); ++i) s << shape[i] << (shape.size() == 1 ? "," : (i + 1 < shape.size() ? ", " : ""));
  s << ")";
  return s.str();
}

[[noreturn]] void fail(const std::string& path, const std::string& what) {
  throw Error("npy file '" + path + "': " + what);
}

// The header dict, a Python literal as NumPy writes it: {'descr': '<u2', 'fortran_order':
// False, 'shape': (64, 256), } then blank padding. Parsed strictly: exactly these three keys,
// once each, nothing after the closing brace but blanks.
class HeaderParser {
 public:
  HeaderParser(const std::string& text, const std::string& path) : t_(text), path_(path) {}

  Header parse() {
    Header h;
    bool seen[3] = {false, false, false};
    expect('{');
    for (;;) {
      if (peek() == '}') break;
      const std::string key = quoted("a key");
      expect(':');
      const int which = key == "descr" ? 0 : key == "fortran_order" ? 1 : key == "shape" ? 2 : -1;
      if (which < 0) fail(path_, "header has an unknown key '" + key + "'");
      if (seen[which]) fail(path_, "header gives '" + key + "' twice");
      seen[which] = true;
      if (which == 0) {
        h.descr = quoted("descr");
      } else if (which == 1) {
        h.fortran_order = word("True") ? true : word("False") ? false
                          : (fail(path_, "fortran_order is neither True nor False"), false);
      } else {
        h.shape = tuple();
      }
      if (peek() == ',') ++i_;
      else if (peek() != '}') fail(path_, "header: expected ',' or '}' after '" + key + "'");
    }
    ++i_;
    if (t_.find_first_not_of(" \n", i_) != std::string::npos) fail(path_, "header has text after its closing '}'");
    for (int k = 0; k < 3; ++k)
      if (!seen[k]) fail(path_, std::string("header has no '") + (k == 0 ? "descr" : k == 1 ? "fortran_order" : "shape") + "' entry");
    return h;
  }

 private:
  char peek() {
    while (i_ < t_.size() && t_[i_] == ' ') ++i_;
    return i_ < t_.size() ? t_[i_] : '\0';
  }
  void expect(char c) {
    if (peek() != c) fail(path_, std::string("header: expected '") + c + "'");
    ++i_;
  }
  bool word(const char* w) {
    peek();
    if (t_.compare(i_, std::strlen(w), w) != 0) return false;
    i_ += std::strlen(w);
    return true;
  }
  std::string quoted(const char* what) {
    if (peek() != '\'') fail(path_, std::string("header: ") + what + " is not a quoted string");
    const auto end = t_.find('\'', i_ + 1);
    if (end == std::string::npos) fail(path_, std::string("header: unterminated ") + what);
    std::string v = t_.substr(i_ + 1, end - i_ - 1);
    i_ = end + 1;
    return v;
  }
  // (d0, d1, ...) of non-negative integers; a trailing comma allowed (NumPy writes (64,)),
  // an empty entry not; one 'L' suffix allowed (Python 2's NumPy wrote 64L).
  std::vector<std::int64_t> tuple() {
    expect('(');
    std::vector<std::int64_t> dims;
    while (peek() != ')') {
      std::size_t j = i_;
      while (j < t_.size() && t_[j] >= '0' && t_[j] <= '9') ++j;
      if (j == i_ || j - i_ > 18) fail(path_, "shape entry at '" + t_.substr(i_, 12) + "' is not a dimension");
      dims.push_back(std::stoll(t_.substr(i_, j - i_)));
      i_ = j;
      if (i_ < t_.size() && t_[i_] == 'L') ++i_;
      if (peek() == ',') ++i_;
      else if (peek() != ')') fail(path_, "shape: expected ',' or ')' after a dimension");
    }
    ++i_;
    return dims;
  }

  const std::string& t_;
  const std::string& path_;
  std::size_t i_ = 0;
};

// `path` opened for reading, or the error naming it and the system's reason.
std::ifstream open_for_reading(const std::string& path) {
  errno = 0;
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(path, std::string("cannot be opened") + (errno != 0 ? std::string(": ") + std::strerror(errno) : ""));
  return in;
}

}  // namespace

Header read_header(const std::string& path) {
  std::ifstream in = open_for_reading(path);
  char magic[8];
  if (!in.read(magic, 8)) fail(path, "too short to be a .npy file");
  if (std::memcmp(magic, "\x93NUMPY", 6) != 0) fail(path, "bad magic (not a .npy file)");
  const int major = static_cast<unsigned char>(magic[6]);
  std::uint32_t header_len = 0;
  std::size_t prefix = 0;
  if (major == 1) {
    unsigned char b[2];
    if (!in.read(reinterpret_cast<char*>(b), 2)) fail(path, "truncated header length");
    header_len = b[0] | (b[1] << 8);
    prefix = 10;
  } else if (major == 2 || major == 3) {
    unsigned char b[4];
    if (!in.read(reinterpret_cast<char*>(b), 4)) fail(path, "truncated header length");
    header_len = b[0] | (b[1] << 8) | (b[2] << 16) | (std::uint32_t(b[3]) << 24);
    prefix = 12;
  } else {
    fail(path, "unsupported format version " + std::to_string(major));
  }
  if (header_len > (1u << 20)) fail(path, "header length " + std::to_string(header_len) + " is implausible");
  std::string header(header_len, '\0');
  if (!in.read(header.data(), header_len)) fail(path, "truncated header");

  Header h = HeaderParser(header, path).parse();
  h.data_offset = prefix + header_len;
  return h;
}

bool regular_file_at(const std::string& path, const std::string& context) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  if (st.type() == fs::file_type::not_found) return false;
  if (ec) throw Error(context + ": " + path + " cannot be read: " + ec.message());
  if (st.type() != fs::file_type::regular) throw Error(context + ": " + path + " is not a regular file");
  return true;
}

void save(const std::string& path, const HostTensor& tensor) {
  std::ostringstream dict;
  dict << "{'descr': '" << descr_of(tensor.dtype()) << "', 'fortran_order': False, 'shape': "
       << shape_string(tensor.shape()) << ", }";
  std::string header = dict.str();
  // Pad so that the data starts at a multiple of 64 bytes; the header ends with '\n'.
  const std::size_t total = 10 + header.size() + 1;
  header.append((64 - total % 64) % 64, ' ');
  header.push_back('\n');
  std::ofstream out(path, std::ios::binary);
  if (!out) throw Error("npy file '" + path + "': cannot be created");
  out.write("\x93NUMPY\x01\x00", 8);
  const unsigned char len[2] = {static_cast<unsigned char>(header.size() & 0xff),
                                static_cast<unsigned char>(header.size() >> 8)};
  out.write(reinterpret_cast<const char*>(len), 2);
  out.write(header.data(), static_cast<std::streamsize>(header.size()));
  out.write(tensor.data<char>(), static_cast<std::streamsize>(tensor.bytes()));
  out.close();  // the last bytes reach the file here: a full disk shows now, not never
  if (!out) throw Error("npy file '" + path + "': write failed");
}

namespace {
void require_shape(const std::string& path, const Header& h, const std::vector<std::int64_t>& expect_shape) {
  if (h.shape != expect_shape)
    fail(path, "shape " + shape_string(h.shape) + " does not match the expected " + shape_string(expect_shape));
}
}  // namespace

void check_shape(const std::string& path, const std::vector<std::int64_t>& expect_shape) {
  require_shape(path, read_header(path), expect_shape);
}

HostTensor load_exact(const std::string& path, DType dtype, const std::vector<std::int64_t>& expect_shape) {
  const std::string want = descr_of(dtype);
  const Header h = read_header(path);
  if (h.descr != want)
    fail(path, "dtype '" + h.descr + "' is not " + to_string(dtype) + "'s own ('" + want +
                   "'): its values would be converted, and the comparison is of the file's bits");
  return load(path, dtype, expect_shape);
}

HostTensor load(const std::string& path, DType dtype, const std::vector<std::int64_t>& expect_shape) {
  const Header h = read_header(path);
  if (h.fortran_order) fail(path, "fortran_order arrays are not supported; save in C order");
  if (!expect_shape.empty()) require_shape(path, h, expect_shape);
  const std::string want = descr_of(dtype);
  std::size_t elem = 0;
  enum { same, f32_to_bf16, i64_to_i32 } conversion = same;
  if (h.descr == want) {
    elem = dtype_size(dtype);
  } else if (dtype == DType::bf16 && h.descr == "<f4") {
    conversion = f32_to_bf16;
    elem = 4;
  } else if (dtype == DType::i32 && h.descr == "<i8") {
    conversion = i64_to_i32;
    elem = 8;
  } else {
    fail(path, "dtype '" + h.descr + "' cannot be read as " + to_string(dtype) + " (expected '" + want + "')");
  }
  if (h.shape.size() > static_cast<std::size_t>(kMaxTensorDims))
    fail(path, "shape " + shape_string(h.shape) + " has " + std::to_string(h.shape.size()) + " dimensions, at most " +
                   std::to_string(kMaxTensorDims));
  // The element count (overflow-checked) is compared with the file before anything is
  // allocated: a header may claim any shape. The non-zero dimensions' product must fit, as a
  // HostTensor's must, wherever a zero stands (an array with one is empty).
  std::size_t n = 1;
  bool empty = false;
  for (std::int64_t d : h.shape) {
    if (d == 0) empty = true;
    if (d < 0 || (d > 0 && (__builtin_mul_overflow(n, static_cast<std::size_t>(d), &n) ||
                            n > static_cast<std::size_t>(std::numeric_limits<std::int64_t>::max()) / elem)))
      fail(path, "shape " + shape_string(h.shape) + " is not a countable array");
  }
  if (empty) n = 0;
  const std::size_t need = n * elem;  // (n <= INT64_MAX / elem: no wrap)
  std::ifstream in = open_for_reading(path);  // (again: read_header's stream is closed)
  in.seekg(0, std::ios::end);
  const std::size_t file_size = static_cast<std::size_t>(in.tellg());
  if (file_size < h.data_offset || file_size - h.data_offset != need)
    fail(path, "holds " + std::to_string(file_size - std::min(file_size, h.data_offset)) + " data bytes; shape " +
                   shape_string(h.shape) + " of '" + h.descr + "' needs " + std::to_string(need));
  HostTensor t(dtype, h.shape);
  in.seekg(static_cast<std::streamoff>(h.data_offset));
  if (conversion == same) {
    in.read(t.data<char>(), static_cast<std::streamsize>(need));
  } else {
    std::vector<char> raw(need);
    in.read(raw.data(), static_cast<std::streamsize>(raw.size()));
    for (std::size_t i = 0; i < n; ++i) {
      if (conversion == f32_to_bf16) {
        float f;
        std::memcpy(&f, raw.data() + 4 * i, 4);
        t.data<std::uint16_t>()[i] = num::bf16_from_float(f);
      } else {
        std::int64_t v;
        std::memcpy(&v, raw.data() + 8 * i, 8);
        if (v < INT32_MIN || v > INT32_MAX) fail(path, "element " + std::to_string(i) + " does not fit int32");
        t.data<std::int32_t>()[i] = static_cast<std::int32_t>(v);
      }
    }
  }
  if (!in) fail(path, "read failed");
  return t;
}

}  // namespace mok::npy
