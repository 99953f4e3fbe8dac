// mok: device copies of a LayerData, for the CLI, tests and benchmarks (not public API).
// Every host tensor is copied to the GPU once; outputs can be poisoned and copied back.
#pragma once
#include <memory>
#include <vector>

#include "mok/data.h"

namespace mok {

class DeviceMirror {
 public:
  // Throws mok::Error when CUDA is unavailable. With `only_rank` >= 0 only that rank's tensors
  // are copied (a real group's process passes its own rank alone: the others' weights and x
  // would take R times the memory on every GPU); the other ranks' arguments are then empty.
  DeviceMirror(const LayerData& host, int device, int only_rank = -1);
  ~DeviceMirror();
  std::vector<RankForward> forward_args() const;
  std::vector<RankBackward> backward_args() const;
  void poison_outputs();                  // 0xff bytes: NaN in every output
  void copy_outputs_to(LayerData& host) const;  // y, dx, gradients of the ranks that have them
  std::size_t bytes() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace mok
