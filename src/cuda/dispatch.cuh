// mok: the dispatch mover, run by the communication CTAs (and, for the head of the pull
// list, by every CTA). Pulls the rows of each row tile, in schedule order, from the source
// ranks' x buffers (peer memory on real EP groups) into the rank's ring buffer,
// zero-filling padding rows, then releases the tile's readiness flag. A ring slot is reused
// only after every down tile of its previous occupant is done.
#pragma once
#include "cuda/forward_types.h"
#include "cuda/sm90.cuh"

namespace mok::cuda {

// The phase-wait limit of this forward, read from the parameters only when a wait is long.
struct ParamsPhaseLimit {
  const ForwardParams& p;
  __device__ __forceinline__ sm90::PhaseWaitLimit operator()() const {
    return {p.phase_trap, p.phase_trap_claim, p.phase_wait_units};
  }
};
__device__ __forceinline__ ParamsPhaseLimit phase_limit(const ForwardParams& p) { return {p}; }

// Rows move with bulk copies (global -> shared -> global, the TMA engine's work): one thread
// per pull warp issues a whole row per instruction, not bound by the instruction rate.
// (Plain 16-byte loads and stores were instruction-bound: ~22 GB/s per SM measured on the
// H200. A CTA moves ~30 GB/s this way, and more bytes in flight did not raise it:
// docs/PERFORMANCE.md, "Measured and not kept".)
// Past the head, a communication CTA pulls up to kMaxPullGroups row tiles at once, one per
// tile group of kPullWarps warps (ForwardParams::pull_groups): while one group starts a tile
// (row addresses, the first loads) or drains it (the last stores, the release), the others
// are in full flight. A head tile is pulled by all of the CTA's groups together.
constexpr int kPullWarps = 4;       // copy pipelines per tile group (a tile's rows split 4 ways)
constexpr int kMaxPullGroups = 3;   // tile groups per communication CTA: its 12 warps
constexpr int kMaxPullSlots = 16;   // row buffers per pipeline (mbarriers)
constexpr int kHeadPullBarrier = 4;  // named barrier of all pulling warps (1..3: the tile groups')
static_assert(kMaxPullGroups * kPullWarps * 32 <= kComputeThreads, "a pull warp per pipeline");

// Shared memory of one pipeline's row slots with `groups` tile groups (the communication
// CTA's dynamic shared memory, less alignment slack and the barriers, split among the
// pipelines, in 128-byte units).
__host__ __device__ constexpr std::size_t pull_pipeline_bytes(int groups) {
  return ((kSmemBytes - kGatherTableBytes - 128 - kMaxPullGroups * kPullWarps * kMaxPullSlots * sizeof(std::uint64_t)) /
          (groups * kPullWarps)) &
         ~std::size_t(127);
}

struct PullPipeline {
  std::uint8_t* slots;    // [slots][row_bytes]
  std::uint64_t* full;    // [slots] the row landed in shared memory
  int num_slots;
  std::uint32_t row_bytes;
  unsigned used = 0;      // rows this pipeline has loaded so far (slot and phase sequence)
};

// The source of row r of a tile: the token's x row, or a zero row for padding.
__device__ __forceinline__ const void* pull_source(const ForwardParams& p, const int2* rows, int r) {
  const int2 row = rows[r];
  return row.x < 0 ? static_cast<const void*>(p.zero_row)
                   : static_cast<const void*>(p.x_source[row.x] + static_cast<long long>(row.y / p.top_k) * p.hidden);
}

// The sources of rows first, first + step, ... (one per lane), staged in shared memory so
// the issuing thread never waits on a dependent global load per row: serial address loads
// (~1 us each) were what bounded dispatch at ~20 GB/s per SM on the H200.
static_assert(kTileM / kPullWarps <= 32, "one row per lane of a pull warp");
__device__ __forceinline__ void stage_sources(const ForwardParams& p, const int2* rows, int first, int step,
                                              const void** sources) {
  const int lane = threadIdx.x % 32;
  const int r = first + lane * step;
  if (r < kTileM) sources[lane] = pull_source(p, rows, r);
  __syncwarp();
}

// Rows first, first + step, ... of the tile into the ring. A bulk store holds its slot until
// it has read it (about as long as a load takes), so half the slots are loads in flight and
// half are stores still reading. Returns when every store is complete.
__device__ __forceinline__ void pull_rows(const ForwardParams& p, PullPipeline& pl, const void* const* sources,
                                          std::uint8_t* ring_tile, int first, int step) {
  const int n = (kTileM - first + step - 1) / step;
  const int S = pl.num_slots;
  // Loads issued ahead of the store being issued (MOK_PULL_AHEAD, a tuning knob; default
  // half the slots) and stores allowed to be still reading their slots (>= 1).
  const int ahead = p.pull_ahead > 0 ? min(p.pull_ahead, S - 1) : max(1, S / 2);
  const int pending = min(8, S - ahead);
  auto load = [&](int j) {
    const unsigned u = pl.used + j;
    const int slot = static_cast<int>(u % S);
    sm90::mbar_arrive_expect_tx(&pl.full[slot], pl.row_bytes);
    sm90::bulk_load_g2s(pl.slots + static_cast<std::size_t>(slot) * pl.row_bytes, sources[j], pl.row_bytes,
                        &pl.full[slot]);
  };
  for (int j = 0; j < min(ahead, n); ++j) load(j);
  for (int i = 0; i < n; ++i) {
    const unsigned u = pl.used + i;
    const int slot = static_cast<int>(u % S);
    sm90::mbar_wait(&pl.full[slot], (u / S) & 1, kPhasePullLoaded, phase_limit(p));
    sm90::bulk_store_s2g(ring_tile + static_cast<std::size_t>(first + i * step) * pl.row_bytes,
                         pl.slots + static_cast<std::size_t>(slot) * pl.row_bytes, pl.row_bytes);
    sm90::bulk_commit();
    // Row j reuses the slot of row j - S <= i - pending, whose store has then read it.
    const int j = i + ahead;
    if (j < n) {
      sm90::bulk_wait_read_but(pending);
      load(j);
    }
  }
  pl.used += n;
  sm90::bulk_wait_all();
}

// Waits until row tile `tile`'s ring slot is free, when the ring wraps (tile >= ring_tiles):
// every down tile of its previous occupant, tile - ring_tiles, done. Those tiles read the slot
// by TMA (async proxy) on other SMs; the fence orders their reads, acquired here, before this
// CTA's writes into it. False after a timeout (recorded in p.error). Both writers of a slot
// wait here: the pulls (its rows) and the gather warps (megakernel.cuh: the SwiGLU rows their
// tile's epilogue writes, ForwardParams::gather_local).
__device__ __forceinline__ bool wait_ring_slot_free(const ForwardParams& p, const RankPlan& plan, int rank, int tile) {
  const bool ok = wait_at_least(plan.down_done + tile - p.ring_tiles, p.down_tiles, p.error, rank, kWaitRingFree,
                                tile, p.timeout_ns);
  fence_proxy_async_global();
  return ok;
}

// Pulls row tiles into the ring. Every CTA runs this at its start: first the head of the
// pull list (ForwardParams::head_pulls), claimed one tile at a time from a counter, each
// tile by all of the CTA's pipelines; then, communication CTAs only (`communication`), the
// rest of the list, each tile group its own tiles, statically. Compute CTAs return after
// the head and reuse this shared memory.
// Why a head: with the pulls shared among the communication CTAs alone, their first G*C
// tiles land together, 30-35 us into the forward (a group moves ~15 GB/s), and every compute
// CTA waits for them (Qwen3-30B: 2.9% of the megakernel's time in its producers' input
// waits). All CTAs together land one tile each (132 on the H200) in about that time, ~31 us,
// and the communication CTAs have that many tiles fewer to pull before they join the
// compute. (With shared experts the compute CTAs start on shared tiles meanwhile, and a head
// only delays those: by default there are as many head pulls as CTAs that find no shared
// gate/up tile in the first group, plan_order.h: default_head_pulls.)
__device__ void dispatch_role(const ForwardParams& p, std::uint8_t* smem_raw, bool communication) {
  __shared__ int s_ok[kMaxPullGroups];
  __shared__ int s_head;
  __shared__ const void* s_sources[kMaxPullGroups * kPullWarps][32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int groups = p.pull_groups;
  const int group = warp / kPullWarps, pipe = warp % kPullWarps;
  const int num_pulls = *p.num_pulls;
  const int head = min(num_pulls, p.head_pulls);
  const std::uint32_t row_bytes = static_cast<std::uint32_t>(p.hidden) * 2;
  // Shared memory: the mbarriers of every possible pipeline, then each pipeline's row slots.
  std::uint8_t* base = align_shared(smem_raw, 128);
  auto* bars = reinterpret_cast<std::uint64_t*>(base);
  std::uint8_t* buffers = base + kMaxPullGroups * kPullWarps * kMaxPullSlots * sizeof(std::uint64_t);
  const std::size_t per_pipeline = pull_pipeline_bytes(groups);
  const int slots = min(kMaxPullSlots, static_cast<int>(per_pipeline / row_bytes));  // >= 2: checked on the host
  PullPipeline pl{buffers + warp * per_pipeline, bars + warp * kMaxPullSlots, slots, row_bytes};
  if (group < groups && lane == 0) {
    for (int s = 0; s < slots; ++s) sm90::mbar_init(&pl.full[s], 1);
    sm90::fence_barrier_init();
  }
  __syncthreads();
  if (group >= groups) return;  // warps beyond the tile groups have no pipeline
  // From here a tile group synchronises only its own warps (named barrier 1 + group), and the
  // head's whole-CTA work all pulling warps (named barrier kHeadPullBarrier).
  const int pulling_threads = groups * kPullWarps * 32;
  auto head_sync = [&] { sm90::named_barrier_sync(kHeadPullBarrier, pulling_threads); };
  auto ring_tile = [&](const RankPlan& plan, int tile) {
    return reinterpret_cast<std::uint8_t*>(plan.ring + static_cast<long long>(tile % p.ring_tiles) * kTileM * p.hidden);
  };
  // Rows first, first + step, ... of the row tile by this warp's pipeline.
  auto pull_my_rows = [&](const RankPlan& plan, int tile, int first, int step) {
    stage_sources(p, plan.rows + static_cast<long long>(tile) * kTileM, first, step, s_sources[warp]);
    if (lane == 0) {
      pull_rows(p, pl, s_sources[warp], ring_tile(plan, tile), first, step);
      // The GEMM reads these rows through TMA (async proxy) on another SM.
      fence_proxy_async_global();
      __threadfence();
    }
    // s_sources[warp] is rewritten for the next tile only after lane 0 used it. (The other
    // lanes wait here, never exit while lane 0 has copies in flight: in mok_pull_rate, a warp
    // whose lanes 1-31 had exited while lane 0 kept 5 or more bulk loads in flight ended in
    // "unspecified launch failure" on the H200.)
    __syncwarp();
  };
  if (head > 0) {
    // (A head pull never waits for a ring slot: pull i's tile is at most i < ring_tiles.)
    for (;;) {
      if (threadIdx.x == 0) s_head = atomicAdd(p.head_counter, 1);
      head_sync();
      const int i = s_head;
      head_sync();  // every thread has read s_head before thread 0 claims again
      if (i >= head) break;
      const int2 pull = p.pulls[i];
      const RankPlan& plan = p.plans[pull.x];
      pull_my_rows(plan, pull.y, warp, groups * kPullWarps);
      head_sync();
      if (threadIdx.x == 0) red_release_gpu_add(plan.rows_ready + pull.y, 1);
    }
  }
  if (communication) {
    const bool leader = threadIdx.x % (kPullWarps * 32) == 0;
    auto group_sync = [&] { sm90::named_barrier_sync(1 + group, kPullWarps * 32); };
    // Group g of CTA c takes pulls head + c + g*C, head + c + (G + g)*C, ...: the first G*C
    // pulls after the head are in flight together, each CTA's groups a stride C apart.
    for (int i = head + blockIdx.x + group * p.num_comm_ctas; i < num_pulls; i += groups * p.num_comm_ctas) {
      const int2 pull = p.pulls[i];
      const RankPlan& plan = p.plans[pull.x];
      const int tile = pull.y;
      const int rank = p.first_rank + pull.x;
      if (leader) {
        s_ok[group] = tile < p.ring_tiles || wait_ring_slot_free(p, plan, rank, tile);
      }
      group_sync();
      if (s_ok[group]) pull_my_rows(plan, tile, pipe, kPullWarps);
      group_sync();
      if (leader) red_release_gpu_add(plan.rows_ready + tile, 1);
    }
  }
  // (Every copy of this pipeline has completed: pull_rows waited for its last stores.) The
  // CTA may go on as a compute CTA, reusing this shared memory.
  if (lane == 0) {
    for (int s = 0; s < slots; ++s) sm90::mbar_inval(&pl.full[s]);
    // The compute role's TMA writes (async proxy) may land on these barriers' bytes.
    sm90::fence_proxy_async_shared();
  }
}

}  // namespace mok::cuda
