// ATen adapter: fused embedding forward and its deterministic (sort-based) backward.
#include "torch/adapter.h"
#include "torch/ops.h"

namespace ls_torch {

static Tensor index_tensor(const char* op, const char* name, const Tensor& t, const Tensor& like) {
  LS_CHECK_CUDA(op, t);
  LS_CHECK_SAME_DEVICE(op, t, like);
  LS_CHECK(t.scalar_type() == at::kLong || t.scalar_type() == at::kInt, op, ": ", name,
              " must be int64 or int32, got ", t.scalar_type());
  return t.to(at::kLong).contiguous();
}

// -> (out [*tokens.shape, C], mask bitmask (empty when p == 0))
std::vector<Tensor> embedding_fwd(const Tensor& tokens, const Tensor& weight, const OptTensor& pos_weight,
                                  const OptTensor& positions, double scale, double p, int64_t padding_idx,
                                  bool zero_pad) {
  const char* op = "embedding_fwd";
  LS_CHECK_INPUT(op, weight);
  LS_CHECK(weight.dim() == 2, op, ": weight must be [num_embeddings, C], got ", weight.sizes());
  check_p(op, p);
  const int64_t C = weight.size(1);
  const ls::DType dt = to_dtype(op, weight);
  Tensor tok = index_tensor(op, "tokens", tokens, weight);
  Tensor pos, pw;
  if (present(pos_weight)) {
    LS_CHECK(present(positions), op, ": positions are required with pos_weight");
    LS_CHECK_CUDA(op, *pos_weight);
    LS_CHECK(pos_weight->dim() == 2 && pos_weight->size(1) == C, op, ": pos_weight must be [P, ", C, "], got ",
                pos_weight->sizes());
    pw = pos_weight->to(weight.scalar_type()).contiguous();
    pos = index_tensor(op, "positions", *positions, weight);
    LS_CHECK(pos.sizes() == tok.sizes(), op, ": positions shape ", pos.sizes(), " != tokens shape ", tok.sizes());
  }
  c10::cuda::CUDAGuard guard(weight.device());
  auto out_shape = tok.sizes().vec();
  out_shape.push_back(C);
  Tensor out = at::empty(out_shape, weight.options());
  const int64_t rows = tok.numel();
  const bool drop = p > 0.0 && rows * C > 0;
  Tensor mask = at::empty({drop ? ls::mask_bytes(rows * C) : 0}, weight.options().dtype(at::kByte));
  ls::PhiloxArgs rng = drop ? philox_args() : ls::PhiloxArgs{};
  launch(op, [&] {
    ls::embedding_fwd(dt, tok.data_ptr<int64_t>(), weight.data_ptr(), pw.defined() ? pw.data_ptr() : nullptr,
                      pos.defined() ? pos.data_ptr<int64_t>() : nullptr, out.data_ptr(),
                      drop ? mask.data_ptr<uint8_t>() : nullptr, rows, checked_int(op, "C", C), (float)scale,
                      drop ? (float)p : 0.f, padding_idx, zero_pad, rng, stream());
  });
  return {out, mask};
}

// Gradient of a [num_embeddings, C] table looked up by `keys` (tokens or positions):
// grad[k] = factor * sum over rows with keys == k != padding_idx of dy * keep (rows whose token is
// padding_idx skipped when zero_pad). Deterministic: keys are sorted, runs are summed in order.
// weight_key (the table's data pointer, or 0): when the CUDA-graph step names a sink for that weight
// (weight_grads.cpp), the gradient goes there (added to it, or written over it after zeroing it) and
// the result is undefined (None): no [num_embeddings, C] tensor is made for autograd to add.
Tensor embedding_bwd(const Tensor& dy, const OptTensor& mask, const Tensor& keys, const Tensor& tokens,
                     int64_t num_embeddings, double factor, int64_t padding_idx, bool zero_pad, int64_t weight_key) {
  const char* op = "embedding_bwd";
  LS_CHECK_INPUT(op, dy);
  const int64_t C = dy.size(-1);
  const ls::DType dt = to_dtype(op, dy);
  Tensor k = index_tensor(op, "keys", keys, dy).reshape({-1});
  Tensor tok = index_tensor(op, "tokens", tokens, dy).reshape({-1});
  const int64_t rows = k.numel();
  LS_CHECK(rows * C == dy.numel(), op, ": dy has ", dy.numel(), " elements, expected ", rows, " x ", C);
  LS_CHECK(tok.numel() == rows, op, ": tokens and keys differ in size");
  if (present(mask)) {
    LS_CHECK_INPUT(op, *mask);
    LS_CHECK_DTYPE(op, *mask, at::kByte);
    LS_CHECK(mask->numel() == ls::mask_bytes(dy.numel()), op, ": mask has ", mask->numel(), " bytes, expected ",
                ls::mask_bytes(dy.numel()));
  }
  c10::cuda::CUDAGuard guard(dy.device());
  bool add = false;
  Tensor sink = weight_key != 0 ? weight_grad_sink(reinterpret_cast<const void*>(weight_key), num_embeddings, C,
                                                   dy.scalar_type(), &add)
                                : Tensor();
  if (sink.defined()) {
    LS_CHECK(sink.device() == dy.device(), op, ": the gradient sink is on ", sink.device(), ", dy on ", dy.device());
    if (!add) sink.zero_();
  }
  Tensor grad = sink.defined() ? sink : at::zeros({num_embeddings, C}, dy.options());
  if (rows > 0) {
    auto sorted = at::sort(k, /*stable=*/true, /*dim=*/0, /*descending=*/false);
    Tensor skeys = std::get<0>(sorted).contiguous(), perm = std::get<1>(sorted).contiguous();
    const int c = checked_int(op, "C", C);
    Tensor workspace = at::empty({ls::embedding_bwd_workspace_floats(rows, c)}, dy.options().dtype(at::kFloat));
    launch(op, [&] {
      ls::embedding_bwd(dt, dy.data_ptr(), present(mask) ? mask->data_ptr<uint8_t>() : nullptr,
                        skeys.data_ptr<int64_t>(), perm.data_ptr<int64_t>(), tok.data_ptr<int64_t>(), grad.data_ptr(),
                        workspace.data_ptr<float>(), rows, c, (float)factor, padding_idx, zero_pad, add, stream());
    });
  }
  return sink.defined() ? Tensor() : grad;
}

}  // namespace ls_torch
