// mok: the kernels around the megakernel: staging x into the rank's symmetric buffer
// before it, and the fixed-order combine epilogue after it:
//   y[t] = bf16( sum_s shared_s[t] + sum_j w[t,j] * combine[t*k+j] ), fp32, shared experts
// first, then j in order, each product rounded then added (no FMA): the CPU's exact order,
// so y is bitwise the CPU reference's whenever the combine rows are.
#pragma once
#include <cuda_bf16.h>

#include "cuda/forward_types.h"

namespace mok::cuda {

struct CallRank {
  const __nv_bfloat16* x;       // [T, H] user input
  const float* router_weights;  // [T, k]
  __nv_bfloat16* y;             // [T, H] user output
};

struct EpilogueParams {
  int tokens, hidden, top_k, num_shared;
  const RankPlan* plans;   // [num_ranks]
  const CallRank* calls;   // [num_ranks]
  const DeviceError* error;
  // Real group: every rank's DeviceError, gathered by the group barrier (entry r: rank r's);
  // else nullptr.
  const DeviceError* group_errors;
  int group_size;
};

// grid (ceil(T*H/8 / 256), num_ranks), 256 threads; each thread one 8-column chunk.
__global__ void stage_x_kernel(const EpilogueParams p) {
  wait_previous_kernel();
  const int d = blockIdx.y;
  const long long chunks = static_cast<long long>(p.tokens) * p.hidden / 8;
  const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= chunks) return;
  reinterpret_cast<int4*>(p.plans[d].x_staged)[i] = reinterpret_cast<const int4*>(p.calls[d].x)[i];
}

// Combine rows one thread reads before its first add (see combine_epilogue_kernel).
constexpr int kEpilogueBatch = 8;

__global__ void __launch_bounds__(256, 4) combine_epilogue_kernel(const EpilogueParams p) {
  wait_previous_kernel();
  const int d = blockIdx.y;
  const int chunks_per_row = p.hidden / 8;
  const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= static_cast<long long>(p.tokens) * chunks_per_row) return;
  const long long t = i / chunks_per_row;
  const int c = static_cast<int>(i % chunks_per_row) * 8;
  const RankPlan& plan = p.plans[d];
  float acc[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) acc[e] = 0.0f;
  for (int s = 0; s < p.num_shared; ++s) {
    const int4 v = __ldcs(reinterpret_cast<const int4*>(plan.shared[s].out + t * p.hidden + c));
    const __nv_bfloat16* b = reinterpret_cast<const __nv_bfloat16*>(&v);
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] = __fadd_rn(acc[e], __bfloat162float(b[e]));
  }
  // The kernel is bound by HBM bandwidth (it reads k rows per output row once). Each batch
  // issues all its loads before the first add, so a thread has up to kEpilogueBatch 16-byte
  // loads in flight instead of one; the adds still run in j order (the bits do not change).
  const float* w = p.calls[d].router_weights + t * p.top_k;
  const __nv_bfloat16* slot = plan.combine + t * p.top_k * p.hidden + c;
  for (int j0 = 0; j0 < p.top_k; j0 += kEpilogueBatch) {
    int4 v[kEpilogueBatch];
    float wj[kEpilogueBatch];
#pragma unroll
    for (int b = 0; b < kEpilogueBatch; ++b) {
      if (j0 + b < p.top_k) {
        v[b] = __ldcs(reinterpret_cast<const int4*>(slot + static_cast<long long>(j0 + b) * p.hidden));
        wj[b] = __ldg(w + j0 + b);
      }
    }
#pragma unroll
    for (int b = 0; b < kEpilogueBatch; ++b) {
      if (j0 + b < p.top_k) {
        const __nv_bfloat16* h = reinterpret_cast<const __nv_bfloat16*>(&v[b]);
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[e] = __fadd_rn(acc[e], __fmul_rn(wj[b], __bfloat162float(h[e])));
      }
    }
  }
  // A failed forward (bad routing, capacity, timeout; here or, in a real group, on any rank:
  // its rows for these tokens may be missing) never returns plausible numbers.
  bool failed = p.error->code != kOk;
  if (p.group_errors != nullptr) {
    // Any rank's: the lanes of this warp still here (a prefix; those past the last chunk
    // returned) share the gathered codes and agree (here, after the loads, where few registers
    // are live: the kernel is at its 64-register bound).
    // (Recomputed from the parameters and indices, not kept live through the loads.)
    const int lane = threadIdx.x % 32;
    const long long left = static_cast<long long>(p.tokens) * (p.hidden / 8) -
                           (static_cast<long long>(blockIdx.x) * blockDim.x + (threadIdx.x - lane));
    const int here = left >= 32 ? 32 : static_cast<int>(left);
    int seen = 0;
    for (int r = lane; r < p.group_size; r += here) seen |= p.group_errors[r].code != kOk;
    failed |= __any_sync(here == 32 ? 0xffffffffu : (1u << here) - 1, seen) != 0;
  }
  int4 out;
  __nv_bfloat16* o = reinterpret_cast<__nv_bfloat16*>(&out);
#pragma unroll
  for (int e = 0; e < 8; ++e) o[e] = failed ? __float2bfloat16_rn(__int_as_float(0x7fc00000)) : __float2bfloat16_rn(acc[e]);
  *reinterpret_cast<int4*>(p.calls[d].y + t * p.hidden + c) = out;
}

}  // namespace mok::cuda
