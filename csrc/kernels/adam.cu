// Adam / AdamW over flat buffers, and the flat gradient L2 norm.
//
// Numerics (all fp32): g = grad * grad_scale (the loss-scale unscale and the clip coefficient folded
// into one factor); m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2; bias corrections bc_i = 1 - b_i^step.
//   fairseq mode: p = p - wd * lr * p;  p = p - (lr * sqrt(bc2) / bc1) * m / (sqrt(v) + eps)
//   torch mode:   p = p * (1 - lr * wd); p = p - (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)
// param_lp (optional) receives p rounded to its dtype in the same pass, param_lp_peer (optional) the same values in
// another GPU's copy (peer-to-peer). A non-finite `norm` or `scale_dev` (a device factor of grad_scale) skips the
// step on the device, without a host sync.
// Split master (bf16 weights): the fp32 master is the bf16 weight (its upper half) and an int16 remainder
// `param_lo`, exactly; `sq_out`: the gradients' L2 norm summed in the same pass; grad_norm: deterministic
// per-block sums, then one block. Details: docs/optimizer.md ("Kernels").
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

// Gradients 4q .. 4q + 3 into g (fp32); SQ: their squares added to sq.
template <typename G, bool SQ>
__device__ __forceinline__ void load_grad4(const G* __restrict__ grad, int64_t q, float (&g)[4], float& sq) {
  if constexpr (sizeof(G) == 4) {
    float4 t = reinterpret_cast<const float4*>(grad)[q];
    g[0] = t.x; g[1] = t.y; g[2] = t.z; g[3] = t.w;
  } else {
    uint2 t = reinterpret_cast<const uint2*>(grad)[q];
    const G* h = reinterpret_cast<const G*>(&t);
#pragma unroll
    for (int k = 0; k < 4; ++k) g[k] = to_f(h[k]);
  }
  if constexpr (SQ) sq += g[0] * g[0] + g[1] * g[1] + g[2] * g[2] + g[3] * g[3];
}

// One range [lo, lo + n) of the flat buffers, grid-strided. VEC: every pointer of the range is aligned for
// 4-wide loads and stores (decided on the host per range, so the branch is uniform over the grid).
// SQ: also add the squares of the gradients read into `sq`.
template <typename G, typename L, bool VEC, bool SQ>
__device__ __forceinline__ void adam_range(float* __restrict__ param, const G* __restrict__ grad,
                                           float* __restrict__ exp_avg, float* __restrict__ exp_avg_sq,
                                           L* __restrict__ param_lp, L* __restrict__ param_lp_peer, int64_t n,
                                           const AdamCoef& c, int64_t tid, int64_t stride, float& sq) {
  int64_t done = 0;
  if (VEC) {
    const int64_t n4 = n / 4;
    for (int64_t q = tid; q < n4; q += stride) {
      float4 p = reinterpret_cast<float4*>(param)[q];
      float4 m = reinterpret_cast<float4*>(exp_avg)[q];
      float4 v = reinterpret_cast<float4*>(exp_avg_sq)[q];
      float g[4];
      load_grad4<G, SQ>(grad, q, g, sq);
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
    const float g = to_f(grad[i]);
    if constexpr (SQ) sq += g * g;
    adam_one<G, L>(p, g, m, v, c);
    param[i] = p;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    if (param_lp != nullptr) param_lp[i] = from_f<L>(p);
    if (param_lp_peer != nullptr) param_lp_peer[i] = from_f<L>(p);
  }
}

// The split master (header): join the bf16 weight's bits and the int16 remainder into the fp32 master, and back.
__device__ __forceinline__ float join_master(uint16_t hi, int16_t lo) {
  return __uint_as_float((uint32_t(hi) << 16) + uint32_t(int32_t(lo)));
}
__device__ __forceinline__ void split_master(float p, uint16_t& hi, int16_t& lo) {
  const uint32_t b = __float_as_uint(p);
  const uint32_t h = (b + 0x8000u) >> 16;
  hi = uint16_t(h);
  lo = int16_t(int32_t(b - (h << 16)));
}

// adam_range for a split master: `hi` is the bf16 weights (as their bits), `lo` the remainders; `peer` (nullable)
// receives the new weights too.
template <typename G, bool VEC, bool SQ>
__device__ __forceinline__ void adam_split_range(uint16_t* __restrict__ hi, int16_t* __restrict__ lo,
                                                 const G* __restrict__ grad, float* __restrict__ exp_avg,
                                                 float* __restrict__ exp_avg_sq, uint16_t* __restrict__ peer,
                                                 int64_t n, const AdamCoef& c, int64_t tid, int64_t stride,
                                                 float& sq) {
  int64_t done = 0;
  if (VEC) {
    const int64_t n4 = n / 4;
    for (int64_t q = tid; q < n4; q += stride) {
      uint2 th = reinterpret_cast<const uint2*>(hi)[q];
      uint2 tl = reinterpret_cast<const uint2*>(lo)[q];
      float4 m = reinterpret_cast<float4*>(exp_avg)[q];
      float4 v = reinterpret_cast<float4*>(exp_avg_sq)[q];
      float g[4];
      load_grad4<G, SQ>(grad, q, g, sq);
      uint16_t* hh = reinterpret_cast<uint16_t*>(&th);
      int16_t* ll = reinterpret_cast<int16_t*>(&tl);
      float p[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) p[k] = join_master(hh[k], ll[k]);
      adam_one<G, __nv_bfloat16>(p[0], g[0], m.x, v.x, c);
      adam_one<G, __nv_bfloat16>(p[1], g[1], m.y, v.y, c);
      adam_one<G, __nv_bfloat16>(p[2], g[2], m.z, v.z, c);
      adam_one<G, __nv_bfloat16>(p[3], g[3], m.w, v.w, c);
#pragma unroll
      for (int k = 0; k < 4; ++k) split_master(p[k], hh[k], ll[k]);
      reinterpret_cast<uint2*>(hi)[q] = th;
      reinterpret_cast<uint2*>(lo)[q] = tl;
      reinterpret_cast<float4*>(exp_avg)[q] = m;
      reinterpret_cast<float4*>(exp_avg_sq)[q] = v;
      if (peer != nullptr) reinterpret_cast<uint2*>(peer)[q] = th;
    }
    done = n4 * 4;
  }
  for (int64_t i = done + tid; i < n; i += stride) {
    float p = join_master(hi[i], lo[i]), m = exp_avg[i], v = exp_avg_sq[i];
    const float g = to_f(grad[i]);
    if constexpr (SQ) sq += g * g;
    adam_one<G, __nv_bfloat16>(p, g, m, v, c);
    uint16_t h;
    int16_t l;
    split_master(p, h, l);
    hi[i] = h;
    lo[i] = l;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    if (peer != nullptr) peer[i] = h;
  }
}

// Up to kMaxRanges ranges of the same flat buffers per launch (a data-parallel rank's owned parts):
// the kernel walks them in order, every block taking its grid-strided share of each.
constexpr int kMaxRanges = 64;
struct FlatRanges {
  int count;
  uint64_t vec;  // bit k: range k takes the 4-wide path
  int64_t lo[kMaxRanges], n[kMaxRanges];
};

// Fills r with the non-empty ranges among bounds' ranges first, first + 1, ... until it holds kMaxRanges;
// vec_ok(lo) says whether the range starting at lo takes the 4-wide path. Returns the index of the first range
// not looked at (count when all were), where the next launch starts, and the elements taken in `total`.
template <typename VecOk>
static int take_ranges(const int64_t* bounds, int count, int first, VecOk vec_ok, FlatRanges& r, int64_t& total) {
  r.count = 0;
  r.vec = 0;
  total = 0;
  int k = first;
  for (; k < count && r.count < kMaxRanges; ++k) {
    const int64_t lo = bounds[2 * k], n = bounds[2 * k + 1] - lo;
    if (n <= 0) continue;
    r.lo[r.count] = lo;
    r.n[r.count] = n;
    if (vec_ok(lo)) r.vec |= uint64_t(1) << r.count;
    ++r.count;
    total += n;
  }
  return k;
}

constexpr int kAdamThreads = 256;

// Sum of v over a block of THREADS threads, in a fixed order; the result is valid in thread 0.
template <int THREADS>
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float sh[THREADS / 32];
  v = warp_sum(v);
  if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = v;
  __syncthreads();
  float t = 0.f;
  if (threadIdx.x == 0)
    for (int w = 0; w < THREADS / 32; ++w) t += sh[w];
  return t;
}

// SQ: sq_partial[blockIdx.x] receives the block's sum of squared gradients (written even when the step is skipped).
// SPLIT: a split master (L is bf16): param_lp holds the weights, param_lo the remainders, param is unused.
template <typename G, typename L, bool SQ, bool SPLIT>
__global__ void __launch_bounds__(kAdamThreads)
    adam_kernel(float* __restrict__ param, const G* __restrict__ grad, float* __restrict__ exp_avg,
                float* __restrict__ exp_avg_sq, L* __restrict__ param_lp, L* __restrict__ param_lp_peer,
                int16_t* __restrict__ param_lo, FlatRanges r, AdamCoef c, const float* __restrict__ norm,
                const float* __restrict__ scale_dev, float* __restrict__ sq_partial) {
  bool skip = norm != nullptr && !isfinite(*norm);
  if (scale_dev != nullptr) {
    const float s = *scale_dev;
    if (!isfinite(s)) skip = true;
    c.grad_scale *= s;
  }
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  const int64_t tid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  float sq = 0.f;
  if (skip) {  // uniform over the grid
    if constexpr (SQ) {
      for (int k = 0; k < r.count; ++k) {
        const G* g = grad + r.lo[k];
        for (int64_t i = tid; i < r.n[k]; i += stride) {
          const float v = to_f(g[i]);
          sq += v * v;
        }
      }
      sq = block_sum<kAdamThreads>(sq);
      if (threadIdx.x == 0) sq_partial[blockIdx.x] = sq;
    }
    return;
  }
  for (int k = 0; k < r.count; ++k) {
    const int64_t o = r.lo[k];
    L* lp = param_lp == nullptr ? nullptr : param_lp + o;
    L* peer = param_lp_peer == nullptr ? nullptr : param_lp_peer + o;
    if constexpr (SPLIT) {
      static_assert(sizeof(L) == 2, "a split master holds 16-bit weights");
      uint16_t* hb = reinterpret_cast<uint16_t*>(lp);
      uint16_t* pb = reinterpret_cast<uint16_t*>(peer);
      if ((r.vec >> k) & 1)
        adam_split_range<G, true, SQ>(hb, param_lo + o, grad + o, exp_avg + o, exp_avg_sq + o, pb, r.n[k], c, tid,
                                      stride, sq);
      else
        adam_split_range<G, false, SQ>(hb, param_lo + o, grad + o, exp_avg + o, exp_avg_sq + o, pb, r.n[k], c, tid,
                                       stride, sq);
      continue;
    }
    if ((r.vec >> k) & 1)
      adam_range<G, L, true, SQ>(param + o, grad + o, exp_avg + o, exp_avg_sq + o, lp, peer, r.n[k], c, tid, stride,
                                 sq);
    else
      adam_range<G, L, false, SQ>(param + o, grad + o, exp_avg + o, exp_avg_sq + o, lp, peer, r.n[k], c, tid, stride,
                                  sq);
  }
  if constexpr (SQ) {
    sq = block_sum<kAdamThreads>(sq);
    if (threadIdx.x == 0) sq_partial[blockIdx.x] = sq;
  }
  if (param_lp_peer != nullptr) __threadfence_system();
}

__global__ void sqrt_sum_kernel(const float* __restrict__ partial, int G, float* __restrict__ out);
constexpr int kNormThreads = 512, kNormMaxBlocks = 1024;
constexpr int kAdamBlocksPerSM = 8;

int64_t adam_norm_workspace(int count) {
  return (int64_t)((count + kMaxRanges - 1) / kMaxRanges) * num_sms() * kAdamBlocksPerSM;
}

template <typename G, typename L, bool SPLIT>
static void launch_adam(float* param, const void* grad, float* m, float* v, void* lp, void* peer, int16_t* lo_buf,
                        const int64_t* bounds, int count, const AdamCoef& c, const float* norm,
                        const float* scale_dev, float* sq_ws, float* sq_out, cudaStream_t stream) {
  const int threads = kAdamThreads;
  int partials = 0;  // sq_out: the per-block sums written so far
  const auto vec_ok = [&](int64_t lo) {
    return (SPLIT ? (uintptr_t)(lo_buf + lo) % 8 == 0 : aligned16(param + lo)) && aligned16(m + lo) &&
           aligned16(v + lo) &&
           ((uintptr_t)(static_cast<const G*>(grad) + lo) % (4 * sizeof(G)) == 0) &&
           (lp == nullptr || (uintptr_t)(static_cast<L*>(lp) + lo) % (4 * sizeof(L)) == 0) &&
           (peer == nullptr || (uintptr_t)(static_cast<L*>(peer) + lo) % (4 * sizeof(L)) == 0);
  };
  for (int first = 0; first < count;) {
    FlatRanges r;
    int64_t total;
    first = take_ranges(bounds, count, first, vec_ok, r, total);
    if (r.count == 0) continue;
    const int blocks = (int)std::max<int64_t>(
        1, std::min<int64_t>((total / 4 + threads - 1) / threads, (int64_t)num_sms() * kAdamBlocksPerSM));
    if (sq_out != nullptr) {
      adam_kernel<G, L, true, SPLIT><<<blocks, threads, 0, stream>>>(
          param, static_cast<const G*>(grad), m, v, static_cast<L*>(lp), static_cast<L*>(peer), lo_buf, r, c, norm,
          scale_dev, sq_ws + partials);
      partials += blocks;
    } else {
      adam_kernel<G, L, false, SPLIT><<<blocks, threads, 0, stream>>>(
          param, static_cast<const G*>(grad), m, v, static_cast<L*>(lp), static_cast<L*>(peer), lo_buf, r, c, norm,
          scale_dev, nullptr);
    }
    LS_CHECK_LAUNCH("adam_step", stream);
  }
  if (sq_out != nullptr) {  // no partials (every range empty): 0
    sqrt_sum_kernel<<<1, kNormThreads, 0, stream>>>(sq_ws, partials, sq_out);
    LS_CHECK_LAUNCH("adam_step norm", stream);
  }
}

static AdamCoef adam_coef(const AdamArgs& a) {
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
  return c;
}

void adam_step_ranges(DType grad_dt, DType lp_dt, float* param, const void* grad, float* exp_avg, float* exp_avg_sq,
                      void* param_lp, void* param_lp_peer, const int64_t* bounds, int count, AdamArgs a,
                      const float* norm, const float* scale_dev, float* sq_ws, float* sq_out, cudaStream_t stream) {
  if (count <= 0) return;
  const AdamCoef c = adam_coef(a);
  LS_DISPATCH(grad_dt, G, {
    LS_DISPATCH(lp_dt, L, launch_adam<G, L, false>(param, grad, exp_avg, exp_avg_sq, param_lp, param_lp_peer, nullptr,
                                                   bounds, count, c, norm, scale_dev, sq_ws, sq_out, stream));
  });
}

void adam_step_split_ranges(DType grad_dt, void* weights, int16_t* lo, const void* grad, float* exp_avg,
                            float* exp_avg_sq, void* weights_peer, const int64_t* bounds, int count, AdamArgs a,
                            const float* norm, const float* scale_dev, float* sq_ws, float* sq_out,
                            cudaStream_t stream) {
  if (count <= 0) return;
  const AdamCoef c = adam_coef(a);
  LS_DISPATCH(grad_dt, G, {
    launch_adam<G, __nv_bfloat16, true>(nullptr, grad, exp_avg, exp_avg_sq, weights, weights_peer, lo, bounds, count,
                                        c, norm, scale_dev, sq_ws, sq_out, stream);
  });
}

// ================================================================ grad norm

int64_t grad_norm_workspace() { return kNormMaxBlocks; }

// Per-block sums of squares over the ranges of r (in order); `accumulate`: add to the partials of an earlier
// launch (more ranges than one launch takes) instead of overwriting them.
template <typename T>
__global__ void __launch_bounds__(kNormThreads) sumsq_partial_kernel(const T* __restrict__ g, FlatRanges r,
                                                                     bool accumulate, float* __restrict__ partial) {
  float s = 0.f;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  const int64_t tid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  for (int k = 0; k < r.count; ++k) {
    const T* x = g + r.lo[k];
    const int64_t n = r.n[k];
    int64_t done = 0;
    if ((r.vec >> k) & 1) {
      const int64_t n8 = n / 8;
      for (int64_t q = tid; q < n8; q += stride) {
        float v[8];
        load8(x + q * 8, v);
#pragma unroll
        for (int j = 0; j < 8; ++j) s += v[j] * v[j];
      }
      done = n8 * 8;
    }
    for (int64_t i = done + tid; i < n; i += stride) {
      const float v = to_f(x[i]);
      s += v * v;
    }
  }
  s = block_sum<kNormThreads>(s);
  if (threadIdx.x == 0) partial[blockIdx.x] = accumulate ? partial[blockIdx.x] + s : s;
}

__global__ void __launch_bounds__(kNormThreads) sqrt_sum_kernel(const float* __restrict__ partial, int G,
                                                                float* __restrict__ out) {
  float s = 0.f;
  for (int i = threadIdx.x; i < G; i += kNormThreads) s += partial[i];
  s = block_sum<kNormThreads>(s);
  if (threadIdx.x == 0) *out = sqrtf(s);
}

void grad_norm_ranges(DType dt, const void* grad, const int64_t* bounds, int count, float* workspace, float* out,
                      cudaStream_t stream) {
  int64_t total = 0;
  for (int k = 0; k < count; ++k) total += std::max<int64_t>(0, bounds[2 * k + 1] - bounds[2 * k]);
  const int G = (int)std::max<int64_t>(1, std::min<int64_t>((total / 8 + kNormThreads - 1) / kNormThreads,
                                                            std::min(kNormMaxBlocks, num_sms() * 4)));
  const size_t esize = dt == DType::F32 ? 4 : 2;
  const auto vec_ok = [&](int64_t lo) { return aligned16(static_cast<const char*>(grad) + lo * esize); };
  int first = 0;
  for (bool first_launch = true;; first_launch = false) {
    FlatRanges r;
    int64_t taken;
    first = take_ranges(bounds, count, first, vec_ok, r, taken);
    if (r.count == 0 && !first_launch) break;  // the first launch runs even when empty: it zeroes the partials
    LS_DISPATCH(dt, T, {
      sumsq_partial_kernel<T><<<G, kNormThreads, 0, stream>>>(static_cast<const T*>(grad), r, !first_launch,
                                                               workspace);
      LS_CHECK_LAUNCH("grad_norm partial", stream);
    });
    if (first >= count) break;
  }
  sqrt_sum_kernel<<<1, kNormThreads, 0, stream>>>(workspace, G, out);
  LS_CHECK_LAUNCH("grad_norm", stream);
}

}  // namespace ls
