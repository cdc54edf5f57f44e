// The layer norm's row arithmetic, shared by layer_norm.cu (the layer norm itself) and fp8.cu (the layer norm that
// writes FP8 codes): both compute a row's mean, rstd and outputs by the same code, so the codes of the latter are
// exactly those of quantising the former's output.
//
// Layout: TX threads per row, each owning 8 consecutive columns (vector loads when C % 8 == 0 and the pointers
// are 16-byte aligned), TY rows per block; a row's sums go over its TX threads in a fixed order.
#pragma once

#include "kernels/common.cuh"

namespace ls {

constexpr int kMaxC = 8192;

struct LnShape {
  int tx, ty;
};

inline LnShape ln_shape(int C) {
  int tx = ((C + 7) / 8 + 31) / 32 * 32;
  int ty = tx >= 256 ? 1 : 256 / tx;
  return {tx, ty};
}

// Sums v over the TX threads of this thread's row; all threads of the block must call it.
__device__ __forceinline__ float2 row_sum2(float2 v, float2* red) {
  v.x = warp_sum(v.x);
  v.y = warp_sum(v.y);
  const int lin = threadIdx.y * blockDim.x + threadIdx.x;
  const int warps_per_row = blockDim.x / 32;
  if ((lin & 31) == 0) red[lin >> 5] = v;
  __syncthreads();
  float2 s = make_float2(0.f, 0.f);
  for (int w = 0; w < warps_per_row; ++w) {
    float2 t = red[threadIdx.y * warps_per_row + w];
    s.x += t.x;
    s.y += t.y;
  }
  __syncthreads();
  return s;
}

template <bool VEC, typename T>
__device__ __forceinline__ void ld(const T* p, int n, float (&v)[8]) {
  if (VEC) load8(p, v); else load_n(p, n, v);
}
template <bool VEC, typename T>
__device__ __forceinline__ void st(T* p, int n, const float (&v)[8]) {
  if (VEC) store8(p, v); else store_n(p, n, v);
}

// mean = sum(v) / C and rstd = 1 / sqrt(sum((v - mean)^2) / C + eps) of this thread's row (v: this thread's 8 columns,
// the first n of them in the row, the others 0); all threads of the block must call it.
__device__ __forceinline__ void ln_row_stats(const float (&v)[8], int n, int C, float eps, float2* red, float& mean,
                                             float& rstd) {
  float s = 0.f;
#pragma unroll
  for (int k = 0; k < 8; ++k) s += v[k];
  mean = row_sum2(make_float2(s, 0.f), red).x / C;
  float q = 0.f;
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    const float d = k < n ? v[k] - mean : 0.f;
    q += d * d;
  }
  const float var = row_sum2(make_float2(q, 0.f), red).x / C;
  rstd = rsqrtf(var + eps);
}

// y = (v - mean) * rstd * gamma + beta, before its rounding to the storage type
__device__ __forceinline__ void ln_affine(const float (&v)[8], float mean, float rstd, const float (&g)[8],
                                          const float (&b)[8], float (&o)[8]) {
#pragma unroll
  for (int k = 0; k < 8; ++k) o[k] = (v[k] - mean) * rstd * g[k] + b[k];
}

}  // namespace ls
