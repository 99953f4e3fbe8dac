// mok: the CPU reference behind mok::Layer (Backend::cpu).
#include <algorithm>

#include "core/backend.h"
#include "core/validate.h"
#include "reference/reference.h"

namespace mok {
namespace {

class CpuBackend final : public BackendImpl {
 public:
  // (LayerOptions::validate has refused what this backend does not take: other EP modes, a
  // CUDA device or stream.)
  CpuBackend(const Problem& p, const Config& c, const LayerOptions& o)
      : problem_(p), config_(c), pool_(o.cpu_threads) {}

  void forward(std::span<const RankForward> ranks) override {
    const ref::DefaultFloatEnvironment float_environment;  // (parallel.h)
    std::vector<TensorView> slots;
    for (int r = 0; r < static_cast<int>(combine_.size()); ++r) slots.push_back(slots_view(r));
    check_forward_args(problem_, {}, ranks, Device::cpu, std::nullopt, 0, slots);
    std::vector<RankInputs> inputs;
    for (int r = 0; r < problem_.ep_size; ++r) {
      check_routing_rank(problem_, r, ranks[r].inputs.top_experts.as<const std::int32_t>(),
                         ranks[r].inputs.router_weights.as<const float>());
      inputs.push_back(ranks[r].inputs);
    }
    const auto scheds = schedule(inputs);
    // (In place after the first forward: a combine_slots() view stays valid for the layer's
    // life, as on the cuda backend, showing the latest forward's slots.) A forward that throws
    // part way (out of host memory) leaves them part written: not offered as whole after it.
    slots_whole_ = false;
    ref::forward(problem_, pool_, ranks, scheds, &combine_);
    slots_whole_ = true;
  }

  void backward(std::span<const RankBackward> ranks) override {
    const ref::DefaultFloatEnvironment float_environment;  // (parallel.h)
    check_backward_args(problem_, {}, ranks, Device::cpu);
    std::vector<RankInputs> inputs;
    for (int r = 0; r < problem_.ep_size; ++r) {
      check_routing_rank(problem_, r, ranks[r].inputs.top_experts.as<const std::int32_t>(),
                         ranks[r].inputs.router_weights.as<const float>());
      inputs.push_back(ranks[r].inputs);
    }
    ref::backward(problem_, pool_, ranks, schedule(inputs));
  }

  std::vector<ScheduleStats> last_schedule_stats() const override { return stats_; }

  TensorView combine_slots(int rank) const override {
    require(!combine_.empty(), "combine_slots: no forward has run yet");
    require(slots_whole_, "combine_slots: the latest forward failed part way (its call raised the error), so the "
                          "slots hold part of its rows; they are whole again after a forward that succeeds");
    return slots_view(rank);
  }

  std::size_t workspace_bytes() const override {
    std::size_t n = 0;
    for (const auto& c : combine_) n += c.size() * sizeof(std::uint16_t);
    return n;
  }

  Config resolved_config() const override { return config_; }

  std::vector<std::vector<ScheduleRow>> last_schedules() const override { return schedules_; }

 private:
  TensorView slots_view(int rank) const {
    auto& buf = const_cast<ref::SlotBuffer&>(combine_[rank]);
    return TensorView::contiguous(buf.data(), DType::bf16,
                                  {std::int64_t(problem_.tokens_per_rank) * problem_.top_k, problem_.hidden});
  }

  // Builds every rank's schedule and records its statistics.
  std::vector<RankSchedule> schedule(const std::vector<RankInputs>& inputs) {
    auto scheds = ref::build_all_schedules(problem_, config_, inputs);
    schedules_.clear();
    for (const auto& s : scheds) schedules_.push_back(s.rows);
    stats_.clear();
    for (const auto& s : scheds)
      stats_.push_back({s.expert_rows, s.real_rows(), s.padded_rows(), schedule_capacity_rows(problem_, config_)});
    return scheds;
  }

  Problem problem_;
  Config config_;
  ref::ThreadPool pool_;
  std::vector<ref::SlotBuffer> combine_;
  bool slots_whole_ = true;  // false while a forward writes them, and after one that threw
  std::vector<ScheduleStats> stats_;
  std::vector<std::vector<ScheduleRow>> schedules_;
};

}  // namespace

std::unique_ptr<BackendImpl> make_cpu_backend(const Problem& p, const Config& c, const LayerOptions& o) {
  return std::make_unique<CpuBackend>(p, c, o);
}

}  // namespace mok
