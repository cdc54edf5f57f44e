// The autograd nodes of csrc/torch/autograd.cpp over the stand-in adapters, as a module for
// tests/test_cpp_nodes.py. Errors become Python exceptions through pybind11's default translation.
#include <torch/extension.h>

#include "torch/ops.h"

namespace py = pybind11;
using namespace ls_torch;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto none = py::none();
  m.def("ag_layer_norm", &ag_layer_norm, py::arg("x"), py::arg("residual") = none, py::arg("weight"),
        py::arg("bias"), py::arg("eps"));
  m.def("ag_pre_layer_norm", &ag_pre_layer_norm);
  m.def("ag_bias_dropout_residual", &ag_bias_dropout_residual, py::arg("x"), py::arg("bias") = none,
        py::arg("residual"), py::arg("p"));
  m.def("ag_bias_act_dropout", &ag_bias_act_dropout, py::arg("x"), py::arg("bias") = none, py::arg("activation"),
        py::arg("p"));
  m.def("ag_split_heads", &ag_split_heads, py::arg("x"), py::arg("bias") = none, py::arg("n"),
        py::arg("num_heads"));
  m.def("ag_linear", &ag_linear, py::arg("x"), py::arg("weight"), py::arg("bias") = none);
}
