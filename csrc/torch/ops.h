// Declarations of every adapter entry point (one definition file per op family; bound in bindings.cpp).
#pragma once

#include <string>
#include <vector>

#include "torch/checks.h"

namespace ls_torch {

std::vector<Tensor> layer_norm_fwd(const Tensor& x, const OptTensor& residual, const Tensor& gamma,
                                   const Tensor& beta, double eps);
std::vector<Tensor> layer_norm_bwd(const Tensor& dy, const OptTensor& dsum, const Tensor& xin, const Tensor& gamma,
                                   const Tensor& mean, const Tensor& rstd);
std::vector<Tensor> layer_norm_bwd_invertible(const Tensor& dy, const OptTensor& dsum, const Tensor& y,
                                              const Tensor& gamma, const Tensor& beta, const Tensor& rstd);

std::vector<Tensor> bias_dropout_residual_fwd(const Tensor& x, const OptTensor& bias, const Tensor& residual,
                                              double p);
std::vector<Tensor> bias_act_dropout_fwd(const Tensor& x, const OptTensor& bias, const std::string& activation,
                                         double p);
Tensor bias_act_dropout_replay(const Tensor& x, const OptTensor& bias, const OptTensor& mask,
                               const std::string& activation, double p);
std::vector<Tensor> bias_act_dropout_bwd(const Tensor& dy, const OptTensor& x, const OptTensor& bias,
                                         const OptTensor& out, const OptTensor& mask, double p,
                                         const std::string& activation, bool need_dbias);

std::vector<Tensor> embedding_fwd(const Tensor& tokens, const Tensor& weight, const OptTensor& pos_weight,
                                  const OptTensor& positions, double scale, double p, int64_t padding_idx,
                                  bool zero_pad);
Tensor embedding_bwd(const Tensor& dy, const OptTensor& mask, const Tensor& keys, const Tensor& tokens,
                     int64_t num_embeddings, double factor, int64_t padding_idx, bool zero_pad, int64_t weight_key);

Tensor qkv_split_fwd(const Tensor& x, const OptTensor& bias, int64_t n, int64_t num_heads, bool token_major);
// Whether a [B, H, T, D] head gradient is stored token-major ([B, T, H, D] memory, as SDPA's backward writes it for
// token-major inputs): split_heads_bwd and the FP8 merge of head gradients read such gradients in place.
inline bool token_major_heads(const Tensor& t) { return t.transpose(1, 2).is_contiguous() && !t.is_contiguous(); }
// The head gradients a merge's kernel reads in place (split_heads_bwd, and the FP8 merge of fp8.cpp): each given part
// as stored when all given parts are token-major, else contiguous [B, H, T, D]; cloned where its data is not 16-byte
// aligned (aligned16); ptrs[i] its data (nullptr: part i not given). keep holds the tensors the pointers point into.
struct HeadGrads {
  std::vector<Tensor> keep;
  std::vector<const void*> ptrs;
  bool token_major;
};
HeadGrads gather_head_grads(const std::vector<OptTensor>& ds, bool aligned16);
std::vector<Tensor> split_heads_bwd(const std::vector<OptTensor>& ds, bool need_dbias);
// The n head parts [B, H, T, D] of a projection's output y2 [B * T, n * H * D] as views, nothing copied: part i is
// columns [i * H * D, (i + 1) * H * D) of every row (ag_linear_split, ag_fp8_linear_split).
inline std::vector<Tensor> head_views(const Tensor& y2, int64_t B, int64_t T, int64_t n, int64_t num_heads) {
  Tensor y5 = y2.view({B, T, n, num_heads, y2.size(-1) / (n * num_heads)});
  std::vector<Tensor> parts;
  for (int64_t i = 0; i < n; ++i) parts.push_back(y5.select(2, i).permute({0, 2, 1, 3}));
  return parts;
}
// The gradients a node got for its n head parts (a part without one: empty), or nothing when no part got one.
inline std::vector<OptTensor> part_grads(const std::vector<Tensor>& grads, int64_t n) {
  bool any = false;
  std::vector<OptTensor> d(n);
  for (int64_t i = 0; i < n && i < (int64_t)grads.size(); ++i) {
    if (grads[i].defined()) d[i] = grads[i];
    any = any || d[i].has_value();
  }
  if (!any) d.clear();
  return d;
}
Tensor merge_heads_fwd(const Tensor& x);
Tensor merge_heads_bwd(const Tensor& dy, int64_t num_heads);

std::vector<Tensor> ls_cross_entropy_fwd(const Tensor& logits, const Tensor& target, double epsilon,
                                         int64_t ignore_index);
Tensor ls_cross_entropy_bwd(const Tensor& logits, const Tensor& target, const Tensor& lse, const Tensor& g_loss,
                            const Tensor& g_nll, double epsilon, int64_t ignore_index, bool inplace);
// (loss sum, nll sum); the gradient of grad_scale * loss sum overwrites logits (cross_entropy.cpp)
std::vector<Tensor> ls_cross_entropy_fwd_bwd(const Tensor& logits, const Tensor& target, double epsilon,
                                             int64_t ignore_index, const OptTensor& grad_scale);
// what every cross-entropy entry checks of its arguments (cross_entropy.cpp)
void check_ce(const char* op, const Tensor& logits, const Tensor& target);
void check_grad_scale(const char* op, const OptTensor& grad_scale, const Tensor& logits);

void adam_step(const Tensor& param, const Tensor& grad, const Tensor& exp_avg, const Tensor& exp_avg_sq,
               const OptTensor& param_lp, double lr, double beta1, double beta2, double eps, double weight_decay,
               int64_t step, double grad_scale, bool torch_mode, const OptTensor& skip_if_nonfinite,
               const OptTensor& grad_scale_tensor, const OptTensor& param_lp_peer,
               const std::vector<int64_t>& ranges, const OptTensor& norm_out, const OptTensor& param_lo);
// ranges: flattened [lo, hi) pairs (ascending, disjoint) that the step / the norm covers; empty: everything.
Tensor grad_norm(const Tensor& grad, const std::vector<int64_t>& ranges);

// Autograd nodes in C++ (autograd.cpp): the differentiable forms of the ops above that a training step
// calls most, plus a linear layer; each records one node in the graph.
std::vector<Tensor> ag_layer_norm(const Tensor& x, const OptTensor& residual, const Tensor& weight,
                                  const Tensor& bias, double eps, bool invertible);
std::vector<Tensor> ag_pre_layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps,
                                      bool invertible);
std::vector<Tensor> ag_bias_dropout_residual(const Tensor& x, const OptTensor& bias, const Tensor& residual,
                                             double p);
std::vector<Tensor> ag_bias_act_dropout(const Tensor& x, const OptTensor& bias, const std::string& activation,
                                        double p);
std::vector<Tensor> ag_split_heads(const Tensor& x, const OptTensor& bias, int64_t n, int64_t num_heads);
Tensor ag_linear(const Tensor& x, const Tensor& weight, const OptTensor& bias);
// x [B, T, K] W^T + b as n parts of heads [B, H, T, D], views of one GEMM's output (the bias in its epilogue)
std::vector<Tensor> ag_linear_split(const Tensor& x, const Tensor& weight, const OptTensor& bias, int64_t n,
                                    int64_t num_heads);

// gemm.cpp: the layers' products, through cuBLASLt (one algorithm per exact shape, its kernel loadable ahead by
// gemm_preload) when on, else through the ATen call named. token: which size counts tokens (0: the rows of a; 1:
// the summed size).
Tensor gemm_mm(const Tensor& a, const Tensor& b, const OptTensor& bias, int64_t token);  // at::mm / at::addmm
void gemm_mm_into(const Tensor& out, const Tensor& a, const Tensor& b, bool add, int64_t token);  // addmm_ / mm_out
std::vector<int64_t> gemm_preload(const std::vector<int64_t>& token_counts, int64_t skip_size);
bool gemm_lt_available();
void gemm_lt_enable();
void gemm_lt_disable();
bool gemm_lt_on();
std::vector<int64_t> gemm_lt_report();

// weight_grads.cpp: weight gradients written into the places the CUDA-graph step names while it captures a
// backward. set_weight_grad_sinks: parameter i's weight gradient goes into dests[i] (same shape and dtype,
// contiguous), overwritten (accumulate false: an update's only micro-batch) or added to; take_weight_grad_sinks:
// the data pointers of the parameters written so, and no sinks from then on. weight_grad_mm: a b as the gradient
// of weight w, or written into w's sink (then undefined is returned: autograd gets no gradient for w).
void set_weight_grad_sinks(const std::vector<Tensor>& params, const std::vector<Tensor>& dests, bool accumulate);
std::vector<int64_t> take_weight_grad_sinks();
Tensor weight_grad_mm(const Tensor& w, const Tensor& a, const Tensor& b);
// weight_grad_overwrite_sink: for a GEMM that can only overwrite (FP8's), the sink of the weight whose data pointer is
// key, if there is one in write mode not yet written, for a [rows, cols] product of dtype (16-byte aligned); the
// caller then writes it there and hands autograd no gradient. Undefined otherwise.
Tensor weight_grad_overwrite_sink(const void* key, int64_t rows, int64_t cols, at::ScalarType dtype);
// weight_grad_sink: the sink of the weight whose data pointer is key for a [rows, cols] gradient of dtype, counted as
// written, or undefined (no capture, no sink, another shape or dtype); *add: add to it (else overwrite it whole).
// add_weight_grad_sinks (after set_weight_grad_sinks): sinks that every writer adds to (the head's weights, whose
// slices hold the head's part of the gradient before the backward runs).
Tensor weight_grad_sink(const void* key, int64_t rows, int64_t cols, at::ScalarType dtype, bool* add);
void add_weight_grad_sinks(const std::vector<Tensor>& params, const std::vector<Tensor>& dests);

// attention.cpp: attention over short sequences (csrc/kernels/attention.cu). q [B, H, Tq, D], k, v [B, H, Tk, D]
// (any strides with the head dim contiguous), attend [B, Tk] bool / uint8 (nonzero = attend) or absent; causal:
// query i sees keys j <= i + Tk - Tq. Packed (pk): q [1, H, Nq, D], k, v [1, H, Nk, D] hold the sequences back to
// back, sequence b in rows [cu_q[b], cu_q[b + 1]) and [cu_k[b], cu_k[b + 1]) (int32 on the GPU, covering the rows),
// max_q / max_k its longest lengths, no attend; causal within each sequence as above. short_attention_fits: whether
// the kernel takes these tensors (CUDA fp16 / bf16, D 32 / 64 / 128, 1 <= Tq, Tk <= 128, 16-byte aligned rows,
// sm_80+ with the shared memory it needs); the callers run SDPA / flash otherwise.
struct Packed {
  Tensor cu_q, cu_k;
  int64_t max_q = 0, max_k = 0;
};
// the Python bindings' packed arguments (cu_q and cu_k both given or both absent)
Packed packed_args(const OptTensor& cu_q, const OptTensor& cu_k, int64_t max_q, int64_t max_k);
bool short_attention_fits(const Tensor& q, const Tensor& k, const Tensor& v, const OptTensor& attend,
                          const Packed* pk = nullptr);
std::vector<Tensor> short_attention_fwd(const Tensor& q, const Tensor& k, const Tensor& v, const OptTensor& attend,
                                        bool causal, double p, const Packed* pk = nullptr);
std::vector<Tensor> short_attention_bwd(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                                        const Tensor& out, const Tensor& lse, const Tensor& mask,
                                        const OptTensor& attend, bool causal, double p, const Packed* pk = nullptr);
Tensor ag_short_attention(const Tensor& q, const Tensor& k, const Tensor& v, const OptTensor& attend, bool causal,
                          double p, const Packed* pk = nullptr);

// Whole layers over those nodes (layers.cpp): the forward of ls_fairseq/modules' encoder and decoder layers in
// one call, recording the same nodes as the Python layers; weights and eps in the order layers.cpp lists.
Tensor encoder_layer_fwd(const Tensor& x, const OptTensor& key_padding_mask, const std::vector<Tensor>& weights,
                         const std::vector<double>& eps, int64_t num_heads, double dropout, double activation_dropout,
                         double attention_dropout, const std::string& activation, bool normalize_before,
                         int64_t short_len, int64_t fp8, const OptTensor& fp8_state, int64_t fp8_slot,
                         int64_t memory, const OptTensor& cu_seqlens, int64_t max_len);
Tensor decoder_layer_fwd(const Tensor& x, const Tensor& cross_k, const Tensor& cross_v,
                         const OptTensor& encoder_padding_mask, const OptTensor& self_attn_padding_mask,
                         const std::vector<Tensor>& weights, const std::vector<double>& eps, int64_t num_heads,
                         double dropout, double activation_dropout, double attention_dropout,
                         double cross_attention_dropout, const std::string& activation, bool normalize_before,
                         int64_t short_len, int64_t fp8, const OptTensor& fp8_state, int64_t fp8_slot,
                         int64_t memory, const OptTensor& cu_tgt, int64_t max_tgt, const OptTensor& cu_src,
                         int64_t max_src);

// fp8.cpp (adapters) and fp8_nodes.cpp (autograd nodes): FP8 linear layers with delayed per-tensor scaling (the
// state and mode are described in fp8.cpp).
struct Fp8Args {
  // 0 off; 1 + gradient format (+ 2: current scaling). A layer's mode also has bit kFp8SkipShift + k set for
  // each of its projections k that stays in the model's precision.
  int64_t mode = 0;
  OptTensor state;   // float32 [3 * linears, kFp8Width]
  int64_t slot = 0;  // this linear's index in the state
  static constexpr int64_t kFp8SkipShift = 4;
  Fp8Args at(int64_t k) const {
    const bool skip = (mode >> (kFp8SkipShift + k)) & 1;
    return {skip ? 0 : mode & ((int64_t{1} << kFp8SkipShift) - 1), state, slot + k};
  }
};
std::vector<Tensor> fp8_quantize(const Tensor& x, const Tensor& state, int64_t row, int64_t format, bool current,
                                 bool rowwise, bool transposed);
void fp8_roll(const Tensor& state, int64_t grad_format);
// The training forward's weights cast ahead in one launch (fp8.cu: fp8_quantize_many), each under its state row
// (delayed scaling); the FP8 projections then take their weight's codes instead of casting it. fp8_forget_weights
// drops what was not taken and returns how many.
void fp8_cast_weights(const std::vector<Tensor>& weights, const Tensor& state, const std::vector<int64_t>& rows);
int64_t fp8_forget_weights();
// An FP8 projection's GEMMs outside autograd (the CUDA-graph step's vocabulary head, ls_fairseq/ops/fp8.py), as the
// FP8 linear node runs them. Forward of x2 [M, K] -> [y, x's transposed codes (undefined unless keep_x), W's
// transposed codes, 1/s of x, 1/s of W]; backward from the output gradient's codes gq [M, N] and transposed codes
// gq_t (undefined: no dW) -> [dx, dW], dW written into dw_out when given.
std::vector<Tensor> fp8_linear_forward_codes(const Tensor& x2, const Tensor& weight, int64_t mode,
                                             const Tensor& state, int64_t slot, bool keep_x);
std::vector<Tensor> fp8_backward_gemms(const Tensor& gq, const OptTensor& gq_t, const Tensor& sg, const Tensor& xq_t,
                                       const Tensor& wq_t, const Tensor& sx, const Tensor& sw, at::ScalarType dtype,
                                       const OptTensor& dw_out);
// The head's loss with an FP8 vocabulary projection: ls_cross_entropy_fwd_bwd whose gradient leaves only as FP8
// codes under the delayed scale of one state row (cross_entropy.cpp) -> (loss sum, nll sum, codes, transposed codes)
std::vector<Tensor> ls_cross_entropy_fwd_bwd_fp8(const Tensor& logits, const Tensor& target, double epsilon,
                                                 int64_t ignore_index, const OptTensor& grad_scale,
                                                 const Tensor& state, int64_t row, int64_t format, bool transposed);
Tensor ag_fp8_linear(const Tensor& x, const Tensor& weight, const OptTensor& bias, int64_t mode,
                     const OptTensor& state, int64_t slot);
// fp8 off or a weight whose sizes are not multiples of 16: the plain linear node
Tensor ag_linear_mode(const Tensor& x, const Tensor& weight, const OptTensor& bias, const Fp8Args& fp8);
bool fp8_linear_shapes_ok(const Tensor& weight);
// The FP8 pieces of ag_bias_act_linear, over 2-d [tokens, F] inputs. Forward: y2 = [a] [W]^T with a =
// dropout(act(x2 + bias)) written straight as e4m3 codes (under current scaling a is made and then quantised)
// -> [y2, mask, a's transposed codes (keep_codes, else undefined), W's transposed codes, 1/s of a, 1/s of W];
// mask: the dropout's keep bits, or with positive_bits (relu, keep_codes) the bits of a > 0 (relu's backward).
// fp8_act_codes_t: a's transposed codes again from x2, bias and the forward's mask, under the forward's scale.
// fp8_linear_backward_codes: [dx2, dW (or undefined)] from the output gradient and those codes; wkey: the weight's
// data pointer, for its weight-gradient sink (weight_grads.cpp).
std::vector<Tensor> fp8_act_linear_forward(const Tensor& x2, const OptTensor& bias, const Tensor& weight,
                                           const std::string& activation, double p, int64_t mode,
                                           const OptTensor& state, int64_t slot, bool keep_codes,
                                           bool positive_bits);
Tensor fp8_act_codes_t(const Tensor& x2, const OptTensor& bias, const OptTensor& mask, const std::string& activation,
                       double p, int64_t mode, const OptTensor& state, int64_t slot);
std::vector<Tensor> fp8_linear_backward_codes(const Tensor& g2, const Tensor& xq_t, const Tensor& wq_t,
                                              const Tensor& sx, const Tensor& sw, int64_t mode,
                                              const OptTensor& state, int64_t slot, bool need_dw,
                                              const void* wkey = nullptr);

// dropout(act(x + bias)) W^T as one node that keeps the activation's input, not its output -> [y, mask]. fp8 as
// in ag_linear_mode. Without FP8 (and with FP8 unless keep_fp8_codes) it recomputes the output in the backward
// (--ls-recompute-activation); with FP8 the output exists only as codes, and keep_fp8_codes keeps their
// transposed copy for the weight gradient instead of recomputing it (the FP8 FFN of the layers).
std::vector<Tensor> ag_bias_act_linear(const Tensor& x, const OptTensor& bias, const Tensor& weight,
                                       const std::string& activation, double p, int64_t fp8,
                                       const OptTensor& fp8_state, int64_t fp8_slot, bool keep_fp8_codes);

// The FFN block's projections as one FP8 node: residual + dropout_{p_out}(dropout_p(act(x W1^T + b1)) W2^T + b2)
// -> [out, activation mask, output mask], both projections in FP8 (mode as in ag_fp8_linear; slots slot1 and slot2
// of the state); the activation leaves the forward only as codes (keep_codes: kept for the weight gradient, else
// made again in the backward, --ls-recompute-activation) and the gradients reaching the projections' outputs leave
// the dropout's and the activation's backward only as codes (fp8_nodes.cpp).
std::vector<Tensor> ag_fp8_ffn(const Tensor& x, const Tensor& w1, const OptTensor& b1, const Tensor& w2,
                               const OptTensor& b2, const Tensor& residual, const std::string& activation, double p,
                               double p_out, int64_t mode, const OptTensor& state, int64_t slot1, int64_t slot2,
                               bool keep_codes);

// An attention block's output projection and residual dropout as one FP8 node: residual + dropout_p(x W^T + b) ->
// [out, mask] (mode, state and slot as in ag_fp8_linear); the output gradient reaching the projection leaves the
// dropout's backward only as codes (fp8_nodes.cpp).
std::vector<Tensor> ag_fp8_linear_residual(const Tensor& x, const Tensor& weight, const OptTensor& bias,
                                           const Tensor& residual, double p, int64_t mode, const OptTensor& state,
                                           int64_t slot);

// The attention's input projection and head split as one FP8 node: x [B, T, C] W^T (+ bias) -> n parts [B, H, T, D]
// (as ag_split_heads makes them); the output gradient is quantised straight from the heads' gradients (fp8_nodes.cpp).
std::vector<Tensor> ag_fp8_linear_split(const Tensor& x, const Tensor& weight, const OptTensor& bias, int64_t n,
                                        int64_t num_heads, int64_t mode, const OptTensor& state, int64_t slot);

// A pre-LN block's entry with its first projection in FP8: layer_norm(x) (ln_w, ln_b, eps) is never written, only
// the projection's input codes (fp8.cpp: pre_ln_codes), and the layer norm's backward runs in the node's.
// ag_fp8_ln_linear_split -> ag_fp8_linear_split's parts, then x (the block's residual);
// ag_fp8_ln_ffn -> ag_fp8_ffn's outputs, with x as the residual.
std::vector<Tensor> ag_fp8_ln_linear_split(const Tensor& x, const Tensor& ln_w, const Tensor& ln_b, double eps,
                                           const Tensor& weight, const OptTensor& bias, int64_t n, int64_t num_heads,
                                           int64_t mode, const OptTensor& state, int64_t slot);
std::vector<Tensor> ag_fp8_ln_ffn(const Tensor& x, const Tensor& ln_w, const Tensor& ln_b, double eps,
                                  const Tensor& w1, const OptTensor& b1, const Tensor& w2, const OptTensor& b2,
                                  const std::string& activation, double p, double p_out, int64_t mode,
                                  const OptTensor& state, int64_t slot1, int64_t slot2, bool keep_codes);

// Memory modes of the layers (bits of the `memory` argument of encoder_layer_fwd / decoder_layer_fwd).
constexpr int64_t kInvertibleLayerNorm = 1;  // layer norms keep their output, not their input
constexpr int64_t kRecomputeActivation = 2;  // the FFN's activation output is recomputed in the backward (gelu)

}  // namespace ls_torch
