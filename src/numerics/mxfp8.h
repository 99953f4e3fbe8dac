// mok: MXFP8 block quantisation on the host (the CPU reference's MXFP8 mode).
#pragma once
#include <cstdint>

namespace mok::num {

// Quantises n <= kMxBlock values into E4M3 elements under one E8M0 scale.
void mx_quantize_block(const float* values, int n, std::uint8_t* elements, std::uint8_t* scale);

// Replaces each row of a row-major [rows, cols] matrix by its MXFP8 round trip, blocks of
// kMxBlock along the columns starting at column 0 (the last block may be partial).
// Rows are independent; parallelised over rows by the caller if wanted.
void mx_roundtrip_rows(float* matrix, std::int64_t rows, std::int64_t cols);

}  // namespace mok::num
