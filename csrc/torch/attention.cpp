// ATen adapter and autograd node: attention over short sequences, padded or packed (csrc/kernels/attention.cu).
//
// short_attention_fits() says whether a call can take the kernel; where it cannot (fp32, a head dim other than
// 32 / 64 / 128, a length over kShortAttentionMax, a layout whose rows are not 16-byte aligned, a GPU older than
// sm_80 or with too little shared memory per block) the callers run PyTorch's kernels instead. The output is
// stored token-major ([B, Tq, H, D] memory, returned as a [B, H, Tq, D] view: merging the heads is then free), and
// so are the gradients of q, k and v (what the head split's backward reads in place). Packed sequences (`Packed`:
// int32 offsets on the device and the longest lengths, as flash attention's varlen call takes them) lie back to
// back in q [1, H, Nq, D] and k, v [1, H, Nk, D]; the offsets must cover the rows (the kernel writes the rows of
// the sequences only).
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
                                 const OptTensor& attend, bool causal, double p, const Packed* pk) {
  ls::ShortAttentionArgs a;
  a.dt = to_dtype(op, q);
  a.B = checked_int(op, "batch", pk != nullptr ? pk->cu_q.numel() - 1 : q.size(0));
  a.H = checked_int(op, "heads", q.size(1));
  a.Tq = checked_int(op, "query length", pk != nullptr ? pk->max_q : q.size(2));
  a.Tk = checked_int(op, "key length", pk != nullptr ? pk->max_k : k.size(2));
  a.D = checked_int(op, "head dim", q.size(3));
  bind(a.q, a.q_s, q);
  bind(a.k, a.k_s, k);
  bind(a.v, a.v_s, v);
  a.attend = present(attend) ? attend->data_ptr<uint8_t>() : nullptr;
  a.causal = causal;
  a.p = static_cast<float>(p);
  a.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(a.D)));
  if (pk != nullptr) {
    a.cu_q = pk->cu_q.data_ptr<int>();
    a.cu_k = pk->cu_k.data_ptr<int>();
  }
  return a;
}

// bytes of the keep bits: [B, H, Tq] rows of ceil(Tk / 8)
int64_t keep_bytes(const ls::ShortAttentionArgs& a) { return (int64_t)a.B * a.H * a.Tq * ((a.Tk + 7) / 8); }

// packed: every tensor's batch stride 0 (a sequence's rows start at its offset; after all tensors are bound)
void unbatch(ls::ShortAttentionArgs& a) {
  for (int64_t* s : {a.q_s, a.k_s, a.v_s, a.o_s, a.do_s, a.dq_s, a.dk_s, a.dv_s}) s[0] = 0;
}

bool cu_ok(const Tensor& cu, const Tensor& q) {
  return cu.is_cuda() && cu.device() == q.device() && cu.scalar_type() == at::kInt && cu.dim() == 1 &&
         cu.is_contiguous() && cu.numel() >= 2;
}

// [B, Tk] bool / uint8 (nonzero = attend) as contiguous uint8 on q's device
OptTensor attend_bytes(const OptTensor& attend) {
  if (!present(attend)) return std::nullopt;
  const Tensor t = contig(*attend);
  return t.scalar_type() == at::kBool ? t.view(at::kByte) : t.to(at::kByte);
}

}  // namespace

Packed packed_args(const OptTensor& cu_q, const OptTensor& cu_k, int64_t max_q, int64_t max_k) {
  LS_CHECK(present(cu_q) == present(cu_k), "short_attention: packed sequences need both cu_q and cu_k");
  if (!present(cu_q)) return Packed{};
  LS_CHECK(max_q >= 1 && max_k >= 1, "short_attention: packed sequences need max_q, max_k >= 1, got ", max_q, ", ",
           max_k);
  return Packed{*cu_q, *cu_k, max_q, max_k};
}

bool short_attention_fits(const Tensor& q, const Tensor& k, const Tensor& v, const OptTensor& attend,
                          const Packed* pk) {
  if (!q.is_cuda() || q.dim() != 4 || k.dim() != 4 || v.dim() != 4) return false;
  if (q.scalar_type() != at::kHalf && q.scalar_type() != at::kBFloat16) return false;
  if (k.scalar_type() != q.scalar_type() || v.scalar_type() != q.scalar_type()) return false;
  if (k.device() != q.device() || v.device() != q.device()) return false;
  int64_t B = q.size(0), Tq = q.size(2), Tk = k.size(2);
  const int64_t H = q.size(1), D = q.size(3);
  if (k.size(0) != B || v.size(0) != B || k.size(1) != H || v.size(1) != H || k.size(3) != D ||
      v.sizes() != k.sizes())
    return false;
  if (pk != nullptr) {  // one row of sequences; offsets of as many sequences for q as for k
    if (B != 1 || present(attend) || !cu_ok(pk->cu_q, q) || !cu_ok(pk->cu_k, q) ||
        pk->cu_k.numel() != pk->cu_q.numel())
      return false;
    B = pk->cu_q.numel() - 1;
    Tq = pk->max_q;
    Tk = pk->max_k;
  }
  if (B * H == 0 || B * H > 0x7fffffffLL) return false;
  if (present(attend) && (attend->dim() != 2 || attend->size(0) != B || attend->size(1) != Tk ||
                          attend->device() != q.device()))
    return false;
  return rows_aligned(q) && rows_aligned(k) && rows_aligned(v) &&
         ls::short_attention_supported(q.get_device(), Tq, Tk, D);
}

// -> [out [B, H, Tq, D] (token-major storage), lse [B, H, Tq] fp32, keep bits (uint8, empty when p == 0)]
std::vector<Tensor> short_attention_fwd(const Tensor& q, const Tensor& k, const Tensor& v, const OptTensor& attend,
                                        bool causal, double p, const Packed* pk) {
  const char* op = "short_attention_fwd";
  check_p(op, p);
  LS_CHECK(short_attention_fits(q, k, v, attend, pk), op, ": q ", q.sizes(), ", k ", k.sizes(), " (",
           q.scalar_type(), ") do not fit the kernel (fp16/bf16, head dim 32/64/128, lengths <= ",
           ls::kShortAttentionMax, ", 16-byte aligned rows; packed: one row of sequences, int32 offsets on the GPU)");
  c10::cuda::CUDAGuard guard(q.device());
  const OptTensor att = attend_bytes(attend);
  ls::ShortAttentionArgs a = make_args(op, q, k, v, att, causal, p, pk);
  Tensor out = token_major_like(q);
  Tensor lse = at::empty({a.B, a.H, a.Tq}, q.options().dtype(at::kFloat));
  Tensor mask = at::empty({p > 0.0 ? keep_bytes(a) : 0}, q.options().dtype(at::kByte));
  bind(a.out, a.o_s, out);
  if (pk != nullptr) unbatch(a);
  a.lse = lse.data_ptr<float>();
  a.mask = p > 0.0 ? mask.data_ptr<uint8_t>() : nullptr;
  const ls::PhiloxArgs rng = p > 0.0 ? philox_args() : ls::PhiloxArgs{};
  launch(op, [&] { ls::short_attention_fwd(a, rng, stream()); });
  return {out, lse, mask};
}

// -> [dq, dk, dv] (token-major storage) from the forward's tensors
std::vector<Tensor> short_attention_bwd(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                                        const Tensor& out, const Tensor& lse, const Tensor& mask,
                                        const OptTensor& attend, bool causal, double p, const Packed* pk) {
  const char* op = "short_attention_bwd";
  check_p(op, p);
  LS_CHECK(short_attention_fits(q, k, v, attend, pk), op, ": inputs do not fit the kernel");
  LS_CHECK(dout.sizes() == q.sizes() && out.sizes() == q.sizes() && dout.scalar_type() == q.scalar_type() &&
               out.scalar_type() == q.scalar_type(),
           op, ": dout ", dout.sizes(), " / out ", out.sizes(), " must match q ", q.sizes(), " (", q.scalar_type(),
           ")");
  c10::cuda::CUDAGuard guard(q.device());
  const OptTensor att = attend_bytes(attend);
  ls::ShortAttentionArgs a = make_args(op, q, k, v, att, causal, p, pk);
  LS_CHECK(lse.scalar_type() == at::kFloat && lse.is_contiguous() && lse.numel() == (int64_t)a.B * a.H * a.Tq, op,
           ": lse must be the forward's fp32 [B, H, Tq]");
  if (p > 0.0)
    LS_CHECK(mask.scalar_type() == at::kByte && mask.is_contiguous() && mask.numel() == keep_bytes(a), op,
             ": the forward's keep bits are missing or of another shape");
  Tensor dO = rows_aligned(dout) ? dout : token_major_like(dout).copy_(dout);
  Tensor o = rows_aligned(out) ? out : token_major_like(out).copy_(out);
  Tensor dq = token_major_like(q), dk = token_major_like(k), dv = token_major_like(v);
  bind(a.out, a.o_s, o);
  bind(a.dout, a.do_s, dO);
  bind(a.dq, a.dq_s, dq);
  bind(a.dk, a.dk_s, dk);
  bind(a.dv, a.dv_s, dv);
  if (pk != nullptr) unbatch(a);
  a.lse = lse.data_ptr<float>();
  a.mask = p > 0.0 ? mask.data_ptr<uint8_t>() : nullptr;
  launch(op, [&] { ls::short_attention_bwd(a, stream()); });
  return {dq, dk, dv};
}

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// out = attention(q, k, v) as one node; keeps q, k, v, out, the log-sum-exp and the keep bits.
// Packed: cu_q, cu_k given (int32 offsets) with the longest lengths; padded: both absent (optional, not undefined
// tensors: autograd records the device of every tensor argument it is given).
struct ShortAttentionNode : public torch::autograd::Function<ShortAttentionNode> {
  static Tensor forward(AutogradContext* ctx, const Tensor& q, const Tensor& k, const Tensor& v,
                        const OptTensor& attend, bool causal, double p, const OptTensor& cu_q,
                        const OptTensor& cu_k, int64_t max_q, int64_t max_k) {
    const bool packed = present(cu_q);
    const Packed pk = packed ? Packed{*cu_q, *cu_k, max_q, max_k} : Packed{};
    auto r = short_attention_fwd(q, k, v, attend, causal, p, packed ? &pk : nullptr);
    ctx->set_materialize_grads(false);
    ctx->save_for_backward({q, k, v, r[0], r[1], r[2]});
    ctx->saved_data["attend"] = present(attend) ? c10::IValue(*attend) : c10::IValue();
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["p"] = p;
    ctx->saved_data["cu_q"] = packed ? c10::IValue(*cu_q) : c10::IValue();
    ctx->saved_data["cu_k"] = packed ? c10::IValue(*cu_k) : c10::IValue();
    ctx->saved_data["max_q"] = max_q;
    ctx->saved_data["max_k"] = max_k;
    return r[0];
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list none(10);
    if (!grads[0].defined()) return none;
    auto s = ctx->get_saved_variables();
    const auto& att = ctx->saved_data["attend"];
    const OptTensor attend = att.isNone() ? OptTensor() : OptTensor(att.toTensor());
    const auto& cq = ctx->saved_data["cu_q"];
    const Packed pk{cq.isNone() ? Tensor() : cq.toTensor(),
                    cq.isNone() ? Tensor() : ctx->saved_data["cu_k"].toTensor(), ctx->saved_data["max_q"].toInt(),
                    ctx->saved_data["max_k"].toInt()};
    auto d = short_attention_bwd(grads[0], s[0], s[1], s[2], s[3], s[4], s[5], attend,
                                 ctx->saved_data["causal"].toBool(), ctx->saved_data["p"].toDouble(),
                                 cq.isNone() ? nullptr : &pk);
    none[0] = d[0];
    none[1] = d[1];
    none[2] = d[2];
    return none;
  }
};

}  // namespace

Tensor ag_short_attention(const Tensor& q, const Tensor& k, const Tensor& v, const OptTensor& attend, bool causal,
                          double p, const Packed* pk) {
  if (pk != nullptr)
    return ShortAttentionNode::apply(q, k, v, attend, causal, p, pk->cu_q, pk->cu_k, pk->max_q, pk->max_k);
  return ShortAttentionNode::apply(q, k, v, attend, causal, p, OptTensor(), OptTensor(), 0, 0);
}

}  // namespace ls_torch
