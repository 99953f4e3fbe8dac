// mok: the MOK_* environment variables the CUDA backend reads to A/B its kernels on the
// device (not public API, not Config: they exist to measure one design against another and
// to inject a test fault). One list, so that the backend's readers (src/cuda/backend.cu) and
// `mok bench`, which records every one that is set beside its numbers (tools/mok/bench.cpp),
// cannot drift apart: a reader names its variable by this enum, never by a string.
#pragma once

namespace mok {

enum class TuningEnv : int {
  kStoreWarp,        // MOK_STORE_WARP: the megakernel's store warp (default on)
  kHalfTiles,        // MOK_HALF_TILES: padding halves of routed tiles skipped (default on)
  kCommJoin,         // MOK_COMM_JOIN: communication CTAs join the compute (default on)
  kCooperative,      // MOK_COOPERATIVE: cooperative megakernel launch (default off)
  kPullAhead,        // MOK_PULL_AHEAD: loads each pull pipeline keeps ahead of its stores
  kPullGroups,       // MOK_PULL_GROUPS: row tiles a communication CTA pulls at once
  kHeadPulls,        // MOK_HEAD_PULLS: head pulls on every CTA / none / the default rule
  kHeadPullTiles,    // MOK_HEAD_PULL_TILES: exactly this many head pulls
  kTaskLag,          // MOK_TASK_LAG: bands between a band's gate/up and its down tiles
  kGatherLocal,      // MOK_GATHER_LOCAL: one rank's routed rows copied from x, not pulled (default: I <= 4096)
  kWaitTimeoutMs,    // MOK_WAIT_TIMEOUT_MS: the cross-CTA spin-wait limit
  kGroupStartMs,     // MOK_GROUP_START_TIMEOUT_MS: how long a rank waits for its NCCL group to form (and its peers' destroys)
  kTestFault,        // MOK_TEST_FAULT: lose_staging_read, abandoned_group or abandon_at_destroy, each for its test
  kCount
};

// A switch, not an array indexed by the enum: a knob added without a name is a -Wswitch
// warning, and no reordering can give a knob another's name.
constexpr const char* tuning_env_name(TuningEnv v) {
  switch (v) {
    case TuningEnv::kStoreWarp: return "MOK_STORE_WARP";
    case TuningEnv::kHalfTiles: return "MOK_HALF_TILES";
    case TuningEnv::kCommJoin: return "MOK_COMM_JOIN";
    case TuningEnv::kCooperative: return "MOK_COOPERATIVE";
    case TuningEnv::kPullAhead: return "MOK_PULL_AHEAD";
    case TuningEnv::kPullGroups: return "MOK_PULL_GROUPS";
    case TuningEnv::kHeadPulls: return "MOK_HEAD_PULLS";
    case TuningEnv::kHeadPullTiles: return "MOK_HEAD_PULL_TILES";
    case TuningEnv::kTaskLag: return "MOK_TASK_LAG";
    case TuningEnv::kGatherLocal: return "MOK_GATHER_LOCAL";
    case TuningEnv::kWaitTimeoutMs: return "MOK_WAIT_TIMEOUT_MS";
    case TuningEnv::kGroupStartMs: return "MOK_GROUP_START_TIMEOUT_MS";
    case TuningEnv::kTestFault: return "MOK_TEST_FAULT";
    case TuningEnv::kCount: break;
  }
  return "MOK_?";
}

}  // namespace mok
