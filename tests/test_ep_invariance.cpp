// EP invariance and determinism of the CPU reference.
//
// EP invariance: the same global batch (make_layer_data and generate_routing are keyed by
// global token and global expert) split over R = 1, 2, 4, 8 ranks gives bitwise identical
// y, dx, d_router_weights and routed weight gradients (ranks' local experts concatenated in
// rank order). Shared weight gradients are per-rank partial sums (each rank's own tokens),
// so only their sum over ranks is compared with R=1, within an fp32 summation tolerance:
// max|sum_R - R1| <= 1e-5 * max|R1| (fp32 eps 6e-8 times at most 64 terms, with margin).
//
// Determinism: bitwise identical outputs run to run and for cpu_threads = 1, 2, 3, forward
// and backward, bf16 and mxfp8.
#include <gtest/gtest.h>

#include <algorithm>
#include <cfenv>
#include <string>
#include <vector>
#if defined(__x86_64__)
#include <xmmintrin.h>
#endif

#include "test_util.h"

namespace mok {
namespace {

using Bytes = std::vector<std::uint8_t>;

constexpr int kGlobalTokens = 64;
constexpr double kSharedSumTol = 1e-5;

Problem ep_problem(int R, Precision precision) {
  return test::make_problem(8, 64, 32, 2, {32, 64}, R, kGlobalTokens / R, precision, 1.0f);
}

LayerData run_split(int R, Precision precision, const RoutingSpec& spec, bool backward) {
  const Problem p = ep_problem(R, precision);
  LayerData data = test::make_data(p, 31, backward, spec);
  test::run_reference(data, backward);
  return data;
}

void expect_same_bytes(const LayerData& a, const LayerData& b, HostTensor RankData::*m, const std::string& what) {
  const Bytes x = test::concat_bytes(a, m), y = test::concat_bytes(b, m);
  ASSERT_EQ(x.size(), y.size()) << what;
  EXPECT_TRUE(x == y) << what << " differs bitwise";
}

class EpInvariance : public ::testing::TestWithParam<const char*> {};

TEST_P(EpInvariance, Bf16ForwardAndBackward) {
  const RoutingSpec spec = RoutingSpec::parse(GetParam());
  const LayerData one = run_split(1, Precision::bf16, spec, true);
  for (int R : {2, 4, 8}) {
    SCOPED_TRACE("R=" + std::to_string(R));
    const LayerData split = run_split(R, Precision::bf16, spec, true);
    // The inputs really are the same global batch.
    for (auto m : {&RankData::x, &RankData::top_experts, &RankData::router_weights, &RankData::dy,
                   &RankData::w_gate, &RankData::w_up, &RankData::w_down})
      expect_same_bytes(split, one, m, "input");
    expect_same_bytes(split, one, &RankData::y, "y");
    expect_same_bytes(split, one, &RankData::dx, "dx");
    expect_same_bytes(split, one, &RankData::d_router_weights, "d_router_weights");
    expect_same_bytes(split, one, &RankData::d_w_gate, "d_w_gate");
    expect_same_bytes(split, one, &RankData::d_w_up, "d_w_up");
    expect_same_bytes(split, one, &RankData::d_w_down, "d_w_down");
    for (int s = 0; s < split.problem.num_shared(); ++s)
      for (auto m : {&SharedHostGrads::d_w_gate, &SharedHostGrads::d_w_up, &SharedHostGrads::d_w_down}) {
        const auto sum = test::shared_grad_sum(split, s, m);
        const auto ref = test::to_doubles(one.ranks[0].d_shared[s].*m);
        const test::Diff d = test::diff(sum, ref);
        EXPECT_EQ(d.non_finite, 0);
        EXPECT_GT(d.max_ref, 0);
        EXPECT_LE(d.max_abs, kSharedSumTol * d.max_ref) << "shared " << s << ": " << d.describe();
        // Each rank's part is its own tokens' contribution, not the whole (it must differ).
        EXPECT_GT(test::diff(test::to_doubles(split.ranks[0].d_shared[s].*m), ref).max_abs, 0.01 * d.max_ref);
      }
  }
}

TEST_P(EpInvariance, Mxfp8Forward) {
  const RoutingSpec spec = RoutingSpec::parse(GetParam());
  const LayerData one = run_split(1, Precision::mxfp8, spec, false);
  for (int R : {2, 4, 8}) {
    SCOPED_TRACE("R=" + std::to_string(R));
    const LayerData split = run_split(R, Precision::mxfp8, spec, false);
    expect_same_bytes(split, one, &RankData::y, "mxfp8 y");
  }
}

// Not required by the layer's contract for shared experts, but the reference's MXFP8 blocks
// for routed rows follow the schedule's global row order, so the routed backward is EP
// invariant too.
TEST_P(EpInvariance, Mxfp8BackwardRoutedParts) {
  const RoutingSpec spec = RoutingSpec::parse(GetParam());
  const LayerData one = run_split(1, Precision::mxfp8, spec, true);
  for (int R : {2, 8}) {
    SCOPED_TRACE("R=" + std::to_string(R));
    const LayerData split = run_split(R, Precision::mxfp8, spec, true);
    expect_same_bytes(split, one, &RankData::dx, "mxfp8 dx");
    expect_same_bytes(split, one, &RankData::d_router_weights, "mxfp8 d_router_weights");
    expect_same_bytes(split, one, &RankData::d_w_gate, "mxfp8 d_w_gate");
    expect_same_bytes(split, one, &RankData::d_w_up, "mxfp8 d_w_up");
    expect_same_bytes(split, one, &RankData::d_w_down, "mxfp8 d_w_down");
  }
}

INSTANTIATE_TEST_SUITE_P(Routings, EpInvariance, ::testing::Values("gaussian", "zipf:1.5"),
                         [](const auto& info) { return std::string(info.param).substr(0, 4); });

// ---- determinism ----------------------------------------------------------------------------

// Every output of every rank, as bytes.
std::vector<Bytes> outputs(const LayerData& d) {
  std::vector<Bytes> v;
  for (const auto& r : d.ranks) {
    for (const HostTensor* t : {&r.y, &r.dx, &r.d_router_weights, &r.d_w_gate, &r.d_w_up, &r.d_w_down})
      v.push_back(test::bytes_of(*t));
    for (const auto& s : r.d_shared)
      for (const HostTensor* t : {&s.d_w_gate, &s.d_w_up, &s.d_w_down}) v.push_back(test::bytes_of(*t));
  }
  return v;
}

// Elements of every output of `d` that still hold the poison (every byte 0xff: NaN in bf16 and
// f32 alike, which no output of finite inputs is), named by rank and tensor.
std::vector<std::string> poisoned_outputs(const LayerData& d) {
  std::vector<std::string> found;
  auto scan = [&](const HostTensor& t, const std::string& name) {
    const TensorView v = t.view();
    const std::size_t size = dtype_size(v.dtype);
    const auto* bytes = static_cast<const unsigned char*>(v.data);
    std::int64_t n = 0;
    for (std::int64_t i = 0; i < v.numel(); ++i)
      n += std::all_of(bytes + i * size, bytes + (i + 1) * size, [](unsigned char b) { return b == 0xff; });
    if (n > 0) found.push_back(name + ": " + std::to_string(n) + " of " + std::to_string(v.numel()));
  };
  for (std::size_t r = 0; r < d.ranks.size(); ++r) {
    const RankData& rd = d.ranks[r];
    const std::string at = "rank " + std::to_string(r) + " ";
    scan(rd.y, at + "y");
    scan(rd.dx, at + "dx");
    scan(rd.d_router_weights, at + "d_router_weights");
    scan(rd.d_w_gate, at + "d_w_gate");
    scan(rd.d_w_up, at + "d_w_up");
    scan(rd.d_w_down, at + "d_w_down");
    for (std::size_t s = 0; s < rd.d_shared.size(); ++s) {
      scan(rd.d_shared[s].d_w_gate, at + "shared d_w_gate");
      scan(rd.d_shared[s].d_w_up, at + "shared d_w_up");
      scan(rd.d_shared[s].d_w_down, at + "shared d_w_down");
    }
  }
  return found;
}

class Determinism : public ::testing::TestWithParam<Precision> {};

// A token's output never depends on its neighbours: moving tokens over positions and
// ranks, and replacing a quarter of them, leaves every kept token's y bitwise unchanged.
TEST(Composition, ATokensOutputDoesNotDependOnItsNeighbours) {
  for (int R : {1, 4}) {
    const Problem p = ep_problem(R, Precision::bf16);
    LayerData a = test::make_data(p, 31, false);
    const LayerData fresh = test::make_data(p, 32, false);
    auto shuffled = test::shuffle_tokens(a, fresh, 33);
    test::run_reference(a, false);
    test::run_reference(shuffled.data, false);
    EXPECT_GE(test::expect_same_y_where_moved(a, shuffled.data, shuffled.moved_to), kGlobalTokens / 2) << "R=" << R;
  }
}

TEST_P(Determinism, BitwiseAcrossRunsAndThreadCounts) {
  // Big enough that every GEMM, gather and epilogue splits over several threads.
  const Problem p = test::make_problem(8, 128, 64, 3, {64, 96}, 2, 160, GetParam(), 1.0f);
  const LayerData pristine = test::make_data(p, 5, true, RoutingSpec::parse("zipf:1.2"));
  // (The check below can fail: every output starts poisoned, every element of it.)
  ASSERT_EQ(poisoned_outputs(pristine).size(), 6 * pristine.ranks.size() + 3 * pristine.ranks[0].d_shared.size() *
                                                                            pristine.ranks.size());
  std::vector<Bytes> first;
  for (int threads : {1, 2, 3}) {
    Layer layer(p, test::roomy_config(), test::cpu_options(threads));
    for (int rep = 0; rep < 2; ++rep) {  // the same Layer twice: run to run
      SCOPED_TRACE("threads=" + std::to_string(threads) + " rep=" + std::to_string(rep));
      LayerData data = pristine;  // outputs poisoned
      layer.forward(data.forward_args());
      layer.backward(data.backward_args());
      const auto out = outputs(data);
      // No element of any output may keep its poison.
      const auto poisoned = poisoned_outputs(data);
      EXPECT_TRUE(poisoned.empty()) << "unwritten elements, first: " << (poisoned.empty() ? "" : poisoned[0]);
      if (first.empty()) first = out;
      ASSERT_EQ(out.size(), first.size());
      for (std::size_t i = 0; i < out.size(); ++i) EXPECT_TRUE(out[i] == first[i]) << "output " << i;
    }
  }
}

// The caller's floating-point settings (another rounding mode; on x86 flush-to-zero and
// denormals-are-zero, as torch.set_flush_denormal sets them) change no bit, at any thread
// count, and are the caller's again after each call. (Without DefaultFloatEnvironment the
// caller's thread computed in them: upward rounding alone changed bits.)
TEST_P(Determinism, TheCallersFloatingPointSettingsChangeNothing) {
  const Problem p = test::make_problem(8, 128, 64, 3, {64, 96}, 2, 160, GetParam(), 1.0f);
  const LayerData pristine = test::make_data(p, 6, true, RoutingSpec::parse("zipf:1.2"));
  auto run = [&](Layer& layer) {
    LayerData data = pristine;
    layer.forward(data.forward_args());
    layer.backward(data.backward_args());
    return outputs(data);
  };
  std::vector<Bytes> want;
  {
    Layer layer(p, test::roomy_config(), test::cpu_options(1));
    want = run(layer);
  }
  for (int threads : {1, 3}) {
    SCOPED_TRACE("threads=" + std::to_string(threads));
    Layer layer(p, test::roomy_config(), test::cpu_options(threads));  // (made in the default settings)
    std::fenv_t before;
    ASSERT_EQ(std::fegetenv(&before), 0);
    ASSERT_EQ(std::fesetround(FE_UPWARD), 0);
#if defined(__x86_64__)
    const unsigned kFlushToZeroAndDenormalsAreZero = 0x8040;
    _mm_setcsr(_mm_getcsr() | kFlushToZeroAndDenormalsAreZero);
#endif
    const auto got = run(layer);
    const int round_after = std::fegetround();
#if defined(__x86_64__)
    const unsigned csr_after = _mm_getcsr();
#endif
    std::fesetenv(&before);
    EXPECT_EQ(round_after, FE_UPWARD) << "the caller's rounding mode was not put back";
#if defined(__x86_64__)
    EXPECT_EQ(csr_after & kFlushToZeroAndDenormalsAreZero, kFlushToZeroAndDenormalsAreZero)
        << "the caller's flush-to-zero was not put back";
#endif
    ASSERT_EQ(got.size(), want.size());
    for (std::size_t i = 0; i < got.size(); ++i) EXPECT_TRUE(got[i] == want[i]) << "output " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Precisions, Determinism, ::testing::Values(Precision::bf16, Precision::mxfp8),
                         [](const auto& info) { return std::string(to_string(info.param)); });

}  // namespace
}  // namespace mok
