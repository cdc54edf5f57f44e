// ATen adapter: bias + dropout + residual, bias + activation + dropout (forward and backward).
#include "torch/adapter.h"
#include "torch/ops.h"

namespace ls_torch {

// What the two forward ops share: checks on x, p and bias, the device guard, the output, the dropout
// bitmask (ceil(numel / 8) bytes, bit k of byte g = element 8g + k kept; empty when nothing is
// dropped) and the RNG state.
struct DropoutFwd {
  c10::cuda::OptionalCUDAGuard guard;
  int64_t C = 0;
  ls::DType dt{};
  OptTensor bias;
  Tensor out, mask;
  bool drop = false;
  ls::PhiloxArgs rng{};

  DropoutFwd(const char* op, const Tensor& x, const OptTensor& b, double p) {
    LS_CHECK_INPUT(op, x);
    LS_CHECK(x.dim() >= 1, op, ": x must have at least one dimension");
    check_p(op, p);
    C = x.size(-1);
    dt = to_dtype(op, x);
    bias = channel_param(op, "bias", b, x, C);
    guard.set_device(x.device());
    out = at::empty_like(x);
    drop = p > 0.0 && x.numel() > 0;
    mask = at::empty({drop ? ls::mask_bytes(x.numel()) : 0}, x.options().dtype(at::kByte));
    if (drop) rng = philox_args();
  }
  uint8_t* mask_ptr() { return drop ? mask.data_ptr<uint8_t>() : nullptr; }
};

// -> (out, mask)
std::vector<Tensor> bias_dropout_residual_fwd(const Tensor& x, const OptTensor& bias, const Tensor& residual,
                                              double p) {
  const char* op = "bias_dropout_residual_fwd";
  LS_CHECK_INPUT(op, x);
  LS_CHECK_INPUT(op, residual);
  LS_CHECK_SAME_DEVICE(op, x, residual);
  LS_CHECK(residual.sizes() == x.sizes(), op, ": residual shape ", residual.sizes(), " != x shape ", x.sizes());
  LS_CHECK_DTYPE(op, residual, x.scalar_type());
  DropoutFwd f(op, x, bias, p);
  launch(op, [&] {
    ls::bias_dropout_residual_fwd(f.dt, x.data_ptr(), ptr_or_null(f.bias), residual.data_ptr(), f.out.data_ptr(),
                                  f.mask_ptr(), x.numel(), checked_int(op, "C", f.C), f.drop ? (float)p : 0.f,
                                  f.rng, stream());
  });
  return {f.out, f.mask};
}

// -> (out, mask)
std::vector<Tensor> bias_act_dropout_fwd(const Tensor& x, const OptTensor& bias, const std::string& activation,
                                         double p) {
  const char* op = "bias_act_dropout_fwd";
  const ls::Act act = parse_act(op, activation);
  DropoutFwd f(op, x, bias, p);
  launch(op, [&] {
    ls::bias_act_dropout_fwd(f.dt, x.data_ptr(), ptr_or_null(f.bias), f.out.data_ptr(), f.mask_ptr(), x.numel(),
                             checked_int(op, "C", f.C), f.drop ? (float)p : 0.f, act, f.rng, stream());
  });
  return {f.out, f.mask};
}

// -> out: the output of bias_act_dropout_fwd(x, bias, activation, p) again, from the mask it returned (the
// recomputed activation of --ls-recompute-activation; bit for bit the forward's values).
Tensor bias_act_dropout_replay(const Tensor& x, const OptTensor& bias, const OptTensor& mask,
                               const std::string& activation, double p) {
  const char* op = "bias_act_dropout_replay";
  const ls::Act act = parse_act(op, activation);
  LS_CHECK_INPUT(op, x);
  LS_CHECK(x.dim() >= 1, op, ": x must have at least one dimension");
  check_p(op, p);
  const bool drop = p > 0.0 && x.numel() > 0;
  if (drop) {
    LS_CHECK(present(mask), op, ": replaying dropout needs the forward's mask");
    LS_CHECK_INPUT(op, *mask);
    LS_CHECK_SAME_DEVICE(op, x, *mask);
    LS_CHECK_DTYPE(op, *mask, at::kByte);
    LS_CHECK(mask->numel() == ls::mask_bytes(x.numel()), op, ": mask has ", mask->numel(), " bytes, expected ",
             ls::mask_bytes(x.numel()));
  }
  const int64_t C = x.size(-1);
  auto b = channel_param(op, "bias", bias, x, C);
  const ls::DType dt = to_dtype(op, x);
  c10::cuda::CUDAGuard guard(x.device());
  Tensor out = at::empty_like(x);
  launch(op, [&] {
    ls::bias_act_dropout_replay(dt, x.data_ptr(), ptr_or_null(b), drop ? mask->data_ptr<uint8_t>() : nullptr,
                                out.data_ptr(), x.numel(), checked_int(op, "C", C), drop ? (float)p : 0.f, act,
                                stream());
  });
  return out;
}

// -> (dx, dbias (empty unless need_dbias)). activation "none": dx = dy * keep / (1 - p);
// "relu" needs `out` (the forward output), or x, bias and the mask, or (neither given) a mask of the bits of
// out > 0; "gelu" needs x, bias and the mask.
std::vector<Tensor> bias_act_dropout_bwd(const Tensor& dy, const OptTensor& x, const OptTensor& bias,
                                         const OptTensor& out, const OptTensor& mask, double p,
                                         const std::string& activation, bool need_dbias) {
  const char* op = "bias_act_dropout_bwd";
  LS_CHECK_INPUT(op, dy);
  LS_CHECK(dy.dim() >= 1, op, ": dy must have at least one dimension");
  check_p(op, p);
  const ls::Act act = parse_act(op, activation);
  const int64_t C = dy.size(-1);
  const int64_t rows = C > 0 ? dy.numel() / C : 0;
  const ls::DType dt = to_dtype(op, dy);
  const bool drop = p > 0.0 && dy.numel() > 0;
  for (const OptTensor* t : {&x, &out}) {
    if (present(*t)) {
      LS_CHECK_INPUT(op, **t);
      LS_CHECK((*t)->sizes() == dy.sizes(), op, ": saved tensor shape ", (*t)->sizes(), " != dy shape ", dy.sizes());
      LS_CHECK_DTYPE(op, **t, dy.scalar_type());
    }
  }
  const bool relu_from_out = act == ls::Act::Relu && present(out);
  const bool relu_bits = act == ls::Act::Relu && !present(out) && !present(x);  // the mask: bits of out > 0
  if (act == ls::Act::Gelu) LS_CHECK(present(x), op, ": gelu backward needs the forward input");
  if ((drop && !relu_from_out) || (relu_bits && dy.numel() > 0)) {
    LS_CHECK(present(mask), op, ": dropout backward needs the mask");
    LS_CHECK_INPUT(op, *mask);
    LS_CHECK_DTYPE(op, *mask, at::kByte);
    LS_CHECK(mask->numel() == ls::mask_bytes(dy.numel()), op, ": mask has ", mask->numel(), " bytes, expected ",
                ls::mask_bytes(dy.numel()));
  }
  auto b = channel_param(op, "bias", bias, dy, C);
  c10::cuda::CUDAGuard guard(dy.device());
  Tensor dx = at::empty_like(dy);
  Tensor db = need_dbias ? at::empty({C}, dy.options()) : at::empty({0}, dy.options());
  if (need_dbias && rows == 0) {
    db.zero_();
    return {dx, db};
  }
  Tensor ws = at::empty({need_dbias ? ls::colsum_workspace(rows, (int)C) : 0}, dy.options().dtype(at::kFloat));
  launch(op, [&] {
    ls::bias_act_dropout_bwd(dt, dy.data_ptr(), ptr_or_null(x), ptr_or_null(b), ptr_or_null(out),
                             (drop || relu_bits) && present(mask) ? mask->data_ptr<uint8_t>() : nullptr, dx.data_ptr(),
                             need_dbias ? db.data_ptr() : nullptr, need_dbias ? ws.data_ptr<float>() : nullptr, rows,
                             checked_int(op, "C", C), drop ? (float)p : 0.f, act, stream());
  });
  return {dx, db};
}

}  // namespace ls_torch
