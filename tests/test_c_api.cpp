// The C interface (include/mok/c_api.h) against mok::Layer itself on the CPU backend: the
// same bits through either, statuses and messages instead of exceptions, and arguments the
// C side can get wrong (NULLs, enum values out of range) named. Also run under ASan/UBSan by
// scripts/host_sanitizers.sh (python/mok's CPU tests are too, through that build's libmok.so).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "capi/c_structs.h"
#include "mok/c_api.h"
#include "test_util.h"

namespace mok::test {
namespace {

using ::testing::HasSubstr;

using capi::c_problem;
using capi::c_tensor;

// What a C caller fills in both mok_rank_forward and mok_rank_backward: inputs and weights.
template <typename CRank>
void fill_inputs_and_weights(CRank& c, const RankInputs& in, const RankWeights& w) {
  c.x = c_tensor(in.x);
  c.top_experts = c_tensor(in.top_experts);
  c.router_weights = c_tensor(in.router_weights);
  c.w_gate = c_tensor(w.w_gate);
  c.w_up = c_tensor(w.w_up);
  c.w_down = c_tensor(w.w_down);
  c.num_shared = static_cast<int32_t>(w.shared.size());
  for (std::size_t s = 0; s < w.shared.size(); ++s)
    c.shared[s] = {c_tensor(w.shared[s].w_gate), c_tensor(w.shared[s].w_up), c_tensor(w.shared[s].w_down)};
}

std::vector<mok_rank_forward> c_forward(const std::vector<RankForward>& args) {
  std::vector<mok_rank_forward> out;
  for (const RankForward& a : args) {
    mok_rank_forward c{};
    fill_inputs_and_weights(c, a.inputs, a.weights);
    c.y = c_tensor(a.y);
    out.push_back(c);
  }
  return out;
}

mok_options cpu_c_options() {
  mok_options o{};
  o.backend = MOK_BACKEND_CPU;
  o.ep_mode = MOK_ALL_RANKS;
  o.cpu_threads = 2;
  return o;
}

TEST(CApi, ForwardAndBackwardGiveTheBitsOfTheCppLayer) {
  // (A clamped SwiGLU, so the limit's way through the interface shows in the bits.)
  const Problem p = make_problem(8, 64, 96, 2, {32}, 2, 16, Precision::bf16, 0.75f);
  LayerData cpp = make_data(p, 31, true), c = make_data(p, 31, true);
  run_reference(cpp, true, Config{}, 2);

  const mok_problem problem = c_problem(p);
  mok_config config;
  mok_default_config(&config);
  const mok_options options = cpu_c_options();
  mok_layer* layer = nullptr;
  ASSERT_EQ(mok_layer_create(&problem, &config, &options, &layer), MOK_OK) << mok_last_error();
  const auto fwd = c_forward(c.forward_args());
  ASSERT_EQ(mok_layer_forward(layer, fwd.data(), static_cast<int32_t>(fwd.size())), MOK_OK) << mok_last_error();

  std::vector<mok_rank_backward> bwd;
  for (const RankBackward& a : c.backward_args()) {
    mok_rank_backward b{};
    fill_inputs_and_weights(b, a.inputs, a.weights);
    b.dy = c_tensor(a.dy);
    b.dx = c_tensor(a.dx);
    b.d_router_weights = c_tensor(a.d_router_weights);
    b.d_w_gate = c_tensor(a.d_w_gate);
    b.d_w_up = c_tensor(a.d_w_up);
    b.d_w_down = c_tensor(a.d_w_down);
    for (std::size_t s = 0; s < a.d_shared.size(); ++s)
      b.d_shared[s] = {c_tensor(a.d_shared[s].d_w_gate), c_tensor(a.d_shared[s].d_w_up),
                       c_tensor(a.d_shared[s].d_w_down)};
    bwd.push_back(b);
  }
  ASSERT_EQ(mok_layer_backward(layer, bwd.data(), static_cast<int32_t>(bwd.size())), MOK_OK) << mok_last_error();
  EXPECT_EQ(mok_layer_synchronize(layer), MOK_OK);
  mok_tensor slots{};
  ASSERT_EQ(mok_layer_combine_slots(layer, 1, &slots), MOK_OK) << mok_last_error();
  EXPECT_NE(slots.data, nullptr);
  EXPECT_EQ(slots.dtype, MOK_BF16);
  EXPECT_EQ(slots.ndim, 2);
  EXPECT_EQ(slots.shape[0], std::int64_t(p.tokens_per_rank) * p.top_k);
  EXPECT_EQ(slots.shape[1], p.hidden);
  EXPECT_EQ(mok_layer_combine_slots(layer, 2, &slots), MOK_ERROR);
  EXPECT_THAT(mok_last_error(), HasSubstr("combine_slots"));
  mok_config resolved;
  ASSERT_EQ(mok_layer_config(layer, &resolved), MOK_OK);
  EXPECT_EQ(resolved.tile_rows, 128);
  mok_layer_destroy(layer);

  for (int r = 0; r < p.ep_size; ++r) {
    EXPECT_TRUE(c.ranks[r].y.bitwise_equal(cpp.ranks[r].y)) << "rank " << r << " y";
    EXPECT_TRUE(c.ranks[r].dx.bitwise_equal(cpp.ranks[r].dx)) << "rank " << r << " dx";
    EXPECT_TRUE(c.ranks[r].d_router_weights.bitwise_equal(cpp.ranks[r].d_router_weights)) << "rank " << r;
    EXPECT_TRUE(c.ranks[r].d_w_gate.bitwise_equal(cpp.ranks[r].d_w_gate)) << "rank " << r << " d_w_gate";
    EXPECT_TRUE(c.ranks[r].d_w_up.bitwise_equal(cpp.ranks[r].d_w_up)) << "rank " << r << " d_w_up";
    EXPECT_TRUE(c.ranks[r].d_w_down.bitwise_equal(cpp.ranks[r].d_w_down)) << "rank " << r << " d_w_down";
    const SharedHostGrads &got = c.ranks[r].d_shared[0], &want = cpp.ranks[r].d_shared[0];
    EXPECT_TRUE(got.d_w_gate.bitwise_equal(want.d_w_gate) && got.d_w_up.bitwise_equal(want.d_w_up) &&
                got.d_w_down.bitwise_equal(want.d_w_down))
        << "rank " << r << " shared gradients";
  }
}

TEST(CApi, FailuresAreStatusesWithTheLayersMessage) {
  const Problem p = make_problem(8, 64, 64, 2, {}, 2, 16);
  mok_problem problem = c_problem(p);
  const mok_options options = cpu_c_options();
  mok_layer* layer = nullptr;

  problem.top_k = 0;
  EXPECT_EQ(mok_layer_create(&problem, nullptr, &options, &layer), MOK_ERROR);
  EXPECT_THAT(mok_last_error(), HasSubstr("top_k"));
  EXPECT_EQ(layer, nullptr);
  problem = c_problem(p);
  problem.num_shared = 9;
  EXPECT_EQ(mok_layer_create(&problem, nullptr, &options, &layer), MOK_ERROR);
  EXPECT_THAT(mok_last_error(), HasSubstr("problem.num_shared = 9: must be in [0, 8]"));
  problem = c_problem(p);
  mok_options bad = options;
  bad.ep_mode = 7;
  EXPECT_EQ(mok_layer_create(&problem, nullptr, &bad, &layer), MOK_ERROR);
  EXPECT_THAT(mok_last_error(), HasSubstr("options.ep_mode = 7"));
  problem.has_swiglu_limit = 7;
  EXPECT_EQ(mok_layer_create(&problem, nullptr, &options, &layer), MOK_ERROR);
  EXPECT_THAT(mok_last_error(), HasSubstr("problem.has_swiglu_limit = 7: must be 0 or 1"));
  problem = c_problem(p);
  mok_config pairs_config{};
  mok_default_config(&pairs_config);
  pairs_config.task_pairs = -1;
  EXPECT_EQ(mok_layer_create(&problem, &pairs_config, &options, &layer), MOK_ERROR);
  EXPECT_THAT(mok_last_error(), HasSubstr("config.task_pairs = -1: must be 0 or 1"));
  layer = reinterpret_cast<mok_layer*>(0x1234);  // (a stale handle: cleared before any check)
  EXPECT_EQ(mok_layer_create(nullptr, nullptr, &options, &layer), MOK_ERROR);
  EXPECT_THAT(mok_last_error(), HasSubstr("problem: must not be NULL"));
  EXPECT_EQ(layer, nullptr);

  ASSERT_EQ(mok_layer_create(&problem, nullptr, &options, &layer), MOK_OK) << mok_last_error();
  LayerData data = make_data(p, 32, false);
  data.ranks[1].top_experts.data<std::int32_t>()[3 * 2 + 1] = 99;
  auto fwd = c_forward(data.forward_args());
  EXPECT_EQ(mok_layer_forward(layer, fwd.data(), 2), MOK_ERROR);
  EXPECT_THAT(mok_last_error(), HasSubstr("top_experts[rank 1][token 3, slot 1] = 99"));
  fwd[0].x.dtype = 42;
  EXPECT_EQ(mok_layer_forward(layer, fwd.data(), 2), MOK_ERROR);
  EXPECT_THAT(mok_last_error(), HasSubstr("ranks[0].x.dtype = 42"));
  // A rank's shared-expert count, named by its C field.
  fwd = c_forward(data.forward_args());
  fwd[1].num_shared = 2;
  EXPECT_EQ(mok_layer_forward(layer, fwd.data(), 2), MOK_ERROR);
  EXPECT_THAT(mok_last_error(), HasSubstr("ranks[1].num_shared = 2: the layer's problem has 0 shared expert(s)"));
  // A cpu tensor has no device index: one given is refused, not ignored.
  fwd = c_forward(data.forward_args());
  fwd[1].w_up.device_index = 7;
  EXPECT_EQ(mok_layer_forward(layer, fwd.data(), 2), MOK_ERROR);
  EXPECT_THAT(mok_last_error(), HasSubstr("ranks[1].w_up.device_index = 7: must be 0 for a cpu tensor"));
  fwd = c_forward(data.forward_args());
  fwd[0].x.dtype = 42;
  EXPECT_EQ(mok_layer_forward(layer, fwd.data(), 0), MOK_ERROR);
  EXPECT_THAT(mok_last_error(), HasSubstr("num_ranks = 0"));
  // A count beyond the layer's is refused before the array is read (these entries past the
  // caller's two would be read past its end: under ASan, scripts/host_sanitizers.sh, a read).
  for (const int32_t n : {3, INT32_MAX}) {
    EXPECT_EQ(mok_layer_forward(layer, fwd.data(), n), MOK_ERROR);
    EXPECT_THAT(mok_last_error(), HasSubstr("entries given; the layer needs one per rank"));
    EXPECT_THAT(mok_last_error(), HasSubstr("num_ranks = " + std::to_string(n) + ": "));
  }
  EXPECT_EQ(mok_layer_forward(nullptr, fwd.data(), 2), MOK_ERROR);
  EXPECT_EQ(mok_layer_synchronize(nullptr), MOK_ERROR);
  EXPECT_EQ(mok_layer_abandon_group(nullptr, "why"), MOK_ERROR);
  EXPECT_THAT(mok_last_error(), HasSubstr("layer: must not be NULL"));
  // Without a group there is nothing to abandon: the layer goes on.
  EXPECT_EQ(mok_layer_abandon_group(layer, nullptr), MOK_OK) << mok_last_error();
  EXPECT_EQ(mok_layer_abandon_group(layer, "no group"), MOK_OK) << mok_last_error();
  int32_t aborted = 7;
  EXPECT_EQ(mok_layer_group_aborted(layer, &aborted), MOK_OK) << mok_last_error();
  EXPECT_EQ(aborted, 0);
  EXPECT_EQ(mok_layer_group_aborted(layer, nullptr), MOK_ERROR);
  EXPECT_THAT(mok_last_error(), HasSubstr("aborted: must not be NULL"));
  LayerData good = make_data(p, 33, false);
  const auto good_fwd = c_forward(good.forward_args());
  EXPECT_EQ(mok_layer_forward(layer, good_fwd.data(), 2), MOK_OK) << mok_last_error();
  mok_layer_destroy(layer);
  mok_layer_destroy(nullptr);  // ignored
  // After a failure: destroyed as while an exception propagates (a group would abort).
  ASSERT_EQ(mok_layer_create(&problem, nullptr, &options, &layer), MOK_OK) << mok_last_error();
  mok_layer_destroy_after_error(layer);
  mok_layer_destroy_after_error(nullptr);
}

TEST(CApi, NamedShapesAndTheAbiVersion) {
  EXPECT_EQ(mok_c_abi_version(), MOK_C_ABI_VERSION);
  ASSERT_EQ(mok_shape_count(), static_cast<int32_t>(named_shapes().size()));
  for (int32_t i = 0; i < mok_shape_count(); ++i) {
    ASSERT_NE(mok_shape_name(i), nullptr) << i;
    EXPECT_EQ(std::string(mok_shape_name(i)), named_shapes()[i].name);
  }
  EXPECT_EQ(mok_shape_name(mok_shape_count()), nullptr);
  EXPECT_EQ(mok_shape_name(-1), nullptr);
  mok_problem p{};
  ASSERT_EQ(mok_problem_from_shape("deepseek-v4-pro", 0, 0, &p), MOK_OK) << mok_last_error();
  EXPECT_EQ(p.hidden, 7168);
  EXPECT_EQ(p.ep_size, 64);
  EXPECT_EQ(p.num_shared, 1);
  EXPECT_EQ(p.shared_intermediate[0], 3072);
  EXPECT_EQ(mok_problem_from_shape("nope", 0, 0, &p), MOK_ERROR);
  EXPECT_THAT(mok_last_error(), HasSubstr("nope"));
  // Only 0 means the shape's default; a problem handed out passes the problem's rules.
  EXPECT_EQ(mok_problem_from_shape("tiny", -5, 0, &p), MOK_ERROR);
  EXPECT_THAT(mok_last_error(), HasSubstr("ep_size = -5: must be >= 0"));
  EXPECT_EQ(mok_problem_from_shape("tiny", 0, -7, &p), MOK_ERROR);
  EXPECT_THAT(mok_last_error(), HasSubstr("tokens_per_rank = -7: must be >= 0"));
  EXPECT_EQ(mok_problem_from_shape("tiny", 3, 0, &p), MOK_ERROR);
  EXPECT_THAT(mok_last_error(), HasSubstr("ep_size"));
}

TEST(CApi, VersionAndCommitAreTheLibrarys) {
  // The same strings through either interface, in their stated forms.
  EXPECT_EQ(std::string(mok_version()), mok::version());
  EXPECT_EQ(std::string(mok_build_commit()), mok::build_commit());
  EXPECT_THAT(mok::version(), ::testing::MatchesRegex("[0-9]+\\.[0-9]+\\.[0-9]+"));
  EXPECT_THAT(mok::build_commit(), ::testing::MatchesRegex("([0-9a-f]{12}(-dirty)?)|unknown"));
}

}  // namespace
}  // namespace mok::test
