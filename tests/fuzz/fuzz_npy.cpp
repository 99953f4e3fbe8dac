// Fuzz target (libFuzzer's entry point): mok::npy's reader on arbitrary file bytes. Every
// call must return a well-formed tensor or throw mok::Error; any other exception, a crash, an
// under-sized tensor or (under the sanitizers) a bad read is a finding. Built as a libFuzzer
// binary by scripts/fuzz.sh, and replayed over tests/fuzz/inputs by ctest (replay_main.cpp).
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <vector>

#include "io/npy.h"
#include "mok/error.h"

namespace {

// The reader takes a path: the bytes go to a file of this process's own.
const std::string& scratch_path() {
  static const std::string path = [] {
    const char* dir = std::getenv("TMPDIR");
    return std::string(dir != nullptr && *dir != '\0' ? dir : "/tmp") + "/mok_fuzz_npy_" + std::to_string(getpid()) +
           ".npy";
  }();
  return path;
}

template <typename Call>
void only_mok_errors(const char* what, Call&& call) {
  try {
    call();
  } catch (const mok::Error&) {
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: an exception other than mok::Error escaped: %s\n", what, e.what());
    std::abort();
  } catch (...) {
    std::fprintf(stderr, "%s: a non-standard exception escaped\n", what);
    std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string& path = scratch_path();
  FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr || (size > 0 && std::fwrite(data, 1, size, f) != size) || std::fclose(f) != 0) {
    std::fprintf(stderr, "fuzz_npy: cannot write %s\n", path.c_str());
    std::abort();
  }
  std::vector<std::int64_t> own_shape;
  bool has_header = false;
  only_mok_errors("read_header", [&] {
    own_shape = mok::npy::read_header(path).shape;
    has_header = true;
  });
  std::vector<std::vector<std::int64_t>> expected = {{}, {2, 3}};
  if (has_header) expected.push_back(own_shape);
  for (const auto& shape : expected) only_mok_errors("check_shape", [&] { mok::npy::check_shape(path, shape); });
  for (const mok::DType dtype : {mok::DType::bf16, mok::DType::f32, mok::DType::i32, mok::DType::i64,
                                 mok::DType::e4m3, mok::DType::e8m0}) {
    for (const auto& shape : expected) {
      only_mok_errors("load", [&] {
        const mok::HostTensor t = mok::npy::load(path, dtype, shape);
        // Every byte is read, so that a tensor smaller than its shape shows under ASan.
        if (t.bytes() != static_cast<std::size_t>(t.numel()) * mok::dtype_size(dtype)) std::abort();
        volatile std::uint8_t sum = 0;
        for (std::size_t i = 0; i < t.bytes(); ++i) sum = sum ^ t.data<std::uint8_t>()[i];
      });
      only_mok_errors("load_exact", [&] { (void)mok::npy::load_exact(path, dtype, shape); });
    }
  }
  std::remove(path.c_str());
  return 0;
}
