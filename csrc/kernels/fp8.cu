// Per-tensor FP8 quantisation for the FP8 linear layers (csrc/torch/fp8.cpp), with delayed scaling: the plain
// cast of one tensor (with an amax pass first under current scaling), the weights' casts in one launch, the head's
// gradient cast straight from the logits, and the roll of the scaling state. The casts fused with other ops (the
// FFN's activation and its gradient, the attention heads' merged gradient) are in fp8_fused.cu; the tile cast both
// use is in fp8_cast.cuh.
//
// Numerics. A tensor x is stored as q = fp8(x * s) with one fp32 scale s per tensor, s the largest power of two
// with m * s <= the format's largest finite value for a reference maximum m (s = 1 when m = 0, NaN when m is inf or
// NaN), so x * s and the GEMM's 1/s are exact and the only rounding is the one to FP8 (round to nearest even,
// saturating). Delayed scaling takes m from the state row's history of maxima, so the codes come out of one pass
// that also records x's own maximum for the next roll; fp8_roll, once per training forward, pushes each row's
// recorded maximum into its history (a non-finite one is left out) and derives the next s and 1/s.
// ls_fairseq/ops/fp8.py holds the same rules in plain PyTorch; docs/fp8.md ("Kernels and layouts") has the rest.
#include "kernels/ce_grad.cuh"
#include "kernels/fp8_cast.cuh"

namespace ls {

namespace {

template <typename T>
__global__ void amax_kernel(const T* __restrict__ x, int64_t n, unsigned* __restrict__ amax_bits) {
  unsigned m = 0u;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  const int64_t groups = n / 8;  // n is a multiple of 16
  for (int64_t g = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; g < groups; g += stride) {
    float v[8];
    load8(x + g * 8, v);
#pragma unroll
    for (int k = 0; k < 8; ++k) m = max(m, abs_bits(v[k]));
  }
  m = block_max_bits<kThreads>(m);
  if (threadIdx.x == 0) atomicMax(amax_bits, m);
}

// Where the cast reads its values: load16(i, j, v) gives the 16 elements j .. j + 15 of row i of the [M, K] tensor to
// quantise, as fp32 values of the storage type T.
template <typename T>
struct PlainSource {
  static constexpr bool kSums = false;  // whether the cast also sums the columns (load16 then fills raw)
  const T* x;
  int64_t K;
  __device__ __forceinline__ void begin() {}
  __device__ __forceinline__ void load16(int64_t i, int64_t j, float (&v)[16]) {
    load8(x + i * K + j, *reinterpret_cast<float(*)[8]>(v));
    load8(x + i * K + j + 8, *reinterpret_cast<float(*)[8]>(v + 8));
  }
};

// The head's gradient of the logits x [N, V] for the loss's statistics (lse per row, from ls_ce_fwd_kernel) as
// the fused loss kernel computes it (ce_grad, rounded to T); rows whose target is ignore_index give zeros. The
// coefficients are the fused kernel's (g_nll = 0; g_loss read from device memory, nullptr: 1).
template <typename T>
struct CeGradSource {
  static constexpr bool kSums = false;
  const T* x;
  const int64_t* target;
  const float* lse;
  const float* g_loss;
  int64_t K;
  float eps;
  int64_t ignore_index;
  CeGrad c;
  __device__ __forceinline__ void begin() { c = ce_grad_coeffs(g_loss != nullptr ? *g_loss : 1.f, 0.f, eps, (int)K); }
  __device__ __forceinline__ void load16(int64_t i, int64_t j, float (&v)[16]) {
    const int64_t t = target[i];
    if (t == ignore_index) {
#pragma unroll
      for (int k = 0; k < 16; ++k) v[k] = 0.f;
      return;
    }
    const float l = lse[i];
    load8(x + i * K + j, *reinterpret_cast<float(*)[8]>(v));
    load8(x + i * K + j + 8, *reinterpret_cast<float(*)[8]>(v + 8));
#pragma unroll
    for (int k = 0; k < 16; ++k) v[k] = ce_grad(v[k], l, c, j + k == t);
    round_as<T>(v);
  }
};

// Several tensors' casts in one launch (the forward's weights, fp8_quantize_many): the jobs' 64 x 64 tiles numbered
// one after another (job j's from start[j]), walked by the grid in that order as cast_kernel walks one tensor's.
// A block records a job's absolute maximum in its row when it moves on to a later job (the job index is the same
// across the block, so the block reduction is too), and its last job's at the end.
constexpr int kMaxCastJobs = 32;  // per launch: the table travels in the kernel's parameters (under 4 KB)
struct CastJobs {
  int n;
  int64_t start[kMaxCastJobs + 1];
  Fp8CastJob job[kMaxCastJobs];
};

template <typename T>
__global__ void cast_many_kernel(const CastJobs jobs, Fp8Format fmt) {
  __shared__ __align__(16) uint8_t tile_t[2][kTile * kTile];
  const int r = threadIdx.x >> 2, c = (threadIdx.x & 3) * 16;
  unsigned m = 0u;
  int buf = 0, cur = 0;
  for (int64_t t = blockIdx.x; t < jobs.start[jobs.n]; t += gridDim.x, buf ^= 1) {
    while (t >= jobs.start[cur + 1]) {  // the jobs before t's are done here: their maximum
      m = block_max_bits<kThreads>(m);
      if (threadIdx.x == 0) record_amax(jobs.job[cur].row, m);
      m = 0u;
      ++cur;
    }
    const Fp8CastJob& J = jobs.job[cur];
    const int64_t tiles_k = (J.K + kTile - 1) / kTile, local = t - jobs.start[cur];
    const int64_t m0 = (local / tiles_k) * kTile, k0 = (local % tiles_k) * kTile;
    const int64_t i = m0 + r, j = k0 + c;
    float v[16];
    if (i < J.M && j < J.K) {
      PlainSource<T>{static_cast<const T*>(J.x), J.K}.load16(i, j, v);
    } else {
#pragma unroll
      for (int k = 0; k < 16; ++k) v[k] = 0.f;
    }
    const uint4 packed = to_codes<uint4>(v, J.row[kFp8Scale], fmt, m);
    store_codes(packed, i, j, J.M, J.K, static_cast<uint8_t*>(J.out), tile_t[buf], m0, k0, J.Mp,
                static_cast<uint8_t*>(J.out_t));
  }
  m = block_max_bits<kThreads>(m);
  if (threadIdx.x == 0 && cur < jobs.n) record_amax(jobs.job[cur].row, m);
}

__global__ void roll_kernel(float* __restrict__ state, int64_t rows, Fp8Format grad_fmt) {
  const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= rows) return;
  float* row = state + i * kFp8Width;
  const unsigned a = __float_as_uint(row[kFp8Amax]);
  if (a < 0x7f800000u) {  // finite: it joins the history
    for (int k = kFp8History - 1; k > 0; --k) row[kFp8Hist + k] = row[kFp8Hist + k - 1];
    row[kFp8Hist] = __uint_as_float(a);
  }
  unsigned m = 0u;
  for (int k = 0; k < kFp8History; ++k) m = max(m, __float_as_uint(row[kFp8Hist + k]));
  const float s = scale_from_bits(m, i % 3 == 2 ? grad_fmt : Fp8Format::E4M3);
  row[kFp8Amax] = 0.f;
  row[kFp8Scale] = s;
  row[kFp8ScaleInv] = 1.f / s;
}

}  // namespace

// ---------------------------------------------------------------- launchers

void fp8_roll(float* state, int64_t rows, Fp8Format grad_fmt, cudaStream_t stream) {
  if (rows <= 0) return;
  roll_kernel<<<(unsigned)((rows + 127) / 128), 128, 0, stream>>>(state, rows, grad_fmt);
  check_launch("fp8_roll", stream);
}

void fp8_quantize(DType dt, const void* x, int64_t M, int64_t K, float* row, Fp8Format fmt, bool current, void* out,
                  void* out_t, int64_t Mp, cudaStream_t stream) {
  if (current && M * K > 0) {
    LS_DISPATCH(dt, T, amax_kernel<T><<<blocks_for(M * K / 8, kThreads), kThreads, 0, stream>>>(
                           static_cast<const T*>(x), M * K, reinterpret_cast<unsigned*>(row + kFp8Amax)));
    check_launch("fp8_amax", stream);
  }
  LS_DISPATCH(dt, T, cast_kernel<<<tile_blocks<cast_kernel<PlainSource<T>>>(M, K, Mp), kThreads, 0, stream>>>(
                         PlainSource<T>{static_cast<const T*>(x), K}, M, K, row, fmt, current,
                         static_cast<uint8_t*>(out), static_cast<uint8_t*>(out_t), Mp));
  check_launch("fp8_cast", stream);
}

void fp8_quantize_many(DType dt, const Fp8CastJob* jobs, int n, Fp8Format fmt, cudaStream_t stream) {
  for (int first = 0; first < n; first += kMaxCastJobs) {
    CastJobs table{};
    table.n = n - first < kMaxCastJobs ? n - first : kMaxCastJobs;
    for (int k = 0; k < table.n; ++k) {
      const Fp8CastJob& J = jobs[first + k];
      table.job[k] = J;
      table.start[k + 1] = table.start[k] + tile_count(J.M, J.K, J.Mp);
    }
    if (table.start[table.n] == 0) continue;
    LS_DISPATCH(dt, T, cast_many_kernel<T><<<wave_blocks<cast_many_kernel<T>>(table.start[table.n]), kThreads, 0,
                                             stream>>>(table, fmt));
    check_launch("fp8_quantize_many", stream);
  }
}

void fp8_ce_grad(DType dt, const void* logits, const int64_t* target, const float* lse, const float* g_loss, int64_t N,
                 int V, float epsilon, int64_t ignore_index, float* fp8_row, Fp8Format fmt, void* codes,
                 void* codes_t, int64_t Mp, cudaStream_t stream) {
  if (N <= 0) return;
  LS_DISPATCH(dt, T, {
    const CeGradSource<T> src{static_cast<const T*>(logits), target, lse, g_loss, V, epsilon, ignore_index, {}};
    cast_kernel<<<tile_blocks<cast_kernel<CeGradSource<T>>>(N, V, Mp), kThreads, 0, stream>>>(
        src, N, V, fp8_row, fmt, false, static_cast<uint8_t*>(codes), static_cast<uint8_t*>(codes_t), Mp);
  });
  check_launch("fp8_ce_grad", stream);
}

}  // namespace ls
