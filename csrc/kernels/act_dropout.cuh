// The elementwise arithmetic of bias + activation + dropout on one dropout group (8 consecutive elements), in fp32:
// dropout.cu (bias_act_dropout forward, replay and backward) and fp8.cu (the same values quantised on the fly,
// never stored in the model's precision) both call these, so the FP8 codes they make equal those of quantising
// the stored tensor by construction.
#pragma once

#include "kernels/common.cuh"

namespace ls {

// v = act(v + b); b nullptr: no bias
template <Act A>
__device__ __forceinline__ void bias_act8(float (&v)[8], const float* b) {
  if (b != nullptr) {
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] += b[k];
  }
#pragma unroll
  for (int k = 0; k < 8; ++k) v[k] = act_f<A>(v[k]);
}

// dropout with the group's keep bits (bit k: keep element k): v = keep ? v * scale : 0, scale = 1 / (1 - p)
__device__ __forceinline__ void keep8(float (&v)[8], uint32_t bits, float scale) {
#pragma unroll
  for (int k = 0; k < 8; ++k) v[k] = ((bits >> k) & 1u) ? v[k] * scale : 0.f;
}

// g *= act'(z) at the activation's input z = x + b (b nullptr: no bias; relu: g where z > 0, else 0); x is
// overwritten with z
template <Act A>
__device__ __forceinline__ void act_grad8(float (&g)[8], float (&x)[8], const float* b) {
  if (b != nullptr) {
#pragma unroll
    for (int k = 0; k < 8; ++k) x[k] += b[k];
  }
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    if constexpr (A == Act::Gelu) g[k] *= gelu_grad_f(x[k]);
    else if constexpr (A == Act::Relu) g[k] = x[k] > 0.f ? g[k] : 0.f;
  }
}

}  // namespace ls
