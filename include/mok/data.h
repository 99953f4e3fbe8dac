// mok: host-side tensors and deterministic layer data (inputs, weights, dy), for the CLI,
// the tests and the benchmarks. Every value is a pure function of (seed, global index):
// token n = rank*T + t, global expert e, so an EP split of the same global batch sees the
// same numbers. x and dy ~ N(0,1); w_gate, w_up ~ N(0, 1/H); w_down ~ N(0, 1/I_width).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "mok/layer.h"
#include "mok/routing.h"

namespace mok {

class HostTensor {
 public:
  HostTensor() = default;
  HostTensor(DType dtype, std::vector<std::int64_t> shape);  // zero-filled

  DType dtype() const { return dtype_; }
  const std::vector<std::int64_t>& shape() const { return shape_; }
  std::int64_t numel() const;
  std::size_t bytes() const { return storage_.size(); }
  bool empty() const { return storage_.empty(); }
  TensorView view() const;  // a view of host memory (const-ness is the caller's promise)

  template <typename T> T* data() { return reinterpret_cast<T*>(storage_.data()); }
  template <typename T> const T* data() const { return reinterpret_cast<const T*>(storage_.data()); }
  void fill_bytes(std::uint8_t byte);
  bool bitwise_equal(const HostTensor& other) const;

 private:
  DType dtype_ = DType::f32;
  std::vector<std::int64_t> shape_;
  std::vector<std::byte> storage_;
};

struct SharedHostWeights {
  HostTensor w_gate, w_up, w_down;  // bf16 [I_s,H], [I_s,H], [H,I_s]
};
struct SharedHostGrads {
  HostTensor d_w_gate, d_w_up, d_w_down;  // f32
};

// One rank's tensors. Outputs are allocated (and poisoned with NaN bit patterns) by
// make_layer_data so an unwritten element never passes a check.
struct RankData {
  HostTensor x, top_experts, router_weights;        // bf16 [T,H], i32 [T,k], f32 [T,k]
  HostTensor w_gate, w_up, w_down;                  // bf16 local routed experts
  std::vector<SharedHostWeights> shared;
  HostTensor y;                                     // bf16 [T,H] out
  HostTensor dy;                                    // bf16 [T,H] in (backward)
  HostTensor dx, d_router_weights;                  // bf16 [T,H], f32 [T,k] out
  HostTensor d_w_gate, d_w_up, d_w_down;            // f32 out
  std::vector<SharedHostGrads> d_shared;

  RankForward forward_args() const;
  RankBackward backward_args() const;
};

struct LayerData {
  Problem problem;
  std::vector<RankData> ranks;

  std::vector<RankForward> forward_args() const;
  std::vector<RankBackward> backward_args() const;
  void poison_outputs();  // NaN-fill every output so unwritten elements are caught
};

// Builds inputs for every rank; with_backward also makes dy. Weights, outputs and gradient
// buffers are made for every rank, or only for `weights_rank` when it is >= 0 (a rank
// slice of a large EP group needs the others' inputs only).
LayerData make_layer_data(const Problem& problem, const Routing& routing, std::uint64_t seed,
                          bool with_backward, int weights_rank = -1);

// The host bytes a routing plus make_layer_data's tensors take for these arguments.
std::uint64_t layer_data_host_bytes(const Problem& problem, bool with_backward, int weights_rank = -1);

// A lower bound of what the CPU reference backend holds besides those tensors: every rank's
// combine slots (bf16 [T*k, H]) and one rank's fp32 working matrices at the mean row count
// (ranks run one after another). Erring low, it never refuses a run that fits.
std::uint64_t reference_host_bytes(const Problem& problem, bool with_backward);

// Throws mok::Error when `bytes` exceed the memory the machine has available now (Linux
// MemAvailable; no check where that is unknown), naming `what` needs them: a run too large
// for the host is refused up front instead of being killed by the kernel part way.
void require_host_memory(std::uint64_t bytes, const std::string& what);

}  // namespace mok
