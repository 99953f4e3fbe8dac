// mok: scalar numerics shared by the CPU reference and the CUDA kernels (host+device).
//
// bf16: round-to-nearest-even from fp32, NaN kept quiet.
// MXFP8 (OCP MX v1.0): E4M3 elements (bias 7, no Inf, NaN = S.1111.111, max normal 448,
// subnormals m*2^-9), blocks of kMxBlock elements along the contraction dimension sharing
// one E8M0 scale (2^(bits-127), bits 0xFF = NaN).
// Scale choice (MoK's, not OCP's floor rule): the smallest power of two X with
// amax/X <= 448, so no element saturates unless X hits the E8M0 range limit [2^-127, 2^127].
// A block holding NaN or Inf gets the NaN scale; every element of it then decodes to NaN.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define MOK_HD __host__ __device__ __forceinline__
#else
#define MOK_HD inline
#endif

namespace mok::num {

MOK_HD std::uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}

MOK_HD float bits_float(std::uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

MOK_HD std::uint16_t bf16_from_float(float f) {
  std::uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>(u >> 16);
}

MOK_HD float bf16_to_float(std::uint16_t b) { return bits_float(std::uint32_t(b) << 16); }

MOK_HD float round_bf16(float f) { return bf16_to_float(bf16_from_float(f)); }

// ---- E4M3 ----------------------------------------------------------------------------
constexpr float kE4m3Max = 448.0f;
constexpr std::uint8_t kE4m3Nan = 0x7f;

// Encodes v (already divided by the block scale) with round-to-nearest-even, saturating
// finite values beyond 448 to +-448.
MOK_HD std::uint8_t e4m3_from_float(float v) {
  const std::uint8_t sign = (float_bits(v) >> 24) & 0x80u;
  float a = fabsf(v);
  if (!(a == a)) return sign | kE4m3Nan;
  if (a >= kE4m3Max) return sign | 0x7e;  // saturate (Inf included)
  if (a < 0.015625f) {                     // below 2^-6: subnormal, step 2^-9
    int m = static_cast<int>(rintf(a * 512.0f));  // exact scaling; 0..8
    return sign | static_cast<std::uint8_t>(m);   // m == 8 is the smallest normal, 0x08
  }
  int e;
  float f = frexpf(a, &e);        // a = f * 2^e, f in [0.5, 1)
  int m = static_cast<int>(rintf((f * 2.0f - 1.0f) * 8.0f));  // exact; 0..8
  int exp_field = e - 1 + 7;
  if (m == 8) { m = 0; ++exp_field; }
  // a < 448 keeps (exp_field, m) <= (15, 6): the NaN code is never produced here.
  return sign | static_cast<std::uint8_t>((exp_field << 3) | m);
}

MOK_HD float e4m3_to_float(std::uint8_t b) {
  const float sign = (b & 0x80u) ? -1.0f : 1.0f;
  const int e = (b >> 3) & 0xf, m = b & 7;
  if (e == 15 && m == 7) return bits_float(0x7fc00000u);
  if (e == 0) return sign * ldexpf(static_cast<float>(m), -9);
  return sign * ldexpf(1.0f + static_cast<float>(m) * 0.125f, e - 7);
}

// ---- E8M0 scales ---------------------------------------------------------------------
constexpr std::uint8_t kE8m0Nan = 0xff;

// The scale for a block whose largest magnitude is amax (finite, >= 0): bits of the
// smallest power of two X in [2^-127, 2^127] with amax / X <= 448.
MOK_HD std::uint8_t e8m0_scale_for_amax(float amax) {
  if (amax == 0.0f) return 0;  // 2^-127; every element encodes as zero
  int e;
  float f = frexpf(amax, &e);  // amax = f * 2^e; 448 = 0.875 * 2^9
  int p = e - 9 + (f > 0.875f ? 1 : 0);
  if (p < -127) p = -127;
  if (p > 127) p = 127;
  return static_cast<std::uint8_t>(p + 127);
}

MOK_HD float e8m0_to_float(std::uint8_t bits) {
  if (bits == kE8m0Nan) return bits_float(0x7fc00000u);
  return ldexpf(1.0f, int(bits) - 127);
}

// Element encode under a (non-NaN) scale: v * 2^-(bits-127), then E4M3.
MOK_HD std::uint8_t e4m3_encode_scaled(float v, std::uint8_t scale_bits) {
  return e4m3_from_float(ldexpf(v, 127 - int(scale_bits)));
}

MOK_HD float mx_decode(std::uint8_t element, std::uint8_t scale_bits) {
  if (scale_bits == kE8m0Nan) return bits_float(0x7fc00000u);
  return ldexpf(e4m3_to_float(element), int(scale_bits) - 127);
}

// SwiGLU with optional clamp (limit <= 0 means none): silu(min(g,L)) * clamp(u,-L,L).
// The clamp keeps a NaN a NaN, as PyTorch's clamp does (fminf/fmaxf would return the limit:
// a NaN in x gave a plausible y while its backward was NaN).
MOK_HD float swiglu(float g, float u, float limit) {
  if (limit > 0.0f) {
    g = g > limit ? limit : g;
    u = u > limit ? limit : (u < -limit ? -limit : u);
  }
  return g / (1.0f + expf(-g)) * u;
}

}  // namespace mok::num
