// Attention over short sequences, padded or packed (lengths <= kShortAttentionMax), forward and backward.
//
//   out = dropout(softmax(q k^T / sqrt(D) + masks)) v      q [B, H, Tq, D], k, v [B, H, Tk, D]
//
// Why a kernel of our own: in a --max-tokens batch of sentences most sequences are 16-128 tokens long, and the
// library kernels (flash and memory-efficient) tile 64-128 rows: measured on an H100 at 8192 tokens, 16 heads of
// 64, one forward + backward took 0.19-0.43 ms where moving the tensors once takes about 0.05 (RESULTS.md). Here
// one CTA holds one (sentence, head) whole in shared memory, every tensor is read once and written once, and each
// warp keeps its scores, probabilities and accumulators in registers, multiplying on the tensor cores with
// mma.sync (m16n8k16, fp32 accumulation) over fragments loaded with ldmatrix.
//   forward:  warp w owns query rows [16w, 16w + 16): S = q k^T, the softmax, P v.
//   backward: warp w owns key rows [16w, 16w + 16) (and [16(w + W), ...) with fewer warps W than key blocks): for
//             every block of 16 queries it recomputes S^T and P^T,
//             accumulates dv = P^T dout and dk = dS^T q in registers and leaves dS^T in shared memory; then warp w
//             owns query rows [16w, 16w + 16) again for dq = dS k.
//
// Numerics (as flash attention's): scores and softmax in fp32, the probabilities rounded to the storage type for
// the product with v, the softmax's log-sum-exp kept (fp32, base 2, in units of the scaled score) for the
// backward, which recomputes the probabilities from q, k and it. dS is rounded to the storage type for its two
// products. A query row whose keys are all masked gets probabilities 0 (output 0, gradients 0).
// Masks: attend [B, Tk] (nonzero = attend; nullable) and causal (query i sees keys j <= i + Tk - Tq).
// Packed sequences (cu_q / cu_k offsets, launch.h): sequence b's own lengths and rows, the same masks within it;
// one launch per class of lengths ((0, 32], (32, 64], (64, 128]), its CTAs sized for the class, each computing
// only the 16-row blocks its sequence fills (the other classes' CTAs return at once).
// Dropout: keep bits drawn with Philox (common.cuh) in groups of 8 keys of one query row and stored as a bitmask,
// one byte per group: byte ((b * H + h) * Tq + i) * mask_row + j / 8, bit j % 8 (mask_row = ceil(Tk / 8)); the
// backward reads them (no RNG state crosses from the forward's CUDA graph to the backward's).
// Layout: each tensor is addressed by its (batch, head, row) strides with the head dim contiguous; rows must be
// 16-byte aligned (the adapter checks, and falls back to PyTorch's kernels otherwise). sm_80 or newer.
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

// ================================================================ forward
// KC: the key capacity (TK <= KC) that sizes the score registers
// KC 128 at head dims up to 64: at most 128 registers, so that two CTAs of 8 warps fit an SM (unbounded it took
// 144 and ran one: 16 sentences' heads of 128 tokens at a time)
template <typename T, int D, int KC>
__global__ void __launch_bounds__(256, (KC == 128 && D <= 64) ? 2 : 0)
    short_attention_fwd_kernel(ShortAttentionArgs a, PhiloxArgs rng, uint32_t threshold) {
  extern __shared__ __align__(128) unsigned char smem[];
  constexpr int LD = Smem<T, D>::LD, NT = KC / 8;
  const Smem<T, D> L(cap_q(a), cap_k(a), false);
  T* sq = reinterpret_cast<T*>(smem + L.q);
  T* sk = reinterpret_cast<T*>(smem + L.k);
  T* sv = reinterpret_cast<T*>(smem + L.v);
  uint8_t* att = smem + L.att;
  // lse, keep bits: stored as [B, H, a.Tq] rows (of mask_row bytes), whatever this sequence's lengths
  const int bh = blockIdx.x, mask_row = (a.Tk + 7) / 8;
  const Seq seq(a, bh);
  if (!seq.in_launch(a)) return;  // another launch's class of packed sequences (uniform over the CTA)
  const int Tq = seq.tq, Tk = seq.tk, TQc = round16(Tq), TKc = round16(Tk);
  const int lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3, r0 = (threadIdx.x >> 5) * 16;
  load_rows<T, D>(sq, LD, static_cast<const T*>(a.q) + seq.at(a.q_s, seq.q0), a.q_s[2], Tq, TQc);
  load_rows<T, D>(sk, LD, static_cast<const T*>(a.k) + seq.at(a.k_s, seq.k0), a.k_s[2], Tk, TKc);
  load_rows<T, D>(sv, LD, static_cast<const T*>(a.v) + seq.at(a.v_s, seq.k0), a.v_s[2], Tk, TKc);
  load_keys(att, a, seq, TKc);
  uint64_t seed = 0, offset = 0;
  if (a.p > 0.f) philox_unpack(rng, seed, offset);
  cp_async_wait_all();
  __syncthreads();
  if (r0 >= TQc) return;  // a packed sequence shorter than the longest: this warp has no rows (no barrier follows)

  // S = q k^T for this warp's 16 rows: s[j] is the n-tile of keys [8j, 8j + 8)
  float s[NT][4];
#pragma unroll
  for (int j = 0; j < NT; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
  for (int kk = 0; kk < D; kk += 16) {
    uint32_t qa[4];
    load_a(qa, sq, LD, r0, kk);
#pragma unroll
    for (int jp = 0; jp < NT / 2; ++jp) {
      if (16 * jp < TKc) {
        uint32_t kb[4];
        load_b_nk(kb, sk, LD, 16 * jp, kk);
        mma16816<T>(s[2 * jp], qa, kb[0], kb[1]);
        mma16816<T>(s[2 * jp + 1], qa, kb[2], kb[3]);
      }
    }
  }

  // softmax of rows r0 + g (elements 0, 1) and r0 + g + 8 (elements 2, 3), in registers
  const float scale = a.scale * kLog2e, keep_scale = 1.f / (1.f - a.p);
  const int row[2] = {r0 + g, r0 + g + 8};
  float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int j = 0; j < NT; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int i = row[e >> 1], col = 8 * j + 2 * t4 + (e & 1);
      const bool ok = 8 * j < TKc && i < Tq && att[col] && (!a.causal || col <= i + Tk - Tq);
      s[j][e] = ok ? s[j][e] * scale : -INFINITY;
      mx[e >> 1] = fmaxf(mx[e >> 1], s[j][e]);
    }
  }
  float sum[2] = {0.f, 0.f};
#pragma unroll
  for (int u = 0; u < 2; ++u) {
    mx[u] = fmaxf(mx[u], __shfl_xor_sync(0xffffffffu, mx[u], 1));
    mx[u] = fmaxf(mx[u], __shfl_xor_sync(0xffffffffu, mx[u], 2));
    if (mx[u] == -INFINITY) mx[u] = 0.f;  // no visible key: probabilities 0
  }
#pragma unroll
  for (int j = 0; j < NT; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      s[j][e] = exp2f(s[j][e] - mx[e >> 1]);  // exp2(-inf) = 0 for the masked
      sum[e >> 1] += s[j][e];
    }
  }
  float inv[2];
#pragma unroll
  for (int u = 0; u < 2; ++u) {
    sum[u] += __shfl_xor_sync(0xffffffffu, sum[u], 1);
    sum[u] += __shfl_xor_sync(0xffffffffu, sum[u], 2);
    inv[u] = sum[u] > 0.f ? 1.f / sum[u] : 0.f;
    if (t4 == 0 && row[u] < Tq && a.lse != nullptr)
      a.lse[(int64_t)bh * a.Tq + row[u]] = sum[u] > 0.f ? mx[u] + log2f(sum[u]) : INFINITY;
  }
  // dropout: lane t4 of a quad draws the key groups j = t4, t4 + 4, ... of its two rows; the quad shares them
  uint32_t bits[2][(NT + 3) / 4];
#pragma unroll
  for (int jj = 0; jj < (NT + 3) / 4; ++jj) {
    bits[0][jj] = bits[1][jj] = 0xFFu;
    const int j = 4 * jj + t4;
    if (a.p > 0.f && j < mask_row) {
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        if (row[u] < Tq) {
          const int64_t grp = ((int64_t)bh * a.Tq + row[u]) * mask_row + j;
          bits[u][jj] = dropout_bits((uint64_t)grp, seed, offset, threshold);
          a.mask[grp] = static_cast<uint8_t>(bits[u][jj]);
        }
      }
    }
  }
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    if (a.p > 0.f) {  // uniform across the warp
      const int src = (lane & ~3) | (j & 3);
      const uint32_t b0 = __shfl_sync(0xffffffffu, bits[0][j >> 2], src);
      const uint32_t b1 = __shfl_sync(0xffffffffu, bits[1][j >> 2], src);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const uint32_t by = (e >> 1) ? b1 : b0;
        s[j][e] = ((by >> (2 * t4 + (e & 1))) & 1u) ? s[j][e] * inv[e >> 1] * keep_scale : 0.f;
      }
    } else {
#pragma unroll
      for (int e = 0; e < 4; ++e) s[j][e] *= inv[e >> 1];
    }
  }

  // out = P v: the probabilities' accumulator layout is the A fragment layout of the next product
  float o[D / 8][4];
#pragma unroll
  for (int e = 0; e < D / 8; ++e) o[e][0] = o[e][1] = o[e][2] = o[e][3] = 0.f;
#pragma unroll
  for (int kt = 0; kt < NT / 2; ++kt) {
    if (16 * kt < TKc) {
      const uint32_t pa[4] = {pack2<T>(s[2 * kt][0], s[2 * kt][1]), pack2<T>(s[2 * kt][2], s[2 * kt][3]),
                              pack2<T>(s[2 * kt + 1][0], s[2 * kt + 1][1]),
                              pack2<T>(s[2 * kt + 1][2], s[2 * kt + 1][3])};
#pragma unroll
      for (int ep = 0; ep < D / 16; ++ep) {
        uint32_t vb[4];
        load_b_kn(vb, sv, LD, 16 * kt, 16 * ep);
        mma16816<T>(o[2 * ep], pa, vb[0], vb[1]);
        mma16816<T>(o[2 * ep + 1], pa, vb[2], vb[3]);
      }
    }
  }
  // this warp's q rows are its own: they stage the output
  warp_store_rows<T, D>(static_cast<T*>(a.out) + seq.at(a.o_s, seq.q0), a.o_s[2], Tq, sq, LD, r0, o);
}

// ================================================================ backward
// head dims up to 64: at most 128 registers (without spills), so that 16 warps fit an SM where 159 registers
// left room for 12
template <typename T, int D>
__global__ void __launch_bounds__(256, D <= 64 ? 2 : 0) short_attention_bwd_kernel(ShortAttentionArgs a) {
  extern __shared__ __align__(128) unsigned char smem[];
  constexpr int LD = Smem<T, D>::LD;
  const Smem<T, D> L(cap_q(a), cap_k(a), true);
  T* sq = reinterpret_cast<T*>(smem + L.q);
  T* sk = reinterpret_cast<T*>(smem + L.k);
  T* sv = reinterpret_cast<T*>(smem + L.v);
  T* sdo = reinterpret_cast<T*>(smem + L.dout);
  T* sds = reinterpret_cast<T*>(smem + L.ds);  // dS^T [TK, LDQ]; at first out [TQ, LD]
  float* sdelta = reinterpret_cast<float*>(smem + L.delta);
  float* slse = reinterpret_cast<float*>(smem + L.lse);
  uint8_t* skeep = smem + L.keep;
  uint8_t* att = smem + L.att;
  const int bh = blockIdx.x, mask_row = (a.Tk + 7) / 8;
  const Seq seq(a, bh);
  if (!seq.in_launch(a)) return;  // another launch's class of packed sequences (uniform over the CTA)
  const int Tq = seq.tq, Tk = seq.tk, TQc = round16(Tq), TKc = round16(Tk);
  const int lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  load_rows<T, D>(sq, LD, static_cast<const T*>(a.q) + seq.at(a.q_s, seq.q0), a.q_s[2], Tq, TQc);
  load_rows<T, D>(sk, LD, static_cast<const T*>(a.k) + seq.at(a.k_s, seq.k0), a.k_s[2], Tk, TKc);
  load_rows<T, D>(sv, LD, static_cast<const T*>(a.v) + seq.at(a.v_s, seq.k0), a.v_s[2], Tk, TKc);
  load_rows<T, D>(sdo, LD, static_cast<const T*>(a.dout) + seq.at(a.do_s, seq.q0), a.do_s[2], Tq, TQc);
  load_rows<T, D>(sds, LD, static_cast<const T*>(a.out) + seq.at(a.o_s, seq.q0), a.o_s[2], Tq, TQc);
  for (int i = threadIdx.x; i < TQc; i += blockDim.x) slse[i] = i < Tq ? a.lse[(int64_t)bh * a.Tq + i] : INFINITY;
  if (a.p > 0.f) {
    const uint8_t* keep = a.mask + (int64_t)bh * a.Tq * mask_row;
    for (int e = threadIdx.x; e < Tq * L.KB; e += blockDim.x) {
      const int r = e / L.KB;
      skeep[e] = keep[r * mask_row + (e - r * L.KB)];
    }
  }
  load_keys(att, a, seq, TKc);
  cp_async_wait_all();
  __syncthreads();
  {  // delta_i = sum_d dout * out (the softmax backward's): C lanes per row, 8 elements each, 32 / C rows a pass
    constexpr int C = D / 8, RPW = 32 / C;
    const int sub = lane / C, c = lane - sub * C;
    for (int i = warp * RPW + sub; i < TQc; i += warps * RPW) {  // TQc is a multiple of 16 >= RPW: whole passes
      float x[8], y[8];
      load8(sdo + i * LD + 8 * c, x);
      load8(sds + i * LD + 8 * c, y);
      float acc = 0.f;
#pragma unroll
      for (int e = 0; e < 8; ++e) acc += x[e] * y[e];
#pragma unroll
      for (int o = C / 2; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
      if (c == 0) sdelta[i] = acc;
    }
  }
  __syncthreads();

  const float scale = a.scale * kLog2e, keep_scale = 1.f / (1.f - a.p);
  // keys [k0, k0 + 16) per warp: dv = P^T dout, dk = dS^T q over all queries, dS^T left in shared memory
  for (int k0 = 16 * warp; k0 < TKc; k0 += 16 * warps) {
    float dv[D / 8][4], dk[D / 8][4];
#pragma unroll
    for (int e = 0; e < D / 8; ++e)
#pragma unroll
      for (int z = 0; z < 4; ++z) dv[e][z] = dk[e][z] = 0.f;
    const int key[2] = {k0 + g, k0 + g + 8};
    for (int q0 = 0; q0 < TQc; q0 += 16) {
      float st[2][4] = {}, dpt[2][4] = {};  // S^T and dP^T (of the dropped P) of these keys x queries [q0, q0 + 16)
#pragma unroll
      for (int kk = 0; kk < D; kk += 16) {
        uint32_t ka[4], va[4], qb[4], ob[4];
        load_a(ka, sk, LD, k0, kk);
        load_a(va, sv, LD, k0, kk);
        load_b_nk(qb, sq, LD, q0, kk);
        load_b_nk(ob, sdo, LD, q0, kk);
        mma16816<T>(st[0], ka, qb[0], qb[1]);
        mma16816<T>(st[1], ka, qb[2], qb[3]);
        mma16816<T>(dpt[0], va, ob[0], ob[1]);
        mma16816<T>(dpt[1], va, ob[2], ob[3]);
      }
      float pd[2][4], ds[2][4];
#pragma unroll
      for (int n = 0; n < 2; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int kj = key[e >> 1], qi = q0 + 8 * n + 2 * t4 + (e & 1);
          const bool ok = qi < Tq && att[kj] && (!a.causal || kj <= qi + Tk - Tq);
          const float p = ok ? exp2f(st[n][e] * scale - slse[qi]) : 0.f;
          float keep = 1.f;
          if (a.p > 0.f && ok) keep = ((skeep[qi * L.KB + (kj >> 3)] >> (kj & 7)) & 1u) ? keep_scale : 0.f;
          pd[n][e] = p * keep;
          ds[n][e] = ok ? p * (dpt[n][e] * keep - sdelta[qi]) * a.scale : 0.f;
        }
      }
      // their accumulator layout is the A fragment of [these keys x queries q0 .. q0 + 15]
      const uint32_t pa[4] = {pack2<T>(pd[0][0], pd[0][1]), pack2<T>(pd[0][2], pd[0][3]),
                              pack2<T>(pd[1][0], pd[1][1]), pack2<T>(pd[1][2], pd[1][3])};
      const uint32_t da[4] = {pack2<T>(ds[0][0], ds[0][1]), pack2<T>(ds[0][2], ds[0][3]),
                              pack2<T>(ds[1][0], ds[1][1]), pack2<T>(ds[1][2], ds[1][3])};
#pragma unroll
      for (int n = 0; n < 2; ++n) {  // dS^T for dq: rows = keys, columns = queries
        *reinterpret_cast<uint32_t*>(sds + key[0] * L.LDQ + q0 + 8 * n + 2 * t4) = da[2 * n];
        *reinterpret_cast<uint32_t*>(sds + key[1] * L.LDQ + q0 + 8 * n + 2 * t4) = da[2 * n + 1];
      }
#pragma unroll
      for (int ep = 0; ep < D / 16; ++ep) {
        uint32_t ob[4], qb[4];
        load_b_kn(ob, sdo, LD, q0, 16 * ep);
        load_b_kn(qb, sq, LD, q0, 16 * ep);
        mma16816<T>(dv[2 * ep], pa, ob[0], ob[1]);
        mma16816<T>(dv[2 * ep + 1], pa, ob[2], ob[3]);
        mma16816<T>(dk[2 * ep], da, qb[0], qb[1]);
        mma16816<T>(dk[2 * ep + 1], da, qb[2], qb[3]);
      }
    }
    // this warp's v rows are its own from here: they stage dv, then dk
    warp_store_rows<T, D>(static_cast<T*>(a.dv) + seq.at(a.dv_s, seq.k0), a.dv_s[2], Tk, sv, LD, k0, dv);
    warp_store_rows<T, D>(static_cast<T*>(a.dk) + seq.at(a.dk_s, seq.k0), a.dk_s[2], Tk, sv, LD, k0, dk);
  }
  __syncthreads();
  // queries [q0, q0 + 16) per warp: dq = dS k
  for (int q0 = 16 * warp; q0 < TQc; q0 += 16 * warps) {
    float dq[D / 8][4];
#pragma unroll
    for (int e = 0; e < D / 8; ++e) dq[e][0] = dq[e][1] = dq[e][2] = dq[e][3] = 0.f;
    for (int k0 = 0; k0 < TKc; k0 += 16) {
      uint32_t dsa[4];
      load_a_t(dsa, sds, L.LDQ, q0, k0);
#pragma unroll
      for (int ep = 0; ep < D / 16; ++ep) {
        uint32_t kb[4];
        load_b_kn(kb, sk, LD, k0, 16 * ep);
        mma16816<T>(dq[2 * ep], dsa, kb[0], kb[1]);
        mma16816<T>(dq[2 * ep + 1], dsa, kb[2], kb[3]);
      }
    }
    // q is not read any more: its rows stage dq
    warp_store_rows<T, D>(static_cast<T*>(a.dq) + seq.at(a.dq_s, seq.q0), a.dq_s[2], Tq, sq, LD, q0, dq);
  }
}

// ================================================================ launchers
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
  // all of the SM's unified memory as shared memory: the CTAs' loads bypass L1 (cp.async.cg), and with the default
  // split the driver took 168 of 228 KB, which held 6 backward CTAs of 32 tokens where their registers allow 8
  cudaFuncSetAttribute(kern, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared);
  if (dev >= 0 && dev < 64) {
    int seen = allowed[dev].load(std::memory_order_relaxed);
    while (static_cast<int>(bytes) > seen && !allowed[dev].compare_exchange_weak(seen, static_cast<int>(bytes))) {
    }
  }
}

template <typename T, int D, int KC>
void launch_fwd_kc(const ShortAttentionArgs& a, PhiloxArgs rng, cudaStream_t stream) {
  const Smem<T, D> L(cap_q(a), cap_k(a), false);
  auto kern = short_attention_fwd_kernel<T, D, KC>;
  static std::atomic<int> allowed[64];
  allow_smem(kern, allowed, L.total);
  kern<<<a.B * a.H, 2 * L.TQ, L.total, stream>>>(a, rng, a.p > 0.f ? dropout_threshold(a.p) : 0u);
  check_launch("short_attention_fwd", stream);
}

template <typename T, int D>
void launch_fwd(const ShortAttentionArgs& a, PhiloxArgs rng, cudaStream_t stream) {
  const int TK = round16(cap_k(a));
  if (TK <= 32) launch_fwd_kc<T, D, 32>(a, rng, stream);
  else if (TK <= 64) launch_fwd_kc<T, D, 64>(a, rng, stream);
  else launch_fwd_kc<T, D, 128>(a, rng, stream);
}

template <typename T, int D>
void launch_bwd(const ShortAttentionArgs& a, cudaStream_t stream) {
  const Smem<T, D> L(cap_q(a), cap_k(a), true);
  auto kern = short_attention_bwd_kernel<T, D>;
  static std::atomic<int> allowed[64];
  allow_smem(kern, allowed, L.total);
  // one warp per 16 keys (the longer length's); D <= 64 holds two CTAs of 8 warps per SM within its 128 registers.
  // D = 128 keeps 4 warps of two 16-key blocks each at 128 tokens, as before the register bound (not measured since)
  const int longer = L.TQ > L.TK ? L.TQ : L.TK;
  const int threads = longer == 128 && D > 64 ? 128 : 2 * longer;
  kern<<<a.B * a.H, threads, L.total, stream>>>(a);
  check_launch("short_attention_bwd", stream);
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

}  // namespace

bool short_attention_supported(int device, int64_t Tq, int64_t Tk, int64_t D) {
  if (!shape_ok(Tq, Tk, D)) return false;
  // per device: its compute capability's major and the shared memory one block may opt in to (read once)
  static int major[64], smem[64];
  static std::atomic<bool> known[64];
  if (device < 0 || device >= 64) return false;
  if (!known[device].load(std::memory_order_acquire)) {
    int mj = 0, sm = 0;
    if (cudaDeviceGetAttribute(&mj, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&sm, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess) {
      cudaGetLastError();
      return false;
    }
    major[device] = mj;
    smem[device] = sm;
    known[device].store(true, std::memory_order_release);
  }
  // the layout does not depend on the 16-bit type's flavour; the backward takes more than the forward
  const int tq = static_cast<int>(Tq), tk = static_cast<int>(Tk);
  const size_t need = D == 32 ? Smem<__half, 32>(tq, tk, true).total
                      : D == 64 ? Smem<__half, 64>(tq, tk, true).total : Smem<__half, 128>(tq, tk, true).total;
  return major[device] >= 8 && need <= static_cast<size_t>(smem[device]);
}

namespace {
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

void short_attention_fwd(const ShortAttentionArgs& a, PhiloxArgs rng, cudaStream_t stream) {
  check_args(a);
  if ((int64_t)a.B * a.H == 0) return;
  per_class(a, [&](const ShortAttentionArgs& c) { LS_SHORT_ATTN_DISPATCH(c, launch_fwd, c, rng, stream); });
}

void short_attention_bwd(const ShortAttentionArgs& a, cudaStream_t stream) {
  check_args(a);
  if ((int64_t)a.B * a.H == 0) return;
  per_class(a, [&](const ShortAttentionArgs& c) { LS_SHORT_ATTN_DISPATCH(c, launch_bwd, c, stream); });
}

}  // namespace ls
