// mok CLI: argument parsing shared by the subcommands.
#pragma once
#include <cstdint>
#include <limits>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "mok/mok.h"

namespace mok::cli {

// The numbers a real-valued option accepts, [lo, hi] or with either end open, and the unit or
// reason that follows the interval in its messages: "[0, 1e+07] seconds".
struct NumberRange {
  double lo, hi;
  bool lo_open = false, hi_open = false;
  const char* unit = "";
  bool contains(double v) const { return (lo_open ? v > lo : v >= lo) && (hi_open ? v < hi : v <= hi); }
  std::string describe() const;
};

// --name value and --flag arguments. Every argument must be consumed by the subcommand;
// finish() rejects what is left, naming it.
class Args {
 public:
  Args(const std::vector<std::string>& argv, const std::vector<std::string>& flags);
  std::optional<std::string> take(const std::string& name);
  std::string take_or(const std::string& name, const std::string& fallback);
  // A whole integer that fits an int; one beyond int's range is refused as outside
  // [lo, INT_MAX] (lo: the option's least value, so the message states the option's bound).
  std::optional<int> take_int(const std::string& name, int lo = std::numeric_limits<int>::min());
  // Any whole integer of 64 bits, for a caller that states the option's range itself.
  std::optional<long long> take_whole(const std::string& name);
  std::optional<std::uint64_t> take_seed(const std::string& name);  // a whole integer >= 0
  // A number, read whole, in `accepted`; one outside it, not finite, or past what a double
  // holds (1e400; 1e-310, below its smallest normal) is refused naming the option, the value
  // and `accepted`.
  std::optional<double> take_double(const std::string& name, const NumberRange& accepted);
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

// --warmup and --iters, the timed repetitions: warmup in [0, max], iters in [1, max], bounded
// so that their sum fits an int (near INT_MAX it overflowed and nothing was timed) and a typo
// cannot run for days. On the cuda backend max is kMaxRepetitions; the cpu backend's passes
// take up to seconds (the default shape's forward and backward about 0.7 s on two cores, the
// medium shape's forward 3 s), so its max is kMaxCpuRepetitions, hours already. Throws naming
// the option, the backend and the bound.
inline constexpr int kMaxRepetitions = 1000000;
inline constexpr int kMaxCpuRepetitions = 10000;
struct Repetitions {
  int warmup, iters;
};
Repetitions take_repetitions(Args& args, Backend backend, int default_warmup, int default_iters);

// Config::validate's rule for --capacity (schedule_capacity_factor), said with the option.
inline constexpr NumberRange kCapacityRange{0, 1, true, false, ""};

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

// Runs `parse`, the library's reading of the value `text` given to the option --`name`
// (RoutingSpec::parse, find_shape, precision_from_string: their messages name the field,
// "routing: ...", not the option), and returns what it returns; a mok::Error from it comes back
// naming the option and the value as typed: "option --routing 'hot:x:0': routing: hot
// fraction 'x' is not a number". (Named where the value is read, not by matching words as
// with_option_names does: "routing" and "dtype" occur in messages about other things.)
template <typename Parse>
auto naming_option(const std::string& name, const std::string& text, Parse&& parse) -> decltype(parse()) {
  try {
    return parse();
  } catch (const PeerWaitError&) {
    throw;
  } catch (const Error& e) {
    throw Error("option --" + name + " '" + text + "': " + e.what());
  }
}

// The problem described by --shape/--experts/... (see `mok run --help`). Its validation
// errors name the options (with_option_names); --shape's and --dtype's, the option (naming_option).
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
