// Scalar numerics: bf16 rounding, OCP E4M3 elements, E8M0 scales, MXFP8 blocks
// (src/numerics/numerics.h, src/numerics/mxfp8.h). Hand-checked vectors plus exhaustive
// comparisons against independent brute-force formulations. Everything here is exact:
// no tolerances, except the documented MXFP8 round-trip error bound (half an E4M3 ulp) and
// the SwiGLU values against libm's double-precision silu (1e-6).
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "core/numbers.h"
#include "mok/error.h"
#include "mok/problem.h"
#include "numerics/mxfp8.h"
#include "numerics/numerics.h"

namespace {

using namespace mok::num;

float f_of(std::uint32_t bits) { return bits_float(bits); }
const float kNaN = std::numeric_limits<float>::quiet_NaN();
const float kInf = std::numeric_limits<float>::infinity();

// ---- bf16 -----------------------------------------------------------------------------------

// Independent bf16 RNE: pick the nearer of the two bf16 neighbours in double, ties to the one
// with an even last bit. The neighbour above FLT_MAX is Inf, which IEEE treats as 2^128.
std::uint16_t bf16_brute(float f) {
  const std::uint32_t u = float_bits(f);
  const std::uint32_t lo = u & 0xffff0000u, hi = lo + 0x10000u;
  const double v = std::fabs(double(f));
  const double vlo = std::fabs(double(f_of(lo)));
  const double vhi = (hi & 0x7fffffffu) == 0x7f800000u ? std::ldexp(1.0, 128) : std::fabs(double(f_of(hi)));
  const double dlo = v - vlo, dhi = vhi - v;
  if (dlo < dhi) return std::uint16_t(lo >> 16);
  if (dhi < dlo) return std::uint16_t(hi >> 16);
  return ((lo >> 16) & 1u) ? std::uint16_t(hi >> 16) : std::uint16_t(lo >> 16);
}

TEST(Bf16, ExactValues) {
  EXPECT_EQ(bf16_from_float(1.0f), 0x3f80);
  EXPECT_EQ(bf16_from_float(-2.0f), 0xc000);
  EXPECT_EQ(bf16_from_float(0.0f), 0x0000);
  EXPECT_EQ(bf16_from_float(-0.0f), 0x8000);
  EXPECT_EQ(bf16_from_float(kInf), 0x7f80);
  EXPECT_EQ(bf16_from_float(-kInf), 0xff80);
  EXPECT_EQ(bf16_to_float(0x3fc0), 1.5f);
  EXPECT_TRUE(std::signbit(bf16_to_float(0x8000)));
}

TEST(Bf16, RoundsToNearestEvenWithTies) {
  // 1 + 2^-8 is halfway between 1 (0x3f80, even) and 1 + 2^-7 (0x3f81): to even, down.
  EXPECT_EQ(bf16_from_float(f_of(0x3f808000u)), 0x3f80);
  // 1 + 3*2^-8 is halfway between 0x3f81 (odd) and 0x3f82 (even): up.
  EXPECT_EQ(bf16_from_float(f_of(0x3f818000u)), 0x3f82);
  // Just above / below a tie.
  EXPECT_EQ(bf16_from_float(f_of(0x3f808001u)), 0x3f81);
  EXPECT_EQ(bf16_from_float(f_of(0x3f807fffu)), 0x3f80);
  EXPECT_EQ(bf16_from_float(f_of(0xbf808000u)), 0xbf80);  // negative tie, to even
  EXPECT_EQ(bf16_from_float(f_of(0xbf818000u)), 0xbf82);
  // Subnormal ties.
  EXPECT_EQ(bf16_from_float(f_of(0x00008000u)), 0x0000);
  EXPECT_EQ(bf16_from_float(f_of(0x00018000u)), 0x0002);
  // Rounding carries into the exponent; FLT_MAX rounds up to Inf (RNE overflow).
  EXPECT_EQ(bf16_from_float(f_of(0x3fffffffu)), 0x4000);
  EXPECT_EQ(bf16_from_float(FLT_MAX), 0x7f80);
  EXPECT_EQ(bf16_from_float(f_of(0x7f7f7fffu)), 0x7f7f);
  EXPECT_EQ(round_bf16(1.00390625f), 1.0f);  // 1 + 2^-8
}

TEST(Bf16, NaNStaysQuietNaN) {
  EXPECT_EQ(bf16_from_float(kNaN), 0x7fc0);
  // A NaN whose payload sits only in the low 16 bits must not truncate to Inf.
  const std::uint16_t s = bf16_from_float(f_of(0x7f800001u));
  EXPECT_TRUE(std::isnan(bf16_to_float(s)));
  EXPECT_EQ(s & 0x0040, 0x0040);  // quiet bit set
  const std::uint16_t n = bf16_from_float(f_of(0xff800001u));
  EXPECT_TRUE(std::isnan(bf16_to_float(n)));
  EXPECT_EQ(n & 0x8000, 0x8000);  // sign kept
  EXPECT_EQ(bf16_from_float(f_of(0x7fffffffu)), 0x7fff);
}

TEST(Bf16, MatchesBruteForceOnRandomAndStructuredBits) {
  std::mt19937 gen(12345);
  std::uniform_int_distribution<std::uint32_t> bits;
  int checked = 0;
  for (int i = 0; i < 2000000; ++i) {
    std::uint32_t u = bits(gen);
    if (i % 4 == 0) u = (u & 0xffff0000u) | 0x8000u;  // exact ties
    if (i % 4 == 1) u = (u & 0xffff0000u) | (0x7fffu + (i & 2));  // next to a tie
    const float f = f_of(u);
    if (std::isnan(f)) continue;
    ASSERT_EQ(bf16_from_float(f), bf16_brute(f)) << std::hex << "bits 0x" << u;
    ++checked;
  }
  EXPECT_GT(checked, 1900000);
}

// ---- E4M3 -----------------------------------------------------------------------------------

// Independent decode: sign, 4-bit exponent (bias 7), 3-bit mantissa, subnormals m/8 * 2^-6,
// S.1111.111 is NaN, no Inf.
double e4m3_formula(int code) {
  const int s = code >> 7, e = (code >> 3) & 15, m = code & 7;
  if (e == 15 && m == 7) return std::numeric_limits<double>::quiet_NaN();
  const double mag = e == 0 ? (m / 8.0) * std::pow(2.0, -6) : (1.0 + m / 8.0) * std::pow(2.0, e - 7);
  return s ? -mag : mag;
}

// Independent encode: the nearest of the 127 finite magnitudes (codes 0..0x7e), ties to the
// even code; anything beyond 448 is nearest to 448 (saturation).
std::uint8_t e4m3_brute(float v) {
  if (std::isnan(v)) return std::signbit(v) ? 0xff : 0x7f;
  const double a = std::fabs(double(v));
  int best = 0;
  double best_d = INFINITY;
  for (int c = 0; c <= 0x7e; ++c) {
    const double d = std::fabs(e4m3_formula(c) - a);
    if (d < best_d || (d == best_d && (c & 1) == 0)) {
      best = c;
      best_d = d;
    }
  }
  return std::uint8_t(best | (std::signbit(v) ? 0x80 : 0));
}

TEST(E4m3, DecodeAll256CodesMatchesFormula) {
  for (int c = 0; c < 256; ++c) {
    const double want = e4m3_formula(c);
    const float got = e4m3_to_float(std::uint8_t(c));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << "code " << c;
      EXPECT_TRUE(c == 0x7f || c == 0xff);
    } else {
      EXPECT_EQ(double(got), want) << "code " << c;
      EXPECT_EQ(std::signbit(got), c >= 0x80) << "code " << c;
    }
  }
  EXPECT_EQ(e4m3_to_float(0x7e), 448.0f);
  EXPECT_EQ(e4m3_to_float(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(e4m3_to_float(0x08), std::ldexp(1.0f, -6));
}

TEST(E4m3, EncodeDecodeRoundTripsEveryCode) {
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7f) == 0x7f) continue;
    EXPECT_EQ(e4m3_from_float(e4m3_to_float(std::uint8_t(c))), c) << "code " << c;
  }
}

TEST(E4m3, ExactValues) {
  EXPECT_EQ(e4m3_from_float(1.0f), 0x38);
  EXPECT_EQ(e4m3_from_float(1.5f), 0x3c);
  EXPECT_EQ(e4m3_from_float(2.0f), 0x40);
  EXPECT_EQ(e4m3_from_float(0.5f), 0x30);
  EXPECT_EQ(e4m3_from_float(-2.0f), 0xc0);
  EXPECT_EQ(e4m3_from_float(240.0f), 0x77);
  EXPECT_EQ(e4m3_from_float(256.0f), 0x78);
  EXPECT_EQ(e4m3_from_float(448.0f), 0x7e);  // max normal
  EXPECT_EQ(e4m3_from_float(-448.0f), 0xfe);
  EXPECT_EQ(e4m3_from_float(0.015625f), 0x08);  // 2^-6, smallest normal
}

TEST(E4m3, RoundsToNearestEvenWithTies) {
  EXPECT_EQ(e4m3_from_float(1.0625f), 0x38);   // halfway 1 (0x38) .. 1.125 (0x39): even
  EXPECT_EQ(e4m3_from_float(1.1875f), 0x3a);   // halfway 0x39 .. 0x3a: even
  EXPECT_EQ(e4m3_from_float(std::nextafter(1.0625f, 2.0f)), 0x39);
  EXPECT_EQ(e4m3_from_float(std::nextafter(1.1875f, 0.0f)), 0x39);
  EXPECT_EQ(e4m3_from_float(432.0f), 0x7e);    // halfway 416 (0x7d) .. 448 (0x7e): even
  EXPECT_EQ(e4m3_from_float(431.0f), 0x7d);
  EXPECT_EQ(e4m3_from_float(-1.0625f), 0xb8);
  EXPECT_EQ(e4m3_from_float(15.5f), 0x58);     // halfway 15 (0x57) .. 16 (0x58): even
}

TEST(E4m3, SaturatesBeyond448AndInf) {
  for (float v : {448.5f, 449.0f, 464.0f, 480.0f, 500.0f, 1e6f, FLT_MAX, kInf}) {
    EXPECT_EQ(e4m3_from_float(v), 0x7e) << v;
    EXPECT_EQ(e4m3_from_float(-v), 0xfe) << v;
  }
}

TEST(E4m3, ZeroNegativeZeroAndNaN) {
  EXPECT_EQ(e4m3_from_float(0.0f), 0x00);
  EXPECT_EQ(e4m3_from_float(-0.0f), 0x80);
  EXPECT_EQ(e4m3_from_float(kNaN), 0x7f);
  EXPECT_EQ(e4m3_from_float(-kNaN), 0xff);
  EXPECT_TRUE(std::isnan(e4m3_to_float(0x7f)));
  EXPECT_TRUE(std::isnan(e4m3_to_float(0xff)));
  EXPECT_EQ(e4m3_to_float(0x80), 0.0f);
  EXPECT_TRUE(std::signbit(e4m3_to_float(0x80)));
}

TEST(E4m3, Subnormals) {
  const float q = std::ldexp(1.0f, -9);
  EXPECT_EQ(e4m3_from_float(q), 0x01);
  EXPECT_EQ(e4m3_from_float(3 * q), 0x03);
  EXPECT_EQ(e4m3_from_float(7 * q), 0x07);
  EXPECT_EQ(e4m3_from_float(-7 * q), 0x87);
  EXPECT_EQ(e4m3_from_float(0.5f * q), 0x00);   // tie between 0 and 2^-9: even (0)
  EXPECT_EQ(e4m3_from_float(0.6f * q), 0x01);
  EXPECT_EQ(e4m3_from_float(1.5f * q), 0x02);   // tie between 1 and 2: even
  EXPECT_EQ(e4m3_from_float(2.5f * q), 0x02);   // tie between 2 and 3: even
  EXPECT_EQ(e4m3_from_float(7.5f * q), 0x08);   // tie 0x07 .. 0x08 (smallest normal): even
  EXPECT_EQ(e4m3_from_float(7.6f * q), 0x08);   // rounds up into the smallest normal
  EXPECT_EQ(e4m3_from_float(std::nextafter(0.015625f, 0.0f)), 0x08);
  EXPECT_EQ(e4m3_from_float(7.4f * q), 0x07);
  EXPECT_EQ(e4m3_from_float(1e-10f), 0x00);
  EXPECT_EQ(e4m3_from_float(-1e-10f), 0x80);
}

TEST(E4m3, EncodeMatchesBruteForceOnEveryBf16Value) {
  // Every bf16 bit pattern (all finite magnitudes, incl. subnormals, ties, saturation).
  for (std::uint32_t b = 0; b < 0x10000u; ++b) {
    const float v = bf16_to_float(std::uint16_t(b));
    if (std::isnan(v)) continue;
    ASSERT_EQ(e4m3_from_float(v), e4m3_brute(v)) << "value " << v;
  }
  // And random fp32 values in the interesting range.
  std::mt19937 gen(7);
  std::uniform_real_distribution<float> expo(-14.0f, 10.0f);
  for (int i = 0; i < 100000; ++i) {
    const float v = std::exp2(expo(gen)) * (i % 2 ? -1.0f : 1.0f);
    ASSERT_EQ(e4m3_from_float(v), e4m3_brute(v)) << "value " << v;
  }
}

// ---- E8M0 scales ----------------------------------------------------------------------------

TEST(E8m0, ScaleChoiceHandChecked) {
  EXPECT_EQ(e8m0_scale_for_amax(448.0f), 127);   // 2^0
  EXPECT_EQ(e8m0_scale_for_amax(449.0f), 128);   // 2^1
  EXPECT_EQ(e8m0_scale_for_amax(std::nextafter(448.0f, 1000.0f)), 128);
  EXPECT_EQ(e8m0_scale_for_amax(1.0f), 119);     // 2^-8: 1/2^-8 = 256 <= 448 < 512
  EXPECT_EQ(e8m0_scale_for_amax(0.0f), 0);
  EXPECT_EQ(e8m0_scale_for_amax(896.0f), 128);   // 896/2 = 448
  EXPECT_EQ(e8m0_scale_for_amax(897.0f), 129);
  EXPECT_EQ(e8m0_scale_for_amax(3.5f), 120);     // 3.5/2^-7 = 448
  EXPECT_EQ(e8m0_scale_for_amax(std::nextafter(3.5f, 4.0f)), 121);
  EXPECT_EQ(e8m0_to_float(127), 1.0f);
  EXPECT_EQ(e8m0_to_float(0), std::ldexp(1.0f, -127));
  EXPECT_EQ(e8m0_to_float(254), std::ldexp(1.0f, 127));
  EXPECT_TRUE(std::isnan(e8m0_to_float(0xff)));
}

TEST(E8m0, ScaleIsSmallestPowerOfTwoWithAmaxOverXAtMost448) {
  std::mt19937 gen(99);
  std::uniform_real_distribution<float> expo(-110.0f, 120.0f);
  for (int i = 0; i < 200000; ++i) {
    float amax = std::exp2(expo(gen));
    // Exact boundaries (i % 3 == 0) and the float just above one (i % 3 == 1), which needs
    // the next scale up.
    if (i % 3 != 2) amax = 448.0f * std::exp2(std::floor(expo(gen)));
    if (i % 3 == 1) amax = std::nextafter(amax, INFINITY);
    const int bits = e8m0_scale_for_amax(amax);
    ASSERT_GT(bits, 0);
    ASSERT_LT(bits, 255);
    const double X = std::ldexp(1.0, bits - 127);
    ASSERT_LE(double(amax) / X, 448.0) << amax;
    ASSERT_GT(double(amax) / (X / 2), 448.0) << amax;  // X/2 would not do: X is the smallest
  }
}

TEST(E8m0, ClampsAtTheRangeEnds) {
  // Low end: the smallest scale is 2^-127; amax below 448*2^-128 would want a smaller one.
  EXPECT_EQ(e8m0_scale_for_amax(448.0f * std::ldexp(1.0f, -127)), 0);  // exactly 2^-127
  EXPECT_EQ(e8m0_scale_for_amax(std::ldexp(1.0f, -140)), 0);           // clamped
  EXPECT_EQ(e8m0_scale_for_amax(std::numeric_limits<float>::denorm_min()), 0);
  EXPECT_EQ(e8m0_scale_for_amax(std::nextafter(448.0f * std::ldexp(1.0f, -127), 1.0f)), 1);
  // High end: the largest finite fp32 needs only 2^120 (FLT_MAX / 2^120 < 256), so the 2^127
  // clamp is never reached from a finite amax; FLT_MAX still encodes without saturating.
  EXPECT_EQ(e8m0_scale_for_amax(FLT_MAX), 247);
  EXPECT_EQ(e4m3_encode_scaled(FLT_MAX, 247), 0x78);  // FLT_MAX/2^120 = 256 - 2^-16 -> 256
  // Under a scale that is too small, elements saturate to +-448 (never Inf, never NaN).
  EXPECT_EQ(e4m3_encode_scaled(1000.0f, 127), 0x7e);
  EXPECT_EQ(e4m3_encode_scaled(-1e30f, 127), 0xfe);
  // Under the clamped smallest scale, tiny values lose precision (underflow), never saturate:
  // 2^-140 / 2^-127 = 2^-13 is below half the smallest subnormal (2^-10): zero.
  EXPECT_EQ(e4m3_encode_scaled(std::ldexp(1.0f, -140), 0), 0x00);
  EXPECT_EQ(e4m3_encode_scaled(std::ldexp(1.0f, -133), 0), 0x08);  // 2^-6
  EXPECT_EQ(mx_decode(0x08, 0), std::ldexp(1.0f, -133));
}

// ---- MXFP8 blocks -----------------------------------------------------------------------------

TEST(MxBlock, ScaleAndElementsFollowTheScalarRules) {
  float v[32];
  for (int i = 0; i < 32; ++i) v[i] = (i % 2 ? -1.0f : 1.0f) * (0.25f + 13.7f * float(i));  // amax 425
  v[5] = 449.0f;                                                                           // amax 449
  std::uint8_t el[32], scale = 0;
  mx_quantize_block(v, 32, el, &scale);
  EXPECT_EQ(scale, 128);  // 2^1: 449/2 <= 448
  for (int i = 0; i < 32; ++i) EXPECT_EQ(el[i], e4m3_from_float(v[i] / 2.0f)) << i;
  EXPECT_EQ(mx_decode(el[5], scale), 448.0f);  // 224.5 -> 224 (step 16 in [128,256)) -> *2
  for (int i = 0; i < 32; ++i) EXPECT_NE(el[i] & 0x7f, 0x7e) << "no element may saturate";

  v[5] = 448.0f;
  for (int i = 0; i < 32; ++i) v[i] = std::fmin(v[i], 448.0f);
  mx_quantize_block(v, 32, el, &scale);
  EXPECT_EQ(scale, 127);
  EXPECT_EQ(el[5], 0x7e);
  for (int i = 0; i < 32; ++i) EXPECT_EQ(el[i], e4m3_from_float(v[i])) << i;
}

TEST(MxBlock, AllZeroBlock) {
  float v[32] = {};
  v[3] = -0.0f;
  std::uint8_t el[32], scale = 77;
  mx_quantize_block(v, 32, el, &scale);
  EXPECT_EQ(scale, 0);
  for (int i = 0; i < 32; ++i) EXPECT_EQ(mx_decode(el[i], scale), 0.0f);
  EXPECT_EQ(el[3], 0x80);
}

TEST(MxBlock, NonFiniteGivesNaNScaleAndAllNaN) {
  for (float bad : {kNaN, kInf, -kInf}) {
    float v[32];
    for (int i = 0; i < 32; ++i) v[i] = 0.5f * float(i);
    v[17] = bad;
    std::uint8_t el[32], scale = 0;
    mx_quantize_block(v, 32, el, &scale);
    EXPECT_EQ(scale, 0xff);
    for (int i = 0; i < 32; ++i) EXPECT_TRUE(std::isnan(mx_decode(el[i], scale))) << i;
    std::vector<float> row(v, v + 32);
    mx_roundtrip_rows(row.data(), 1, 32);
    for (int i = 0; i < 32; ++i) EXPECT_TRUE(std::isnan(row[i])) << i;
  }
}

TEST(MxBlock, RoundTripRowsBlocksOf32PartialLastAndIndependentRows) {
  constexpr int rows = 3, cols = 70;  // blocks [0,32), [32,64), [64,70)
  std::mt19937 gen(3);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> m(rows * cols);
  for (auto& x : m) x = nd(gen);
  m[0 * cols + 3] = 1e4f;     // a huge value in row 0, block 0 only
  m[1 * cols + 40] = 1e-3f;   // row 1, block 1
  m[2 * cols + 66] = -3e5f;   // row 2, partial block
  std::vector<float> q = m;
  mx_roundtrip_rows(q.data(), rows, cols);
  for (int r = 0; r < rows; ++r)
    for (int c0 = 0; c0 < cols; c0 += 32) {
      const int n = std::min(32, cols - c0);
      std::uint8_t el[32], scale;
      mx_quantize_block(&m[r * cols + c0], n, el, &scale);
      float amax = 0;
      for (int i = 0; i < n; ++i) amax = std::fmax(amax, std::fabs(m[r * cols + c0 + i]));
      EXPECT_EQ(scale, e8m0_scale_for_amax(amax));
      const double X = e8m0_to_float(scale);
      for (int i = 0; i < n; ++i) {
        const float v = m[r * cols + c0 + i], got = q[r * cols + c0 + i];
        ASSERT_EQ(got, mx_decode(el[i], scale)) << r << "," << c0 + i;
        // Error bound: half an E4M3 ulp: 2^-4 relative for normals, 2^-10 * X below 2^-6 * X.
        ASSERT_LE(std::fabs(double(got) - v), std::max(std::ldexp(std::fabs(double(v)), -4), std::ldexp(X, -10)))
            << r << "," << c0 + i;
      }
    }
  // Block independence: row 0 block 1 is untouched by the huge value in block 0.
  for (int c = 32; c < 64; ++c)
    EXPECT_LE(std::fabs(q[c] - m[c]), std::ldexp(std::fabs(m[c]), -4) + 1e-6f) << c;
}

TEST(Swiglu, ClampAndPlain) {
  const auto silu = [](double g) { return g / (1.0 + std::exp(-g)); };
  EXPECT_NEAR(swiglu(0.7f, -1.3f, 0.0f), silu(0.7) * -1.3, 1e-6);
  EXPECT_NEAR(swiglu(2.0f, 3.0f, 1.0f), silu(1.0) * 1.0, 1e-6);      // gate and up clamped
  EXPECT_NEAR(swiglu(-5.0f, -3.0f, 1.0f), silu(-5.0) * -1.0, 1e-6);  // gate not clamped below
  EXPECT_NEAR(swiglu(0.5f, 0.25f, 1.0f), silu(0.5) * 0.25, 1e-6);
  // A NaN stays NaN through the clamp (fminf/fmaxf turned it into the limit).
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (const float limit : {0.0f, 1.0f}) {
    EXPECT_TRUE(std::isnan(swiglu(nan, 0.5f, limit))) << "limit " << limit;
    EXPECT_TRUE(std::isnan(swiglu(0.5f, nan, limit))) << "limit " << limit;
  }
}

// A double kept as a float: up to FLT_MAX plus half an ulp it rounds to a float (FLT_MAX at the
// top); beyond, and below the smallest subnormal's half, it is refused as written.
TEST(Numbers, ToFloatInRangeRefusesOnlyWhatCannotBeAFloat) {
  EXPECT_EQ(mok::to_float_in_range(3.4028235e38, "x"), FLT_MAX);  // (FLT_MAX as usually written)
  EXPECT_EQ(mok::to_float_in_range(-0x1.fffffep127, "x"), -FLT_MAX);
  EXPECT_EQ(mok::to_float_in_range(0x1.fffffefffffffp127, "x"), FLT_MAX);  // (just under the half ulp)
  EXPECT_EQ(mok::to_float_in_range(0.0, "x"), 0.0f);
  EXPECT_EQ(mok::to_float_in_range(1e-45, "x"), std::numeric_limits<float>::denorm_min());
  for (const double bad : {0x1.ffffffp127, 3.5e38, -1e300, 1e-50, -1e-50})
    try {
      mok::to_float_in_range(bad, "x");
      ADD_FAILURE() << bad << " was taken";
    } catch (const mok::Error& e) {
      EXPECT_NE(std::string(e.what()).find("is outside float's range"), std::string::npos) << e.what();
    }
}

// A decimal number double cannot hold is told apart: too large, or a nonzero magnitude below
// the smallest normal (a denormal, or one that would read as 0), and parse_finite's message
// says which, with the bound (stod's out_of_range said "out of range" for both).
TEST(Numbers, ReadDecimalTellsTooLargeFromTooSmall) {
  double v = 0;
  EXPECT_EQ(mok::read_decimal("1e308", v), mok::DecimalRead::ok);
  EXPECT_EQ(mok::read_decimal("2.2250738585072014e-308", v), mok::DecimalRead::ok);  // (the smallest normal)
  EXPECT_EQ(mok::read_decimal("0e-400", v), mok::DecimalRead::ok);
  EXPECT_EQ(v, 0.0);
  for (const char* large : {"1e400", "-1e309"}) EXPECT_EQ(mok::read_decimal(large, v), mok::DecimalRead::too_large) << large;
  for (const char* small : {"1e-310", "-4.9406564584124654e-324", "1e-400", "2.2250738585072e-308"})
    EXPECT_EQ(mok::read_decimal(small, v), mok::DecimalRead::too_small) << small;
  for (const char* junk : {"", " 1", "1 ", "0x10", "1e400x", "1e"})
    EXPECT_EQ(mok::read_decimal(junk, v), mok::DecimalRead::not_a_number) << "'" << junk << "'";
  auto message = [](const std::string& text) {
    try {
      mok::parse_finite(text, "x");
    } catch (const mok::Error& e) {
      return std::string(e.what());
    }
    return std::string("taken");
  };
  EXPECT_EQ(message("1e400"), "x: '1e400' is out of range (beyond double's largest magnitude, 1.7976931348623157e+308)");
  EXPECT_EQ(message("1e-310"),
            "x: '1e-310' is too small to read (a nonzero magnitude below double's smallest normal, "
            "2.2250738585072014e-308)");
  EXPECT_EQ(message("inf"), "x: must be a finite number, got 'inf'");
}

}  // namespace
