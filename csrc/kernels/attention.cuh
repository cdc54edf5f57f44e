// What the short-sequence attention kernels (attention.cu: forward, attention_bwd.cu: backward) share: the
// tensor-core fragments (mma.sync m16n8k16 over ldmatrix loads, sm_80+), the shared-memory staging and layout, one
// CTA's sequence (padded or packed), and the launchers' helpers (shared-memory limits, the dtype / head-dim
// dispatch, the per-class launches of packed sequences).
#pragma once

#include <atomic>
#include <type_traits>

#include "kernels/common.cuh"

namespace ls {

namespace {

constexpr float kLog2e = 1.4426950408889634f;

__host__ __device__ constexpr int round16(int x) { return (x + 15) / 16 * 16; }

// the longest query / key length a launch's CTAs are sized for: the tensors' (Tq, Tk), or for a launch over one
// class of packed sequences (lo, hi], at most hi
__host__ __device__ inline int cap_q(const ShortAttentionArgs& a) { return a.hi > 0 && a.hi < a.Tq ? a.hi : a.Tq; }
__host__ __device__ inline int cap_k(const ShortAttentionArgs& a) { return a.hi > 0 && a.hi < a.Tk ? a.hi : a.Tk; }

// ---------------------------------------------------------------- tensor-core fragments (sm_80+)
// mma.sync m16n8k16 with a row-major A (16 x 16: a[0] rows g, a[1] rows g + 8, a[2] / a[3] the same at k + 8) and
// a column-major B (16 x 8), fp32 C (c[0], c[1]: row g, columns 2t, 2t + 1; c[2], c[3]: row g + 8), where
// g = lane / 4 and t = lane % 4; each register of A and B holds two consecutive-k elements.
template <typename T>
__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same<T, __half>::value) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// two floats as the storage type's pair (the first in the low half: the lower k or column)
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (std::is_same<T, __half>::value) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  } else {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  }
}

template <bool TRANS>
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void* p) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p));
  if constexpr (TRANS)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}

// A fragment: rows [m0, m0 + 16), k [k0, k0 + 16) of a row-major shared matrix (row stride ld elements)
template <typename T>
__device__ __forceinline__ void load_a(uint32_t (&a)[4], const T* base, int ld, int m0, int k0) {
  const int lane = threadIdx.x & 31, m = lane >> 3, r = lane & 7;
  ldsm_x4<false>(a, base + (m0 + r + (m & 1) * 8) * ld + k0 + (m >> 1) * 8);
}
// A fragment of A = S^T: S stored row-major with rows = k, columns = m
template <typename T>
__device__ __forceinline__ void load_a_t(uint32_t (&a)[4], const T* base, int ld, int m0, int k0) {
  const int lane = threadIdx.x & 31, m = lane >> 3, r = lane & 7;
  ldsm_x4<true>(a, base + (k0 + r + (m >> 1) * 8) * ld + m0 + (m & 1) * 8);
}
// B fragments of two n-tiles (b[0], b[1]: columns [n0, n0 + 8); b[2], b[3]: [n0 + 8, n0 + 16)) for k [k0, k0 + 16)
// from a shared matrix stored with rows = n, columns = k (B^T row-major: k of S = q k^T)
template <typename T>
__device__ __forceinline__ void load_b_nk(uint32_t (&b)[4], const T* base, int ld, int n0, int k0) {
  const int lane = threadIdx.x & 31, m = lane >> 3, r = lane & 7;
  ldsm_x4<false>(b, base + (n0 + r + (m >> 1) * 8) * ld + k0 + (m & 1) * 8);
}
// the same from a shared matrix stored with rows = k, columns = n (B row-major: v of P v)
template <typename T>
__device__ __forceinline__ void load_b_kn(uint32_t (&b)[4], const T* base, int ld, int k0, int n0) {
  const int lane = threadIdx.x & 31, m = lane >> 3, r = lane & 7;
  ldsm_x4<true>(b, base + (k0 + r + (m & 1) * 8) * ld + n0 + (m >> 1) * 8);
}

// ---------------------------------------------------------------- shared memory
// 16 bytes global -> shared without passing through registers (sm_80+); valid == false writes zeros
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  const int n = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(n));
}
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::); }

// starts copying rows [0, n) of a strided [*, D] matrix into shared memory (row stride ld), rows [n, n_pad) zero
template <typename T, int D>
__device__ __forceinline__ void load_rows(T* dst, int ld, const T* src, int64_t row_stride, int n, int n_pad) {
  constexpr int V = D / 8;  // 16-byte vectors per row
  for (int e = threadIdx.x; e < n_pad * V; e += blockDim.x) {
    const int r = e / V, c = (e - r * V) * 8;
    cp_async16(dst + r * ld + c, r < n ? src + r * row_stride + c : src, r < n);
  }
}

// one warp: the fp32 accumulators acc[D / 8][4] of rows [r0, r0 + 16) as T into shared rows (stride ld), then
// rows [r0, min(r0 + 16, n)) to global memory (row stride row_stride), 16 bytes at a time
template <typename T, int D>
__device__ __forceinline__ void warp_store_rows(T* out, int64_t row_stride, int n, T* stage, int ld, int r0,
                                                const float (&acc)[D / 8][4]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int e = 0; e < D / 8; ++e) {
    *reinterpret_cast<uint32_t*>(stage + (r0 + g) * ld + 8 * e + 2 * t) = pack2<T>(acc[e][0], acc[e][1]);
    *reinterpret_cast<uint32_t*>(stage + (r0 + g + 8) * ld + 8 * e + 2 * t) = pack2<T>(acc[e][2], acc[e][3]);
  }
  __syncwarp();
  constexpr int V = D / 8;
  for (int e = lane; e < 16 * V; e += 32) {
    const int r = e / V, c = (e - r * V) * 8;
    if (r0 + r < n)
      *reinterpret_cast<uint4*>(out + (r0 + r) * row_stride + c) =
          *reinterpret_cast<const uint4*>(stage + (r0 + r) * ld + c);
  }
  __syncwarp();
}

// Shared-memory layout; TQ, TK: the lengths rounded up to 16.
template <typename T, int D>
struct Smem {
  static constexpr int LD = D + 8;  // rows of q, k, v, dout (T): 16-byte aligned, ldmatrix without bank conflicts
  int TQ, TK, LDQ;                  // LDQ: rows of dS^T (T), TQ + 8
  int KB;                           // bytes of a query row's keep bits in shared memory, ceil(Tk / 8)
  size_t q, k, v, dout, ds, delta, lse, keep, att, total;
  __host__ __device__ static size_t take(size_t& o, size_t bytes) {
    const size_t at = o;
    o += (bytes + 127) / 128 * 128;
    return at;
  }
  __host__ __device__ Smem(int Tq, int Tk, bool backward) {
    TQ = round16(Tq);
    TK = round16(Tk);
    LDQ = TQ + 8;
    KB = (Tk + 7) / 8;
    size_t o = 0;
    q = take(o, sizeof(T) * TQ * LD);
    k = take(o, sizeof(T) * TK * LD);
    v = take(o, sizeof(T) * TK * LD);
    dout = backward ? take(o, sizeof(T) * TQ * LD) : 0;
    // dS^T; before it, out (for delta)
    const size_t ds_elems = (size_t)TK * LDQ > (size_t)TQ * LD ? (size_t)TK * LDQ : (size_t)TQ * LD;
    ds = backward ? take(o, sizeof(T) * ds_elems) : 0;
    delta = backward ? take(o, sizeof(float) * TQ) : 0;
    lse = backward ? take(o, sizeof(float) * TQ) : 0;
    keep = backward ? take(o, (size_t)TQ * KB) : 0;
    att = take(o, TK);
    total = o;
  }
};

// One CTA's sequence: batch entry b, head h, its lengths and the first rows of its queries and keys (0 when
// padded; packed: cu_q[b], cu_k[b], with the lengths cut to the longest the launch was sized for).
struct Seq {
  int b, h, tq, tk;
  int64_t q0, k0;
  __device__ Seq(const ShortAttentionArgs& a, int bh) {
    b = bh / a.H;
    h = bh - b * a.H;
    if (a.cu_q != nullptr) {
      q0 = a.cu_q[b];
      k0 = a.cu_k[b];
      tq = min(max(a.cu_q[b + 1] - a.cu_q[b], 0), a.Tq);
      tk = min(max(a.cu_k[b + 1] - a.cu_k[b], 0), a.Tk);
    } else {
      q0 = k0 = 0;
      tq = a.Tq;
      tk = a.Tk;
    }
  }
  // whether this launch takes the sequence: its longer length in the launch's class (lo, hi], or every sequence
  __device__ bool in_launch(const ShortAttentionArgs& a) const {
    const int m = tq > tk ? tq : tk;
    return a.hi == 0 || (m > a.lo && m <= a.hi);
  }
  // the first element of this sequence's head in a tensor of (batch, head, row) strides s (packed: batch stride 0)
  __device__ int64_t at(const int64_t (&s)[3], int64_t row0) const { return b * s[0] + h * s[1] + row0 * s[2]; }
};

// att[j] = 1 where key j exists and is not padding (the padding is the same for every query row)
__device__ __forceinline__ void load_keys(uint8_t* att, const ShortAttentionArgs& a, const Seq& sq, int TK) {
  for (int j = threadIdx.x; j < TK; j += blockDim.x)
    att[j] = j < sq.tk && (a.attend == nullptr || a.attend[(int64_t)sq.b * a.Tk + j] != 0);
}

}  // namespace

// ---------------------------------------------------------------- launchers' helpers
namespace {

// Raises (never lowers) a kernel's dynamic shared-memory limit on the current device to `bytes`: a CUDA graph
// captured earlier with a larger launch of the same kernel must stay launchable. `allowed`: the kernel's limits so
// far, per device. Also asks for the largest shared-memory carveout (below).
template <typename K>
void allow_smem(K* kern, std::atomic<int> (&allowed)[64], size_t bytes) {
  int dev = 0;
  cudaGetDevice(&dev);
  if (dev >= 0 && dev < 64 && static_cast<int>(bytes) <= allowed[dev].load(std::memory_order_relaxed)) return;
  cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
  // all of the SM's unified memory as shared memory: the CTAs' loads bypass L1 (cp.async.cg), and the default split
  // leaves less shared memory than the backward's short-sequence CTAs need to fill an SM as their registers allow
  cudaFuncSetAttribute(kern, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared);
  if (dev >= 0 && dev < 64) {
    int seen = allowed[dev].load(std::memory_order_relaxed);
    while (static_cast<int>(bytes) > seen && !allowed[dev].compare_exchange_weak(seen, static_cast<int>(bytes))) {
    }
  }
}

#define LS_SHORT_ATTN_DISPATCH(a, FN, ...)                                                          \
  do {                                                                                              \
    if ((a).dt == DType::F16) {                                                                     \
      if ((a).D == 32) FN<__half, 32>(__VA_ARGS__);                                                 \
      else if ((a).D == 64) FN<__half, 64>(__VA_ARGS__);                                            \
      else FN<__half, 128>(__VA_ARGS__);                                                            \
    } else {                                                                                        \
      if ((a).D == 32) FN<__nv_bfloat16, 32>(__VA_ARGS__);                                          \
      else if ((a).D == 64) FN<__nv_bfloat16, 64>(__VA_ARGS__);                                     \
      else FN<__nv_bfloat16, 128>(__VA_ARGS__);                                                     \
    }                                                                                               \
  } while (0)

// the head dims and lengths the kernels are built for
bool shape_ok(int64_t Tq, int64_t Tk, int64_t D) {
  return (D == 32 || D == 64 || D == 128) && Tq >= 1 && Tk >= 1 && Tq <= kShortAttentionMax &&
         Tk <= kShortAttentionMax;
}

void check_args(const ShortAttentionArgs& a) {
  if (a.dt == DType::F32 || !shape_ok(a.Tq, a.Tk, a.D))
    throw std::runtime_error("short_attention: unsupported shape or dtype (the adapter should have fallen back)");
}

// Packed sequences of mixed lengths: one launch per class of lengths (0, 32], (32, 64], (64, 128] up to the
// longest, each sized for its class, so that a short sequence's CTA takes the shared memory (and the
// occupancy) of its class rather than of the longest sequence. Padded tensors: one launch.
template <typename F>
void per_class(const ShortAttentionArgs& a, F&& launch) {
  if (a.cu_q == nullptr) return launch(a);
  const int longest = a.Tq > a.Tk ? a.Tq : a.Tk;
  for (int lo = 0, hi = 32; lo < longest; lo = hi, hi *= 2) {
    ShortAttentionArgs c = a;
    c.lo = lo;
    c.hi = hi;
    launch(c);
  }
}

}  // namespace

}  // namespace ls
