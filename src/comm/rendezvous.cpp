#include "comm/rendezvous.h"

#include <chrono>
#include <fstream>
#include <functional>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include <unistd.h>

#include "mok/error.h"

namespace mok::comm {
namespace {

// Polls `ready` every 20 ms for up to `timeout_ms`; false when the time ran out first.
bool poll_until(std::uint64_t timeout_ms, const std::function<bool()>& ready) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  for (;;) {
    if (ready()) return true;
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

}  // namespace

IdRendezvous::IdRendezvous(const GroupEnvironment& env) : rank_(env.rank), world_size_(env.world_size) {
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
  const bool received = poll_until(timeout_ms, [&] {
    std::ifstream in(file_, std::ios::binary);
    return in && in.read(static_cast<char*>(id), static_cast<std::streamsize>(bytes));
  });
  if (!received)
    throw PeerWaitError("EP group: rank " + std::to_string(rank_) + " waited " + std::to_string(timeout_ms) +
                        " ms for rank 0's NCCL id in " + file_.string() + "; is rank 0 alive, and do both read the "
                        "same directory and job?");
}

std::filesystem::path IdRendezvous::mark(int rank) const { return file_.string() + ".here." + std::to_string(rank); }

void IdRendezvous::arrive_and_wait_for_all(std::uint64_t timeout_ms) const {
  {
    std::ofstream here(mark(rank_), std::ios::trunc);
    if (!here)
      throw Error("EP group: rank " + std::to_string(rank_) + " cannot leave its mark " + mark(rank_).string() +
                  " (may this process write there?)");
  }
  std::vector<int> missing;
  const bool all_here = poll_until(timeout_ms, [&] {
    missing.clear();
    for (int r = 0; r < world_size_; ++r) {
      std::error_code ec;
      if (!std::filesystem::exists(mark(r), ec)) missing.push_back(r);
    }
    return missing.empty();
  });
  if (all_here) return;
  std::error_code ignored;
  std::filesystem::remove(mark(rank_), ignored);
  std::string names;
  for (std::size_t i = 0; i < missing.size() && i < 8; ++i) names += (i ? ", " : "") + std::to_string(missing[i]);
  if (missing.size() > 8) names += " and " + std::to_string(missing.size() - 8) + " more";
  throw PeerWaitError("EP group: rank " + std::to_string(rank_) + " waited " + std::to_string(timeout_ms) +
                      " ms for the other ranks to arrive; not arrived: rank" + (missing.size() > 1 ? "s " : " ") +
                      names + " (their marks " + file_.string() + ".here.<rank>; did they start, with the same "
                      "directory and job?)");
}

void IdRendezvous::retire() const {
  // Best effort: a leftover is named by job, see the header.
  std::error_code ec;
  std::filesystem::remove(file_, ec);
  for (int r = 0; r < world_size_; ++r) std::filesystem::remove(mark(r), ec);
}

}  // namespace mok::comm
