// mok: the MoE layer. One Layer object runs forward and backward for the ranks of an EP
// group that this process holds:
//   - EpMode::all_ranks: every rank of the group is held here (the CPU reference keeps
//     them as separate tensors; the CUDA backend runs them as "virtual ranks" on one GPU);
//   - EpMode::rank_slice: one active rank of a large group does exactly its share of the
//     work; the other ranks' inputs are read from memory filled in advance and their
//     combine slots are written as they would be over NVLink (CUDA backend only);
//   - EpMode::distributed: one process per GPU (started by `mok launch`, torchrun or mpirun);
//     this process holds one rank (its tensors are the only entry of `ranks`) and reaches the
//     others over NVLink through NCCL symmetric memory (CUDA backend only). Constructing and
//     destroying such a Layer are collective: every rank does both. A rank that gives up on
//     its peers throws mok::PeerWaitError; a destroy waits for its queued work at most the
//     group's wait limit, then aborts the communicator (saying so on stderr), and otherwise
//     meets the peers within the group's start-up limit (a peer that aborted or never comes
//     makes it abort too) and tears it down with them; a Layer destroyed while an exception propagates aborts
//     it at once instead of waiting. A forward that throws on
//     one rank (a bad argument, say) leaves the group out of step, since its peers went on:
//     that rank's communicator is aborted at once, its later forwards, backwards and
//     synchronizes throw naming the first error, and destroying its Layer waits for no peer
//     (only, within the group's wait limit, for its own running megakernels and queued work)
//     (build a new Layer to go on, and drop the CUDA graphs captured with this one: their
//     all-gathers and peer pointers belong to the aborted communicator); abandon_group does
//     the same on request. A
//     device-side failure (Layer::synchronize) reaches every rank through the group's
//     barrier instead: the group stays in step and the next forward runs.
//
// Tensors are row-major and contiguous; every call validates every argument and throws
// mok::Error naming the argument and the rule it broke, before any work starts. On the CUDA
// backend what only the data can tell (an expert id out of range or repeated in a token's row,
// a weight that is not finite, more rows for a rank than the schedule's capacity) is found on
// the device: y is NaN and Layer::synchronize throws the error. The error stays recorded
// until that synchronize reports it: forwards queued or made after it, CUDA graph replays
// included, skip their routed work and give NaN too, whatever their inputs (synchronize
// before relying on a forward after a failed one). A call that throws once its work has
// started (the host out of memory part way, on the CPU backend) may have written part of its
// outputs: they are not the call's results, and the error says so by being raised.
//
// Threads: calls on one Layer from several threads run one at a time (each waits for the one
// in progress; abandon_group too, so it cannot interrupt a call: the group's wait limits do).
// Destroying a Layer while another thread calls it is the caller's error. Separate Layers
// run independently.
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "mok/config.h"
#include "mok/error.h"
#include "mok/problem.h"
#include "mok/tensor.h"

namespace mok {

struct LayerInternals;

enum class Backend : std::uint8_t { cpu, cuda };
const char* to_string(Backend backend);
Backend backend_from_string(const std::string& name);  // throws mok::Error

enum class EpMode : std::uint8_t { all_ranks, rank_slice, distributed };
const char* to_string(EpMode mode);

// One shared expert's weights (replicated on every rank), bf16:
//   w_gate [I_s, H], w_up [I_s, H], w_down [H, I_s].
struct SharedExpertWeights {
  TensorView w_gate, w_up, w_down;
};

// The routed experts this rank owns (E/R of them) and the shared experts, bf16:
//   w_gate [E/R, I, H], w_up [E/R, I, H], w_down [E/R, H, I].
struct RankWeights {
  TensorView w_gate, w_up, w_down;
  std::vector<SharedExpertWeights> shared;
};

// What a rank brings to the layer:
//   x [T, H] bf16; top_experts [T, k] i32 (global ids, distinct per token);
//   router_weights [T, k] f32 (finite).
struct RankInputs {
  TensorView x, top_experts, router_weights;
};

struct RankForward {
  RankInputs inputs;
  RankWeights weights;  // may be empty for a non-active rank in rank_slice mode
  // [T, H] bf16 out. rank_slice mode writes only the active rank's: a non-active rank's y may
  // be empty, and when given it is neither checked nor written (its tokens' rows come from
  // ranks this process does not run).
  TensorView y;
};

// Gradients of one shared expert's weights, f32, the shapes of the weights.
struct SharedExpertGrads {
  TensorView d_w_gate, d_w_up, d_w_down;
};

struct RankBackward {
  RankInputs inputs;
  RankWeights weights;
  TensorView dy;                // [T, H] bf16 in
  TensorView dx;                // [T, H] bf16 out
  TensorView d_router_weights;  // [T, k] f32 out
  TensorView d_w_gate, d_w_up;  // [E/R, I, H] f32 out (this rank's routed experts)
  TensorView d_w_down;          // [E/R, H, I] f32 out
  std::vector<SharedExpertGrads> d_shared;  // f32 out: this rank's tokens' contribution
};

struct LayerOptions {
  Backend backend = Backend::cpu;
  EpMode ep_mode = EpMode::all_ranks;
  int active_rank = 0;        // rank_slice: the rank that does its work (0 in the other modes)
  int cpu_threads = 0;        // cpu backend: 0 = hardware concurrency
  // cuda backend: the layer's GPU (distributed: instead the launcher's local rank, or device 0
  // where the process sees one GPU, its own). Every call
  // runs there whichever device the calling thread has current, and leaves that one current.
  int cuda_device = 0;
  // cuda backend: a cudaStream_t of that GPU (one of another GPU is refused when the Layer is
  // made), nullptr = its legacy default stream. It must outlive the Layer: the destructor waits on it (the CUDA runtime cannot tell a destroyed
  // stream's handle from a live one; using it is undefined, a crash in practice).
  void* cuda_stream = nullptr;

  // The rules of these fields that hold whatever the problem (the Layer constructor also
  // bounds active_rank by ep_size): active_rank >= 0, and 0 outside a rank slice (it would be
  // ignored), cpu_threads in range, cuda_device >= 0, and on the cpu
  // backend, which holds every rank on the host, ep_mode all_ranks and no CUDA device or
  // stream (a value there would be ignored). Throws mok::Error naming the field; for callers
  // that check before any work (mok run).
  void validate() const;
};

// Per-rank statistics of the last schedule (for reports and tests).
struct ScheduleStats {
  std::vector<std::int64_t> rows_per_local_expert;  // real rows, before padding
  std::int64_t real_rows = 0;
  std::int64_t padded_rows = 0;
  std::int64_t capacity_rows = 0;
  // cuda backend: routed tasks (gate/up and down) of tiles whose rows 64..127 are padding,
  // computed by one consumer warpgroup (MOK_HALF_TILES); 0 on the cpu backend.
  std::int64_t half_tile_tasks = 0;
  // cuda backend: communication CTAs of the forward's launch that went on to compute tasks
  // once their pulls were done (MOK_COMM_JOIN; the same for every rank of one launch).
  std::int64_t joined_comm_ctas = 0;
  // cuda backend: claims made on the forward's head-pull counter (MOK_HEAD_PULLS): the head's
  // pulls plus each CTA's one last claim, which found the head taken; 0 when the launch had
  // no head (head pulls off, pair mode, or no pulls). One launch's count, the same for every
  // rank of it.
  std::int64_t head_pull_claims = 0;
};

class Layer {
 public:
  Layer(const Problem& problem, const Config& config, const LayerOptions& options);
  ~Layer();
  Layer(Layer&&) noexcept;
  Layer& operator=(Layer&&) noexcept;

  const Problem& problem() const;
  const Config& config() const;        // with the library's choices filled in
  const LayerOptions& options() const;
  // Device (or host) memory the layer holds for its buffers, in bytes.
  std::size_t workspace_bytes() const;

  // `ranks` holds all R ranks (all_ranks mode), all R ranks' inputs with the active
  // rank's weights and outputs (rank_slice mode), or this process's rank only (distributed).
  // On the CUDA backend the call is asynchronous on the stream given in the options: the host
  // does not wait for the device (a new tensor set waits only while the host is as many new
  // sets ahead of the stream as there are slots no live CUDA graph holds: 8 with none; in
  // distributed mode an eager forward also waits, within the group's wait limit, while the
  // megakernel of the forward 16 calls back is unfinished). It captures into a CUDA graph; the
  // 8 tensor sets seen last are kept ready (their pointers and tensor maps uploaded), and a set
  // a graph captured stays reserved for its replays while that graph or an executable graph
  // made from it lives (a capture with a new set takes the slot of the least recently used set
  // no live graph holds, as an eager call does; with all 8 held, a new set waits up to a second
  // for a graph destroyed just now to let go, then throws). A graph's replays use the layer's
  // workspace (counters, rows, combine slots, argument slots) as its eager forwards do:
  // launch them on the layer's stream, or order them with it (events), never beside it.
  void forward(std::span<const RankForward> ranks);
  // The backward pass: built on the cpu backend (the reference); the cuda backend throws
  // mok::Error saying it is not built yet.
  void backward(std::span<const RankBackward> ranks);

  // The schedule statistics of the last call, per rank held here (forces a sync on CUDA).
  std::vector<ScheduleStats> last_schedule_stats() const;

  // Waits for the layer's outstanding device work and reports a device-side failure
  // (capacity overflow, a timed-out wait) as mok::Error. No-op on the CPU backend.
  void synchronize() const;

  // Distributed mode: this rank gives up on its EP group now, without waiting for the peers.
  // Its NCCL communicator is aborted (the peers' waits then time out and name this rank),
  // every later forward, backward and synchronize throws saying why (`why`), and destroying
  // the Layer waits for no peer. For a rank that stops after an error its peers may not share,
  // caught above the Layer (a Layer destroyed while an exception propagates does this by
  // itself). Forwards still queued on the layer's stream read the peers' memory through the
  // communicator, which the abort unmaps: the abort first waits for a megakernel that may be
  // running (never for a peer), and a forward whose ids were not yet gathered keeps off the
  // peers (its y is NaN). Not covered: CUDA graph replays already past their schedule, and
  // NCCL's own queued collectives (NCCL's abort handles those). Other modes and the CPU
  // backend hold no group: nothing to abandon, and the Layer goes on as before.
  void abandon_group(const std::string& why);
  // Distributed mode: whether this rank's communicator was aborted (abandon_group, a failed
  // call, or a wait that gave up on the peers), so that destroying the Layer waits for no peer.
  // False without a group.
  bool group_aborted() const;

  // The combine slots of rank r, bf16 [T*k, H]: slot t*k+j receives the row that
  // expert top_experts[t,j] produced for token t. Exposed for tests and rank_slice runs
  // (where the slots other ranks would write are filled in advance). The view is the layer's
  // own memory, valid for the Layer's life (on the cpu backend, from its first forward on);
  // each forward rewrites it, so a forward refuses it, or any part of it, as an argument.
  // On the cpu backend, after a forward that threw part way (out of memory), this throws
  // until a forward succeeds: the slots then hold part of that forward's rows.
  TensorView combine_slots(int rank) const;

  struct Impl;

 private:
  friend struct LayerInternals;
  Impl& impl() const;  // throws mok::Error on a moved-from Layer
  std::unique_ptr<Impl> impl_;
};

// True when the CUDA backend was built and a GPU it runs on is present: a Hopper GPU (sm_90;
// the build's code is sm_90a). Another GPU does not count: the cuda backend refuses it.
bool cuda_available();
std::string cuda_device_name();

// The library's version (CMake's project version, e.g. "0.1.0"; pip's and find_package's too)
// and the commit it was built from: 12 hex digits, with "-dirty" when tracked files differed
// from it, or "unknown" when built outside a git checkout.
std::string version();
std::string build_commit();

}  // namespace mok
