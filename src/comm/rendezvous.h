// mok: how the NCCL unique id travels from rank 0 to the other ranks of a group, through a
// directory every rank can read (GroupEnvironment::rendezvous_dir).
//
// What must stay true:
//  - a reader never sees half an id (rank 0 writes a temporary file, then renames it);
//  - a reader does not take an id another job left behind: the file is named after the
//    launcher's job where the launcher says which (GroupEnvironment::job_key), and rank 0
//    removes it as soon as the group has formed (every rank has read it by then) or its
//    start failed, so a reused directory holds no old id (only a rank 0 killed between
//    publishing and the group forming leaves one; see the marks below);
//  - every wait is bounded and its error names the file it waited for;
//  - NCCL starts only once every rank has arrived (each leaves a mark beside the id and
//    waits for all the others'), because NCCL's own start-up waits for a missing rank
//    without a limit;
//  - a mark holds the id its rank will start NCCL with, and only marks holding this rank's
//    id count: a mark an earlier job left under the same key (a reused MOK_RUN_ID after a
//    killed rank 0, say) holds that job's id and lets no rank through early. A rank other
//    than 0 that read such an earlier job's id file before rank 0 replaced it sees the file
//    change while it waits, takes the new id and marks again, so the group still forms.
//    What files cannot tell apart: a rank that starts before its rank 0 publishes, and
//    finds an earlier job's id with a whole set of that job's marks (all of it arrived, then
//    its rank 0 was killed before the group formed), passes with that id; NCCL's start then
//    fails reaching the dead rank 0, and the error names the id file.
// Host-only (no CUDA, no NCCL): the id is opaque bytes here, and this is tested on the CPU.
#pragma once
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>

#include "comm/group_env.h"

namespace mok::comm {

class IdRendezvous {
 public:
  explicit IdRendezvous(const GroupEnvironment& env);

  // The file the id goes through: <rendezvous_dir>/nccl_unique_id[.<job key>].
  const std::filesystem::path& file() const { return file_; }

  // Rank 0: leaves the id for the others (whole or not at all), after removing any marks an
  // earlier job left under the same key. Throws mok::Error when the directory cannot be
  // written.
  void publish(const void* id, std::size_t bytes) const;

  // Another rank: waits up to `timeout_ms` for rank 0's id and copies it out; throws
  // mok::PeerWaitError naming the file and the rank on a timeout.
  void receive(void* id, std::size_t bytes, std::uint64_t timeout_ms) const;

  // Every rank, once it holds the id (`id`, `bytes`): leaves its mark (file() +
  // ".here.<rank>", holding the id) and waits up to `timeout_ms` for every rank's mark with
  // the same id. A rank other than 0 whose id was an earlier job's (the id file changed
  // since it read it) takes the file's id into `id` and marks again. Throws
  // mok::PeerWaitError naming the ranks that did not arrive (and takes its own mark back, so
  // a later job is not told it is here).
  // Giving up, it takes its mark back first and then looks once more: a rank that saw every
  // mark and went on into NCCL's unbounded start saw this one's, so it saw the others' before
  // the removal, and they are still there unless their ranks gave up at the same moment. When
  // that last look finds every other rank, this one marks again and goes on instead of
  // leaving those that went on waiting in NCCL for good. (It closes the window between the
  // poll's last look and its deadline; ranks giving up at the same instant remain.)
  void arrive_and_wait_for_all(void* id, std::size_t bytes, std::uint64_t timeout_ms) const;
  // Tests only: runs between taking the mark back and the last look (a peer arriving then).
  void set_before_last_look(std::function<void()> hook) { before_last_look_ = std::move(hook); }
  std::filesystem::path mark(int rank) const;

  // Rank 0, once every rank holds the id and has arrived (the group formed): removes the id
  // and every mark, so that the next job in the same directory reads none of them. Quiet
  // when they are already gone.
  void retire() const;

 private:
  std::filesystem::path file_;
  int rank_ = 0;
  int world_size_ = 1;
  std::function<void()> before_last_look_;
};

}  // namespace mok::comm
