// The megakernel's work order (src/cuda/plan_order.h), checked on the CPU: the closed-form
// offsets each device thread writes at, that every task and pull appears exactly once, that
// every task comes after what it waits for, and that a wrapping ring never makes a pull wait
// for later work (the order's deadlock freedom).
#include <gtest/gtest.h>

#include <map>
#include <random>
#include <set>
#include <tuple>
#include <vector>

#include "cuda/plan_order.h"

namespace mok::cuda {
namespace {

struct Item {
  int group;
  int index;  // position in its list (tasks or pulls)
};

using TaskKey = std::tuple<std::uint32_t, int, int, int, int>;  // kind, rank, shared, col, row tile

struct Order {
  std::vector<int> group_tasks, group_pulls;  // per group
  std::map<TaskKey, Item> tasks;              // real tasks (phantoms apart)
  std::vector<TaskKey> sequence;              // every task in order, phantoms included
  std::map<std::pair<int, int>, Item> pulls;
  int duplicates = 0;
};

Order build(const PlanShape& p, const std::vector<int>& rows) {
  auto row_tiles = [&](int d) { return rows[d]; };
  Order o;
  int ti = 0, pi = 0;
  const int groups = plan_groups(p, row_tiles);
  for (int g = 0; g < groups; ++g) {
    int nt = 0, np = 0;
    plan_group(
        p, g, row_tiles,
        [&](std::uint32_t kind, int d, int s, int n, int t) {
          o.sequence.emplace_back(kind, d, s, n, t);
          if (!(kind & kPhantom)) o.duplicates += !o.tasks.emplace(TaskKey{kind, d, s, n, t}, Item{g, ti}).second;
          ++ti;
          ++nt;
        },
        [&](int d, int t) {
          o.duplicates += !o.pulls.emplace(std::pair{d, t}, Item{g, pi++}).second;
          ++np;
        });
    o.group_tasks.push_back(nt);
    o.group_pulls.push_back(np);
  }
  return o;
}

struct Case {
  PlanShape shape;
  std::vector<int> rows;
};

Case random_case(std::mt19937& rng) {
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  Case c{};
  PlanShape& p = c.shape;
  p.num_ranks = pick(1, 4);
  p.num_shared = pick(0, 2);
  p.shared_tiles = p.num_shared > 0 ? pick(1, 20) : 0;
  for (int s = 0; s < p.num_shared; ++s) p.shared_gateup_tiles[s] = pick(1, 6);
  p.gateup_tiles = pick(1, 10);
  p.down_tiles = pick(1, 10);
  p.band = pick(1, 9);
  p.lag = pick(0, 6);
  p.pairs = pick(0, 1);
  for (int d = 0; d < p.num_ranks; ++d) c.rows.push_back(pick(0, 3) == 0 ? 0 : pick(1, 40));
  return c;
}

TEST(PlanOrder, ClosedFormOffsetsMatchTheGroupsBefore) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 300; ++trial) {
    const Case c = random_case(rng);
    auto row_tiles = [&](int d) { return c.rows[d]; };
    const Order o = build(c.shape, c.rows);
    PlanCount sum{0, 0};
    for (std::size_t g = 0; g <= o.group_tasks.size(); ++g) {
      const PlanCount closed = plan_prefix(c.shape, static_cast<int>(g), row_tiles);
      ASSERT_EQ(closed.tasks, sum.tasks) << "trial " << trial << " group " << g;
      ASSERT_EQ(closed.pulls, sum.pulls) << "trial " << trial << " group " << g;
      if (g < o.group_tasks.size()) {
        sum.tasks += o.group_tasks[g];
        sum.pulls += o.group_pulls[g];
      }
    }
  }
}

TEST(PlanOrder, EveryTaskAndPullExactlyOnce) {
  std::mt19937 rng(11);
  for (int trial = 0; trial < 300; ++trial) {
    const Case c = random_case(rng);
    const PlanShape& p = c.shape;
    const Order o = build(p, c.rows);
    ASSERT_EQ(o.duplicates, 0) << "trial " << trial;
    std::size_t tasks = 0, pulls = 0;
    for (int d = 0; d < p.num_ranks; ++d) {
      tasks += static_cast<std::size_t>(c.rows[d]) * (p.gateup_tiles + p.down_tiles);
      for (int s = 0; s < p.num_shared; ++s)
        tasks += static_cast<std::size_t>(p.shared_tiles) * (p.shared_gateup_tiles[s] + p.down_tiles);
      pulls += c.rows[d];
      for (int t = 0; t < c.rows[d]; ++t) {
        ASSERT_TRUE(o.pulls.count({d, t})) << "pull " << d << "," << t;
        for (int n = 0; n < p.down_tiles; ++n) ASSERT_TRUE(o.tasks.count({kRoutedDown, d, 0, n, t}));
      }
    }
    EXPECT_EQ(o.tasks.size(), tasks) << "trial " << trial;
    EXPECT_EQ(o.pulls.size(), pulls) << "trial " << trial;
  }
}

TEST(PlanOrder, EveryTaskComesAfterWhatItWaitsFor) {
  std::mt19937 rng(13);
  for (int trial = 0; trial < 300; ++trial) {
    const Case c = random_case(rng);
    const Order o = build(c.shape, c.rows);
    // Latest gate/up task per (rank, shared or routed, row tile), and its pull's group.
    std::map<std::tuple<int, int, int>, int> last_gateup;
    for (const auto& [key, item] : o.tasks) {
      const auto [kind, d, s, n, t] = key;
      if (kind == kRoutedGateUp) {
        const Item pull = o.pulls.at({d, t});
        ASSERT_LE(pull.group, item.group) << "gate/up before its rows are pulled";
      }
      if (kind == kRoutedGateUp || kind == kSharedGateUp) {
        const int fam = kind == kRoutedGateUp ? -1 : s;
        auto& last = last_gateup[{d, fam, t}];
        last = std::max(last, item.index);
      }
    }
    for (const auto& [key, item] : o.tasks) {
      const auto [kind, d, s, n, t] = key;
      if (kind == kRoutedDown || kind == kSharedDown) {
        const int fam = kind == kRoutedDown ? -1 : s;
        ASSERT_GT(item.index, last_gateup.at({d, fam, t})) << "a down tile before its row tile's gate/up tiles";
      }
    }
  }
}

TEST(PlanOrder, WrappingRingNeverWaitsForLaterWork) {
  // A pull of row tile t reuses the ring slot of tile t - ring and waits for all its down
  // tiles: they must come in an earlier group. choose_band_and_lag guarantees it, and so
  // does any lag ring_allows_lag accepts (MOK_TASK_LAG is checked by it).
  std::mt19937 rng(17);
  for (int trial = 0; trial < 300; ++trial) {
    Case c = random_case(rng);
    PlanShape& p = c.shape;
    const int ring = std::uniform_int_distribution<int>(1, 24)(rng);
    const int compute = std::uniform_int_distribution<int>(1, 130)(rng);
    const BandAndLag bl = choose_band_and_lag(p.band, compute, p.gateup_tiles, p.down_tiles, ring, true);
    p.band = bl.band;
    const int chosen_lag = bl.lag;
    ASSERT_TRUE(ring_allows_lag(p.band, chosen_lag, ring, true)) << "trial " << trial;
    const int other_lag = std::uniform_int_distribution<int>(0, ring / p.band - 1)(rng);
    ASSERT_TRUE(ring_allows_lag(p.band, other_lag, ring, true));
    ASSERT_FALSE(ring_allows_lag(p.band, ring / p.band, ring, true));
    for (const int lag : {chosen_lag, other_lag}) {
      p.lag = lag;
      const Order o = build(p, c.rows);
      for (int d = 0; d < p.num_ranks; ++d)
        for (int t = ring; t < c.rows[d]; ++t) {
          const int pull_group = o.pulls.at({d, t}).group;
          for (int n = 0; n < p.down_tiles; ++n)
            ASSERT_LT(o.tasks.at({kRoutedDown, d, 0, n, t - ring}).group, pull_group)
                << "trial " << trial << " ring " << ring << " band " << p.band << " lag " << p.lag;
        }
    }
  }
}

TEST(PlanOrder, PairsAreHomogeneousAndPhantomsRepeatTheirTwin) {
  std::mt19937 rng(19);
  for (int trial = 0; trial < 300; ++trial) {
    Case c = random_case(rng);
    c.shape.pairs = 1;
    const Order o = build(c.shape, c.rows);
    ASSERT_EQ(o.sequence.size() % 2, 0u) << "trial " << trial;
    for (std::size_t i = 0; i < o.sequence.size(); i += 2) {
      const auto [ka, da, sa, na, ta] = o.sequence[i];
      const auto [kb, db, sb, nb, tb] = o.sequence[i + 1];
      ASSERT_FALSE(ka & kPhantom) << "a pair starts with a real task";
      // Same kind, rank and shared expert: the two CTAs run the same K depth in lockstep.
      ASSERT_EQ(ka, kb & ~kPhantom) << "trial " << trial << " pair " << i / 2;
      ASSERT_EQ(da, db);
      ASSERT_EQ(sa, sb);
      if (kb & kPhantom) {
        ASSERT_EQ(std::tie(na, ta), std::tie(nb, tb)) << "a phantom repeats its twin";
      }
    }
  }
}

TEST(PlanOrder, BandAndLagChoices) {
  // No wrap: the band asked for is kept; the lag is counted in bands.
  BandAndLag r = choose_band_and_lag(8, 124, 8, 16, 1000, false);
  EXPECT_EQ(r.band, 8);
  EXPECT_EQ(r.lag, (13 + 7) / 8 + 1);  // ceil(5*124 / (2*24)) = 13 row tiles
  // Band 1 is row-tile order with the lag capped below the ring.
  r = choose_band_and_lag(1, 124, 1, 1, 4, true);
  EXPECT_EQ(r.band, 1);
  EXPECT_EQ(r.lag, 3);
  // A ring too small for the band shrinks it.
  r = choose_band_and_lag(8, 124, 8, 16, 12, true);
  EXPECT_LT(r.band, 8);
  EXPECT_TRUE(r.band == 1 || 12 / r.band > r.lag);
  // 0 (library default) means 1.
  EXPECT_EQ(choose_band_and_lag(0, 124, 8, 16, 1000, false).band, 1);
}

TEST(PlanOrder, DefaultBandFollowsWhetherAnExpertsWeightsStayInL2) {
  const long long l2 = 50LL << 20;  // the H200's 50 MiB
  // Qwen3-30B-A3B: 6.3 MB of gate/up weights per expert, a quarter of L2 holds them: small bands.
  EXPECT_EQ(default_band_tiles(false, expert_gateup_bytes(2048, 768), l2), 4);
  // Qwen3.5-397B-A17B (16.8 MB) and DeepSeek-V4-Pro (88 MB) do not stay: wide bands.
  EXPECT_EQ(default_band_tiles(false, expert_gateup_bytes(4096, 1024), l2), 12);
  EXPECT_EQ(default_band_tiles(false, expert_gateup_bytes(7168, 3072), l2), 12);
  // The boundary belongs to the small bands; pairs always take 8.
  EXPECT_EQ(default_band_tiles(false, l2 / 4, l2), 4);
  EXPECT_EQ(default_band_tiles(false, l2 / 4 + 1, l2), 12);
  EXPECT_EQ(default_band_tiles(true, expert_gateup_bytes(2048, 768), l2), 8);
  EXPECT_EQ(default_band_tiles(true, expert_gateup_bytes(7168, 3072), l2), 8);
}

// Head pulls by default: one per CTA that finds no shared gate/up tile in group 0, at most
// one per CTA, none past the ring. The shapes of the H200 sweep (132 CTAs, band 12).
TEST(PlanOrder, DefaultHeadPullsLeaveTheFirstSharedTilesToTheRest) {
  auto shape = [](int shared_tiles, std::vector<int> shared_cols, int ranks) {
    PlanShape p{};
    p.num_ranks = ranks;
    p.num_shared = static_cast<int>(shared_cols.size());
    p.shared_tiles = shared_cols.empty() ? 0 : shared_tiles;
    for (std::size_t s = 0; s < shared_cols.size(); ++s) p.shared_gateup_tiles[s] = shared_cols[s];
    p.band = 12;
    return p;
  };
  EXPECT_EQ(default_head_pulls(shape(0, {}, 1), 132, 1000), 132);        // no shared expert: every CTA
  EXPECT_EQ(default_head_pulls(shape(0, {}, 1), 132, 40), 40);           // never past the ring
  EXPECT_EQ(default_head_pulls(shape(4, {8}, 1), 132, 1000), 100);       // Qwen3.5 slice, T=512
  EXPECT_EQ(default_head_pulls(shape(8, {8}, 1), 132, 1000), 68);        // T=1024
  EXPECT_EQ(default_head_pulls(shape(16, {8}, 1), 132, 1000), 36);       // T=2048: a band of 12
  EXPECT_EQ(default_head_pulls(shape(16, {24}, 1), 132, 1000), 0);       // DeepSeek-V4-Pro slice, T=2048
  EXPECT_EQ(default_head_pulls(shape(4, {24}, 1), 132, 1000), 36);       // T=512
  EXPECT_EQ(default_head_pulls(shape(4, {8, 2}, 1), 132, 1000), 92);     // two shared experts
  EXPECT_EQ(default_head_pulls(shape(4, {8}, 2), 132, 1000), 68);        // two computed ranks
}

TEST(PlanOrder, BandsAreColumnMajorWithinTheBand) {
  PlanShape p{};
  p.num_ranks = 1;
  p.gateup_tiles = 2;
  p.down_tiles = 1;
  p.band = 3;
  p.lag = 1;
  std::vector<std::tuple<std::uint32_t, int, int>> seen;  // kind, col, row tile
  auto row_tiles = [](int) { return 5; };
  plan_group(
      p, 0, row_tiles, [&](std::uint32_t kind, int, int, int n, int t) { seen.emplace_back(kind, n, t); },
      [](int, int) {});
  const std::vector<std::tuple<std::uint32_t, int, int>> want = {
      {kRoutedGateUp, 0, 0}, {kRoutedGateUp, 0, 1}, {kRoutedGateUp, 0, 2},
      {kRoutedGateUp, 1, 0}, {kRoutedGateUp, 1, 1}, {kRoutedGateUp, 1, 2}};
  EXPECT_EQ(seen, want);
}

// A task's packed fields (Task) come back as written, each at its largest value beside the
// others' (a field that overlapped another would change it), and two tasks name the same
// weight tile exactly when all but their row tile, phantom and padding bits agree.
TEST(PlanOrder, TaskFieldsRoundTripAtTheirLimits) {
  std::mt19937 gen(7);
  const std::uint32_t max_rank = 4095, max_expert = kMaxTaskExperts - 1, max_col = kMaxColumnTiles - 1,
                      max_row = (1u << 24) - 1;  // capacity rows < 2^31, so row tiles < 2^24
  for (int trial = 0; trial < 2000; ++trial) {
    const std::uint32_t kind = gen() % 4, rank = trial == 0 ? max_rank : gen() % (max_rank + 1),
                        expert = trial == 0 ? max_expert : gen() % (max_expert + 1),
                        col = trial == 0 ? max_col : gen() % (max_col + 1),
                        row = trial == 0 ? max_row : gen() % (max_row + 1);
    const bool phantom = trial == 0 || gen() % 2, padding = trial == 0 || gen() % 2;
    const Task t = Task::make(kind | (phantom ? kPhantom : 0) | (padding ? kUpperHalfPadding : 0), rank, expert,
                              col, row);
    ASSERT_EQ(t.kind(), kind) << "trial " << trial;
    ASSERT_EQ(t.phantom(), phantom) << "trial " << trial;
    ASSERT_EQ(t.upper_half_padding(), padding) << "trial " << trial;
    ASSERT_EQ(t.rank(), rank) << "trial " << trial;
    ASSERT_EQ(t.expert(), expert) << "trial " << trial;
    ASSERT_EQ(t.shared(), expert) << "trial " << trial;  // the same field for shared kinds
    ASSERT_EQ(t.col_tile(), col) << "trial " << trial;
    ASSERT_EQ(t.row_tile(), row) << "trial " << trial;
    // Another row tile, phantom or padding: the same weight tile; another expert or column: not.
    EXPECT_TRUE(t.same_weight_tile(Task::make(kind, rank, expert, col, (row + 1) % (max_row + 1))))
        << "trial " << trial;
    EXPECT_FALSE(t.same_weight_tile(Task::make(kind, rank, (expert + 1) % (max_expert + 1), col, row)))
        << "trial " << trial;
    EXPECT_FALSE(t.same_weight_tile(Task::make(kind, rank, expert, (col + 1) % (max_col + 1), row)))
        << "trial " << trial;
    EXPECT_FALSE(t.same_weight_tile(Task::make((kind + 1) % 4, rank, expert, col, row))) << "trial " << trial;
    EXPECT_FALSE(t.same_weight_tile(Task::make(kind, (rank + 1) % (max_rank + 1), expert, col, row)))
        << "trial " << trial;
  }
}

}  // namespace
}  // namespace mok::cuda
