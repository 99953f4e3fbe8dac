// mok: the CUDA backend behind mok::Layer (Backend::cuda), Hopper sm_90a.
//
// A forward is six stream-ordered launches (more in a real group) and no host synchronisation:
//   memset(counters) -> [group: stage x, all-gather ids] -> schedule count (+ validation) -> offsets -> scatter + plan
//   -> megakernel (dispatch + every expert FFN + combine push) -> combine epilogue.
// The grid and every buffer are sized from the schedule capacity on the host; the device
// reads the real row counts. Device-side input errors (bad expert ids, capacity) are
// recorded on the device, poison y, and are raised by Layer::synchronize().
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <exception>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <memory>
#include <list>
#include <optional>
#include <sstream>
#include <thread>

#include <nccl.h>
#include <nccl_device/core.h>
#include <nccl_device/impl/core__funcs.h>

#include "comm/ep_group.h"
#include "core/backend.h"
#include "core/numbers.h"
#include "core/tuning_env.h"
#include "core/validate.h"
#include "cuda/combine.cuh"
#include "cuda/common.cuh"
#include "cuda/forward_types.h"
#include "cuda/megakernel.cuh"
#include "cuda/schedule.cuh"
#include "cuda/tensor_map.h"

namespace mok {
namespace cuda {

std::string describe_phase_wait_trap(const PhaseWaitTrap& t) {
  const char* what = "an unknown phase wait";
  switch (t.site) {
    case kPhaseTaskSlotFree: what = "the producer waiting for the consumers to take a task"; break;
    case kPhaseTaskClaimed: what = "a compute role waiting for its next task"; break;
    case kPhaseStageFree: what = "the producer waiting for the consumers to release a stage"; break;
    case kPhaseStageLoaded: what = "the consumers waiting for a stage's TMA loads"; break;
    case kPhaseStagingHandedOver: what = "the store warp waiting for a staged tile"; break;
    case kPhaseStagingRead: what = "the consumers waiting for the store warp to read the staging tile"; break;
    case kPhasePullLoaded: what = "a dispatch pipeline waiting for a pulled row to land"; break;
  }
  std::ostringstream s;
  s << "forward: a wait inside the megakernel timed out after " << t.waited_ns / 1000000 << " ms (" << what
    << "; CTA " << t.block << ", thread " << t.thread
    << "): an arrival inside that CTA never came, and the kernel trapped; the CUDA context is unusable now "
       "(restart the process; the limit is 2 * MOK_WAIT_TIMEOUT_MS + 1 s)";
  return s.str();
}

namespace {

// A 2D bf16 tensor [outer, inner] (row-major) read in boxes of 64 x box_rows, 128B swizzle
// (cuda/tensor_map.h).
CUtensorMap encode_2d(const void* base, std::uint64_t inner, std::uint64_t outer, std::uint32_t box_rows) {
  CUtensorMap map;
  const TensorMapStatus status = encode_bf16_tiles(&map, base, inner, outer, box_rows);
  require(status.ok(), status.describe());
  return map;
}

class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(std::size_t bytes) : bytes_(bytes) {
    if (bytes) MOK_CUDA_CHECK(cudaMalloc(&ptr_, bytes));
  }
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(o.ptr_), bytes_(o.bytes_) { o.ptr_ = nullptr; }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    std::swap(ptr_, o.ptr_);
    std::swap(bytes_, o.bytes_);
    return *this;
  }
  ~DeviceBuffer() {
    if (ptr_) cudaFree(ptr_);
  }
  template <typename T> T* as() const { return static_cast<T*>(ptr_); }
  std::size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  std::size_t bytes_ = 0;
};

// A time limit in milliseconds from the environment: in [1, 3600000], anything else an
// error naming the variable; unset or empty: `default_ms`. (Below 1 ms a wait limit reached
// the device as 0 ns and the group's rendezvous as 0 ms: every wait failed, blamed on the
// kernel.) Returned in nanoseconds.
std::uint64_t limit_ns_from_env(TuningEnv knob, std::uint64_t default_ms) {
  const char* name = tuning_env_name(knob);
  const char* env = std::getenv(name);
  if (env == nullptr || *env == '\0') return default_ms * 1000000ull;
  const double ms = parse_finite(env, name);
  require(ms >= 1 && ms <= 3.6e6, std::string(name) + " = " + env + ": must be in [1, 3600000] ms");
  return static_cast<std::uint64_t>(ms * 1e6);
}

// MOK_WAIT_TIMEOUT_MS: the cross-CTA spin-wait limit, and a group's wait for its peers once
// it runs (default 20 s).
std::uint64_t wait_timeout_ns() { return limit_ns_from_env(TuningEnv::kWaitTimeoutMs, 20000); }

// MOK_GROUP_START_TIMEOUT_MS: how long a rank of a real group waits for the others to start:
// for rank 0's NCCL id, then for every rank's arrival (default 120 s: each process makes its
// data and CUDA context first, and launchers start them seconds apart); and, at the layer's
// destroy, for the others to reach theirs (EpGroup::meet).
std::uint64_t group_start_timeout_ms() { return limit_ns_from_env(TuningEnv::kGroupStartMs, 120000) / 1000000; }

constexpr int kMaxPhaseMarks = 6;  // record_phases: setup, schedule, megakernel, group barrier, epilogue, end

// An on/off A/B switch for the device, not a Config: "0", "off" or "false" turn it off, "1",
// "on" or "true" on; unset or empty: the default. Anything else is an error naming it.
bool switch_from_env(TuningEnv knob, bool default_on) {
  const char* name = tuning_env_name(knob);
  const char* env = std::getenv(name);
  if (env == nullptr || *env == '\0') return default_on;
  const std::string v = env;
  if (v == "0" || v == "off" || v == "false") return false;
  if (v == "1" || v == "on" || v == "true") return true;
  throw Error(std::string(name) + " = '" + v + "': must be 0/off/false or 1/on/true (or unset)");
}

// An on/off switch whose default is a rule of the shape: -1 unset (the rule decides), 0 off, 1 on.
int rule_switch_from_env(TuningEnv knob) {
  const char* env = std::getenv(tuning_env_name(knob));
  if (env == nullptr || *env == '\0') return -1;
  return switch_from_env(knob, false) ? 1 : 0;
}

// MOK_STORE_WARP=0 turns the megakernel's store warp off (the consumers then send their
// tiles' rows themselves, as before it existed).
bool store_warp_from_env() { return switch_from_env(TuningEnv::kStoreWarp, true); }

// MOK_HALF_TILES=0: a routed tile whose rows 64..127 are all padding (an expert's last tile,
// 64 rows or fewer) is computed whole, as before, instead of by its lower warpgroup alone.
bool half_tiles_from_env() { return switch_from_env(TuningEnv::kHalfTiles, true); }

// MOK_COMM_JOIN=0: communication CTAs exit after their last pull instead of running the
// compute role for the tasks still unclaimed (the default; in pair mode a cluster joins as a
// pair), so the SMs dispatch takes early compute the end of the layer.
bool comm_join_from_env() { return switch_from_env(TuningEnv::kCommJoin, true); }

// MOK_GATHER_LOCAL=1: a single rank (EP = 1) has its compute CTAs copy its routed rows from x
// wherever gather mode can run (ForwardParams::gather_local); =0: it pulls them into the ring
// like any other rank; unset (-1): the default rule (kGatherMaxIntermediate).
int gather_local_from_env() { return rule_switch_from_env(TuningEnv::kGatherLocal); }

// Gather mode by default only up to this intermediate size: a routed row's copy costs the
// same whatever I is, its gate/up/down work grows with I, and where the work dwarfs the copy
// the pulls cost little while the gathered loads (16-byte copies by two warps) feed the wgmmas
// a little slower than TMA boxes. Measured on the H100 (forward ms, gather vs pulls in the
// same run, three rounds each, da05eee): Qwen3-30B (I = 768) T = 16384 2.41-2.54 vs
// 2.59-2.62, T = 4096 0.78-0.79 vs 0.87; gpt-oss-20b (I = 2880) 1.62-1.67 vs 1.62-1.67;
// Mixtral (I = 14336) T = 4096 4.70-4.73 vs 4.56-4.61.
constexpr int kGatherMaxIntermediate = 4096;

// Head pulls (dispatch_role says what): MOK_HEAD_PULLS=1 on for every CTA, =0 off (only the
// communication CTAs pull rows, the earlier design); unset: default_head_pulls (plan_order.h),
// one per CTA that has no shared-expert tile to start on (every CTA without shared experts).
// Measured on the H200 (forward ms, none vs every CTA, alternating, b5661bf): Qwen3-30B
// 2.597-2.604 vs 2.584-2.587, gpt-oss-20b 1.702/1.704 vs 1.670/1.672; with shared experts,
// where the compute CTAs start on the shared tiles while the first pulls land and a head on
// every CTA only delays them, Qwen3.5 slice 1.107/1.110 vs 1.112/1.114, DeepSeek-V4-Pro slice
// 3.258/3.264 vs 3.281/3.283.
int head_pulls_from_env() { return rule_switch_from_env(TuningEnv::kHeadPulls); }

// MOK_COOPERATIVE=1 launches the megakernel cooperatively: the driver starts it only when
// every CTA can be resident at once. Off by default: a partial grid is safe and overlaps a
// kernel on another stream (DESIGN.md, "Residency").
bool cooperative_from_env() { return switch_from_env(TuningEnv::kCooperative, false); }

// The limit of the phase waits inside a CTA, in units of 2^20 ns: twice the cross-CTA limit
// and a second more, so that when a cross-CTA wait times out (the producer waiting for rows,
// say) the roles it feeds drain (the error is reported, the context stays usable) before
// their own phase waits could trap. Saturating.
unsigned phase_wait_units(std::uint64_t timeout_ns) {
  const std::uint64_t cap = std::uint64_t(0x7fffffff) << 20;
  const std::uint64_t ns = timeout_ns >= cap / 2 ? cap : 2 * timeout_ns + 1000000000ull;
  return static_cast<unsigned>(std::min(ns, cap) >> 20);
}

// MOK_TEST_FAULT=lose_staging_read: a deliberate lost arrival, for the test that proves a
// stuck phase wait is reported rather than hung. =abandoned_group: the layer starts with its
// abandoned word set, as an aborting group's is, for the test that proves a forward then
// touches no other rank's memory (in any EP mode). =abandon_at_destroy: in a real group, the
// rank abandons it as its layer's destroy starts (after its last collective), for the check
// that its peers' destroys then end within the start-up limit (scripts/device_multi.sh);
// without a group it changes nothing. Anything else set is an error.
int test_fault_from_env() {
  const char* name = tuning_env_name(TuningEnv::kTestFault);
  const char* env = std::getenv(name);
  if (env == nullptr || *env == '\0') return kNoFault;
  if (std::string(env) == "lose_staging_read") return kFaultLoseStagingRead;
  if (std::string(env) == "abandoned_group") return kFaultAbandonedGroup;
  if (std::string(env) == "abandon_at_destroy") return kFaultAbandonAtDestroy;
  throw Error(std::string(name) + " = '" + env +
              "': must be lose_staging_read, abandoned_group or abandon_at_destroy (or unset)");
}

// Distributed mode: where the layer's last eager forwards are, for an abort that must not
// unmap the peers' memory under a running megakernel (CudaBackend::drain_before_abort). Per
// forward, one event after its ids' all-gather (its schedule's count kernel, which reads the
// abandoned word, comes next) and one after its megakernel; NCCL work sits on either side of
// both, so recording them costs no programmatic launch. A ring of kTrackedForwards. A forward
// is tracked from its first mark on: one that fails before its second (a launch in between,
// or that record itself) has megakernel_recorded false, and its megakernel_done still holds
// an older forward's state, which says nothing about this one.
class ForwardMarks {
 public:
  static constexpr int kTrackedForwards = 16;
  struct Pair {
    cudaEvent_t ids_gathered = nullptr, megakernel_done = nullptr;
    bool megakernel_recorded = false;
  };
  ForwardMarks() = default;
  ForwardMarks(const ForwardMarks&) = delete;
  ForwardMarks& operator=(const ForwardMarks&) = delete;
  ~ForwardMarks() {
    for (const Pair& m : ring_) {
      if (m.ids_gathered) cudaEventDestroy(m.ids_gathered);
      if (m.megakernel_done) cudaEventDestroy(m.megakernel_done);
    }
  }
  void create() {
    ring_.resize(kTrackedForwards);
    for (Pair& m : ring_) {
      MOK_CUDA_CHECK(cudaEventCreateWithFlags(&m.ids_gathered, cudaEventDisableTiming));
      MOK_CUDA_CHECK(cudaEventCreateWithFlags(&m.megakernel_done, cudaEventDisableTiming));
    }
  }
  bool created() const { return !ring_.empty(); }
  // The pair the next forward records into (its previous forward's, kTrackedForwards ago,
  // must be done first: the caller waits for its megakernel_done).
  Pair& next() { return ring_[next_ % ring_.size()]; }
  void advance() {
    ++next_;
    live_ = std::min<std::size_t>(live_ + 1, ring_.size());
  }
  // The tracked forwards' pairs, oldest first.
  template <typename Visit>
  void each_oldest_first(Visit&& visit) const {
    for (std::size_t i = next_ - live_; i < next_; ++i)
      if (!visit(ring_[i % ring_.size()])) return;
  }

 private:
  std::vector<Pair> ring_;
  std::size_t next_ = 0, live_ = 0;
};

// Polls `query` (a cudaEventQuery or cudaStreamQuery) until it stops answering "not ready"
// (done, or an error: nothing more to wait for) or `deadline` passes; false on the deadline.
template <typename Query>
bool poll_until_done(Query&& query, std::chrono::steady_clock::time_point deadline) {
  for (;;) {
    if (query() != cudaErrorNotReady) return true;
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

// One T in host-mapped memory, value-initialised: the host and the device both reach it
// while kernels run (a record a trapped kernel leaves, a word the host raises). Unallocated
// (both addresses null) until allocated; freed with its owner unless leaked.
template <typename T>
class HostMapped {
 public:
  HostMapped() = default;
  HostMapped(const HostMapped&) = delete;
  HostMapped& operator=(const HostMapped&) = delete;
  ~HostMapped() {
    if (host_ != nullptr) cudaFreeHost(host_);
  }
  void allocate() {
    MOK_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&host_), sizeof(T), cudaHostAllocMapped));
    *host_ = T{};
    MOK_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&device_), host_, 0));
  }
  // allocate(), or false (and unallocated) where mapped memory is not to be had.
  bool try_allocate() {
    try {
      allocate();
      return true;
    } catch (const Error&) {
      cudaGetLastError();
      if (host_ != nullptr) cudaFreeHost(host_);
      host_ = device_ = nullptr;
      return false;
    }
  }
  T* host() const { return host_; }
  T* device() const { return device_; }
  // Never frees it (kernels that may still use it are queued).
  void leak() { host_ = nullptr; }

 private:
  T* host_ = nullptr;
  T* device_ = nullptr;
};

// A tuning knob's integer: 0 (the library's default) when unset or empty, else parsed and
// required to be in [0, hi]; anything else is an error naming the variable.
int tuning_integer_from_env(TuningEnv knob, int hi) {
  const char* name = tuning_env_name(knob);
  const char* env = std::getenv(name);
  if (env == nullptr || *env == '\0') return 0;
  return static_cast<int>(parse_integer(env, 0, hi, name));
}

// Dispatch loads each pull pipeline keeps ahead of its stores (tuning; 0 = the default).
int pull_ahead_from_env() { return tuning_integer_from_env(TuningEnv::kPullAhead, kMaxPullSlots); }

// MOK_HEAD_PULL_TILES=N (tuning): exactly min(N, grid, ring tiles) head pulls, whatever
// MOK_HEAD_PULLS and the default rule say; 0 or unset: not used.
int head_pull_tiles_from_env() { return tuning_integer_from_env(TuningEnv::kHeadPullTiles, 1 << 20); }

// Groups a band's down tiles come after its gate/up tiles (tuning; 0 = the default from
// choose_band_and_lag). A wrapping ring still needs ring / band > lag: refused otherwise.
int task_lag_from_env() { return tuning_integer_from_env(TuningEnv::kTaskLag, 64); }

// Row tiles a communication CTA pulls at once (tuning; 0 = the default, chosen per shape:
// up to kDefaultPullGroups while each pipeline keeps enough row slots).
constexpr int kDefaultPullGroups = 2;
int pull_groups_from_env() { return tuning_integer_from_env(TuningEnv::kPullGroups, kMaxPullGroups); }

int ceil_div(long long a, long long b) { return static_cast<int>((a + b - 1) / b); }

// One kernel launch through cudaLaunchKernelEx, with the attributes the forward uses:
//  - after_kernel(): a programmatic dependent of the previous kernel in the stream (PDL), so
//    its launch overlaps that kernel's tail; the kernel calls wait_previous_kernel() first.
//    Only where the previous operation in the stream is one of our kernels.
//  - in_pairs(): 2-CTA clusters (the megakernel's pair mode).
//  - cooperative(): the grid starts only once every CTA can be resident (it waits while other
//    kernels hold SMs; a grid that could never be resident at once is a launch error).
class Launch {
 public:
  Launch(dim3 grid, dim3 block, std::size_t smem, cudaStream_t stream) {
    cfg_.gridDim = grid;
    cfg_.blockDim = block;
    cfg_.dynamicSmemBytes = smem;
    cfg_.stream = stream;
  }
  Launch& after_kernel(bool on = true) {
    if (on) {
      cudaLaunchAttribute& a = next_attr();
      a.id = cudaLaunchAttributeProgrammaticStreamSerialization;
      a.val.programmaticStreamSerializationAllowed = 1;
    }
    return *this;
  }
  Launch& in_pairs(bool on = true) {
    if (on) {
      cudaLaunchAttribute& a = next_attr();
      a.id = cudaLaunchAttributeClusterDimension;
      a.val.clusterDim.x = 2;
      a.val.clusterDim.y = a.val.clusterDim.z = 1;
    }
    return *this;
  }
  Launch& cooperative(bool on = true) {
    if (on) {
      cudaLaunchAttribute& a = next_attr();
      a.id = cudaLaunchAttributeCooperative;
      a.val.cooperative = 1;
    }
    return *this;
  }
  // The config as cudaLaunchKernelEx and the occupancy queries take it (valid while *this is).
  const cudaLaunchConfig_t& config() {
    cfg_.attrs = attrs_;
    cfg_.numAttrs = num_attrs_;
    return cfg_;
  }
  template <typename... Params, typename... Args>
  void operator()(const char* name, void (*kernel)(Params...), Args&&... args) {
    const cudaError_t e = cudaLaunchKernelEx(&config(), kernel, std::forward<Args>(args)...);
    if (e != cudaSuccess) {
      cudaGetLastError();  // clear it: a later launch check must not report this one
      throw Error(std::string("CUDA launch of ") + name + " failed: " + cudaGetErrorString(e));
    }
  }

 private:
  cudaLaunchAttribute& next_attr() {
    if (num_attrs_ == std::size(attrs_)) throw Error("Launch: more launch attributes than it has room for");
    return attrs_[num_attrs_++];
  }
  cudaLaunchConfig_t cfg_{};
  cudaLaunchAttribute attrs_[3]{};
  unsigned num_attrs_ = 0;
};

// Distributed mode: every peer's staged x and combine slots, by load/store (LSA) pointer.
__global__ void peer_pointers_kernel(ncclWindow_t x_window, ncclWindow_t combine_window, int ranks, void** out) {
  const int r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= ranks) return;
  out[r] = ncclGetPeerPointer(x_window, 0, r);
  out[ranks + r] = ncclGetPeerPointer(combine_window, 0, r);
}

// This thread in relaxed stream-capture mode while it lives: its event queries and waits are
// then allowed during its own capture and do not invalidate another thread's.
struct RelaxedCaptureMode {
  cudaStreamCaptureMode previous = cudaStreamCaptureModeRelaxed;
  RelaxedCaptureMode() { MOK_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&previous)); }
  ~RelaxedCaptureMode() { cudaThreadExchangeStreamCaptureMode(&previous); }
  RelaxedCaptureMode(const RelaxedCaptureMode&) = delete;
  RelaxedCaptureMode& operator=(const RelaxedCaptureMode&) = delete;
};

// Whether `device`'s primary context is active, i.e. someone used that GPU in this process.
// (cudaSetDevice makes it active: setting a device the caller never used would give that
// GPU a context and its memory.) The driver's call comes through the runtime, as
// tensor_map.h's does: mok does not link the driver library. Unknown counts as active.
inline bool primary_context_active(int device) {
  static const auto get_state = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuDevicePrimaryCtxGetState", &fn, 7000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess)
      fn = nullptr;
    return reinterpret_cast<PFN_cuDevicePrimaryCtxGetState_v7000>(fn);
  }();
  unsigned flags = 0;
  int active = 1;
  // (The runtime's and the driver's device ordinals are the same: both follow CUDA_VISIBLE_DEVICES.)
  if (get_state == nullptr || get_state(static_cast<CUdevice>(device), &flags, &active) != CUDA_SUCCESS) return true;
  return active != 0;
}

// The calling thread's current device, kept: while entered, CUDA calls go to the layer's
// device, and leaving restores the caller's. So a layer on GPU 1 runs from a thread whose
// current device is 0 (CUDA refuses a launch into another device's stream, and the legacy
// stream is the current device's), and creating or calling one does not change the device
// the caller (PyTorch, say) sees -- unless the caller's device was one it never used (no
// active context): that one is not set back, since setting it would create its context (a
// rank of a group whose process never touched GPU 0 must not open one there); the layer's
// device stays current, as it would after the caller's own cudaSetDevice.
class OnDevice {
 public:
  OnDevice() = default;
  explicit OnDevice(int device) { enter(device); }
  ~OnDevice() { leave(); }
  OnDevice(const OnDevice&) = delete;
  OnDevice& operator=(const OnDevice&) = delete;
  // Notes the caller's current device, once (leave() restores it).
  void remember() {
    if (previous_ < 0) MOK_CUDA_CHECK(cudaGetDevice(&previous_));
  }
  void enter(int device) {
    remember();
    int current = 0;
    MOK_CUDA_CHECK(cudaGetDevice(&current));
    if (current != device) MOK_CUDA_CHECK(cudaSetDevice(device));
  }
  void leave() noexcept {
    if (previous_ < 0) return;
    int current = -1;
    if ((cudaGetDevice(&current) != cudaSuccess || current != previous_) && primary_context_active(previous_))
      cudaSetDevice(previous_);
    previous_ = -1;
  }

 private:
  int previous_ = -1;  // the caller's device, once noted
};

// One call's pointers and tensor maps, uploaded once per distinct set of tensors into one
// of a few slots allocated up front (so nothing is allocated while a stream captures),
// and kept unchanged while cached, so a captured CUDA graph that copied them stays valid.
struct ArgSlot {
  void* host = nullptr;  // pinned
  DeviceBuffer device;
  // Recorded on the stream behind the slot's latest upload outside a capture: once it has
  // completed, the pinned host copy may be rewritten (the device copy is rewritten by a copy
  // on the same stream, so it waits for every forward that read it by stream order alone).
  // A slot uploaded in a capture is handed over only once its graphs are gone and their
  // launches done (GraphPins), so the event, which records every eager upload (a new set's,
  // and a set first seen in a capture when an eager call uploads it), is all a hand-over waits
  // for (a slot never used: nothing recorded, and the event counts as complete).
  cudaEvent_t uploaded = nullptr;
  ArgSlot() = default;
  ArgSlot(ArgSlot&& o) noexcept : host(o.host), device(std::move(o.device)), uploaded(o.uploaded) {
    o.host = nullptr;
    o.uploaded = nullptr;
  }
  ~ArgSlot() {
    if (host) cudaFreeHost(host);
    if (uploaded) cudaEventDestroy(uploaded);
  }
};

// How many CUDA graphs that captured a call hold each argument slot: such a graph reads the
// slot (and may re-upload it from the slot's host copy) on every replay, so the slot is not
// given to another tensor set while one lives. Each capture adds one, and a CUDA user object
// retained by the graph being captured takes it back when the last of that graph and its
// executable graphs is gone and their launches are done (also when a capture that failed or
// was abandoned is discarded). Shared with those user objects, which may outlive the layer.
struct GraphPins {
  static constexpr std::size_t kSlots = 8;
  std::array<std::atomic<int>, kSlots> graphs{};
};

// One graph's hold on one slot: the user object's data, freed by its destructor.
struct GraphPin {
  std::shared_ptr<GraphPins> pins;
  std::size_t slot;
  // Called by CUDA on a thread of its own, once nothing can use the slot through the graph:
  // no CUDA call here (the runtime forbids them in a user object's destructor).
  static void CUDART_CB release(void* data) {
    auto* pin = static_cast<GraphPin*>(data);
    pin->pins->graphs[pin->slot].fetch_sub(1, std::memory_order_acq_rel);
    delete pin;
  }
};

struct CallArgs {
  std::vector<const void*> key;
  std::size_t slot = 0;
  // The device copy was written outside a capture. A set first seen in a capture was copied
  // only into that graph, which writes the device copy when it replays. Until an eager call
  // has uploaded it, every call with it copies it first: an eager one on the stream, a later
  // capture into its own graph, so any graph may replay first (the host copy is unchanged,
  // so these copies need no wait).
  bool uploaded_eagerly = false;
  RankMaps* maps = nullptr;  // device views into the slot
  const __nv_bfloat16** x_source = nullptr;
  const int** tops = nullptr;
  const float** weights = nullptr;
  CallRank* calls = nullptr;
};

}  // namespace

class CudaBackend final : public BackendImpl {
 public:
  // The caller's stream must belong to the layer's device: one of another device fails only
  // at the first launch into it ("invalid resource handle"), without naming the stream. The
  // legacy default stream is the current device's, which every call sets. The per-thread
  // default stream is refused: the handle names another stream on each calling thread, while
  // every hand-over here (the counters' reset behind the last megakernel, an argument slot
  // rewritten behind the forwards that read it, synchronize) relies on one stream in order.
  static void check_stream_device(void* handle, int device, const std::string& whose_device) {
    const auto stream = static_cast<cudaStream_t>(handle);
    require(stream != cudaStreamPerThread,
            "LayerOptions.cuda_stream: cudaStreamPerThread is another stream on each calling thread, and a "
            "layer's calls must run in one stream's order: give a stream of your own (cudaStreamCreate) or the "
            "default stream (nullptr)");
    if (stream == nullptr || stream == cudaStreamLegacy) return;
    int stream_device = -1;
    const cudaError_t e = cudaStreamGetDevice(stream, &stream_device);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();  // (not sticky: cleared, so that it is not reported later as another call's)
      throw Error(std::string("LayerOptions.cuda_stream: not a stream CUDA knows (") + cudaGetErrorString(e) +
                  "): it must be a live stream of the layer's device");
    }
    require(stream_device == device, "LayerOptions.cuda_stream: a stream of GPU " + std::to_string(stream_device) +
                                         ", but the layer runs on GPU " + std::to_string(device) + " (" +
                                         whose_device + "): give a stream of that GPU");
  }

  CudaBackend(const Problem& p, const Config& c, const LayerOptions& o) : problem_(p), config_(c), options_(o) {
#ifdef MOK_MEASUREMENT_BUILD
    std::fprintf(stderr, "mok: MEASUREMENT BUILD (%s)\n", MOK_MEASUREMENT_BUILD);
#endif
    on_device_.remember();  // (the group below sets its rank's device)
    validate_rules();
    if (o.ep_mode != EpMode::distributed) check_stream_device(o.cuda_stream, o.cuda_device, "LayerOptions.cuda_device");
    if (o.ep_mode == EpMode::distributed) {
      const auto env = comm::GroupEnvironment::from_environment();
      // (Before the group forms: a rank that fails here is one its peers name as missing.)
      check_stream_device(o.cuda_stream, env.cuda_device(cuda_device_count()),
                          "the device of the launcher's local rank (" + env.source + ")");
      require(env.world_size == p.ep_size, "ep_mode = distributed: the group has " + std::to_string(env.world_size) +
                                               " processes (" + env.source + ") but Problem.ep_size = " +
                                               std::to_string(p.ep_size));
      group_ = std::make_unique<comm::EpGroup>(env, comm::EpGroup::Limits{timeout_ns_ / 1000000, group_start_timeout_ms()});
      options_.cuda_device = group_->device();
      // Mismatched shapes or configs across ranks are caught here, before any kernel runs.
      group_->check_same_everywhere("problem and config", p.describe() + " | " + c.describe());
    }
    on_device_.enter(options_.cuda_device);
    cudaDeviceProp prop;
    MOK_CUDA_CHECK(cudaGetDeviceProperties(&prop, options_.cuda_device));
    require(prop.major == 9 && prop.minor == 0,
            std::string("backend = cuda: this build targets sm_90a (Hopper); device ") + prop.name + " is sm_" +
                std::to_string(prop.major) + std::to_string(prop.minor));
    stream_ = static_cast<cudaStream_t>(o.cuda_stream);
    sms_ = prop.multiProcessorCount;

    const int R = p.ep_size;
    num_ranks_ = o.ep_mode == EpMode::all_ranks ? R : 1;
    first_rank_ = o.ep_mode == EpMode::all_ranks ? 0 : group_ ? group_->rank() : o.active_rank;
    const std::int64_t capacity_rows = schedule_capacity_rows(p, c);
    require(capacity_rows < (1ll << 31), "problem: a schedule capacity of " + std::to_string(capacity_rows) +
                                             " rows; the cuda backend's row indices are 32-bit (fewer than 2^31)");
    capacity_ = static_cast<int>(capacity_rows);
    cap_tiles_ = capacity_ / kTileM;
    ring_tiles_ = std::max(1, std::min(c.macrobatch_rows, capacity_) / kTileM);
    // (The schedule's 32-bit stream positions step up to a chunk and a token past the last id,
    // schedule.cuh's pos.slot + 32 and (end + k - 1) / k, and a rank's padded total, an int in
    // the offsets kernel, can hold every id plus 127 padding rows per local expert. Hence the
    // margin.)
    const long long stream_ids = static_cast<long long>(R) * p.tokens_per_rank * p.top_k;
    const long long padding_rows = static_cast<long long>(p.local_experts()) * (kTileM - 1);
    constexpr long long kMaxStreamIds = (1ll << 31) - 1024;
    require(stream_ids + padding_rows < kMaxStreamIds,
            "problem: ep_size * tokens_per_rank * top_k = " + std::to_string(stream_ids) + " routed ids, plus " +
                std::to_string(padding_rows) + " rows of padding (127 per local expert); the cuda backend's "
                "schedule takes fewer than 2^31 - 1024 in all");
    const int dest_experts = num_ranks_ * p.local_experts();
    require(dest_experts <= kScheduleMaxExperts,
            "problem: " + std::to_string(dest_experts) + " experts computed on this GPU; the cuda backend's schedule "
            "takes at most " + std::to_string(kScheduleMaxExperts) + " (use fewer virtual ranks or a rank slice)");
    // Small chunks when large ones would leave SMs without a count/scatter block.
    chunk_ids_ = ceil_div(ceil_div(stream_ids, kScheduleChunkLarge), kScheduleWarps) < sms_ ? kScheduleChunkSmall
                                                                                             : kScheduleChunkLarge;
    chunks_ = static_cast<int>(ceil_div(stream_ids, chunk_ids_));
    // The schedule's row offsets and (expert, chunk) indices are 32-bit on the device.
    require(stream_ids + static_cast<long long>(dest_experts) * (kTileM - 1) < (1ll << 31) &&
                static_cast<long long>(p.local_experts()) * chunks_ < (1ll << 31),
            "problem: " + std::to_string(stream_ids) + " routed ids over " + std::to_string(dest_experts) +
                " experts is too large for the cuda backend's 32-bit schedule offsets");
    schedule_count_smem_ = static_cast<int>(kScheduleWarps * count_warp_ints(dest_experts, chunk_ids_) * sizeof(int));
    schedule_scatter_smem_ = static_cast<int>(kScheduleWarps * dest_experts * sizeof(int));
    gateup_tiles_ = ceil_div(p.intermediate, kGateUpCols);
    down_tiles_ = ceil_div(p.hidden, kDownCols);
    // A task names its column tile in 12 bits (plan_order.h: Task), and the TMA coordinate
    // of an expert's weight rows (e * I + column) is a signed 32-bit integer.
    const auto width_rule = [&](const std::string& name, int width) {
      require(ceil_div(width, kGateUpCols) <= kMaxColumnTiles,
              name + " = " + std::to_string(width) + ": the cuda backend takes at most " +
                  std::to_string(kMaxColumnTiles * kGateUpCols) + " (its tasks count " +
                  std::to_string(kMaxColumnTiles) + " column tiles of " + std::to_string(kGateUpCols) + ")");
    };
    width_rule("Problem.intermediate", p.intermediate);
    for (int s = 0; s < p.num_shared(); ++s)
      width_rule("Problem.shared_intermediate[" + std::to_string(s) + "]", p.shared_intermediate[s]);
    require(static_cast<long long>(p.local_experts()) * p.intermediate < (1ll << 31),
            "problem: " + std::to_string(p.local_experts()) + " local experts x intermediate " +
                std::to_string(p.intermediate) + " weight rows; the cuda backend's tensor-map coordinates take fewer "
                "than 2^31");
    // The down tiles' column tiles too (256 columns of H each), and w_down's rows (e * H + column).
    // (Where rows are pulled H is far below both; gather mode takes wider rows.)
    require(ceil_div(p.hidden, kDownCols) <= kMaxColumnTiles,
            "Problem.hidden = " + std::to_string(p.hidden) + ": the cuda backend takes at most " +
                std::to_string(kMaxColumnTiles * kDownCols) + " (its tasks count " + std::to_string(kMaxColumnTiles) +
                " column tiles of " + std::to_string(kDownCols) + ")");
    require(static_cast<long long>(p.local_experts()) * p.hidden < (1ll << 31),
            "problem: " + std::to_string(p.local_experts()) + " local experts x hidden " + std::to_string(p.hidden) +
                " weight rows of w_down; the cuda backend's tensor-map coordinates take fewer than 2^31");
    shared_row_tiles_ = ceil_div(p.tokens_per_rank, kTileM);

    // Default split: a pulled row (2H bytes) feeds 6*H*I flops, so the pull rate the compute
    // SMs need is ~(their rate)/(3I) bytes/s. On the H200 a communication SM moved ~30 GB/s
    // (Qwen3-30B, T=16384: 3 SMs 5.5 ms, 6 SMs 3.0 ms, 12 SMs 2.7 ms) and a compute SM does
    // ~4 TFLOP/s, so ~sms * 44 / I pull SMs; rounded up (sms * 55 / I) because too few
    // starve every compute SM while one too many costs 1/sms of the math.
    // Communication CTAs that join the compute once their pulls are done (MOK_COMM_JOIN, the
    // default; in pair mode a cluster joins as a pair) cost little more than their pull time,
    // and more of them start the compute SMs sooner: 16 then (a quarter of the SMs at most).
    // Measured on the H200 (forward ms, separate roles at the rate default vs joined with
    // 12/16/20 CTAs):
    // Qwen3-30B T=16384 2.59 vs 2.56/2.56-2.62/2.57, Qwen3.5 slice 1.132 vs 1.12/1.12/1.11,
    // DeepSeek-V4-Pro slice 3.37 vs -/3.28/3.31 (24).
    const int rate_comm_ctas = std::clamp(static_cast<int>(ceil_div(55LL * sms_, p.intermediate)), 2, 16);
    // Gather mode: one rank whose every row is its own (EP = 1). Its compute CTAs copy the
    // routed rows from x into their stages as they load them (megakernel.cuh: gather_loop), so
    // no row is copied into the ring and every SM computes. Not with task pairs (their lockstep
    // and multicast are TMA-only) nor when the config asks for communication SMs (which then
    // pull as on any rank: the A/B in the tests, besides MOK_GATHER_LOCAL=0).
    const bool gather_wanted =
        gather_local_env_ == 1 || (gather_local_env_ < 0 && p.intermediate <= kGatherMaxIntermediate);
    gather_local_ = gather_wanted && p.ep_size == 1 && !group_ && !c.task_pairs && c.forward_comm_sms == 0 &&
                    static_cast<long long>(p.tokens_per_rank) * p.hidden * 2 < (1ll << 32);  // (32-bit row offsets)
    if (!gather_local_) {
      // Rows are pulled (gather mode pulls none, so it takes any width): a pull pipeline holds
      // two rows at least. The largest such hidden, a multiple of the 64-column rule.
      const std::size_t row_bytes = static_cast<std::size_t>(p.hidden) * 2;
      const auto widest = [&](int groups) { return std::to_string(pull_pipeline_bytes(groups) / 4 / 64 * 64); };
      require(pull_pipeline_bytes(1) / row_bytes >= 2,
              "problem: hidden = " + std::to_string(p.hidden) + " is too wide for the cuda backend's row pulls (at most " +
                  widest(1) + "; one rank (ep_size 1) whose rows are gathered where they lie takes any width)");
      // Tile groups per communication CTA: as many as keep kMinGroupSlots row slots per
      // pipeline (fewer slots and each pipeline has too few loads in flight).
      constexpr int kMinGroupSlots = 4;
      if (pull_groups_ == 0) {
        pull_groups_ = 1;
        while (pull_groups_ < kDefaultPullGroups &&
               pull_pipeline_bytes(pull_groups_ + 1) / row_bytes >= static_cast<std::size_t>(kMinGroupSlots))
          ++pull_groups_;
      } else {
        require(pull_pipeline_bytes(pull_groups_) / row_bytes >= 2,
                std::string(tuning_env_name(TuningEnv::kPullGroups)) + " = " + std::to_string(pull_groups_) +
                    ": leaves fewer than 2 row slots per pull pipeline at hidden = " + std::to_string(p.hidden) +
                    " (at most " + widest(pull_groups_) + ")");
      }
    } else if (pull_groups_ == 0) {
      pull_groups_ = 1;  // (nothing is pulled)
    }
    comm_ctas_ = gather_local_           ? 0
                 : c.forward_comm_sms > 0 ? c.forward_comm_sms
                 : comm_join_            ? std::max(rate_comm_ctas, std::min(16, sms_ / 4))
                                         : rate_comm_ctas;
    MOK_CUDA_CHECK(cudaFuncSetAttribute(forward_megakernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
    pairs_ = c.task_pairs;
    if (pairs_) {
      // Clusters of two over the whole grid: an even split, and no more CTAs than can be
      // resident at once in clusters (so every CTA gets its SM once other kernels leave them).
      comm_ctas_ += comm_ctas_ & 1;
      Launch probe(dim3(sms_ & ~1), dim3(kComputeThreads), kSmemBytes, nullptr);
      int clusters = 0;
      MOK_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&clusters, forward_megakernel, &probe.in_pairs().config()));
      grid_ctas_ = std::min(sms_ & ~1, 2 * clusters);
    } else {
      grid_ctas_ = sms_;
    }
    require(comm_ctas_ + (pairs_ ? 2 : 1) <= grid_ctas_,
            "Config.forward_comm_sms = " + std::to_string(comm_ctas_) + ": must leave compute SMs (" +
                std::to_string(grid_ctas_) + " CTAs can be resident" + (pairs_ ? " in 2-CTA clusters)" : ")"));
    config_.forward_comm_sms = comm_ctas_;
    if (config_.backward_comm_sms == 0) config_.backward_comm_sms = comm_ctas_;
    compute_ctas_ = grid_ctas_ - comm_ctas_;
    // A gate/up tile costs about two average tasks, so while one runs ~2.5 * compute CTAs
    // tasks are claimed: put a row tile's down tiles that many tasks after its gate/up tiles.
    // Bands: default_band_tiles says why and what was measured (row tile by row tile, band 1,
    // re-streamed every weight tile from HBM: DeepSeek-V4-Pro slice 4.34 vs 3.37 ms at 4).
    const int asked_band =
        c.task_band_tiles > 0
            ? c.task_band_tiles
            : default_band_tiles(pairs_, expert_gateup_bytes(p.hidden, p.intermediate), prop.l2CacheSize);
    const bool ring_wraps = ring_tiles_ < cap_tiles_;
    const BandAndLag order =
        choose_band_and_lag(asked_band, compute_ctas_, gateup_tiles_, down_tiles_, ring_tiles_, ring_wraps);
    band_ = order.band;
    lag_ = order.lag;
    if (task_lag_ > 0) {
      require(ring_allows_lag(band_, task_lag_, ring_tiles_, ring_wraps),
              std::string(tuning_env_name(TuningEnv::kTaskLag)) + " = " + std::to_string(task_lag_) + ": a wrapping ring of " + std::to_string(ring_tiles_) +
                  " row tiles in bands of " + std::to_string(band_) + " needs ring / band > lag");
      lag_ = task_lag_;
    }
    plan_shape_ = PlanShape{num_ranks_, p.num_shared(), p.num_shared() > 0 ? shared_row_tiles_ : 0, {},
                            gateup_tiles_, down_tiles_, band_, lag_, pairs_ ? 1 : 0};
    for (int s = 0; s < p.num_shared(); ++s)
      plan_shape_.shared_gateup_tiles[s] = ceil_div(p.shared_intermediate[s], kGateUpCols);
    config_.task_band_tiles = band_;
    // Head pulls only where none can wait for a ring slot (pull i's tile is at most i, so
    // i < ring_tiles never wraps) and outside pair mode (a pair starts in lockstep).
    head_pulls_ = pairs_ || gather_local_    ? 0
                  : head_pull_tiles_env_ > 0 ? std::min({head_pull_tiles_env_, grid_ctas_, ring_tiles_})
                  : head_pulls_env_ == 1     ? std::min(grid_ctas_, ring_tiles_)
                  : head_pulls_env_ == 0     ? 0
                                             : default_head_pulls(plan_shape_, grid_ctas_, ring_tiles_);

    // (The plan kernel counts and places tasks in 32-bit integers.)
    const long long max_tasks = max_tasks_per_forward();
    require(max_tasks < (1ll << 31), "problem: up to " + std::to_string(max_tasks) +
                                         " compute tasks per forward; the cuda backend's task list takes fewer than 2^31");
    allocate();
    // The combine slots here (this rank's in a group, every rank's on one GPU), which no
    // forward's argument may overlap: made once, they never move.
    for (int r = group_ ? first_rank_ : 0; r < (group_ ? first_rank_ + 1 : p.ep_size); ++r)
      own_combine_slots_.push_back(combine_slots(r));
    // The limit belongs to the kernel, not to this Layer: set it to what any Layer may need, so
    // a later, smaller Layer cannot lower it under an earlier one.
    for (const int chunk : {kScheduleChunkSmall, kScheduleChunkLarge}) {
      MOK_CUDA_CHECK(cudaFuncSetAttribute(count_kernel(chunk), cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          kScheduleWarps * count_warp_ints(kScheduleMaxExperts, chunk) * sizeof(int)));
      MOK_CUDA_CHECK(cudaFuncSetAttribute(scatter_plan_kernel(chunk), cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          kScheduleWarps * kScheduleMaxExperts * sizeof(int)));
    }
    on_device_.leave();  // (the caller's current device, as it was)
  }

  // cudaFree waits for the device, so buffers in use by queued work are released safely.
  // The caller's stream must outlive the layer (layer.h): a group's destructor waits on it
  // and meets its peers there (destructor below).

  // A kernel that trapped on a phase wait left its site in host memory: every later CUDA
  // call fails with a sticky error that says nothing, so the entry points look here first.
  void throw_if_trapped() const {
    if (phase_trap_.host() != nullptr && static_cast<const volatile PhaseWaitTrap*>(phase_trap_.host())->site != 0) {
      // The device wrote the other fields before the site (sm90.cuh): read them after it.
      std::atomic_thread_fence(std::memory_order_acquire);
      throw Error(describe_phase_wait_trap(*phase_trap_.host()));
    }
  }

  // Runs `body`; a mok::Error from it becomes the trap's diagnosis when a kernel trapped.
  template <typename Body>
  auto diagnosed(Body&& body) const {
    try {
      return body();
    } catch (const Error&) {
      throw_if_trapped();
      throw;
    }
  }

  void forward(std::span<const RankForward> ranks) override {
    throw_if_group_aborted("forward");
    // (Outside the try: the abort after a failure runs on the layer's device too.)
    std::optional<OnDevice> on;
    try {
      on.emplace(options_.cuda_device);
      throw_if_trapped();
      diagnosed([&] { enqueue_forward(ranks); });
    } catch (const std::exception& e) {
      abort_group_after(e.what());
      throw;
    }
  }

  // In a real group every rank enqueues the same collectives in the same order. A forward
  // that throws on this rank (a bad argument, say: the peers' own passed) leaves the group out
  // of step: the peers' all-gather waits for this rank, and a later forward's would be matched
  // with theirs. So the communicator is aborted at once (the peers' waits time out and name
  // it), every later call says why, and destroying the Layer never waits for the peers. A
  // device error the group barrier carried is different: every rank passed the barrier, the
  // group is in step, and it stays usable (synchronize).
  // (A trapped kernel, a CUDA error or a wait that gave up on the peers go the same way.)
  void abort_group_after(const std::string& why) const {
    if (!group_ || !group_abort_reason_.empty()) return;
    group_abort_reason_ = why.empty() ? std::string("an error without a message") : why;
    if (group_->communicator_aborted()) return;  // (a wait that gave up on the peers said so)
    std::fprintf(stderr, "mok: rank %d: %s; aborting its NCCL communicator (the group may be out of step)\n",
                 group_->rank(), group_abort_reason_.c_str());
    std::fflush(stderr);
    group_->abort_communicator();  // (drain_before_abort first: the hook)
  }

  // Sets the abandoned word (nothing without one); the fence orders the store before whatever
  // follows (an abort, a query of the stream).
  void raise_abandoned() const {
    if (abandoned_.host() == nullptr) return;
    *static_cast<volatile int*>(abandoned_.host()) = 1;
    std::atomic_thread_fence(std::memory_order_seq_cst);
  }

  // Called before every abort of the communicator, which unmaps the peers' memory that a
  // megakernel reads and writes. It raises the abandoned word first: a forward whose ids'
  // all-gather has not completed yet reads it in its schedule's count kernel, which comes
  // next, and touches no peer (kGroupAbandoned). Then it walks the tracked eager forwards,
  // oldest first: done ones are passed; the first one not done is waited for if its ids were
  // gathered (its megakernel may have read the word before it was raised, and is running or
  // about to: it depends on no peer and ends within milliseconds, or by its own wait limits,
  // which the group's wait limit exceeds), and the walk stops at the first one whose
  // all-gather is still pending (stream order: nothing after it has run). So the abort waits
  // only for megakernels, never for a dead peer. Not covered: forwards replayed from a CUDA
  // graph (their count kernels read the word, but one already past it is not waited for).
  void drain_before_abort() const {
    raise_abandoned();
    if (!forward_marks_.created()) return;
    try {
      const RelaxedCaptureMode relaxed;  // (event queries inside a capture, this thread's or another's)
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(group_wait_limit_ms());
      forward_marks_.each_oldest_first([&](const ForwardMarks::Pair& m) {
        if (!m.megakernel_recorded) {
          // A forward that failed between its marks: its megakernel may be queued or not. It
          // is the newest tracked one (its failure aborts the group before any other call),
          // so the stream holds nothing after it: wait for the stream, once its ids are in.
          if (cudaEventQuery(m.ids_gathered) == cudaErrorNotReady) return false;  // will read the word
          poll_until_done([&] { return cudaStreamQuery(stream_); }, deadline);
          return false;
        }
        if (cudaEventQuery(m.megakernel_done) != cudaErrorNotReady) return true;  // done (or the context failed)
        if (cudaEventQuery(m.ids_gathered) == cudaErrorNotReady) return false;    // will read the word
        // The megakernel a forward's own wait just gave up on (the group's whole limit): not
        // waited for twice. Nothing after it in the stream has run.
        if (m.megakernel_done == megakernel_waited_for_) return false;
        poll_until_done([&] { return cudaEventQuery(m.megakernel_done); }, deadline);
        return true;
      });
    } catch (const std::exception&) {
      // (The abort goes ahead: this wait only closes the window in which a fault can hit.)
    }
  }

  // (Every abort goes through abort_group_after, a wait that gave up included: the reason says.)
  bool group_aborted() const override { return !group_abort_reason_.empty(); }

  void abandon_group(const std::string& why) override {
    // (On the layer's device if that can be set; the abort goes ahead either way.)
    std::optional<OnDevice> on;
    try {
      on.emplace(options_.cuda_device);
    } catch (const std::exception&) {
    }
    abort_group_after(why.empty() ? std::string("the caller abandoned the group") : "the caller abandoned the group: " + why);
  }

  void throw_if_group_aborted(const std::string& call) const {
    if (!group_abort_reason_.empty())
      throw Error(call + ": this rank's EP group was aborted after an earlier error (" + group_abort_reason_ +
                  "); destroy this Layer and build a new one");
  }

  void enqueue_forward(std::span<const RankForward> ranks) {
    // x rows and weights move with bulk copies and TMA, y is written in 16-byte stores (a
    // misaligned one would fault and lose the context): all on this layer's device, aligned.
    check_forward_args(problem_, options_, ranks, Device::cuda, Placement{options_.cuda_device, 16},
                       group_ ? first_rank_ : 0, own_combine_slots_);
    const CallArgs& a = call_args(ranks);
    const Problem& p = problem_;
    const int T = p.tokens_per_rank, H = p.hidden;

    // Phase timing (record_phases): an event starts each phase; PDL is off then, since the
    // events sit between the kernels. A forward that throws part way records no split (the
    // next one reuses its events).
    // Not in a capture: its events would be capture dependencies, never times, and the
    // graph would keep PDL off for good.
    cudaStreamCaptureStatus capture_status = cudaStreamCaptureStatusNone;
    MOK_CUDA_CHECK(cudaStreamIsCapturing(stream_, &capture_status));
    const std::size_t split = phase_names_.size();
    const bool timing = split < phase_forwards_ && capture_status == cudaStreamCaptureStatusNone;
    std::vector<std::string> names;
    auto phase = [&](const char* name) {
      if (!timing) return;
      MOK_CUDA_CHECK(cudaEventRecord(phase_events_.at(split * kMaxPhaseMarks + names.size()), stream_));
      if (name != nullptr)
        names.push_back(name);
      else
        phase_names_.push_back(std::move(names));
    };
    const bool pdl = !timing;
    phase("setup");
    // Before the schedule too: the count kernel adds each block's rows to RankPlan::expert_rows.
    MOK_CUDA_CHECK(cudaMemsetAsync(counters_.as<int>(), 0, counters_.bytes(), stream_));

    EpilogueParams ep{T, H, p.top_k, p.num_shared(), plans_dev_.as<RankPlan>(), a.calls, error_.as<DeviceError>(),
                      group_ ? group_errors_.as<DeviceError>() : nullptr, group_ ? group_->size() : 0};
    const dim3 row_grid(ceil_div(static_cast<long long>(T) * H / 8, 256), num_ranks_);
    if (group_) {  // peers pull this rank's rows from its symmetric window
      Launch(row_grid, dim3(256), 0, stream_)("stage_x_kernel", stage_x_kernel, ep);
    }

    ScheduleParams sp{};
    sp.top_experts = a.tops;
    sp.router_weights = a.weights;
    sp.ep_size = p.ep_size;
    sp.tokens = T;
    sp.top_k = p.top_k;
    sp.num_experts = p.num_experts;
    sp.local_experts = p.local_experts();
    sp.first_rank = first_rank_;
    sp.num_ranks = num_ranks_;
    sp.chunks = chunks_;
    sp.capacity_rows = capacity_;
    sp.plans = plans_dev_.as<RankPlan>();
    sp.error = error_.as<DeviceError>();
    sp.abandoned = abandoned_.device();
    // Distributed and eager: this forward's marks for drain_before_abort (a capture's are
    // not kept: its replays run wherever the caller launches them).
    ForwardMarks::Pair* marks = nullptr;
    if (group_) {
      if (capture_status == cudaStreamCaptureStatusNone) {
        marks = &forward_marks_.next();
        const RelaxedCaptureMode relaxed;  // (another thread's global-mode capture stays valid)
        if (cudaEventQuery(marks->megakernel_done) == cudaErrorNotReady) {  // (16 forwards ahead)
          // (Should this wait give up, its abort's drain does not wait for the same megakernel
          // a second time: megakernel_waited_for_.)
          megakernel_waited_for_ = marks->megakernel_done;
          struct Clear {
            cudaEvent_t& event;
            ~Clear() { event = nullptr; }
          } clear{megakernel_waited_for_};
          group_->wait_for_event(marks->megakernel_done, "a forward waiting for the megakernel 16 forwards back",
                                 group_wait_limit_ms(), [this] { throw_if_trapped(); });
        }
      }
    }
    if (group_) {
      // Every rank's ids, gathered; each rank validates its own. The all-gather is also the
      // barrier after staging: no rank pulls rows before every rank has staged its x.
      group_->all_gather(ranks[0].inputs.top_experts.data, gathered_tops_.as<void>(),
                         static_cast<std::size_t>(T) * p.top_k * sizeof(int), stream_);
      if (marks != nullptr) {
        MOK_CUDA_CHECK(cudaEventRecord(marks->ids_gathered, stream_));
        marks->megakernel_recorded = false;  // (tracked from here: ForwardMarks)
        forward_marks_.advance();
      }
    }
    // Each rank validates its own ids (a slice or virtual ranks: every rank's).
    sp.validate_first_rank = group_ ? first_rank_ : 0;
    sp.validate_ranks = group_ ? 1 : p.ep_size;
    // The first kernel follows a memset (or the all-gather): an ordinary launch. Every later
    // one follows one of ours and launches as a programmatic dependent (PDL), hiding most of
    // the launch gap; in a group the epilogue follows the group barrier instead.
    const int sched_blocks = ceil_div(chunks_, kScheduleWarps);
    phase("schedule");
    Launch(dim3(sched_blocks), dim3(kScheduleThreads), schedule_count_smem_, stream_)(
        "schedule_count_kernel", count_kernel(chunk_ids_), sp);
    Launch(dim3(p.local_experts() * num_ranks_), dim3(kOffsetsThreads), 0, stream_)
        .after_kernel(pdl)("schedule_offsets_kernel", schedule_offsets_kernel, sp);
    const int max_groups = ceil_div(std::max(cap_tiles_, shared_row_tiles_), band_) + lag_;
    const int plan_blocks = ceil_div(max_groups, kPlanGroupsPerBlock);
    ScatterPlanParams spp{};
    spp.schedule = sp;
    spp.plan_blocks = plan_blocks;
    spp.plan.plans = plans_dev_.as<RankPlan>();
    spp.plan.shape = plan_shape_;
    spp.plan.tasks = tasks_.as<Task>();
    spp.plan.num_tasks = task_counts_.as<int>();
    spp.plan.pulls = pulls_.as<int2>();
    spp.plan.num_pulls = task_counts_.as<int>() + 1;
    Launch(dim3(sched_blocks + plan_blocks), dim3(kScheduleThreads), schedule_scatter_smem_, stream_)
        .after_kernel(pdl)("schedule_scatter_plan_kernel", scatter_plan_kernel(chunk_ids_), spp);

    ForwardParams fp{};
    fp.ep_size = p.ep_size;
    fp.tokens = T;
    fp.hidden = H;
    fp.inter = p.intermediate;
    fp.top_k = p.top_k;
    fp.local_experts = p.local_experts();
    fp.num_shared = p.num_shared();
    fp.capacity_rows = capacity_;
    fp.ring_tiles = ring_tiles_;
    fp.first_rank = first_rank_;
    fp.num_ranks = num_ranks_;
    fp.num_comm_ctas = comm_ctas_;
    fp.gateup_tiles = gateup_tiles_;
    fp.down_tiles = down_tiles_;
    fp.swiglu_limit = p.swiglu_limit ? *p.swiglu_limit : 0.0f;
    fp.timeout_ns = timeout_ns_;
    fp.x_source = a.x_source;
    fp.zero_row = zero_row_.as<__nv_bfloat16>();
    fp.combine_of = combine_of_dev_.as<__nv_bfloat16*>();
    fp.plans = plans_dev_.as<RankPlan>();
    fp.maps = a.maps;
    fp.tasks = tasks_.as<Task>();
    fp.num_tasks = task_counts_.as<int>();
    fp.pulls = pulls_.as<int2>();
    fp.num_pulls = task_counts_.as<int>() + 1;
    fp.error = error_.as<DeviceError>();
    fp.task_counter = launch_counter(kTaskCounter);
    fp.comm_started = launch_counter(kCommStarted);
    fp.comm_joined = launch_counter(kCommJoined);
    fp.head_pulls = head_pulls_;
    fp.head_counter = launch_counter(kHeadCounter);
    fp.ring_wraps = ring_tiles_ < cap_tiles_ ? 1 : 0;
    fp.pull_ahead = pull_ahead_;
    fp.pull_groups = pull_groups_;
    fp.store_warp = store_warp_ ? 1 : 0;
    fp.half_tiles = half_tiles_ ? 1 : 0;
    fp.comm_join = comm_join_ ? 1 : 0;
    fp.gather_local = gather_local_ ? 1 : 0;
    fp.test_fault = test_fault_;
    fp.phase_trap = phase_trap_.device();
    fp.phase_trap_claim = phase_trap_claim_.as<int>();
    fp.phase_wait_units = phase_wait_units_;
    fp.pairs = pairs_ ? 1 : 0;
    phase("megakernel");
    Launch(dim3(grid_ctas_), dim3(kComputeThreads), kSmemBytes, stream_)
        .after_kernel(pdl)
        .in_pairs(pairs_)
        .cooperative(cooperative_)("forward_megakernel", forward_megakernel, fp);
    if (marks != nullptr) {
      MOK_CUDA_CHECK(cudaEventRecord(marks->megakernel_done, stream_));
      marks->megakernel_recorded = true;
    }
    // The group barrier: an all-gather of every rank's DeviceError, which completes on no rank
    // before every rank has contributed, so after it every rank's rows are in our combine
    // slots, and every rank's error is known here (a rank that failed, capacity say, did not
    // push its rows for our tokens: the epilogue poisons y, synchronize names that rank).
    if (group_) {
      phase("group_barrier");
      // Every entry marked "no status" first (kNoGroupStatus: 0xFF bytes): the all-gather
      // overwrites them all, so one still marked after it was aborted before that rank's status
      // came, and the epilogue poisons y instead of summing slots that rank never filled (the
      // table otherwise still held the previous forward's codes).
      MOK_CUDA_CHECK(cudaMemsetAsync(group_errors_.as<void>(), 0xFF, group_->size() * sizeof(DeviceError), stream_));
      group_->all_gather(error_.as<void>(), group_errors_.as<void>(), sizeof(DeviceError), stream_);
    }

    phase("epilogue");
    Launch(row_grid, dim3(256), 0, stream_)
        .after_kernel(pdl && !group_)("combine_epilogue_kernel", combine_epilogue_kernel, ep);
    phase(nullptr);  // the end of the last phase
  }

  void backward(std::span<const RankBackward>) override {
    throw Error("backward on the cuda backend is not built yet (the CPU reference has it: backend = cpu)");
  }

  std::vector<ScheduleStats> last_schedule_stats() const override {
    const OnDevice on(options_.cuda_device);
    wait_for_stream("waiting for the schedule statistics");
    std::vector<ScheduleStats> out;
    const int E_loc = problem_.local_experts();
    // The launch-wide counters, the same for every rank of the launch.
    int joined = 0, head_claims = 0;
    MOK_CUDA_CHECK(cudaMemcpy(&joined, launch_counter(kCommJoined), 4, cudaMemcpyDeviceToHost));
    MOK_CUDA_CHECK(cudaMemcpy(&head_claims, launch_counter(kHeadCounter), 4, cudaMemcpyDeviceToHost));
    for (int d = 0; d < num_ranks_; ++d) {
      // The count kernel's totals (the offsets kernel lays the segments out from them and
      // checks them against the chunk counts: kScheduleMismatch), so the tests that compare
      // these with the CPU schedule check the totals the layout came from.
      std::vector<int> rows(E_loc);
      int tiles = 0, half_tile_tasks = 0;
      MOK_CUDA_CHECK(cudaMemcpy(rows.data(), plans_host_[d].expert_rows, rows.size() * sizeof(int), cudaMemcpyDeviceToHost));
      MOK_CUDA_CHECK(cudaMemcpy(&tiles, plans_host_[d].num_row_tiles, 4, cudaMemcpyDeviceToHost));
      MOK_CUDA_CHECK(cudaMemcpy(&half_tile_tasks, plans_host_[d].half_tile_tasks, 4, cudaMemcpyDeviceToHost));
      ScheduleStats s;
      s.rows_per_local_expert.assign(rows.begin(), rows.end());
      for (auto n : s.rows_per_local_expert) s.real_rows += n;
      s.padded_rows = static_cast<std::int64_t>(tiles) * kTileM;
      s.capacity_rows = capacity_;
      s.half_tile_tasks = half_tile_tasks;
      s.joined_comm_ctas = joined;
      s.head_pull_claims = head_claims;
      out.push_back(std::move(s));
    }
    return out;
  }

  void record_phases(int forwards) override {
    require(forwards >= 0, "record_phases(" + std::to_string(forwards) + "): the forward count must be >= 0");
    const OnDevice on(options_.cuda_device);
    phase_names_.clear();
    for (auto e : phase_events_) cudaEventDestroy(e);
    phase_events_.clear();
    phase_forwards_ = 0;
    std::vector<cudaEvent_t> events(static_cast<std::size_t>(forwards) * kMaxPhaseMarks, nullptr);
    for (auto& e : events) {
      const cudaError_t err = cudaEventCreate(&e);
      if (err != cudaSuccess) {
        for (auto made : events)
          if (made) cudaEventDestroy(made);
        MOK_CUDA_CHECK(err);
      }
    }
    phase_events_ = std::move(events);
    phase_forwards_ = static_cast<std::size_t>(forwards);
  }

  std::vector<std::vector<PhaseTime>> phase_times() const override {
    std::vector<std::vector<PhaseTime>> out;
    if (phase_names_.empty()) return out;
    const OnDevice on(options_.cuda_device);
    synchronize();  // (in a group: with the group's deadline)
    for (std::size_t f = 0; f < phase_names_.size(); ++f) {
      const cudaEvent_t* marks = phase_events_.data() + f * kMaxPhaseMarks;
      std::vector<PhaseTime>& split = out.emplace_back();
      for (std::size_t i = 0; i < phase_names_[f].size(); ++i) {
        float ms = 0;
        MOK_CUDA_CHECK(cudaEventElapsedTime(&ms, marks[i], marks[i + 1]));
        split.push_back({phase_names_[f][i], ms});
      }
    }
    return out;
  }

  // A group's wait for its peers: past the phase-wait limit, so a trapped kernel is named
  // rather than a peer blamed.
  std::uint64_t group_wait_limit_ms() const { return (std::uint64_t(phase_wait_units_) << 20) / 1000000 + 2000; }

  // Waits for everything on the stream. In a group the wait has a deadline (a dead peer is an
  // error naming `what`, never a hang); a trapped kernel is named before any other error.
  void wait_for_stream(const std::string& what) const {
    throw_if_group_aborted(what);
    try {
      throw_if_trapped();
      if (group_) group_->wait(stream_, what, group_wait_limit_ms(), [this] { throw_if_trapped(); });
      const cudaError_t sync = cudaStreamSynchronize(stream_);
      if (sync != cudaSuccess) {
        throw_if_trapped();
        MOK_CUDA_CHECK(sync);
      }
    } catch (const std::exception& e) {
      abort_group_after(e.what());  // (in a real group; a no-op otherwise)
      throw;
    }
  }

  void synchronize() const override {
    const OnDevice on(options_.cuda_device);
    wait_for_stream("waiting for the forward");
    DeviceError e;
    MOK_CUDA_CHECK(cudaMemcpy(&e, error_.as<DeviceError>(), sizeof(e), cudaMemcpyDeviceToHost));
    // The peers' errors of the same forward (a group), read now and reported with this rank's
    // own error when it has one: each forward's errors are reported once, so a second
    // synchronize() never blames a peer for a forward already reported.
    std::optional<std::string> peer;
    std::vector<DeviceError> gathered;  // (empty outside a group)
    if (group_) {
      gathered.resize(group_->size());
      MOK_CUDA_CHECK(cudaMemcpy(gathered.data(), group_errors_.as<DeviceError>(), gathered.size() * sizeof(DeviceError),
                                cudaMemcpyDeviceToHost));
      peer = describe_peer_errors(gathered, first_rank_, problem_.tokens_per_rank, problem_.top_k);
      // (Cleared on the layer's stream, as error_ is below; the next forward gathers afresh.)
      if (peer || e.code != kOk)
        MOK_CUDA_CHECK(cudaMemsetAsync(group_errors_.as<void>(), 0, gathered.size() * sizeof(DeviceError), stream_));
    }
    if (e.code != kOk) {
      // Cleared on the layer's stream, so that the next forward's checks run after the clear
      // (a cudaMemset on the legacy stream may still be pending behind other work there
      // while a non-blocking stream_ runs that forward, and wipe the error it records).
      MOK_CUDA_CHECK(cudaMemsetAsync(error_.as<DeviceError>(), 0, sizeof(DeviceError), stream_));
      throw Error(describe_forward_errors(e, gathered, first_rank_, problem_.tokens_per_rank, problem_.top_k));
    }
    if (peer)
      throw PeerWaitError("forward: " + *peer + "; y was poisoned with NaN here too (that rank's rows for this "
                          "rank's tokens may be missing)");
  }

  TensorView combine_slots(int rank) const override {
    require(!group_ || rank == first_rank_, "combine_slots: in a distributed group only this rank's (" +
                                                std::to_string(first_rank_) + ") slots are here");
    return TensorView::contiguous(group_ ? combine_sym_.local : combine_[rank].as<void>(), DType::bf16,
                                  {std::int64_t(problem_.tokens_per_rank) * problem_.top_k, problem_.hidden},
                                  Device::cuda, options_.cuda_device);
  }

  std::size_t workspace_bytes() const override { return workspace_bytes_; }
  Config resolved_config() const override { return config_; }

  std::vector<std::vector<ScheduleRow>> last_schedules() const override {
    const OnDevice on(options_.cuda_device);
    wait_for_stream("waiting for the schedules");
    std::vector<std::vector<ScheduleRow>> out;
    for (int d = 0; d < num_ranks_; ++d) {
      int tiles = 0;
      MOK_CUDA_CHECK(cudaMemcpy(&tiles, plans_host_[d].num_row_tiles, 4, cudaMemcpyDeviceToHost));
      std::vector<ScheduleRow> rows(static_cast<std::size_t>(tiles) * kTileM);
      static_assert(sizeof(ScheduleRow) == sizeof(int2));
      MOK_CUDA_CHECK(cudaMemcpy(rows.data(), plans_host_[d].rows, rows.size() * sizeof(int2), cudaMemcpyDeviceToHost));
      out.push_back(std::move(rows));
    }
    return out;
  }

 private:
  void validate_rules() const {
    const Problem& p = problem_;
    const std::string rule = " must be a multiple of 64 for the cuda backend (TMA tiles of 64 along the contraction)";
    require(p.hidden % kAlignRule == 0, "Problem.hidden = " + std::to_string(p.hidden) + ":" + rule);
    require(p.intermediate % kAlignRule == 0, "Problem.intermediate = " + std::to_string(p.intermediate) + ":" + rule);
    for (int s = 0; s < p.num_shared(); ++s)
      require(p.shared_intermediate[s] % kAlignRule == 0,
              "Problem.shared_intermediate[" + std::to_string(s) + "] = " + std::to_string(p.shared_intermediate[s]) +
                  ":" + rule);
    require(p.num_shared() <= kMaxShared, "Problem.shared_intermediate: at most " + std::to_string(kMaxShared) +
                                              " shared experts on the cuda backend");
    require(p.precision == Precision::bf16,
            "Problem.precision = mxfp8: the cuda backend runs bf16 so far (the CPU reference has mxfp8)");
    require(config_.tile_rows == kTileM, "Config.tile_rows = " + std::to_string(config_.tile_rows) +
                                             ": the cuda backend's GEMM tile is 128 rows; use 128");
    // (A task names its computed rank d < num_ranks_ <= ep_size in 12 bits: plan_order.h.)
    static_assert(kMaxEpSize <= 1 << 12, "Task's rank field holds every computed rank");
  }

  // The most compute tasks a forward can list: every shared tile, and every row tile the
  // capacity allows times its gate/up and down column tiles.
  long long max_tasks_per_forward() const {
    long long shared_tasks = 0;
    for (int w : problem_.shared_intermediate)
      shared_tasks += static_cast<long long>(shared_row_tiles_) * (ceil_div(w, kGateUpCols) + down_tiles_);
    long long tasks = num_ranks_ * (shared_tasks + static_cast<long long>(cap_tiles_) * (gateup_tiles_ + down_tiles_));
    if (pairs_) tasks *= 2;  // at most one phantom per real task (odd runs)
    return tasks;
  }

  void allocate() {
    const Problem& p = problem_;
    const int R = p.ep_size, T = p.tokens_per_rank, H = p.hidden, I = p.intermediate;
    const std::size_t ring_rows = static_cast<std::size_t>(ring_tiles_) * kTileM;
    // Gather mode pulls nothing, so the pulled-row ring is never read or written: one tile,
    // only for its tensor map (Qwen3-30B at T = 16384 saves 0.54 GB).
    const std::size_t pulled_ring_rows = gather_local_ ? kTileM : ring_rows;
    auto track = [&](DeviceBuffer b) {
      workspace_bytes_ += b.bytes();
      return b;
    };
    // Counters zeroed per forward: rows_ready, act_ready, down_done per rank, then shared,
    // then the rank's rows per local expert (the schedule's), then its half-tile task count.
    const std::size_t per_rank_counters =
        3 * static_cast<std::size_t>(cap_tiles_) + p.num_shared() * shared_row_tiles_ + p.local_experts() + 1;
    // ... then the joined and the started communication CTAs (MOK_COMM_JOIN) and the
    // megakernel's task counter last.
    counters_ = track(DeviceBuffer((num_ranks_ * per_rank_counters + kLaunchCounters) * sizeof(int)));
    error_ = track(DeviceBuffer(sizeof(DeviceError)));
    // (A real group's barrier gathers every rank's DeviceError here.)
    const std::size_t group_errors_bytes = (group_ ? group_->size() : 1) * sizeof(DeviceError);
    group_errors_ = track(DeviceBuffer(group_errors_bytes));
    MOK_CUDA_CHECK(cudaMemset(error_.as<void>(), 0, sizeof(DeviceError)));
    MOK_CUDA_CHECK(cudaMemset(group_errors_.as<void>(), 0, group_errors_bytes));
    if (group_ || test_fault_ == kFaultAbandonedGroup) {
      abandoned_.allocate();
      if (test_fault_ == kFaultAbandonedGroup) raise_abandoned();
    }
    if (group_) {
      forward_marks_.create();
      // Every abort of the communicator is drained first, the group's own included (a wait
      // that gave up on the peers, an NCCL error): drain_before_abort. (It uses only members
      // declared before group_, which outlive the group.)
      group_->set_before_abort([this] { drain_before_abort(); });
    }
    phase_trap_.try_allocate();  // (a diagnostic aid, not a requirement)
    phase_trap_claim_ = DeviceBuffer(sizeof(int));
    MOK_CUDA_CHECK(cudaMemset(phase_trap_claim_.as<void>(), 0, sizeof(int)));
    const long long max_tasks = max_tasks_per_forward();
    tasks_ = track(DeviceBuffer(std::max<long long>(1, max_tasks) * sizeof(Task)));
    pulls_ = track(DeviceBuffer(std::max<long long>(1, static_cast<long long>(num_ranks_) * cap_tiles_) * sizeof(int2)));
    task_counts_ = track(DeviceBuffer(2 * sizeof(int)));

    // Combine slots: every rank's here (virtual ranks, slices), or this rank's in symmetric
    // memory with the peers' reached through NCCL (distributed).
    const std::size_t combine_bytes = static_cast<std::size_t>(T) * p.top_k * H * 2;
    std::vector<__nv_bfloat16*> combine_ptrs;
    if (group_) {
      combine_sym_ = group_->alloc_symmetric(combine_bytes);
      x_sym_ = group_->alloc_symmetric(static_cast<std::size_t>(T) * H * 2);
      // Registering the windows is collective, and NCCL waits there for every rank without a
      // limit: a rank that failed on its own since the last meeting (out of memory, say) would
      // leave the others waiting for good. So the ranks meet first where the wait is bounded
      // (a missing rank makes it a PeerWaitError within the start-up limit).
      // (And again between the two: a registration can fail on one rank alone too.)
      group_->check_same_everywhere("readiness to register the shared windows", "ready");
      group_->register_window(combine_sym_);
      group_->check_same_everywhere("the first shared window registered", "ready");
      group_->register_window(x_sym_);
      workspace_bytes_ += combine_sym_.bytes + x_sym_.bytes;
      DeviceBuffer peers(2 * R * sizeof(void*));
      Launch(dim3(ceil_div(R, 256)), dim3(256), 0, stream_)("peer_pointers_kernel", peer_pointers_kernel,
                                           static_cast<ncclWindow_t>(x_sym_.window),
                                           static_cast<ncclWindow_t>(combine_sym_.window), R, peers.as<void*>());
      // The copy below runs on the legacy stream, which does not wait for a non-blocking
      // stream_ (mok bench's): the table is read only once the kernel has written it.
      MOK_CUDA_CHECK(cudaStreamSynchronize(stream_));
      std::vector<void*> host(2 * R);
      MOK_CUDA_CHECK(cudaMemcpy(host.data(), peers.as<void>(), host.size() * sizeof(void*), cudaMemcpyDeviceToHost));
      peer_x_.assign(host.begin(), host.begin() + R);
      for (int r = 0; r < R; ++r) combine_ptrs.push_back(static_cast<__nv_bfloat16*>(host[R + r]));
      // This rank's own memory by its own address, not through NCCL's flat window of every
      // rank: an abort unmaps that window, ours included, while ncclMemAlloc's memory stays
      // mapped until it is freed, so work still queued then (stage_x, the epilogue) reads and
      // writes memory that is there. (The same bytes: nothing else changes.)
      peer_x_[first_rank_] = x_sym_.local;
      combine_ptrs[first_rank_] = static_cast<__nv_bfloat16*>(combine_sym_.local);
      gathered_tops_ = track(DeviceBuffer(static_cast<std::size_t>(R) * T * p.top_k * sizeof(int)));
      teardown_scratch_ = DeviceBuffer(static_cast<std::size_t>(group_->size()));
    } else {
      for (int r = 0; r < R; ++r) combine_.push_back(track(DeviceBuffer(combine_bytes)));
      for (auto& b : combine_) combine_ptrs.push_back(b.as<__nv_bfloat16>());
    }
    zero_row_ = track(DeviceBuffer(static_cast<std::size_t>(H) * 2));
    MOK_CUDA_CHECK(cudaMemset(zero_row_.as<void>(), 0, static_cast<std::size_t>(H) * 2));
    combine_of_dev_ = track(DeviceBuffer(R * sizeof(void*)));
    MOK_CUDA_CHECK(cudaMemcpy(combine_of_dev_.as<void>(), combine_ptrs.data(), R * sizeof(void*), cudaMemcpyHostToDevice));

    plans_host_.assign(num_ranks_, RankPlan{});
    fixed_maps_.assign(num_ranks_, RankMaps{});
    for (int d = 0; d < num_ranks_; ++d) {
      RankPlan& plan = plans_host_[d];
      int* counters = counters_.as<int>() + d * per_rank_counters;
      plan.rows_ready = counters;
      plan.act_ready = counters + cap_tiles_;
      plan.down_done = counters + 2 * cap_tiles_;
      plan.half_tile_tasks = counters + per_rank_counters - 1;
      plan.expert_rows = plan.half_tile_tasks - p.local_experts();
      rank_buffers_.push_back(track(DeviceBuffer(static_cast<std::size_t>(capacity_) * sizeof(int2))));
      plan.rows = rank_buffers_.back().as<int2>();
      rank_buffers_.push_back(track(DeviceBuffer(std::max(1, cap_tiles_) * sizeof(int))));
      plan.block_expert = rank_buffers_.back().as<int>();
      rank_buffers_.push_back(track(DeviceBuffer(sizeof(int) * (1 + 2 * static_cast<std::size_t>(p.local_experts()) * chunks_))));
      plan.num_row_tiles = rank_buffers_.back().as<int>();
      plan.expert_counts = plan.num_row_tiles + 1;
      plan.expert_offsets = plan.expert_counts + static_cast<std::size_t>(p.local_experts()) * chunks_;
      rank_buffers_.push_back(track(DeviceBuffer(pulled_ring_rows * H * 2)));
      plan.ring = rank_buffers_.back().as<__nv_bfloat16>();
      rank_buffers_.push_back(track(DeviceBuffer(ring_rows * I * 2)));
      plan.act = rank_buffers_.back().as<__nv_bfloat16>();
      // A real group stages x in its symmetric window (peers pull from there); on one GPU
      // the rows and the shared experts read the caller's x directly (per call, below).
      plan.x_staged = group_ ? static_cast<__nv_bfloat16*>(x_sym_.local) : nullptr;
      plan.combine = combine_ptrs[first_rank_ + d];
      RankMaps& m = fixed_maps_[d];
      m.ring = encode_2d(plan.ring, H, pulled_ring_rows, kTileM);
      m.act = encode_2d(plan.act, I, ring_rows, kTileM);
      if (group_) m.x_staged = encode_2d(plan.x_staged, H, T, kTileM);
      for (int s = 0; s < p.num_shared(); ++s) {
        const int w = p.shared_intermediate[s];
        SharedPlan& sp = plan.shared[s];
        sp.width = w;
        sp.gateup_tiles = ceil_div(w, kGateUpCols);
        sp.act_ready = counters + 3 * cap_tiles_ + s * shared_row_tiles_;
        rank_buffers_.push_back(track(DeviceBuffer(static_cast<std::size_t>(T) * w * 2)));
        sp.act = rank_buffers_.back().as<__nv_bfloat16>();
        rank_buffers_.push_back(track(DeviceBuffer(static_cast<std::size_t>(T) * H * 2)));
        sp.out = rank_buffers_.back().as<__nv_bfloat16>();
        m.shared_act[s] = encode_2d(sp.act, w, T, kTileM);
      }
    }
    for (std::size_t i = 0; i < kCacheEntries; ++i) {
      ArgSlot slot;
      MOK_CUDA_CHECK(cudaMallocHost(&slot.host, arg_slot_bytes()));
      MOK_CUDA_CHECK(cudaEventCreateWithFlags(&slot.uploaded, cudaEventDisableTiming));
      slot.device = track(DeviceBuffer(arg_slot_bytes()));
      slots_.push_back(std::move(slot));
    }
    plans_dev_ = track(DeviceBuffer(num_ranks_ * sizeof(RankPlan)));
    MOK_CUDA_CHECK(cudaMemcpy(plans_dev_.as<void>(), plans_host_.data(), num_ranks_ * sizeof(RankPlan), cudaMemcpyHostToDevice));
    // Every set-up copy and memset above went to the legacy stream, and a pageable copy may
    // return before its transfer lands: done before the first forward, which a non-blocking
    // stream_ does not order after them.
    MOK_CUDA_CHECK(cudaStreamSynchronize(nullptr));
  }

  // The device block of pointers and tensor maps for this call's tensors (cached).
  const CallArgs& call_args(std::span<const RankForward> ranks) {
    const Problem& p = problem_;
    const int R = p.ep_size;
    std::vector<const void*> key;
    for (const auto& r : ranks) {
      key.push_back(r.inputs.x.data);
      key.push_back(r.inputs.top_experts.data);
      key.push_back(r.inputs.router_weights.data);
    }
    for (int d = 0; d < num_ranks_; ++d) {
      const RankForward& r = ranks[arg_index(d)];
      key.push_back(r.y.data);
      key.push_back(r.weights.w_gate.data);
      key.push_back(r.weights.w_up.data);
      key.push_back(r.weights.w_down.data);
      for (const auto& s : r.weights.shared) {
        key.push_back(s.w_gate.data);
        key.push_back(s.w_up.data);
        key.push_back(s.w_down.data);
      }
    }
    cudaStreamCaptureStatus status;
    cudaGraph_t capture_graph = nullptr;
    MOK_CUDA_CHECK(cudaStreamGetCaptureInfo(stream_, &status, nullptr, &capture_graph));
    const bool capturing = status != cudaStreamCaptureStatusNone;
    for (auto it = cache_.begin(); it != cache_.end(); ++it)
      if (it->key == key) {
        if (status == cudaStreamCaptureStatusActive) pin_for_graph(it->slot, capture_graph);
        if (!it->uploaded_eagerly) {
          MOK_CUDA_CHECK(cudaMemcpyAsync(slots_[it->slot].device.as<void>(), slots_[it->slot].host, arg_slot_bytes(),
                                         cudaMemcpyHostToDevice, stream_));
          // (Recorded like any eager upload: the slot may be handed over once its graphs are
          // gone, and its host copy must not be rewritten under this copy.)
          if (!capturing) MOK_CUDA_CHECK(cudaEventRecord(slots_[it->slot].uploaded, stream_));
          it->uploaded_eagerly = !capturing;
        }
        cache_.splice(cache_.begin(), cache_, it);
        return cache_.front();
      }
    // A slot no cached set holds, else the least recently used set's that no live graph holds.
    std::vector<bool> held(slots_.size(), false);
    for (const CallArgs& c : cache_) held[c.slot] = true;
    std::size_t slot = std::find(held.begin(), held.end(), false) - held.begin();
    auto victim = cache_.rend();
    if (slot == slots_.size()) {
      auto unpinned = [&](const CallArgs& c) { return pins_->graphs[c.slot].load(std::memory_order_acquire) == 0; };
      victim = std::find_if(cache_.rbegin(), cache_.rend(), unpinned);
      // A graph destroyed just now lets go of its slot on CUDA's thread a moment later (its
      // user object's destructor): that is waited for, briefly, before the error.
      for (int ms = 0; victim == cache_.rend() && ms < 1000; ++ms) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
        victim = std::find_if(cache_.rbegin(), cache_.rend(), unpinned);
      }
      require(victim != cache_.rend(),
              "forward: all " + std::to_string(slots_.size()) + " argument slots hold tensor sets of CUDA graphs "
              "still alive, which replay them; call with one of those sets, destroy graphs no longer needed "
              "(with their executable graphs), or use another Layer for more");
      slot = victim->slot;
    }
    // The slot's host copy is rewritten below: the copy that last uploaded it must be done. It
    // almost always is (a set used least recently, or a slot never used), so the host does not
    // wait; if not (the host is that many new sets ahead of the stream), it waits for that copy,
    // during a capture too.
    wait_for_upload(slots_[slot], capturing);
    if (victim != cache_.rend()) cache_.erase(std::next(victim).base());
    // (Cached only once its slot holds it: a throw below leaves no entry naming this set.)
    CallArgs a;
    a.key = std::move(key);
    a.slot = slot;
    a.uploaded_eagerly = !capturing;

    // Layout: RankMaps[num_ranks] | x_source[R] | tops[R] | weights[R] | CallRank[num_ranks].
    const std::size_t maps_bytes = num_ranks_ * sizeof(RankMaps);
    const std::size_t ptr_bytes = R * sizeof(void*);
    const std::size_t total = arg_slot_bytes();
    char* host = static_cast<char*>(slots_[slot].host);
    auto* hmaps = reinterpret_cast<RankMaps*>(host);
    auto* hx = reinterpret_cast<const __nv_bfloat16**>(host + maps_bytes);
    auto* htops = reinterpret_cast<const int**>(host + maps_bytes + ptr_bytes);
    auto* hw = reinterpret_cast<const float**>(host + maps_bytes + 2 * ptr_bytes);
    auto* hcalls = reinterpret_cast<CallRank*>(host + maps_bytes + 3 * ptr_bytes);
    for (int r = 0; r < R; ++r) {
      if (group_) {
        // Peers' staged x by NVLink pointer; ids from the all-gathered copy; each rank
        // validates only its own router weights.
        hx[r] = static_cast<const __nv_bfloat16*>(peer_x_[r]);
        htops[r] = gathered_tops_.as<const int>() + static_cast<std::size_t>(r) * p.tokens_per_rank * p.top_k;
        hw[r] = ranks[0].inputs.router_weights.as<const float>();
        continue;
      }
      // One GPU: every rank's rows are read from the x it was given (in a rank slice, the
      // other ranks' x filled in advance); nothing is staged.
      hx[r] = ranks[r].inputs.x.as<const __nv_bfloat16>();
      htops[r] = ranks[r].inputs.top_experts.as<const int>();
      hw[r] = ranks[r].inputs.router_weights.as<const float>();
    }
    const int H = p.hidden, I = p.intermediate, E = p.local_experts();
    for (int d = 0; d < num_ranks_; ++d) {
      const RankForward& r = ranks[arg_index(d)];
      RankMaps& m = hmaps[d];
      m = fixed_maps_[d];
      if (!group_) m.x_staged = encode_2d(r.inputs.x.data, H, p.tokens_per_rank, kTileM);
      m.w_gate = encode_2d(r.weights.w_gate.data, H, static_cast<std::uint64_t>(E) * I, kGateUpCols);
      m.w_up = encode_2d(r.weights.w_up.data, H, static_cast<std::uint64_t>(E) * I, kGateUpCols);
      m.w_down = encode_2d(r.weights.w_down.data, I, static_cast<std::uint64_t>(E) * H, kBHalfRows);
      for (int s = 0; s < p.num_shared(); ++s) {
        const int w = p.shared_intermediate[s];
        m.shared_w_gate[s] = encode_2d(r.weights.shared[s].w_gate.data, H, w, kGateUpCols);
        m.shared_w_up[s] = encode_2d(r.weights.shared[s].w_up.data, H, w, kGateUpCols);
        m.shared_w_down[s] = encode_2d(r.weights.shared[s].w_down.data, w, H, kBHalfRows);
      }
      hcalls[d] = CallRank{r.inputs.x.as<const __nv_bfloat16>(), r.inputs.router_weights.as<const float>(),
                           r.y.as<__nv_bfloat16>()};
    }
    MOK_CUDA_CHECK(cudaMemcpyAsync(slots_[slot].device.as<void>(), host, total, cudaMemcpyHostToDevice, stream_));
    if (!capturing) MOK_CUDA_CHECK(cudaEventRecord(slots_[slot].uploaded, stream_));
    char* dev = slots_[slot].device.as<char>();
    a.maps = reinterpret_cast<RankMaps*>(dev);
    a.x_source = reinterpret_cast<const __nv_bfloat16**>(dev + maps_bytes);
    a.tops = reinterpret_cast<const int**>(dev + maps_bytes + ptr_bytes);
    a.weights = reinterpret_cast<const float**>(dev + maps_bytes + 2 * ptr_bytes);
    a.calls = reinterpret_cast<CallRank*>(dev + maps_bytes + 3 * ptr_bytes);
    // (Pinned last: a throw above leaves neither an entry nor a pin for this set.)
    if (status == cudaStreamCaptureStatusActive) pin_for_graph(slot, capture_graph);
    cache_.push_front(std::move(a));
    return cache_.front();
  }

  // `graph` (being captured) holds argument slot `slot` until it and its executable graphs are
  // gone (GraphPins).
  void pin_for_graph(std::size_t slot, cudaGraph_t graph) {
    auto* pin = new GraphPin{pins_, slot};
    pins_->graphs[slot].fetch_add(1, std::memory_order_acq_rel);
    cudaUserObject_t object = nullptr;
    const cudaError_t created = cudaUserObjectCreate(&object, pin, GraphPin::release, 1, cudaUserObjectNoDestructorSync);
    if (created != cudaSuccess) {
      GraphPin::release(pin);
      MOK_CUDA_CHECK(created);
    }
    // (The graph takes over the one reference: its release runs the destructor.)
    const cudaError_t retained = cudaGraphRetainUserObject(graph, object, 1, cudaGraphUserObjectMove);
    if (retained != cudaSuccess) {
      cudaUserObjectRelease(object, 1);  // (runs GraphPin::release, on CUDA's thread)
      MOK_CUDA_CHECK(retained);
    }
  }

  // Waits until the copy that last uploaded `slot` (always outside a capture) has read its
  // host memory. On one GPU it waits for that copy's event. In a real group the stream also
  // holds NCCL work that waits for the peers: outside a capture the whole stream is waited for,
  // with the group's limits; during one (a capturing stream may not be waited for) its event,
  // with the same limits (EpGroup::wait_for_event). The event calls run in relaxed capture mode: in this
  // thread's own capture they are otherwise refused, and in another thread's global-mode
  // capture (PyTorch's default) they would invalidate it. (The event was recorded before any
  // capture began, so waiting for it adds nothing to a graph.)
  void wait_for_upload(const ArgSlot& slot, bool capturing) const {
    const RelaxedCaptureMode relaxed;
    if (cudaEventQuery(slot.uploaded) == cudaSuccess) return;
    if (group_ && !capturing) {
      wait_for_stream("a forward waiting for an argument slot");
      return;
    }
    if (group_) {
      group_->wait_for_event(slot.uploaded, "waiting, during a capture, for an argument slot's upload",
                             group_wait_limit_ms(), [this] { throw_if_trapped(); });
      return;
    }
    const cudaError_t done = cudaEventSynchronize(slot.uploaded);
    if (done != cudaSuccess) {
      throw_if_trapped();
      MOK_CUDA_CHECK(done);
    }
  }

  // Where computed rank d's tensors are in the `ranks` argument.
  int arg_index(int d) const { return group_ ? 0 : first_rank_ + d; }

  std::size_t arg_slot_bytes() const {
    return num_ranks_ * sizeof(RankMaps) + 3 * problem_.ep_size * sizeof(void*) + num_ranks_ * sizeof(CallRank);
  }

  static constexpr std::size_t kCacheEntries = GraphPins::kSlots;

  // Declared first, so destroyed last: the constructor and the destructor enter the layer's
  // device here, so that members constructed or freed on the way (a constructor that throws
  // included) are on that device, and the caller's device comes back after the last of them.
  OnDevice on_device_;
  Problem problem_;
  Config config_;
  LayerOptions options_;
  cudaStream_t stream_ = nullptr;
  int sms_ = 0, num_ranks_ = 0, first_rank_ = 0;
  int capacity_ = 0, cap_tiles_ = 0, ring_tiles_ = 0, chunks_ = 0;
  int chunk_ids_ = kScheduleChunkLarge;  // ids per count/scatter warp
  int schedule_count_smem_ = 0, schedule_scatter_smem_ = 0;  // dynamic smem of the schedule kernels
  int gateup_tiles_ = 0, down_tiles_ = 0, shared_row_tiles_ = 0;
  int comm_ctas_ = 0, compute_ctas_ = 0, grid_ctas_ = 0, band_ = 1, lag_ = 0;
  bool pairs_ = false;  // Config::task_pairs: 2-CTA clusters
  PlanShape plan_shape_{};  // the task order's parameters (plan_order.h)
  int pull_ahead_ = pull_ahead_from_env();
  int task_lag_ = task_lag_from_env();
  int pull_groups_ = pull_groups_from_env();  // 0 until the constructor chooses
  bool store_warp_ = store_warp_from_env();
  bool half_tiles_ = half_tiles_from_env();
  bool comm_join_ = comm_join_from_env();
  int gather_local_env_ = gather_local_from_env();  // -1: unset (the default rule), 0 off, 1 on
  bool gather_local_ = false;                       // decided by the constructor
  int head_pulls_env_ = head_pulls_from_env();  // -1: unset (the default rule), 0 off, 1 on
  int head_pull_tiles_env_ = head_pull_tiles_from_env();  // > 0: that many head pulls (tuning)
  int head_pulls_ = 0;  // head pulls per forward: fixed by the shape, the grid and the ring
  bool cooperative_ = cooperative_from_env();
  int test_fault_ = test_fault_from_env();
  std::uint64_t timeout_ns_ = wait_timeout_ns();
  std::size_t workspace_bytes_ = 0;
  // Host-mapped record of a phase wait that timed out (the kernel writes it, then traps; it
  // survives the lost context). nullptr when mapped memory is not available: the kernel
  // then traps without saying where. The claim flag picks the one thread that writes it.
  HostMapped<PhaseWaitTrap> phase_trap_;
  DeviceBuffer phase_trap_claim_;
  unsigned phase_wait_units_ = phase_wait_units(timeout_ns_);
  // record_phases(n): per recorded forward, kMaxPhaseMarks events (one before each phase and
  // one after the last) and the names of the phases it recorded.
  std::vector<cudaEvent_t> phase_events_;
  std::size_t phase_forwards_ = 0;
  std::vector<std::vector<std::string>> phase_names_;

  // The launch-wide counters at the end of counters_ (after every rank's), counted from it.
  enum LaunchCounter { kTaskCounter = 1, kCommStarted = 2, kCommJoined = 3, kHeadCounter = 4, kLaunchCounters = 4 };
  int* launch_counter(LaunchCounter c) const { return counters_.as<int>() + counters_.bytes() / sizeof(int) - c; }

  DeviceBuffer counters_, error_, group_errors_, tasks_, pulls_, task_counts_, combine_of_dev_, plans_dev_, zero_row_;
  std::vector<DeviceBuffer> combine_, rank_buffers_;
  std::vector<TensorView> own_combine_slots_;  // views of the slots above (or combine_sym_.local)
  std::vector<RankPlan> plans_host_;
  std::vector<RankMaps> fixed_maps_;
  std::list<CallArgs> cache_;
  std::vector<ArgSlot> slots_;
  std::shared_ptr<GraphPins> pins_ = std::make_shared<GraphPins>();
  // ScheduleParams::abandoned, raised before this rank's group is aborted (allocated in a
  // group, or for MOK_TEST_FAULT=abandoned_group), and the eager forwards' marks
  // (drain_before_abort). Declared before group_, whose before-abort hook uses them: the group
  // is destroyed first.
  HostMapped<int> abandoned_;
  ForwardMarks forward_marks_;
  // The megakernel_done event an eager forward is waiting for (16 forwards back), else null.
  cudaEvent_t megakernel_waited_for_ = nullptr;
  // Distributed mode only (the destructor frees the symmetric buffers while the group lives).
  std::unique_ptr<comm::EpGroup> group_;
  // Why this rank aborted its group's communicator (abort_group_after); empty while it has
  // not (a reason is never empty).
  mutable std::string group_abort_reason_;
  comm::SymmetricBuffer x_sym_, combine_sym_;
  std::vector<void*> peer_x_;
  DeviceBuffer gathered_tops_;
  // One byte per rank for the destroy's meeting (EpGroup::meet): allocated with the layer, so
  // that the destroy allocates nothing (a full GPU would otherwise fail it on one rank alone).
  DeviceBuffer teardown_scratch_;

 public:
  ~CudaBackend() override {
    bool on_layers_device = true;
    try {
      on_device_.enter(options_.cuda_device);  // (left after the last member is freed)
    } catch (const std::exception&) {
      // (A context that cannot even set its device frees what it can from here.)
      on_layers_device = false;
    }
    // A rank that fails while its peers carry on may have NCCL kernels on its stream waiting
    // for them; the frees below would wait for those: abort the communicator first.
    if (group_ && std::uncaught_exceptions() > 0) group_->abort_communicator();  // (drained first: the hook)
    if (group_ && test_fault_ == kFaultAbandonAtDestroy) abort_group_after("MOK_TEST_FAULT=abandon_at_destroy");
    // Otherwise the frees wait for the queued work, whose all-gathers a peer that failed and
    // stays alive never joins: wait for it here first, within the group's limit, which aborts
    // the communicator when it runs out (a destructor reports nothing; the reason is logged).
    if (group_ && !group_->communicator_aborted()) {
      try {
        wait_for_stream("destroying the layer");
      } catch (const std::exception&) {
      }
    }
    // Deregistering the windows (free_symmetric) is collective, and NCCL waits there for every
    // rank without a limit: a peer that aborted its communicator (a failed call of its own,
    // abandon_group) after its last collective, or that never destroys its layer, would leave
    // this rank waiting for good. So the ranks meet first where the wait is bounded (the
    // start-up limit, as before the registration in allocate()): a rank missing there aborts
    // this rank's communicator (saying so), which takes the windows with it. The meeting is
    // on the layer's own (drained) stream with memory allocated beforehand, and nothing that
    // can fail follows its gather: once a rank has passed it, its peers deregister.
    if (group_ && !group_->communicator_aborted()) {
      if (!on_layers_device) {
        abort_group_after("destroying the layer: its device could not be set");
      } else {
        try {
          group_->meet(stream_, teardown_scratch_.as<void>(), "meeting to destroy the layer (deregister its windows)");
        } catch (const std::exception& e) {
          abort_group_after(std::string("destroying the layer: ") + e.what());  // (a no-op once aborted)
        }
      }
    }
    // After an abort, the stream's NCCL work returns at once and what follows it (stage_x,
    // schedules that found the word, epilogues) runs out. The symmetric buffers (unmapped at
    // once by ncclMemFree) and the word are freed only once it has; left allocated, said so,
    // when it has not within the group's limit.
    bool stream_done = true;
    if (group_ && group_->communicator_aborted()) {
      stream_done = poll_until_done([&] { return cudaStreamQuery(stream_); },
                                    std::chrono::steady_clock::now() + std::chrono::milliseconds(group_wait_limit_ms()));
      if (!stream_done) {
        std::fprintf(stderr, "mok: rank %d: the aborted layer's stream still holds work after %llu ms; its shared "
                     "windows, abandoned word and trap record are left allocated (its other buffers' frees wait "
                     "for the device)\n", group_->rank(), static_cast<unsigned long long>(group_wait_limit_ms()));
        abandoned_.leak();
        phase_trap_.leak();
        group_->forget_symmetric(x_sym_);  // (else the group frees them)
        group_->forget_symmetric(combine_sym_);
      }
    }
    for (auto e : phase_events_) cudaEventDestroy(e);
    if (group_ && stream_done) {
      group_->free_symmetric(x_sym_);
      group_->free_symmetric(combine_sym_);
    }
  }
};

}  // namespace cuda

std::unique_ptr<BackendImpl> make_cuda_backend(const Problem& p, const Config& c, const LayerOptions& o) {
  // (A GPU of another generation is refused by the constructor, naming it.)
  require(cuda_device_count() > 0, "backend = cuda: no CUDA device is available");
  return std::make_unique<cuda::CudaBackend>(p, c, o);
}

std::vector<std::pair<const void*, std::string>> cuda_forward_kernels() {
  using namespace cuda;
  return {{reinterpret_cast<const void*>(stage_x_kernel), "stage_x_kernel"},
          {reinterpret_cast<const void*>(count_kernel(kScheduleChunkSmall)), "schedule_count_kernel"},
          {reinterpret_cast<const void*>(count_kernel(kScheduleChunkLarge)), "schedule_count_kernel"},
          {reinterpret_cast<const void*>(schedule_offsets_kernel), "schedule_offsets_kernel"},
          {reinterpret_cast<const void*>(scatter_plan_kernel(kScheduleChunkSmall)), "schedule_scatter_plan_kernel"},
          {reinterpret_cast<const void*>(scatter_plan_kernel(kScheduleChunkLarge)), "schedule_scatter_plan_kernel"},
          {reinterpret_cast<const void*>(forward_megakernel), "forward_megakernel"},
          {reinterpret_cast<const void*>(combine_epilogue_kernel), "combine_epilogue_kernel"}};
}

bool cuda_available() {
  // A GPU this build runs on (sm_90a code: Hopper, compute capability 9.0), not any GPU: on
  // another one the cuda backend refuses to start, so the CLI's and the tests' defaults
  // take the CPU reference there.
  const int n = cuda_device_count();
  for (int d = 0; d < n; ++d) {
    int major = 0, minor = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, d) == cudaSuccess &&
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, d) == cudaSuccess && major == 9 && minor == 0)
      return true;
  }
  return false;
}

int cuda_device_count() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

std::string cuda_device_name() {
  if (cuda_device_count() == 0) return "none";
  cudaDeviceProp prop;
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) return "unknown";
  return prop.name;
}

}  // namespace mok
