// Multi-tensor copy with a scale: dst_i[k] = src_i[k] * scale for every pair (src_i may be dst_i),
// computed in fp32 and rounded once to the tensors' dtype. With scale = 1.0f / d (the fp32
// reciprocal) this is exactly a copy followed by PyTorch's in-place division by a host number d on
// CUDA, which multiplies by that reciprocal: the overlapped gradient reduction folds a bucket's
// gradients into the flat buffer and averages them in one pass instead of two.
//
// One launch covers up to kCopyScaleTensors pairs and kCopyScaleBlocks chunks of kCopyScaleChunk
// elements (small chunks, so that a 25 MB bucket keeps every SM busy); the host splits longer lists
// into several launches. Each block owns one chunk of one pair: 8-element vectors where both
// pointers and the chunk start allow it, single elements for the rest.
#include "kernels/common.cuh"

namespace ls {

template <typename T>
__global__ void copy_scale_kernel(CopyScaleLaunch args, float scale) {
  const int t = args.block_tensor[blockIdx.x];
  const int64_t start = (int64_t)args.block_chunk[blockIdx.x] * kCopyScaleChunk;
  const int64_t n = args.numel[t];
  const int64_t end = start + kCopyScaleChunk < n ? start + kCopyScaleChunk : n;
  const T* src = static_cast<const T*>(args.src[t]);
  T* dst = static_cast<T*>(args.dst[t]);
  int64_t done = start;
  const bool vec = ((reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst)) % 16 == 0);
  if (vec) {  // chunk starts are multiples of 8 elements, so every 8-element group is 16-byte aligned
    const int64_t groups = (end - start) / 8;
    const int64_t step = blockDim.x;
    int64_t g = threadIdx.x;
    // four groups per thread in flight: all loads first, then the stores (each thread reads and
    // writes only its own groups, so a source that is its destination is safe)
    for (; g + 3 * step < groups; g += 4 * step) {
      float v[4][8];
#pragma unroll
      for (int u = 0; u < 4; ++u) load8(src + start + (g + u * step) * 8, v[u]);
#pragma unroll
      for (int u = 0; u < 4; ++u) {
#pragma unroll
        for (int k = 0; k < 8; ++k) v[u][k] *= scale;
        store8(dst + start + (g + u * step) * 8, v[u]);
      }
    }
    for (; g < groups; g += step) {
      float v[8];
      load8(src + start + g * 8, v);
#pragma unroll
      for (int k = 0; k < 8; ++k) v[k] *= scale;
      store8(dst + start + g * 8, v);
    }
    done = start + groups * 8;
  }
  for (int64_t i = done + threadIdx.x; i < end; i += blockDim.x) dst[i] = from_f<T>(to_f(src[i]) * scale);
}

void copy_scale(DType dt, const void* const* src, void* const* dst, const int64_t* numel, int count, float scale,
                cudaStream_t stream) {
  CopyScaleLaunch args{};
  int tensors = 0, blocks = 0;
  auto flush = [&] {
    if (blocks > 0) {
      LS_DISPATCH(dt, T, copy_scale_kernel<T><<<blocks, 256, 0, stream>>>(args, scale));
      check_launch("copy_scale", stream);
    }
    args = CopyScaleLaunch{};
    tensors = blocks = 0;
  };
  for (int i = 0; i < count; ++i) {
    const int64_t n = numel[i];
    if (n <= 0) continue;
    const int64_t chunks = (n + kCopyScaleChunk - 1) / kCopyScaleChunk;
    int slot = -1;  // pair i's entry in the launch being filled
    for (int64_t c = 0; c < chunks; ++c) {
      if (blocks == kCopyScaleBlocks) {  // full: the next launch takes pair i on from chunk c
        flush();
        slot = -1;
      }
      if (slot < 0) {
        if (tensors == kCopyScaleTensors) flush();
        slot = tensors++;
        args.src[slot] = src[i];
        args.dst[slot] = dst[i];
        args.numel[slot] = n;
      }
      args.block_tensor[blocks] = (uint8_t)slot;
      args.block_chunk[blocks] = (int32_t)c;
      ++blocks;
    }
  }
  flush();
}

}  // namespace ls
