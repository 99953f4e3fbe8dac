#include "core/compare.h"

#include <cmath>
#include <sstream>
#include <vector>

#include "mok/error.h"
#include "numerics/numerics.h"

namespace mok {

std::string Comparison::describe() const {
  std::ostringstream s;
  s.precision(4);
  s << "max_abs=" << max_abs << " rel=" << rel << " cos=" << std::fixed;
  s.precision(6);
  s << cosine;
  if (non_finite) s << " non_finite=" << non_finite;
  return s.str();
}

Comparison compare(const float* out, const float* ref, std::int64_t n) {
  Comparison c;
  c.count = n;
  double sum_diff = 0, sum_ref = 0, dot = 0, nout = 0, nref = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    const double o = out[i], r = ref[i];
    if (!std::isfinite(r) || !std::isfinite(o)) {
      // A NaN or Inf on either side never passes (a reference that overflowed or is poisoned
      // checks nothing), except the same infinity on both, which agree.
      if (!(std::isinf(r) && o == r)) ++c.non_finite;
      continue;
    }
    const double d = std::fabs(o - r);
    c.max_abs = std::max(c.max_abs, d);
    sum_diff += d;
    sum_ref += std::fabs(r);
    dot += o * r;
    nout += o * o;
    nref += r * r;
  }
  c.rel = sum_ref > 0 ? sum_diff / sum_ref : (sum_diff > 0 ? INFINITY : 0.0);
  c.cosine = (nout > 0 && nref > 0) ? dot / std::sqrt(nout * nref) : (nout == nref ? 1.0 : 0.0);
  return c;
}

Comparison compare(const HostTensor& out, const HostTensor& ref) {
  require(out.dtype() == ref.dtype() && out.shape() == ref.shape(),
          "compare: tensors differ in dtype or shape");
  const std::int64_t n = out.numel();
  if (out.dtype() == DType::f32) return compare(out.data<float>(), ref.data<float>(), n);
  require(out.dtype() == DType::bf16, "compare: only bf16 and f32 tensors");
  std::vector<float> o(n), r(n);
  for (std::int64_t i = 0; i < n; ++i) {
    o[i] = num::bf16_to_float(out.data<std::uint16_t>()[i]);
    r[i] = num::bf16_to_float(ref.data<std::uint16_t>()[i]);
  }
  return compare(o.data(), r.data(), n);
}

Tolerance mok_tolerance(Precision precision) {
  return precision == Precision::bf16 ? Tolerance{0.5, 0.01, 0.9999} : Tolerance{1.0, 0.1, 0.996};
}

}  // namespace mok
