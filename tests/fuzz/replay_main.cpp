// Runs a fuzz target over every file under the directories given (ctest's regression replay of
// tests/fuzz/inputs: seeds and past findings), without libFuzzer. A finding aborts; an empty
// directory is an error, so that a test that replays nothing cannot pass.
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size);

int main(int argc, char** argv) {
  std::size_t replayed = 0;
  for (int a = 1; a < argc; ++a) {
    for (const auto& entry : std::filesystem::recursive_directory_iterator(argv[a])) {
      if (!entry.is_regular_file()) continue;
      std::ifstream in(entry.path(), std::ios::binary);
      const std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      std::printf("replay %s (%zu bytes)\n", entry.path().c_str(), bytes.size());
      std::fflush(stdout);  // (the last line names the input when one aborts)
      LLVMFuzzerTestOneInput(reinterpret_cast<const std::uint8_t*>(bytes.data()), bytes.size());
      ++replayed;
    }
  }
  if (replayed == 0) {
    std::fprintf(stderr, "replay: no input found under the directories given\n");
    return 1;
  }
  std::printf("replay: %zu inputs, no finding\n", replayed);
  return 0;
}
