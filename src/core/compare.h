// mok: comparing results against the reference, with MoK's metrics.
//   max_abs = max |out - ref|; rel = sum |out - ref| / sum |ref|; cosine of the two vectors.
// A NaN or Inf in `out` or `ref` is counted and never passes (the same infinity in both agrees).
#pragma once
#include <cstdint>
#include <string>

#include "mok/data.h"

namespace mok {

struct Comparison {
  double max_abs = 0, rel = 0, cosine = 1;
  std::int64_t non_finite = 0;  // elements NaN/Inf in out or ref (not the same infinity in both)
  std::int64_t count = 0;
  bool passes(double max_abs_bound, double rel_bound) const {
    return non_finite == 0 && max_abs <= max_abs_bound && rel <= rel_bound;
  }
  std::string describe() const;
};

// out and ref must have the same dtype (bf16 or f32) and shape.
Comparison compare(const HostTensor& out, const HostTensor& ref);
Comparison compare(const float* out, const float* ref, std::int64_t n);

// MoK's bars: bf16 (0.5, 0.01), mxfp8 (1.0, 0.1); gradient cosine 0.9999 / 0.996.
struct Tolerance {
  double max_abs, rel, grad_cosine;
};
Tolerance mok_tolerance(Precision precision);

}  // namespace mok
