#include "reference/gemm.h"

#include <algorithm>
#include <cstring>

namespace mok::ref {
namespace {

typedef float v8 __attribute__((vector_size(32)));

inline v8 load8(const float* p) {
  v8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline float combine_lanes(v8 acc) {
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

inline float finish(v8 acc, const float* a, const float* b, std::int64_t k8, std::int64_t K) {
  float s = combine_lanes(acc);
  for (std::int64_t i = k8; i < K; ++i) {
    const float p = a[i] * b[i];
    s = s + p;
  }
  return s;
}

// 2 rows of A against 4 rows of B: 8 independent dots sharing loads.
inline void micro_2x4(const float* a0, const float* a1, const float* b0, const float* b1,
                      const float* b2, const float* b3, std::int64_t K, float* c0, float* c1) {
  const std::int64_t k8 = K - K % 8;
  v8 acc[2][4] = {};
  for (std::int64_t i = 0; i < k8; i += 8) {
    const v8 x0 = load8(a0 + i), x1 = load8(a1 + i);
    v8 w = load8(b0 + i);
    acc[0][0] += x0 * w; acc[1][0] += x1 * w;
    w = load8(b1 + i);
    acc[0][1] += x0 * w; acc[1][1] += x1 * w;
    w = load8(b2 + i);
    acc[0][2] += x0 * w; acc[1][2] += x1 * w;
    w = load8(b3 + i);
    acc[0][3] += x0 * w; acc[1][3] += x1 * w;
  }
  const float* bs[4] = {b0, b1, b2, b3};
  for (int j = 0; j < 4; ++j) {
    c0[j] = finish(acc[0][j], a0, bs[j], k8, K);
    c1[j] = finish(acc[1][j], a1, bs[j], k8, K);
  }
}

}  // namespace

float dot(const float* a, const float* b, std::int64_t K) {
  const std::int64_t k8 = K - K % 8;
  v8 acc = {};
  for (std::int64_t i = 0; i < k8; i += 8) acc += load8(a + i) * load8(b + i);
  return finish(acc, a, b, k8, K);
}

void gemm_nt(ThreadPool& pool, std::int64_t M, std::int64_t N, std::int64_t K, const float* A,
             std::int64_t lda, const float* B, std::int64_t ldb, float* C, std::int64_t ldc) {
  if (M <= 0 || N <= 0) return;
  constexpr std::int64_t kBlockM = 32, kBlockN = 64;
  const std::int64_t blocks_m = (M + kBlockM - 1) / kBlockM, blocks_n = (N + kBlockN - 1) / kBlockN;
  pool.parallel_for(blocks_m * blocks_n, 1, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t blk = begin; blk < end; ++blk) {
      const std::int64_t m0 = (blk / blocks_n) * kBlockM, n0 = (blk % blocks_n) * kBlockN;
      const std::int64_t m1 = std::min(M, m0 + kBlockM), n1 = std::min(N, n0 + kBlockN);
      for (std::int64_t m = m0; m < m1; m += 2) {
        const bool pair = m + 1 < m1;
        const float* a0 = A + m * lda;
        const float* a1 = pair ? a0 + lda : a0;
        std::int64_t n = n0;
        for (; n + 4 <= n1; n += 4) {
          float c0[4], c1[4];
          micro_2x4(a0, a1, B + n * ldb, B + (n + 1) * ldb, B + (n + 2) * ldb, B + (n + 3) * ldb,
                    K, c0, c1);
          for (int j = 0; j < 4; ++j) {
            C[m * ldc + n + j] = c0[j];
            if (pair) C[(m + 1) * ldc + n + j] = c1[j];
          }
        }
        for (; n < n1; ++n) {
          C[m * ldc + n] = dot(a0, B + n * ldb, K);
          if (pair) C[(m + 1) * ldc + n] = dot(a1, B + n * ldb, K);
        }
      }
    }
  });
}

}  // namespace mok::ref
