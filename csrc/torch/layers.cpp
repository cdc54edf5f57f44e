// Whole transformer layers in one call from Python: the encoder layer and the decoder layer (training and
// full-sequence forward; incremental decoding stays in Python) as the same sequence of autograd nodes that
// ls_fairseq/modules/*_layer.py records through the public ops (autograd.cpp's nodes, torch's SDPA and the
// views between them), in the same order, so the kernels, their dropout streams and the recorded graph are
// those of the Python layer. What goes away is the Python between the ops: per layer the module calls, the
// ops' argument checks and dispatch, and about twenty crossings into C++ (host time the eager step waits for;
// docs/op_paths.md). The GIL is released for the layer.
//
// Weights, in this order (the names of the Python modules):
//   encoder: self_attn_layer_norm.{weight,bias}, self_attn.{in_proj_weight,in_proj_bias},
//            self_attn.out_proj.{weight,bias}, final_layer_norm.{weight,bias}, fc1.{weight,bias},
//            fc2.{weight,bias}                                                              (12)
//   decoder: the 12 above, then encoder_attn_layer_norm.{weight,bias}, encoder_attn.q_proj.{weight,bias},
//            encoder_attn.out_proj.{weight,bias}                                            (18)
// eps: the layer norms' eps in the same order (self-attention, final[, encoder-attention]).
// Dropout probabilities are the effective ones (0 outside training); the decoder's encoder-attention has its own.
// memory: the memory modes (ops.h: kInvertibleLayerNorm, kRecomputeActivation), as the Python layers apply them.
// Packed sentences (cu_seqlens / cu_tgt, cu_src given): x is [1, tokens, C] with the sentences back to back, no
// padding; attention runs over each sentence's rows (Packed, ops.h), everything else is row-wise.
#include <torch/extension.h>

#include <ATen/Context.h>

#include "torch/gil.h"
#include "torch/ops.h"

namespace ls_torch {

namespace {

// The SDPA backends ls_fairseq/ops/attention.py allows: flash, memory-efficient and math (not cuDNN, not the
// overrideable slot); for short sequences the memory-efficient kernel goes first. Set for one call and
// restored after it, as the Python context does.
class SdpBackends {
 public:
  explicit SdpBackends(bool short_seq) {
    auto& c = at::globalContext();
    prev_[0] = c.userEnabledFlashSDP();
    prev_[1] = c.userEnabledMemEfficientSDP();
    prev_[2] = c.userEnabledMathSDP();
    prev_[3] = c.userEnabledCuDNNSDP();
    prev_[4] = c.userEnabledOverrideableSDP();
    set(true, true, true, false, false);
    if (short_seq) {
      order_ = c.sDPPriorityOrder();
      std::vector<int64_t> order = {static_cast<int64_t>(at::SDPBackend::efficient_attention),
                                    static_cast<int64_t>(at::SDPBackend::flash_attention),
                                    static_cast<int64_t>(at::SDPBackend::math)};
      for (auto b : *order_) {
        const auto v = static_cast<int64_t>(b);
        if (std::find(order.begin(), order.end(), v) == order.end()) order.push_back(v);
      }
      c.setSDPPriorityOrder(order);
    }
  }
  ~SdpBackends() {
    set(prev_[0], prev_[1], prev_[2], prev_[3], prev_[4]);
    if (order_) {
      std::vector<int64_t> order;
      for (auto b : *order_) order.push_back(static_cast<int64_t>(b));
      at::globalContext().setSDPPriorityOrder(order);
    }
  }
  SdpBackends(const SdpBackends&) = delete;
  SdpBackends& operator=(const SdpBackends&) = delete;

 private:
  static void set(bool flash, bool efficient, bool math, bool cudnn, bool overrideable) {
    auto& c = at::globalContext();
    if (c.userEnabledFlashSDP() != flash) c.setSDPUseFlash(flash);
    if (c.userEnabledMemEfficientSDP() != efficient) c.setSDPUseMemEfficient(efficient);
    if (c.userEnabledMathSDP() != math) c.setSDPUseMath(math);
    if (c.userEnabledCuDNNSDP() != cudnn) c.setSDPUseCuDNN(cudnn);
    if (c.userEnabledOverrideableSDP() != overrideable) c.setSDPUseOverrideable(overrideable);
  }
  bool prev_[5];
  std::optional<std::array<at::SDPBackend, at::num_sdp_backends>> order_;
};

// [B, S] padding mask (true = pad) -> [B, 1, 1, S] (true = attend), as ops.attention builds it.
Tensor attend_mask(const Tensor& key_padding_mask) {
  return key_padding_mask.to(at::kBool).bitwise_not().view({key_padding_mask.size(0), 1, 1, key_padding_mask.size(1)});
}

// Packed sequences (no padding, batch 1; `Packed` of ops.h): sequence i is rows [cu_q[i], cu_q[i + 1]) of the
// queries and [cu_k[i], cu_k[i + 1]) of the keys and values; max_q / max_k bound the sequences' lengths.
// [Nq, Nk] (true = attend) of packed sequences: within each sequence, causal from its first row (the CPU's way;
// ls_fairseq/ops/attention.py's reference builds the same)
Tensor varlen_mask(const Packed& vl, bool causal) {
  auto seg_pos = [](const Tensor& cu) {
    const Tensor c = cu.to(at::kLong);
    const int64_t n = c.numel() - 1;
    const Tensor seg = at::repeat_interleave(at::arange(n, c.options()), c.slice(0, 1) - c.slice(0, 0, n));
    return std::make_pair(seg, at::arange(seg.numel(), c.options()) - c.index_select(0, seg));
  };
  auto [sq, pq] = seg_pos(vl.cu_q);
  auto [sk, pk] = seg_pos(vl.cu_k);
  Tensor m = sq.unsqueeze(1).eq(sk.unsqueeze(0));
  return causal ? m.logical_and(pk.unsqueeze(0).le(pq.unsqueeze(1))) : m;
}

// softmax(q k^T / sqrt(D) + masks) v for q [B, H, T, D], k, v [B, H, S, D]; attend [B, 1, 1, S] or absent.
// With vl: packed sequences, q [1, H, Nq, D], k, v [1, H, Nk, D]; on CUDA a kernel over them (below; its layout
// [1, N, H, D] is a view of ours, and so is its output's), on the CPU a block mask.
Tensor attention(const Tensor& q, const Tensor& k, const Tensor& v, const OptTensor& attend, bool causal, double p,
                 int64_t short_len, const Packed* vl = nullptr) {
  if (vl != nullptr) {
    if (!q.is_cuda()) return at::scaled_dot_product_attention(q, k, v, varlen_mask(*vl, causal), p);
    // fp16 / bf16: the kernels of attention.cu or flash's, whose backwards replay the forward's dropout mask (also
    // under CUDA graphs);
    // fp32: the memory-efficient kernel without dropout (over packed sequences its backward does not see the mask
    // its forward drew). As ls_fairseq/ops/attention.py's _varlen_cuda.
    if (q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16) {
      // sequences up to kShortAttentionMax: the kernel of attention.cu over the packed rows; longer ones: flash
      if (short_attention_fits(q, k, v, std::nullopt, vl))
        return ag_short_attention(q, k, v, std::nullopt, causal, p, vl);
      auto r = at::_flash_attention_forward(q.transpose(1, 2).select(0, 0), k.transpose(1, 2).select(0, 0),
                                            v.transpose(1, 2).select(0, 0), vl->cu_q, vl->cu_k, vl->max_q, vl->max_k,
                                            p, causal, false);
      return std::get<0>(r).unsqueeze(0).transpose(1, 2);
    }
    TORCH_CHECK(p == 0.0, "attention: packed sequences (varlen) with dropout need fp16 or bf16 on CUDA, got ",
                q.scalar_type(), " with p=", p);
    const bool grad =
        at::GradMode::is_enabled() && (q.requires_grad() || k.requires_grad() || v.requires_grad());
    auto r = at::_efficient_attention_forward(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), std::nullopt,
                                              vl->cu_q, vl->cu_k, vl->max_q, vl->max_k, 0.0, causal ? 1 : 0, grad);
    return std::get<0>(r).transpose(1, 2);
  }
  // short sequences (most of a --max-tokens batch of sentences): the kernel of attention.cu
  const OptTensor attend2 = present(attend) ? OptTensor(attend->view({attend->size(0), attend->size(3)})) : OptTensor();
  if (short_attention_fits(q, k, v, attend2)) return ag_short_attention(q, k, v, attend2, causal, p);
  const int64_t Tq = q.size(-2), S = k.size(-2);
  SdpBackends backends(std::max(Tq, S) <= short_len);
  if (!present(attend) && causal && Tq == S) return at::scaled_dot_product_attention(q, k, v, std::nullopt, p, true);
  OptTensor mask = attend;
  if (causal && Tq > 1) {  // query i sits at absolute position S - Tq + i and sees keys up to it
    Tensor c = at::ones({Tq, S}, q.options().dtype(at::kBool)).tril(S - Tq);
    mask = present(attend) ? attend->bitwise_and(c) : c;
  }
  return at::scaled_dot_product_attention(q, k, v, mask, p);
}

// [B, H, T, D] -> [B, T, H * D]: a view when the attention output is token-major in memory (flash and
// memory-efficient kernels), else a copy.
Tensor merge_heads(const Tensor& x) {
  const int64_t B = x.size(0), H = x.size(1), T = x.size(2), D = x.size(3);
  Tensor t = x.transpose(1, 2);
  return t.is_contiguous() ? t.view({B, T, H * D}) : t.reshape({B, T, H * D});
}

struct Dropouts {
  double dropout, act, attn, cross_attn;  // cross_attn: the decoder's encoder-attention
};

// What a layer's blocks share besides the weights.
struct LayerArgs {
  int64_t num_heads;
  Dropouts p;
  bool pre;          // normalize_before
  int64_t short_len;
  Fp8Args fp8;       // slots: self-attention QKV 0, output 1; FFN 2, 3; cross-attention query 4, output 5
  bool invertible;   // kInvertibleLayerNorm
  bool recompute;    // kRecomputeActivation
};

// (input of the block, its residual): layer_norm(x) and x for pre-LN, x and x for post-LN
std::pair<Tensor, Tensor> block_input(const Tensor& x, const LayerArgs& a, const Tensor& w, const Tensor& b,
                                      double eps) {
  if (!a.pre) return {x, x};
  auto r = ag_pre_layer_norm(x, w, b, eps, a.invertible);
  return {r[0], r[1]};
}

// the block's output from x = residual + dropout(h + bias): x, or its layer norm in a post-LN block
Tensor block_end(const Tensor& x, const LayerArgs& a, const Tensor& w, const Tensor& b, double eps) {
  return a.pre ? x : ag_layer_norm(x, std::nullopt, w, b, eps, a.invertible)[0];
}

// residual + dropout(h + bias), then the layer norm of a post-LN block
Tensor block_output(const Tensor& h, const Tensor& bias, const Tensor& residual, const LayerArgs& a, const Tensor& w,
                    const Tensor& b, double eps) {
  return block_end(ag_bias_dropout_residual(h, bias, residual, a.p.dropout)[0], a, w, b, eps);
}

// h W^T + b split into n parts of heads: views of one GEMM's output (its gradient merged from the heads', the bias's
// summed on the way); in FP8 one node whose output gradient is quantised from the heads' gradients (as
// ls_fairseq/ops/linear.py's linear_split)
std::vector<Tensor> linear_split(const Tensor& h, const Tensor& weight, const Tensor& bias, int64_t n,
                                 int64_t num_heads, const Fp8Args& f) {
  return f.mode > 0 && fp8_linear_shapes_ok(weight)
             ? ag_fp8_linear_split(h, weight, bias, n, num_heads, f.mode, f.state, f.slot)
             : ag_linear_split(h, weight, bias, n, num_heads);
}

// An attention block's end: residual + dropout(h W^T + bias), then the layer norm of a post-LN block; in FP8 one
// node whose output gradient leaves the dropout's backward as codes (as ls_fairseq/ops/linear.py's
// linear_dropout_residual)
Tensor projection_output(const Tensor& h, const Tensor& weight, const Tensor& bias, const Tensor& residual,
                         const Fp8Args& f, const LayerArgs& a, const Tensor& w, const Tensor& b, double eps) {
  if (f.mode > 0 && fp8_linear_shapes_ok(weight))
    return block_end(ag_fp8_linear_residual(h, weight, bias, residual, a.p.dropout, f.mode, f.state, f.slot)[0], a,
                     w, b, eps);
  return block_output(ag_linear_mode(h, weight, std::nullopt, f), bias, residual, a, w, b, eps);
}

// whether a pre-LN block's layer norm goes into its FP8 projection's node (written only as the input codes)
bool ln_into_fp8(const LayerArgs& a, const Fp8Args& f, const Tensor& weight) {
  return a.pre && !a.invertible && f.mode > 0 && fp8_linear_shapes_ok(weight);
}

Tensor self_attention_block(const Tensor& x, const OptTensor& attend, bool causal, const std::vector<Tensor>& w,
                            double eps, const LayerArgs& a, const Packed* vl) {
  std::vector<Tensor> parts;
  Tensor residual;
  if (ln_into_fp8(a, a.fp8.at(0), w[2])) {
    const Fp8Args& f = a.fp8.at(0);
    parts = ag_fp8_ln_linear_split(x, w[0], w[1], eps, w[2], w[3], 3, a.num_heads, f.mode, f.state, f.slot);
    residual = parts.back();
    parts.pop_back();
  } else {
    Tensor h;
    std::tie(h, residual) = block_input(x, a, w[0], w[1], eps);
    parts = linear_split(h, w[2], w[3], 3, a.num_heads, a.fp8.at(0));
  }
  Tensor out = attention(parts[0], parts[1], parts[2], attend, causal, a.p.attn, a.short_len, vl);
  return projection_output(merge_heads(out), w[4], w[5], residual, a.fp8.at(1), a, w[0], w[1], eps);
}

Tensor ffn_block(const Tensor& x, const std::vector<Tensor>& w, double eps, const std::string& activation,
                 const LayerArgs& a) {
  const Fp8Args f1 = a.fp8.at(2), f = a.fp8.at(3);
  const bool recompute = a.recompute && activation == "gelu";
  const bool both_fp8 = f1.mode > 0 && f.mode > 0 && fp8_linear_shapes_ok(w[8]) && fp8_linear_shapes_ok(w[10]);
  if (both_fp8 && ln_into_fp8(a, f1, w[8]))  // pre-LN: the block's output is the node's (block_end is x)
    return ag_fp8_ln_ffn(x, w[6], w[7], eps, w[8], w[9], w[10], w[11], activation, a.p.act, a.p.dropout, f.mode,
                         f.state, f1.slot, f.slot, !recompute)[0];
  auto [h, residual] = block_input(x, a, w[6], w[7], eps);
  if (both_fp8) {
    // both projections in FP8: one node with the residual's dropout, the activation and the gradients reaching the
    // projections only as codes
    return block_end(ag_fp8_ffn(h, w[8], w[9], w[10], w[11], residual, activation, a.p.act, a.p.dropout, f.mode,
                                f.state, f1.slot, f.slot, !recompute)[0],
                     a, w[6], w[7], eps);
  }
  h = ag_linear_mode(h, w[8], std::nullopt, f1);
  if (recompute || (f.mode > 0 && fp8_linear_shapes_ok(w[10]))) {  // FP8: the activation written only as codes
    h = ag_bias_act_linear(h, w[9], w[10], activation, a.p.act, f.mode, f.state, f.slot, !recompute)[0];
  } else {
    h = ag_bias_act_dropout(h, w[9], activation, a.p.act)[0];
    h = ag_linear_mode(h, w[10], std::nullopt, f);
  }
  return block_output(h, w[11], residual, a, w[6], w[7], eps);
}

Tensor cross_attention_block(const Tensor& x, const Tensor& k, const Tensor& v, const OptTensor& attend,
                             const std::vector<Tensor>& w, double eps, const LayerArgs& a, const Packed* vl) {
  auto [h, residual] = block_input(x, a, w[12], w[13], eps);
  Tensor q = linear_split(h, w[14], w[15], 1, a.num_heads, a.fp8.at(4))[0];
  Tensor out = attention(q, k, v, attend, false, a.p.cross_attn, a.short_len, vl);
  return projection_output(merge_heads(out), w[16], w[17], residual, a.fp8.at(5), a, w[12], w[13], eps);
}

LayerArgs layer_args(int64_t num_heads, const Dropouts& p, bool pre, int64_t short_len, const Fp8Args& fp8,
                     int64_t memory) {
  LS_CHECK(memory >= 0 && memory <= (kInvertibleLayerNorm | kRecomputeActivation),
           "transformer layer: unknown memory mode bits ", memory);
  LS_CHECK(fp8.mode >= 0 && (fp8.mode & 15) <= 4 && (fp8.mode >> Fp8Args::kFp8SkipShift) < 64,
           "transformer layer: fp8 mode must be 0 to 4 plus skip bits 16 << k for projections k < 6, got ", fp8.mode);
  return {num_heads, p, pre, short_len, fp8, (memory & kInvertibleLayerNorm) != 0,
          (memory & kRecomputeActivation) != 0};
}

// Clear errors for what the Python layer would have refused or what no kernel below checks.
void check_layer(const char* op, const Tensor& x, const std::vector<Tensor>& w, size_t n_weights,
                 const std::vector<double>& eps, size_t n_eps, int64_t num_heads, const std::string& activation,
                 const Dropouts& p) {
  LS_CHECK(w.size() == n_weights, op, ": expected ", static_cast<int64_t>(n_weights), " weights, got ",
           static_cast<int64_t>(w.size()));
  LS_CHECK(eps.size() == n_eps, op, ": expected ", static_cast<int64_t>(n_eps), " layer-norm eps values, got ",
           static_cast<int64_t>(eps.size()));
  LS_CHECK(x.dim() == 3, op, ": expected input [batch, length, embed_dim], got ", x.sizes());
  const int64_t C = w[2].dim() == 2 ? w[2].size(1) : -1;
  LS_CHECK(x.size(2) == C, op, ": input ", x.sizes(), " does not match embed_dim ", C);
  LS_CHECK(num_heads >= 1 && C % num_heads == 0, op, ": embed_dim ", C, " is not divisible by num_heads ", num_heads);
  for (size_t i = 0; i < w.size(); ++i) {
    LS_CHECK(w[i].defined(), op, ": weight ", static_cast<int64_t>(i), " is undefined");
    LS_CHECK(w[i].device() == x.device() && w[i].scalar_type() == x.scalar_type(), op, ": weight ",
             static_cast<int64_t>(i), " is ", w[i].scalar_type(), " on ", w[i].device().str(), ", the input ",
             x.scalar_type(), " on ", x.device().str());
  }
  LS_CHECK(activation == "relu" || activation == "gelu", op, ": unsupported activation '", activation, "'");
  for (double q : {p.dropout, p.act, p.attn, p.cross_attn})
    LS_CHECK(q >= 0.0 && q < 1.0, op, ": dropout probability must be in [0, 1), got ", q);
}

void check_padding_mask(const char* op, const char* what, const OptTensor& mask, int64_t B, int64_t S,
                        const Tensor& x) {
  if (!present(mask)) return;
  LS_CHECK(mask->dim() == 2 && mask->size(0) == B && mask->size(1) == S, op, ": ", what, " ", mask->sizes(),
           " != (batch, length) (", B, ", ", S, ")");
  LS_CHECK(mask->device() == x.device(), op, ": ", what, " is on ", mask->device().str(), ", the input on ",
           x.device().str());
}

// The packed-sequence arguments of a layer call: cu_seqlens int32 [n + 1] on x's device, x [1, N, C], no masks.
void check_varlen(const char* op, const char* what, const Tensor& cu, int64_t max_len, const Tensor& x,
                  const OptTensor& mask) {
  LS_CHECK(cu.scalar_type() == at::kInt && cu.dim() == 1 && cu.numel() >= 2, op, ": ", what,
           " must be int32 [sentences + 1], got ", cu.scalar_type(), " ", cu.sizes());
  LS_CHECK(cu.device() == x.device(), op, ": ", what, " is on ", cu.device().str(), ", the input on ",
           x.device().str());
  LS_CHECK(max_len >= 1, op, ": the longest packed sentence must be given (>= 1), got ", max_len);
  LS_CHECK(x.size(0) == 1, op, ": packed sentences come as one row [1, tokens, embed_dim], got ", x.sizes());
  LS_CHECK(!present(mask), op, ": packed sentences take no padding mask");
}

}  // namespace

Tensor encoder_layer_fwd(const Tensor& x, const OptTensor& key_padding_mask, const std::vector<Tensor>& weights,
                         const std::vector<double>& eps, int64_t num_heads, double dropout, double activation_dropout,
                         double attention_dropout, const std::string& activation, bool normalize_before,
                         int64_t short_len, int64_t fp8, const OptTensor& fp8_state, int64_t fp8_slot,
                         int64_t memory, const OptTensor& cu_seqlens, int64_t max_len) {
  const char* op = "encoder_layer";
  const Dropouts p{dropout, activation_dropout, attention_dropout, 0.0};
  check_layer(op, x, weights, 12, eps, 2, num_heads, activation, p);
  const LayerArgs a = layer_args(num_heads, p, normalize_before, short_len, Fp8Args{fp8, fp8_state, fp8_slot}, memory);
  check_padding_mask(op, "key_padding_mask", key_padding_mask, x.size(0), x.size(1), x);
  std::optional<Packed> vl;
  if (present(cu_seqlens)) {
    check_varlen(op, "cu_seqlens", *cu_seqlens, max_len, x, key_padding_mask);
    vl = Packed{*cu_seqlens, *cu_seqlens, max_len, max_len};
  }
  ReleaseGilIfHeld nogil;  // nothing below needs Python
  OptTensor attend = present(key_padding_mask) ? OptTensor(attend_mask(*key_padding_mask)) : std::nullopt;
  Tensor h = self_attention_block(x, attend, false, weights, eps[0], a, vl ? &*vl : nullptr);
  return ffn_block(h, weights, eps[1], activation, a);
}

Tensor decoder_layer_fwd(const Tensor& x, const Tensor& cross_k, const Tensor& cross_v,
                         const OptTensor& encoder_padding_mask, const OptTensor& self_attn_padding_mask,
                         const std::vector<Tensor>& weights, const std::vector<double>& eps, int64_t num_heads,
                         double dropout, double activation_dropout, double attention_dropout,
                         double cross_attention_dropout, const std::string& activation, bool normalize_before,
                         int64_t short_len, int64_t fp8, const OptTensor& fp8_state, int64_t fp8_slot,
                         int64_t memory, const OptTensor& cu_tgt, int64_t max_tgt, const OptTensor& cu_src,
                         int64_t max_src) {
  const char* op = "decoder_layer";
  const Dropouts p{dropout, activation_dropout, attention_dropout, cross_attention_dropout};
  check_layer(op, x, weights, 18, eps, 3, num_heads, activation, p);
  const LayerArgs a = layer_args(num_heads, p, normalize_before, short_len, Fp8Args{fp8, fp8_state, fp8_slot}, memory);
  const int64_t B = x.size(0), C = x.size(2);
  for (const Tensor* t : {&cross_k, &cross_v})
    LS_CHECK(t->dim() == 4 && t->size(0) == B && t->size(1) == num_heads && t->size(3) == C / num_heads &&
                 t->size(2) == cross_k.size(2),
             op, ": encoder keys/values must be [", B, ", ", num_heads, ", source length, ", C / num_heads, "], got ",
             t->sizes());
  check_padding_mask(op, "encoder_padding_mask", encoder_padding_mask, B, cross_k.size(2), x);
  check_padding_mask(op, "self_attn_padding_mask", self_attn_padding_mask, B, x.size(1), x);
  std::optional<Packed> self_vl, cross_vl;
  LS_CHECK(present(cu_tgt) == present(cu_src), op, ": packed sentences need both cu_tgt and cu_src");
  if (present(cu_tgt)) {
    check_varlen(op, "cu_tgt", *cu_tgt, max_tgt, x, self_attn_padding_mask);
    check_varlen(op, "cu_src", *cu_src, max_src, x, encoder_padding_mask);
    LS_CHECK(cu_tgt->numel() == cu_src->numel(), op, ": cu_tgt and cu_src must count the same sentences, got ",
             cu_tgt->numel(), " and ", cu_src->numel(), " entries");
    self_vl = Packed{*cu_tgt, *cu_tgt, max_tgt, max_tgt};
    cross_vl = Packed{*cu_tgt, *cu_src, max_tgt, max_src};
  }
  ReleaseGilIfHeld nogil;  // nothing below needs Python
  OptTensor self_attend =
      present(self_attn_padding_mask) ? OptTensor(attend_mask(*self_attn_padding_mask)) : std::nullopt;
  OptTensor enc_attend = present(encoder_padding_mask) ? OptTensor(attend_mask(*encoder_padding_mask)) : std::nullopt;
  Tensor h = self_attention_block(x, self_attend, true, weights, eps[0], a, self_vl ? &*self_vl : nullptr);
  h = cross_attention_block(h, cross_k, cross_v, enc_attend, weights, eps[2], a, cross_vl ? &*cross_vl : nullptr);
  return ffn_block(h, weights, eps[1], activation, a);
}

}  // namespace ls_torch
