// Where a process sits in a real EP group, read from its launcher's environment.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <thread>

#include <unistd.h>

#include "comm/group_env.h"
#ifdef MOK_HAS_CUDA
#include "comm/ep_group.h"
#include "cuda/device_error.h"
#endif
#include "comm/rendezvous.h"
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

TEST(GroupEnvironment, AnEmptyDirectoryVariableIsUnset) {
  // MOK_LAUNCH_DIR="" hides no MOK_RENDEZVOUS_DIR, and an empty one alone is none at all.
  EXPECT_EQ(read({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MOK_LAUNCH_DIR", ""}, {"MOK_RENDEZVOUS_DIR", "/shared"}})
                .rendezvous_dir,
            "/shared");
  EXPECT_THAT(error_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MOK_RENDEZVOUS_DIR", ""}}),
              HasSubstr("no rendezvous directory"));
}

TEST(GroupEnvironment, TheDeviceIsTheLocalRankOrTheProcesssOneGpu) {
  const auto env = read({{"RANK", "5"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "3"}, {"MOK_RENDEZVOUS_DIR", "/d"}});
  EXPECT_EQ(env.cuda_device(8), 3);  // the process sees its node's GPUs
  EXPECT_EQ(env.cuda_device(4), 3);
  EXPECT_EQ(env.cuda_device(1), 0);  // the launcher gave it one GPU (CUDA_VISIBLE_DEVICES)
  auto refusal = [&](int visible) -> std::string {
    try {
      env.cuda_device(visible);
    } catch (const Error& e) {
      return e.what();
    }
    return "no error";
  };
  EXPECT_THAT(refusal(2), HasSubstr("local rank 3 (torchrun) has no GPU: this process sees 2"));
  EXPECT_THAT(refusal(2), HasSubstr("or exactly one: its own"));
  EXPECT_THAT(refusal(0), HasSubstr("rank 5 (torchrun) sees no CUDA device"));
  const auto first = read({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "0"}, {"MOK_RENDEZVOUS_DIR", "/d"}});
  EXPECT_EQ(first.cuda_device(1), 0);
  EXPECT_EQ(first.cuda_device(2), 0);
}

TEST(GroupEnvironment, AFailedStartSaysWhichGpuTheRankTookAndWhyTwoRanksMayShareIt) {
  const auto env = read({{"RANK", "5"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "3"}, {"MOK_RENDEZVOUS_DIR", "/d"}});
  EXPECT_EQ(env.shared_gpu_hint(8),
            "; NCCL also refuses two ranks on one GPU: rank 5 (local rank 3) took CUDA device 3 of the 8 this process "
            "sees");
  EXPECT_THAT(env.shared_gpu_hint(1), ::testing::AllOf(HasSubstr("took CUDA device 0 of the 1 this process sees"),
                                                       HasSubstr("give each rank its own GPU")));
  EXPECT_EQ(read({{"RANK", "0"}, {"WORLD_SIZE", "1"}}).shared_gpu_hint(1), "");  // (a group of one)
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
  // The whole text digits: blanks, signs and ranges beyond 2^20 are named (stoll read " +1").
  for (const char* bad : {" +1", "+1", "1 ", "0x2", "", "2000000"})
    EXPECT_THAT(error_of({{"MOK_RANK", "0"}, {"MOK_WORLD_SIZE", bad}, {"MOK_LAUNCH_DIR", "/d"}}),
                HasSubstr("MOK_WORLD_SIZE = '" + std::string(bad) + "' is not a non-negative integer"))
        << "'" << bad << "'";
}

// Two launchers' variables that disagree (one left in the environment) are an error naming
// both; the same values under two schemes are fine; a local rank is one of the group's.
TEST(GroupEnvironment, LaunchersThatDisagreeAreNamedAndALocalRankIsInTheGroup) {
  EXPECT_THAT(error_of({{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"OMPI_COMM_WORLD_RANK", "3"},
                        {"OMPI_COMM_WORLD_SIZE", "8"}, {"MOK_RENDEZVOUS_DIR", "/d"}}),
              ::testing::AllOf(HasSubstr("RANK = 0, WORLD_SIZE = 1 (torchrun)"),
                    HasSubstr("OMPI_COMM_WORLD_RANK = 3, OMPI_COMM_WORLD_SIZE = 8 (Open MPI)"),
                    HasSubstr("disagree")));
  EXPECT_THAT(error_of({{"MOK_RANK", "0"}, {"MOK_WORLD_SIZE", "1"}, {"RANK", "2"}, {"WORLD_SIZE", "3"}}),
              HasSubstr("(mok launch) but RANK = 2, WORLD_SIZE = 3 (torchrun)"));
  const auto same = read({{"MOK_RANK", "1"}, {"MOK_WORLD_SIZE", "2"}, {"RANK", "1"}, {"WORLD_SIZE", "2"},
                          {"MOK_LAUNCH_DIR", "/d"}});
  EXPECT_EQ(same.source, "mok launch");
  EXPECT_EQ(same.rank, 1);
  EXPECT_THAT(error_of({{"MOK_RANK", "1"}, {"MOK_WORLD_SIZE", "2"}, {"MOK_LOCAL_RANK", "5"}, {"MOK_LAUNCH_DIR", "/d"}}),
              HasSubstr("MOK_LOCAL_RANK = 5 must be below MOK_WORLD_SIZE = 2"));
}

TEST(GroupEnvironment, JobKeyComesFromTheLauncher) {
  const std::map<std::string, std::string> torchrun = {
      {"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MOK_RENDEZVOUS_DIR", "/d"}};
  auto with = [&](std::map<std::string, std::string> extra) {
    extra.insert(torchrun.begin(), torchrun.end());
    return read(extra).job_key;
  };
  EXPECT_EQ(with({}), "");
  EXPECT_EQ(with({{"TORCHELASTIC_RUN_ID", "none"}}), "");  // torchrun's default is no id
  EXPECT_EQ(with({{"TORCHELASTIC_RUN_ID", "ab12"}, {"TORCHELASTIC_RESTART_COUNT", "3"}}), "ab12.restart3");
  EXPECT_EQ(with({{"TORCHELASTIC_RUN_ID", "none"}, {"TORCHELASTIC_RESTART_COUNT", "0"}}), "restart0");
  // torchrun's default id: its store's address and port tell two jobs at once apart.
  EXPECT_EQ(with({{"TORCHELASTIC_RUN_ID", "none"}, {"MASTER_ADDR", "10.0.0.1"}, {"MASTER_PORT", "29500"},
                  {"TORCHELASTIC_RESTART_COUNT", "1"}}),
            "10.0.0.1_29500.restart1");
  EXPECT_EQ(with({{"MASTER_ADDR", "h"}, {"MASTER_PORT", "1"}}), "");  // not torchrun: no job to name
  EXPECT_EQ(with({{"OMPI_MCA_ess_base_jobid", "4711"}}), "4711");
  EXPECT_EQ(with({{"PMIX_NAMESPACE", "prterun-host-99@1"}}), "prterun-host-99_1");
  // MOK_RUN_ID wins over every launcher's id; what a file name cannot hold is replaced.
  EXPECT_EQ(with({{"MOK_RUN_ID", "job/7 a"}, {"TORCHELASTIC_RUN_ID", "ab12"}}), "job_7_a");
  // An empty variable is unset: it hides no other source (MOK_RUN_ID=$SLURM_JOB_ID outside Slurm).
  EXPECT_EQ(with({{"MOK_RUN_ID", ""}, {"TORCHELASTIC_RUN_ID", "ab12"}}), "ab12");
  EXPECT_EQ(with({{"MOK_RUN_ID", ""}}), "");
  const std::string long_id = std::string(100, 'a') + std::string(100, 'z');
  const std::string key = with({{"MOK_RUN_ID", long_id}});
  EXPECT_EQ(key.size(), 96u);
  EXPECT_EQ(key.front(), 'a');
  EXPECT_EQ(key.back(), 'z');  // the tail, where job ids usually differ, is kept
}

// A fresh directory per test, removed after it.
class Rendezvous : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("mok_rendezvous_" + std::to_string(getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  GroupEnvironment rank(int r, const std::string& job) const {
    GroupEnvironment env;
    env.rank = r;
    env.world_size = 2;
    env.rendezvous_dir = dir_.string();
    env.job_key = job;
    return env;
  }
  std::filesystem::path dir_;
};

TEST_F(Rendezvous, TheIdArrivesWholeAndIsRemovedOnceTheGroupFormed) {
  const IdRendezvous root(rank(0, "")), other(rank(1, ""));
  EXPECT_EQ(root.file(), other.file());
  EXPECT_EQ(root.file().filename(), "nccl_unique_id");
  char sent[128], got[128] = {};
  for (int i = 0; i < 128; ++i) sent[i] = static_cast<char>(i * 7 + 1);
  // The reader starts first and waits for rank 0.
  std::thread reader([&] { other.receive(got, sizeof(got), 10000); });
  std::this_thread::sleep_for(std::chrono::milliseconds(60));
  root.publish(sent, sizeof(sent));
  reader.join();
  EXPECT_EQ(0, std::memcmp(sent, got, sizeof(sent)));
  for (const auto& entry : std::filesystem::directory_iterator(dir_))  // no temporary left behind
    EXPECT_EQ(entry.path(), root.file());
  root.retire();
  EXPECT_FALSE(std::filesystem::exists(root.file()));
  root.retire();  // already gone: quiet
}

TEST_F(Rendezvous, AnotherJobsIdInTheSameDirectoryIsNotTaken) {
  const IdRendezvous earlier(rank(0, "job1")), root(rank(0, "job2")), other(rank(1, "job2"));
  EXPECT_EQ(root.file().filename(), "nccl_unique_id.job2");
  char stale[128], fresh[128], got[128] = {};
  std::memset(stale, 0x55, sizeof(stale));
  std::memset(fresh, 0x2a, sizeof(fresh));
  earlier.publish(stale, sizeof(stale));  // job 1 died before its group formed
  std::thread reader([&] { other.receive(got, sizeof(got), 10000); });
  std::this_thread::sleep_for(std::chrono::milliseconds(60));
  root.publish(fresh, sizeof(fresh));
  reader.join();
  EXPECT_EQ(0, std::memcmp(fresh, got, sizeof(fresh)));
}

TEST_F(Rendezvous, AWaitThatEndsNamesTheFileAndTheRank) {
  const IdRendezvous other(rank(1, "j"));
  char got[128];
  try {
    other.receive(got, sizeof(got), 50);
    FAIL() << "receive returned without an id";
  } catch (const PeerWaitError& e) {  // a witness's error: mok exits 4 (kPeerWaitExitStatus)
    EXPECT_THAT(e.what(), HasSubstr("rank 1 waited 50 ms"));
    EXPECT_THAT(e.what(), HasSubstr(other.file().string()));
  }
  // A short file (rank 0 died mid-write without the rename) is not an id either.
  std::ofstream(other.file(), std::ios::binary).write("abc", 3);
  EXPECT_THROW(other.receive(got, sizeof(got), 50), Error);
}

// NCCL's start-up waits for a missing rank without a limit: it starts only once all arrived.
TEST_F(Rendezvous, EveryRankWaitsForAllToArriveAndRank0RemovesTheMarks) {
  const IdRendezvous root(rank(0, "j")), other(rank(1, "j"));
  char id[128], id_root[128], id_other[128];
  for (int i = 0; i < 128; ++i) id[i] = static_cast<char>(3 * i + 5);
  std::memcpy(id_root, id, sizeof(id));
  std::memcpy(id_other, id, sizeof(id));
  root.publish(id, sizeof(id));
  std::string late_error;
  std::thread late([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(80));
    try {
      other.arrive_and_wait_for_all(id_other, sizeof(id_other), 5000);
    } catch (const std::exception& e) {
      late_error = e.what();
    }
  });
  const auto start = std::chrono::steady_clock::now();
  EXPECT_NO_THROW(root.arrive_and_wait_for_all(id_root, sizeof(id_root), 5000));
  EXPECT_GE(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(60));  // it waited for rank 1
  late.join();
  EXPECT_EQ(late_error, "");
  EXPECT_EQ(0, std::memcmp(id_root, id, sizeof(id)));  // nobody's id changed
  EXPECT_EQ(0, std::memcmp(id_other, id, sizeof(id)));
  EXPECT_TRUE(std::filesystem::exists(root.mark(0)));
  EXPECT_TRUE(std::filesystem::exists(root.mark(1)));
  for (const auto& entry : std::filesystem::directory_iterator(dir_))  // no temporary left behind
    EXPECT_EQ(entry.path().extension().string().find("tmp"), std::string::npos) << entry.path();
  root.retire();
  EXPECT_FALSE(std::filesystem::exists(root.file()));
  EXPECT_FALSE(std::filesystem::exists(root.mark(0)));
  EXPECT_FALSE(std::filesystem::exists(root.mark(1)));
}

TEST_F(Rendezvous, ARankThatNeverArrivesIsNamedAndTheWaiterTakesItsMarkBack) {
  GroupEnvironment env = rank(0, "j");
  env.world_size = 4;
  const IdRendezvous root(env);
  env.rank = 2;
  const IdRendezvous third(env);
  char id[128];
  std::memset(id, 0x31, sizeof(id));
  std::ofstream(third.mark(2), std::ios::binary).write(id, sizeof(id));  // rank 2 is here; 1 and 3 never come
  try {
    root.arrive_and_wait_for_all(id, sizeof(id), 50);
    FAIL() << "returned with ranks missing";
  } catch (const PeerWaitError& e) {  // a witness's error: mok exits 4
    EXPECT_THAT(e.what(), HasSubstr("rank 0 waited 50 ms for the other ranks to arrive; not arrived: ranks 1, 3"));
  }
  EXPECT_FALSE(std::filesystem::exists(root.mark(0)));
  EXPECT_TRUE(std::filesystem::exists(third.mark(2)));  // only its own
}

// A rank whose wait runs out as the last peer arrives: it takes its mark back, looks once more,
// finds everyone (a peer that saw every mark may already be in NCCL's unbounded start) and
// goes on with its mark left again, instead of leaving that peer waiting for good.
TEST_F(Rendezvous, ARankGivingUpAsTheLastPeerArrivesGoesOnIfAllAreThere) {
  IdRendezvous root(rank(0, "j")), other(rank(1, "j"));
  char id[128];
  std::memset(id, 0x4d, sizeof(id));
  root.publish(id, sizeof(id));
  bool looked_again = false;
  other.set_before_last_look([&] {
    EXPECT_FALSE(std::filesystem::exists(other.mark(1))) << "the mark is taken back before the last look";
    std::ofstream(root.mark(0), std::ios::binary).write(id, sizeof(id));  // rank 0 arrives just now
    looked_again = true;
  });
  EXPECT_NO_THROW(other.arrive_and_wait_for_all(id, sizeof(id), 0));
  EXPECT_TRUE(looked_again);
  EXPECT_TRUE(std::filesystem::exists(other.mark(1)));  // marked again: rank 0 may go on
  // Nobody there at the last look either: it gives up naming them, its mark taken back.
  std::filesystem::remove(root.mark(0));
  std::filesystem::remove(other.mark(1));
  other.set_before_last_look({});
  try {
    other.arrive_and_wait_for_all(id, sizeof(id), 0);
    FAIL() << "returned with rank 0 missing";
  } catch (const PeerWaitError& e) {
    EXPECT_THAT(e.what(), HasSubstr("not arrived: rank 0"));
    EXPECT_THAT(e.what(), Not(HasSubstr("removed the id")));
  }
  EXPECT_FALSE(std::filesystem::exists(other.mark(1)));
}

// Rank 0 gave up (and removed the id and marks) while rank 1 still waits: rank 1 leaves no
// mark again, so that one it would leave behind if it were killed now cannot exist.
TEST_F(Rendezvous, AWaiterDoesNotMarkAgainOnceRank0HasRemovedTheId) {
  const IdRendezvous root(rank(0, "j")), other(rank(1, "j"));
  char id[128];
  std::memset(id, 0x17, sizeof(id));
  root.publish(id, sizeof(id));
  std::string error;
  std::thread waiting([&] {
    try {
      other.arrive_and_wait_for_all(id, sizeof(id), 400);
    } catch (const std::exception& e) {
      error = e.what();
    }
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_TRUE(std::filesystem::exists(other.mark(1)));
  root.retire();
  std::this_thread::sleep_for(std::chrono::milliseconds(150));  // several of rank 1's polls
  EXPECT_FALSE(std::filesystem::exists(other.mark(1)));
  waiting.join();
  EXPECT_THAT(error, HasSubstr("not arrived: rank 0 "));
  EXPECT_TRUE(std::filesystem::is_empty(dir_));
}

// A reused job key (MOK_RUN_ID) after a rank 0 was killed: its id file and every mark of its
// group are still there.
TEST_F(Rendezvous, AnEarlierJobsMarksLetNoRankThrough) {
  const IdRendezvous root(rank(0, "j"));
  char stale[128], fresh[128];
  std::memset(stale, 0x55, sizeof(stale));
  std::memset(fresh, 0x2a, sizeof(fresh));
  auto rank1_mark = [&](const char* bytes, std::size_t n, bool extra) {
    std::ofstream out(root.mark(1), std::ios::binary | std::ios::trunc);
    out.write(bytes, static_cast<std::streamsize>(n));
    if (extra) out.put('x');
  };
  auto rank0_passes = [&] {
    try {
      root.arrive_and_wait_for_all(fresh, sizeof(fresh), 60);
      return true;
    } catch (const PeerWaitError& e) {
      EXPECT_THAT(e.what(), HasSubstr("not arrived: rank 1 "));
      return false;
    }
  };
  std::ofstream(root.mark(0), std::ios::binary).write(stale, sizeof(stale));
  rank1_mark(stale, sizeof(stale), false);  // the earlier job's whole set
  EXPECT_FALSE(rank0_passes());
  rank1_mark(fresh, 100, false);  // half a mark
  EXPECT_FALSE(rank0_passes());
  rank1_mark(fresh, sizeof(fresh), true);  // this id and more
  EXPECT_FALSE(rank0_passes());
  rank1_mark(fresh, sizeof(fresh), false);  // rank 1 of this job
  EXPECT_TRUE(rank0_passes());
}

TEST_F(Rendezvous, ARankThatReadAnEarlierJobsIdTakesTheNewOneAndTheGroupForms) {
  const IdRendezvous earlier(rank(0, "j")), root(rank(0, "j")), other(rank(1, "j"));
  char stale[128], fresh[128], got[128] = {}, root_id[128];
  std::memset(stale, 0x55, sizeof(stale));
  std::memset(fresh, 0x2a, sizeof(fresh));
  std::memcpy(root_id, fresh, sizeof(fresh));
  // The earlier job's rank 0 published, its rank 1 arrived, and rank 0 died before arriving.
  earlier.publish(stale, sizeof(stale));
  std::ofstream(earlier.mark(1), std::ios::binary).write(stale, sizeof(stale));
  other.receive(got, sizeof(got), 1000);  // this job's rank 1 starts first and reads it
  ASSERT_EQ(0, std::memcmp(got, stale, sizeof(stale)));
  // (Each wait's error is kept and checked after the join: a throw must fail the test, not
  // end the process.)
  std::string rank1_error, rank0_error;
  std::thread one([&] {
    try {
      other.arrive_and_wait_for_all(got, sizeof(got), 5000);
    } catch (const std::exception& e) {
      rank1_error = e.what();
    }
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // rank 1 waits on the stale marks
  root.publish(fresh, sizeof(fresh));
  try {
    root.arrive_and_wait_for_all(root_id, sizeof(root_id), 5000);
  } catch (const std::exception& e) {
    rank0_error = e.what();
  }
  one.join();
  EXPECT_EQ(rank0_error, "");
  EXPECT_EQ(rank1_error, "");
  EXPECT_EQ(0, std::memcmp(got, fresh, sizeof(fresh)));  // rank 1 starts NCCL with this job's id
  EXPECT_EQ(0, std::memcmp(root_id, fresh, sizeof(fresh)));
  root.retire();
  EXPECT_TRUE(std::filesystem::is_empty(dir_));
}

TEST_F(Rendezvous, AnUnwritableDirectoryIsAnError) {
  GroupEnvironment env = rank(0, "");
  env.rendezvous_dir = (dir_ / "missing" / "deeper").string();
  char id[128] = {};
  EXPECT_THAT([&] { IdRendezvous(env).publish(id, sizeof(id)); },
              ::testing::ThrowsMessage<Error>(HasSubstr("cannot leave its NCCL id")));
}

#ifdef MOK_HAS_CUDA
// A real group's barrier gathers every rank's device error; a rank whose own forward was fine
// names the peer that failed and what it recorded.
TEST(GroupErrors, APeersDeviceErrorIsNamedWithItsRankAndWhat) {
  using namespace mok::cuda;
  const int T = 512, k = 8;
  std::vector<DeviceError> gathered(8, DeviceError{});
  EXPECT_FALSE(describe_peer_errors(gathered, 2, T, k).has_value());  // nobody failed
  gathered[2].code = kCapacityExceeded;  // this rank's own: reported as its own, not a peer's
  EXPECT_FALSE(describe_peer_errors(gathered, 2, T, k).has_value());
  gathered[5].code = kExpertOutOfRange;
  gathered[5].index = 5LL * T * k + 7 * k + 3;  // rank 5, token 7, slot 3
  gathered[5].value = 999;
  EXPECT_EQ(describe_peer_errors(gathered, 2, T, k).value(),
            "rank 5 of the EP group recorded a device error: top_experts[rank 5][token 7, slot 3] = 999: expert id "
            "must be in [0, num_experts)");
  gathered[6].code = kWaitTimeout;
  gathered[7].code = kNonFiniteWeight;
  gathered[7].index = 7LL * T * k;  // rank 7, token 0, slot 0
  EXPECT_THAT(describe_peer_errors(gathered, 2, T, k).value(),
              ::testing::AllOf(HasSubstr("rank 5 of the EP group"), HasSubstr("(and 2 other ranks recorded one too)")));
  // Seen from rank 5: rank 7's bad routing comes before rank 2's capacity overflow (a cause
  // first: APeersBadRoutingIsNamedAsTheLikelyCause); without it, rank 2 is first.
  EXPECT_THAT(describe_peer_errors(gathered, 5, T, k).value(),
              ::testing::AllOf(HasSubstr("rank 7 of the EP group recorded a device error: router_weights[rank 7]"),
                               HasSubstr("(and 2 other ranks")));
  gathered[7] = DeviceError{};
  EXPECT_THAT(describe_peer_errors(gathered, 5, T, k).value(),
              ::testing::AllOf(HasSubstr("rank 2 of the EP group recorded a device error: schedule: rank"),
                               HasSubstr("(and 1 other rank recorded one too)")));
}

// Bad routing on a peer is named before other ranks' errors, and before this rank's own
// capacity overflow, which the peer's repeated ids can cause (a rank checks only its own
// ids); any other own error comes first, with the peers' after it.
TEST(GroupErrors, APeersBadRoutingIsNamedAsTheLikelyCause) {
  using namespace mok::cuda;
  const int T = 512, k = 8;
  std::vector<DeviceError> gathered(8, DeviceError{});
  gathered[1].code = kCapacityExceeded;
  gathered[1].rank = 1;
  gathered[6].code = kDuplicateExpert;
  gathered[6].index = 6LL * T * k + 2 * k + 1;  // rank 6, token 2, slot 1
  gathered[6].value = 3;
  EXPECT_THAT(describe_peer_errors(gathered, 0, T, k).value(),
              ::testing::AllOf(::testing::StartsWith("rank 6 of the EP group recorded a device error: "
                                                     "top_experts[rank 6][token 2]: expert 3 appears twice"),
                               HasSubstr("(and 1 other rank recorded one too)")));

  DeviceError own{};
  own.code = kCapacityExceeded;
  own.rank = 0;
  own.index = 4096;
  own.value = 4224;
  EXPECT_THAT(describe_forward_errors(own, gathered, 0, T, k),
              ::testing::AllOf(::testing::StartsWith("rank 6 of the EP group recorded a device error"),
                               HasSubstr("possibly because of it"),
                               HasSubstr("schedule: rank 0 receives 4224 padded rows, more than its capacity of 4096"),
                               HasSubstr("1.0 covers every valid routing")));
  // Without a peer's bad routing, or with another own error: the own error first.
  std::vector<DeviceError> capacity_only = gathered;
  capacity_only[6] = DeviceError{};
  EXPECT_THAT(describe_forward_errors(own, capacity_only, 0, T, k),
              ::testing::AllOf(::testing::StartsWith("schedule: rank 0 receives 4224 padded rows"),
                               HasSubstr("; in the same forward, rank 1 of the EP group")));
  DeviceError own_bad = gathered[6];
  own_bad.index = 2LL * k;  // rank 0, token 2, slot 0
  EXPECT_THAT(describe_forward_errors(own_bad, gathered, 0, T, k),
              ::testing::AllOf(::testing::StartsWith("top_experts[rank 0][token 2]"),
                               HasSubstr("; in the same forward, rank 6 of the EP group")));
  EXPECT_EQ(describe_forward_errors(own, {}, 0, T, k), describe_device_error(own, T, k));  // outside a group
}

// A forward whose schedule saw the group being aborted names the rank and says that it kept
// off the peers and poisoned its output (the GPU side: GpuErrors.AnAbandonedGroups...).
TEST(GroupErrors, AnAbandonedForwardSaysItTouchedNoPeer) {
  using namespace mok::cuda;
  DeviceError e{};
  e.code = kGroupAbandoned;
  e.rank = 3;
  EXPECT_THAT(describe_device_error(e, 512, 8),
              ::testing::AllOf(HasSubstr("rank 3's EP group was being aborted"), HasSubstr("touched no peer memory"),
                               HasSubstr("poisoned with NaN")));
  std::vector<DeviceError> gathered(4, DeviceError{});
  gathered[3] = e;
  EXPECT_THAT(describe_peer_errors(gathered, 0, 512, 8).value(),
              HasSubstr("rank 3 of the EP group recorded a device error: rank 3's EP group was being aborted"));
}

// A rank whose status never came (the group barrier's all-gather aborted before it did) is
// read from the 0xFF bytes the table is filled with before each barrier (backend.cu): its
// code is kNoGroupStatus, which is no kOk (the epilogue poisons y) and is named as such.
TEST(GroupErrors, ARankWhoseStatusNeverCameIsNamedAsSuch) {
  using namespace mok::cuda;
  std::vector<DeviceError> gathered(4, DeviceError{});
  std::memset(&gathered[2], 0xFF, sizeof(DeviceError));  // (what cudaMemsetAsync(..., 0xFF, ...) leaves)
  ASSERT_EQ(gathered[2].code, kNoGroupStatus);
  ASSERT_NE(gathered[2].code, kOk);
  EXPECT_EQ(describe_peer_errors(gathered, 0, 512, 8).value(),
            "rank 2 of the EP group sent no status: the group's barrier was aborted before its status arrived (its "
            "rows for this rank's tokens may be missing), and the output was poisoned with NaN");
  EXPECT_FALSE(is_routing_error(kNoGroupStatus));
}

// A timed-out device wait says which wait, on what: a shared expert's down GEMM names a token
// tile (not a routed row tile), a pull names the tile it waits to pull.
TEST(GroupErrors, ATimedOutWaitNamesItsSite) {
  using namespace mok::cuda;
  DeviceError e{};
  e.code = kWaitTimeout;
  e.rank = 1;
  e.index = 12;
  e.value = 3;
  const std::pair<int, const char*> sites[] = {
      {kWaitRowsReady, "a GEMM waiting for its pulled rows, row tile 12 (counter stuck at 3)"},
      {kWaitActReady, "a down GEMM waiting for its SwiGLU rows, row tile 12"},
      {kWaitSharedActReady, "a shared expert's down GEMM waiting for its SwiGLU rows, token tile 12"},
      {kWaitRingFree, "the pull of row tile 12 waiting for its ring slot"},
      {99, "wait site 99, item 12"}};
  for (const auto& [where, want] : sites) {
    e.where = where;
    EXPECT_THAT(describe_device_error(e, 512, 8),
                ::testing::AllOf(HasSubstr("device wait timed out on rank 1: "), HasSubstr(want)));
  }
}

// MOK_NCCL_LIBRARY set for one test, restored after it.
class NcclLibrary : public ::testing::Test {
 protected:
  void SetUp() override {
    if (const char* v = std::getenv("MOK_NCCL_LIBRARY")) saved_ = v;
  }
  void TearDown() override {
    if (saved_) setenv("MOK_NCCL_LIBRARY", saved_->c_str(), 1);
    else unsetenv("MOK_NCCL_LIBRARY");
  }
  static std::string error_with(const char* library) {
    setenv("MOK_NCCL_LIBRARY", library, 1);
    try {
      const auto choice = nccl_library();
      return "no error: took " + choice.path;
    } catch (const Error& e) {
      return e.what();
    }
  }
  std::optional<std::string> saved_;
};

TEST_F(NcclLibrary, AMissingOrForeignLibraryIsNamedWithTheFix) {
  std::string e = error_with("/nonexistent/libnccl.so.2");
  EXPECT_THAT(e, HasSubstr("/nonexistent/libnccl.so.2: cannot load"));
  EXPECT_THAT(e, HasSubstr("Point MOK_NCCL_LIBRARY at such a libnccl.so.2"));
  e = error_with("libc.so.6");
  EXPECT_THAT(e, HasSubstr("libc.so.6: not an NCCL library"));
}

TEST(NcclRelease, OnlyTheHeadersReleaseAtTheirPatchOrLaterIsTaken) {
  const int headers = nccl_headers_version();  // e.g. 22809 for 2.28.9
  EXPECT_TRUE(nccl_release_accepted(headers));
  EXPECT_TRUE(nccl_release_accepted(headers + 1));                 // a later patch
  EXPECT_FALSE(nccl_release_accepted(headers - 1));                // an earlier patch
  EXPECT_FALSE(nccl_release_accepted(headers / 100 * 100 + 100));  // the next minor release
  EXPECT_FALSE(nccl_release_accepted(headers / 100 * 100 - 100 + 99));
}

TEST_F(NcclLibrary, TheOneTakenMatchesTheHeadersRelease) {
  unsetenv("MOK_NCCL_LIBRARY");
  NcclLibraryChoice choice;
  try {
    choice = nccl_library();
  } catch (const Error& e) {
    // No NCCL of the right release on this machine: the error must say what was tried.
    EXPECT_THAT(e.what(), HasSubstr("libnccl.so.2"));
    GTEST_SKIP() << "no NCCL of the headers' release here: " << e.what();
  }
  EXPECT_FALSE(choice.path.empty());
  EXPECT_TRUE(nccl_release_accepted(choice.version)) << choice.version;
  // Asking for that very file by name gives the same answer.
  setenv("MOK_NCCL_LIBRARY", choice.path.c_str(), 1);
  EXPECT_EQ(nccl_library().version, choice.version);
}
#endif

}  // namespace
}  // namespace mok::comm
