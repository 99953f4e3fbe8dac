// mok: what a backend implements behind mok::Layer. The Layer validates the problem, the
// config and every argument's shape/dtype/device before a backend sees them.
#pragma once
#include <memory>
#include <string>
#include <utility>
#include <span>
#include <vector>

#include "core/schedule.h"
#include "mok/layer.h"

namespace mok {

struct PhaseTime {
  std::string name;  // setup, schedule, megakernel, group_barrier, epilogue
  double ms;
};

class BackendImpl {
 public:
  virtual ~BackendImpl() = default;
  virtual void forward(std::span<const RankForward> ranks) = 0;
  virtual void backward(std::span<const RankBackward> ranks) = 0;
  virtual std::vector<ScheduleStats> last_schedule_stats() const = 0;
  virtual void synchronize() const {}
  // Distributed mode: abort the group's communicator (Layer::abandon_group); no group, no-op.
  virtual void abandon_group(const std::string& /*why*/) {}
  virtual bool group_aborted() const { return false; }
  virtual TensorView combine_slots(int rank) const = 0;
  virtual std::size_t workspace_bytes() const = 0;
  // The config with the backend's choices (comm SMs, ...) filled in.
  virtual Config resolved_config() const = 0;
  // The schedules of the last call, one per rank computed here (for tests).
  virtual std::vector<std::vector<ScheduleRow>> last_schedules() const = 0;
  // Phase timing (benchmarks): record_phases(n) makes the next n forwards each record device
  // events between their phases, with no host wait between forwards, so they run back to
  // back as timed forwards do. phase_times() (which waits
  // for the device) returns each recorded forward's split, in call order. The events
  // serialise what PDL overlaps, so the phases sum to a little more than an untimed forward.
  // record_phases(0) stops and forgets. Empty where a backend does not record phases.
  virtual void record_phases(int /*forwards*/) {}
  virtual std::vector<std::vector<PhaseTime>> phase_times() const { return {}; }
};

// CUDA devices this process sees (0 without CUDA or a GPU): a group's rank picks its device
// among them (comm::GroupEnvironment::cuda_device).
int cuda_device_count();

// The CUDA forward's kernels (host stub address, name), to recognise them in captured
// graphs; empty without CUDA.
std::vector<std::pair<const void*, std::string>> cuda_forward_kernels();

// Internal access to a Layer's backend (tests, benchmarks).
struct LayerInternals {
  static BackendImpl& backend(const Layer& layer);
};

std::unique_ptr<BackendImpl> make_cpu_backend(const Problem& p, const Config& c, const LayerOptions& o);
// Defined in src/cuda/ when CUDA is built, else a stub that throws mok::Error.
std::unique_ptr<BackendImpl> make_cuda_backend(const Problem& p, const Config& c, const LayerOptions& o);

}  // namespace mok
