// mok: the communication role's dispatch mover. Pulls the rows of each row tile, in
// schedule order, from the source ranks' x buffers (peer memory on real EP groups) into
// the rank's ring buffer, zero-filling padding rows, then releases the tile's readiness
// flag. A ring slot is reused only after every down tile of its previous occupant is done.
#pragma once
#include "cuda/forward_types.h"

namespace mok::cuda {

__device__ __forceinline__ void copy_row(int4* __restrict__ dst, const int4* __restrict__ src, int chunks, int lane) {
  // Four independent 16-byte loads in flight per lane before the stores.
  int c = lane;
  for (; c + 96 < chunks; c += 128) {
    const int4 a = src[c], b = src[c + 32], d = src[c + 64], e = src[c + 96];
    dst[c] = a;
    dst[c + 32] = b;
    dst[c + 64] = d;
    dst[c + 96] = e;
  }
  for (; c < chunks; c += 32) dst[c] = src[c];
}

__device__ void dispatch_role(const ForwardParams& p) {
  __shared__ int s_ok;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  const int num_pulls = *p.num_pulls;
  const int chunks = p.hidden / 8;  // 16-byte chunks per row
  for (int i = blockIdx.x; i < num_pulls; i += p.num_comm_ctas) {
    const int2 pull = p.pulls[i];
    const RankPlan& plan = p.plans[pull.x];
    const int tile = pull.y;
    const int rank = p.first_rank + pull.x;
    if (threadIdx.x == 0) {
      s_ok = 1;
      if (tile >= p.ring_tiles)
        s_ok = wait_at_least(plan.down_done + tile - p.ring_tiles, p.down_tiles, p.error, rank, kWaitRingFree, tile,
                             p.timeout_ns);
    }
    __syncthreads();
    if (s_ok) {
      int4* ring = reinterpret_cast<int4*>(plan.ring + static_cast<long long>(tile % p.ring_tiles) * kTileM * p.hidden);
      for (int r = warp; r < kTileM; r += warps) {
        const int2 row = plan.rows[static_cast<long long>(tile) * kTileM + r];
        int4* dst = ring + static_cast<long long>(r) * chunks;
        if (row.x < 0) {
          for (int c = lane; c < chunks; c += 32) dst[c] = make_int4(0, 0, 0, 0);
        } else {
          const int4* src = reinterpret_cast<const int4*>(p.x_source[row.x] +
                                                          static_cast<long long>(row.y / p.top_k) * p.hidden);
          copy_row(dst, src, chunks, lane);
        }
      }
    }
    // The GEMM reads these rows through TMA (async proxy) on another SM.
    fence_proxy_async_global();
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) red_release_gpu_add(plan.rows_ready + tile, 1);
  }
}

}  // namespace mok::cuda
