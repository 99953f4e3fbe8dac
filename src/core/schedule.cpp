#include "core/schedule.h"

#include <algorithm>
#include <string>

#include "core/numbers.h"
#include "mok/error.h"

namespace mok {

std::int64_t RankSchedule::real_rows() const {
  std::int64_t n = 0;
  for (auto r : expert_rows) n += r;
  return n;
}

namespace {

// The error for a rank whose padded rows exceed the capacity (one text for both builders).
void check_capacity(const Problem& problem, const Config& config, int dest_rank, std::int64_t padded) {
  const std::int64_t capacity = schedule_capacity_rows(problem, config);
  if (padded > capacity) {
    throw Error("schedule: rank " + std::to_string(dest_rank) + " receives " + std::to_string(padded) +
                " padded rows, more than its capacity of " + std::to_string(capacity) +
                " (Config.schedule_capacity_factor = " + exact_number(config.schedule_capacity_factor) +
                "); raise schedule_capacity_factor (1.0 covers every routing). No token was dropped: "
                "nothing ran.");
  }
}

}  // namespace

std::vector<RankSchedule> build_schedules(const Problem& problem, const Config& config,
                                          std::span<const std::int32_t* const> top_experts) {
  const int R = problem.ep_size, E = problem.num_experts, E_loc = problem.local_experts(), k = problem.top_k;
  const std::int64_t T = problem.tokens_per_rank;
  // A counting sort of every routed id by its expert: scanned in (source rank, slot) order,
  // each expert's rows come out in MoK's order (source ranks in order, tokens in order).
  std::vector<std::int64_t> first(std::size_t(E) + 1, 0);
  for (int s = 0; s < R; ++s)
    for (std::int64_t i = 0; i < T * k; ++i) ++first[std::size_t(top_experts[s][i]) + 1];
  for (int e = 0; e < E; ++e) first[e + 1] += first[e];
  std::vector<ScheduleRow> by_expert(static_cast<std::size_t>(first[E]));
  std::vector<std::int64_t> next(first.begin(), first.end() - 1);
  for (int s = 0; s < R; ++s)
    for (std::int64_t i = 0; i < T * k; ++i)
      by_expert[next[top_experts[s][i]]++] = ScheduleRow{s, static_cast<std::int32_t>(i)};

  std::vector<RankSchedule> scheds(R);
  for (int d = 0; d < R; ++d) {
    RankSchedule& sched = scheds[d];
    sched.expert_begin.assign(E_loc + 1, 0);
    sched.expert_rows.assign(E_loc, 0);
    std::int64_t pos = 0;
    for (int e = 0; e < E_loc; ++e) {
      const int g = d * E_loc + e;
      sched.expert_begin[e] = pos;
      sched.expert_rows[e] = first[g + 1] - first[g];
      pos += (sched.expert_rows[e] + config.tile_rows - 1) / config.tile_rows * config.tile_rows;
    }
    sched.expert_begin[E_loc] = pos;
    check_capacity(problem, config, d, pos);
    sched.rows.assign(pos, ScheduleRow{-1, -1});
    for (int e = 0; e < E_loc; ++e) {
      const int g = d * E_loc + e;
      std::copy(by_expert.begin() + first[g], by_expert.begin() + first[g + 1],
                sched.rows.begin() + sched.expert_begin[e]);
    }
  }
  return scheds;
}

RankSchedule build_schedule(const Problem& problem, const Config& config,
                            std::span<const std::int32_t* const> top_experts, int dest_rank) {
  const int R = problem.ep_size, E_loc = problem.local_experts(), k = problem.top_k;
  const std::int64_t T = problem.tokens_per_rank;
  const int first_expert = dest_rank * E_loc;

  // counts[e][s]: rows local expert e receives from source rank s.
  std::vector<std::int64_t> counts(std::size_t(E_loc) * R, 0);
  for (int s = 0; s < R; ++s)
    for (std::int64_t i = 0; i < T * k; ++i) {
      const int e = top_experts[s][i] - first_expert;
      if (e >= 0 && e < E_loc) ++counts[std::size_t(e) * R + s];
    }

  RankSchedule sched;
  sched.expert_begin.assign(E_loc + 1, 0);
  sched.expert_rows.assign(E_loc, 0);
  // Prefix sums: the (e, s) block starts at offset[e][s].
  std::vector<std::int64_t> offset(std::size_t(E_loc) * R, 0);
  std::int64_t pos = 0;
  for (int e = 0; e < E_loc; ++e) {
    sched.expert_begin[e] = pos;
    std::int64_t n = 0;
    for (int s = 0; s < R; ++s) {
      offset[std::size_t(e) * R + s] = pos + n;
      n += counts[std::size_t(e) * R + s];
    }
    sched.expert_rows[e] = n;
    pos += (n + config.tile_rows - 1) / config.tile_rows * config.tile_rows;
  }
  sched.expert_begin[E_loc] = pos;

  check_capacity(problem, config, dest_rank, pos);

  sched.rows.assign(pos, ScheduleRow{-1, -1});
  for (int s = 0; s < R; ++s)
    for (std::int64_t i = 0; i < T * k; ++i) {
      const int e = top_experts[s][i] - first_expert;
      if (e >= 0 && e < E_loc)
        sched.rows[offset[std::size_t(e) * R + s]++] = ScheduleRow{s, static_cast<std::int32_t>(i)};
    }
  return sched;
}

}  // namespace mok
