// mok microbenchmarks (bench/micro): what their command lines and CUDA calls share. A
// benchmark has no caller to hand an error to, so a failure prints "<tool>: ..." and exits:
// 1 for a CUDA error, 2 for a bad argument.
#pragma once
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "mok_commit.h"  // MOK_GIT_COMMIT, MOK_GIT_DIRTY (generated at build time: CMakeLists.txt gives the micro tools its folder)

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

// The JSON fields that say where a run was made: `"gpu": "<name>", "commit": "<sha>[-dirty]"`
// (the build's commit, so a record names the code it timed).
inline std::string json_run_fields(const cudaDeviceProp& prop) {
  return "\"gpu\": \"" + std::string(prop.name) + "\", \"commit\": \"" + MOK_GIT_COMMIT + (MOK_GIT_DIRTY ? "-dirty" : "") +
         "\"";
}

}  // namespace mok::micro
