// ATen adapter: label-smoothed cross-entropy forward (sums) and backward, and both in one pass; the same pass with
// the gradient left only as FP8 codes (the FP8 vocabulary projection).
#include <torch/csrc/autograd/variable.h>

#include "torch/adapter.h"
#include "torch/fp8.h"
#include "torch/ops.h"

namespace ls_torch {

void check_ce(const char* op, const Tensor& logits, const Tensor& target) {
  LS_CHECK_INPUT(op, logits);
  LS_CHECK_INPUT(op, target);
  LS_CHECK_SAME_DEVICE(op, logits, target);
  LS_CHECK(logits.dim() == 2, op, ": logits must be [tokens, vocab], got ", logits.sizes());
  LS_CHECK(target.dim() == 1 && target.size(0) == logits.size(0), op, ": target must be [", logits.size(0),
              "], got ", target.sizes());
  LS_CHECK_DTYPE(op, target, at::kLong);
  LS_CHECK(logits.size(1) >= 1, op, ": vocabulary must not be empty");
}

void check_grad_scale(const char* op, const OptTensor& grad_scale, const Tensor& logits) {
  if (!present(grad_scale)) return;
  LS_CHECK(grad_scale->device() == logits.device(), op, ": grad_scale must be on ", logits.device(), ", got ",
           grad_scale->device());
  LS_CHECK(grad_scale->scalar_type() == at::kFloat && grad_scale->numel() == 1, op,
           ": grad_scale must be a 1-element float32 tensor, got ", grad_scale->scalar_type(), " of shape ",
           grad_scale->sizes());
}

// -> (loss sum, nll sum, lse [N]); all fp32.
std::vector<Tensor> ls_cross_entropy_fwd(const Tensor& logits, const Tensor& target, double epsilon,
                                         int64_t ignore_index) {
  const char* op = "ls_cross_entropy_fwd";
  check_ce(op, logits, target);
  LS_CHECK(epsilon >= 0.0 && epsilon < 1.0, op, ": label smoothing must be in [0, 1), got ", epsilon);
  const ls::DType dt = to_dtype(op, logits);
  c10::cuda::CUDAGuard guard(logits.device());
  const int64_t N = logits.size(0);
  auto f32 = logits.options().dtype(at::kFloat);
  Tensor losses = at::empty({2, N}, f32), lse = at::empty({N}, f32);
  launch(op, [&] {
    ls::ls_cross_entropy_fwd(dt, logits.data_ptr(), target.data_ptr<int64_t>(), losses.data_ptr<float>(),
                             lse.data_ptr<float>(), N, checked_int(op, "vocab", logits.size(1)), (float)epsilon,
                             ignore_index, stream());
  });
  Tensor sums = N > 0 ? losses.sum(1) : at::zeros({2}, f32);
  return {sums[0].clone(), sums[1].clone(), lse};  // no aliasing between outputs
}

// inplace: the gradient overwrites the logits (which the backward reads for the last time here) instead of
// taking a second [tokens, vocab] buffer; the logits' version counter is bumped, so a node that kept them
// for later fails loudly instead of reading gradients.
Tensor ls_cross_entropy_bwd(const Tensor& logits, const Tensor& target, const Tensor& lse, const Tensor& g_loss,
                            const Tensor& g_nll, double epsilon, int64_t ignore_index, bool inplace) {
  const char* op = "ls_cross_entropy_bwd";
  check_ce(op, logits, target);
  LS_CHECK_INPUT(op, lse);
  LS_CHECK(lse.numel() == logits.size(0), op, ": lse must have one entry per row");
  const ls::DType dt = to_dtype(op, logits);
  c10::cuda::CUDAGuard guard(logits.device());
  Tensor gl = g_loss.to(logits.device(), at::kFloat).reshape({1}).contiguous();
  Tensor gn = g_nll.to(logits.device(), at::kFloat).reshape({1}).contiguous();
  Tensor dlogits = inplace ? logits : at::empty_like(logits);
  launch(op, [&] {
    ls::ls_cross_entropy_bwd(dt, logits.data_ptr(), target.data_ptr<int64_t>(), lse.data_ptr<float>(),
                             gl.data_ptr<float>(), gn.data_ptr<float>(), dlogits.data_ptr(), logits.size(0),
                             checked_int(op, "vocab", logits.size(1)), (float)epsilon, ignore_index, stream());
  });
  if (inplace) torch::autograd::impl::bump_version(logits);
  return dlogits;
}

// The training step's head in one pass -> (loss sum, nll sum), fp32; the gradient of grad_scale * loss sum
// (a 1-element fp32 device tensor, 1 when absent) overwrites the logits, whose version counter is bumped as in
// the in-place backward. Not an autograd op: nothing is saved.
std::vector<Tensor> ls_cross_entropy_fwd_bwd(const Tensor& logits, const Tensor& target, double epsilon,
                                             int64_t ignore_index, const OptTensor& grad_scale) {
  const char* op = "ls_cross_entropy_fwd_bwd";
  check_ce(op, logits, target);  // includes: logits contiguous (the gradient is written over them)
  LS_CHECK(epsilon >= 0.0 && epsilon < 1.0, op, ": label smoothing must be in [0, 1), got ", epsilon);
  const ls::DType dt = to_dtype(op, logits);
  auto f32 = logits.options().dtype(at::kFloat);
  check_grad_scale(op, grad_scale, logits);
  c10::cuda::CUDAGuard guard(logits.device());
  const int64_t N = logits.size(0);
  Tensor losses = at::empty({2, N}, f32);
  const float* scale = present(grad_scale) ? grad_scale->data_ptr<float>() : nullptr;  // null: 1
  launch(op, [&] {
    ls::ls_cross_entropy_fwd_bwd(dt, logits.data_ptr(), target.data_ptr<int64_t>(), losses.data_ptr<float>(), scale,
                                 N, checked_int(op, "vocab", logits.size(1)), (float)epsilon, ignore_index, stream());
  });
  torch::autograd::impl::bump_version(logits);
  Tensor sums = N > 0 ? losses.sum(1) : at::zeros({2}, f32);
  return {sums[0].clone(), sums[1].clone()};
}

using namespace fp8_impl;

// The loss and nll sums of the head as ls_cross_entropy_fwd_bwd computes them, and the gradient of
// grad_scale * loss sum only as FP8 codes in `format`: exactly the codes fp8_quantize would make of the gradient
// that ls_cross_entropy_fwd_bwd writes, under the delayed scale of state row `row` (whose amax records the
// gradient's maximum). A pass per row makes the loss's statistics and a tile pass over the logits the codes: the
// row-major codes [N, V] and, when `transposed`, the transposed codes [V, padded16(N)] (what the weight-gradient
// GEMM reads). The logits are left as they are: the gradient is never stored in their precision. V a multiple of
// 16.
std::vector<Tensor> ls_cross_entropy_fwd_bwd_fp8(const Tensor& logits, const Tensor& target, double epsilon,
                                                 int64_t ignore_index, const OptTensor& grad_scale,
                                                 const Tensor& state, int64_t row, int64_t format, bool transposed) {
  const char* op = "ls_cross_entropy_fwd_bwd_fp8";
  check_ce(op, logits, target);
  LS_CHECK(epsilon >= 0.0 && epsilon < 1.0, op, ": label smoothing must be in [0, 1), got ", epsilon);
  LS_CHECK(logits.size(1) % 16 == 0, op, ": the vocabulary (", logits.size(1),
           ") must be a multiple of 16 for FP8 codes");
  LS_CHECK(row >= 0, op, ": row must be >= 0, got ", row);
  check_state(op, state, row + 1, logits);
  check_grad_scale(op, grad_scale, logits);
  const ls::Fp8Format fmt = to_format(op, format);
  const ls::DType dt = to_dtype(op, logits);
  Tensor x = aligned(logits);
  const int64_t N = x.size(0), V = x.size(1), Mp = padded16(N);
  Tensor q, q_t;
  std::tie(q, q_t) = empty_codes(x, N, V, fmt, true, transposed);
  Tensor losses = at::empty({2, N}, x.options().dtype(at::kFloat));
  Tensor lse = at::empty({N}, x.options().dtype(at::kFloat));
  float* fp8_row = state.data_ptr<float>() + row * ls::kFp8Width;
  c10::cuda::CUDAGuard guard(x.device());
  launch(op, [&] {
    ls::ls_cross_entropy_fwd_bwd_fp8(dt, x.data_ptr(), target.data_ptr<int64_t>(), losses.data_ptr<float>(),
                                     present(grad_scale) ? grad_scale->data_ptr<float>() : nullptr, N,
                                     checked_int(op, "vocab", V), (float)epsilon, ignore_index,
                                     lse.data_ptr<float>(), fp8_row, fmt, q.data_ptr(),
                                     transposed ? q_t.data_ptr() : nullptr, Mp, stream());
  });
  Tensor sums = N > 0 ? losses.sum(1) : at::zeros({2}, losses.options());
  return {sums[0].clone(), sums[1].clone(), q, q_t};
}

}  // namespace ls_torch
