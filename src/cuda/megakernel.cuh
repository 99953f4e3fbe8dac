// mok: the forward megakernel. One persistent launch per forward; every CTA takes a role:
//   blocks [0, num_comm_ctas)  communication: pull rows into the ring (dispatch.cuh);
//   the rest                   compute: warpgroup 0 produces TMA loads, warpgroups 1-2
//                              consume them with wgmma and run the tile epilogues, which
//                              write SwiGLU rows and push result rows into the owners'
//                              combine slots (tile_epilogue.cuh).
// With head pulls (ForwardParams::head_pulls) every CTA first pulls tiles from the head of
// the pull list, claimed from a counter, and only then takes its role (dispatch.cuh).
// Both roles walk one task order built on the device (schedule.cuh: plan). A task only
// waits for work earlier in that order, and a compute CTA claims a task only once it runs,
// so the lowest unfinished item can always progress: no deadlock, whatever the routing.
// The launch is not cooperative: when another kernel holds SMs, part of the grid starts
// (the communication CTAs first: lowest indices) and works on while the rest waits for SMs.
#pragma once
#include "cuda/dispatch.cuh"
#include "cuda/forward_types.h"
#include "cuda/sm90.cuh"
#include "cuda/tile_epilogue.cuh"

namespace mok::cuda {

// Where one task's operand tiles come from, and what it waits for.
struct TileJob {
  const CUtensorMap* a;  // nullptr: the gather warps copy A (ForwardParams::gather_local)
  const CUtensorMap* b0;
  // B comes as two 128-row boxes: gate then up rows (gate/up tiles), or rows n*256 and
  // n*256 + 128 of the down weights (down tiles).
  const CUtensorMap* b1;
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
      const int e = task.expert();
      j.a = &m.ring;
      j.a_row = (tile % p.ring_tiles) * kTileM;
      j.b0 = &m.w_gate;
      j.b1 = &m.w_up;
      j.b0_row = j.b1_row = e * p.inter + n * kGateUpCols;
      j.k_tiles = p.hidden / kTileK;
      j.wait_flag = plan.rows_ready + tile;
      j.wait_target = 1;
      j.wait_site = kWaitRowsReady;
      if (p.gather_local) {  // the gather warps copy A and wait for what it needs (gather_loop)
        j.a = nullptr;
        j.wait_flag = nullptr;
      }
      break;
    }
    case kRoutedDown: {
      const int e = task.expert();
      j.a = &m.act;
      j.a_row = (tile % p.ring_tiles) * kTileM;
      j.b0 = j.b1 = &m.w_down;
      j.b0_row = e * p.hidden + n * kDownCols;
      j.b1_row = j.b0_row + kBHalfRows;
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
      j.b0 = j.b1 = &m.shared_w_down[s];
      j.b0_row = n * kDownCols;
      j.b1_row = j.b0_row + kBHalfRows;
      j.k_tiles = plan.shared[s].width / kTileK;
      j.wait_flag = plan.shared[s].act_ready + tile;
      j.wait_target = plan.shared[s].gateup_tiles;
      j.wait_site = kWaitSharedActReady;
      break;
    }
  }
  return j;
}

constexpr int kTaskSlots = 4;

// The barriers, the task ring and the store job fit the bytes kSmemBytes keeps for them.
static_assert((2 * kStages + 2 * kTaskSlots + 2) * 8 + 8 + kTaskSlots * 8 + kTaskSlots * 4 <=
                  kBarrierAreaBytes,
              "megakernel smem: barrier area");

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
  // Stage s: A [128][64] at stages + s*kStageBytes, then B [256][64] (gate rows 0..127, up
  // rows 128..255), both swizzled. Addressed arithmetically: an array of per-stage pointers
  // indexed by the running slot would live in local memory (a load per k step).
  std::uint8_t* stages;
  __device__ __forceinline__ __nv_bfloat16* a(int s) const {
    return reinterpret_cast<__nv_bfloat16*>(stages + s * kStageBytes);
  }
  __device__ __forceinline__ __nv_bfloat16* b(int s) const {
    return reinterpret_cast<__nv_bfloat16*>(stages + s * kStageBytes + kStageABytes);
  }
  __nv_bfloat16* staging;     // [128][kStagingPitch]
  std::uint64_t* full;        // [kStages] TMA landed
  std::uint64_t* empty;       // [kStages] both consumer warpgroups done with the stage
  std::uint64_t* task_full;   // [kTaskSlots] the producer claimed a task into the slot
  std::uint64_t* task_empty;  // [kTaskSlots] every consumer thread has read the slot
  // Store warp (ForwardParams::store_warp): the consumers hand a staged tile over...
  std::uint64_t* staging_full;   // [1] ...the staging tile holds store_job's rows
  std::uint64_t* staging_empty;  // [1] ...the store warp has read them (staging reusable)
  volatile std::uint64_t* store_job;  // [1] Task::bits of the staged tile, kNoStoreJob = stop
  // [kTaskSlots] outside pair mode, the claimed task itself (Task::bits), written with its
  // index by the producer, which has read it already: its readers need not fetch it from
  // global memory between two tiles.
  volatile std::uint64_t* task_bits;
  volatile int* task_ring;    // [kTaskSlots] claimed task index, -1 = no more tasks
  std::uint32_t* gather_offsets;  // [8][16] gather mode: the current gate/up tile's rows' byte offsets in x (gather_loop)
};

constexpr std::uint64_t kNoStoreJob = ~std::uint64_t(0);

__device__ __forceinline__ ComputeSmem carve_smem(std::uint8_t* raw) {
  std::uint8_t* base = align_shared(raw, 1024);  // the 128B-swizzle atoms are 1024 bytes
  ComputeSmem s;
  s.stages = base;
  s.staging = reinterpret_cast<__nv_bfloat16*>(base + kStages * kStageBytes);
  s.full = reinterpret_cast<std::uint64_t*>(base + kStages * kStageBytes + kStagingBytes);
  s.empty = s.full + kStages;
  s.task_full = s.empty + kStages;
  s.task_empty = s.task_full + kTaskSlots;
  s.staging_full = s.task_empty + kTaskSlots;
  s.staging_empty = s.staging_full + 1;
  s.store_job = s.staging_empty + 1;  // 8-byte aligned: it follows the 8-byte barriers
  s.task_bits = s.store_job + 1;
  s.task_ring = reinterpret_cast<volatile int*>(s.task_bits + kTaskSlots);
  s.gather_offsets = reinterpret_cast<std::uint32_t*>(reinterpret_cast<std::uint8_t*>(s.full) + kBarrierAreaBytes);
  return s;
}

// Pair mode (ForwardParams::pairs): compute CTAs run as 2-CTA clusters. Cluster rank 0 (the
// leader) claims pair j (tasks 2j, 2j+1 of the list, plan_order.h) and hands j to both CTAs'
// task rings; each CTA computes its task of the pair. The two walk their stage rings in
// lockstep (a pair's tasks have the same K depth), each stage being free only when both
// CTAs' consumers have released it, so when the pair's B tiles are the same (one weight
// tile, two row tiles) each CTA loads one 128-row half and multicasts it to both.
struct PairRole {
  bool on = false;
  std::uint32_t me = 0, peer = 0;
};

__device__ __forceinline__ PairRole pair_role(const ForwardParams& p) {
  PairRole r;
  if (p.pairs) {
    r.on = true;
    r.me = sm90::cluster_ctarank();
    r.peer = r.me ^ 1u;
  }
  return r;
}

__device__ __forceinline__ void wait_task_full(const ForwardParams& p, const PairRole& pr, std::uint64_t* bar,
                                               std::uint32_t phase) {
  if (pr.on)
    sm90::mbar_wait_cluster(bar, phase, kPhaseTaskClaimed, phase_limit(p));
  else
    sm90::mbar_wait(bar, phase, kPhaseTaskClaimed, phase_limit(p));
}

// The task of this CTA for claimed item `idx` (a task, or in pair mode a pair).
__device__ __forceinline__ Task item_task(const ForwardParams& p, const PairRole& pr, int idx) {
  return p.tasks[pr.on ? 2 * idx + static_cast<int>(pr.me) : idx];
}

// Where a finished tile's rows go: row r of task `task` (nullptr: a padding row, or a token
// past T), `cols` columns each; `signal` is raised by one once they are visible (nullptr:
// nobody waits for them inside this launch).
struct TileStore {
  int cols;
  int* signal;
};

__device__ __forceinline__ TileStore tile_store(const ForwardParams& p, Task task) {
  const RankPlan& plan = p.plans[task.rank()];
  const int tile = task.row_tile(), n = task.col_tile();
  switch (task.kind()) {
    case kRoutedGateUp:
      return {min(kGateUpCols, p.inter - n * kGateUpCols), plan.act_ready + tile};
    case kRoutedDown:  // only a wrapping ring needs to know when a row tile is done
      return {min(kDownCols, p.hidden - n * kDownCols), p.ring_wraps ? plan.down_done + tile : nullptr};
    case kSharedGateUp: {
      const SharedPlan& sp = plan.shared[task.shared()];
      return {min(kGateUpCols, sp.width - n * kGateUpCols), sp.act_ready + tile};
    }
    default:  // kSharedDown: read by the epilogue kernel after this launch
      return {min(kDownCols, p.hidden - n * kDownCols), nullptr};
  }
}

__device__ __forceinline__ __nv_bfloat16* tile_row_destination(const ForwardParams& p, Task task, int r) {
  const RankPlan& plan = p.plans[task.rank()];
  const int tile = task.row_tile(), n = task.col_tile();
  switch (task.kind()) {
    case kRoutedGateUp:  // SwiGLU rows into the ring slot of the row tile
      return plan.act + (static_cast<long long>(tile % p.ring_tiles) * kTileM + r) * p.inter + n * kGateUpCols;
    case kRoutedDown: {  // result rows into their owners' combine slots
      const int2 row = plan.rows[static_cast<long long>(tile) * kTileM + r];
      if (row.x < 0) return nullptr;  // padding row
      return p.combine_of[row.x] + static_cast<long long>(row.y) * p.hidden + n * kDownCols;
    }
    case kSharedGateUp: {
      const SharedPlan& sp = plan.shared[task.shared()];
      const int t = tile * kTileM + r;
      return t < p.tokens ? sp.act + static_cast<long long>(t) * sp.width + n * kGateUpCols : nullptr;
    }
    default: {  // kSharedDown
      const SharedPlan& sp = plan.shared[task.shared()];
      const int t = tile * kTileM + r;
      return t < p.tokens ? sp.out + static_cast<long long>(t) * p.hidden + n * kDownCols : nullptr;
    }
  }
}

// The store warp (warp 1 of warpgroup 0, ForwardParams::store_warp): sends each staged tile's
// rows with bulk copies (lane l: rows l, l + 32, ...), frees the staging tile as soon as they
// are read, and raises the tile's counter once they are visible, while the consumers already
// run the next tile's wgmmas. It waits only for the consumers' hand-over and for its own
// copies, so it can hold no other role back (and the counters it raises only wait for
// stores already issued: no deferral a later task could depend on).
__device__ __forceinline__ void store_loop(const ForwardParams& p, const ComputeSmem& sm) {
  const int lane = threadIdx.x % 32;
  std::uint32_t phase = 0;
  for (;;) {
    sm90::mbar_wait(sm.staging_full, phase, kPhaseStagingHandedOver, phase_limit(p));
    phase ^= 1;
    // Lane 0 alone reads the job and passes it on: the consumers rewrite it once lane 0 has
    // arrived on staging_empty, so no other lane's read may be pending by then.
    std::uint64_t bits = 0;
    if (lane == 0) bits = *sm.store_job;
    bits = __shfl_sync(0xffffffffu, bits, 0);
    if (bits == kNoStoreJob) break;
    const Task task{bits};
    if (task.phantom()) {  // (pair mode) nothing to send: hand the staging tile straight back
      if (lane == 0) sm90::mbar_arrive(sm.staging_empty);
      continue;
    }
    const TileStore st = tile_store(p, task);
#ifndef MOK_MEASURE_LEAVE_OUT_STORES  // (a measurement build, cmake/cuda.cmake)
    store_rows_async(sm.staging, st.cols, lane, 32, [&](int r) { return tile_row_destination(p, task, r); });
#endif
    sm90::bulk_wait_read_all();
    __syncwarp();
    if (lane == 0 && p.test_fault != kFaultLoseStagingRead) sm90::mbar_arrive(sm.staging_empty);
    if (st.signal != nullptr) {
      own_stores_visible();
      __syncwarp();
      if (lane == 0) red_release_gpu_add(st.signal, 1);
    }
  }
  sm90::bulk_wait_all();  // no bulk store may outlive the CTA's shared memory
}

// The producer claims tasks in order from one counter (a CTA that finishes early takes the
// next task: gate/up tiles cost 4x a down tile), hands each index to the consumers through
// a small ring, waits for the task's inputs and streams its operand tiles with TMA.
__device__ __forceinline__ void producer_loop(const ForwardParams& p, const ComputeSmem& sm, int num_tasks) {
  // This thread issues every TMA load of the CTA. The maps live in an argument slot that a
  // host copy rewrites when another tensor set takes it (backend.cu, call_args): acquire
  // every map a task may name before the first load.
  for (int d = 0; d < p.num_ranks; ++d) {
    const RankMaps& m = p.maps[d];
    for (const CUtensorMap* map : {&m.ring, &m.act, &m.x_staged, &m.w_gate, &m.w_up, &m.w_down})
      sm90::tensormap_acquire_after_host_write(map);
    for (int s = 0; s < p.num_shared; ++s)
      for (const CUtensorMap* map : {&m.shared_w_gate[s], &m.shared_w_up[s], &m.shared_w_down[s], &m.shared_act[s]})
        sm90::tensormap_acquire_after_host_write(map);
  }
  const PairRole pr = pair_role(p);
  const int num_items = pr.on ? num_tasks / 2 : num_tasks;
  RingPosition<kStages> stage;
  RingPosition<kTaskSlots> tslot;
  bool aborted = false;
  // Claims the next item and hands it to the task ring's readers (-1: no more). Outside pair
  // mode the task itself goes into the ring too (and into `claimed`, the producer's own copy),
  // so that the consumers, between two tiles, need not read it from global memory. (Claiming
  // one task ahead, during the current task's first stage, was slower: a claimed task waits
  // for the CTA to finish its current one, and the tasks that depend on it wait too.)
  auto claim = [&](Task& claimed) {
    int idx;
    if (!pr.on || pr.me == 0) {
      if (pr.on)  // (the peer's readers arrive too, from the other CTA)
        sm90::mbar_wait_cluster(&sm.task_empty[tslot.slot], tslot.phase ^ 1, kPhaseTaskSlotFree, phase_limit(p));
      else
        sm90::mbar_wait(&sm.task_empty[tslot.slot], tslot.phase ^ 1, kPhaseTaskSlotFree, phase_limit(p));
      idx = atomicAdd(p.task_counter, 1);
      if (idx >= num_items) idx = -1;
      if (!pr.on) {
        claimed = idx >= 0 ? p.tasks[idx] : Task{0};
        sm.task_bits[tslot.slot] = claimed.bits;
      }
      sm.task_ring[tslot.slot] = idx;
      if (pr.on) {
        sm90::st_cluster_u32(&sm.task_ring[tslot.slot], pr.peer, idx);
        sm90::mbar_arrive_cluster(&sm.task_full[tslot.slot], pr.peer);
      }
      sm90::mbar_arrive(&sm.task_full[tslot.slot]);
    } else {
      sm90::mbar_wait_cluster(&sm.task_full[tslot.slot], tslot.phase, kPhaseTaskClaimed, phase_limit(p));
      idx = sm.task_ring[tslot.slot];
      sm90::mbar_arrive_cluster(&sm.task_empty[tslot.slot], 0);  // the leader reuses the slot after this
    }
    tslot.advance();
    return idx;
  };
  Task claimed{0};
  for (int idx = claim(claimed); idx >= 0;) {
#ifdef MOK_MEASURE_PRODUCER_DELAY  // (a measurement build, cmake/cuda.cmake)
    for (const long long start = clock64(); clock64() - start < MOK_MEASURE_PRODUCER_DELAY;) {
    }
#endif
    const Task task = pr.on ? item_task(p, pr, idx) : claimed;
    const TileJob job = describe_task(p, task);
    const bool share_b = pr.on && task.same_weight_tile(p.tasks[2 * idx + static_cast<int>(pr.peer)]);
    if (!aborted && job.wait_flag != nullptr)
      aborted = !wait_at_least(job.wait_flag, job.wait_target, p.error, p.first_rank + task.rank(), job.wait_site,
                               task.row_tile(), p.timeout_ns);
    // Rows written by other SMs (generic stores or bulk copies) are about to be read by TMA.
    if (!aborted) fence_proxy_async_global();
    for (int kb = 0; kb < job.k_tiles; ++kb) {
      const int st = stage.slot;
      sm90::mbar_wait(&sm.empty[st], stage.phase ^ 1, kPhaseStageFree, phase_limit(p));
      if (aborted && !pr.on) {
        sm90::mbar_arrive(&sm.full[st]);  // keep the consumers moving; outputs are poisoned
      } else {
        // (A pair keeps loading after an abort, whatever the memory holds, so that its peer's
        // barriers still complete; the outputs are poisoned all the same.)
        // (No proxy fence here in gather mode, though the stage may have held rows the gather
        // warps copied: each copying thread fenced its own writes into the async proxy before
        // its arrival on the stage's full barrier, which the consumers' release of the stage,
        // waited for above, follows.)
        sm90::mbar_arrive_expect_tx(&sm.full[st], job.a != nullptr ? kStageBytes : kStageBBytes);
        if (job.a != nullptr) sm90::tma_load_2d(sm.a(st), job.a, &sm.full[st], kb * kTileK, job.a_row);
        if (share_b) {
          const bool second = pr.me == 1;
          sm90::tma_load_2d_multicast(sm.b(st) + (second ? kBHalfRows * kTileK : 0), second ? job.b1 : job.b0,
                                      &sm.full[st], kb * kTileK, second ? job.b1_row : job.b0_row, 0x3);
        } else {
          sm90::tma_load_2d(sm.b(st), job.b0, &sm.full[st], kb * kTileK, job.b0_row);
          sm90::tma_load_2d(sm.b(st) + kBHalfRows * kTileK, job.b1, &sm.full[st], kb * kTileK, job.b1_row);
        }
      }
      stage.advance();
    }
    idx = claim(claimed);
  }
}

// Gather mode (ForwardParams::gather_local: one rank, every routed row local): warps 2 and 3
// of warpgroup 0 (idle otherwise) copy each routed gate/up tile's A rows straight from x into
// the stages with 16-byte cp.async copies, so nothing is pulled into the row ring and no SM
// pulls; the producer loads only B for those tiles. (One TMA request per row costs ~20 SM
// clocks, far too slow; cp.async copies fed the wgmmas as fast as one 128-row box:
// mok_feed_rate, docs/PERFORMANCE.md.) The two warps follow every task, as the consumers do,
// and arrive on every stage's full barrier (its count is 1 + kGatherThreads in this mode):
// for a gathered tile once their own copies have landed, otherwise at once. A stage's copies
// are waited for one stage later (cp.async.wait_group 1: two stages in flight per thread) and
// fenced into the async proxy by the thread that copied them, which then arrives. Stage s
// arrives only after stage s + 1's wait for a free slot, which needs kStages >= 3: that slot's
// last stage, s + 1 - kStages <= s - 2, is freed once the consumers have stage s - 1, arrived.
// Thread t copies chunk t % 8 (16 bytes) of rows t / 8 + 8i, i < 16, all in the same swizzle
// row (r % 8 = t / 8: chunk c lands at r * 128 + ((c ^ r % 8) * 16)), reading the rows' byte
// offsets in x four at a time from a table in shared memory (thread t's sixteen side by side;
// 32-bit: the backend asks T * H * 2 < 2^32; kGatherPadding marks a padding row, copied as
// zeros), written once per tile.
constexpr int kGatherThreads = 64;
static_assert(kStages >= 3, "gather_loop arrives on a stage one stage late (see above)");
constexpr int kGatherRows = kTileM * 8 / kGatherThreads;  // rows per thread (a chunk of each)
constexpr int kGatherBarrier = 5;                          // named barrier of the two gather warps
constexpr std::uint32_t kGatherPadding = ~0u;              // the offset of a padding row

__device__ __forceinline__ void gather_loop(const ForwardParams& p, const ComputeSmem& sm) {
  const int t = threadIdx.x - 64;
  RingPosition<kStages> stage;
  RingPosition<kTaskSlots> tslot;
  for (;;) {
    sm90::mbar_wait(&sm.task_full[tslot.slot], tslot.phase, kPhaseTaskClaimed, phase_limit(p));
    const int idx = sm.task_ring[tslot.slot];
    const Task task{sm.task_bits[tslot.slot]};  // (gather mode is never pair mode)
    sm90::mbar_arrive(&sm.task_empty[tslot.slot]);
    tslot.advance();
    if (idx < 0) break;
    const TileJob job = describe_task(p, task);
    if (job.a != nullptr) {  // A comes by TMA: nothing to copy, an arrival on each of its stages
      for (int kb = 0; kb < job.k_tiles; ++kb) {
        sm90::mbar_wait(&sm.empty[stage.slot], stage.phase ^ 1, kPhaseStageFree, phase_limit(p));
        sm90::mbar_arrive(&sm.full[stage.slot]);
        stage.advance();
      }
      continue;
    }
    const int tile = task.row_tile();
    if (t == 0 && tile >= p.ring_tiles) {
      // The SwiGLU ring slot this tile's epilogue writes must be free, as a pull into a
      // wrapping ring waits. No stage of the tile completes before this thread's arrival, which
      // comes after the wait. A timeout is recorded and the copies go on (the outputs are
      // poisoned).
      wait_ring_slot_free(p, p.plans[0], p.first_rank, tile);
    }
    // The table is rewritten once both warps have issued the last tile's copies (which read it).
    sm90::named_barrier_sync(kGatherBarrier, kGatherThreads);
    const int2* rows = p.plans[0].rows + static_cast<long long>(tile) * kTileM;
    for (int r = t; r < kTileM; r += kGatherThreads) {  // row r at (r % 8) * 16 + r / 8
      const int2 row = rows[r];
      sm.gather_offsets[(r % 8) * kGatherRows + r / 8] =
          row.x < 0 ? kGatherPadding
                    : static_cast<std::uint32_t>(row.y / p.top_k) * static_cast<std::uint32_t>(p.hidden) * 2u;
    }
    const int chunk = t % 8, first = t / 8;
    sm90::named_barrier_sync(kGatherBarrier, kGatherThreads);
    const uint4* offsets = reinterpret_cast<const uint4*>(sm.gather_offsets + first * kGatherRows);
    int pending_stage = -1;  // the stage whose copies are issued and not yet arrived on
    for (int kb = 0; kb < job.k_tiles; ++kb) {
      const int st = stage.slot;
      sm90::mbar_wait(&sm.empty[st], stage.phase ^ 1, kPhaseStageFree, phase_limit(p));
      // (No proxy fence before these copies: the stage's earlier wgmma reads and TMA writes
      // are complete, waited for by its consumers before they released it; a fence would
      // also wait for this thread's copies still in flight.)
      const std::uint32_t dst = sm90::smem_addr(sm.a(st)) + first * (kTileK * 2) + ((chunk ^ first) << 4);
      const char* x_k = reinterpret_cast<const char*>(p.x_source[0]) + kb * (kTileK * 2) + chunk * 16;
#pragma unroll
      for (int q = 0; q < kGatherRows / 4; ++q) {
        const uint4 four = offsets[q];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const std::uint32_t offset = j == 0 ? four.x : j == 1 ? four.y : j == 2 ? four.z : four.w;
          const bool pad = offset == kGatherPadding;
          sm90::cp_async_16(dst + (4 * q + j) * 8 * (kTileK * 2), x_k + (pad ? 0u : offset), pad ? 0u : 16u);
        }
      }
      sm90::cp_async_commit();
      // The previous stage's copies (one group back) have landed: fenced into the async proxy
      // here, by their writer, so the consumers' wgmmas read them with no fence of their own
      // (64 threads fence instead of 256, off the consumers' path; the consumer-side fence of
      // 90d2b1c measured the same, docs/PERFORMANCE.md).
      if (pending_stage >= 0) {
        sm90::cp_async_wait_group<1>();
        sm90::fence_proxy_async_shared();
        sm90::mbar_arrive(&sm.full[pending_stage]);
      }
      pending_stage = st;
      stage.advance();
    }
    // The tile's last stage arrives before the next task's waits (the ring-free wait above may
    // wait for down tiles this CTA's consumers run after this tile).
    sm90::cp_async_wait_group<0>();
    sm90::fence_proxy_async_shared();
    sm90::mbar_arrive(&sm.full[pending_stage]);
  }
}

__device__ __forceinline__ void consumer_loop(const ForwardParams& p, const ComputeSmem& sm, float limit) {
  const int wg_idx = threadIdx.x / 128 - 1;  // which 64-row half of the tile
  const bool wg_leader = threadIdx.x % 128 == 0;
  const int ct = threadIdx.x - 128;           // consumer thread 0..255
  // (Pair facts are re-read where used, from the parameter bank and %cluster_ctarank, rather
  // than held in registers next to the 128 accumulators.)
  // A stage is released to both CTAs' producers in pair mode (either may multicast into it).
  auto release_stage = [&](int slot) {
    if (!wg_leader) return;
    sm90::mbar_arrive(&sm.empty[slot]);
    if (p.pairs) sm90::mbar_arrive_remote(&sm.empty[slot], sm90::cluster_ctarank() ^ 1u);
  };
  RingPosition<kStages> stage;
  RingPosition<kTaskSlots> tslot;
  bool staging_handed_over = false;  // store warp mode: a tile is with the store warp
  std::uint32_t staging_empty_phase = 0;
  float acc[128];
  for (;;) {
    wait_task_full(p, pair_role(p), &sm.task_full[tslot.slot], tslot.phase);
    const int idx = sm.task_ring[tslot.slot];
    const std::uint64_t bits = p.pairs ? 0 : sm.task_bits[tslot.slot];  // (read before the slot is given back)
    // The slot is reused by the claiming producer: the leader's, in pair mode, which rewrites
    // this CTA's copy through distributed shared memory once every reader arrived (a release
    // and an acquire at cluster scope order this read before that write; once per task).
    if (p.pairs && sm90::cluster_ctarank() != 0)
      sm90::mbar_arrive_cluster(&sm.task_empty[tslot.slot], 0);
    else
      sm90::mbar_arrive(&sm.task_empty[tslot.slot]);
    tslot.advance();
    if (idx < 0) break;
    const Task task = p.pairs ? item_task(p, pair_role(p), idx) : Task{bits};
    const TileJob job = describe_task(p, task);
#ifdef MOK_MEASURE_LEAVE_OUT_MMA  // (no wgmma writes them: zeroed as before, so the build reads no garbage)
#pragma unroll
    for (int r = 0; r < 128; ++r) acc[r] = 0.0f;
#endif
    // Rows 64..127 all padding (the plan's bit, ForwardParams::half_tiles): warpgroup 2 has
    // nothing to compute. (A vote, so the branch is warp-uniform to the compiler: wgmma must
    // not sit on a divergent path.)
    const bool idle = __all_sync(0xffffffffu, wg_idx == 1 && p.half_tiles && task.upper_half_padding());
    if (idle) {  // hand every stage straight back, once loaded (the producer may then reuse it)
      for (int kb = 0; kb < job.k_tiles; ++kb) {
        sm90::mbar_wait(&sm.full[stage.slot], stage.phase, kPhaseStageLoaded, phase_limit(p));
        release_stage(stage.slot);
        stage.advance();
      }
    } else {
      int prev = 0;
      for (int kb = 0; kb < job.k_tiles; ++kb) {
        sm90::mbar_wait(&sm.full[stage.slot], stage.phase, kPhaseStageLoaded, phase_limit(p));
        sm90::wgmma_fence();
#ifndef MOK_MEASURE_LEAVE_OUT_MMA  // (a measurement build, cmake/cuda.cmake)
#pragma unroll
        for (int kk = 0; kk < kTileK / 16; ++kk) {
          const std::uint64_t da = sm90::make_smem_desc(sm.a(stage.slot) + wg_idx * 64 * kTileK + kk * 16);
          const std::uint64_t db = sm90::make_smem_desc(sm.b(stage.slot) + kk * 16);
          // The task's first wgmma overwrites the accumulators (scale-d 0) instead of adding
          // to zeros: 64 zeroing instructions per thread and tile saved, issued between two
          // tiles' wgmmas, where the tensor cores wait. (Every task has k_tiles >= 1.)
          sm90::wgmma_m64n256k16(acc, da, db, kb > 0 || kk > 0 ? 1 : 0);
        }
#endif
        sm90::wgmma_commit();
        if (kb > 0) {
          sm90::wgmma_wait<1>();
          release_stage(prev);
        }
        prev = stage.slot;
        stage.advance();
      }
      sm90::wgmma_wait<0>();
      release_stage(prev);
    }
    sm90::fence_accumulators(acc);

    // ---- epilogue: registers -> staging (bf16) -> bulk row stores ----
    // Store warp mode: stage the tile, hand it to the store warp and start the next mainloop
    // at once. A phantom (pair mode, odd run) only kept its peer in lockstep: it is staged
    // nowhere but still handed over, as a job the store warp returns at once, so that the
    // store warp's wait for a hand-over never spans more than one task's input waits (skipping
    // it let a run of waits add up past the phase limit and trap, review).
    // Otherwise consumer threads 0..127 send a row each (MOK_STORE_WARP=0).
    const bool gate_up = task.kind() == kRoutedGateUp || task.kind() == kSharedGateUp;
    if (p.store_warp) {
      if (staging_handed_over) {  // the store warp has read the previous tile
        sm90::mbar_wait(sm.staging_empty, staging_empty_phase, kPhaseStagingRead, phase_limit(p));
        staging_empty_phase ^= 1;
      }
      if (task.phantom()) {
        // Every consumer thread past its staging_empty wait before the hand-over, as on the
        // tile path: the store warp answers a phantom at once, so a thread still before that
        // wait would find staging_empty two phases on, its parity the same, and wait for good.
        consumers_sync();
        if (ct == 0) {
          *sm.store_job = task.bits;
          sm90::mbar_arrive(sm.staging_full);
        }
        staging_handed_over = true;
        continue;
      }
    } else {
      staging_reusable();  // the previous task's row stores have read the staging tile
      consumers_sync();
    }
    // (An idle warpgroup leaves its half of the staging tile as it was: those rows are padding,
    // sent nowhere for down tiles and, for gate/up tiles, read only by the same row tile's
    // down tiles, whose warpgroup 2 is idle too.)
#ifdef MOK_MEASURE_LEAVE_OUT_STAGING  // (a measurement build, cmake/cuda.cmake)
    if (!idle) {
      // The accumulators are still read (summed), else ptxas deletes the wgmmas that fill them.
      float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma unroll
      for (int r = 0; r < 128; r += 4) { s0 += acc[r]; s1 += acc[r + 1]; s2 += acc[r + 2]; s3 += acc[r + 3]; }
      if (s0 + s1 + s2 + s3 == 1234.5f) sm.staging[ct] = __float2bfloat16_rn(s0);
    } else
#endif
    if (idle) {
      if (wg_leader && !task.phantom()) atomicAdd(p.plans[task.rank()].half_tile_tasks, 1);  // ScheduleStats, tests
    } else if (gate_up) {
      stage_swiglu(acc, sm.staging, wg_idx * 64, limit);
    } else {
      stage_output(acc, sm.staging, wg_idx * 64);
    }
    sm90::fence_proxy_async_shared();  // the bulk copies (async proxy) read what we wrote
    consumers_sync();
    if (p.store_warp) {
      if (ct == 0) {
        *sm.store_job = task.bits;
        sm90::mbar_arrive(sm.staging_full);
      }
      staging_handed_over = true;
      continue;
    }
    int* signal = nullptr;
    if (!task.phantom()) {
      const TileStore st = tile_store(p, task);
      if (ct < kTileM)
        store_rows_async(sm.staging, st.cols, ct, kTileM, [&](int r) { return tile_row_destination(p, task, r); });
      signal = st.signal;
    }
    if (signal != nullptr) {
      stores_complete();
      consumers_sync();
      if (ct == 0) red_release_gpu_add(signal, 1);
    }
  }
  if (p.store_warp) {
    // Stop the store warp once it has taken the last tile.
    if (staging_handed_over)
      sm90::mbar_wait(sm.staging_empty, staging_empty_phase, kPhaseStagingRead, phase_limit(p));
    if (ct == 0) {
      *sm.store_job = kNoStoreJob;
      sm90::mbar_arrive(sm.staging_full);
    }
    return;
  }
  // Every bulk store complete, as at the store warp's end: none may outlive the CTA's shared
  // memory, and the rows pushed into a peer GPU's slots are written before the kernel ends
  // (the group's barrier after it is what the peer's epilogue waits on).
  stores_complete();
}

__global__ void __launch_bounds__(kComputeThreads, 1) forward_megakernel(const __grid_constant__ ForwardParams p) {
  extern __shared__ std::uint8_t smem_raw[];
  if (static_cast<int>(blockIdx.x) < p.num_comm_ctas) {
    // A pair's joining communication CTAs write into each other's shared memory below, which
    // is allowed only once both have started: each arrives now and waits just before that
    // write (by then long done: the peer arrived before its pulls).
    if (p.pairs && p.comm_join) sm90::cluster_arrive_relaxed();
    if (p.comm_join && threadIdx.x == 0) atomicAdd(p.comm_started, 1);
    wait_previous_kernel();
    dispatch_role(p, smem_raw, true);
    if (!p.comm_join) return;
    // Every pull of this CTA is complete and its pipeline barriers are invalidated: it joins
    // the compute CTAs for the tasks still unclaimed (a late compute CTA is one that was not
    // resident at first: it claims a task only once it runs) -- but only if every
    // communication CTA has started: pulls are assigned statically, so a joined CTA could
    // wait on rows of one not yet resident, which would need this SM to start (review).
    // Thread 0 reads the count once and the barrier's reduction hands every thread the same
    // answer (a shared flag written before the barrier drew a racecheck report).
    bool all_comm_started =
        __syncthreads_or(threadIdx.x == 0 && *static_cast<volatile int*>(p.comm_started) == p.num_comm_ctas);
    if (p.pairs) {
      // A pair computes in lockstep, so both CTAs of the cluster join or neither: each tells
      // the other its answer (the two may have read the count at different times). Both are
      // communication CTAs: the count is even in pair mode and clusters are whole.
      __shared__ int s_peer_joins;
      sm90::cluster_wait();  // both CTAs have started (the arrival at entry)
      if (threadIdx.x == 0) sm90::st_cluster_u32(&s_peer_joins, sm90::cluster_ctarank() ^ 1u, all_comm_started);
      sm90::cluster_sync();  // the peer's answer is here (and no CTA leaves before its peer wrote)
      all_comm_started = __syncthreads_or(threadIdx.x == 0 && all_comm_started && s_peer_joins != 0);
    }
    if (!all_comm_started) return;
    if (threadIdx.x == 0) atomicAdd(p.comm_joined, 1);
  } else if (p.head_pulls > 0) {
    // A compute CTA first helps pull the head of the list (dispatch_role says why), in the
    // shared memory its stages take afterwards: every warp is done with it before the
    // barriers below are initialised.
    wait_previous_kernel();
    dispatch_role(p, smem_raw, false);
    __syncthreads();
  }
  const ComputeSmem sm = carve_smem(smem_raw);
  const PairRole pr = pair_role(p);
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      sm90::mbar_init(&sm.full[s], p.gather_local ? 1 + kGatherThreads : 1);  // (gather_loop says why)
      // Released by both consumer warpgroups, of both CTAs in pair mode.
      sm90::mbar_init(&sm.empty[s], pr.on ? 4 : 2);
    }
    for (int s = 0; s < kTaskSlots; ++s) {
      sm90::mbar_init(&sm.task_full[s], 1);
      // Read by every consumer thread; in pair mode the leader's slot is also read by the
      // peer's consumers and producer (the peer's own task_empty is not used).
      sm90::mbar_init(&sm.task_empty[s], pr.on ? 2 * kConsumerThreads + 1
                                         : kConsumerThreads + (p.gather_local ? kGatherThreads : 0));
    }
    sm90::mbar_init(sm.staging_full, 1);   // consumer thread 0, after both warpgroups staged
    sm90::mbar_init(sm.staging_empty, 1);  // store warp lane 0, after every lane's reads
    sm90::fence_barrier_init();
  }
  __syncthreads();
  if (pr.on) sm90::cluster_sync();  // the peer's barriers exist before anyone arrives on them
  // The schedule's rows, tasks and pulls (PDL: the set-up above overlapped it, except in a
  // CTA that waited already for its head pulls; a second wait returns at once).
  wait_previous_kernel();
  const int num_tasks = *p.num_tasks;
  if (threadIdx.x < 128) {
    sm90::setmaxnreg_dec<40>();
    if (threadIdx.x == 0)
      producer_loop(p, sm, num_tasks);
    else if (threadIdx.x / 32 == 1 && p.store_warp)
      store_loop(p, sm);
    else if (threadIdx.x >= 64 && p.gather_local)
      gather_loop(p, sm);
  } else {
    sm90::setmaxnreg_inc<232>();
    consumer_loop(p, sm, p.swiglu_limit);
  }
  // No CTA of a pair leaves while its peer may still multicast into it or arrive on it.
  // (p.pairs, re-read from the parameter bank: a predicate held across the roles spilled.)
  if (p.pairs) sm90::cluster_sync();
}

}  // namespace mok::cuda
