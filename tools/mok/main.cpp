// mok: command-line entry point. `mok` alone runs the default job (mok run).
#include <cstdio>
#include <new>
#include <string>
#include <vector>

#include "mok/cli_args.h"
#include "mok/layer.h"

namespace {

const char* kHelp = R"(usage: mok <command> [options]
commands:
  run      run the layer on a shape (default command); mok run --help
  shapes   list the named shapes
  bench    time the CUDA forward MoK's way and write the peers' inputs (bench/run.py drives it)
  launch   start one process per rank: mok launch -n N [--timeout S] [--grace S] [--peer-grace S] -- COMMAND ...
  version  the library's version, the commit it was built from and whether the CUDA backend is in it
With no arguments, mok runs the default shape on the best available backend.
)";

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  if (!args.empty() && (args[0] == "--help" || args[0] == "-h")) args[0] = "help";
  if (!args.empty() && args[0] == "--version") args[0] = "version";
  std::string command = "run";
  if (!args.empty() && args[0].rfind("--", 0) != 0) {
    command = args[0];
    args.erase(args.begin());
  }
  try {
    int rc = -1;
    if (command == "run") rc = mok::cli::run_command(args);
    else if (command == "shapes") rc = mok::cli::shapes_command(args);
    else if (command == "bench") rc = mok::cli::bench_command(args);
    else if (command == "launch") rc = mok::cli::launch_command(args);
    else if (command == "help") {
      if (!args.empty())
        throw mok::Error("mok help: takes no arguments, got '" + args[0] + "' (a command's options: mok <command> --help)");
      std::fputs(kHelp, stdout);
      rc = 0;
    } else if (command == "version") {
      if (!args.empty()) throw mok::Error("mok version: takes no options, got '" + args[0] + "'");
#ifdef MOK_HAS_CUDA
      const char* backends = "CUDA backend built (sm_90a)";
#else
      const char* backends = "CPU reference only (built without the CUDA backend)";
#endif
      std::printf("mok %s (commit %s; %s)\n", mok::version().c_str(), mok::build_commit().c_str(), backends);
      rc = 0;
    } else {
      std::fprintf(stderr, "mok: unknown command '%s'\n%s", command.c_str(), kHelp);
      return 2;
    }
    // A table that never reached its reader (a full disk, a closed pipe) is a failed run.
    if (std::fflush(stdout) != 0 || std::ferror(stdout)) {
      std::fprintf(stderr, "mok: error: writing the output failed (standard output)\n");
      return 2;
    }
    return rc;
  } catch (const mok::PeerWaitError& e) {
    std::fprintf(stderr, "mok: error: %s\n", e.what());
    return mok::kPeerWaitExitStatus;
  } catch (const mok::Error& e) {
    std::fprintf(stderr, "mok: error: %s\n", e.what());
    return 2;
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "mok: error: out of host memory: this run needs more than the machine has "
                         "(fewer --tokens, a smaller shape, or --ep-mode slice)\n");
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mok: internal error: %s\n", e.what());
    return 1;
  }
}
