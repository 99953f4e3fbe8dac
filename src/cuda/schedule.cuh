// mok: the schedule on the GPU, from the (all-gathered) top-k ids, with counts and prefix
// sums only, bit for bit the rows of the CPU builder (src/core/schedule.cpp):
//   count:    rows per (destination expert, chunk of the source id stream), one warp per
//             chunk, one pass over the ids, and each block's rows per expert added to the
//             expert's total; the same warp validates its chunk's ids (in range, distinct
//             per token, finite router weights; errors recorded; a bad id is never a
//             destination, so counting needs no order);
//   offsets:  one block per destination expert: its segment (experts in order, each padded
//             to 128 rows) from its rank's totals, the capacity check, the first row of each
//             of its (expert, chunk)s by a block scan, its padding rows and row tiles' expert
//             (and whether a tile's rows 64..127 are padding);
//   scatter:  each chunk's warp writes its rows in stream order from those offsets;
//   plan:     the compute task list and the pull list, in dependency order (in the
//             scatter's launch, on blocks of its own: it needs the row-tile counts and the
//             tiles' experts, not the rows).
// Every pass is spread over many warps with its loads issued together: these kernels are
// latency-bound (a few microseconds of work each), and a chain of dependent loads, or one
// block doing a whole pass, is what made them slow.
// The id stream is source-rank major: position g = s*T*k + t*k + j, so stream order is
// MoK's order (source ranks in rank order, tokens in index order).
#pragma once
#include <climits>

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "cuda/forward_types.h"

namespace mok::cuda {

constexpr int kScheduleThreads = 256;
constexpr int kScheduleWarps = kScheduleThreads / 32;
// Ids per warp in count and scatter (a chunk): the large chunk normally, the small one when
// the large would leave SMs without a block (Qwen3-30B's 131k ids: 32 blocks of 512-id chunks
// on 132 SMs), since both passes are latency-bound per warp.
constexpr int kScheduleChunkLarge = 512;
constexpr int kScheduleChunkSmall = 128;
constexpr int kScheduleMaxExperts = 4096;   // destination experts one forward builds (smem histograms)
static_assert(kScheduleMaxExperts <= kMaxTaskExperts, "a task names its local expert in Task's expert field");
// Blocks per SM in count's and scatter's launch bounds (registers: 64 per thread at 4, 80 at
// 3). With the bound from the thread count alone ptxas 13 capped them at 32 registers and
// spilled; large chunks hold 16 ids and their loads in flight per lane and spilled at 64.
// Large chunks are chosen only when there are enough blocks to fill the SMs anyway.
__host__ __device__ constexpr int schedule_blocks_per_sm(int chunk) {
  return chunk > kScheduleChunkSmall ? 3 : 4;
}

struct ScheduleParams {
  const int* const* top_experts;      // [R] -> [T*k]
  const float* const* router_weights; // [R] -> [T*k]
  int ep_size, tokens, top_k, num_experts, local_experts;
  int first_rank, num_ranks;          // destination ranks built here
  int validate_first_rank;            // validate source ranks [this, this + validate_ranks)
  int validate_ranks;
  int chunks;                         // ceil(R*T*k / chunk), chunk = kScheduleChunkLarge or Small
  int capacity_rows;
  RankPlan* plans;                    // [num_ranks]
  DeviceError* error;
  // Host-mapped; nonzero once the host is aborting this rank's EP group, whose abort unmaps
  // the peers' memory (nullptr: not a group). Read by the count kernel, whose error makes the
  // plan list no routed work: a forward queued behind the abort touches no peer (backend.cu,
  // drain_before_abort).
  const int* abandoned;
};

// The id stream in chunks of kChunk ids, one warp per chunk. A destination expert
// q indexes the experts computed here: rank first_rank + q / E_loc, local expert q % E_loc.
struct StreamChunk {
  unsigned begin, end;  // [begin, end) positions in the stream
};

template <int kChunk>
__device__ __forceinline__ StreamChunk stream_chunk(const ScheduleParams& p, int chunk) {
  const unsigned total = static_cast<unsigned>(p.ep_size) * p.tokens * p.top_k;
  const unsigned begin = static_cast<unsigned>(chunk) * kChunk;
  return {begin, min(total, begin + kChunk)};
}

// Stream position g as (source rank, slot t*k + j); per = T*k ids per source rank.
struct StreamPos {
  int src, slot;
};

__device__ __forceinline__ StreamPos stream_pos(unsigned g, unsigned per) {
  const unsigned src = g / per;
  return {static_cast<int>(src), static_cast<int>(g - src * per)};
}

// Whether source rank `src`'s ids and weights are validated here (each rank validates its
// own; a slice or virtual ranks: every rank's).
__device__ __forceinline__ bool validates_rank(const ScheduleParams& p, int src) {
  return src >= p.validate_first_rank && src < p.validate_first_rank + p.validate_ranks;
}

// Destination expert of expert id e, or -1 when another rank computes it (a bad id, out of
// range, is never a destination: first_rank*E_loc + Q <= num_experts).
__device__ __forceinline__ int local_destination(const ScheduleParams& p, int e) {
  // Unsigned: e is unvalidated here (another rank's id may be anything), and e - first*E_loc
  // could overflow as a signed int; wrapped, an id below the range is past it.
  const unsigned q = static_cast<unsigned>(e) - static_cast<unsigned>(p.first_rank * p.local_experts);
  return q < static_cast<unsigned>(p.num_ranks * p.local_experts) ? static_cast<int>(q) : -1;
}

// Lane `lane`'s values of a per-source-rank array (`source[s]` -> [T*k]) at its warp's chunk
// positions begin + 32*i + lane, i < kPerLane. Each value is two dependent loads (the source
// rank's pointer, then the value), and both are unconditional: a position past the chunk's
// end is clamped to its last one (its value is read and not used). Under an `if (g < end)`
// the compiler kept each pointer load and its use in one branch region, so a warp waited
// out one full load latency per value, kPerLane of them in a row (the count kernel's 28 us
// on the Qwen3.5 slice); unconditional, a batch's pointer loads issue together, then its
// value loads. (Batches of 4 bound the live pointers' registers.)
template <int kPerLane, typename T>
__device__ __forceinline__ void load_stream(const T* const* source, const StreamChunk& c, unsigned per, int lane,
                                            T (&out)[kPerLane]) {
  constexpr int kBatch = kPerLane < 4 ? kPerLane : 4;
  static_assert(kPerLane % kBatch == 0, "whole batches");
#pragma unroll
  for (int b = 0; b < kPerLane; b += kBatch) {
    const T* rows[kBatch];
    int slot[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const StreamPos pos = stream_pos(min(c.begin + 32u * (b + u) + lane, c.end - 1), per);
      rows[u] = source[pos.src];
      slot[u] = pos.slot;
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) out[b + u] = rows[u][slot[u]];
  }
}

// A chunk whose ids all belong to one source rank (always when T*k is a multiple of the
// chunk, as on every named shape): its rank's pointer is loaded once and lane `lane`'s
// positions are slots slot0 + 32*i + lane, so no position needs a division and every load is
// issued at once. (Warp-uniform; load_chunk takes the general path otherwise.)
struct OneSource {
  int src = -1;    // the source rank, or -1 when the chunk spans two ranks
  int slot0 = 0;   // the chunk's first slot t*k + j in that rank
  unsigned size = 0;
};

__device__ __forceinline__ OneSource one_source(const ScheduleParams& p, const StreamChunk& c) {
  const unsigned per = static_cast<unsigned>(p.tokens) * p.top_k;
  const unsigned src = c.begin / per;
  OneSource o;
  if ((c.end - 1) / per != src) return o;
  o.src = static_cast<int>(src);
  o.slot0 = static_cast<int>(c.begin - src * per);
  o.size = c.end - c.begin;
  return o;
}

// Lane `lane`'s values of `o`'s chunk from `source[o.src]` (`fill` past the chunk's end).
template <int kPerLane, typename T>
__device__ __forceinline__ void load_one_source(const T* const* source, const OneSource& o, int lane, T fill,
                                                T (&out)[kPerLane]) {
  const T* values = source[o.src] + o.slot0;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const unsigned at = 32u * i + lane;
    out[i] = at < o.size ? values[at] : fill;
  }
}

// Lane `lane`'s expert ids of its warp's chunk (stream positions begin + 32*i + lane; -1 past
// the end): through the one rank pointer when the chunk is `o`'s, else position by position.
template <int kIdsPerLane>
__device__ __forceinline__ void load_chunk(const ScheduleParams& p, const StreamChunk& c, const OneSource& o,
                                           int lane, int (&ids)[kIdsPerLane]) {
  if (o.src >= 0) {
    load_one_source(p.top_experts, o, lane, -1, ids);
    return;
  }
  const unsigned per = static_cast<unsigned>(p.tokens) * p.top_k;
  load_stream(p.top_experts, c, per, lane, ids);
#pragma unroll
  for (int i = 0; i < kIdsPerLane; ++i)
    if (c.begin + 32u * i + lane >= c.end) ids[i] = -1;
}

// A bad routing entry at stream position g (kept out of line: inlined at every check, the
// error path multiplied the count kernel's code). Of several, the least (g, code) is the one
// recorded, whichever warp finds it first (DeviceError::first_bad_routing_inverted); the
// offsets kernel records it as the error (record_first_bad_routing).
__device__ __noinline__ void report_bad_entry(DeviceError* err, int code, unsigned g) {
  const unsigned long long key = (static_cast<unsigned long long>(g) << 2) | static_cast<unsigned>(code - 1);
  atomicMax(&err->first_bad_routing_inverted, ~key);
  atomicExch(&err->abort, 1);
}

// The first bad routing entry the count kernel found, recorded as the error: its rank, slot
// and (for an id) the id, read back from the ids. Run by one thread after the count kernel.
__device__ __forceinline__ void record_first_bad_routing(const ScheduleParams& p, unsigned long long inverted) {
  const unsigned long long key = ~inverted;
  const int code = static_cast<int>(key & 3) + 1;
  const long long g = static_cast<long long>(key >> 2);
  const long long per_rank = static_cast<long long>(p.tokens) * p.top_k;
  const int src = static_cast<int>(g / per_rank);
  const long long slot = g % per_rank;
  const long long value = code == kNonFiniteWeight ? 0 : p.top_experts[src][slot];
  report_error(p.error, code, src, 0, g, value);
}

// Validation of the chunk's ids that belong to a source rank validated here: each id in
// range, not a repeat of an earlier slot of its token, its router weight finite. The
// chunk's ids and weights are staged in shared memory first (`staged`: the chunk's ids,
// then its weights, this warp's), all loads issued together; the checks then run as a
// rolled loop over shared memory. Only the earlier slots of a token that began in an
// earlier chunk (k may exceed the chunk) are read from global memory. (Per token, each lane
// walked its tokens' ids and weights one dependent global load after another; unrolled per
// id, the kernel's code grew to 8.7k instructions, run once per warp, and the kernel ran
// slower still.) The reported index is g = rank*T*k + slot (DeviceError's rule).
template <int kIdsPerLane>
__device__ __forceinline__ void validate_chunk(const ScheduleParams& p, const StreamChunk& c, const OneSource& o,
                                               int lane, const int (&ids)[kIdsPerLane], int* staged) {
  constexpr int kChunk = 32 * kIdsPerLane;
  const unsigned per = static_cast<unsigned>(p.tokens) * p.top_k;
  const int vfirst = p.validate_first_rank, vend = p.validate_first_rank + p.validate_ranks;
  // Warp-uniform: the chunk's first and last source ranks.
  const int first_src = static_cast<int>(c.begin / per), last_src = static_cast<int>((c.end - 1) / per);
  if (last_src < vfirst || first_src >= vend) return;
  auto validated = [&](unsigned g, StreamPos pos) { return g < c.end && validates_rank(p, pos.src); };
  float* staged_weight = reinterpret_cast<float*>(staged + kChunk);
#pragma unroll
  for (int i = 0; i < kIdsPerLane; ++i) staged[32 * i + lane] = ids[i];  // (first: frees ids' registers)
  // The chunk's weights, all of them: in a group only the validated rank's are on this GPU
  // (the others' entries are stand-ins, the rank's own pointer again: their weights must not
  // be read), so a chunk that spans another rank takes the rolled per-id path, which reads
  // only validated positions.
  if (o.src >= 0) {
    float weights[kIdsPerLane];
    load_one_source(p.router_weights, o, lane, 0.0f, weights);  // (one source: no division)
#pragma unroll
    for (int i = 0; i < kIdsPerLane; ++i) staged_weight[32 * i + lane] = weights[i];
  } else {
#pragma unroll 1
    for (int at = lane; at < kChunk; at += 32) {
      const unsigned g = c.begin + at;
      const StreamPos pos = stream_pos(g, per);
      staged_weight[at] = validated(g, pos) ? p.router_weights[pos.src][pos.slot] : 0.0f;
    }
  }
  __syncwarp();
  // The position and its slot j in the token walk forward 32 ids per step: one division
  // each before the loop instead of two per id (per = T*k is a multiple of k, so a wrap
  // into the next source rank leaves j as it is).
  const int k = p.top_k, j_step = 32 % k;
  StreamPos pos = stream_pos(c.begin + lane, per);
  int j = pos.slot % k;
#pragma unroll 1
  for (int at = lane; at < kChunk; at += 32) {
    const unsigned g = c.begin + at;
    if (at != lane) {
      pos.slot += 32;
      while (pos.slot >= static_cast<int>(per)) {  // (more than once only when T*k < 32)
        pos.slot -= static_cast<int>(per);
        ++pos.src;
      }
      j += j_step;
      if (j >= k) j -= k;
    }
    if (!validated(g, pos)) continue;
    const int e = staged[at];
    if (e < 0 || e >= p.num_experts) report_bad_entry(p.error, kExpertOutOfRange, g);
    // Slots j-1 .. j-in_chunk are staged; slots 0 .. j-in_chunk-1 lie before the chunk.
    const int in_chunk = min(j, at);
    bool repeat = false;
    for (int d = 1; d <= in_chunk; ++d) repeat |= staged[at - d] == e;
    if (j > in_chunk) {  // (only a token that began in an earlier chunk)
      const int* token_ids = p.top_experts[pos.src] + (pos.slot - j);
      for (int i = 0; i < j - in_chunk; ++i) repeat |= token_ids[i] == e;
    }
    if (repeat) report_bad_entry(p.error, kDuplicateExpert, g);
    if (!isfinite(staged_weight[at])) report_bad_entry(p.error, kNonFiniteWeight, g);
  }
}

// Validation of a one-source chunk of a validated rank, token by token (k <= kTokenMaxK):
// the same checks and reports as validate_chunk. Each lane checks its own positions' ids for
// range and weights for finiteness in registers, stages its ids, and then takes whole tokens
// (their slots before the chunk staged too, so every read is shared memory). A token's ids go into
// kWidth registers (kWidth >= k; the rest get distinct negative fillers that are never
// reported) and are compared pairwise, unrolled: no per-position loop, branch or bound. (The
// per-position rolled loop of validate_chunk was 70% of the count kernel's instructions on
// the Qwen3.5 slice: ~140 per id.) The reported slot of a repeat is the token's first slot
// that repeats an earlier one. `staged`: 2 * kChunk ints (the kChunk before the chunk's ids
// hold the first token's earlier slots: k - 1 <= kChunk).
constexpr int kTokenMaxK = 16;

// The first `slots` ids of a token at `token` (stream position g0): its first slot that
// repeats an earlier one is reported.
template <int kWidth>
__device__ __forceinline__ void check_token_repeats(const ScheduleParams& p, const int* token, int slots, int src,
                                                    unsigned g0) {
  int v[kWidth];
#pragma unroll
  for (int m = 0; m < kWidth; ++m) v[m] = m < slots ? token[m] : INT_MIN + m;
  int repeat_slot = kWidth;
#pragma unroll
  for (int b = kWidth - 1; b >= 1; --b) {
    bool repeat = false;
#pragma unroll
    for (int a = 0; a < b; ++a) repeat |= v[a] == v[b];
    if (repeat && b < slots) repeat_slot = b;
  }
  if (repeat_slot < kWidth) report_bad_entry(p.error, kDuplicateExpert, g0 + repeat_slot);
}

template <int kIdsPerLane>
__device__ __forceinline__ void validate_one_source(const ScheduleParams& p, const OneSource& o, int lane,
                                                    const int (&ids)[kIdsPerLane], int* staged) {
  constexpr int kChunk = 32 * kIdsPerLane;
  const int k = p.top_k;
  const unsigned first = static_cast<unsigned>(o.src) * p.tokens * k + o.slot0;  // the chunk's first g
  float weights[kIdsPerLane];
  load_one_source(p.router_weights, o, lane, 0.0f, weights);
  int* chunk_ids = staged + kChunk;
#pragma unroll
  for (int i = 0; i < kIdsPerLane; ++i) {
    const unsigned at = 32u * i + lane;
    chunk_ids[at] = ids[i];
    if (at < o.size) {
      if (ids[i] < 0 || ids[i] >= p.num_experts) report_bad_entry(p.error, kExpertOutOfRange, first + at);
      if (!isfinite(weights[i])) report_bad_entry(p.error, kNonFiniteWeight, first + at);
    }
  }
  // The first token's slots before the chunk (j0 of them).
  const int j0 = o.slot0 % k;
  const int* rank_ids = p.top_experts[o.src];
  for (int m = lane; m < j0; m += 32) chunk_ids[m - j0] = rank_ids[o.slot0 - j0 + m];
  __syncwarp();
  if (k == 1) return;  // (no repeats)
  // Every token with a slot in the chunk, up to the chunk's end: a token that goes on into
  // the next chunk is checked here for the pairs in this chunk (the next chunk may take the
  // per-position path, which compares only its own positions with their earlier slots).
  const int end = o.slot0 + static_cast<int>(o.size);
  const int t_first = o.slot0 / k, t_end = (end + k - 1) / k;
  for (int t = t_first + lane; t < t_end; t += 32) {
    const int base = t * k - o.slot0;  // >= -j0
    const int slots = min(k, end - t * k);
    if (k <= 4)
      check_token_repeats<4>(p, chunk_ids + base, slots, o.src, first + base);
    else if (k <= 8)
      check_token_repeats<8>(p, chunk_ids + base, slots, o.src, first + base);
    else
      check_token_repeats<kTokenMaxK>(p, chunk_ids + base, slots, o.src, first + base);
  }
}

// Dynamic shared memory of the count kernel per warp: the histogram (Q ints), then the staged
// ids and weights.
__host__ __device__ constexpr int count_warp_ints(int dest_experts, int chunk) { return dest_experts + 2 * chunk; }

// grid ceil(chunks / kScheduleWarps), kScheduleThreads; dynamic smem: count_warp_ints(Q,
// kChunk) per warp. Writes rows per (expert, chunk), and adds the block's rows per expert
// to RankPlan::expert_rows (the offsets kernel starts from them; they must be zero before
// this kernel runs: the forward's memset of the counters, or they count twice).
template <int kChunk>
__global__ void __launch_bounds__(kScheduleThreads, schedule_blocks_per_sm(kChunk))
    schedule_count_kernel(const ScheduleParams p) {
  wait_previous_kernel();
  allow_next_kernel_launch();
  extern __shared__ int count_smem[];
  // (Loaded first, used last: the host-memory read's latency hides behind the counting.)
  const bool watch = p.abandoned != nullptr && blockIdx.x == 0 && threadIdx.x == 0;
  const int abandoned = watch ? ld_relaxed_sys(p.abandoned) : 0;
  const int E = p.local_experts, Q = p.num_ranks * E;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int chunk = static_cast<int>(blockIdx.x) * kScheduleWarps + warp;
  int* hist = count_smem + warp * count_warp_ints(Q, kChunk);
  for (int q = lane; q < Q; q += 32) hist[q] = 0;
  __syncwarp();
  if (chunk < p.chunks) {
    const StreamChunk c = stream_chunk<kChunk>(p, chunk);
    const OneSource o = one_source(p, c);
    int ids[kChunk / 32];
    load_chunk(p, c, o, lane, ids);
#pragma unroll
    for (int i = 0; i < kChunk / 32; ++i) {
      const int q = local_destination(p, ids[i]);
      if (q >= 0) atomicAdd(&hist[q], 1);
    }
    __syncwarp();
    for (int q = lane; q < Q; q += 32) p.plans[q / E].expert_counts[(q % E) * p.chunks + chunk] = hist[q];
    // (Warp-uniform.) One source rank, validated here, small k: token by token.
    if (o.src >= 0 && validates_rank(p, o.src) && p.top_k <= kTokenMaxK)
      validate_one_source(p, o, lane, ids, hist + Q);
    else
      validate_chunk(p, c, o, lane, ids, hist + Q);
  }
  __syncthreads();
  // The block's rows per expert: one global atomic per (block, expert with rows).
  for (int q = threadIdx.x; q < Q; q += kScheduleThreads) {
    int n = 0;
#pragma unroll
    for (int w = 0; w < kScheduleWarps; ++w) n += count_smem[w * count_warp_ints(Q, kChunk) + q];
    if (n != 0) atomicAdd(&p.plans[q / E].expert_rows[q % E], n);
  }
  // Before the plan reads the error (the scatter+plan kernel waits for this grid).
  if (abandoned != 0) report_error(p.error, kGroupAbandoned, p.first_rank, 0, 0, 0);
}

constexpr int kOffsetsThreads = 256;
constexpr int kOffsetsItems = 8;  // chunk counts per thread per scan step, loaded together

// grid Q (block q: rank d = q / E_loc, local expert e = q % E_loc), kOffsetsThreads. From the
// rank's rows per expert: the expert's segment (the rank's experts in order, each padded to
// 128 rows) and the rank's total; the capacity check and the row-tile count (block e = 0);
// then, by a block scan over the expert's chunk counts, the first row of each of its (expert,
// chunk)s; its padding rows and the expert of each of its row tiles. (One block for all
// experts, a warp per expert, scanned each expert's chunks as a chain of dependent loads:
// ~15 us at Qwen3-30B's 128 experts x 256 chunks.)
__global__ void __launch_bounds__(kOffsetsThreads) schedule_offsets_kernel(const ScheduleParams p) {
  wait_previous_kernel();
  allow_next_kernel_launch();
  using Reduce = cub::BlockReduce<int, kOffsetsThreads>;
  using Scan = cub::BlockScan<int, kOffsetsThreads>;
  __shared__ union {
    typename Reduce::TempStorage reduce;
    typename Scan::TempStorage scan;
  } tmp;
  __shared__ int segment[2];  // the rank's padded rows before expert e, and in all
  const int E = p.local_experts, q = static_cast<int>(blockIdx.x), d = q / E, e = q % E;
  const RankPlan& plan = p.plans[d];
  auto padded = [](int n) { return (n + kTileM - 1) / kTileM * kTileM; };
  int before = 0, all = 0;
  for (int i = threadIdx.x; i < E; i += kOffsetsThreads) {
    const int n = padded(plan.expert_rows[i]);
    all += n;
    if (i < e) before += n;
  }
  before = Reduce(tmp.reduce).Sum(before);  // (valid in thread 0)
  __syncthreads();
  all = Reduce(tmp.reduce).Sum(all);
  if (threadIdx.x == 0) {
    segment[0] = before;
    segment[1] = all;
  }
  __syncthreads();
  const int seg = segment[0], rank_rows = segment[1];
  const bool over = rank_rows > p.capacity_rows;
  // (The count kernel, which records bad routing, is complete: wait_previous_kernel.)
  const unsigned long long bad_routing = static_cast<const volatile DeviceError*>(p.error)->first_bad_routing_inverted;
  if (q == 0 && threadIdx.x == 0 && bad_routing != 0) record_first_bad_routing(p, bad_routing);
  if (e == 0 && threadIdx.x == 0) {
    // Bad routing is the error when there is some (the CPU validates before it schedules);
    // else the lowest rank computed here that is over its capacity, as the CPU names it: a
    // rank over it looks at the ranks before it (their totals are final: the count kernel is
    // complete), so one block records the error whichever runs first.
    bool lower_rank_over = false;
    if (over && bad_routing == 0)
      for (int lower = 0; lower < d && !lower_rank_over; ++lower) {
        int rows = 0;
        for (int i = 0; i < E; ++i) rows += padded(p.plans[lower].expert_rows[i]);
        lower_rank_over = rows > p.capacity_rows;
      }
    if (over && bad_routing == 0 && !lower_rank_over)
      report_error(p.error, kCapacityExceeded, p.first_rank + d, 0, p.capacity_rows, rank_rows);
    // 0 row tiles: the scatter and the megakernel do nothing for this rank (no row dropped
    // silently: the error poisons y).
    *plan.num_row_tiles = over ? 0 : rank_rows / kTileM;
  }
  if (over) return;
  const int chunks = p.chunks;
  const int* counts = plan.expert_counts + e * chunks;
  int* offsets = plan.expert_offsets + e * chunks;
  int carry = seg;
  for (int step = 0; step < chunks; step += kOffsetsThreads * kOffsetsItems) {
    const int first = step + static_cast<int>(threadIdx.x) * kOffsetsItems;
    int n[kOffsetsItems];
#pragma unroll
    for (int u = 0; u < kOffsetsItems; ++u) n[u] = first + u < chunks ? counts[first + u] : 0;
    int mine = 0;
#pragma unroll
    for (int u = 0; u < kOffsetsItems; ++u) mine += n[u];
    int prefix = 0, step_rows = 0;
    Scan(tmp.scan).ExclusiveSum(mine, prefix, step_rows);
    __syncthreads();  // tmp is reused by the next step
    int running = carry + prefix;
#pragma unroll
    for (int u = 0; u < kOffsetsItems; ++u) {
      if (first + u < chunks) offsets[first + u] = running;
      running += n[u];
    }
    carry += step_rows;
  }
  const int real_end = carry;  // seg + the expert's rows
  // The segments came from expert_rows, the rows from the chunk counts: they agree unless
  // expert_rows was not zeroed before the count kernel (then segments would overlap or leave
  // unwritten gaps: an error, never a wrong schedule presented as right).
  if (threadIdx.x == 0 && real_end - seg != plan.expert_rows[e])
    report_error(p.error, kScheduleMismatch, p.first_rank + d, 0, e, real_end - seg);
  // (Bounded by the capacity too: after a mismatch the chunk counts may reach past it, and
  // the error is the news, not a write past the buffers.)
  const int padded_end = min(seg + padded(real_end - seg), p.capacity_rows);
  for (int r = real_end + threadIdx.x; r < padded_end; r += kOffsetsThreads) plan.rows[r] = make_int2(-1, -1);
  // (Padding follows the expert's rows: row 64 past them means rows 64..127 are padding.)
  for (int tile = seg / kTileM + threadIdx.x; tile < padded_end / kTileM; tile += kOffsetsThreads)
    plan.block_expert[tile] = e | (tile * kTileM + kTileM / 2 >= real_end ? kTileUpperHalfPadding : 0);
}

// Scatter block `block` of ceil(chunks / kScheduleWarps); `next_all`: per warp, Q ints.
// Each warp writes its chunk's rows in stream order: the lanes holding the same expert are
// ranked by lane (match_any), 32 ids at a time. A warp's next row per destination expert
// starts at the chunk's offsets, all loaded before the loop (which then reads no global
// memory; with the offsets read per id, each of its steps waited on a global load), or
// kNoRows for a rank over capacity (kNoRows plus at most a chunk of rows stays negative:
// nothing is written).
constexpr int kNoRows = INT_MIN / 2;

template <int kChunk>
__device__ __forceinline__ void scatter_block(const ScheduleParams& p, int block, int* next_all) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int chunk = block * kScheduleWarps + warp;
  if (chunk >= p.chunks) return;
  const int E = p.local_experts, Q = p.num_ranks * E;
  const StreamChunk c = stream_chunk<kChunk>(p, chunk);
  const unsigned per = static_cast<unsigned>(p.tokens) * p.top_k;
  const unsigned lanes_below = (1u << lane) - 1;
  // The ids first, so that their loads and the offsets' are in flight together.
  const OneSource o = one_source(p, c);
  int ids[kChunk / 32];
  load_chunk(p, c, o, lane, ids);
  int* next_row = next_all + warp * Q;
  for (int q = lane; q < Q; q += 32) {
    const RankPlan& plan = p.plans[q / E];
    next_row[q] = *plan.num_row_tiles > 0 ? plan.expert_offsets[(q % E) * p.chunks + chunk] : kNoRows;
  }
  __syncwarp();
#pragma unroll
  for (int i = 0; i < kChunk / 32; ++i) {
    const int q = local_destination(p, ids[i]);
    // Most steps of a slice's chunk hold no row of its experts (1 id in 64 on the Qwen3.5
    // slice): they skip the match, a slow instruction (a match per 32 ids in the count
    // kernel's validation made that kernel 1.7x slower).
    if (__ballot_sync(0xffffffffu, q >= 0) == 0) continue;
    // (One source: the slot without a division.)
    const StreamPos pos = o.src >= 0 ? StreamPos{o.src, o.slot0 + 32 * i + lane}
                                     : stream_pos(c.begin + 32u * i + lane, per);
    const unsigned peers = __match_any_sync(0xffffffffu, q);
    const int before = __popc(peers & lanes_below);
    if (q >= 0) {
      const int row = next_row[q] + before;
      // (row < capacity: the offsets came from chunk counts that, after a mismatch the offsets
      // kernel reported, may reach past the rows buffer.)
      if (row >= 0 && row < p.capacity_rows) p.plans[q / E].rows[row] = make_int2(pos.src, pos.slot);
    }
    __syncwarp();
    if (q >= 0 && before == 0) next_row[q] += __popc(peers);
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
// in plan_order.h, written at its closed-form offset, run by run (plan_group_runs): lane l
// writes a run's items l, l + 32, ..., so each warp store is 32 consecutive entries and a
// group of ~600 tasks (the Qwen3.5 slice's band of 12 row tiles) takes ~20 steps per lane.
// (Every lane walking every item of the group, storing its own, took ~30k cycles on the
// slice: the scatter+plan kernel's long pole.)
constexpr int kPlanGroupsPerBlock = 256 / 32;

// A routed task with its tile's local expert and whether its rows 64..127 are all padding
// (Task), both from the word the offsets kernel wrote for the tile (block_expert).
__device__ __forceinline__ Task routed_task(const PlanParams& p, std::uint32_t kind, int rank, int col, int tile) {
  const int word = p.plans[rank].block_expert[tile];
  if (word & kTileUpperHalfPadding) kind |= kUpperHalfPadding;
  return Task::make(kind, rank, word & ~kTileUpperHalfPadding, col, tile);
}

// `error`: what the schedule's earlier kernels recorded. After any error (a rank over its
// capacity, a bad id, segments that disagree with their counts) the plan lists no routed
// work: the rows may have gaps nothing wrote, and y is poisoned anyway.
__device__ __forceinline__ void plan_block(const PlanParams& p, int block, const DeviceError* error) {
  const int g = block * kPlanGroupsPerBlock + static_cast<int>(threadIdx.x / 32);
  const int lane = threadIdx.x % 32;
  const bool failed = static_cast<const volatile DeviceError*>(error)->code != kOk;
  auto row_tiles = [&](int d) { return failed ? 0 : *p.plans[d].num_row_tiles; };
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
  plan_group_runs(
      p.shape, g, row_tiles,
      [&](std::uint32_t kind, int d, int s, int cols, int lo, int hi) {
        const int items = run_tasks(p.shape, cols, hi - lo);
        for (int i = lane; i < items; i += 32)
          run_item(kind, d, s, cols, lo, hi, i, [&](std::uint32_t k, int rank, int sh, int n, int t) {
            const std::uint32_t base_kind = k & 3;  // (without kPhantom)
            tasks[i] = base_kind == kRoutedGateUp || base_kind == kRoutedDown ? routed_task(p, k, rank, n, t)
                                                                              : Task::make(k, rank, sh, n, t);
          });
        tasks += items;
      },
      [&](int d, int lo, int hi) {
        for (int t = lo + lane; t < hi; t += 32) pulls[t - lo] = make_int2(d, t);
        pulls += hi - lo;
      });
}

// grid plan_blocks + the scatter's blocks, kScheduleThreads: blocks below plan_blocks write the
// task and pull lists, the rest scatter the rows. The plan needs only the row-tile counts and
// the tiles' experts (written by the offsets kernel), not the rows, so it runs beside the scatter instead of
// after it: one launch and the plan's time off the chain before the megakernel. (Plan
// blocks first, so they start in the first wave even when the scatter's shared memory
// takes more than one.) Dynamic smem: per scatter warp, its next row per destination expert.
struct ScatterPlanParams {
  ScheduleParams schedule;
  PlanParams plan;
  int plan_blocks;
};

static_assert(kScheduleThreads == 32 * kPlanGroupsPerBlock, "the plan's blocks are the scatter's size");
template <int kChunk>
__global__ void __launch_bounds__(kScheduleThreads, schedule_blocks_per_sm(kChunk))
    schedule_scatter_plan_kernel(const ScatterPlanParams p) {
  wait_previous_kernel();
  // The megakernel's CTAs may take the SMs this grid leaves free at once (one CTA per SM;
  // they all become resident as this grid's blocks exit).
  allow_next_kernel_launch();
  extern __shared__ int scatter_smem[];
  const int block = static_cast<int>(blockIdx.x);
  if (block < p.plan_blocks)
    plan_block(p.plan, block, p.schedule.error);
  else
    scatter_block<kChunk>(p.schedule, block - p.plan_blocks, scatter_smem);
}

// The count and the scatter+plan kernel for a chunk of `chunk` ids (kScheduleChunkSmall or
// kScheduleChunkLarge).
using ScheduleKernel = void (*)(ScheduleParams);
using ScatterPlanKernel = void (*)(ScatterPlanParams);
inline ScheduleKernel count_kernel(int chunk) {
  return chunk == kScheduleChunkSmall ? schedule_count_kernel<kScheduleChunkSmall>
                                      : schedule_count_kernel<kScheduleChunkLarge>;
}
inline ScatterPlanKernel scatter_plan_kernel(int chunk) {
  return chunk == kScheduleChunkSmall ? schedule_scatter_plan_kernel<kScheduleChunkSmall>
                                      : schedule_scatter_plan_kernel<kScheduleChunkLarge>;
}

}  // namespace mok::cuda
