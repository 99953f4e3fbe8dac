// mok: argument validation shared by every backend. Each check throws mok::Error naming
// the argument (with rank, token and slot where it applies) and the rule it broke.
#pragma once
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>

#include "mok/layer.h"

namespace mok {

// Host routing data of one rank: ids in [0, E), distinct per token, finite weights.
void check_routing_rank(const Problem& p, int rank, const std::int32_t* ids, const float* weights);

// `count` rank entries for a call: one per rank of the group, or this process's one in
// distributed mode. (The C interface checks it before reading its array.)
void check_rank_count(const Problem& p, const LayerOptions& o, std::size_t count);

// Where a backend needs the tensors it moves in bulk: on one device, their data aligned.
struct Placement {
  int device_index;
  std::size_t align_bytes;
};

// Shapes, dtypes, devices and presence of every tensor. `active` lists the ranks whose
// weights and outputs must be present (all of them unless in rank_slice mode). With a
// placement, x, y and the weights must also be where it says, and the routing (top_experts,
// router_weights) on its device, aligned to its 4-byte elements.
// `first_rank`: the rank ranks[0] is, for the names errors give (a distributed process
// passes its own rank only).
// `combine_slots`: the layer's own combine slots here, rank first_rank + i's at i (empty
// before they exist). The forward writes and reads them, so no argument may share their
// bytes: a combine_slots() view handed back as x or y is refused, as an overlap is.
void check_forward_args(const Problem& p, const LayerOptions& o, std::span<const RankForward> ranks,
                        Device device, std::optional<Placement> placement = std::nullopt, int first_rank = 0,
                        std::span<const TensorView> combine_slots = {});
void check_backward_args(const Problem& p, const LayerOptions& o, std::span<const RankBackward> ranks,
                         Device device);

}  // namespace mok
