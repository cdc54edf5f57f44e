// CPU stand-ins, in plain ATen, for the CUDA adapters that csrc/torch/autograd.cpp calls. They let
// tests/test_cpp_nodes.py build the real autograd nodes on a machine without a GPU and check their
// wiring (which inputs get which gradient, absent biases and residuals, unused outputs) against torch's
// own autograd. The kernels themselves are tested on the GPU (tests/gpu/). No dropout here: p must be 0.
#include "torch/ops.h"
namespace ls_torch {
std::vector<Tensor> layer_norm_fwd(const Tensor& x, const OptTensor& residual, const Tensor& gamma,
                                   const Tensor& beta, double eps) {
  Tensor s = present(residual) ? x + *residual : x;
  auto r = at::native_layer_norm(s, {x.size(-1)}, gamma, beta, eps);
  return {std::get<0>(r), present(residual) ? s : at::empty({0}, x.options()), std::get<1>(r), std::get<2>(r)};
}
std::vector<Tensor> layer_norm_bwd(const Tensor& dy, const OptTensor& dsum, const Tensor& xin, const Tensor& gamma,
                                   const Tensor& mean, const Tensor& rstd) {
  auto r = at::native_layer_norm_backward(dy, xin, {xin.size(-1)}, mean, rstd, gamma, gamma, {true, true, true});
  Tensor dx = std::get<0>(r);
  if (present(dsum)) dx = dx + *dsum;
  return {dx, std::get<1>(r), std::get<2>(r)};
}
// xhat = (y - beta) / gamma, then the layer-norm backward with that xhat (mean 0, the given rstd)
std::vector<Tensor> layer_norm_bwd_invertible(const Tensor& dy, const OptTensor& dsum, const Tensor& y,
                                              const Tensor& gamma, const Tensor& beta, const Tensor& rstd) {
  const int64_t C = y.size(-1);
  Tensor xh = (y - beta) / gamma, r = rstd.reshape({-1, 1});
  Tensor dy2 = dy.reshape({-1, C}), xh2 = xh.reshape({-1, C});
  Tensor gw = dy2 * gamma;
  Tensor dx = r * (gw - gw.mean(-1, true) - xh2 * (gw * xh2).mean(-1, true));
  dx = dx.view(y.sizes());
  if (present(dsum)) dx = dx + *dsum;
  return {dx, (dy2 * xh2).sum(0), dy2.sum(0)};
}
Tensor bias_act_dropout_replay(const Tensor& x, const OptTensor& bias, const OptTensor& mask,
                               const std::string& act, double p) {
  LS_CHECK(p == 0.0, "fake: p must be 0");
  Tensor y = present(bias) ? x + *bias : x;
  return act == "relu" ? at::relu(y) : at::gelu(y);
}
std::vector<Tensor> bias_dropout_residual_fwd(const Tensor& x, const OptTensor& bias, const Tensor& residual, double p) {
  LS_CHECK(p == 0.0, "fake: p must be 0");
  Tensor y = present(bias) ? x + *bias : x.clone();
  return {y + residual, at::empty({0}, x.options().dtype(at::kByte))};
}
std::vector<Tensor> bias_act_dropout_fwd(const Tensor& x, const OptTensor& bias, const std::string& act, double p) {
  LS_CHECK(p == 0.0, "fake: p must be 0");
  Tensor y = present(bias) ? x + *bias : x;
  return {act == "relu" ? at::relu(y) : at::gelu(y), at::empty({0}, x.options().dtype(at::kByte))};
}
std::vector<Tensor> bias_act_dropout_bwd(const Tensor& dy, const OptTensor& x, const OptTensor& bias,
                                         const OptTensor& out, const OptTensor& mask, double p,
                                         const std::string& act, bool need_dbias) {
  Tensor dx;
  if (act == "none") dx = dy.clone();
  else if (act == "relu") { LS_CHECK(present(out), "fake: relu needs out"); dx = dy * (*out > 0).to(dy.scalar_type()); }
  else { LS_CHECK(present(x), "fake: gelu needs x"); Tensor y = present(bias) ? *x + *bias : *x; dx = at::gelu_backward(dy, y); }
  Tensor db = need_dbias ? dx.reshape({-1, dy.size(-1)}).sum(0) : at::empty({0}, dy.options());
  return {dx, db};
}
Tensor qkv_split_fwd(const Tensor& x, const OptTensor& bias, int64_t n, int64_t H, bool token_major) {
  LS_CHECK(token_major, "fake: token_major only");
  Tensor y = present(bias) ? x + *bias : x;
  const int64_t B = x.size(0), T = x.size(1), D = x.size(2) / n / H;
  return y.view({B, T, n, H, D}).permute({2, 0, 1, 3, 4}).contiguous().transpose(2, 3);
}
std::vector<Tensor> split_heads_bwd(const std::vector<OptTensor>& ds, bool need_dbias) {
  const int64_t n = (int64_t)ds.size();
  Tensor ref;
  for (const auto& d : ds) if (present(d)) { ref = *d; break; }
  std::vector<Tensor> parts;
  for (const auto& d : ds) parts.push_back(present(d) ? *d : at::zeros_like(ref));
  Tensor st = at::stack(parts, 0);  // [n, B, H, T, D]
  const int64_t B = ref.size(0), H = ref.size(1), T = ref.size(2), D = ref.size(3);
  Tensor dx = st.permute({1, 3, 0, 2, 4}).reshape({B, T, n * H * D});
  Tensor db = need_dbias ? dx.reshape({-1, n * H * D}).sum(0) : at::empty({0}, ref.options());
  return {dx, db};
}
// The products as gemm.cpp runs them with cuBLASLt off (on the CPU it always is): the ATen calls.
Tensor gemm_mm(const Tensor& a, const Tensor& b, const OptTensor& bias, int64_t token) {
  return present(bias) ? at::addmm(*bias, a, b) : at::mm(a, b);
}
void gemm_mm_into(const Tensor& out, const Tensor& a, const Tensor& b, bool add, int64_t token) {
  if (add)
    const_cast<Tensor&>(out).addmm_(a, b);
  else
    at::mm_out(const_cast<Tensor&>(out), a, b);
}
// The FP8 linear node needs CUDA (csrc/torch/fp8_nodes.cpp): here only the plain linear node is reachable.
Tensor ag_linear_mode(const Tensor& x, const Tensor& weight, const OptTensor& bias, const Fp8Args& fp8) {
  LS_CHECK(fp8.mode == 0, "linear: FP8 needs a CUDA GPU with FP8 tensor cores");
  return ag_linear(x, weight, bias);
}
bool fp8_linear_shapes_ok(const Tensor& weight) { return false; }
std::vector<Tensor> fp8_act_linear_forward(const Tensor& x2, const OptTensor& bias, const Tensor& weight,
                                           const std::string& activation, double p, int64_t mode,
                                           const OptTensor& state, int64_t slot, bool keep_codes,
                                           bool positive_bits) {
  LS_CHECK(false, "linear: FP8 needs a CUDA GPU with FP8 tensor cores");
  return {};
}
Tensor fp8_act_codes_t(const Tensor& x2, const OptTensor& bias, const OptTensor& mask, const std::string& activation,
                       double p, int64_t mode, const OptTensor& state, int64_t slot) {
  LS_CHECK(false, "linear: FP8 needs a CUDA GPU with FP8 tensor cores");
  return {};
}
std::vector<Tensor> fp8_linear_backward_codes(const Tensor& g2, const Tensor& xq_t, const Tensor& wq_t,
                                              const Tensor& sx, const Tensor& sw, int64_t mode,
                                              const OptTensor& state, int64_t slot, bool need_dw,
                                              const void* wkey) {
  LS_CHECK(false, "linear: FP8 needs a CUDA GPU with FP8 tensor cores");
  return {};
}
std::vector<Tensor> ag_fp8_linear_split(const Tensor& x, const Tensor& weight, const OptTensor& bias, int64_t n,
                                        int64_t num_heads, int64_t mode, const OptTensor& state, int64_t slot) {
  LS_CHECK(false, "linear: FP8 needs a CUDA GPU with FP8 tensor cores");
  return {};
}
std::vector<Tensor> ag_fp8_linear_residual(const Tensor& x, const Tensor& weight, const OptTensor& bias,
                                           const Tensor& residual, double p, int64_t mode, const OptTensor& state,
                                           int64_t slot) {
  LS_CHECK(false, "linear: FP8 needs a CUDA GPU with FP8 tensor cores");
  return {};
}
std::vector<Tensor> ag_fp8_ffn(const Tensor& x, const Tensor& w1, const OptTensor& b1, const Tensor& w2,
                               const OptTensor& b2, const Tensor& residual, const std::string& activation, double p,
                               double p_out, int64_t mode, const OptTensor& state, int64_t slot1, int64_t slot2,
                               bool keep_codes) {
  LS_CHECK(false, "linear: FP8 needs a CUDA GPU with FP8 tensor cores");
  return {};
}
std::vector<Tensor> ag_fp8_ln_linear_split(const Tensor& x, const Tensor& ln_w, const Tensor& ln_b, double eps,
                                           const Tensor& weight, const OptTensor& bias, int64_t n, int64_t num_heads,
                                           int64_t mode, const OptTensor& state, int64_t slot) {
  LS_CHECK(false, "linear: FP8 needs a CUDA GPU with FP8 tensor cores");
  return {};
}
std::vector<Tensor> ag_fp8_ln_ffn(const Tensor& x, const Tensor& ln_w, const Tensor& ln_b, double eps,
                                  const Tensor& w1, const OptTensor& b1, const Tensor& w2, const OptTensor& b2,
                                  const std::string& activation, double p, double p_out, int64_t mode,
                                  const OptTensor& state, int64_t slot1, int64_t slot2, bool keep_codes) {
  LS_CHECK(false, "linear: FP8 needs a CUDA GPU with FP8 tensor cores");
  return {};
}
// attention over short sequences: a CUDA kernel only; the layers take SDPA on the CPU
bool short_attention_fits(const Tensor& q, const Tensor& k, const Tensor& v, const OptTensor& attend,
                          const Packed* pk) {
  return false;
}
Tensor ag_short_attention(const Tensor& q, const Tensor& k, const Tensor& v, const OptTensor& attend, bool causal,
                          double p, const Packed* pk) {
  LS_CHECK(false, "short attention: needs a CUDA GPU");
  return {};
}
}  // namespace ls_torch
