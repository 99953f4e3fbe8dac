// mok bench's work directory: an earlier run's files are removed before anything reads it,
// and nothing else there is touched.
#include <gtest/gtest.h>

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
