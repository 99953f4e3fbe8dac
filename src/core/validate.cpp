#include "core/validate.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

namespace mok {
namespace {

std::string rank_name(const char* what, int rank) {
  return std::string(what) + "[rank " + std::to_string(rank) + "]";
}

void check_inputs(const Problem& p, const RankInputs& in, int r, Device dev) {
  const std::int64_t T = p.tokens_per_rank, H = p.hidden, k = p.top_k;
  check_tensor(in.x, rank_name("x", r), DType::bf16, {T, H}, dev);
  check_tensor(in.top_experts, rank_name("top_experts", r), DType::i32, {T, k}, dev);
  check_tensor(in.router_weights, rank_name("router_weights", r), DType::f32, {T, k}, dev);
}

void check_weights(const Problem& p, const RankWeights& w, int r, Device dev) {
  const std::int64_t E = p.local_experts(), H = p.hidden, I = p.intermediate;
  check_tensor(w.w_gate, rank_name("w_gate", r), DType::bf16, {E, I, H}, dev);
  check_tensor(w.w_up, rank_name("w_up", r), DType::bf16, {E, I, H}, dev);
  check_tensor(w.w_down, rank_name("w_down", r), DType::bf16, {E, H, I}, dev);
  require(static_cast<int>(w.shared.size()) == p.num_shared(),
          rank_name("weights.shared", r) + ": holds " + std::to_string(w.shared.size()) +
              " shared experts; the problem has " + std::to_string(p.num_shared()));
  for (int s = 0; s < p.num_shared(); ++s) {
    const std::int64_t Is = p.shared_intermediate[s];
    const std::string n = "[shared " + std::to_string(s) + "]";
    check_tensor(w.shared[s].w_gate, rank_name("w_gate", r) + n, DType::bf16, {Is, H}, dev);
    check_tensor(w.shared[s].w_up, rank_name("w_up", r) + n, DType::bf16, {Is, H}, dev);
    check_tensor(w.shared[s].w_down, rank_name("w_down", r) + n, DType::bf16, {H, Is}, dev);
  }
}

}  // namespace

void check_rank_count(const Problem& p, const LayerOptions& o, std::size_t count) {
  if (o.ep_mode == EpMode::distributed) {
    require(count == 1, "ranks: " + std::to_string(count) +
                            " entries given; with ep_mode = distributed pass this process's rank only");
    return;
  }
  require(count == static_cast<std::size_t>(p.ep_size),
          "ranks: " + std::to_string(count) + " entries given; the layer needs one per rank of "
          "the EP group (ep_size = " + std::to_string(p.ep_size) + ")");
}

namespace {

template <typename Args>
void check_rank_count(const Problem& p, const LayerOptions& o, std::span<const Args> ranks) {
  check_rank_count(p, o, ranks.size());
}

void check_placement(const TensorView& t, const std::string& name, const Placement& where) {
  require(t.device_index == where.device_index,
          name + ": must be on cuda:" + std::to_string(where.device_index) + ", got " + t.describe());
  require(reinterpret_cast<std::uintptr_t>(t.data) % where.align_bytes == 0,
          name + ": its data must be " + std::to_string(where.align_bytes) +
              "-byte aligned for the cuda backend, got " + t.describe());
}

// fn(view, name) for each of a rank's weight tensors, routed then shared, named as errors name them.
template <typename Fn>
void for_each_weight(const RankWeights& w, int r, Fn fn) {
  fn(w.w_gate, rank_name("w_gate", r));
  fn(w.w_up, rank_name("w_up", r));
  fn(w.w_down, rank_name("w_down", r));
  for (std::size_t s = 0; s < w.shared.size(); ++s) {
    const std::string n = "[shared " + std::to_string(s) + "]";
    fn(w.shared[s].w_gate, rank_name("w_gate", r) + n);
    fn(w.shared[s].w_up, rank_name("w_up", r) + n);
    fn(w.shared[s].w_down, rank_name("w_down", r) + n);
  }
}

void check_weight_placement(const RankWeights& w, int r, const Placement& where) {
  for_each_weight(w, r, [&](const TensorView& t, const std::string& name) { check_placement(t, name, where); });
}

bool is_active(const LayerOptions& o, int r) {
  return o.ep_mode != EpMode::rank_slice || r == o.active_rank;
}

// Memory the call reads or writes, to find outputs that share bytes with any other tensor
// (the layer reads inputs while it writes outputs, in an order no caller should depend on).
// Inputs may overlap each other (one shared-expert weight buffer for every rank, say).
struct MemorySpan {
  std::uintptr_t begin, end;
  std::string name;
  bool output;
};

class SpanList {
 public:
  void add(const TensorView& t, std::string name, bool output) {
    if (t.data == nullptr || t.numel() <= 0) return;  // (check_tensor has refused what matters)
    const auto b = reinterpret_cast<std::uintptr_t>(t.data);
    spans_.push_back({b, b + static_cast<std::uintptr_t>(t.numel()) * dtype_size(t.dtype), std::move(name), output});
  }
  void add_inputs(const RankInputs& in, int r) {
    add(in.x, rank_name("x", r), false);
    add(in.top_experts, rank_name("top_experts", r), false);
    add(in.router_weights, rank_name("router_weights", r), false);
  }
  void add_weights(const RankWeights& w, int r) {
    for_each_weight(w, r, [&](const TensorView& t, const std::string& name) { add(t, name, false); });
  }
  // Throws naming the first output that shares memory with another tensor.
  void require_outputs_apart() {
    std::sort(spans_.begin(), spans_.end(), [](const MemorySpan& a, const MemorySpan& b) { return a.begin < b.begin; });
    for (std::size_t i = 0; i < spans_.size(); ++i)
      for (std::size_t j = i + 1; j < spans_.size() && spans_[j].begin < spans_[i].end; ++j)
        if (spans_[i].output || spans_[j].output) {
          const MemorySpan& out = spans_[i].output ? spans_[i] : spans_[j];
          const MemorySpan& other = spans_[i].output ? spans_[j] : spans_[i];
          throw Error(out.name + " overlaps " + other.name +
                      " in memory: an output must not share bytes with an input or another output");
        }
  }

 private:
  std::vector<MemorySpan> spans_;
};

}  // namespace

void check_routing_rank(const Problem& p, int rank, const std::int32_t* ids, const float* weights) {
  const std::int64_t T = p.tokens_per_rank;
  const int k = p.top_k, E = p.num_experts;
  std::vector<std::int64_t> seen(E, -1);
  std::vector<int> seen_slot(E, -1);
  // (Each message is built only when its check fails: this runs over every id of every
  // forward, 1.3M of them for one of MoK's EP-64 batches.)
  const auto where = [&](std::int64_t t, int j) {
    return "[rank " + std::to_string(rank) + "][token " + std::to_string(t) + ", slot " + std::to_string(j) + "]";
  };
  for (std::int64_t t = 0; t < T; ++t)
    for (int j = 0; j < k; ++j) {
      const std::int32_t e = ids[t * k + j];
      if (e < 0 || e >= E)
        throw Error("top_experts" + where(t, j) + " = " + std::to_string(e) + ": expert id must be in [0, " +
                    std::to_string(E) + ")");
      if (seen[e] == t)
        throw Error("top_experts[rank " + std::to_string(rank) + "][token " + std::to_string(t) + "]: expert " +
                    std::to_string(e) + " appears in slots " + std::to_string(seen_slot[e]) + " and " +
                    std::to_string(j) + "; a token's experts must be distinct");
      seen[e] = t;
      seen_slot[e] = j;
      const float w = weights[t * k + j];
      if (!std::isfinite(w))
        throw Error("router_weights" + where(t, j) + " = " + std::to_string(w) + ": must be finite");
    }
}

void check_forward_args(const Problem& p, const LayerOptions& o, std::span<const RankForward> ranks,
                        Device dev, std::optional<Placement> placement, int first_rank,
                        std::span<const TensorView> combine_slots) {
  check_rank_count(p, o, ranks);
  for (int i = 0; i < static_cast<int>(ranks.size()); ++i) {
    const int r = first_rank + i;  // the rank errors name (ranks[i] is rank first_rank + i)
    check_inputs(p, ranks[i].inputs, r, dev);
    if (placement) {
      check_placement(ranks[i].inputs.x, rank_name("x", r), *placement);
      // The routing is read an element at a time (the schedule kernels, the ids' all-gather):
      // the same device, and aligned to its 4-byte elements (which check_tensor, in
      // check_inputs above, already requires on every device; stated here with the device's
      // rule, which names the device).
      const Placement element_aligned{placement->device_index, 4};
      check_placement(ranks[i].inputs.top_experts, rank_name("top_experts", r), element_aligned);
      check_placement(ranks[i].inputs.router_weights, rank_name("router_weights", r), element_aligned);
    }
    if (!is_active(o, i)) continue;
    check_weights(p, ranks[i].weights, r, dev);
    check_tensor(ranks[i].y, rank_name("y", r), DType::bf16, {p.tokens_per_rank, p.hidden}, dev);
    if (placement) {
      check_weight_placement(ranks[i].weights, r, *placement);
      check_placement(ranks[i].y, rank_name("y", r), *placement);
    }
  }
  SpanList spans;
  for (int i = 0; i < static_cast<int>(ranks.size()); ++i) {
    const int r = first_rank + i;
    spans.add_inputs(ranks[i].inputs, r);
    if (!is_active(o, i)) continue;
    spans.add_weights(ranks[i].weights, r);
    spans.add(ranks[i].y, rank_name("y", r), true);
  }
  for (int i = 0; i < static_cast<int>(combine_slots.size()); ++i)
    spans.add(combine_slots[i], "the layer's combine_slots(" + std::to_string(first_rank + i) + ")", true);
  spans.require_outputs_apart();
}

void check_backward_args(const Problem& p, const LayerOptions& o, std::span<const RankBackward> ranks,
                         Device dev) {
  check_rank_count(p, o, ranks);
  const std::int64_t T = p.tokens_per_rank, H = p.hidden, I = p.intermediate, k = p.top_k;
  const std::int64_t E = p.local_experts();
  for (int r = 0; r < static_cast<int>(ranks.size()); ++r) {
    const auto& b = ranks[r];
    check_inputs(p, b.inputs, r, dev);
    check_tensor(b.dy, rank_name("dy", r), DType::bf16, {T, H}, dev);
    if (!is_active(o, r)) continue;
    check_weights(p, b.weights, r, dev);
    check_tensor(b.dx, rank_name("dx", r), DType::bf16, {T, H}, dev);
    check_tensor(b.d_router_weights, rank_name("d_router_weights", r), DType::f32, {T, k}, dev);
    check_tensor(b.d_w_gate, rank_name("d_w_gate", r), DType::f32, {E, I, H}, dev);
    check_tensor(b.d_w_up, rank_name("d_w_up", r), DType::f32, {E, I, H}, dev);
    check_tensor(b.d_w_down, rank_name("d_w_down", r), DType::f32, {E, H, I}, dev);
    require(static_cast<int>(b.d_shared.size()) == p.num_shared(),
            rank_name("d_shared", r) + ": holds " + std::to_string(b.d_shared.size()) +
                " entries; the problem has " + std::to_string(p.num_shared()) + " shared experts");
    for (int s = 0; s < p.num_shared(); ++s) {
      const std::int64_t Is = p.shared_intermediate[s];
      const std::string n = "[shared " + std::to_string(s) + "]";
      check_tensor(b.d_shared[s].d_w_gate, rank_name("d_w_gate", r) + n, DType::f32, {Is, H}, dev);
      check_tensor(b.d_shared[s].d_w_up, rank_name("d_w_up", r) + n, DType::f32, {Is, H}, dev);
      check_tensor(b.d_shared[s].d_w_down, rank_name("d_w_down", r) + n, DType::f32, {H, Is}, dev);
    }
  }
  SpanList spans;
  for (int r = 0; r < static_cast<int>(ranks.size()); ++r) {
    const auto& b = ranks[r];
    spans.add_inputs(b.inputs, r);
    spans.add(b.dy, rank_name("dy", r), false);
    if (!is_active(o, r)) continue;
    spans.add_weights(b.weights, r);
    spans.add(b.dx, rank_name("dx", r), true);
    spans.add(b.d_router_weights, rank_name("d_router_weights", r), true);
    spans.add(b.d_w_gate, rank_name("d_w_gate", r), true);
    spans.add(b.d_w_up, rank_name("d_w_up", r), true);
    spans.add(b.d_w_down, rank_name("d_w_down", r), true);
    for (std::size_t s = 0; s < b.d_shared.size(); ++s) {
      const std::string n = "[shared " + std::to_string(s) + "]";
      spans.add(b.d_shared[s].d_w_gate, rank_name("d_w_gate", r) + n, true);
      spans.add(b.d_shared[s].d_w_up, rank_name("d_w_up", r) + n, true);
      spans.add(b.d_shared[s].d_w_down, rank_name("d_w_down", r) + n, true);
    }
  }
  spans.require_outputs_apart();
}

}  // namespace mok
