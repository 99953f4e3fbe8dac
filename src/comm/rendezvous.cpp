#include "comm/rendezvous.h"

#include <chrono>
#include <cstring>
#include <fstream>
#include <functional>
#include <optional>
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

// Writes `bytes` to `path` whole or not at all (a temporary file, then a rename); false when
// the directory cannot be written (nothing is left behind then). The temporary's name is
// this process's own: two ranks sharing a directory and a key (a misconfiguration) still
// never rename a file the other is writing.
bool write_whole(const std::filesystem::path& path, const void* data, std::size_t bytes, std::string* why) {
  const std::filesystem::path tmp = path.string() + "." + std::to_string(getpid()) + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out.write(static_cast<const char*>(data), static_cast<std::streamsize>(bytes));
    out.close();
    if (!out) {
      std::error_code ignored;
      std::filesystem::remove(tmp, ignored);
      *why = "cannot write " + tmp.string();
      return false;
    }
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) {
    std::error_code ignored;
    std::filesystem::remove(tmp, ignored);
    *why = "cannot rename " + tmp.string() + " to " + path.string() + ": " + ec.message();
    return false;
  }
  return true;
}

// What `path` holds when it is exactly `bytes` long (nothing when it is missing, short or
// longer).
std::optional<std::vector<char>> read_exact(const std::filesystem::path& path, std::size_t bytes) {
  std::ifstream in(path, std::ios::binary);
  std::vector<char> got(bytes);
  if (!in.read(got.data(), static_cast<std::streamsize>(bytes))) return std::nullopt;
  if (in.get() != std::ifstream::traits_type::eof()) return std::nullopt;
  return got;
}

bool same(const std::optional<std::vector<char>>& got, const void* data, std::size_t bytes) {
  return got && std::memcmp(got->data(), data, bytes) == 0;
}

// Whether `path` holds exactly `bytes` bytes equal to `data`.
bool holds(const std::filesystem::path& path, const void* data, std::size_t bytes) {
  return same(read_exact(path, bytes), data, bytes);
}

}  // namespace

IdRendezvous::IdRendezvous(const GroupEnvironment& env) : rank_(env.rank), world_size_(env.world_size) {
  file_ = std::filesystem::path(env.rendezvous_dir) /
          (env.job_key.empty() ? std::string("nccl_unique_id") : "nccl_unique_id." + env.job_key);
}

void IdRendezvous::publish(const void* id, std::size_t bytes) const {
  // An earlier job's marks under this key hold its id: they would not count, but a rank of
  // this job that read that job's id (before this one replaces it) must not find them whole.
  std::error_code ignored;
  for (int r = 0; r < world_size_; ++r) std::filesystem::remove(mark(r), ignored);
  std::string why;
  if (!write_whole(file_, id, bytes, &why))
    throw Error("EP group: rank 0 cannot leave its NCCL id in " + file_.string() + ": " + why +
                " (does the directory exist, and may this process write there?)");
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

void IdRendezvous::arrive_and_wait_for_all(void* id, std::size_t bytes, std::uint64_t timeout_ms) const {
  auto leave_mark = [&] {
    std::string why;
    if (!write_whole(mark(rank_), id, bytes, &why))
      throw Error("EP group: rank " + std::to_string(rank_) + " cannot leave its mark " + mark(rank_).string() + ": " +
                  why + " (may this process write there?)");
  };
  leave_mark();
  std::vector<int> missing;
  const bool all_here = poll_until(timeout_ms, [&] {
    const auto in_file = read_exact(file_, bytes);
    if (rank_ != 0 && in_file && !same(in_file, id, bytes)) {
      // Rank 0 publishes once per job: an id file that now differs from ours means ours was
      // an earlier job's (read before rank 0 replaced it). Take the new one and mark again.
      std::memcpy(id, in_file->data(), bytes);  // (the mark follows just below)
      std::error_code ignored;
      std::filesystem::remove(mark(rank_), ignored);
    }
    // Rank 0's publish clears old marks: one of ours it removed is left again, but only while
    // the id file holds our id (once rank 0 has given up and removed it, a mark left now
    // would outlive this rank if it were killed). A failure to write it is not this wait's
    // error: the wait goes on and, at worst, times out naming the missing ranks.
    if (!holds(mark(rank_), id, bytes) && same(in_file, id, bytes)) {
      std::string ignored;
      write_whole(mark(rank_), id, bytes, &ignored);
    }
    missing.clear();
    for (int r = 0; r < world_size_; ++r)
      if (!holds(mark(r), id, bytes)) missing.push_back(r);
    return missing.empty();
  });
  if (all_here) return;
  std::error_code ignored;
  std::filesystem::remove(mark(rank_), ignored);
  // The last look (see the header): every other rank here, with rank 0's id still published
  // (it removes the id when it gives up), means someone may have gone on: so does this rank.
  if (before_last_look_) before_last_look_();
  missing.clear();
  for (int r = 0; r < world_size_; ++r)
    if (r != rank_ && !holds(mark(r), id, bytes)) missing.push_back(r);
  const bool id_removed = !holds(file_, id, bytes);
  if (missing.empty() && !id_removed) {
    leave_mark();
    return;
  }
  const std::string start = "EP group: rank " + std::to_string(rank_) + " waited " + std::to_string(timeout_ms) +
                            " ms for the other ranks to arrive; ";
  if (missing.empty())
    throw PeerWaitError(start + "its id " + file_.string() + " was removed meanwhile (rank 0 gave up on the group?)");
  std::string names;
  for (std::size_t i = 0; i < missing.size() && i < 8; ++i) names += (i ? ", " : "") + std::to_string(missing[i]);
  if (missing.size() > 8) names += " and " + std::to_string(missing.size() - 8) + " more";
  throw PeerWaitError(start + "not arrived: rank" + (missing.size() > 1 ? "s " : " ") + names + " (their marks " +
                      file_.string() + ".here.<rank>, each holding the id; did they start, with the same directory "
                      "and job?)" + (id_removed ? "; meanwhile rank 0 removed the id (it gave up on the group?)" : ""));
}

void IdRendezvous::retire() const {
  // Best effort: a leftover is named by job, see the header.
  std::error_code ec;
  std::filesystem::remove(file_, ec);
  for (int r = 0; r < world_size_; ++r) std::filesystem::remove(mark(r), ec);
}

}  // namespace mok::comm
