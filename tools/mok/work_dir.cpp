#include "mok/work_dir.h"

#include <algorithm>
#include <cctype>
#include <string>
#include <system_error>

#include "mok/error.h"

namespace mok::cli {
namespace {

bool all_digits(const std::string& s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](unsigned char c) { return std::isdigit(c); });
}

// `name` is prefix + <digits> + suffix.
bool numbered(const std::string& name, const std::string& prefix, const std::string& suffix) {
  if (name.size() <= prefix.size() + suffix.size()) return false;
  if (name.compare(0, prefix.size(), prefix) != 0) return false;
  if (name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0) return false;
  return all_digits(name.substr(prefix.size(), name.size() - prefix.size() - suffix.size()));
}

}  // namespace

bool is_bench_output(const std::string& file_name) {
  std::string name = file_name;
  const std::string tmp = ".tmp";
  if (name.size() > tmp.size() && name.compare(name.size() - tmp.size(), tmp.size(), tmp) == 0)
    name.resize(name.size() - tmp.size());
  static const char* const kNames[] = {
      "mok.json",       "peer.json",      "x_all.npy",          "row_source.npy", "row_expert.npy",
      "row_weight.npy", "combine_local.npy", "rows_ref.npy",    "dy_local.npy",   "top_experts.npy",
      "w_gate.npy",     "w_up.npy",       "w_down.npy",         "x_local.npy",    "router_weights.npy",
      "y_ref.npy"};
  for (const char* known : kNames)
    if (name == known) return true;
  for (const char* part : {"_w_gate.npy", "_w_up.npy", "_w_down.npy"})
    if (numbered(name, "shared", part)) return true;
  return numbered(name, "rows_for", ".npy") || numbered(name, "slots_for", ".npy");
}

std::vector<std::string> clear_bench_outputs(const std::filesystem::path& dir) {
  namespace fs = std::filesystem;
  std::vector<std::string> removed;
  std::error_code ec;
  if (!fs::exists(dir, ec)) return removed;  // nothing written there yet
  auto fail = [&](const std::string& what, const std::error_code& e) -> Error {
    return Error("mok bench: cannot " + what + " (" + e.message() +
                 "); an earlier run's file could be read as this run's: remove it, or use another --work-dir");
  };
  fs::directory_iterator it(dir, ec);
  if (ec) throw fail("list --work-dir " + dir.string(), ec);
  for (; it != fs::directory_iterator(); it.increment(ec)) {
    if (ec) throw fail("list --work-dir " + dir.string(), ec);
    const std::string name = it->path().filename().string();
    if (!is_bench_output(name)) continue;
    std::error_code kind;
    if (!it->is_regular_file(kind)) continue;  // (a directory of that name is not ours)
    std::error_code rm;
    fs::remove(it->path(), rm);
    if (rm) throw fail("remove " + it->path().string() + ", left by an earlier run", rm);
    removed.push_back(name);
  }
  if (ec) throw fail("list --work-dir " + dir.string(), ec);
  std::sort(removed.begin(), removed.end());
  return removed;
}

}  // namespace mok::cli
