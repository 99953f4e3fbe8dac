// mok: non-owning tensor views. No CUDA or framework types: a view is a pointer, a dtype,
// where the memory lives, a shape and strides (in elements, row-major order).
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

namespace mok {

enum class DType : std::uint8_t {
  bf16,    // bfloat16, stored as the upper 16 bits of an IEEE float32
  f32,     // IEEE float32
  i32,     // int32
  i64,     // int64 (.npy routing files may hold it: converted to i32 on load; the layer takes i32)
  e4m3,    // OCP FP8 E4M3 (MXFP8 element)
  e8m0,    // OCP E8M0 power-of-two scale (MXFP8 block scale)
};

const char* to_string(DType dtype);
std::size_t dtype_size(DType dtype);

enum class Device : std::uint8_t { cpu, cuda };
const char* to_string(Device device);

constexpr int kMaxTensorDims = 4;

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::bf16;
  Device device = Device::cpu;
  int device_index = 0;
  int ndim = 0;
  std::array<std::int64_t, kMaxTensorDims> shape{};
  std::array<std::int64_t, kMaxTensorDims> strides{};  // in elements

  // A row-major contiguous view.
  static TensorView contiguous(void* data, DType dtype, std::initializer_list<std::int64_t> shape,
                               Device device = Device::cpu, int device_index = 0);

  std::int64_t numel() const;
  std::size_t bytes() const { return static_cast<std::size_t>(numel()) * dtype_size(dtype); }
  bool is_contiguous() const;
  bool empty() const { return data == nullptr; }
  std::string describe() const;  // e.g. "bf16[2048,4096] on cuda:0"

  template <typename T>
  T* as() const { return static_cast<T*>(data); }
};

// Validates that `view` has the given dtype, device, shape and is contiguous, with its data
// aligned to its elements (the library reads it through typed pointers); on failure throws
// mok::Error naming `name` and the rule broken.
void check_tensor(const TensorView& view, const std::string& name, DType dtype,
                  std::initializer_list<std::int64_t> shape, Device device);

}  // namespace mok
