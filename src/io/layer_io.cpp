#include "io/layer_io.h"

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <limits>
#include <map>
#include <optional>
#include <sstream>
#include <string_view>
#include <vector>

#include "core/numbers.h"
#include "core/validate.h"
#include "io/npy.h"
#include "mok/error.h"

namespace mok::io {
namespace fs = std::filesystem;

namespace {
fs::path rank_dir(const std::string& dir, int r) { return fs::path(dir) / ("rank" + std::to_string(r)); }
}  // namespace

std::string problem_to_json(const Problem& p) {
  std::ostringstream s;
  s << "{\n  \"num_experts\": " << p.num_experts << ",\n  \"hidden\": " << p.hidden
    << ",\n  \"intermediate\": " << p.intermediate << ",\n  \"top_k\": " << p.top_k
    << ",\n  \"shared_intermediate\": [";
  for (std::size_t i = 0; i < p.shared_intermediate.size(); ++i) s << (i ? ", " : "") << p.shared_intermediate[i];
  s << "],\n  \"ep_size\": " << p.ep_size << ",\n  \"tokens_per_rank\": " << p.tokens_per_rank
    << ",\n  \"precision\": \"" << to_string(p.precision) << "\",\n  \"swiglu_limit\": ";
  // max_digits10 so that the float reads back bit-exactly (the default 6 digits do not).
  if (p.swiglu_limit) s << std::setprecision(std::numeric_limits<float>::max_digits10) << *p.swiglu_limit;
  else s << "null";
  s << "\n}\n";
  return s.str();
}

namespace {

// problem.json is one flat JSON object. Parsed strictly: each key once, only the keys a
// problem has, values as raw text (a number, null, a "string" or a [list] of numbers with no
// empty entry), nothing after the closing brace.
using FlatObject = std::map<std::string, std::string>;

bool blank(const std::string& s) { return s.find_first_not_of(" \t\n\r") == std::string::npos; }

// The entries of a "[...]" list's raw text: none for "[]", else every comma-separated field;
// nullopt when a field is blank ("[1,]", "[, ]").
std::optional<std::vector<std::string>> list_entries(const std::string& list) {
  const std::string inner = list.substr(1, list.size() - 2);
  if (blank(inner)) return std::vector<std::string>{};
  std::vector<std::string> fields = split_fields(inner, ',');
  for (const auto& f : fields)
    if (blank(f)) return std::nullopt;
  return fields;
}

FlatObject parse_flat_object(const std::string& t, const std::string& source) {
  static const char* const kKeys[] = {"num_experts", "hidden", "intermediate", "top_k", "shared_intermediate",
                                      "ep_size", "tokens_per_rank", "precision", "swiglu_limit"};
  std::size_t i = 0;
  auto ws = [&] {
    while (i < t.size() && (t[i] == ' ' || t[i] == '\t' || t[i] == '\n' || t[i] == '\r')) ++i;
    return i < t.size() ? t[i] : '\0';
  };
  auto bad = [&](const std::string& what) -> Error { return Error(source + ": " + what); };
  if (ws() != '{') throw bad("not a JSON object (no '{')");
  ++i;
  FlatObject out;
  if (ws() == '}') ++i;
  else
    for (;;) {
      if (ws() != '"') throw bad("expected a quoted key");
      const auto kend = t.find('"', i + 1);
      if (kend == std::string::npos) throw bad("unterminated key");
      const std::string key = t.substr(i + 1, kend - i - 1);
      i = kend + 1;
      if (std::find(std::begin(kKeys), std::end(kKeys), key) == std::end(kKeys)) throw bad("unknown key \"" + key + "\"");
      if (out.count(key)) throw bad("\"" + key + "\" given twice");
      if (ws() != ':') throw bad("no value for \"" + key + "\"");
      ++i;
      const char c = ws();
      std::size_t end;
      if (c == '"') {
        end = t.find('"', i + 1);
        if (end == std::string::npos) throw bad("unterminated string for \"" + key + "\"");
        ++end;
      } else if (c == '[') {
        end = t.find(']', i);
        if (end == std::string::npos) throw bad("unterminated list for \"" + key + "\"");
        ++end;
        // Entries separated by single commas: "[]", "[1]", "[1, 2]"; not "[1,]" or "[, ]".
        if (!list_entries(t.substr(i, end - i))) throw bad("\"" + key + "\": an empty list entry");
      } else {
        end = t.find_first_of(",}\n\r\t ", i);
        if (end == std::string::npos || end == i) throw bad("bad value for \"" + key + "\"");
      }
      out[key] = t.substr(i, end - i);
      i = end;
      const char next = ws();
      ++i;
      if (next == '}') break;
      if (next != ',') throw bad("expected ',' or '}' after \"" + key + "\"");
    }
  ws();
  if (i != t.size()) throw bad("text after the closing '}'");  // (a NUL byte too: ws() says '\0' there)
  return out;
}

const std::string& json_value(const FlatObject& o, const std::string& key, const std::string& source) {
  const auto it = o.find(key);
  if (it == o.end()) throw Error(source + ": missing key \"" + key + "\"");
  return it->second;
}

// Whether `t` is a number as JSON writes one, -?(0|[1-9][0-9]*)(.[0-9]+)?([eE][+-]?[0-9]+)?,
// or with `integer` the part before the fraction alone. (std::stoll and std::stod, which read
// the value, also take "+8", "0008", ".5" and "1.": not JSON, and not what problem_to_json
// writes.)
bool json_number_syntax(const std::string& t, bool integer) {
  std::size_t i = 0;
  auto digits = [&] {
    const std::size_t from = i;
    while (i < t.size() && t[i] >= '0' && t[i] <= '9') ++i;
    return i > from;
  };
  if (i < t.size() && t[i] == '-') ++i;
  if (i < t.size() && t[i] == '0')
    ++i;
  else if (!digits())
    return false;
  if (!integer) {
    if (i < t.size() && t[i] == '.' && (++i, !digits())) return false;
    if (i < t.size() && (t[i] == 'e' || t[i] == 'E')) {
      ++i;
      if (i < t.size() && (t[i] == '+' || t[i] == '-')) ++i;
      if (!digits()) return false;
    }
  }
  return i == t.size();
}

// A problem size: an int, the whole (blank-trimmed) value (a wider one would be truncated).
int strict_int(const std::string& v, const std::string& what) {
  const std::size_t first = v.find_first_not_of(" \t\r\n");
  const std::size_t last = v.find_last_not_of(" \t\r\n");
  const std::string t = first == std::string::npos ? "" : v.substr(first, last - first + 1);
  if (!json_number_syntax(t, true)) throw Error(what + ": '" + t + "' is not an integer");
  return static_cast<int>(
      parse_integer(t, std::numeric_limits<int>::min(), std::numeric_limits<int>::max(), what));
}

int json_int(const FlatObject& o, const std::string& key, const std::string& source) {
  return strict_int(json_value(o, key, source), source + ": \"" + key + "\"");
}

}  // namespace

Problem problem_from_json(const std::string& json, const std::string& source) {
  const FlatObject text = parse_flat_object(json, source);
  Problem p;
  p.num_experts = json_int(text, "num_experts", source);
  p.hidden = json_int(text, "hidden", source);
  p.intermediate = json_int(text, "intermediate", source);
  p.top_k = json_int(text, "top_k", source);
  p.ep_size = json_int(text, "ep_size", source);
  p.tokens_per_rank = json_int(text, "tokens_per_rank", source);
  const std::string shared = json_value(text, "shared_intermediate", source);
  if (shared.size() < 2 || shared.front() != '[' || shared.back() != ']')
    throw Error(source + ": \"shared_intermediate\" must be a list");
  const auto widths = list_entries(shared);  // (parse_flat_object refused blank entries)
  for (const std::string& item : *widths)
    p.shared_intermediate.push_back(strict_int(item, source + ": \"shared_intermediate\" entry"));
  std::string prec = json_value(text, "precision", source);
  if (prec.size() < 2 || prec.front() != '"') throw Error(source + ": \"precision\" must be a string");
  try {
    p.precision = precision_from_string(prec.substr(1, prec.size() - 2));
  } catch (const Error& e) {
    throw Error(source + ": \"precision\": " + e.what());
  }
  const std::string limit = json_value(text, "swiglu_limit", source);
  if (limit != "null") {
    const std::string what = source + ": \"swiglu_limit\"";
    if (!json_number_syntax(limit, false)) throw Error(what + ": '" + limit + "' is not a number or null");
    p.swiglu_limit = to_float_in_range(parse_finite(limit, what + " (a number or null)"), what);
  }
  try {
    p.validate();
  } catch (const Error& e) {
    throw Error(source + ": " + e.what());
  }
  return p;
}

namespace {

struct Entry {
  std::string name;
  HostTensor* tensor;
};

std::vector<Entry> entries(RankData& r) {
  std::vector<Entry> v = {{"x", &r.x}, {"top_experts", &r.top_experts}, {"router_weights", &r.router_weights},
                          {"w_gate", &r.w_gate}, {"w_up", &r.w_up}, {"w_down", &r.w_down},
                          {"y", &r.y}, {"dy", &r.dy}, {"dx", &r.dx}, {"d_router_weights", &r.d_router_weights},
                          {"d_w_gate", &r.d_w_gate}, {"d_w_up", &r.d_w_up}, {"d_w_down", &r.d_w_down}};
  for (std::size_t s = 0; s < r.shared.size(); ++s) {
    const std::string p = "shared" + std::to_string(s) + "_";
    v.push_back({p + "w_gate", &r.shared[s].w_gate});
    v.push_back({p + "w_up", &r.shared[s].w_up});
    v.push_back({p + "w_down", &r.shared[s].w_down});
  }
  for (std::size_t s = 0; s < r.d_shared.size(); ++s) {
    const std::string p = "shared" + std::to_string(s) + "_";
    v.push_back({p + "d_w_gate", &r.d_shared[s].d_w_gate});
    v.push_back({p + "d_w_up", &r.d_shared[s].d_w_up});
    v.push_back({p + "d_w_down", &r.d_shared[s].d_w_down});
  }
  return v;
}

}  // namespace

void save_layer_data(const std::string& dir, const LayerData& data) {
  // What this save writes, in order, each entry listed before it is made. A save that fails
  // part way removes them again, newest first (a directory only when empty), so it leaves no
  // partial save that looks like a whole one. Files it did not write are never touched (one
  // it overwrote is removed: its old content was gone already). problem.json, which --load
  // needs first, is written last: a save cut short by a signal (no unwinding) leaves none.
  std::vector<fs::path> created;
  auto make_directory = [&](const fs::path& d, const char* what) {
    std::vector<fs::path> missing;  // (d and its missing parents, innermost first)
    std::error_code ec;
    // (symlink_status: a dangling link is there, not this save's to remove on failure; only a
    // path not found is missing.)
    for (fs::path q = d; !q.empty() && fs::symlink_status(q, ec).type() == fs::file_type::not_found;
         q = q.parent_path()) {
      missing.push_back(q);
      if (q == q.parent_path()) break;
    }
    created.insert(created.end(), missing.rbegin(), missing.rend());
    fs::create_directories(d, ec);
    if (ec) throw Error("--save " + dir + ": cannot create " + what + ": " + ec.message());
  };
  try {
    make_directory(dir, "the directory");
    // An earlier save's problem.json goes first, so that no moment of this one has a
    // problem.json beside files of another run.
    const fs::path pj = fs::path(dir) / "problem.json";
    std::error_code gone;
    if (fs::is_regular_file(pj, gone)) {
      created.push_back(pj);
      fs::remove(pj, gone);
      if (gone) throw Error("--save " + dir + ": cannot replace problem.json: " + gone.message());
    }
    for (int r = 0; r < static_cast<int>(data.ranks.size()); ++r) {
      make_directory(rank_dir(dir, r), "rank directory");
      for (const auto& e : entries(const_cast<RankData&>(data.ranks[r])))
        if (!e.tensor->empty()) {
          const fs::path f = rank_dir(dir, r) / (e.name + ".npy");
          created.push_back(f);
          npy::save(f.string(), *e.tensor);
        }
    }
    {
      created.push_back(pj);  // (maybe listed already, for the old one: removing twice is harmless)
      std::ofstream out(pj);
      out << problem_to_json(data.problem);
      out.close();
      if (!out) throw Error("--save " + dir + ": cannot write problem.json");
    }
  } catch (const std::exception& e) {
    std::error_code ec;  // (each step without throwing: the save's error is the news)
    for (auto it = created.rbegin(); it != created.rend(); ++it) fs::remove(*it, ec);
    throw Error(std::string(e.what()) + "; what this save had written under " + dir + " is removed");
  }
}

void require_directory(const std::string& dir, const std::string& context) {
  std::error_code ec;
  const fs::file_status st = fs::status(dir, ec);
  if (st.type() == fs::file_type::not_found) throw Error(context + ": no such directory");
  if (ec) throw Error(context + ": cannot be read: " + ec.message());
  if (st.type() != fs::file_type::directory)
    throw Error(context + ": not a directory (a --save writes a directory: problem.json and rank<r>/)");
}

std::optional<Problem> read_problem_json(const std::string& dir, const std::string& context) {
  const fs::path pj = fs::path(dir) / "problem.json";
  if (!npy::regular_file_at(pj.string(), context)) return std::nullopt;
  // (A save writes a few hundred bytes: a file far larger is no save's, and read whole it
  // could take the host's memory.)
  constexpr std::uintmax_t kMaxProblemJsonBytes = 1 << 20;
  std::error_code size_ec;
  const std::uintmax_t size = fs::file_size(pj, size_ec);
  if (!size_ec && size > kMaxProblemJsonBytes)
    throw Error(context + ": " + pj.string() + " holds " + std::to_string(size) + " bytes; a problem.json a save " +
                "writes is under 1 KiB (at most " + std::to_string(kMaxProblemJsonBytes) + " bytes are read)");
  std::ifstream in(pj);
  if (!in) throw Error(context + ": " + pj.string() + " cannot be read (permissions?)");
  std::stringstream text;
  text << in.rdbuf();
  try {
    return problem_from_json(text.str(), pj.string());
  } catch (const Error& e) {
    throw Error(context + ": " + e.what());
  }
}

namespace {

LayerData load_layer_data_named_by_caller(const std::string& dir, const bool with_backward,
                                          const std::function<std::uint64_t(const Problem&)>& extra_host_bytes,
                                          const std::string& context) {
  require_directory(dir, context);
  const std::optional<Problem> problem = read_problem_json(dir, context);
  if (!problem) {
    // A distributed run's save holds each rank's y alone (rank<r>/y.npy), for --expect.
    std::error_code ec;
    if (fs::is_regular_file(fs::path(dir) / "rank0" / "y.npy", ec) &&
        !fs::exists(fs::path(dir) / "rank0" / "x.npy", ec))
      throw Error(context + ": no problem.json in that directory, and rank0/ holds y.npy without x.npy: a "
                  "distributed run's --save (each rank's y alone, for --expect), not a layer to load");
    throw Error(context + ": no problem.json in that directory (a --save writes it last: one cut short leaves none)");
  }
  const Problem& p = *problem;

  // A rank's file, which must be there. dy is only in a save that ran a backward.
  auto required_file = [&](int r, const std::string& name) {
    const fs::path f = rank_dir(dir, r) / (name + ".npy");
    if (npy::regular_file_at(f.string(), context)) return f.string();
    if (name == "dy")
      throw Error(context + ": missing " + f.string() + ": --pass backward and both need dy, which a save made " +
                  "with --pass forward does not hold (load it with --pass forward)");
    throw Error(context + ": missing " + f.string());
  };

  // Before anything is allocated: the files that pin every size problem.json gives (T, H, k,
  // E/R, I, each shared width, and R through the last rank's directory) must have those
  // sizes, and no rank or shared expert beyond them may be there, so a problem.json that does
  // not describe the files is reported at once rather than after allocating (or running out
  // of memory on) what it claims, or by running a smaller problem than the files hold.
  {
    const std::int64_t T = p.tokens_per_rank, H = p.hidden, k = p.top_k, I = p.intermediate;
    const std::int64_t local = p.num_experts / p.ep_size;
    auto pin = [&](int r, const std::string& name, const std::vector<std::int64_t>& shape) {
      npy::check_shape(required_file(r, name), shape);
    };
    for (int r : {0, p.ep_size - 1}) {
      pin(r, "x", {T, H});
      pin(r, "top_experts", {T, k});
    }
    pin(0, "w_gate", {local, I, H});
    const std::size_t S = p.shared_intermediate.size();
    for (std::size_t s = 0; s < S; ++s) pin(0, "shared" + std::to_string(s) + "_w_gate", {p.shared_intermediate[s], H});
    // Any rank<N> beyond ep_size, and in a rank's directory any shared<S>_* file beyond the
    // shared experts problem.json lists, whatever it holds (a part of another problem's save).
    auto numbered = [](const std::string& name, const std::string& prefix, std::size_t* end) -> long long {
      std::size_t i = prefix.size();
      if (name.compare(0, prefix.size(), prefix) != 0 || i >= name.size() || !std::isdigit(static_cast<unsigned char>(name[i])))
        return -1;
      long long n = 0;
      for (; i < name.size() && std::isdigit(static_cast<unsigned char>(name[i])) && n < (1LL << 40); ++i)
        n = n * 10 + (name[i] - '0');
      *end = i;
      return n;
    };
    auto listing = [&](const fs::path& d) {
      std::vector<std::string> names;
      std::error_code ec;
      if (!fs::is_directory(d, ec)) return names;  // (a missing rank is named by the loads below)
      fs::directory_iterator it(d, ec);
      for (; !ec && it != fs::directory_iterator(); it.increment(ec)) names.push_back(it->path().filename().string());
      if (ec) throw Error(context + ": cannot list " + d.string() + ": " + ec.message());
      std::sort(names.begin(), names.end());  // (the first beyond is named the same way every time)
      return names;
    };
    for (const std::string& name : listing(dir)) {
      std::size_t end = 0;
      const long long r = numbered(name, "rank", &end);
      if (r >= p.ep_size && end == name.size())
        throw Error(context + ": " + (fs::path(dir) / name).string() + " is there, but problem.json's ep_size is " +
                    std::to_string(p.ep_size) + ": the files hold another problem");
    }
    for (int r = 0; r < p.ep_size; ++r)
      for (const std::string& name : listing(rank_dir(dir, r))) {
        std::size_t end = 0;
        const long long shared = numbered(name, "shared", &end);
        if (shared >= static_cast<long long>(S) && end < name.size() && name[end] == '_')
          throw Error(context + ": " + (rank_dir(dir, r) / name).string() +
                      " is there, but problem.json's shared_intermediate lists " + std::to_string(S) +
                      " shared expert(s): the files hold another problem");
      }
  }

  const std::uint64_t data_bytes = layer_data_host_bytes(p, with_backward);
  const std::uint64_t extra = extra_host_bytes ? extra_host_bytes(p) : 0;
  require_host_memory(data_bytes > ~extra ? ~std::uint64_t{0} : data_bytes + extra,
                      context + " (" + p.describe() + (extra ? ", with the CPU reference" : "") + ")");
  // Shapes come from a freshly made LayerData of the same problem (which also allocates and
  // poisons the outputs); its generated values are then replaced by the files'.
  Routing placeholder;
  const std::int64_t per = std::int64_t(p.tokens_per_rank) * p.top_k;
  for (int r = 0; r < p.ep_size; ++r) {
    std::vector<std::int32_t> ids(per);
    for (std::int64_t i = 0; i < per; ++i) ids[i] = static_cast<std::int32_t>(i % p.top_k);
    placeholder.top_experts.push_back(std::move(ids));
    placeholder.router_weights.emplace_back(per, 1.0f);
  }
  LayerData data = make_layer_data(p, placeholder, 0, with_backward);
  const std::vector<std::string> inputs = {"x", "top_experts", "router_weights", "w_gate", "w_up", "w_down", "dy"};
  for (int r = 0; r < p.ep_size; ++r) {
    for (auto& e : entries(data.ranks[r])) {
      const bool is_input = std::find(inputs.begin(), inputs.end(), e.name) != inputs.end() ||
                            (e.name.rfind("shared", 0) == 0 && e.name.find("_d_") == std::string::npos);
      if (!is_input || e.tensor->empty()) continue;
      *e.tensor = npy::load(required_file(r, e.name), e.tensor->dtype(), e.tensor->shape());
    }
    try {
      check_routing_rank(p, r, data.ranks[r].top_experts.data<std::int32_t>(),
                         data.ranks[r].router_weights.data<float>());
    } catch (const Error& e) {
      throw Error(context + " (" + (rank_dir(dir, r) / "top_experts.npy").string() + ", router_weights.npy): " +
                  e.what());
    }
  }
  data.poison_outputs();
  return data;
}

}  // namespace

LayerData load_layer_data(const std::string& dir, const bool with_backward,
                          const std::function<std::uint64_t(const Problem&)>& extra_host_bytes) {
  const std::string context = "--load " + dir;
  try {
    return load_layer_data_named_by_caller(dir, with_backward, extra_host_bytes, context);
  } catch (const Error& e) {
    // Every error names the option: the npy reader's and the routing's name only the file.
    if (std::string_view(e.what()).starts_with(context)) throw;
    throw Error(context + ": " + e.what());
  }
}

}  // namespace mok::io
