// The label-smoothed cross-entropy's gradient of one logit, shared by cross_entropy.cu's kernels and fp8.cu's
// tile cast of the head's gradient, so that every kernel that makes it computes the same bits:
//   dlogit_v = p_v * A - Bc - [v == t] * Dt,   p_v = exp(x_v - lse)   (fp32)
#pragma once

#include "kernels/common.cuh"

namespace ls {

struct CeGrad {
  float A, Bc, Dt;
};

// The coefficients for the gradient of g_loss * loss + g_nll * nll (fairseq's label smoothing, eps_i = eps / (V - 1))
__device__ __forceinline__ CeGrad ce_grad_coeffs(float gl, float gn, float eps, int V) {
  const float eps_i = V > 1 ? eps / (V - 1) : 0.f;
  return {gl * (1.f - eps - eps_i + (float)V * eps_i) + gn, gl * eps_i, gl * (1.f - eps - eps_i) + gn};
}

__device__ __forceinline__ float ce_grad(float x, float lse, const CeGrad& c, bool is_target) {
  const float p = __expf(x - lse);
  return p * c.A - c.Bc - (is_target ? c.Dt : 0.f);
}

}  // namespace ls
