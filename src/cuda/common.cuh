// mok: CUDA plumbing shared by the kernels: error checks, device-side failure reporting,
// synchronisation primitives that say their scope and memory order, and spin-waits that
// time out loudly instead of hanging.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "cuda/device_error.h"
#include "mok/error.h"

#define MOK_CUDA_CHECK(expr)                                                                    \
  do {                                                                                          \
    cudaError_t mok_err_ = (expr);                                                              \
    if (mok_err_ != cudaSuccess)                                                                \
      throw ::mok::Error(std::string("CUDA error: ") + cudaGetErrorString(mok_err_) + " in " + \
                         #expr + " at " + __FILE__ + ":" + std::to_string(__LINE__));           \
  } while (0)

namespace mok::cuda {

// A phase wait inside a CTA (an mbarrier: a stage, a task slot, the staging tile) that ran
// past the wait timeout. Such a wait only stalls while another role of its CTA is late, and
// those roles' own cross-CTA waits time out and drain; so this fires only when an arrival is
// lost for good (a bug, or a copy that never lands). The kernel cannot drain then: the
// waiting thread records where it was in host-mapped memory, which survives the trap it
// then executes, and Layer::synchronize names it.
enum PhaseWaitSite : int {
  kPhaseTaskSlotFree = 1,     // producer: the consumers to read a task slot
  kPhaseTaskClaimed = 2,      // consumers (and a pair's second producer): the next task
  kPhaseStageFree = 3,        // producer: the consumers to release a stage
  kPhaseStageLoaded = 4,      // consumers: a stage's TMA loads to land
  kPhaseStagingHandedOver = 5,  // store warp: the consumers' next staged tile
  kPhaseStagingRead = 6,      // consumers: the store warp to read the staging tile
  kPhasePullLoaded = 7,       // dispatch: a row pull's bulk loads to land
};

struct PhaseWaitTrap {
  int site;  // PhaseWaitSite; 0 = none
  int block, thread;
  int pad;
  long long waited_ns;
};

std::string describe_phase_wait_trap(const PhaseWaitTrap& t);

#if defined(__CUDACC__)

__device__ __forceinline__ void report_error(DeviceError* err, int code, int rank, int where, long long index,
                                             long long value) {
  if (atomicCAS(&err->code, 0, code) == 0) {
    err->rank = rank;
    err->where = where;
    err->index = index;
    err->value = value;
  }
  atomicExch(&err->abort, 1);
}

__device__ __forceinline__ int ld_acquire_gpu(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ int ld_volatile(const int* p) {
  int v;
  asm volatile("ld.volatile.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// A word the host writes while kernels run (host-mapped memory): system scope, never cached.
__device__ __forceinline__ int ld_relaxed_sys(const int* p) {
  int v;
  asm volatile("ld.relaxed.sys.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Release-add at GPU scope: every write this thread made (and, after a CTA barrier, its
// CTA made) is visible to whoever acquires the new value.
__device__ __forceinline__ void red_release_gpu_add(int* p, int v) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Generic-proxy writes -> later async-proxy (TMA) reads of global memory.
__device__ __forceinline__ void fence_proxy_async_global() {
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

// `raw` (dynamic shared memory) advanced to the next multiple of `align` bytes of the shared
// window. Derived from `raw` by pointer arithmetic, not through an integer, so the compiler
// still knows the result is shared memory (STS/LDS, not generic stores).
__device__ __forceinline__ std::uint8_t* align_shared(std::uint8_t* raw, unsigned align) {
  const unsigned offset = static_cast<unsigned>(__cvta_generic_to_shared(raw));
  return raw + ((align - offset % align) % align);
}

// Programmatic dependent launch (PDL). A kernel launched as a programmatic dependent of the
// previous kernel in its stream may start while that kernel drains; before it touches any
// memory that kernel reads or writes it must call wait_previous_kernel(), which returns once
// the previous grid has completed and its writes are visible (at once when the launch was an
// ordinary one). Completion is transitive: the previous kernel waited for its own predecessor.
// That holds only while every thread of every such kernel calls it before it can exit: no
// early return above the call.
__device__ __forceinline__ void wait_previous_kernel() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

// Lets the next kernel's CTAs launch now instead of as this grid's CTAs exit. Only for small
// grids that never wait on the next kernel (its CTAs then sit resident in their own wait).
__device__ __forceinline__ void allow_next_kernel_launch() { asm volatile("griddepcontrol.launch_dependents;"); }

__device__ __forceinline__ std::uint64_t globaltimer_ns() {
  std::uint64_t t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

// Spins until *flag >= target (acquire, GPU scope). Returns false (after recording where
// it was stuck) when `timeout_ns` passes, or at once when another role aborted.
__device__ __forceinline__ bool wait_at_least(const int* flag, int target, DeviceError* err, int rank, int where,
                                              long long item, std::uint64_t timeout_ns) {
  if (ld_acquire_gpu(flag) >= target) return true;
  const std::uint64_t start = globaltimer_ns();
  for (int spin = 0;; ++spin) {
    const int v = ld_acquire_gpu(flag);
    if (v >= target) return true;
    if ((spin & 63) == 63) {
      if (ld_volatile(&err->abort)) return false;
      if (globaltimer_ns() - start > timeout_ns) {
        // No printf here: a call in the kernel would serialise every wgmma (ptxas C7510).
        // The host reads this record in Layer::synchronize().
        report_error(err, kWaitTimeout, rank, where, item, v);
        return false;
      }
    }
    __nanosleep(64);
  }
}

#endif  // __CUDACC__

}  // namespace mok::cuda
