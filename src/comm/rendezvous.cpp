#include "comm/rendezvous.h"

#include <chrono>
#include <fstream>
#include <string>
#include <system_error>
#include <thread>

#include <unistd.h>

#include "mok/error.h"

namespace mok::comm {

IdRendezvous::IdRendezvous(const GroupEnvironment& env) : rank_(env.rank) {
  file_ = std::filesystem::path(env.rendezvous_dir) /
          (env.job_key.empty() ? std::string("nccl_unique_id") : "nccl_unique_id." + env.job_key);
}

void IdRendezvous::publish(const void* id, std::size_t bytes) const {
  // This process's own temporary name: two rank 0s sharing a directory and a key (a
  // misconfiguration) still never rename a file the other is writing.
  const std::filesystem::path tmp = file_.string() + "." + std::to_string(getpid()) + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out.write(static_cast<const char*>(id), static_cast<std::streamsize>(bytes));
    out.close();
    if (!out)
      throw Error("EP group: rank 0 cannot write its NCCL id to " + tmp.string() +
                  " (does the directory exist, and may this process write there?)");
  }
  std::error_code ec;
  std::filesystem::rename(tmp, file_, ec);
  if (ec) {
    std::error_code ignored;
    std::filesystem::remove(tmp, ignored);
    throw Error("EP group: rank 0 cannot rename " + tmp.string() + " to " + file_.string() + ": " + ec.message());
  }
}

void IdRendezvous::receive(void* id, std::size_t bytes, std::uint64_t timeout_ms) const {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  for (;;) {
    std::ifstream in(file_, std::ios::binary);
    if (in && in.read(static_cast<char*>(id), static_cast<std::streamsize>(bytes))) return;
    if (std::chrono::steady_clock::now() > deadline)
      throw PeerWaitError("EP group: rank " + std::to_string(rank_) + " waited " + std::to_string(timeout_ms) +
                  " ms for rank 0's NCCL id in " + file_.string() + "; is rank 0 alive, and do both read the same "
                  "directory and job?");
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

void IdRendezvous::retire() const {
  std::error_code ec;
  std::filesystem::remove(file_, ec);  // best effort: a leftover is named by job, see the header
}

}  // namespace mok::comm
