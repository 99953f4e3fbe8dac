// mok: the schedule on the GPU, from the (all-gathered) top-k ids, with counts and prefix
// sums only, bit for bit the rows of the CPU builder (src/core/schedule.cpp):
//   validate: ids in range, distinct per token, finite router weights (errors recorded);
//   count:    rows per (destination expert, chunk of the source id stream);
//   scatter:  each (expert, chunk) block writes its rows in stream order at its prefix
//             offset, the expert's last chunk pads the segment to 128 rows;
//   plan:     the compute task list and the pull list, in dependency order.
// The id stream is source-rank major: position g = s*T*k + t*k + j, so stream order is
// MoK's order (source ranks in rank order, tokens in index order).
#pragma once
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "cuda/forward_types.h"

namespace mok::cuda {

constexpr int kScheduleThreads = 256;
constexpr int kScheduleChunk = 16384;  // ids per count/scatter block

struct ScheduleParams {
  const int* const* top_experts;      // [R] -> [T*k]
  const float* const* router_weights; // [R] -> [T*k]
  int ep_size, tokens, top_k, num_experts, local_experts;
  int first_rank, num_ranks;          // destination ranks built here
  int validate_first_rank;            // validate ranks [this, this + gridDim.y)
  int chunks;                         // ceil(R*T*k / kScheduleChunk)
  int capacity_rows;
  RankPlan* plans;                    // [num_ranks]
  DeviceError* error;
};

__global__ void schedule_validate_kernel(const ScheduleParams p) {
  const int rank = p.validate_first_rank + blockIdx.y;
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= p.tokens) return;
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

__device__ __forceinline__ int stream_id(const ScheduleParams& p, long long g) {
  const long long per = static_cast<long long>(p.tokens) * p.top_k;
  return p.top_experts[g / per][g % per];
}

// grid (chunks, local_experts, num_ranks)
__global__ void __launch_bounds__(kScheduleThreads) schedule_count_kernel(const ScheduleParams p) {
  using Reduce = cub::BlockReduce<int, kScheduleThreads>;
  __shared__ typename Reduce::TempStorage tmp;
  const int chunk = blockIdx.x, e = blockIdx.y, d = blockIdx.z;
  const int target = (p.first_rank + d) * p.local_experts + e;
  const long long total = static_cast<long long>(p.ep_size) * p.tokens * p.top_k;
  const long long begin = static_cast<long long>(chunk) * kScheduleChunk;
  const long long end = min(total, begin + kScheduleChunk);
  int n = 0;
  for (long long g = begin + threadIdx.x; g < end; g += kScheduleThreads) n += stream_id(p, g) == target;
  n = Reduce(tmp).Sum(n);
  if (threadIdx.x == 0) p.plans[d].expert_counts[e * p.chunks + chunk] = n;
}

// grid (chunks, local_experts, num_ranks)
__global__ void __launch_bounds__(kScheduleThreads) schedule_scatter_kernel(const ScheduleParams p) {
  using Reduce = cub::BlockReduce<long long, kScheduleThreads>;
  using Scan = cub::BlockScan<int, kScheduleThreads>;
  __shared__ union {
    typename Reduce::TempStorage reduce;
    typename Scan::TempStorage scan;
  } tmp;
  __shared__ long long s_expert_start, s_block_start, s_own;
  __shared__ bool s_over_capacity;
  const int chunk = blockIdx.x, e = blockIdx.y, d = blockIdx.z;
  RankPlan& plan = p.plans[d];
  const int* counts = plan.expert_counts;

  // Padded segment sizes: rows of the experts before this one, rows of all experts.
  long long before = 0, total = 0;
  for (int x = threadIdx.x; x < p.local_experts; x += kScheduleThreads) {
    long long n = 0;
    for (int c = 0; c < p.chunks; ++c) n += counts[x * p.chunks + c];
    const long long padded = (n + kTileM - 1) / kTileM * kTileM;
    total += padded;
    if (x < e) before += padded;
  }
  before = Reduce(tmp.reduce).Sum(before);
  __syncthreads();
  total = Reduce(tmp.reduce).Sum(total);
  if (threadIdx.x == 0) {
    long long own = 0, prior = 0;
    for (int c = 0; c < p.chunks; ++c) {
      if (c < chunk) prior += counts[e * p.chunks + c];
      own += counts[e * p.chunks + c];
    }
    s_expert_start = before;
    s_block_start = before + prior;
    s_own = own;
    s_over_capacity = total > p.capacity_rows;
    if (chunk == 0 && e == 0) {
      if (s_over_capacity) report_error(p.error, kCapacityExceeded, p.first_rank + d, 0, p.capacity_rows, total);
      *plan.num_row_tiles = s_over_capacity ? 0 : static_cast<int>(total / kTileM);
    }
  }
  __syncthreads();
  if (s_over_capacity) return;  // write nothing: the forward reports the error, drops nothing
  const long long expert_start = s_expert_start;
  long long out = s_block_start;

  const int target = (p.first_rank + d) * p.local_experts + e;
  const long long per = static_cast<long long>(p.tokens) * p.top_k;
  const long long stream_total = p.ep_size * per;
  const long long begin = static_cast<long long>(chunk) * kScheduleChunk;
  const long long end = min(stream_total, begin + kScheduleChunk);
  for (long long g0 = begin; g0 < end; g0 += kScheduleThreads) {
    const long long g = g0 + threadIdx.x;
    const int hit = (g < end && stream_id(p, g) == target) ? 1 : 0;
    int offset, count;
    Scan(tmp.scan).ExclusiveSum(hit, offset, count);
    if (hit) plan.rows[out + offset] = make_int2(static_cast<int>(g / per), static_cast<int>(g % per));
    out += count;
    __syncthreads();
  }
  if (chunk == p.chunks - 1) {
    const long long real_end = expert_start + s_own;
    const long long padded_end = expert_start + (s_own + kTileM - 1) / kTileM * kTileM;
    for (long long r = real_end + threadIdx.x; r < padded_end; r += kScheduleThreads) plan.rows[r] = make_int2(-1, -1);
    for (long long tile = expert_start / kTileM + threadIdx.x; tile < padded_end / kTileM; tile += kScheduleThreads)
      plan.block_expert[tile] = e;
  }
}

struct PlanParams {
  RankPlan* plans;
  int num_ranks, num_shared, tokens;
  int shared_gateup_tiles[kMaxShared];
  int gateup_tiles, down_tiles;  // routed, per row tile
  int lag;                       // groups between a row tile's gate/up and its down tiles
  Task* tasks;
  int* num_tasks;
  int2* pulls;
  int* num_pulls;
};

// One block. Groups g = 0, 1, ...: for each rank d, the gate/up tiles of shared row tile g
// and of routed row tile g (whose pull comes first), then the down tiles of row tile
// g - lag. The lag lets a row tile's gate/up tiles finish before its down tiles are taken.
__device__ __forceinline__ void plan_group(const PlanParams& p, int g, int shared_tiles, Task* tasks, int2* pulls,
                                           int& n_task, int& n_pull) {
  for (int d = 0; d < p.num_ranks; ++d) {
    const int m = *p.plans[d].num_row_tiles;
    if (g < shared_tiles)
      for (int s = 0; s < p.num_shared; ++s)
        for (int n = 0; n < p.shared_gateup_tiles[s]; ++n) {
          if (tasks) tasks[n_task] = Task::make(kSharedGateUp, d, s, n, g);
          ++n_task;
        }
    if (g < m) {
      if (pulls) pulls[n_pull] = make_int2(d, g);
      ++n_pull;
      for (int n = 0; n < p.gateup_tiles; ++n) {
        if (tasks) tasks[n_task] = Task::make(kRoutedGateUp, d, 0, n, g);
        ++n_task;
      }
    }
    const int lagged = g - p.lag;
    if (lagged >= 0 && lagged < shared_tiles)
      for (int s = 0; s < p.num_shared; ++s)
        for (int n = 0; n < p.down_tiles; ++n) {
          if (tasks) tasks[n_task] = Task::make(kSharedDown, d, s, n, lagged);
          ++n_task;
        }
    if (lagged >= 0 && lagged < m)
      for (int n = 0; n < p.down_tiles; ++n) {
        if (tasks) tasks[n_task] = Task::make(kRoutedDown, d, 0, n, lagged);
        ++n_task;
      }
  }
}

__global__ void __launch_bounds__(1024) schedule_plan_kernel(const PlanParams p) {
  using Scan = cub::BlockScan<int, 1024>;
  __shared__ typename Scan::TempStorage tmp;
  const int tid = threadIdx.x;
  const int shared_tiles = p.num_shared > 0 ? (p.tokens + kTileM - 1) / kTileM : 0;
  int max_tiles = shared_tiles;
  for (int d = 0; d < p.num_ranks; ++d) max_tiles = max(max_tiles, *p.plans[d].num_row_tiles);
  const int groups = max_tiles > 0 ? max_tiles + p.lag : 0;
  int task = 0, pull = 0;
  for (int g0 = 0; g0 < groups; g0 += 1024) {
    const int g = g0 + tid;
    int n_task = 0, n_pull = 0;
    if (g < groups) plan_group(p, g, shared_tiles, nullptr, nullptr, n_task, n_pull);
    int task_off, task_sum, pull_off, pull_sum;
    Scan(tmp).ExclusiveSum(n_task, task_off, task_sum);
    __syncthreads();
    Scan(tmp).ExclusiveSum(n_pull, pull_off, pull_sum);
    if (g < groups) {
      int t = 0, q = 0;
      plan_group(p, g, shared_tiles, p.tasks + task + task_off, p.pulls + pull + pull_off, t, q);
    }
    task += task_sum;
    pull += pull_sum;
    __syncthreads();
  }
  if (tid == 0) {
    *p.num_tasks = task;
    *p.num_pulls = pull;
  }
}

}  // namespace mok::cuda
