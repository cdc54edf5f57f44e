// The FP8 linear layers' autograd nodes: one projection (ag_fp8_linear), the FFN block's two projections with their
// activation and residual dropout (ag_fp8_ffn), an attention block's output projection with its residual dropout
// (ag_fp8_linear_residual) and the attention's input projection with its head split (ag_fp8_linear_split), each also
// with the pre-LN block's layer norm written only as the first projection's input codes (the ag_fp8_ln_* entries).
// The output gradients reaching each projection leave the kernel that computes them as FP8 codes (fp8.cpp's fused
// casts). A layer whose sizes are not multiples of 16 takes the plain linear node instead (ag_linear_mode), so any
// model size trains.
#include <torch/extension.h>

#include "torch/fp8.h"

namespace ls_torch {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using namespace fp8_impl;

namespace {

OptTensor opt_of(const Tensor& t) { return t.defined() ? OptTensor(t) : std::nullopt; }

// The residual of a block whose projection maps x [..., K] to [..., n]: x's leading sizes, dtype and device
void check_residual(const char* op, const Tensor& residual, const Tensor& x, int64_t n) {
  auto out_sizes = x.sizes().vec();
  out_sizes.back() = n;
  LS_CHECK(residual.sizes() == at::IntArrayRef(out_sizes) && residual.scalar_type() == x.scalar_type() &&
               residual.device() == x.device(),
           op, ": residual must be ", at::IntArrayRef(out_sizes), " of ", x.scalar_type(), " on ", x.device().str(),
           ", got ", residual.sizes(), " of ", residual.scalar_type());
}

// A node's first projection from its input x2 [M, K]: linear_forward, or with ln_w (a pre-LN block) from the codes
// of layer_norm(x2) (pre_ln_codes). -> [y2, xq_t, wq_t, sx, sw] and, with ln_w, what input_grads reads of the layer
// norm (the node saves it after its own tensors): [x2, ln_w, ln_b, mean, rstd]
std::pair<std::vector<Tensor>, std::vector<Tensor>> first_forward(const char* op, const Tensor& x2,
                                                                  const OptTensor& ln_w, const OptTensor& ln_b,
                                                                  double eps, const Tensor& weight,
                                                                  const OptTensor& bias, const Use& u, bool keep_x) {
  if (!present(ln_w)) return {linear_forward(x2, weight, bias, u, keep_x), {}};
  auto c = pre_ln_codes(op, x2, *ln_w, *ln_b, eps, u, keep_x);  // [xq, xq_t, mean, rstd]
  return {codes_forward(c[0], c[1], x2.scalar_type(), weight, bias, u), {x2, *ln_w, *ln_b, c[2], c[3]}};
}

// Out[0], the gradient of a node's input x [..., C], from its first projection's input gradient dx2 [rows, C]: with
// the node's layer norm (ln; the saved tensors s[ln_saved ..]: first_forward's x2, ln_w, ln_b, mean, rstd), that
// layer norm's backward with the residual's gradient gsum (nullable) added into x's, and the layer norm's weight and
// bias gradients into out[ln_out], out[ln_out + 1] (in their dtypes); else dx2 in x's shape.
void input_grads(AutogradContext* ctx, variable_list& out, const Tensor& dx2, const Tensor& gsum, bool ln,
                 bool need_dx, const variable_list& s, size_t ln_saved, size_t ln_out) {
  const auto x_sizes = ctx->saved_data["x_sizes"].toIntVector();
  if (!ln || !need_dx) {
    out[0] = need_dx ? at::_unsafe_view(dx2, x_sizes) : Tensor();
    return;
  }
  const Tensor &x2 = s[ln_saved], &ln_w = s[ln_saved + 1], &ln_b = s[ln_saved + 2];
  auto r = layer_norm_bwd(contig(dx2), gsum.defined() ? OptTensor(contig(gsum.reshape(dx2.sizes()))) : std::nullopt,
                          x2, ln_w, s[ln_saved + 3], s[ln_saved + 4]);
  out[0] = ctx->needs_input_grad(0) ? at::_unsafe_view(r[0], x_sizes) : Tensor();
  out[ln_out] = r[1].scalar_type() == ln_w.scalar_type() ? r[1] : r[1].to(ln_w.scalar_type());
  out[ln_out + 1] = r[2].scalar_type() == ln_b.scalar_type() ? r[2] : r[2].to(ln_b.scalar_type());
}

inline const void* key_of(AutogradContext* ctx, const char* name) {
  return reinterpret_cast<const void*>(ctx->saved_data[name].toInt());
}
inline int64_t key_value(const Tensor& w) { return reinterpret_cast<int64_t>(w.data_ptr()); }

struct Fp8LinearNode : public torch::autograd::Function<Fp8LinearNode> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& weight, const OptTensor& bias,
                        int64_t mode, const Tensor& state, int64_t slot) {
    const Use u = use_of("fp8_linear", mode, state, slot, x);
    const int64_t K = x.size(-1);
    Tensor x2 = contig(x.reshape({-1, K}));
    auto f = linear_forward(x2, weight, bias, u, weight.requires_grad());
    auto sizes = x.sizes().vec();
    sizes.back() = weight.size(0);
    ctx->set_materialize_grads(false);
    ctx->save_for_backward({f[1], f[2], f[3], f[4], state});
    ctx->saved_data["hb"] = present(bias);
    ctx->saved_data["mode"] = mode;
    ctx->saved_data["slot"] = slot;
    ctx->saved_data["x_sizes"] = x.sizes().vec();
    ctx->saved_data["w_dtype"] = static_cast<int64_t>(weight.scalar_type());
    ctx->saved_data["wkey"] = key_value(weight);
    return at::_unsafe_view(f[0], sizes);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const Tensor& g = grads[0];
    if (!g.defined()) return {Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
    auto s = ctx->get_saved_variables();
    const Use u{(ctx->saved_data["mode"].toInt() - 1) & 1, ctx->saved_data["mode"].toInt() >= 3, s[4],
                ctx->saved_data["slot"].toInt()};
    const int64_t N = g.size(-1);
    Tensor g2 = contig(g.reshape({-1, N}));
    const bool need_dx = ctx->needs_input_grad(0), need_dw = ctx->needs_input_grad(1) && s[0].defined();
    auto [dx2, dw] = linear_backward(g2, s[0], s[1], s[2], s[3], u, need_dx, need_dw,
                                     static_cast<at::ScalarType>(ctx->saved_data["w_dtype"].toInt()),
                                     key_of(ctx, "wkey"));
    Tensor dx = need_dx ? at::_unsafe_view(dx2, ctx->saved_data["x_sizes"].toIntVector()) : Tensor();
    Tensor db = ctx->saved_data["hb"].toBool() && ctx->needs_input_grad(2) ? g2.sum(0) : Tensor();
    return {dx, dw, db, Tensor(), Tensor(), Tensor()};
  }
};

}  // namespace

namespace {

// The FFN block's projections as one node: out = residual + dropout(dropout(act(x W1^T + b1)) W2^T + b2) with both
// projections in FP8, so that the gradients reaching each projection's output leave the kernel that computes them
// as codes: the residual dropout's backward writes the second projection's (with b2's gradient summed on the way),
// the activation's backward the first one's (with b1's); neither is stored in the model's precision nor quantised
// by a pass of its own. The forward is the chain ag_fp8_linear -> ag_bias_act_linear(keep_codes) ->
// ag_bias_dropout_residual would record, and every value but the bias gradients (the same sums in another order)
// equals that chain's bit for bit.
struct Fp8FfnNode : public torch::autograd::Function<Fp8FfnNode> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& w1, const OptTensor& b1,
                               const Tensor& w2, const OptTensor& b2, const Tensor& residual,
                               const std::string& activation, double p, double p_out, int64_t mode,
                               const Tensor& state, int64_t slot1, int64_t slot2, bool keep_codes,
                               const OptTensor& ln_w, const OptTensor& ln_b, double eps) {
    const char* op = "fp8_ffn";
    const Use u1 = use_of(op, mode, state, slot1, x);  // slot2: checked by ag_fp8_ffn and fp8_act_linear_forward
    Tensor x2 = contig(x.reshape({-1, x.size(-1)}));
    const bool ln = present(ln_w);  // pre-LN: the first projection's input is layer_norm(x), residual is x
    // f1: [h2, xq_t, w1q_t, sx, sw1]
    auto [f1, ln_keep] = first_forward(op, x2, ln_w, ln_b, eps, w1, std::nullopt, u1, w1.requires_grad());
    const bool relu_bits = keep_codes && activation == "relu";  // relu's backward needs only the bits of a > 0
    auto f2 = fp8_act_linear_forward(f1[0], b1, w2, activation, p, mode, state, slot2, keep_codes, relu_bits);
    const Tensor res2 = ln ? x2 : contig(residual.reshape({-1, w2.size(0)}));
    auto o = bias_dropout_residual_fwd(f2[0], b2, res2, p_out);  // [out, mask]
    auto sizes = x.sizes().vec();
    sizes.back() = w2.size(0);
    ctx->set_materialize_grads(false);
    // h2 f2[1]=mask  xq_t w1q_t sx sw1  aq_t w2q_t sa sw2  b1 state  mask_out  (ln: x2 ln_w ln_b mean rstd)
    std::vector<Tensor> keep = {relu_bits ? Tensor() : f1[0], f2[1], f1[1], f1[2], f1[3], f1[4], f2[2], f2[3], f2[4],
                                f2[5], present(b1) ? *b1 : Tensor(), state, o[1]};
    keep.insert(keep.end(), ln_keep.begin(), ln_keep.end());
    ctx->save_for_backward(keep);
    ctx->saved_data["ln"] = ln;
    ctx->mark_non_differentiable({f2[1], o[1]});
    ctx->saved_data["x_sizes"] = x.sizes().vec();
    ctx->saved_data["act"] = activation;
    ctx->saved_data["p"] = p;
    ctx->saved_data["p_out"] = p_out;
    ctx->saved_data["hb2"] = present(b2);
    ctx->saved_data["relu_bits"] = relu_bits;
    ctx->saved_data["mode"] = mode;
    ctx->saved_data["slot1"] = slot1;
    ctx->saved_data["slot2"] = slot2;
    ctx->saved_data["w1key"] = key_value(w1);
    ctx->saved_data["w2key"] = key_value(w2);
    return {at::_unsafe_view(o[0], sizes), f2[1], o[1]};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const char* op = "fp8_ffn backward";
    const Tensor& g = grads[0];
    const variable_list none(17);
    if (!g.defined()) return none;
    const bool ln = ctx->saved_data["ln"].toBool();
    auto s = ctx->get_saved_variables();
    const Tensor &h2 = s[0], &mask_t = s[1], &xq_t = s[2], &w1q_t = s[3], &sx = s[4], &sw1 = s[5];
    const Tensor &sa = s[8], &sw2 = s[9], &mask_out = s[12];
    const OptTensor b1 = opt_of(s[10]);
    const Tensor& state = s[11];
    const std::string act = ctx->saved_data["act"].toStringRef();
    const double p = ctx->saved_data["p"].toDouble(), p_out = ctx->saved_data["p_out"].toDouble();
    const bool relu_bits = ctx->saved_data["relu_bits"].toBool();
    const int64_t mode = ctx->saved_data["mode"].toInt(), slot2 = ctx->saved_data["slot2"].toInt();
    const Use u1 = use_of(op, mode, state, ctx->saved_data["slot1"].toInt(), g);
    const Use u2 = use_of(op, mode, state, slot2, g);
    const OptTensor mask = p > 0 || relu_bits ? OptTensor(mask_t) : std::nullopt;
    // (needs_input_grad counts the tensor arguments: x w1 b1 w2 b2 residual state ln_w ln_b)
    const bool need_ln = ln && (ctx->needs_input_grad(7) || ctx->needs_input_grad(8));
    const bool need_dx = ctx->needs_input_grad(0) || need_ln, need_dw1 = ctx->needs_input_grad(1) && xq_t.defined();
    const bool need_db = present(b1) && ctx->needs_input_grad(2), need_dw2 = ctx->needs_input_grad(3);
    const bool need_db2 = ctx->saved_data["hb2"].toBool() && ctx->needs_input_grad(4);

    Tensor g2 = contig(g.reshape({-1, g.size(-1)}));
    Tensor aq_t = s[6];
    if (!aq_t.defined() && need_dw2) aq_t = fp8_act_codes_t(h2, b1, mask, act, p, mode, state, slot2);
    // the second projection's output gradient: the residual dropout's backward of g, as codes
    auto c2 = act_grad_codes(op, g2, std::nullopt, std::nullopt, p_out > 0 ? OptTensor(mask_out) : std::nullopt,
                             p_out, "none", u2, true, need_dw2 && aq_t.defined(), need_db2);
    auto [da2, dw2] = backward_gemms(c2[0], c2[1], scale_inv_of(state, u2.row(2)), aq_t, s[7], sa, sw2,
                                     g2.scalar_type(), g2.scalar_type(), key_of(ctx, "w2key"));
    auto c = act_grad_codes(op, da2, relu_bits ? std::nullopt : OptTensor(h2), b1, mask, p, act, u1, need_dx,
                            need_dw1, need_db);
    auto [dx2, dw1] = backward_gemms(c[0], c[1], scale_inv_of(state, u1.row(2)), xq_t, w1q_t, sx, sw1,
                                     g2.scalar_type(), g2.scalar_type(), key_of(ctx, "w1key"));
    variable_list out(17);
    input_grads(ctx, out, dx2, g, ln, need_dx, s, 13, 14);  // with ln, g (the residual's gradient) joins x's there
    out[1] = dw1;
    out[2] = need_db ? c[2] : Tensor();
    out[3] = need_dw2 ? dw2 : Tensor();
    out[4] = need_db2 ? c2[2] : Tensor();
    out[5] = !ln && ctx->needs_input_grad(5) ? g : Tensor();  // the residual's gradient: g itself
    return out;
  }
};

}  // namespace

namespace {
// What the FFN node needs of its arguments but the residual -> the first projection's use of the state
Use checked_ffn(const char* op, const Tensor& x, const Tensor& w1, const OptTensor& b1, const Tensor& w2,
                const OptTensor& b2, const std::string& activation, double p, double p_out, int64_t mode,
                const OptTensor& state, int64_t slot1, int64_t slot2) {
  LS_CHECK(x.dim() >= 2 && w1.dim() == 2 && w2.dim() == 2 && x.size(-1) == w1.size(1) && w2.size(1) == w1.size(0),
           op, ": input ", x.sizes(), ", first weight ", w1.sizes(), " and second weight ", w2.sizes(),
           " do not chain");
  check_projection(op, x, w1, b1);
  check_projection(op, x, w2, b2);
  check_p(op, p);
  check_p(op, p_out);
  parse_act(op, activation);
  const Use u = use_of(op, mode, state, slot1, x);
  use_of(op, mode, state, slot2, x);
  return u;
}
}  // namespace

std::vector<Tensor> ag_fp8_ffn(const Tensor& x, const Tensor& w1, const OptTensor& b1, const Tensor& w2,
                               const OptTensor& b2, const Tensor& residual, const std::string& activation, double p,
                               double p_out, int64_t mode, const OptTensor& state, int64_t slot1, int64_t slot2,
                               bool keep_codes) {
  const char* op = "fp8_ffn";
  const Use u = checked_ffn(op, x, w1, b1, w2, b2, activation, p, p_out, mode, state, slot1, slot2);
  check_residual(op, residual, x, w2.size(0));
  if (x.numel() == 0) {
    auto r = ag_bias_act_dropout(ag_linear(x, w1, std::nullopt), b1, activation, p);
    auto o = ag_bias_dropout_residual(ag_linear(r[0], w2, std::nullopt), b2, residual, p_out);
    return {o[0], r[1], o[1]};
  }
  return Fp8FfnNode::apply(x, w1, b1, w2, b2, residual, activation, p, p_out, mode, u.state, slot1, slot2,
                           keep_codes, std::nullopt, std::nullopt, 0.0);
}

std::vector<Tensor> ag_fp8_ln_ffn(const Tensor& x, const Tensor& ln_w, const Tensor& ln_b, double eps,
                                  const Tensor& w1, const OptTensor& b1, const Tensor& w2, const OptTensor& b2,
                                  const std::string& activation, double p, double p_out, int64_t mode,
                                  const OptTensor& state, int64_t slot1, int64_t slot2, bool keep_codes) {
  const char* op = "fp8_ln_ffn";
  if (x.numel() == 0) {  // the chain
    auto r = ag_pre_layer_norm(x, ln_w, ln_b, eps, false);
    return ag_fp8_ffn(r[0], w1, b1, w2, b2, r[1], activation, p, p_out, mode, state, slot1, slot2, keep_codes);
  }
  const Use u = checked_ffn(op, x, w1, b1, w2, b2, activation, p, p_out, mode, state, slot1, slot2);
  check_residual(op, x, x, w2.size(0));  // x is the residual: the FFN maps it to its own size
  // x's gradient as the residual reaches x through the layer norm's backward, not as the residual input's
  return Fp8FfnNode::apply(x, w1, b1, w2, b2, x, activation, p, p_out, mode, u.state, slot1, slot2, keep_codes,
                           ln_w, ln_b, eps);
}

namespace {

// An attention block's output projection and the block's residual dropout as one FP8 node: out = residual +
// dropout(x W^T + b), so that the projection's output gradient leaves the dropout's backward as codes (with b's
// gradient summed on the way) and is neither stored in the model's precision nor quantised by a pass of its own,
// as the FFN node's second projection. The forward is the chain ag_fp8_linear -> ag_bias_dropout_residual would
// record, and every value but the bias gradient (the same sum in another order) equals that chain's bit for bit.
struct Fp8LinearResidualNode : public torch::autograd::Function<Fp8LinearResidualNode> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& weight, const OptTensor& bias,
                               const Tensor& residual, double p, int64_t mode, const Tensor& state, int64_t slot) {
    const Use u = use_of("fp8_linear_residual", mode, state, slot, x);
    Tensor x2 = contig(x.reshape({-1, x.size(-1)}));
    auto f = linear_forward(x2, weight, std::nullopt, u, weight.requires_grad());  // [y2, xq_t, wq_t, sx, sw]
    auto o = bias_dropout_residual_fwd(f[0], bias, contig(residual.reshape({-1, weight.size(0)})), p);
    auto sizes = x.sizes().vec();
    sizes.back() = weight.size(0);
    ctx->set_materialize_grads(false);
    ctx->save_for_backward({f[1], f[2], f[3], f[4], state, o[1]});
    ctx->mark_non_differentiable({o[1]});
    ctx->saved_data["x_sizes"] = x.sizes().vec();
    ctx->saved_data["hb"] = present(bias);
    ctx->saved_data["p"] = p;
    ctx->saved_data["mode"] = mode;
    ctx->saved_data["slot"] = slot;
    ctx->saved_data["wkey"] = key_value(weight);
    return {at::_unsafe_view(o[0], sizes), o[1]};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const char* op = "fp8_linear_residual backward";
    const Tensor& g = grads[0];
    if (!g.defined()) return variable_list(8);
    auto s = ctx->get_saved_variables();
    const Tensor &xq_t = s[0], &wq_t = s[1], &sx = s[2], &sw = s[3], &state = s[4], &mask = s[5];
    const Use u = use_of(op, ctx->saved_data["mode"].toInt(), state, ctx->saved_data["slot"].toInt(), g);
    const double p = ctx->saved_data["p"].toDouble();
    const bool need_dx = ctx->needs_input_grad(0), need_dw = ctx->needs_input_grad(1) && xq_t.defined();
    const bool need_db = ctx->saved_data["hb"].toBool() && ctx->needs_input_grad(2);
    Tensor g2 = contig(g.reshape({-1, g.size(-1)}));
    // the projection's output gradient: the residual dropout's backward of g, as codes (row-major codes also when
    // only the bias gradient is asked for: the kernel writes at least one layout)
    auto c = act_grad_codes(op, g2, std::nullopt, std::nullopt, p > 0 ? OptTensor(mask) : std::nullopt, p, "none", u,
                            need_dx || !need_dw, need_dw, need_db);
    auto [dx2, dw] = backward_gemms(need_dx ? c[0] : Tensor(), c[1], scale_inv_of(state, u.row(2)), xq_t, wq_t, sx,
                                    sw, g2.scalar_type(), g2.scalar_type(), key_of(ctx, "wkey"));
    variable_list out(8);
    out[0] = need_dx ? at::_unsafe_view(dx2, ctx->saved_data["x_sizes"].toIntVector()) : Tensor();
    out[1] = dw;
    out[2] = need_db ? c[2] : Tensor();
    out[3] = ctx->needs_input_grad(3) ? g : Tensor();  // the residual's gradient: g itself
    return out;
  }
};

}  // namespace

std::vector<Tensor> ag_fp8_linear_residual(const Tensor& x, const Tensor& weight, const OptTensor& bias,
                                           const Tensor& residual, double p, int64_t mode, const OptTensor& state,
                                           int64_t slot) {
  const char* op = "fp8_linear_residual";
  LS_CHECK(x.dim() >= 2 && weight.dim() == 2 && x.size(-1) == weight.size(1), op, ": input ", x.sizes(),
           " does not match weight ", weight.sizes());
  check_residual(op, residual, x, weight.size(0));
  check_projection(op, x, weight, bias);
  check_p(op, p);
  const Use u = use_of(op, mode, state, slot, x);
  if (x.numel() == 0) return ag_bias_dropout_residual(ag_linear(x, weight, std::nullopt), bias, residual, p);
  return Fp8LinearResidualNode::apply(x, weight, bias, residual, p, mode, u.state, slot);
}

namespace {

// The attention's input projection and its head split as one FP8 node: x W^T (+ bias) -> n parts [B, H, T, D], views
// of the GEMM's output (the bias added in its epilogue), so that nothing is copied in the forward and the output
// gradient leaves the heads' gradients as codes (with the bias gradient summed on the way), never merged in the
// model's precision nor quantised by a pass of its own. Every value but the bias gradient (the same sum in another
// order) equals bit for bit that of the chain ag_fp8_linear (with the bias) -> the heads as views of its output.
// With ln_w (a pre-LN block): x is the block's input and the projection's input is layer_norm(x) (ln_w, ln_b, eps),
// made by pre_ln_codes as codes only; the node then also returns x (the block's residual), whose gradient the layer
// norm's backward adds into x's, as PreLayerNormNode does.
struct Fp8LinearSplitNode : public torch::autograd::Function<Fp8LinearSplitNode> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& weight, const OptTensor& bias,
                               int64_t n, int64_t num_heads, int64_t mode, const Tensor& state, int64_t slot,
                               const OptTensor& ln_w, const OptTensor& ln_b, double eps) {
    const char* op = "fp8_linear_split";
    const Use u = use_of(op, mode, state, slot, x);
    Tensor x2 = contig(x.reshape({-1, x.size(-1)}));
    const bool ln = present(ln_w);
    // the bias in the GEMM's epilogue; the parts are views of its output (as ag_linear_split's, autograd.cpp)
    // f: [y2, xq_t, wq_t, sx, sw]
    auto [f, ln_keep] = first_forward(op, x2, ln_w, ln_b, eps, weight, bias, u, weight.requires_grad());
    ctx->set_materialize_grads(false);
    std::vector<Tensor> keep = {f[1], f[2], f[3], f[4], state};
    keep.insert(keep.end(), ln_keep.begin(), ln_keep.end());
    ctx->save_for_backward(keep);
    ctx->saved_data["x_sizes"] = x.sizes().vec();
    ctx->saved_data["hb"] = present(bias);
    ctx->saved_data["n"] = n;
    ctx->saved_data["ln"] = ln;
    ctx->saved_data["mode"] = mode;
    ctx->saved_data["slot"] = slot;
    ctx->saved_data["dtype"] = static_cast<int64_t>(x.scalar_type());
    ctx->saved_data["wkey"] = key_value(weight);
    auto out = head_views(f[0], x.size(0), x.size(1), n, num_heads);
    if (ln) out.push_back(x.view_as(x));
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const char* op = "fp8_linear_split backward";
    const int64_t n = ctx->saved_data["n"].toInt();
    const bool ln = ctx->saved_data["ln"].toBool();
    const Tensor gx = ln && (int64_t)grads.size() > n ? grads[n] : Tensor();  // the residual's gradient
    const auto d = part_grads(grads, n);
    variable_list out(11);
    if (d.empty()) {
      out[0] = gx;
      return out;
    }
    auto s = ctx->get_saved_variables();
    const Tensor &xq_t = s[0], &wq_t = s[1], &sx = s[2], &sw = s[3], &state = s[4];
    const Use u = use_of(op, ctx->saved_data["mode"].toInt(), state, ctx->saved_data["slot"].toInt(), state);
    // (needs_input_grad counts the tensor arguments: x, weight, bias, state, ln_w, ln_b)
    const bool need_ln = ln && (ctx->needs_input_grad(4) || ctx->needs_input_grad(5));
    const bool need_dx = ctx->needs_input_grad(0) || need_ln;
    const bool need_dw = ctx->needs_input_grad(1) && xq_t.defined();
    const bool need_db = ctx->saved_data["hb"].toBool() && ctx->needs_input_grad(2);
    auto c = merge_codes(op, d, u, need_dx, need_dw, need_db);
    const auto dt = static_cast<at::ScalarType>(ctx->saved_data["dtype"].toInt());
    auto [dx2, dw] = backward_gemms(c[0], c[1], scale_inv_of(state, u.row(2)), xq_t, wq_t, sx, sw, dt, dt,
                                    key_of(ctx, "wkey"));
    input_grads(ctx, out, dx2, gx, ln, need_dx, s, 5, 8);
    out[1] = dw;
    out[2] = need_db ? c[2] : Tensor();
    return out;
  }
};

}  // namespace

namespace {
// What the projection + head split node needs of its arguments -> the projection's use of the state
Use checked_split(const char* op, const Tensor& x, const Tensor& weight, const OptTensor& bias, int64_t n,
                  int64_t num_heads, int64_t mode, const OptTensor& state, int64_t slot) {
  LS_CHECK(n >= 1, op, ": n must be >= 1, got ", n);
  LS_CHECK(num_heads >= 1 && weight.dim() == 2 && weight.size(0) % (n * num_heads) == 0, op, ": weight ",
           weight.sizes(), " does not split into ", n, " parts of ", num_heads, " heads");
  LS_CHECK(x.dim() == 3 && x.size(-1) == weight.size(1), op, ": input ", x.sizes(), " does not match weight ",
           weight.sizes(), " (expected [batch, length, ", weight.size(1), "])");
  check_projection(op, x, weight, bias);
  return use_of(op, mode, state, slot, x);
}
}  // namespace

std::vector<Tensor> ag_fp8_linear_split(const Tensor& x, const Tensor& weight, const OptTensor& bias, int64_t n,
                                        int64_t num_heads, int64_t mode, const OptTensor& state, int64_t slot) {
  const Use u = checked_split("fp8_linear_split", x, weight, bias, n, num_heads, mode, state, slot);
  if (x.numel() == 0) return ag_split_heads(ag_linear(x, weight, std::nullopt), bias, n, num_heads);
  return Fp8LinearSplitNode::apply(x, weight, bias, n, num_heads, mode, u.state, slot, std::nullopt, std::nullopt,
                                   0.0);
}

std::vector<Tensor> ag_fp8_ln_linear_split(const Tensor& x, const Tensor& ln_w, const Tensor& ln_b, double eps,
                                           const Tensor& weight, const OptTensor& bias, int64_t n, int64_t num_heads,
                                           int64_t mode, const OptTensor& state, int64_t slot) {
  if (x.numel() == 0) {  // the chain
    auto r = ag_pre_layer_norm(x, ln_w, ln_b, eps, false);
    auto parts = ag_fp8_linear_split(r[0], weight, bias, n, num_heads, mode, state, slot);
    parts.push_back(r[1]);
    return parts;
  }
  const Use u = checked_split("fp8_ln_linear_split", x, weight, bias, n, num_heads, mode, state, slot);
  return Fp8LinearSplitNode::apply(x, weight, bias, n, num_heads, mode, u.state, slot, ln_w, ln_b, eps);
}

Tensor ag_fp8_linear(const Tensor& x, const Tensor& weight, const OptTensor& bias, int64_t mode,
                     const OptTensor& state, int64_t slot) {
  const char* op = "fp8_linear";
  LS_CHECK(x.dim() >= 2 && weight.dim() == 2 && x.size(-1) == weight.size(1), op, ": input ", x.sizes(),
           " does not match weight ", weight.sizes());
  check_projection(op, x, weight, bias);
  const Use u = use_of(op, mode, state, slot, x);
  if (x.numel() == 0) return ag_linear(x, weight, bias);
  return Fp8LinearNode::apply(x, weight, bias, mode, u.state, slot);
}

Tensor ag_linear_mode(const Tensor& x, const Tensor& weight, const OptTensor& bias, const Fp8Args& fp8) {
  if (fp8.mode > 0 && fp8_linear_shapes_ok(weight) && x.dim() >= 2)
    return ag_fp8_linear(x, weight, bias, fp8.mode, fp8.state, fp8.slot);
  return ag_linear(x, weight, bias);
}

}  // namespace ls_torch
