// mok: what the forward kernels share, host and device: tile shapes, task encoding, and the
// per-rank plan (every buffer a rank's work touches). The host fills these once per layer
// (buffers) and per call (weight tensor maps); the device fills the schedule parts.
#pragma once
#include <cuda.h>
#include <cuda_bf16.h>

#include <cstdint>

#include "cuda/common.cuh"
#include "cuda/plan_order.h"

namespace mok::cuda {

// GEMM tiles. Every task is a 128-row tile; gate/up tiles cover 128 columns of I for both
// gate and up (one 256-wide wgmma), down tiles 256 columns of H. K advances 64 at a time
// (one 128-byte swizzled row per tile row).
constexpr int kTileM = 128;
constexpr int kGateUpCols = 128;
constexpr int kDownCols = 256;
constexpr int kTileK = 64;
constexpr int kBHalfRows = 128;  // B tiles load as two 128-row boxes (one per CTA of a pair)
constexpr int kStages = 3;
constexpr int kComputeThreads = 384;  // WG0 producer, WG1-2 consumers (one m64 half each)
constexpr int kAlignRule = 64;        // H, I and shared widths must be multiples of this

constexpr int kStageABytes = kTileM * kTileK * 2;     // 16 KiB
constexpr int kStageBBytes = kDownCols * kTileK * 2;  // 32 KiB (gate 128 rows + up 128 rows)
constexpr int kStageBytes = kStageABytes + kStageBBytes;
constexpr int kStagingPitch = kDownCols + 8;          // bf16 per staging row (+16 B: no bank conflicts)
constexpr int kStagingBytes = kTileM * kStagingPitch * 2;
// Gather mode (ForwardParams::gather_local): the current routed gate/up tile's rows' byte offsets in x.
constexpr int kGatherTableBytes = kTileM * 4;
constexpr int kBarrierAreaBytes = 256;  // the compute CTA's barriers, task ring and store job (megakernel.cuh)
constexpr int kSmemBytes =
    1024 /*align slack*/ + kStages * kStageBytes + kStagingBytes + kBarrierAreaBytes + kGatherTableBytes;


// One shared expert of one rank.
struct SharedPlan {
  __nv_bfloat16* act;   // [T, I_s] SwiGLU output
  __nv_bfloat16* out;   // [T, H] expert output
  int* act_ready;       // [ceil(T/128)] gate/up tiles finished per row tile
  int width;            // I_s
  int gateup_tiles;     // ceil(I_s / 128)
};


// Tensor maps of one rank (in device global memory, 64-byte aligned).
struct RankMaps {
  CUtensorMap ring;        // [ring_rows, H] pulled x rows          box 64 x 128
  CUtensorMap act;         // [ring_rows, I] SwiGLU rows             box 64 x 128
  CUtensorMap x_staged;    // [T, H] this rank's staged x            box 64 x 128
  CUtensorMap w_gate;      // [E_loc*I, H]                           box 64 x 128
  CUtensorMap w_up;        // [E_loc*I, H]                           box 64 x 128
  CUtensorMap w_down;      // [E_loc*H, I]                           box 64 x 128 (two per tile)
  CUtensorMap shared_w_gate[kMaxShared];  // [I_s, H]                box 64 x 128
  CUtensorMap shared_w_up[kMaxShared];    // [I_s, H]                box 64 x 128
  CUtensorMap shared_w_down[kMaxShared];  // [H, I_s]                box 64 x 128 (two per tile)
  CUtensorMap shared_act[kMaxShared];     // [T, I_s]                box 64 x 128
};

// Per-rank state of one forward. Schedule fields are written by the schedule kernels.
struct RankPlan {
  // Schedule (device-built): rows in MoK's order, padded per expert to 128.
  int2* rows;              // [capacity] (src_rank, slot = t*k + j); (-1, -1) for padding
  int* block_expert;       // [capacity / 128] local expert of each row tile, | kTileUpperHalfPadding
  int* num_row_tiles;      // [1] padded rows / 128 (0 after a capacity error)
  int* expert_counts;      // [E_loc * chunks] rows per (expert, source chunk)
  int* expert_offsets;     // [E_loc * chunks] first row of each (expert, source chunk)
  int* expert_rows;        // [E_loc] rows per local expert (count kernel's atomics; zeroed before each forward)
  // Readiness counters, zeroed before each forward.
  int* rows_ready;         // [capacity / 128] 1 when the tile's rows are in the ring
  int* act_ready;          // [capacity / 128] gate/up tiles done
  int* down_done;          // [capacity / 128] down tiles done (frees the ring slot)
  int* half_tile_tasks;    // [1] routed tasks computed by one consumer warpgroup (half tiles)
  // Buffers.
  __nv_bfloat16* ring;     // [ring_rows, H]
  __nv_bfloat16* act;      // [ring_rows, I]
  __nv_bfloat16* x_staged; // [T, H] symmetric copy of this rank's x
  __nv_bfloat16* combine;  // [T*k, H] this rank's combine slots (written by every rank)
  const float* router_weights;  // [T, k]
  SharedPlan shared[kMaxShared];
};

// Deliberate faults for the tests that prove a stuck wait is reported (MOK_TEST_FAULT).
enum TestFault : int {
  kNoFault = 0,
  kFaultLoseStagingRead = 1,  // the store warp never says it has read the staging tile
  kFaultAbandonedGroup = 2,   // the layer's abandoned word is set from the start (any EP mode)
  kFaultAbandonAtDestroy = 3, // distributed: the rank abandons its group as its layer's destroy starts
};

// Everything the megakernel reads, by value (__grid_constant__).
struct ForwardParams {
  int ep_size, tokens, hidden, inter, top_k, local_experts, num_shared;
  int capacity_rows, ring_tiles;           // ring_tiles = ring_rows / 128
  int first_rank, num_ranks;               // the ranks computed here (virtual: all; slice: one)
  int num_comm_ctas;
  int gateup_tiles, down_tiles;            // per routed row tile: ceil(I/128), ceil(H/256)
  float swiglu_limit;                      // <= 0: no clamp
  std::uint64_t timeout_ns;
  const __nv_bfloat16* const* x_source;    // [R] where row pulls read each source rank's x
  const __nv_bfloat16* zero_row;           // [H] zeros: the source of padding rows
  __nv_bfloat16* const* combine_of;        // [R] each rank's combine slots
  RankPlan* plans;                         // [num_ranks]
  const RankMaps* maps;                    // [num_ranks]
  const Task* tasks;                       // compute tasks in dependency order
  const int* num_tasks;                    // [1]
  const int2* pulls;                       // (rank index, row tile) in dependency order
  const int* num_pulls;                    // [1]
  int* task_counter;                       // next compute task to claim (zeroed per forward)
  int ring_wraps;                          // ring_tiles < capacity tiles: pulls wait for free slots
  int pull_ahead;                          // dispatch: loads ahead per pipeline (0: half its slots)
  int pull_groups;                         // dispatch: row tiles a communication CTA pulls at once past the head
  int pairs;                               // compute CTAs run task pairs as 2-CTA clusters (plan_order.h)
  int store_warp;                          // a warp of warpgroup 0 sends the staged tiles (megakernel.cuh)
  int comm_join;                           // communication CTAs become compute CTAs once their pulls are done
  int* comm_started;                       // communication CTAs started so far (comm_join; zeroed per forward)
  int* comm_joined;                        // communication CTAs that went on to compute (ScheduleStats, tests)
  int head_pulls;                          // pulls [0, head_pulls) are claimed by every CTA at its start (0: none)
  int* head_counter;                       // next head pull to claim (zeroed per forward)
  int half_tiles;                          // routed tiles with rows 64.. all padding: one consumer warpgroup computes
  // One rank whose every row is local (EP = 1): routed gate/up tiles read their rows straight
  // from x (warps 2-3's cp.async copies, gather_loop), nothing is pulled and every CTA computes.
  int gather_local;
  int test_fault;                          // TestFault: a deliberate bug for the timeout tests (0: none)
  PhaseWaitTrap* phase_trap;               // host-mapped record of a timed-out phase wait (nullptr: none)
  int* phase_trap_claim;                   // device flag: who writes that record
  unsigned phase_wait_units;               // phase-wait limit, units of 2^20 ns (0: none)
  DeviceError* error;
};

}  // namespace mok::cuda
