// Adam / AdamW over flat buffers, and the flat gradient L2 norm.
//
// Numerics (all fp32): g = grad * grad_scale (the loss-scale unscale and the clip coefficient folded
// into one factor); m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2; bias corrections bc_i = 1 - b_i^step.
//   fairseq mode: p = p - wd * lr * p;  p = p - (lr * sqrt(bc2) / bc1) * m / (sqrt(v) + eps)
//   torch mode:   p = p * (1 - lr * wd); p = p - (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)
// param_lp (optional) receives p rounded to its dtype in the same pass; param_lp_peer (optional, the same
// range of another GPU's copy, mapped peer-to-peer) receives the same values: a data-parallel rank that
// owns this range writes it on every rank in one pass (its stores are fenced at system scope before the
// kernel ends; the caller orders them before the peer's next read). When `norm` is given and not
// finite, the kernel writes nothing: the step is skipped on the device, without a host sync.
// `scale_dev` (optional, device fp32 scalar) multiplies grad_scale, read on the device: a factor that
// is only known there (loss scale, clip coefficient) needs no host sync; a non-finite factor also
// skips the step.
// grad_norm: per-block fp32 sums of squares (fixed grid), then one block sums the partials in a
// fixed order and takes the square root: deterministic; inf / NaN propagate.
#include <cmath>

#include "kernels/common.cuh"

namespace ls {

struct AdamCoef {
  float lr, b1, b2, eps, decay_mul, step_size, inv_sqrt_bc2, grad_scale;
  bool torch_mode;
};

template <typename G, typename L>
__device__ __forceinline__ void adam_one(float& p, float g_raw, float& m, float& v, const AdamCoef& c) {
  const float g = g_raw * c.grad_scale;
  m = c.b1 * m + (1.f - c.b1) * g;
  v = c.b2 * v + (1.f - c.b2) * g * g;
  const float denom = c.torch_mode ? sqrtf(v) * c.inv_sqrt_bc2 + c.eps : sqrtf(v) + c.eps;
  p = p * c.decay_mul - c.step_size * m / denom;
}

template <typename G, typename L, bool VEC>
__global__ void adam_kernel(float* __restrict__ param, const G* __restrict__ grad, float* __restrict__ exp_avg,
                            float* __restrict__ exp_avg_sq, L* __restrict__ param_lp, L* __restrict__ param_lp_peer,
                            int64_t n, AdamCoef c, const float* __restrict__ norm,
                            const float* __restrict__ scale_dev) {
  if (norm != nullptr && !isfinite(*norm)) return;
  if (scale_dev != nullptr) {
    const float s = *scale_dev;
    if (!isfinite(s)) return;
    c.grad_scale *= s;
  }
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  const int64_t tid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  int64_t done = 0;
  if (VEC) {
    const int64_t n4 = n / 4;
    for (int64_t q = tid; q < n4; q += stride) {
      float4 p = reinterpret_cast<float4*>(param)[q];
      float4 m = reinterpret_cast<float4*>(exp_avg)[q];
      float4 v = reinterpret_cast<float4*>(exp_avg_sq)[q];
      float g[4];
      if constexpr (sizeof(G) == 4) {
        float4 t = reinterpret_cast<const float4*>(grad)[q];
        g[0] = t.x; g[1] = t.y; g[2] = t.z; g[3] = t.w;
      } else {
        uint2 t = reinterpret_cast<const uint2*>(grad)[q];
        const G* h = reinterpret_cast<const G*>(&t);
#pragma unroll
        for (int k = 0; k < 4; ++k) g[k] = to_f(h[k]);
      }
      adam_one<G, L>(p.x, g[0], m.x, v.x, c);
      adam_one<G, L>(p.y, g[1], m.y, v.y, c);
      adam_one<G, L>(p.z, g[2], m.z, v.z, c);
      adam_one<G, L>(p.w, g[3], m.w, v.w, c);
      reinterpret_cast<float4*>(param)[q] = p;
      reinterpret_cast<float4*>(exp_avg)[q] = m;
      reinterpret_cast<float4*>(exp_avg_sq)[q] = v;
      if constexpr (sizeof(L) == 4) {
        if (param_lp != nullptr) reinterpret_cast<float4*>(param_lp)[q] = p;
        if (param_lp_peer != nullptr) reinterpret_cast<float4*>(param_lp_peer)[q] = p;
      } else {
        uint2 t;
        L* h = reinterpret_cast<L*>(&t);
        h[0] = from_f<L>(p.x); h[1] = from_f<L>(p.y); h[2] = from_f<L>(p.z); h[3] = from_f<L>(p.w);
        if (param_lp != nullptr) reinterpret_cast<uint2*>(param_lp)[q] = t;
        if (param_lp_peer != nullptr) reinterpret_cast<uint2*>(param_lp_peer)[q] = t;
      }
    }
    done = n4 * 4;
  }
  for (int64_t i = done + tid; i < n; i += stride) {
    float p = param[i], m = exp_avg[i], v = exp_avg_sq[i];
    adam_one<G, L>(p, to_f(grad[i]), m, v, c);
    param[i] = p;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    if (param_lp != nullptr) param_lp[i] = from_f<L>(p);
    if (param_lp_peer != nullptr) param_lp_peer[i] = from_f<L>(p);
  }
  if (param_lp_peer != nullptr) __threadfence_system();
}

template <typename G, typename L>
static void launch_adam(float* param, const void* grad, float* m, float* v, void* lp, void* peer, int64_t n,
                        const AdamCoef& c, const float* norm, const float* scale_dev, cudaStream_t stream) {
  const int threads = 256;
  const int blocks = (int)std::max<int64_t>(1, std::min<int64_t>((n / 4 + threads - 1) / threads, (int64_t)num_sms() * 8));
  const bool vec = aligned16(param) && aligned16(m) && aligned16(v) && ((uintptr_t)grad % (4 * sizeof(G)) == 0) &&
                   (lp == nullptr || (uintptr_t)lp % (4 * sizeof(L)) == 0) &&
                   (peer == nullptr || (uintptr_t)peer % (4 * sizeof(L)) == 0);
  if (vec)
    adam_kernel<G, L, true><<<blocks, threads, 0, stream>>>(param, static_cast<const G*>(grad), m, v,
                                                            static_cast<L*>(lp), static_cast<L*>(peer), n, c,
                                                            norm, scale_dev);
  else
    adam_kernel<G, L, false><<<blocks, threads, 0, stream>>>(param, static_cast<const G*>(grad), m, v,
                                                             static_cast<L*>(lp), static_cast<L*>(peer), n, c,
                                                             norm, scale_dev);
  LS_CHECK_LAUNCH("adam_step", stream);
}

void adam_step(DType grad_dt, DType lp_dt, float* param, const void* grad, float* exp_avg, float* exp_avg_sq,
               void* param_lp, void* param_lp_peer, int64_t n, AdamArgs a, const float* norm,
               const float* scale_dev, cudaStream_t stream) {
  if (n <= 0) return;
  const double bc1 = 1.0 - std::pow((double)a.beta1, (double)a.step);
  const double bc2 = 1.0 - std::pow((double)a.beta2, (double)a.step);
  AdamCoef c;
  c.lr = a.lr; c.b1 = a.beta1; c.b2 = a.beta2; c.eps = a.eps; c.grad_scale = a.grad_scale;
  c.torch_mode = a.torch_mode;
  c.decay_mul = (float)(1.0 - (double)a.lr * a.weight_decay);
  if (a.torch_mode) {
    c.step_size = (float)(a.lr / bc1);
    c.inv_sqrt_bc2 = (float)(1.0 / std::sqrt(bc2));
  } else {
    c.step_size = (float)(a.lr * std::sqrt(bc2) / bc1);
    c.inv_sqrt_bc2 = 1.f;
  }
  LS_DISPATCH(grad_dt, G, {
    LS_DISPATCH(lp_dt, L, launch_adam<G, L>(param, grad, exp_avg, exp_avg_sq, param_lp, param_lp_peer, n, c, norm,
                                                     scale_dev, stream));
  });
}

// ================================================================ grad norm
constexpr int kNormThreads = 512, kNormMaxBlocks = 1024;

int64_t grad_norm_workspace() { return kNormMaxBlocks; }

// Sum of v over a block of kNormThreads threads, in a fixed order; the result is valid in thread 0.
__device__ __forceinline__ float block_sum_norm(float v) {
  __shared__ float sh[kNormThreads / 32];
  v = warp_sum(v);
  if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = v;
  __syncthreads();
  float t = 0.f;
  if (threadIdx.x == 0)
    for (int w = 0; w < kNormThreads / 32; ++w) t += sh[w];
  return t;
}

template <typename T>
__global__ void __launch_bounds__(kNormThreads) sumsq_partial_kernel(const T* __restrict__ g, int64_t n, bool vec,
                                                                     float* __restrict__ partial) {
  float s = 0.f;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  const int64_t tid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  int64_t done = 0;
  if (vec) {
    const int64_t n8 = n / 8;
    for (int64_t q = tid; q < n8; q += stride) {
      float v[8];
      load8(g + q * 8, v);
#pragma unroll
      for (int k = 0; k < 8; ++k) s += v[k] * v[k];
    }
    done = n8 * 8;
  }
  for (int64_t i = done + tid; i < n; i += stride) {
    const float v = to_f(g[i]);
    s += v * v;
  }
  s = block_sum_norm(s);
  if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

__global__ void __launch_bounds__(kNormThreads) sqrt_sum_kernel(const float* __restrict__ partial, int G,
                                                                float* __restrict__ out) {
  float s = 0.f;
  for (int i = threadIdx.x; i < G; i += kNormThreads) s += partial[i];
  s = block_sum_norm(s);
  if (threadIdx.x == 0) *out = sqrtf(s);
}

void grad_norm(DType dt, const void* grad, int64_t n, float* workspace, float* out, cudaStream_t stream) {
  const int G = (int)std::max<int64_t>(1, std::min<int64_t>((n / 8 + kNormThreads - 1) / kNormThreads,
                                                            std::min(kNormMaxBlocks, num_sms() * 4)));
  const bool vec = aligned16(grad);
  LS_DISPATCH(dt, T, {
    sumsq_partial_kernel<T><<<G, kNormThreads, 0, stream>>>(static_cast<const T*>(grad), n, vec, workspace);
    LS_CHECK_LAUNCH("grad_norm partial", stream);
  });
  sqrt_sum_kernel<<<1, kNormThreads, 0, stream>>>(workspace, G, out);
  LS_CHECK_LAUNCH("grad_norm", stream);
}

}  // namespace ls
