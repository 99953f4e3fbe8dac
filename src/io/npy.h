// mok: .npy files (NumPy format v1.0/2.0), little-endian, C order.
// bf16 tensors are stored as '<u2' (their raw bits): NumPy has no bf16 dtype; read them with
// numpy as uint16 and view as bfloat16 (ml_dtypes) or shift into float32 (<< 16).
// Reading accepts '<f4' for a bf16 tensor (rounded to nearest even) and '<i8' for int32.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "mok/data.h"

namespace mok::npy {

struct Header {
  std::string descr;                  // e.g. "<f4"
  bool fortran_order = false;
  std::vector<std::int64_t> shape;
  std::size_t data_offset = 0;
};

// Parses the header of `path`; throws mok::Error naming the file and what is malformed.
Header read_header(const std::string& path);

// Reads only the header of `path` and requires its shape to equal `expect_shape` (the message
// load gives): a file's size can be checked before the tensor is allocated.
void check_shape(const std::string& path, const std::vector<std::int64_t>& expect_shape);

// Whether a regular file is at `path` (false: nothing there). Something else there, or a
// status that cannot be read (a directory without permission), is a mok::Error starting with
// `context` and naming the path, never std::filesystem's exception.
bool regular_file_at(const std::string& path, const std::string& context);

void save(const std::string& path, const HostTensor& tensor);

// Loads `path` as a tensor of `dtype`. If `expect_shape` is non-empty the file's shape
// must equal it. Throws mok::Error naming the file and the rule it broke.
HostTensor load(const std::string& path, DType dtype, const std::vector<std::int64_t>& expect_shape = {});
// load, without the conversions it allows ('<f4' rounded to bf16, '<i8' narrowed to i32): the
// file's dtype must be `dtype`'s own, for comparisons that promise the file's very bits.
HostTensor load_exact(const std::string& path, DType dtype, const std::vector<std::int64_t>& expect_shape = {});

}  // namespace mok::npy
