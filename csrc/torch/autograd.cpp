// Autograd nodes written in C++ for the ops a training step calls most often (per transformer-big
// micro-batch: 32 layer norms, 30 bias+dropout+residual, 12 bias+act+dropout, 12 head splits, 62
// linear layers). A Python torch.autograd.Function costs tens of microseconds of host time per call
// (building its context in Python, and in the backward taking the GIL and calling Python); these
// nodes do the same work without entering Python after the call. The numerics are those of the
// adapters they call (layer_norm.cpp, dropout.cpp, heads.cpp) and of the products (gemm.cpp); the Python
// Functions in ls_fairseq/ops stay for torch.compile, which traces them through the custom ops.
//
// Conventions: an optional tensor argument is a std::optional<Tensor>: when empty (or holding an undefined
// tensor) it is not an input of the node at all (an undefined at::Tensor would be, and the node records the
// device of every input), so it has no edge, and needs_input_grad() indices count only the tensors present. backward returns one
// entry per forward argument, undefined for the absent and the non-tensor ones. Gradients that are not
// needed arrive undefined (set_materialize_grads(false)); parameter gradients are returned in the
// parameter's dtype.
#include <torch/extension.h>

#include "torch/ops.h"

namespace ls_torch {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace {

inline OptTensor opt(const Tensor& t) { return t.defined() ? OptTensor(t) : std::nullopt; }
inline OptTensor opt_contig(const Tensor& t) { return t.defined() ? OptTensor(contig(t)) : std::nullopt; }
inline OptTensor opt_contig(const OptTensor& t) { return present(t) ? OptTensor(contig(*t)) : std::nullopt; }
inline Tensor or_undefined(const OptTensor& t) { return present(t) ? *t : Tensor(); }
inline Tensor as_dtype(const Tensor& t, int64_t dt) {
  const auto st = static_cast<at::ScalarType>(dt);
  return (!t.defined() || t.scalar_type() == st) ? t : t.to(st);
}
inline int64_t dtype_code(const Tensor& t) { return static_cast<int64_t>(t.defined() ? t.scalar_type() : at::kFloat); }
inline int64_t dtype_code(const OptTensor& t) { return dtype_code(or_undefined(t)); }
// x2 [M, K] W^T (+ b): one GEMM, the bias added in its epilogue
inline Tensor linear_rows(const Tensor& x2, const Tensor& weight, const OptTensor& bias) {
  return gemm_mm(x2, weight.t(), bias, 0);
}

// The optional bias at argument 1 (the dropout nodes and the head split): whether it is there, and its dtype.
inline void keep_bias_info(AutogradContext* ctx, const OptTensor& bias) {
  ctx->saved_data["hb"] = present(bias);
  ctx->saved_data["bdt"] = dtype_code(bias);
}
inline bool bias_grad_needed(AutogradContext* ctx) {
  return ctx->saved_data["hb"].toBool() && ctx->needs_input_grad(1);
}
inline Tensor bias_grad(AutogradContext* ctx, const Tensor& db, bool needed) {
  return needed ? as_dtype(db, ctx->saved_data["bdt"].toInt()) : Tensor();
}
// The two layer-norm nodes: the forward keeps the normalised input, the weight, mean and rstd (r[2], r[3]
// of layer_norm_fwd) and the bias dtype; the backward turns them into {dx, dweight, dbias}, dx including
// gsum (the gradient that reached the normalised input by another way), parameter gradients in their dtypes.
// Invertible (--ls-invertible-layernorm): the forward keeps the output y (r[0]), the weight, the bias and rstd
// instead, and the backward recovers the normalised input from y (layer_norm.cu). y is the input of the next
// linear layer, which keeps it anyway, so the layer norm's input is no longer held for the backward.
inline void keep_layer_norm(AutogradContext* ctx, const Tensor& input, const Tensor& weight, const Tensor& bias,
                            const std::vector<Tensor>& r, bool invertible) {
  ctx->set_materialize_grads(false);
  if (invertible)
    ctx->save_for_backward({r[0], weight, r[3], bias});
  else
    ctx->save_for_backward({input, weight, r[3], r[2]});
  ctx->saved_data["inv"] = invertible;
  ctx->saved_data["bdt"] = dtype_code(bias);
}
inline std::vector<Tensor> layer_norm_grads(AutogradContext* ctx, const Tensor& gy, const Tensor& gsum) {
  auto s = ctx->get_saved_variables();
  auto r = ctx->saved_data["inv"].toBool()
               ? layer_norm_bwd_invertible(contig(gy), opt_contig(gsum), s[0], s[1], s[3], s[2])
               : layer_norm_bwd(contig(gy), opt_contig(gsum), s[0], s[1], s[3], s[2]);
  return {r[0], as_dtype(r[1], dtype_code(s[1])), as_dtype(r[2], ctx->saved_data["bdt"].toInt())};
}

// What the dropout nodes keep besides their tensors; their mask output has no gradient.
inline void keep_dropout_info(AutogradContext* ctx, double p, const OptTensor& bias, const Tensor& mask) {
  ctx->saved_data["p"] = p;
  keep_bias_info(ctx, bias);
  ctx->mark_non_differentiable({mask});
}

// layer_norm(x) -> [y]; with a residual: layer_norm(x + residual), x + residual -> [y, s]
struct LayerNormNode : public torch::autograd::Function<LayerNormNode> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const OptTensor& residual,
                               const Tensor& weight, const Tensor& bias, double eps, bool invertible) {
    const bool has_res = present(residual);
    Tensor xc = contig(x);
    auto r = layer_norm_fwd(xc, opt_contig(residual), weight, bias, eps);
    keep_layer_norm(ctx, has_res ? r[1] : xc, weight, bias, r, invertible);
    ctx->saved_data["res"] = has_res;
    if (has_res) return {r[0], r[1]};
    return {r[0]};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const bool has_res = ctx->saved_data["res"].toBool();
    const Tensor gs = has_res && grads.size() > 1 ? grads[1] : Tensor();
    if (!grads[0].defined()) {  // only x + residual was used
      return {gs, has_res ? gs : Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
    }
    auto d = layer_norm_grads(ctx, grads[0], gs);
    return {d[0], has_res ? d[0] : Tensor(), d[1], d[2], Tensor(), Tensor()};
  }
};

// pre-LN block entry: (layer_norm(x), x). Both gradients reach this node, and the kernel adds the
// residual branch's gradient into dx in the same pass.
struct PreLayerNormNode : public torch::autograd::Function<PreLayerNormNode> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& weight, const Tensor& bias,
                               double eps, bool invertible) {
    Tensor xc = contig(x);
    auto r = layer_norm_fwd(xc, std::nullopt, weight, bias, eps);
    keep_layer_norm(ctx, xc, weight, bias, r, invertible);
    return {r[0], x.view_as(x)};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const Tensor gx = grads.size() > 1 ? grads[1] : Tensor();
    if (!grads[0].defined()) return {gx, Tensor(), Tensor(), Tensor(), Tensor()};
    auto d = layer_norm_grads(ctx, grads[0], gx);
    return {d[0], d[1], d[2], Tensor(), Tensor()};
  }
};

// residual + dropout(x + bias) -> [out, mask]; saves only the 1-bit-per-element mask.
struct BiasDropoutResidualNode : public torch::autograd::Function<BiasDropoutResidualNode> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const OptTensor& bias, const Tensor& residual,
                               double p) {
    auto r = bias_dropout_residual_fwd(contig(x), bias, contig(residual), p);
    ctx->set_materialize_grads(false);
    ctx->save_for_backward({r[1]});
    keep_dropout_info(ctx, p, bias, r[1]);
    return {r[0], r[1]};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const Tensor& g = grads[0];
    if (!g.defined()) return {Tensor(), Tensor(), Tensor(), Tensor()};
    const double p = ctx->saved_data["p"].toDouble();
    const bool need_db = bias_grad_needed(ctx);
    auto s = ctx->get_saved_variables();
    auto r = bias_act_dropout_bwd(contig(g), std::nullopt, std::nullopt, std::nullopt,
                                  p > 0 ? OptTensor(s[0]) : std::nullopt, p, "none", need_db);
    return {r[0], bias_grad(ctx, r[1], need_db), g, Tensor()};
  }
};

// dropout(activation(x + bias)) -> [out, mask]; relu saves its output only, gelu x, bias and the mask.
struct BiasActDropoutNode : public torch::autograd::Function<BiasActDropoutNode> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const OptTensor& bias,
                               const std::string& activation, double p) {
    Tensor xc = contig(x);
    auto r = bias_act_dropout_fwd(xc, bias, activation, p);
    const bool relu = activation == "relu";
    ctx->set_materialize_grads(false);
    if (relu)
      ctx->save_for_backward({r[0]});
    else
      ctx->save_for_backward({xc, or_undefined(bias), r[1]});
    ctx->saved_data["act"] = activation;
    keep_dropout_info(ctx, p, bias, r[1]);
    return {r[0], r[1]};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const Tensor& g = grads[0];
    if (!g.defined()) return {Tensor(), Tensor(), Tensor(), Tensor()};
    const std::string act = ctx->saved_data["act"].toStringRef();
    const double p = ctx->saved_data["p"].toDouble();
    const bool need_db = bias_grad_needed(ctx);
    auto s = ctx->get_saved_variables();
    std::vector<Tensor> r;
    if (act == "relu") {
      r = bias_act_dropout_bwd(contig(g), std::nullopt, std::nullopt, s[0], std::nullopt, p, act, need_db);
    } else {
      r = bias_act_dropout_bwd(contig(g), s[0], opt(s[1]), std::nullopt, p > 0 ? OptTensor(s[2]) : std::nullopt, p,
                               act, need_db);
    }
    return {r[0], bias_grad(ctx, r[1], need_db), Tensor(), Tensor()};
  }
};

// y = dropout(act(x + b)) W^T as one node that does not keep the activation's output a for the backward.
// --ls-recompute-activation: the stored pair (BiasActDropoutNode, then LinearNode) keeps, for gelu, both the
// activation's input (for gelu') and a (for the weight gradient); this node keeps the input and the 1-bit mask and
// computes a again in the backward (bias_act_dropout_replay: the forward's arithmetic and keep bits, so the same
// values bit for bit). The GEMMs and the activation backward are the stored pair's own calls in the same order, so
// every gradient equals the stored path's bit for bit, for one more elementwise pass over [tokens, ffn]. For relu
// the stored pair keeps a alone already (relu' comes from a > 0): the layers recompute for gelu only.
// FP8: a exists only as its e4m3 codes, written by the activation's own pass (fp8_act_linear_forward); the
// weight gradient reads their transposed copy, kept (keep_fp8_codes: the layers' FP8 FFN, relu or gelu) or made
// again from x and the mask (recomputing). With the codes kept, relu keeps only the bits of a > 0 (neither x nor
// the keep bits): its backward is dy * [a > 0] / (1 - p). The codes, and so every gradient, equal those of the
// stored pair with the FP8 linear node.
struct BiasActLinearNode : public torch::autograd::Function<BiasActLinearNode> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const OptTensor& bias, const Tensor& weight,
                               const std::string& activation, double p, int64_t fp8, const OptTensor& fp8_state,
                               int64_t fp8_slot, bool keep_fp8_codes) {
    Tensor xc = contig(x);
    const bool use_fp8 = fp8 > 0 && fp8_linear_shapes_ok(weight) && xc.numel() > 0;
    // FP8 relu with the codes kept: the bits of a > 0 are all its backward needs (neither x nor the keep bits)
    const bool relu_bits = use_fp8 && keep_fp8_codes && activation == "relu";
    Tensor y2, mask, aq_t, wq_t, sx, sw;
    if (use_fp8) {
      auto f = fp8_act_linear_forward(xc.reshape({-1, x.size(-1)}), bias, weight, activation, p, fp8, fp8_state,
                                      fp8_slot, keep_fp8_codes, relu_bits);
      y2 = f[0], mask = f[1], aq_t = f[2], wq_t = f[3], sx = f[4], sw = f[5];
    } else {
      auto r = bias_act_dropout_fwd(xc, bias, activation, p);  // [a, mask]
      y2 = gemm_mm(r[0].reshape({-1, x.size(-1)}), weight.t(), std::nullopt, 0);
      mask = r[1];
    }
    auto sizes = x.sizes().vec();
    sizes.back() = weight.size(0);
    ctx->set_materialize_grads(false);
    ctx->save_for_backward({relu_bits ? Tensor() : xc, or_undefined(bias), mask, weight, wq_t, sx, sw,
                            or_undefined(fp8_state), aq_t});
    ctx->saved_data["x_sizes"] = x.sizes().vec();
    ctx->saved_data["relu_bits"] = relu_bits;
    ctx->saved_data["act"] = activation;
    ctx->saved_data["fp8"] = use_fp8 ? fp8 : int64_t(0);
    ctx->saved_data["slot"] = fp8_slot;
    keep_dropout_info(ctx, p, bias, mask);
    return {at::_unsafe_view(y2, sizes), mask};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const Tensor& g = grads[0];
    const variable_list none(9);
    if (!g.defined()) return none;
    auto s = ctx->get_saved_variables();
    const Tensor &xc = s[0], &w = s[3];
    const OptTensor bias = opt(s[1]);
    const std::string act = ctx->saved_data["act"].toStringRef();
    const double p = ctx->saved_data["p"].toDouble();
    const bool relu_bits = ctx->saved_data["relu_bits"].toBool();
    const OptTensor mask = p > 0 || relu_bits ? OptTensor(s[2]) : std::nullopt;
    const auto x_sizes = ctx->saved_data["x_sizes"].toIntVector();
    const int64_t fp8 = ctx->saved_data["fp8"].toInt();
    const bool need_db = bias_grad_needed(ctx);
    const bool need_dw = ctx->needs_input_grad(present(bias) ? 2 : 1);  // counts the tensors present

    Tensor g2 = contig(g.reshape({-1, w.size(0)}));
    std::vector<Tensor> r;
    Tensor dw;
    if (fp8 > 0) {
      const OptTensor state = opt(s[7]);
      const int64_t slot = ctx->saved_data["slot"].toInt();
      Tensor aq_t = s[8];
      if (!aq_t.defined() && need_dw)
        aq_t = fp8_act_codes_t(xc.reshape({-1, xc.size(-1)}), bias, mask, act, p, fp8, state, slot);
      auto d = fp8_linear_backward_codes(g2, aq_t, s[4], s[5], s[6], fp8, state, slot, need_dw, w.data_ptr());
      dw = d[1];
      // relu: from the bits of a > 0; gelu: from x and the keep bits
      r = bias_act_dropout_bwd(at::_unsafe_view(d[0], x_sizes), relu_bits ? std::nullopt : OptTensor(xc), bias,
                               std::nullopt, mask, p, act, need_db);
    } else {
      Tensor a = bias_act_dropout_replay(xc, bias, mask, act, p);
      Tensor a2 = a.reshape({-1, xc.size(-1)});
      dw = need_dw ? weight_grad_mm(w, g2.t(), a2) : Tensor();  // undefined when written into its sink
      Tensor da2 = gemm_mm(g2, w, std::nullopt, 0);
      const bool relu = act == "relu";
      r = bias_act_dropout_bwd(at::_unsafe_view(da2, xc.sizes()), relu ? std::nullopt : OptTensor(xc), bias,
                               relu ? OptTensor(a) : std::nullopt, mask, p, act, need_db);
    }
    return {r[0], bias_grad(ctx, r[1], need_db), dw, Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

// [B, T, n*C] (+ bias) -> n parts [B, H, T, D] stored token-major (n <= 3: q, k, v or k, v)
struct SplitHeadsNode : public torch::autograd::Function<SplitHeadsNode> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const OptTensor& bias, int64_t n,
                               int64_t num_heads) {
    Tensor out = qkv_split_fwd(contig(x), bias, n, num_heads, true);
    ctx->set_materialize_grads(false);
    ctx->saved_data["n"] = n;
    keep_bias_info(ctx, bias);
    return out.unbind(0);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto d = part_grads(grads, ctx->saved_data["n"].toInt());
    if (d.empty()) return {Tensor(), Tensor(), Tensor(), Tensor()};
    const bool need_db = bias_grad_needed(ctx);
    auto r = split_heads_bwd(d, need_db);
    return {r[0], bias_grad(ctx, r[1], need_db), Tensor(), Tensor()};
  }
};

// y = x W^T (+ b) for x [..., K], W [N, K]: one GEMM on the flattened rows, one node in the graph
// (at::linear on a 3-d input records the transpose, the reshape and the product as separate nodes).
// The weight gradient is computed as dY^T X, already in W's [N, K] layout.
struct LinearNode : public torch::autograd::Function<LinearNode> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& weight, const OptTensor& bias) {
    const int64_t K = x.size(-1);
    Tensor x2 = x.reshape({-1, K});
    Tensor y2 = linear_rows(x2, weight, bias);
    auto sizes = x.sizes().vec();
    sizes.back() = weight.size(0);
    ctx->set_materialize_grads(false);
    ctx->save_for_backward({x2, weight});
    ctx->saved_data["hb"] = present(bias);
    // not a view for autograd (y2 is this node's own buffer), as at::matmul returns its folded product
    return at::_unsafe_view(y2, sizes);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const Tensor& g = grads[0];
    if (!g.defined()) return {Tensor(), Tensor(), Tensor()};
    auto s = ctx->get_saved_variables();
    const Tensor &x2 = s[0], &w = s[1];
    Tensor g2 = g.reshape({-1, w.size(0)});
    Tensor dx, dw, db;
    if (ctx->needs_input_grad(0)) {
      auto sizes = g.sizes().vec();
      sizes.back() = w.size(1);
      dx = at::_unsafe_view(gemm_mm(g2, w, std::nullopt, 0), sizes);
    }
    if (ctx->needs_input_grad(1)) dw = weight_grad_mm(w, g2.t(), x2);  // undefined when written into its sink
    if (ctx->saved_data["hb"].toBool() && ctx->needs_input_grad(2)) db = g2.sum(0);
    return {dx, dw, db};
  }
};

// x W^T + b split into n parts of heads [B, H, T, D] (x [B, T, K], W [n*H*D, K]): one GEMM with the bias added in
// its epilogue (fp32, one rounding), the parts views of its output, so nothing is copied in the forward (a linear node
// and a split node write the product, then read it back to add the bias and copy the heads); the attention kernels
// read the heads in place through their strides. Backward: the parts' gradients merged, the bias gradient summed on
// the way (split_heads_bwd), then the input and weight gradients as the linear node's.
struct LinearSplitNode : public torch::autograd::Function<LinearSplitNode> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& weight, const OptTensor& bias,
                               int64_t n, int64_t num_heads) {
    const int64_t B = x.size(0), T = x.size(1), K = x.size(2);
    Tensor x2 = x.reshape({B * T, K});
    Tensor y2 = linear_rows(x2, weight, bias);
    ctx->set_materialize_grads(false);
    ctx->save_for_backward({x2, weight});
    ctx->saved_data["hb"] = present(bias);
    ctx->saved_data["n"] = n;
    ctx->saved_data["x_sizes"] = x.sizes().vec();
    return head_views(y2, B, T, n, num_heads);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto d = part_grads(grads, ctx->saved_data["n"].toInt());
    if (d.empty()) return variable_list(5);
    auto s = ctx->get_saved_variables();
    const Tensor &x2 = s[0], &w = s[1];
    const bool has_bias = ctx->saved_data["hb"].toBool();
    const bool need_db = has_bias && ctx->needs_input_grad(2);
    auto r = split_heads_bwd(d, need_db);  // [B, T, N], the bias gradient
    Tensor g2 = r[0].view({-1, w.size(0)});
    Tensor dx, dw;
    if (ctx->needs_input_grad(0)) dx = gemm_mm(g2, w, std::nullopt, 0).view(ctx->saved_data["x_sizes"].toIntVector());
    if (ctx->needs_input_grad(1)) dw = weight_grad_mm(w, g2.t(), x2);  // undefined when written into its sink
    return {dx, dw, need_db ? r[1] : Tensor(), Tensor(), Tensor()};
  }
};

}  // namespace

variable_list ag_layer_norm(const Tensor& x, const OptTensor& residual, const Tensor& weight, const Tensor& bias,
                            double eps, bool invertible) {
  return LayerNormNode::apply(x, residual, weight, bias, eps, invertible);
}

variable_list ag_pre_layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps,
                                bool invertible) {
  return PreLayerNormNode::apply(x, weight, bias, eps, invertible);
}

variable_list ag_bias_dropout_residual(const Tensor& x, const OptTensor& bias, const Tensor& residual, double p) {
  return BiasDropoutResidualNode::apply(x, bias, residual, p);
}

variable_list ag_bias_act_dropout(const Tensor& x, const OptTensor& bias, const std::string& activation, double p) {
  return BiasActDropoutNode::apply(x, bias, activation, p);
}

variable_list ag_split_heads(const Tensor& x, const OptTensor& bias, int64_t n, int64_t num_heads) {
  LS_CHECK(n >= 1, "split_heads: n must be >= 1, got ", n);
  return SplitHeadsNode::apply(x, bias, n, num_heads);
}

variable_list ag_linear_split(const Tensor& x, const Tensor& weight, const OptTensor& bias, int64_t n,
                              int64_t num_heads) {
  const char* op = "linear_split";
  LS_CHECK(x.dim() == 3 && weight.dim() == 2 && x.size(2) == weight.size(1), op, ": input ", x.sizes(),
           " (expected [batch, length, in_features]) does not match weight ", weight.sizes());
  LS_CHECK(x.device() == weight.device() && x.scalar_type() == weight.scalar_type(), op, ": input (",
           x.scalar_type(), " on ", x.device().str(), ") and weight (", weight.scalar_type(), " on ",
           weight.device().str(), ") differ");
  LS_CHECK(n >= 1 && num_heads >= 1 && weight.size(0) % (n * num_heads) == 0, op, ": ", weight.size(0),
           " output features do not split into ", n, " parts of ", num_heads, " heads");
  if (present(bias))
    LS_CHECK(bias->dim() == 1 && bias->size(0) == weight.size(0) && bias->scalar_type() == x.scalar_type() &&
                 bias->device() == x.device(),
             op, ": bias must be [", weight.size(0), "] of ", x.scalar_type(), " on ", x.device().str(), ", got ",
             bias->sizes(), " of ", bias->scalar_type(), " on ", bias->device().str());
  return LinearSplitNode::apply(x, weight, bias, n, num_heads);
}

std::vector<Tensor> ag_bias_act_linear(const Tensor& x, const OptTensor& bias, const Tensor& weight,
                                       const std::string& activation, double p, int64_t fp8,
                                       const OptTensor& fp8_state, int64_t fp8_slot, bool keep_fp8_codes) {
  const char* op = "bias_act_linear";
  LS_CHECK(x.dim() >= 2 && weight.dim() == 2 && x.size(-1) == weight.size(1), op, ": input ", x.sizes(),
           " does not match weight ", weight.sizes());
  LS_CHECK(x.device() == weight.device() && x.scalar_type() == weight.scalar_type(), op, ": input (",
           x.scalar_type(), " on ", x.device().str(), ") and weight (", weight.scalar_type(), " on ",
           weight.device().str(), ") differ");
  LS_CHECK(activation == "relu" || activation == "gelu", op, ": unsupported activation '", activation, "'");
  return BiasActLinearNode::apply(x, bias, weight, activation, p, fp8, fp8_state, fp8_slot, keep_fp8_codes);
}

Tensor ag_linear(const Tensor& x, const Tensor& weight, const OptTensor& bias) {
  const char* op = "linear";
  LS_CHECK(x.dim() >= 1 && weight.dim() == 2 && x.size(-1) == weight.size(1), op, ": input ", x.sizes(),
           " does not match weight ", weight.sizes());
  LS_CHECK(x.device() == weight.device(), op, ": input and weight are on different devices");
  LS_CHECK(x.scalar_type() == weight.scalar_type(), op, ": input is ", x.scalar_type(), ", weight is ",
           weight.scalar_type());
  if (present(bias))
    LS_CHECK(bias->dim() == 1 && bias->size(0) == weight.size(0) && bias->scalar_type() == x.scalar_type(), op,
             ": bias must be [", weight.size(0), "] of ", x.scalar_type(), ", got ", bias->sizes(), " of ",
             bias->scalar_type());
  return LinearNode::apply(x, weight, bias);
}

}  // namespace ls_torch
