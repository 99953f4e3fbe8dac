// The CPU reference against the independent dense formulation of tests/test_util.h
// (double precision, a loop per token and slot, bf16 rounding at the reference's points).
//
// Tolerances (chosen up front). The two sides round the same values to bf16 at the same
// points, so they differ only where fp32 and double sums straddle a rounding boundary (rare,
// one bf16 ulp each) and by fp32 summation error (~1e-6 relative):
//   every tensor: rel = sum|out - ref| / sum|ref| <= 1e-4, and
//   bf16 tensors (y, combine slots, dx): max|out - ref| <= 2^-7 * max|ref| (one or two bf16
//   ulps of the largest element); f32 gradients: max|out - ref| <= 1e-3 * max|ref|.
// (Observed: rel ~1e-6, max_abs/max_ref <= 2e-5.) The bounds are tight enough to see one
// missing or extra bf16 rounding point, which costs rel ~1e-3 (dropping them all: 2.3e-3).
// MXFP8 mode (forward): the same bounds; the dense side round-trips the same operands with
// the (separately tested) MXFP8 scalar code.
// MXFP8 backward has no rounding-exact dense twin; it is held to MoK's gradient bar instead,
// cosine >= 0.996 and rel <= 0.1, against the straight-through gradient of the MXFP8
// forward: g, u, a and the clamp masks from the MXFP8 forward, every backward product exact.
// (Against the fully exact gradient a tight clamp limit fails the bar legitimately: MXFP8
// moves g and u by up to 2^-4 relative, which flips the clamp masks near the limit.)
#include <gtest/gtest.h>

#include <optional>
#include <sstream>
#include <string>
#include <limits>
#include <memory>
#include <thread>
#include <vector>

#include <sys/wait.h>
#include <unistd.h>

#include "core/compare.h"
#include "test_util.h"

namespace mok {
namespace {

using test::DenseLayer;
using test::Diff;
using test::Mode;

constexpr double kRel = 1e-4;
constexpr double kBf16AbsFrac = 1.0 / 128;  // 2^-7
constexpr double kF32AbsFrac = 1e-3;

void expect_close(const std::vector<double>& out, const std::vector<double>& ref, const std::string& what,
                  double abs_frac) {
  const Diff d = test::diff(out, ref);
  EXPECT_EQ(d.non_finite, 0) << what << ": " << d.describe();
  EXPECT_LE(d.rel, kRel) << what << ": " << d.describe();
  EXPECT_LE(d.max_abs, abs_frac * d.max_ref) << what << ": " << d.describe();
  EXPECT_GT(d.max_ref, 0) << what << ": all zero, the comparison means nothing";
}

struct Case {
  int R;
  int k;
  std::vector<int> shared;
  std::optional<float> limit;
  Precision precision = Precision::bf16;
  int H = 64, I = 32;
  int tokens = 48;                  // in all (T = tokens / R per rank)
  std::string routing = "gaussian";  // RoutingSpec::parse
};

std::string name_of(const Case& c) {
  std::ostringstream n;  // (a stream: GCC 12 warns falsely on "literal" + std::string here)
  n << "R" << c.R << "_k" << c.k << "_shared";
  for (int w : c.shared) n << "_" << w;
  if (c.limit) n << "_limit" << int(*c.limit * 100); else n << "_nolimit";
  n << (c.precision == Precision::bf16 ? "_bf16" : "_mxfp8") << "_H" << c.H << "_I" << c.I;
  if (c.tokens != 48) n << "_T" << c.tokens;
  if (c.routing != "gaussian") n << "_" << c.routing.substr(0, c.routing.find(':'));
  return n.str();
}

// gtest prints parameters with this (instead of a byte dump) in failure messages.
void PrintTo(const Case& c, std::ostream* os) { *os << name_of(c); }

class ReferenceVsDense : public ::testing::TestWithParam<Case> {};

// E=8, H=64, I=32 (one case with H, I and shared widths not multiples of 8, for the GEMM
// tails), 48 tokens in all (T = 48/R per rank) unless a case says; limit 0.75 clamps a good
// share of gate and up values (checked below, so the clamp paths are really exercised).
Problem problem_of(const Case& c) {
  return test::make_problem(8, c.H, c.I, c.k, c.shared, c.R, c.tokens / c.R, c.precision, c.limit);
}

TEST_P(ReferenceVsDense, ForwardAndEveryGradient) {
  const Case c = GetParam();
  const Problem p = problem_of(c);
  LayerData data = test::make_data(p, 1234, true, RoutingSpec::parse(c.routing));
  Layer layer(p, test::roomy_config(), test::cpu_options());
  layer.forward(data.forward_args());
  // What the case is for holds: experts without rows, or MXFP8 row blocks past the first.
  const auto stats = layer.last_schedule_stats();
  int empty_experts = 0, most_rows = 0;
  for (const auto& s : stats)
    for (auto rows : s.rows_per_local_expert) {
      empty_experts += rows == 0;
      most_rows = std::max(most_rows, static_cast<int>(rows));
    }
  if (c.routing != "gaussian") {
    EXPECT_GE(empty_experts, 1) << "the case must leave experts without rows";
  }
  if (c.tokens > 48) {
    EXPECT_GT(most_rows, 64) << "the case must give an expert more than two row blocks";
  }

  const DenseLayer dense = DenseLayer::from(data);
  const Mode mode = c.precision == Precision::bf16 ? Mode::bf16 : Mode::mxfp8;
  const auto f = test::dense_forward(dense, mode);
  if (c.limit) {
    EXPECT_GT(f.gate_clamped, 50) << "the gate clamp must be exercised";
    EXPECT_GT(f.up_clamped, 50) << "the up clamp must be exercised";
  }
  expect_close(test::concat_ranks(data, &RankData::y), f.y, "y", kBf16AbsFrac);

  // The combine slots: slot t*k+j holds expert top_experts[t,j]'s output row for token t.
  std::vector<double> combine;
  for (int r = 0; r < c.R; ++r) {
    const TensorView v = layer.combine_slots(r);
    ASSERT_EQ(v.numel(), std::int64_t(p.tokens_per_rank) * p.top_k * p.hidden);
    for (std::int64_t i = 0; i < v.numel(); ++i) combine.push_back(num::bf16_to_float(v.as<std::uint16_t>()[i]));
  }
  expect_close(combine, f.combine, "combine slots", kBf16AbsFrac);

  layer.backward(data.backward_args());
  // Every gradient the layer wrote beside the formulation's, with its name and bar: dx as y,
  // the fp32 gradients to kF32AbsFrac.
  auto each_gradient = [&](const test::DenseGrads& g, const std::string& tag, auto&& visit) {
    visit(test::concat_ranks(data, &RankData::dx), g.dx, tag + "dx", kBf16AbsFrac);
    visit(test::concat_ranks(data, &RankData::d_router_weights), g.d_router, tag + "d_router_weights", kF32AbsFrac);
    visit(test::concat_ranks(data, &RankData::d_w_gate), g.d_gate, tag + "d_w_gate", kF32AbsFrac);
    visit(test::concat_ranks(data, &RankData::d_w_up), g.d_up, tag + "d_w_up", kF32AbsFrac);
    visit(test::concat_ranks(data, &RankData::d_w_down), g.d_down, tag + "d_w_down", kF32AbsFrac);
    for (int s = 0; s < p.num_shared(); ++s) {
      const std::string n = tag + "shared " + std::to_string(s) + " ";
      visit(test::shared_grad_sum(data, s, &SharedHostGrads::d_w_gate), g.d_shared_gate[s], n + "d_w_gate",
            kF32AbsFrac);
      visit(test::shared_grad_sum(data, s, &SharedHostGrads::d_w_up), g.d_shared_up[s], n + "d_w_up", kF32AbsFrac);
      visit(test::shared_grad_sum(data, s, &SharedHostGrads::d_w_down), g.d_shared_down[s], n + "d_w_down",
            kF32AbsFrac);
    }
  };
  // bf16 and MXFP8 alike, against the formulation with the reference's rounding points (for
  // MXFP8: dy and W_down^T along H, [dG | dU] and the weights along 2I, the wgrads' operands
  // along each expert's rows), as tightly: a rounding point dropped or moved fails here.
  const bool mx = c.precision != Precision::bf16;
  each_gradient(test::dense_backward(dense, mode), mx ? "mxfp8 " : "", expect_close);
  if (mx) {
    // And MoK's gradient bar against the straight-through gradient (no backward rounding), so
    // that a harmful rounding point put into both the reference and the formulation above
    // would still fail.
    const double cos_bar = mok_tolerance(Precision::mxfp8).grad_cosine;
    each_gradient(test::dense_backward(dense, Mode::mxfp8, /*round_backward=*/false), "straight-through ",
                  [&](const std::vector<double>& out, const std::vector<double>& ref, const std::string& what,
                      double /*abs_frac: MoK's bar instead*/) {
                    const Diff d = test::diff(out, ref);
                    EXPECT_EQ(d.non_finite, 0) << what;
                    EXPECT_GE(d.cosine, cos_bar) << what << ": " << d.describe();
                    EXPECT_LE(d.rel, 0.1) << what << ": " << d.describe();
                  });
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cases, ReferenceVsDense,
    ::testing::Values(Case{1, 2, {}, std::nullopt}, Case{2, 2, {}, 0.75f}, Case{1, 3, {44}, std::nullopt},
                      Case{2, 2, {44}, 0.75f}, Case{1, 2, {32, 80}, 0.75f}, Case{2, 3, {32, 80}, std::nullopt},
                      Case{4, 2, {20}, 0.75f}, Case{2, 3, {20, 36}, 0.75f, Precision::bf16, 60, 36},
                      Case{1, 2, {32, 64}, std::nullopt, Precision::mxfp8},
                      Case{2, 3, {32, 64}, 0.75f, Precision::mxfp8}, Case{2, 2, {}, std::nullopt, Precision::mxfp8},
                      // k = 1, k = E, experts that receive no rows (every token's k to one
                      // rank's experts), and MXFP8 experts with several 32-row blocks along
                      // the wgrad's rows.
                      Case{2, 1, {32}, std::nullopt}, Case{1, 8, {}, 0.75f}, Case{2, 8, {32}, std::nullopt, Precision::mxfp8},
                      Case{2, 2, {32}, 0.75f, Precision::bf16, 64, 32, 48, "worst:0"},
                      Case{2, 2, {}, std::nullopt, Precision::mxfp8, 64, 32, 48, "worst:1"},
                      Case{1, 2, {32}, 0.75f, Precision::mxfp8, 64, 32, 256}),
    [](const ::testing::TestParamInfo<Case>& info) { return name_of(info.param); });

// The bf16 rounding points matter: a dense formulation that skips them is measurably off,
// so the comparison above can tell them apart (guards against a vacuous check).
TEST(ReferenceVsDenseSanity, RoundingPointsAreVisible) {
  const Problem p = test::make_problem(8, 64, 32, 2, {48}, 1, 48);
  LayerData data = test::make_data(p, 1234, false);
  test::run_reference(data, false);
  const auto exact = test::dense_forward(DenseLayer::from(data), Mode::exact);
  std::vector<double> y_exact_rounded;
  for (double v : exact.y) y_exact_rounded.push_back(test::rnd_bf16(v));
  const Diff d = test::diff(test::concat_ranks(data, &RankData::y), y_exact_rounded);
  EXPECT_GT(d.rel, 10 * kRel) << "without the intermediate rounding the results must differ: " << d.describe();
  EXPECT_LT(d.rel, 2e-2) << d.describe();
}

}  // namespace
}  // namespace mok

namespace mok {

// MoK's check never passes a NaN or Inf on either side: a reference that overflowed or was
// poisoned checks nothing (an all-NaN reference used to pass with max_abs 0).
TEST(Compare, ANonFiniteValueOnEitherSideNeverPasses) {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  const std::vector<float> fine = {1.0f, -2.0f, 3.0f};
  EXPECT_TRUE(compare(fine.data(), fine.data(), 3).passes(0.5, 0.01));
  const std::vector<float> all_nan = {nan, nan, nan};
  const Comparison c = compare(fine.data(), all_nan.data(), 3);
  EXPECT_EQ(c.non_finite, 3);
  EXPECT_FALSE(c.passes(1e9, 1e9));
  EXPECT_FALSE(compare(all_nan.data(), fine.data(), 3).passes(1e9, 1e9));
  const std::vector<float> with_inf = {1.0f, inf, 3.0f}, other_inf = {1.0f, -inf, 3.0f};
  EXPECT_TRUE(compare(with_inf.data(), with_inf.data(), 3).passes(0.5, 0.01)) << "the same infinity agrees";
  EXPECT_FALSE(compare(other_inf.data(), with_inf.data(), 3).passes(1e9, 1e9));
  EXPECT_FALSE(compare(fine.data(), with_inf.data(), 3).passes(1e9, 1e9));
}

// Calls on one Layer from several threads run one at a time: the CPU backend's thread pool
// holds one job, and overlapping calls used to hang in it or give a wrong y (Python's ctypes
// releases the GIL, so its threads really do overlap).
TEST(Layer, CallsFromSeveralThreadsRunOneAtATime) {
  const Problem p = test::make_problem(8, 64, 32, 2, {32}, 2, 16);
  LayerData want = test::make_data(p, 77, false);
  test::run_reference(want, false, test::roomy_config(), 4);
  Layer layer(p, test::roomy_config(), test::cpu_options(4));
  constexpr int kThreads = 4, kCalls = 20;
  std::vector<LayerData> got(kThreads, want);
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i)
    threads.emplace_back([&, i] {
      for (int c = 0; c < kCalls; ++c) {
        got[i].poison_outputs();
        layer.forward(got[i].forward_args());
        for (int r = 0; r < p.ep_size; ++r)
          if (!got[i].ranks[r].y.bitwise_equal(want.ranks[r].y)) {
            ADD_FAILURE() << "thread " << i << " call " << c << " rank " << r << ": y differs";
            return;
          }
      }
    });
  for (auto& t : threads) t.join();
}

// A Layer used in a forked child (Python's multiprocessing forks by default on Linux): its
// CPU threads stayed in the parent, so the child's calls used to wait for them for ever, and
// so did its destructor. The child starts its own and gets the parent's bits; one that only
// destroys the layer exits. Each child has an alarm, so a hang is a failure, not a stuck test.
TEST(Layer, AForkedChildUsesItsOwnThreads) {
  const Problem p = test::make_problem(8, 64, 32, 2, {32}, 2, 16);
  LayerData want = test::make_data(p, 78, false);
  auto layer = std::make_unique<Layer>(p, test::roomy_config(), test::cpu_options(3));
  layer->forward(want.forward_args());  // (the pool has run a job before the fork)
  for (const bool call : {true, false}) {
    const pid_t child = fork();
    ASSERT_NE(child, -1);
    if (child == 0) {
      alarm(60);
      int code = 0;
      try {
        if (call) {
          LayerData got = want;
          for (int c = 0; c < 3 && code == 0; ++c) {
            got.poison_outputs();
            layer->forward(got.forward_args());
            for (int r = 0; r < p.ep_size; ++r)
              if (!got.ranks[r].y.bitwise_equal(want.ranks[r].y)) code = 3;
          }
        }
        layer.reset();
      } catch (...) {
        code = 4;
      }
      _exit(code);
    }
    int status = 0;
    ASSERT_EQ(waitpid(child, &status, 0), child);
    EXPECT_TRUE(WIFEXITED(status)) << (call ? "calls" : "destroy only") << ": the child ended by signal "
                                   << (WIFSIGNALED(status) ? WTERMSIG(status) : 0) << " (14: its alarm, a hang)";
    if (WIFEXITED(status))
      EXPECT_EQ(WEXITSTATUS(status), 0) << (call ? "calls" : "destroy only") << " (3: y differs, 4: threw)";
  }
  // The parent's pool is untouched by the children.
  LayerData again = want;
  again.poison_outputs();
  layer->forward(again.forward_args());
  for (int r = 0; r < p.ep_size; ++r) EXPECT_TRUE(again.ranks[r].y.bitwise_equal(want.ranks[r].y)) << "rank " << r;
}

}  // namespace mok
