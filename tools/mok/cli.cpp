#include "mok/cli_args.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <sstream>

#include "core/numbers.h"

namespace mok::cli {

Args::Args(const std::vector<std::string>& argv, const std::vector<std::string>& flags) {
  for (std::size_t i = 0; i < argv.size(); ++i) {
    const std::string& a = argv[i];
    if (a.rfind("--", 0) != 0) throw Error("argument '" + a + "': expected an option starting with --");
    std::string name = a.substr(2), value;
    const auto eq = name.find('=');
    const bool is_flag = std::find(flags.begin(), flags.end(), name.substr(0, eq)) != flags.end();
    if (eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
      if (is_flag) throw Error("option --" + name + ": is a flag and takes no value (got '" + a + "')");
      // (An empty value, here or as the next argument, would read as a path or a list no one
      // meant: "--expect=" is the root, "--load ''" the current directory.)
      if (value.empty()) throw Error("option --" + name + ": the value is empty");
    } else if (is_flag) {
      if (flags_set_.count(name)) throw Error("option --" + name + ": given twice");
      flags_set_[name] = true;
      continue;
    } else {
      // An option without its value: "--save --check" is a forgotten value, not a directory
      // named --check (the next option is parsed as one). Said when the option is taken, so
      // that a misspelt option (--chek) is named as unknown by finish() instead.
      std::string missing;
      if (i + 1 >= argv.size())
        missing = "option --" + name + ": needs a value";
      else if (argv[i + 1].rfind("--", 0) == 0)
        missing = "option --" + name + ": needs a value, got the option '" + argv[i + 1] + "' (write --" + name +
                  "=VALUE for a value that starts with --)";
      if (!missing.empty()) {
        if (has(name)) throw Error("option --" + name + ": given twice");
        missing_[name] = missing;
        continue;
      }
      value = argv[++i];
      if (value.empty()) throw Error("option --" + name + ": the value is empty");
    }
    if (has(name)) throw Error("option --" + name + ": given twice");
    values_[name] = value;
  }
}

std::optional<std::string> Args::take(const std::string& name) {
  if (const auto m = missing_.find(name); m != missing_.end()) throw Error(m->second);
  auto it = values_.find(name);
  if (it == values_.end()) return std::nullopt;
  std::string v = it->second;
  values_.erase(it);
  return v;
}

std::string Args::take_or(const std::string& name, const std::string& fallback) {
  auto v = take(name);
  return v ? *v : fallback;
}

std::optional<int> Args::take_int(const std::string& name, int lo) {
  auto v = take(name);
  if (!v) return std::nullopt;
  // A value an int holds is the caller's to judge (its rules name the option's field); one
  // beyond, or no integer, is refused by the second read, whose message states the option's
  // own least value.
  try {
    return static_cast<int>(
        parse_integer(*v, std::numeric_limits<int>::min(), std::numeric_limits<int>::max(), "option --" + name));
  } catch (const Error&) {
    parse_integer(*v, lo, std::numeric_limits<int>::max(), "option --" + name);
    throw;  // (not reached: what int's range refused, [lo, INT_MAX] refuses too)
  }
}

std::optional<long long> Args::take_whole(const std::string& name) {
  auto v = take(name);
  if (!v) return std::nullopt;
  return parse_integer(*v, std::numeric_limits<long long>::min(), std::numeric_limits<long long>::max(),
                       "option --" + name);
}

std::optional<std::uint64_t> Args::take_seed(const std::string& name) {
  auto v = take(name);
  if (!v) return std::nullopt;
  return static_cast<std::uint64_t>(parse_integer(*v, 0, std::numeric_limits<long long>::max(), "option --" + name));
}

std::string NumberRange::describe() const {
  return std::string(lo_open ? "(" : "[") + exact_number(lo) + ", " + exact_number(hi) + (hi_open ? ")" : "]") +
         (*unit ? " " : "") + unit;
}

std::optional<double> Args::take_double(const std::string& name, const NumberRange& accepted) {
  auto v = take(name);
  if (!v) return std::nullopt;
  const std::string what = "option --" + name;
  const double value = parse_finite(*v, what, accepted.describe());
  if (!accepted.contains(value)) throw Error(what + ": " + *v + " is out of range " + accepted.describe());
  return value;
}

bool Args::take_flag(const std::string& name) {
  auto it = flags_set_.find(name);
  if (it == flags_set_.end()) return false;
  flags_set_.erase(it);
  return true;
}

void Args::finish() const {
  std::string unknown;
  for (const auto& [k, v] : values_) unknown += " --" + k;
  for (const auto& [k, v] : flags_set_) unknown += " --" + k;
  for (const auto& [k, v] : missing_) unknown += " --" + k;
  if (!unknown.empty()) throw Error("unknown or unused option(s):" + unknown + " (see --help)");
}

Repetitions take_repetitions(Args& args, Backend backend, int default_warmup, int default_iters) {
  const bool on_cpu = backend == Backend::cpu;
  const int max = on_cpu ? kMaxCpuRepetitions : kMaxRepetitions;
  auto take = [&](const char* name, int lo, int fallback) {
    const long long n = args.take_whole(name).value_or(fallback);
    if (n >= lo && n <= max) return static_cast<int>(n);
    std::string message = std::string("option --") + name + ": must be in [" + std::to_string(lo) + ", " +
                          std::to_string(max) + "] on the " + to_string(backend) + " backend, got " +
                          std::to_string(n);
    if (on_cpu)
      message += " (a pass of the CPU reference takes up to seconds, so " + std::to_string(max) +
                 " already run for hours; the cuda backend takes up to " + std::to_string(kMaxRepetitions) + ")";
    throw Error(message);
  };
  const int warmup = take("warmup", 0, default_warmup);
  const int iters = take("iters", 1, default_iters);
  return {warmup, iters};
}

int resolve_active_rank(const std::optional<std::string>& given, bool slice, const Problem& problem,
                        const Routing& routing) {
  if (!slice) {
    if (given) throw Error("option --active-rank: only a rank slice (--ep-mode slice) has one, got '" + *given + "'");
    return 0;
  }
  const std::string text = given.value_or("busiest");
  if (text == "busiest") return routing_balance(problem, routing).busiest_rank;
  try {
    return static_cast<int>(parse_integer(text, 0, problem.ep_size - 1, "option --active-rank"));
  } catch (const Error&) {  // one message for both ways to be wrong: the choices
    throw Error("option --active-rank: must be busiest or a rank in [0, " + std::to_string(problem.ep_size) +
                "), got '" + text + "'");
  }
}

std::string with_option_names(const std::string& message, std::span<const std::string_view> options_not_taken) {
  // Field names as the library's messages spell them, and the options that set them.
  static const std::pair<const char*, const char*> kOptions[] = {
      {"num_experts", "--experts or --shape"},
      {"hidden", "--hidden or --shape"},
      {"intermediate", "--intermediate or --shape"},
      {"top_k", "--topk or --shape"},
      {"ep_size", "--ep"},
      {"tokens_per_rank", "--tokens"},
      {"shared_intermediate", "--shared"},
      {"swiglu_limit", "--swiglu-limit"},
      {"precision", "--dtype"},
      {"minibatch_rows", "--minibatch"},
      {"macrobatch_rows", "--macrobatch"},
      {"schedule_capacity_factor", "--capacity"},
      {"forward_comm_sms", "--comm-sms"},
      {"backward_comm_sms", "--comm-sms"},
      {"tile_rows", "--tile-rows"},
      {"task_band_tiles", "--band"},
      {"task_pairs", "--pairs"},
      {"cpu_threads", "--threads"},
      {"active_rank", "--active-rank"},
      {"ep_mode", "--ep-mode"},
      {"backend", "--backend"},
  };
  std::string named;
  for (const auto& [field, option] : kOptions) {
    if (std::find(options_not_taken.begin(), options_not_taken.end(), option) != options_not_taken.end()) continue;
    // A whole word: "hidden" must not match inside "hidden_rows", nor "ep_size" in "keep_size".
    for (std::size_t at = message.find(field); at != std::string::npos; at = message.find(field, at + 1)) {
      const std::size_t end = at + std::strlen(field);
      auto word = [&](std::size_t i) { return std::isalnum(static_cast<unsigned char>(message[i])) || message[i] == '_'; };
      if ((at > 0 && word(at - 1)) || (end < message.size() && word(end))) continue;
      named += (named.empty() ? "" : ", ") + std::string(option);
      break;
    }
  }
  return named.empty() ? message : message + " [options: " + named + "]";
}

ProblemArgs parse_problem(Args& args, const std::string& default_shape, bool /*gpu*/) {
  ProblemArgs out;
  const bool explicit_sizes = args.has("experts") || args.has("hidden") || args.has("intermediate") ||
                              args.has("topk");
  auto shape = args.take("shape");
  if (shape && explicit_sizes)
    throw Error("--shape and explicit sizes (--experts/--hidden/--intermediate/--topk) exclude each other");
  Problem& p = out.problem;
  if (explicit_sizes) {
    auto need = [&](const char* name) {
      auto v = args.take_int(name, 1);
      if (!v) throw Error(std::string("option --") + name + ": needed with explicit sizes");
      return static_cast<int>(*v);
    };
    p.num_experts = need("experts");
    p.hidden = need("hidden");
    p.intermediate = need("intermediate");
    p.top_k = need("topk");
    p.ep_size = static_cast<int>(args.take_int("ep", 1).value_or(1));
    p.tokens_per_rank = static_cast<int>(args.take_int("tokens", 1).value_or(256));
  } else {
    out.shape_name = shape ? *shape : default_shape;
    const NamedShape& s = naming_option("shape", out.shape_name,
                                        [&]() -> const NamedShape& { return find_shape(out.shape_name); });
    p = problem_from_shape(s, static_cast<int>(args.take_int("ep", 1).value_or(s.default_ep_size)),
                           static_cast<int>(args.take_int("tokens", 1).value_or(s.default_tokens)));
  }
  if (auto shared = args.take("shared")) {
    p.shared_intermediate.clear();
    if (*shared != "none") {
      // Every comma-separated field is a width: an empty one ("", "256,", ",256") is an error,
      // never silently dropped.
      for (const std::string& item : split_fields(*shared, ','))
        p.shared_intermediate.push_back(static_cast<int>(
            parse_integer(item, 1, std::numeric_limits<int>::max(), "option --shared (a comma list or 'none')")));
    }
  }
  const std::string dtype = args.take_or("dtype", "bf16");
  p.precision = naming_option("dtype", dtype, [&] { return precision_from_string(dtype); });
  // The layer keeps a float: a limit below float's smallest normal would keep fewer digits
  // than were written (or none).
  static constexpr NumberRange kSwigluLimitRange{std::numeric_limits<float>::min(), std::numeric_limits<float>::max(),
                                                 false, false, "(a positive normal float: the layer keeps a float)"};
  if (auto limit = args.take_double("swiglu-limit", kSwigluLimitRange))
    p.swiglu_limit = to_float_in_range(*limit, "option --swiglu-limit");
  naming_options([&] { p.validate(); });
  return out;
}

int shapes_command(const std::vector<std::string>& argv) {
  Args args(argv, {"help"});
  if (args.take_flag("help")) {
    std::puts("usage: mok shapes\nLists the named shapes (use one with --shape NAME).");
    return 0;
  }
  args.finish();
  std::printf("%-20s %5s %6s %6s %4s %-8s %4s %6s  %s\n", "name", "E", "H", "I", "k", "shared", "EP", "T", "note");
  for (const auto& s : named_shapes()) {
    std::string shared;
    for (int w : s.shared_intermediate) {
      if (!shared.empty()) shared += ',';
      shared += std::to_string(w);
    }
    std::printf("%-20s %5d %6d %6d %4d %-8s %4d %6d  %s\n", s.name.c_str(), s.num_experts, s.hidden,
                s.intermediate, s.top_k, shared.empty() ? "-" : shared.c_str(), s.default_ep_size, s.default_tokens,
                s.note.c_str());
  }
  return 0;
}

}  // namespace mok::cli
