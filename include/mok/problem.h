// mok: the problem (what layer is computed) kept apart from the config (how it is run).
//
// An EP group has `ep_size` ranks; rank r holds `tokens_per_rank` tokens and owns the
// routed experts [r*E/R, (r+1)*E/R). Shared experts are replicated on every rank and
// applied to every token with weight 1. See docs/DESIGN.md for the exact layer.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace mok {

enum class Precision : std::uint8_t {
  bf16,   // bf16 operands, fp32 accumulation
  mxfp8,  // OCP MX v1.0: E4M3 elements, 32-element blocks along the contraction, E8M0 scales
};
const char* to_string(Precision precision);
Precision precision_from_string(const std::string& name);  // throws mok::Error

constexpr int kMaxTopK = 255;        // MoK's bound, kept so k fits in a byte
constexpr int kMxBlock = 32;         // MXFP8 block length along the contraction dimension
// Far beyond any MoE layer in use (512 experts, EP 64 today), and small enough that what the
// library keeps per expert and per rank (routing, schedules, every rank's ids) stays small
// next to the tensors, and a run's time stays linear in the work, not in E or R squared.
constexpr int kMaxExperts = 65536;
constexpr int kMaxEpSize = 4096;     // also `mok launch -n`'s bound

struct Problem {
  int num_experts = 0;                   // E: routed experts in the whole EP group
  int hidden = 0;                        // H
  int intermediate = 0;                  // I: routed expert width
  int top_k = 0;                         // k
  std::vector<int> shared_intermediate;  // widths of the shared experts (0..n of them)
  int ep_size = 1;                       // R
  int tokens_per_rank = 0;               // T (the same on every rank)
  Precision precision = Precision::bf16;
  std::optional<float> swiglu_limit;     // clamped SwiGLU: gate <= L, -L <= up <= L

  // Throws mok::Error naming the first field that breaks a rule.
  void validate() const;

  int local_experts() const { return num_experts / ep_size; }
  int num_shared() const { return static_cast<int>(shared_intermediate.size()); }
  std::int64_t rows_per_rank() const { return std::int64_t(tokens_per_rank) * top_k; }
  // Forward FLOPs per rank counted as MoK does: 6*(T + T*k)*H*I. The shared expert always
  // counts as T rows of width I, whatever the shared experts really are (none, or other
  // widths); forward_flops() is what the rank does.
  double mok_forward_flops() const;
  // FLOPs the rank actually performs in the forward (routed rows times 6*H*I plus each
  // shared expert's 6*T*H*I_s); equals mok_forward_flops() for MoK's shapes.
  double forward_flops() const;
  std::string describe() const;
};

// Named shapes: MoK's four, the single-GPU ones, and small test shapes.
struct NamedShape {
  std::string name;
  int num_experts, hidden, intermediate, top_k;
  std::vector<int> shared_intermediate;
  int default_ep_size;       // the EP size the shape is measured at (64 for MoK's)
  int default_tokens;        // tokens per rank
  std::string note;
};
const std::vector<NamedShape>& named_shapes();
// Throws mok::Error listing the known names when `name` is unknown.
const NamedShape& find_shape(const std::string& name);
Problem problem_from_shape(const NamedShape& shape, int ep_size, int tokens_per_rank);

}  // namespace mok
