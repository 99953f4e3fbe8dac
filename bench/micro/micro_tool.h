// mok microbenchmarks (bench/micro): what their command lines and CUDA calls share. A
// benchmark has no caller to hand an error to, so a failure prints "<tool>: ..." and exits:
// 1 for a CUDA error, 2 for a bad argument.
#pragma once
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

namespace mok::micro {

struct Tool {
  const char* name;

  void check(cudaError_t e, const char* what) const {
    if (e != cudaSuccess) {
      std::fprintf(stderr, "%s: %s: %s\n", name, what, cudaGetErrorString(e));
      std::exit(1);
    }
  }

  // `value` of `option`, a whole integer in [lo, hi].
  int parse(const char* option, const char* value, int lo, int hi) const {
    char* end = nullptr;
    const long v = std::strtol(value, &end, 10);
    if (end == value || *end != '\0' || v < lo || v > hi) {
      std::fprintf(stderr, "%s: %s = '%s': must be an integer in [%d, %d]\n", name, option, value, lo, hi);
      std::exit(2);
    }
    return static_cast<int>(v);
  }
};

}  // namespace mok::micro
