// mok: the order of the megakernel's work (compute tasks and row pulls) and a task's packed
// encoding (Task), as plain integer logic shared by the device (the plan blocks of
// schedule_scatter_plan_kernel, the megakernel) and the host (choosing band and lag, and the
// CPU tests that check the order's counts, coverage and dependencies, and the encoding).
//
// Groups g = 0, 1, ... each cover the band of row tiles [g*band, (g+1)*band). In a group,
// for each computed rank d: the shared experts' gate/up tiles of the band, the pulls of the
// band's routed row tiles, their gate/up tiles, then the down tiles (shared, routed) of band
// g - lag. Within a band the order is column by column (for n: for row tile), so CTAs that
// claim consecutive tasks read the same weight tile at about the same time (one HBM read,
// the rest L2 hits). The lag lets a band's gate/up tiles finish before its down tiles are
// taken. What must stay true (tests/test_plan_order.cpp):
//   - a gate/up tile's pull is in its own group or earlier, a down tile comes after every
//     gate/up tile of its row tile, so the lowest unfinished item can always progress;
//   - when the row ring wraps, a pull waits for the down tiles of the tile one ring earlier,
//     which must be in an earlier group: ring_tiles / band > lag (choose_band_and_lag).
#pragma once
#include <algorithm>
#include <cstdint>

#if defined(__CUDACC__)
#define MOK_PLAN_HD __host__ __device__ __forceinline__
#else
#define MOK_PLAN_HD inline
#endif

namespace mok::cuda {

enum TaskKind : std::uint32_t { kRoutedGateUp = 0, kRoutedDown = 1, kSharedGateUp = 2, kSharedDown = 3 };
// Or-ed into a kind: the second task of a pair that only repeats the first (odd counts in
// pair mode); it is computed for the pair's lockstep and its results are not stored.
constexpr std::uint32_t kPhantom = 8;

constexpr int kMaxShared = 8;

// A compute task, packed: kind 2 bits | upper-half padding 1 | phantom 1 | rank 12 | expert
// 12 | column tile 12 | row tile 24. The expert field holds a routed tile's local expert (the
// plan kernel copies it from RankPlan::block_expert) or a shared tile's shared expert, and
// the padding bit says that rows 64..127 of a routed tile are all padding (half tiles): the
// producer reads neither from global memory between two tasks. (The backend refuses shapes
// with more column tiles than the field holds; local experts are at most kScheduleMaxExperts
// = 4096 and row tiles fewer than 2^24, the capacity being fewer than 2^31 rows.)
constexpr int kMaxColumnTiles = 1 << 12;
constexpr int kMaxTaskExperts = 1 << 12;
constexpr std::uint32_t kUpperHalfPadding = 4;  // (or-ed into a kind, as kPhantom)
// Or-ed into RankPlan::block_expert[tile] by the offsets kernel: the tile's rows 64..127 are
// all padding (the plan kernel turns it into kUpperHalfPadding).
constexpr int kTileUpperHalfPadding = 1 << 30;
static_assert(kTileUpperHalfPadding >= kMaxTaskExperts, "block_expert: the flag is above every expert");
static_assert((kPhantom & kUpperHalfPadding) == 0 && (kPhantom | kUpperHalfPadding) < 16 && kSharedDown < 4,
              "Task: kind, padding and phantom bits share the low 4 bits");
static_assert(kMaxShared <= kMaxTaskExperts, "Task: a shared index fits the expert field");
struct Task {
  std::uint64_t bits;
  // `kind` may carry kPhantom and kUpperHalfPadding; `expert`: local expert (routed kinds) or
  // shared expert index (shared kinds).
  MOK_PLAN_HD static Task make(std::uint32_t kind, std::uint32_t rank, std::uint32_t expert,
                                       std::uint32_t col_tile, std::uint32_t row_tile) {
    return Task{std::uint64_t(kind) | (std::uint64_t(rank) << 4) | (std::uint64_t(expert) << 16) |
                (std::uint64_t(col_tile) << 28) | (std::uint64_t(row_tile) << 40)};
  }
  MOK_PLAN_HD std::uint32_t kind() const { return bits & 0x3; }
  MOK_PLAN_HD bool phantom() const { return (bits & kPhantom) != 0; }  // pair mode: compute, store nothing
  MOK_PLAN_HD bool upper_half_padding() const { return (bits & kUpperHalfPadding) != 0; }
  MOK_PLAN_HD std::uint32_t rank() const { return (bits >> 4) & 0xfff; }
  MOK_PLAN_HD std::uint32_t expert() const { return (bits >> 16) & 0xfff; }  // routed kinds
  MOK_PLAN_HD std::uint32_t shared() const { return (bits >> 16) & 0xfff; }  // shared kinds
  MOK_PLAN_HD std::uint32_t col_tile() const { return (bits >> 28) & 0xfff; }
  MOK_PLAN_HD std::uint32_t row_tile() const { return static_cast<std::uint32_t>(bits >> 40); }
  // The bits that name a task's weight tile: all but the row tile, phantom and padding bits.
  static constexpr std::uint64_t kWeightTileBits =
      ((std::uint64_t(1) << 40) - 1) & ~std::uint64_t(kPhantom | kUpperHalfPadding);
  // Whether the two tasks read the same B tile (weights): same kind, rank, expert (routed or
  // shared) and column. (Pair mode: the two CTAs then share it by multicast.)
  MOK_PLAN_HD bool same_weight_tile(Task other) const {
    return (bits & kWeightTileBits) == (other.bits & kWeightTileBits);
  }
};

// What the order depends on. Row tiles of computed rank d: row_tiles[d] (device-built).
struct PlanShape {
  int num_ranks, num_shared;
  int shared_tiles;                       // ceil(T / 128) when there are shared experts, else 0
  int shared_gateup_tiles[kMaxShared];    // ceil(I_s / 128)
  int gateup_tiles, down_tiles;           // routed, per row tile: ceil(I / 128), ceil(H / 256)
  int band, lag;
  int pairs;                              // 1: tasks go in pairs (2-CTA clusters), see plan_group
};

MOK_PLAN_HD int plan_min(int a, int b) { return a < b ? a : b; }
MOK_PLAN_HD int plan_max(int a, int b) { return a > b ? a : b; }

// Tasks of one (kind, rank, shared expert) run over `rows` row tiles: in pair mode rounded up
// to even (a phantom completes an odd run), so a pair never mixes kinds or K depths.
MOK_PLAN_HD int run_tasks(const PlanShape& p, int cols, int rows) {
  const int n = cols * rows;
  return p.pairs ? n + (n & 1) : n;
}

// Item i of the run (kind, rank d, shared s, cols, [lo, hi)), 0 <= i < run_tasks(p, cols,
// hi - lo), to task(kind, d, s, col, row_tile): column by column, and the phantom last (the
// rule plan_group_runs states).
template <typename EmitTask>
MOK_PLAN_HD void run_item(std::uint32_t kind, int d, int s, int cols, int lo, int hi, int i, EmitTask task) {
  const int rows = hi - lo;
  if (i == cols * rows) {
    task(kind | kPhantom, d, s, cols - 1, hi - 1);
    return;
  }
  const int n = i / rows;
  task(kind, d, s, n, lo + i - n * rows);
}

// Emits group g's order as runs: run(kind, rank, shared, cols, lo, hi) stands for the tasks
// (kind, rank, shared, n, t) for n in [0, cols), t in [lo, hi), n outer (column by column),
// and in pair mode, when their count is odd, one more: (kind | kPhantom, rank, shared,
// cols - 1, hi - 1); pulls(rank, lo, hi) stands for pulls (rank, t), t in [lo, hi). A run is
// a closed-form range, so the device writes one with every lane of a warp at once.
template <typename RowTiles, typename EmitRun, typename EmitPulls>
MOK_PLAN_HD void plan_group_runs(const PlanShape& p, int g, RowTiles row_tiles, EmitRun run, EmitPulls pulls) {
  auto band_run = [&](std::uint32_t kind, int d, int s, int cols, int band, int limit) {
    const int lo = band * p.band, hi = plan_min(lo + p.band, limit);
    if (hi > lo) run(kind, d, s, cols, lo, hi);
  };
  const int lagged = g - p.lag;
  for (int d = 0; d < p.num_ranks; ++d) {
    const int m = row_tiles(d);
    for (int s = 0; s < p.num_shared; ++s) band_run(kSharedGateUp, d, s, p.shared_gateup_tiles[s], g, p.shared_tiles);
    if (g * p.band < m) pulls(d, g * p.band, plan_min((g + 1) * p.band, m));
    band_run(kRoutedGateUp, d, 0, p.gateup_tiles, g, m);
    if (lagged >= 0) {
      for (int s = 0; s < p.num_shared; ++s) band_run(kSharedDown, d, s, p.down_tiles, lagged, p.shared_tiles);
      band_run(kRoutedDown, d, 0, p.down_tiles, lagged, m);
    }
  }
}

// Group g's tasks (task(kind, rank, shared, col, row_tile)) and pulls (pull(rank, row_tile))
// one by one: plan_group_runs expanded.
// Pair mode: consecutive tasks 2i, 2i+1 of the list run together on a 2-CTA cluster; within a
// band they are the same column of two row tiles (same weight tile when the rows are of one
// expert: loaded once, multicast to both).
template <typename RowTiles, typename EmitTask, typename EmitPull>
MOK_PLAN_HD void plan_group(const PlanShape& p, int g, RowTiles row_tiles, EmitTask task, EmitPull pull) {
  plan_group_runs(
      p, g, row_tiles,
      [&](std::uint32_t kind, int d, int s, int cols, int lo, int hi) {
        const int items = run_tasks(p, cols, hi - lo);
        for (int i = 0; i < items; ++i) run_item(kind, d, s, cols, lo, hi, i, task);
      },
      [&](int d, int lo, int hi) {
        for (int t = lo; t < hi; ++t) pull(d, t);
      });
}

struct PlanCount {
  int tasks, pulls;
};

// Tasks of one run type over the bands before g, for row tiles [0, X): the full bands, each
// `band` rows, and the last partial one (X % band rows) when g is past it.
MOK_PLAN_HD int runs_before(const PlanShape& p, int g, int X, int cols) {
  if (g <= 0 || X <= 0) return 0;
  const int full = plan_min(g, X / p.band), rest = X % p.band;
  return full * run_tasks(p, cols, p.band) + (g > X / p.band && rest ? run_tasks(p, cols, rest) : 0);
}

// Tasks and pulls of the groups before g, in closed form, so each group can be planned by its
// own thread.
template <typename RowTiles>
MOK_PLAN_HD PlanCount plan_prefix(const PlanShape& p, int g, RowTiles row_tiles) {
  const int lagged = plan_max(0, g - p.lag);
  PlanCount c{0, 0};
  for (int d = 0; d < p.num_ranks; ++d) {
    const int m = row_tiles(d);
    for (int s = 0; s < p.num_shared; ++s)
      c.tasks += runs_before(p, g, p.shared_tiles, p.shared_gateup_tiles[s]) +
                 runs_before(p, lagged, p.shared_tiles, p.down_tiles);
    c.tasks += runs_before(p, g, m, p.gateup_tiles) + runs_before(p, lagged, m, p.down_tiles);
    c.pulls += plan_min(g * p.band, m);
  }
  return c;
}

// Groups the order has: every band of the most row tiles any rank (or the shared experts)
// has, plus the lag for the last down tiles.
template <typename RowTiles>
MOK_PLAN_HD int plan_groups(const PlanShape& p, RowTiles row_tiles) {
  int max_tiles = p.shared_tiles;
  for (int d = 0; d < p.num_ranks; ++d) max_tiles = plan_max(max_tiles, row_tiles(d));
  return max_tiles > 0 ? (max_tiles + p.band - 1) / p.band + p.lag : 0;
}

struct BandAndLag {
  int band, lag;
};

// The band the library picks when Config::task_band_tiles is 0. A band reads each of its
// experts' weight tiles from HBM once (its row tiles take a column together); the next band
// of the same expert finds them again only if they stayed in L2. So: small bands (4) when an
// expert's gate/up weights fit in a quarter of L2 (they stay, and small bands keep the rows
// and tasks in flight few), 12 when they do not. Measured on the H200 (forward ms, band
// 4/8/12/16, 55275be): Qwen3-30B T=16384 (6.3 MB per expert) 2.56/2.59/2.61/2.62, T=4096
// 0.79/0.82/0.81/0.82; Qwen3.5 slice (16.8 MB) 1.126/1.089/1.067/1.063; DeepSeek-V4-Pro
// slice 3.36/3.25/3.18/3.18; GLM-5.2 slice 2.47/2.34/2.33/2.34; Kimi-K2.7 slice
// 2.84/2.73/2.73/2.73; gpt-oss-20b T=8192 3.09/2.96/2.95/2.95; Mixtral 4.93/4.71/4.78/4.74.
// Pairs share a weight tile only within a band of 2 or more row tiles: 8 with pairs.
inline long long expert_gateup_bytes(int hidden, int intermediate) {
  return 2LL * intermediate * hidden * 2;  // gate and up, bf16
}
inline int default_band_tiles(bool pairs, long long gateup_bytes, long long l2_bytes) {
  if (pairs) return 8;
  return 4 * gateup_bytes <= l2_bytes ? 4 : 12;
}

// Head pulls when Config leaves them to the library (dispatch_role says what they are): as
// many as there are CTAs that find no shared-expert gate/up tile to start on in the first
// group; they would otherwise wait for the communication CTAs' first row tiles, each pulled
// by one tile group at about half a CTA's rate. Without shared experts that is every CTA. At
// most one per CTA and none beyond the ring (a head pull never waits for a ring slot). Measured
// on the H200 (forward ms, no head pulls / 16 / 32 / 64 / 132, 2026-12-03): Qwen3.5 slice
// T=512 0.324-0.326 / 0.324-0.327 / 0.324-0.325 / 0.317-0.323 / 0.318-0.320, T=1024
// 0.576-0.577 / .573-.574 / .569-.570 / .565-.571 / .563-.569, T=2048 1.067-1.070 /
// 1.069-1.070 / 1.066 / 1.068-1.069 / 1.082-1.084; DeepSeek-V4-Pro slice T=512 0.976-0.977 /
// .966-.967 / .952-.961 / .960-.961 / .951-.961, T=2048 3.166-3.168 / 3.172 / 3.172-3.173 /
// 3.178-3.180 / 3.185-3.189; Kimi-K2.7 slice T=512 0.784-0.800 / .782-.784 / .765-.771 /
// .769-.772 / .770-.771. (This rule gives 41 (every pull), 68, 36, 36, 0 and 68 of them.)
inline int default_head_pulls(const PlanShape& p, int grid_ctas, int ring_tiles) {
  int shared_first = 0;  // the shared experts' gate/up tasks of group 0, every computed rank's
  for (int s = 0; s < p.num_shared; ++s)
    shared_first += p.num_ranks * std::min(p.band, p.shared_tiles) * p.shared_gateup_tiles[s];
  return std::clamp(grid_ctas - shared_first, 0, std::min(grid_ctas, ring_tiles));
}

// The wrapping ring's rule (see the top of this file): a pull that waits for the down tiles
// of the tile one ring earlier finds them in an earlier group only if ring / band > lag.
inline bool ring_allows_lag(int band, int lag, int ring_tiles, bool ring_wraps) {
  return !ring_wraps || ring_tiles / band > lag;
}

// Host: the band (asked for, or 1) and the lag in groups. While one task runs about 2.5x the
// compute CTAs' worth of tasks are claimed (a gate/up tile costs about two average tasks), so
// a row tile's down tiles go that many tasks after its gate/up tiles. With a wrapping ring
// the band shrinks until ring_tiles / band > lag (for band 1: lag <= ring_tiles - 1).
inline BandAndLag choose_band_and_lag(int asked_band, int compute_ctas, int gateup_tiles, int down_tiles,
                                      int ring_tiles, bool ring_wraps) {
  const int per_tile = gateup_tiles + down_tiles;
  const int lag_tiles = (5 * compute_ctas + 2 * per_tile - 1) / (2 * per_tile);
  BandAndLag r{std::max(1, asked_band), 0};
  for (;;) {
    r.lag = (lag_tiles + r.band - 1) / r.band + 1;
    if (r.band == 1) r.lag = std::max(0, std::min(r.lag, ring_tiles - 1));
    if (r.band == 1 || ring_allows_lag(r.band, r.lag, ring_tiles, ring_wraps)) return r;
    --r.band;
  }
}

}  // namespace mok::cuda
