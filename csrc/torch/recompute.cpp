// --ls-recompute-activation: the middle of the FFN block, y = dropout(act(x + b)) W^T, as one autograd node
// that does not keep the activation's output a = dropout(act(x + b)) for the backward. The stored path keeps two
// [tokens, ffn] tensors for a gelu FFN (the activation's input for gelu', and a for the weight gradient of the
// second projection); this node keeps the input and the 1-bit dropout mask only, and in the backward computes a
// again from them (bias_act_dropout_replay: the forward's arithmetic and keep bits, so the same values bit for
// bit). The GEMMs and the activation backward are the stored path's own calls in the same order, so every
// gradient equals the stored path's bit for bit; the price is one elementwise pass over [tokens, ffn].
// For relu the stored path already keeps a alone (relu' comes from a > 0), so there is nothing to drop: the
// layers use this node for gelu only.
#include <torch/extension.h>

#include "torch/ops.h"

namespace ls_torch {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace {

struct BiasActLinearNode : public torch::autograd::Function<BiasActLinearNode> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const OptTensor& bias, const Tensor& weight,
                               const std::string& activation, double p, int64_t fp8) {
    Tensor xc = contig(x);
    auto r = bias_act_dropout_fwd(xc, bias, activation, p);  // [a, mask]
    const int64_t F = x.size(-1);
    Tensor a2 = r[0].reshape({-1, F});
    const bool use_fp8 = fp8 > 0 && fp8_linear_shapes_ok(weight);
    Tensor y2, wq, sw;
    if (use_fp8) {
      auto f = fp8_linear_forward(a2, weight, std::nullopt);
      y2 = f[0], wq = f[1], sw = f[2];
    } else {
      y2 = at::mm(a2, weight.t());
    }
    auto sizes = x.sizes().vec();
    sizes.back() = weight.size(0);
    ctx->set_materialize_grads(false);
    ctx->save_for_backward({xc, present(bias) ? *bias : Tensor(), r[1], weight, wq, sw});
    ctx->saved_data["act"] = activation;
    ctx->saved_data["p"] = p;
    ctx->saved_data["hb"] = present(bias);
    ctx->saved_data["bdt"] = static_cast<int64_t>(present(bias) ? bias->scalar_type() : at::kFloat);
    ctx->saved_data["gf"] = use_fp8 ? fp8 - 1 : int64_t(-1);
    ctx->mark_non_differentiable({r[1]});
    return {at::_unsafe_view(y2, sizes), r[1]};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const Tensor& g = grads[0];
    if (!g.defined()) return {Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
    auto s = ctx->get_saved_variables();
    const Tensor &xc = s[0], &w = s[3];
    const OptTensor bias = s[1].defined() ? OptTensor(s[1]) : std::nullopt;
    const std::string act = ctx->saved_data["act"].toStringRef();
    const double p = ctx->saved_data["p"].toDouble();
    const OptTensor mask = p > 0 ? OptTensor(s[2]) : std::nullopt;
    const bool hb = ctx->saved_data["hb"].toBool();
    const int64_t gf = ctx->saved_data["gf"].toInt();
    const int64_t F = xc.size(-1);
    // needs_input_grad counts the tensors present: x, [bias,] weight
    const bool need_dw = ctx->needs_input_grad(hb ? 2 : 1);
    const bool need_db = hb && ctx->needs_input_grad(1);

    Tensor a = bias_act_dropout_replay(xc, bias, mask, act, p);
    Tensor g2 = contig(g.reshape({-1, w.size(0)}));
    Tensor dw = need_dw ? at::mm(g2.t(), a.reshape({-1, F})) : Tensor();
    Tensor da2 = gf >= 0 ? fp8_linear_input_grad(g2, s[4], s[5], gf) : at::mm(g2, w);
    Tensor da = at::_unsafe_view(da2, xc.sizes());
    const bool relu = act == "relu";
    auto r = bias_act_dropout_bwd(da, relu ? std::nullopt : OptTensor(xc), bias, relu ? OptTensor(a) : std::nullopt,
                                  mask, p, act, need_db);
    const auto bdt = static_cast<at::ScalarType>(ctx->saved_data["bdt"].toInt());
    Tensor db = need_db ? (r[1].scalar_type() == bdt ? r[1] : r[1].to(bdt)) : Tensor();
    return {r[0], db, dw, Tensor(), Tensor(), Tensor()};
  }
};

}  // namespace

std::vector<Tensor> ag_bias_act_linear(const Tensor& x, const OptTensor& bias, const Tensor& weight,
                                       const std::string& activation, double p, int64_t fp8) {
  const char* op = "bias_act_linear";
  LS_CHECK(x.dim() >= 2 && weight.dim() == 2 && x.size(-1) == weight.size(1), op, ": input ", x.sizes(),
           " does not match weight ", weight.sizes());
  LS_CHECK(x.device() == weight.device() && x.scalar_type() == weight.scalar_type(), op, ": input (",
           x.scalar_type(), " on ", x.device().str(), ") and weight (", weight.scalar_type(), " on ",
           weight.device().str(), ") differ");
  LS_CHECK(activation == "relu" || activation == "gelu", op, ": unsupported activation '", activation, "'");
  auto r = BiasActLinearNode::apply(x, bias, weight, activation, p, fp8);
  return {r[0], r[1]};
}

}  // namespace ls_torch
