#include "comm/ep_group.h"

#include <cuda_runtime.h>
#include <dlfcn.h>
#include <nccl.h>
#include <nccl_device/core.h>
#include <nccl_device/impl/comm__types.h>

#include <algorithm>
#include <chrono>
#include <exception>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "comm/rendezvous.h"
#include "mok/error.h"

namespace mok::comm {
namespace {

std::string nccl_version_text(int code) {
  // NCCL_VERSION(X, Y, Z) = X * 10000 + Y * 100 + Z since 2.9, X * 1000 + Y * 100 + Z before.
  const int major = code >= 10000 ? code / 10000 : code / 1000;
  const int minor = code >= 10000 ? code / 100 % 100 : code / 100 % 10;
  return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(code % 100);
}

struct OpenedNccl {
  void* handle = nullptr;
  NcclLibraryChoice choice;
};

// The first candidate that loads and whose NCCL release has the device API mok was compiled
// against: the same major.minor as the headers, patch at least theirs (the window and
// device-communicator layouts that mok's kernels read change between releases, and an older
// library refuses or misreads them: 2.28.3 answers ncclDevCommCreate with "invalid usage").
OpenedNccl open_nccl_library() {
  std::vector<std::string> candidates;
  const char* chosen = std::getenv("MOK_NCCL_LIBRARY");
  const bool chosen_by_user = chosen != nullptr && *chosen != '\0';
  if (chosen_by_user) {
    candidates.push_back(chosen);
  } else {
    candidates.push_back("libnccl.so.2");  // the dynamic loader's search: LD_LIBRARY_PATH, ld.so.cache
#ifdef MOK_BUILD_NCCL_LIBRARY
    candidates.push_back(MOK_BUILD_NCCL_LIBRARY);  // the CUDA toolkit's, whose headers mok was built with
#endif
  }
  std::string tried;
  for (const auto& path : candidates) {
    // Local while probing: a library passed over must not lend its symbols to the one taken.
    void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      tried += "\n  " + path + ": cannot load (" + dlerror() + ")";
      continue;
    }
    auto pass_over = [&](const std::string& why) {
      tried += "\n  " + path + ": " + why;
      dlclose(lib);
    };
    auto get_version = reinterpret_cast<decltype(&::ncclGetVersion)>(dlsym(lib, "ncclGetVersion"));
    int version = 0;
    if (get_version == nullptr) {
      pass_over("not an NCCL library (no ncclGetVersion)");
      continue;
    }
    if (const ncclResult_t r = get_version(&version); r != ncclSuccess) {
      pass_over("ncclGetVersion failed (error " + std::to_string(int(r)) + ")");
      continue;
    }
    if (!nccl_release_accepted(version)) {
      pass_over("NCCL " + nccl_version_text(version));
      continue;
    }
    Dl_info info{};
    std::string where = path;
    if (dladdr(reinterpret_cast<void*>(get_version), &info) != 0 && info.dli_fname) where = info.dli_fname;
    // It stays local: mok reaches every entry point through this handle, and a global copy
    // could stand in for another NCCL the process already holds (PyTorch's, say).
    return OpenedNccl{lib, NcclLibraryChoice{where, version}};
  }
  const std::string release = nccl_version_text(NCCL_VERSION_CODE);
  throw Error("ep_mode = distributed needs NCCL " + release + " or a later " + release.substr(0, release.rfind('.')) +
              ".x (the headers mok was built with: the device API's layouts change between releases). Tried:" + tried +
              (chosen_by_user ? "\nPoint MOK_NCCL_LIBRARY at" : "\nSet MOK_NCCL_LIBRARY to") +
              " such a libnccl.so.2 (PyTorch's is site-packages/nvidia/nccl/lib/libnccl.so.2)" +
              (chosen_by_user ? "" : ", or put its directory first in LD_LIBRARY_PATH"));
}

// The NCCL entry points mok uses, resolved from the shared library at run time.
struct NcclApi {
  void* lib = nullptr;
  decltype(&::ncclGetUniqueId) GetUniqueId = nullptr;
  decltype(&::ncclCommInitRank) CommInitRank = nullptr;
  decltype(&::ncclCommDestroy) CommDestroy = nullptr;
  decltype(&::ncclCommAbort) CommAbort = nullptr;
  decltype(&::ncclCommGetAsyncError) CommGetAsyncError = nullptr;
  decltype(&::ncclGetErrorString) GetErrorString = nullptr;
  decltype(&::ncclAllGather) AllGather = nullptr;
  decltype(&::ncclMemAlloc) MemAlloc = nullptr;
  decltype(&::ncclMemFree) MemFree = nullptr;
  decltype(&::ncclCommWindowRegister) CommWindowRegister = nullptr;
  decltype(&::ncclCommWindowDeregister) CommWindowDeregister = nullptr;
  decltype(&::ncclDevCommCreate) DevCommCreate = nullptr;
  decltype(&::ncclDevCommDestroy) DevCommDestroy = nullptr;

  static const NcclApi& get() {
    static NcclApi api = load();
    return api;
  }

 private:
  static NcclApi load() {
    NcclApi a;
    a.lib = open_nccl_library().handle;
    auto sym = [&](auto& fn, const char* s) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(a.lib, s));
      if (!fn) throw Error(std::string("NCCL library lacks ") + s + " (mok needs NCCL >= 2.28 for symmetric windows)");
    };
    sym(a.GetUniqueId, "ncclGetUniqueId");
    sym(a.CommInitRank, "ncclCommInitRank");
    sym(a.CommDestroy, "ncclCommDestroy");
    sym(a.CommAbort, "ncclCommAbort");
    sym(a.CommGetAsyncError, "ncclCommGetAsyncError");
    sym(a.GetErrorString, "ncclGetErrorString");
    sym(a.AllGather, "ncclAllGather");
    sym(a.MemAlloc, "ncclMemAlloc");
    sym(a.MemFree, "ncclMemFree");
    sym(a.CommWindowRegister, "ncclCommWindowRegister");
    sym(a.CommWindowDeregister, "ncclCommWindowDeregister");
    sym(a.DevCommCreate, "ncclDevCommCreate");
    sym(a.DevCommDestroy, "ncclDevCommDestroy");
    return a;
  }
};

void check_nccl(ncclResult_t r, const char* what) {
  if (r != ncclSuccess && r != ncclInProgress)
    throw Error(std::string("NCCL ") + what + " failed: " + NcclApi::get().GetErrorString(r));
}

void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw Error(std::string("CUDA ") + what + ": " + cudaGetErrorString(e));
}

}  // namespace

bool nccl_release_accepted(int version) {
  return version / 100 == NCCL_VERSION_CODE / 100 && version >= NCCL_VERSION_CODE;
}

int nccl_headers_version() { return NCCL_VERSION_CODE; }

NcclLibraryChoice nccl_library() {
  const OpenedNccl opened = open_nccl_library();
  dlclose(opened.handle);  // (a group's own handle keeps NCCL loaded: dlopen counts references)
  return opened.choice;
}

struct EpGroup::Impl {
  GroupEnvironment env;
  int device = 0;  // env.cuda_device: the CUDA device this rank runs on
  Limits limits;
  ncclComm_t comm = nullptr;  // null once aborted
  std::function<void()> before_abort;  // (set_before_abort; may be empty)
  // Every symmetric buffer allocated and not yet freed: the group frees what a caller that
  // threw before free_symmetric left (a constructor failing after its first allocation).
  std::vector<SymmetricBuffer> symmetric;

  // The kept entry of `b` (by its memory), or end().
  std::vector<SymmetricBuffer>::iterator find(const SymmetricBuffer& b) {
    return std::find_if(symmetric.begin(), symmetric.end(),
                        [&](const SymmetricBuffer& k) { return k.local == b.local; });
  }

  // Deregisters `b`'s window (while the communicator lives: an abort took the windows with
  // it) and frees its memory.
  void release(const SymmetricBuffer& b) const {
    const NcclApi& nccl = NcclApi::get();
    if (b.window && comm) nccl.CommWindowDeregister(comm, static_cast<ncclWindow_t>(b.window));
    if (b.local) nccl.MemFree(b.local);
  }
};

EpGroup::EpGroup(const GroupEnvironment& env, Limits limits) : impl_(std::make_unique<Impl>()) {
  impl_->env = env;
  impl_->limits = limits;
  // Multicast off in this process whatever started it (KINDS.md: it can take GPUs down).
  setenv("NCCL_NVLS_ENABLE", "0", 1);
  setenv("NVSHMEM_DISABLE_NVLS", "1", 1);
  setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1", 1);
  // Calls that return when their work is done: the rendezvous removes the id only once the
  // communicator exists (comm/rendezvous.h).
  setenv("NCCL_COMM_BLOCKING", "1", 1);
  const NcclApi& nccl = NcclApi::get();
  int devices = 0;
  check_cuda(cudaGetDeviceCount(&devices), "cudaGetDeviceCount");
  impl_->device = env.cuda_device(devices);
  check_cuda(cudaSetDevice(impl_->device), "cudaSetDevice");

  // Rendezvous: rank 0 publishes the unique id; once the communicator exists every rank
  // has read it, and rank 0 removes it (comm/rendezvous.h says why) -- also when anything
  // after the publish fails, so a failed start leaves no id for the next job.
  ncclUniqueId id;
  const IdRendezvous rendezvous(env);
  struct RetireOnExit {
    const IdRendezvous* rendezvous = nullptr;
    ~RetireOnExit() {
      if (rendezvous) rendezvous->retire();
    }
  } retire_on_exit;
  if (env.rank == 0) {
    check_nccl(nccl.GetUniqueId(&id), "ncclGetUniqueId");
    if (env.world_size > 1) {
      rendezvous.publish(id.internal, sizeof(id.internal));
      retire_on_exit.rendezvous = &rendezvous;
    }
  } else {
    rendezvous.receive(id.internal, sizeof(id.internal), limits.start_ms);
  }
  // NCCL's start-up waits for every rank without a limit: it starts only once all are here.
  // (NCCL 2.28.9's non-blocking communicator, which NCCL bounds itself, crashed in its
  // symmetric-memory calls on the H200: DESIGN.md.)
  // (A rank that read an earlier job's id takes rank 0's new one here.)
  if (env.world_size > 1) rendezvous.arrive_and_wait_for_all(id.internal, sizeof(id.internal), limits.start_ms);
  ncclResult_t init = nccl.CommInitRank(&impl_->comm, env.world_size, id, env.rank);
  // From here a throw leaves a communicator that no destructor would reach (this one never
  // finished): abort it on the way out.
  struct AbortUnlessFormed {
    EpGroup* group;
    ~AbortUnlessFormed() {
      if (group) group->abort_communicator();
    }
  } abort_unless_formed{this};
  // (NCCL_COMM_BLOCKING=1 above makes the call blocking; should a library still answer "in
  // progress", the communicator is waited for: the id may be removed only once it exists.)
  const auto init_deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(limits.start_ms);
  while (init == ncclInProgress && impl_->comm != nullptr) {
    if (std::chrono::steady_clock::now() > init_deadline)
      throw PeerWaitError("EP group: rank " + std::to_string(env.rank) + "'s NCCL communicator was not ready after " +
                  std::to_string(limits.start_ms) + " ms");
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    nccl.CommGetAsyncError(impl_->comm, &init);
  }
  if (init != ncclSuccess) {
    std::string hint;
    if (env.world_size > 1 && env.rank != 0)
      hint = " (the id came from " + rendezvous.file().string() +
             "; an earlier job that died before its group formed can leave its id there: remove the file, or give "
             "each job its own directory or MOK_RUN_ID)";
    throw Error(std::string("NCCL ncclCommInitRank failed on rank ") + std::to_string(env.rank) + ": " +
                nccl.GetErrorString(init) + hint + env.shared_gpu_hint(devices));
  }

  // Every peer must be load/store reachable (one NVLink domain): the megakernel pulls and
  // pushes rows with plain loads and stores.
  ncclDevCommRequirements_t reqs;
  std::memset(&reqs, 0, sizeof(reqs));  // no multimem, no barriers, no GIN
  ncclDevComm_t dev;
  // (NCCL answers a group it cannot give symmetric memory, one whose GPUs are not all
  // directly peer-to-peer connected say, with a bare "invalid usage"; its reason goes to
  // NCCL_DEBUG's log only.)
  const ncclResult_t created = nccl.DevCommCreate(impl_->comm, &reqs, &dev);
  if (created != ncclSuccess && created != ncclInProgress)
    throw Error(std::string("NCCL ncclDevCommCreate failed on rank ") + std::to_string(env.rank) + ": " +
                nccl.GetErrorString(created) +
                " (mok's NCCL provider needs symmetric memory: every GPU of the group on one host, directly "
                "peer-to-peer connected (NVLink), with CUDA's cuMem allocations; run with NCCL_DEBUG=WARN for "
                "NCCL's reason)");
  const int lsa_size = dev.lsaSize;
  nccl.DevCommDestroy(impl_->comm, &dev);
  if (lsa_size != env.world_size)
    throw Error("EP group: only " + std::to_string(lsa_size) + " of " + std::to_string(env.world_size) +
                " ranks are reachable by load/store from rank " + std::to_string(env.rank) +
                "; mok's NCCL provider needs one NVLink domain (the network path, GIN, is not built)");
  abort_unless_formed.group = nullptr;
}

EpGroup::~EpGroup() {
  // Destroying a communicator waits for the peers (it is collective in effect); while an
  // error unwinds (this rank failed, the others may not have), it is aborted instead.
  if (std::uncaught_exceptions() > 0) abort_communicator();
  for (const SymmetricBuffer& b : impl_->symmetric) impl_->release(b);
  const NcclApi& nccl = NcclApi::get();
  if (impl_->comm) nccl.CommDestroy(impl_->comm);
}

void EpGroup::abort_communicator() {
  if (impl_->comm == nullptr) return;
  if (impl_->before_abort) impl_->before_abort();
  NcclApi::get().CommAbort(impl_->comm);
  impl_->comm = nullptr;
}

void EpGroup::set_before_abort(std::function<void()> hook) { impl_->before_abort = std::move(hook); }

bool EpGroup::communicator_aborted() const { return impl_->comm == nullptr; }

int EpGroup::rank() const { return impl_->env.rank; }
int EpGroup::size() const { return impl_->env.world_size; }
int EpGroup::device() const { return impl_->device; }

void EpGroup::check_same_everywhere(const std::string& what, const std::string& fingerprint) {
  constexpr std::size_t kBytes = 1024;
  if (fingerprint.size() >= kBytes) throw Error("EP group: fingerprint of " + what + " too long");
  std::vector<char> mine(kBytes, 0), all(kBytes * size(), 0);
  std::memcpy(mine.data(), fingerprint.data(), fingerprint.size());
  struct Scratch {  // (freed on every way out)
    char* p = nullptr;
    ~Scratch() {
      if (p) cudaFree(p);
    }
  } d_mine, d_all;
  check_cuda(cudaMalloc(&d_mine.p, kBytes), "cudaMalloc");
  check_cuda(cudaMalloc(&d_all.p, kBytes * size()), "cudaMalloc");
  check_cuda(cudaMemcpy(d_mine.p, mine.data(), kBytes, cudaMemcpyHostToDevice), "cudaMemcpy");
  all_gather(d_mine.p, d_all.p, kBytes, nullptr);
  wait(nullptr, "checking that every rank has the same " + what, impl_->limits.start_ms);
  check_cuda(cudaMemcpy(all.data(), d_all.p, all.size(), cudaMemcpyDeviceToHost), "cudaMemcpy");
  const std::string first(all.data());
  for (int r = 1; r < size(); ++r) {
    const std::string other(all.data() + r * kBytes);
    if (other != first)
      throw Error("EP group: rank " + std::to_string(r) + "'s " + what + " differs from rank 0's:\n  rank 0: " + first +
                  "\n  rank " + std::to_string(r) + ": " + other + "\nnothing ran");
  }
}

SymmetricBuffer EpGroup::alloc_symmetric(std::size_t bytes) {
  const NcclApi& nccl = NcclApi::get();
  SymmetricBuffer b;
  b.bytes = (bytes + NCCL_WIN_REQUIRED_ALIGNMENT - 1) / NCCL_WIN_REQUIRED_ALIGNMENT * NCCL_WIN_REQUIRED_ALIGNMENT;
  check_nccl(nccl.MemAlloc(&b.local, b.bytes), "ncclMemAlloc");
  impl_->symmetric.push_back(b);
  return b;
}

void EpGroup::register_window(SymmetricBuffer& b) {
  const auto it = impl_->find(b);
  if (it == impl_->symmetric.end() || it->window != nullptr)
    throw Error("EP group: register_window: not a buffer of this group's alloc_symmetric, or registered already");
  ncclWindow_t win = nullptr;
  check_nccl(NcclApi::get().CommWindowRegister(impl_->comm, b.local, b.bytes, &win, NCCL_WIN_COLL_SYMMETRIC),
             "ncclCommWindowRegister");
  b.window = it->window = win;
}

void EpGroup::free_symmetric(SymmetricBuffer& b) {
  const auto it = impl_->find(b);
  if (it != impl_->symmetric.end()) {  // (else freed already, or never allocated here)
    impl_->release(*it);
    impl_->symmetric.erase(it);
  }
  b = SymmetricBuffer{};
}

void EpGroup::forget_symmetric(SymmetricBuffer& b) {
  const auto it = impl_->find(b);
  if (it != impl_->symmetric.end()) impl_->symmetric.erase(it);
  b = SymmetricBuffer{};
}

void EpGroup::all_gather(const void* send, void* recv, std::size_t bytes_per_rank, void* stream) {
  check_nccl(NcclApi::get().AllGather(send, recv, bytes_per_rank, ncclChar, impl_->comm,
                                      static_cast<cudaStream_t>(stream)),
             "ncclAllGather");
}

void EpGroup::meet(void* stream, void* scratch, const std::string& what) {
  // (In place: this rank's byte is already at scratch + rank, where NCCL wants it.) A call
  // NCCL refuses at once (a peer's abort it has already seen, say) names the meeting too,
  // and aborts, as a wait that gives up does.
  try {
    all_gather(static_cast<char*>(scratch) + rank(), scratch, 1, stream);
  } catch (const Error& e) {
    give_up("EP group: rank " + std::to_string(rank()) + " stopped while " + what + ": " + e.what());
  }
  wait(stream, what, impl_->limits.start_ms);
}

void EpGroup::give_up(const std::string& message) {
  // Said before the abort: tearing down a communicator whose peers are gone can itself
  // block, and the launcher's log must hold this rank's reason either way.
  std::fprintf(stderr, "mok: rank %d: %s; aborting its NCCL communicator\n", rank(), message.c_str());
  std::fflush(stderr);
  abort_communicator();
  throw PeerWaitError(message);
}

void EpGroup::wait(void* stream, const std::string& what, std::uint64_t deadline_ms,
                   const std::function<void()>& check) {
  wait_until_done([stream] { return static_cast<int>(cudaStreamQuery(static_cast<cudaStream_t>(stream))); }, what,
                  deadline_ms, check);
}

void EpGroup::wait_for_event(void* event, const std::string& what, std::uint64_t deadline_ms,
                             const std::function<void()>& check) {
  wait_until_done([event] { return static_cast<int>(cudaEventQuery(static_cast<cudaEvent_t>(event))); }, what,
                  deadline_ms, check);
}

void EpGroup::wait_until_done(const std::function<int()>& query, const std::string& what, std::uint64_t deadline_ms,
                              const std::function<void()>& check) {
  const NcclApi& nccl = NcclApi::get();
  const std::uint64_t limit_ms = deadline_ms > 0 ? deadline_ms : impl_->limits.wait_ms;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(limit_ms);
  for (;;) {
    const auto q = static_cast<cudaError_t>(query());
    if (q == cudaSuccess) return;
    if (check) check();
    if (q != cudaErrorNotReady) throw Error("CUDA error while " + what + ": " + cudaGetErrorString(q));
    ncclResult_t async = ncclSuccess;
    nccl.CommGetAsyncError(impl_->comm, &async);
    const bool late = std::chrono::steady_clock::now() > deadline;
    if ((async != ncclSuccess && async != ncclInProgress) || late) {
      const std::string message =
          "EP group: rank " + std::to_string(rank()) + " stopped while " + what + ": " +
          (late ? "not done within " +
                      (limit_ms % 1000 == 0 ? std::to_string(limit_ms / 1000) + " s" : std::to_string(limit_ms) + " ms") +
                      " (a peer rank died or hangs, and `mok launch` names it; or this stream held more work than "
                      "that)"
                : std::string("NCCL error ") + nccl.GetErrorString(async));
      give_up(message);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

}  // namespace mok::comm
