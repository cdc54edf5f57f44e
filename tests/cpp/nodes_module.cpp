// The autograd nodes of csrc/torch/autograd.cpp and the layers of csrc/torch/layers.cpp over the stand-in
// adapters, and the stand-ins themselves under the adapters' names, as a module for tests/test_cpp_nodes.py
// (whose Python autograd.Functions call the adapters). Errors become Python exceptions through pybind11's
// default translation.
#include <torch/extension.h>

#include "torch/ops.h"

namespace py = pybind11;
using namespace ls_torch;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto none = py::none();
  m.def("ag_layer_norm", &ag_layer_norm, py::arg("x"), py::arg("residual") = none, py::arg("weight"),
        py::arg("bias"), py::arg("eps"), py::arg("invertible") = false);
  m.def("ag_pre_layer_norm", &ag_pre_layer_norm, py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("eps"),
        py::arg("invertible") = false);
  m.def("ag_bias_act_linear", &ag_bias_act_linear, py::arg("x"), py::arg("bias") = none, py::arg("weight"),
        py::arg("activation"), py::arg("p"), py::arg("fp8") = 0, py::arg("fp8_state") = none, py::arg("fp8_slot") = 0);
  m.def("ag_bias_dropout_residual", &ag_bias_dropout_residual, py::arg("x"), py::arg("bias") = none,
        py::arg("residual"), py::arg("p"));
  m.def("ag_bias_act_dropout", &ag_bias_act_dropout, py::arg("x"), py::arg("bias") = none, py::arg("activation"),
        py::arg("p"));
  m.def("ag_split_heads", &ag_split_heads, py::arg("x"), py::arg("bias") = none, py::arg("n"),
        py::arg("num_heads"));
  m.def("ag_linear", &ag_linear, py::arg("x"), py::arg("weight"), py::arg("bias") = none);
  m.def("encoder_layer_fwd", &encoder_layer_fwd, py::arg("x"), py::arg("key_padding_mask") = none, py::arg("weights"), py::arg("eps"),
        py::arg("num_heads"), py::arg("dropout"), py::arg("activation_dropout"), py::arg("attention_dropout"),
        py::arg("activation"), py::arg("normalize_before"), py::arg("short_len"), py::arg("fp8") = 0,
        py::arg("fp8_state") = none, py::arg("fp8_slot") = 0, py::arg("memory") = 0);
  m.def("decoder_layer_fwd", &decoder_layer_fwd, py::arg("x"), py::arg("cross_k"), py::arg("cross_v"), py::arg("encoder_padding_mask") = none,
        py::arg("self_attn_padding_mask") = none, py::arg("weights"), py::arg("eps"), py::arg("num_heads"),
        py::arg("dropout"), py::arg("activation_dropout"), py::arg("attention_dropout"),
        py::arg("cross_attention_dropout"), py::arg("activation"), py::arg("normalize_before"), py::arg("short_len"),
        py::arg("fp8") = 0, py::arg("fp8_state") = none, py::arg("fp8_slot") = 0, py::arg("memory") = 0);
  m.def("layer_norm_fwd", &layer_norm_fwd);
  m.def("layer_norm_bwd", &layer_norm_bwd);
  m.def("layer_norm_bwd_invertible", &layer_norm_bwd_invertible);
  m.def("bias_act_dropout_replay", &bias_act_dropout_replay);
  m.def("bias_dropout_residual_fwd", &bias_dropout_residual_fwd);
  m.def("bias_act_dropout_fwd", &bias_act_dropout_fwd);
  m.def("bias_act_dropout_bwd", &bias_act_dropout_bwd);
  m.def("qkv_split_fwd", &qkv_split_fwd);
  m.def("qkv_split_bwd", &qkv_split_bwd);
}
