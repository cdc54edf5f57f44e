// ATen adapter: head split (q/k/v, k/v with bias) and head merge.
#include "torch/adapter.h"
#include "torch/ops.h"

namespace ls_torch {

// x [B, T, n*C] (+ bias [n*C]) -> out [n, B, H, T, C/H]; token_major: out is a view of [n, B, T, H, C/H]
Tensor qkv_split_fwd(const Tensor& x, const OptTensor& bias, int64_t n, int64_t num_heads, bool token_major) {
  const char* op = "qkv_split_fwd";
  LS_CHECK_INPUT(op, x);
  LS_CHECK(x.dim() == 3, op, ": x must be [batch, length, n*embed_dim], got ", x.sizes());
  LS_CHECK(n >= 1 && x.size(2) % n == 0, op, ": last dimension ", x.size(2), " is not ", n,
              " x embed_dim");
  const int64_t Cn = x.size(2) / n;
  LS_CHECK(num_heads >= 1 && Cn % num_heads == 0, op, ": embed_dim ", Cn, " not divisible by num_heads ", num_heads);
  const ls::DType dt = to_dtype(op, x);
  auto b = channel_param(op, "bias", bias, x, x.size(2));
  c10::cuda::CUDAGuard guard(x.device());
  const int64_t B = x.size(0), T = x.size(1), D = Cn / num_heads;
  Tensor out = token_major ? at::empty({n, B, T, num_heads, D}, x.options())
                           : at::empty({n, B, num_heads, T, D}, x.options());
  launch(op, [&] {
    ls::split_heads_fwd(dt, x.data_ptr(), ptr_or_null(b), out.data_ptr(), checked_int(op, "batch", B),
                        checked_int(op, "length", T), (int)n, (int)num_heads, checked_int(op, "head_dim", D),
                        token_major, stream());
  });
  return token_major ? out.transpose(2, 3) : out;
}

// grads of the n parts (each [B, H, T, D] or None) -> (dx [B, T, n*H*D], dbias [n*H*D] or empty).
// Gradients stored token-major ([B, T, H, D] memory, as SDPA's backward writes them for token-major
// inputs) are read in place; any other layout is made contiguous first. One kernel merges up to
// kMaxSplitParts parts and sums the bias gradient in the same pass; more parts are stacked by ATen.
std::vector<Tensor> split_heads_bwd(const std::vector<OptTensor>& ds, bool need_dbias) {
  const char* op = "split_heads_bwd";
  const int64_t n = (int64_t)ds.size();
  LS_CHECK(n >= 1, op, ": at least one part is needed");
  const Tensor* ref = nullptr;
  for (const auto& d : ds)
    if (present(d)) { ref = &d.value(); break; }
  LS_CHECK(ref != nullptr, op, ": at least one gradient must be given");
  LS_CHECK(ref->dim() == 4, op, ": gradients must be [batch, heads, length, head_dim], got ", ref->sizes());
  for (const auto& d : ds) {
    if (!present(d)) continue;
    const Tensor& t = d.value();
    LS_CHECK_CUDA(op, t);
    LS_CHECK(t.sizes() == ref->sizes(), op, ": gradient shapes differ: ", t.sizes(), " vs ", ref->sizes());
    LS_CHECK_DTYPE(op, t, ref->scalar_type());
  }
  const int64_t B = ref->size(0), H = ref->size(1), T = ref->size(2), D = ref->size(3);
  c10::cuda::CUDAGuard guard(ref->device());
  if (n > ls::kMaxSplitParts) {  // beyond the kernel's table of parts: one stacking copy, the bias summed in fp32
    std::vector<Tensor> parts;
    for (const auto& d : ds) parts.push_back((present(d) ? d.value() : at::zeros_like(*ref)).transpose(1, 2));
    Tensor dx = at::stack(parts, 2).view({B, T, n * H * D});
    Tensor db = need_dbias ? dx.sum(at::IntArrayRef{0, 1}, false, at::kFloat).to(ref->scalar_type())
                           : at::empty({0}, ref->options());
    return {dx, db};
  }
  const HeadGrads g = gather_head_grads(ds, false);
  const ls::DType dt = to_dtype(op, *ref);
  Tensor dx = at::empty({B, T, n * H * D}, ref->options());
  Tensor db = need_dbias ? at::empty({n * H * D}, ref->options()) : at::empty({0}, ref->options());
  const int64_t rows = B * T;
  if (need_dbias && rows == 0) db.zero_();
  Tensor ws = at::empty({need_dbias ? ls::colsum_workspace(rows, (int)(n * H * D)) : 0}, ref->options().dtype(at::kFloat));
  launch(op, [&] {
    ls::split_heads_bwd(dt, g.ptrs.data(), dx.data_ptr(), need_dbias && rows > 0 ? db.data_ptr() : nullptr,
                        need_dbias ? ws.data_ptr<float>() : nullptr, checked_int(op, "batch", B),
                        checked_int(op, "length", T), (int)n, checked_int(op, "heads", H),
                        checked_int(op, "head_dim", D), g.token_major, stream());
  });
  return {dx, db};
}

HeadGrads gather_head_grads(const std::vector<OptTensor>& ds, bool aligned16) {
  HeadGrads g{{}, std::vector<const void*>(ds.size(), nullptr), true};
  for (const auto& d : ds)
    if (present(d)) g.token_major = g.token_major && token_major_heads(*d);
  for (size_t i = 0; i < ds.size(); ++i) {
    if (!present(ds[i])) continue;
    Tensor t = g.token_major ? *ds[i] : ds[i]->contiguous();
    if (aligned16 && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 != 0) t = t.clone();  // keeps its strides
    g.keep.push_back(t);
    g.ptrs[i] = t.data_ptr();
  }
  return g;
}

// [B, H, T, D] -> [B, T, H*D]
Tensor merge_heads_fwd(const Tensor& x) {
  const char* op = "merge_heads_fwd";
  LS_CHECK_CUDA(op, x);
  LS_CHECK(x.dim() == 4, op, ": x must be [batch, heads, length, head_dim], got ", x.sizes());
  return split_heads_bwd({OptTensor(x.contiguous())}, false)[0];
}

// [B, T, H*D] -> [B, H, T, D]
Tensor merge_heads_bwd(const Tensor& dy, int64_t num_heads) {
  return qkv_split_fwd(dy.contiguous(), std::nullopt, 1, num_heads, false)[0];
}

}  // namespace ls_torch
