// Head split (with the projection bias add) and head merge for attention.
//
//   split:  x [B, T, n*H*D] (+ bias [n*H*D])  ->  out [n, B, H, T, D]     (q, k, v = out[0..n))
//   merge:  x [B, H, T, D]                    ->  out [B, T, H*D]         (= split backward, n = 1)
// token_major: the [B, H, T, D] tensors are stored [B, T, H, D] (the layout SDPA's kernels read and
// write natively; the split is then a de-interleave, and its backward an interleave).
// Numerics: the bias add is done in fp32 and rounded once. The backward of split writes
// dx [B, T, n*H*D] and the bias gradient as the fp32 column sum over B*T rows (colsum.cuh).
// Each thread moves 8 consecutive elements of one head row (vector access when D % 8 == 0).
#include "kernels/colsum.cuh"

namespace ls {

// ================================================================ split forward
template <typename T, bool VEC>
__global__ void split_heads_kernel(const T* __restrict__ x, const T* __restrict__ bias, T* __restrict__ out,
                                   int B, int T_, int n, int H, int D, bool token_major) {
  const int W = n * H * D;
  const int64_t total = (int64_t)B * T_ * W;
  const int64_t groups = (total + 7) / 8;
  for (int64_t g = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; g < groups; g += (int64_t)gridDim.x * blockDim.x) {
    const int64_t i0 = g * 8;
    if (VEC) {
      const int64_t bt = i0 / W;
      const int j = (int)(i0 - bt * W);
      const int b = (int)(bt / T_), t = (int)(bt - (int64_t)b * T_);
      const int part = j / (H * D), rem = j - part * H * D, h = rem / D, d = rem - h * D;
      float v[8];
      load8(x + i0, v);
      if (bias != nullptr) {
        float bv[8];
        load8(bias + j, bv);
#pragma unroll
        for (int k = 0; k < 8; ++k) v[k] += bv[k];
      }
      store8(out + (token_major ? ((int64_t)part * B * T_ + bt) * (H * D) + rem
                                : ((((int64_t)part * B + b) * H + h) * T_ + t) * D + d), v);
    } else {
      for (int k = 0; k < 8; ++k) {
        const int64_t i = i0 + k;
        if (i >= total) break;
        const int64_t bt = i / W;
        const int j = (int)(i - bt * W);
        const int b = (int)(bt / T_), t = (int)(bt - (int64_t)b * T_);
        const int part = j / (H * D), rem = j - part * H * D, h = rem / D, d = rem - h * D;
        float v = to_f(x[i]);
        if (bias != nullptr) v += to_f(bias[j]);
        out[token_major ? ((int64_t)part * B * T_ + bt) * (H * D) + rem
                        : ((((int64_t)part * B + b) * H + h) * T_ + t) * D + d] = from_f<T>(v);
      }
    }
  }
}

void split_heads_fwd(DType dt, const void* x, const void* bias, void* out, int B, int T_, int n, int H, int D,
                     bool token_major, cudaStream_t stream) {
  const int64_t total = (int64_t)B * T_ * n * H * D;
  if (total <= 0) return;
  const bool vec = D % 8 == 0 && aligned16(x) && aligned16(out) && (bias == nullptr || aligned16(bias));
  const int threads = 256;
  const int blocks = (int)std::min<int64_t>(((total + 7) / 8 + threads - 1) / threads, (int64_t)num_sms() * 16);
  LS_DISPATCH(dt, T, {
    if (vec)
      split_heads_kernel<T, true><<<blocks, threads, 0, stream>>>(static_cast<const T*>(x), static_cast<const T*>(bias),
                                                                  static_cast<T*>(out), B, T_, n, H, D, token_major);
    else
      split_heads_kernel<T, false><<<blocks, threads, 0, stream>>>(static_cast<const T*>(x), static_cast<const T*>(bias),
                                                                   static_cast<T*>(out), B, T_, n, H, D, token_major);
    LS_CHECK_LAUNCH("split_heads_fwd", stream);
  });
}

// ================================================================ split backward / merge forward
template <typename T>
struct MergeOp {
  const T* src[kMaxSplitParts];  // [B, H, T, D] (or [B, T, H, D] if token_major) each, nullptr = zeros
  T* dx;            // [B, T, n*H*D]
  int T_, H, D, W;
  bool token_major;

  __device__ __forceinline__ int64_t src_index(int64_t r, int b, int t, int h, int d) const {
    return token_major ? r * (H * D) + h * D + d : (((int64_t)b * H + h) * T_ + t) * D + d;
  }

  template <bool VEC>
  __device__ __forceinline__ void apply(int64_t r, int c0, int n, float (&v)[1][8]) const {
    const int b = (int)(r / T_), t = (int)(r - (int64_t)b * T_);
    float g[8];
    if (VEC) {
      const int part = c0 / (H * D), rem = c0 - part * H * D, h = rem / D, d = rem - h * D;
      const T* s = src[part];
      if (s != nullptr) {
        load8(s + src_index(r, b, t, h, d), g);
      } else {
#pragma unroll
        for (int k = 0; k < 8; ++k) g[k] = 0.f;
      }
      store8(dx + r * W + c0, g);
    } else {
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        g[k] = 0.f;
        if (k < n) {
          const int c = c0 + k;
          const int part = c / (H * D), rem = c - part * H * D, h = rem / D, d = rem - h * D;
          const T* s = src[part];
          if (s != nullptr) g[k] = to_f(s[src_index(r, b, t, h, d)]);
          dx[r * W + c] = from_f<T>(g[k]);
        }
      }
    }
#pragma unroll
    for (int k = 0; k < 8; ++k) v[0][k] = g[k];
  }
};

void split_heads_bwd(DType dt, const void* const* douts, void* dx, void* dbias, float* workspace, int B, int T_, int n,
                     int H, int D, bool token_major, cudaStream_t stream) {
  if (n < 1 || n > kMaxSplitParts) throw std::runtime_error("split_heads_bwd: n out of range");
  const int W = n * H * D;
  const int64_t rows = (int64_t)B * T_;
  bool vec = D % 8 == 0 && aligned16(dx);
  for (int i = 0; i < n; ++i) vec = vec && (douts[i] == nullptr || aligned16(douts[i]));
  LS_DISPATCH(dt, T, {
    MergeOp<T> op{{}, static_cast<T*>(dx), T_, H, D, W, token_major};
    for (int i = 0; i < n; ++i) op.src[i] = static_cast<const T*>(douts[i]);
    T* const outs[1] = {static_cast<T*>(dbias)};
    run_rowloop_colsum<T, 1>(op, vec, rows, W, outs, workspace, stream, "split_heads_bwd");
  });
}

}  // namespace ls
