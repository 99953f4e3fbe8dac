// mok: how the layer is run (tuning), kept apart from what it computes (Problem).
// Zero means "the library chooses" from the problem and the GPU; a Layer's config() holds
// the values it chose.
#pragma once
#include <string>

#include "mok/problem.h"

namespace mok {

// Communication SMs a config may ask for (validate): above every GPU's SM count, so the
// backend's own check against the GPU names the rule, and small enough that sums of CTA
// counts stay in an int.
constexpr int kMaxCommSms = 1024;

struct Config {
  // MoK's overlap granularity (rows per readiness group). Validated only, for now: mok's
  // CUDA forward tracks readiness per 128-row tile; macrobatch_rows must be a multiple of it.
  int minibatch_rows = 4096;
  int macrobatch_rows = 131072;          // rows held at once in the row-buffer ring
  // Rows a rank's schedule may hold: mean + factor * (worst - mean), plus each expert's
  // padding, where mean = T*k (balanced routing) and worst = R*T*min(k, E/R) (every token
  // routed here). 1.0 covers every routing; more rows than capacity is an error, never a drop.
  double schedule_capacity_factor = 0.5;
  int forward_comm_sms = 0;              // 0: chosen by the library (MoK uses 40 on GB300)
  int backward_comm_sms = 0;             // 0: chosen by the library (MoK uses 28)
  int tile_rows = 128;                   // each expert's row segment is padded to this
  // Compute-task order (CUDA): row tiles are taken in bands of this many, and within a band
  // column by column, so CTAs running at once share weight tiles in L2 instead of each
  // streaming its own from HBM. 0: chosen by the library (4 when an expert's gate/up
  // weights fit in a quarter of L2, else 12; 8 with task_pairs); 1: row tile by row tile.
  int task_band_tiles = 0;
  // Compute SMs in 2-CTA clusters running task pairs (CUDA): two row tiles of one expert and
  // column load the weight tile once, each CTA a half, multicast to both (half the weight
  // traffic through L2). Implies bands (8 unless task_band_tiles says). Off by default:
  // on the H200 it was slower than bands alone (Qwen3.5 slice 1.23 vs 1.15 ms).
  bool task_pairs = false;

  void validate() const;                 // throws mok::Error naming the field
  std::string describe() const;
};

// Rows the schedule of one rank may hold: the capacity with every expert's segment padded.
std::int64_t schedule_capacity_rows(const Problem& problem, const Config& config);

}  // namespace mok
