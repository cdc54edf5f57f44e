// Shared device helpers for the ls_fairseq kernels: ATen-free.
//
// - Storage types float / __half / __nv_bfloat16; all arithmetic is fp32 (to_f / from_f).
// - Vec8<T>: 8 contiguous elements loaded/stored as one (fp16/bf16: 16 bytes) or two (fp32)
//   vector transactions; callers fall back to scalar access when alignment is not given.
// - Philox4x32-10 (counter-based RNG, Salmon et al. 2011), keyed by the seed and offset that
//   the adapter takes from torch's CUDA generator, so torch.manual_seed reproduces a pattern.
//   One Philox call gives 128 bits = 8 x 16-bit uniforms, which drive the dropout decisions
//   of one group of 8 consecutive elements (flat index 8g .. 8g+7): keep <=> u16 >= round(p * 65536).
//   The keep decisions are stored as a bitmask, one byte per group (bit k = element 8g+k).
// - LS_CHECK_LAUNCH(stream): checks every launch; with -DLS_FAIRSEQ_DEBUG_SYNC also syncs.
#pragma once

#include <cstdint>
#include <cstdio>
#include <type_traits>
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>

#include "kernels/launch.h"

namespace ls {

// ---------------------------------------------------------------- type conversion
__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// v[k] = to_f(from_f<T>(v[k])): the values as T stores them. bf16 rounds two values in one instruction and widens
// them back by moving bits; the other types round one at a time.
template <typename T, int N>
__device__ __forceinline__ void round_as(float (&v)[N]) {
  static_assert(N % 2 == 0, "pairs");
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
#pragma unroll
    for (int k = 0; k < N; k += 2) {
      const __nv_bfloat162 h = __floats2bfloat162_rn(v[k], v[k + 1]);  // .x = v[k] in the low half
      const uint32_t u = *reinterpret_cast<const uint32_t*>(&h);
      v[k] = __uint_as_float(u << 16);
      v[k + 1] = __uint_as_float(u & 0xffff0000u);
    }
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) v[k] = to_f(from_f<T>(v[k]));
  }
}

// ---------------------------------------------------------------- 8-element vectors
template <typename T>
struct alignas(16) Raw8 { T v[8]; };

// Load 8 elements starting at p (vector when `vec`, which requires 16-byte alignment of p for
// 2-byte types and 32-byte ... we only need 16: fp32 is read as two float4).
template <typename T>
__device__ __forceinline__ void load8(const T* __restrict__ p, float (&out)[8]) {
  if constexpr (sizeof(T) == 2) {
    uint4 u = *reinterpret_cast<const uint4*>(p);
    const T* t = reinterpret_cast<const T*>(&u);
#pragma unroll
    for (int k = 0; k < 8; ++k) out[k] = to_f(t[k]);
  } else {
    float4 a = reinterpret_cast<const float4*>(p)[0];
    float4 b = reinterpret_cast<const float4*>(p)[1];
    out[0] = a.x; out[1] = a.y; out[2] = a.z; out[3] = a.w;
    out[4] = b.x; out[5] = b.y; out[6] = b.z; out[7] = b.w;
  }
}

template <typename T>
__device__ __forceinline__ void store8(T* __restrict__ p, const float (&in)[8]) {
  if constexpr (sizeof(T) == 2) {
    uint4 u;
    T* t = reinterpret_cast<T*>(&u);
#pragma unroll
    for (int k = 0; k < 8; ++k) t[k] = from_f<T>(in[k]);
    *reinterpret_cast<uint4*>(p) = u;
  } else {
    reinterpret_cast<float4*>(p)[0] = make_float4(in[0], in[1], in[2], in[3]);
    reinterpret_cast<float4*>(p)[1] = make_float4(in[4], in[5], in[6], in[7]);
  }
}

// Scalar fallback: elements p[0..n), n <= 8, missing ones are 0.
template <typename T>
__device__ __forceinline__ void load_n(const T* __restrict__ p, int n, float (&out)[8]) {
#pragma unroll
  for (int k = 0; k < 8; ++k) out[k] = k < n ? to_f(p[k]) : 0.f;
}
template <typename T>
__device__ __forceinline__ void store_n(T* __restrict__ p, int n, const float (&in)[8]) {
#pragma unroll
  for (int k = 0; k < 8; ++k)
    if (k < n) p[k] = from_f<T>(in[k]);
}

// ---------------------------------------------------------------- reductions
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// ---------------------------------------------------------------- Philox4x32-10
// Seed/offset as torch's generator hands them out; when a CUDA graph is being captured the
// values live in device memory (seed_ptr / offset_ptr) and are read at kernel run time.

__device__ __forceinline__ void philox_unpack(const PhiloxArgs& a, uint64_t& seed, uint64_t& offset) {
  if (a.captured) {
    seed = static_cast<uint64_t>(*a.seed_ptr);
    offset = static_cast<uint64_t>(*a.offset_ptr) + a.offset_intragraph;
  } else {
    seed = a.seed;
    offset = a.offset;
  }
}

__device__ __forceinline__ uint4 philox4x32_10(uint64_t counter_lo, uint64_t counter_hi, uint64_t key) {
  uint32_t c0 = (uint32_t)counter_lo, c1 = (uint32_t)(counter_lo >> 32);
  uint32_t c2 = (uint32_t)counter_hi, c3 = (uint32_t)(counter_hi >> 32);
  uint32_t k0 = (uint32_t)key, k1 = (uint32_t)(key >> 32);
#pragma unroll
  for (int r = 0; r < 10; ++r) {
    uint32_t hi0 = __umulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
    uint32_t hi1 = __umulhi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
    uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
    c0 = n0; c1 = lo1; c2 = n2; c3 = lo0;
    k0 += 0x9E3779B9u; k1 += 0xBB67AE85u;
  }
  return make_uint4(c0, c1, c2, c3);
}

// Keep bits (bit k = keep element k) of group g. threshold = round(p * 65536).
__device__ __forceinline__ uint32_t dropout_bits(uint64_t g, uint64_t seed, uint64_t offset, uint32_t threshold) {
  const uint4 r = philox4x32_10(g, offset, seed);
  if (threshold > 0xFFFFu) return 0u;  // p rounds to 1: no 16-bit draw reaches it
  // element 2i draws the low half of word i, element 2i + 1 its high half; each compared in place, unmasked:
  // lo >= threshold iff (w << 16) >= (threshold << 16), hi >= threshold iff w >= (threshold << 16)
  const uint32_t t = threshold << 16;
  const uint32_t w[4] = {r.x, r.y, r.z, r.w};
  uint32_t bits = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    bits |= (w[i] << 16) >= t ? 1u << (2 * i) : 0u;
    bits |= w[i] >= t ? 1u << (2 * i + 1) : 0u;
  }
  return bits;
}

inline uint32_t dropout_threshold(float p) {
  double t = static_cast<double>(p) * 65536.0 + 0.5;
  if (t < 0) t = 0;
  if (t > 65536.0) t = 65536.0;
  return static_cast<uint32_t>(t);
}

// ---------------------------------------------------------------- activations (fp32)
__device__ __forceinline__ float gelu_f(float x) { return 0.5f * x * (1.f + erff(x * 0.70710678118654752f)); }
__device__ __forceinline__ float gelu_grad_f(float x) {
  const float cdf = 0.5f * (1.f + erff(x * 0.70710678118654752f));
  const float pdf = 0.39894228040143268f * __expf(-0.5f * x * x);
  return cdf + x * pdf;
}

template <Act A>
__device__ __forceinline__ float act_f(float x) {
  if constexpr (A == Act::Relu) return fmaxf(x, 0.f);
  else if constexpr (A == Act::Gelu) return gelu_f(x);
  else return x;
}

// ---------------------------------------------------------------- misc
inline int ceil_div(int64_t a, int64_t b) { return static_cast<int>((a + b - 1) / b); }

inline int num_sms() {
  int dev = 0, n = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev);
  return n > 0 ? n : 80;
}

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// How many blocks of `threads` threads of the kernel K the GPU holds at once (its registers and shared memory
// decide): a grid-stride kernel launched with more runs its last blocks after the first ones finish, on a part of the
// GPU. Asked once per kernel and block size (the answer depends on those and the architecture only).
template <auto K, int THREADS>
inline int resident_blocks() {
  static const int per_sm = [] {
    int n = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, K, THREADS, 0) != cudaSuccess) {
      cudaGetLastError();  // cleared: the launch that follows reports its own errors
      n = 0;
    }
    return n > 0 ? n : 1;
  }();
  return per_sm * num_sms();
}

}  // namespace ls

// ---------------------------------------------------------------- dtype dispatch
#define LS_DISPATCH(DT, T, ...)                                  \
  switch (DT) {                                                  \
    case ::ls::DType::F32: { using T = float; __VA_ARGS__; break; }          \
    case ::ls::DType::F16: { using T = __half; __VA_ARGS__; break; }         \
    case ::ls::DType::BF16: { using T = __nv_bfloat16; __VA_ARGS__; break; } \
  }

// ---------------------------------------------------------------- activation dispatch
// The body with A a constexpr ::ls::Act equal to ACT (relu, gelu, or none for any other value).
#define LS_DISPATCH_ACT(ACT, A, ...)                                                          \
  switch (ACT) {                                                                              \
    case ::ls::Act::Relu: { constexpr ::ls::Act A = ::ls::Act::Relu; __VA_ARGS__; break; }    \
    case ::ls::Act::Gelu: { constexpr ::ls::Act A = ::ls::Act::Gelu; __VA_ARGS__; break; }    \
    default: { constexpr ::ls::Act A = ::ls::Act::None; __VA_ARGS__; break; }                 \
  }
