// Routing generators, routing_balance, file routing and RoutingSpec::parse (include/mok/routing.h).
// Statistical checks use 1024+ tokens and bounds of >= 4 standard deviations.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <set>
#include <string>
#include <vector>

#include "core/rng.h"
#include "io/npy.h"
#include "test_util.h"

namespace mok {
namespace {

using ::testing::HasSubstr;
using test::error_message;

// E=16 over R=4 (4 experts per rank), k=4, 256 tokens per rank.
Problem routing_problem(int R = 4, int T = 256, int k = 4, int E = 16) {
  return test::make_problem(E, 32, 32, k, {}, R, T);
}

void expect_valid(const Problem& p, const Routing& r) {
  ASSERT_EQ(static_cast<int>(r.top_experts.size()), p.ep_size);
  ASSERT_EQ(static_cast<int>(r.router_weights.size()), p.ep_size);
  const int k = p.top_k;
  for (int rank = 0; rank < p.ep_size; ++rank) {
    ASSERT_EQ(r.top_experts[rank].size(), std::size_t(p.tokens_per_rank) * k);
    ASSERT_EQ(r.router_weights[rank].size(), std::size_t(p.tokens_per_rank) * k);
    for (int t = 0; t < p.tokens_per_rank; ++t) {
      std::set<int> ids;
      double sum = 0;
      for (int j = 0; j < k; ++j) {
        const int e = r.top_experts[rank][t * k + j];
        const float w = r.router_weights[rank][t * k + j];
        ASSERT_GE(e, 0);
        ASSERT_LT(e, p.num_experts);
        ids.insert(e);
        ASSERT_TRUE(std::isfinite(w));
        ASSERT_GT(w, 0.0f);
        sum += w;
      }
      ASSERT_EQ(static_cast<int>(ids.size()), k) << "rank " << rank << " token " << t << ": ids not distinct";
      ASSERT_NEAR(sum, 1.0, 1e-6) << "rank " << rank << " token " << t;
    }
  }
  EXPECT_NO_THROW(validate_routing(p, r));
}

// Fraction of tokens (over all ranks) whose top-k contains expert e.
double fraction_with(const Problem& p, const Routing& r, int e) {
  std::int64_t n = 0;
  for (const auto& ids : r.top_experts)
    for (int t = 0; t < p.tokens_per_rank; ++t)
      n += std::count(ids.begin() + t * p.top_k, ids.begin() + (t + 1) * p.top_k, e);
  return double(n) / (double(p.ep_size) * p.tokens_per_rank);
}

bool same(const Routing& a, const Routing& b) {
  return a.top_experts == b.top_experts && a.router_weights == b.router_weights;
}

const char* const kKinds[] = {"gaussian", "zipf", "zipf:0", "zipf:2.5", "hot", "hot:0.5:3", "hot:0", "worst:2"};

TEST(Rng, UniformIsStrictlyInsideTheUnitInterval) {
  // The extreme bit patterns (every other value lies between them).
  EXPECT_GT(rng::unit_from_bits(0), 0.0f);
  EXPECT_LT(rng::unit_from_bits(~std::uint64_t(0)), 1.0f);  // was exactly 1 with 24 bits
  EXPECT_GT(rng::unit_from_bits(~std::uint64_t(0)), 0.9999f);
  // Distinct top bits give distinct values (no rounding merges neighbours).
  EXPECT_LT(rng::unit_from_bits(~std::uint64_t(0) - (std::uint64_t(1) << 41)), rng::unit_from_bits(~std::uint64_t(0)));
}

TEST(Routing, GeneratorsProduceValidRoutings) {
  for (const char* kind : kKinds)
    for (int k : {1, 4, 7}) {
      SCOPED_TRACE(std::string(kind) + " k=" + std::to_string(k));
      const Problem p = routing_problem(4, 64, k);
      expect_valid(p, generate_routing(p, RoutingSpec::parse(kind), 3));
    }
}

TEST(Routing, DeterministicForASeed) {
  const Problem p = routing_problem();
  for (const char* kind : kKinds) {
    SCOPED_TRACE(kind);
    const RoutingSpec s = RoutingSpec::parse(kind);
    EXPECT_TRUE(same(generate_routing(p, s, 42), generate_routing(p, s, 42)));
    EXPECT_FALSE(same(generate_routing(p, s, 42), generate_routing(p, s, 43))) << "the seed must matter";
  }
}

TEST(Routing, EpInvariantGlobalRouting) {
  // (worst is defined by the EP split itself: one rank's experts, so it is left out.)
  for (const char* kind : {"gaussian", "zipf", "zipf:0", "zipf:2.5", "hot", "hot:0.5:3", "hot:0"}) {
    SCOPED_TRACE(kind);
    const RoutingSpec s = RoutingSpec::parse(kind);
    const Routing one = generate_routing(routing_problem(1, 1024), s, 8);
    const Routing four = generate_routing(routing_problem(4, 256), s, 8);
    std::vector<std::int32_t> ids;
    std::vector<float> w;
    for (int r = 0; r < 4; ++r) {
      ids.insert(ids.end(), four.top_experts[r].begin(), four.top_experts[r].end());
      w.insert(w.end(), four.router_weights[r].begin(), four.router_weights[r].end());
    }
    EXPECT_TRUE(ids == one.top_experts[0]);
    EXPECT_TRUE(w == one.router_weights[0]);
  }
}

TEST(Routing, ZipfIsSkewedGaussianIsNot) {
  const Problem p = routing_problem();  // 4096 rows, 256 per expert on average
  const RoutingBalance g = routing_balance(p, generate_routing(p, RoutingSpec::parse("gaussian"), 1));
  const RoutingBalance z = routing_balance(p, generate_routing(p, RoutingSpec::parse("zipf:1.2"), 1));
  const RoutingBalance z0 = routing_balance(p, generate_routing(p, RoutingSpec::parse("zipf:0"), 1));
  EXPECT_LT(g.max_over_mean_expert, 1.3);
  EXPECT_GT(z.max_over_mean_expert, 2.0);
  EXPECT_GT(z.max_over_mean_expert, 1.5 * g.max_over_mean_expert);
  EXPECT_LT(z0.max_over_mean_expert, 1.3) << "exponent 0 is uniform";
  EXPECT_EQ(z.total_rows, 4096);
}

TEST(Routing, HotExpertAppearsInTheRequestedFraction) {
  const Problem p = routing_problem();  // 1024 tokens; k/E = 1/4
  // fraction f forced, plus the Gaussian chance k/E for the others: f + (1-f)*k/E.
  // Binomial sd <= 0.016 for 1024 tokens; bound 0.07 (> 4 sd).
  for (double f : {0.0, 0.3, 0.5, 0.9}) {
    const RoutingSpec s = RoutingSpec::parse("hot:" + std::to_string(f) + ":5");
    const double got = fraction_with(p, generate_routing(p, s, 2), 5);
    EXPECT_NEAR(got, f + (1 - f) * 0.25, 0.07) << "fraction " << f;
  }
  EXPECT_EQ(fraction_with(p, generate_routing(p, RoutingSpec::parse("hot:1:9"), 2), 9), 1.0);
  EXPECT_EQ(fraction_with(p, generate_routing(p, RoutingSpec::parse("hot"), 2), 0), 1.0);
}

TEST(Routing, WorstRoutesEverythingToOneRank) {
  for (int worst : {0, 3}) {
    const Problem p = routing_problem();  // k = 4 = E/R
    const Routing r = generate_routing(p, RoutingSpec::parse("worst:" + std::to_string(worst)), 4);
    for (const auto& ids : r.top_experts)
      for (int e : ids) ASSERT_EQ(e / p.local_experts(), worst);
    const RoutingBalance b = routing_balance(p, r);
    EXPECT_EQ(b.rows_per_rank[worst], b.total_rows);
    EXPECT_DOUBLE_EQ(b.max_over_mean_rank, 4.0);
  }
  // k > E/R: each token sends all E/R rows it can to the worst rank, the rest elsewhere.
  const Problem p = routing_problem(4, 64, 6);
  const Routing r = generate_routing(p, RoutingSpec::parse("worst:1"), 4);
  expect_valid(p, r);
  const RoutingBalance b = routing_balance(p, r);
  EXPECT_EQ(b.rows_per_rank[1], 4 * 64 * 4);
}

TEST(Routing, BalanceOnAHandMadeRouting) {
  const Problem p = test::make_problem(4, 32, 32, 2, {}, 2, 2);
  Routing r;
  r.top_experts = {{0, 1, 0, 2}, {0, 3, 1, 0}};
  r.router_weights = {{0.5f, 0.5f, 0.5f, 0.5f}, {0.5f, 0.5f, 0.5f, 0.5f}};
  const RoutingBalance b = routing_balance(p, r);
  // Per expert: e0 = 4, e1 = 2, e2 = 1, e3 = 1 (mean 2); per rank: {e0,e1} = 6, {e2,e3} = 2 (mean 4).
  EXPECT_EQ(b.total_rows, 8);
  EXPECT_EQ(b.max_rows_expert, 4);
  EXPECT_DOUBLE_EQ(b.max_over_mean_expert, 2.0);
  EXPECT_EQ(b.rows_per_rank, (std::vector<std::int64_t>{6, 2}));
  EXPECT_EQ(b.max_rows_rank, 6);
  EXPECT_DOUBLE_EQ(b.max_over_mean_rank, 1.5);
  EXPECT_EQ(b.busiest_rank, 0);
  // Rank 1 busier, then a tie: the lowest rank wins.
  r.top_experts = {{2, 1, 3, 2}, {0, 3, 1, 2}};
  EXPECT_EQ(routing_balance(p, r).busiest_rank, 1);
  r.top_experts = {{2, 1, 3, 0}, {0, 3, 1, 2}};
  EXPECT_EQ(routing_balance(p, r).busiest_rank, 0);
}

TEST(Routing, BusiestRankHoldsTheHotExpert) {
  const Problem p = routing_problem();  // 4 ranks of 4 experts
  for (int hot : {0, 5, 14})
    EXPECT_EQ(routing_balance(p, generate_routing(p, RoutingSpec::parse("hot:1:" + std::to_string(hot)), 3))
                  .busiest_rank,
              hot / p.local_experts())
        << "hot expert " << hot;
}

// ---- file routing ---------------------------------------------------------------------------

class FileRouting : public ::testing::Test {
 protected:
  // E=8 over R=2, k=2, T=3: 6 global tokens.
  Problem p_ = test::make_problem(8, 32, 32, 2, {}, 2, 3);
  std::vector<std::int32_t> ids_ = {0, 5, 7, 1, 2, 3, 4, 6, 1, 0, 6, 2};
  std::vector<float> w_ = {0.25f, 0.75f, 0.5f, 0.5f, 1.0f, 0.0f, 0.1f, 0.9f, 0.3f, 0.7f, 0.6f, 0.4f};
  test::TempDir dir_{"routing"};

  RoutingSpec spec() const { return RoutingSpec::parse("file:" + dir_.str()); }
  void write_ids(DType dtype, std::vector<std::int64_t> shape) {
    HostTensor t(dtype, shape);
    for (std::int64_t i = 0; i < t.numel(); ++i) {
      const std::int32_t v = ids_[i % ids_.size()];
      if (dtype == DType::i64) t.data<std::int64_t>()[i] = v; else t.data<std::int32_t>()[i] = v;
    }
    npy::save(dir_.file("top_experts.npy"), t);
  }
  void write_weights(std::vector<std::int64_t> shape) {
    HostTensor t(DType::f32, shape);
    for (std::int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = w_[i % w_.size()];
    npy::save(dir_.file("router_weights.npy"), t);
  }
};

TEST_F(FileRouting, ReadsIdsAndWeights) {
  write_ids(DType::i32, {6, 2});
  write_weights({6, 2});
  const Routing r = generate_routing(p_, spec(), 0);
  ASSERT_EQ(r.top_experts.size(), 2u);
  EXPECT_EQ(r.top_experts[0], (std::vector<std::int32_t>(ids_.begin(), ids_.begin() + 6)));
  EXPECT_EQ(r.top_experts[1], (std::vector<std::int32_t>(ids_.begin() + 6, ids_.end())));
  EXPECT_EQ(r.router_weights[0], (std::vector<float>(w_.begin(), w_.begin() + 6)));
  EXPECT_EQ(r.router_weights[1], (std::vector<float>(w_.begin() + 6, w_.end())));
}

TEST_F(FileRouting, Int64IdsAndDefaultWeights) {
  write_ids(DType::i64, {6, 2});
  const Routing r = generate_routing(p_, spec(), 0);
  EXPECT_EQ(r.top_experts[1], (std::vector<std::int32_t>(ids_.begin() + 6, ids_.end())));
  for (const auto& w : r.router_weights)
    for (float v : w) EXPECT_EQ(v, 0.5f) << "without router_weights.npy the weights are 1/k";
}

TEST_F(FileRouting, MissingOrMismatchedFilesAreErrors) {
  std::string msg = error_message([&] { generate_routing(p_, spec(), 0); });
  EXPECT_THAT(msg, HasSubstr("top_experts.npy"));
  EXPECT_THAT(msg, HasSubstr(dir_.str()));

  write_ids(DType::i32, {5, 2});  // 5 tokens, the problem has 6
  msg = error_message([&] { generate_routing(p_, spec(), 0); });
  EXPECT_THAT(msg, HasSubstr("top_experts.npy"));
  EXPECT_THAT(msg, HasSubstr("shape"));

  write_ids(DType::i32, {6, 3});  // wrong k
  EXPECT_THAT(error_message([&] { generate_routing(p_, spec(), 0); }), HasSubstr("top_experts.npy"));

  write_ids(DType::i32, {6, 2});
  write_weights({6, 1});
  msg = error_message([&] { generate_routing(p_, spec(), 0); });
  EXPECT_THAT(msg, HasSubstr("router_weights.npy"));

  HostTensor wi(DType::i32, {6, 2});  // weights of the wrong dtype
  npy::save(dir_.file("router_weights.npy"), wi);
  EXPECT_THAT(error_message([&] { generate_routing(p_, spec(), 0); }), HasSubstr("router_weights.npy"));

  write_weights({6, 2});
  ids_[9] = ids_[8];  // rank 1, token 1: the same expert twice
  write_ids(DType::i32, {6, 2});
  EXPECT_THAT(error_message([&] { generate_routing(p_, spec(), 0); }), HasSubstr("distinct"));
  ids_[9] = 8;  // out of range
  write_ids(DType::i32, {6, 2});
  EXPECT_THAT(error_message([&] { generate_routing(p_, spec(), 0); }), HasSubstr("top_experts"));

  const RoutingSpec nowhere = RoutingSpec::parse("file:" + dir_.file("no_such_dir"));
  EXPECT_THAT(error_message([&] { generate_routing(p_, nowhere, 0); }), HasSubstr("no_such_dir"));
}

// ---- RoutingSpec::parse ---------------------------------------------------------------------

TEST(RoutingSpecParse, AcceptsTheDocumentedForms) {
  RoutingSpec s = RoutingSpec::parse("gaussian");
  EXPECT_EQ(s.kind, RoutingKind::gaussian);
  s = RoutingSpec::parse("zipf");
  EXPECT_EQ(s.kind, RoutingKind::zipf);
  EXPECT_EQ(s.zipf_exponent, 1.2);
  EXPECT_EQ(RoutingSpec::parse("zipf:1.5").zipf_exponent, 1.5);
  s = RoutingSpec::parse("hot");
  EXPECT_EQ(s.kind, RoutingKind::hot);
  EXPECT_EQ(s.hot_fraction, 1.0);
  EXPECT_EQ(s.hot_expert, 0);
  EXPECT_EQ(RoutingSpec::parse("hot:0.5").hot_fraction, 0.5);
  s = RoutingSpec::parse("hot:0.5:7");
  EXPECT_EQ(s.hot_fraction, 0.5);
  EXPECT_EQ(s.hot_expert, 7);
  EXPECT_EQ(RoutingSpec::parse("worst").worst_rank, 0);
  s = RoutingSpec::parse("worst:3");
  EXPECT_EQ(s.kind, RoutingKind::worst);
  EXPECT_EQ(s.worst_rank, 3);
  s = RoutingSpec::parse("file:/some/dir:with:colons");
  EXPECT_EQ(s.kind, RoutingKind::file);
  EXPECT_EQ(s.path, "/some/dir:with:colons");
  // (Numbers with more than six digits too: describe() rounded them, so a recorded run's spec
  // named another routing.)
  for (const char* text : {"gaussian", "zipf:1.5", "hot:0.25:3", "worst:2", "file:/x/y", "zipf:1.23456789",
                           "hot:0.1234567891:2"}) {
    const RoutingSpec a = RoutingSpec::parse(text), b = RoutingSpec::parse(a.describe());
    EXPECT_EQ(a.describe(), text);
    EXPECT_EQ(a.kind, b.kind) << text;
    EXPECT_EQ(a.zipf_exponent, b.zipf_exponent) << text;
    EXPECT_EQ(a.hot_fraction, b.hot_fraction) << text;
    EXPECT_EQ(a.hot_expert, b.hot_expert) << text;
    EXPECT_EQ(a.worst_rank, b.worst_rank) << text;
    EXPECT_EQ(a.path, b.path) << text;
  }
}

TEST(RoutingSpecParse, RejectsEverythingElse) {
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"", "unknown kind"},           {"uniform", "unknown kind"},     {"Gaussian", "unknown kind"},
      {"gaussian:1", "too many"},     {"zipf:abc", "zipf exponent"},   {"zipf:-1", "zipf exponent"},
      {"zipf:inf", "zipf exponent"},  {"zipf:nan", "zipf exponent"},   {"zipf:1:2", "too many"},
      {"zipf:1.5x", "zipf exponent"}, {"hot:1.5", "hot fraction"},     {"hot:-0.1", "hot fraction"},
      {"hot:x", "hot fraction"},      {"hot:0.5:x", "hot expert"},     {"hot:0.5:7:1", "too many"},
      {"hot:0.5:7.5", "hot expert"},  {"hot:0.5:1e10", "hot expert"},  {"worst:x", "worst rank"},
      {"worst:1:2", "too many"},      {"worst:1.5", "worst rank"},     {"file:", "directory"},
      {"file", "directory"},
      // Integers are written as integers, as on the command line ("1.0" is a decimal).
      {"hot:0.5:1.0", "hot expert: '1.0' is not an integer"}, {"hot:0.5:1e0", "hot expert: '1e0' is not an integer"},
      {"worst:-0.0", "worst rank: '-0.0' is not an integer"}, {"worst: 1", "worst rank: ' 1' is not an integer"}};
  for (const auto& [text, what] : bad) {
    const std::string msg = error_message([&] { RoutingSpec::parse(text); });
    EXPECT_THAT(msg, HasSubstr("routing")) << "'" << text << "'";
    EXPECT_THAT(msg, HasSubstr(what)) << "'" << text << "'";
  }
}

TEST(RoutingSpecParse, GeneratorRejectsOutOfRangeExpertAndRank) {
  const Problem p = routing_problem();  // E=16, R=4
  EXPECT_THAT(error_message([&] { generate_routing(p, RoutingSpec::parse("hot:0.5:16"), 1); }),
              HasSubstr("hot expert"));
  EXPECT_THAT(error_message([&] { generate_routing(p, RoutingSpec::parse("hot:0.5:-1"), 1); }),
              HasSubstr("hot expert"));
  EXPECT_THAT(error_message([&] { generate_routing(p, RoutingSpec::parse("worst:4"), 1); }),
              HasSubstr("worst rank"));
  EXPECT_THAT(error_message([&] { generate_routing(p, RoutingSpec::parse("worst:-1"), 1); }),
              HasSubstr("worst rank"));
}

}  // namespace
}  // namespace mok
