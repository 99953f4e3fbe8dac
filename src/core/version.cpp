// mok::version() and mok::build_commit() (mok/layer.h). MOK_VERSION comes from CMake's
// project version; mok_commit.h is written at every build by cmake/git_commit.cmake.
#include <string>

#include "mok/layer.h"
#include "mok_commit.h"

namespace mok {

std::string version() { return MOK_VERSION; }

std::string build_commit() {
  const std::string commit = MOK_GIT_COMMIT;
  return MOK_GIT_DIRTY && commit != "unknown" ? commit + "-dirty" : commit;
}

}  // namespace mok
