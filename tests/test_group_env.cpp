// Where a process sits in a real EP group, read from its launcher's environment.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <map>

#include "comm/group_env.h"
#include "mok/error.h"

namespace mok::comm {
namespace {

using ::testing::HasSubstr;

GroupEnvironment read(const std::map<std::string, std::string>& vars) {
  return GroupEnvironment::from_environment([&](const char* name) -> std::optional<std::string> {
    auto it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  });
}

std::string error_of(const std::map<std::string, std::string>& vars) {
  try {
    read(vars);
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

TEST(GroupEnvironment, MokLaunchVariables) {
  const auto env = read({{"MOK_RANK", "2"}, {"MOK_WORLD_SIZE", "4"}, {"MOK_LOCAL_RANK", "2"}, {"MOK_LAUNCH_DIR", "/tmp/x"}});
  EXPECT_EQ(env.rank, 2);
  EXPECT_EQ(env.world_size, 4);
  EXPECT_EQ(env.local_rank, 2);
  EXPECT_EQ(env.rendezvous_dir, "/tmp/x");
  EXPECT_EQ(env.source, "mok launch");
}

TEST(GroupEnvironment, TorchrunAndMpiVariables) {
  auto env = read({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "1"}, {"MOK_RENDEZVOUS_DIR", "/shared"}});
  EXPECT_EQ(env.source, "torchrun");
  EXPECT_EQ(env.rank, 1);
  EXPECT_EQ(env.rendezvous_dir, "/shared");
  env = read({{"OMPI_COMM_WORLD_RANK", "3"}, {"OMPI_COMM_WORLD_SIZE", "8"}, {"MOK_LAUNCH_DIR", "/d"}});
  EXPECT_EQ(env.source, "Open MPI");
  EXPECT_EQ(env.local_rank, 3);  // defaults to the rank
}

TEST(GroupEnvironment, SingleProcessNeedsNoRendezvous) {
  const auto env = read({{"RANK", "0"}, {"WORLD_SIZE", "1"}});
  EXPECT_EQ(env.world_size, 1);
  EXPECT_TRUE(env.rendezvous_dir.empty());
}

TEST(GroupEnvironment, ErrorsNameTheVariable) {
  EXPECT_THAT(error_of({}), HasSubstr("not part of an EP group"));
  EXPECT_THAT(error_of({{"MOK_RANK", "0"}}), HasSubstr("MOK_WORLD_SIZE is missing"));
  EXPECT_THAT(error_of({{"MOK_RANK", "x"}, {"MOK_WORLD_SIZE", "2"}, {"MOK_LAUNCH_DIR", "/d"}}),
              HasSubstr("MOK_RANK = 'x'"));
  EXPECT_THAT(error_of({{"MOK_RANK", "2"}, {"MOK_WORLD_SIZE", "2"}, {"MOK_LAUNCH_DIR", "/d"}}),
              HasSubstr("must be below MOK_WORLD_SIZE"));
  EXPECT_THAT(error_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}}), HasSubstr("MOK_RENDEZVOUS_DIR"));
}

}  // namespace
}  // namespace mok::comm
