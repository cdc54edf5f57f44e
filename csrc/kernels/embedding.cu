// Token embedding x scale + positional embedding + dropout (+ zeroed padding rows), and its backward.
//
// Numerics: out = dropout(W[tok] * scale + P[pos]) computed in fp32, rounded once to the storage
// type; dropout groups/bitmask as in common.cuh over the flat [rows, C] index.
// Backward: the keys (tokens, or positions) are sorted stably by the adapter; dy[row] * keep is
// summed in fp32 per run of equal keys, in chunks of consecutive rows that are then combined in a
// fixed order, so the gradient is bit-identical from run to run (no atomics), and each gradient row
// is written once (x factor), rounded once.
#include "kernels/common.cuh"

namespace ls {

// ================================================================ forward
template <typename T, bool VEC>
__global__ void embedding_fwd_kernel(const int64_t* __restrict__ tokens, const T* __restrict__ weight,
                                     const T* __restrict__ pos_weight, const int64_t* __restrict__ positions,
                                     T* __restrict__ out, uint8_t* __restrict__ mask, int64_t rows, int C, float scale,
                                     float p, int64_t padding_idx, bool zero_pad, uint32_t threshold, PhiloxArgs rng) {
  uint64_t seed = 0, offset = 0;
  if (mask != nullptr) philox_unpack(rng, seed, offset);
  const float dscale = mask != nullptr ? 1.f / (1.f - p) : 1.f;
  const int64_t n = rows * C;
  const int64_t groups = (n + 7) / 8;
  for (int64_t g = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; g < groups; g += (int64_t)gridDim.x * blockDim.x) {
    const int64_t i0 = g * 8;
    float v[8];
    if (VEC) {
      const int64_t r = i0 / C;
      const int c = (int)(i0 - r * C);
      const int64_t tok = tokens[r];
      load8(weight + tok * C + c, v);
#pragma unroll
      for (int k = 0; k < 8; ++k) v[k] *= scale;
      if (pos_weight != nullptr) {
        float pv[8];
        load8(pos_weight + positions[r] * C + c, pv);
#pragma unroll
        for (int k = 0; k < 8; ++k) v[k] += pv[k];
      }
      if (zero_pad && tok == padding_idx)
#pragma unroll
        for (int k = 0; k < 8; ++k) v[k] = 0.f;
    } else {
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const int64_t i = i0 + k;
        v[k] = 0.f;
        if (i < n) {
          const int64_t r = i / C;
          const int c = (int)(i - r * C);
          const int64_t tok = tokens[r];
          float t = to_f(weight[tok * C + c]) * scale;
          if (pos_weight != nullptr) t += to_f(pos_weight[positions[r] * C + c]);
          v[k] = (zero_pad && tok == padding_idx) ? 0.f : t;
        }
      }
    }
    if (mask != nullptr) {
      const uint32_t bits = dropout_bits(g, seed, offset, threshold);
#pragma unroll
      for (int k = 0; k < 8; ++k) v[k] = ((bits >> k) & 1u) ? v[k] * dscale : 0.f;
      mask[g] = (uint8_t)bits;
    }
    if (VEC) store8(out + i0, v); else store_n(out + i0, (int)min((int64_t)8, n - i0), v);
  }
}

void embedding_fwd(DType dt, const int64_t* tokens, const void* weight, const void* pos_weight,
                   const int64_t* positions, void* out, uint8_t* mask, int64_t rows, int C, float scale, float p,
                   int64_t padding_idx, bool zero_pad, PhiloxArgs rng, cudaStream_t stream) {
  const int64_t n = rows * C;
  if (n <= 0) return;
  const bool vec = C % 8 == 0 && aligned16(weight) && aligned16(out) && (pos_weight == nullptr || aligned16(pos_weight));
  const int threads = 256;
  const int blocks = (int)std::min<int64_t>(((n + 7) / 8 + threads - 1) / threads, (int64_t)num_sms() * 16);
  const uint32_t thr = dropout_threshold(p);
  LS_DISPATCH(dt, T, {
    if (vec)
      embedding_fwd_kernel<T, true><<<blocks, threads, 0, stream>>>(tokens, static_cast<const T*>(weight),
          static_cast<const T*>(pos_weight), positions, static_cast<T*>(out), mask, rows, C, scale, p, padding_idx,
          zero_pad, thr, rng);
    else
      embedding_fwd_kernel<T, false><<<blocks, threads, 0, stream>>>(tokens, static_cast<const T*>(weight),
          static_cast<const T*>(pos_weight), positions, static_cast<T*>(out), mask, rows, C, scale, p, padding_idx,
          zero_pad, thr, rng);
    LS_CHECK_LAUNCH("embedding_fwd", stream);
  });
}

// ================================================================ backward
// Two passes over the stably sorted keys, deterministic (fixed summation order, no atomics):
//  1. one block per chunk of kEmbChunk consecutive sorted positions sums each run segment inside
//     its chunk (a segment starts at a run start or at a chunk start) into partial[segment start];
//  2. one block per run start (other blocks exit at once) adds its run's segment sums in order
//     (the run start, then every chunk start inside the run), scales and writes the gradient row.
// A run of n equal keys (a frequent token) is thus summed by n / kEmbChunk blocks in parallel
// and combined from n / kEmbChunk partial rows, instead of by one block over all n rows.
constexpr int kEmbChunk = 32;

template <bool VEC>
__device__ __forceinline__ void store_partial(float* __restrict__ p, int n, const float (&v)[8]) {
  if (VEC) {
    reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
    reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
  } else {
    for (int k = 0; k < n; ++k) p[k] = v[k];
  }
}

template <bool VEC>
__device__ __forceinline__ void add_partial(const float* __restrict__ p, int n, float (&v)[8]) {
  if (VEC) {
    const float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
    v[0] += a.x; v[1] += a.y; v[2] += a.z; v[3] += a.w;
    v[4] += b.x; v[5] += b.y; v[6] += b.z; v[7] += b.w;
  } else {
    for (int k = 0; k < n; ++k) v[k] += p[k];
  }
}

template <typename T, bool VEC>
__global__ void embedding_bwd_chunk_kernel(const T* __restrict__ dy, const uint8_t* __restrict__ mask,
                                           const int64_t* __restrict__ keys, const int64_t* __restrict__ perm,
                                           const int64_t* __restrict__ tokens, float* __restrict__ partial,
                                           int64_t rows, int C, int64_t padding_idx, bool zero_pad) {
  const int64_t j0 = (int64_t)blockIdx.x * kEmbChunk;
  const int64_t j1 = min(rows, j0 + kEmbChunk);
  for (int c0 = 8 * threadIdx.x; c0 < C; c0 += 8 * blockDim.x) {
    const int n = min(8, C - c0);
    float acc[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) acc[k] = 0.f;
    int64_t seg = j0, key = keys[j0];
    for (int64_t j = j0; j < j1; ++j) {
      const int64_t kj = keys[j];
      if (kj != key) {  // the previous segment is complete
        if (key != padding_idx) store_partial<VEC>(partial + seg * C + c0, n, acc);
#pragma unroll
        for (int k = 0; k < 8; ++k) acc[k] = 0.f;
        seg = j;
        key = kj;
      }
      if (key == padding_idx) continue;
      const int64_t r = perm[j];
      if (zero_pad && tokens[r] == padding_idx) continue;
      const int64_t i0 = r * C + c0;
      float g[8];
      if (VEC) load8(dy + i0, g); else load_n(dy + i0, n, g);
      if (mask != nullptr) {
        if (VEC) {  // C % 8 == 0: the 8 elements are the 8 bits of one mask byte
          const uint32_t bits = mask[i0 >> 3];
#pragma unroll
          for (int k = 0; k < 8; ++k) g[k] = ((bits >> k) & 1u) ? g[k] : 0.f;
        } else {
#pragma unroll
          for (int k = 0; k < 8; ++k) {
            const int64_t i = i0 + k;
            g[k] = (k < n && ((mask[i >> 3] >> (i & 7)) & 1u)) ? g[k] : 0.f;
          }
        }
      }
#pragma unroll
      for (int k = 0; k < 8; ++k) acc[k] += g[k];
    }
    if (key != padding_idx) store_partial<VEC>(partial + seg * C + c0, n, acc);
  }
}

template <typename T, bool VEC>
__global__ void embedding_bwd_finalize_kernel(const float* __restrict__ partial, const int64_t* __restrict__ keys,
                                              T* __restrict__ grad, int64_t rows, int C, float factor,
                                              int64_t padding_idx, bool accumulate) {
  const int64_t s = blockIdx.x;
  const int64_t key = keys[s];
  if ((s > 0 && keys[s - 1] == key) || key == padding_idx) return;
  for (int c0 = 8 * threadIdx.x; c0 < C; c0 += 8 * blockDim.x) {
    const int n = min(8, C - c0);
    float acc[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) acc[k] = 0.f;
    add_partial<VEC>(partial + s * C + c0, n, acc);
    for (int64_t seg = (s / kEmbChunk + 1) * kEmbChunk; seg < rows && keys[seg] == key; seg += kEmbChunk)
      add_partial<VEC>(partial + seg * C + c0, n, acc);
#pragma unroll
    for (int k = 0; k < 8; ++k) acc[k] *= factor;
    T* dst = grad + key * C + c0;
    if (accumulate) {  // into the row's present value, rounded once
      float old[8];
      if (VEC) load8(dst, old); else load_n(dst, n, old);
#pragma unroll
      for (int k = 0; k < 8; ++k) acc[k] += old[k];
    }
    if (VEC) store8(dst, acc); else store_n(dst, n, acc);
  }
}

int64_t embedding_bwd_workspace_floats(int64_t rows, int C) { return rows * (int64_t)C; }

void embedding_bwd(DType dt, const void* dy, const uint8_t* mask, const int64_t* sorted_keys, const int64_t* perm,
                   const int64_t* tokens, void* grad, float* workspace, int64_t rows, int C, float factor,
                   int64_t padding_idx, bool zero_pad, bool accumulate, cudaStream_t stream) {
  if (rows <= 0 || C <= 0) return;
  if (rows > 0x7fffffffLL) throw std::runtime_error("embedding backward: too many rows");
  const bool vec = C % 8 == 0 && aligned16(dy) && aligned16(grad) && aligned16(workspace);
  const int threads = std::min(128, ((C + 7) / 8 + 31) / 32 * 32);
  const unsigned chunks = (unsigned)((rows + kEmbChunk - 1) / kEmbChunk);
  LS_DISPATCH(dt, T, {
    if (vec) {
      embedding_bwd_chunk_kernel<T, true><<<chunks, threads, 0, stream>>>(static_cast<const T*>(dy), mask,
          sorted_keys, perm, tokens, workspace, rows, C, padding_idx, zero_pad);
      LS_CHECK_LAUNCH("embedding_bwd (chunks)", stream);
      embedding_bwd_finalize_kernel<T, true><<<(unsigned)rows, threads, 0, stream>>>(workspace, sorted_keys,
          static_cast<T*>(grad), rows, C, factor, padding_idx, accumulate);
    } else {
      embedding_bwd_chunk_kernel<T, false><<<chunks, threads, 0, stream>>>(static_cast<const T*>(dy), mask,
          sorted_keys, perm, tokens, workspace, rows, C, padding_idx, zero_pad);
      LS_CHECK_LAUNCH("embedding_bwd (chunks)", stream);
      embedding_bwd_finalize_kernel<T, false><<<(unsigned)rows, threads, 0, stream>>>(workspace, sorted_keys,
          static_cast<T*>(grad), rows, C, factor, padding_idx, accumulate);
    }
    LS_CHECK_LAUNCH("embedding_bwd", stream);
  });
}

}  // namespace ls
