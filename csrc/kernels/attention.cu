// Attention over short padded sequences (both lengths <= kShortAttentionMax), forward and backward.
//
//   out = dropout(softmax(q k^T / sqrt(D) + masks)) v      q [B, H, Tq, D], k, v [B, H, Tk, D]
//
// Why a kernel of our own: in a --max-tokens batch of sentences most sequences are 16-64 tokens long, and the
// library kernels (flash and memory-efficient) tile 64-128 rows: measured on an H100 at 8192 tokens, 16 heads of
// 64, one forward + backward took 0.19-0.43 ms where moving the tensors once takes about 0.05 (RESULTS.md). Here
// one CTA holds one (sentence, head) whole in shared memory: every tensor is read once and written once, and the
// products run on the tensor cores through WMMA (16x16x16 tiles, fp32 accumulation; the GEMMs are tiny, so no
// library GEMM applies).
//
// Numerics (as flash attention's): scores and softmax in fp32, the probabilities rounded to the storage type for
// the product with v, the softmax's log-sum-exp kept (fp32, base 2, in units of the scaled score) for the
// backward, which recomputes the probabilities from q, k and it. dS is rounded to the storage type for its two
// products. A query row whose keys are all masked gets probabilities 0 (output 0, gradients 0).
// Masks: attend [B, Tk] (nonzero = attend; nullable) and causal (query i sees keys j <= i + Tk - Tq).
// Dropout: keep bits drawn with Philox (common.cuh) in groups of 8 keys of one query row and stored as a bitmask,
// one byte per group: byte ((b * H + h) * Tq + i) * mask_row + j / 8, bit j % 8 (mask_row = ceil(Tk / 8)); the
// backward reads them (no RNG state crosses from the forward's CUDA graph to the backward's).
// Layout: each tensor is addressed by its (batch, head, row) strides with the head dim contiguous; rows must be
// 16-byte aligned (the adapter checks, and falls back to PyTorch's kernels otherwise).
#include <mma.h>

#include <atomic>
#include <type_traits>

#include "kernels/common.cuh"

namespace ls {

namespace {

using namespace nvcuda;

constexpr int kMaxThreads = 256;  // 4 warps per CTA, 8 for the longest sequences (launcher)
constexpr float kLog2e = 1.4426950408889634f;

__host__ __device__ constexpr int round16(int x) { return (x + 15) / 16 * 16; }

// Shared-memory layout of one CTA; TQ, TK: the lengths rounded up to 16. Element strides padded against bank
// conflicts (WMMA wants multiples of 8 elements for 16-bit types and of 4 for fp32). The backward stages its
// output rows through `stage`, which first holds out (for delta) and then dP.
template <typename T, int D>
struct Smem {
  static constexpr int LD = D + 8;  // rows of q, k, v, dout (T)
  int TQ, TK, LDS, LDP, LDG;
  size_t q, k, v, dout, s, p, ds, stage, delta, lse, keep, total;
  // the next region of `bytes` at `o` (128-byte aligned, as WMMA's 32-byte tiles and the 16-byte copies need)
  __host__ __device__ static size_t take(size_t& o, size_t bytes) {
    const size_t at = o;
    o += (bytes + 127) / 128 * 128;
    return at;
  }
  __host__ __device__ Smem(int Tq, int Tk, bool backward) {
    TQ = round16(Tq);
    TK = round16(Tk);
    LDS = TK + 4;
    LDP = TK + 8;
    LDG = D + 4;
    const int R = TQ > TK ? TQ : TK;
    size_t stage_floats = (size_t)R * LDG;
    if (backward && (size_t)TQ * LDS > stage_floats) stage_floats = (size_t)TQ * LDS;
    size_t o = 0;
    q = take(o, sizeof(T) * TQ * LD);
    k = take(o, sizeof(T) * TK * LD);
    v = take(o, sizeof(T) * TK * LD);
    dout = backward ? take(o, sizeof(T) * TQ * LD) : 0;
    s = take(o, sizeof(float) * TQ * LDS);
    p = take(o, sizeof(T) * TQ * LDP);
    ds = backward ? take(o, sizeof(T) * TQ * LDP) : 0;
    stage = take(o, sizeof(float) * stage_floats);
    delta = backward ? take(o, sizeof(float) * TQ) : 0;
    lse = backward ? take(o, sizeof(float) * TQ) : 0;
    keep = backward ? take(o, (size_t)TQ * ((Tk + 7) / 8)) : 0;
    total = o;
  }
};

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

// rows [0, n) of an fp32 stage (row stride D + 4) to a strided [*, D] matrix in T
template <typename T, int D>
__device__ __forceinline__ void store_rows(T* __restrict__ dst, const float* __restrict__ stage, int64_t row_stride,
                                           int n) {
  constexpr int V = D / 8;
  for (int e = threadIdx.x; e < n * V; e += blockDim.x) {
    const int r = e / V, c = (e - r * V) * 8;
    float f[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) f[k] = stage[r * (D + 4) + c + k];
    store8(dst + r * row_stride + c, f);
  }
}

// C [M, N] (fp32, row stride ldc) = A [M, K] B [K, N] over 16x16 tiles spread across the warps. A is row-major
// (row stride lda) or, with A_T, stored transposed (A[m][k] at a[k * lda + m]); B likewise with B_T.
template <typename T, bool A_T, bool B_T>
__device__ __forceinline__ void warp_gemm(float* c, int ldc, const T* a, int lda, const T* b, int ldb, int M, int N,
                                          int K) {
  using LA = std::conditional_t<A_T, wmma::col_major, wmma::row_major>;
  using LB = std::conditional_t<B_T, wmma::col_major, wmma::row_major>;
  const int warps = blockDim.x / 32, tn = N / 16, tiles = (M / 16) * tn;
  for (int t = threadIdx.x / 32; t < tiles; t += warps) {
    const int tm = t / tn, tc = t - tm * tn;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
    wmma::fill_fragment(acc, 0.f);
    for (int kk = 0; kk < K; kk += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, T, LA> fa;
      wmma::fragment<wmma::matrix_b, 16, 16, 16, T, LB> fb;
      wmma::load_matrix_sync(fa, A_T ? a + kk * lda + tm * 16 : a + tm * 16 * lda + kk, lda);
      wmma::load_matrix_sync(fb, B_T ? b + tc * 16 * ldb + kk : b + kk * ldb + tc * 16, ldb);
      wmma::mma_sync(acc, fa, fb, acc);
    }
    wmma::store_matrix_sync(c + tm * 16 * ldc + tc * 16, acc, ldc, wmma::mem_row_major);
  }
}

// Which keys of this lane's two columns (lane, lane + 32) a query row sees: padding is the same for every row
// (read once), causality depends on the row.
struct LaneKeys {
  bool key[2];
  int Tq, Tk;
  bool causal;
  __device__ LaneKeys(const ShortAttentionArgs& a, int b, int lane) : Tq(a.Tq), Tk(a.Tk), causal(a.causal) {
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int j = lane + 32 * u;
      key[u] = j < a.Tk && (a.attend == nullptr || a.attend[(int64_t)b * a.Tk + j] != 0);
    }
  }
  __device__ __forceinline__ bool sees(int i, int u, int lane) const {
    return i < Tq && key[u] && (!causal || lane + 32 * u <= i + Tk - Tq);
  }
};

// keep bit of column j from the byte of its group of 8, held by lane j / 8
__device__ __forceinline__ bool keep_bit(uint32_t bits, int j) {
  const uint32_t g = __shfl_sync(0xffffffffu, bits, (j >> 3) & 31);
  return (g >> (j & 7)) & 1u;
}

}  // namespace

// ================================================================ forward
template <typename T, int D>
__global__ void __launch_bounds__(kMaxThreads) short_attention_fwd_kernel(ShortAttentionArgs a, PhiloxArgs rng,
                                                                           uint32_t threshold) {
  extern __shared__ __align__(128) unsigned char smem[];
  constexpr int LD = Smem<T, D>::LD;
  const Smem<T, D> L(a.Tq, a.Tk, false);
  T* sq = reinterpret_cast<T*>(smem + L.q);
  T* sk = reinterpret_cast<T*>(smem + L.k);
  T* sv = reinterpret_cast<T*>(smem + L.v);
  float* ss = reinterpret_cast<float*>(smem + L.s);
  T* sp = reinterpret_cast<T*>(smem + L.p);
  float* stage = reinterpret_cast<float*>(smem + L.stage);
  const int bh = blockIdx.x, b = bh / a.H, h = bh - b * a.H, Tq = a.Tq, Tk = a.Tk;
  load_rows<T, D>(sq, LD, static_cast<const T*>(a.q) + b * a.q_s[0] + h * a.q_s[1], a.q_s[2], Tq, L.TQ);
  load_rows<T, D>(sk, LD, static_cast<const T*>(a.k) + b * a.k_s[0] + h * a.k_s[1], a.k_s[2], Tk, L.TK);
  load_rows<T, D>(sv, LD, static_cast<const T*>(a.v) + b * a.v_s[0] + h * a.v_s[1], a.v_s[2], Tk, L.TK);
  const int lane = threadIdx.x & 31, warps = blockDim.x / 32, mask_row = (Tk + 7) / 8;
  const LaneKeys keys(a, b, lane);  // its loads overlap the copies
  uint64_t seed = 0, offset = 0;
  if (a.p > 0.f) philox_unpack(rng, seed, offset);
  cp_async_wait_all();
  __syncthreads();
  warp_gemm<T, false, true>(ss, L.LDS, sq, LD, sk, LD, L.TQ, L.TK, D);  // S = q k^T
  __syncthreads();

  const float scale = a.scale * kLog2e, keep_scale = 1.f / (1.f - a.p);
  for (int i = threadIdx.x / 32; i < L.TQ; i += warps) {
    float x[2];
    bool ok[2];
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      ok[u] = keys.sees(i, u, lane);
      x[u] = ok[u] ? ss[i * L.LDS + lane + 32 * u] * scale : -INFINITY;
    }
    float m = warp_max(fmaxf(x[0], x[1]));
    if (m == -INFINITY) m = 0.f;  // no visible key: probabilities 0
    float e[2];
#pragma unroll
    for (int u = 0; u < 2; ++u) e[u] = ok[u] ? exp2f(x[u] - m) : 0.f;
    const float sum = warp_sum(e[0] + e[1]);
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    uint32_t bits = 0xFFu;
    if (a.p > 0.f && i < Tq && lane < mask_row) {
      const int64_t g = ((int64_t)bh * Tq + i) * mask_row + lane;
      bits = dropout_bits((uint64_t)g, seed, offset, threshold);
      a.mask[g] = static_cast<uint8_t>(bits);
    }
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int j = lane + 32 * u;
      float pv = e[u] * inv;
      if (a.p > 0.f) pv = keep_bit(bits, j) ? pv * keep_scale : 0.f;
      if (j < L.TK) sp[i * L.LDP + j] = from_f<T>(pv);
    }
    if (lane == 0 && i < Tq && a.lse != nullptr) a.lse[(int64_t)bh * Tq + i] = sum > 0.f ? m + log2f(sum) : INFINITY;
  }
  __syncthreads();
  warp_gemm<T, false, false>(stage, L.LDG, sp, L.LDP, sv, LD, L.TQ, D, L.TK);  // out = P v
  __syncthreads();
  store_rows<T, D>(static_cast<T*>(a.out) + b * a.o_s[0] + h * a.o_s[1], stage, a.o_s[2], Tq);
}

// ================================================================ backward
template <typename T, int D>
__global__ void __launch_bounds__(kMaxThreads) short_attention_bwd_kernel(ShortAttentionArgs a) {
  extern __shared__ __align__(128) unsigned char smem[];
  constexpr int LD = Smem<T, D>::LD;
  const Smem<T, D> L(a.Tq, a.Tk, true);
  T* sq = reinterpret_cast<T*>(smem + L.q);
  T* sk = reinterpret_cast<T*>(smem + L.k);
  T* sv = reinterpret_cast<T*>(smem + L.v);
  T* sdo = reinterpret_cast<T*>(smem + L.dout);
  float* ss = reinterpret_cast<float*>(smem + L.s);
  T* sp = reinterpret_cast<T*>(smem + L.p);
  T* sds = reinterpret_cast<T*>(smem + L.ds);
  float* stage = reinterpret_cast<float*>(smem + L.stage);
  T* so = reinterpret_cast<T*>(smem + L.stage);  // out, until delta is known
  float* sdelta = reinterpret_cast<float*>(smem + L.delta);
  float* slse = reinterpret_cast<float*>(smem + L.lse);
  uint8_t* skeep = smem + L.keep;
  const int bh = blockIdx.x, b = bh / a.H, h = bh - b * a.H, Tq = a.Tq, Tk = a.Tk;
  load_rows<T, D>(sq, LD, static_cast<const T*>(a.q) + b * a.q_s[0] + h * a.q_s[1], a.q_s[2], Tq, L.TQ);
  load_rows<T, D>(sk, LD, static_cast<const T*>(a.k) + b * a.k_s[0] + h * a.k_s[1], a.k_s[2], Tk, L.TK);
  load_rows<T, D>(sv, LD, static_cast<const T*>(a.v) + b * a.v_s[0] + h * a.v_s[1], a.v_s[2], Tk, L.TK);
  load_rows<T, D>(sdo, LD, static_cast<const T*>(a.dout) + b * a.do_s[0] + h * a.do_s[1], a.do_s[2], Tq, L.TQ);
  load_rows<T, D>(so, LD, static_cast<const T*>(a.out) + b * a.o_s[0] + h * a.o_s[1], a.o_s[2], Tq, L.TQ);
  const int lane = threadIdx.x & 31, warps = blockDim.x / 32, mask_row = (Tk + 7) / 8;
  for (int i = threadIdx.x; i < L.TQ; i += blockDim.x) slse[i] = i < Tq ? a.lse[(int64_t)bh * Tq + i] : INFINITY;
  if (a.p > 0.f) {
    const uint8_t* keep = a.mask + (int64_t)bh * Tq * mask_row;
    for (int e = threadIdx.x; e < Tq * mask_row; e += blockDim.x) skeep[e] = keep[e];
  }
  const LaneKeys keys(a, b, lane);
  cp_async_wait_all();
  __syncthreads();
  for (int i = threadIdx.x / 32; i < L.TQ; i += warps) {  // delta_i = sum_d dout * out (the softmax backward's)
    float acc = 0.f;
    for (int d = lane; d < D; d += 32) acc += to_f(sdo[i * LD + d]) * to_f(so[i * LD + d]);
    acc = warp_sum(acc);
    if (lane == 0) sdelta[i] = acc;
  }
  warp_gemm<T, false, true>(ss, L.LDS, sq, LD, sk, LD, L.TQ, L.TK, D);  // S = q k^T
  __syncthreads();
  warp_gemm<T, false, true>(stage, L.LDS, sdo, LD, sv, LD, L.TQ, L.TK, D);  // dP (of the dropped P) = dout v^T
  __syncthreads();

  const float scale = a.scale * kLog2e, keep_scale = 1.f / (1.f - a.p);
  for (int i = threadIdx.x / 32; i < L.TQ; i += warps) {
    const uint32_t bits = a.p > 0.f && i < Tq && lane < mask_row ? skeep[i * mask_row + lane] : 0xFFu;
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int j = lane + 32 * u;
      const bool ok = keys.sees(i, u, lane);
      const float p = ok ? exp2f(ss[i * L.LDS + j] * scale - slse[i]) : 0.f;
      float keep = 1.f;
      if (a.p > 0.f) keep = keep_bit(bits, j) ? keep_scale : 0.f;
      if (j < L.TK) {
        const float dp = ok ? stage[i * L.LDS + j] : 0.f;
        sp[i * L.LDP + j] = from_f<T>(p * keep);                                // dropped P, for dv
        sds[i * L.LDP + j] = from_f<T>(p * (dp * keep - sdelta[i]) * a.scale);  // dS / sqrt(D)
      }
    }
  }
  __syncthreads();
  T* dq = static_cast<T*>(a.dq) + b * a.dq_s[0] + h * a.dq_s[1];
  T* dk = static_cast<T*>(a.dk) + b * a.dk_s[0] + h * a.dk_s[1];
  T* dv = static_cast<T*>(a.dv) + b * a.dv_s[0] + h * a.dv_s[1];
  warp_gemm<T, true, false>(stage, L.LDG, sp, L.LDP, sdo, LD, L.TK, D, L.TQ);  // dv = P^T dout
  __syncthreads();
  store_rows<T, D>(dv, stage, a.dv_s[2], Tk);
  __syncthreads();
  warp_gemm<T, true, false>(stage, L.LDG, sds, L.LDP, sq, LD, L.TK, D, L.TQ);  // dk = dS^T q
  __syncthreads();
  store_rows<T, D>(dk, stage, a.dk_s[2], Tk);
  __syncthreads();
  warp_gemm<T, false, false>(stage, L.LDG, sds, L.LDP, sk, LD, L.TQ, D, L.TK);  // dq = dS k
  __syncthreads();
  store_rows<T, D>(dq, stage, a.dq_s[2], Tq);
}

// ================================================================ launchers
namespace {

// 8 warps where there are 16 or more score tiles (lengths over 48), else 4
int threads_for(int TQ, int TK) { return (TQ / 16) * (TK / 16) >= 16 ? 256 : 128; }

template <typename T, int D>
void launch_fwd(const ShortAttentionArgs& a, PhiloxArgs rng, cudaStream_t stream) {
  const Smem<T, D> L(a.Tq, a.Tk, false);
  auto kern = short_attention_fwd_kernel<T, D>;
  cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(L.total));
  kern<<<a.B * a.H, threads_for(L.TQ, L.TK), L.total, stream>>>(a, rng, a.p > 0.f ? dropout_threshold(a.p) : 0u);
  check_launch("short_attention_fwd", stream);
}

template <typename T, int D>
void launch_bwd(const ShortAttentionArgs& a, cudaStream_t stream) {
  const Smem<T, D> L(a.Tq, a.Tk, true);
  auto kern = short_attention_bwd_kernel<T, D>;
  cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(L.total));
  kern<<<a.B * a.H, threads_for(L.TQ, L.TK), L.total, stream>>>(a);
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

void short_attention_fwd(const ShortAttentionArgs& a, PhiloxArgs rng, cudaStream_t stream) {
  check_args(a);
  if ((int64_t)a.B * a.H == 0) return;
  LS_SHORT_ATTN_DISPATCH(a, launch_fwd, a, rng, stream);
}

void short_attention_bwd(const ShortAttentionArgs& a, cudaStream_t stream) {
  check_args(a);
  if ((int64_t)a.B * a.H == 0) return;
  LS_SHORT_ATTN_DISPATCH(a, launch_bwd, a, stream);
}

}  // namespace ls
