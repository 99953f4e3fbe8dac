#include <algorithm>
#include <cstdint>
#include <sstream>

#include "mok/error.h"
#include "mok/tensor.h"

namespace mok {

const char* to_string(DType dtype) {
  switch (dtype) {
    case DType::bf16: return "bf16";
    case DType::f32: return "f32";
    case DType::i32: return "i32";
    case DType::i64: return "i64";
    case DType::e4m3: return "e4m3";
    case DType::e8m0: return "e8m0";
  }
  return "?";
}

std::size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::bf16: return 2;
    case DType::f32: case DType::i32: return 4;
    case DType::i64: return 8;
    case DType::e4m3: case DType::e8m0: return 1;
  }
  return 0;
}

const char* to_string(Device device) { return device == Device::cpu ? "cpu" : "cuda"; }

TensorView TensorView::contiguous(void* data, DType dtype, std::initializer_list<std::int64_t> shape,
                                  Device device, int device_index) {
  require(shape.size() <= kMaxTensorDims, "TensorView::contiguous: at most 4 dimensions");
  TensorView v;
  v.data = data;
  v.dtype = dtype;
  v.device = device;
  v.device_index = device_index;
  v.ndim = static_cast<int>(shape.size());
  int i = 0;
  for (auto s : shape) v.shape[i++] = s;
  std::int64_t stride = 1;
  for (int d = v.ndim - 1; d >= 0; --d) {
    v.strides[d] = stride;
    stride *= v.shape[d];
  }
  return v;
}

namespace {
// The dimensions a view's arrays really hold: a caller's ndim outside [0, kMaxTensorDims] is
// an error check_tensor reports, never an index past the arrays.
int held_dims(const TensorView& v) { return std::clamp(v.ndim, 0, kMaxTensorDims); }
}  // namespace

std::int64_t TensorView::numel() const {
  std::int64_t n = 1;
  for (int d = 0; d < held_dims(*this); ++d) n *= shape[d];
  return n;
}

bool TensorView::is_contiguous() const {
  std::int64_t stride = 1;
  for (int d = held_dims(*this) - 1; d >= 0; --d) {
    if (shape[d] != 1 && strides[d] != stride) return false;
    stride *= shape[d];
  }
  return true;
}

std::string TensorView::describe() const {
  std::ostringstream s;
  s << to_string(dtype) << "[";
  for (int d = 0; d < held_dims(*this); ++d) s << (d ? "," : "") << shape[d];
  if (ndim != held_dims(*this)) s << " (ndim " << ndim << ")";
  s << "] on " << to_string(device);
  if (device == Device::cuda) s << ":" << device_index;
  return s.str();
}

void check_tensor(const TensorView& view, const std::string& name, DType dtype,
                  std::initializer_list<std::int64_t> shape, Device device) {
  // The common case is fast: messages are only built when a rule is broken (this runs for
  // every tensor of every rank on every call).
  require(view.ndim >= 0 && view.ndim <= kMaxTensorDims,
          name + ": ndim must be in [0, " + std::to_string(kMaxTensorDims) + "], got " + std::to_string(view.ndim));
  bool shape_ok = view.ndim == static_cast<int>(shape.size());
  int i = 0;
  for (auto s : shape) shape_ok = shape_ok && view.shape[i++] == s;
  // (Checked for the dtype asked for: a view of another dtype is refused below either way.)
  const bool aligned = reinterpret_cast<std::uintptr_t>(view.data) % dtype_size(dtype) == 0;
  if (view.data != nullptr && view.dtype == dtype && shape_ok && view.device == device && view.is_contiguous() &&
      aligned)
    return;
  std::ostringstream want;
  want << to_string(dtype) << "[";
  i = 0;
  for (auto s : shape) want << (i++ ? "," : "") << s;
  want << "] on " << to_string(device);
  require(view.data != nullptr, name + ": missing (null data pointer); expected " + want.str());
  require(view.dtype == dtype, name + ": dtype must be " + to_string(dtype) + ", got " + view.describe());
  require(shape_ok, name + ": shape must be " + want.str() + ", got " + view.describe());
  require(view.device == device, name + ": must be on " + to_string(device) + ", got " + view.describe());
  require(view.is_contiguous(), name + ": must be contiguous (row-major), got " + view.describe());
  std::ostringstream at;
  at << view.data;
  require(aligned, name + ": data at " + at.str() + " must be aligned to its " + std::to_string(dtype_size(dtype)) +
                       "-byte elements, got " + view.describe());
}

}  // namespace mok
