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
#include "kernels/common.cuh"

namespace ls {

constexpr int kCeThreads = 256;

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

template <typename T, bool VEC>
__global__ void __launch_bounds__(kCeThreads) ls_ce_fwd_kernel(const T* __restrict__ logits,
                                                               const int64_t* __restrict__ target,
                                                               float* __restrict__ losses, float* __restrict__ lse_out,
                                                               int64_t N, int V, float eps, int64_t ignore_index) {
  const int64_t row = blockIdx.x;
  const T* x = logits + row * V;
  const int64_t t = target[row];
  const bool ignored = t == ignore_index;
  MaxSum acc{-INFINITY, 0.f};
  float sx = 0.f;
  const int groups = (V + 7) / 8;
  for (int g = threadIdx.x; g < groups; g += kCeThreads) {
    float v[8];
    const int c0 = g * 8;
    const int n = min(8, V - c0);
    if (VEC) load8(x + c0, v); else load_n(x + c0, n, v);
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
  // block reduction of (m, s) and sx
  __shared__ MaxSum sh_ms[kCeThreads / 32];
  __shared__ float sh_sx[kCeThreads / 32];
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
    MaxSum tot = sh_ms[0];
    float tsx = sh_sx[0];
    for (int w = 1; w < kCeThreads / 32; ++w) { tot = ms_combine(tot, sh_ms[w]); tsx += sh_sx[w]; }
    const float lse = tot.m + __logf(tot.s);
    lse_out[row] = lse;
    float loss = 0.f, nll = 0.f;
    if (!ignored) {
      if (t < 0 || t >= V) {
        loss = nll = NAN;
      } else {
        const float eps_i = V > 1 ? eps / (V - 1) : 0.f;
        nll = lse - to_f(x[t]);
        const float smooth = (float)V * lse - tsx;
        loss = (1.f - eps - eps_i) * nll + eps_i * smooth;
      }
    }
    losses[row] = loss;
    losses[N + row] = nll;
  }
}

template <typename T, bool VEC>
// dlogits may be logits (the in-place backward): each thread reads its 8 values before it writes them, and no
// other thread touches them, so the pointers are not __restrict__.
__global__ void __launch_bounds__(kCeThreads) ls_ce_bwd_kernel(const T* logits,
                                                               const int64_t* __restrict__ target,
                                                               const float* __restrict__ lse_in,
                                                               const float* __restrict__ g_loss,
                                                               const float* __restrict__ g_nll, T* dlogits,
                                                               int V, float eps, int64_t ignore_index) {
  const int64_t row = blockIdx.x;
  const T* x = logits + row * V;
  T* dx = dlogits + row * V;
  const int64_t t = target[row];
  const int groups = (V + 7) / 8;
  float A = 0.f, Bc = 0.f, Dt = 0.f, lse = 0.f;
  const bool ignored = t == ignore_index;
  if (!ignored) {
    const float gl = *g_loss, gn = *g_nll;
    const float eps_i = V > 1 ? eps / (V - 1) : 0.f;
    A = gl * (1.f - eps - eps_i + (float)V * eps_i) + gn;
    Bc = gl * eps_i;
    Dt = gl * (1.f - eps - eps_i) + gn;
    lse = lse_in[row];
  }
  for (int g = threadIdx.x; g < groups; g += kCeThreads) {
    const int c0 = g * 8;
    const int n = min(8, V - c0);
    float v[8];
    if (ignored) {
#pragma unroll
      for (int k = 0; k < 8; ++k) v[k] = 0.f;
    } else {
      if (VEC) load8(x + c0, v); else load_n(x + c0, n, v);
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const float p = __expf(v[k] - lse);
        v[k] = p * A - Bc - ((int64_t)(c0 + k) == t ? Dt : 0.f);
      }
    }
    if (VEC) store8(dx + c0, v); else store_n(dx + c0, n, v);
  }
}

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

}  // namespace ls
