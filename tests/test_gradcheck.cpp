// Gradients against central finite differences of the layer's exact math.
//
// loss = sum(y * dy), y from the dense formulation of tests/test_util.h in double precision
// WITHOUT any bf16 rounding (Mode::exact). For a deterministic sample of entries of x,
// router_weights, every routed weight and every shared weight, the central difference
// (loss(v+h) - loss(v-h)) / 2h with h = 1e-5 is compared to
//   1. the dense exact backward (a self-check of the test's own backward formulas):
//      relative L2 error <= 1e-6 (double precision; FD truncation error is ~h^2);
//   2. the CPU reference's gradients, which round through bf16 (operands, a, dG/dU, each
//      expert's dx row; each point costs ~2^-9 relative, a few of them chain, observed
//      <= 3.3e-3): relative L2 error <= 1e-2 and cosine >= 0.9999 over each sampled vector.
// The clamped case (limit 1.0) clamps ~16% of gate and up values, so the masks matter.
#include <gtest/gtest.h>

#include <optional>
#include <random>
#include <string>
#include <vector>

#include "test_util.h"

namespace mok {
namespace {

using test::DenseLayer;

constexpr double kStep = 1e-5;
constexpr double kSelfRelL2 = 1e-6;
constexpr double kRefRelL2 = 1e-2;
constexpr double kRefCosine = 0.9999;

struct Sample {
  std::vector<double> fd, dense, ref;
};

// Perturbs one double `v` (inside `layer`) and returns the central difference of the loss.
double central_difference(DenseLayer& layer, double& v) {
  const double saved = v;
  v = saved + kStep;
  const double up = test::dense_loss(layer);
  v = saved - kStep;
  const double down = test::dense_loss(layer);
  v = saved;
  return (up - down) / (2 * kStep);
}

void check(const Sample& s, const std::string& what) {
  ASSERT_FALSE(s.fd.empty());
  const test::Diff self = test::diff(s.dense, s.fd);
  EXPECT_EQ(self.non_finite, 0) << what << " (dense backward vs FD)";
  EXPECT_LE(self.rel_l2, kSelfRelL2) << what << " (dense backward vs FD): " << self.describe();
  const test::Diff ref = test::diff(s.ref, s.fd);
  EXPECT_EQ(ref.non_finite, 0) << what;
  EXPECT_LE(ref.rel_l2, kRefRelL2) << what << " (reference vs FD): " << ref.describe();
  EXPECT_GE(ref.cosine, kRefCosine) << what << " (reference vs FD): " << ref.describe();
  EXPECT_GT(ref.max_ref, 0) << what << ": every sampled gradient is zero";
}

class GradCheck : public ::testing::TestWithParam<std::optional<float>> {};

TEST_P(GradCheck, ReferenceGradientsMatchFiniteDifferences) {
  // E=8 over R=2, H=32, I=32, k=2, shared widths 16 and 24, 16 tokens in all.
  const Problem p = test::make_problem(8, 32, 32, 2, {16, 24}, 2, 8, Precision::bf16, GetParam());
  LayerData data = test::make_data(p, 77, true);
  test::run_reference(data, true);

  DenseLayer layer = DenseLayer::from(data);
  const auto exact = test::dense_backward(layer, test::Mode::exact);
  const auto ref_dx = test::concat_ranks(data, &RankData::dx);
  const auto ref_dw = test::concat_ranks(data, &RankData::d_router_weights);
  const auto ref_dg = test::concat_ranks(data, &RankData::d_w_gate);
  const auto ref_du = test::concat_ranks(data, &RankData::d_w_up);
  const auto ref_dd = test::concat_ranks(data, &RankData::d_w_down);

  std::mt19937 gen(2024);
  auto pick = [&](std::size_t n) { return std::uniform_int_distribution<std::size_t>(0, n - 1)(gen); };
  constexpr int kSamples = 24;

  auto sample = [&](std::vector<double>& values, const std::vector<double>& dense,
                    const std::vector<double>& ref, int n, const std::string& what) {
    Sample s;
    for (int i = 0; i < n; ++i) {
      const std::size_t idx = pick(values.size());
      s.fd.push_back(central_difference(layer, values[idx]));
      s.dense.push_back(dense[idx]);
      s.ref.push_back(ref[idx]);
    }
    check(s, what);
  };

  sample(layer.x, exact.dx, ref_dx, kSamples, "dx");
  // Every router weight (16 tokens * k = 32 of them).
  {
    Sample s;
    for (std::size_t i = 0; i < layer.w.size(); ++i) {
      s.fd.push_back(central_difference(layer, layer.w[i]));
      s.dense.push_back(exact.d_router[i]);
      s.ref.push_back(ref_dw[i]);
    }
    check(s, "d_router_weights");
  }
  // Routed weights of every expert, gathered as [E, ...] in global expert order.
  {
    const std::size_t per = layer.experts[0].gate.size();
    Sample sg, su, sd;
    for (int i = 0; i < kSamples; ++i) {
      const std::size_t e = pick(layer.experts.size()), j = pick(per);
      sg.fd.push_back(central_difference(layer, layer.experts[e].gate[j]));
      sg.dense.push_back(exact.d_gate[e * per + j]);
      sg.ref.push_back(ref_dg[e * per + j]);
      su.fd.push_back(central_difference(layer, layer.experts[e].up[j]));
      su.dense.push_back(exact.d_up[e * per + j]);
      su.ref.push_back(ref_du[e * per + j]);
      sd.fd.push_back(central_difference(layer, layer.experts[e].down[j]));
      sd.dense.push_back(exact.d_down[e * per + j]);
      sd.ref.push_back(ref_dd[e * per + j]);
    }
    check(sg, "d_w_gate");
    check(su, "d_w_up");
    check(sd, "d_w_down");
  }
  // Shared experts: the reference's gradient is the sum of every rank's contribution.
  for (int s = 0; s < p.num_shared(); ++s) {
    const std::string n = "shared " + std::to_string(s) + " ";
    sample(layer.shared[s].gate, exact.d_shared_gate[s], test::shared_grad_sum(data, s, &SharedHostGrads::d_w_gate),
           kSamples, n + "d_w_gate");
    sample(layer.shared[s].up, exact.d_shared_up[s], test::shared_grad_sum(data, s, &SharedHostGrads::d_w_up),
           kSamples, n + "d_w_up");
    sample(layer.shared[s].down, exact.d_shared_down[s], test::shared_grad_sum(data, s, &SharedHostGrads::d_w_down),
           kSamples, n + "d_w_down");
  }
}

INSTANTIATE_TEST_SUITE_P(Limits, GradCheck, ::testing::Values(std::nullopt, std::optional<float>(1.0f)),
                         [](const auto& info) { return std::string(info.param ? "clamped" : "plain"); });

}  // namespace
}  // namespace mok
