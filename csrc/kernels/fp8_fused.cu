// FP8 casts fused with the op that makes their values, so that those values are never stored in the model's
// precision (csrc/torch/fp8.cpp): a = dropout(act(x + bias)) written as the codes of the FFN's second projection
// (fp8_bias_act_dropout), that activation's input gradient written as the codes of the first projection's output
// gradient (fp8_act_dropout_grad), and the attention heads' gradients merged into the codes of the input
// projection's output gradient (fp8_merge_heads_grad). The gradients' casts also sum their columns for the bias
// gradient (per 64-row tile, or per work item of tiles down a column strip, in a fixed order, then colsum_finalize:
// deterministic). The tile cast is fp8_cast.cuh's.
#include "kernels/act_dropout.cuh"
#include "kernels/colsum.cuh"
#include "kernels/fp8_cast.cuh"

namespace ls {

namespace {

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
  // Every load is issued before the Philox draws, so the draws overlap the loads' latency (faster than drawing
  // between them); the keep and positive bits of the two groups leave as one 2-byte store each.
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

// The cast of a summing source whose rows are read in order (the activation gradients): its tiles are walked in
// work items of `chunk` consecutive 64-row tiles of one 64-column strip (the strips of a chunk side by side in the
// item order). Each thread adds its rows' raw values in registers, in increasing row order, and a work item's
// column sums leave once, as row item / strips of partial ([chunks, K] floats): one block reduction per chunk
// instead of one per tile. chunk depends on the shape and the GPU only (cast_chunk), so the order of the sums does
// too. A block walks its tiles (its items' tiles, item after item) one ahead: each tile's loads are issued before
// the previous tile is converted and stored, so that they are in flight meanwhile: at up to 80 registers an SM
// holds 3 blocks, one fewer than without the loads ahead, and the loads in flight pay for it (benchmarks/RESULTS.md,
// section 'FP8').
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

// tiles a work item of chunked_cast_kernel, for a GPU that holds `resident` of its blocks at once: 4, or 2 or 1
// where 4 leaves fewer items than half of that. At transformer-big's shapes 4 is the best choice or close to it;
// longer items leave too few for the grid, and one tile per item pays a block reduction per tile
// (benchmarks/RESULTS.md, section 'FP8').
int cast_chunk(int64_t M, int64_t K, int64_t Mp, int64_t resident) {
  int c = 4;
  while (c > 1 && 2 * tile_count(M, K, Mp, c) < resident) c /= 2;
  return c;
}

}  // namespace

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
