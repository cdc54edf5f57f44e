// Attention over short sequences, padded or packed: the backward kernel and its launcher (the forward and the
// description of the numerics are in attention.cu, what both share in attention.cuh). Warp w owns key rows
// [16w, 16w + 16) (and [16(w + W), ...) with fewer warps W than key blocks): for every block of 16 queries it
// recomputes S^T and P^T from q, k and the forward's log-sum-exp, accumulates dv = P^T dout and dk = dS^T q in
// registers and leaves dS^T in shared memory; then warp w owns query rows [16w, 16w + 16) again for dq = dS k.
// dS is rounded to the storage type for its two products; the dropout's keep bits are read from the forward's mask.
#include "kernels/attention.cuh"

namespace ls {

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

template <typename T, int D>
void launch_bwd(const ShortAttentionArgs& a, cudaStream_t stream) {
  const Smem<T, D> L(cap_q(a), cap_k(a), true);
  auto kern = short_attention_bwd_kernel<T, D>;
  static std::atomic<int> allowed[64];
  allow_smem(kern, allowed, L.total);
  // one warp per 16 keys (the longer length's); D <= 64 holds two CTAs of 8 warps per SM within its 128 registers.
  // D = 128 keeps 4 warps of two 16-key blocks each at 128 tokens
  const int longer = L.TQ > L.TK ? L.TQ : L.TK;
  const int threads = longer == 128 && D > 64 ? 128 : 2 * longer;
  kern<<<a.B * a.H, threads, L.total, stream>>>(a);
  check_launch("short_attention_bwd", stream);
}

}  // namespace

void short_attention_bwd(const ShortAttentionArgs& a, cudaStream_t stream) {
  check_args(a);
  if ((int64_t)a.B * a.H == 0) return;
  per_class(a, [&](const ShortAttentionArgs& c) { LS_SHORT_ATTN_DISPATCH(c, launch_bwd, c, stream); });
}

}  // namespace ls
