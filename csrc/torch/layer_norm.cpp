// ATen adapter: layer norm (+ residual add) forward and backward.
#include "torch/adapter.h"
#include "torch/ops.h"

namespace ls_torch {

// -> (y, x + residual (empty without residual), mean [rows] fp32, rstd [rows] fp32)
std::vector<Tensor> layer_norm_fwd(const Tensor& x, const OptTensor& residual, const Tensor& gamma,
                                   const Tensor& beta, double eps) {
  const char* op = "layer_norm_fwd";
  LS_CHECK_INPUT(op, x);
  LS_CHECK(x.dim() >= 1, op, ": x must have at least one dimension");
  const int64_t C = x.size(-1);
  LS_CHECK(C >= 1 && C <= 8192, op, ": hidden size ", C, " is outside the supported range [1, 8192]");
  const ls::DType dt = to_dtype(op, x);
  if (present(residual)) {
    LS_CHECK_INPUT(op, *residual);
    LS_CHECK_SAME_DEVICE(op, x, *residual);
    LS_CHECK(residual->sizes() == x.sizes(), op, ": residual shape ", residual->sizes(), " != x shape ", x.sizes());
    LS_CHECK_DTYPE(op, *residual, x.scalar_type());
  }
  auto g = channel_param(op, "weight", gamma, x, C);
  auto b = channel_param(op, "bias", beta, x, C);
  c10::cuda::CUDAGuard guard(x.device());
  const int64_t rows = x.numel() / C;
  Tensor y = at::empty_like(x);
  Tensor s = present(residual) ? at::empty_like(x) : at::empty({0}, x.options());
  auto f32 = x.options().dtype(at::kFloat);
  Tensor mean = at::empty({rows}, f32), rstd = at::empty({rows}, f32);
  launch(op, [&] {
    ls::layer_norm_fwd(dt, x.data_ptr(), ptr_or_null(residual), g->data_ptr(), b->data_ptr(), y.data_ptr(),
                       present(residual) ? s.data_ptr() : nullptr, mean.data_ptr<float>(), rstd.data_ptr<float>(),
                       rows, (int)C, (float)eps, stream());
  });
  return {y, s, mean, rstd};
}

namespace {

// Both backwards: xin is the input (mean given) or, invertible, the output (beta given, mean absent).
std::vector<Tensor> ln_bwd(const char* op, const Tensor& dy, const OptTensor& dsum, const Tensor& xin,
                           const Tensor& gamma, const OptTensor& beta, const OptTensor& mean, const Tensor& rstd) {
  LS_CHECK_INPUT(op, dy);
  LS_CHECK_INPUT(op, xin);
  LS_CHECK(dy.sizes() == xin.sizes(), op, ": dy shape ", dy.sizes(), " != input shape ", xin.sizes());
  LS_CHECK_DTYPE(op, dy, xin.scalar_type());
  const int64_t C = xin.size(-1);
  LS_CHECK(C >= 1 && C <= 8192, op, ": hidden size ", C, " is outside the supported range [1, 8192]");
  const int64_t rows = xin.numel() / C;
  const ls::DType dt = to_dtype(op, xin);
  if (present(dsum)) {
    LS_CHECK_INPUT(op, *dsum);
    LS_CHECK(dsum->sizes() == xin.sizes(), op, ": dsum shape ", dsum->sizes(), " != input shape ", xin.sizes());
    LS_CHECK_DTYPE(op, *dsum, xin.scalar_type());
  }
  if (present(mean)) {
    LS_CHECK_INPUT(op, *mean);
    LS_CHECK(mean->numel() == rows, op, ": mean must have ", rows, " elements");
    LS_CHECK_DTYPE(op, *mean, at::kFloat);
  }
  LS_CHECK_INPUT(op, rstd);
  LS_CHECK(rstd.numel() == rows, op, ": rstd must have ", rows, " elements");
  LS_CHECK_DTYPE(op, rstd, at::kFloat);
  auto g = channel_param(op, "weight", gamma, xin, C);
  OptTensor b = channel_param(op, "bias", beta, xin, C);
  c10::cuda::CUDAGuard guard(xin.device());
  Tensor dx = at::empty_like(xin);
  Tensor dg = at::empty({C}, xin.options()), db = at::empty({C}, xin.options());
  Tensor ws = at::empty({std::max<int64_t>(ls::layer_norm_bwd_workspace(rows, (int)C), 2 * C)},
                        xin.options().dtype(at::kFloat));
  launch(op, [&] {
    ls::layer_norm_bwd(dt, dy.data_ptr(), ptr_or_null(dsum), xin.data_ptr(), g->data_ptr(), ptr_or_null(b),
                       present(mean) ? mean->data_ptr<float>() : nullptr, rstd.data_ptr<float>(), dx.data_ptr(),
                       dg.data_ptr(), db.data_ptr(), ws.data_ptr<float>(), rows, (int)C, stream());
  });
  return {dx, dg, db};
}

}  // namespace

// -> (dx, dgamma, dbeta); xin is the layer norm's input (x, or x + residual), dsum the gradient
// flowing into x + residual from elsewhere (added to dx).
std::vector<Tensor> layer_norm_bwd(const Tensor& dy, const OptTensor& dsum, const Tensor& xin, const Tensor& gamma,
                                   const Tensor& mean, const Tensor& rstd) {
  return ln_bwd("layer_norm_bwd", dy, dsum, xin, gamma, std::nullopt, mean, rstd);
}

// The same from the layer norm's output y instead of its input (xhat = (y - beta) / gamma): the backward of
// --ls-invertible-layernorm, which keeps y (held by the next layer anyway) and not the input.
std::vector<Tensor> layer_norm_bwd_invertible(const Tensor& dy, const OptTensor& dsum, const Tensor& y,
                                              const Tensor& gamma, const Tensor& beta, const Tensor& rstd) {
  return ln_bwd("layer_norm_bwd_invertible", dy, dsum, y, gamma, beta, std::nullopt, rstd);
}

}  // namespace ls_torch
