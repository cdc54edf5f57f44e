// The tile cast that every FP8 quantisation kernel runs (fp8.cu, fp8_fused.cu): a source of values (Source::load16)
// becomes e4m3 / e5m2 codes under a per-tensor power-of-two scale, row-major and/or transposed, with the tensor's
// absolute maximum recorded for delayed scaling and, for a summing source, its columns' partial sums.
//
// The cast works on 64 x 64 tiles: 256 threads each convert 16 consecutive elements of a row and store them as one
// 16-byte word of the row-major codes; the transposed codes (what the weight-gradient GEMM reads) go through shared
// memory and leave as 16-byte words of the transposed rows. The grid is one wave: no more blocks than the GPU holds.
#pragma once

#include "kernels/fp8_codes.cuh"

namespace ls {

namespace {

constexpr int kThreads = 256;
constexpr int kMaxBlocks = 1184;  // 8 per SM on a 148-SM chip: enough to fill the grid-stride loops
constexpr int kTile = 64;

__device__ __forceinline__ float scale_from_bits(unsigned amax_bits, Fp8Format fmt) {
  if (amax_bits >= 0x7f800000u) return __int_as_float(0x7fc00000);  // inf or NaN: NaN scale
  if (amax_bits == 0u) return 1.f;
  int E;
  const float f = frexpf(__uint_as_float(amax_bits), &E);
  const int F = fmt == Fp8Format::E4M3 ? 9 : 16;
  int k = f <= 0.875f ? F - E : F - E - 1;
  k = k < -126 ? -126 : (k > 126 ? 126 : k);
  return ldexpf(1.f, k);
}

// Adds this tile's rows of raw into partial[k0 .. k0 + 63] (the tile row's slice of the partial sums), in a fixed
// order: a butterfly over the 8 rows of a warp, then the 8 warps in turn.
__device__ __forceinline__ void tile_colsum(float (&raw)[16], float* __restrict__ partial, int64_t k0, int64_t K) {
  __shared__ float warp_sums[kThreads / 32][kTile];
#pragma unroll
  for (int k = 0; k < 16; ++k) {
    float s = raw[k];
    s += __shfl_xor_sync(0xffffffffu, s, 4);
    s += __shfl_xor_sync(0xffffffffu, s, 8);
    s += __shfl_xor_sync(0xffffffffu, s, 16);
    raw[k] = s;
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane < 4) {
#pragma unroll
    for (int k = 0; k < 16; ++k) warp_sums[warp][lane * 16 + k] = raw[k];
  }
  __syncthreads();
  if (threadIdx.x < kTile && k0 + threadIdx.x < K) {
    float s = 0.f;
#pragma unroll
    for (int w = 0; w < kThreads / 32; ++w) s += warp_sums[w][threadIdx.x];
    partial[k0 + threadIdx.x] = s;
  }
  __syncthreads();
}

// Byte offset, in row x of the transposed shared tile, of that row's 16-byte chunk q (its rows 16q .. 16q + 15 of
// the untransposed tile): chunk q is kept at chunk q ^ (x / 16) % 4, so that the byte stores of a warp (8 rows,
// 4 chunks) hit distinct banks. Rows x .. x + 15 with x a multiple of 16 share the offset.
__device__ __forceinline__ int swizzled_chunk(int x, int q) { return ((q ^ (x >> 4)) & 3) * 16; }

// This thread's 16 codes (row r = threadIdx.x / 4, columns c .. c + 15 of the tile at (m0, k0)) into the transposed
// codes out_t [K, Mp], through tb: one of the kernel's two shared tiles, alternated per tile so that one barrier per
// tile suffices (tb is written again only after the next tile's barrier, which every thread reaches after its read).
__device__ __forceinline__ void store_transposed(const uint4& packed, uint8_t* tb, int64_t m0, int64_t k0, int64_t K,
                                                 int64_t Mp, uint8_t* __restrict__ out_t) {
  const int r = threadIdx.x >> 2, c = (threadIdx.x & 3) * 16;
  const uint8_t* b = reinterpret_cast<const uint8_t*>(&packed);
  const int at = swizzled_chunk(c, r >> 4) + (r & 15);  // row r's byte in transposed rows c .. c + 15
#pragma unroll
  for (int k = 0; k < 16; ++k) tb[(c + k) * kTile + at] = b[k];
  __syncthreads();
  const int64_t jt = k0 + r, it = m0 + c;  // transposed: row jt of out_t, its columns it .. it + 15
  if (jt < K && it < Mp)
    *reinterpret_cast<uint4*>(out_t + jt * Mp + it) =
        *reinterpret_cast<const uint4*>(tb + r * kTile + swizzled_chunk(r, c >> 4));
}

// This thread's 16 codes (of row i, columns j .. j + 15, in the tile at (m0, k0)) into the row-major codes out
// [M, K] and the transposed codes out_t, each skipped when nullptr
__device__ __forceinline__ void store_codes(const uint4& packed, int64_t i, int64_t j, int64_t M, int64_t K,
                                            uint8_t* __restrict__ out, uint8_t* tb, int64_t m0, int64_t k0,
                                            int64_t Mp, uint8_t* __restrict__ out_t) {
  if (out != nullptr && i < M && j < K) *reinterpret_cast<uint4*>(out + i * K + j) = packed;
  if (out_t != nullptr) store_transposed(packed, tb, m0, k0, K, Mp, out_t);
}

// partial (Source::kSums): [tiles of 64 rows, K] floats, each tile row's column sums of the source's raw values
template <typename Source>
__global__ void cast_kernel(Source src, int64_t M, int64_t K, float* __restrict__ row, Fp8Format fmt, bool current,
                            uint8_t* __restrict__ out, uint8_t* __restrict__ out_t, int64_t Mp,
                            float* __restrict__ partial = nullptr) {
  __shared__ __align__(16) uint8_t tile_t[2][kTile * kTile];  // two buffers: one barrier per tile
  const float s = current ? scale_from_bits(__float_as_uint(row[kFp8Amax]), fmt) : row[kFp8Scale];
  if (current && blockIdx.x == 0 && threadIdx.x == 0) {
    row[kFp8Scale] = s;
    row[kFp8ScaleInv] = 1.f / s;  // exact: s is a power of two (or NaN)
  }
  const int64_t tiles_m = (Mp + kTile - 1) / kTile, tiles_k = (K + kTile - 1) / kTile;
  const int r = threadIdx.x >> 2, c = (threadIdx.x & 3) * 16;  // this thread's row and first column in a tile
  unsigned m = 0u;
  int buf = 0;
  src.begin();
  for (int64_t t = blockIdx.x; t < tiles_m * tiles_k; t += gridDim.x, buf ^= 1) {
    const int64_t m0 = (t / tiles_k) * kTile, k0 = (t % tiles_k) * kTile;
    const int64_t i = m0 + r, j = k0 + c;
    float v[16], raw[16];
    if (i < M && j < K) {  // K is a multiple of 16: a row's 16 columns are all in or all out
      if constexpr (Source::kSums) src.load16(i, j, v, raw);
      else src.load16(i, j, v);
    } else {
#pragma unroll
      for (int k = 0; k < 16; ++k) v[k] = raw[k] = 0.f;
    }
    if constexpr (Source::kSums) {
      if (partial != nullptr) tile_colsum(raw, partial + (t / tiles_k) * K, k0, K);  // uniform over the block
    }
    const uint4 packed = to_codes<uint4>(v, s, fmt, m);
    store_codes(packed, i, j, M, K, out, tile_t[buf], m0, k0, Mp, out_t);
  }
  if (!current) {
    m = block_max_bits<kThreads>(m);
    if (threadIdx.x == 0) record_amax(row, m);
  }
}

int blocks_for(int64_t work, int64_t per_block) {
  const int64_t b = (work + per_block - 1) / per_block;
  return (int)(b < 1 ? 1 : (b > kMaxBlocks ? kMaxBlocks : b));
}

// rows of 64 x 64 tiles over the [max(M, Mp), K] tensor the cast walks
int64_t tile_rows(int64_t M, int64_t Mp) { return ((Mp > M ? Mp : M) + kTile - 1) / kTile; }

// rows of work items of `chunk` tiles down a column strip (of partial sums of a summing cast)
int64_t chunk_rows(int64_t M, int64_t Mp, int chunk) { return (tile_rows(M, Mp) + chunk - 1) / chunk; }

// work items of `chunk` 64 x 64 tiles over the [max(M, Mp), K] tensor the cast walks
int64_t tile_count(int64_t M, int64_t K, int64_t Mp, int chunk = 1) {
  return chunk_rows(M, Mp, chunk) * ((K + kTile - 1) / kTile);
}

// the grid of a tile kernel (cast_kernel, chunked_cast_kernel, cast_many_kernel) over `tiles` work items: one per
// block and step, no more blocks than the GPU holds at once with its registers (one wave)
template <auto Kernel>
int wave_blocks(int64_t tiles) {
  const int64_t resident = resident_blocks<Kernel, kThreads>();
  return blocks_for(tiles < resident ? tiles : resident, 1);
}

template <auto Kernel>
int tile_blocks(int64_t M, int64_t K, int64_t Mp, int chunk = 1) {  // chunk: tiles a work item (chunked_cast_kernel)
  return wave_blocks<Kernel>(tile_count(M, K, Mp, chunk));
}

}  // namespace

}  // namespace ls
