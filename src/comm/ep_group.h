// mok: a real EP group over NCCL, one process per GPU (EpMode::distributed).
//
// NCCL is loaded at run time (nccl_library() below says which): mok and its tests run on
// machines without it, and the error says where to point when it is missing or too old.
// Bootstrap: rank 0 creates the unique id and leaves it in the rendezvous directory; the
// others wait for it; then every rank waits for all the others to arrive, and only then
// starts NCCL, whose own start-up waits for missing ranks without a limit (both waits are
// bounded by Limits::start_ms; comm/rendezvous.h). Rank 0 removes the id and the arrival
// marks once the group formed. Symmetric buffers come from ncclMemAlloc registered as
// windows; peers are reached through load/store (LSA) pointers, so every rank must be in one
// NVLink domain. NVLink multicast stays off: NCCL_NVLS_ENABLE=0 is set before mok's NCCL
// starts, which is in time unless NCCL already ran in this process (PyTorch's, when
// MOK_NCCL_LIBRARY names the same library: NCCL reads the variable once), so launchers other
// than `mok launch` must export it (README).
// No CUDA or NCCL type appears here: handles are opaque.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "comm/group_env.h"

namespace mok::comm {

// The NCCL library a distributed layer uses: MOK_NCCL_LIBRARY when set, else the first of
// the dynamic loader's libnccl.so.2 and the build's CUDA toolkit NCCL whose release matches
// the headers mok was compiled with (same major.minor, patch at least theirs). Throws
// mok::Error listing every candidate and why it was passed over.
struct NcclLibraryChoice {
  std::string path;  // the file loaded
  int version = 0;   // NCCL_VERSION_CODE of that library
};
NcclLibraryChoice nccl_library();
// The rule above for one NCCL_VERSION_CODE, and the headers' own code.
bool nccl_release_accepted(int version);
int nccl_headers_version();

struct SymmetricBuffer {
  void* local = nullptr;   // this rank's device memory
  void* window = nullptr;  // ncclWindow_t, usable in kernels (ncclGetPeerPointer)
  std::size_t bytes = 0;
};

class EpGroup {
 public:
  struct Limits {
    std::uint64_t wait_ms = 60000;    // a running group's wait for its peers (wait())
    std::uint64_t start_ms = 120000;  // forming the group: the id, and every rank's arrival
  };
  // Sets the CUDA device to env.cuda_device() (the local rank, or device 0 where the process
  // sees one GPU). Throws mok::Error on any failure, naming it, and
  // mok::PeerWaitError when the others did not arrive within limits.start_ms.
  EpGroup(const GroupEnvironment& env, Limits limits);
  ~EpGroup();
  EpGroup(const EpGroup&) = delete;
  EpGroup& operator=(const EpGroup&) = delete;

  int rank() const;
  int size() const;
  int device() const;

  // Every rank passes its own `fingerprint` (e.g. the problem and config); throws mok::Error
  // naming the first rank whose fingerprint differs from rank 0's. Blocking; call before
  // any kernel runs.
  void check_same_everywhere(const std::string& what, const std::string& fingerprint);

  // This rank's memory for a symmetric buffer (local: no window yet). The group keeps track
  // of it until free_symmetric (and frees what a failed caller left).
  SymmetricBuffer alloc_symmetric(std::size_t bytes);
  // Collective: every rank registers its buffer as one window, in the same order. NCCL waits
  // for every rank here without a limit, so call it only after a bounded meeting of all ranks
  // (check_same_everywhere) past every step that can fail on one rank alone.
  void register_window(SymmetricBuffer& buffer);
  void free_symmetric(SymmetricBuffer& buffer);
  // Drops `buffer` from the group's list without freeing it (never freed: kernels that may
  // still use it are queued).
  void forget_symmetric(SymmetricBuffer& buffer);

  // Stream-ordered all-gather (stream = a cudaStream_t): recv[r] = rank r's send. It is also
  // a barrier: it completes on no rank before every rank has called it.
  void all_gather(const void* send, void* recv, std::size_t bytes_per_rank, void* stream);

  // A bounded meeting of every rank on `stream` (drained by the caller): an in-place
  // all-gather of one byte per rank over `scratch` (size() bytes of device memory, allocated
  // beforehand, so that a meeting at teardown needs no allocation), then wait() for it within
  // the start-up limit. It copies nothing to or from the host and uses no other stream, so
  // nothing else on the device can hold it past its limit. Throws as wait() does (the
  // communicator aborted) when a rank does not come; once it returns, every rank has reached
  // it.
  void meet(void* stream, void* scratch, const std::string& what);

  // Waits for `stream` with a deadline (the group's timeout, or `deadline_ms` when > 0),
  // watching NCCL's asynchronous errors; on a timeout or error aborts the communicator and
  // throws mok::Error saying so. `check`, when given, runs while waiting and may throw a
  // better diagnosis (a trapped kernel, say) before the group blames a peer.
  // Throws mok::PeerWaitError (mok/error.h) when it gives up on the peers.
  void wait(void* stream, const std::string& what, std::uint64_t deadline_ms = 0,
            const std::function<void()>& check = {});
  // The same for `event` (a cudaEvent_t): for a wait that may not query its stream (one that
  // is capturing a CUDA graph).
  void wait_for_event(void* event, const std::string& what, std::uint64_t deadline_ms = 0,
                      const std::function<void()>& check = {});

  // Aborts the communicator now (idempotent): NCCL work waiting on peers returns, so the
  // process can free its memory and exit. The group is unusable after it. The abort unmaps
  // the peers' windows: the before-abort hook runs first, every time (wait()'s own abort
  // included), so that kernels still queued can learn to keep off them.
  void abort_communicator();
  void set_before_abort(std::function<void()> hook);
  bool communicator_aborted() const;

 private:
  // wait()'s loop over `query`: cudaStreamQuery's or cudaEventQuery's result (a cudaError_t,
  // as an int: no CUDA types in this header).
  void wait_until_done(const std::function<int()>& query, const std::string& what, std::uint64_t deadline_ms,
                       const std::function<void()>& check);
  // Gives up on the peers: says `message` on stderr, aborts the communicator, throws
  // mok::PeerWaitError(message).
  [[noreturn]] void give_up(const std::string& message);

  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace mok::comm
