// mok: the forward megakernel. One persistent launch per forward; every CTA takes a role:
//   blocks [0, num_comm_ctas)  communication: pull rows into the ring (dispatch.cuh);
//   the rest                   compute: warpgroup 0 produces TMA loads, warpgroups 1-2
//                              consume them with wgmma and run the tile epilogues, which
//                              write SwiGLU rows and push result rows into the owners'
//                              combine slots (tile_epilogue.cuh).
// Both roles walk one task order built on the device (schedule.cuh: plan). A task only
// waits for work earlier in that order, and every CTA is resident, so the lowest unfinished
// item can always progress: no deadlock, whatever the routing.
#pragma once
#include "cuda/dispatch.cuh"
#include "cuda/forward_types.h"
#include "cuda/sm90.cuh"
#include "cuda/tile_epilogue.cuh"

namespace mok::cuda {

// Where one task's operand tiles come from, and what it waits for.
struct TileJob {
  const CUtensorMap* a;
  const CUtensorMap* b0;
  const CUtensorMap* b1;  // up weights of a gate/up tile; nullptr for down tiles
  int a_row, b0_row, b1_row;
  int k_tiles;
  const int* wait_flag;  // nullptr: no wait
  int wait_target, wait_site;
};

__device__ __forceinline__ TileJob describe_task(const ForwardParams& p, Task task) {
  const int d = task.rank(), tile = task.row_tile(), n = task.col_tile(), s = task.shared();
  const RankMaps& m = p.maps[d];
  const RankPlan& plan = p.plans[d];
  TileJob j{};
  switch (task.kind()) {
    case kRoutedGateUp: {
      const int e = plan.block_expert[tile];
      j.a = &m.ring;
      j.a_row = (tile % p.ring_tiles) * kTileM;
      j.b0 = &m.w_gate;
      j.b1 = &m.w_up;
      j.b0_row = j.b1_row = e * p.inter + n * kGateUpCols;
      j.k_tiles = p.hidden / kTileK;
      j.wait_flag = plan.rows_ready + tile;
      j.wait_target = 1;
      j.wait_site = kWaitRowsReady;
      break;
    }
    case kRoutedDown: {
      const int e = plan.block_expert[tile];
      j.a = &m.act;
      j.a_row = (tile % p.ring_tiles) * kTileM;
      j.b0 = &m.w_down;
      j.b0_row = e * p.hidden + n * kDownCols;
      j.k_tiles = p.inter / kTileK;
      j.wait_flag = plan.act_ready + tile;
      j.wait_target = p.gateup_tiles;
      j.wait_site = kWaitActReady;
      break;
    }
    case kSharedGateUp: {
      j.a = &m.x_staged;
      j.a_row = tile * kTileM;
      j.b0 = &m.shared_w_gate[s];
      j.b1 = &m.shared_w_up[s];
      j.b0_row = j.b1_row = n * kGateUpCols;
      j.k_tiles = p.hidden / kTileK;
      break;
    }
    default: {  // kSharedDown
      j.a = &m.shared_act[s];
      j.a_row = tile * kTileM;
      j.b0 = &m.shared_w_down[s];
      j.b0_row = n * kDownCols;
      j.k_tiles = plan.shared[s].width / kTileK;
      j.wait_flag = plan.shared[s].act_ready + tile;
      j.wait_target = plan.shared[s].gateup_tiles;
      j.wait_site = kWaitActReady;
      break;
    }
  }
  return j;
}

constexpr int kTaskSlots = 4;

// A position in a ring of N mbarrier-guarded slots: the slot index and the parity of the
// barrier phase to wait for. Producer and consumers walk the same sequence.
template <int N>
struct RingPosition {
  int slot = 0;
  std::uint32_t phase = 0;
  __device__ __forceinline__ void advance() {
    if (++slot == N) {
      slot = 0;
      phase ^= 1;
    }
  }
};

struct ComputeSmem {
  __nv_bfloat16* a[kStages];  // [128][64] swizzled
  __nv_bfloat16* b[kStages];  // [256][64] swizzled (gate rows 0..127, up rows 128..255)
  __nv_bfloat16* staging;     // [128][kStagingPitch]
  std::uint64_t* full;        // [kStages] TMA landed
  std::uint64_t* empty;       // [kStages] both consumer warpgroups done with the stage
  std::uint64_t* task_full;   // [kTaskSlots] the producer claimed a task into the slot
  std::uint64_t* task_empty;  // [kTaskSlots] every consumer thread has read the slot
  volatile int* task_ring;    // [kTaskSlots] claimed task index, -1 = no more tasks
};

__device__ __forceinline__ ComputeSmem carve_smem(std::uint8_t* raw) {
  std::uint8_t* base = reinterpret_cast<std::uint8_t*>((reinterpret_cast<std::uintptr_t>(raw) + 1023) & ~std::uintptr_t(1023));
  ComputeSmem s;
  for (int i = 0; i < kStages; ++i) {
    s.a[i] = reinterpret_cast<__nv_bfloat16*>(base + i * kStageBytes);
    s.b[i] = reinterpret_cast<__nv_bfloat16*>(base + i * kStageBytes + kStageABytes);
  }
  s.staging = reinterpret_cast<__nv_bfloat16*>(base + kStages * kStageBytes);
  s.full = reinterpret_cast<std::uint64_t*>(base + kStages * kStageBytes + kStagingBytes);
  s.empty = s.full + kStages;
  s.task_full = s.empty + kStages;
  s.task_empty = s.task_full + kTaskSlots;
  s.task_ring = reinterpret_cast<volatile int*>(s.task_empty + kTaskSlots);
  return s;
}

// The producer claims tasks in order from one counter (a CTA that finishes early takes the
// next task: gate/up tiles cost 4x a down tile), hands each index to the consumers through
// a small ring, waits for the task's inputs and streams its operand tiles with TMA.
__device__ __forceinline__ void producer_loop(const ForwardParams& p, const ComputeSmem& sm, int num_tasks) {
  RingPosition<kStages> stage;
  RingPosition<kTaskSlots> tslot;
  bool aborted = false;
  for (;;) {
    sm90::mbar_wait(&sm.task_empty[tslot.slot], tslot.phase ^ 1);
    int idx = atomicAdd(p.task_counter, 1);
    if (idx >= num_tasks) idx = -1;
    sm.task_ring[tslot.slot] = idx;
    sm90::mbar_arrive(&sm.task_full[tslot.slot]);
    tslot.advance();
    if (idx < 0) break;
    const Task task = p.tasks[idx];
    const TileJob job = describe_task(p, task);
    if (!aborted && job.wait_flag != nullptr)
      aborted = !wait_at_least(job.wait_flag, job.wait_target, p.error, p.first_rank + task.rank(), job.wait_site,
                               task.row_tile(), p.timeout_ns);
    // Rows written by other SMs (generic stores or bulk copies) are about to be read by TMA.
    if (!aborted) fence_proxy_async_global();
    for (int kb = 0; kb < job.k_tiles; ++kb) {
      const int st = stage.slot;
      sm90::mbar_wait(&sm.empty[st], stage.phase ^ 1);
      if (aborted) {
        sm90::mbar_arrive(&sm.full[st]);  // keep the consumers moving; outputs are poisoned
      } else {
        sm90::mbar_arrive_expect_tx(&sm.full[st], kStageBytes);
        sm90::tma_load_2d(sm.a[st], job.a, &sm.full[st], kb * kTileK, job.a_row);
        sm90::tma_load_2d(sm.b[st], job.b0, &sm.full[st], kb * kTileK, job.b0_row);
        if (job.b1 != nullptr)
          sm90::tma_load_2d(sm.b[st] + kGateUpCols * kTileK, job.b1, &sm.full[st], kb * kTileK, job.b1_row);
      }
      stage.advance();
    }
  }
}

__device__ __forceinline__ void consumer_loop(const ForwardParams& p, const ComputeSmem& sm, float limit) {
  const int wg_idx = threadIdx.x / 128 - 1;  // which 64-row half of the tile
  const bool wg_leader = threadIdx.x % 128 == 0;
  const int ct = threadIdx.x - 128;           // consumer thread 0..255
  RingPosition<kStages> stage;
  RingPosition<kTaskSlots> tslot;
  float acc[128];
  for (;;) {
    sm90::mbar_wait(&sm.task_full[tslot.slot], tslot.phase);
    const int idx = sm.task_ring[tslot.slot];
    sm90::mbar_arrive(&sm.task_empty[tslot.slot]);
    tslot.advance();
    if (idx < 0) break;
    const Task task = p.tasks[idx];
    const TileJob job = describe_task(p, task);
#pragma unroll
    for (int r = 0; r < 128; ++r) acc[r] = 0.0f;
    int prev = 0;
    for (int kb = 0; kb < job.k_tiles; ++kb) {
      sm90::mbar_wait(&sm.full[stage.slot], stage.phase);
      sm90::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kTileK / 16; ++kk) {
        const std::uint64_t da = sm90::make_smem_desc(sm.a[stage.slot] + wg_idx * 64 * kTileK + kk * 16);
        const std::uint64_t db = sm90::make_smem_desc(sm.b[stage.slot] + kk * 16);
        sm90::wgmma_m64n256k16(acc, da, db, 1);
      }
      sm90::wgmma_commit();
      if (kb > 0) {
        sm90::wgmma_wait<1>();
        if (wg_leader) sm90::mbar_arrive(&sm.empty[prev]);
      }
      prev = stage.slot;
      stage.advance();
    }
    sm90::wgmma_wait<0>();
    if (wg_leader) sm90::mbar_arrive(&sm.empty[prev]);
    sm90::fence_accumulators(acc);

    // ---- epilogue: registers -> staging (bf16) -> bulk row stores ----
    const RankPlan& plan = p.plans[task.rank()];
    const int tile = task.row_tile(), n = task.col_tile();
    const bool gate_up = task.kind() == kRoutedGateUp || task.kind() == kSharedGateUp;
    staging_reusable();  // the previous task's row stores have read the staging tile
    consumers_sync();
    if (gate_up)
      stage_swiglu(acc, sm.staging, wg_idx * 64, limit);
    else
      stage_output(acc, sm.staging, wg_idx * 64);
    sm90::fence_proxy_async_shared();
    consumers_sync();
    int* signal = nullptr;
    switch (task.kind()) {
      case kRoutedGateUp: {
        __nv_bfloat16* act = plan.act + static_cast<long long>(tile % p.ring_tiles) * kTileM * p.inter + n * kGateUpCols;
        store_rows_async(sm.staging, min(kGateUpCols, p.inter - n * kGateUpCols),
                         [&](int r) { return act + static_cast<long long>(r) * p.inter; });
        signal = plan.act_ready + tile;
        break;
      }
      case kRoutedDown: {
        const int2* rows = plan.rows + static_cast<long long>(tile) * kTileM;
        store_rows_async(sm.staging, min(kDownCols, p.hidden - n * kDownCols), [&](int r) -> __nv_bfloat16* {
          const int2 row = rows[r];
          if (row.x < 0) return nullptr;  // padding row
          return p.combine_of[row.x] + static_cast<long long>(row.y) * p.hidden + n * kDownCols;
        });
        // Only a wrapping ring needs to know when a row tile is done.
        if (p.ring_wraps) signal = plan.down_done + tile;
        break;
      }
      case kSharedGateUp: {
        const SharedPlan& sp = plan.shared[task.shared()];
        store_rows_async(sm.staging, min(kGateUpCols, sp.width - n * kGateUpCols), [&](int r) -> __nv_bfloat16* {
          const int t = tile * kTileM + r;
          return t < p.tokens ? sp.act + static_cast<long long>(t) * sp.width + n * kGateUpCols : nullptr;
        });
        signal = sp.act_ready + tile;
        break;
      }
      default: {  // kSharedDown: read by the epilogue kernel after this launch
        const SharedPlan& sp = plan.shared[task.shared()];
        store_rows_async(sm.staging, min(kDownCols, p.hidden - n * kDownCols), [&](int r) -> __nv_bfloat16* {
          const int t = tile * kTileM + r;
          return t < p.tokens ? sp.out + static_cast<long long>(t) * p.hidden + n * kDownCols : nullptr;
        });
        break;
      }
    }
    if (signal != nullptr) {
      stores_complete();
      consumers_sync();
      if (ct == 0) red_release_gpu_add(signal, 1);
    }
  }
  staging_reusable();  // no bulk store may outlive the CTA's shared memory
}

__global__ void __launch_bounds__(kComputeThreads, 1) forward_megakernel(const __grid_constant__ ForwardParams p) {
  extern __shared__ std::uint8_t smem_raw[];
  if (static_cast<int>(blockIdx.x) < p.num_comm_ctas) {
    dispatch_role(p, smem_raw);
    return;
  }
  const ComputeSmem sm = carve_smem(smem_raw);
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      sm90::mbar_init(&sm.full[s], 1);
      sm90::mbar_init(&sm.empty[s], 2);
    }
    for (int s = 0; s < kTaskSlots; ++s) {
      sm90::mbar_init(&sm.task_full[s], 1);
      sm90::mbar_init(&sm.task_empty[s], kConsumerThreads);
    }
    sm90::fence_barrier_init();
  }
  __syncthreads();
  const int num_tasks = *p.num_tasks;
  if (threadIdx.x < 128) {
    sm90::setmaxnreg_dec<40>();
    if (threadIdx.x == 0) producer_loop(p, sm, num_tasks);
  } else {
    sm90::setmaxnreg_inc<232>();
    consumer_loop(p, sm, p.swiglu_limit);
  }
}

}  // namespace mok::cuda
