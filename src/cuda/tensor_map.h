// mok: the TMA descriptors the megakernel reads its bf16 operands through, made on the host.
// One definition for the backend and the microbenchmarks (bench/micro), so a microbenchmark
// reads its operands exactly as the megakernel does.
#pragma once
#include <cuda.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <atomic>
#include <cstdint>
#include <string>

#include "cuda/forward_types.h"

namespace mok::cuda {

// What making a tensor map came to: finding cuTensorMapEncodeTiled in the driver (mok does
// not link libcuda; the runtime's error is kept), then the encode itself.
struct TensorMapStatus {
  cudaError_t lookup = cudaSuccess;  // cudaGetDriverEntryPointByVersion
  bool found = true;                 // the driver has the entry point
  CUresult encode = CUDA_SUCCESS;    // cuTensorMapEncodeTiled
  bool ok() const { return lookup == cudaSuccess && found && encode == CUDA_SUCCESS; }
  std::string describe() const {
    if (lookup != cudaSuccess)
      return std::string("looking up cuTensorMapEncodeTiled failed: ") + cudaGetErrorString(lookup);
    if (!found) return "the CUDA driver has no cuTensorMapEncodeTiled";
    return "cuTensorMapEncodeTiled failed (CUresult " + std::to_string(static_cast<int>(encode)) + ")";
  }
};

// The driver's encoder, looked up once it is found (a failed lookup is retried next call).
inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder(TensorMapStatus& status) {
  static std::atomic<PFN_cuTensorMapEncodeTiled_v12000> cached{nullptr};
  if (const auto fn = cached.load(std::memory_order_acquire)) return fn;
  void* p = nullptr;
  cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
  status.lookup = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q);
  status.found = q == cudaDriverEntryPointSuccess && p != nullptr;
  if (status.lookup != cudaSuccess || !status.found) return nullptr;
  const auto fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  cached.store(fn, std::memory_order_release);
  return fn;
}

// A 2D bf16 tensor [outer, inner] (row-major) read in boxes of kTileK x box_rows: one
// 128-byte row per box row, with the 128-byte swizzle the wgmma shared-memory descriptors
// (cuda/sm90.cuh) expect, promoted to L2 in 256-byte lines.
inline TensorMapStatus encode_bf16_tiles(CUtensorMap* map, const void* base, std::uint64_t inner,
                                         std::uint64_t outer, std::uint32_t box_rows) {
  TensorMapStatus status;
  const auto encode = tensor_map_encoder(status);
  if (encode == nullptr) return status;
  const cuuint64_t dims[2] = {inner, outer};
  const cuuint64_t strides[1] = {inner * 2};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(kTileK), box_rows};
  const cuuint32_t elem[2] = {1, 1};
  status.encode = encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(base), dims, strides, box, elem,
                         CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                         CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return status;
}

}  // namespace mok::cuda
