// ATen adapter: fused Adam / AdamW step over flat buffers, and the flat gradient norm.
#include "torch/adapter.h"
#include "torch/ops.h"

namespace ls_torch {

// The kernel reads an optional fp32 scalar on param's device: its pointer, or nullptr when absent.
static const float* device_scalar(const char* op, const char* name, const OptTensor& t, const Tensor& param) {
  if (!present(t)) return nullptr;
  LS_CHECK(t->is_cuda(), op, ": ", name, " must be a CUDA tensor, got ", t->device());
  LS_CHECK(t->device() == param.device(), op, ": param and ", name, " are on different devices");
  LS_CHECK(t->scalar_type() == at::kFloat, op, ": ", name, " must be ", at::kFloat, ", got ", t->scalar_type());
  LS_CHECK(t->numel() == 1, op, ": ", name, " must be a scalar tensor");
  return t->data_ptr<float>();  // one element: contiguous
}

// `ranges`: flattened [lo, hi) pairs into buffers of n elements, ascending and disjoint; empty = [0, n).
static std::vector<int64_t> checked_ranges(const char* op, const std::vector<int64_t>& ranges, int64_t n) {
  if (ranges.empty()) return {0, n};
  LS_CHECK(ranges.size() % 2 == 0, op, ": ranges must be [lo, hi) pairs, got ", ranges.size(), " numbers");
  LS_CHECK(ranges.size() / 2 < (size_t)INT32_MAX, op, ": too many ranges");
  int64_t prev = 0;
  for (size_t k = 0; k < ranges.size(); k += 2) {
    const int64_t lo = ranges[k], hi = ranges[k + 1];
    LS_CHECK(0 <= lo && lo <= hi && hi <= n, op, ": range [", lo, ", ", hi, ") is not inside the ", n,
             " elements of the buffers");
    LS_CHECK(lo >= prev, op, ": ranges must be ascending and disjoint; [", lo, ", ", hi,
             ") starts before the previous range ends at ", prev);
    prev = hi;
  }
  return ranges;
}

void adam_step(const Tensor& param, const Tensor& grad, const Tensor& exp_avg, const Tensor& exp_avg_sq,
               const OptTensor& param_lp, double lr, double beta1, double beta2, double eps, double weight_decay,
               int64_t step, double grad_scale, bool torch_mode, const OptTensor& skip_if_nonfinite,
               const OptTensor& grad_scale_tensor, const OptTensor& param_lp_peer,
               const std::vector<int64_t>& ranges, const OptTensor& norm_out, const OptTensor& param_lo) {
  const char* op = "adam_step";
  const int64_t n = param.numel();
  for (const Tensor* t : {&param, &grad, &exp_avg, &exp_avg_sq}) {
    LS_CHECK_INPUT(op, *t);
    LS_CHECK_SAME_DEVICE(op, param, *t);
    LS_CHECK(t->numel() == n, op, ": buffer sizes differ (", t->numel(), " vs ", n, ")");
  }
  const bool split = present(param_lo);  // param: bf16 weights, the upper halves of a split fp32 master
  if (split) {
    LS_CHECK_INPUT(op, *param_lo);
    LS_CHECK_SAME_DEVICE(op, param, *param_lo);
    LS_CHECK(param_lo->numel() == n, op, ": param_lo has ", param_lo->numel(), " elements, param has ", n);
    LS_CHECK_DTYPE(op, *param_lo, at::kShort);
    LS_CHECK_DTYPE(op, param, at::kBFloat16);
    LS_CHECK(!present(param_lp), op, ": with param_lo, param is the bf16 weights themselves; pass no param_lp");
  } else {
    LS_CHECK_DTYPE(op, param, at::kFloat);
  }
  LS_CHECK_DTYPE(op, exp_avg, at::kFloat);
  LS_CHECK_DTYPE(op, exp_avg_sq, at::kFloat);
  LS_CHECK(step >= 1, op, ": step must be >= 1, got ", step);
  const ls::DType gdt = to_dtype(op, grad);
  ls::DType ldt = ls::DType::F32;
  if (present(param_lp)) {
    LS_CHECK_INPUT(op, *param_lp);
    LS_CHECK_SAME_DEVICE(op, param, *param_lp);
    LS_CHECK(param_lp->numel() == n, op, ": param_lp has ", param_lp->numel(), " elements, param has ", n);
    ldt = to_dtype(op, *param_lp);
  }
  if (split) ldt = ls::DType::BF16;
  if (present(param_lp_peer)) {  // a peer GPU's copy, mapped into this device's address space
    LS_CHECK_INPUT(op, *param_lp_peer);
    LS_CHECK_SAME_DEVICE(op, param, *param_lp_peer);
    LS_CHECK(param_lp_peer->numel() == n, op, ": param_lp_peer has ", param_lp_peer->numel(),
             " elements, param has ", n);
    LS_CHECK(to_dtype(op, *param_lp_peer) == ldt, op, ": param_lp_peer must have ",
             present(param_lp) ? param_lp->scalar_type() : param.scalar_type(), ", got ",
             param_lp_peer->scalar_type());
  }
  const float* norm = device_scalar(op, "skip_if_nonfinite", skip_if_nonfinite, param);
  const float* scale_dev = device_scalar(op, "grad_scale_tensor", grad_scale_tensor, param);
  const std::vector<int64_t> bounds = checked_ranges(op, ranges, n);
  float* sq_out = nullptr;
  Tensor sq_ws;
  if (present(norm_out)) {  // the gradients' norm, summed in the step's own pass
    LS_CHECK(norm == nullptr, op,
             ": norm_out and skip_if_nonfinite exclude each other (the norm is known after the step)");
    sq_out = const_cast<float*>(device_scalar(op, "norm_out", norm_out, param));
  }
  c10::cuda::CUDAGuard guard(param.device());
  if (sq_out != nullptr)
    sq_ws = at::empty({std::max<int64_t>(1, ls::adam_norm_workspace((int)(bounds.size() / 2)))},
                      param.options().dtype(at::kFloat));
  ls::AdamArgs a{(float)lr, (float)beta1, (float)beta2, (float)eps, (float)weight_decay, (float)grad_scale, step,
                 torch_mode};
  launch(op, [&] {
    if (split) {
      ls::adam_step_split_ranges(gdt, param.data_ptr(), param_lo->data_ptr<int16_t>(), grad.data_ptr(),
                                 exp_avg.data_ptr<float>(), exp_avg_sq.data_ptr<float>(),
                                 present(param_lp_peer) ? param_lp_peer->data_ptr() : nullptr, bounds.data(),
                                 (int)(bounds.size() / 2), a, norm, scale_dev,
                                 sq_out == nullptr ? nullptr : sq_ws.data_ptr<float>(), sq_out, stream());
      return;
    }
    ls::adam_step_ranges(gdt, ldt, param.data_ptr<float>(), grad.data_ptr(), exp_avg.data_ptr<float>(),
                         exp_avg_sq.data_ptr<float>(), present(param_lp) ? param_lp->data_ptr() : nullptr,
                         present(param_lp_peer) ? param_lp_peer->data_ptr() : nullptr, bounds.data(),
                         (int)(bounds.size() / 2), a, norm, scale_dev,
                         sq_out == nullptr ? nullptr : sq_ws.data_ptr<float>(), sq_out, stream());
  });
}

Tensor grad_norm(const Tensor& grad, const std::vector<int64_t>& ranges) {
  const char* op = "grad_norm";
  LS_CHECK_INPUT(op, grad);
  const ls::DType dt = to_dtype(op, grad);
  const std::vector<int64_t> bounds = checked_ranges(op, ranges, grad.numel());
  c10::cuda::CUDAGuard guard(grad.device());
  auto f32 = grad.options().dtype(at::kFloat);
  Tensor out = at::empty({}, f32);
  if (grad.numel() == 0) return out.zero_();
  Tensor ws = at::empty({ls::grad_norm_workspace()}, f32);
  launch(op, [&] {
    ls::grad_norm_ranges(dt, grad.data_ptr(), bounds.data(), (int)(bounds.size() / 2), ws.data_ptr<float>(),
                         out.data_ptr<float>(), stream());
  });
  return out;
}

}  // namespace ls_torch
