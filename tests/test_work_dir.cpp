// mok bench's work directory: an earlier run's files are removed before anything reads it,
// and nothing else there is touched.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>

#include <unistd.h>

#include "mok/work_dir.h"

namespace mok::cli {
namespace {

TEST(WorkDir, KnowsWhatTheBenchAndItsPeersWrite) {
  for (const char* name : {"mok.json", "mok.json.tmp", "peer.json", "x_all.npy", "w_down.npy", "y_ref.npy",
                           "shared0_w_gate.npy", "shared12_w_down.npy.tmp", "rows_for3.npy", "slots_for63.npy.tmp",
                           "dy_local.npy", "top_experts.npy"})
    EXPECT_TRUE(is_bench_output(name)) << name;
  for (const char* name : {"notes.txt", "mok.json.bak", "my_weights.npy", "shared_w_gate.npy", "sharedX_w_up.npy",
                           "rows_for.npy", "rows_for3a.npy", "slots_for-1.npy", ".tmp", "w_gate.npz", "rank0"})
    EXPECT_FALSE(is_bench_output(name)) << name;
}

// What the bench writes is named by the same list the cleaner reads (work_dir.h).
TEST(WorkDir, KnowsEveryNameTheBenchWritesBy) {
  std::vector<std::string> seen;
  for (int f = 0; f < static_cast<int>(BenchFile::kCount); ++f) {
    const std::string name = bench_file_name(static_cast<BenchFile>(f));
    EXPECT_FALSE(name.empty()) << "file " << f << " has no name";
    EXPECT_EQ(std::count(seen.begin(), seen.end(), name), 0) << name << " names two files";
    seen.push_back(name);
    EXPECT_TRUE(is_bench_output(name)) << name;
    EXPECT_TRUE(is_bench_output(name + ".tmp")) << name;
  }
  for (int r : {0, 7, 63}) {
    EXPECT_TRUE(is_bench_output(rows_for_file(r))) << rows_for_file(r);
    EXPECT_TRUE(is_bench_output(slots_for_file(r))) << slots_for_file(r);
    for (BenchFile w : {BenchFile::kWGate, BenchFile::kWUp, BenchFile::kWDown})
      EXPECT_TRUE(is_bench_output(shared_weight_file(r, w))) << shared_weight_file(r, w);
  }
  EXPECT_EQ(shared_weight_file(2, BenchFile::kWUp), "shared2_w_up.npy");  // bench/README.md's contract
  EXPECT_EQ(rows_for_file(3), "rows_for3.npy");
  EXPECT_FALSE(is_bench_output(shared_weight_file(1, BenchFile::kXAll)));  // not a weight
}

TEST(WorkDir, ClearingRemovesOnlyTheBenchOutputs) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() /
                       ("mok_work_dir_" + std::to_string(getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir / "rank0");
  for (const char* name : {"mok.json", "peer.json", "rows_for1.npy", "x_local.npy.tmp", "keep.npy", "README"})
    std::ofstream(dir / name) << "earlier";
  std::ofstream(dir / "rank0" / "mok.json") << "earlier";  // a subdirectory is its rank's to clear
  const auto removed = clear_bench_outputs(dir);
  EXPECT_EQ(removed, (std::vector<std::string>{"mok.json", "peer.json", "rows_for1.npy", "x_local.npy.tmp"}));
  EXPECT_TRUE(fs::exists(dir / "keep.npy"));
  EXPECT_TRUE(fs::exists(dir / "README"));
  EXPECT_TRUE(fs::exists(dir / "rank0" / "mok.json"));
  EXPECT_FALSE(fs::exists(dir / "mok.json"));
  EXPECT_TRUE(clear_bench_outputs(dir).empty());          // nothing left to remove
  EXPECT_TRUE(clear_bench_outputs(dir / "absent").empty());  // a directory not made yet
  fs::remove_all(dir);
}

}  // namespace
}  // namespace mok::cli
