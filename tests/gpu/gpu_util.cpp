#include "gpu/gpu_util.h"

#include <cstring>

#include "core/backend.h"

namespace mok::test {

GpuRun run_gpu_all_ranks(const LayerData& host, const Config& config, int repeats) {
  GpuRun out{host, {}, {}};
  LayerOptions o;
  o.backend = Backend::cuda;
  Layer layer(host.problem, config, o);
  DeviceMirror mirror(host, 0);
  const auto args = mirror.forward_args();
  for (int i = 0; i < repeats; ++i) layer.forward(args);
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
  EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size() * 2), 0) << what;
}

void expect_close(const LayerData& gpu, const LayerData& ref, Precision precision, const std::string& what) {
  const Tolerance tol = mok_tolerance(precision);
  for (std::size_t r = 0; r < gpu.ranks.size(); ++r) {
    const Comparison c = compare(gpu.ranks[r].y, ref.ranks[r].y);
    EXPECT_TRUE(c.passes(tol.max_abs, tol.rel)) << what << " rank " << r << ": " << c.describe();
    ::testing::Test::RecordProperty((what + "_rank" + std::to_string(r)).c_str(), c.describe().c_str());
    std::printf("[check] %s rank %zu: %s\n", what.c_str(), r, c.describe().c_str());
  }
}

}  // namespace mok::test
