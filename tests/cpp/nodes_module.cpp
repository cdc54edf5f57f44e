// The autograd nodes of csrc/torch/autograd.cpp and the layers of csrc/torch/layers.cpp over the stand-in
// adapters, and the stand-ins themselves under the adapters' names, as a module for tests/test_cpp_nodes.py
// (whose Python autograd.Functions call the adapters). Errors become Python exceptions through pybind11's
// default translation.
#include <torch/extension.h>

#include "torch/node_bindings.h"
#include "torch/ops.h"

using namespace ls_torch;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  bind_nodes_and_layers(m, [](auto f) { return f; });  // as ls_fairseq._C binds them, without its error guard
  m.def("layer_norm_fwd", &layer_norm_fwd);
  m.def("layer_norm_bwd", &layer_norm_bwd);
  m.def("layer_norm_bwd_invertible", &layer_norm_bwd_invertible);
  m.def("bias_act_dropout_replay", &bias_act_dropout_replay);
  m.def("bias_dropout_residual_fwd", &bias_dropout_residual_fwd);
  m.def("bias_act_dropout_fwd", &bias_act_dropout_fwd);
  m.def("bias_act_dropout_bwd", &bias_act_dropout_bwd);
  m.def("qkv_split_fwd", &qkv_split_fwd);
  m.def("split_heads_bwd", &split_heads_bwd);
}
