// Label-smoothed cross-entropy over the vocabulary, without materialising log-probabilities.
//
// Per row (one block per row), in fp32: an online max / sum-exp over the logits gives
// lse = m + log(sum exp(x - m)); with sx = sum_v x_v and x_t the target logit,
//   nll = lse - x_t,  smooth = sum_v -log p_v = V * lse - sx,
//   loss = (1 - eps - eps_i) * nll + eps_i * smooth,   eps_i = eps / (V - 1)   (fairseq's definition).
// Rows whose target is ignore_index give 0 (and a zero gradient); a target outside [0, V) gives NaN.
// lse is saved (4 bytes per row) for the backward, which re-reads the logits once:
//   dlogit_v = p_v * (g_loss * (1 - eps - eps_i + V * eps_i) + g_nll) - g_loss * eps_i
//              - [v == t] * (g_loss * (1 - eps - eps_i) + g_nll),        p_v = exp(x_v - lse),
// computed in fp32 and written in the logits' dtype. g_loss / g_nll are read from device memory.
// The fused forward + backward (the training step's head) does both in one block of 512 threads per row, the
// gradient written over the logits, so the row leaves HBM once and returns once (from L2); the FP8 head makes the
// statistics, then a tile pass (fp8.cu: fp8_ce_grad) writes the gradient's codes in both layouts. Why 512
// threads, and how its results relate to the separate passes': docs/kernels.md ("Cross-entropy").
#include "kernels/ce_grad.cuh"
#include "kernels/common.cuh"

namespace ls {

constexpr int kCeThreads = 256;
constexpr int kCeFusedThreads = 512;

struct MaxSum {
  float m, s;
};

__device__ __forceinline__ MaxSum ms_combine(MaxSum a, MaxSum b) {
  const float m = fmaxf(a.m, b.m);
  if (m == -INFINITY) return {m, 0.f};
  const float sa = a.m == -INFINITY ? 0.f : a.s * __expf(a.m - m);
  const float sb = b.m == -INFINITY ? 0.f : b.s * __expf(b.m - m);
  return {m, sa + sb};
}

// The n (<= 8) values of one group into the running (max, sum-exp) and sum.
__device__ __forceinline__ void ce_accumulate(MaxSum& acc, float& sx, const float (&v)[8], int n) {
  float m = -INFINITY;
#pragma unroll
  for (int k = 0; k < 8; ++k)
    if (k < n) { m = fmaxf(m, v[k]); sx += v[k]; }
  const float mm = fmaxf(m, acc.m);
  float s = acc.m == -INFINITY ? 0.f : acc.s * __expf(acc.m - mm);
#pragma unroll
  for (int k = 0; k < 8; ++k)
    if (k < n) s += __expf(v[k] - mm);
  acc = {mm, s};
}

// The forward's pass over row x [V]: (max, sum-exp) and the sum of the logits, reduced over the block of
// THREADS threads; the totals are valid in thread 0 only. VEC: V % 8 == 0 and x 16-byte aligned.
template <typename T, bool VEC, int THREADS>
__device__ __forceinline__ void ce_row_stats(const T* x, int V, MaxSum& tot, float& tsx) {
  MaxSum acc{-INFINITY, 0.f};
  float sx = 0.f;
  const int groups = (V + 7) / 8;
  int g = threadIdx.x;
  for (; g + THREADS < groups; g += 2 * THREADS) {  // two groups' loads issued before either is used
    float a[8], b[8];
    const int c0 = g * 8, c1 = c0 + THREADS * 8;
    const int na = VEC ? 8 : min(8, V - c0), nb = VEC ? 8 : min(8, V - c1);
    if (VEC) { load8(x + c0, a); load8(x + c1, b); } else { load_n(x + c0, na, a); load_n(x + c1, nb, b); }
    ce_accumulate(acc, sx, a, na);
    ce_accumulate(acc, sx, b, nb);
  }
  if (g < groups) {
    float a[8];
    const int c0 = g * 8;
    const int na = VEC ? 8 : min(8, V - c0);
    if (VEC) load8(x + c0, a); else load_n(x + c0, na, a);
    ce_accumulate(acc, sx, a, na);
  }
  __shared__ MaxSum sh_ms[THREADS / 32];
  __shared__ float sh_sx[THREADS / 32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    MaxSum other{__shfl_xor_sync(0xffffffffu, acc.m, o), __shfl_xor_sync(0xffffffffu, acc.s, o)};
    acc = ms_combine(acc, other);
  }
  sx = warp_sum(sx);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) { sh_ms[warp] = acc; sh_sx[warp] = sx; }
  __syncthreads();
  if (threadIdx.x == 0) {
    tot = sh_ms[0];
    tsx = sh_sx[0];
    for (int w = 1; w < THREADS / 32; ++w) { tot = ms_combine(tot, sh_ms[w]); tsx += sh_sx[w]; }
  }
}

// (loss, nll) of a row that is not ignored, from lse, the sum of its logits and its target logit x_t
// (read only when t is in [0, V)).
template <typename T>
__device__ __forceinline__ void ce_row_loss(const T* x, int64_t t, int V, float eps, float lse, float tsx,
                                            float& loss, float& nll) {
  if (t < 0 || t >= V) {
    loss = nll = NAN;
  } else {
    const float eps_i = V > 1 ? eps / (V - 1) : 0.f;
    nll = lse - to_f(x[t]);
    const float smooth = (float)V * lse - tsx;
    loss = (1.f - eps - eps_i) * nll + eps_i * smooth;
  }
}

// dx = the gradient of row x (dx may be x: each thread reads its 8 values before it writes them, and no other
// thread touches them, so the pointers are not __restrict__); ignored: zeros, x not read.
template <typename T, bool VEC, int THREADS>
__device__ __forceinline__ void ce_grad_row(const T* x, T* dx, int V, int64_t t, bool ignored, float lse,
                                            CeGrad c) {
  const int groups = (V + 7) / 8;
  for (int g = threadIdx.x; g < groups; g += THREADS) {
    const int c0 = g * 8;
    const int n = min(8, V - c0);
    float v[8];
    if (ignored) {
#pragma unroll
      for (int k = 0; k < 8; ++k) v[k] = 0.f;
    } else {
      if (VEC) load8(x + c0, v); else load_n(x + c0, n, v);
#pragma unroll
      for (int k = 0; k < 8; ++k) v[k] = ce_grad(v[k], lse, c, (int64_t)(c0 + k) == t);
    }
    if (VEC) store8(dx + c0, v); else store_n(dx + c0, n, v);
  }
}

// The fused kernels' prologue of a row that is not ignored: the forward's pass, then in thread 0 lse, the row's
// (loss, nll) into losses [2, N] and the backward's coefficients with g_nll = 0 (g_loss null: 1), broadcast to the
// block with lse. x[t] is read before the barrier, so before a second pass that overwrites the logits.
template <typename T, bool VEC>
__device__ __forceinline__ CeGrad ce_fused_prologue(const T* x, int64_t t, int V, float eps, const float* g_loss,
                                                    float* losses, int64_t row, int64_t N, float& lse) {
  MaxSum tot;
  float tsx;
  ce_row_stats<T, VEC, kCeFusedThreads>(x, V, tot, tsx);
  __shared__ float sh_lse;
  __shared__ CeGrad sh_c;
  if (threadIdx.x == 0) {
    const float l = tot.m + __logf(tot.s);
    float loss, nll;
    ce_row_loss(x, t, V, eps, l, tsx, loss, nll);
    losses[row] = loss;
    losses[N + row] = nll;
    sh_lse = l;
    sh_c = ce_grad_coeffs(g_loss != nullptr ? *g_loss : 1.f, 0.f, eps, V);
  }
  __syncthreads();
  lse = sh_lse;
  return sh_c;
}

// THREADS: kCeThreads; kCeFusedThreads for the FP8 head's first pass, whose loss, nll and lse are then bit for bit
// the fused kernel's (ce_fused_prologue: the same row statistics and loss)
template <typename T, bool VEC, int THREADS = kCeThreads>
__global__ void __launch_bounds__(THREADS) ls_ce_fwd_kernel(const T* __restrict__ logits,
                                                            const int64_t* __restrict__ target,
                                                            float* __restrict__ losses, float* __restrict__ lse_out,
                                                            int64_t N, int V, float eps, int64_t ignore_index) {
  const int64_t row = blockIdx.x;
  const T* x = logits + row * V;
  const int64_t t = target[row];
  MaxSum tot;
  float tsx;
  ce_row_stats<T, VEC, THREADS>(x, V, tot, tsx);
  if (threadIdx.x == 0) {
    const float lse = tot.m + __logf(tot.s);
    lse_out[row] = lse;
    float loss = 0.f, nll = 0.f;
    if (t != ignore_index) ce_row_loss(x, t, V, eps, lse, tsx, loss, nll);
    losses[row] = loss;
    losses[N + row] = nll;
  }
}

template <typename T, bool VEC>
__global__ void __launch_bounds__(kCeThreads) ls_ce_bwd_kernel(const T* logits,
                                                               const int64_t* __restrict__ target,
                                                               const float* __restrict__ lse_in,
                                                               const float* __restrict__ g_loss,
                                                               const float* __restrict__ g_nll, T* dlogits,
                                                               int V, float eps, int64_t ignore_index) {
  const int64_t row = blockIdx.x;
  const int64_t t = target[row];
  const bool ignored = t == ignore_index;
  CeGrad c{0.f, 0.f, 0.f};
  float lse = 0.f;
  if (!ignored) {
    c = ce_grad_coeffs(*g_loss, *g_nll, eps, V);
    lse = lse_in[row];
  }
  ce_grad_row<T, VEC, kCeThreads>(logits + row * V, dlogits + row * V, V, t, ignored, lse, c);
}

// logits [N, V] are overwritten by d(g_loss * sum of losses)/dlogits (g_loss null: 1); losses [2, N] as the
// forward's.
template <typename T, bool VEC>
__global__ void __launch_bounds__(kCeFusedThreads) ls_ce_fwd_bwd_kernel(T* logits,
                                                                        const int64_t* __restrict__ target,
                                                                        float* __restrict__ losses,
                                                                        const float* __restrict__ g_loss,
                                                                        int64_t N, int V, float eps,
                                                                        int64_t ignore_index) {
  const int64_t row = blockIdx.x;
  T* x = logits + row * V;
  const int64_t t = target[row];
  const bool ignored = t == ignore_index;  // the same for the whole block
  if (ignored) {
    if (threadIdx.x == 0) { losses[row] = 0.f; losses[N + row] = 0.f; }
    ce_grad_row<T, VEC, kCeFusedThreads>(x, x, V, t, true, 0.f, CeGrad{0.f, 0.f, 0.f});
    return;
  }
  float lse;
  const CeGrad c = ce_fused_prologue<T, VEC>(x, t, V, eps, g_loss, losses, row, N, lse);
  ce_grad_row<T, VEC, kCeFusedThreads>(x, x, V, t, false, lse, c);
}

// ================================================================ launchers

void ls_cross_entropy_fwd(DType dt, const void* logits, const int64_t* target, float* losses, float* lse, int64_t N,
                          int V, float epsilon, int64_t ignore_index, cudaStream_t stream) {
  if (N <= 0) return;
  const bool vec = V % 8 == 0 && aligned16(logits);
  LS_DISPATCH(dt, T, {
    if (vec)
      ls_ce_fwd_kernel<T, true><<<(unsigned)N, kCeThreads, 0, stream>>>(static_cast<const T*>(logits), target, losses,
                                                                         lse, N, V, epsilon, ignore_index);
    else
      ls_ce_fwd_kernel<T, false><<<(unsigned)N, kCeThreads, 0, stream>>>(static_cast<const T*>(logits), target, losses,
                                                                          lse, N, V, epsilon, ignore_index);
    LS_CHECK_LAUNCH("ls_cross_entropy_fwd", stream);
  });
}

void ls_cross_entropy_bwd(DType dt, const void* logits, const int64_t* target, const float* lse, const float* g_loss,
                          const float* g_nll, void* dlogits, int64_t N, int V, float epsilon, int64_t ignore_index,
                          cudaStream_t stream) {
  if (N <= 0) return;
  const bool vec = V % 8 == 0 && aligned16(logits) && aligned16(dlogits);
  LS_DISPATCH(dt, T, {
    if (vec)
      ls_ce_bwd_kernel<T, true><<<(unsigned)N, kCeThreads, 0, stream>>>(static_cast<const T*>(logits), target, lse,
          g_loss, g_nll, static_cast<T*>(dlogits), V, epsilon, ignore_index);
    else
      ls_ce_bwd_kernel<T, false><<<(unsigned)N, kCeThreads, 0, stream>>>(static_cast<const T*>(logits), target, lse,
          g_loss, g_nll, static_cast<T*>(dlogits), V, epsilon, ignore_index);
    LS_CHECK_LAUNCH("ls_cross_entropy_bwd", stream);
  });
}

void ls_cross_entropy_fwd_bwd(DType dt, void* logits, const int64_t* target, float* losses, const float* g_loss,
                              int64_t N, int V, float epsilon, int64_t ignore_index, cudaStream_t stream) {
  if (N <= 0) return;
  const bool vec = V % 8 == 0 && aligned16(logits);
  LS_DISPATCH(dt, T, {
    if (vec)
      ls_ce_fwd_bwd_kernel<T, true><<<(unsigned)N, kCeFusedThreads, 0, stream>>>(static_cast<T*>(logits), target,
          losses, g_loss, N, V, epsilon, ignore_index);
    else
      ls_ce_fwd_bwd_kernel<T, false><<<(unsigned)N, kCeFusedThreads, 0, stream>>>(static_cast<T*>(logits), target,
          losses, g_loss, N, V, epsilon, ignore_index);
    LS_CHECK_LAUNCH("ls_cross_entropy_fwd_bwd", stream);
  });
}

void ls_cross_entropy_fwd_bwd_fp8(DType dt, const void* logits, const int64_t* target, float* losses,
                                  const float* g_loss, int64_t N, int V, float epsilon, int64_t ignore_index,
                                  float* lse, float* fp8_row, Fp8Format fmt, void* codes, void* codes_t, int64_t Mp,
                                  cudaStream_t stream) {
  if (N <= 0) return;
  if (V % 16 != 0 || !aligned16(logits) || !aligned16(codes) || (codes_t != nullptr && !aligned16(codes_t)))
    throw std::runtime_error("ls_cross_entropy_fwd_bwd_fp8: the vocabulary must be a multiple of 16 and the "
                             "buffers 16-byte aligned");
  LS_DISPATCH(dt, T, {  // the loss's statistics per row, then the gradient's codes from a pass over the logits
    ls_ce_fwd_kernel<T, true, kCeFusedThreads><<<(unsigned)N, kCeFusedThreads, 0, stream>>>(
        static_cast<const T*>(logits), target, losses, lse, N, V, epsilon, ignore_index);
    LS_CHECK_LAUNCH("ls_cross_entropy_fwd_bwd_fp8", stream);
  });
  fp8_ce_grad(dt, logits, target, lse, g_loss, N, V, epsilon, ignore_index, fp8_row, fmt, codes, codes_t, Mp, stream);
}

}  // namespace ls
