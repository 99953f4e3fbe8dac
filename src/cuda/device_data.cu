// mok: DeviceMirror, device copies of a LayerData (CLI, tests, benchmarks).
#include <cuda_runtime.h>

#include "core/backend.h"
#include "core/device_mirror.h"
#include "cuda/common.cuh"

namespace mok {

struct DeviceMirror::Impl {
  int device = 0;
  // Per rank: the device copy of every tensor the rank has, keyed as in RankData.
  struct RankViews {
    RankForward fwd;
    RankBackward bwd;
  };
  std::vector<RankViews> ranks;
  std::vector<void*> allocations;
  std::vector<std::pair<void*, std::size_t>> outputs;
  struct OutputLink {
    std::size_t rank;
    HostTensor* (*select)(RankData&, std::size_t);
    std::size_t index;
    void* device;
    std::size_t bytes;
  };
  std::vector<OutputLink> links;
  std::size_t total = 0;

  // The Impl owns the allocations, so a constructor that throws part way (out of memory on
  // a large shape, a failed copy) frees what it had uploaded.
  Impl() = default;
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;
  ~Impl() {
    for (void* p : allocations) cudaFree(p);
  }

  TensorView upload(const HostTensor& t, bool copy) {
    if (t.empty()) return {};
    allocations.push_back(nullptr);  // (the slot first: a failed push leaks nothing)
    MOK_CUDA_CHECK(cudaMalloc(&allocations.back(), t.bytes()));
    void* p = allocations.back();
    total += t.bytes();
    if (copy) MOK_CUDA_CHECK(cudaMemcpy(p, t.data<void>(), t.bytes(), cudaMemcpyHostToDevice));
    TensorView v = t.view();
    v.data = p;
    v.device = Device::cuda;
    v.device_index = device;
    return v;
  }
};

DeviceMirror::DeviceMirror(const LayerData& host, int device, int only_rank) : impl_(std::make_unique<Impl>()) {
  require(cuda_device_count() > 0, "DeviceMirror: no CUDA device is available");
  require(only_rank < static_cast<int>(host.ranks.size()),
          "DeviceMirror: only_rank " + std::to_string(only_rank) + " is not one of the data's " +
              std::to_string(host.ranks.size()) + " ranks");
  MOK_CUDA_CHECK(cudaSetDevice(device));
  impl_->device = device;
  for (std::size_t r = 0; r < host.ranks.size(); ++r) {
    const RankData& d = host.ranks[r];
    Impl::RankViews v;
    if (only_rank >= 0 && static_cast<int>(r) != only_rank) {  // (another process's rank: empty arguments)
      impl_->ranks.push_back(std::move(v));
      continue;
    }
    auto in = [&](const HostTensor& t) { return impl_->upload(t, true); };
    auto out = [&](const HostTensor& t, HostTensor* (*sel)(RankData&, std::size_t), std::size_t idx) {
      TensorView view = impl_->upload(t, false);
      if (!view.empty()) {
        impl_->outputs.emplace_back(view.data, t.bytes());
        impl_->links.push_back({r, sel, idx, view.data, t.bytes()});
      }
      return view;
    };
    v.fwd.inputs = {in(d.x), in(d.top_experts), in(d.router_weights)};
    v.fwd.weights = {in(d.w_gate), in(d.w_up), in(d.w_down), {}};
    if (!d.w_gate.empty())
      for (const auto& s : d.shared) v.fwd.weights.shared.push_back({in(s.w_gate), in(s.w_up), in(s.w_down)});
    v.fwd.y = out(d.y, [](RankData& x, std::size_t) { return &x.y; }, 0);
    v.bwd.inputs = v.fwd.inputs;
    v.bwd.weights = v.fwd.weights;
    v.bwd.dy = in(d.dy);
    v.bwd.dx = out(d.dx, [](RankData& x, std::size_t) { return &x.dx; }, 0);
    v.bwd.d_router_weights = out(d.d_router_weights, [](RankData& x, std::size_t) { return &x.d_router_weights; }, 0);
    v.bwd.d_w_gate = out(d.d_w_gate, [](RankData& x, std::size_t) { return &x.d_w_gate; }, 0);
    v.bwd.d_w_up = out(d.d_w_up, [](RankData& x, std::size_t) { return &x.d_w_up; }, 0);
    v.bwd.d_w_down = out(d.d_w_down, [](RankData& x, std::size_t) { return &x.d_w_down; }, 0);
    for (std::size_t s = 0; s < d.d_shared.size(); ++s)
      v.bwd.d_shared.push_back(
          {out(d.d_shared[s].d_w_gate, [](RankData& x, std::size_t i) { return &x.d_shared[i].d_w_gate; }, s),
           out(d.d_shared[s].d_w_up, [](RankData& x, std::size_t i) { return &x.d_shared[i].d_w_up; }, s),
           out(d.d_shared[s].d_w_down, [](RankData& x, std::size_t i) { return &x.d_shared[i].d_w_down; }, s)});
    impl_->ranks.push_back(std::move(v));
  }
  poison_outputs();
}

DeviceMirror::~DeviceMirror() = default;  // (Impl frees the allocations)

std::vector<RankForward> DeviceMirror::forward_args() const {
  std::vector<RankForward> v;
  for (const auto& r : impl_->ranks) v.push_back(r.fwd);
  return v;
}

std::vector<RankBackward> DeviceMirror::backward_args() const {
  std::vector<RankBackward> v;
  for (const auto& r : impl_->ranks) v.push_back(r.bwd);
  return v;
}

void DeviceMirror::poison_outputs() {
  for (auto& [p, n] : impl_->outputs) MOK_CUDA_CHECK(cudaMemset(p, 0xff, n));
  MOK_CUDA_CHECK(cudaDeviceSynchronize());
}

void DeviceMirror::copy_outputs_to(LayerData& host) const {
  MOK_CUDA_CHECK(cudaDeviceSynchronize());
  for (const auto& l : impl_->links) {
    HostTensor* t = l.select(host.ranks[l.rank], l.index);
    MOK_CUDA_CHECK(cudaMemcpy(t->data<void>(), l.device, l.bytes, cudaMemcpyDeviceToHost));
  }
}

std::size_t DeviceMirror::bytes() const { return impl_->total; }

}  // namespace mok
