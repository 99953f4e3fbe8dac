#include "comm/group_env.h"

#include <cstdlib>

#include "mok/error.h"

namespace mok::comm {
namespace {

// A launcher's variable: the whole text a decimal integer in [0, 2^20], no blanks or signs
// (stoll alone read " +1" as 1).
int parse_int(const std::string& name, const std::string& text) {
  const bool digits = !text.empty() && text.find_first_not_of("0123456789") == std::string::npos;
  try {
    if (!digits) throw std::invalid_argument("not digits");
    const long long v = std::stoll(text);
    if (v > 1 << 20) throw std::out_of_range("range");
    return static_cast<int>(v);
  } catch (const std::exception&) {
    throw Error("environment: " + name + " = '" + text + "' is not a non-negative integer (at most 2^20)");
  }
}

// A file-name-safe form of a launcher's job id: anything else becomes '_', and a long id is
// cut (the id's head and tail both kept: job ids often differ only at the end).
std::string file_safe(const std::string& text) {
  std::string out;
  for (char c : text) {
    const bool safe = (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '.' ||
                      c == '_' || c == '-';
    out += safe ? c : '_';
  }
  constexpr std::size_t kMax = 96;
  if (out.size() > kMax) out = out.substr(0, kMax / 2) + out.substr(out.size() - kMax / 2);
  return out;
}

}  // namespace

GroupEnvironment GroupEnvironment::from_environment(
    const std::function<std::optional<std::string>(const char*)>& getenv_fn) {
  auto get = [&](const char* name) -> std::optional<std::string> {
    if (getenv_fn) return getenv_fn(name);
    const char* v = std::getenv(name);
    return v ? std::optional<std::string>(v) : std::nullopt;
  };
  // The directory and job-id variables: an empty one counts as unset (`MOK_RUN_ID=$SLURM_JOB_ID`
  // outside Slurm must neither hide torchrun's id nor give every job the same empty key).
  auto get_set = [&](const char* name) -> std::optional<std::string> {
    auto v = get(name);
    return v && !v->empty() ? v : std::nullopt;
  };
  struct Scheme {
    const char *source, *rank, *size, *local;
  };
  const Scheme schemes[] = {{"mok launch", "MOK_RANK", "MOK_WORLD_SIZE", "MOK_LOCAL_RANK"},
                            {"torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK"},
                            {"Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"}};
  // Another scheme's rank and size, when set, must say the same: a disagreeing pair is a
  // launcher's variables left in the environment (a stray RANK=0 WORLD_SIZE=1 over mpirun's
  // would make every process a group of one), and which of them is this launch is not ours to
  // guess.
  auto check_others_agree = [&](const Scheme& taken, int rank, int world_size) {
    for (const auto& other : schemes) {
      if (&other == &taken) continue;
      const auto r = get(other.rank), n = get(other.size);
      if (!r || !n) continue;
      if (*r == std::to_string(rank) && *n == std::to_string(world_size)) continue;  // (the same digits)
      throw Error(std::string("environment: ") + taken.rank + " = " + std::to_string(rank) + ", " + taken.size +
                  " = " + std::to_string(world_size) + " (" + taken.source + ") but " + other.rank + " = " + *r +
                  ", " + other.size + " = " + *n + " (" + other.source +
                  "): two launchers' variables disagree; unset the ones left from another launch");
    }
  };
  for (const auto& s : schemes) {
    const auto rank = get(s.rank), size = get(s.size);
    if (!rank && !size) continue;
    if (!rank || !size)
      throw Error(std::string("environment: ") + (rank ? s.size : s.rank) + " is missing while " +
                  (rank ? s.rank : s.size) + " is set (" + s.source + ")");
    GroupEnvironment env;
    env.source = s.source;
    env.rank = parse_int(s.rank, *rank);
    env.world_size = parse_int(s.size, *size);
    if (env.world_size < 1) throw Error(std::string("environment: ") + s.size + " must be >= 1");
    if (env.rank >= env.world_size)
      throw Error(std::string("environment: ") + s.rank + " = " + *rank + " must be below " + s.size + " = " + *size);
    check_others_agree(s, env.rank, env.world_size);
    const auto local = get(s.local);
    env.local_rank = local ? parse_int(s.local, *local) : env.rank;
    if (env.local_rank >= env.world_size)
      throw Error(std::string("environment: ") + s.local + " = " + *local + " must be below " + s.size + " = " +
                  *size + " (a node's ranks are some of the group's)");
    if (auto dir = get_set("MOK_LAUNCH_DIR")) env.rendezvous_dir = *dir;
    else if (auto dir2 = get_set("MOK_RENDEZVOUS_DIR")) env.rendezvous_dir = *dir2;
    std::string job;
    if (auto id = get_set("MOK_RUN_ID")) {
      job = *id;
    } else {
      auto add = [&](const std::optional<std::string>& part, const char* prefix) {
        if (!part || part->empty() || *part == "none") return;
        if (!job.empty()) job += '.';
        job += prefix;
        job += *part;
      };
      add(get_set("TORCHELASTIC_RUN_ID"), "");
      // torchrun without --rdzv-id has no run id ("none"): its store's address tells two jobs
      // running at once apart (one after another may share it; the id is removed by then).
      if (job.empty() && get_set("TORCHELASTIC_RUN_ID")) {
        const auto addr = get_set("MASTER_ADDR"), port = get_set("MASTER_PORT");
        if (addr && port) job = *addr + "_" + *port;
      }
      add(get_set("TORCHELASTIC_RESTART_COUNT"), "restart");
      if (job.empty()) add(get_set("OMPI_MCA_ess_base_jobid"), "");
      if (job.empty()) add(get_set("PMIX_NAMESPACE"), "");
    }
    env.job_key = file_safe(job);
    if (env.world_size > 1 && env.rendezvous_dir.empty())
      throw Error("environment: no rendezvous directory for the NCCL unique id: start the ranks with "
                  "`mok launch`, or set MOK_RENDEZVOUS_DIR to a directory every rank can read (" +
                  env.source + ")");
    return env;
  }
  throw Error("environment: this process is not part of an EP group: start it with `mok launch -n N -- ...`, "
              "torchrun or mpirun (none of MOK_RANK, RANK, OMPI_COMM_WORLD_RANK is set)");
}

int GroupEnvironment::cuda_device(int visible_devices) const {
  if (visible_devices < 1)
    throw Error("EP group: rank " + std::to_string(rank) + " (" + source + ") sees no CUDA device");
  if (local_rank < visible_devices) return local_rank;
  if (visible_devices == 1) return 0;  // the launcher's one GPU for this process
  throw Error("EP group: local rank " + std::to_string(local_rank) + " (" + source + ") has no GPU: this process sees " +
              std::to_string(visible_devices) +
              " (a process sees either its node's GPUs, one per local rank, or exactly one: its own)");
}

std::string GroupEnvironment::shared_gpu_hint(int visible_devices) const {
  if (world_size <= 1 || visible_devices < 1) return "";
  const int device = cuda_device(visible_devices);
  std::string hint = "; NCCL also refuses two ranks on one GPU: rank " + std::to_string(rank) + " (local rank " +
                     std::to_string(local_rank) + ") took CUDA device " + std::to_string(device) + " of the " +
                     std::to_string(visible_devices) + " this process sees";
  if (visible_devices == 1)
    hint += " (one GPU visible is taken as the process's own: where every rank sees the same one, as `mok launch "
            "-n N` on a machine with fewer than N GPUs, give each rank its own GPU)";
  return hint;
}

}  // namespace mok::comm
