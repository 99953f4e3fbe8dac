#include "numerics/mxfp8.h"

#include <algorithm>
#include <cmath>

#include "mok/problem.h"
#include "numerics/numerics.h"

namespace mok::num {

void mx_quantize_block(const float* values, int n, std::uint8_t* elements, std::uint8_t* scale) {
  float amax = 0.0f;
  bool non_finite = false;
  for (int i = 0; i < n; ++i) {
    if (!std::isfinite(values[i])) non_finite = true;
    amax = std::max(amax, std::fabs(values[i]));
  }
  if (non_finite) {
    *scale = kE8m0Nan;
    for (int i = 0; i < n; ++i) elements[i] = kE4m3Nan | (std::signbit(values[i]) ? 0x80 : 0);
    return;
  }
  *scale = e8m0_scale_for_amax(amax);
  for (int i = 0; i < n; ++i) elements[i] = e4m3_encode_scaled(values[i], *scale);
}

void mx_roundtrip_rows(float* matrix, std::int64_t rows, std::int64_t cols) {
  std::uint8_t elements[kMxBlock];
  std::uint8_t scale;
  for (std::int64_t r = 0; r < rows; ++r) {
    float* row = matrix + r * cols;
    for (std::int64_t c = 0; c < cols; c += kMxBlock) {
      const int n = static_cast<int>(std::min<std::int64_t>(kMxBlock, cols - c));
      mx_quantize_block(row + c, n, elements, &scale);
      for (int i = 0; i < n; ++i) row[c + i] = mx_decode(elements[i], scale);
    }
  }
}

}  // namespace mok::num
