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

constexpr char kShared[] = "shared", kRowsFor[] = "rows_for", kSlotsFor[] = "slots_for", kNpy[] = ".npy";

}  // namespace

std::string shared_weight_file(int s, BenchFile which) {
  return kShared + std::to_string(s) + "_" + bench_file_name(which);
}
std::string rows_for_file(int r) { return kRowsFor + std::to_string(r) + kNpy; }
std::string slots_for_file(int r) { return kSlotsFor + std::to_string(r) + kNpy; }

bool is_bench_output(const std::string& file_name) {
  std::string name = file_name;
  const std::string tmp = ".tmp";
  if (name.size() > tmp.size() && name.compare(name.size() - tmp.size(), tmp.size(), tmp) == 0)
    name.resize(name.size() - tmp.size());
  for (int f = 0; f < static_cast<int>(BenchFile::kCount); ++f)
    if (name == bench_file_name(static_cast<BenchFile>(f))) return true;
  // The numbered names, by the same pieces the helpers above join.
  for (const BenchFile part : {BenchFile::kWGate, BenchFile::kWUp, BenchFile::kWDown})
    if (numbered(name, kShared, std::string("_") + bench_file_name(part))) return true;
  return numbered(name, kRowsFor, kNpy) || numbered(name, kSlotsFor, kNpy);
}

void make_option_directory(const std::filesystem::path& dir, const std::string& option) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::exists(dir, ec) && !fs::is_directory(dir, ec))
    throw Error("option " + option + " " + dir.string() + ": is not a directory");
  // A dangling symbolic link on the way would fail the creation as "File exists": say what it is.
  for (fs::path d = fs::absolute(dir, ec); !ec && !d.empty() && d != d.root_path(); d = d.parent_path()) {
    std::error_code link_ec, target_ec;
    if (fs::is_symlink(fs::symlink_status(d, link_ec)) && !fs::exists(d, target_ec) && !target_ec)
      throw Error("option " + option + " " + dir.string() + ": " + d.string() +
                  " is a symbolic link to a missing target (" + fs::read_symlink(d, link_ec).string() + ")");
  }
  fs::create_directories(dir, ec);
  if (ec) throw Error("option " + option + " " + dir.string() + ": cannot create the directory: " + ec.message());
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
