// The single Python module ls_fairseq._C. Every entry point checks its arguments with the GIL held and
// releases the GIL around the kernel launches (see launch() in adapter.h).
#include <torch/extension.h>

#include "torch/adapter.h"
#include "torch/grad_buckets.h"
#include "torch/node_bindings.h"
#include "torch/ops.h"

namespace py = pybind11;
using namespace ls_torch;

// Errors cross into Python as a RuntimeError set here, never as a C++ exception through pybind11's
// translator chain (a c10::Error thrown from an extension crashed the interpreter on torch 2.11).
template <typename R, typename... A>
static auto guarded(R (*f)(A...)) {
  return [f](A... a) -> R {
    try {
      return f(std::forward<A>(a)...);
    } catch (const c10::Error& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what_without_backtrace());
    } catch (const std::exception& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
    }
    throw py::error_already_set();
  };
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "ls_fairseq fused CUDA kernels (see csrc/kernels for the numerics of each)";
  const auto none = py::none();

  m.def("layer_norm_fwd", guarded(&layer_norm_fwd), "layer norm (+ residual) forward", py::arg("x"), py::arg("residual") = none,
        py::arg("weight"), py::arg("bias"), py::arg("eps"));
  m.def("layer_norm_bwd", guarded(&layer_norm_bwd), "layer norm backward", py::arg("dy"), py::arg("dsum") = none,
        py::arg("xin"), py::arg("weight"), py::arg("mean"), py::arg("rstd"));
  m.def("layer_norm_bwd_invertible", guarded(&layer_norm_bwd_invertible),
        "layer norm backward from the output y (xhat = (y - bias) / weight)", py::arg("dy"), py::arg("dsum") = none,
        py::arg("y"), py::arg("weight"), py::arg("bias"), py::arg("rstd"));

  m.def("bias_dropout_residual_fwd", guarded(&bias_dropout_residual_fwd), "residual + dropout(x + bias)", py::arg("x"),
        py::arg("bias") = none, py::arg("residual"), py::arg("p"));
  m.def("bias_act_dropout_fwd", guarded(&bias_act_dropout_fwd), "dropout(act(x + bias))", py::arg("x"), py::arg("bias") = none,
        py::arg("activation"), py::arg("p"));
  m.def("bias_act_dropout_replay", guarded(&bias_act_dropout_replay),
        "dropout(act(x + bias)) again from the forward's mask", py::arg("x"), py::arg("bias") = none,
        py::arg("mask") = none, py::arg("activation"), py::arg("p"));
  m.def("bias_act_dropout_bwd", guarded(&bias_act_dropout_bwd), "backward of bias(+act)+dropout", py::arg("dy"),
        py::arg("x") = none, py::arg("bias") = none, py::arg("out") = none, py::arg("mask") = none, py::arg("p"),
        py::arg("activation"), py::arg("need_dbias"));

  m.def("embedding_fwd", guarded(&embedding_fwd), "token x scale + positions + dropout", py::arg("tokens"), py::arg("weight"),
        py::arg("pos_weight") = none, py::arg("positions") = none, py::arg("scale"), py::arg("p"),
        py::arg("padding_idx"), py::arg("zero_pad"));
  m.def("embedding_bwd", guarded(&embedding_bwd), "deterministic embedding-table gradient", py::arg("dy"),
        py::arg("mask") = none, py::arg("keys"), py::arg("tokens"), py::arg("num_embeddings"), py::arg("factor"),
        py::arg("padding_idx"), py::arg("zero_pad"), py::arg("weight_key") = 0);

  m.def("qkv_split_fwd", guarded(&qkv_split_fwd), "[B,T,n*C] (+bias) -> [n,B,H,T,D] (token_major: stored [n,B,T,H,D])",
        py::arg("x"), py::arg("bias") = none, py::arg("n"), py::arg("num_heads"), py::arg("token_major") = false);
  m.def("split_heads_bwd", guarded(&split_heads_bwd),
        "backward of the split into n = len(parts) parts (None: a zero gradient): [dx [B,T,n*H*D], dbias]",
        py::arg("parts"), py::arg("need_dbias"));
  m.def("merge_heads_fwd", guarded(&merge_heads_fwd), "[B,H,T,D] -> [B,T,H*D]", py::arg("x"));
  m.def("merge_heads_bwd", guarded(&merge_heads_bwd), "[B,T,H*D] -> [B,H,T,D]", py::arg("dy"), py::arg("num_heads"));

  m.def("ls_cross_entropy_fwd", guarded(&ls_cross_entropy_fwd), "label-smoothed CE: (loss, nll, lse)", py::arg("logits"),
        py::arg("target"), py::arg("epsilon"), py::arg("ignore_index"));
  m.def("ls_cross_entropy_bwd", guarded(&ls_cross_entropy_bwd), "label-smoothed CE backward", py::arg("logits"),
        py::arg("target"), py::arg("lse"), py::arg("g_loss"), py::arg("g_nll"), py::arg("epsilon"),
        py::arg("ignore_index"), py::arg("inplace") = false);
  m.def("ls_cross_entropy_fwd_bwd", guarded(&ls_cross_entropy_fwd_bwd),
        "label-smoothed CE forward and backward in one pass: (loss, nll); d(grad_scale * loss)/dlogits overwrites "
        "logits", py::arg("logits"), py::arg("target"), py::arg("epsilon"), py::arg("ignore_index"),
        py::arg("grad_scale") = none);

  m.def("adam_step", guarded(&adam_step), "fused Adam/AdamW over flat buffers", py::arg("param"), py::arg("grad"),
        py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("param_lp") = none, py::arg("lr"), py::arg("beta1"),
        py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("step"), py::arg("grad_scale"),
        py::arg("torch_mode"), py::arg("skip_if_nonfinite") = none, py::arg("grad_scale_tensor") = none,
        py::arg("param_lp_peer") = none, py::arg("ranges") = std::vector<int64_t>{}, py::arg("norm_out") = none,
        py::arg("param_lo") = none);
  m.def("grad_norm", guarded(&grad_norm), "L2 norm of a flat buffer, or of ranges of it (fp32 scalar tensor)",
        py::arg("grad"), py::arg("ranges") = std::vector<int64_t>{});

  // autograd nodes and whole layers in C++ (autograd.cpp, layers.cpp)
  bind_nodes_and_layers(m, [](auto f) { return guarded(f); });

  // the layers' products through cuBLASLt (gemm.cpp)
  m.def("gemm_mm", guarded(&gemm_mm), "a b (+ bias), through cuBLASLt when on and the operands fit (token: 0 when "
        "a's rows count tokens, 1 when the summed size does)", py::arg("a"), py::arg("b"), py::arg("bias") = none,
        py::arg("token") = 0);
  m.def("gemm_mm_into", guarded(&gemm_mm_into), "out = a b, or out += a b (add), as gemm_mm", py::arg("out"),
        py::arg("a"), py::arg("b"), py::arg("add"), py::arg("token") = 0);
  m.def("gemm_preload", guarded(&gemm_preload),
        "every class seen at these token counts: plans made and each new kernel run once on scratch operands; "
        "[shapes planned, products run, classes] (classes with a size equal to skip_size left out)",
        py::arg("token_counts"), py::arg("skip_size") = 0);
  m.def("gemm_lt_available", guarded(&gemm_lt_available), "whether this build and process have cuBLASLt");
  m.def("gemm_lt_enable", guarded(&gemm_lt_enable), "the products through cuBLASLt");
  m.def("gemm_lt_disable", guarded(&gemm_lt_disable), "the products through ATen");
  m.def("gemm_lt_on", guarded(&gemm_lt_on), "whether the products go through cuBLASLt");
  m.def("gemm_lt_report", guarded(&gemm_lt_report),
        "[on, classes, shapes through cuBLASLt, shapes through ATen, kernels run, refusals, preload products, "
        "preload ms]");

  // FP8 (fp8.cpp, fp8_nodes.cpp, fp8.cu, fp8_fused.cu)
  m.def("fp8_quantize", guarded(&fp8_quantize),
        "FP8 codes of a 2-d tensor under one row of an FP8 state: [row-major codes, transposed codes] (fp8.cpp)",
        py::arg("x"), py::arg("state"), py::arg("row"), py::arg("format"), py::arg("current"), py::arg("rowwise") = true,
        py::arg("transposed") = false);
  m.def("ls_cross_entropy_fwd_bwd_fp8", guarded(&ls_cross_entropy_fwd_bwd_fp8),
        "the head's label-smoothed CE (loss, nll) with its gradient only as FP8 codes: [loss, nll, codes, "
        "transposed codes] (cross_entropy.cpp)", py::arg("logits"), py::arg("target"), py::arg("epsilon"),
        py::arg("ignore_index"), py::arg("grad_scale"), py::arg("state"), py::arg("row"), py::arg("format"),
        py::arg("transposed"));
  m.def("fp8_linear_forward_codes", guarded(&fp8_linear_forward_codes),
        "an FP8 projection's forward outside autograd: [y, x's transposed codes, W's transposed codes, 1/s of x, "
        "1/s of W] (fp8.cpp)", py::arg("x"), py::arg("weight"), py::arg("mode"), py::arg("state"), py::arg("slot"),
        py::arg("keep_x"));
  m.def("fp8_backward_gemms", guarded(&fp8_backward_gemms),
        "an FP8 projection's input-gradient and weight-gradient GEMMs from the output gradient's codes: [dx, dW] "
        "(fp8.cpp)", py::arg("gq"), py::arg("gq_t"), py::arg("sg"), py::arg("xq_t"), py::arg("wq_t"), py::arg("sx"),
        py::arg("sw"), py::arg("dtype"), py::arg("dw_out") = none);
  m.def("fp8_roll", guarded(&fp8_roll), "each FP8 state row's amax into its history, and its next scale (fp8.cu)",
        py::arg("state"), py::arg("grad_format"));
  m.def("fp8_cast_weights", guarded(&fp8_cast_weights),
        "a training forward's FP8 weights cast in one launch, each under its state row; the projections take "
        "their codes (fp8.cpp)", py::arg("weights"), py::arg("state"), py::arg("rows"));
  m.def("fp8_forget_weights", guarded(&fp8_forget_weights),
        "drop the weights' codes no projection took; returns how many (fp8.cpp)");
  m.def("ag_fp8_linear", guarded(&ag_fp8_linear), "differentiable x W^T (+ b) as FP8 GEMMs (fp8_nodes.cpp)",
        py::arg("x"), py::arg("weight"), py::arg("bias") = none, py::arg("mode"), py::arg("state"), py::arg("slot"));
  m.def("ag_fp8_linear_split", guarded(&ag_fp8_linear_split),
        "differentiable x W^T (+ b) split into n parts of heads [B, H, T, D], the projection in FP8, as one node "
        "(fp8_nodes.cpp)", py::arg("x"), py::arg("weight"), py::arg("bias") = none, py::arg("n"), py::arg("num_heads"),
        py::arg("mode"), py::arg("state"), py::arg("slot"));
  m.def("ag_fp8_linear_residual", guarded(&ag_fp8_linear_residual),
        "differentiable residual + dropout(x W^T + b), the projection in FP8, as one node: [out, mask] (fp8_nodes.cpp)",
        py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("residual"), py::arg("p"), py::arg("mode"),
        py::arg("state"), py::arg("slot"));
  m.def("ag_fp8_ffn", guarded(&ag_fp8_ffn),
        "differentiable residual + dropout(dropout(act(x W1^T + b1)) W2^T + b2), both projections in FP8 as one "
        "node: [out, activation mask, output mask] (fp8_nodes.cpp)",
        py::arg("x"), py::arg("w1"), py::arg("b1"), py::arg("w2"), py::arg("b2"), py::arg("residual"),
        py::arg("activation"), py::arg("p"), py::arg("p_out"), py::arg("mode"), py::arg("state"), py::arg("slot1"),
        py::arg("slot2"), py::arg("keep_codes") = true);
  m.def("ag_fp8_ln_linear_split", guarded(&ag_fp8_ln_linear_split),
        "ag_fp8_linear_split of layer_norm(x), the layer norm written only as the projection's input codes: the "
        "parts, then x (fp8_nodes.cpp)",
        py::arg("x"), py::arg("ln_weight"), py::arg("ln_bias"), py::arg("eps"), py::arg("weight"),
        py::arg("bias") = none, py::arg("n"), py::arg("num_heads"), py::arg("mode"), py::arg("state"),
        py::arg("slot"));
  m.def("ag_fp8_ln_ffn", guarded(&ag_fp8_ln_ffn),
        "ag_fp8_ffn of layer_norm(x) with x as the residual, the layer norm written only as the first projection's "
        "input codes (fp8_nodes.cpp)",
        py::arg("x"), py::arg("ln_weight"), py::arg("ln_bias"), py::arg("eps"), py::arg("w1"), py::arg("b1"),
        py::arg("w2"), py::arg("b2"), py::arg("activation"), py::arg("p"), py::arg("p_out"), py::arg("mode"),
        py::arg("state"), py::arg("slot1"), py::arg("slot2"), py::arg("keep_codes") = true);
  // packed sequences when cu_q is given (with cu_k, max_q, max_k: ops.h)
  m.def("short_attention_fits", guarded(+[](const Tensor& q, const Tensor& k, const Tensor& v, const OptTensor& attend,
                                             const OptTensor& cu_q, const OptTensor& cu_k, int64_t max_q,
                                             int64_t max_k) {
          const Packed pk = packed_args(cu_q, cu_k, max_q, max_k);
          return short_attention_fits(q, k, v, attend, present(cu_q) ? &pk : nullptr);
        }),
        "whether attention over these tensors can take the short-sequence kernel (attention.cpp)", py::arg("q"),
        py::arg("k"), py::arg("v"), py::arg("attend") = none, py::arg("cu_q") = none, py::arg("cu_k") = none,
        py::arg("max_q") = 0, py::arg("max_k") = 0);
  m.def("short_attention_fwd", guarded(+[](const Tensor& q, const Tensor& k, const Tensor& v, const OptTensor& attend,
                                            bool causal, double p, const OptTensor& cu_q, const OptTensor& cu_k,
                                            int64_t max_q, int64_t max_k) {
          const Packed pk = packed_args(cu_q, cu_k, max_q, max_k);
          return short_attention_fwd(q, k, v, attend, causal, p, present(cu_q) ? &pk : nullptr);
        }),
        "attention over short sequences: [out (token-major), lse, keep bits] (attention.cu)", py::arg("q"),
        py::arg("k"), py::arg("v"), py::arg("attend") = none, py::arg("causal") = false, py::arg("p") = 0.0,
        py::arg("cu_q") = none, py::arg("cu_k") = none, py::arg("max_q") = 0, py::arg("max_k") = 0);
  m.def("short_attention_bwd", guarded(+[](const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                                            const Tensor& out, const Tensor& lse, const Tensor& mask,
                                            const OptTensor& attend, bool causal, double p, const OptTensor& cu_q,
                                            const OptTensor& cu_k, int64_t max_q, int64_t max_k) {
          const Packed pk = packed_args(cu_q, cu_k, max_q, max_k);
          return short_attention_bwd(dout, q, k, v, out, lse, mask, attend, causal, p, present(cu_q) ? &pk : nullptr);
        }),
        "backward of short_attention_fwd: [dq, dk, dv]", py::arg("dout"), py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("out"), py::arg("lse"), py::arg("mask"), py::arg("attend") = none, py::arg("causal") = false,
        py::arg("p") = 0.0, py::arg("cu_q") = none, py::arg("cu_k") = none, py::arg("max_q") = 0,
        py::arg("max_k") = 0);
  m.def("ag_short_attention", guarded(+[](const Tensor& q, const Tensor& k, const Tensor& v, const OptTensor& attend,
                                           bool causal, double p, const OptTensor& cu_q, const OptTensor& cu_k,
                                           int64_t max_q, int64_t max_k) {
          const Packed pk = packed_args(cu_q, cu_k, max_q, max_k);
          return ag_short_attention(q, k, v, attend, causal, p, present(cu_q) ? &pk : nullptr);
        }),
        "differentiable attention over short sequences as one node (attention.cpp)", py::arg("q"), py::arg("k"),
        py::arg("v"), py::arg("attend") = none, py::arg("causal") = false, py::arg("p") = 0.0,
        py::arg("cu_q") = none, py::arg("cu_k") = none, py::arg("max_q") = 0, py::arg("max_k") = 0);
  bind_grad_buckets(m);  // the overlapped all-reduce's gradient hooks and bucket folds (no CUDA)
}
