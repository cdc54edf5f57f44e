// Attention over short sequences, padded or packed (lengths <= kShortAttentionMax): the forward kernel, its
// launchers, and the query of whether a shape runs here (the backward is in attention_bwd.cu, what both share in
// attention.cuh).
//
//   out = dropout(softmax(q k^T / sqrt(D) + masks)) v      q [B, H, Tq, D], k, v [B, H, Tk, D]
//
// One CTA holds one (sentence, head) whole in shared memory, every tensor is read once and written once, and each
// warp keeps its scores, probabilities and accumulators in registers, multiplying on the tensor cores; the forward's
// warp w owns query rows [16w, 16w + 16): S = q k^T, the softmax, P v. Scores and softmax in fp32, the probabilities
// rounded to the storage type for the product with v, the log-sum-exp kept (fp32, base 2) for the backward.
// Why a kernel of our own, the masks, the packed launches, the dropout bits and the layout: docs/kernels.md
// ("Short attention"). sm_80 or newer.
#include "kernels/attention.cuh"

namespace ls {

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

// ================================================================ launchers
namespace {

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
  per_class(a, [&](const ShortAttentionArgs& c) { LS_SHORT_ATTN_DISPATCH(c, launch_fwd, c, rng, stream); });
}

}  // namespace ls
