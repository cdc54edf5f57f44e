// FP8 linear layers for Hopper (and Ada): y = x W^T (+ b) with x and W quantised to e4m3 per tensor (current
// scaling, power-of-two scales: csrc/kernels/fp8.cu) and the product taken by torch's FP8 GEMM
// (at::_scaled_mm over cuBLASLt), output in the input's dtype. Backward: the input gradient is a second FP8
// GEMM, dY quantised to the gradient format (e4m3 or e5m2) against the saved e4m3 W; the weight gradient
// dY^T X stays a GEMM in the input's dtype from the saved high-precision X (no transposed FP8 copies of the
// activations and gradients are made), as does the bias gradient.
//
// The GEMM wants K and N multiples of 16 (FP8 tensor-core tiles); a layer whose sizes are not takes the plain
// linear node instead (ag_linear_mode), so any model size trains.
#include <torch/extension.h>

#include "torch/adapter.h"
#include "torch/ops.h"

namespace ls_torch {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace {

ls::Fp8Format to_format(const char* op, int64_t f) {
  LS_CHECK(f == 0 || f == 1, op, ": FP8 format must be 0 (e4m3) or 1 (e5m2), got ", f);
  return f == 0 ? ls::Fp8Format::E4M3 : ls::Fp8Format::E5M2;
}

// (q, scale_inv) of a contiguous CUDA tensor; checks done by the callers
std::pair<Tensor, Tensor> quantize(const char* op, const Tensor& x, ls::Fp8Format fmt) {
  const ls::DType dt = to_dtype(op, x);
  const auto qt = fmt == ls::Fp8Format::E4M3 ? at::kFloat8_e4m3fn : at::kFloat8_e5m2;
  Tensor q = at::empty(x.sizes(), x.options().dtype(qt));
  Tensor scale_inv = at::empty({}, x.options().dtype(at::kFloat));
  Tensor scratch = at::empty({1}, x.options().dtype(at::kInt));
  const int64_t n = x.numel();
  if (n > 0) {
    c10::cuda::CUDAGuard guard(x.device());
    launch(op, [&] {
      ls::fp8_quantize(dt, x.data_ptr(), n, fmt, reinterpret_cast<unsigned*>(scratch.data_ptr()), q.data_ptr(),
                       scale_inv.data_ptr<float>(), stream());
    });
  } else {
    scale_inv.fill_(1.0);
  }
  return {q, scale_inv};
}

struct Fp8LinearNode : public torch::autograd::Function<Fp8LinearNode> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& weight, const OptTensor& bias,
                        int64_t grad_format) {
    const int64_t K = x.size(-1);
    Tensor x2 = contig(x.reshape({-1, K}));
    auto f = fp8_linear_forward(x2, weight, bias);
    auto sizes = x.sizes().vec();
    sizes.back() = weight.size(0);
    ctx->set_materialize_grads(false);
    ctx->save_for_backward({x2, weight, f[1], f[2]});
    ctx->saved_data["hb"] = present(bias);
    ctx->saved_data["gf"] = grad_format;
    return at::_unsafe_view(f[0], sizes);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const Tensor& g = grads[0];
    if (!g.defined()) return {Tensor(), Tensor(), Tensor(), Tensor()};
    auto s = ctx->get_saved_variables();
    const Tensor &x2 = s[0], &w = s[1], &wq = s[2], &sw = s[3];
    Tensor g2 = contig(g.reshape({-1, w.size(0)}));
    Tensor dx, dw, db;
    if (ctx->needs_input_grad(0)) {
      auto sizes = g.sizes().vec();
      sizes.back() = w.size(1);
      dx = at::_unsafe_view(fp8_linear_input_grad(g2, wq, sw, ctx->saved_data["gf"].toInt()), sizes);
    }
    if (ctx->needs_input_grad(1)) dw = at::mm(g2.t(), x2);
    if (ctx->saved_data["hb"].toBool() && ctx->needs_input_grad(2)) db = g2.sum(0);
    return {dx, dw, db, Tensor()};
  }
};

}  // namespace

std::vector<Tensor> fp8_linear_forward(const Tensor& x2, const Tensor& weight, const OptTensor& bias) {
  const char* op = "fp8_linear";
  auto [xq, sx] = quantize(op, x2, ls::Fp8Format::E4M3);
  auto [wq, sw] = quantize(op, contig(weight), ls::Fp8Format::E4M3);
  // mat2 = W^T as a column-major [K, N] view of the row-major [N, K] codes; fast accumulation forward
  Tensor y2 = at::_scaled_mm(xq, wq.t(), sx, sw, bias, std::nullopt, x2.scalar_type(), true);
  return {y2, wq, sw};
}

Tensor fp8_linear_input_grad(const Tensor& g2, const Tensor& wq, const Tensor& sw, int64_t grad_format) {
  const char* op = "fp8_linear backward";
  auto [gq, sg] = quantize(op, g2, to_format(op, grad_format));
  // mat2 = W [N, K] column-major: the transposed copy of the codes, viewed back
  Tensor wqt = wq.t().contiguous();
  return at::_scaled_mm(gq, wqt.t(), sg, sw, std::nullopt, std::nullopt, g2.scalar_type(), false);
}

bool fp8_linear_shapes_ok(const Tensor& weight) { return weight.size(0) % 16 == 0 && weight.size(1) % 16 == 0; }

std::vector<Tensor> fp8_quantize(const Tensor& x, int64_t format) {
  const char* op = "fp8_quantize";
  LS_CHECK_INPUT(op, x);
  to_dtype(op, x);
  auto [q, s] = quantize(op, x, to_format(op, format));
  return {q, s};
}

Tensor ag_fp8_linear(const Tensor& x, const Tensor& weight, const OptTensor& bias, int64_t grad_format) {
  const char* op = "fp8_linear";
  LS_CHECK(x.dim() >= 2 && weight.dim() == 2 && x.size(-1) == weight.size(1), op, ": input ", x.sizes(),
           " does not match weight ", weight.sizes());
  LS_CHECK(x.is_cuda() && x.device() == weight.device(), op, ": input and weight must be on one CUDA device");
  LS_CHECK(x.scalar_type() == weight.scalar_type() &&
               (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf),
           op, ": input and weight must both be bfloat16 or float16, got ", x.scalar_type(), " and ",
           weight.scalar_type());
  LS_CHECK(fp8_linear_shapes_ok(weight), op, ": weight ", weight.sizes(),
           " has a size that is not a multiple of 16 (the FP8 GEMM's requirement)");
  if (present(bias))
    LS_CHECK(bias->dim() == 1 && bias->size(0) == weight.size(0) && bias->scalar_type() == x.scalar_type(), op,
             ": bias must be [", weight.size(0), "] of ", x.scalar_type(), ", got ", bias->sizes(), " of ",
             bias->scalar_type());
  to_format(op, grad_format);
  return Fp8LinearNode::apply(x, weight, bias, grad_format);
}

Tensor ag_linear_mode(const Tensor& x, const Tensor& weight, const OptTensor& bias, int64_t fp8) {
  if (fp8 > 0 && fp8_linear_shapes_ok(weight) && x.dim() >= 2) return ag_fp8_linear(x, weight, bias, fp8 - 1);
  return ag_linear(x, weight, bias);
}

}  // namespace ls_torch
