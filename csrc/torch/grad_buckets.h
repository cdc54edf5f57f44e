// The GradBuckets class (grad_buckets.cpp) of ls_fairseq._C: the overlapped all-reduce's per-parameter
// hooks and bucket folds in C++.
#pragma once

#include <pybind11/pybind11.h>

namespace ls_torch {

// Adds ``GradBuckets`` to module ``m``.
void bind_grad_buckets(pybind11::module_& m);

}  // namespace ls_torch
