// mok: the TMA descriptors the megakernel reads its bf16 operands through, made on the host.
// One definition for the backend and the microbenchmarks (bench/micro), so a microbenchmark
// reads its operands exactly as the megakernel does.
#pragma once
#include <cuda.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <cstdint>

#include "cuda/forward_types.h"

namespace mok::cuda {

// cuTensorMapEncodeTiled, taken from the driver at run time (mok does not link libcuda), or
// nullptr when the driver does not have it.
inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q;
    const cudaError_t e = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q);
    return e == cudaSuccess && q == cudaDriverEntryPointSuccess ? reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p)
                                                                : nullptr;
  }();
  return fn;
}

// A 2D bf16 tensor [outer, inner] (row-major) read in boxes of kTileK x box_rows: one
// 128-byte row per box row, with the 128-byte swizzle the wgmma shared-memory descriptors
// (cuda/sm90.cuh) expect, promoted to L2 in 256-byte lines. Returns the driver's result;
// CUDA_ERROR_NOT_FOUND when the driver has no encoder.
inline CUresult encode_bf16_tiles(CUtensorMap* map, const void* base, std::uint64_t inner, std::uint64_t outer,
                                  std::uint32_t box_rows) {
  const auto encode = tensor_map_encoder();
  if (encode == nullptr) return CUDA_ERROR_NOT_FOUND;
  const cuuint64_t dims[2] = {inner, outer};
  const cuuint64_t strides[1] = {inner * 2};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(kTileK), box_rows};
  const cuuint32_t elem[2] = {1, 1};
  return encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(base), dims, strides, box, elem,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
}

}  // namespace mok::cuda
