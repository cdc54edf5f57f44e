// Row loop with a fused, deterministic column sum: the skeleton of every backward kernel
// that produces a bias (or gamma/beta) gradient next to an elementwise input gradient.
//
// Layout: block (32, 8); thread x owns 8 consecutive columns c0 = 8 * (blockIdx.x * 32 + tx),
// thread y walks rows r = blockIdx.y * 8 + ty, stepping gridDim.y * 8. Each thread keeps fp32
// sums of what the op returns for its columns, the 8 y-threads are combined in shared memory in
// a fixed order and written to partial[blockIdx.y, C]; colsum_finalize then sums the gridDim.y
// partial rows in a fixed order (one launch for all sums). No atomics, so the result is bit-identical run to run.
#pragma once

#include "kernels/common.cuh"

namespace ls {

constexpr int kColsumTX = 32, kColsumTY = 8;

inline dim3 colsum_grid(int64_t rows, int C) {
  int gx = ceil_div(C, 8 * kColsumTX);
  int target = num_sms() * 8;  // blocks of 256 threads to fill the GPU
  int64_t gy = (target + gx - 1) / gx;
  int64_t max_gy = (rows + kColsumTY - 1) / kColsumTY;
  if (gy > max_gy) gy = max_gy;
  if (gy < 1) gy = 1;
  if (gy > 65535) gy = 65535;
  return dim3(gx, static_cast<unsigned>(gy));
}

inline int64_t colsum_partial_floats(int64_t rows, int C) {
  dim3 g = colsum_grid(rows, C);
  return static_cast<int64_t>(g.y) * C;
}

// Op: struct with  template <bool VEC> __device__ void apply(int64_t r, int c0, int n, float (&v)[N_SUMS][8])
// computing the elementwise output of row r, columns c0 .. c0+n-1, and returning in v what the
// column sums accumulate (N_SUMS independent sums, e.g. dgamma and dbeta).
template <int N_SUMS, bool VEC, typename Op>
__global__ void __launch_bounds__(256) rowloop_colsum_kernel(Op op, int64_t rows, int C, float* __restrict__ partial) {
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int c0 = 8 * (blockIdx.x * kColsumTX + tx);
  const int n = c0 < C ? min(8, C - c0) : 0;
  float acc[N_SUMS][8];
#pragma unroll
  for (int s = 0; s < N_SUMS; ++s)
#pragma unroll
    for (int k = 0; k < 8; ++k) acc[s][k] = 0.f;
  if (n > 0) {
    for (int64_t r = (int64_t)blockIdx.y * kColsumTY + ty; r < rows; r += (int64_t)gridDim.y * kColsumTY) {
      float v[N_SUMS][8];
      op.template apply<VEC>(r, c0, n, v);
#pragma unroll
      for (int s = 0; s < N_SUMS; ++s)
#pragma unroll
        for (int k = 0; k < 8; ++k) acc[s][k] += v[s][k];
    }
  }
  if (partial == nullptr) return;
  __shared__ float sh[kColsumTY][kColsumTX * 8 + 1];
  for (int s = 0; s < N_SUMS; ++s) {
#pragma unroll
    for (int k = 0; k < 8; ++k) sh[ty][tx * 8 + k] = acc[s][k];
    __syncthreads();
    // 256 threads, 256 columns of this block: thread t sums column t over the 8 rows.
    const int t = ty * kColsumTX + tx;
    const int c = 8 * blockIdx.x * kColsumTX + t;
    float sum = 0.f;
#pragma unroll
    for (int y = 0; y < kColsumTY; ++y) sum += sh[y][t];
    if (c < C) partial[((int64_t)s * gridDim.y + blockIdx.y) * C + c] = sum;
    __syncthreads();
  }
}

// ---------------------------------------------------------------- finalize
// out_s[c] = sum_g partial[s, g, c] for every s whose out_s is set, in ONE launch: grid
// (ceil(C / 32), N_SUMS), block (32, 32). Thread (x, y) of block (bx, s) owns column bx * 32 + x
// and the partial rows g = y, y + 32, ..., kept in four independent accumulators (four loads in
// flight instead of one: the partials sit in L2 and the kernel is latency-bound). The 32 per-y
// sums of a column are then added by one warp with a fixed butterfly. Every addition happens in
// an order fixed by (G, C) alone: bit-identical run to run.
template <typename T, int N_SUMS>
struct ColsumOuts {
  T* p[N_SUMS];
};

template <typename T, int N_SUMS>
__global__ void __launch_bounds__(1024) colsum_finalize_kernel(const float* __restrict__ partial, int G, int C,
                                                               ColsumOuts<T, N_SUMS> outs) {
  T* out = outs.p[blockIdx.y];
  if (out == nullptr) return;  // uniform over the block
  __shared__ float sh[32][33];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int c = blockIdx.x * 32 + tx;
  const float* src = partial + (int64_t)blockIdx.y * G * C;
  float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
  if (c < C) {
    int g = ty;
    for (; g + 96 < G; g += 128) {
      a0 += src[(int64_t)g * C + c];
      a1 += src[(int64_t)(g + 32) * C + c];
      a2 += src[(int64_t)(g + 64) * C + c];
      a3 += src[(int64_t)(g + 96) * C + c];
    }
    for (; g < G; g += 32) a0 += src[(int64_t)g * C + c];
  }
  sh[ty][tx] = (a0 + a1) + (a2 + a3);
  __syncthreads();
  // warp ty reduces column ty of this block: lane l holds the partial of y = l
  const float v = warp_sum(sh[tx][ty]);
  const int cw = blockIdx.x * 32 + ty;
  if (tx == 0 && cw < C) out[cw] = from_f<T>(v);
}

// Launches the finalize for partial [N_SUMS, G, C]; outs[s] == nullptr skips sum s.
template <typename T, int N_SUMS>
void colsum_finalize(const float* partial, int G, int C, T* const (&outs)[N_SUMS], cudaStream_t stream,
                     const char* name) {
  ColsumOuts<T, N_SUMS> o;
  bool any = false;
  for (int s = 0; s < N_SUMS; ++s) {
    o.p[s] = outs[s];
    any = any || outs[s] != nullptr;
  }
  if (!any || C <= 0) return;
  colsum_finalize_kernel<T, N_SUMS><<<dim3(ceil_div(C, 32), N_SUMS), dim3(32, 32), 0, stream>>>(partial, G, C, o);
  LS_CHECK_LAUNCH(name, stream);
}

// Runs op over all rows; for each of the N_SUMS sums with outs[s] != nullptr writes the column sum.
// workspace: N_SUMS * colsum_partial_floats(rows, C) floats (unused when every out is null).
template <typename T, int N_SUMS, typename Op>
void run_rowloop_colsum(Op op, bool vec, int64_t rows, int C, T* const (&outs)[N_SUMS], float* workspace,
                        cudaStream_t stream, const char* name) {
  if (rows <= 0 || C <= 0) return;
  dim3 grid = colsum_grid(rows, C);  // the most partial rows the workspace holds
  dim3 block(kColsumTX, kColsumTY);
  bool any = false;
  for (int s = 0; s < N_SUMS; ++s) any = any || outs[s] != nullptr;
  float* partial = any ? workspace : nullptr;
  // one wave: no more row blocks than the GPU holds at once with this op's registers (fewer partials too)
  auto one_wave = [&](int resident) {
    const int gy = std::max(1, resident / static_cast<int>(grid.x));
    if (static_cast<int>(grid.y) > gy) grid.y = gy;
  };
  if (vec) {
    one_wave(resident_blocks<rowloop_colsum_kernel<N_SUMS, true, Op>, kColsumTX * kColsumTY>());
    rowloop_colsum_kernel<N_SUMS, true><<<grid, block, 0, stream>>>(op, rows, C, partial);
  } else {
    one_wave(resident_blocks<rowloop_colsum_kernel<N_SUMS, false, Op>, kColsumTX * kColsumTY>());
    rowloop_colsum_kernel<N_SUMS, false><<<grid, block, 0, stream>>>(op, rows, C, partial);
  }
  LS_CHECK_LAUNCH(name, stream);
  if (any) colsum_finalize<T, N_SUMS>(partial, grid.y, C, outs, stream, "colsum_finalize");
}

}  // namespace ls
