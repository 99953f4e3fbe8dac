// mok: where a process sits in a real EP group (one process per GPU), read from the
// environment of the launcher that started it:
//   mok launch:  MOK_RANK, MOK_WORLD_SIZE, MOK_LOCAL_RANK, MOK_LAUNCH_DIR
//   torchrun:    RANK, WORLD_SIZE, LOCAL_RANK (+ MOK_LAUNCH_DIR or MOK_RENDEZVOUS_DIR, shared)
//   Open MPI:    OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_RANK
// The rendezvous directory is where rank 0 leaves the NCCL unique id for the others; the job
// key names that file after the launcher's job, so that jobs sharing a directory read each
// its own id whenever the launcher tells them apart (comm/rendezvous.h):
//   MOK_RUN_ID if set (an empty variable here counts as unset); else torchrun's TORCHELASTIC_RUN_ID (or, for its default "none",
//   MASTER_ADDR and MASTER_PORT) and TORCHELASTIC_RESTART_COUNT; else Open MPI's
//   OMPI_MCA_ess_base_jobid or PMIX_NAMESPACE. Plain RANK/WORLD_SIZE give none: such jobs
//   need a directory each, or MOK_RUN_ID. `mok launch` needs none: its directory is private.
#pragma once
#include <functional>
#include <optional>
#include <string>

namespace mok::comm {

struct GroupEnvironment {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  std::string rendezvous_dir;
  std::string job_key;  // [A-Za-z0-9._-] only, at most 96 characters; empty when none is known
  std::string source;  // which launcher's variables were used

  // Throws mok::Error naming the variable that is missing or malformed. `getenv` is
  // injectable for tests.
  static GroupEnvironment from_environment(
      const std::function<std::optional<std::string>(const char*)>& getenv = {});

  // The CUDA device this rank runs on, among the `visible_devices` its process sees: its
  // local rank where the process sees its node's GPUs (mok launch, torchrun), device 0 where
  // the launcher gave each process its one GPU (CUDA_VISIBLE_DEVICES per process, as SLURM's
  // --gpus-per-task and many MPI setups do). Throws mok::Error naming the local rank and
  // the count otherwise (several GPUs visible, but not this rank's).
  int cuda_device(int visible_devices) const;

  // What to say when the group's NCCL start fails in a way two ranks on one GPU would cause
  // (NCCL refuses them; its own message shows only with NCCL_DEBUG=WARN): the device this rank
  // took (cuda_device's rule) and why another rank may have taken the same one. Empty for a
  // group of one.
  std::string shared_gpu_hint(int visible_devices) const;
};

}  // namespace mok::comm
