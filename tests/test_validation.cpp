// Bad input: every case asserts that mok::Error is thrown AND that its message names the
// argument (with its rank/token/slot where that applies) and the rule it broke.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "core/tuning_env.h"
#include "core/validate.h"
#include "test_util.h"

namespace mok {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;
using test::error_message;

class BadInput : public ::testing::Test {
 protected:
  // E=8 over R=2, H=64, I=32, k=2, one shared expert, T=8.
  Problem p_ = test::make_problem(8, 64, 32, 2, {32}, 2, 8);
  LayerData data_ = test::make_data(p_, 3, true);
  Layer layer_{p_, test::roomy_config(), test::cpu_options(2)};

  std::string forward_error() { return error_message([&] { layer_.forward(data_.forward_args()); }); }
  std::string backward_error() { return error_message([&] { layer_.backward(data_.backward_args()); }); }
  std::string forward_error(const std::vector<RankForward>& args) {
    return error_message([&] { layer_.forward(args); });
  }
  std::string backward_error(const std::vector<RankBackward>& args) {
    return error_message([&] { layer_.backward(args); });
  }
  std::int32_t& id(int rank, int t, int j) { return data_.ranks[rank].top_experts.data<std::int32_t>()[t * 2 + j]; }
  float& weight(int rank, int t, int j) { return data_.ranks[rank].router_weights.data<float>()[t * 2 + j]; }
};

TEST_F(BadInput, GoodInputRuns) {
  EXPECT_NO_THROW(layer_.forward(data_.forward_args()));
  EXPECT_NO_THROW(layer_.backward(data_.backward_args()));
}

TEST_F(BadInput, ExpertIdOutOfRange) {
  id(1, 5, 1) = 8;
  std::string msg = forward_error();
  EXPECT_THAT(msg, AllOf(HasSubstr("top_experts[rank 1][token 5, slot 1]"), HasSubstr("= 8"),
                         HasSubstr("[0, 8)")));
  EXPECT_THAT(backward_error(), HasSubstr("top_experts[rank 1][token 5, slot 1]"));
  id(1, 5, 1) = -1;
  EXPECT_THAT(forward_error(), AllOf(HasSubstr("top_experts[rank 1][token 5, slot 1]"), HasSubstr("-1")));
  // Validation precedes any work: rank 0's output was never written.
  EXPECT_TRUE(std::isnan(test::element(data_.ranks[0].y, 0)));
}

TEST_F(BadInput, SameExpertTwiceInATokensTopK) {
  id(0, 3, 1) = id(0, 3, 0);
  const std::string msg = forward_error();
  EXPECT_THAT(msg, AllOf(HasSubstr("top_experts[rank 0][token 3]"), HasSubstr("distinct")));
  EXPECT_THAT(backward_error(), HasSubstr("top_experts[rank 0][token 3]"));
}

TEST_F(BadInput, NonFiniteRouterWeight) {
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                    -std::numeric_limits<float>::infinity()}) {
    weight(1, 2, 0) = bad;
    EXPECT_THAT(forward_error(), AllOf(HasSubstr("router_weights[rank 1][token 2, slot 0]"), HasSubstr("finite")));
    EXPECT_THAT(backward_error(), HasSubstr("router_weights[rank 1][token 2, slot 0]"));
    weight(1, 2, 0) = 0.5f;
  }
}

TEST_F(BadInput, WrongXShape) {
  const HostTensor narrow(DType::bf16, {8, 63}), long3d(DType::bf16, {1, 8, 64}), few(DType::bf16, {7, 64});
  for (const HostTensor* x : {&narrow, &long3d, &few}) {
    auto args = data_.forward_args();
    args[0].inputs.x = x->view();
    EXPECT_THAT(forward_error(args), AllOf(HasSubstr("x[rank 0]"), HasSubstr("shape"), HasSubstr("bf16[8,64]")));
    auto bargs = data_.backward_args();
    bargs[1].inputs.x = x->view();
    EXPECT_THAT(backward_error(bargs), AllOf(HasSubstr("x[rank 1]"), HasSubstr("shape")));
  }
  // A strided (non-contiguous) view of the right shape.
  HostTensor wide(DType::bf16, {8, 128});
  auto args = data_.forward_args();
  args[1].inputs.x = TensorView::contiguous(wide.view().data, DType::bf16, {8, 64});
  args[1].inputs.x.strides = {128, 1};
  EXPECT_THAT(forward_error(args), AllOf(HasSubstr("x[rank 1]"), HasSubstr("contiguous")));
  // Data not aligned to its elements (a C caller's pointer one byte on, say) is refused, never
  // read through a misaligned typed pointer.
  {
    HostTensor spare(DType::f32, {8 * 2 + 1});
    auto a = data_.forward_args();
    a[1].inputs.router_weights =
        TensorView::contiguous(static_cast<char*>(spare.view().data) + 2, DType::f32, {8, 2});
    EXPECT_THAT(forward_error(a), AllOf(HasSubstr("router_weights[rank 1]"), HasSubstr("aligned to its 4-byte")));
    a = data_.forward_args();
    a[0].inputs.x = TensorView::contiguous(static_cast<char*>(data_.ranks[0].x.view().data) + 1, DType::bf16, {8, 64});
    EXPECT_THAT(forward_error(a), AllOf(HasSubstr("x[rank 0]"), HasSubstr("aligned to its 2-byte")));
  }
  // An ndim the view's arrays cannot hold is reported, never read past them.
  for (int bad : {5, 1000000, -1}) {
    auto a = data_.forward_args();
    a[0].inputs.x.ndim = bad;
    EXPECT_THAT(forward_error(a), AllOf(HasSubstr("x[rank 0]"), HasSubstr("ndim must be in [0, 4]"),
                                        HasSubstr("got " + std::to_string(bad))));
    EXPECT_THAT(a[0].inputs.x.describe(), HasSubstr("(ndim " + std::to_string(bad) + ")"));
  }
}

TEST_F(BadInput, PlacementOfTheTensorsMovedInBulk) {
  // The CUDA backend's rule (check_forward_args with a placement): x, y and the weights on
  // the layer's device, their data 16-byte aligned. Checked here on host views.
  const LayerOptions o = test::cpu_options();
  const Placement here{0, 16};
  auto check = [&](const std::vector<RankForward>& args, Placement where) {
    return error_message([&] { check_forward_args(p_, o, args, Device::cpu, where); });
  };
  auto args = data_.forward_args();
  ASSERT_EQ(reinterpret_cast<std::uintptr_t>(args[0].inputs.x.data) % 16, 0u) << "host tensors are 16-byte aligned";
  EXPECT_NO_THROW(check_forward_args(p_, o, args, Device::cpu, here));
  EXPECT_THAT(check(args, Placement{1, 16}), AllOf(HasSubstr("x[rank 0]"), HasSubstr("must be on cuda:1")));
  HostTensor spare(DType::bf16, {8 * 64 + 8});
  auto shifted = [&](TensorView t) {
    t.data = static_cast<char*>(spare.view().data) + 2;  // same shape and strides, off by one bf16
    return t;
  };
  auto bad = args;
  bad[1].inputs.x = shifted(bad[1].inputs.x);
  EXPECT_THAT(check(bad, here), AllOf(HasSubstr("x[rank 1]"), HasSubstr("16-byte aligned")));
  bad = args;
  bad[0].y = shifted(bad[0].y);
  EXPECT_THAT(check(bad, here), AllOf(HasSubstr("y[rank 0]"), HasSubstr("16-byte aligned")));
  bad = args;
  bad[1].weights.shared[0].w_up.device_index = 1;
  EXPECT_THAT(check(bad, here), AllOf(HasSubstr("w_up[rank 1][shared 0]"), HasSubstr("must be on cuda:0")));
  // The routing: on the device, aligned to its 4-byte elements (16 is not asked of it). A
  // misaligned id tensor reached the schedule kernels and lost the CUDA context.
  HostTensor routing_spare(DType::i32, {args[1].inputs.top_experts.numel() + 4});
  auto moved = [&](TensorView t, std::size_t bytes) {
    t.data = static_cast<char*>(routing_spare.view().data) + bytes;
    return t;
  };
  bad = args;
  bad[1].inputs.top_experts = moved(bad[1].inputs.top_experts, 4);
  bad[1].inputs.router_weights = moved(bad[1].inputs.router_weights, 4);
  EXPECT_NO_THROW(check_forward_args(p_, o, bad, Device::cpu, here));
  bad[1].inputs.top_experts = moved(bad[1].inputs.top_experts, 2);
  // (On any device: check_tensor's element alignment, ahead of the placement's own rule.)
  EXPECT_THAT(check(bad, here), AllOf(HasSubstr("top_experts[rank 1]"), HasSubstr("aligned to its 4-byte elements")));
  bad = args;
  bad[0].inputs.router_weights = moved(bad[0].inputs.router_weights, 6);
  EXPECT_THAT(check(bad, here), AllOf(HasSubstr("router_weights[rank 0]"), HasSubstr("aligned to its 4-byte elements")));
  bad = args;
  bad[0].inputs.top_experts.device_index = 1;
  EXPECT_THAT(check(bad, here), AllOf(HasSubstr("top_experts[rank 0]"), HasSubstr("must be on cuda:0")));
}

// A distributed process passes its own rank only, as ranks[0]: its errors name its real
// rank (every process said "rank 0" before).
TEST_F(BadInput, ErrorsNameTheRealRankOfTheFirstEntry) {
  const LayerOptions o = test::cpu_options();
  auto args = data_.forward_args();
  args[1].inputs.x.ndim = 1;
  const std::string e =
      error_message([&] { check_forward_args(p_, o, args, Device::cpu, std::nullopt, /*first_rank=*/5); });
  EXPECT_THAT(e, HasSubstr("x[rank 6]"));
  EXPECT_THAT(e, Not(HasSubstr("[rank 1]")));
}

// An output sharing bytes with any input or another output is refused before any work: the
// layer reads inputs while it writes outputs, so the result would depend on that order (the
// CPU backend returned wrong numbers for these, silently).
TEST_F(BadInput, OutputsMustNotOverlapOtherTensors) {
  auto fwd = [&](auto&& change) {
    auto args = data_.forward_args();
    change(args);
    return forward_error(args);
  };
  EXPECT_THAT(fwd([](auto& a) { a[0].y.data = a[1].inputs.x.data; }),
              AllOf(HasSubstr("y[rank 0] overlaps x[rank 1]"), HasSubstr("must not share bytes")));
  EXPECT_THAT(fwd([](auto& a) { a[1].y.data = a[0].y.data; }), HasSubstr("overlaps y[rank"));
  EXPECT_THAT(fwd([](auto& a) { a[0].y.data = a[1].weights.w_gate.data; }), HasSubstr("overlaps w_gate[rank 1]"));
  // Partly: y starting half-way into another rank's y.
  EXPECT_THAT(fwd([&](auto& a) { a[1].y.data = static_cast<std::uint16_t*>(a[0].y.data) + 8 * 64 / 2; }),
              HasSubstr("overlaps y[rank"));
  // Inputs may share memory: one shared-expert weight buffer for both ranks is fine.
  auto shared_once = data_.forward_args();
  shared_once[1].weights.shared = shared_once[0].weights.shared;
  EXPECT_NO_THROW(layer_.forward(shared_once));
  // Backward: dx over another rank's dy, and two ranks' weight gradients in one buffer.
  auto bwd = data_.backward_args();
  bwd[0].dx.data = bwd[1].dy.data;
  EXPECT_THAT(backward_error(bwd), HasSubstr("dx[rank 0] overlaps dy[rank 1]"));
  bwd = data_.backward_args();
  bwd[1].d_w_gate.data = bwd[0].d_w_gate.data;
  EXPECT_THAT(backward_error(bwd), HasSubstr("overlaps d_w_gate[rank"));
  // After the refusals a valid call still runs.
  EXPECT_NO_THROW(layer_.forward(data_.forward_args()));
  EXPECT_NO_THROW(layer_.backward(data_.backward_args()));
}

TEST_F(BadInput, WrongDtypes) {
  const HostTensor xf(DType::f32, {8, 64}), ids64(DType::i64, {8, 2}), wbf(DType::bf16, {8, 2});
  auto args = data_.forward_args();
  args[1].inputs.x = xf.view();
  EXPECT_THAT(forward_error(args), AllOf(HasSubstr("x[rank 1]"), HasSubstr("dtype must be bf16")));
  args = data_.forward_args();
  args[0].inputs.top_experts = ids64.view();
  EXPECT_THAT(forward_error(args), AllOf(HasSubstr("top_experts[rank 0]"), HasSubstr("dtype must be i32")));
  args = data_.forward_args();
  args[0].inputs.router_weights = wbf.view();
  EXPECT_THAT(forward_error(args), AllOf(HasSubstr("router_weights[rank 0]"), HasSubstr("dtype must be f32")));
  args = data_.forward_args();
  args[1].y = xf.view();
  EXPECT_THAT(forward_error(args), AllOf(HasSubstr("y[rank 1]"), HasSubstr("dtype")));

  const HostTensor dwg_bf16(DType::bf16, {4, 32, 64});
  auto bargs = data_.backward_args();
  bargs[1].d_w_gate = dwg_bf16.view();
  EXPECT_THAT(backward_error(bargs), AllOf(HasSubstr("d_w_gate[rank 1]"), HasSubstr("dtype must be f32")));
  bargs = data_.backward_args();
  bargs[0].dy = xf.view();
  EXPECT_THAT(backward_error(bargs), HasSubstr("dy[rank 0]"));
}

TEST_F(BadInput, WrongWeightShapesAndMissingTensors) {
  const HostTensor wg(DType::bf16, {4, 32, 63}), sg(DType::bf16, {31, 64});
  auto args = data_.forward_args();
  args[0].weights.w_gate = wg.view();
  EXPECT_THAT(forward_error(args), AllOf(HasSubstr("w_gate[rank 0]"), HasSubstr("bf16[4,32,64]")));
  args = data_.forward_args();
  args[1].weights.shared[0].w_up = sg.view();
  EXPECT_THAT(forward_error(args), AllOf(HasSubstr("w_up[rank 1][shared 0]"), HasSubstr("shape")));
  args = data_.forward_args();
  args[1].weights.shared.clear();
  EXPECT_THAT(forward_error(args), AllOf(HasSubstr("weights.shared"), HasSubstr("rank 1")));
  args = data_.forward_args();
  args[1].y = TensorView{};
  EXPECT_THAT(forward_error(args), AllOf(HasSubstr("y[rank 1]"), HasSubstr("missing")));
  auto bargs = data_.backward_args();
  bargs[0].d_shared.clear();
  EXPECT_THAT(backward_error(bargs), AllOf(HasSubstr("d_shared[rank 0]"), HasSubstr("shared")));
  bargs = data_.backward_args();
  bargs[0].d_router_weights = TensorView{};
  EXPECT_THAT(backward_error(bargs), AllOf(HasSubstr("d_router_weights[rank 0]"), HasSubstr("missing")));
}

TEST_F(BadInput, WrongNumberOfRanks) {
  auto args = data_.forward_args();
  args.pop_back();
  EXPECT_THAT(forward_error(args), AllOf(HasSubstr("ranks"), HasSubstr("ep_size = 2")));
  auto bargs = data_.backward_args();
  bargs.push_back(bargs[0]);
  EXPECT_THAT(backward_error(bargs), AllOf(HasSubstr("ranks"), HasSubstr("3 entries")));
}

TEST_F(BadInput, CapacityTooSmall) {
  // Every token to rank 0's experts; capacity factor 0.05 cannot hold them.
  const Problem p = test::make_problem(8, 64, 32, 2, {32}, 2, 256);
  LayerData data = make_layer_data(p, generate_routing(p, RoutingSpec::parse("worst:0"), 1), 1, true);
  Config c = test::roomy_config();
  c.schedule_capacity_factor = 0.05;
  Layer layer(p, c, test::cpu_options());
  EXPECT_THAT(error_message([&] { layer.forward(data.forward_args()); }),
              AllOf(HasSubstr("capacity"), HasSubstr("rank 0")));
  EXPECT_THAT(error_message([&] { layer.backward(data.backward_args()); }), HasSubstr("capacity"));
  // The same layer still works on a routing that fits.
  LayerData ok = make_layer_data(p, generate_routing(p, RoutingSpec{}, 1), 1, false);
  EXPECT_NO_THROW(layer.forward(ok.forward_args()));
}

// The layer's combine slots are its own memory, which every forward writes: handed back as an
// argument they are refused like any overlap. A view stays valid across forwards.
TEST_F(BadInput, CombineSlotsAreNoArgument) {
  layer_.forward(data_.forward_args());
  const TensorView slots = layer_.combine_slots(1);  // [T*k = 16, H = 64]
  const auto first_rows = [&](std::int64_t skip) {
    return TensorView::contiguous(static_cast<std::uint16_t*>(slots.data) + skip * 64, DType::bf16, {8, 64});
  };
  auto args = data_.forward_args();
  args[0].y = first_rows(8);
  EXPECT_THAT(forward_error(args), AllOf(HasSubstr("combine_slots(1)"), HasSubstr("y[rank 0]"),
                                         HasSubstr("must not share bytes")));
  args = data_.forward_args();
  args[1].inputs.x = first_rows(0);
  EXPECT_THAT(forward_error(args), AllOf(HasSubstr("combine_slots(1)"), HasSubstr("x[rank 1]")));
  // The view taken before shows the next forward's slots, in the same memory.
  const auto* bits = static_cast<const std::uint16_t*>(slots.data);
  const std::vector<std::uint16_t> before(bits, bits + slots.numel());
  const LayerData other = test::make_data(p_, 11, true);
  layer_.forward(other.forward_args());
  EXPECT_EQ(layer_.combine_slots(1).data, slots.data);
  EXPECT_NE(std::vector<std::uint16_t>(bits, bits + slots.numel()), before);
}

TEST_F(BadInput, CombineSlotsArguments) {
  Layer fresh(p_, test::roomy_config(), test::cpu_options());
  EXPECT_THAT(error_message([&] { fresh.combine_slots(0); }), HasSubstr("no forward"));
  EXPECT_THAT(error_message([&] { layer_.combine_slots(2); }), HasSubstr("combine_slots"));
  EXPECT_THAT(error_message([&] { layer_.combine_slots(-1); }), HasSubstr("combine_slots"));
}

// ---- problem, config, options, names ----------------------------------------------------------

TEST(BadProblem, FieldRules) {
  const Problem good = test::make_problem(8, 64, 32, 2, {32}, 2, 8);
  ASSERT_NO_THROW(good.validate());
  struct Case {
    std::function<void(Problem&)> edit;
    std::string field;
  };
  const std::vector<Case> cases = {
      {[](Problem& p) { p.top_k = 9; }, "Problem.top_k = 9"},  // k > E
      {[](Problem& p) { p.top_k = 0; }, "Problem.top_k = 0"},
      {[](Problem& p) { p.top_k = 256; }, "Problem.top_k = 256"},
      {[](Problem& p) { p.num_experts = 0; }, "Problem.num_experts"},
      {[](Problem& p) { p.num_experts = 6; p.ep_size = 4; }, "ep_size (4)"},  // E % R != 0
      {[](Problem& p) { p.ep_size = 0; }, "Problem.ep_size"},
      // (Per-expert and per-rank host state, and the schedule's time in R, stay bounded.)
      {[](Problem& p) { p.num_experts = kMaxExperts * 2; }, "Problem.num_experts = 131072: must be in [1, 65536]"},
      {[](Problem& p) { p.num_experts = 8192; p.ep_size = 8192; }, "Problem.ep_size = 8192: must be in [1, 4096]"},
      {[](Problem& p) { p.hidden = 0; }, "Problem.hidden"},
      {[](Problem& p) { p.intermediate = -3; }, "Problem.intermediate"},
      {[](Problem& p) { p.tokens_per_rank = 0; }, "Problem.tokens_per_rank"},
      {[](Problem& p) { p.shared_intermediate = {32, 0}; }, "Problem.shared_intermediate[1]"},
      {[](Problem& p) { p.hidden = 2000000000; p.tokens_per_rank = 1000; }, "x (tokens_per_rank * hidden)"},
      {[](Problem& p) { p.intermediate = 2000000000; p.hidden = 2000; }, "the local routed weights"},
      {[](Problem& p) { p.swiglu_limit = 0.0f; }, "Problem.swiglu_limit"},
      {[](Problem& p) { p.swiglu_limit = -1.0f; }, "Problem.swiglu_limit"},
      {[](Problem& p) { p.swiglu_limit = std::numeric_limits<float>::quiet_NaN(); }, "Problem.swiglu_limit"},
      {[](Problem& p) { p.swiglu_limit = std::numeric_limits<float>::infinity(); }, "Problem.swiglu_limit"},
      // (a subnormal limit keeps fewer digits than were written)
      {[](Problem& p) { p.swiglu_limit = std::numeric_limits<float>::denorm_min(); }, "a positive normal float"},
      {[](Problem& p) { p.swiglu_limit = std::numeric_limits<float>::min() / 2; }, "a positive normal float"},
      {[](Problem& p) { p.precision = Precision::mxfp8; p.hidden = 48; }, "Problem.hidden = 48"},
      {[](Problem& p) { p.precision = Precision::mxfp8; p.intermediate = 40; }, "Problem.intermediate = 40"},
      {[](Problem& p) { p.precision = Precision::mxfp8; p.shared_intermediate = {32, 48}; },
       "Problem.shared_intermediate[1] = 48"},
  };
  for (const auto& c : cases) {
    Problem p = good;
    c.edit(p);
    EXPECT_THAT(error_message([&] { p.validate(); }), HasSubstr(c.field)) << c.field;
    // The Layer and the data generator validate too.
    EXPECT_THAT(error_message([&] { Layer l(p, test::roomy_config(), test::cpu_options()); }), HasSubstr(c.field));
  }
  // mxfp8 with multiples of 32 everywhere is fine.
  Problem mx = good;
  mx.precision = Precision::mxfp8;
  EXPECT_NO_THROW(mx.validate());
  EXPECT_THAT(error_message([&] {
                Problem p = good;
                p.num_experts = 6;
                p.ep_size = 4;
                generate_routing(p, RoutingSpec{}, 1);
              }),
              HasSubstr("num_experts"));
}

TEST(BadConfig, FieldRules) {
  const Problem p = test::make_problem(8, 64, 32, 2, {}, 1, 8);
  struct Case {
    std::function<void(Config&)> edit;
    std::string field;
  };
  const std::vector<Case> cases = {
      {[](Config& c) { c.minibatch_rows = 100; }, "Config.minibatch_rows = 100"},  // not a multiple of 128
      {[](Config& c) { c.minibatch_rows = 0; }, "Config.minibatch_rows"},
      {[](Config& c) { c.tile_rows = 96; }, "Config.tile_rows = 96"},
      {[](Config& c) { c.macrobatch_rows = 4096 + 128; }, "Config.macrobatch_rows"},
      {[](Config& c) { c.schedule_capacity_factor = 0; }, "Config.schedule_capacity_factor"},
      {[](Config& c) { c.schedule_capacity_factor = 1.5; }, "Config.schedule_capacity_factor"},
      // (Named as given: six significant digits printed it as 1, a valid value.)
      {[](Config& c) { c.schedule_capacity_factor = 1.0000001; }, "Config.schedule_capacity_factor = 1.0000001:"},
      {[](Config& c) { c.forward_comm_sms = -1; }, "Config.forward_comm_sms"},
      {[](Config& c) { c.backward_comm_sms = -2; }, "Config.backward_comm_sms"},
  };
  for (const auto& c : cases) {
    Config cfg;
    ASSERT_NO_THROW(cfg.validate());
    c.edit(cfg);
    EXPECT_THAT(error_message([&] { cfg.validate(); }), HasSubstr(c.field)) << c.field;
    EXPECT_THAT(error_message([&] { Layer l(p, cfg, test::cpu_options()); }), HasSubstr(c.field));
  }
}

TEST(BadOptions, RankSliceActiveRankAndThreadsOnCpu) {
  const Problem p = test::make_problem(8, 64, 32, 2, {}, 2, 8);
  LayerOptions o;
  o.ep_mode = EpMode::rank_slice;
  EXPECT_THAT(error_message([&] { Layer l(p, Config{}, o); }), AllOf(HasSubstr("rank_slice"), HasSubstr("ep_mode")));
  o = LayerOptions{};
  o.active_rank = 2;
  EXPECT_THAT(error_message([&] { Layer l(p, Config{}, o); }), HasSubstr("active_rank"));
  o = LayerOptions{};
  o.cpu_threads = -1;
  EXPECT_THAT(error_message([&] { Layer l(p, Config{}, o); }), HasSubstr("cpu_threads"));
  o.cpu_threads = 1000000;  // would ask the OS for a million threads
  EXPECT_THAT(error_message([&] { Layer l(p, Config{}, o); }),
              AllOf(HasSubstr("cpu_threads = 1000000"), HasSubstr("at most 4 per core")));
  // What the cpu backend would ignore is refused, naming the field (and so by validate() alone).
  int stream_stand_in = 0;
  o = LayerOptions{};
  o.cuda_stream = &stream_stand_in;
  EXPECT_THAT(error_message([&] { o.validate(); }), AllOf(HasSubstr("cuda_stream"), HasSubstr("cpu backend")));
  EXPECT_THAT(error_message([&] { Layer l(p, Config{}, o); }), HasSubstr("LayerOptions.cuda_stream"));
  o = LayerOptions{};
  o.cuda_device = 1;
  EXPECT_THAT(error_message([&] { Layer l(p, Config{}, o); }),
              AllOf(HasSubstr("cuda_device = 1"), HasSubstr("cpu backend uses no GPU")));
  o.cuda_device = -3;
  EXPECT_THAT(error_message([&] { o.validate(); }), AllOf(HasSubstr("cuda_device = -3"), HasSubstr(">= 0")));
  o = LayerOptions{};
  o.ep_mode = EpMode::distributed;
  EXPECT_THAT(error_message([&] { o.validate(); }), AllOf(HasSubstr("ep_mode = distributed"), HasSubstr("cpu")));
  o.active_rank = -1;
  o.ep_mode = EpMode::all_ranks;
  EXPECT_THAT(error_message([&] { o.validate(); }), HasSubstr("active_rank = -1"));
  // An active rank outside a rank slice would be ignored: refused, on either backend.
  o.active_rank = 1;
  EXPECT_THAT(error_message([&] { Layer l(p, Config{}, o); }),
              AllOf(HasSubstr("LayerOptions.active_rank = 1"), HasSubstr("only a rank slice"),
                    HasSubstr("leave it 0 in all_ranks")));
  o.backend = Backend::cuda;
  o.ep_mode = EpMode::distributed;
  EXPECT_THAT(error_message([&] { o.validate(); }), AllOf(HasSubstr("active_rank = 1"), HasSubstr("distributed")));
  o.ep_mode = EpMode::rank_slice;
  EXPECT_NO_THROW(o.validate());
  EXPECT_NO_THROW(LayerOptions{}.validate());
}

TEST(BadNames, ShapesDtypesBackends) {
  const std::string msg = error_message([] { find_shape("nope"); });
  EXPECT_THAT(msg, AllOf(HasSubstr("unknown name"), HasSubstr("'nope'"), HasSubstr("tiny")));
  EXPECT_EQ(find_shape("tiny").num_experts, 8);
  EXPECT_THAT(error_message([] { precision_from_string("fp8"); }), AllOf(HasSubstr("dtype"), HasSubstr("fp8")));
  EXPECT_THAT(error_message([] { backend_from_string("tpu"); }), AllOf(HasSubstr("backend"), HasSubstr("tpu")));
  EXPECT_EQ(precision_from_string("mxfp8"), Precision::mxfp8);
  EXPECT_EQ(backend_from_string("cpu"), Backend::cpu);
}

TEST(BadData, MakeLayerDataArguments) {
  const Problem p = test::make_problem(8, 64, 32, 2, {}, 2, 8);
  const Routing r = generate_routing(p, RoutingSpec{}, 1);
  EXPECT_THAT(error_message([&] { make_layer_data(p, r, 1, false, 2); }), HasSubstr("weights_rank"));
  Routing short_r = r;
  short_r.top_experts.pop_back();
  EXPECT_THAT(error_message([&] { make_layer_data(p, short_r, 1, false); }), HasSubstr("routing"));
  Routing bad = r;
  bad.router_weights[1][3] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_THAT(error_message([&] { make_layer_data(p, bad, 1, false); }), HasSubstr("router_weights[rank 1]"));
}

// Misuse of the API around the layer call (found by probing it): each is a named error, not a
// crash, a silently changed value or an unnamed standard exception.
TEST(ApiMisuse, EachIsANamedError) {
  const Problem p = test::make_problem(8, 64, 32, 2, {32}, 2, 8);
  // A moved-from Layer.
  Layer a(p, test::roomy_config(), test::cpu_options(1));
  Layer b(std::move(a));
  LayerData data = test::make_data(p, 3, false);
  EXPECT_THAT(error_message([&] { a.forward(data.forward_args()); }), HasSubstr("moved from"));
  EXPECT_NO_THROW(b.forward(data.forward_args()));
  // Routing statistics of a routing that is not one of this problem's.
  Routing r = generate_routing(p, RoutingSpec::parse("gaussian"), 1);
  Routing short_one = r;
  short_one.top_experts.pop_back();
  EXPECT_THAT(error_message([&] { routing_balance(p, short_one); }), HasSubstr("ep_size is 2"));
  r.top_experts[1][5] = 99;
  EXPECT_THAT(error_message([&] { routing_balance(p, r); }), HasSubstr("top_experts[rank 1][token 2, slot 1] = 99"));
  // A RoutingSpec built directly is checked like a parsed one.
  RoutingSpec zipf = RoutingSpec::parse("zipf");
  zipf.zipf_exponent = std::nan("");
  EXPECT_THAT(error_message([&] { generate_routing(p, zipf, 1); }), HasSubstr("zipf exponent"));
  RoutingSpec hot = RoutingSpec::parse("hot");
  hot.hot_fraction = 5;
  EXPECT_THAT(error_message([&] { generate_routing(p, hot, 1); }), HasSubstr("hot fraction must be in [0, 1], got 5"));
  // An enum value outside its range; a negative tensor dimension.
  Problem q = p;
  q.precision = static_cast<Precision>(7);
  EXPECT_THAT(error_message([&] { q.validate(); }), HasSubstr("Problem.precision = 7"));
  EXPECT_THAT(error_message([&] { HostTensor(DType::bf16, {-1, 4}); }), HasSubstr("dimension 0 = -1"));
  // Sizes whose element or byte count wraps (they gave a tensor with numel() past its storage).
  const std::int64_t big = std::int64_t(1) << 32;
  EXPECT_THAT(error_message([&] { HostTensor(DType::f32, {std::int64_t(1) << 62}); }),
              HasSubstr("dimension 0 = 4611686018427387904 makes the tensor larger than 2^63 bytes"));
  EXPECT_THAT(error_message([&] { HostTensor(DType::bf16, {big, big}); }), HasSubstr("dimension 1"));
  EXPECT_THAT(error_message([&] { HostTensor(DType::bf16, {(std::int64_t(1) << 62) + 1, 4}); }),
              HasSubstr("larger than 2^63 bytes"));
  // An empty tensor's other dimensions obey the bound too, wherever the zero stands (the zero
  // first was taken and the zero last refused; the contiguous strides of the first wrapped).
  EXPECT_THAT(error_message([&] { HostTensor(DType::bf16, {0, big, big}); }), HasSubstr("larger than 2^63 bytes"));
  EXPECT_THAT(error_message([&] { HostTensor(DType::bf16, {big, big, 0}); }), HasSubstr("larger than 2^63 bytes"));
  EXPECT_EQ(HostTensor(DType::bf16, {3, 0, 5}).numel(), 0);
  EXPECT_EQ(HostTensor(DType::bf16, {3, 0, 5}).view().strides[0], 0);
  // More dimensions than a TensorView holds (view() wrote past its arrays).
  EXPECT_THAT(error_message([&] { HostTensor(DType::f32, {3, 1, 1, 1, 2}); }), HasSubstr("5 dimensions, at most 4"));
}

// The device knobs (core/tuning_env.h): the backend names each by its enum, and `mok bench`
// records the set ones by walking this list, so a name must be a distinct MOK_ variable.
TEST(TuningEnv, EachKnobHasItsOwnMokName) {
  std::vector<std::string> seen;
  for (int i = 0; i < static_cast<int>(TuningEnv::kCount); ++i) {
    const std::string name = tuning_env_name(static_cast<TuningEnv>(i));
    EXPECT_EQ(name.rfind("MOK_", 0), 0u) << name;
    EXPECT_EQ(std::count(seen.begin(), seen.end(), name), 0) << name << " names two knobs";
    seen.push_back(name);
  }
  EXPECT_STREQ(tuning_env_name(TuningEnv::kStoreWarp), "MOK_STORE_WARP");
  EXPECT_STREQ(tuning_env_name(TuningEnv::kTestFault), "MOK_TEST_FAULT");
}

}  // namespace
}  // namespace mok
