// mok: counter-based random numbers. Every value is a pure function of (seed, stream,
// index), computed with integer operations and exact float arithmetic only, so host and
// device produce the same bits and any split of the work gives the same numbers.
#pragma once
#include <cstdint>

#include "numerics/numerics.h"

namespace mok::rng {

enum Stream : std::uint64_t {
  kX = 1, kDy = 2, kGate = 3, kUp = 4, kDown = 5, kSharedGate = 6, kSharedUp = 7, kSharedDown = 8,
  kLogits = 9, kExpertChoice = 10, kHotPick = 11, kPermutation = 12,
};

MOK_HD std::uint64_t mix64(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

MOK_HD std::uint64_t hash(std::uint64_t seed, std::uint64_t stream, std::uint64_t index) {
  return mix64(mix64(seed * 0x100000001b3ull + stream) ^ index);
}

// Uniform in (0, 1), never 0 or 1: 23 random bits, so that v + 0.5 is exact in fp32 (with 24
// bits, 2^24 - 1 + 0.5 rounded to 2^24 and the draw was exactly 1: a zipf key of +inf, a
// hot:1.0 token missing its hot expert).
MOK_HD float unit_from_bits(std::uint64_t h) { return (static_cast<float>(h >> 41) + 0.5f) * (1.0f / 8388608.0f); }

MOK_HD float uniform(std::uint64_t seed, std::uint64_t stream, std::uint64_t index) {
  return unit_from_bits(hash(seed, stream, index));
}

// Approximately N(0,1): the sum of four 16-bit uniforms, centred and scaled to unit
// variance (Irwin-Hall; tails end at +-3.46). Every step is exact in fp32.
MOK_HD float normal(std::uint64_t seed, std::uint64_t stream, std::uint64_t index) {
  const std::uint64_t h = hash(seed, stream, index);
  const float sum = static_cast<float>((h & 0xffff) + ((h >> 16) & 0xffff) + ((h >> 32) & 0xffff) + (h >> 48));
  // (sum + 2) / 65536 - 2 is the centred sum of four uniforms on (0,1); variance 1/3.
  return ((sum + 2.0f) * (1.0f / 65536.0f) - 2.0f) * 1.7320508f;
}

}  // namespace mok::rng
