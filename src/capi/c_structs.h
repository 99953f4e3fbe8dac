// mok's C++ values as the C interface's plain structs (include/mok/c_api.h): what the library
// hands out (combine_slots, named shapes) and what a C++ caller of the interface builds (the
// C interface's own tests). The reverse direction, with its checks, stays in c_api.cpp.
#pragma once
#include "mok/c_api.h"
#include "mok/problem.h"
#include "mok/tensor.h"

namespace mok::capi {

mok_tensor c_tensor(const TensorView& v);
// (p.num_shared() <= MOK_C_MAX_SHARED: the caller checks, naming what the problem came from.)
mok_problem c_problem(const Problem& p);

}  // namespace mok::capi
