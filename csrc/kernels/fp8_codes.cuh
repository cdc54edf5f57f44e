// What every kernel that writes FP8 codes shares (fp8.cu's casts, cross_entropy.cu's head): the conversion of two
// values to codes and the absolute maximum as an ordered bit pattern.
#pragma once

#include <cuda_fp8.h>

#include "kernels/common.cuh"

namespace ls {

// |v| as an unsigned bit pattern: for non-negative floats the integer order is the float order, NaN above inf
__device__ __forceinline__ unsigned abs_bits(float v) { return __float_as_uint(v) & 0x7fffffffu; }

// two codes (round to nearest even, beyond the format's range saturated to its largest finite value)
__device__ __forceinline__ uint16_t to_fp8x2(float a, float b, Fp8Format fmt) {
  const __nv_fp8_interpretation_t kind = fmt == Fp8Format::E4M3 ? __NV_E4M3 : __NV_E5M2;
  return (uint16_t)__nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, kind);
}

// The codes of the N values v under scale s, packed in order into a Word of N bytes; m takes their absolute maximum
template <typename Word, int N>
__device__ __forceinline__ Word to_codes(const float (&v)[N], float s, Fp8Format fmt, unsigned& m) {
  static_assert(sizeof(Word) == N && N % 2 == 0, "one byte per value");
  Word packed;
  uint16_t* h = reinterpret_cast<uint16_t*>(&packed);
#pragma unroll
  for (int k = 0; k < N / 2; ++k) {
    m = max(m, max(abs_bits(v[2 * k]), abs_bits(v[2 * k + 1])));
    h[k] = to_fp8x2(v[2 * k] * s, v[2 * k + 1] * s, fmt);
  }
  return packed;
}

// The block's maximum of m (THREADS threads), valid in thread 0; every thread must call it.
template <int THREADS>
__device__ __forceinline__ unsigned block_max_bits(unsigned m) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, o));
  __shared__ unsigned warp_max[THREADS / 32];
  __syncthreads();  // warp_max may still be read from an earlier call
  if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = m;
  __syncthreads();
  if (threadIdx.x == 0)
    for (int w = 1; w < THREADS / 32; ++w) m = max(m, warp_max[w]);
  return m;
}

// Delayed scaling's record of a tensor's maximum m (a block's part of it) in its state row: the row's amax, and a
// NaN 1/s when m is inf or NaN (the GEMM's product is then NaN, which the optimizer's overflow check sees).
__device__ __forceinline__ void record_amax(float* row, unsigned m) {
  atomicMax(reinterpret_cast<unsigned*>(row + kFp8Amax), m);
  if (m >= 0x7f800000u) row[kFp8ScaleInv] = __int_as_float(0x7fc00000);
}

}  // namespace ls
