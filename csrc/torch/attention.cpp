// ATen adapter and autograd node: attention over short padded sequences (csrc/kernels/attention.cu).
//
// short_attention_fits() says whether a call can take the kernel; where it cannot (fp32, a head dim other than
// 32 / 64 / 128, a length over kShortAttentionMax, a layout whose rows are not 16-byte aligned, a GPU older than
// sm_80 or with too little shared memory per block) the callers run PyTorch's SDPA instead. The output is stored token-major ([B, Tq, H, D] memory, returned as a [B, H, Tq, D]
// view: merging the heads is then free), and so are the gradients of q, k and v (what the head split's backward
// reads in place).
#include <cmath>
#include <cstdint>

#include <torch/extension.h>

#include "torch/adapter.h"
#include "torch/ops.h"

namespace ls_torch {

namespace {

bool rows_aligned(const Tensor& t) {
  return t.stride(3) == 1 && t.stride(0) % 8 == 0 && t.stride(1) % 8 == 0 && t.stride(2) % 8 == 0 &&
         reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
}

// a [B, H, T, D] tensor as the kernels take it: its data and its (batch, head, row) strides
template <typename P>
void bind(P& ptr, int64_t (&s)[3], const Tensor& t) {
  ptr = t.data_ptr();
  s[0] = t.stride(0);
  s[1] = t.stride(1);
  s[2] = t.stride(2);
}

// [B, H, T, D] stored as [B, T, H, D]
Tensor token_major_like(const Tensor& t) {
  return at::empty({t.size(0), t.size(2), t.size(1), t.size(3)}, t.options()).transpose(1, 2);
}

ls::ShortAttentionArgs make_args(const char* op, const Tensor& q, const Tensor& k, const Tensor& v,
                                 const OptTensor& attend, bool causal, double p) {
  ls::ShortAttentionArgs a;
  a.dt = to_dtype(op, q);
  a.B = checked_int(op, "batch", q.size(0));
  a.H = checked_int(op, "heads", q.size(1));
  a.Tq = checked_int(op, "query length", q.size(2));
  a.Tk = checked_int(op, "key length", k.size(2));
  a.D = checked_int(op, "head dim", q.size(3));
  bind(a.q, a.q_s, q);
  bind(a.k, a.k_s, k);
  bind(a.v, a.v_s, v);
  a.attend = present(attend) ? attend->data_ptr<uint8_t>() : nullptr;
  a.causal = causal;
  a.p = static_cast<float>(p);
  a.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(a.D)));
  return a;
}

// [B, Tk] bool / uint8 (nonzero = attend) as contiguous uint8 on q's device
OptTensor attend_bytes(const OptTensor& attend) {
  if (!present(attend)) return std::nullopt;
  const Tensor t = contig(*attend);
  return t.scalar_type() == at::kBool ? t.view(at::kByte) : t.to(at::kByte);
}

}  // namespace

bool short_attention_fits(const Tensor& q, const Tensor& k, const Tensor& v, const OptTensor& attend) {
  if (!q.is_cuda() || q.dim() != 4 || k.dim() != 4 || v.dim() != 4) return false;
  if (q.scalar_type() != at::kHalf && q.scalar_type() != at::kBFloat16) return false;
  if (k.scalar_type() != q.scalar_type() || v.scalar_type() != q.scalar_type()) return false;
  if (k.device() != q.device() || v.device() != q.device()) return false;
  const int64_t B = q.size(0), H = q.size(1), Tq = q.size(2), Tk = k.size(2), D = q.size(3);
  if (k.size(0) != B || v.size(0) != B || k.size(1) != H || v.size(1) != H || k.size(3) != D ||
      v.sizes() != k.sizes())
    return false;
  if (B * H == 0 || B * H > 0x7fffffffLL) return false;
  if (present(attend) && (attend->dim() != 2 || attend->size(0) != B || attend->size(1) != Tk ||
                          attend->device() != q.device()))
    return false;
  return rows_aligned(q) && rows_aligned(k) && rows_aligned(v) &&
         ls::short_attention_supported(q.get_device(), Tq, Tk, D);
}

// -> [out [B, H, Tq, D] (token-major storage), lse [B, H, Tq] fp32, keep bits (uint8, empty when p == 0)]
std::vector<Tensor> short_attention_fwd(const Tensor& q, const Tensor& k, const Tensor& v, const OptTensor& attend,
                                        bool causal, double p) {
  const char* op = "short_attention_fwd";
  check_p(op, p);
  LS_CHECK(short_attention_fits(q, k, v, attend), op, ": q ", q.sizes(), ", k ", k.sizes(), " (", q.scalar_type(),
           ") do not fit the kernel (fp16/bf16, head dim 32/64/128, lengths <= ", ls::kShortAttentionMax,
           ", 16-byte aligned rows)");
  c10::cuda::CUDAGuard guard(q.device());
  const OptTensor att = attend_bytes(attend);
  ls::ShortAttentionArgs a = make_args(op, q, k, v, att, causal, p);
  Tensor out = token_major_like(q);
  Tensor lse = at::empty({a.B, a.H, a.Tq}, q.options().dtype(at::kFloat));
  const int64_t mask_row = (a.Tk + 7) / 8;
  Tensor mask = at::empty({p > 0.0 ? (int64_t)a.B * a.H * a.Tq * mask_row : 0}, q.options().dtype(at::kByte));
  bind(a.out, a.o_s, out);
  a.lse = lse.data_ptr<float>();
  a.mask = p > 0.0 ? mask.data_ptr<uint8_t>() : nullptr;
  const ls::PhiloxArgs rng = p > 0.0 ? philox_args() : ls::PhiloxArgs{};
  launch(op, [&] { ls::short_attention_fwd(a, rng, stream()); });
  return {out, lse, mask};
}

// -> [dq, dk, dv] (token-major storage) from the forward's tensors
std::vector<Tensor> short_attention_bwd(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                                        const Tensor& out, const Tensor& lse, const Tensor& mask,
                                        const OptTensor& attend, bool causal, double p) {
  const char* op = "short_attention_bwd";
  check_p(op, p);
  LS_CHECK(short_attention_fits(q, k, v, attend), op, ": inputs do not fit the kernel");
  LS_CHECK(dout.sizes() == q.sizes() && out.sizes() == q.sizes() && dout.scalar_type() == q.scalar_type() &&
               out.scalar_type() == q.scalar_type(),
           op, ": dout ", dout.sizes(), " / out ", out.sizes(), " must match q ", q.sizes(), " (", q.scalar_type(),
           ")");
  LS_CHECK(lse.scalar_type() == at::kFloat && lse.is_contiguous() && lse.numel() == q.size(0) * q.size(1) * q.size(2),
           op, ": lse must be the forward's fp32 [B, H, Tq]");
  const int64_t mask_row = (k.size(2) + 7) / 8;
  if (p > 0.0)
    LS_CHECK(mask.scalar_type() == at::kByte && mask.is_contiguous() &&
                 mask.numel() == q.size(0) * q.size(1) * q.size(2) * mask_row,
             op, ": the forward's keep bits are missing or of another shape");
  c10::cuda::CUDAGuard guard(q.device());
  const OptTensor att = attend_bytes(attend);
  Tensor dO = rows_aligned(dout) ? dout : token_major_like(dout).copy_(dout);
  Tensor o = rows_aligned(out) ? out : token_major_like(out).copy_(out);
  ls::ShortAttentionArgs a = make_args(op, q, k, v, att, causal, p);
  Tensor dq = token_major_like(q), dk = token_major_like(k), dv = token_major_like(v);
  bind(a.out, a.o_s, o);
  bind(a.dout, a.do_s, dO);
  bind(a.dq, a.dq_s, dq);
  bind(a.dk, a.dk_s, dk);
  bind(a.dv, a.dv_s, dv);
  a.lse = lse.data_ptr<float>();
  a.mask = p > 0.0 ? mask.data_ptr<uint8_t>() : nullptr;
  launch(op, [&] { ls::short_attention_bwd(a, stream()); });
  return {dq, dk, dv};
}

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// out = attention(q, k, v) as one node; keeps q, k, v, out, the log-sum-exp and the keep bits.
struct ShortAttentionNode : public torch::autograd::Function<ShortAttentionNode> {
  static Tensor forward(AutogradContext* ctx, const Tensor& q, const Tensor& k, const Tensor& v,
                        const OptTensor& attend, bool causal, double p) {
    auto r = short_attention_fwd(q, k, v, attend, causal, p);
    ctx->set_materialize_grads(false);
    ctx->save_for_backward({q, k, v, r[0], r[1], r[2]});
    ctx->saved_data["attend"] = present(attend) ? c10::IValue(*attend) : c10::IValue();
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["p"] = p;
    return r[0];
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (!grads[0].defined()) return {Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
    auto s = ctx->get_saved_variables();
    const auto& att = ctx->saved_data["attend"];
    const OptTensor attend = att.isNone() ? OptTensor() : OptTensor(att.toTensor());
    auto d = short_attention_bwd(grads[0], s[0], s[1], s[2], s[3], s[4], s[5], attend,
                                 ctx->saved_data["causal"].toBool(), ctx->saved_data["p"].toDouble());
    return {d[0], d[1], d[2], Tensor(), Tensor(), Tensor()};
  }
};

}  // namespace

Tensor ag_short_attention(const Tensor& q, const Tensor& k, const Tensor& v, const OptTensor& attend, bool causal,
                          double p) {
  return ShortAttentionNode::apply(q, k, v, attend, causal, p);
}

}  // namespace ls_torch
