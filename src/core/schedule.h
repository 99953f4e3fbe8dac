// mok: the schedule, MoK's order. One schedule per destination rank d lists the rows d will
// process: for each local expert in order, rows from source ranks in rank order, tokens in
// index order; each row names (source rank, slot = t*k + j). Each expert's segment is
// padded with empty rows (src_rank = -1) to a multiple of Config::tile_rows. The same
// schedule drives dispatch, combine and the whole backward. Built with counts and prefix
// sums only; the GPU builder (src/cuda/schedule.cu) must produce the same bits.
#pragma once
#include <cstdint>
#include <span>
#include <vector>

#include "mok/config.h"
#include "mok/problem.h"

namespace mok {

struct ScheduleRow {
  std::int32_t src_rank;  // -1 for a padding row
  std::int32_t slot;      // t*k + j on the source rank; -1 for a padding row
  bool operator==(const ScheduleRow&) const = default;
};

struct RankSchedule {
  std::vector<std::int64_t> expert_begin;  // [E/R + 1] padded row offsets
  std::vector<std::int64_t> expert_rows;   // [E/R] real rows per local expert
  std::vector<ScheduleRow> rows;           // [expert_begin.back()]
  std::int64_t real_rows() const;
  std::int64_t padded_rows() const { return static_cast<std::int64_t>(rows.size()); }
};

// top_experts[s] points at source rank s's [T, k] ids (already validated).
// Throws mok::Error when a rank's padded rows exceed schedule_capacity_rows().
RankSchedule build_schedule(const Problem& problem, const Config& config,
                            std::span<const std::int32_t* const> top_experts, int dest_rank);

// Every rank's schedule, equal to build_schedule's for each rank (the same error, for the
// first rank over its capacity), from one pass over the ids: build_schedule per rank reads
// every rank's ids R times.
std::vector<RankSchedule> build_schedules(const Problem& problem, const Config& config,
                                          std::span<const std::int32_t* const> top_experts);

}  // namespace mok
