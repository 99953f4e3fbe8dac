#include "mok/data.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>

#include "core/rng.h"
#include "mok/error.h"
#include "numerics/numerics.h"
#include "reference/parallel.h"

namespace mok {

HostTensor::HostTensor(DType dtype, std::vector<std::int64_t> shape) : dtype_(dtype), shape_(std::move(shape)) {
  // The element count and the bytes must fit (a wrapped product would give a tensor whose
  // numel() is larger than its storage).
  // At most kMaxTensorDims dimensions: view() describes it in a TensorView's fixed arrays.
  require(shape_.size() <= static_cast<std::size_t>(kMaxTensorDims),
          "HostTensor: " + std::to_string(shape_.size()) + " dimensions, at most " + std::to_string(kMaxTensorDims));
  // (The product of the non-zero dimensions, wherever a zero stands: an empty tensor's
  // other dimensions obey the same bound, and numel()'s product, in any order, cannot wrap.)
  const std::int64_t max_bytes = std::numeric_limits<std::int64_t>::max();
  std::int64_t n = 1;
  bool empty = false;
  for (std::size_t d = 0; d < shape_.size(); ++d) {
    require(shape_[d] >= 0, "HostTensor: dimension " + std::to_string(d) + " = " + std::to_string(shape_[d]) +
                                " must be >= 0");
    if (shape_[d] == 0) {
      empty = true;
      continue;
    }
    require(n <= max_bytes / static_cast<std::int64_t>(dtype_size(dtype_)) / shape_[d],
            "HostTensor: dimension " + std::to_string(d) + " = " + std::to_string(shape_[d]) +
                " makes the tensor larger than 2^63 bytes");
    n *= shape_[d];
  }
  storage_.resize(empty ? 0 : static_cast<std::size_t>(n) * dtype_size(dtype_));
}

std::int64_t HostTensor::numel() const {
  std::int64_t n = 1;
  for (auto s : shape_) n *= s;
  return n;
}

TensorView HostTensor::view() const {
  TensorView v;
  if (storage_.empty()) return v;
  v.data = const_cast<std::byte*>(storage_.data());
  v.dtype = dtype_;
  v.device = Device::cpu;
  v.ndim = static_cast<int>(shape_.size());
  std::int64_t stride = 1;
  for (int d = v.ndim - 1; d >= 0; --d) {
    v.shape[d] = shape_[d];
    v.strides[d] = stride;
    stride *= shape_[d];
  }
  return v;
}

void HostTensor::fill_bytes(std::uint8_t byte) { std::memset(storage_.data(), byte, storage_.size()); }

bool HostTensor::bitwise_equal(const HostTensor& other) const {
  return dtype_ == other.dtype_ && shape_ == other.shape_ && storage_ == other.storage_;
}

RankForward RankData::forward_args() const {
  RankForward f;
  f.inputs = {x.view(), top_experts.view(), router_weights.view()};
  f.weights = {w_gate.view(), w_up.view(), w_down.view(), {}};
  for (const auto& s : shared) f.weights.shared.push_back({s.w_gate.view(), s.w_up.view(), s.w_down.view()});
  f.y = y.view();
  return f;
}

RankBackward RankData::backward_args() const {
  RankBackward b;
  const RankForward f = forward_args();
  b.inputs = f.inputs;
  b.weights = f.weights;
  b.dy = dy.view();
  b.dx = dx.view();
  b.d_router_weights = d_router_weights.view();
  b.d_w_gate = d_w_gate.view();
  b.d_w_up = d_w_up.view();
  b.d_w_down = d_w_down.view();
  for (const auto& s : d_shared) b.d_shared.push_back({s.d_w_gate.view(), s.d_w_up.view(), s.d_w_down.view()});
  return b;
}

std::vector<RankForward> LayerData::forward_args() const {
  std::vector<RankForward> v;
  for (const auto& r : ranks) v.push_back(r.forward_args());
  return v;
}

std::vector<RankBackward> LayerData::backward_args() const {
  std::vector<RankBackward> v;
  for (const auto& r : ranks) v.push_back(r.backward_args());
  return v;
}

void LayerData::poison_outputs() {
  // 0xff bytes: NaN in bf16 and f32, so an element nothing wrote never passes a check.
  for (auto& r : ranks) {
    for (HostTensor* t : {&r.y, &r.dx, &r.d_router_weights, &r.d_w_gate, &r.d_w_up, &r.d_w_down})
      if (!t->empty()) t->fill_bytes(0xff);
    for (auto& s : r.d_shared)
      for (HostTensor* t : {&s.d_w_gate, &s.d_w_up, &s.d_w_down}) t->fill_bytes(0xff);
  }
}

namespace {

// Fills a bf16 tensor with scale * N(0,1) drawn at index offset + i of `stream`.
void fill_normal(ref::ThreadPool& pool, HostTensor& t, std::uint64_t seed, std::uint64_t stream,
                 std::uint64_t offset, float scale) {
  std::uint16_t* d = t.data<std::uint16_t>();
  pool.parallel_for(t.numel(), 1 << 16, [&](std::int64_t b, std::int64_t e) {
    for (std::int64_t i = b; i < e; ++i)
      d[i] = num::bf16_from_float(scale * rng::normal(seed, stream, offset + std::uint64_t(i)));
  });
}

}  // namespace

// Byte counts are worked out in long double and saturate: absurd problems must compare as
// too large, not wrap around.
namespace {
std::uint64_t saturating_bytes(long double bytes) {
  return bytes >= 1.8e19L ? std::numeric_limits<std::uint64_t>::max() : static_cast<std::uint64_t>(bytes);
}
}  // namespace

std::uint64_t layer_data_host_bytes(const Problem& p, bool with_backward, int weights_rank) {
  const long double T = p.tokens_per_rank, H = p.hidden, I = p.intermediate, k = p.top_k;
  const long double E_loc = p.num_experts / std::max(1, p.ep_size);
  long double shared = 0;
  for (int w : p.shared_intermediate) shared += 3.0L * w * H;
  const long double per_rank_inputs = T * H * 2 + T * k * 8 * 2 /* routing + its tensors */ +
                                      (with_backward ? T * H * 2 : 0);
  const long double per_weighted_rank = (3 * E_loc * I * H + shared) * 2 + T * H * 2 /* y */ +
                                        (with_backward ? T * H * 2 + T * k * 4 + (3 * E_loc * I * H + shared) * 4 : 0);
  const long double ranks = p.ep_size, weighted = weights_rank >= 0 ? 1 : ranks;
  return saturating_bytes(ranks * per_rank_inputs + weighted * per_weighted_rank);
}

std::uint64_t reference_host_bytes(const Problem& p, bool with_backward) {
  const long double T = p.tokens_per_rank, H = p.hidden, I = p.intermediate, k = p.top_k, R = p.ep_size;
  const long double rows = T * k;  // one rank's mean routed rows
  const long double combine = R * T * k * H * 2;
  // Forward: gathered rows and results [n,H], gate|up [n,2I], activations [n,I], in fp32; the
  // backward adds dy rows and its gradients of the SwiGLU (about six [n,I] matrices).
  const long double work = rows * (2 * H + 3 * I) * 4 + (with_backward ? rows * (H + 6 * I) * 4 : 0);
  return saturating_bytes(combine + work);
}

void require_host_memory(std::uint64_t bytes, const std::string& what) {
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  std::uint64_t kib = 0;
  std::string unit;
  while (meminfo >> key >> kib >> unit)
    if (key == "MemAvailable:") {
      const std::uint64_t available = kib * 1024;
      if (bytes > available) {
        // (Only the numbers through a fixed buffer: `what` may be long, a path or a shape.)
        char numbers[96];
        std::snprintf(numbers, sizeof numbers, "%.1f GiB of host memory, more than the %.1f GiB available",
                      double(bytes) / (1ull << 30), double(available) / (1ull << 30));
        throw Error(what + " needs " + numbers +
                    " (fewer tokens, a smaller EP group or shape, or a rank slice on the GPU)");
      }
      return;
    }
}

LayerData make_layer_data(const Problem& p, const Routing& routing, std::uint64_t seed, bool with_backward,
                          int weights_rank) {
  require(weights_rank >= -1 && weights_rank < p.ep_size,
          "make_layer_data: weights_rank = " + std::to_string(weights_rank) + " must be -1 or in [0, ep_size)");
  p.validate();
  validate_routing(p, routing);
  require_host_memory(layer_data_host_bytes(p, with_backward, weights_rank), "make_layer_data: " + p.describe());
  ref::ThreadPool pool(0);
  const std::int64_t T = p.tokens_per_rank, H = p.hidden, I = p.intermediate, k = p.top_k;
  const std::int64_t E_loc = p.local_experts();
  const float gate_scale = 1.0f / std::sqrt(float(H));
  LayerData data;
  data.problem = p;
  data.ranks.resize(p.ep_size);
  for (int r = 0; r < p.ep_size; ++r) {
    RankData& d = data.ranks[r];
    const std::uint64_t token0 = std::uint64_t(r) * T;
    d.x = HostTensor(DType::bf16, {T, H});
    fill_normal(pool, d.x, seed, rng::kX, token0 * H, 1.0f);
    d.top_experts = HostTensor(DType::i32, {T, k});
    d.router_weights = HostTensor(DType::f32, {T, k});
    std::memcpy(d.top_experts.data<std::int32_t>(), routing.top_experts[r].data(), T * k * 4);
    std::memcpy(d.router_weights.data<float>(), routing.router_weights[r].data(), T * k * 4);
    if (with_backward) {
      d.dy = HostTensor(DType::bf16, {T, H});
      fill_normal(pool, d.dy, seed, rng::kDy, token0 * H, 1.0f);
    }
    if (weights_rank >= 0 && r != weights_rank) continue;
    // Routed experts: global expert e = r*E_loc + local index; values keyed by e.
    const std::uint64_t e0 = std::uint64_t(r) * E_loc;
    d.w_gate = HostTensor(DType::bf16, {E_loc, I, H});
    d.w_up = HostTensor(DType::bf16, {E_loc, I, H});
    d.w_down = HostTensor(DType::bf16, {E_loc, H, I});
    fill_normal(pool, d.w_gate, seed, rng::kGate, e0 * I * H, gate_scale);
    fill_normal(pool, d.w_up, seed, rng::kUp, e0 * I * H, gate_scale);
    fill_normal(pool, d.w_down, seed, rng::kDown, e0 * H * I, 1.0f / std::sqrt(float(I)));
    // Shared experts: the same weights on every rank.
    for (int s = 0; s < p.num_shared(); ++s) {
      const std::int64_t Is = p.shared_intermediate[s];
      const std::uint64_t stream_offset = std::uint64_t(s) << 40;
      SharedHostWeights w{HostTensor(DType::bf16, {Is, H}), HostTensor(DType::bf16, {Is, H}),
                          HostTensor(DType::bf16, {H, Is})};
      fill_normal(pool, w.w_gate, seed, rng::kSharedGate, stream_offset, gate_scale);
      fill_normal(pool, w.w_up, seed, rng::kSharedUp, stream_offset, gate_scale);
      fill_normal(pool, w.w_down, seed, rng::kSharedDown, stream_offset, 1.0f / std::sqrt(float(Is)));
      d.shared.push_back(std::move(w));
    }
    d.y = HostTensor(DType::bf16, {T, H});
    if (with_backward) {
      d.dx = HostTensor(DType::bf16, {T, H});
      d.d_router_weights = HostTensor(DType::f32, {T, k});
      d.d_w_gate = HostTensor(DType::f32, {E_loc, I, H});
      d.d_w_up = HostTensor(DType::f32, {E_loc, I, H});
      d.d_w_down = HostTensor(DType::f32, {E_loc, H, I});
      for (int s = 0; s < p.num_shared(); ++s) {
        const std::int64_t Is = p.shared_intermediate[s];
        d.d_shared.push_back({HostTensor(DType::f32, {Is, H}), HostTensor(DType::f32, {Is, H}),
                              HostTensor(DType::f32, {H, Is})});
      }
    }
  }
  data.poison_outputs();
  return data;
}

}  // namespace mok
