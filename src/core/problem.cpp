#include <cmath>
#include <limits>
#include <sstream>

#include "core/numbers.h"
#include "mok/config.h"
#include "mok/error.h"
#include "mok/problem.h"

namespace mok {

const char* to_string(Precision precision) {
  return precision == Precision::bf16 ? "bf16" : "mxfp8";
}

Precision precision_from_string(const std::string& name) {
  if (name == "bf16") return Precision::bf16;
  if (name == "mxfp8") return Precision::mxfp8;
  throw Error("dtype: must be bf16 or mxfp8, got '" + name + "'");
}

void Problem::validate() const {
  auto field = [](const char* name, long long value, const std::string& rule) {
    return std::string("Problem.") + name + " = " + std::to_string(value) + ": " + rule;
  };
  require(num_experts >= 1 && num_experts <= kMaxExperts,
          field("num_experts", num_experts, "must be in [1, " + std::to_string(kMaxExperts) + "]"));
  require(hidden >= 1, field("hidden", hidden, "must be >= 1"));
  require(intermediate >= 1, field("intermediate", intermediate, "must be >= 1"));
  require(top_k >= 1 && top_k <= kMaxTopK,
          field("top_k", top_k, "must be in [1, " + std::to_string(kMaxTopK) + "]"));
  require(top_k <= num_experts,
          field("top_k", top_k, "must be <= num_experts (" + std::to_string(num_experts) +
                                    "): a token's experts are distinct"));
  require(ep_size >= 1 && ep_size <= kMaxEpSize,
          field("ep_size", ep_size, "must be in [1, " + std::to_string(kMaxEpSize) + "]"));
  require(num_experts % ep_size == 0,
          field("num_experts", num_experts,
                "must be divisible by ep_size (" + std::to_string(ep_size) + ")"));
  require(tokens_per_rank >= 1, field("tokens_per_rank", tokens_per_rank, "must be >= 1"));
  require(std::int64_t(tokens_per_rank) * top_k < (std::int64_t(1) << 31),
          field("tokens_per_rank", tokens_per_rank, "tokens_per_rank * top_k must fit in int32"));
  for (std::size_t s = 0; s < shared_intermediate.size(); ++s) {
    require(shared_intermediate[s] >= 1,
            "Problem.shared_intermediate[" + std::to_string(s) + "] = " +
                std::to_string(shared_intermediate[s]) + ": must be >= 1");
  }
  // Every tensor a rank holds must be countable and allocatable: element counts are checked
  // in floating point (no overflow) against 2^40, far beyond any GPU or host today, so that
  // absurd sizes are a named error rather than an overflow or an allocation failure.
  const double kMaxElements = std::ldexp(1.0, 40);
  auto size_rule = [&](const char* what, double elements) {
    if (elements <= kMaxElements) return;
    std::ostringstream n;
    n << elements;
    throw Error(std::string("Problem: ") + what + " would hold " + n.str() + " elements: at most 2^40 per tensor");
  };
  size_rule("x (tokens_per_rank * hidden)", double(tokens_per_rank) * hidden);
  size_rule("the combine slots (tokens_per_rank * top_k * hidden)", double(tokens_per_rank) * top_k * hidden);
  size_rule("the local routed weights (num_experts / ep_size * intermediate * hidden)",
            double(num_experts / ep_size) * intermediate * hidden);
  for (int w : shared_intermediate) size_rule("a shared expert's weights (width * hidden)", double(w) * hidden);
  if (swiglu_limit) {
    // A subnormal limit keeps fewer digits than were written (mok run refuses one on the
    // command line; the same rule for problem.json, the C API and Python).
    require(std::isfinite(*swiglu_limit) && *swiglu_limit >= std::numeric_limits<float>::min(),
            "Problem.swiglu_limit = " + exact_number(*swiglu_limit) + ": must be finite and at least " +
                exact_number(std::numeric_limits<float>::min()) + " (a positive normal float)");
  }
  require(precision == Precision::bf16 || precision == Precision::mxfp8,
          "Problem.precision = " + std::to_string(static_cast<int>(precision)) + ": must be bf16 or mxfp8");
  if (precision == Precision::mxfp8) {
    const std::string rule = "must be a multiple of " + std::to_string(kMxBlock) +
                             " for mxfp8 (32-element blocks along the contraction)";
    require(hidden % kMxBlock == 0, field("hidden", hidden, rule));
    require(intermediate % kMxBlock == 0, field("intermediate", intermediate, rule));
    for (std::size_t s = 0; s < shared_intermediate.size(); ++s) {
      require(shared_intermediate[s] % kMxBlock == 0,
              "Problem.shared_intermediate[" + std::to_string(s) + "] = " +
                  std::to_string(shared_intermediate[s]) + ": " + rule);
    }
  }
}

double Problem::mok_forward_flops() const {
  return 6.0 * (double(tokens_per_rank) + double(tokens_per_rank) * top_k) * hidden * intermediate;
}

double Problem::forward_flops() const {
  double f = 6.0 * double(tokens_per_rank) * top_k * hidden * intermediate;
  for (int w : shared_intermediate) f += 6.0 * double(tokens_per_rank) * hidden * w;
  return f;
}

std::string Problem::describe() const {
  std::ostringstream s;
  s << "E=" << num_experts << " H=" << hidden << " I=" << intermediate << " k=" << top_k
    << " shared=[";
  for (std::size_t i = 0; i < shared_intermediate.size(); ++i)
    s << (i ? "," : "") << shared_intermediate[i];
  s << "] EP=" << ep_size << " T=" << tokens_per_rank << " " << to_string(precision);
  if (swiglu_limit) s << " swiglu_limit=" << exact_number(*swiglu_limit);  // (exact: --expect compares these)
  return s.str();
}

const std::vector<NamedShape>& named_shapes() {
  static const std::vector<NamedShape> shapes = {
      {"qwen3.5-397b-a17b", 512, 4096, 1024, 10, {1024}, 64, 2048, "MoK shape"},
      {"deepseek-v4-pro", 384, 7168, 3072, 6, {3072}, 64, 2048, "MoK shape"},
      {"kimi-k2.7-code", 384, 7168, 2048, 8, {2048}, 64, 2048, "MoK shape"},
      {"glm-5.2", 256, 6144, 2048, 8, {2048}, 64, 2048, "MoK shape"},
      {"qwen3-30b-a3b", 128, 2048, 768, 8, {}, 1, 16384, "single GPU"},
      {"mixtral-8x7b", 8, 4096, 14336, 2, {}, 1, 4096, "single GPU"},
      {"gpt-oss-20b", 32, 2880, 2880, 4, {}, 1, 4096, "single GPU, H not a multiple of 256"},
      {"tiny", 8, 256, 128, 2, {128}, 2, 64, "test shape"},
      {"small", 16, 512, 256, 4, {256}, 4, 256, "test shape"},
      {"medium", 64, 1024, 512, 6, {512}, 8, 512, "test shape"},
  };
  return shapes;
}

const NamedShape& find_shape(const std::string& name) {
  for (const auto& s : named_shapes())
    if (s.name == name) return s;
  std::string known;
  for (const auto& s : named_shapes()) known += (known.empty() ? "" : ", ") + s.name;
  throw Error("shape: unknown name '" + name + "'; known shapes: " + known);
}

Problem problem_from_shape(const NamedShape& shape, int ep_size, int tokens_per_rank) {
  Problem p;
  p.num_experts = shape.num_experts;
  p.hidden = shape.hidden;
  p.intermediate = shape.intermediate;
  p.top_k = shape.top_k;
  p.shared_intermediate = shape.shared_intermediate;
  p.ep_size = ep_size;
  p.tokens_per_rank = tokens_per_rank;
  return p;
}

// ---- Config ---------------------------------------------------------------------------

void Config::validate() const {
  auto field = [](const char* name, long long value, const std::string& rule) {
    return std::string("Config.") + name + " = " + std::to_string(value) + ": " + rule;
  };
  require(tile_rows == 64 || tile_rows == 128 || tile_rows == 256,
          field("tile_rows", tile_rows, "must be 64, 128 or 256"));
  require(minibatch_rows >= tile_rows && minibatch_rows % tile_rows == 0,
          field("minibatch_rows", minibatch_rows,
                "must be a positive multiple of tile_rows (" + std::to_string(tile_rows) + ")"));
  require(macrobatch_rows >= minibatch_rows && macrobatch_rows % minibatch_rows == 0,
          field("macrobatch_rows", macrobatch_rows,
                "must be a positive multiple of minibatch_rows (" + std::to_string(minibatch_rows) + ")"));
  require(schedule_capacity_factor > 0.0 && schedule_capacity_factor <= 1.0,
          "Config.schedule_capacity_factor = " + exact_number(schedule_capacity_factor) +
              ": must be in (0, 1] (1 covers every routing)");
  // (Bounded here so that the backend's sums of CTA counts cannot overflow; it then checks
  // the count against the GPU's SMs.)
  require(forward_comm_sms >= 0 && forward_comm_sms <= kMaxCommSms,
          field("forward_comm_sms", forward_comm_sms, "must be in [0, " + std::to_string(kMaxCommSms) + "] (0 = auto)"));
  require(backward_comm_sms >= 0 && backward_comm_sms <= kMaxCommSms,
          field("backward_comm_sms", backward_comm_sms, "must be in [0, " + std::to_string(kMaxCommSms) + "] (0 = auto)"));
  require(task_band_tiles >= 0 && task_band_tiles <= 64,
          field("task_band_tiles", task_band_tiles, "must be in [0, 64] (0 = auto)"));
}

std::string Config::describe() const {
  std::ostringstream s;
  s << "minibatch=" << minibatch_rows << " macrobatch=" << macrobatch_rows
    << " capacity_factor=" << exact_number(schedule_capacity_factor) << " tile_rows=" << tile_rows
    << " comm_sms(fwd,bwd)=" << forward_comm_sms << "," << backward_comm_sms << " band=" << task_band_tiles << " pairs=" << (task_pairs ? 1 : 0);
  return s.str();
}

std::int64_t schedule_capacity_rows(const Problem& problem, const Config& config) {
  // worst: every token of every rank sends min(k, E/R) rows here; mean: T*k rows.
  const double worst = double(problem.ep_size) * problem.tokens_per_rank *
                       std::min(problem.top_k, problem.local_experts());
  const double mean = double(problem.tokens_per_rank) * problem.top_k;
  std::int64_t cap = static_cast<std::int64_t>(std::ceil(mean + config.schedule_capacity_factor * (worst - mean)));
  cap += std::int64_t(problem.local_experts()) * (config.tile_rows - 1);
  return (cap + config.tile_rows - 1) / config.tile_rows * config.tile_rows;
}

}  // namespace mok
