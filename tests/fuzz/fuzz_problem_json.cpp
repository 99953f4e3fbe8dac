// Fuzz target (libFuzzer's entry point): mok::io::problem_from_json on arbitrary text. It must
// accept the text or throw mok::Error; a problem it accepts must come back unchanged through
// problem_to_json and problem_from_json. Anything else (another exception, a crash, a round
// trip that differs or fails) is a finding. Built as a libFuzzer binary by scripts/fuzz.sh,
// and replayed over tests/fuzz/inputs by ctest (replay_main.cpp).
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <optional>
#include <string>

#include "io/layer_io.h"
#include "mok/error.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  std::optional<mok::Problem> p;
  try {
    p = mok::io::problem_from_json(text, "fuzz.json");
  } catch (const mok::Error&) {
    return 0;  // malformed: refused, as it must be
  } catch (const std::exception& e) {
    std::fprintf(stderr, "an exception other than mok::Error escaped: %s\n", e.what());
    std::abort();
  } catch (...) {
    std::fprintf(stderr, "a non-standard exception escaped\n");
    std::abort();
  }
  const std::string again = mok::io::problem_to_json(*p);
  try {
    const mok::Problem q = mok::io::problem_from_json(again, "round_trip.json");
    if (q.num_experts != p->num_experts || q.hidden != p->hidden || q.intermediate != p->intermediate ||
        q.top_k != p->top_k || q.ep_size != p->ep_size || q.tokens_per_rank != p->tokens_per_rank ||
        q.shared_intermediate != p->shared_intermediate || q.precision != p->precision ||
        q.swiglu_limit != p->swiglu_limit) {
      std::fprintf(stderr, "the round trip changed the problem:\n%s\n", again.c_str());
      std::abort();
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "an accepted problem did not read back: %s\n%s\n", e.what(), again.c_str());
    std::abort();
  }
  return 0;
}
