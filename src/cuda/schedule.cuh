// mok: the schedule on the GPU, from the (all-gathered) top-k ids, with counts and prefix
// sums only, bit for bit the rows of the CPU builder (src/core/schedule.cpp):
//   count:    rows per (destination expert, chunk of the source id stream), one warp per
//             chunk, one pass over the ids; the same warp validates the tokens that start
//             in its chunk (ids in range, distinct per token, finite router weights; errors
//             recorded; a bad id is never a destination, so counting needs no order);
//   offsets:  each expert's segment padded to 128 rows, the capacity check, the first row
//             of every (expert, chunk), padding rows and each row tile's expert;
//   scatter:  each chunk's warp writes its rows in stream order from those offsets;
//   plan:     the compute task list and the pull list, in dependency order (in the
//             scatter's launch, on blocks of its own: it needs only the row-tile counts).
// The id stream is source-rank major: position g = s*T*k + t*k + j, so stream order is
// MoK's order (source ranks in rank order, tokens in index order).
#pragma once
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "cuda/forward_types.h"

namespace mok::cuda {

constexpr int kScheduleThreads = 256;
constexpr int kScheduleWarps = kScheduleThreads / 32;
constexpr int kScheduleChunk = 512;         // ids per warp in count and scatter (more, shorter warps: both passes are latency-bound)
constexpr int kScheduleMaxExperts = 4096;   // destination experts one forward builds (smem histograms)

struct ScheduleParams {
  const int* const* top_experts;      // [R] -> [T*k]
  const float* const* router_weights; // [R] -> [T*k]
  int ep_size, tokens, top_k, num_experts, local_experts;
  int first_rank, num_ranks;          // destination ranks built here
  int validate_first_rank;            // validate source ranks [this, this + validate_ranks)
  int validate_ranks;
  int chunks;                         // ceil(R*T*k / kScheduleChunk)
  int capacity_rows;
  RankPlan* plans;                    // [num_ranks]
  DeviceError* error;
};

// Validation of one token of source rank `rank`: ids in range, distinct, finite weights.
__device__ __forceinline__ void validate_token(const ScheduleParams& p, int rank, int t) {
  const int k = p.top_k;
  const int* ids = p.top_experts[rank] + static_cast<long long>(t) * k;
  const float* w = p.router_weights[rank] + static_cast<long long>(t) * k;
  const long long base = (static_cast<long long>(rank) * p.tokens + t) * k;
  for (int j = 0; j < k; ++j) {
    const int e = ids[j];
    if (e < 0 || e >= p.num_experts) report_error(p.error, kExpertOutOfRange, rank, 0, base + j, e);
    for (int i = 0; i < j; ++i)
      if (ids[i] == e) report_error(p.error, kDuplicateExpert, rank, 0, base + j, e);
    if (!isfinite(w[j])) report_error(p.error, kNonFiniteWeight, rank, 0, base + j, 0);
  }
}

// The id stream in chunks of kScheduleChunk ids, one warp per chunk. A destination expert
// q indexes the experts computed here: rank first_rank + q / E_loc, local expert q % E_loc.
struct StreamChunk {
  unsigned begin, end;  // [begin, end) positions in the stream
};

__device__ __forceinline__ StreamChunk stream_chunk(const ScheduleParams& p, int chunk) {
  const unsigned total = static_cast<unsigned>(p.ep_size) * p.tokens * p.top_k;
  const unsigned begin = static_cast<unsigned>(chunk) * kScheduleChunk;
  return {begin, min(total, begin + kScheduleChunk)};
}

// Stream position g as (source rank, slot t*k + j); per = T*k ids per source rank.
struct StreamPos {
  int src, slot;
};

__device__ __forceinline__ StreamPos stream_pos(unsigned g, unsigned per) {
  const unsigned src = g / per;
  return {static_cast<int>(src), static_cast<int>(g - src * per)};
}

// Destination expert of a stream position, or -1 when another rank computes it.
__device__ __forceinline__ int destination_expert(const ScheduleParams& p, StreamPos pos) {
  const int q = p.top_experts[pos.src][pos.slot] - p.first_rank * p.local_experts;
  return q >= 0 && q < p.num_ranks * p.local_experts ? q : -1;
}

constexpr int kIdsPerLane = kScheduleChunk / 32;

// Lane `lane`'s destination experts of its warp's chunk (stream positions begin + 32*i +
// lane), all loaded before any is used: 32 independent loads in flight per lane instead of a
// chain of dependent ones (the count and scatter passes are latency-bound otherwise).
__device__ __forceinline__ void load_chunk(const ScheduleParams& p, const StreamChunk& c, int lane,
                                           int (&q)[kIdsPerLane]) {
  const unsigned per = static_cast<unsigned>(p.tokens) * p.top_k;
#pragma unroll
  for (int i = 0; i < kIdsPerLane; ++i) {
    const unsigned g = c.begin + 32u * i + lane;
    q[i] = g < c.end ? destination_expert(p, stream_pos(g, per)) : -1;
  }
}

// The chunk a warp of count or scatter owns, and that warp's per-destination-expert
// counters in dynamic shared memory (Q ints per warp), zeroed. chunk < 0: past the last one.
struct WarpChunk {
  int lane, chunk;
  int* per_expert;
};

__device__ __forceinline__ WarpChunk warp_chunk(const ScheduleParams& p, int block, int* smem) {
  const int warp = threadIdx.x / 32;
  WarpChunk w{static_cast<int>(threadIdx.x % 32), block * kScheduleWarps + warp, nullptr};
  if (w.chunk >= p.chunks) {
    w.chunk = -1;
    return w;
  }
  const int Q = p.num_ranks * p.local_experts;
  w.per_expert = smem + warp * Q;
  for (int q = w.lane; q < Q; q += 32) w.per_expert[q] = 0;
  __syncwarp();
  return w;
}

// grid ceil(chunks / kScheduleWarps), kScheduleThreads; dynamic smem: a histogram of the
// destination experts per warp. Writes rows per (expert, chunk).
// (Four blocks per SM in the bounds: with the thread count alone ptxas 13 capped count and
// scatter at 32 registers and spilled; with it they need 40 and spill nothing.)
__global__ void __launch_bounds__(kScheduleThreads, 4) schedule_count_kernel(const ScheduleParams p) {
  wait_previous_kernel();
  allow_next_kernel_launch();
  extern __shared__ int hist_all[];
  const WarpChunk w = warp_chunk(p, static_cast<int>(blockIdx.x), hist_all);
  if (w.chunk < 0) return;
  const int lane = w.lane, chunk = w.chunk, Q = p.num_ranks * p.local_experts;
  int* hist = w.per_expert;
  const StreamChunk c = stream_chunk(p, chunk);
  int q[kIdsPerLane];
  load_chunk(p, c, lane, q);
#pragma unroll
  for (int i = 0; i < kIdsPerLane; ++i)
    if (q[i] >= 0) atomicAdd(&hist[q[i]], 1);
  __syncwarp();
  for (int q = lane; q < Q; q += 32)
    p.plans[q / p.local_experts].expert_counts[(q % p.local_experts) * p.chunks + chunk] = hist[q];
  // The tokens whose first id is in this chunk (their ids are in L1/L2 now).
  const unsigned k = p.top_k;
  for (unsigned u = (c.begin + k - 1) / k + lane; u * k < c.end; u += 32) {
    const int rank = static_cast<int>(u / p.tokens);
    if (rank >= p.validate_first_rank && rank < p.validate_first_rank + p.validate_ranks)
      validate_token(p, rank, static_cast<int>(u - static_cast<unsigned>(rank) * p.tokens));
  }
}

// One block of 1024 threads; dynamic smem: rows per destination expert. From the counts:
// each expert's padded segment (experts in order, each padded to 128 rows), the capacity
// check, the start row of every (expert, chunk), the padding rows and each row tile's expert.
__global__ void __launch_bounds__(1024) schedule_offsets_kernel(const ScheduleParams p) {
  wait_previous_kernel();
  allow_next_kernel_launch();
  constexpr int kItems = kScheduleMaxExperts / 1024;
  using Scan = cub::BlockScan<int, 1024>;
  __shared__ typename Scan::TempStorage tmp;
  extern __shared__ int expert_rows[];  // [Q] real rows, then [Q] padded segment starts
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int E = p.local_experts, Q = p.num_ranks * E;
  int* start = expert_rows + Q;
  for (int q = warp; q < Q; q += 32) {
    const int* counts = p.plans[q / E].expert_counts + (q % E) * p.chunks;
    int n = 0;
#pragma unroll 4
    for (int c = lane; c < p.chunks; c += 32) n += counts[c];
    for (int o = 16; o > 0; o >>= 1) n += __shfl_xor_sync(0xffffffffu, n, o);
    if (lane == 0) expert_rows[q] = n;
  }
  __syncthreads();
  // Padded starts: one scan over every destination expert; a rank's segment starts at its
  // first expert's value.
  int padded[kItems];
#pragma unroll
  for (int i = 0; i < kItems; ++i) {
    const int q = threadIdx.x * kItems + i;
    padded[i] = q < Q ? (expert_rows[q] + kTileM - 1) / kTileM * kTileM : 0;
  }
  Scan(tmp).ExclusiveSum(padded, padded);
#pragma unroll
  for (int i = 0; i < kItems; ++i) {
    const int q = threadIdx.x * kItems + i;
    if (q < Q) start[q] = padded[i];
  }
  __syncthreads();
  for (int d = threadIdx.x; d < p.num_ranks; d += blockDim.x) {
    const int first = start[d * E];
    const int last = d * E + E - 1;
    const int total = start[last] + (expert_rows[last] + kTileM - 1) / kTileM * kTileM - first;
    const bool over = total > p.capacity_rows;
    if (over) report_error(p.error, kCapacityExceeded, p.first_rank + d, 0, p.capacity_rows, total);
    // 0 row tiles: the scatter and the megakernel do nothing for this rank (no row dropped
    // silently: the error poisons y).
    *p.plans[d].num_row_tiles = over ? 0 : total / kTileM;
  }
  __syncthreads();
  for (int q = warp; q < Q; q += 32) {
    const int d = q / E, e = q % E;
    RankPlan& plan = p.plans[d];
    // The capacity check above ran in this block; re-derive it rather than read the flag
    // another thread wrote (no block-wide ordering needed beyond the barrier).
    const int first = start[d * E], last = d * E + E - 1;
    if (start[last] + (expert_rows[last] + kTileM - 1) / kTileM * kTileM - first > p.capacity_rows) continue;
    const int seg = start[q] - first;
    const int* counts = plan.expert_counts + e * p.chunks;
    int* offsets = plan.expert_offsets + e * p.chunks;
    int running = seg;
    // 32 chunks per scan step, kScanBatch steps' counts loaded before any is scanned (the
    // loop is latency-bound: one expert's chunks are scanned by one warp in order).
    constexpr int kScanBatch = 4;
    for (int c0 = 0; c0 < p.chunks; c0 += 32 * kScanBatch) {
      int n[kScanBatch];
#pragma unroll
      for (int b = 0; b < kScanBatch; ++b) {
        const int c = c0 + 32 * b + lane;
        n[b] = c < p.chunks ? counts[c] : 0;
      }
#pragma unroll
      for (int b = 0; b < kScanBatch; ++b) {
        const int c = c0 + 32 * b + lane;
        int incl = n[b];
        for (int o = 1; o < 32; o <<= 1) {
          const int v = __shfl_up_sync(0xffffffffu, incl, o);
          if (lane >= o) incl += v;
        }
        if (c < p.chunks) offsets[c] = running + incl - n[b];
        running += __shfl_sync(0xffffffffu, incl, 31);
      }
    }
    const int real_end = seg + expert_rows[q];
    const int padded_end = seg + (expert_rows[q] + kTileM - 1) / kTileM * kTileM;
    for (int r = real_end + lane; r < padded_end; r += 32) plan.rows[r] = make_int2(-1, -1);
    for (int tile = seg / kTileM + lane; tile < padded_end / kTileM; tile += 32) plan.block_expert[tile] = e;
  }
}

// Scatter block `block` of ceil(chunks / kScheduleWarps); `written_all`: per warp, rows
// written so far per destination expert. Each warp writes its chunk's rows in stream order:
// the lanes holding the same expert are ranked by lane (match_any), 32 ids at a time.
__device__ __forceinline__ void scatter_block(const ScheduleParams& p, int block, int* written_all) {
  const WarpChunk w = warp_chunk(p, block, written_all);
  if (w.chunk < 0) return;
  const int lane = w.lane, chunk = w.chunk, E = p.local_experts;
  int* written = w.per_expert;
  const StreamChunk c = stream_chunk(p, chunk);
  const unsigned per = static_cast<unsigned>(p.tokens) * p.top_k;
  const unsigned lanes_below = (1u << lane) - 1;
  int qs[kIdsPerLane];
  load_chunk(p, c, lane, qs);
#pragma unroll
  for (int i = 0; i < kIdsPerLane; ++i) {
    const unsigned g = c.begin + 32u * i + lane;
    const int q = qs[i];
    const StreamPos pos = stream_pos(g, per);
    const unsigned peers = __match_any_sync(0xffffffffu, q);
    const int before = __popc(peers & lanes_below);
    if (q >= 0) {
      RankPlan& plan = p.plans[q / E];
      if (*plan.num_row_tiles > 0) {  // 0: over capacity (or no rows at all)
        const int row = plan.expert_offsets[(q % E) * p.chunks + chunk] + written[q] + before;
        plan.rows[row] = make_int2(pos.src, pos.slot);
      }
    }
    __syncwarp();
    if (q >= 0 && before == 0) written[q] += __popc(peers);
    __syncwarp();
  }
}

struct PlanParams {
  RankPlan* plans;
  PlanShape shape;  // row tiles per rank come from plans[d].num_row_tiles
  Task* tasks;
  int* num_tasks;
  int2* pulls;
  int* num_pulls;
};

// grid ceil(max_groups / kPlanGroupsPerBlock), 256 threads: one warp per group of the order
// in plan_order.h, written at its closed-form offset. Every lane walks the group's order and
// lane l stores its items l, l + 32, ..., so each warp store is 32 consecutive entries (with
// a thread per group, each store instruction wrote 32 scattered lines).
constexpr int kPlanGroupsPerBlock = 256 / 32;

__device__ __forceinline__ void plan_block(const PlanParams& p, int block) {
  const int g = block * kPlanGroupsPerBlock + static_cast<int>(threadIdx.x / 32);
  const int lane = threadIdx.x % 32;
  auto row_tiles = [&](int d) { return *p.plans[d].num_row_tiles; };
  const int groups = plan_groups(p.shape, row_tiles);
  if (g == 0 && lane == 0) {
    const PlanCount all = plan_prefix(p.shape, groups, row_tiles);
    *p.num_tasks = all.tasks;
    *p.num_pulls = all.pulls;
  }
  if (g >= groups) return;
  const PlanCount before = plan_prefix(p.shape, g, row_tiles);
  Task* tasks = p.tasks + before.tasks;
  int2* pulls = p.pulls + before.pulls;
  int task_index = 0, pull_index = 0;
  plan_group(
      p.shape, g, row_tiles,
      [&](std::uint32_t kind, int d, int s, int n, int t) {
        if (task_index % 32 == lane) tasks[task_index] = Task::make(kind, d, s, n, t);
        ++task_index;
      },
      [&](int d, int t) {
        if (pull_index % 32 == lane) pulls[pull_index] = make_int2(d, t);
        ++pull_index;
      });
}

// grid plan_blocks + the scatter's blocks, kScheduleThreads: blocks below plan_blocks write the
// task and pull lists, the rest scatter the rows. The plan needs only the row-tile counts
// (written by the offsets kernel), not the rows, so it runs beside the scatter instead of
// after it: one launch and the plan's time off the chain before the megakernel. (Plan
// blocks first, so they start in the first wave even when the scatter's shared memory
// takes more than one.) Dynamic smem: the scatter's per-warp counters.
struct ScatterPlanParams {
  ScheduleParams schedule;
  PlanParams plan;
  int plan_blocks;
};

static_assert(kScheduleThreads == 32 * kPlanGroupsPerBlock, "the plan's blocks are the scatter's size");
__global__ void __launch_bounds__(kScheduleThreads, 4) schedule_scatter_plan_kernel(const ScatterPlanParams p) {
  wait_previous_kernel();
  // The megakernel's CTAs may take the SMs this grid leaves free at once (one CTA per SM;
  // they all become resident as this grid's blocks exit).
  allow_next_kernel_launch();
  extern __shared__ int scatter_smem[];
  const int block = static_cast<int>(blockIdx.x);
  if (block < p.plan_blocks)
    plan_block(p.plan, block);
  else
    scatter_block(p.schedule, block - p.plan_blocks, scatter_smem);
}

}  // namespace mok::cuda
