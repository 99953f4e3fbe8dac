#include "gpu/gpu_util.h"

#include <cuda_runtime.h>
#include <gmock/gmock.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>

#include "numerics/numerics.h"

#include "core/backend.h"

namespace mok::test {

namespace {

std::uint64_t seed_from_environment_or_fresh() {
  const char* given = std::getenv("MOK_TEST_SEED");
  if (given != nullptr && *given != '\0') {
    errno = 0;
    char* end = nullptr;
    const unsigned long long seed = std::strtoull(given, &end, 10);
    if (errno != 0 || *end != '\0' || given[0] == '-' || given[0] == '+') {
      std::fprintf(stderr, "MOK_TEST_SEED=%s: must be a decimal number in [0, 2^64)\n", given);
      std::exit(2);
    }
    return seed;
  }
  std::random_device fresh;
  const std::uint64_t seed = (static_cast<std::uint64_t>(fresh()) << 32) ^ fresh();
  // Handed down to the processes this one starts (death tests rerun the binary), so that they
  // build the same inputs as the seed printed here says.
  setenv("MOK_TEST_SEED", std::to_string(seed).c_str(), 1);  // (unset or empty here)
  return seed;
}

// Says the seed when the tests start and again after each failed test, next to its failure.
class SeedReporter : public ::testing::EmptyTestEventListener {
  void OnTestProgramStart(const ::testing::UnitTest&) override {
    std::printf("[seed] random inputs from MOK_TEST_SEED=%llu (set it to rerun these inputs)\n",
                static_cast<unsigned long long>(test_seed()));
  }
  void OnTestEnd(const ::testing::TestInfo& info) override {
    if (info.result() != nullptr && info.result()->Failed())
      std::printf("[seed] %s.%s failed on the inputs of MOK_TEST_SEED=%llu\n", info.test_suite_name(), info.name(),
                  static_cast<unsigned long long>(test_seed()));
  }
};

// (Registered before gtest_main's InitGoogleTest: the listener list is gtest's singleton's.)
[[maybe_unused]] const bool seed_reporter_registered = [] {
  ::testing::UnitTest::GetInstance()->listeners().Append(new SeedReporter);
  return true;
}();

}  // namespace

std::uint64_t test_seed() {
  static const std::uint64_t seed = seed_from_environment_or_fresh();
  return seed;
}

LayerOptions cuda_layer_options(EpMode mode, int active_rank) {
  LayerOptions o;
  o.backend = Backend::cuda;
  o.ep_mode = mode;
  o.active_rank = active_rank;
  return o;
}

GpuRun run_gpu_all_ranks(const LayerData& host, const Config& config, int repeats) {
  GpuRun out{host, {}, {}};
  Layer layer(host.problem, config, cuda_layer_options());
  DeviceMirror mirror(host, 0);
  const auto args = mirror.forward_args();
  // All calls but the last back to back; then y is poisoned again, so that the y returned is
  // the last call's own (one that wrote nothing would otherwise leave an earlier call's).
  for (int i = 0; i + 1 < repeats; ++i) layer.forward(args);
  if (repeats > 1) {
    layer.synchronize();
    mirror.poison_outputs();
  }
  layer.forward(args);
  layer.synchronize();
  mirror.copy_outputs_to(out.data);
  out.schedules = LayerInternals::backend(layer).last_schedules();
  out.stats = layer.last_schedule_stats();
  return out;
}

LayerData run_reference(const LayerData& host, const Config& config) {
  LayerData ref = host;
  ref.poison_outputs();
  Layer layer(host.problem, config, LayerOptions{});
  layer.forward(ref.forward_args());
  return ref;
}

std::vector<std::uint16_t> global_y(const LayerData& data) {
  std::vector<std::uint16_t> y;
  for (const auto& r : data.ranks) y.insert(y.end(), r.y.data<std::uint16_t>(), r.y.data<std::uint16_t>() + r.y.numel());
  return y;
}

void expect_same_bits(const std::vector<std::uint16_t>& got, const std::vector<std::uint16_t>& want,
                      const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  EXPECT_EQ(std::count(want.begin(), want.end(), std::uint16_t{0xffff}), 0)
      << what << ": the baseline holds the poison's bits (an output no forward wrote)";
  EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size() * 2), 0) << what;
}

void zero_y(const DeviceMirror& mirror) {
  for (const RankForward& r : mirror.forward_args())
    if (r.y.data != nullptr) {
      ASSERT_EQ(cudaMemset(r.y.data, 0, r.y.bytes()), cudaSuccess);
    }
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

std::int64_t elements_not_nan(const HostTensor& t) {
  const TensorView v = t.view();
  const auto* bits = static_cast<const std::uint16_t*>(v.data);
  return std::count_if(bits, bits + v.numel(), [](std::uint16_t b) { return !std::isnan(num::bf16_to_float(b)); });
}

void expect_all_y_nan(const LayerData& data, const std::string& what) {
  for (std::size_t r = 0; r < data.ranks.size(); ++r) {
    const std::int64_t numbers = elements_not_nan(data.ranks[r].y);
    EXPECT_EQ(numbers, 0) << what << ": rank " << r << "'s y keeps " << numbers << " of " << data.ranks[r].y.numel()
                          << " elements that are not NaN";
  }
}

void expect_refused_and_y_poisoned(Layer& layer, LayerData& host, const std::vector<std::string>& want,
                                   const std::string& what) {
  DeviceMirror mirror(host, 0);
  zero_y(mirror);
  layer.forward(mirror.forward_args());
  try {
    layer.synchronize();
    ADD_FAILURE() << what << ": no error from synchronize()";
  } catch (const Error& e) {
    for (const std::string& w : want) EXPECT_THAT(e.what(), ::testing::HasSubstr(w)) << what;
  }
  mirror.copy_outputs_to(host);
  expect_all_y_nan(host, what);
}

void expect_close(const LayerData& gpu, const LayerData& ref, Precision precision, const std::string& what) {
  const Tolerance tol = mok_tolerance(precision);
  ASSERT_EQ(gpu.ranks.size(), ref.ranks.size()) << what;
  for (std::size_t r = 0; r < gpu.ranks.size(); ++r) {
    const Comparison c = compare(gpu.ranks[r].y, ref.ranks[r].y);
    EXPECT_GT(c.count, 0) << what << " rank " << r << ": nothing compared";
    EXPECT_TRUE(c.passes(tol.max_abs, tol.rel)) << what << " rank " << r << ": " << c.describe();
    ::testing::Test::RecordProperty((what + "_rank" + std::to_string(r)).c_str(), c.describe().c_str());
    std::printf("[check] %s rank %zu: %s\n", what.c_str(), r, c.describe().c_str());
  }
}

}  // namespace mok::test
