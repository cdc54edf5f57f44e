// The GradReady class (grad_ready.cpp) of ls_fairseq._C: gradient-ready counting for the overlapped all-reduce.
#pragma once

#include <pybind11/pybind11.h>

namespace ls_torch {

// Adds ``GradReady`` to module ``m``.
void bind_grad_ready(pybind11::module_& m);

}  // namespace ls_torch
