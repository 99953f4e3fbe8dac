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

namespace {

int failures = 0;

void expect(bool ok, const std::string& what) {
  if (!ok) {
    std::fprintf(stderr, "consumer: FAILED: %s\n", what.c_str());
    ++failures;
  }
}

}  // namespace

int main() {
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
  mok::Layer layer(p, mok::Config{}, mok::LayerOptions{});  // the CPU backend
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
