// mok CLI: argument parsing shared by the subcommands.
#pragma once
#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "mok/mok.h"

namespace mok::cli {

// --name value and --flag arguments. Every argument must be consumed by the subcommand;
// finish() rejects what is left, naming it.
class Args {
 public:
  Args(const std::vector<std::string>& argv, const std::vector<std::string>& flags);
  std::optional<std::string> take(const std::string& name);
  std::string take_or(const std::string& name, const std::string& fallback);
  std::optional<int> take_int(const std::string& name);        // a whole integer that fits an int
  std::optional<std::uint64_t> take_seed(const std::string& name);  // a whole integer >= 0
  std::optional<double> take_double(const std::string& name);  // a whole, finite number
  bool take_flag(const std::string& name);
  bool has(const std::string& name) const {
    return values_.count(name) || flags_set_.count(name) || missing_.count(name);
  }
  void finish() const;  // throws mok::Error listing unknown arguments

 private:
  std::map<std::string, std::string> values_;
  std::map<std::string, bool> flags_set_;
  // Options given without a value, and the error that says so, thrown when one is taken (an
  // option no one takes is reported as unknown by finish()).
  std::map<std::string, std::string> missing_;
};

// --warmup and --iters, the timed repetitions: warmup in [0, 1000000], iters in [1, 1000000]
// (bounded so that their sum fits an int and a typo cannot run for days; near INT_MAX the
// sum overflowed and nothing was timed). Throws naming the option.
struct Repetitions {
  int warmup, iters;
};
Repetitions take_repetitions(Args& args, int default_warmup, int default_iters);

// `message` (a mok::Error's, naming a Problem, Config or LayerOptions field) with the
// command-line options that set the fields it names appended, e.g. "Problem.num_experts = 8:
// must be divisible by ep_size (3) [options: --experts or --shape, --ep]". A field set by an
// option in `options_not_taken` (one the command does not have: mok bench has no --tile-rows)
// is left unnamed rather than pointing at an option the command would refuse.
std::string with_option_names(const std::string& message, std::span<const std::string_view> options_not_taken = {});

// Runs `fn` (a validation, a Layer's construction) and returns what it returns; a mok::Error
// from it comes back with the options that set the fields it names (with_option_names). A
// PeerWaitError passes unchanged (it has its own exit status).
template <typename Fn>
auto naming_options(Fn&& fn, std::span<const std::string_view> options_not_taken = {}) -> decltype(fn()) {
  try {
    return fn();
  } catch (const PeerWaitError&) {
    throw;
  } catch (const Error& e) {
    throw Error(with_option_names(e.what(), options_not_taken));
  }
}

// The problem described by --shape/--experts/... (see `mok run --help`). Its validation
// errors name the options (with_option_names).
struct ProblemArgs {
  Problem problem;
  std::string shape_name;  // "" for explicit sizes
};
ProblemArgs parse_problem(Args& args, const std::string& default_shape, bool gpu);

// --active-rank of a rank slice: "busiest" (the default; RoutingBalance::busiest_rank: the
// rank whose experts receive the most rows, the one that sets a group's pace, which a slice
// should measure) or a rank number in [0, ep_size). Not a slice: 0, and the option is refused
// if given (it would be ignored). Throws naming the option. The routing must be valid.
int resolve_active_rank(const std::optional<std::string>& text, bool slice, const Problem& problem,
                        const Routing& routing);

int run_command(const std::vector<std::string>& argv);
int shapes_command(const std::vector<std::string>& argv);
int bench_command(const std::vector<std::string>& argv);
int launch_command(const std::vector<std::string>& argv);

}  // namespace mok::cli
