#include "mok/layer.h"

#include <algorithm>
#include <mutex>
#include <thread>

#include "core/backend.h"

namespace mok {

const char* to_string(Backend backend) { return backend == Backend::cpu ? "cpu" : "cuda"; }

Backend backend_from_string(const std::string& name) {
  if (name == "cpu") return Backend::cpu;
  if (name == "cuda") return Backend::cuda;
  throw Error("backend: must be cpu or cuda, got '" + name + "'");
}

const char* to_string(EpMode mode) {
  switch (mode) {
    case EpMode::all_ranks: return "all_ranks";
    case EpMode::rank_slice: return "rank_slice";
    case EpMode::distributed: return "distributed";
  }
  return "?";
}

struct Layer::Impl {
  Problem problem;
  Config config;
  LayerOptions options;
  std::unique_ptr<BackendImpl> backend;
  // The backends keep per-call state (the CPU thread pool's one job, the CUDA argument slots,
  // the group's abort reason): calls on one Layer from several threads run one at a time.
  std::mutex calls;
};

void LayerOptions::validate() const {
  // (A bound, so that a typo cannot ask the OS for a million threads.)
  const int max_threads = static_cast<int>(std::max(16u, 4 * std::thread::hardware_concurrency()));
  require(cpu_threads >= 0 && cpu_threads <= max_threads,
          "LayerOptions.cpu_threads = " + std::to_string(cpu_threads) + ": must be in [0, " +
              std::to_string(max_threads) + "] (0 = all cores; at most 4 per core)");
  require(active_rank >= 0, "LayerOptions.active_rank = " + std::to_string(active_rank) + ": must be >= 0");
  // (Elsewhere it would be ignored: every rank is held here, or a group's rank is the process's.)
  require(ep_mode == EpMode::rank_slice || active_rank == 0,
          "LayerOptions.active_rank = " + std::to_string(active_rank) + ": only a rank slice (ep_mode rank_slice) " +
              "has an active rank; leave it 0 in " + to_string(ep_mode));
  require(cuda_device >= 0, "LayerOptions.cuda_device = " + std::to_string(cuda_device) + ": must be >= 0");
  if (backend != Backend::cpu) return;
  require(ep_mode == EpMode::all_ranks,
          std::string("LayerOptions.ep_mode = ") + to_string(ep_mode) +
              ": the cpu backend holds every rank (use all_ranks); rank_slice and distributed need the cuda backend");
  require(cuda_stream == nullptr, "LayerOptions.cuda_stream: set, but the cpu backend runs on no stream (leave it null, "
                                  "or use the cuda backend)");
  require(cuda_device == 0, "LayerOptions.cuda_device = " + std::to_string(cuda_device) +
                                ": the cpu backend uses no GPU (leave it 0, or use the cuda backend)");
}

Layer::Layer(const Problem& problem, const Config& config, const LayerOptions& options)
    : impl_(std::make_unique<Impl>()) {
  problem.validate();
  config.validate();
  options.validate();
  require(options.active_rank < problem.ep_size,
          "LayerOptions.active_rank = " + std::to_string(options.active_rank) + ": must be in [0, ep_size = " +
              std::to_string(problem.ep_size) + ")");
  impl_->problem = problem;
  impl_->options = options;
  impl_->backend = options.backend == Backend::cpu ? make_cpu_backend(problem, config, options)
                                                   : make_cuda_backend(problem, config, options);
  impl_->config = impl_->backend->resolved_config();
}

Layer::~Layer() = default;
Layer::Layer(Layer&&) noexcept = default;
Layer& Layer::operator=(Layer&&) noexcept = default;

// A moved-from Layer holds nothing: every use is an error, not a null dereference.
Layer::Impl& Layer::impl() const {
  require(impl_ != nullptr, "Layer: used after it was moved from");
  return *impl_;
}

const Problem& Layer::problem() const { return impl().problem; }
const Config& Layer::config() const { return impl().config; }
const LayerOptions& Layer::options() const { return impl().options; }
namespace {
// The layer's backend, for one call, with the layer's call lock held.
struct Locked {
  std::lock_guard<std::mutex> hold;
  BackendImpl& backend;
  explicit Locked(Layer::Impl& impl) : hold(impl.calls), backend(*impl.backend) {}
  BackendImpl* operator->() const { return &backend; }
};
}  // namespace

std::size_t Layer::workspace_bytes() const { return Locked(impl())->workspace_bytes(); }
void Layer::forward(std::span<const RankForward> ranks) { Locked(impl())->forward(ranks); }
void Layer::backward(std::span<const RankBackward> ranks) { Locked(impl())->backward(ranks); }
std::vector<ScheduleStats> Layer::last_schedule_stats() const { return Locked(impl())->last_schedule_stats(); }
void Layer::synchronize() const { Locked(impl())->synchronize(); }
void Layer::abandon_group(const std::string& why) { Locked(impl())->abandon_group(why); }
bool Layer::group_aborted() const { return Locked(impl())->group_aborted(); }

BackendImpl& LayerInternals::backend(const Layer& layer) { return *layer.impl().backend; }

TensorView Layer::combine_slots(int rank) const {
  require(rank >= 0 && rank < impl().problem.ep_size,
          "combine_slots: rank " + std::to_string(rank) + " must be in [0, ep_size)");
  return Locked(impl())->combine_slots(rank);
}

}  // namespace mok
