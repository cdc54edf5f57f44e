// The Python bindings of the C++ autograd nodes (autograd.cpp) and whole-layer calls (layers.cpp), with their
// argument names and defaults in one place: ls_fairseq._C (bindings.cpp) and the CPU test module over stand-in
// adapters (tests/cpp/nodes_module.cpp) both bind them from here. `wrap` turns a function pointer into what is
// bound (bindings.cpp: its error guard; the test module: the function itself).
#pragma once

#include <torch/extension.h>

#include "torch/ops.h"

namespace ls_torch {

template <typename Wrap>
void bind_nodes_and_layers(pybind11::module_& m, Wrap wrap) {
  namespace py = pybind11;
  const auto none = py::none();
  m.def("ag_layer_norm", wrap(&ag_layer_norm), "differentiable layer norm (+ residual): [y] or [y, x + residual]",
        py::arg("x"), py::arg("residual") = none, py::arg("weight"), py::arg("bias"), py::arg("eps"),
        py::arg("invertible") = false);
  m.def("ag_pre_layer_norm", wrap(&ag_pre_layer_norm), "differentiable pre-LN entry: [layer_norm(x), x]",
        py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("eps"), py::arg("invertible") = false);
  m.def("ag_bias_dropout_residual", wrap(&ag_bias_dropout_residual),
        "differentiable residual + dropout(x + bias): [out, mask]", py::arg("x"), py::arg("bias") = none,
        py::arg("residual"), py::arg("p"));
  m.def("ag_bias_act_dropout", wrap(&ag_bias_act_dropout), "differentiable dropout(act(x + bias)): [out, mask]",
        py::arg("x"), py::arg("bias") = none, py::arg("activation"), py::arg("p"));
  m.def("ag_split_heads", wrap(&ag_split_heads), "differentiable [B,T,n*C] (+bias) -> n x [B,H,T,D]",
        py::arg("x"), py::arg("bias") = none, py::arg("n"), py::arg("num_heads"));
  m.def("ag_linear_split", wrap(&ag_linear_split),
        "differentiable x W^T (+ b) [B,T,K] -> n x [B,H,T,D], views of one GEMM's output (autograd.cpp)",
        py::arg("x"), py::arg("weight"), py::arg("bias") = none, py::arg("n"), py::arg("num_heads"));
  m.def("ag_linear", wrap(&ag_linear), "differentiable x W^T (+ b), one GEMM over the flattened rows",
        py::arg("x"), py::arg("weight"), py::arg("bias") = none);
  m.def("ag_bias_act_linear", wrap(&ag_bias_act_linear),
        "differentiable dropout(act(x + bias)) W^T keeping the activation's input, not its output: [y, mask] "
        "(autograd.cpp)", py::arg("x"), py::arg("bias") = none, py::arg("weight"), py::arg("activation"),
        py::arg("p"), py::arg("fp8") = 0, py::arg("fp8_state") = none, py::arg("fp8_slot") = 0,
        py::arg("keep_fp8_codes") = false);
  m.def("set_weight_grad_sinks", wrap(&set_weight_grad_sinks),
        "while a backward is captured: write each parameter's weight gradient into its destination (weight_grads.cpp)",
        py::arg("params"), py::arg("dests"), py::arg("accumulate"));
  m.def("add_weight_grad_sinks", wrap(&add_weight_grad_sinks),
        "after set_weight_grad_sinks: sinks that every writer adds to (weight_grads.cpp)", py::arg("params"),
        py::arg("dests"));
  m.def("take_weight_grad_sinks", wrap(&take_weight_grad_sinks),
        "data pointers of the parameters whose gradients went into their sinks; the sinks are dropped");
  m.def("encoder_layer_fwd", wrap(&encoder_layer_fwd),
        "an encoder layer's forward over the nodes above, in one call (layers.cpp)", py::arg("x"),
        py::arg("key_padding_mask") = none, py::arg("weights"), py::arg("eps"), py::arg("num_heads"),
        py::arg("dropout"), py::arg("activation_dropout"), py::arg("attention_dropout"), py::arg("activation"),
        py::arg("normalize_before"), py::arg("short_len"), py::arg("fp8") = 0, py::arg("fp8_state") = none,
        py::arg("fp8_slot") = 0, py::arg("memory") = 0, py::arg("cu_seqlens") = none, py::arg("max_len") = 0);
  m.def("decoder_layer_fwd", wrap(&decoder_layer_fwd),
        "a decoder layer's full-sequence forward over the nodes above, in one call (layers.cpp)", py::arg("x"),
        py::arg("cross_k"), py::arg("cross_v"), py::arg("encoder_padding_mask") = none,
        py::arg("self_attn_padding_mask") = none, py::arg("weights"), py::arg("eps"), py::arg("num_heads"),
        py::arg("dropout"), py::arg("activation_dropout"), py::arg("attention_dropout"),
        py::arg("cross_attention_dropout"), py::arg("activation"), py::arg("normalize_before"),
        py::arg("short_len"), py::arg("fp8") = 0, py::arg("fp8_state") = none, py::arg("fp8_slot") = 0,
        py::arg("memory") = 0, py::arg("cu_tgt") = none, py::arg("max_tgt") = 0, py::arg("cu_src") = none,
        py::arg("max_src") = 0);
}

}  // namespace ls_torch
