// The schedule (src/core/schedule.h): MoK's row order, padding, empty experts, capacity.
// Exact checks (no tolerances): hand-made routings, and random routings against an
// independent brute-force builder.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <vector>

#include "core/schedule.h"
#include "test_util.h"

namespace mok {
namespace {

using ::testing::HasSubstr;
using test::error_message;

Config tiles(int tile_rows, double factor = 1.0) {
  Config c;
  c.tile_rows = tile_rows;
  c.minibatch_rows = tile_rows;
  c.macrobatch_rows = tile_rows * 16;
  c.schedule_capacity_factor = factor;
  return c;
}

constexpr ScheduleRow kPad{-1, -1};

std::vector<const std::int32_t*> pointers(const std::vector<std::vector<std::int32_t>>& top) {
  std::vector<const std::int32_t*> v;
  for (const auto& t : top) v.push_back(t.data());
  return v;
}

RankSchedule build(const Problem& p, const Config& c, const std::vector<std::vector<std::int32_t>>& top, int d) {
  const auto ptrs = pointers(top);
  return build_schedule(p, c, ptrs, d);
}

// Independent: walk experts, then source ranks, then every slot in index order.
RankSchedule brute(const Problem& p, int tile, const std::vector<std::vector<std::int32_t>>& top, int d) {
  RankSchedule s;
  const int E_loc = p.local_experts();
  for (int e = 0; e < E_loc; ++e) {
    s.expert_begin.push_back(static_cast<std::int64_t>(s.rows.size()));
    std::int64_t n = 0;
    for (int src = 0; src < p.ep_size; ++src)
      for (std::size_t i = 0; i < top[src].size(); ++i)
        if (top[src][i] == d * E_loc + e) {
          s.rows.push_back({src, static_cast<std::int32_t>(i)});
          ++n;
        }
    s.expert_rows.push_back(n);
    while (s.rows.size() % tile) s.rows.push_back({-1, -1});
  }
  s.expert_begin.push_back(static_cast<std::int64_t>(s.rows.size()));
  return s;
}

void expect_same(const RankSchedule& a, const RankSchedule& b) {
  EXPECT_EQ(a.expert_begin, b.expert_begin);
  EXPECT_EQ(a.expert_rows, b.expert_rows);
  ASSERT_EQ(a.rows.size(), b.rows.size());
  for (std::size_t i = 0; i < a.rows.size(); ++i)
    ASSERT_EQ(a.rows[i], b.rows[i]) << "row " << i << ": (" << a.rows[i].src_rank << "," << a.rows[i].slot
                                    << ") vs (" << b.rows[i].src_rank << "," << b.rows[i].slot << ")";
}

TEST(Schedule, HandMadeOrderAndPadding) {
  // E=4 over R=2 (experts 0,1 on rank 0; 2,3 on rank 1), k=2, T=3.
  const Problem p = test::make_problem(4, 32, 32, 2, {}, 2, 3);
  const std::vector<std::vector<std::int32_t>> top = {
      {1, 2, /**/ 3, 0, /**/ 0, 1},   // rank 0: tokens 0..2
      {2, 0, /**/ 1, 3, /**/ 0, 2}};  // rank 1
  const Config c = tiles(64);
  const RankSchedule s0 = build(p, c, top, 0);
  EXPECT_EQ(s0.expert_rows, (std::vector<std::int64_t>{4, 3}));
  EXPECT_EQ(s0.expert_begin, (std::vector<std::int64_t>{0, 64, 128}));
  EXPECT_EQ(s0.real_rows(), 7);
  EXPECT_EQ(s0.padded_rows(), 128);
  const std::vector<ScheduleRow> e0 = {{0, 3}, {0, 4}, {1, 1}, {1, 4}};  // slot = t*k + j
  const std::vector<ScheduleRow> e1 = {{0, 0}, {0, 5}, {1, 2}};
  for (std::size_t i = 0; i < 64; ++i) {
    EXPECT_EQ(s0.rows[i], i < e0.size() ? e0[i] : kPad) << i;
    EXPECT_EQ(s0.rows[64 + i], i < e1.size() ? e1[i] : kPad) << i;
  }
  const RankSchedule s1 = build(p, c, top, 1);
  EXPECT_EQ(s1.expert_rows, (std::vector<std::int64_t>{3, 2}));
  const std::vector<ScheduleRow> e2 = {{0, 1}, {1, 0}, {1, 5}}, e3 = {{0, 2}, {1, 3}};
  for (std::size_t i = 0; i < 64; ++i) {
    EXPECT_EQ(s1.rows[i], i < e2.size() ? e2[i] : kPad) << i;
    EXPECT_EQ(s1.rows[64 + i], i < e3.size() ? e3[i] : kPad) << i;
  }
  // Larger tiles: same rows, more padding.
  const RankSchedule t256 = build(p, tiles(256), top, 0);
  EXPECT_EQ(t256.expert_begin, (std::vector<std::int64_t>{0, 256, 512}));
  EXPECT_EQ(t256.rows[256], (ScheduleRow{0, 0}));
}

TEST(Schedule, EmptyExpertsGetNoRowsAndNoPadding) {
  // E=6 over R=2 (3 local experts each); nobody routes to experts 1, 3, 4, 5.
  const Problem p = test::make_problem(6, 32, 32, 2, {}, 2, 2);
  const std::vector<std::vector<std::int32_t>> top = {{0, 2, 2, 0}, {2, 0, 0, 2}};
  const RankSchedule s0 = build(p, tiles(64), top, 0);
  EXPECT_EQ(s0.expert_rows, (std::vector<std::int64_t>{4, 0, 4}));
  EXPECT_EQ(s0.expert_begin, (std::vector<std::int64_t>{0, 64, 64, 128}));
  EXPECT_EQ(s0.rows[0], (ScheduleRow{0, 0}));
  EXPECT_EQ(s0.rows[1], (ScheduleRow{0, 3}));
  EXPECT_EQ(s0.rows[2], (ScheduleRow{1, 1}));
  EXPECT_EQ(s0.rows[3], (ScheduleRow{1, 2}));
  EXPECT_EQ(s0.rows[64], (ScheduleRow{0, 1}));
  const RankSchedule s1 = build(p, tiles(64), top, 1);
  EXPECT_EQ(s1.expert_rows, (std::vector<std::int64_t>{0, 0, 0}));
  EXPECT_EQ(s1.expert_begin, (std::vector<std::int64_t>{0, 0, 0, 0}));
  EXPECT_TRUE(s1.rows.empty());
}

TEST(Schedule, ExactlyFullTileNeedsNoPadding) {
  const Problem p = test::make_problem(2, 32, 32, 1, {}, 1, 64);
  std::vector<std::vector<std::int32_t>> top(1, std::vector<std::int32_t>(64, 1));
  const RankSchedule s = build(p, tiles(64), top, 0);
  EXPECT_EQ(s.expert_begin, (std::vector<std::int64_t>{0, 0, 64}));
  for (int i = 0; i < 64; ++i) EXPECT_EQ(s.rows[i], (ScheduleRow{0, i}));
}

TEST(Schedule, RandomRoutingsMatchBruteForce) {
  for (int R : {1, 2, 4, 8})
    for (const char* spec : {"gaussian", "zipf:1.5", "hot:0.7:3", "worst:0"})
      for (int tile : {64, 128}) {
        const Problem p = test::make_problem(8, 32, 32, 3, {}, R, 40);
        const Routing r = generate_routing(p, RoutingSpec::parse(spec), 11);
        for (int d = 0; d < R; ++d) {
          SCOPED_TRACE(std::string(spec) + " R=" + std::to_string(R) + " d=" + std::to_string(d));
          const RankSchedule s = build(p, tiles(tile), r.top_experts, d);
          expect_same(s, brute(p, tile, r.top_experts, d));
          for (auto b : s.expert_begin) EXPECT_EQ(b % tile, 0);
        }
        // Every rank's at once (one pass over the ids): the same schedules.
        const auto ptrs = pointers(r.top_experts);
        const std::vector<RankSchedule> all = build_schedules(p, tiles(tile), ptrs);
        ASSERT_EQ(all.size(), static_cast<std::size_t>(R));
        for (int d = 0; d < R; ++d) expect_same(all[d], brute(p, tile, r.top_experts, d));
      }
}

TEST(Schedule, CapacityOverflowThrowsNeverDrops) {
  // E=8 over R=2, k=2, T=256, tile 64, factor 0.1: every token to rank 0 means 1024 rows
  // there (2 experts * 512, no padding), well above the capacity at this factor.
  const Problem p = test::make_problem(8, 32, 32, 2, {}, 2, 256);
  const Config c = tiles(64, 0.1);
  ASSERT_LT(schedule_capacity_rows(p, c), 1024);
  EXPECT_EQ(schedule_capacity_rows(p, c) % 64, 0);
  const Routing r = generate_routing(p, RoutingSpec::parse("worst:0"), 1);
  const std::string msg = error_message([&] { build(p, c, r.top_experts, 0); });
  EXPECT_THAT(msg, HasSubstr("capacity"));
  EXPECT_THAT(msg, HasSubstr("rank 0"));
  EXPECT_THAT(msg, HasSubstr("schedule_capacity_factor"));
  EXPECT_NO_THROW(build(p, c, r.top_experts, 1));  // rank 1 receives nothing
  const auto ptrs = pointers(r.top_experts);
  EXPECT_EQ(error_message([&] { build_schedules(p, c, ptrs); }), msg);  // the same error, for rank 0

  // Through the Layer: the error is raised before any output is written.
  LayerData data = make_layer_data(p, r, 1, false);
  Layer layer(p, c, test::cpu_options());
  EXPECT_THAT(error_message([&] { layer.forward(data.forward_args()); }), HasSubstr("capacity"));
  EXPECT_TRUE(std::isnan(test::element(data.ranks[0].y, 0)));
}

TEST(Schedule, CapacityBoundaryIsExact) {
  // Rank 0's experts filled to its capacity exactly, in whole tiles: accepted, nothing
  // dropped; one row more (a tile more of padding): refused, naming both counts.
  const Problem p = test::make_problem(8, 32, 32, 2, {}, 2, 256);
  const Config c = tiles(64, 0.1);
  const std::int64_t capacity = schedule_capacity_rows(p, c);
  ASSERT_EQ(capacity, 832);  // ceil(512 + 0.1 * 512) + 4 * 63, rounded up to 64
  std::vector<std::int64_t> rows = test::whole_tile_rows(p, capacity, 64);
  const Routing full = test::routing_with_rank0_rows(p, rows);
  RankSchedule at;
  ASSERT_NO_THROW(at = build(p, c, full.top_experts, 0));
  EXPECT_EQ(at.expert_rows, rows);
  EXPECT_EQ(at.real_rows(), capacity);
  EXPECT_EQ(at.padded_rows(), capacity);

  rows[1] += 1;  // 512 + 321 real rows: 896 padded
  const Routing over = test::routing_with_rank0_rows(p, rows);
  const std::string msg = error_message([&] { build(p, c, over.top_experts, 0); });
  EXPECT_THAT(msg, HasSubstr("rank 0 receives 896 padded rows, more than its capacity of 832"));

  // Through the Layer: the full rank's forward runs and writes every y; the other is refused
  // before any output is written.
  LayerData ok = make_layer_data(p, full, 3, false);
  Layer layer(p, c, test::cpu_options());
  ASSERT_NO_THROW(layer.forward(ok.forward_args()));
  for (const auto& r : ok.ranks)
    for (std::int64_t i = 0; i < r.y.numel(); ++i) ASSERT_FALSE(std::isnan(test::element(r.y, i))) << i;
  LayerData refused = make_layer_data(p, over, 3, false);
  EXPECT_THAT(error_message([&] { layer.forward(refused.forward_args()); }), HasSubstr("capacity of 832"));
  EXPECT_TRUE(std::isnan(test::element(refused.ranks[0].y, 0)));
}

TEST(Schedule, CapacityFactorOneNeverOverflows) {
  // All tokens of every rank routed to one rank's experts, over a grid of shapes and tiles.
  int checked = 0;
  for (int E : {8, 16})
    for (int R : {1, 2, 4, 8})
      for (int k : {1, 2, 3, 5, 8})
        for (int T : {1, 7, 64, 200})
          for (int tile : {64, 128, 256}) {
            if (k > E) continue;
            const Problem p = test::make_problem(E, 32, 32, k, {}, R, T);
            const Config c = tiles(tile, 1.0);
            // Worst case by hand: every token's first min(k, E/R) experts on rank d, the
            // rest on other ranks; each expert of d gets R*T rows.
            const int d = R - 1, E_loc = E / R;
            std::vector<std::vector<std::int32_t>> top(R, std::vector<std::int32_t>(std::size_t(T) * k));
            for (int s = 0; s < R; ++s)
              for (int t = 0; t < T; ++t)
                for (int j = 0; j < k; ++j) top[s][t * k + j] = (d * E_loc + j) % E;
            RankSchedule sched;
            ASSERT_NO_THROW(sched = build(p, c, top, d)) << p.describe() << " tile " << tile;
            EXPECT_EQ(sched.real_rows(), std::int64_t(R) * T * std::min(k, E_loc));
            EXPECT_LE(sched.padded_rows(), schedule_capacity_rows(p, c));
            ++checked;
          }
  EXPECT_GT(checked, 400);
}

TEST(Schedule, LayerReportsScheduleStats) {
  const Problem p = test::make_problem(8, 32, 32, 2, {}, 2, 24);
  const Config c = test::roomy_config();
  LayerData data = test::make_data(p, 4, false);
  Layer layer(p, c, test::cpu_options());
  layer.forward(data.forward_args());
  const auto stats = layer.last_schedule_stats();
  ASSERT_EQ(stats.size(), 2u);
  std::vector<std::vector<std::int32_t>> top;
  for (const auto& r : data.ranks)
    top.emplace_back(r.top_experts.data<std::int32_t>(), r.top_experts.data<std::int32_t>() + 48);
  for (int d = 0; d < 2; ++d) {
    const RankSchedule s = brute(p, c.tile_rows, top, d);
    EXPECT_EQ(stats[d].rows_per_local_expert, s.expert_rows);
    EXPECT_EQ(stats[d].real_rows, s.real_rows());
    EXPECT_EQ(stats[d].padded_rows, s.padded_rows());
    EXPECT_EQ(stats[d].capacity_rows, schedule_capacity_rows(p, c));
  }
  EXPECT_EQ(stats[0].real_rows + stats[1].real_rows, 2 * 24 * 2);
}

}  // namespace
}  // namespace mok
