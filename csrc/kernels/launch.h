// Launch checking and the C++ declarations of every launcher (no CUDA/ATen types beyond
// cudaStream_t, so the torch adapters can include this with a plain C++ compiler).
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <cuda_runtime.h>

namespace ls {

// Throws std::runtime_error with the kernel's name on a launch error (the adapters turn it into
// a Python RuntimeError). With -DLS_FAIRSEQ_DEBUG_SYNC the stream is synchronised as well so
// that asynchronous faults are attributed to the right kernel.
inline void check_launch(const char* what, cudaStream_t stream) {
  cudaError_t e = cudaGetLastError();
#ifdef LS_FAIRSEQ_DEBUG_SYNC
  if (e == cudaSuccess) e = cudaStreamSynchronize(stream);
#else
  (void)stream;
#endif
  if (e != cudaSuccess)
    throw std::runtime_error(std::string("ls_fairseq kernel ") + what + " failed: " + cudaGetErrorString(e));
}

enum class DType : int { F32 = 0, F16 = 1, BF16 = 2 };

// Philox seed/offset as torch's CUDA generator hands them out (see PhiloxCudaState): plain
// values, or device pointers while a CUDA graph is being captured.
struct PhiloxArgs {
  uint64_t seed = 0;
  uint64_t offset = 0;
  const int64_t* seed_ptr = nullptr;
  const int64_t* offset_ptr = nullptr;
  uint64_t offset_intragraph = 0;
  bool captured = false;
};

// Philox counter increment one dropout launch over n elements reserves (one 128-bit block per
// group of 8 elements, groups are distinguished by the counter, calls by the offset).
constexpr uint64_t kPhiloxIncrement = 4;

// Bytes of the dropout bitmask of n elements.
inline int64_t mask_bytes(int64_t n) { return (n + 7) / 8; }

// ================================================================ layer_norm.cu
// y = LN(x [+ residual]); sum_out (optional) = x + residual; mean/rstd [rows] fp32.
void layer_norm_fwd(DType dt, const void* x, const void* residual, const void* gamma, const void* beta,
                    void* y, void* sum_out, float* mean, float* rstd, int64_t rows, int C, float eps,
                    cudaStream_t stream);
// The layer norm of x [rows, C] (no residual) written only as e4m3 codes under the delayed scale of the FP8 state
// row `row` (its amax records the output's maximum): exactly fp8_quantize's codes of layer_norm_fwd's output, out
// [rows, C] and out_t [C, Mp] (nullable; rows .. Mp - 1 zero; Mp a multiple of 16 >= rows); mean/rstd as
// layer_norm_fwd's.
// C 256, 512 or 1024 (layer_norm_codes_supported), 16-byte aligned buffers, bf16 or fp16.
bool layer_norm_codes_supported(int C);
void layer_norm_codes(DType dt, const void* x, const void* gamma, const void* beta, float* mean, float* rstd,
                      int64_t rows, int C, float eps, float* row, void* out, void* out_t, int64_t Mp,
                      cudaStream_t stream);
// Floats of workspace layer_norm_bwd needs.
int64_t layer_norm_bwd_workspace(int64_t rows, int C);
// dx = LN'(xin)^T dy [+ dsum]; dgamma, dbeta = column sums. beta == nullptr: xin is the LN input and mean is
// read; beta given (invertible): xin is the LN output y, xhat = (y - beta) / gamma, mean is not read.
void layer_norm_bwd(DType dt, const void* dy, const void* dsum, const void* xin, const void* gamma,
                    const void* beta, const float* mean, const float* rstd, void* dx, void* dgamma, void* dbeta,
                    float* workspace, int64_t rows, int C, cudaStream_t stream);

// ================================================================ dropout.cu
// Column-sum workspace (floats) for the backward kernels that also reduce a bias gradient.
int64_t colsum_workspace(int64_t rows, int C);

enum class Act : int { None = 0, Relu = 1, Gelu = 2 };

// out = residual + dropout(x + bias); mask (nullable when p == 0) gets mask_bytes(n) bytes.
void bias_dropout_residual_fwd(DType dt, const void* x, const void* bias, const void* residual, void* out,
                               uint8_t* mask, int64_t n, int C, float p, PhiloxArgs rng, cudaStream_t stream);
// out = dropout(act(x + bias)).
void bias_act_dropout_fwd(DType dt, const void* x, const void* bias, void* out, uint8_t* mask, int64_t n, int C,
                          float p, Act act, PhiloxArgs rng, cudaStream_t stream);
// out = dropout(act(x + bias)) with the keep bits of a mask bias_act_dropout_fwd wrote (nullptr: p was 0): the
// forward's values again, bit for bit.
void bias_act_dropout_replay(DType dt, const void* x, const void* bias, const uint8_t* keep, void* out, int64_t n,
                             int C, float p, Act act, cudaStream_t stream);
// dx = dy * act'(x + bias) * keep / (1 - p); dbias (nullable) = column sums of dx.
// Act::None: no activation (bias_dropout_residual's backward; x, bias unused).
// Act::Relu: act' read from `out` (> 0), mask unused; or, with out == nullptr, from x + bias (> 0) and the mask;
// or, with neither out nor x, the mask holds the bits of out > 0 (act' * keep), also when p == 0.
// Act::Gelu: needs x, bias and mask.
void bias_act_dropout_bwd(DType dt, const void* dy, const void* x, const void* bias, const void* out,
                          const uint8_t* mask, void* dx, void* dbias, float* workspace, int64_t rows, int C, float p,
                          Act act, cudaStream_t stream);

// ================================================================ embedding.cu
// out[r] = dropout(W[tokens[r]] * scale + P[positions[r]]), zeroed where tokens[r] == padding_idx if zero_pad.
void embedding_fwd(DType dt, const int64_t* tokens, const void* weight, const void* pos_weight,
                   const int64_t* positions, void* out, uint8_t* mask, int64_t rows, int C, float scale, float p,
                   int64_t padding_idx, bool zero_pad, PhiloxArgs rng, cudaStream_t stream);
// grad[key] = sum over rows r with keys[r] == key (key != padding_idx) of dy[r] * keep[r] * factor,
// rows with tokens[r] == padding_idx skipped if zero_pad (accumulate: added to grad[key], each row rounded
// once). sorted_keys/perm: keys sorted (stably), and the row each sorted entry came from. Only the rows of
// keys present are written: grad must be zeroed by the caller (or hold what is added to). workspace: fp32 scratch of
// embedding_bwd_workspace_floats(rows, C) elements (16-byte aligned). Deterministic.
int64_t embedding_bwd_workspace_floats(int64_t rows, int C);
void embedding_bwd(DType dt, const void* dy, const uint8_t* mask, const int64_t* sorted_keys, const int64_t* perm,
                   const int64_t* tokens, void* grad, float* workspace, int64_t rows, int C, float factor,
                   int64_t padding_idx, bool zero_pad, bool accumulate, cudaStream_t stream);

// ================================================================ heads.cu
// x [B, T, n*H*D] (+ bias [n*H*D]) -> out [n, B, H, T, D] (stored [n, B, T, H, D] if token_major).
void split_heads_fwd(DType dt, const void* x, const void* bias, void* out, int B, int T, int n, int H, int D,
                     bool token_major, cudaStream_t stream);
// The most parts one merge takes (split_heads_bwd, fp8_merge_heads_grad): q, k, v, or the keys and values of a
// layer-batched cross-attention of up to 32 decoder layers.
constexpr int kMaxSplitParts = 64;
// douts[i], i < n <= kMaxSplitParts: [B, H, T, D] (stored [B, T, H, D] if token_major; nullptr = zero)
// -> dx [B, T, n*H*D]; dbias (nullable) = sum over B, T.
void split_heads_bwd(DType dt, const void* const* douts, void* dx, void* dbias, float* workspace, int B, int T, int n,
                     int H, int D, bool token_major, cudaStream_t stream);

// ================================================================ cross_entropy.cu
// Per row: losses[0, r] = smoothed loss, losses[1, r] = nll (0 for ignored rows); lse[r] = logsumexp.
void ls_cross_entropy_fwd(DType dt, const void* logits, const int64_t* target, float* losses, float* lse,
                          int64_t N, int V, float epsilon, int64_t ignore_index, cudaStream_t stream);
// dlogits = d(g_loss * loss + g_nll * nll)/dlogits; g_loss, g_nll are device fp32 scalars.
void ls_cross_entropy_bwd(DType dt, const void* logits, const int64_t* target, const float* lse,
                          const float* g_loss, const float* g_nll, void* dlogits, int64_t N, int V, float epsilon,
                          int64_t ignore_index, cudaStream_t stream);
// Both in one pass (the training step's head): losses as the forward's, and logits (written in place) =
// d(g_loss * sum of losses[0])/dlogits, the backward's gradient with g_nll = 0; g_loss is a device fp32 scalar
// (null: 1).
void ls_cross_entropy_fwd_bwd(DType dt, void* logits, const int64_t* target, float* losses, const float* g_loss,
                              int64_t N, int V, float epsilon, int64_t ignore_index, cudaStream_t stream);

// ================================================================ adam.cu
struct AdamArgs {
  float lr, beta1, beta2, eps, weight_decay, grad_scale;
  int64_t step;
  bool torch_mode;  // false: fairseq's Adam, true: torch.optim.AdamW
};
// In-place update of `count` ranges [bounds[2k], bounds[2k+1]) of the same flat buffers (all pointers are
// bases: the ranges offset every buffer alike; {0, n} is the whole buffer), one launch per 64 ranges. The
// ranges must not overlap. param_lp (nullable) of lp_dt receives the new param, and so does param_lp_peer
// (nullable, of lp_dt: a peer GPU's copy of the same buffer, written with system-scope fenced stores). If norm
// (nullable, device fp32 scalar) is not finite, nothing is written (the step is skipped on the device).
// scale_dev (nullable, device fp32 scalar) multiplies args.grad_scale on the device; a non-finite value also
// skips the step. sq_out (nullable, device fp32 scalar; count >= 1): receives the L2 norm of the gradients read
// (before any scale) over the ranges, summed in the same pass into sq_ws (adam_norm_workspace(count) floats);
// give no `norm` with it (the caller tests the norm afterwards).
void adam_step_ranges(DType grad_dt, DType lp_dt, float* param, const void* grad, float* exp_avg, float* exp_avg_sq,
                      void* param_lp, void* param_lp_peer, const int64_t* bounds, int count, AdamArgs args,
                      const float* norm, const float* scale_dev, float* sq_ws, float* sq_out, cudaStream_t stream);
// The same update for bf16 weights whose fp32 master is split (adam.cu's header): `weights` (bf16) are the
// master's upper halves and the weights the model reads, `lo` (int16) the remainders; weights_peer (nullable) as
// param_lp_peer above. Every other argument as adam_step_ranges's.
void adam_step_split_ranges(DType grad_dt, void* weights, int16_t* lo, const void* grad, float* exp_avg,
                            float* exp_avg_sq, void* weights_peer, const int64_t* bounds, int count, AdamArgs args,
                            const float* norm, const float* scale_dev, float* sq_ws, float* sq_out,
                            cudaStream_t stream);
int64_t adam_norm_workspace(int count);
int64_t grad_norm_workspace();
// out = the L2 norm (fp32 scalar) of the union of `count` ranges [bounds[2k], bounds[2k+1]) of grad ({0, n}: all
// of it); inf/NaN propagate. Deterministic (fixed-shape passes).
void grad_norm_ranges(DType dt, const void* grad, const int64_t* bounds, int count, float* workspace, float* out,
                      cudaStream_t stream);

// ================================================================ attention.cu
// Attention over short sequences, padded or packed, one CTA per (sequence, head) (attention.cu describes the
// numerics).
constexpr int kShortAttentionMax = 128;  // the longest query and key length the kernels take
struct ShortAttentionArgs {
  DType dt = DType::F16;  // F16 or BF16
  int B = 0, H = 0, Tq = 0, Tk = 0, D = 0;  // D: 32, 64 or 128; 1 <= Tq, Tk <= kShortAttentionMax; sm_80+
  // [B, H, T, D] tensors as (batch, head, row) element strides, the head dim contiguous, rows 16-byte aligned
  const void *q = nullptr, *k = nullptr, *v = nullptr;
  int64_t q_s[3] = {0, 0, 0}, k_s[3] = {0, 0, 0}, v_s[3] = {0, 0, 0};
  void* out = nullptr;  // written by the forward, read by the backward
  int64_t o_s[3] = {0, 0, 0};
  const void* dout = nullptr;  // backward
  int64_t do_s[3] = {0, 0, 0};
  void *dq = nullptr, *dk = nullptr, *dv = nullptr;  // backward
  int64_t dq_s[3] = {0, 0, 0}, dk_s[3] = {0, 0, 0}, dv_s[3] = {0, 0, 0};
  const uint8_t* attend = nullptr;  // [B, Tk], nonzero = attend; nullable
  bool causal = false;              // query i sees keys j <= i + Tk - Tq
  float p = 0.f;                    // attention dropout
  float scale = 1.f;                // of the scores (1 / sqrt(D))
  float* lse = nullptr;             // [B, H, Tq] fp32: written by the forward (nullable there), read by the backward
  uint8_t* mask = nullptr;          // keep bits [B, H, Tq, ceil(Tk / 8)] bytes when p > 0
  // Packed sequences (nullable; then attend is null and the batch strides 0): sequence b holds rows
  // [cu_q[b], cu_q[b + 1]) of q, out, dout, dq and [cu_k[b], cu_k[b + 1]) of k, v, dk, dv, B + 1 int32 offsets each;
  // Tq, Tk are the longest lengths (longer sequences are cut to them); lse and the keep bits keep their padded rows.
  const int* cu_q = nullptr;
  const int* cu_k = nullptr;
  // set by the launcher (attention.cu) for packed sequences: this launch takes the sequences whose longer length
  // is in (lo, hi], its CTAs sized for at most hi; 0, 0: every sequence, sized for (Tq, Tk)
  int lo = 0, hi = 0;
};
// Whether the kernels take these sizes on this device: D 32, 64 or 128, lengths 1 .. kShortAttentionMax, sm_80 or
// newer (cp.async, bf16 tensor cores), and the shared memory of the backward's CTA within what a block may use.
bool short_attention_supported(int device, int64_t Tq, int64_t Tk, int64_t D);
void short_attention_fwd(const ShortAttentionArgs& a, PhiloxArgs rng, cudaStream_t stream);
void short_attention_bwd(const ShortAttentionArgs& a, cudaStream_t stream);
// ================================================================ fp8.cu
enum class Fp8Format : int { E4M3 = 0, E5M2 = 1 };
// Per-tensor FP8 scaling state (fp32, one row of kFp8Width per quantised tensor; see fp8.cu): 1 / s (what the
// GEMM reads: first, so that it is 16-byte aligned as cuBLASLt wants its scales), the scale s in use, the absolute
// maximum seen since the last roll (as its bit pattern), and the history of the last kFp8History absolute maxima
// (newest first).
constexpr int kFp8Width = 20;
constexpr int kFp8ScaleInv = 0, kFp8Scale = 1, kFp8Amax = 2, kFp8Hist = 4;
constexpr int kFp8History = kFp8Width - kFp8Hist;
// Rows 3j, 3j + 1, 3j + 2 of a state belong to linear j's input, weight and output gradient: the roll derives
// each row's next scale from its history, in e4m3 for inputs and weights and in grad_fmt for gradients.
void fp8_roll(float* state, int64_t rows, Fp8Format grad_fmt, cudaStream_t stream);
// Codes of x [M, K] (dtype dt, contiguous, 16-byte aligned, K a multiple of 16) under the scale of `row`:
// out [M, K] row-major and/or out_t [K, Mp] (x transposed, rows M..Mp-1 zero; Mp a multiple of 16 >= M), each
// optional (nullptr). current: the scale comes from x's own absolute maximum (an extra pass), else from the row.
void fp8_quantize(DType dt, const void* x, int64_t M, int64_t K, float* row, Fp8Format fmt, bool current, void* out,
                  void* out_t, int64_t Mp, cudaStream_t stream);
// One cast of fp8_quantize (delayed scaling: the row's scale, x's maximum recorded there) in fp8_quantize_many
struct Fp8CastJob {
  const void* x;  // [M, K], K a multiple of 16, 16-byte aligned
  void* out;      // [M, K] codes or nullptr
  void* out_t;    // [K, Mp] codes or nullptr
  float* row;     // the state row
  int64_t M, K, Mp;
};
// The casts of n tensors of one dtype in one launch per 32 (the forward's weights): each job's codes and recorded
// maximum exactly as fp8_quantize (current = false) makes them.
void fp8_quantize_many(DType dt, const Fp8CastJob* jobs, int n, Fp8Format fmt, cudaStream_t stream);
// The head's loss and gradient (ls_cross_entropy_fwd_bwd, cross_entropy.cu) with the gradient written only as the
// FP8 codes that fp8_quantize (delayed scaling, fmt) would make of it under the state row fp8_row (the gradient's
// maximum recorded there): codes [N, V] and/or codes_t [V, Mp] as fp8_quantize's out / out_t; the logits are not
// written. lse: [N] floats of scratch. V a multiple of 16, 16-byte aligned buffers.
void ls_cross_entropy_fwd_bwd_fp8(DType dt, const void* logits, const int64_t* target, float* losses,
                                  const float* g_loss, int64_t N, int V, float epsilon, int64_t ignore_index,
                                  float* lse, float* fp8_row, Fp8Format fmt, void* codes, void* codes_t, int64_t Mp,
                                  cudaStream_t stream);
// Its second pass (fp8.cu): the codes of the gradient of rows with log-sum-exp lse [N] (ignored rows zero)
void fp8_ce_grad(DType dt, const void* logits, const int64_t* target, const float* lse, const float* g_loss, int64_t N,
                 int V, float epsilon, int64_t ignore_index, float* fp8_row, Fp8Format fmt, void* codes,
                 void* codes_t, int64_t Mp, cudaStream_t stream);
// The e4m3 codes of a = dropout(act(x + bias)) [M, K] as fp8_quantize (delayed scaling: the row's scale, a's maximum
// recorded) would make them from bias_act_dropout_fwd's output, without writing a: out and/or out_t as there.
// Dropout applies when p > 0: draw draws the keep bits from rng (the forward; written to keep unless nullptr), else
// they are read from keep (the backward's replay). positive (draw only, nullable): the bits of a > 0, in the layout
// of the dropout mask (all relu's backward needs). x, bias 16-byte aligned, K a multiple of 16.
void fp8_bias_act_dropout(DType dt, const void* x, const void* bias, uint8_t* keep, uint8_t* positive, bool draw,
                          int64_t M, int64_t K, float p, Act act, PhiloxArgs rng, float* row, void* out, void* out_t,
                          int64_t Mp, cudaStream_t stream);
// The codes of dh = dy * act'(x + bias) * keep / (1 - p) [M, K], the input gradient bias_act_dropout_bwd would
// return (rounded to dt), under the delayed scale of `row` in format fmt (its maximum recorded), without writing dh:
// out and/or out_t as fp8_quantize's; dbias (nullable): the bias gradient, the fp32 column sum of the unrounded
// values, deterministic, through partial (fp8_grad_partial_floats(M, K, Mp) floats). x nullptr with relu: keep
// holds the bits of a > 0; otherwise keep holds the keep bits (nullptr: no dropout). 16-byte aligned pointers.
int64_t fp8_grad_partial_floats(int64_t M, int64_t K, int64_t Mp);
void fp8_act_dropout_grad(DType dt, const void* dy, const void* x, const void* bias, const uint8_t* keep, int64_t M,
                          int64_t K, float p, Act act, float* row, Fp8Format fmt, void* out, void* out_t, int64_t Mp,
                          void* dbias, float* partial, cudaStream_t stream);
// The codes of the attention input projection's output gradient [B * T, n * H * D], merged from the
// n <= kMaxSplitParts head gradients d[i] [B, H, T, D] (stored [B, T, H, D] when token_major; nullptr: zeros) as
// split_heads_bwd merges them, under the delayed scale of `row` (its maximum recorded), without writing the merged
// tensor; out, out_t, dbias and partial as in fp8_act_dropout_grad (M = B * T, K = n * H * D). D a multiple of 16,
// 16-byte aligned pointers.
void fp8_merge_heads_grad(DType dt, const void* const* d, int B, int T_, int n, int H, int D, bool token_major,
                          float* row, Fp8Format fmt, void* out, void* out_t, int64_t Mp, void* dbias, float* partial,
                          cudaStream_t stream);

}  // namespace ls

#define LS_CHECK_LAUNCH(name, stream) ::ls::check_launch(name, stream)
