// mok: the CPU reference's one matrix primitive, with a fixed summation order.
//
// dot(a, b, K) is defined as: 8 lanes, lane l sums a[i]*b[i] for i = l, l+8, ... below
// K8 = K - K%8 in increasing i (each product rounded to fp32, then added: no FMA);
// the lanes combine as ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7)); the K%8 tail elements are
// then added in order. gemm_nt computes every C element with exactly this dot, so its
// results are bitwise independent of thread count, blocking and the machine's vector width.
#pragma once
#include <cstdint>

#include "reference/parallel.h"

namespace mok::ref {

float dot(const float* a, const float* b, std::int64_t K);

// C[m*ldc + n] = dot(A + m*lda, B + n*ldb, K) for m < M, n < N.
void gemm_nt(ThreadPool& pool, std::int64_t M, std::int64_t N, std::int64_t K, const float* A,
             std::int64_t lda, const float* B, std::int64_t ldb, float* C, std::int64_t ldc);

}  // namespace mok::ref
