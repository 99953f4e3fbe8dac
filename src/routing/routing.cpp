#include "mok/routing.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <limits>
#include <numeric>
#include <sstream>

#include "core/numbers.h"
#include "core/rng.h"
#include "core/validate.h"
#include "io/npy.h"
#include "mok/error.h"
#include "reference/parallel.h"

namespace mok {
namespace {

// The rules of the spec's numbers (check_spec_numbers), said too when one cannot be read.
constexpr const char* kZipfExponentRule = "must be finite and >= 0";
constexpr const char* kHotFractionRule = "must be in [0, 1]";

// A number field; `rule` (one of the above) is said when the number cannot be read.
double parse_number(const std::string& text, const std::string& what, const std::string& rule) {
  double v = 0;
  const DecimalRead read = read_decimal(text, v);
  if (read == DecimalRead::not_a_number) throw Error("routing: " + what + " '" + text + "' is not a number");
  if (read != DecimalRead::ok) throw Error("routing: " + what + " " + out_of_double_range(text, read) + "; " + rule);
  return v;
}

// An integer field, written as an integer (as the command line's integers are: "1.0", "1e0"
// and "-0.0" are not), that fits an int; its range is checked with the problem.
int parse_int(const std::string& text, const std::string& what) {
  return static_cast<int>(parse_integer(text, std::numeric_limits<int>::min(), std::numeric_limits<int>::max(),
                                        "routing: " + what));
}


// Writes the k chosen experts of one token in descending key order (ties: lower id first)
// and their router weights: the softmax of their Gaussian logits.
void finish_token(std::vector<std::pair<float, int>>& keyed, int k, std::uint64_t seed, std::int64_t n,
                  int E, std::int32_t* ids, float* weights) {
  std::partial_sort(keyed.begin(), keyed.begin() + k, keyed.end(), [](const auto& a, const auto& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  });
  double mx = -1e30;
  std::vector<double> logit(k);
  for (int j = 0; j < k; ++j) {
    ids[j] = keyed[j].second;
    logit[j] = rng::normal(seed, rng::kLogits, std::uint64_t(n) * E + keyed[j].second);
    mx = std::max(mx, logit[j]);
  }
  double sum = 0;
  for (int j = 0; j < k; ++j) sum += std::exp(logit[j] - mx);
  for (int j = 0; j < k; ++j) weights[j] = static_cast<float>(std::exp(logit[j] - mx) / sum);
}

Routing routing_from_files(const Problem& p, const RoutingSpec& spec) {
  namespace fs = std::filesystem;
  const std::int64_t N = std::int64_t(p.ep_size) * p.tokens_per_rank;
  const fs::path dir(spec.path);
  const std::string top_path = (dir / "top_experts.npy").string();
  const std::string context = "routing file:" + spec.path;
  if (!npy::regular_file_at(top_path, context)) throw Error(context + ": no top_experts.npy in that directory");
  const HostTensor top = npy::load(top_path, DType::i32, {N, p.top_k});
  HostTensor w;
  const std::string w_path = (dir / "router_weights.npy").string();
  const bool has_weights = npy::regular_file_at(w_path, context);
  if (has_weights) w = npy::load(w_path, DType::f32, {N, p.top_k});
  Routing r;
  const std::int64_t per = std::int64_t(p.tokens_per_rank) * p.top_k;
  for (int rank = 0; rank < p.ep_size; ++rank) {
    r.top_experts.emplace_back(top.data<std::int32_t>() + rank * per, top.data<std::int32_t>() + (rank + 1) * per);
    if (has_weights)
      r.router_weights.emplace_back(w.data<float>() + rank * per, w.data<float>() + (rank + 1) * per);
    else
      r.router_weights.emplace_back(per, 1.0f / float(p.top_k));
  }
  try {
    validate_routing(p, r);
  } catch (const Error& e) {
    // (Rank r's token t is row r * tokens_per_rank + t of the files.)
    throw Error("routing file:" + spec.path + " (top_experts.npy" + (has_weights ? ", router_weights.npy" : "") +
                ", rows = rank * " + std::to_string(p.tokens_per_rank) + " + token): " + e.what());
  }
  return r;
}

// The spec's numbers, whichever way it was made.
void check_spec_numbers(const RoutingSpec& s) {
  if (s.kind == RoutingKind::zipf)
    require(std::isfinite(s.zipf_exponent) && s.zipf_exponent >= 0,
            "routing: zipf exponent " + std::string(kZipfExponentRule) + ", got " + exact_number(s.zipf_exponent));
  if (s.kind == RoutingKind::hot)
    require(s.hot_fraction >= 0 && s.hot_fraction <= 1,
            "routing: hot fraction " + std::string(kHotFractionRule) + ", got " + exact_number(s.hot_fraction));
}

}  // namespace

RoutingSpec RoutingSpec::parse(const std::string& text) {
  RoutingSpec s;
  const auto parts = split_fields(text, ':');  // "zipf:" has an empty exponent: an error
  const std::string kind = parts.empty() ? "" : parts[0];
  auto want_at_most = [&](std::size_t n) {
    if (parts.size() > n) throw Error("routing: too many ':' fields in '" + text + "'");
  };
  if (kind == "gaussian") {
    s.kind = RoutingKind::gaussian;
    want_at_most(1);
  } else if (kind == "zipf") {
    s.kind = RoutingKind::zipf;
    want_at_most(2);
    if (parts.size() > 1) s.zipf_exponent = parse_number(parts[1], "zipf exponent", kZipfExponentRule);
  } else if (kind == "hot") {
    s.kind = RoutingKind::hot;
    want_at_most(3);
    if (parts.size() > 1) s.hot_fraction = parse_number(parts[1], "hot fraction", kHotFractionRule);
    if (parts.size() > 2) s.hot_expert = parse_int(parts[2], "hot expert");
  } else if (kind == "worst") {
    s.kind = RoutingKind::worst;
    want_at_most(2);
    if (parts.size() > 1) s.worst_rank = parse_int(parts[1], "worst rank");
  } else if (kind == "file") {
    s.kind = RoutingKind::file;
    s.path = text.size() > 5 ? text.substr(5) : "";
    require(!s.path.empty(), "routing: file needs a directory, as file:DIR");
  } else {
    throw Error("routing: unknown kind '" + text +
                "'; expected gaussian, zipf[:s], hot[:fraction[:expert]], worst[:rank] or file:DIR");
  }
  check_spec_numbers(s);
  return s;
}

std::string RoutingSpec::describe() const {
  std::ostringstream s;
  switch (kind) {
    case RoutingKind::gaussian: s << "gaussian"; break;
    case RoutingKind::zipf: s << "zipf:" << exact_number(zipf_exponent); break;
    case RoutingKind::hot: s << "hot:" << exact_number(hot_fraction) << ":" << hot_expert; break;
    case RoutingKind::worst: s << "worst:" << worst_rank; break;
    case RoutingKind::file: s << "file:" << path; break;
  }
  return s.str();
}

Routing generate_routing(const Problem& p, const RoutingSpec& spec, std::uint64_t seed) {
  p.validate();
  if (spec.kind == RoutingKind::file) return routing_from_files(p, spec);
  const int E = p.num_experts, k = p.top_k, R = p.ep_size, E_loc = p.local_experts();
  const std::int64_t T = p.tokens_per_rank;
  check_spec_numbers(spec);  // (parse checked them too; a spec may be built directly)
  if (spec.kind == RoutingKind::hot)
    require(spec.hot_expert >= 0 && spec.hot_expert < E,
            "routing: hot expert " + std::to_string(spec.hot_expert) + " must be in [0, " + std::to_string(E) + ")");
  if (spec.kind == RoutingKind::worst)
    require(spec.worst_rank >= 0 && spec.worst_rank < R,
            "routing: worst rank " + std::to_string(spec.worst_rank) + " must be in [0, " + std::to_string(R) + ")");

  // Zipf: popularity by rank over a seeded permutation of the experts.
  std::vector<float> log_pop(E, 0.0f);
  if (spec.kind == RoutingKind::zipf) {
    std::vector<int> perm(E);
    std::iota(perm.begin(), perm.end(), 0);
    for (int i = E - 1; i > 0; --i) {
      const int j = static_cast<int>(rng::hash(seed, rng::kPermutation, i) % std::uint64_t(i + 1));
      std::swap(perm[i], perm[j]);
    }
    // (Clamped to float's range: an exponent near double's largest would convert out of
    // range, which C++ leaves undefined; the clamp only meets such exponents.)
    for (int rank = 0; rank < E; ++rank)
      log_pop[perm[rank]] = static_cast<float>(std::max(-spec.zipf_exponent * std::log(double(rank + 1)),
                                                        -double(std::numeric_limits<float>::max())));
  }

  Routing r;
  r.top_experts.assign(R, std::vector<std::int32_t>(T * k));
  r.router_weights.assign(R, std::vector<float>(T * k));
  ref::ThreadPool pool(0);
  pool.parallel_for(std::int64_t(R) * T, 256, [&](std::int64_t b, std::int64_t e) {
    std::vector<std::pair<float, int>> keyed;
    for (std::int64_t n = b; n < e; ++n) {
      const int rank = static_cast<int>(n / T);
      const std::int64_t t = n % T;
      std::int32_t* ids = r.top_experts[rank].data() + t * k;
      float* weights = r.router_weights[rank].data() + t * k;
      keyed.clear();
      for (int ex = 0; ex < E; ++ex) {
        float key = rng::normal(seed, rng::kLogits, std::uint64_t(n) * E + ex);
        switch (spec.kind) {
          case RoutingKind::zipf: {
            // Gumbel top-k: k distinct draws with probability proportional to popularity.
            const float u = rng::uniform(seed, rng::kExpertChoice, std::uint64_t(n) * E + ex);
            key = log_pop[ex] - std::log(-std::log(u));
            break;
          }
          case RoutingKind::hot:
            if (ex == spec.hot_expert &&
                rng::uniform(seed, rng::kHotPick, std::uint64_t(n)) < spec.hot_fraction)
              key = 1e30f;  // always chosen
            break;
          case RoutingKind::worst: {
            // The worst rank's experts first; the others only when k > E/R.
            if (ex / E_loc == spec.worst_rank) key += 1e6f;
            break;
          }
          default: break;
        }
        keyed.emplace_back(key, ex);
      }
      finish_token(keyed, k, seed, n, E, ids, weights);
    }
  });
  return r;
}

RoutingBalance routing_balance(const Problem& p, const Routing& routing) {
  // Sizes and id ranges (what the counting below indexes by); the full rules are
  // validate_routing's.
  require(static_cast<int>(routing.top_experts.size()) == p.ep_size,
          "routing_balance: the routing holds " + std::to_string(routing.top_experts.size()) +
              " ranks; ep_size is " + std::to_string(p.ep_size));
  for (int r = 0; r < p.ep_size; ++r) {
    const auto& ids = routing.top_experts[r];
    require(static_cast<std::int64_t>(ids.size()) == std::int64_t(p.tokens_per_rank) * p.top_k,
            "routing_balance: rank " + std::to_string(r) + " must hold T*k ids");
    for (std::size_t i = 0; i < ids.size(); ++i)
      if (ids[i] < 0 || ids[i] >= p.num_experts)
        throw Error("routing_balance: top_experts[rank " + std::to_string(r) + "][token " +
                    std::to_string(i / p.top_k) + ", slot " + std::to_string(i % p.top_k) + "] = " +
                    std::to_string(ids[i]) + ": expert id must be in [0, " + std::to_string(p.num_experts) + ")");
  }
  RoutingBalance b;
  std::vector<std::int64_t> per_expert(p.num_experts, 0);
  b.rows_per_rank.assign(p.ep_size, 0);
  for (const auto& ids : routing.top_experts)
    for (auto e : ids) {
      ++per_expert[e];
      ++b.rows_per_rank[e / p.local_experts()];
      ++b.total_rows;
    }
  b.max_rows_expert = *std::max_element(per_expert.begin(), per_expert.end());
  const auto busiest = std::max_element(b.rows_per_rank.begin(), b.rows_per_rank.end());  // first of equals
  b.max_rows_rank = *busiest;
  b.busiest_rank = static_cast<int>(busiest - b.rows_per_rank.begin());
  b.max_over_mean_expert = double(b.max_rows_expert) / (double(b.total_rows) / p.num_experts);
  b.max_over_mean_rank = double(b.max_rows_rank) / (double(b.total_rows) / p.ep_size);
  return b;
}

void validate_routing(const Problem& p, const Routing& routing) {
  const std::int64_t T = p.tokens_per_rank;
  const int k = p.top_k;
  require(static_cast<int>(routing.top_experts.size()) == p.ep_size &&
              static_cast<int>(routing.router_weights.size()) == p.ep_size,
          "routing: must hold ep_size (" + std::to_string(p.ep_size) + ") ranks");
  for (int r = 0; r < p.ep_size; ++r) {
    require(static_cast<std::int64_t>(routing.top_experts[r].size()) == T * k &&
                static_cast<std::int64_t>(routing.router_weights[r].size()) == T * k,
            "routing: rank " + std::to_string(r) + " must hold T*k entries");
    check_routing_rank(p, r, routing.top_experts[r].data(), routing.router_weights[r].data());
  }
}

}  // namespace mok
