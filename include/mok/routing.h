// mok: routing generators (which experts each token goes to, with what weight).
//
// Every generator is a pure function of (problem, spec, seed) and of the *global* token
// index n = rank*T + t, so the same global batch split over any EP size gets the same
// routing. Router weights are the softmax over the chosen experts' logits (they sum to 1).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "mok/problem.h"

namespace mok {

enum class RoutingKind : std::uint8_t {
  gaussian,  // logits ~ N(0,1) per (token, expert), top-k (as MoK)
  zipf,      // expert popularity p_e ~ 1/rank^s over a seeded permutation, k distinct draws
  hot,       // one hot expert is in `hot_fraction` of the tokens' top-k, the rest Gaussian
  worst,     // every token routed to the experts of one rank (`worst_rank`)
  file,      // read from .npy files (see RoutingSpec::path)
};

struct RoutingSpec {
  RoutingKind kind = RoutingKind::gaussian;
  double zipf_exponent = 1.2;
  double hot_fraction = 1.0;
  int hot_expert = 0;
  int worst_rank = 0;
  // kind == file: a directory holding top_experts.npy [R*T, k] (int32 or int64) and,
  // optionally, router_weights.npy [R*T, k] (float32); without it the weights are 1/k.
  std::string path;

  // "gaussian", "zipf", "zipf:1.5", "hot", "hot:0.5", "hot:0.5:7", "worst", "worst:3",
  // "file:DIR". Throws mok::Error on anything else.
  static RoutingSpec parse(const std::string& text);
  std::string describe() const;
};

// Per rank: top_experts [T*k] and router_weights [T*k], row-major [T, k].
struct Routing {
  std::vector<std::vector<std::int32_t>> top_experts;
  std::vector<std::vector<float>> router_weights;
};

Routing generate_routing(const Problem& problem, const RoutingSpec& spec, std::uint64_t seed);

// How unbalanced a routing is: rows per expert and per destination rank over their means.
struct RoutingBalance {
  double max_over_mean_expert = 0;
  double max_over_mean_rank = 0;
  std::int64_t max_rows_expert = 0;
  std::int64_t max_rows_rank = 0;
  std::int64_t total_rows = 0;
  std::vector<std::int64_t> rows_per_rank;  // rows each rank's experts receive
  int busiest_rank = 0;  // the rank with the most rows (the lowest on a tie): it sets a group's pace
};
// The routing must be valid for the problem (validate_routing): ids index the counts.
RoutingBalance routing_balance(const Problem& problem, const Routing& routing);

// Checks a routing against the problem: ids in range, distinct per token, finite weights.
// Throws mok::Error naming rank, token and slot.
void validate_routing(const Problem& problem, const Routing& routing);

}  // namespace mok
