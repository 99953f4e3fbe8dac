// mok: the CPU reference backend. Computes exactly the layer of docs/DESIGN.md for ranks
// held in this process, each rank's tensors separate, through MoK's data flow: schedule,
// dispatch (gather rows in schedule order), routed and shared SwiGLU FFNs, combine into the
// owners' slots, fixed-order epilogue; and the backward with every gradient.
//
// Numerics (bf16 mode): operands bf16, products and sums fp32 in the fixed order of
// reference/gemm.h; the SwiGLU output `a` is rounded to bf16 before the down projection;
// each expert's output row is rounded to bf16 into its combine slot (shared experts into
// their own [T,H] bf16 buffers); y = bf16(sum_s shared_s + sum_j w_j * combine_j), fp32,
// shared experts first, then j in order, each term a rounded product then a rounded add.
// mxfp8 mode: every GEMM operand is replaced by its MXFP8 round trip, blocks of 32 along
// that GEMM's contraction dimension (activations from their fp32 values).
#pragma once
#include <cstdint>
#include <span>
#include <vector>

#include "core/schedule.h"
#include "mok/layer.h"
#include "reference/parallel.h"

namespace mok::ref {

// Combine slots of one rank: bf16 bits [T*k, H].
using SlotBuffer = std::vector<std::uint16_t>;

// The real rows of destination rank `dest`'s schedule, in schedule order: bf16 [n, H],
// each row the expert's output before the router weight.
SlotBuffer routed_rows_rank(const Problem& problem, ThreadPool& pool, const RankSchedule& sched, int dest,
                            std::span<const RankForward> ranks);

// Routed expert rows of destination rank `dest`: reads x of every source rank, writes each
// produced row into combine[src][slot]. Only the slots routed to `dest` are touched.
void routed_forward_rank(const Problem& problem, ThreadPool& pool, const RankSchedule& sched,
                         int dest, std::span<const RankForward> ranks,
                         std::span<SlotBuffer> combine);

// The shared experts of one rank on its own tokens: one bf16 [T, H] buffer per expert.
std::vector<SlotBuffer> shared_forward_rank(const Problem& problem, ThreadPool& pool, const RankForward& rank);

// y = bf16(sum_s shared_s + sum_j w_j * combine_j) in the fixed order (see the top).
void combine_epilogue_rank(const Problem& problem, ThreadPool& pool, const std::vector<SlotBuffer>& shared_out,
                           const SlotBuffer& combine, const float* router_weights, std::uint16_t* y);

// Full forward of all ranks (ranks.size() == R) under their schedules (one per rank, from
// build_all_schedules). If `combine_out` is given, it receives every rank's combine slots,
// written in place when it already holds R buffers of the slots' size (so views of them stay
// valid from one forward to the next: the cpu backend's combine_slots()).
void forward(const Problem& problem, ThreadPool& pool, std::span<const RankForward> ranks,
             std::span<const RankSchedule> schedules, std::vector<SlotBuffer>* combine_out = nullptr);

void backward(const Problem& problem, ThreadPool& pool, std::span<const RankBackward> ranks,
              std::span<const RankSchedule> schedules);

// All R schedules for host routing tensors (validated by the caller).
std::vector<RankSchedule> build_all_schedules(const Problem& problem, const Config& config,
                                              std::span<const RankInputs> inputs);

}  // namespace mok::ref
