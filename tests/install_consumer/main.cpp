// Built against an installed mok (tests/install_consumer.sh). Through libmok.so's C++ API:
// a forward on the CPU backend writes every y and is bitwise repeatable, and bad input
// raises mok::Error across the library boundary naming the argument; the library's version
// is the CMake package's; through its C API, the ABI and version. Exits non-zero, saying why,
// on any failure.
#include <mok/c_api.h>
#include <mok/mok.h>

#include <cmath>
#include <cstdio>
#include <string>
#include <utility>

namespace {

int failures = 0;

// Every function the public headers declare (and the library defines), by address: a name
// libmok.so does not export (cmake/libmok.map) fails this program's link. Each address goes
// through a volatile of its own type, so that the compiler keeps every reference. (The
// constructors, which have no address, are called in main.)
template <typename P>
bool kept(P p) {
  static volatile P slot;
  slot = p;
  return slot != nullptr;
}
template <typename... P>
int unaddressable(P... p) {
  return (0 + ... + (kept(p) ? 0 : 1));
}
int public_api_missing() {
  return unaddressable(
    // mok/config.h
    &mok::Config::validate, &mok::Config::describe, &mok::schedule_capacity_rows,
    // mok/data.h
    &mok::HostTensor::numel, &mok::HostTensor::view, &mok::HostTensor::fill_bytes,
    &mok::HostTensor::bitwise_equal, &mok::RankData::forward_args,
    &mok::RankData::backward_args, &mok::LayerData::forward_args,
    &mok::LayerData::backward_args, &mok::LayerData::poison_outputs,
    &mok::make_layer_data, &mok::layer_data_host_bytes, &mok::reference_host_bytes,
    &mok::require_host_memory,
    // mok/layer.h
    static_cast<const char* (*)(mok::Backend)>(&mok::to_string),
    static_cast<const char* (*)(mok::EpMode)>(&mok::to_string), &mok::backend_from_string,
    &mok::Layer::problem, &mok::Layer::config, &mok::Layer::options,
    &mok::Layer::workspace_bytes, &mok::Layer::forward, &mok::Layer::backward,
    &mok::Layer::last_schedule_stats, &mok::Layer::synchronize, &mok::Layer::abandon_group,
    &mok::Layer::group_aborted, &mok::Layer::combine_slots,
    static_cast<mok::Layer& (mok::Layer::*)(mok::Layer&&) noexcept>(&mok::Layer::operator=),
    &mok::cuda_available, &mok::cuda_device_name, &mok::version, &mok::build_commit,
    // mok/problem.h
    static_cast<const char* (*)(mok::Precision)>(&mok::to_string), &mok::precision_from_string,
    &mok::Problem::validate, &mok::Problem::mok_forward_flops, &mok::Problem::forward_flops,
    &mok::Problem::describe, &mok::named_shapes, &mok::find_shape, &mok::problem_from_shape,
    // mok/routing.h
    &mok::RoutingSpec::parse, &mok::RoutingSpec::describe, &mok::generate_routing,
    &mok::routing_balance, &mok::validate_routing,
    // mok/tensor.h
    static_cast<const char* (*)(mok::DType)>(&mok::to_string),
    static_cast<const char* (*)(mok::Device)>(&mok::to_string), &mok::dtype_size,
    &mok::TensorView::contiguous, &mok::TensorView::numel, &mok::TensorView::is_contiguous,
    &mok::TensorView::describe, &mok::check_tensor,
    // mok/c_api.h
    &mok_c_abi_version, &mok_last_error, &mok_cuda_available, &mok_version,
    &mok_build_commit, &mok_default_config, &mok_shape_count, &mok_shape_name, &mok_problem_from_shape,
    &mok_layer_create, &mok_layer_destroy, &mok_layer_destroy_after_error,
    &mok_layer_abandon_group, &mok_layer_group_aborted, &mok_layer_forward,
    &mok_layer_backward, &mok_layer_synchronize, &mok_layer_combine_slots,
    &mok_layer_config);
}

void expect(bool ok, const std::string& what) {
  if (!ok) {
    std::fprintf(stderr, "consumer: FAILED: %s\n", what.c_str());
    ++failures;
  }
}

}  // namespace

int main() {
  expect(public_api_missing() == 0, "every public function has an address");
  expect(mok_c_abi_version() > 0, "mok_c_abi_version() is positive");
  expect(mok::version() == MOK_PACKAGE_VERSION && std::string(mok_version()) == MOK_PACKAGE_VERSION,
         "the library's version (" + mok::version() + ") is the package's (" MOK_PACKAGE_VERSION ")");

  mok::Problem p;
  p.num_experts = 8;
  p.hidden = 256;
  p.intermediate = 256;
  p.top_k = 2;
  p.shared_intermediate = {256};
  p.ep_size = 2;
  p.tokens_per_rank = 64;
  const mok::Routing routing = mok::generate_routing(p, mok::RoutingSpec::parse("gaussian"), 7);
  mok::LayerData first = mok::make_layer_data(p, routing, 7, false);
  mok::LayerData second = first;
  mok::Layer constructed(p, mok::Config{}, mok::LayerOptions{});  // the CPU backend
  mok::Layer layer(std::move(constructed));
  layer.forward(first.forward_args());
  layer.forward(second.forward_args());
  layer.synchronize();
  for (int r = 0; r < p.ep_size; ++r) {
    const mok::HostTensor& y = first.ranks[r].y;
    std::int64_t nan = 0;
    for (std::int64_t i = 0; i < y.numel(); ++i) {
      // bf16 bit patterns: exponent all ones is NaN or infinity (the poison is NaN)
      const std::uint16_t bits = y.data<std::uint16_t>()[i];
      nan += (bits & 0x7f80) == 0x7f80;
    }
    expect(nan == 0, "rank " + std::to_string(r) + "'s y is written and finite (" + std::to_string(nan) + " not)");
    expect(y.bitwise_equal(second.ranks[r].y), "rank " + std::to_string(r) + "'s y is the same bits on a second call");
  }

  const mok::HostTensor zeros(mok::DType::f32, {2, 3});
  expect(zeros.numel() == 6 && zeros.bytes() == 24, "a HostTensor f32[2,3] holds 6 elements in 24 bytes");

  mok::Problem bad = p;
  bad.top_k = 0;
  try {
    mok::Layer refused(bad, mok::Config{}, mok::LayerOptions{});
    expect(false, "a Problem with top_k = 0 is refused");
  } catch (const mok::Error& e) {
    expect(std::string(e.what()).find("top_k") != std::string::npos,
           std::string("the error names top_k: ") + e.what());
  }
  if (failures == 0) std::printf("consumer: ok (forward of %s on the CPU backend)\n", p.describe().c_str());
  return failures == 0 ? 0 : 1;
}
