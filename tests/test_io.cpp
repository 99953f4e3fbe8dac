// .npy files (src/io/npy.h) and whole-layer save/load with problem.json (src/io/layer_io.h).
// Round trips are checked bitwise; every malformed input must throw mok::Error whose
// message names the file (and, for problem.json, the key).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <thread>
#include <string>
#include <vector>

#include "io/layer_io.h"
#include "io/npy.h"
#include "numerics/numerics.h"
#include "test_util.h"

namespace mok {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using test::error_message;
using test::TempDir;

// Writes a .npy file by hand, as NumPy does: magic, version, little-endian header length,
// the dict padded with spaces to a multiple of 64 and ended by '\n', then the data.
void write_npy(const std::string& path, const std::string& dict, const std::string& data, int major = 1) {
  std::string header = dict;
  const std::size_t prefix = major == 1 ? 10 : 12;
  header.append((64 - (prefix + header.size() + 1) % 64) % 64, ' ');
  header.push_back('\n');
  std::ofstream out(path, std::ios::binary);
  out.write("\x93NUMPY", 6);
  out.put(char(major));
  out.put(0);
  const std::size_t n = header.size();
  out.put(char(n & 0xff));
  out.put(char((n >> 8) & 0xff));
  if (major != 1) {
    out.put(char((n >> 16) & 0xff));
    out.put(char((n >> 24) & 0xff));
  }
  out << header << data;
}

template <typename T>
std::string raw_bytes(const std::vector<T>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary);
  out << bytes;
}

HostTensor filled(DType dtype, std::vector<std::int64_t> shape) {
  HostTensor t(dtype, std::move(shape));
  auto* b = t.data<std::uint8_t>();
  for (std::size_t i = 0; i < t.bytes(); ++i) b[i] = static_cast<std::uint8_t>(i * 37 + 11);
  if (dtype == DType::bf16)  // keep clear of NaN bit patterns (bitwise compare still applies)
    for (std::int64_t i = 0; i < t.numel(); ++i) t.data<std::uint16_t>()[i] &= 0xbfff;
  return t;
}

// ---- npy round trips ----------------------------------------------------------------------

TEST(Npy, RoundTripsEveryDtypeBitwise) {
  TempDir dir("npy");
  const std::vector<std::pair<DType, std::vector<std::int64_t>>> cases = {
      {DType::bf16, {3, 5}}, {DType::f32, {2, 3, 4}}, {DType::i32, {7}}, {DType::i64, {2, 2}},
      {DType::f32, {1, 1, 1, 3}}, {DType::bf16, {0, 4}}};
  int n = 0;
  for (const auto& [dtype, shape] : cases) {
    std::string name = std::to_string(n++);  // (built in steps: GCC 12 -Wrestrict false positive)
    name.insert(0, 1, 't');
    name += ".npy";
    const std::string path = dir.file(name);
    const HostTensor t = filled(dtype, shape);
    npy::save(path, t);
    const npy::Header h = npy::read_header(path);
    EXPECT_EQ(h.shape, shape);
    EXPECT_FALSE(h.fortran_order);
    EXPECT_EQ(h.data_offset % 64, 0u) << "data must start 64-byte aligned";
    const HostTensor back = npy::load(path, dtype, shape);
    EXPECT_TRUE(back.bitwise_equal(t)) << to_string(dtype);
    EXPECT_TRUE(npy::load(path, dtype).bitwise_equal(t)) << "without an expected shape";
  }
  EXPECT_EQ(npy::read_header(dir.file("t0.npy")).descr, "<u2");
  EXPECT_EQ(npy::read_header(dir.file("t1.npy")).descr, "<f4");
  EXPECT_EQ(npy::read_header(dir.file("t2.npy")).descr, "<i4");
  EXPECT_EQ(npy::read_header(dir.file("t3.npy")).descr, "<i8");
}

TEST(Npy, ReadsNumPyWrittenFilesV1AndV2) {
  TempDir dir("npy");
  const std::vector<float> v = {1.5f, -2.0f, 3.25f, 0.0f, 1e-3f, 7.0f};
  write_npy(dir.file("a.npy"), "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }", raw_bytes(v));
  write_npy(dir.file("b.npy"), "{'descr': '<f4', 'fortran_order': False, 'shape': (6,), }", raw_bytes(v), 2);
  const HostTensor a = npy::load(dir.file("a.npy"), DType::f32, {2, 3});
  const HostTensor b = npy::load(dir.file("b.npy"), DType::f32, {6});
  for (int i = 0; i < 6; ++i) {
    EXPECT_EQ(a.data<float>()[i], v[i]);
    EXPECT_EQ(b.data<float>()[i], v[i]);
  }
}

TEST(Npy, ReadsF32AsBf16WithRoundToNearestEven) {
  TempDir dir("npy");
  const std::vector<float> v = {1.0f, num::bits_float(0x3f808000u), num::bits_float(0x3f818000u),
                                num::bits_float(0x3f808001u), -3.3f, 1e30f, 0.0f, -0.0f};
  HostTensor t(DType::f32, {2, 4});
  std::memcpy(t.data<float>(), v.data(), v.size() * 4);
  npy::save(dir.file("f.npy"), t);
  const HostTensor b = npy::load(dir.file("f.npy"), DType::bf16, {2, 4});
  ASSERT_EQ(b.dtype(), DType::bf16);
  const std::vector<std::uint16_t> want = {0x3f80, 0x3f80, 0x3f82, 0x3f81, num::bf16_from_float(-3.3f),
                                           num::bf16_from_float(1e30f), 0x0000, 0x8000};
  for (int i = 0; i < 8; ++i) EXPECT_EQ(b.data<std::uint16_t>()[i], want[i]) << i;
}

// load_exact (mok run --expect: a bitwise comparison) converts nothing: an f32 file read
// as bf16, or an i64 one as i32, is refused naming the file and both dtypes.
TEST(Npy, LoadExactRefusesWhatLoadWouldConvert) {
  TempDir dir("npy");
  HostTensor f(DType::f32, {2, 2});
  std::memset(f.data<float>(), 0, 16);
  npy::save(dir.file("f.npy"), f);
  EXPECT_NO_THROW(npy::load(dir.file("f.npy"), DType::bf16, {2, 2}));
  EXPECT_THAT(error_message([&] { npy::load_exact(dir.file("f.npy"), DType::bf16, {2, 2}); }),
              AllOf(HasSubstr(dir.file("f.npy")), HasSubstr("'<f4'"), HasSubstr("'<u2'")));
  const std::vector<std::int64_t> v = {1, 2};
  write_npy(dir.file("i.npy"), "{'descr': '<i8', 'fortran_order': False, 'shape': (2,), }", raw_bytes(v));
  EXPECT_THAT(error_message([&] { npy::load_exact(dir.file("i.npy"), DType::i32); }), HasSubstr("'<i8'"));
  HostTensor b(DType::bf16, {2, 2});
  std::memset(b.data<std::uint16_t>(), 0x3f, 8);
  npy::save(dir.file("b.npy"), b);
  const HostTensor back = npy::load_exact(dir.file("b.npy"), DType::bf16, {2, 2});
  EXPECT_EQ(std::memcmp(back.data<std::uint16_t>(), b.data<std::uint16_t>(), 8), 0);
}

TEST(Npy, ReadsI64AsI32AndRejectsOutOfRange) {
  TempDir dir("npy");
  const std::vector<std::int64_t> v = {0, 7, -3, 2147483647, -2147483648LL, 5};
  write_npy(dir.file("i.npy"), "{'descr': '<i8', 'fortran_order': False, 'shape': (3, 2), }", raw_bytes(v));
  const HostTensor t = npy::load(dir.file("i.npy"), DType::i32, {3, 2});
  ASSERT_EQ(t.dtype(), DType::i32);
  for (int i = 0; i < 6; ++i) EXPECT_EQ(t.data<std::int32_t>()[i], v[i]) << i;

  const std::vector<std::int64_t> big = {1, 2147483648LL};
  write_npy(dir.file("big.npy"), "{'descr': '<i8', 'fortran_order': False, 'shape': (2,), }", raw_bytes(big));
  const std::string msg = error_message([&] { npy::load(dir.file("big.npy"), DType::i32); });
  EXPECT_THAT(msg, HasSubstr(dir.file("big.npy")));
  EXPECT_THAT(msg, HasSubstr("int32"));
}

TEST(Npy, AWriteThatFailsIsAnError) {
  // /dev/full accepts the open and fails the writes (ENOSPC), as a full disk would.
  if (!std::filesystem::exists("/dev/full")) GTEST_SKIP() << "no /dev/full on this system";
  const HostTensor t = filled(DType::f32, {64, 64});
  EXPECT_THAT(error_message([&] { npy::save("/dev/full", t); }), HasSubstr("write failed"));
}

// ---- malformed npy files ----------------------------------------------------------------

class NpyMalformed : public ::testing::Test {
 protected:
  void SetUp() override {
    HostTensor t = filled(DType::f32, {4, 8});
    good_ = dir_.file("good.npy");
    npy::save(good_, t);
    bytes_ = read_file(good_);
  }
  // Loading `path` as f32 [4,8] must throw an Error naming the file and containing `what`.
  void expect_error(const std::string& path, const std::string& what, DType dtype = DType::f32,
                    std::vector<std::int64_t> shape = {4, 8}) {
    const std::string msg = error_message([&] { npy::load(path, dtype, shape); });
    EXPECT_THAT(msg, HasSubstr(path));
    EXPECT_THAT(msg, HasSubstr(what));
  }
  TempDir dir_{"npy_bad"};
  std::string good_, bytes_;
};

TEST_F(NpyMalformed, GoodFileLoads) { EXPECT_NO_THROW(npy::load(good_, DType::f32, {4, 8})); }

TEST_F(NpyMalformed, MissingFile) { expect_error(dir_.file("nope.npy"), "cannot be opened"); }

TEST_F(NpyMalformed, BadMagic) {
  std::string b = bytes_;
  b[1] = 'X';
  write_file(dir_.file("magic.npy"), b);
  expect_error(dir_.file("magic.npy"), "magic");
  write_file(dir_.file("short.npy"), "\x93NU");
  expect_error(dir_.file("short.npy"), "too short");
}

TEST_F(NpyMalformed, TruncatedHeader) {
  write_file(dir_.file("th.npy"), bytes_.substr(0, 40));  // header claims more bytes than there are
  expect_error(dir_.file("th.npy"), "truncated header");
  write_file(dir_.file("tl.npy"), bytes_.substr(0, 9));   // not even the header length
  expect_error(dir_.file("tl.npy"), "truncated header length");
}

TEST_F(NpyMalformed, TruncatedOrOversizedData) {
  write_file(dir_.file("td.npy"), bytes_.substr(0, bytes_.size() - 4));
  expect_error(dir_.file("td.npy"), "data bytes");
  write_file(dir_.file("long.npy"), bytes_ + "xxxx");
  expect_error(dir_.file("long.npy"), "data bytes");
  // A header may claim any shape: it is checked against the file before anything is
  // allocated (with no expected shape, as a loader of unknown arrays calls it).
  write_npy(dir_.file("huge.npy"), "{'descr': '<f4', 'fortran_order': False, 'shape': (100000000000, 100000), }", "");
  expect_error(dir_.file("huge.npy"), "data bytes", DType::f32, {});
  write_npy(dir_.file("overflow.npy"),
            "{'descr': '<f4', 'fortran_order': False, 'shape': (4294967296, 4294967296, 4), }", "");
  expect_error(dir_.file("overflow.npy"), "not a countable array", DType::f32, {});
  // More dimensions than a tensor holds: named with the file, not by the tensor alone.
  write_npy(dir_.file("five.npy"), "{'descr': '<f4', 'fortran_order': False, 'shape': (1, 1, 1, 1, 1), }",
            raw_bytes(std::vector<float>(1, 1.0f)));
  expect_error(dir_.file("five.npy"), "has 5 dimensions, at most 4", DType::f32, {});
  // An empty array's other dimensions obey the same bound, wherever its zero stands (the
  // zero first loaded, the zero last was refused).
  for (const char* shape : {"(0, 4294967296, 4294967296)", "(4294967296, 4294967296, 0)"}) {
    write_npy(dir_.file("empty.npy"),
              std::string("{'descr': '<f4', 'fortran_order': False, 'shape': ") + shape + ", }", "");
    expect_error(dir_.file("empty.npy"), "not a countable array", DType::f32, {});
  }
  write_npy(dir_.file("empty.npy"), "{'descr': '<f4', 'fortran_order': False, 'shape': (3, 0, 5), }", "");
  EXPECT_EQ(npy::load(dir_.file("empty.npy"), DType::f32).numel(), 0);
}

TEST_F(NpyMalformed, WrongDtype) {
  expect_error(good_, "'<f4' cannot be read as i32", DType::i32);
  expect_error(good_, "'<f4' cannot be read as i64", DType::i64);
  const std::vector<double> d(32, 1.0);
  write_npy(dir_.file("f8.npy"), "{'descr': '<f8', 'fortran_order': False, 'shape': (4, 8), }", raw_bytes(d));
  expect_error(dir_.file("f8.npy"), "'<f8' cannot be read as f32");
  expect_error(dir_.file("f8.npy"), "'<f8' cannot be read as bf16", DType::bf16);
  const std::vector<float> be(32, 1.0f);
  write_npy(dir_.file("be.npy"), "{'descr': '>f4', 'fortran_order': False, 'shape': (4, 8), }", raw_bytes(be));
  expect_error(dir_.file("be.npy"), "'>f4'");
}

TEST_F(NpyMalformed, FortranOrder) {
  const std::vector<float> v(32, 1.0f);
  write_npy(dir_.file("fo.npy"), "{'descr': '<f4', 'fortran_order': True, 'shape': (4, 8), }", raw_bytes(v));
  expect_error(dir_.file("fo.npy"), "fortran_order");
}

TEST_F(NpyMalformed, ShapeMismatch) {
  expect_error(good_, "does not match", DType::f32, {8, 4});
  expect_error(good_, "does not match", DType::f32, {4, 8, 1});
  expect_error(good_, "does not match", DType::f32, {32});
}

TEST_F(NpyMalformed, BrokenHeaderDict) {
  const std::vector<float> v(32, 1.0f);
  write_npy(dir_.file("nd.npy"), "{'fortran_order': False, 'shape': (4, 8), }", raw_bytes(v));
  expect_error(dir_.file("nd.npy"), "descr");
  write_npy(dir_.file("ns.npy"), "{'descr': '<f4', 'fortran_order': False, 'shape': (4, x), }", raw_bytes(v));
  expect_error(dir_.file("ns.npy"), "shape");
  write_npy(dir_.file("nf.npy"), "{'descr': '<f4', 'fortran_order': Maybe, 'shape': (4, 8), }", raw_bytes(v));
  expect_error(dir_.file("nf.npy"), "fortran_order");
  // Parsed strictly: no empty or suffixed dimensions, each key once, no other key, nothing
  // after the dict (each was silently accepted once).
  const std::vector<std::pair<std::string, std::string>> strict = {
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (4,, 8), }", "is not a dimension"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (4LLL, 8), }", "expected ',' or ')'"},
      {"{'descr': '<f4', 'descr': '<i4', 'fortran_order': False, 'shape': (4, 8), }", "'descr' twice"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (4, 8), 'x': 1, }", "unknown key 'x'"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (4, 8), } junk", "after its closing"}};
  for (std::size_t i = 0; i < strict.size(); ++i) {
    const std::string f = dir_.file("strict" + std::to_string(i) + ".npy");
    write_npy(f, strict[i].first, raw_bytes(v));
    expect_error(f, strict[i].second);
  }
  // What NumPy writes (and Python 2's 'L' suffix) still loads.
  write_npy(dir_.file("py2.npy"), "{'descr': '<f4', 'fortran_order': False, 'shape': (4L, 8L), }", raw_bytes(v));
  EXPECT_NO_THROW(npy::load(dir_.file("py2.npy"), DType::f32, {4, 8}));
}

// ---- problem.json ---------------------------------------------------------------------------

TEST(ProblemJson, RoundTripsEveryField) {
  for (const Problem& p :
       {test::make_problem(8, 64, 32, 2, {}, 2, 16),
        test::make_problem(16, 96, 64, 3, {32, 64}, 4, 5, Precision::bf16, 1.2345678f),
        test::make_problem(8, 64, 32, 8, {32}, 1, 3, Precision::mxfp8, 7.0f),
        test::make_problem(4, 32, 32, 1, {32}, 2, 1, Precision::mxfp8, 1e-3f)}) {
    const Problem q = io::problem_from_json(io::problem_to_json(p), "test.json");
    EXPECT_EQ(q.num_experts, p.num_experts);
    EXPECT_EQ(q.hidden, p.hidden);
    EXPECT_EQ(q.intermediate, p.intermediate);
    EXPECT_EQ(q.top_k, p.top_k);
    EXPECT_EQ(q.shared_intermediate, p.shared_intermediate);
    EXPECT_EQ(q.ep_size, p.ep_size);
    EXPECT_EQ(q.tokens_per_rank, p.tokens_per_rank);
    EXPECT_EQ(q.precision, p.precision);
    ASSERT_EQ(q.swiglu_limit.has_value(), p.swiglu_limit.has_value());
    if (p.swiglu_limit) {
      EXPECT_EQ(*q.swiglu_limit, *p.swiglu_limit) << "swiglu_limit must round-trip exactly";
    }
  }
}

TEST(ProblemJson, ParseErrorsNameTheSourceAndTheKey) {
  const std::string good = io::problem_to_json(test::make_problem(8, 64, 32, 2, {32}, 2, 16));
  ASSERT_NO_THROW(io::problem_from_json(good, "src.json"));
  auto replace = [&](const std::string& from, const std::string& to) {
    std::string s = good;
    const auto pos = s.find(from);
    EXPECT_NE(pos, std::string::npos) << from;
    return s.replace(pos, from.size(), to);
  };
  const std::vector<std::pair<std::string, std::string>> bad = {
      {replace("\"hidden\"", "\"hiddn\""), "unknown key \"hiddn\""},      // a misspelt key
      {replace("\"hidden\": 64,", ""), "missing key \"hidden\""},
      {replace("\"top_k\": 2,", "\"top_k\": 2, \"top_k\": 3,"), "\"top_k\" given twice"},
      {good + "x", "text after the closing '}'"},
      {replace("[32]", "[32, , ]"), "\"shared_intermediate\": an empty list entry"},
      {replace("[32]", "[32,]"), "\"shared_intermediate\": an empty list entry"},
      {replace("\"hidden\": 64", "\"hidden\": 6x4"), "hidden"},           // not an integer
      {replace("\"hidden\": 64", "\"hidden\": 64.5"), "hidden"},
      {replace("\"top_k\": 2", "\"top_k\": \"2\""), "top_k"},
      {replace("[32]", "[32, abc]"), "shared_intermediate"},
      {replace("[32]", "32"), "shared_intermediate"},                     // not a list
      {replace("[32]", "[32"), "shared_intermediate"},                    // unterminated
      {replace("\"bf16\"", "bf16"), "precision"},                         // not a string
      {replace("\"bf16\"", "\"fp4\""), "precision"},                      // unknown value
      {replace("\"swiglu_limit\": null", "\"swiglu_limit\": big"), "swiglu_limit"},
      {replace("\"top_k\": 2", "\"top_k\": 9"), "top_k"},                 // breaks a rule: k > E
      {replace("\"ep_size\": 2", "\"ep_size\": 3"), "ep_size"},           // E % R != 0
      {replace("\"swiglu_limit\": null", "\"swiglu_limit\": -1"), "swiglu_limit"},
      {replace("\"swiglu_limit\": null", "\"swiglu_limit\": 1e-40"), "a positive normal float"},
      {replace("\"swiglu_limit\": null", "\"swiglu_limit\": 1e-45"), "a positive normal float"},
      {replace("\"ep_size\": 2", "\"ep_size\": 4294967298"), "ep_size"},  // would truncate to 2
      {replace("[32]", "[32abc]"), "shared_intermediate"},                 // a partial number
      {replace("\"swiglu_limit\": null", "\"swiglu_limit\": 1.5x"), "swiglu_limit"},
      {replace("\"swiglu_limit\": null", "\"swiglu_limit\": nan"), "swiglu_limit"},
      // Beyond float's range: refused as written, not validated as the 0 or inf it would become.
      {replace("\"swiglu_limit\": null", "\"swiglu_limit\": 1e-50"), "1e-50 is outside float's range"},
      {replace("\"swiglu_limit\": null", "\"swiglu_limit\": 1e300"), "1e+300 is outside float's range"},
      // Numbers as JSON writes them: no '+', no leading zeros, digits on both sides of a '.'.
      {replace("\"hidden\": 64", "\"hidden\": +64"), "\"hidden\": '+64' is not an integer"},
      {replace("\"hidden\": 64", "\"hidden\": 0064"), "\"hidden\": '0064' is not an integer"},
      {replace("[32]", "[+32]"), "\"shared_intermediate\" entry: '+32' is not an integer"},
      {replace("\"swiglu_limit\": null", "\"swiglu_limit\": .5"), "'.5' is not a number or null"},
      {replace("\"swiglu_limit\": null", "\"swiglu_limit\": 1."), "'1.' is not a number or null"},
      {replace("\"swiglu_limit\": null", "\"swiglu_limit\": 1e"), "'1e' is not a number or null"},
      // Nothing after the closing brace, a NUL byte included (it read as the end of the text).
      {good + std::string(1, '\0') + "junk", "text after the closing '}'"},
  };
  for (const auto& [text, key] : bad) {
    const std::string msg = error_message([&] { io::problem_from_json(text, "src.json"); });
    EXPECT_THAT(msg, HasSubstr("src.json")) << text;
    EXPECT_THAT(msg, HasSubstr(key)) << text;
  }
}

TEST(ProblemJson, ReadsWindowsLineEndings) {
  // A problem.json edited on Windows: CRLF between the keys and inside the list.
  const Problem p = test::make_problem(8, 64, 32, 2, {32, 64}, 2, 16);
  std::string text;
  for (char c : io::problem_to_json(p)) text += c == '\n' ? std::string("\r\n") : std::string(1, c);
  const auto pos = text.find("[32, 64]");
  ASSERT_NE(pos, std::string::npos) << text;
  text.replace(pos, 8, "[\r\n  32,\r\n  64\r\n]");
  const Problem q = io::problem_from_json(text, "crlf.json");
  EXPECT_EQ(q.shared_intermediate, p.shared_intermediate);
  EXPECT_EQ(q.describe(), p.describe());
}

// ---- whole-layer save/load ------------------------------------------------------------------

TEST(LayerIo, SaveLoadRoundTripReproducesTheRun) {
  TempDir dir("layer");
  const Problem p = test::make_problem(8, 64, 32, 2, {32, 64}, 2, 12, Precision::bf16, 1.5f);
  LayerData data = test::make_data(p, 5, true);
  test::run_reference(data, true);
  io::save_layer_data(dir.str(), data);
  EXPECT_TRUE(std::filesystem::exists(dir.path() / "problem.json"));
  EXPECT_TRUE(std::filesystem::exists(dir.path() / "rank1" / "shared1_d_w_down.npy"));

  LayerData back = io::load_layer_data(dir.str(), true);
  EXPECT_EQ(io::problem_to_json(back.problem), io::problem_to_json(p));
  ASSERT_EQ(back.ranks.size(), data.ranks.size());
  for (int r = 0; r < p.ep_size; ++r) {
    const RankData &a = data.ranks[r], &b = back.ranks[r];
    for (auto m : {&RankData::x, &RankData::top_experts, &RankData::router_weights, &RankData::w_gate,
                   &RankData::w_up, &RankData::w_down, &RankData::dy})
      EXPECT_TRUE((a.*m).bitwise_equal(b.*m)) << "rank " << r;
    for (int s = 0; s < p.num_shared(); ++s) {
      EXPECT_TRUE(a.shared[s].w_gate.bitwise_equal(b.shared[s].w_gate));
      EXPECT_TRUE(a.shared[s].w_up.bitwise_equal(b.shared[s].w_up));
      EXPECT_TRUE(a.shared[s].w_down.bitwise_equal(b.shared[s].w_down));
    }
    // Outputs come back poisoned (NaN), not as the saved values.
    EXPECT_TRUE(std::isnan(test::element(b.y, 0)));
    EXPECT_TRUE(std::isnan(test::element(b.d_w_gate, 0)));
  }
  // Running the loaded data reproduces every output bitwise.
  test::run_reference(back, true);
  for (int r = 0; r < p.ep_size; ++r) {
    const RankData &a = data.ranks[r], &b = back.ranks[r];
    for (auto m : {&RankData::y, &RankData::dx, &RankData::d_router_weights, &RankData::d_w_gate,
                   &RankData::d_w_up, &RankData::d_w_down})
      EXPECT_TRUE((a.*m).bitwise_equal(b.*m)) << "rank " << r;
    for (int s = 0; s < p.num_shared(); ++s) EXPECT_TRUE(a.d_shared[s].d_w_up.bitwise_equal(b.d_shared[s].d_w_up));
  }
  // Saved outputs are readable too.
  const HostTensor y1 = npy::load((dir.path() / "rank1" / "y.npy").string(), DType::bf16, {12, 64});
  EXPECT_TRUE(y1.bitwise_equal(data.ranks[1].y));
}

// A save that fails part way (here rank1 cannot be a directory: a file has its name) removes
// what it had written and nothing else.
TEST(LayerIo, AFailedSaveRemovesWhatItWroteAndNothingElse) {
  TempDir dir("layer");
  const Problem p = test::make_problem(4, 32, 32, 2, {32}, 2, 4);
  const LayerData data = test::make_data(p, 2, false);
  namespace fs = std::filesystem;
  const fs::path target = dir.path() / "new" / "save";
  fs::create_directories(target);
  for (const char* name : {"keep.txt", "rank1"}) std::ofstream(target / name) << "not mok's";
  const std::string msg = error_message([&] { io::save_layer_data(target.string(), data); });
  EXPECT_THAT(msg, HasSubstr("rank directory"));
  EXPECT_THAT(msg, HasSubstr("is removed"));
  EXPECT_FALSE(fs::exists(target / "problem.json"));
  EXPECT_FALSE(fs::exists(target / "rank0")) << "rank0 was written before the failure";
  EXPECT_TRUE(fs::is_regular_file(target / "keep.txt"));
  EXPECT_TRUE(fs::is_regular_file(target / "rank1"));
}

// problem.json is written last: a save cut short by a signal (no unwinding, so no rollback)
// leaves none, and --load never takes a partial save for a whole one. One data file is a FIFO
// here, so that the save can be watched while it writes that file: problem.json is not there
// yet then (and is once the save is done). The pipe holds one page, less than the file, so the
// save waits in that file until it is read.
TEST(LayerIo, ProblemJsonIsWrittenLast) {
  TempDir dir("layer");
  const Problem p = test::make_problem(4, 512, 32, 2, {32}, 2, 16);  // x: 16 KiB per rank
  const LayerData data = test::make_data(p, 2, false);
  namespace fs = std::filesystem;
  fs::create_directories(dir.path() / "rank1");
  const fs::path fifo = dir.path() / "rank1" / "x.npy";
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  const int fd = open(fifo.c_str(), O_RDONLY | O_NONBLOCK);  // (so the save's open does not block)
  ASSERT_GE(fd, 0);
  ASSERT_GE(fcntl(fd, F_SETPIPE_SZ, 4096), 4096);
  ASSERT_LE(fcntl(fd, F_GETPIPE_SZ), 8192);
  std::atomic<bool> done{false};
  std::string error;
  std::thread saver([&] {
    try {
      io::save_layer_data(dir.str(), data);
    } catch (const std::exception& e) {
      error = e.what();
    }
    done = true;
  });
  bool seen_writing = false, json_while_writing = false;
  char buffer[4096];
  for (;;) {  // (drained until the save is done: a full pipe would hold it)
    const ssize_t n = read(fd, buffer, sizeof buffer);
    if (n > 0) {
      if (!seen_writing) json_while_writing = fs::exists(dir.path() / "problem.json");
      seen_writing = true;
      continue;
    }
    if (done) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  saver.join();
  close(fd);
  EXPECT_EQ(error, "");
  EXPECT_TRUE(seen_writing) << "the save never wrote rank1/x.npy";
  EXPECT_FALSE(json_while_writing) << "problem.json was there while the data files were still being written";
  EXPECT_TRUE(fs::is_regular_file(dir.path() / "problem.json"));
}

TEST(LayerIo, ForwardOnlyLoadNeedsNoDy) {
  TempDir dir("layer");
  const Problem p = test::make_problem(4, 32, 32, 2, {}, 1, 4);
  LayerData data = test::make_data(p, 2, false);
  test::run_reference(data, false);
  io::save_layer_data(dir.str(), data);
  EXPECT_FALSE(std::filesystem::exists(dir.path() / "rank0" / "dy.npy"));
  LayerData back = io::load_layer_data(dir.str(), false);
  EXPECT_TRUE(back.ranks[0].dy.empty());
  // Asking for the backward needs dy: the error names the missing file and the way out.
  const std::string msg = error_message([&] { io::load_layer_data(dir.str(), true); });
  EXPECT_THAT(msg, AllOf(HasSubstr("dy.npy"), HasSubstr("load it with --pass forward")));
}

// What the caller will hold beside the loaded data (mok run: the CPU reference's slots and
// work) is in the memory check, made before any tensor is read: too much is a named error.
TEST(LayerIo, LoadCountsTheCallersMemoryBeforeReading) {
  TempDir dir("layer");
  const Problem p = test::make_problem(4, 32, 32, 2, {}, 1, 4);
  io::save_layer_data(dir.str(), test::make_data(p, 2, false));
  Problem seen;
  EXPECT_NO_THROW(io::load_layer_data(dir.str(), false, [&](const Problem& q) {
    seen = q;
    return std::uint64_t{1} << 20;
  }));
  EXPECT_EQ(seen.describe(), p.describe());
  for (const std::uint64_t huge : {std::uint64_t{1} << 62, ~std::uint64_t{0}})
    EXPECT_THAT(error_message([&] { io::load_layer_data(dir.str(), false, [&](const Problem&) { return huge; }); }),
                AllOf(HasSubstr("--load"), HasSubstr("with the CPU reference"), HasSubstr("GiB of host memory")));
}

// A problem.json that describes less than the directory holds (fewer ranks, fewer shared
// experts) is refused: loading it would run another problem than the one saved.
TEST(LayerIo, LoadRefusesFilesBeyondTheProblem) {
  namespace fs = std::filesystem;
  TempDir dir("layer");
  const Problem p = test::make_problem(4, 32, 32, 2, {32}, 2, 4);  // 2 local experts per rank
  io::save_layer_data(dir.str(), test::make_data(p, 2, false));
  const std::string pj = (dir.path() / "problem.json").string();
  Problem one_rank = p;  // the same files' sizes, for rank 0 only
  one_rank.num_experts = 2;
  one_rank.ep_size = 1;
  write_file(pj, io::problem_to_json(one_rank));
  EXPECT_THAT(error_message([&] { io::load_layer_data(dir.str(), false); }),
              AllOf(HasSubstr("rank1"), HasSubstr("ep_size is 1"), HasSubstr("another problem")));
  Problem no_shared = p;
  no_shared.shared_intermediate.clear();
  write_file(pj, io::problem_to_json(no_shared));
  EXPECT_THAT(error_message([&] { io::load_layer_data(dir.str(), false); }),
              AllOf(HasSubstr("rank0/shared0_"), HasSubstr("0 shared expert(s)")));
  write_file(pj, io::problem_to_json(p));
  EXPECT_NO_THROW(io::load_layer_data(dir.str(), false));
  // Any file of them, in any rank: not only the ones a load reads first.
  fs::create_directories(dir.path() / "rank2");
  fs::copy_file(dir.path() / "rank0" / "w_gate.npy", dir.path() / "rank2" / "w_gate.npy");
  EXPECT_THAT(error_message([&] { io::load_layer_data(dir.str(), false); }),
              AllOf(HasSubstr("rank2 is there"), HasSubstr("ep_size is 2")));
  fs::remove_all(dir.path() / "rank2");
  fs::copy_file(dir.path() / "rank1" / "shared0_w_up.npy", dir.path() / "rank1" / "shared1_w_up.npy");
  EXPECT_THAT(error_message([&] { io::load_layer_data(dir.str(), false); }),
              AllOf(HasSubstr("rank1/shared1_w_up.npy is there"), HasSubstr("1 shared expert(s)")));
  fs::remove(dir.path() / "rank1" / "shared1_w_up.npy");
  // Names that only look alike are not mok's: left alone.
  write_file((dir.path() / "rank1" / "shared_notes.txt").string(), "x");
  fs::create_directories(dir.path() / "ranks_old");
  EXPECT_NO_THROW(io::load_layer_data(dir.str(), false));
}

// Whether a file is there: nothing there is false; something that is not a file, or a path
// whose status cannot be read, is a named error (not std::filesystem's exception).
TEST(Npy, RegularFileAtNamesWhatIsThere) {
  TempDir dir("at");
  EXPECT_FALSE(npy::regular_file_at(dir.file("nope.npy"), "ctx"));
  EXPECT_FALSE(npy::regular_file_at(dir.file("no_dir/nope.npy"), "ctx"));
  write_file(dir.file("f.npy"), "x");
  EXPECT_TRUE(npy::regular_file_at(dir.file("f.npy"), "ctx"));
  EXPECT_THAT(error_message([&] { npy::regular_file_at(dir.str(), "ctx"); }),
              AllOf(HasSubstr("ctx: "), HasSubstr("is not a regular file")));
  const std::string too_long = dir.file(std::string(5000, 'a') + ".npy");  // (ENAMETOOLONG, even as root)
  EXPECT_THAT(error_message([&] { npy::regular_file_at(too_long, "ctx"); }),
              AllOf(HasSubstr("ctx: "), HasSubstr("cannot be read")));
}

TEST(LayerIo, LoadErrorsNameTheFile) {
  TempDir dir("layer");
  // No problem.json.
  EXPECT_THAT(error_message([&] { io::load_layer_data(dir.str(), false); }), HasSubstr("problem.json"));

  const Problem p = test::make_problem(4, 32, 32, 2, {32}, 2, 4);
  LayerData data = test::make_data(p, 2, false);
  io::save_layer_data(dir.str(), data);
  ASSERT_NO_THROW(io::load_layer_data(dir.str(), false));

  // A missing input file.
  const auto wg = dir.path() / "rank1" / "shared0_w_up.npy";
  std::filesystem::rename(wg, dir.path() / "moved.npy");
  EXPECT_THAT(error_message([&] { io::load_layer_data(dir.str(), false); }), HasSubstr(wg.string()));
  std::filesystem::rename(dir.path() / "moved.npy", wg);

  // A file whose shape disagrees with problem.json.
  const auto x = (dir.path() / "rank0" / "x.npy").string();
  npy::save(x, HostTensor(DType::bf16, {4, 31}));
  std::string msg = error_message([&] { io::load_layer_data(dir.str(), false); });
  EXPECT_THAT(msg, HasSubstr(x));
  EXPECT_THAT(msg, HasSubstr("shape"));
  npy::save(x, data.ranks[0].x);

  // A routing file with an out-of-range expert id.
  HostTensor bad_ids = data.ranks[1].top_experts;
  bad_ids.data<std::int32_t>()[3] = 4;
  npy::save((dir.path() / "rank1" / "top_experts.npy").string(), bad_ids);
  msg = error_message([&] { io::load_layer_data(dir.str(), false); });
  EXPECT_THAT(msg, HasSubstr("top_experts[rank 1]"));

  // A malformed problem.json.
  write_file((dir.path() / "problem.json").string(), "{\"num_experts\": 4}");
  msg = error_message([&] { io::load_layer_data(dir.str(), false); });
  EXPECT_THAT(msg, HasSubstr("problem.json"));
  EXPECT_THAT(msg, HasSubstr("hidden"));
}

}  // namespace
}  // namespace mok
