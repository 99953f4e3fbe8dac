// mok: what the consumer warpgroups do with a finished accumulator tile.
//
// Accumulator layout of one m64nNk16 wgmma (per warpgroup, thread = 32*warp + lane):
// register 4j+c holds row 16*warp + lane/4 + 8*(c/2), column 8j + 2*(lane%4) + c%2.
// Tiles go through a padded shared-memory staging tile so that global stores are 16-byte
// chunks of whole rows (rows are scattered to their owners' combine slots).
#pragma once
#include <cuda_bf16.h>

#include "cuda/common.cuh"
#include "cuda/forward_types.h"
#include "cuda/sm90.cuh"
#include "numerics/numerics.h"

namespace mok::cuda {

constexpr int kConsumerThreads = 256;
constexpr int kConsumerBarrier = 1;  // named barrier id for the two consumer warpgroups

__device__ __forceinline__ void consumers_sync() { sm90::named_barrier_sync(kConsumerBarrier, kConsumerThreads); }

// SwiGLU on the GPU: num::swiglu's clamp and formula, g * sigmoid(g) * u, with the
// sigmoid's exponential on the SFU (ex2.approx.ftz) and its reciprocal either on the SFU
// (rcp.approx.ftz) or on the FMA pipe (a bit-trick guess refined by a cubic and a Newton
// step). Why both: the consumers run the SwiGLU between two tiles' wgmmas while the tensor
// cores wait, and with two MUFU operations per element the SFU (16 per clock per SM) bounds
// that gap, ~2k cycles per gate/up tile; moving half the reciprocals to the FMA pipe (32
// per clock per scheduler) balances the two pipes. Both reciprocals are within ~2e-8
// relative of 1/d, far below the bf16 rounding that follows (2^-9); results stay
// deterministic (tests compare the GPU with the CPU reference within MoK's bar, and GPU
// runs with each other bit for bit).
__device__ __forceinline__ float exp2_sfu(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float reciprocal_sfu(float d) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(d));
  return r;
}

// 1/d for d in [1, inf] without the SFU. d is clamped to 2^100 so that the guess stays a
// normal number (1/inf becomes 2^-100: g * 2^-100 is a silu of ~0 either way). The guess
// (0x7ef311c3 minus d's bits) is within 5.1% of 1/d; the cubic step r(1 + e + e^2) takes
// that to 1.3e-4 and the Newton step to ~2e-8.
__device__ __forceinline__ float reciprocal_fma(float d) {
  d = fminf(d, 0x1p100f);
  float r = __int_as_float(0x7ef311c3 - __float_as_int(d));
  float e = fmaf(-d, r, 1.0f);
  r = fmaf(r, fmaf(e, e, e), r);
  e = fmaf(-d, r, 1.0f);
  return fmaf(r, e, r);
}

// min and max that keep a NaN (one instruction each, like fminf and fmaxf, which return the
// other operand): the clamp must not turn a NaN gate or up value into the limit (num::swiglu).
__device__ __forceinline__ float min_keep_nan(float a, float b) {
  float r;
  asm("min.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
__device__ __forceinline__ float max_keep_nan(float a, float b) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

template <bool kReciprocalOnFma, bool kClamp>
__device__ __forceinline__ float swiglu_fast(float g, float u, float limit) {
  if (kClamp) {
    g = min_keep_nan(g, limit);
    u = min_keep_nan(max_keep_nan(u, -limit), limit);
  }
  // g -> -inf: the exponential overflows to inf and the sigmoid to 0 (2^-100 on the FMA
  // path), so silu -> -0 (the limit); a NaN g or u stays NaN through the products.
  const float d = 1.0f + exp2_sfu(g * -1.4426950408889634f);
  const float sigmoid = kReciprocalOnFma ? reciprocal_fma(d) : reciprocal_sfu(d);
  return g * sigmoid * u;
}

// SwiGLU of a gate/up tile (gate in columns 0..127, up in 128..255 of the accumulator),
// rounded to bf16 into staging [128][kStagingPitch]. The clamp is a template parameter:
// as a runtime test ptxas predicates its two min/max per element, 128 issue slots per
// thread and tile even when there is no limit.
template <bool kClamp>
__device__ __forceinline__ void stage_swiglu_tile(const float (&acc)[128], __nv_bfloat16* staging, int wg_row0,
                                                  float limit) {
  const int t = threadIdx.x % 128, warp = t / 32, lane = t % 32;
  const int row = wg_row0 + 16 * warp + lane / 4;
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    const int col = 8 * j + 2 * (lane % 4);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      // Column 2i on the SFU, 2i+1 on the FMA pipe: half the reciprocals each.
      const float a0 = swiglu_fast<false, kClamp>(acc[4 * j + 2 * h], acc[64 + 4 * j + 2 * h], limit);
      const float a1 = swiglu_fast<true, kClamp>(acc[4 * j + 2 * h + 1], acc[64 + 4 * j + 2 * h + 1], limit);
      *reinterpret_cast<__nv_bfloat162*>(staging + (row + 8 * h) * kStagingPitch + col) =
          __floats2bfloat162_rn(a0, a1);
    }
  }
}

__device__ __forceinline__ void stage_swiglu(const float (&acc)[128], __nv_bfloat16* staging, int wg_row0,
                                             float limit) {
  if (limit > 0.0f)
    stage_swiglu_tile<true>(acc, staging, wg_row0, limit);
  else
    stage_swiglu_tile<false>(acc, staging, wg_row0, limit);
}

// A down tile (256 columns), rounded to bf16 into staging.
__device__ __forceinline__ void stage_output(const float (&acc)[128], __nv_bfloat16* staging, int wg_row0) {
  const int t = threadIdx.x % 128, warp = t / 32, lane = t % 32;
  const int row = wg_row0 + 16 * warp + lane / 4;
#pragma unroll
  for (int j = 0; j < 32; ++j) {
    const int col = 8 * j + 2 * (lane % 4);
#pragma unroll
    for (int h = 0; h < 2; ++h)
      *reinterpret_cast<__nv_bfloat162*>(staging + (row + 8 * h) * kStagingPitch + col) =
          __floats2bfloat162_rn(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
  }
}

// Stores staging rows first, first + step, ... < 128 with bulk copies, row r to dst_row(r)
// (nullptr: skip), `cols` columns (a multiple of 8). Asynchronous: the calling thread waits
// for its copies' reads before the staging tile is written again, and for their writes
// before anyone is told the rows are there.
template <typename DstRow>
__device__ __forceinline__ void store_rows_async(const __nv_bfloat16* staging, int cols, int first, int step,
                                                 DstRow dst_row) {
  for (int r = first; r < kTileM; r += step) {
    __nv_bfloat16* dst = dst_row(r);
    if (dst != nullptr) sm90::bulk_store_s2g(dst, staging + r * kStagingPitch, static_cast<std::uint32_t>(cols) * 2);
  }
  sm90::bulk_commit();
}

// (Consumer-issued stores: consumer threads 0..127 each sent one row.)
__device__ __forceinline__ void staging_reusable() {
  if (threadIdx.x - 128 < kTileM) sm90::bulk_wait_read_all();
}

// The calling thread's rows are in global memory and visible to other SMs, including their
// TMA loads.
__device__ __forceinline__ void own_stores_visible() {
  sm90::bulk_wait_all();
  fence_proxy_async_global();
  __threadfence();
}

// (Consumer-issued stores.)
__device__ __forceinline__ void stores_complete() {
  if (threadIdx.x - 128 < kTileM) own_stores_visible();
}

}  // namespace mok::cuda
