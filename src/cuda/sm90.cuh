// mok: Hopper (sm_90a) primitives in raw PTX: mbarriers, TMA tile loads, wgmma.
//
// Shared-memory tiles are K-major with the 128-byte swizzle: each row holds 64 bf16 of the
// contraction (128 bytes), rows grouped by 8 into 1024-byte swizzle atoms. TMA writes
// them in that layout (CU_TENSOR_MAP_SWIZZLE_128B) and wgmma reads them through matrix
// descriptors with the same swizzle, so no thread ever touches the operand tiles.
#pragma once
#include <cuda.h>
#include <cstdint>

#include "cuda/common.cuh"

namespace mok::cuda::sm90 {

__device__ __forceinline__ std::uint32_t smem_addr(const void* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}

// ---- mbarrier --------------------------------------------------------------------------
__device__ __forceinline__ void mbar_init(std::uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count));
}
// Ends an mbarrier's life, so that its shared memory may be used for something else.
__device__ __forceinline__ void mbar_inval(std::uint64_t* bar) {
  asm volatile("mbarrier.inval.shared::cta.b64 [%0];" ::"r"(smem_addr(bar)) : "memory");
}

__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

__device__ __forceinline__ void mbar_arrive_expect_tx(std::uint64_t* bar, std::uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void mbar_arrive(std::uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}

__device__ __forceinline__ bool mbar_try_wait(std::uint64_t* bar, std::uint32_t phase) {
  std::uint32_t ok;
  asm volatile(
      "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(ok)
      : "r"(smem_addr(bar)), "r"(phase)
      : "memory");
  return ok != 0;
}

// One try with acquire at cluster scope: for barriers the peer CTA of a pair arrives on.
__device__ __forceinline__ bool mbar_try_wait_cluster(std::uint64_t* bar, std::uint32_t phase) {
  std::uint32_t ok;
  asm volatile(
      "{\n .reg .pred p;\n mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n"
      " selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(ok)
      : "r"(smem_addr(bar)), "r"(phase)
      : "memory");
  return ok != 0;
}

// Phase waits with a deadline (common.cuh: PhaseWaitSite). `Limit` gives, only when a try
// has failed, the record to write and the limit in units of 2^20 ns (~1.05 ms): read from
// the kernel's parameters at that point, so a wait keeps just one 32-bit start time in
// registers (warpgroup 0 runs in 40: scripts/check_setmaxnreg.py).
struct PhaseWaitLimit {
  PhaseWaitTrap* record;   // host-mapped (nullptr: trap without a record)
  int* claim;              // device flag: the first thread to time out writes the record
  unsigned units;          // 0: no deadline
};

// A failed try: the first starts the clock (never 0: 0 means not started; unsigned
// differences survive the wrap after ~52 days); a later one past the limit claims the
// record, writes where it was and traps. The threads that lose the claim wait for the
// winner's trap, which ends the whole grid.
template <typename Limit>
__device__ __forceinline__ void phase_wait_tick(int site, unsigned& start, Limit limit) {
  const unsigned now = static_cast<unsigned>(globaltimer_ns() >> 20) | 1u;
  if (start == 0) {
    start = now;
    return;
  }
  const PhaseWaitLimit l = limit();
  if (l.units == 0 || now - start <= l.units) return;
  if (atomicCAS(l.claim, 0, 1) == 0) {
    if (l.record != nullptr) {
      volatile PhaseWaitTrap* t = l.record;
      t->block = static_cast<int>(blockIdx.x);
      t->thread = static_cast<int>(threadIdx.x);
      t->waited_ns = static_cast<long long>(now - start) << 20;
      // The host reads the other fields once it sees site != 0: they must be visible first.
      __threadfence_system();
      t->site = site;
      __threadfence_system();
    }
    asm volatile("trap;");
  }
  for (;;) __nanosleep(1 << 20);
}

template <typename Limit>
__device__ __forceinline__ void mbar_wait(std::uint64_t* bar, std::uint32_t phase, int site, Limit limit) {
  unsigned start = 0;
  while (!mbar_try_wait(bar, phase)) phase_wait_tick(site, start, limit);
}

template <typename Limit>
__device__ __forceinline__ void mbar_wait_cluster(std::uint64_t* bar, std::uint32_t phase, int site, Limit limit) {
  unsigned start = 0;
  while (!mbar_try_wait_cluster(bar, phase)) phase_wait_tick(site, start, limit);
}

// ---- TMA -------------------------------------------------------------------------------
// Orders this thread's later TMA reads of `map` (the tensormap proxy) after writes to it by
// the generic proxy anywhere in the system, a host copy included. A tensor map in global
// memory that the host rewrites between launches needs it before its first use in a kernel
// (CUDA Programming Guide, tensor maps in global memory: acquire at .sys scope after a host
// copy); without it TMA may read the map's earlier contents.
__device__ __forceinline__ void tensormap_acquire_after_host_write(const CUtensorMap* map) {
  asm volatile("fence.proxy.tensormap::generic.acquire.sys [%0], 128;" ::"l"(map) : "memory");
}

__device__ __forceinline__ void tma_prefetch_descriptor(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(map) : "memory");
}

// Loads the box at (inner = c0, outer = c1) of a 2D tensor into shared memory; completion
// is counted in bytes on `bar`. Out-of-bounds elements are filled with zero.
__device__ __forceinline__ void tma_load_2d(void* smem_dst, const CUtensorMap* map, std::uint64_t* bar, int c0,
                                            int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];" ::"r"(
          smem_addr(smem_dst)),
      "l"(map), "r"(smem_addr(bar)), "r"(c0), "r"(c1)
      : "memory");
}

// 16 bytes global -> shared through L2 (cp.async.cg), the bytes past `src_bytes` zero-filled
// (0: all zeros, nothing read). No "memory" clobber: the copy's bytes are read only by other
// threads after a barrier (whose own asm orders it), and without one the compiler may load
// what the next copies need (their addresses) ahead of this one.
__device__ __forceinline__ void cp_async_16(std::uint32_t smem_dst, const void* gmem_src, std::uint32_t src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_dst), "l"(gmem_src), "r"(src_bytes));
}

// Closes this thread's cp.async copies issued since the last commit into one group.
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

// Waits until at most N of this thread's committed cp.async groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait_group() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// An arrival on `bar` once this thread's earlier cp.async copies have landed, one of those the
// barrier's count expects (.noinc: it does not count itself in when issued).
__device__ __forceinline__ void cp_async_mbar_arrive_noinc(std::uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(smem_addr(bar)) : "memory");
}

// Shared -> global bulk copy (the TMA engine stores a whole row while threads move on).
__device__ __forceinline__ void bulk_store_s2g(void* gmem_dst, const void* smem_src, std::uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(gmem_dst), "r"(smem_addr(smem_src)),
               "r"(bytes)
               : "memory");
}
// Global -> shared bulk copy of `bytes` (a multiple of 16), completing on `bar` (expect_tx).
__device__ __forceinline__ void bulk_load_g2s(void* smem_dst, const void* gmem_src, std::uint32_t bytes,
                                              std::uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   smem_addr(smem_dst)),
               "l"(gmem_src), "r"(bytes), "r"(smem_addr(bar))
               : "memory");
}
// Waits until all but the N most recent bulk store groups of this thread have read shared memory.
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}
// Waits until all but the `pending` (1..8; more waits as for 8) most recent bulk store
// groups have read shared memory (the PTX takes the count as an immediate).
__device__ __forceinline__ void bulk_wait_read_but(int pending) {
  switch (pending) {
#define MOK_WAIT_READ_CASE(n) \
  case n:                     \
    bulk_wait_read<n>();      \
    break;
    MOK_WAIT_READ_CASE(1) MOK_WAIT_READ_CASE(2) MOK_WAIT_READ_CASE(3) MOK_WAIT_READ_CASE(4)
    MOK_WAIT_READ_CASE(5) MOK_WAIT_READ_CASE(6) MOK_WAIT_READ_CASE(7)
#undef MOK_WAIT_READ_CASE
    default:
      bulk_wait_read<8>();
  }
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// Waits until this thread's bulk stores have finished reading shared memory.
__device__ __forceinline__ void bulk_wait_read_all() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }
// Waits until this thread's bulk stores are complete (written to global memory).
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }
// Ordinary shared-memory writes -> visible to the async proxy (bulk copies, wgmma).
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// ---- wgmma -----------------------------------------------------------------------------
// Matrix descriptor for a K-major, 128B-swizzled tile: start address, stride between
// 8-row groups (SBO) = 1024 bytes, leading byte offset unused (1) with swizzling,
// layout type 1 = SWIZZLE_128B in bits 62-63. Tiles must be 1024-byte aligned.
__device__ __forceinline__ std::uint64_t make_smem_desc(const void* tile) {
  const std::uint64_t addr = smem_addr(tile);
  std::uint64_t desc = 0;
  desc |= (addr & 0x3ffff) >> 4;
  desc |= std::uint64_t(1) << 16;
  desc |= std::uint64_t(1024 >> 4) << 32;
  desc |= std::uint64_t(1) << 62;
  return desc;
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

// Keeps the compiler from moving accumulator reads/writes across wgmma boundaries.
template <int N>
__device__ __forceinline__ void fence_accumulators(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// D[64 x 256] (+)= A[64 x 16] * B[256 x 16]^T, bf16 in, fp32 accumulate; both from shared
// memory. scale_d = 0 overwrites D (first k-step of a tile).
__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], std::uint64_t desc_a, std::uint64_t desc_b,
                                                 int scale_d) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
      "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "
      "%128, %129, p, 1, 1, 0, 0;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
        "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
        "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]),
        "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]),
        "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]),
        "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

// Register budget hand-off between warpgroup roles (needs __launch_bounds__(.., 1)).
template <int Regs>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(Regs));
}
template <int Regs>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(Regs));
}

__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// ---- 2-CTA clusters (pair mode) --------------------------------------------------------
__device__ __forceinline__ std::uint32_t cluster_ctarank() {
  std::uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}

// The shared::cluster address of `local` (a shared-memory object of this CTA) in CTA `cta`.
__device__ __forceinline__ std::uint32_t peer_smem_addr(const void* local, std::uint32_t cta) {
  std::uint32_t out;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(out) : "r"(smem_addr(local)), "r"(cta));
  return out;
}

// Arrives on the mbarrier at `local`'s offset in CTA `cta` of the cluster (release, cluster scope).
__device__ __forceinline__ void mbar_arrive_cluster(std::uint64_t* local, std::uint32_t cta) {
  asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" ::"r"(peer_smem_addr(local, cta))
               : "memory");
}

// The same arrive with the default (CTA-scope) release: enough to say "I am done reading
// this stage or slot" (what CUTLASS's cluster barriers do), without the GPU-scope fence a
// cluster-scope release compiles to, which would cost every K step.
__device__ __forceinline__ void mbar_arrive_remote(std::uint64_t* local, std::uint32_t cta) {
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" ::"r"(peer_smem_addr(local, cta)) : "memory");
}

// Stores a 32-bit value at `local`'s offset in CTA `cta` of the cluster.
__device__ __forceinline__ void st_cluster_u32(volatile int* local, std::uint32_t cta, int value) {
  asm volatile("st.shared::cluster.u32 [%0], %1;" ::"r"(peer_smem_addr(const_cast<int*>(local), cta)), "r"(value)
               : "memory");
}

// Like tma_load_2d, but the box lands at the same shared-memory offset in every CTA of
// `cta_mask`, each CTA's barrier at `bar`'s offset counting the bytes it receives.
__device__ __forceinline__ void tma_load_2d_multicast(void* smem_dst, const CUtensorMap* map, std::uint64_t* bar,
                                                      int c0, int c1, std::uint16_t cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%3, %4}], [%2], %5;" ::"r"(smem_addr(smem_dst)),
      "l"(map), "r"(smem_addr(bar)), "r"(c0), "r"(c1), "h"(cta_mask)
      : "memory");
}

// Every thread of the cluster (arrive, then wait): no CTA leaves while its peer may still
// write into its shared memory or arrive on its barriers.
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release;\n\tbarrier.cluster.wait.acquire;" ::: "memory");
}

// The two halves of a cluster barrier, for every thread of the cluster: an arrival that orders
// nothing (here: "this CTA has started") and, later, the wait for every thread's arrival.
__device__ __forceinline__ void cluster_arrive_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire;" ::: "memory"); }

}  // namespace mok::cuda::sm90
