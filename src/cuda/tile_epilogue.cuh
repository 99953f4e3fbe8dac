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

// SwiGLU on the GPU: num::swiglu's clamp and formula with the hardware exp2 and reciprocal
// (two MUFU operations instead of expf's and an IEEE division's ~30 instructions, paid by
// the consumers between two tiles' wgmmas). The bf16 rounding that follows dwarfs the
// ~1e-6 relative difference; results stay deterministic (tests compare the GPU with the
// CPU reference within MoK's bar, and GPU runs with each other bit for bit).
__device__ __forceinline__ float swiglu_fast(float g, float u, float limit) {
  if (limit > 0.0f) {
    g = fminf(g, limit);
    u = fminf(fmaxf(u, -limit), limit);
  }
  // g -> -inf: exp overflows to inf and g / inf = -0 (the limit); NaN stays NaN.
  return __fdividef(g, 1.0f + __expf(-g)) * u;
}

// SwiGLU of a gate/up tile (gate in columns 0..127, up in 128..255 of the accumulator),
// rounded to bf16 into staging [128][kStagingPitch].
__device__ __forceinline__ void stage_swiglu(const float (&acc)[128], __nv_bfloat16* staging, int wg_row0,
                                             float limit) {
  const int t = threadIdx.x % 128, warp = t / 32, lane = t % 32;
  const int row = wg_row0 + 16 * warp + lane / 4;
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    const int col = 8 * j + 2 * (lane % 4);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float a0 = swiglu_fast(acc[4 * j + 2 * h], acc[64 + 4 * j + 2 * h], limit);
      const float a1 = swiglu_fast(acc[4 * j + 2 * h + 1], acc[64 + 4 * j + 2 * h + 1], limit);
      *reinterpret_cast<__nv_bfloat162*>(staging + (row + 8 * h) * kStagingPitch + col) =
          __floats2bfloat162_rn(a0, a1);
    }
  }
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
