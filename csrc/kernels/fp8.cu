// Per-tensor FP8 quantisation with current scaling, for the FP8 linear layers (csrc/torch/fp8.cpp).
//
// Numerics. A tensor x is stored as q = fp8(x * s) with one fp32 scale s per tensor, chosen from the tensor's
// own absolute maximum amax (current scaling: no history, nothing to go stale after a loss-scale change):
//
//     amax = f * 2^E with f in [0.5, 1)          (frexp)
//     k    = F - E  if f <= 0.875,  F - E - 1 otherwise,   F = 9 (e4m3, max 448 = 0.875 * 2^9)
//                                                            F = 16 (e5m2, max 57344 = 0.875 * 2^16)
//     s    = 2^k, k clamped to [-126, 126];  s = 1 when amax = 0;  s = NaN when amax is inf or NaN
//
// i.e. the largest power of two with amax * s <= the format's largest finite value. A power of two makes
// x * s exact in fp32 and the GEMM's dequantisation factor 1/s exact, so the only rounding is the one to FP8
// (round to nearest even; no value can exceed the format's maximum, so saturation never acts). A non-finite
// amax gives NaN scales and NaN outputs: an fp16 overflow in a gradient still reaches the optimizer's check.
// ls_fairseq/ops/fp8.py holds the same rule in plain PyTorch (the reference the tests compare with).
//
// Two launches per tensor: the amax (|x| compared as unsigned bit patterns, so NaN > inf > every finite
// value; block maxima go to one device word with atomicMax) and the cast, which reads amax, derives s and
// writes q and 1/s. The amax word is zeroed by the launcher.
#include <cuda_fp8.h>

#include "kernels/common.cuh"

namespace ls {

namespace {

constexpr int kFp8Threads = 256;
constexpr int kFp8MaxBlocks = 1184;  // 8 per SM on a 148-SM chip: enough to fill the grid-stride loops

__device__ __forceinline__ float fp8_scale_from_bits(unsigned amax_bits, Fp8Format fmt) {
  const float amax = __uint_as_float(amax_bits);
  if (amax_bits >= 0x7f800000u) return __int_as_float(0x7fc00000);  // inf or NaN: NaN scale
  if (amax_bits == 0u) return 1.f;
  int E;
  const float f = frexpf(amax, &E);
  const int F = fmt == Fp8Format::E4M3 ? 9 : 16;
  int k = f <= 0.875f ? F - E : F - E - 1;
  k = k < -126 ? -126 : (k > 126 ? 126 : k);
  return ldexpf(1.f, k);
}

template <typename T>
__global__ void fp8_amax_kernel(const T* __restrict__ x, int64_t n, bool vec, unsigned* __restrict__ amax_bits) {
  unsigned m = 0u;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  const int64_t tid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  int64_t done = 0;
  if (vec) {
    const int64_t groups = n / 8;
    for (int64_t g = tid; g < groups; g += stride) {
      float v[8];
      load8(x + g * 8, v);
#pragma unroll
      for (int k = 0; k < 8; ++k) m = max(m, __float_as_uint(fabsf(v[k])));
    }
    done = groups * 8;
  }
  for (int64_t i = done + tid; i < n; i += stride) m = max(m, __float_as_uint(fabsf(to_f(x[i]))));
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, o));
  __shared__ unsigned warp_max[kFp8Threads / 32];
  if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = m;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < (int)(blockDim.x >> 5); ++w) m = max(m, warp_max[w]);
    atomicMax(amax_bits, m);
  }
}

__device__ __forceinline__ uint16_t to_fp8x2(float a, float b, Fp8Format fmt) {
  const __nv_fp8_interpretation_t kind = fmt == Fp8Format::E4M3 ? __NV_E4M3 : __NV_E5M2;
  return (uint16_t)__nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, kind);
}

__device__ __forceinline__ uint8_t to_fp8(float a, Fp8Format fmt) {
  const __nv_fp8_interpretation_t kind = fmt == Fp8Format::E4M3 ? __NV_E4M3 : __NV_E5M2;
  return (uint8_t)__nv_cvt_float_to_fp8(a, __NV_SATFINITE, kind);
}

template <typename T>
__global__ void fp8_cast_kernel(const T* __restrict__ x, int64_t n, bool vec, const unsigned* __restrict__ amax_bits,
                                Fp8Format fmt, uint8_t* __restrict__ out, float* __restrict__ scale_inv) {
  const float s = fp8_scale_from_bits(*amax_bits, fmt);
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  const int64_t tid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (tid == 0) *scale_inv = 1.f / s;  // exact: s is a power of two (or NaN)
  int64_t done = 0;
  if (vec) {  // 8 inputs in, 8 bytes out
    const int64_t groups = n / 8;
    for (int64_t g = tid; g < groups; g += stride) {
      float v[8];
      load8(x + g * 8, v);
      uint2 packed;
      uint16_t* h = reinterpret_cast<uint16_t*>(&packed);
#pragma unroll
      for (int k = 0; k < 4; ++k) h[k] = to_fp8x2(v[2 * k] * s, v[2 * k + 1] * s, fmt);
      *reinterpret_cast<uint2*>(out + g * 8) = packed;
    }
    done = groups * 8;
  }
  for (int64_t i = done + tid; i < n; i += stride) out[i] = to_fp8(to_f(x[i]) * s, fmt);
}

int fp8_blocks(int64_t n) {
  const int64_t b = (n / 8 + kFp8Threads - 1) / kFp8Threads;
  return (int)(b < 1 ? 1 : (b > kFp8MaxBlocks ? kFp8MaxBlocks : b));
}

}  // namespace

// ---------------------------------------------------------------- launchers

void fp8_quantize(DType dt, const void* x, int64_t n, Fp8Format fmt, unsigned* amax_bits, void* out,
                  float* scale_inv, cudaStream_t stream) {
  const bool vec = reinterpret_cast<uintptr_t>(x) % 16 == 0 && reinterpret_cast<uintptr_t>(out) % 8 == 0;
  const int blocks = fp8_blocks(n);
  if (cudaMemsetAsync(amax_bits, 0, sizeof(unsigned), stream) != cudaSuccess) check_launch("fp8_amax (memset)", stream);
  LS_DISPATCH(dt, T, fp8_amax_kernel<T><<<blocks, kFp8Threads, 0, stream>>>(static_cast<const T*>(x), n, vec,
                                                                              amax_bits));
  check_launch("fp8_amax", stream);
  LS_DISPATCH(dt, T, fp8_cast_kernel<T><<<blocks, kFp8Threads, 0, stream>>>(static_cast<const T*>(x), n, vec,
                                                                              amax_bits, fmt,
                                                                              static_cast<uint8_t*>(out), scale_inv));
  check_launch("fp8_cast", stream);
}

}  // namespace ls
