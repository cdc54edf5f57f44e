// Layer norm over the last dimension (C <= 8192), optionally fused with the residual add before it.
//
// Numerics: s = x + residual is computed in fp32 and rounded to the storage type (it is also an
// output, and the reference normalises the rounded s); the row is kept in registers, the mean is
// sum(s) / C and the variance the two-pass sum((s - mean)^2) / C, both in fp32; y is rounded once.
// mean and rstd = 1 / sqrt(var + eps) are saved in fp32 for the backward.
// Backward: with xhat = (s - mean) * rstd and gw = dy * gamma (fp32),
//   dx = rstd * (gw - mean(gw) - xhat * mean(gw * xhat)) [+ dsum],
//   dgamma = sum_rows dy * xhat, dbeta = sum_rows dy.
// Invertible backward (--ls-invertible-layernorm): the input is not kept; xhat is recovered from the stored
// output as (y - beta) / gamma in fp32 (its precision and gamma = 0: docs/kernels.md, "Layer norm").
// The column sums are fp32 per-thread accumulations over a fixed set of rows per block, combined
// across the block and then across blocks in a fixed order: deterministic.
// Layout: TX threads per row, each owning 8 consecutive columns (vector loads when C % 8 == 0 and
// the pointers are 16-byte aligned), TY rows per block with TX * TY <= 256 (or TX alone up to 1024).
#include <initializer_list>

#include "kernels/colsum.cuh"
#include "kernels/fp8_codes.cuh"

namespace ls {

constexpr int kMaxC = 8192;

struct LnShape {
  int tx, ty;
};

static LnShape ln_shape(int C) {
  int tx = ((C + 7) / 8 + 31) / 32 * 32;
  int ty = tx >= 256 ? 1 : 256 / tx;
  return {tx, ty};
}

// Sums v over the TX threads of this thread's row; all threads of the block must call it.
__device__ __forceinline__ float2 row_sum2(float2 v, float2* red) {
  v.x = warp_sum(v.x);
  v.y = warp_sum(v.y);
  const int lin = threadIdx.y * blockDim.x + threadIdx.x;
  const int warps_per_row = blockDim.x / 32;
  if ((lin & 31) == 0) red[lin >> 5] = v;
  __syncthreads();
  float2 s = make_float2(0.f, 0.f);
  for (int w = 0; w < warps_per_row; ++w) {
    float2 t = red[threadIdx.y * warps_per_row + w];
    s.x += t.x;
    s.y += t.y;
  }
  __syncthreads();
  return s;
}

template <bool VEC, typename T>
__device__ __forceinline__ void ld(const T* p, int n, float (&v)[8]) {
  if (VEC) load8(p, v); else load_n(p, n, v);
}
template <bool VEC, typename T>
__device__ __forceinline__ void st(T* p, int n, const float (&v)[8]) {
  if (VEC) store8(p, v); else store_n(p, n, v);
}

// ================================================================ forward
template <typename T, bool VEC>
__global__ void __launch_bounds__(1024) layer_norm_fwd_kernel(
    const T* __restrict__ x, const T* __restrict__ residual, const T* __restrict__ gamma, const T* __restrict__ beta,
    T* __restrict__ y, T* __restrict__ sum_out, float* __restrict__ mean_out, float* __restrict__ rstd_out,
    int64_t rows, int C, float eps) {
  __shared__ float2 red[32];
  const int64_t r = (int64_t)blockIdx.x * blockDim.y + threadIdx.y;
  const bool valid_row = r < rows;
  const int c0 = 8 * threadIdx.x;
  const int n = valid_row && c0 < C ? min(8, C - c0) : 0;
  const int64_t i0 = r * C + c0;
  float v[8];
  if (n > 0) {
    ld<VEC>(x + i0, n, v);
    if (residual != nullptr) {
      float rv[8];
      ld<VEC>(residual + i0, n, rv);
#pragma unroll
      for (int k = 0; k < 8; ++k) v[k] += rv[k];
      round_as<T>(v);  // s is stored (and normalised) rounded
      if (sum_out != nullptr) st<VEC>(sum_out + i0, n, v);
    }
  } else {
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = 0.f;
  }
  float s = 0.f;
#pragma unroll
  for (int k = 0; k < 8; ++k) s += v[k];
  const float mean = row_sum2(make_float2(s, 0.f), red).x / C;
  float q = 0.f;
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    const float d = k < n ? v[k] - mean : 0.f;
    q += d * d;
  }
  const float var = row_sum2(make_float2(q, 0.f), red).x / C;
  const float rstd = rsqrtf(var + eps);
  if (n > 0) {
    float g[8], b[8], o[8];
    ld<VEC>(gamma + c0, n, g);
    ld<VEC>(beta + c0, n, b);
#pragma unroll
    for (int k = 0; k < 8; ++k) o[k] = (v[k] - mean) * rstd * g[k] + b[k];
    st<VEC>(y + i0, n, o);
  }
  if (valid_row && threadIdx.x == 0) {
    mean_out[r] = mean;
    rstd_out[r] = rstd;
  }
}

// ================================================================ backward
// INV: xin is the output y and beta is read; otherwise xin is the input (x or x + residual) and mean is read.
template <typename T, bool VEC, bool INV>
__global__ void __launch_bounds__(1024) layer_norm_bwd_kernel(
    const T* __restrict__ dy, const T* __restrict__ dsum, const T* __restrict__ xin, const T* __restrict__ gamma,
    const T* __restrict__ beta, const float* __restrict__ mean, const float* __restrict__ rstd, T* __restrict__ dx,
    float* __restrict__ partial, int64_t rows, int C) {
  __shared__ float2 red[32];
  extern __shared__ float sh[];  // [ty][tx * 8] column partials of the block's rows
  const int c0 = 8 * threadIdx.x;
  const int ncol = c0 < C ? min(8, C - c0) : 0;
  float w[8], bt[8];
  if (ncol > 0) {
    ld<VEC>(gamma + c0, ncol, w);
    if (INV) ld<VEC>(beta + c0, ncol, bt);
  }
  float acc_g[8], acc_b[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) acc_g[k] = acc_b[k] = 0.f;
  const float inv_c = 1.f / C;
  for (int64_t base = (int64_t)blockIdx.x * blockDim.y; base < rows; base += (int64_t)gridDim.x * blockDim.y) {
    const int64_t r = base + threadIdx.y;
    const int n = r < rows ? ncol : 0;
    const int64_t i0 = r * C + c0;
    float g[8], xh[8], gwv[8];
    float a = 0.f, b = 0.f, rs = 0.f;
    if (n > 0) {
      const float mu = INV ? 0.f : mean[r];
      rs = rstd[r];
      ld<VEC>(dy + i0, n, g);
      ld<VEC>(xin + i0, n, xh);
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        if (INV)
          xh[k] = k < n ? __fdiv_rn(xh[k] - bt[k], w[k]) : 0.f;
        else
          xh[k] = k < n ? (xh[k] - mu) * rs : 0.f;
        // rounded product, kept: gw - mean(gw) must be exactly 0 when the row is constant (C == 1),
        // which an FMA contraction of g * w - mean would break (then amplified by rstd = eps^-1/2)
        gwv[k] = __fmul_rn(g[k], w[k]);
        a += gwv[k];
        b += gwv[k] * xh[k];
        acc_g[k] += g[k] * xh[k];
        acc_b[k] += g[k];
      }
    }
    const float2 ab = row_sum2(make_float2(a, b), red);
    if (n > 0) {
      const float ma = ab.x * inv_c, mb = ab.y * inv_c;
      float o[8];
#pragma unroll
      for (int k = 0; k < 8; ++k) o[k] = rs * (__fsub_rn(gwv[k], ma) - xh[k] * mb);
      if (dsum != nullptr) {
        float d[8];
        ld<VEC>(dsum + i0, n, d);
#pragma unroll
        for (int k = 0; k < 8; ++k) o[k] += d[k];
      }
      st<VEC>(dx + i0, n, o);
    }
  }
  // combine the blockDim.y rows of column partials, write partial[s, blockIdx.x, C]
  const int width = blockDim.x * 8;
  for (int s = 0; s < 2; ++s) {
    float* acc = s == 0 ? acc_g : acc_b;
#pragma unroll
    for (int k = 0; k < 8; ++k) sh[threadIdx.y * width + c0 + k] = acc[k];
    __syncthreads();
    for (int c = threadIdx.y * blockDim.x + threadIdx.x; c < C; c += blockDim.x * blockDim.y) {
      float t = 0.f;
      for (int y = 0; y < (int)blockDim.y; ++y) t += sh[y * width + c];
      partial[((int64_t)s * gridDim.x + blockIdx.x) * C + c] = t;
    }
    __syncthreads();
  }
}

// ================================================================ launchers
static bool ln_vec(int C, std::initializer_list<const void*> ptrs) {
  if (C % 8 != 0) return false;
  for (const void* p : ptrs)
    if (p != nullptr && !aligned16(p)) return false;
  return true;
}

void layer_norm_fwd(DType dt, const void* x, const void* residual, const void* gamma, const void* beta, void* y,
                    void* sum_out, float* mean, float* rstd, int64_t rows, int C, float eps, cudaStream_t stream) {
  if (rows <= 0) return;
  if (C < 1 || C > kMaxC) throw std::runtime_error("layer_norm: hidden size must be in [1, 8192]");
  const LnShape s = ln_shape(C);
  const dim3 block(s.tx, s.ty);
  const int64_t grid = (rows + s.ty - 1) / s.ty;
  const bool vec = ln_vec(C, {x, residual, gamma, beta, y, sum_out});
  LS_DISPATCH(dt, T, {
    const T* xt = static_cast<const T*>(x);
    const T* rt = static_cast<const T*>(residual);
    const T* gt = static_cast<const T*>(gamma);
    const T* bt = static_cast<const T*>(beta);
    if (vec)
      layer_norm_fwd_kernel<T, true><<<grid, block, 0, stream>>>(xt, rt, gt, bt, static_cast<T*>(y),
                                                                 static_cast<T*>(sum_out), mean, rstd, rows, C, eps);
    else
      layer_norm_fwd_kernel<T, false><<<grid, block, 0, stream>>>(xt, rt, gt, bt, static_cast<T*>(y),
                                                                  static_cast<T*>(sum_out), mean, rstd, rows, C, eps);
    LS_CHECK_LAUNCH("layer_norm_fwd", stream);
  });
}

// ================================================================ forward, output as FP8 codes
// The layer norm of x [rows, C] written only as the e4m3 codes the FP8 projection after it reads (fp8.cu's cast of
// layer_norm_fwd's output under the delayed scale of state row `row`, whose amax records the output's maximum).
// A warp takes a row: lane j holds the 8-column groups of layer_norm_fwd_kernel's threads j, j + 32, ... (one per
// warp of its row), and sums them as those warps do (the butterfly within each, then the warps in order), so the
// mean, the variance, y rounded to T and its codes are those of layer_norm_fwd and fp8_quantize bit for bit, with
// no barrier per row. A block takes a band of kLnBand rows: the row-major codes go straight out, and through shared
// memory the band's transposed codes, out_t[c, band rows] (rows rows .. Mp - 1 zero; out_t nullptr: none).
// Two blocks an SM (128 registers a thread: each row's values, gamma and beta held from their loads on; with fewer
// registers they spill).
constexpr int kLnBand = 16;
constexpr int kLnCodesWarps = 8;
constexpr int kLnRowsPerWarp = kLnBand / kLnCodesWarps;

template <typename T, int C>
__global__ void __launch_bounds__(32 * kLnCodesWarps, 2) layer_norm_codes_kernel(
    const T* __restrict__ x, const T* __restrict__ gamma, const T* __restrict__ beta, float* __restrict__ mean_out,
    float* __restrict__ rstd_out, int64_t rows, float eps, float* __restrict__ row_state, uint8_t* __restrict__ out,
    uint8_t* __restrict__ out_t, int64_t Mp) {
  constexpr int V = C / 256;        // layer_norm_fwd_kernel's warps a row: the groups a lane holds
  constexpr int kStride = C + 4;    // bytes a band row in shared memory (a warp's stores and reads: one row's bytes)
  __shared__ __align__(16) uint8_t band[kLnBand * kStride];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t m0 = (int64_t)blockIdx.x * kLnBand;
  const float s = row_state[kFp8Scale];
  uint4 raw[kLnRowsPerWarp][V];  // every row's values loaded before the first is used
#pragma unroll
  for (int i = 0; i < kLnRowsPerWarp; ++i) {
    const int64_t r = m0 + warp + i * kLnCodesWarps;
#pragma unroll
    for (int w = 0; w < V; ++w)
      raw[i][w] = r < rows ? *reinterpret_cast<const uint4*>(x + r * C + 8 * (32 * w + lane)) : make_uint4(0u, 0u, 0u, 0u);
  }
  unsigned m = 0u;
#pragma unroll
  for (int i = 0; i < kLnRowsPerWarp; ++i) {
    const int rr = warp + i * kLnCodesWarps;
    const int64_t r = m0 + rr;
    const bool valid = r < rows;
    const T* t = reinterpret_cast<const T*>(&raw[i][0]);  // [w * 8 + k]: converted where used, not kept in fp32
    float total = 0.f;
#pragma unroll
    for (int w = 0; w < V; ++w) {
      float sum = 0.f;
#pragma unroll
      for (int k = 0; k < 8; ++k) sum += to_f(t[w * 8 + k]);
      total += warp_sum(sum);
    }
    const float mean = total / C;
    float qt = 0.f;
#pragma unroll
    for (int w = 0; w < V; ++w) {
      float q = 0.f;
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const float d = to_f(t[w * 8 + k]) - mean;
        q += d * d;
      }
      qt += warp_sum(q);
    }
    const float var = qt / C;
    const float rstd = rsqrtf(var + eps);
#pragma unroll
    for (int w = 0; w < V; ++w) {
      const int c0 = 8 * (32 * w + lane);
      float g[8], b[8], o[8];
      load8(gamma + c0, g);
      load8(beta + c0, b);
#pragma unroll
      for (int k = 0; k < 8; ++k) o[k] = valid ? (to_f(t[w * 8 + k]) - mean) * rstd * g[k] + b[k] : 0.f;
      round_as<T>(o);
      const uint2 packed = to_codes<uint2>(o, s, Fp8Format::E4M3, m);
      if (valid) *reinterpret_cast<uint2*>(out + r * C + c0) = packed;
      uint32_t* dst = reinterpret_cast<uint32_t*>(band + rr * kStride + c0);
      dst[0] = packed.x;
      dst[1] = packed.y;
    }
    if (valid && lane == 0) {
      mean_out[r] = mean;
      rstd_out[r] = rstd;
    }
  }
  m = block_max_bits<32 * kLnCodesWarps>(m);  // its barriers also make the band's shared rows visible
  // out_t[c, m0 .. m0 + 15]: the 16 codes of column c gathered from the band's rows, one 16-byte store
  if (out_t != nullptr && m0 < Mp) {
    for (int c = threadIdx.x; c < C; c += 32 * kLnCodesWarps) {
      uint4 word;
      uint8_t* bytes = reinterpret_cast<uint8_t*>(&word);
#pragma unroll
      for (int k = 0; k < 16; ++k) bytes[k] = band[k * kStride + c];
      *reinterpret_cast<uint4*>(out_t + (int64_t)c * Mp + m0) = word;
    }
  }
  if (threadIdx.x == 0) record_amax(row_state, m);
}

bool layer_norm_codes_supported(int C) { return C == 256 || C == 512 || C == 1024; }

namespace {
template <typename T, int C>
void launch_ln_codes(const void* x, const void* gamma, const void* beta, float* mean, float* rstd, int64_t rows,
                     float eps, float* row, void* out, void* out_t, int64_t Mp, cudaStream_t stream) {
  const int64_t grid = (Mp + kLnBand - 1) / kLnBand;
  layer_norm_codes_kernel<T, C><<<grid, 32 * kLnCodesWarps, 0, stream>>>(
      static_cast<const T*>(x), static_cast<const T*>(gamma), static_cast<const T*>(beta), mean, rstd, rows, eps, row,
      static_cast<uint8_t*>(out), static_cast<uint8_t*>(out_t), Mp);
}

template <typename T>
void launch_ln_codes(int C, const void* x, const void* gamma, const void* beta, float* mean, float* rstd,
                     int64_t rows, float eps, float* row, void* out, void* out_t, int64_t Mp, cudaStream_t stream) {
  if (C == 256) launch_ln_codes<T, 256>(x, gamma, beta, mean, rstd, rows, eps, row, out, out_t, Mp, stream);
  else if (C == 512) launch_ln_codes<T, 512>(x, gamma, beta, mean, rstd, rows, eps, row, out, out_t, Mp, stream);
  else launch_ln_codes<T, 1024>(x, gamma, beta, mean, rstd, rows, eps, row, out, out_t, Mp, stream);
}
}  // namespace

void layer_norm_codes(DType dt, const void* x, const void* gamma, const void* beta, float* mean, float* rstd,
                      int64_t rows, int C, float eps, float* row, void* out, void* out_t, int64_t Mp,
                      cudaStream_t stream) {
  if (rows <= 0) return;
  if (!layer_norm_codes_supported(C)) throw std::runtime_error("layer_norm_codes: hidden size must be 256, 512 or 1024");
  if (dt == DType::BF16)
    launch_ln_codes<__nv_bfloat16>(C, x, gamma, beta, mean, rstd, rows, eps, row, out, out_t, Mp, stream);
  else if (dt == DType::F16)
    launch_ln_codes<__half>(C, x, gamma, beta, mean, rstd, rows, eps, row, out, out_t, Mp, stream);
  else
    throw std::runtime_error("layer_norm_codes: bfloat16 or float16 input expected");
  LS_CHECK_LAUNCH("layer_norm_codes", stream);
}

// One wave: the backward kernel needs 64 registers a thread, so an SM holds 1024 of its threads, and a grid sized for
// 2048 would run in two waves and write twice the column partials the finalize then reads.
static int ln_bwd_grid(int64_t rows, int C) {
  const LnShape s = ln_shape(C);
  const int per_sm = std::max(1, 1024 / (s.tx * s.ty));
  const int64_t max_g = (rows + s.ty - 1) / s.ty;
  return (int)std::max<int64_t>(1, std::min<int64_t>(max_g, (int64_t)num_sms() * per_sm));
}

int64_t layer_norm_bwd_workspace(int64_t rows, int C) { return 2 * (int64_t)ln_bwd_grid(rows, C) * C; }

template <typename T, bool INV>
static void launch_ln_bwd(bool vec, int grid, dim3 block, size_t shmem, cudaStream_t stream, const void* dy,
                          const void* dsum, const void* xin, const void* gamma, const void* beta, const float* mean,
                          const float* rstd, void* dx, float* workspace, int64_t rows, int C) {
  auto k = vec ? layer_norm_bwd_kernel<T, true, INV> : layer_norm_bwd_kernel<T, false, INV>;
  k<<<grid, block, shmem, stream>>>(static_cast<const T*>(dy), static_cast<const T*>(dsum), static_cast<const T*>(xin),
                                    static_cast<const T*>(gamma), static_cast<const T*>(beta), mean, rstd,
                                    static_cast<T*>(dx), workspace, rows, C);
}

void layer_norm_bwd(DType dt, const void* dy, const void* dsum, const void* xin, const void* gamma, const void* beta,
                    const float* mean, const float* rstd, void* dx, void* dgamma, void* dbeta, float* workspace,
                    int64_t rows, int C, cudaStream_t stream) {
  if (C < 1 || C > kMaxC) throw std::runtime_error("layer_norm: hidden size must be in [1, 8192]");
  const LnShape s = ln_shape(C);
  const dim3 block(s.tx, s.ty);
  const int grid = ln_bwd_grid(rows, C);
  const size_t shmem = (size_t)s.tx * s.ty * 8 * sizeof(float);
  const bool inv = beta != nullptr;
  const bool vec = ln_vec(C, {dy, dsum, xin, gamma, beta, dx});
  LS_DISPATCH(dt, T, {
    if (rows > 0) {
      if (inv)
        launch_ln_bwd<T, true>(vec, grid, block, shmem, stream, dy, dsum, xin, gamma, beta, mean, rstd, dx, workspace,
                               rows, C);
      else
        launch_ln_bwd<T, false>(vec, grid, block, shmem, stream, dy, dsum, xin, gamma, beta, mean, rstd, dx, workspace,
                                rows, C);
      LS_CHECK_LAUNCH("layer_norm_bwd", stream);
    } else {
      cudaMemsetAsync(workspace, 0, 2 * (size_t)C * sizeof(float), stream);
    }
    const int G = rows > 0 ? grid : 1;
    T* const outs[2] = {static_cast<T*>(dgamma), static_cast<T*>(dbeta)};
    colsum_finalize<T, 2>(workspace, G, C, outs, stream, "layer_norm_bwd dgamma/dbeta");
  });
}

}  // namespace ls
