// Bias + dropout + residual, and bias + activation + dropout: forward and backward.
//
// Numerics: inputs are read in their storage type and converted to fp32; the bias add, the
// activation (relu, or exact gelu 0.5 x (1 + erf(x / sqrt 2))), the dropout scale 1 / (1 - p) and
// the residual add are done in fp32; the result is rounded once to the storage type.
// Dropout: one Philox4x32-10 block per group of 8 consecutive elements (see common.cuh); the
// keep decisions are written as a bitmask (1 bit per element), which the backward reads.
// Backward: dx = dy * act'(x + b) * keep / (1 - p) in fp32, rounded once; the bias gradient is
// the fp32 column sum of the fp32 dx values (before rounding), deterministic (colsum.cuh).
// Relu's backward needs no mask and no input when it has the output: act' * keep == (out > 0); without the output
// it takes act' from the input and keep from the mask, or reads the bits of out > 0 from the mask (what the FP8 FFN
// keeps: it writes no bf16 output).
#include "kernels/act_dropout.cuh"
#include "kernels/colsum.cuh"

namespace ls {

// ================================================================ forward kernel
// out = [residual +] dropout(act(x + bias)) over n elements, bias period C.
// REPLAY: the keep bits are read from `keep` (a mask this kernel wrote before) instead of drawn, and no mask is
// written: the same arithmetic, so the same values bit for bit (the recomputed activation of
// --ls-recompute-activation).
template <typename T, Act A, bool RESIDUAL, bool VEC, bool REPLAY = false>
__global__ void fused_dropout_fwd_kernel(const T* __restrict__ x, const T* __restrict__ bias,
                                         const T* __restrict__ residual, T* __restrict__ out,
                                         uint8_t* __restrict__ mask, int64_t n, int C, float p,
                                         uint32_t threshold, PhiloxArgs rng, const uint8_t* __restrict__ keep = nullptr) {
  // Groups per thread and iteration: every load of them is issued before their Philox draws, which then overlap
  // the loads' latency. Two groups pay where a group has few loads; with a residual (three loads per group
  // already) one is faster (benchmarks/RESULTS.md, section 'ops').
  constexpr int U = RESIDUAL ? 1 : 2;
  uint64_t seed = 0, offset = 0;
  if (!REPLAY && mask != nullptr) philox_unpack(rng, seed, offset);
  const float scale = (REPLAY || mask != nullptr) ? 1.f / (1.f - p) : 1.f;
  const int64_t groups = (n + 7) / 8, stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t g0 = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; g0 < groups; g0 += U * stride) {
    float v[U][8], b[U][8], r[U][8];
    int cnt[U];
    uint32_t bits[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t g = g0 + u * stride, i0 = g * 8;
      cnt[u] = g < groups ? (int)min((int64_t)8, n - i0) : 0;
      if (cnt[u] == 0) continue;
      if (VEC) load8(x + i0, v[u]); else load_n(x + i0, cnt[u], v[u]);
      if (bias != nullptr) {
        if (VEC) {
          load8(bias + (int)(i0 % C), b[u]);
        } else {
#pragma unroll
          for (int k = 0; k < 8; ++k) b[u][k] = k < cnt[u] ? to_f(bias[(int)((i0 + k) % C)]) : 0.f;
        }
      }
      if (RESIDUAL) {
        if (VEC) load8(residual + i0, r[u]); else load_n(residual + i0, cnt[u], r[u]);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t g = g0 + u * stride;
      bits[u] = 0u;
      if (cnt[u] == 0) continue;
      if (REPLAY) bits[u] = keep[g];
      else if (mask != nullptr) bits[u] = dropout_bits(g, seed, offset, threshold);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (cnt[u] == 0) continue;
      const int64_t g = g0 + u * stride, i0 = g * 8;
      bias_act8<A>(v[u], bias != nullptr ? b[u] : nullptr);
      if (REPLAY || mask != nullptr) {
        keep8(v[u], bits[u], scale);
        if (!REPLAY) mask[g] = (uint8_t)bits[u];  // drawn here: kept for the backward
      }
      if (RESIDUAL) {
#pragma unroll
        for (int k = 0; k < 8; ++k) v[u][k] += r[u][k];
      }
      if (VEC) store8(out + i0, v[u]); else store_n(out + i0, cnt[u], v[u]);
    }
  }
}

template <typename T, Act A, bool RESIDUAL>
static void launch_fwd(const T* x, const T* bias, const T* residual, T* out, uint8_t* mask, int64_t n, int C,
                       float p, PhiloxArgs rng, cudaStream_t stream, const char* name) {
  if (n <= 0) return;
  const bool vec = C % 8 == 0 && aligned16(x) && aligned16(out) && (bias == nullptr || aligned16(bias)) &&
                   (!RESIDUAL || aligned16(residual));
  const int threads = 256;
  const int64_t groups = (n + 7) / 8;
  const int blocks = (int)std::min<int64_t>((groups + threads - 1) / threads, (int64_t)num_sms() * 16);
  const uint32_t thr = dropout_threshold(p);
  if (vec)
    fused_dropout_fwd_kernel<T, A, RESIDUAL, true><<<blocks, threads, 0, stream>>>(x, bias, residual, out, mask, n, C, p, thr, rng);
  else
    fused_dropout_fwd_kernel<T, A, RESIDUAL, false><<<blocks, threads, 0, stream>>>(x, bias, residual, out, mask, n, C, p, thr, rng);
  LS_CHECK_LAUNCH(name, stream);
}

// ================================================================ backward op (colsum.cuh)
template <typename T, Act A>
struct ActDropoutBwdOp {
  const T* dy;
  const T* x;
  const T* bias;
  const T* out;
  const uint8_t* mask;
  T* dx;
  int C;
  float scale;

  // bits k < n of the mask from element i0 on (one byte when i0 is a multiple of 8 and n == 8)
  __device__ __forceinline__ uint32_t load_bits(int64_t i0, int n) const {
    if ((i0 & 7) == 0 && n == 8) return mask[i0 >> 3];
    uint32_t bits = 0;
    for (int k = 0; k < n; ++k) bits |= ((mask[(i0 + k) >> 3] >> ((i0 + k) & 7)) & 1u) << k;
    return bits;
  }

  template <bool VEC>
  __device__ __forceinline__ void apply(int64_t r, int c0, int n, float (&v)[1][8]) const {
    const int64_t i0 = r * C + c0;
    float g[8];
    if (VEC) load8(dy + i0, g); else load_n(dy + i0, n, g);
    if (A == Act::Relu && out != nullptr) {  // relu' * keep == (out > 0)
      float o[8];
      if (VEC) load8(out + i0, o); else load_n(out + i0, n, o);
      uint32_t bits = 0;
#pragma unroll
      for (int k = 0; k < 8; ++k) bits |= (o[k] > 0.f ? 1u : 0u) << k;
      keep8(g, bits, scale);
    } else if (A == Act::Relu && x == nullptr) {  // the mask holds the bits of out > 0
      keep8(g, load_bits(i0, n), scale);
    } else {
      if constexpr (A != Act::None) {
        float z[8], b[8];
        if (VEC) load8(x + i0, z); else load_n(x + i0, n, z);
        if (bias != nullptr) {
          if (VEC) load8(bias + c0, b); else load_n(bias + c0, n, b);
        }
        act_grad8<A>(g, z, bias != nullptr ? b : nullptr);  // relu from its input when no output is kept
      }
      if (mask != nullptr) keep8(g, load_bits(i0, n), scale);
    }
    if (VEC) store8(dx + i0, g); else store_n(dx + i0, n, g);
#pragma unroll
    for (int k = 0; k < 8; ++k) v[0][k] = k < n ? g[k] : 0.f;
  }
};

// ================================================================ launchers
int64_t colsum_workspace(int64_t rows, int C) { return colsum_partial_floats(rows, C); }

void bias_dropout_residual_fwd(DType dt, const void* x, const void* bias, const void* residual, void* out,
                               uint8_t* mask, int64_t n, int C, float p, PhiloxArgs rng, cudaStream_t stream) {
  LS_DISPATCH(dt, T, launch_fwd<T, Act::None, true>(
      static_cast<const T*>(x), static_cast<const T*>(bias), static_cast<const T*>(residual),
      static_cast<T*>(out), mask, n, C, p, rng, stream, "bias_dropout_residual_fwd"));
}

void bias_act_dropout_fwd(DType dt, const void* x, const void* bias, void* out, uint8_t* mask, int64_t n, int C,
                          float p, Act act, PhiloxArgs rng, cudaStream_t stream) {
  LS_DISPATCH(dt, T, {
    const T* xt = static_cast<const T*>(x);
    const T* bt = static_cast<const T*>(bias);
    T* ot = static_cast<T*>(out);
    LS_DISPATCH_ACT(act, A, launch_fwd<T, A, false>(xt, bt, nullptr, ot, mask, n, C, p, rng, stream,
                                                    A == Act::Relu   ? "bias_relu_dropout_fwd"
                                                    : A == Act::Gelu ? "bias_gelu_dropout_fwd"
                                                                     : "bias_dropout_fwd"));
  });
}

template <typename T, Act A>
static void launch_replay(const T* x, const T* bias, const uint8_t* keep, T* out, int64_t n, int C, float p,
                          cudaStream_t stream) {
  if (n <= 0) return;
  const bool vec = C % 8 == 0 && aligned16(x) && aligned16(out) && (bias == nullptr || aligned16(bias));
  const int threads = 256;
  const int64_t groups = (n + 7) / 8;
  const int blocks = (int)std::min<int64_t>((groups + threads - 1) / threads, (int64_t)num_sms() * 16);
  if (vec)
    fused_dropout_fwd_kernel<T, A, false, true, true><<<blocks, threads, 0, stream>>>(x, bias, nullptr, out, nullptr,
                                                                                     n, C, p, 0u, PhiloxArgs{}, keep);
  else
    fused_dropout_fwd_kernel<T, A, false, false, true><<<blocks, threads, 0, stream>>>(x, bias, nullptr, out, nullptr,
                                                                                      n, C, p, 0u, PhiloxArgs{}, keep);
  LS_CHECK_LAUNCH("bias_act_dropout_replay", stream);
}

void bias_act_dropout_replay(DType dt, const void* x, const void* bias, const uint8_t* keep, void* out, int64_t n,
                             int C, float p, Act act, cudaStream_t stream) {
  if (keep == nullptr) {  // no dropout was applied: the forward without a mask
    bias_act_dropout_fwd(dt, x, bias, out, nullptr, n, C, 0.f, act, PhiloxArgs{}, stream);
    return;
  }
  LS_DISPATCH(dt, T, {
    const T* xt = static_cast<const T*>(x);
    const T* bt = static_cast<const T*>(bias);
    T* ot = static_cast<T*>(out);
    LS_DISPATCH_ACT(act, A, launch_replay<T, A>(xt, bt, keep, ot, n, C, p, stream));
  });
}

template <typename T, Act A>
static void launch_bwd(const void* dy, const void* x, const void* bias, const void* out, const uint8_t* mask,
                       void* dx, void* dbias, float* workspace, int64_t rows, int C, float p, cudaStream_t stream) {
  ActDropoutBwdOp<T, A> op{static_cast<const T*>(dy), static_cast<const T*>(x), static_cast<const T*>(bias),
                           static_cast<const T*>(out), mask, static_cast<T*>(dx), C, 1.f / (1.f - p)};
  const bool vec = C % 8 == 0 && aligned16(dy) && aligned16(dx) && (x == nullptr || aligned16(x)) &&
                   (out == nullptr || aligned16(out)) && (bias == nullptr || aligned16(bias));
  T* const outs[1] = {static_cast<T*>(dbias)};
  run_rowloop_colsum<T, 1>(op, vec, rows, C, outs, workspace, stream, "bias_act_dropout_bwd");
}

void bias_act_dropout_bwd(DType dt, const void* dy, const void* x, const void* bias, const void* out,
                          const uint8_t* mask, void* dx, void* dbias, float* workspace, int64_t rows, int C, float p,
                          Act act, cudaStream_t stream) {
  LS_DISPATCH(dt, T,
              LS_DISPATCH_ACT(act, A, launch_bwd<T, A>(dy, x, bias, out, mask, dx, dbias, workspace, rows, C, p,
                                                       stream)));
}

}  // namespace ls
