// Per-tensor FP8 quantisation for the FP8 linear layers (csrc/torch/fp8.cpp), with delayed scaling.
//
// Numerics. A tensor x is stored as q = fp8(x * s) with one fp32 scale s per tensor. s is always a power of two,
// the largest one with m * s <= the format's largest finite value for a reference maximum m:
//
//     m = f * 2^E with f in [0.5, 1)          (frexp)
//     k = F - E  if f <= 0.875,  F - E - 1 otherwise,   F = 9 (e4m3, max 448 = 0.875 * 2^9)
//                                                        F = 16 (e5m2, max 57344 = 0.875 * 2^16)
//     s = 2^k, k clamped to [-126, 126];  s = 1 when m = 0;  s = NaN when m is inf or NaN
//
// so x * s is exact in fp32, the GEMM's dequantisation factor 1/s is exact, and the only rounding is the one to
// FP8 (round to nearest even, values beyond the format's range saturate to its largest finite value).
//
// Delayed scaling: m is the largest absolute maximum this tensor had over its last kFp8History uses (the state row's
// history), so the codes come out of ONE pass over x, which also records x's own absolute maximum in the row for the
// next roll. fp8_roll, launched once per training forward for all rows of a model, pushes each row's recorded maximum
// into its history (a non-finite one is left out: an fp16 overflow must not poison the scales that follow) and
// derives the row's next s and 1/s. Current scaling (`current`, the first forward and backward of a fresh state,
// whose history is empty) takes m from x itself: an amax pass, then the cast.
//
// Inf or NaN in x: under current scaling the scale is NaN and so are the codes; under delayed scaling the cast writes
// NaN to the row's 1/s, so the GEMM's output is NaN. Either way an fp16 overflow reaches the optimizer's check.
// ls_fairseq/ops/fp8.py holds the same rules in plain PyTorch (the reference the tests compare with).
//
// The same cast also takes its values straight from dropout(act(x + bias)) (fp8_bias_act_dropout): the FP8 FFN's
// activation is never written in its own precision, only as codes; and from that activation's backward
// (fp8_act_dropout_grad) and from the attention heads' gradients (fp8_merge_heads_grad): the output gradients of
// the FFN's first projection and of the attention's input projection leave as codes too, with their bias gradients
// summed on the way (per 64-row tile, or per work item of tiles down a column strip, in a fixed order, then
// colsum_finalize: deterministic).
//
// The weights of a model's FP8 projections are cast together, in one launch per 32 (fp8_quantize_many): each weight
// alone is one or two waves of tiles, too few to keep the GPU's memory busy. The head's gradient comes from the
// logits through its own source (CeGradSource), both layouts in one pass after the loss's per-row statistics.
//
// The cast works on 64 x 64 tiles: 256 threads each convert 16 consecutive elements of a row and store them as one
// 16-byte word of the row-major codes; the transposed codes (what the weight-gradient GEMM reads) go through shared
// memory and leave as 16-byte words of the transposed rows.
#include "kernels/act_dropout.cuh"
#include "kernels/ce_grad.cuh"
#include "kernels/colsum.cuh"
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

// a = dropout(act(x + bias)) as bias_act_dropout_fwd computes and stores it (dropout.cu: fp32 arithmetic, the keep
// bits of 8-element group g from Philox(g), the result rounded to T), never written out. Dropout applies when p > 0:
// DRAW draws the keep bits (the forward; written to keep unless it is nullptr), otherwise they are read from keep
// (the backward's replay). positive (DRAW, nullable): gets the bits of a > 0, in the keep mask's layout.
template <typename T, Act A, bool DRAW>
struct ActDropoutSource {
  static constexpr bool kSums = false;
  const T* x;
  const T* bias;
  uint8_t* keep;
  uint8_t* positive;
  int64_t K;
  float p;
  uint32_t threshold;
  PhiloxArgs rng;
  uint64_t seed = 0, offset = 0;
  __device__ __forceinline__ void begin() {
    if (DRAW && p > 0.f) philox_unpack(rng, seed, offset);
  }
  // Every load is issued before the Philox draws, so the draws overlap the loads' latency (1.4x faster on an H100
  // than drawing between them); the keep and positive bits of the two groups leave as one 2-byte store each.
  __device__ __forceinline__ void load16(int64_t i, int64_t j, float (&v)[16]) {
    const float scale = 1.f / (1.f - p);
    const int64_t e = i * K + j;  // a multiple of 16: groups e / 8 and e / 8 + 1
    float b[16];
    load8(x + e, *reinterpret_cast<float(*)[8]>(v));
    load8(x + e + 8, *reinterpret_cast<float(*)[8]>(v + 8));
    if (bias != nullptr) {
      load8(bias + j, *reinterpret_cast<float(*)[8]>(b));
      load8(bias + j + 8, *reinterpret_cast<float(*)[8]>(b + 8));
    }
    uint32_t bits[2] = {0u, 0u};
    if (p > 0.f) {
#pragma unroll
      for (int h = 0; h < 2; ++h)
        bits[h] = DRAW ? dropout_bits((uint64_t)((e >> 3) + h), seed, offset, threshold) : keep[(e >> 3) + h];
    }
    uint32_t pos[2] = {0u, 0u};
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float(&w)[8] = *reinterpret_cast<float(*)[8]>(v + 8 * h);
      bias_act8<A>(w, bias != nullptr ? b + 8 * h : nullptr);
      if (p > 0.f) keep8(w, bits[h], scale);
      round_as<T>(w);
#pragma unroll
      for (int k = 0; k < 8; ++k) pos[h] |= w[k] > 0.f ? 1u << k : 0u;
    }
    if (DRAW && p > 0.f && keep != nullptr)
      *reinterpret_cast<uint16_t*>(keep + (e >> 3)) = (uint16_t)(bits[0] | bits[1] << 8);
    if (DRAW && positive != nullptr)
      *reinterpret_cast<uint16_t*>(positive + (e >> 3)) = (uint16_t)(pos[0] | pos[1] << 8);
  }
};

// dh = the gradient of x in a = dropout(act(x + bias)) for the gradient dy of a, as bias_act_dropout_bwd computes
// it (dropout.cu: fp32, rounded to T), and the fp32 values before rounding in raw (what the bias gradient sums).
// x nullptr (relu): keep holds the bits of a > 0 (relu' and the keep bits in one); otherwise keep holds the keep
// bits, or is nullptr when no dropout was applied.
template <typename T, Act A>
struct ActDropoutGradSource {
  static constexpr bool kSums = true;
  static constexpr int kWords = sizeof(T);  // 16-byte words of 16 elements
  const T* dy;
  const T* x;
  const T* bias;
  const uint8_t* keep;
  int64_t K;
  float scale;
  // what 16 elements of a row need from memory, as stored: chunked_cast_kernel fetches them a tile ahead of their use
  struct Fetched {
    uint4 dy[kWords];
    uint4 x[A == Act::None ? 1 : kWords];
    uint32_t bits;  // keep bits of the two 8-element groups
  };
  __device__ __forceinline__ void begin() {}
  __device__ __forceinline__ void fetch(int64_t i, int64_t j, Fetched& f) const {
    const int64_t e = i * K + j;  // a multiple of 16: groups e / 8 and e / 8 + 1
#pragma unroll
    for (int q = 0; q < kWords; ++q) f.dy[q] = reinterpret_cast<const uint4*>(dy + e)[q];
    if constexpr (A != Act::None) {
      if (x != nullptr) {
#pragma unroll
        for (int q = 0; q < kWords; ++q) f.x[q] = reinterpret_cast<const uint4*>(x + e)[q];
      }
    }
    f.bits = keep != nullptr ? *reinterpret_cast<const uint16_t*>(keep + (e >> 3)) : 0u;
  }
  // raw: the gradient in fp32 before rounding; the cast's values are raw rounded to T (values_of)
  __device__ __forceinline__ void convert(const Fetched& f, int64_t j, float (&raw)[16]) const {
    const T* g16 = reinterpret_cast<const T*>(f.dy);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float(&g)[8] = *reinterpret_cast<float(*)[8]>(raw + 8 * h);
      const uint32_t bits = (f.bits >> (8 * h)) & 0xffu;
#pragma unroll
      for (int k = 0; k < 8; ++k) g[k] = to_f(g16[8 * h + k]);
      if (A == Act::Relu && x == nullptr) {
        keep8(g, bits, scale);
      } else {
        if constexpr (A != Act::None) {
          const T* x16 = reinterpret_cast<const T*>(f.x);
          float z[8], b[8];
#pragma unroll
          for (int k = 0; k < 8; ++k) z[k] = to_f(x16[8 * h + k]);
          if (bias != nullptr) load8(bias + j + 8 * h, b);
          act_grad8<A>(g, z, bias != nullptr ? b : nullptr);
        }
        if (keep != nullptr) keep8(g, bits, scale);
      }
    }
  }
  static __device__ __forceinline__ void values_of(float (&raw)[16]) { round_as<T>(raw); }
};

// The gradient of the attention's input projection, merged from the heads' gradients: row r (= b * T + t), column
// j of [B * T, n * H * D] is src[j / (H * D)] at head (j % (H * D)) / D, position j % D, of token (b, t); the parts
// are [B, H, T, D], stored [B, T, H, D] when token_major (nullptr: zeros). D a multiple of 16, so a 16-column load is
// one head's contiguous run. The values are copied (no rounding); raw = v for the bias gradient.
template <typename T>
struct MergeHeadsSource {
  static constexpr bool kSums = true;
  const T* src[kMaxSplitParts];
  int64_t T_, H, D;
  bool token_major;
  __device__ __forceinline__ void begin() {}
  __device__ __forceinline__ void load16(int64_t i, int64_t j, float (&v)[16], float (&raw)[16]) {
    const int64_t part = j / (H * D), rem = j - part * H * D;
    const T* s = src[part];
    if (s == nullptr) {
#pragma unroll
      for (int k = 0; k < 16; ++k) v[k] = raw[k] = 0.f;
      return;
    }
    const int64_t b = i / T_, t = i - b * T_, h = rem / D, d = rem - h * D;
    const T* p = s + (token_major ? i * (H * D) + rem : ((b * H + h) * T_ + t) * D + d);
    load8(p, *reinterpret_cast<float(*)[8]>(v));
    load8(p + 8, *reinterpret_cast<float(*)[8]>(v + 8));
#pragma unroll
    for (int k = 0; k < 16; ++k) raw[k] = v[k];
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

// The cast of a summing source whose rows are read in order (the activation gradients): its tiles are walked in
// work items of `chunk` consecutive 64-row tiles of one 64-column strip (the strips of a chunk side by side in the
// item order). Each thread adds its rows' raw values in registers, in increasing row order, and a work item's
// column sums leave once, as row item / strips of partial ([chunks, K] floats): one block reduction per chunk
// instead of one per tile. chunk depends on the shape and the GPU only (cast_chunk), so the order of the sums does
// too. A block walks its tiles (its items' tiles, item after item) one ahead: each tile's loads are issued before
// the previous tile is converted and stored, so that they are in flight meanwhile. At up to 80 registers an SM
// holds 3 blocks; without the loads ahead it held 4 at 64, each thread waiting for its loads before converting them,
// and the ReLU gradient's cast of 7,488 x 4,096 took 1.17x as long on an H200.
template <typename Source>
__global__ void __launch_bounds__(kThreads, 3)
    chunked_cast_kernel(Source src, int64_t M, int64_t K, float* __restrict__ row, Fp8Format fmt,
                        uint8_t* __restrict__ out, uint8_t* __restrict__ out_t, int64_t Mp,
                        float* __restrict__ partial, int chunk) {
  static_assert(Source::kSums, "a summing source");
  __shared__ __align__(16) uint8_t tile_t[2][kTile * kTile];
  const float s = row[kFp8Scale];
  const int tiles_m = (int)((Mp + kTile - 1) / kTile), tiles_k = (int)((K + kTile - 1) / kTile);
  const int items = (tiles_m + chunk - 1) / chunk * tiles_k;
  const int r = threadIdx.x >> 2, c = (threadIdx.x & 3) * 16;
  unsigned m = 0u;
  int buf = 0;
  src.begin();
  typename Source::Fetched next;
  const auto first_tile = [&](int item) { return (item / tiles_k) * chunk; };  // its row tile
  const auto fetch = [&](int item, int tile) {  // this thread's part of row tile `tile` of work item `item`
    const int64_t i = (int64_t)tile * kTile + r, j = (item % tiles_k) * kTile + c;
    if (item < items && i < M && j < K) src.fetch(i, j, next);
  };
  // the tile after (w, tm) in this block's walk: the next row tile of item w, else the first of w + gridDim.x
  int w = blockIdx.x, tm = first_tile(w);
  fetch(w, tm);
  float acc[16];
#pragma unroll
  for (int k = 0; k < 16; ++k) acc[k] = 0.f;
  while (w < items) {
    const int ci = w / tiles_k, k0 = (w - ci * tiles_k) * kTile;
    const int64_t i = (int64_t)tm * kTile + r, j = k0 + c;
    const bool item_ends = tm + 1 >= min(tiles_m, (ci + 1) * chunk);
    const int w_next = item_ends ? w + (int)gridDim.x : w;
    const int tm_next = item_ends ? first_tile(w_next) : tm + 1;
    const typename Source::Fetched cur = next;
    fetch(w_next, tm_next);
    float v[16];
    if (i < M && j < K) {
      src.convert(cur, j, v);
    } else {
#pragma unroll
      for (int k = 0; k < 16; ++k) v[k] = 0.f;
    }
#pragma unroll
    for (int k = 0; k < 16; ++k) acc[k] += v[k];
    Source::values_of(v);
    const uint4 packed = to_codes<uint4>(v, s, fmt, m);
    store_codes(packed, i, j, M, K, out, tile_t[buf], (int64_t)tm * kTile, k0, Mp, out_t);
    buf ^= 1;
    if (item_ends) {
      if (partial != nullptr) tile_colsum(acc, partial + (int64_t)ci * K, k0, K);  // uniform over the block
#pragma unroll
      for (int k = 0; k < 16; ++k) acc[k] = 0.f;
    }
    w = w_next;
    tm = tm_next;
  }
  m = block_max_bits<kThreads>(m);
  if (threadIdx.x == 0) record_amax(row, m);
}

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

// tiles a work item of chunked_cast_kernel, for a GPU that holds `resident` of its blocks at once: 4, or 2 or 1
// where 4 leaves fewer items than half of that. Measured on an H200 (transformer-big's shapes, 1,800 to 7,488 rows):
// 4 was the fastest or within 2% of it from 3,600 rows up; 8 lost up to 20%; 1 up to 21% (a block reduction per tile).
int cast_chunk(int64_t M, int64_t K, int64_t Mp, int64_t resident) {
  int c = 4;
  while (c > 1 && 2 * tile_count(M, K, Mp, c) < resident) c /= 2;
  return c;
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

namespace {
template <typename T, Act A, bool DRAW>
void launch_act_cast(const void* x, const void* bias, uint8_t* keep, uint8_t* positive, int64_t M, int64_t K,
                     float p, PhiloxArgs rng, float* row, void* out, void* out_t, int64_t Mp, cudaStream_t stream) {
  const ActDropoutSource<T, A, DRAW> src{static_cast<const T*>(x), static_cast<const T*>(bias), keep, positive, K,
                                         p, dropout_threshold(p), rng};
  using Source = std::remove_cv_t<decltype(src)>;
  cast_kernel<<<tile_blocks<cast_kernel<Source>>(M, K, Mp), kThreads, 0, stream>>>(
      src, M, K, row, Fp8Format::E4M3, false, static_cast<uint8_t*>(out), static_cast<uint8_t*>(out_t), Mp);
}

template <typename T, bool DRAW>
void launch_act_cast(Act act, const void* x, const void* bias, uint8_t* keep, uint8_t* positive, int64_t M,
                     int64_t K, float p, PhiloxArgs rng, float* row, void* out, void* out_t, int64_t Mp,
                     cudaStream_t stream) {
  LS_DISPATCH_ACT(act, A,
                  launch_act_cast<T, A, DRAW>(x, bias, keep, positive, M, K, p, rng, row, out, out_t, Mp, stream));
}
}  // namespace

void fp8_bias_act_dropout(DType dt, const void* x, const void* bias, uint8_t* keep, uint8_t* positive, bool draw,
                          int64_t M, int64_t K, float p, Act act, PhiloxArgs rng, float* row, void* out, void* out_t,
                          int64_t Mp, cudaStream_t stream) {
  if (M <= 0 || K <= 0) return;
  if (draw) {
    LS_DISPATCH(dt, T, launch_act_cast<T, true>(act, x, bias, keep, positive, M, K, p, rng, row, out, out_t, Mp,
                                                stream));
  } else {
    LS_DISPATCH(dt, T, launch_act_cast<T, false>(act, x, bias, keep, positive, M, K, p, rng, row, out, out_t, Mp,
                                                 stream));
  }
  check_launch("fp8_bias_act_dropout", stream);
}

int64_t fp8_grad_partial_floats(int64_t M, int64_t K, int64_t Mp) { return tile_rows(M, Mp) * K; }

namespace {
// The cast of a summing source: the codes, and the column sums of its raw values into dbias (T, nullable); CHUNKED:
// through chunked_cast_kernel (sources read in row order), else cast_kernel
template <typename T, bool CHUNKED, typename Source>
void launch_summing_cast(const Source& src, int64_t M, int64_t K, float* row, Fp8Format fmt, void* out, void* out_t,
                         int64_t Mp, void* dbias, float* partial, cudaStream_t stream, const char* name) {
  float* sums = dbias != nullptr ? partial : nullptr;
  int chunk = 1;
  if constexpr (CHUNKED)
    if (sums != nullptr) chunk = cast_chunk(M, K, Mp, resident_blocks<chunked_cast_kernel<Source>, kThreads>());
  uint8_t* const o = static_cast<uint8_t*>(out);
  uint8_t* const o_t = static_cast<uint8_t*>(out_t);
  if constexpr (CHUNKED)
    chunked_cast_kernel<<<tile_blocks<chunked_cast_kernel<Source>>(M, K, Mp, chunk), kThreads, 0, stream>>>(
        src, M, K, row, fmt, o, o_t, Mp, sums, chunk);
  else
    cast_kernel<<<tile_blocks<cast_kernel<Source>>(M, K, Mp), kThreads, 0, stream>>>(src, M, K, row, fmt, false, o,
                                                                                    o_t, Mp, sums);
  check_launch(name, stream);
  if (dbias == nullptr) return;
  T* const outs[1] = {static_cast<T*>(dbias)};
  colsum_finalize<T, 1>(partial, (int)chunk_rows(M, Mp, chunk), (int)K, outs, stream, name);
}

template <typename T, Act A>
void launch_grad_cast(const void* dy, const void* x, const void* bias, const uint8_t* keep, int64_t M, int64_t K,
                      float p, float* row, Fp8Format fmt, void* out, void* out_t, int64_t Mp, void* dbias,
                      float* partial, cudaStream_t stream) {
  const ActDropoutGradSource<T, A> src{static_cast<const T*>(dy), static_cast<const T*>(x),
                                       static_cast<const T*>(bias), keep, K, 1.f / (1.f - p)};
  launch_summing_cast<T, true>(src, M, K, row, fmt, out, out_t, Mp, dbias, partial, stream, "fp8_act_dropout_grad");
}
}  // namespace

void fp8_act_dropout_grad(DType dt, const void* dy, const void* x, const void* bias, const uint8_t* keep, int64_t M,
                          int64_t K, float p, Act act, float* row, Fp8Format fmt, void* out, void* out_t, int64_t Mp,
                          void* dbias, float* partial, cudaStream_t stream) {
  if (M <= 0 || K <= 0) return;
  LS_DISPATCH(dt, T,
              LS_DISPATCH_ACT(act, A, launch_grad_cast<T, A>(dy, x, bias, keep, M, K, p, row, fmt, out, out_t, Mp,
                                                             dbias, partial, stream)));
}

void fp8_merge_heads_grad(DType dt, const void* const* d, int B, int T_, int n, int H, int D, bool token_major,
                          float* row, Fp8Format fmt, void* out, void* out_t, int64_t Mp, void* dbias, float* partial,
                          cudaStream_t stream) {
  const int64_t M = (int64_t)B * T_, K = (int64_t)n * H * D;
  if (M <= 0 || K <= 0) return;
  if (n > kMaxSplitParts) throw std::runtime_error("fp8_merge_heads_grad: n out of range");
  LS_DISPATCH(dt, T, {
    MergeHeadsSource<T> src{{}, T_, H, D, token_major};
    for (int i = 0; i < n; ++i) src.src[i] = static_cast<const T*>(d[i]);
    launch_summing_cast<T, false>(src, M, K, row, fmt, out, out_t, Mp, dbias, partial, stream, "fp8_merge_heads_grad");
  });
}

}  // namespace ls
